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

from jax import lax

from jaxfold._src import compat
from jaxfold._src import layout
from jaxfold._src.analysis import (_ADD, _CUMULATIVE, _LAYOUT, _SHARDING, _UNARY_SAME,
                                   _scalar_literal, shape_of)
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


_DROPOUT = ("a random mask (dropout) that varies along the normalized axes makes the input "
            "not zero-mean; jaxfold.cbwc(..., through_dropout=True) folds it anyway, inexactly "
            "[at {}]")


def _freeze(spec: dict) -> tuple:
  return tuple(sorted(spec.items()))


class Walker:
  """Backwards: what must be centered for ``var`` to be zero-sum over ``spec``.

  Walks across scan boundaries: a body's consts/xs map to the scan operands
  (xs gain the stacked axis), and a carry is zero-sum when its initial value
  is and the body preserves it (a coinductive fixed point).
  """

  def __init__(self, graph: Graph, constancy_of, leaf_vars: set):
    self.g = graph
    self.const_of = constancy_of
    self.leaves = leaf_vars
    self.parent: dict = {}      # body graph -> (scan node, enclosing graph)
    self.body: dict = {}        # scan node -> body graph
    self._index(graph)

  def _index(self, g: Graph) -> None:
    for n in g.nodes:
      if compat.is_scan(n.eqn):
        self.parent[n.subgraphs[0]] = (n, g)
        self.body[n] = n.subgraphs[0]
        self._index(n.subgraphs[0])

  def graphs(self) -> list:
    return [self.g] + list(self.body.values())

  def needs(self, var: Any, spec: dict, g: Optional[Graph] = None) -> list:
    self._seen: set = set()
    out: list = []
    self._walk(g or self.g, var, spec, None, (), out, var, spec)
    return out

  def _walk(self, g, v, spec, use, chain, out, top_var, top_spec):
    key = (id(g), v, _freeze(spec), use[0].index if use else None)
    if key in self._seen:
      return
    self._seen.add(key)
    const = self.const_of(g)
    if _is_zero(g, v):
      return
    if compat.is_literal(v):
      out.append(Blocker(v, _freeze(spec), "a non-zero literal"))
      return
    if g is self.g and (v in self.leaves or v in g.const_values):
      out.append(LeafNeed(v, _freeze(spec), use, top_var, _freeze(top_spec), chain))
      return
    if g is not self.g and v in g.const_values:
      out.append(Blocker(v, _freeze(spec), "a constant captured inside a loop body"))
      return
    prod = g.producer.get(v)
    if prod is None and g in self.parent:
      return self._scan_input(g, v, spec, out)
    if prod is None:
      out.append(Blocker(v, _freeze(spec), "a program input (not a parameter)"))
      return
    if compat.is_scan(prod[0].eqn):
      return self._scan_output(g, prod, spec, out, v)
    node, _ = prod
    p = node.prim
    rec = lambda a, s, layout_step=False: self._walk(
        g, a, s, use if layout_step else (node, node.invars.index(a)),
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
      if set(spec) <= const._of(b, out_shape):
        s = self._through_broadcast(a, spec, out_shape)
        if s is not None:
          return rec(a, s)
      if p is lax.mul_p and set(spec) <= const._of(a, out_shape):
        s = self._through_broadcast(b, spec, out_shape)
        if s is not None:
          return rec(b, s)
      if any(compat.is_var(x) and const.from_key(x) for x in (a, b)):
        out.append(Blocker(v, _freeze(spec), _DROPOUT.format(node.where())))
      else:
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
      # The padded region holds the padding value: zero-sum needs it to be 0.
      if all(tuple(cfg[d]) == (0, 0, 0) for d in spec) and (
          _is_zero(g, node.invars[1]) or all(tuple(c) == (0, 0, 0) for c in cfg)):
        return rec(node.invars[0], spec)
    if p is lax.select_n_p and set(spec) <= const._of(node.invars[0], out_shape):
      for a in node.invars[1:]:
        rec(a, spec)
      return
    if p is lax.select_n_p and compat.is_var(node.invars[0]) and const.from_key(node.invars[0]):
      out.append(Blocker(v, _freeze(spec), _DROPOUT.format(node.where())))
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

  # -- loops -------------------------------------------------------------------

  def _scan_input(self, body, v, spec, out):
    node, outer = self.parent[body]
    nc, ncar = compat.scan_partition(node.params)
    i = body.invars.index(v)
    operand = node.invars[i]
    if i < nc:
      return self._walk(outer, operand, spec, None, (), out, operand, spec)
    if i < nc + ncar:
      # Zero-sum carry: the initial value is, and the body keeps it so (the
      # assumption for this carry is what the seen-set records).
      self._walk(outer, operand, spec, None, (), out, operand, spec)
      j = i - nc
      return self._walk(body, body.outvars[j], spec, None, (), out, body.outvars[j], spec)
    stacked = {d + 1: b for d, b in spec.items()}
    return self._walk(outer, operand, stacked, None, (), out, operand, stacked)

  def _scan_output(self, g, prod, spec, out, v):
    node, k = prod
    body = self.body[node]
    nc, ncar = compat.scan_partition(node.params)
    if k < ncar:
      return self._walk(body, body.outvars[k], spec, None, (), out, body.outvars[k], spec)
    if 0 in spec:
      out.append(Blocker(v, _freeze(spec), "a scan output normalized over its stacked axis"))
      return
    inner = {d - 1: b for d, b in spec.items()}
    return self._walk(body, body.outvars[k], inner, None, (), out, body.outvars[k], inner)

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
    if None in sides:
      return None
    # Zero-sum over a subset of the axes implies it over all of them, so a
    # spec spanning both operands is narrowed to the right operand's part
    # (where a layer keeps its weights); the shift check then decides.
    side = 1 if 1 in sides else 0
    return side, {owner[d][1]: b for d, b in spec.items() if owner[d][0] == side}

  @staticmethod
  def _conv_back(node, spec):
    dn = node.params["dimension_numbers"]
    o_out, o_k = dn.out_spec[1], dn.rhs_spec[0]
    # Narrowing to the channel axis is sound: zero-sum over a subset of the
    # reduced axes implies zero-sum over all of them.
    if o_out not in spec or node.params.get("batch_group_count", 1) != 1:
      return None
    block = spec[o_out]
    n_out = shape_of(node.outvars[0])[o_out]
    fg = node.params["feature_group_count"]
    if (n_out // fg) % block:
      return None
    return {o_k: block}


def _is_zero(graph: Graph, v: Any) -> bool:
  """A structural zero: a 0 literal, possibly broadcast, reshaped or converted."""
  while True:
    if compat.is_literal(v):
      return _scalar_literal(v) == 0.0
    prod = graph.producer.get(v)
    if prod is None or prod[0].prim not in _LAYOUT | _UNARY_SAME:
      return False
    v = prod[0].invars[0]


def _describe(node: Node) -> str:
  return f"the output of `{node.prim.name}`, which is not provably zero-sum [at {node.where()}]"


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
  """Sites inside conditional or while-loop bodies (reported, not folded)."""
  out = []
  for n in graph.nodes:
    for g in n.subgraphs:
      if not compat.is_scan(n.eqn):
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
