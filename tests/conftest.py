"""Shared test helpers: random non-trivial parameters and exactness checks."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def randomize(params, seed=0, scale=0.5):
  """Perturbs every float leaf (γ, β, biases included): γ=1/β=0 hides bugs."""
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  out = []
  for k, leaf in zip(keys, leaves):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      leaf = leaf + scale * jax.random.normal(k, leaf.shape, jnp.float32).astype(leaf.dtype)
    out.append(leaf)
  return jax.tree_util.tree_unflatten(tree, out)


def rel_err(a, b) -> float:
  errs = []
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
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


@pytest.fixture
def x64():
  """Float64 for algebraic exactness checks, restored afterwards."""
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", prev)
