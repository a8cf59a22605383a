"""Rotation facets: how an orthogonal map applied along a dim passes a primitive.

``jaxfold.rotate`` replaces parameters by ``p ×_d Q`` (Q orthogonal, applied
along dim ``d``: ``(p ×_d Q)[.., i, ..] = Σ_j p[.., j, ..] Q[j, i]``) and must
show that every program output is unchanged. It follows, forwards, the state
of each value:

* ``None``: unchanged;
* ``Lin(dims)``: the new value is the old one ``×_d Q`` along every d in dims;
* ``Quad(dim)``: a sum of elementwise products of pairs of ``Lin({dim})``
  values (times factors constant along ``dim``): its sum over ``dim`` is
  unchanged, because ``<xQ, yQ> = <x, y>``.

Each facet returns the output states, raises ``Want`` when an unchanged
operand would have to be rotated too (the driver may rotate the parameter it
comes from), and ``Block`` otherwise. Every facet here holds for every
orthogonal Q; primitives without one block (the default in ``base``).
"""

from __future__ import annotations

import dataclasses
import math

from jaxfold._src import algebra as A

# The facets attach to registered rules: the families must be registered first,
# whatever order the package imports its modules in.
from jaxfold._src.rules import contraction, control, elementwise, reduction, structural  # noqa: F401
from jaxfold._src.rules import dims as D
from jaxfold._src.rules.base import Block, all_rules, set_facets


@dataclasses.dataclass(frozen=True)
class Lin:
  dims: frozenset


@dataclasses.dataclass(frozen=True)
class Quad:
  dim: int


class Want(Block):
  """Operand ``operand`` (unchanged) would have to be ``Lin(dims)``."""

  def __init__(self, operand: int, dims: frozenset, msg: str):
    super().__init__(msg)
    self.operand, self.dims = operand, frozenset(dims)


def _fits(node, k, dims) -> bool:
  """Operand ``k`` spans the output's ``dims`` (it may be broadcast along others)."""
  a, out = tuple(node.ins[k].shape), tuple(node.outs[0].shape)
  return len(a) == len(out) and all(a[d] == out[d] for d in dims)


def _zero(ctx, a) -> bool:
  return ctx.facts(a).value == 0


def _rotated(ins) -> list:
  return [(k, s) for k, s in enumerate(ins) if s is not None]


# ----------------------------------------------------------------------------
# Elementwise.


def _identity(node, ins, ctx):
  import jax.numpy as jnp  # numpy does not know bfloat16/float8 as inexact
  new = node.params.get("new_dtype")
  if new is not None and not jnp.issubdtype(new, jnp.inexact):
    raise Block("a rotated value is converted to a non-float type")
  return list(ins[:len(node.outs)])


def _sum(node, ins, ctx):
  """add/sub: every non-zero operand carries the same state."""
  states = {s for s in ins if s is not None}
  if len(states) != 1:
    raise Block(f"`{node.prim.name}` of values rotated differently")
  (state,) = states
  dims = _dims_of(state)
  for k, s in enumerate(ins):
    if s is not None and not _fits(node, k, dims):
      raise Block(f"a rotated operand of `{node.prim.name}` is broadcast along the rotated dim")
  for k, s in enumerate(ins):
    if s is None and not _zero(ctx, node.ins[k]):
      if isinstance(state, Lin) and _fits(node, k, dims):
        raise Want(k, state.dims, f"`{node.prim.name}` adds an unrotated value to the rotated "
                                  "stream")
      raise Block(f"`{node.prim.name}` adds an unrotated value to a rotated one")
  return [state]


def _dims_of(state) -> frozenset:
  return state.dims if isinstance(state, Lin) else frozenset({state.dim})


def _mul(node, ins, ctx):
  rot = _rotated(ins)
  out_shape = node.outs[0].shape
  if len(rot) == 2:
    (_, a), (_, b) = rot
    if (isinstance(a, Lin) and a == b and len(a.dims) == 1 and _fits(node, 0, a.dims)
        and _fits(node, 1, a.dims)):
      return [Quad(next(iter(a.dims)))]
    raise Block("a product of two rotated values that is not a sum of squares")
  (k, s), = rot
  other = node.ins[1 - k]
  if not _fits(node, k, _dims_of(s)):
    raise Block("a rotated operand of `mul` is broadcast along the rotated dim")
  if not ctx.constant_along(other, _dims_of(s), out_shape):
    raise Block("a rotated value is multiplied by a factor that varies along the rotated dim (a norm's γ? "
                "jaxfold.fuse_affine moves it into the readers)")
  return [s]


def _div(node, ins, ctx):
  if ins[1] is not None or not _fits(node, 0, _dims_of(ins[0])):
    raise Block("a division by a rotated value")
  if not ctx.constant_along(node.ins[1], _dims_of(ins[0]), node.outs[0].shape):
    raise Block("a rotated value is divided by a value that varies along the rotated dim")
  return [ins[0]]


def _square(node, ins, ctx):
  s = ins[0]
  y = node.params.get("y", 2)
  if isinstance(s, Lin) and len(s.dims) == 1 and y == 2:
    return [Quad(next(iter(s.dims)))]
  raise Block("a power of a rotated value other than a square")


def _select(node, ins, ctx):
  if ins[0] is not None:
    raise Block("a select whose predicate is rotated")
  states = {s for s in ins[1:] if s is not None}
  if len(states) != 1:
    raise Block("a select between values rotated differently")
  (state,) = states
  for k in range(1, len(ins)):
    if ins[k] is None and not _zero(ctx, node.ins[k]):
      raise Block("a select between a rotated and an unrotated value")
    if ins[k] is not None and not _fits(node, k, _dims_of(state)):
      raise Block("a rotated case of a select is broadcast")
  if not ctx.constant_along(node.ins[0], _dims_of(state), node.outs[0].shape):
    raise Block("a select whose predicate varies along the rotated dim")
  return [state]


# ----------------------------------------------------------------------------
# Reductions and contractions.


def _reduce_sum(node, ins, ctx):
  axes = set(node.params["axes"])
  down = lambda d: d - sum(1 for a in axes if a < d)
  s = ins[0]
  if isinstance(s, Quad):
    return [None] if s.dim in axes else [Quad(down(s.dim))]
  if s.dims & axes:
    raise Block("a sum over the rotated dim of a rotated value")
  return [Lin(frozenset(down(d) for d in s.dims))]


def _dot(node, ins, ctx):
  dd = D.DotDims(node.params, node.ins[0].shape, node.ins[1].shape)
  if any(isinstance(s, Quad) for s in ins if s is not None):
    return _dot_quad(node, ins, ctx, dd)
  rot = [s.dims if s is not None else frozenset() for s in ins]
  batch = (set(dd.lb), set(dd.rb))
  for side in (0, 1):
    if rot[side] & batch[side]:
      raise Block("a batched contraction over a rotated dim")
  contracted = (dd.lc, dd.rc)
  for side in (0, 1):
    for i, d in enumerate(contracted[side]):
      partner = contracted[1 - side][i]
      if d in rot[side] and partner not in rot[1 - side]:
        # x Q · (Qᵀ W) = x W: the other operand must be rotated along its paired dim.
        raise Want(1 - side, frozenset(partner for j, partner in enumerate(contracted[1 - side])
                                       if contracted[side][j] in rot[side]),
                   "a contraction over the rotated dim reads an unrotated operand")
  out = frozenset(o for o, (side, d) in dd.owner.items() if d in rot[side])
  return [Lin(out) if out else None]


def _dot_quad(node, ins, ctx, dd):
  """A sum of squares contracted over its dim with weights constant along it
  (a mean written ``x² @ ones / n`` or ``einsum('...d,d', x², ones / n)``):
  ``Σ_d q[.., d, e] w[e]`` for w independent of d is a weighted sum over the
  other dims of unchanged sums over d, so it is unchanged."""
  rot = _rotated(ins)
  if len(rot) != 1:
    raise Block("a contraction of a sum of squares with a rotated value")
  (side, s), = rot
  mine, other = dd.contracting(side), dd.contracting(1 - side)
  if s.dim not in mine:
    raise Block("a contraction of a sum of squares that keeps its dim")
  paired = other[mine.index(s.dim)]
  if not ctx.constant_along(node.ins[1 - side], (paired,), node.ins[1 - side].shape):
    raise Block("a sum of squares contracted over its dim with weights that vary along it")
  return [None]


def _conv(node, ins, ctx):
  cd = D.ConvDims(node.params)
  if ins[0] is not None or not isinstance(ins[1], Lin) or ins[1].dims != {cd.kernel_out}:
    raise Block("a convolution whose input or kernel input features are rotated")
  if cd.groups != 1 or cd.batch_groups != 1:
    raise Block("a grouped convolution with a rotated kernel")
  return [Lin(frozenset({cd.out_channel}))]


# ----------------------------------------------------------------------------
# Structural: the rotated dim must map to one output dim of the same size.


def _lin(s, node) -> frozenset:
  if not isinstance(s, Lin):
    raise Block(f"a sum of squares passes `{node.prim.name}`")
  return s.dims


def _transpose(node, ins, ctx):
  perm = node.params["permutation"]
  dims = _lin(ins[0], node)
  return [Lin(frozenset(o for o, p in enumerate(perm) if p in dims))]


def _broadcast(node, ins, ctx):
  dims = _lin(ins[0], node)
  bdims = node.params["broadcast_dimensions"]
  in_shape, out_shape = node.ins[0].shape, node.outs[0].shape
  if any(in_shape[d] != out_shape[bdims[d]] for d in dims):
    raise Block("a rotated dim is broadcast")
  return [Lin(frozenset(bdims[d] for d in dims))]


def _reshape(node, ins, ctx):
  dims = _lin(ins[0], node)
  if node.params.get("dimensions") is not None:
    raise Block("a reshape with a dimension order")
  in_shape, out_shape = node.ins[0].shape, node.outs[0].shape
  out = set()
  for d in dims:
    # Row-major: the axis survives whole where the sizes before it agree.
    before = math.prod(in_shape[:d])
    match = [o for o in range(len(out_shape))
             if out_shape[o] == in_shape[d] and math.prod(out_shape[:o]) == before]
    if not match:
      raise Block("a reshape that splits or merges the rotated dim")
    out.add(match[-1] if in_shape[d] == 1 else match[0])
  return [Lin(frozenset(out))]


def _squeeze(node, ins, ctx):
  dims = _lin(ins[0], node)
  gone = set(d % len(node.ins[0].shape) for d in node.params["dimensions"])
  if dims & gone:
    raise Block("the rotated dim is squeezed")
  return [Lin(frozenset(d - sum(1 for g in gone if g < d) for d in dims))]


def _slice(node, ins, ctx):
  dims = _lin(ins[0], node)
  if any(node.ins[0].shape[d] != node.outs[0].shape[d] for d in dims):
    raise Block("a slice of the rotated dim")
  strides = node.params.get("strides")
  if node.prim.name == "slice" and strides and any(strides[d] != 1 for d in dims):
    raise Block("a strided slice of the rotated dim")
  if any(s is not None for s in ins[1:]):
    raise Block("a rotated slice index")
  return [ins[0]]


def _split(node, ins, ctx):
  dims = _lin(ins[0], node)
  if node.params["axis"] in dims:
    raise Block("a split of the rotated dim")
  return [ins[0]] * len(node.outs)


def _concat(node, ins, ctx):
  states = {s for s in ins if s is not None}
  if len(states) != 1:
    raise Block("a concatenation of values rotated differently")
  (state,) = states
  dims = _lin(state, node)
  if node.params["dimension"] in dims:
    raise Block("a concatenation along the rotated dim")
  for k, s in enumerate(ins):
    if s is None and not _zero(ctx, node.ins[k]):
      raise Want(k, dims, "a rotated value is concatenated with an unrotated one")
  return [state]


def _gather(node, ins, ctx):
  if any(s is not None for s in ins[1:]):
    raise Block("rotated gather indices")
  dims = _lin(ins[0], node)
  gd = D.GatherDims(node.params, node.ins[0].shape, node.outs[0].shape)
  back = {d: o for o, d in gd.offset.items()}
  if any(d not in back or d in gd.indexed or not gd.full(d) for d in dims):
    raise Block("a gather that indexes the rotated dim")
  if gd.may_fill and not (gd.fill is None or A.exact(gd.fill) == 0 or gd.fill != gd.fill):
    raise Block("a gather whose out-of-bounds fill value is not zero or NaN")
  return [Lin(frozenset(back[d] for d in dims))]


# ----------------------------------------------------------------------------


def _prims(*names) -> list:
  return [p for r in all_rules() if r.name in names for p in r.primitives if p is not None]


set_facets(_prims("copy", "optimization_barrier", "sharding_constraint", "pvary", "checkpoint_name",
                  "stop_gradient", "neg", "convert_element_type", "reduce_precision"), rotate=_identity)
set_facets(_prims("add", "sub"), rotate=_sum)
set_facets(_prims("mul"), rotate=_mul)
set_facets(_prims("div"), rotate=_div)
set_facets(_prims("integer_pow"), rotate=_square)
set_facets(_prims("select_n"), rotate=_select)
set_facets(_prims("reduce_sum"), rotate=_reduce_sum)
set_facets(_prims("dot_general"), rotate=_dot)
set_facets(_prims("conv_general_dilated"), rotate=_conv)
set_facets(_prims("transpose"), rotate=_transpose)
set_facets(_prims("broadcast_in_dim"), rotate=_broadcast)
set_facets(_prims("reshape"), rotate=_reshape)
set_facets(_prims("squeeze"), rotate=_squeeze)
set_facets(_prims("slice", "dynamic_slice"), rotate=_slice)
set_facets(_prims("split"), rotate=_split)
set_facets(_prims("concatenate"), rotate=_concat)
set_facets(_prims("gather"), rotate=_gather)
