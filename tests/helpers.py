"""Helpers shared by the tests (``from helpers import ...``): random non-trivial
parameters, relative errors and a float64 context."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np


def randomize(params, seed=0, scale=0.5, key=None):
  """Perturbs every float leaf (γ, β and biases included): γ=1/β=0 hides bugs.

  ``key`` (a PRNG key) overrides ``seed``.
  """
  leaves, tree = jax.tree_util.tree_flatten(params)
  key = jax.random.PRNGKey(seed) if key is None else key
  keys = jax.random.split(key, max(len(leaves), 1))
  out = []
  for k, leaf in zip(keys, leaves):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      leaf = leaf + scale * jax.random.normal(k, leaf.shape, jnp.float32).astype(leaf.dtype)
    out.append(leaf)
  return jax.tree_util.tree_unflatten(tree, out)


def named_params(seed=0, **shapes):
  """A dict of float64 leaves by name: ``g*`` γ near 1 (non-uniform), ``b*`` β
  and biases with a non-zero mean, anything else a weight scaled by its fan-in."""
  rng = np.random.default_rng(seed)
  out = {}
  for k, s in shapes.items():
    if k.startswith("g"):
      out[k] = jnp.asarray(1 + 0.5 * rng.normal(size=s))
    elif k.startswith("b"):
      out[k] = jnp.asarray(rng.normal(size=s) + 0.3)
    else:
      out[k] = jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]))
  return out


def rel_err(a, b) -> float:
  """``max |a − b| / max |a|`` over the leaves, in float64 (NaN anywhere fails)."""
  errs = []
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))) or x.shape != y.shape:
      return float("inf")
    if x.size == 0:       # (a zero-length loop's stacked outputs)
      errs.append(0.0)
      continue
    errs.append(np.max(np.abs(x - y)) / max(np.max(np.abs(x)), 1e-30))
  return max(errs)


@contextlib.contextmanager
def x64_context():
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", prev)


def center_blocks(x, spec: dict):
  """Independent oracle of a centering: subtracts the mean over each joint block
  of ``spec`` ({dim: block}), in NumPy float64, returned in ``x``'s dtype."""
  a = np.asarray(x, np.float64)
  split, axes = [], []
  for d, s in enumerate(a.shape):
    if d in spec:
      split.extend([s // spec[d], spec[d]])
      axes.append(len(split) - 1)
    else:
      split.append(s)
  z = a.reshape(split)
  z = z - z.mean(axis=tuple(axes), keepdims=True)
  return z.reshape(a.shape).astype(np.asarray(x).dtype)
