"""Contractions: dot_general and conv_general_dilated.

The producers of a normalization's input: zero-sum of a weight over its
output features makes the contraction's output zero-sum over the same
features. A shift on one operand becomes a new shift on the output, constant
only along the perturbed operand's free dims where it was.
"""

from __future__ import annotations

from fractions import Fraction

from jax import lax

from jaxfold._src import algebra as A
from jaxfold._src.rules import dims as D
from jaxfold._src.rules.base import Block, Facts, Need, Rule, freeze, register, size_one
from jaxfold._src.rules.elementwise import ctx_zero


def _effective(p: A.Poly, ctx, rank: int) -> list:
  """Per dim, whether ``a*c`` (a linear poly's single term) is constant."""
  if not p.is_linear:
    raise Block("a nonlinear function of the shift reaches a contraction")
  coef = p.coeffs[0]
  return [p.dims[d] is None and ctx.expr_constant_along(coef, d) for d in range(rank)]


def _block(p: A.Poly, d: int, constant: bool):
  if constant:
    return None
  e = p.dims[d]
  return (None, e[1] if (e is not None and p.is_pure) else 1)


def _zero_simplify(node, zeros):
  if any(zeros):
    return lambda ins: [ctx_zero(node.outs[0])]
  return None


# ----------------------------------------------------------------------------
# dot_general.


def _dot_dims(node) -> D.DotDims:
  return D.DotDims(node.params, node.ins[0].shape, node.ins[1].shape)


def _dot_facts(node, ins, ctx):
  dd = _dot_dims(node)
  const = set(size_one(node.outs[0].shape))
  for o, (side, d) in dd.owner.items():
    if d in ins[side].const:
      const.add(o)
  for o, (dl, dr) in dd.batch.items():
    if dl in ins[0].const and dr in ins[1].const:
      const.add(o)
  return [Facts(frozenset(const), None, ins[0].random or ins[1].random)]


def sum_against_constant(node, ctx):
  """``(side, k)`` when the contraction is ``k * Σ`` of operand ``side`` over its
  contracting dims: the other operand is one known scalar ``k`` everywhere (a
  mean written as ``h @ ones / n`` or ``einsum('...d,d', h, ones / n)``) and
  there are no batch dims; else None."""
  dd = _dot_dims(node)
  if dd.batch:
    return None
  for side in (0, 1):
    f = ctx.facts(node.ins[1 - side])
    if isinstance(f.value, Fraction) and f.value != 0:
      return side, A.snap(f.value, node.ins[1 - side].dtype)
  return None


def _sum_layout(e: A.Expr, node, side: int, dd: D.DotDims) -> A.Expr:
  """A sum over ``side``'s contracting dims, placed at the contraction's output dims."""
  out_shape = node.outs[0].shape
  dims = tuple(o for o, (s, _) in sorted(dd.owner.items()) if s == side)
  if len(dims) == len(out_shape):
    return e
  return A.view_op(e, out_shape, lambda v: v.broadcast(out_shape, dims), ("broadcast", dims))


def _dot_shift(node, ins, ctx):
  if ins[0] is not None and ins[1] is not None:
    raise Block("the shift reaches both operands of a contraction")
  side = 0 if ins[0] is not None else 1
  p = ins[side]
  other = node.ins[1 - side]
  dd = _dot_dims(node)
  summed = sum_against_constant(node, ctx)
  if summed is not None and summed[0] == side and all(p.dims[d] is None for d in dd.contracting(side)):
    # k * Σ_K c = k * |K| * c: c is constant along the contracted dims (a mean
    # as a contraction with ones keeps the shift's identity, so h - mean cancels).
    in_shape = node.ins[side].shape
    keep = tuple(e for d, e in enumerate(p.dims) if d in dd.free[side])
    poly = A.poly_map(p, lambda c: A.scale(A.reduce_sum(c, dd.contracting(side), in_shape), summed[1]), keep)
    if poly is None:
      return [None]
    dims = [None] * dd.rank
    for o, (s, d) in dd.owner.items():
      if s == side:
        dims[o] = p.dims[d]
    return [A.poly_map(poly, lambda c: _sum_layout(c, node, side, dd), tuple(dims))]
  const_p = _effective(p, ctx, len(node.ins[side].shape))
  other_const = ctx.constant_dims(other, other.shape)
  dims = []
  for o in range(dd.rank):
    if o in dd.batch:
      d_side, d_other = dd.batch[o][side], dd.batch[o][1 - side]
      dims.append(_block(p, d_side, const_p[d_side] and d_other in other_const))
    else:
      s, d = dd.owner[o]
      if s == side:
        dims.append(_block(p, d, const_p[d]))
      else:
        dims.append(None if d in other_const else (None, 1))
  if p.is_pure:  # a function of (c, k, the other operand): recomputations share it
    return [A.pure_of(("dot", node.tag(), side, p.sym, p.dims, p.coeffs, ctx.canon(other)), tuple(dims))]
  return [A.pure(tuple(dims))]


def _dot_zero_sum(node, k, spec, ctx):
  dd = _dot_dims(node)
  if any(d in dd.batch for d, _ in spec):
    raise Block("a batched contraction whose batch dims are normalized")
  sides = {dd.owner[d][0] for d, _ in spec}
  # Zero-sum over part of the normalized dims implies it over all of them,
  # so a spec spanning both operands narrows to the right (weight) side.
  side = 1 if 1 in sides else 0
  return [Need(side, freeze({dd.owner[d][1]: b for d, b in spec if dd.owner[d][0] == side}))]


def _dot_canon(node, ins, ctx):
  summed = sum_against_constant(node, ctx)
  if summed is not None:
    side, k = summed
    dd = _dot_dims(node)
    total = A.reduce_sum(ins[side], dd.contracting(side), node.ins[side].shape)
    return [A.scale(_sum_layout(total, node, side, dd), k)]
  # Distributing over sums is exact but rarely needed (nothing cancels
  # across a contraction's operands); past single terms the value stands
  # for itself, which keeps canonical forms of deep models small.
  if len(ins[0].terms) > 1 or len(ins[1].terms) > 1:
    return [ctx.atom(node.outs[0])]
  return [A.bilinear(node.tag(), ins[0], ins[1], node.outs[0].shape)]


def _dot_sums(node, ctx):
  summed = sum_against_constant(node, ctx)
  if summed is None:
    return None
  return summed[0], _dot_dims(node).contracting(summed[0])


register(Rule("dot_general", (lax.dot_general_p,), facts=_dot_facts, canon=_dot_canon, sums=_dot_sums,
              contraction=lambda node: D.DotDims(node.params, node.ins[0].shape, node.ins[1].shape),
              shift=_dot_shift, zero_sum=_dot_zero_sum, simplify=_zero_simplify,
              variants=("weight side", "activation side", "batched", "transposed kernel")))


# ----------------------------------------------------------------------------
# conv_general_dilated.


def _conv_shift(node, ins, ctx):
  if ins[0] is not None and ins[1] is not None:
    raise Block("the shift reaches both operands of a convolution")
  cd = D.ConvDims(node.params)
  out_shape = node.outs[0].shape
  dims = [(None, 1)] * len(out_shape)
  if ins[1] is not None:
    p = ins[1]
    const_p = _effective(p, ctx, len(node.ins[1].shape))
    if cd.batch_groups == 1:
      # A kernel shift constant along its output features stays constant
      # along the output channels of one feature group (contiguous blocks).
      per_group = out_shape[cd.out_channel] // cd.groups
      e = p.dims[cd.kernel_out]
      if const_p[cd.kernel_out]:
        dims[cd.out_channel] = None if cd.groups == 1 else (None, per_group)
      elif p.is_pure and e is not None and per_group % e[1] == 0:
        dims[cd.out_channel] = (None, e[1])
  else:
    p = ins[0]
    const_p = _effective(p, ctx, len(node.ins[0].shape))
    if const_p[cd.lhs_batch] and cd.batch_groups == 1:
      dims[cd.out_batch] = None
  for d in size_one(out_shape):
    dims[d] = None
  return [A.pure(tuple(dims))]


def _conv_zero_sum(node, k, spec, ctx):
  cd = D.ConvDims(node.params)
  s = dict(spec)
  if cd.batch_groups != 1:
    raise Block("a convolution with batch groups whose output is normalized")
  if cd.out_channel not in s:
    others = sorted(s)
    shape = node.outs[0].shape
    raise Block(f"the norm reduces over {'axis' if len(others) == 1 else 'axes'} "
                f"{', '.join(f'{d} (size {shape[d]})' for d in others)} of a convolution's "
                f"output but not over its channels (axis {cd.out_channel}): centering the "
                "kernel's output channels makes only sums over the channels zero")
  block = s[cd.out_channel]
  per_group = node.outs[0].shape[cd.out_channel] // cd.groups
  if per_group % block:
    raise Block("a grouped convolution whose feature groups are smaller than the normalized "
                "groups")
  # Narrowing to the channel axis is sound: zero-sum over a subset of the
  # normalized axes implies zero-sum over all of them.
  return [Need(1, freeze({cd.kernel_out: block}))]


register(Rule("conv_general_dilated", (lax.conv_general_dilated_p,),
              canon=lambda node, ins, ctx: [A.bilinear(node.tag(), ins[0], ins[1],
                                                       node.outs[0].shape)],
              facts=lambda node, ins, ctx: [Facts(size_one(node.outs[0].shape), None,
                                                  ins[0].random or ins[1].random)],
              shift=_conv_shift, zero_sum=_conv_zero_sum, simplify=_zero_simplify,
              variants=("kernel", "grouped kernel", "input")))
