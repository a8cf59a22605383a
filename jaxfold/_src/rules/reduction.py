"""Reductions and cumulative ops.

``reduce_sum`` is where a shift meets a normalization: summing ``c`` over
axes along which it is constant multiplies it by their size, exactly, which
is what lets ``h - mean(h)`` cancel. Summing over an axis along which ``c``
varies leaves a new, unrelated shift.
"""

from __future__ import annotations

import math

from jax import lax

from jaxfold._src import algebra as A
from jaxfold._src.rules.base import Block, Facts, Need, Rule, freeze, register, size_one
from jaxfold._src.rules.elementwise import _opaque_canon, _prims, ctx_zero


def _reduce_facts(node, ins, ctx):
  axes = tuple(node.params["axes"])
  in_shape = node.ins[0].shape
  kept = [d for d in range(len(in_shape)) if d not in axes]
  const = frozenset(i for i, d in enumerate(kept) if d in ins[0].const)
  value = None
  v = ins[0].value
  if v is not None and node.prim is lax.reduce_sum_p and all(
      isinstance(in_shape[d], int) for d in axes):
    try:
      value = ctx.round_to(v * math.prod(in_shape[d] for d in axes), node.outs[0].dtype)
    except (TypeError, OverflowError, ValueError):
      value = None
  elif v is not None and node.prim in (lax.reduce_max_p, lax.reduce_min_p):
    value = v
  return [Facts(const | size_one(node.outs[0].shape), value, ins[0].random)]


def _sum_canon(node, ins, ctx):
  return [A.reduce_sum(ins[0], node.params["axes"], node.ins[0].shape)]


def _sum_shift(node, ins, ctx):
  p = ins[0]
  axes = tuple(node.params["axes"])
  in_shape = node.ins[0].shape
  dims = tuple(e for d, e in enumerate(p.dims) if d not in axes)
  if all(p.dims[a] is None for a in axes):
    # Σ a_k c^k = c^k Σ a_k: c is constant along the summed axes.
    return [A.poly_map(p, lambda c: A.reduce_sum(c, axes, in_shape), dims)]
  if p.is_pure:
    return [A.pure(dims)]
  varying = [a for a in axes if p.dims[a] is not None]
  raise Block(f"a nonlinear function of the shift (a variance, say) is summed over axes {axes}, "
              f"which include {_axes_text(varying, in_shape)} along which the shift varies: a "
              f"reduction over {_axes_text(varying, in_shape, short=True)} as well does not "
              "remove a shift that differs along it")


def _axes_text(axes, shape, short: bool = False) -> str:
  """``axis 1 (size 5)``, ``axes 1 (size 5) and 2 (size 3)``."""
  if short:
    return ("axis " if len(axes) == 1 else "axes ") + ", ".join(map(str, axes))
  parts = [f"{a} (size {shape[a]})" for a in axes]
  return ("axis " if len(parts) == 1 else "axes ") + " and ".join(parts)


def _sum_zero_sum(node, k, spec, ctx):
  axes = node.params["axes"]
  kept = [d for d in range(len(node.ins[0].shape)) if d not in axes]
  return [Need(0, freeze({kept[d]: b for d, b in spec}))]


register(Rule("reduce_sum", (lax.reduce_sum_p,), facts=_reduce_facts, canon=_sum_canon,
              sums=lambda node, ctx: (0, tuple(node.params["axes"])),
              sum_axes=lambda node: tuple(node.params["axes"]), shift=_sum_shift, zero_sum=_sum_zero_sum,
              simplify=lambda node, zeros: (lambda ins: [ctx_zero(node.outs[0])]) if zeros[0] else None,
              variants=("normalized axes", "shift-varying axes")))

def _along_constant(node, p, what: str) -> None:
  """An order statistic sees ``x + k*c`` as ``x`` plus a constant only when ``c``
  is constant along the reduced axes and ``k`` is a constant (no ``x*c`` term)."""
  axes = tuple(node.params["axes"])
  if not p.is_pure or any(p.dims[a] is not None for a in axes):
    raise Block(f"the shift varies along the axes `{node.prim.name}` reduces over {axes}, so "
                f"its {what} is not the original's {what} shifted")


def _extremum_shift(node, ins, ctx):
  """``max(x + k*c) = max(x) + k*c``: the same shift, without the reduced axes."""
  p = ins[0]
  _along_constant(node, p, "maximum" if node.prim is lax.reduce_max_p else "minimum")
  axes = tuple(node.params["axes"])
  dims = tuple(e for d, e in enumerate(p.dims) if d not in axes)
  return [A.make(p.sym, dims, [A.const(c.const_value) for c in p.coeffs])]


def _arg_extremum_shift(node, ins, ctx):
  """``argmax(x + k*c) = argmax(x)``: the indices do not see the shift."""
  _along_constant(node, ins[0], "position")
  return [None]


for _p in _prims("reduce_max_p", "reduce_min_p"):
  register(Rule(_p.name, (_p,), facts=_reduce_facts, canon=_opaque_canon, shift=_extremum_shift))
for _p in _prims("argmax_p", "argmin_p"):
  register(Rule(_p.name, (_p,), facts=_reduce_facts, canon=_opaque_canon, shift=_arg_extremum_shift))
for _p in _prims("reduce_prod_p", "reduce_and_p", "reduce_or_p", "reduce_xor_p"):
  register(Rule(_p.name, (_p,), facts=_reduce_facts, canon=_opaque_canon))


# ----------------------------------------------------------------------------
# Cumulative ops along one axis.


def _cum_facts(node, ins, ctx):
  axis = node.params["axis"]
  const = ins[0].const - {axis} if node.ins[0].shape[axis] != 1 else ins[0].const
  keep_value = node.prim in _prims("cummax_p", "cummin_p")
  return [Facts(const | size_one(node.outs[0].shape), ins[0].value if keep_value else None,
                ins[0].random)]


def _cum_tag(node):
  return (node.prim.name, node.params["axis"], bool(node.params.get("reverse", False)))


def _cumsum_shift(node, ins, ctx):
  p = ins[0]
  axis = node.params["axis"]
  shape = node.outs[0].shape
  if p.dims[axis] is None and not any(c.is_const for c in p.coeffs):
    # cumsum(a c^k) = c^k cumsum(a) when c is constant along the axis.
    tag = _cum_tag(node)
    return [A.poly_map(p, lambda c: A.app(tag, (c,), shape, False), p.dims)]
  if p.is_pure:
    # cumsum of a constant c is (i+1)·c: no longer constant along the axis.
    dims = list(p.dims)
    dims[axis] = (None, 1) if shape[axis] != 1 else None
    return [A.pure(tuple(dims))]
  raise Block("a nonlinear function of the shift is accumulated")


def _cumsum_zero_sum(node, k, spec, ctx):
  if any(d == node.params["axis"] for d, _ in spec):
    raise Block("a cumulative sum along the normalized axes")
  return [Need(0, spec)]


register(Rule("cumsum", _prims("cumsum_p"), facts=_cum_facts,
              canon=lambda node, ins, ctx: [A.app(_cum_tag(node), ins, node.outs[0].shape, False)],
              shift=_cumsum_shift, zero_sum=_cumsum_zero_sum,
              simplify=lambda node, zeros: (lambda ins: [ctx_zero(node.outs[0])]) if zeros[0] else None,
              variants=("other axis", "normalized axis")))

for _p in _prims("cumprod_p", "cummax_p", "cummin_p", "cumlogsumexp_p"):
  register(Rule(_p.name, (_p,), facts=_cum_facts,
                canon=lambda node, ins, ctx: [A.app(_cum_tag(node), ins, node.outs[0].shape, False)]))
