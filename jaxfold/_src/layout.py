"""How dimensions map through layout operations.

Two kinds of per-dimension facts travel through reshapes, transposes and
broadcasts: a shift's *embedding* (forwards) and a zero-sum *spec* (backwards,
from a normalization towards the parameters). A spec is ``{dim: block}``: the
value sums to zero over each joint block made of ``block`` consecutive
elements of every listed dimension. Anything that cannot be mapped exactly
returns None, and the caller refuses to fold.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

Spec = dict  # {dim: block}


def groups(in_shape: Sequence[int], out_shape: Sequence[int]):
  """Pairs of (input dims, output dims) that a row-major reshape maps together."""
  out, i, j = [], 0, 0
  n, m = len(in_shape), len(out_shape)
  while i < n or j < m:
    gi, gj = [], []
    pi = pj = 1
    if i < n and j < m and not isinstance(in_shape[i], int) and _same_dim(in_shape[i], out_shape[j]):
      # A symbolic dim carried through unchanged (e.g. jax.export's batch).
      out.append(([i], [j]))
      i += 1
      j += 1
      continue
    if i < n:
      gi.append(i); pi *= in_shape[i]; i += 1
    if j < m:
      gj.append(j); pj *= out_shape[j]; j += 1
    while pi != pj:
      if pi < pj and i < n:
        gi.append(i); pi *= in_shape[i]; i += 1
      elif j < m:
        gj.append(j); pj *= out_shape[j]; j += 1
      else:
        return None
    # Trailing size-1 dims join the current group.
    while i < n and in_shape[i] == 1 and (j >= m or out_shape[j] != 1):
      gi.append(i); i += 1
    while j < m and out_shape[j] == 1 and (i >= n or in_shape[i] != 1):
      gj.append(j); j += 1
    out.append((gi, gj))
  return out


def _big(s) -> bool:
  """Size > 1; a symbolic dim counts as a real axis (varying along size 1 is harmless)."""
  return s > 1 if isinstance(s, int) else True


def _same_dim(a, b) -> bool:
  try:
    return bool(a == b)
  except Exception:
    return False


def _block_to_dims(sizes: Sequence[int], block: int) -> Optional[dict]:
  """Expresses a contiguous block of a flattened group as per-dim blocks."""
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
  """Inverse of _block_to_dims: the block must be an inner contiguous run."""
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


def reshape_spec_back(spec: Spec, in_shape, out_shape) -> Optional[Spec]:
  try:
    return _reshape_spec_back(spec, in_shape, out_shape)
  except Exception:  # symbolic dims whose order is unknown: fail closed
    return None


def _reshape_spec_back(spec: Spec, in_shape, out_shape) -> Optional[Spec]:
  gs = groups(in_shape, out_shape)
  if gs is None:
    return None
  res: Spec = {}
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
  return res


def reshape_emb(emb: tuple, in_shape, out_shape) -> Optional[tuple]:
  try:
    return _reshape_emb(emb, in_shape, out_shape)
  except Exception:  # symbolic dims whose order is unknown: fail closed
    return None


def _reshape_emb(emb: tuple, in_shape, out_shape) -> Optional[tuple]:
  """Maps a shift embedding forwards through a reshape."""
  gs = groups(in_shape, out_shape)
  if gs is None:
    return None
  out = [None] * len(out_shape)
  for gi, gj in gs:
    varying = [i for i in gi if emb[i] is not None]
    if not varying:
      continue
    sizes = [out_shape[o] for o in gj]
    big_out = [k for k, s in enumerate(sizes) if _big(s)]
    big_in = [i for i in gi if _big(in_shape[i])]
    if len(big_out) == 1 and len(big_in) > 1:
      # A merge: the merged axis varies like the tuple of the merged homes,
      # in blocks spanning the constant axes inside the last varying one.
      inner = math.prod(in_shape[i] for i in gi[gi.index(varying[-1]) + 1:])
      if any(emb[i] is None and _big(in_shape[i]) for i in gi[:gi.index(varying[-1])]):
        return None
      # One varying axis keeps its home (the inverse of a split), so a value
      # split and merged back is recognised as carrying the same shift.
      homes = [emb[i] for i in varying]
      if len(varying) == 1:
        home = homes[0][0]
      elif all(h[1] == 1 and isinstance(h[0], tuple) and h[0][:1] == ("split",) and h[0][1] == homes[0][0][1]
               and h[0][2] == k for k, h in enumerate(homes)) and varying == big_in:
        home = homes[0][0][1]  # undoing an earlier split
      else:
        home = ("merge",) + tuple(homes)
      out[gj[big_out[0]]] = (home, emb[varying[-1]][1] * inner)
      continue
    if len(varying) > 1 or varying[0] != big_in[0]:
      return None
    home, block = emb[varying[0]]
    # Inner dims of the group are constant when the block spans them.
    inner = math.prod(in_shape[i] for i in gi[gi.index(varying[0]) + 1:])
    block *= inner
    first = big_out[0] if big_out else None
    if first is None:
      continue
    rest = math.prod(sizes[first + 1:])
    if block == 1 and rest > 1:
      # A varying axis split into several: each part gets a home derived
      # from the original, so the same split elsewhere matches.
      for k, o in enumerate(big_out):
        out[gj[o]] = (("split", home, k), 1)
      continue
    if block % rest:
      return None
    b = block // rest
    if sizes[first] % b:
      return None
    out[gj[first]] = (home, b)
  return tuple(out)


def center(x, spec: Spec):
  """Subtracts the mean over each joint block of ``spec`` (float32 or wider).

  Works on jax and NumPy arrays alike (only array methods are used).
  """
  import jax.numpy as jnp
  dtype = x.dtype
  acc = jnp.promote_types(dtype, jnp.float32)
  y = x.astype(acc)
  shape = list(y.shape)
  split, axes = [], []
  for d, s in enumerate(shape):
    b = spec.get(d)
    if b is None:
      split.append(s)
    else:
      split.extend([s // b, b])
      axes.append(len(split) - 1)
  z = y.reshape(split)
  z = z - z.mean(axis=tuple(axes), keepdims=True)
  return z.reshape(shape).astype(dtype)


def full_spec(shape, axes) -> Spec:
  return {a: shape[a] for a in axes}


def fmt_spec(spec: Spec, shape) -> str:
  parts = []
  for d in sorted(spec):
    b = spec[d]
    parts.append(str(d) if b == shape[d] else f"{d}(groups of {b})")
  return "(" + ", ".join(parts) + ")"
