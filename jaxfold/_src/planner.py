"""Finds normalization sites and decides, per site, what to center.

A *site* is a mean reduction whose result is subtracted from the value it
averaged (the centering step of a LayerNorm/GroupNorm, in any formulation).
It folds when its input provably sums to zero over the reduced axes once the
chosen parameters are centered, and every centering is invisible at the
program's outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
from jax import lax

from jaxfold._src import compat
from jaxfold._src import layout
from jaxfold._src.analysis import (Constancy, Propagator, _ADD, _CUMULATIVE, _LAYOUT,
                                   _SHARDING, _UNARY_SAME, _scalar_literal, seed_poly,
                                   shape_of)
from jaxfold._src.graph import Graph, Node


# ----------------------------------------------------------------------------
# What a site needs.


@dataclasses.dataclass(frozen=True)
class LeafNeed:
  """Parameter leaf ``leaf`` must sum to zero over ``spec``; ``use`` is the
  equation (and operand) through which the walk reached it."""
  var: Any
  spec: tuple
  use: Optional[tuple]       # (node, operand index) or None for a direct use
  out_var: Any               # the value whose zero-sum the use provides
  out_spec: tuple
  chain: tuple               # layout nodes between the leaf and the use


@dataclasses.dataclass(frozen=True)
class Blocker:
  var: Any
  spec: tuple
  reason: str


def _freeze(spec: dict) -> tuple:
  return tuple(sorted(spec.items()))


class Walker:
  """Backwards: what must be centered for ``var`` to be zero-sum over ``spec``."""

  def __init__(self, graph: Graph, constancy: Constancy, leaf_vars: set):
    self.g = graph
    self.const = constancy
    self.leaves = leaf_vars

  def needs(self, var: Any, spec: dict) -> list:
    self._seen: set = set()
    out: list = []
    self._walk(var, spec, None, (), out, var, spec)
    return out

  def _walk(self, v, spec, use, chain, out, top_var, top_spec):
    key = (v, _freeze(spec), use[0].index if use else None)
    if key in self._seen:
      return
    self._seen.add(key)
    if compat.is_literal(v):
      if _scalar_literal(v) == 0.0:
        return
      out.append(Blocker(v, _freeze(spec), "a non-zero literal"))
      return
    if v in self.leaves or v in self.g.const_values:
      out.append(LeafNeed(v, _freeze(spec), use, top_var, _freeze(top_spec), chain))
      return
    prod = self.g.producer.get(v)
    if prod is None:
      out.append(Blocker(v, _freeze(spec), "a program input (not a parameter)"))
      return
    node, _ = prod
    p = node.prim
    rec = lambda a, s, layout_step=False: self._walk(
        a, s, use if layout_step else (node, node.invars.index(a)),
        (chain + (node,)) if layout_step else (),
        out, top_var if layout_step else v, top_spec if layout_step else spec)
    out_shape = shape_of(v)
    if p in _UNARY_SAME or p in _SHARDING:
      return rec(node.invars[0], spec, layout_step=True)
    if p is lax.neg_p:
      return rec(node.invars[0], spec)
    if p in _ADD:
      for a in node.invars:
        s = self._through_broadcast(a, spec, out_shape)
        if s is None:
          out.append(Blocker(v, _freeze(spec), f"`{p.name}` broadcasts an operand along the normalized axes [at {node.where()}]"))
          return
        rec(a, s)
      return
    if p in (lax.mul_p, lax.div_p):
      a, b = node.invars
      if set(spec) <= self.const._of(b, out_shape):
        s = self._through_broadcast(a, spec, out_shape)
        if s is not None:
          return rec(a, s)
      if p is lax.mul_p and set(spec) <= self.const._of(a, out_shape):
        s = self._through_broadcast(b, spec, out_shape)
        if s is not None:
          return rec(b, s)
      out.append(Blocker(v, _freeze(spec), f"a product that varies along the normalized axes [at {node.where()}]"))
      return
    if p in _LAYOUT:
      s = self._layout_back(node, spec)
      if s is None:
        out.append(Blocker(v, _freeze(spec), f"`{p.name}` mixes the normalized axes [at {node.where()}]"))
        return
      return rec(node.invars[0], s, layout_step=True)
    if p is lax.reduce_sum_p:
      axes = node.params["axes"]
      kept = [d for d in range(len(shape_of(node.invars[0]))) if d not in axes]
      return rec(node.invars[0], {kept[d]: b for d, b in spec.items()})
    if p in (lax.slice_p, lax.dynamic_slice_p):
      ins = shape_of(node.invars[0])
      if all(ins[d] == out_shape[d] for d in spec):
        return rec(node.invars[0], spec)
    if p is lax.concatenate_p and node.params["dimension"] not in spec:
      for a in node.invars:
        rec(a, spec)
      return
    if p is lax.pad_p:
      cfg = node.params["padding_config"]
      if all(cfg[d] == (0, 0, 0) for d in spec) and _scalar_literal(node.invars[1]) in (0.0, None):
        if _scalar_literal(node.invars[1]) == 0.0 or all(c == (0, 0, 0) for c in cfg):
          return rec(node.invars[0], spec)
    if p is lax.select_n_p and set(spec) <= self.const._of(node.invars[0], out_shape):
      for a in node.invars[1:]:
        rec(a, spec)
      return
    if p is lax.dynamic_update_slice_p:
      us = shape_of(node.invars[1])
      if all(us[d] == out_shape[d] for d in spec):
        rec(node.invars[0], spec)
        rec(node.invars[1], spec)
        return
    if p in _CUMULATIVE and node.params["axis"] not in spec:
      return rec(node.invars[0], spec)
    if p is lax.gather_p:
      s = self._gather_back(node, spec)
      if s is not None:
        return rec(node.invars[0], s)
    if p is lax.dot_general_p:
      r = self._dot_back(node, spec)
      if r is not None:
        side, s = r
        return rec(node.invars[side], s)
    if p is lax.conv_general_dilated_p:
      s = self._conv_back(node, spec)
      if s is not None:
        return rec(node.invars[1], s)
      out.append(Blocker(v, _freeze(spec), f"a convolution whose output cannot be centered over {layout.fmt_spec(spec, out_shape)} (grouped/depthwise feature groups smaller than the normalization's groups?) [at {node.where()}]"))
      return
    out.append(Blocker(v, _freeze(spec), _describe(node)))

  # -- mapping a spec backwards through one equation -----------------------

  @staticmethod
  def _through_broadcast(a, spec, out_shape):
    s = shape_of(a)
    if not s:
      return None if not (compat.is_literal(a) and _scalar_literal(a) == 0.0) else {}
    if any(s[d] != out_shape[d] for d in spec):
      return None
    return dict(spec)

  @staticmethod
  def _layout_back(node, spec):
    x = node.invars[0]
    ins, outs = shape_of(x), shape_of(node.outvars[0])
    p = node.prim
    if p is lax.transpose_p:
      perm = node.params["permutation"]
      return {perm[d]: b for d, b in spec.items()}
    if p is lax.broadcast_in_dim_p:
      bd = node.params["broadcast_dimensions"]
      res = {}
      for d, b in spec.items():
        if d not in bd or ins[bd.index(d)] != outs[d]:
          return None
        res[bd.index(d)] = b
      return res
    return layout.reshape_spec_back(spec, ins, outs)

  @staticmethod
  def _gather_back(node, spec):
    dn = node.params["dimension_numbers"]
    sizes = node.params["slice_sizes"]
    ins = shape_of(node.invars[0])
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    kept = [d for d in range(len(ins)) if d not in dn.collapsed_slice_dims and d not in batching]
    res = {}
    for d, b in spec.items():
      if d not in dn.offset_dims:
        return None
      od = kept[list(dn.offset_dims).index(d)]
      if sizes[od] != ins[od]:
        return None
      res[od] = b
    return res

  @staticmethod
  def _dot_back(node, spec):
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    ls, rs = shape_of(node.invars[0]), shape_of(node.invars[1])
    lfree = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rs)) if d not in rc and d not in rb]
    nb = len(lb)
    owner = {}
    for i, d in enumerate(lfree):
      owner[nb + i] = (0, d)
    for i, d in enumerate(rfree):
      owner[nb + len(lfree) + i] = (1, d)
    sides = {owner.get(d, (None,))[0] for d in spec}
    if len(sides) != 1 or None in sides:
      return None
    side = sides.pop()
    return side, {owner[d][1]: b for d, b in spec.items()}

  @staticmethod
  def _conv_back(node, spec):
    dn = node.params["dimension_numbers"]
    o_out, o_k = dn.out_spec[1], dn.rhs_spec[0]
    if set(spec) != {o_out} or node.params.get("batch_group_count", 1) != 1:
      return None
    block = spec[o_out]
    n_out = shape_of(node.outvars[0])[o_out]
    fg = node.params["feature_group_count"]
    if (n_out // fg) % block:
      return None
    return {o_k: block}


def _describe(node: Node) -> str:
  p = node.prim
  kind = {lax.rsqrt_p: "a normalization's output (γ·n + β is not zero-mean for non-uniform γ)",
          }.get(p)
  if p in (lax.add_p,):
    kind = None
  if kind is None:
    kind = f"the output of `{p.name}`, which is not provably zero-sum"
  return f"{kind} [at {node.where()}]"


# ----------------------------------------------------------------------------
# Sites.


@dataclasses.dataclass
class SiteInfo:
  reduces: list           # reduce_sum nodes computing the site's mean
  input: Any              # the value averaged (in the reduction's layout)
  axes: tuple
  node: Node              # first reduction, for locations
  graph: Graph


def find_sites(graph: Graph) -> list[SiteInfo]:
  """Mean reductions whose result is subtracted from the averaged value."""
  sites: dict = {}
  for node in graph.nodes:
    if node.prim is not lax.reduce_sum_p:
      continue
    u = _strip(graph, node.invars[0])
    if not _is_subtracted(graph, node.outvars[0], _strip_layout(graph, u)):
      continue
    key = (u, tuple(node.params["axes"]))
    if key in sites:
      sites[key].reduces.append(node)
    else:
      sites[key] = SiteInfo([node], u, tuple(node.params["axes"]), node, graph)
  return list(sites.values())


def nested_sites(graph: Graph) -> list[tuple[Node, SiteInfo]]:
  """Sites inside loop or conditional bodies (reported, not folded)."""
  out = []
  for n in graph.nodes:
    for g in n.subgraphs:
      out += [(n, s) for s in find_sites(g)]
      out += nested_sites(g)
  return out


def _strip(graph: Graph, v: Any) -> Any:
  while compat.is_var(v) and v in graph.producer:
    node, _ = graph.producer[v]
    if node.prim in _UNARY_SAME:
      v = node.invars[0]
    else:
      break
  return v


def _strip_layout(graph: Graph, v: Any) -> Any:
  while compat.is_var(v) and v in graph.producer:
    node, _ = graph.producer[v]
    if node.prim in _UNARY_SAME or node.prim is lax.reshape_p:
      v = node.invars[0]
    else:
      break
  return v


def _is_subtracted(graph: Graph, mean: Any, root: Any) -> bool:
  frontier, seen = [mean], set()
  while frontier:
    v = frontier.pop()
    if v in seen:
      continue
    seen.add(v)
    for node, k in graph.consumers.get(v, []):
      p = node.prim
      if p is lax.sub_p and k == 1:
        if _strip_layout(graph, node.invars[0]) is root:
          return True
      if p in _UNARY_SAME or p in _LAYOUT or (p in (lax.div_p, lax.mul_p) and
                                               any(_scalar_literal(a) is not None or not shape_of(a)
                                                   for a in node.invars if a is not v)):
        frontier.append(node.outvars[0])
  return False
