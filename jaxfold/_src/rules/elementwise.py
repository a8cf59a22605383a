"""Elementwise primitives: arithmetic, casts, selections, nonlinearities.

Arithmetic that is polynomial in its operands (add, sub, neg, mul, division
by a shift-free value, integer powers) carries a shift exactly; casts do so
only when they cannot quantize it; every other elementwise function stops it.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfold._src import algebra as A
from jaxfold._src import compat
from jaxfold._src.hints import cast_hint
from jaxfold._src.rules.base import Block, Facts, Need, Rule, lift_poly, operand_const, operand_spec, register, size_one
from jaxfold._src.zero import Zero


def _prims(*names: str) -> tuple:
  return compat.lax_prims(*names)


# ----------------------------------------------------------------------------
# Shared facets.


def elementwise_facts(node, ins, ctx, value=None) -> list:
  shape = node.outs[0].shape
  const = frozenset(range(len(shape)))
  for a in node.ins:
    const &= operand_const(ctx, a, shape)
  const |= size_one(shape)
  random = any([f.random for f in ins])
  return [Facts(const, value, random) for _ in node.outs]


def _known(ins) -> Optional[list]:
  vals = [f.value for f in ins]
  if all(type(v) is Fraction for v in vals):   # (no subclass is made; isinstance is an ABC check)
    return vals
  return None


def _arith_facts(fn):
  """Facts with the known scalar computed exactly, then rounded as the
  program rounds it (to the output dtype)."""
  def facts(node, ins, ctx):
    vals = _known(ins)
    value = None
    if vals is not None:
      try:
        value = ctx.round_to(fn(*vals), node.outs[0].dtype)
      except (ZeroDivisionError, OverflowError, ValueError):
        value = None
    return elementwise_facts(node, ins, ctx, value)
  return facts


def _opaque_canon(node, ins, ctx):
  """``f(args)`` for a deterministic elementwise ``f``, canonical in its args."""
  tag = (node.prim.name, _static(node.params))
  return [A.app(tag, ins, node.outs[0].shape)]


def _static(params: dict) -> tuple:
  return tuple(sorted((k, repr(v)) for k, v in params.items()))


def _block_nonlinear(node, ins, ctx):
  raise Block(f"the shift reaches the nonlinearity `{node.prim.name}`")


def _block_zero_sum(node, k, spec, ctx):
  raise Block(f"the output of the nonlinearity `{node.prim.name}` is not provably zero-sum")


def _zero_out(node, zeros):
  if any(zeros):
    return lambda ins: [ctx_zero(node.outs[0])]
  return None


def ctx_zero(v):
  return Zero(v.aval)


def _union_pure(p, q, out_shape) -> A.Poly:
  """``c1 + c2`` of two independent pure shifts: a fresh one varying where
  either does, piecewise constant on blocks both respect."""
  dims = []
  for x, y in zip(p.dims, q.dims):
    if x is None and y is None:
      dims.append(None)
    else:
      bx = x[1] if x is not None else None
      by = y[1] if y is not None else None
      b = bx if by is None else by if bx is None else math.gcd(bx, by)
      dims.append((None, b))
  return A.pure(tuple(dims))


# ----------------------------------------------------------------------------
# add, sub, add_any.


def _add_shift(sign):
  def shift(node, ins, ctx):
    out_shape = node.outs[0].shape
    a, b = node.ins
    pa = lift_poly(ins[0], a, out_shape) if ins[0] is not None else None
    pb = lift_poly(ins[1], b, out_shape) if ins[1] is not None else None
    if pa is None:
      return [A.poly_map(pb, lambda c: A.scale(c, sign), pb.dims)]
    if pb is None:
      return [pa]
    if pa.same_symbol(pb):
      return [A.poly_add(pa, pb, sign)]
    if pa.is_pure and pb.is_pure:
      return [_union_pure(pa, pb, out_shape)]
    raise Block("two different shifts, one of them nonlinear, meet in a sum")
  return shift


def _add_canon(sign):
  def canon(node, ins, ctx):
    return [A.add(ins[0], ins[1], sign)]
  return canon


def _add_zero_sum(node, k, spec, ctx):
  out_shape = node.outs[0].shape
  needs = []
  for i, a in enumerate(node.ins):
    if ctx.is_zero(a):
      continue
    s = operand_spec(a, spec, out_shape)
    if s is None:
      # Summing a value broadcast along some normalized dims multiplies its
      # sum over the others by their size: it must be zero-sum over those.
      s = _broadcast_spec(a, spec, out_shape)
      if s is None:
        raise Block(f"`{node.prim.name}` {'subtracts' if i and node.prim is lax.sub_p else 'adds'} an "
                    "operand broadcast along every normalized axis: constant there, it is zero-sum only "
                    "where it is zero, which no centering proves (a bias, an offset, or a mean that does "
                    "not cancel the other operand's)")
    needs.append(Need(i, s))
  return needs


def _broadcast_spec(a, spec, out_shape):
  s = tuple(a.shape)
  if len(s) != len(out_shape):
    return None
  kept = tuple((d, b) for d, b in spec if s[d] == out_shape[d])
  return kept or None


def _add_simplify(sign):
  def simplify(node, zeros):
    za, zb = zeros
    out = node.outs[0]
    if za and zb:
      return lambda ins: [ctx_zero(out)]
    if zb:
      return lambda ins: [_fit(ins[0], out.aval)]
    if za:
      return lambda ins: [_fit(ins[1] if sign > 0 else -ins[1], out.aval)]
    return None
  return simplify


def _fit(x, aval):
  x = jnp.asarray(x)
  if x.dtype != aval.dtype:
    x = x.astype(aval.dtype)
  if x.shape != tuple(aval.shape):
    x = jnp.broadcast_to(x, aval.shape)
  return x


register(Rule("add", _prims("add_p", "add_any_p", "add_jaxvals_p"),
              facts=_arith_facts(lambda a, b: a + b), canon=_add_canon(1),
              shift=_add_shift(1), zero_sum=_add_zero_sum, simplify=_add_simplify(1),
              variants=("same shift", "two shifts", "scalar operand", "size-1 broadcast"),
              epilogue="bias", arith="+"))
register(Rule("sub", (lax.sub_p,), facts=_arith_facts(lambda a, b: a - b),
              canon=_add_canon(-1), shift=_add_shift(-1), zero_sum=_add_zero_sum,
              simplify=_add_simplify(-1), variants=("cancellation", "near-cancellation"),
              epilogue="subtract"))


def _neg_shift(node, ins, ctx):
  p = ins[0]
  return [A.poly_map(p, lambda c: A.scale(c, -1), p.dims)]


register(Rule("neg", (lax.neg_p,), facts=_arith_facts(lambda a: -a),
              canon=lambda node, ins, ctx: [A.scale(ins[0], -1)], shift=_neg_shift,
              zero_sum=lambda node, k, spec, ctx: [Need(0, spec)],
              simplify=lambda node, zeros: (lambda ins: [ctx_zero(node.outs[0])]) if zeros[0] else None,
              epilogue="step"))


# ----------------------------------------------------------------------------
# mul, div.


def _scale_shift(p: A.Poly, x: Any, other: Any, factor: A.Expr, ctx, out_shape) -> A.Poly:
  """Shift of ``x * other`` where only ``x`` carries ``p``; ``factor`` is the
  canonical value ``other`` contributes (itself, or its inverse)."""
  p = lift_poly(p, x, out_shape)
  if factor.is_const:
    k = factor.const_value
    return A.poly_map(p, lambda c: A.scale(c, k), p.dims)
  factor = A.lift(factor, out_shape)
  if p.is_pure:
    return A.derived(p, factor, ctx.constant_dims(other, out_shape), out_shape)
  return A.poly_map(p, lambda c: A.mul(c, factor), p.dims)


def _mul_shift(node, ins, ctx):
  out_shape = node.outs[0].shape
  a, b = node.ins
  if ins[0] is not None and ins[1] is not None:
    pa, pb = lift_poly(ins[0], a, out_shape), lift_poly(ins[1], b, out_shape)
    if not pa.same_symbol(pb):
      raise Block("two different shifts are multiplied")
    return [A.poly_mul(pa, A.lift(ctx.canon(a), out_shape), pb, A.lift(ctx.canon(b), out_shape))]
  if ins[0] is not None:
    return [_scale_shift(ins[0], a, b, ctx.canon(b), ctx, out_shape)]
  return [_scale_shift(ins[1], b, a, ctx.canon(a), ctx, out_shape)]


def _mul_zero_sum(node, k, spec, ctx):
  a, b = node.ins
  if ctx.is_zero(a) or ctx.is_zero(b):
    return []
  out_shape = node.outs[0].shape
  dims = [d for d, _ in spec]
  for i, (x, y) in enumerate(((a, b), (b, a))):
    if ctx.constant_along(y, dims, out_shape):
      s = operand_spec(x, spec, out_shape)
      if s is not None:
        return [Need(i, s)]
  if ctx.facts(a).random or ctx.facts(b).random:
    raise Block(DROPOUT)
  raise Block("a product with a factor that varies along the normalized axes")


DROPOUT = ("a random mask (dropout) that varies along the normalized axes makes the input "
           "not zero-mean; jaxfold.cbwc(..., through_dropout=True) folds it anyway, inexactly")


register(Rule("mul", (lax.mul_p,), facts=_arith_facts(lambda a, b: a * b),
              canon=lambda node, ins, ctx: [A.mul(ins[0], ins[1])], shift=_mul_shift,
              zero_sum=_mul_zero_sum, simplify=_zero_out,
              variants=("constant factor", "per-token factor", "varying factor", "same shift"),
              arith="*"), kind="scale")


def _float_node(node) -> bool:
  return _is_float(node.outs[0].dtype)


def _is_float(dtype) -> bool:
  return compat.is_inexact(dtype)


def _trunc_div(a: Fraction, b: Fraction) -> Fraction:
  q = abs(a) / abs(b)
  q = Fraction(math.floor(q))
  return q if (a >= 0) == (b > 0) else -q


def _div_facts(node, ins, ctx):
  fl = _is_float(node.outs[0].dtype)
  return _arith_facts(lambda a, b: a / b if fl else _trunc_div(a, b))(node, ins, ctx)


def _div_canon(node, ins, ctx):
  if not _is_float(node.outs[0].dtype):
    return _opaque_canon(node, ins, ctx)
  return [A.mul(ins[0], A.inv(ins[1], node.ins[1].shape))]


def _div_shift(node, ins, ctx):
  if ins[1] is not None:
    out_shape = node.outs[0].shape
    if ins[0] is not None and _float_node(node):
      # exp(x + c) / Σ exp(x + c): the factor exp(c) cancels in the ratio (softmax).
      pa, pb = lift_poly(ins[0], node.ins[0], out_shape), lift_poly(ins[1], node.ins[1], out_shape)
      if pa.same_symbol(pb) and A.exp_values(pa):
        ca, cb = _in_exp_atoms(ctx, pa, node.ins)
        if A.is_proportional(pa, A.lift(ca, out_shape)) and A.is_proportional(pb, A.lift(cb, out_shape)):
          return [None]
    raise Block("the shift reaches a divisor")
  if not _is_float(node.outs[0].dtype):
    raise Block("integer division truncates the shift")
  a, b = node.ins
  return [_scale_shift(ins[0], a, b, A.inv(ctx.canon(b), b.shape), ctx, node.outs[0].shape)]


def _div_zero_sum(node, k, spec, ctx):
  a, b = node.ins
  if ctx.is_zero(a):
    return []
  out_shape = node.outs[0].shape
  if _is_float(node.outs[0].dtype) and ctx.constant_along(b, [d for d, _ in spec], out_shape):
    s = operand_spec(a, spec, out_shape)
    if s is not None:
      return [Need(0, s)]
  if ctx.facts(b).random:
    raise Block(DROPOUT)
  raise Block("a division by a value that varies along the normalized axes")


register(Rule("div", (lax.div_p,), facts=_div_facts, canon=_div_canon, shift=_div_shift,
              zero_sum=_div_zero_sum,
              simplify=lambda node, zeros: ((lambda ins: [ctx_zero(node.outs[0])])
                                            if zeros[0] and _is_float(node.outs[0].dtype) else None),
              variants=("constant divisor", "rounded reciprocal", "per-token divisor",
                        "shift in divisor"), arith="/"), kind="scale")


# ----------------------------------------------------------------------------
# Powers.


def _pow_n(node) -> int:
  return 2 if node.prim is lax.square_p else int(node.params["y"])


def _pow_facts(node, ins, ctx):
  n = _pow_n(node)
  return _arith_facts(lambda a: a ** n if n >= 0 else 1 / a ** (-n))(node, ins, ctx)


def _pow_canon(node, ins, ctx):
  n = _pow_n(node)
  if n >= 0:
    return [A.power(ins[0], n)]
  return [A.inv(A.power(ins[0], -n), node.outs[0].shape)]


def _pow_shift(node, ins, ctx):
  n = _pow_n(node)
  if n < 0:
    raise Block(f"the shift reaches a negative power (`{node.prim.name}`)")
  if n == 0:
    return [None]
  p = ins[0]
  v = ctx.canon(node.ins[0])
  acc_p, acc_v = p, v
  for i in range(n - 1):
    acc_p = A.poly_mul(acc_p, acc_v, p, v)
    if acc_p is None:
      break
    if i < n - 2:   # the last power of v is never read (v² is the bulk of a LayerNorm's check)
      acc_v = A.mul(acc_v, v)
  return [acc_p]


def _pow_zero_sum(node, k, spec, ctx):
  if _pow_n(node) == 1:
    return [Need(0, spec)]
  raise Block(f"a power (`{node.prim.name}`) is not zero-sum")


register(Rule("integer_pow", (lax.square_p, lax.integer_pow_p), facts=_pow_facts,
              canon=_pow_canon, shift=_pow_shift, zero_sum=_pow_zero_sum,
              simplify=lambda node, zeros: ((lambda ins: [ctx_zero(node.outs[0])])
                                            if zeros[0] and _pow_n(node) >= 1 else None),
              variants=("square", "cube", "negative"), epilogue="step"))


# ----------------------------------------------------------------------------
# max / min / clamp, comparisons, select.


def _cmp(fn):
  return lambda *v: Fraction(int(bool(fn(*v))))


def _max_canon(node, ins, ctx):
  """``max(0, v) = v`` for a provably non-negative ``v`` (a clamped variance)."""
  for a, b in ((ins[0], ins[1]), (ins[1], ins[0])):
    if a.is_const and a.const_value <= 0 and A.nonneg(b):
      return [A.lift(b, node.outs[0].shape)]
  return [A.app(("max",), ins, node.outs[0].shape, commutative=True)]


def _bound_shift(identity: float):
  """``max(x, -inf) = x`` (``min(x, inf) = x``): jax.nn.softmax guards its row
  maximum this way; any other bound stops the shift."""
  def shift(node, ins, ctx):
    for i in (0, 1):
      other = node.ins[1 - i]
      if ins[i] is not None and ins[1 - i] is None and ctx.facts(other).value == identity:
        return [lift_poly(ins[i], node.ins[i], node.outs[0].shape)]
    return _block_nonlinear(node, ins, ctx)
  return shift


register(Rule("max", (lax.max_p,), facts=_arith_facts(max), canon=_max_canon,
              shift=_bound_shift(-math.inf), zero_sum=_block_zero_sum, variants=("clamp", "-inf bound"),
              activation=True))   # (ReLU is max(x, 0))
register(Rule("min", (lax.min_p,), facts=_arith_facts(min),
              canon=lambda node, ins, ctx: [A.app(("min",), ins, node.outs[0].shape, commutative=True)],
              shift=_bound_shift(math.inf), zero_sum=_block_zero_sum))
register(Rule("clamp", (lax.clamp_p,), facts=_arith_facts(lambda lo, x, hi: min(max(x, lo), hi)),
              canon=_opaque_canon, shift=_block_nonlinear, zero_sum=_block_zero_sum))
for _name, _fn in (("eq_p", lambda a, b: a == b), ("ne_p", lambda a, b: a != b),
                   ("lt_p", lambda a, b: a < b), ("le_p", lambda a, b: a <= b),
                   ("gt_p", lambda a, b: a > b), ("ge_p", lambda a, b: a >= b)):
  register(Rule(_name[:-2], _prims(_name), facts=_arith_facts(_cmp(_fn)), canon=_opaque_canon,
                shift=_block_nonlinear, zero_sum=_block_zero_sum))


def _select_facts(node, ins, ctx):
  pred = ins[0].value
  if isinstance(pred, Fraction):
    case = ins[1 + int(pred)]
    return [Facts(case.const | size_one(node.outs[0].shape), case.value,
                  case.random or ins[0].random)]
  vals = [f.value for f in ins[1:]]
  value = vals[0] if all(isinstance(v, Fraction) and v == vals[0] for v in vals) else None
  return elementwise_facts(node, ins, ctx, value)


def _select_canon(node, ins, ctx):
  pred = ctx.facts(node.ins[0]).value
  shape = node.outs[0].shape
  if isinstance(pred, Fraction):
    return [A.lift(ins[1 + int(pred)], shape)]
  return [A.app(("select_n",), ins, shape)]


def _select_shift(node, ins, ctx):
  shape = node.outs[0].shape
  pred = ctx.facts(node.ins[0]).value
  if ins[0] is not None:
    raise Block("the shift reaches a selection predicate")
  if isinstance(pred, Fraction):
    i = 1 + int(pred)
    return [lift_poly(ins[i], node.ins[i], shape) if ins[i] is not None else None]
  polys = [lift_poly(p, a, shape) if p is not None else None
           for p, a in zip(ins[1:], node.ins[1:])]
  live = [p for p in polys if p is not None]
  if len(live) == len(polys) and all(
      p.same_symbol(live[0]) and p.coeffs == live[0].coeffs for p in live):
    return [live[0]]  # every case moves by the same c: so does the selection
  if not all(p.is_pure for p in live):
    raise Block("a nonlinear function of the shift reaches a selection")
  const = ctx.constant_dims(node.ins[0], shape)
  dims = []
  for d in range(len(shape)):
    es = [p.dims[d] for p in live]
    if d in const:
      if all(e is None for e in es):
        dims.append(None)
      else:
        dims.append((None, math.gcd(*[e[1] for e in es if e is not None])))
    else:
      dims.append((None, 1))
  return [A.pure(tuple(dims))]


def _select_zero_sum(node, k, spec, ctx):
  pred = node.ins[0]
  val = ctx.facts(pred).value
  shape = node.outs[0].shape
  if isinstance(val, Fraction):
    i = 1 + int(val)
    if ctx.is_zero(node.ins[i]):
      return []
    s = operand_spec(node.ins[i], spec, shape)
    if s is None:
      raise Block("`select_n` broadcasts a case along the normalized axes")
    return [Need(i, s)]
  if not ctx.constant_along(pred, [d for d, _ in spec], shape):
    if ctx.facts(pred).random:
      raise Block(DROPOUT)
    raise Block("a selection whose predicate varies along the normalized axes")
  needs = []
  for i, a in enumerate(node.ins[1:], 1):
    if ctx.is_zero(a):
      continue
    s = operand_spec(a, spec, shape)
    if s is None:
      raise Block("`select_n` broadcasts a case along the normalized axes")
    needs.append(Need(i, s))
  return needs


def _select_simplify(node, zeros):
  if zeros[0]:
    return None
  if all(zeros[1:]):
    return lambda ins: [ctx_zero(node.outs[0])]
  return None


register(Rule("select_n", (lax.select_n_p,), facts=_select_facts, canon=_select_canon,
              shift=_select_shift, zero_sum=_select_zero_sum, simplify=_select_simplify,
              variants=("constant predicate", "per-token predicate", "varying predicate",
                        "shift in predicate")))


# ----------------------------------------------------------------------------
# Casts and identities.


def _convert_kind(src, dst, ctx) -> str:
  """'same' | 'exact' (no rounding possible) | 'rounding' (within the
  program's output precision) | 'quantize'."""
  src, dst = np.dtype(src), np.dtype(dst)
  if src == dst:
    return "same"
  if not _is_float(dst):
    return "quantize"
  if not _is_float(src):
    return "quantize"  # ints into floats: only shift-free values (indices) take this path
  if ctx.at_least_as_precise(dst, src):
    return "exact"
  if ctx.at_least_as_precise(dst, ctx.tolerance):
    return "rounding"
  return "quantize"


def _convert_facts(node, ins, ctx):
  v = ins[0].value
  value = None
  if isinstance(v, Fraction):
    dst = node.outs[0].dtype
    try:
      if _is_float(dst):
        value = ctx.round_to(v, dst)
      elif np.dtype(dst) == np.bool_:
        value = Fraction(int(v != 0))
      else:
        value = Fraction(math.trunc(v))
    except (OverflowError, ValueError):
      value = None
  return [Facts(ins[0].const, value, ins[0].random)]


def _convert_canon(node, ins, ctx):
  kind = _convert_kind(node.ins[0].dtype, node.outs[0].dtype, ctx)
  if kind in ("same", "exact", "rounding"):
    return [ins[0]]
  return [A.app(("convert", str(np.dtype(node.outs[0].dtype))), ins, node.outs[0].shape)]


def _quantizer_reason(node, ctx, what: str) -> str:
  src, dst = np.dtype(node.ins[0].dtype).name, np.dtype(node.outs[0].dtype).name
  # e.g. HF's Flax Dinov2 interpolates its position table in float32 in a float64 model
  hint = (f": the program computes this part in {dst} on {src} values; compute in {src} throughout "
          f"or fold the {dst} model") if _is_float(node.ins[0].dtype) else ""
  return (f"{what} [{src} -> {dst}] rounds the shifted value more coarsely than the program's "
          f"outputs ({np.dtype(ctx.tolerance).name}), so the shift would not stay exact{hint}")


def _convert_shift(node, ins, ctx):
  kind = _convert_kind(node.ins[0].dtype, node.outs[0].dtype, ctx)
  if kind == "quantize":
    if not _is_float(node.outs[0].dtype):
      raise Block(f"a cast to {np.dtype(node.outs[0].dtype).name} quantizes the shift")
    raise Block(_quantizer_reason(node, ctx, "a cast"))
  return [ins[0]]


def _convert_zero_sum(node, k, spec, ctx):
  if _convert_kind(node.ins[0].dtype, node.outs[0].dtype, ctx) == "quantize":
    src, dst = np.dtype(node.ins[0].dtype).name, np.dtype(node.outs[0].dtype).name
    hint = ""
    if _is_float(node.ins[0].dtype) and _is_float(node.outs[0].dtype):
      # e.g. Keras's JAX backend computes in its floatx (float32) and casts float64 inputs down:
      # the framework's setting is named only when its code made the cast.
      made_by = next((p for p in ("keras", "flax") if compat.made_in_package(node.eqn, p)), "")
      hint = ": " + cast_hint(made_by, src, dst)
    raise Block(f"a cast to {dst} does not keep a zero sum{hint}")
  return [Need(0, spec, transparent=True)]


def _convert_simplify(node, zeros):
  if zeros[0] and _is_float(node.outs[0].dtype):
    return lambda ins: [ctx_zero(node.outs[0])]
  return None


def _float_bits(dtype) -> tuple:
  info = jnp.finfo(dtype)
  return info.nmant, info.nexp


def _convert_cast(params, src, dst) -> Optional[tuple]:
  if not (jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)):
    return None
  (ms, es), (md, ed) = _float_bits(src), _float_bits(dst)
  return min(ms, md), min(es, ed)


register(Rule("convert_element_type", (lax.convert_element_type_p,), facts=_convert_facts,
              canon=_convert_canon, shift=_convert_shift, zero_sum=_convert_zero_sum,
              simplify=_convert_simplify,
              variants=("widening", "narrowing within tolerance", "narrowing beyond tolerance",
                        "int target"), reindex="convert", cast=_convert_cast), kind="identity")


def _rp_kind(node, ctx) -> str:
  import jax.numpy as jnp
  info = jnp.finfo(node.ins[0].dtype)
  e, m = node.params["exponent_bits"], node.params["mantissa_bits"]
  if m >= info.nmant and e >= info.nexp:
    return "exact"
  tol = jnp.finfo(ctx.tolerance)
  if m >= tol.nmant and e >= tol.nexp:
    return "rounding"
  return "quantize"


def _rp_shift(node, ins, ctx):
  if _rp_kind(node, ctx) == "quantize":
    raise Block(f"`reduce_precision` to {node.params['exponent_bits']} exponent and "
                f"{node.params['mantissa_bits']} mantissa bits quantizes the shift")
  return [ins[0]]


def _rp_canon(node, ins, ctx):
  if _rp_kind(node, ctx) == "quantize":
    return _opaque_canon(node, ins, ctx)
  return [ins[0]]


def _rp_zero_sum(node, k, spec, ctx):
  if _rp_kind(node, ctx) == "quantize":
    raise Block("`reduce_precision` to a narrow format does not keep a zero sum")
  return [Need(0, spec, transparent=True)]


def _rp_cast(params, src, dst) -> Optional[tuple]:
  # the value is rounded to the emulated format (e.g. a float8 in a float32)
  bits = _convert_cast(params, src, dst)
  if bits is None:
    return None
  return min(bits[0], params["mantissa_bits"]), min(bits[1], params["exponent_bits"])


register(Rule("reduce_precision", _prims("reduce_precision_p"),
              facts=lambda node, ins, ctx: [Facts(ins[0].const, None, ins[0].random)],
              canon=_rp_canon, shift=_rp_shift, zero_sum=_rp_zero_sum,
              simplify=lambda node, zeros: (lambda ins: [ctx_zero(node.outs[0])]) if zeros[0] else None,
              variants=("wide format", "narrow format"), cast=_rp_cast), kind="identity")


def _identity_rule(name, prims, differentiable=True, reindex=""):
  """Each output is its same-position operand (barriers, copies, constraints)."""
  def facts(node, ins, ctx):
    return [Facts(f.const, f.value, f.random) for f in ins[:len(node.outs)]]

  def canon(node, ins, ctx):
    return list(ins[:len(node.outs)])

  def shift(node, ins, ctx):
    if not differentiable and ctx.cbwc:
      raise Block(f"the shift passes `{node.prim.name}`, whose gradient is not the derivative "
                  "of its value, so CBWC gradients would differ")
    return list(ins[:len(node.outs)])

  def zero_sum(node, k, spec, ctx):
    return [Need(k, spec, transparent=True)]

  def simplify(node, zeros):
    if any(zeros):
      return lambda ins: [ctx_zero(o) if z else x for o, z, x in zip(node.outs, zeros, ins)]
    return None

  register(Rule(name, prims, facts=facts, canon=canon, shift=shift, zero_sum=zero_sum,
                simplify=simplify, differentiable=differentiable, kind="identity", reindex=reindex,
                variants=("several operands",) if name == "optimization_barrier" else ()))


_identity_rule("copy", _prims("copy_p"), reindex="move")
_identity_rule("optimization_barrier", _prims("optimization_barrier_p"))
_identity_rule("sharding_constraint", _prims("sharding_constraint_p"))
# shard_map's replication check marks values (a literal 8.0 in a mean) as varying across mesh axes
_identity_rule("pvary", compat.vary_prims())
# remat policies read these tags, not values: a value passes unchanged (MaxText tags every
# projection output, so without it no norm of such a model folds)
_identity_rule("checkpoint_name", compat.checkpoint_name_prims())
_identity_rule("stop_gradient", _prims("stop_gradient_p"), differentiable=False)


# ----------------------------------------------------------------------------
# Every other elementwise function: facts and canonical form only; a shift
# that reaches it is visible (unless it cancelled before).

_EXACT_UNARY = {
    "abs_p": abs,
    "sign_p": lambda a: Fraction((a > 0) - (a < 0)),
    "floor_p": lambda a: Fraction(math.floor(a)),
    "ceil_p": lambda a: Fraction(math.ceil(a)),
    "not_p": None,
}
_NONLINEAR = ("exp_p", "exp2_p", "log_p", "log1p_p", "expm1_p", "tanh_p", "logistic_p", "erf_p",
              "erfc_p", "erf_inv_p", "sin_p", "cos_p", "tan_p", "asin_p", "acos_p", "atan_p",
              "sinh_p", "cosh_p", "asinh_p", "acosh_p", "atanh_p", "sqrt_p", "rsqrt_p", "cbrt_p",
              "pow_p", "atan2_p", "rem_p", "nextafter_p", "round_p", "is_finite_p", "and_p",
              "or_p", "xor_p", "lgamma_p", "digamma_p", "igamma_p", "igammac_p",
              "bessel_i0e_p", "bessel_i1e_p", "real_p", "imag_p", "conj_p", "complex_p",
              "population_count_p", "clz_p", "shift_left_p", "shift_right_arithmetic_p",
              "shift_right_logical_p", "polygamma_p", "zeta_p", "mulhi_p")

def _exp_shift(node, ins, ctx):
  p = ins[0]
  if not p.is_pure or not _float_node(node):
    return _block_nonlinear(node, ins, ctx)
  out = node.outs[0]
  return [A.exp_of(p, ctx.atom(out), out)]


def _in_exp_atoms(ctx, p: A.Poly, vals) -> list:
  """Canonical forms of ``vals`` written over the atoms of the ``exp``
  outputs that carry ``p``'s symbol (what its coefficients are written in;
  cheap: nothing behind those outputs is expanded)."""
  overrides = dict(ctx.overrides)
  overrides.update({v: ctx.atom(v) for v in A.exp_values(p)})
  with ctx.assuming(overrides):
    return [ctx.canon(v) for v in vals]


def _log_shift(node, ins, ctx):
  p = ins[0]
  if _float_node(node) and A.exp_values(p) and A.is_proportional(p, _in_exp_atoms(ctx, p, node.ins)[0]):
    return [A.log_of(p)]
  return _block_nonlinear(node, ins, ctx)


def _pow_canon(node, ins, ctx):
  """``x ** ±½`` and ``x ** -1`` are the (r)sqrt and reciprocal they equal."""
  y = ins[1]
  if y.is_const and _float_node(node):
    k = y.const_value
    shape = node.outs[0].shape
    if k == Fraction(-1, 2):
      return [A.app(A.RSQRT, (ins[0],), shape)]
    if k == Fraction(1, 2):
      return [A.app(A.SQRT, (ins[0],), shape)]
    if k == -1:
      return [A.lift(A.inv(ins[0], node.ins[0].shape), shape)]
  return _opaque_canon(node, ins, ctx)


# The smooth activations' pieces (GELU: erf or tanh; SiLU/sigmoid: logistic; ELU: expm1).
_ACTIVATIONS = frozenset({"exp", "exp2", "expm1", "tanh", "logistic", "erf", "erfc", "log1p"})
_SHIFTS = {"exp_p": _exp_shift, "log_p": _log_shift}
_SHIFT_VARIANTS = {"exp_p": ("nonlinear", "ratio of sums"), "log_p": ("nonlinear", "log of a sum of exps")}

for _name in tuple(_EXACT_UNARY) + _NONLINEAR:
  _p = getattr(lax, _name, None)
  if _p is None:
    continue
  if _name == "pow_p":
    register(Rule("pow", (_p,), facts=elementwise_facts, canon=_pow_canon, shift=_block_nonlinear,
                  zero_sum=_block_zero_sum, epilogue="step"))
    continue
  _fn = _EXACT_UNARY.get(_name)
  _tag = _name[:-2]
  register(Rule(_tag, (_p,), facts=_arith_facts(_fn) if _fn else elementwise_facts,
                canon=(lambda tag: (lambda node, ins, ctx: [A.app(tag, ins, node.outs[0].shape)]))(
                    {"sqrt": A.SQRT, "rsqrt": A.RSQRT}[_tag]) if _tag in ("sqrt", "rsqrt") else _opaque_canon,
                shift=_SHIFTS.get(_name, _block_nonlinear), zero_sum=_block_zero_sum,
                variants=_SHIFT_VARIANTS.get(_name, ()), activation=_tag in _ACTIVATIONS,
                epilogue="step" if _tag in ("sqrt", "rsqrt") else ""))
