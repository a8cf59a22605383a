"""jaxfold/_src/layout.py: block centering on the host and under jax."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxfold._src import layout

SPECS = [((6, 8), {1: 8}), ((6, 8), {0: 6}), ((6, 8), {1: 4}), ((4, 6, 8), {1: 3, 2: 8}),
         ((4, 6, 8), {0: 2}), ((5,), {0: 5})]


def _block_sums(x, spec):
  split, axes = [], []
  for d, s in enumerate(x.shape):
    if d in spec:
      split += [s // spec[d], spec[d]]
      axes.append(len(split) - 1)
    else:
      split.append(s)
  return np.asarray(x, np.float64).reshape(split).sum(axis=tuple(axes))


@pytest.mark.parametrize("shape,spec", SPECS)
def test_center_zeroes_every_block_and_only_removes_block_means(shape, spec, x64):
  rng = np.random.default_rng(0)
  x = rng.normal(size=shape) + 3.0
  c = layout.center(x, spec)
  assert c.dtype == x.dtype and c.shape == x.shape
  np.testing.assert_allclose(_block_sums(c, spec), 0.0, atol=1e-12)
  # What was removed is constant over each block: centering twice changes nothing.
  np.testing.assert_allclose(layout.center(c, spec), c, atol=1e-12)
  # Host and jax agree.
  cj = layout.center(jnp.asarray(x), spec)
  assert cj.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(cj), c, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_center_keeps_low_precision_dtypes_and_rounds_once(dtype):
  rng = np.random.default_rng(1)
  x = (rng.normal(size=(4, 16)) + 2.0).astype(dtype)
  c = layout.center(x, {1: 16})
  assert c.dtype == np.dtype(dtype)
  want = (x.astype(np.float64) - x.astype(np.float64).mean(axis=1, keepdims=True)).astype(dtype)
  # One rounding of the float64 (float32 for half types) result.
  np.testing.assert_allclose(c.astype(np.float64), want.astype(np.float64),
                             atol=float(ml_dtypes.finfo(dtype).eps) * 8)
  cj = layout.center(jnp.asarray(x), {1: 16})
  assert cj.dtype == jnp.dtype(dtype)


def test_spec_helpers():
  assert layout.full_spec((2, 3, 4), (1, 2)) == {1: 3, 2: 4}
  assert layout.fmt_spec({1: 3, 2: 2}, (2, 3, 4)) == "(1, 2(groups of 2))"
