"""Centering over blocks, and how a zero-sum spec reads.

A spec is ``{dim: block}``: the value sums to zero over each joint block made
of ``block`` consecutive elements of every listed dimension.
"""

from __future__ import annotations

import numpy as np

Spec = dict  # {dim: block}


def center(x, spec: Spec, out=None, pairwise: bool = False):
  """Subtracts the mean over each joint block of ``spec``, keeping ``x``'s dtype.

  Works on jax and NumPy arrays alike. On the host (NumPy) the mean is
  accumulated in float64 and the subtraction writes the only full-size array
  (no float64 copy of a large table), into ``out`` when given (a contiguous
  array of ``x``'s shape and dtype); under jax the arithmetic runs in at
  least float32. ``pairwise``: a float32 array centered along its last axis
  alone takes NumPy's pairwise float32 sum there (within ~2 ulp of the
  float64 mean, in a third of the time).
  """
  dtype = x.dtype
  shape = tuple(x.shape)
  split, axes = blocks(shape, spec)
  if isinstance(x, np.ndarray):
    z = x.reshape(split)
    fast = pairwise and dtype == np.float32 and axes == (len(split) - 1,)
    m = z.mean(axis=axes, dtype=np.float32 if fast else np.float64, keepdims=True)
    dest = None if out is None else out.reshape(split)
    if dtype in (np.float32, np.float64):
      y = np.subtract(z, m.astype(dtype), out=dest)
    else:  # bfloat16/float16: subtract in float32, round once
      y = (z.astype(np.float32) - m.astype(np.float32)).astype(dtype)
      if dest is not None:
        dest[...] = y
        y = dest
    return y.reshape(shape)
  import jax.numpy as jnp
  acc = jnp.promote_types(dtype, jnp.float32)
  z = x.astype(acc).reshape(split)
  z = z - z.mean(axis=axes, keepdims=True)
  return z.reshape(shape).astype(dtype)


def blocks(shape, spec: Spec) -> tuple:
  """``(split, axes)``: ``shape`` with every dim ``spec`` centers in blocks
  smaller than the dim split into (blocks, block size), and the axes of
  ``split`` that hold the blocks (a mean over them is each block's mean).

  Example:
    >>> blocks((2, 6, 4), {1: 3, 2: 4})
    ((2, 2, 3, 4), (2, 3))
  """
  split, axes = [], []
  for d, n in enumerate(shape):
    b = spec.get(d)
    if b is not None and b != n:
      split.append(n // b)
    split.append(n if b is None else b)
    if b is not None:
      axes.append(len(split) - 1)
  return tuple(split), tuple(axes)


def full_spec(shape, axes) -> Spec:
  return {a: shape[a] for a in axes}


def fmt_spec(spec: Spec, shape) -> str:
  parts = []
  for d in sorted(spec):
    b = spec[d]
    parts.append(str(d) if b == shape[d] else f"{d}(groups of {b})")
  return "(" + ", ".join(parts) + ")"
