"""Centering over blocks, and how a zero-sum spec reads.

A spec is ``{dim: block}``: the value sums to zero over each joint block made
of ``block`` consecutive elements of every listed dimension.
"""

from __future__ import annotations

Spec = dict  # {dim: block}


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
