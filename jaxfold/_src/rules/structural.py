"""Primitives that move elements without arithmetic: layout, slicing,
concatenation, padding, gathers and their kin.

A shift constant along a dim stays constant along it only where the
primitive keeps that dim whole: a slice, pad, roll or gather along a dim
where ``c`` varies remaps indices (a fresh label), and padding or filling
mixes shifted and unshifted elements (varying).
"""

from __future__ import annotations

import math
from typing import Optional

from jax import lax

from jaxfold._src import algebra as A
from jaxfold._src.rules import dims as D
from jaxfold._src.rules.base import Block, Facts, Need, Rule, freeze, register, size_one
from jaxfold._src.rules.elementwise import _prims, ctx_zero


def _same_value(node, ins, ctx) -> list:
  """Facts when elements are only rearranged: a known scalar stays known."""
  return [Facts(size_one(o.shape), ins[0].value, any(f.random for f in ins)) for o in node.outs]


def _only_operand_zero(node, zeros):
  """Outputs are zero when the data operand is (indices never matter)."""
  if zeros[0]:
    return lambda ins: [ctx_zero(o) for o in node.outs]
  return None


def _all_data_zero(n_data):
  def simplify(node, zeros):
    if all(zeros[:n_data]):
      return lambda ins: [ctx_zero(o) for o in node.outs]
    return None
  return simplify


def _view_coeffs(p: A.Poly, out_shape, op, tag, dims) -> Optional[A.Poly]:
  return A.poly_map(p, lambda c: A.view_op(c, out_shape, op, tag), dims)


def _canon_view(op_of_node):
  def canon(node, ins, ctx):
    out_shape = node.outs[0].shape
    return [A.view_op(ins[0], out_shape, op_of_node(node), node.tag())]
  return canon


def _no_shift_in(ins, start: int, what: str):
  if any(p is not None for p in ins[start:]):
    raise Block(f"the shift reaches {what}")


# ----------------------------------------------------------------------------
# transpose, broadcast_in_dim, reshape, squeeze, expand_dims.


def _transpose_facts(node, ins, ctx):
  perm = node.params["permutation"]
  inv = {p: i for i, p in enumerate(perm)}
  return [Facts(frozenset(inv[d] for d in ins[0].const), ins[0].value, ins[0].random)]


def _transpose_shift(node, ins, ctx):
  perm = node.params["permutation"]
  p = ins[0]
  return [_view_coeffs(p, node.outs[0].shape, lambda v: v.transpose(perm), node.tag(),
                       tuple(p.dims[i] for i in perm))]


def _transpose_zero_sum(node, k, spec, ctx):
  perm = node.params["permutation"]
  return [Need(0, freeze({perm[d]: b for d, b in spec}), transparent=True)]


register(Rule("transpose", (lax.transpose_p,), facts=_transpose_facts,
              canon=_canon_view(lambda n: (lambda v: v.transpose(n.params["permutation"]))),
              shift=_transpose_shift, zero_sum=_transpose_zero_sum, simplify=_only_operand_zero,
              reindex="move"), kind="layout")


def _bcast_facts(node, ins, ctx):
  bd = node.params["broadcast_dimensions"]
  out_shape = node.outs[0].shape
  in_shape = node.ins[0].shape
  const = set(size_one(out_shape)) | {d for d in range(len(out_shape)) if d not in bd}
  for i, d in enumerate(bd):
    if i in ins[0].const or in_shape[i] != out_shape[d]:
      const.add(d)
  return [Facts(frozenset(const), ins[0].value, any(f.random for f in ins))]


def _bcast_op(node):
  shape, bd = node.outs[0].shape, node.params["broadcast_dimensions"]
  return lambda v: v.broadcast(shape, bd)


def _bcast_shift(node, ins, ctx):
  if any(p is not None for p in ins[1:]):
    raise Block("the shift reaches a dynamic broadcast shape")
  p = ins[0]
  bd = node.params["broadcast_dimensions"]
  out_shape, in_shape = node.outs[0].shape, node.ins[0].shape
  dims = [None] * len(out_shape)
  for i, d in enumerate(bd):
    if D.same(in_shape[i], out_shape[d]):
      dims[d] = p.dims[i]
    elif p.dims[i] is not None:
      dims[d] = _ONE_BLOCK  # a labelled size-1 dim repeated
  q = _one_block(tuple(dims), lambda ds: _view_coeffs(p, out_shape, _bcast_op(node), node.tag(), ds))
  if (q is not None and _ONE_BLOCK not in dims and len(in_shape) == len(out_shape)
      and tuple(bd) == tuple(range(len(out_shape)))):
    q = A.broadcast_derived(p, q, in_shape, out_shape)   # size-1 expansion only: every dim stays where it was
  return [q]


def _bcast_zero_sum(node, k, spec, ctx):
  bd = list(node.params["broadcast_dimensions"])
  in_shape, out_shape = node.ins[0].shape, node.outs[0].shape
  res = {}
  for d, b in spec:
    if d not in bd or not D.same(in_shape[bd.index(d)], out_shape[d]):
      raise Block("`broadcast_in_dim` repeats a value along the normalized axes")
    res[bd.index(d)] = b
  return [Need(0, freeze(res), transparent=True)]


register(Rule("broadcast_in_dim", (lax.broadcast_in_dim_p,), facts=_bcast_facts,
              canon=_canon_view(_bcast_op), shift=_bcast_shift, zero_sum=_bcast_zero_sum,
              simplify=_only_operand_zero, variants=("new dims", "size-1 expansion"), reindex="move"), kind="layout")


def _reshape_check(node):
  if node.params.get("dimensions") is not None:
    raise Block("a reshape with a dimension permutation")


def _reshape_facts(node, ins, ctx):
  in_shape, out_shape = node.ins[0].shape, node.outs[0].shape
  const = set(size_one(out_shape))
  gs = D.reshape_groups(in_shape, out_shape) if node.params.get("dimensions") is None else None
  for gi, gj in gs or ():
    if all(i in ins[0].const for i in gi):
      const.update(gj)
  return [Facts(frozenset(const), ins[0].value, any(f.random for f in ins))]


def _reshape_shift(node, ins, ctx):
  _reshape_check(node)
  if any(p is not None for p in ins[1:]):
    raise Block("the shift reaches a dynamic reshape size")
  p = ins[0]
  in_shape, out_shape = node.ins[0].shape, node.outs[0].shape
  dims = D.reshape_dims(p.dims, in_shape, out_shape)
  if dims is None:
    raise Block(f"a reshape {tuple(in_shape)} -> {tuple(out_shape)} that mixes the axes the "
                "shift varies along with others")
  return [_view_coeffs(p, out_shape, lambda v: v.reshape(out_shape), node.tag(), dims)]


def _reshape_zero_sum(node, k, spec, ctx):
  _reshape_check(node)
  res = D.reshape_spec_back(dict(spec), node.ins[0].shape, node.outs[0].shape)
  if res is None:
    strided = _strided_groups(dict(spec), node.ins[0].shape, node.outs[0].shape)
    if strided is not None:
      d, stride = strided
      raise Block(f"a reshape {tuple(node.ins[0].shape)} -> {tuple(node.outs[0].shape)} puts elements of "
                  f"dim {d} that are {stride} apart in one normalized group (strided groups: c, c + {stride}, "
                  f"c + {2 * stride}, ...): a centering "
                  "over consecutive blocks, the only kind jaxfold applies to a parameter, cannot make "
                  "those groups zero-sum")
    raise Block(f"a reshape {tuple(node.ins[0].shape)} -> {tuple(node.outs[0].shape)} mixes "
                "the normalized axes with others")
  return [Need(0, freeze(res), transparent=True)]


def _strided_groups(spec: dict, in_shape, out_shape):
  """``(input dim, stride)`` where the reshape splits one input dim and the
  normalized dims among its parts are followed by a part they leave out
  (``h.reshape(..., C // G, G)`` reduced over the ``C // G`` axis: channels
  c, c + G, c + 2G, ... in one group); else None."""
  for gi, gj in D.reshape_groups(in_shape, out_shape) or ():
    inside = [k for k, o in enumerate(gj) if o in spec]
    if len(gi) != 1 or not inside:
      continue
    after = [out_shape[o] for o in gj[max(inside) + 1:]]
    if any(not isinstance(n, int) for n in after):
      return None
    stride = math.prod(after)
    if stride > 1:
      return gi[0], stride
  return None


def _reshape_canon(node, ins, ctx):
  if node.params.get("dimensions") is not None:
    return [A.app(("reshape_perm", node.tag()), ins[:1], node.outs[0].shape, False)]
  out_shape = node.outs[0].shape
  return [A.view_op(ins[0], out_shape, lambda v: v.reshape(out_shape), node.tag())]


register(Rule("reshape", (lax.reshape_p,), facts=_reshape_facts, canon=_reshape_canon,
              shift=_reshape_shift, zero_sum=_reshape_zero_sum, simplify=_only_operand_zero,
              variants=("split", "merge", "grouped"), reindex="move"), kind="layout")


def _squeeze_kept(node) -> list:
  dims = node.params["dimensions"]
  return [d for d in range(len(node.ins[0].shape)) if d not in dims]


def _squeeze_facts(node, ins, ctx):
  kept = _squeeze_kept(node)
  return [Facts(frozenset(i for i, d in enumerate(kept) if d in ins[0].const), ins[0].value,
                ins[0].random)]


def _squeeze_shift(node, ins, ctx):
  p = ins[0]
  kept = _squeeze_kept(node)
  out_shape = node.outs[0].shape
  return [_view_coeffs(p, out_shape, lambda v: v.reshape(out_shape), node.tag(),
                       tuple(p.dims[d] for d in kept))]


def _squeeze_zero_sum(node, k, spec, ctx):
  kept = _squeeze_kept(node)
  return [Need(0, freeze({kept[d]: b for d, b in spec}), transparent=True)]


register(Rule("squeeze", (lax.squeeze_p,), facts=_squeeze_facts,
              canon=_canon_view(lambda n: (lambda v: v.reshape(n.outs[0].shape))),
              shift=_squeeze_shift, zero_sum=_squeeze_zero_sum, simplify=_only_operand_zero,
              reindex="move"), kind="layout")


# ----------------------------------------------------------------------------
# rev, slice, dynamic_slice, split, tile.


def _moved_dim(e, aligned: bool):
  """A dim whose indices were remapped: a fresh index map, blocks kept only
  when the remapping respects their alignment."""
  if e is None:
    return None
  return (A.fresh_label(), e[1] if aligned else 1)


def _rev_shift(node, ins, ctx):
  p = ins[0]
  rd = node.params["dimensions"]
  shape = node.outs[0].shape
  dims = tuple(_moved_dim(e, shape[d] % e[1] == 0) if d in rd and e is not None else e
               for d, e in enumerate(p.dims))
  if dims != p.dims and not p.is_pure:
    raise Block("a nonlinear function of the shift is reversed along an axis it varies along")
  return [_view_coeffs(p, shape, lambda v: v.rev(rd), node.tag(), dims)]


register(Rule("rev", (lax.rev_p,), facts=lambda node, ins, ctx: [Facts(ins[0].const, ins[0].value, ins[0].random)],
              canon=_canon_view(lambda n: (lambda v: v.rev(n.params["dimensions"]))),
              shift=_rev_shift,
              zero_sum=lambda node, k, spec, ctx: _rev_zero_sum(node, spec),
              simplify=_only_operand_zero, reindex="move"))


def _rev_zero_sum(node, spec):
  rd = node.params["dimensions"]
  shape = node.outs[0].shape
  for d, b in spec:
    if d in rd and shape[d] % b:
      raise Block("`rev` misaligns the normalized groups")
  return [Need(0, spec, transparent=True)]


def _slice_facts(node, ins, ctx):
  return [Facts(ins[0].const | size_one(node.outs[0].shape), ins[0].value, ins[0].random)]


_ONE_BLOCK = ("one block",)


def _one_block(dims, make):
  """``make(dims)`` where ``dims`` marks dims that now lie inside one block of
  a varying ``c``: constant there, but *which* block's value it is is lost, so
  the result gets a symbol of its own (rows 0 and 1 of a row-varying shift,
  sliced or broadcast alike, must not cancel)."""
  if _ONE_BLOCK not in dims:
    return make(dims)
  r = make(tuple(None if e == _ONE_BLOCK else e for e in dims))
  return r if r is None else A.Poly(A.fresh_symbol(), r.dims, r.coeffs)


def _slice_dims(p, starts, steps, in_shape, out_shape):
  dims = []
  for d, e in enumerate(p.dims):
    if e is None or (starts[d] == 0 and steps[d] == 1 and out_shape[d] == in_shape[d]):
      dims.append(e)
    elif starts[d] % e[1] == 0 and steps[d] == 1 and out_shape[d] <= e[1]:
      dims.append(_ONE_BLOCK)  # inside one block: c is constant on it
    else:
      dims.append(_moved_dim(e, starts[d] % e[1] == 0 and steps[d] == 1))
  return tuple(dims)


def _slice_shift(node, ins, ctx):
  p = ins[0]
  starts = node.params["start_indices"]
  limits = node.params["limit_indices"]
  steps = node.params["strides"] or (1,) * len(starts)
  in_shape, out_shape = node.ins[0].shape, node.outs[0].shape
  dims = _slice_dims(p, starts, steps, in_shape, out_shape)
  return [_one_block(dims, lambda ds: _view_coeffs(
      p, out_shape, lambda v: v.slice(starts, limits, steps), node.tag(), ds))]


def _slice_zero_sum(node, k, spec, ctx):
  in_shape, out_shape = node.ins[0].shape, node.outs[0].shape
  if all(D.same(in_shape[d], out_shape[d]) for d, _ in spec):
    return [Need(0, spec, transparent=True)]
  # A slice starting on a block boundary keeps whole blocks: it is zero-sum
  # when every aligned block of its source is.
  starts = node.params["start_indices"]
  steps = node.params["strides"] or (1,) * len(starts)
  for d, b in spec:
    if not D.same(in_shape[d], out_shape[d]) and (
        steps[d] != 1 or not isinstance(b, int) or starts[d] % b):
      raise Block("a slice along the normalized axes that does not start on a block boundary")
  return [Need(0, spec)]


register(Rule("slice", (lax.slice_p,), facts=_slice_facts,
              canon=_canon_view(lambda n: (lambda v: v.slice(n.params["start_indices"],
                                                             n.params["limit_indices"],
                                                             n.params["strides"]))),
              shift=_slice_shift, zero_sum=_slice_zero_sum, simplify=_only_operand_zero,
              variants=("other axis", "aligned", "misaligned"), reindex="move"))


def _dslice_shift(node, ins, ctx):
  _no_shift_in(ins, 1, "dynamic slice indices")
  p = ins[0]
  in_shape, out_shape = node.ins[0].shape, node.outs[0].shape
  cut = [d for d in range(len(in_shape)) if not D.same(in_shape[d], out_shape[d])]
  dims = tuple(_moved_dim(e, False) if d in cut else e for d, e in enumerate(p.dims))
  idx = [ctx.canon(a) for a in node.ins[1:]]
  tag = node.tag()

  def coeff(c):
    if c.is_const:
      return c
    return A.app(("dynamic_slice", tag), [c] + idx, out_shape, False)
  return [A.poly_map(p, coeff, dims)]


def _dslice_canon(node, ins, ctx):
  return [A.app(("dynamic_slice", node.tag()), ins, node.outs[0].shape, False)]


def _copies_of(v, dim: int):
  """``u`` when ``v`` is ``concatenate([u, u, ...], dim)`` (two or more copies)."""
  node = getattr(v, "producer", None)
  if node is None or node.prim is not lax.concatenate_p or node.params["dimension"] != dim:
    return None
  u = node.ins[0]
  return u if len(node.ins) > 1 and all(a is u for a in node.ins) else None


def _dslice_zero_sum(node, k, spec, ctx):
  in_shape, out_shape = node.ins[0].shape, node.outs[0].shape
  cut = [d for d, _ in spec if not D.same(in_shape[d], out_shape[d])]
  if not cut:
    return [Need(0, spec, transparent=True)]
  # A window of one copy's length over copies of one value (``jnp.roll`` by a
  # traced shift: the start is clamped into the copies) is a cyclic rotation
  # of that value along the axis, which keeps its sums over all of it.
  d = cut[0]
  u = _copies_of(node.ins[0], d) if len(cut) == 1 else None
  if u is not None and u.shape[d] == out_shape[d] == dict(spec)[d]:
    return [Need(0, spec, source=u)]
  raise Block("a dynamic slice along the normalized axes (where its window falls is known only at "
              "run time)")


register(Rule("dynamic_slice", (lax.dynamic_slice_p,), facts=_slice_facts, canon=_dslice_canon,
              shift=_dslice_shift, zero_sum=_dslice_zero_sum, simplify=_only_operand_zero,
              variants=("other axis", "normalized axis", "two indices", "cyclic window")))


def _split_facts(node, ins, ctx):
  return [Facts(ins[0].const | size_one(o.shape), ins[0].value, ins[0].random) for o in node.outs]


def _split_ranges(node):
  axis = node.params["axis"]
  start = 0
  for o in node.outs:
    n = o.shape[axis]
    yield axis, start, start + n
    start += n


def _split_canon(node, ins, ctx):
  out = []
  in_shape = node.ins[0].shape
  for (axis, lo, hi), o in zip(_split_ranges(node), node.outs):
    starts = [0] * len(in_shape)
    limits = list(in_shape)
    starts[axis], limits[axis] = lo, hi
    out.append(A.view_op(ins[0], o.shape, lambda v, s=tuple(starts), l=tuple(limits): v.slice(s, l),
                         ("slice", tuple(starts), tuple(limits))))
  return out


def _split_shift(node, ins, ctx):
  p = ins[0]
  in_shape = node.ins[0].shape
  out = []
  for (axis, lo, hi), o in zip(_split_ranges(node), node.outs):
    starts = [0] * len(in_shape)
    limits = list(in_shape)
    starts[axis], limits[axis] = lo, hi
    steps = (1,) * len(in_shape)
    dims = _slice_dims(p, starts, steps, in_shape, o.shape)
    out.append(_one_block(dims, lambda ds, o=o, s=tuple(starts), l=tuple(limits): _view_coeffs(
        p, o.shape, lambda v: v.slice(s, l), ("slice", s, l), ds)))
  return out


def _split_zero_sum(node, k, spec, ctx):
  axis = node.params["axis"]
  if any(d == axis for d, _ in spec):
    raise Block("a split along the normalized axes")
  return [Need(0, spec, transparent=True)]


register(Rule("split", _prims("split_p"), facts=_split_facts, canon=_split_canon,
              shift=_split_shift, zero_sum=_split_zero_sum, simplify=_only_operand_zero))


def _tile_facts(node, ins, ctx):
  reps = node.params["reps"]
  out_shape = node.outs[0].shape
  const = {d for d in ins[0].const if reps[d] == 1 or node.ins[0].shape[d] == 1}
  return [Facts(frozenset(const) | size_one(out_shape), ins[0].value, ins[0].random)]


def _tile_shift(node, ins, ctx):
  p = ins[0]
  reps = node.params["reps"]
  out_shape = node.outs[0].shape
  in_shape = node.ins[0].shape
  dims = tuple(_moved_dim(e, False) if (reps[d] != 1 and in_shape[d] != 1) else e
               for d, e in enumerate(p.dims))
  if dims != p.dims and not p.is_pure:
    raise Block("a nonlinear function of the shift is tiled along an axis it varies along")
  tag = node.tag()
  return [A.poly_map(p, lambda c: c if c.is_const else A.app(tag, [c], out_shape, False), dims)]


def _tile_zero_sum(node, k, spec, ctx):
  reps = node.params["reps"]
  in_shape = node.ins[0].shape
  res = {}
  for d, b in spec:
    if reps[d] != 1 and b != node.outs[0].shape[d]:
      raise Block("`tile` repeats part of a normalized group")
    res[d] = in_shape[d] if reps[d] != 1 else b
  return [Need(0, freeze(res), transparent=True)]


register(Rule("tile", _prims("tile_p"), facts=_tile_facts,
              canon=lambda node, ins, ctx: [A.app(node.tag(), ins, node.outs[0].shape, False)],
              shift=_tile_shift, zero_sum=_tile_zero_sum, simplify=_only_operand_zero))


# ----------------------------------------------------------------------------
# concatenate, pad, dynamic_update_slice.


def _piecewise_pure(polys, const_dims, out_shape) -> A.Poly:
  """A fresh pure shift for a piecewise assembly of pure shifts (and
  unshifted pieces): constant along a dim only where every piece is and the
  assembly does not switch between pieces along it."""
  dims = []
  for d in range(len(out_shape)):
    es = [p.dims[d] for p in polys]
    if d in const_dims and all(e is None for e in es):
      dims.append(None)
    elif d in const_dims:
      dims.append((None, math.gcd(*[e[1] for e in es if e is not None])))
    else:
      dims.append((None, 1))
  return A.pure(tuple(dims))


def _all_same(polys) -> bool:
  return all(p.same_symbol(polys[0]) and p.is_pure and p.coeffs == polys[0].coeffs for p in polys)


def _concat_shift(node, ins, ctx):
  dim = node.params["dimension"]
  out_shape = node.outs[0].shape
  live = [p for p in ins if p is not None]
  if len(live) == len(ins) and _all_same(live) and live[0].dims[dim] is None:
    return [live[0]]
  if not all(p.is_pure for p in live):
    raise Block("a nonlinear function of the shift is concatenated")
  keep = frozenset(range(len(out_shape))) - {dim}
  out = _piecewise_pure(live, keep, out_shape)
  # Along the concatenation, the result is constant on aligned blocks that
  # divide every piece and every piece's own block.
  sizes = [a.shape[dim] for a in node.ins]
  blocks = [p.dims[dim][1] if p is not None and p.dims[dim] is not None else n
            for p, n in zip(ins, sizes)]
  if all(isinstance(n, int) for n in sizes):
    b = math.gcd(*sizes, *blocks)
    if b > 1:
      dims = list(out.dims)
      dims[dim] = (None, b)
      out = A.pure(tuple(dims))
  return [out]


def _permuted_source(node, dim: int):
  """The value whose pieces ``node`` concatenates in another order, if its
  operands are unit-stride slices of one value, whole along every other dim,
  that tile ``dim`` exactly (``jnp.roll``, a swap of halves): a permutation
  along ``dim``, so sums over all of ``dim`` are unchanged."""
  src, spans = None, []
  for a in node.ins:
    prod = getattr(a, "producer", None)
    if prod is None or prod.prim is not lax.slice_p:
      return None
    s = prod.ins[0]
    if src is None:
      src = s
    elif s is not src:
      return None
    start, limit = prod.params["start_indices"], prod.params["limit_indices"]
    strides = prod.params["strides"] or (1,) * len(start)
    if strides[dim] != 1 or any(d != dim and (start[d] != 0 or limit[d] != n or strides[d] != 1)
                                for d, n in enumerate(s.shape)):
      return None
    spans.append((start[dim], limit[dim]))
  spans.sort()
  end = 0
  for lo, hi in spans:
    if lo != end:
      return None
    end = hi
  return src if end == src.shape[dim] == node.outs[0].shape[dim] else None


def _concat_zero_sum(node, k, spec, ctx):
  dim = node.params["dimension"]
  block = dict(spec).get(dim)
  if block == node.outs[0].shape[dim] and len(node.ins) > 1:
    src = _permuted_source(node, dim)
    if src is not None:
      return [Need(0, spec, source=src)]
  if block is not None and not all(a.shape[dim] % block == 0 for a in node.ins):
    # Pieces that are whole groups keep each group inside one operand.
    raise Block("a concatenation along the normalized axes whose pieces are not whole groups")
  return [Need(i, spec, transparent=block is None) for i, a in enumerate(node.ins)
          if not ctx.is_zero(a)]


def _concat_facts(node, ins, ctx):
  dim = node.params["dimension"]
  const = frozenset.intersection(*[f.const for f in ins]) - {dim}
  vals = [f.value for f in ins]
  value = vals[0] if all(v is not None and v == vals[0] for v in vals) else None
  return [Facts(const | size_one(node.outs[0].shape), value, any(f.random for f in ins))]


register(Rule("concatenate", (lax.concatenate_p,), facts=_concat_facts,
              canon=lambda node, ins, ctx: [A.app(node.tag(), ins, node.outs[0].shape, False)],
              shift=_concat_shift, zero_sum=_concat_zero_sum,
              simplify=_all_data_zero(10**9),
              variants=("other axis", "normalized axis", "permutation of one value")))


def _padded_dims(node) -> set:
  return {d for d, (lo, hi, it) in enumerate(node.params["padding_config"])
          if lo > 0 or hi > 0 or it > 0}


def _pad_shift(node, ins, ctx):
  if ins[1] is not None:
    raise Block("the shift reaches a padding value")
  p = ins[0]
  cfg = node.params["padding_config"]
  if all(tuple(c) == (0, 0, 0) for c in cfg):
    return [p]
  if not p.is_pure:
    raise Block("a nonlinear function of the shift is padded")
  padded = _padded_dims(node)
  dims = []
  for d, (e, (lo, hi, _)) in enumerate(zip(p.dims, cfg)):
    if d in padded:
      dims.append((None, 1))        # padded elements carry no shift
    elif lo or hi:
      dims.append(None if e is None else (None, e[1] if (-lo) % e[1] == 0 else 1))
    else:
      dims.append(None if e is None else (None, e[1]))
  return [A.pure(tuple(dims))]


def _pad_zero_sum(node, k, spec, ctx):
  cfg = node.params["padding_config"]
  out_shape = node.outs[0].shape
  any_padding = bool(_padded_dims(node))
  if any_padding and not ctx.is_zero(node.ins[1]):
    raise Block("padding with a non-zero value adds elements that do not sum to zero")
  res = {}
  for d, b in spec:
    lo, hi, it = cfg[d]
    if (lo, hi, it) == (0, 0, 0):
      res[d] = b
    elif lo >= 0 and hi >= 0 and b == out_shape[d]:
      res[d] = node.ins[0].shape[d]   # zeros added to a whole normalized dim
    else:
      raise Block("padding or cropping along the normalized axes")
  return [Need(0, freeze(res))]


def _pad_facts(node, ins, ctx):
  padded = _padded_dims(node)
  same = ins[0].value is not None and ins[0].value == ins[1].value
  const = {d for d in ins[0].const if d not in padded or same}
  return [Facts(frozenset(const) | size_one(node.outs[0].shape),
                ins[0].value if (same or not padded) else None, ins[0].random or ins[1].random)]


register(Rule("pad", (lax.pad_p,), facts=_pad_facts,
              canon=lambda node, ins, ctx: [A.app(node.tag(), ins, node.outs[0].shape, False)],
              shift=_pad_shift, zero_sum=_pad_zero_sum,
              simplify=lambda node, zeros: (lambda ins: [ctx_zero(node.outs[0])]) if zeros[0] and zeros[1] else None,
              variants=("other axis", "normalized axis", "cropping", "interior",
                        "non-zero value")))


def _dus_covered(node) -> list:
  upd, out_shape = node.ins[1].shape, node.outs[0].shape
  return [D.same(upd[d], out_shape[d]) for d in range(len(out_shape))]


def _dus_shift(node, ins, ctx):
  _no_shift_in(ins, 2, "update indices")
  covered = _dus_covered(node)
  out_shape = node.outs[0].shape
  live = [p for p in ins[:2] if p is not None]
  partial = {d for d, c in enumerate(covered) if not c}
  if (len(live) == 2 and _all_same(live) and all(live[0].dims[d] is None for d in partial)):
    return [live[0]]
  if not all(p.is_pure for p in live):
    raise Block("a nonlinear function of the shift reaches `dynamic_update_slice`")
  keep = frozenset(range(len(out_shape))) - partial
  return [_piecewise_pure(live, keep, out_shape)]


def _dus_zero_sum(node, k, spec, ctx):
  covered = _dus_covered(node)
  if not all(covered[d] for d, _ in spec):
    raise Block("an update of part of the normalized axes")
  return [Need(i, spec) for i in (0, 1) if not ctx.is_zero(node.ins[i])]


def _dus_facts(node, ins, ctx):
  """Constant along a dim where operand and update both are and the update spans it whole:
  along a dim it covers in part, positions mix the two (ones written over half of a zeros
  vector are not constant), unless both are the same known scalar."""
  a, u = ins[0], ins[1]
  out_shape = node.outs[0].shape
  random = a.random or u.random
  if a.value is not None and a.value == u.value:
    return [Facts(frozenset(range(len(out_shape))), a.value, random)]
  covered = _dus_covered(node)
  const = frozenset(d for d in a.const & u.const if covered[d])
  return [Facts(const | size_one(out_shape), None, random)]


register(Rule("dynamic_update_slice", (lax.dynamic_update_slice_p,), facts=_dus_facts,
              canon=lambda node, ins, ctx: [A.app(node.tag(), ins, node.outs[0].shape, False)],
              shift=_dus_shift, zero_sum=_dus_zero_sum, simplify=_all_data_zero(2)))


# ----------------------------------------------------------------------------
# gather.


def _gather_dims(node) -> D.GatherDims:
  return D.GatherDims(node.params, node.ins[0].shape, node.outs[0].shape)


def _gather_facts(node, ins, ctx):
  g = _gather_dims(node)
  const = set(size_one(node.outs[0].shape))
  for od, d in g.offset.items():
    if d in ins[0].const:
      const.add(od)
  if all(d in ins[0].const for d in g.indexed) and not g.may_fill:
    const.update(g.batch_out)
  return [Facts(frozenset(const), None if g.may_fill else ins[0].value,
                ins[0].random or ins[1].random)]


def _gather_shift(node, ins, ctx):
  if ins[1] is not None:
    raise Block("the shift reaches gather indices")
  p = ins[0]
  if not p.is_pure:
    raise Block("a nonlinear function of the shift is gathered")
  g = _gather_dims(node)
  out_shape = node.outs[0].shape
  dims = [(None, 1)] * len(out_shape)
  for od, d in g.offset.items():
    e = p.dims[d]
    if e is None:
      dims[od] = None
    elif g.full(d) and d not in g.indexed:
      dims[od] = (None, e[1])
  # Which window is read does not matter when c is constant along every
  # indexed dim, unless an out-of-bounds window reads the fill value.
  if all(p.dims[d] is None for d in g.indexed) and not g.may_fill:
    for od in g.batch_out:
      dims[od] = None
  return [A.pure(tuple(dims))]


def _gather_zero_sum(node, k, spec, ctx):
  g = _gather_dims(node)
  res = {}
  for d, b in spec:
    if d not in g.offset:
      raise Block("a gather that indexes along the normalized axes")
    od = g.offset[d]
    if not g.full(od):
      raise Block("a gather that slices part of the normalized axes")
    res[od] = b
  if g.may_fill and not g.fill_is_harmless():
    raise Block(f"a gather whose out-of-bounds windows read the fill value {g.fill!r}, "
                "which does not sum to zero")
  return [Need(0, freeze(res))]


def _static_window(node, ctx) -> Optional[tuple]:
  """``(starts, limits)`` when the gather reads one window at a known start
  (``x[:, 0]`` at symbolic shapes, which jnp writes as a gather, not a slice):
  one index vector (no batch dims) that is one known integer everywhere, the
  window inside the operand (so clip, fill and promise modes all read it
  alone), its indexed dims collapsed or kept in place. Else None."""
  g = _gather_dims(node)
  dn = node.params["dimension_numbers"]
  idx, in_shape, out_shape = node.ins[1], node.ins[0].shape, node.outs[0].shape
  k = ctx.facts(idx).value
  if (k is None or k.denominator != 1 or tuple(idx.shape) != (len(dn.start_index_map),)
      or getattr(dn, "operand_batching_dims", ()) or tuple(dn.offset_dims) != tuple(range(len(out_shape)))
      or len(g.offset) != len(out_shape) or any(g.sizes[d] != 1 for d in dn.collapsed_slice_dims)):
    return None
  starts, limits = [0] * len(in_shape), list(g.sizes)
  for d in dn.start_index_map:
    n, size = in_shape[d], g.sizes[d]
    if not (isinstance(size, int) and 0 <= k.numerator and A.provably_le(k.numerator + size, n)):
      return None
    starts[d], limits[d] = k.numerator, k.numerator + size
  return tuple(starts), tuple(limits)


def _gather_canon(node, ins, ctx):
  window = _static_window(node, ctx)
  out_shape = node.outs[0].shape
  if window is None:
    return [A.app(node.tag(), ins, out_shape, False)]
  starts, limits = window

  def op(v):
    w = v.slice(starts, limits)
    return w.reshape(out_shape)   # the collapsed size-1 dims dropped
  return [A.view_op(ins[0], out_shape, op, ("gather window", starts, limits))]


register(Rule("gather", (lax.gather_p,), facts=_gather_facts, canon=_gather_canon,
              shift=_gather_shift, zero_sum=_gather_zero_sum, simplify=_only_operand_zero,
              variants=("embedding lookup", "fill mode", "clip mode")))


# ----------------------------------------------------------------------------
# iota: constant along every dim but its own.


def _iota_facts(node, ins, ctx):
  shape = node.outs[0].shape
  d = node.params["dimension"]
  return [Facts(frozenset(i for i in range(len(shape)) if i != d) | size_one(shape), None, False)]


register(Rule("iota", _prims("iota_p"), facts=_iota_facts,
              canon=lambda node, ins, ctx: [A.app(node.tag(), (), node.outs[0].shape, False)]))


# ----------------------------------------------------------------------------
# Order statistics along one axis: sort and top_k permute (or select) values
# within each slice, so a shift constant along that axis rides along exactly.


def _sorted_axis(node) -> int:
  if node.prim is lax.sort_p:
    return node.params["dimension"]
  return node.params.get("axis", len(node.ins[0].shape) - 1)


def _order_shift(node, ins, ctx):
  """``sort(x + k*c) = sort(x) + k*c`` and ``top_k(x + k*c) = (top_k(x) + k*c,
  same indices)`` when ``c`` is constant along the axis and ``k`` a constant."""
  if len(node.ins) != 1:
    raise Block(f"the shift reaches a multi-operand `{node.prim.name}` (keys sorting payloads)")
  p, axis = ins[0], _sorted_axis(node)
  if not p.is_pure or p.dims[axis] is not None:
    raise Block(f"the shift varies along the axis `{node.prim.name}` orders ({axis}), so it "
                "changes the order")
  return [p] + [None] * (len(node.outs) - 1)


def _order_facts(node, ins, ctx):
  if len(node.ins) != 1:
    return [Facts(size_one(v.shape), None, any(f.random for f in ins)) for v in node.outs]
  values = Facts(ins[0].const, ins[0].value, ins[0].random)
  return [values] + [Facts(size_one(v.shape), None, ins[0].random) for v in node.outs[1:]]


def _sort_zero_sum(node, k, spec, ctx):
  axis = node.params["dimension"]
  if len(node.ins) != 1 or dict(spec).get(axis) != node.ins[0].shape[axis]:
    raise Block("`sort` keeps a sum only over the whole sorted axis")
  return [Need(0, spec)]


register(Rule("sort", (lax.sort_p,), facts=_order_facts, shift=_order_shift,
              zero_sum=_sort_zero_sum, variants=("along a constant-shift axis", "along the shift")))
register(Rule("top_k", (lax.top_k_p,), facts=_order_facts, shift=_order_shift,
              variants=("values", "indices")))


# ----------------------------------------------------------------------------
# scatter-add: out = operand + S(updates), linear in both. S sums update
# windows into operand positions; along a window dim that spans the whole
# operand dim the window maps index for index (a full window can only start at
# 0: out-of-bounds ones are dropped or clamped), along any other dim it lands
# wherever the indices say.


def _full_windows(node) -> dict:
  """{operand dim: updates dim} for the window dims spanning a whole operand dim."""
  dn = node.params["dimension_numbers"]
  op_shape, up_shape = node.ins[0].shape, node.ins[2].shape
  excluded = set(dn.inserted_window_dims) | set(getattr(dn, "operand_batching_dims", ()))
  op_window = [d for d in range(len(op_shape)) if d not in excluded]
  return {od: ud for od, ud in zip(op_window, dn.update_window_dims) if up_shape[ud] == op_shape[od]}


def _scatter_add_shift(node, ins, ctx):
  operand, idx, updates = ins
  if idx is not None:
    raise Block("the shift reaches the indices of a `scatter-add`")
  if getattr(node.params["dimension_numbers"], "operand_batching_dims", ()):
    raise Block("the shift reaches a batched `scatter-add`")
  if any(p is not None and not p.is_pure for p in (operand, updates)):
    raise Block("a nonlinear function of the shift reaches a `scatter-add`")
  if updates is None:
    return [operand]          # (x + c) + S(u): the operand's shift, unchanged
  full, rank = _full_windows(node), len(node.outs[0].shape)
  # S(c): constant along a full window where c is, anything elsewhere.
  dims = [None if d in full and updates.dims[full[d]] is None else (None, 1) for d in range(rank)]
  if operand is not None:     # two shifts: a fresh one varying where either does
    dims = [None if e is None and o is None else (None, 1) for e, o in zip(dims, operand.dims)]
  return [A.pure(tuple(dims))]


def _scatter_add_zero_sum(node, k, spec, ctx):
  full = _full_windows(node)
  if getattr(node.params["dimension_numbers"], "operand_batching_dims", ()) or any(
      d not in full for d, _ in spec):
    raise Block("`scatter-add` moves values along the normalized axes")
  return [Need(0, spec), Need(2, freeze({full[d]: b for d, b in spec}))]


register(Rule("scatter-add", (lax.scatter_add_p,), facts=lambda node, ins, ctx: [
    Facts(size_one(node.outs[0].shape), None, any(f.random for f in ins))],
    shift=_scatter_add_shift, zero_sum=_scatter_add_zero_sum,
    variants=("rows along tokens", "into features")))
