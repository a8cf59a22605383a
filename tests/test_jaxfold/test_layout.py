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


@pytest.mark.parametrize("shape,spec", [((300, 768), {1: 768}), ((300, 768), {1: 256}),
                                        ((768, 96), {0: 768}), ((4, 6, 8), {1: 3, 2: 8})])
def test_pairwise_center_is_within_ulps_of_the_float64_mean(shape, spec):
  """pairwise=True (the fold's float32 host path without x64): NumPy's pairwise
  float32 sum where the block is the contiguous last axis, float64 elsewhere."""
  rng = np.random.default_rng(1)
  x = (rng.normal(size=shape) * 0.02 + 0.01).astype(np.float32)
  ref = layout.center(x, spec)
  got = layout.center(x, spec, pairwise=True)
  assert got.dtype == np.float32
  fast = set(spec) == {x.ndim - 1}
  if not fast:   # a strided or multi-axis block keeps the float64 mean: bit-identical
    assert np.array_equal(got, ref)
  else:
    assert np.max(np.abs(got - ref) / np.spacing(np.abs(x).max())) <= 4
  # the block means left are at float32 rounding (the float64 path leaves ~1e-9 too)
  assert np.abs(_block_sums(got, spec) / np.prod([spec[d] for d in spec])).max() < 1e-8


def test_fold_centers_float64_under_x64_and_pairwise_without():
  from helpers import x64_context

  from jaxfold._src import centering, compat
  x = (np.random.default_rng(2).normal(size=(64, 512)) * 0.02 + 0.01).astype(np.float32)
  fast = layout.center(x, {1: 512}, pairwise=True)
  assert not np.array_equal(fast, layout.center(x, {1: 512}))   # the two paths differ here
  with x64_context():
    assert compat.x64_enabled()
    assert np.array_equal(centering.host_center(x, {1: 512}), layout.center(x, {1: 512}))
  assert not compat.x64_enabled()
  assert np.array_equal(centering.host_center(x, {1: 512}), fast)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape,spec", [((4, 16), {1: 16}), ((6, 8), {0: 3}), ((4, 6, 8), {1: 3, 2: 8})])
def test_half_precision_center_subtracts_in_float32_and_rounds_once(dtype, shape, spec):
  """A bfloat16/float16 table: the float64 block mean, then ``x - mean`` in
  float32 rounded once to the table's dtype, bit for bit (subtracting a mean
  already rounded to bfloat16 leaves a block mean of bfloat16's rounding)."""
  rng = np.random.default_rng(3)
  x = (rng.normal(size=shape) * 0.5 + 2.0).astype(dtype)
  c = layout.center(x, spec)
  split, axes = [], []
  for d, s in enumerate(shape):
    split += [s // spec[d], spec[d]] if d in spec else [s]
    if d in spec:
      axes.append(len(split) - 1)
  z = x.reshape(split)
  m = z.astype(np.float64).mean(axis=tuple(axes), keepdims=True)
  want = (z.astype(np.float32) - m.astype(np.float32)).astype(dtype).reshape(shape)
  assert c.dtype == np.dtype(dtype)
  assert np.array_equal(c.view(np.uint16), want.view(np.uint16))
  # under jax (CBWC's forward pass, a leaf on an accelerator) the same: float32 arithmetic, one rounding
  cj = np.asarray(layout.center(jnp.asarray(x), spec))
  assert cj.dtype == np.dtype(dtype)
  assert np.array_equal(cj.view(np.uint16), want.view(np.uint16))
