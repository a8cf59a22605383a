"""Shared checks for the Keras tests: skip unless keras runs on JAX, compare a fold with
the original, leaf by leaf, at the precision each output leaf is computed in."""

import jax
import numpy as np
import pytest


def require_keras_jax():
  """keras (JAX backend) or a skip that says why; conftest sets KERAS_BACKEND=jax."""
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip(f"keras was imported with the {keras.backend.backend()!r} backend before the tests set "
                "KERAS_BACKEND=jax; jaxfold folds JAX programs", allow_module_level=True)
  return keras


def cast_inputs(x, dtype):
  return jax.tree_util.tree_map(lambda a: a.astype(dtype) if np.asarray(a).dtype.kind == "f" else a, x)


def assert_same(f, params, folded, x):
  """``folded.apply_fn(folded.params, x) == f(params, x)``: ≤ 1e-9 relative on float64
  leaves, ≤ 1e-5 on the others (Keras computes those in float32). One jit for both."""
  a, b = jax.jit(lambda p, q, x: (f(p, x), folded.apply_fn(q, x)))(params, folded.params, x)
  for y, z in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
    y, z = np.asarray(y), np.asarray(z)
    assert y.dtype == z.dtype and y.shape == z.shape
    tol = 1e-9 if y.dtype == np.float64 else 1e-5
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(z))
    err = np.max(np.abs(y.astype(np.float64) - z)) / max(np.max(np.abs(y.astype(np.float64))), 1e-30)
    assert err <= tol, (err, y.dtype)

