"""Dimension bookkeeping shared by the facets: reshape groups, and the
operand/output dim maps of dot_general, conv_general_dilated and gather.

Two per-dim facts travel through these maps: a shift's *dims* (forwards:
``None`` or ``(label, block)``) and a zero-sum *spec* (backwards:
``{dim: block}``). Whatever cannot be mapped exactly returns None and the
caller blocks.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from jaxfold._src import algebra as A


def _big(s) -> bool:
  """Size > 1; a symbolic dim counts as a real axis."""
  return s > 1 if isinstance(s, int) else True


def same(a, b) -> bool:
  try:
    return bool(a == b)
  except Exception:  # undecidable symbolic comparison
    return False


def reshape_groups(in_shape: Sequence, out_shape: Sequence) -> Optional[list]:
  """Pairs (input dims, output dims) that a row-major reshape maps together."""
  try:
    return _groups(list(in_shape), list(out_shape))
  except Exception:  # symbolic dims whose products cannot be compared
    return None


def _groups(in_shape, out_shape):
  out, i, j = [], 0, 0
  n, m = len(in_shape), len(out_shape)
  while i < n or j < m:
    if (i < n and j < m and not isinstance(in_shape[i], int)
        and same(in_shape[i], out_shape[j])):
      out.append(([i], [j]))  # a symbolic dim carried through unchanged
      i += 1
      j += 1
      continue
    gi, gj, pi, pj = [], [], 1, 1
    if i < n:
      gi.append(i); pi *= in_shape[i]; i += 1
    if j < m:
      gj.append(j); pj *= out_shape[j]; j += 1
    while not same(pi, pj):
      if pi < pj and i < n:
        gi.append(i); pi *= in_shape[i]; i += 1
      elif j < m:
        gj.append(j); pj *= out_shape[j]; j += 1
      else:
        return None
    while i < n and same(in_shape[i], 1) and (j >= m or not same(out_shape[j], 1)):
      gi.append(i); i += 1
    while j < m and same(out_shape[j], 1) and (i >= n or not same(in_shape[i], 1)):
      gj.append(j); j += 1
    out.append((gi, gj))
  return out


# ----------------------------------------------------------------------------
# Reshape: shift dims forwards.


def reshape_dims(dims: tuple, in_shape: Sequence, out_shape: Sequence) -> Optional[tuple]:
  """Maps a shift's dims forwards through a row-major reshape.

  Labels are derived from the input labels, blocks and sizes only, so two
  values reshaped alike carry equal labels exactly when their ``c`` agree.
  """
  gs = reshape_groups(in_shape, out_shape)
  if gs is None:
    return None
  out = [None] * len(out_shape)
  for gi, gj in gs:
    varying = [i for i in gi if dims[i] is not None]
    if not varying:
      continue
    sizes = [out_shape[o] for o in gj]
    big_out = [k for k, s in enumerate(sizes) if _big(s)]
    if not all(isinstance(in_shape[i], int) for i in gi) or not all(
        isinstance(s, int) for s in sizes):
      if gi == [varying[0]] and len(gj) == 1:
        out[gj[0]] = dims[varying[0]]  # an unchanged (symbolic) dim
        continue
      return None
    last = gi.index(varying[-1])
    inner = math.prod(in_shape[i] for i in gi[last + 1:])
    # A big constant dim outside the varying ones makes c periodic: not blocks.
    if any(dims[i] is None and _big(in_shape[i]) for i in gi[:last]):
      return None
    if len(varying) > 1:
      if len(big_out) != 1:
        return None
      parts = tuple((dims[i][0], dims[i][1], in_shape[i]) for i in varying)
      label = _merged_label(parts)
      out[gj[big_out[0]]] = (label, dims[varying[-1]][1] * inner)
      continue
    label, block = dims[varying[0]]
    block *= inner                       # the flat group is constant on runs of this size
    if not big_out:
      # All size 1: the label says *which* element of c this is (x[0:1] and
      # x[1:2] reshaped alike differ), so it is kept, never dropped.
      if not gj:
        return None
      out[gj[0]] = dims[varying[0]]
      continue
    first = big_out[0]
    rest = math.prod(sizes[first + 1:])
    if block == 1 and rest > 1:
      # One varying axis split into several, each a derived index map.
      sizes_t = tuple(sizes[k] for k in big_out)
      for k, o in enumerate(big_out):
        out[gj[o]] = (("split", label, k, sizes_t), 1)
      continue
    if block % rest or sizes[first] % (block // rest):
      return None
    out[gj[first]] = (label, block // rest)
  return tuple(out)


def _merged_label(parts: tuple):
  """Merging the pieces of an earlier split restores the original label."""
  labels = [p[0] for p in parts]
  if all(isinstance(l, tuple) and l[:1] == ("split",) for l in labels) and all(
      p[1] == 1 for p in parts):
    base = labels[0][1]
    sizes = labels[0][3]
    if all(l[1] == base and l[2] == k and l[3] == sizes for k, l in enumerate(labels)) and len(
        labels) == len(sizes):
      return base
  return ("merge", parts)


# ----------------------------------------------------------------------------
# Reshape: zero-sum specs backwards.


def _block_to_dims(sizes: Sequence[int], block: int) -> Optional[dict]:
  """A contiguous block of a flattened group as per-dim blocks."""
  spec, rest = {}, block
  for d in reversed(range(len(sizes))):
    if rest == 1:
      break
    s = sizes[d]
    if rest >= s:
      if rest % s:
        return None
      if s > 1:
        spec[d] = s
      rest //= s
    else:
      if s % rest:
        return None
      spec[d] = rest
      rest = 1
  return spec if rest == 1 else None


def _dims_to_block(sizes: Sequence[int], spec: dict) -> Optional[int]:
  """Per-dim blocks as one contiguous block of the flattened group."""
  block, full = 1, True
  for d in reversed(range(len(sizes))):
    b = spec.get(d)
    if b is None:
      if sizes[d] == 1:
        continue
      full = False
      continue
    if not full:
      return None
    block *= b
    full = b == sizes[d]
  return block


def reshape_spec_back(spec: dict, in_shape: Sequence, out_shape: Sequence) -> Optional[dict]:
  gs = reshape_groups(in_shape, out_shape)
  if gs is None:
    return None
  res: dict = {}
  try:
    for gi, gj in gs:
      sub = {k: spec[o] for k, o in enumerate(gj) if o in spec}
      if not sub:
        continue
      block = _dims_to_block([out_shape[o] for o in gj], sub)
      if block is None:
        return None
      dims = _block_to_dims([in_shape[i] for i in gi], block)
      if dims is None:
        return None
      res.update({gi[k]: b for k, b in dims.items()})
  except TypeError:  # symbolic sizes in a normalized group
    return None
  return res


# ----------------------------------------------------------------------------
# dot_general.


class DotDims:
  """Output dims of ``dot_general``: batch, then lhs free, then rhs free."""

  def __init__(self, params: dict, lhs_shape: Sequence, rhs_shape: Sequence):
    self.numbers = params["dimension_numbers"]
    (self.lc, self.rc), (self.lb, self.rb) = self.numbers
    self.free = (
        [d for d in range(len(lhs_shape)) if d not in self.lc and d not in self.lb],
        [d for d in range(len(rhs_shape)) if d not in self.rc and d not in self.rb])
    nb = len(self.lb)
    self.owner = {}                      # out dim -> (side, operand dim) for free dims
    for i, d in enumerate(self.free[0]):
      self.owner[nb + i] = (0, d)
    for i, d in enumerate(self.free[1]):
      self.owner[nb + len(self.free[0]) + i] = (1, d)
    self.batch = {i: (self.lb[i], self.rb[i]) for i in range(nb)}
    self.rank = nb + len(self.free[0]) + len(self.free[1])

  def contracting(self, side: int) -> tuple:
    return tuple(self.lc if side == 0 else self.rc)


# ----------------------------------------------------------------------------
# conv_general_dilated.


class ConvDims:
  def __init__(self, params: dict):
    dn = params["dimension_numbers"]
    self.out_channel = dn.out_spec[1]
    self.out_batch = dn.out_spec[0]
    self.kernel_out = dn.rhs_spec[0]
    self.lhs_batch = dn.lhs_spec[0]
    self.groups = params["feature_group_count"]
    self.batch_groups = params.get("batch_group_count", 1)


# ----------------------------------------------------------------------------
# gather.


class GatherDims:
  """Which output dims are slices of which operand dims."""

  def __init__(self, params: dict, operand_shape: Sequence, out_shape: Sequence):
    dn = params["dimension_numbers"]
    self.sizes = tuple(params["slice_sizes"])
    self.operand_shape = tuple(operand_shape)
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    self.indexed = frozenset(dn.start_index_map) | frozenset(dn.collapsed_slice_dims) | frozenset(
        batching)
    kept = [d for d in range(len(operand_shape))
            if d not in dn.collapsed_slice_dims and d not in batching]
    self.offset = dict(zip(dn.offset_dims, kept))   # out dim -> operand dim
    self.batch_out = [d for d in range(len(out_shape)) if d not in self.offset]
    self.mode = params.get("mode")
    self.fill = params.get("fill_value")

  def full(self, d: int) -> bool:
    """The slice spans operand dim ``d`` entirely (its start is then 0)."""
    return same(self.sizes[d], self.operand_shape[d])

  @property
  def may_fill(self) -> bool:
    """Out-of-bounds windows read the fill value instead of the operand."""
    return "FILL_OR_DROP" in str(self.mode)

  def fill_is_harmless(self) -> bool:
    """A dropped window of zeros (or NaN, NaN in both programs) is zero-sum."""
    f = self.fill
    if f is None:
      return True  # NaN for floats, the gather's documented default
    k = A.exact(f)
    return k == 0 or (k is None and f != f)
