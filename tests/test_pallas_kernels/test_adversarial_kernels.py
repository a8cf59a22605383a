"""Adversarial numerics of the Pallas kernels (interpret mode) and of folded models using them.

Every case names its reference: ``rms_norm_reference`` / ``fused_add_rms_norm_reference``
/ ``rms_matmul_reference`` (the XLA path, float32 accumulation, float64 for float64)
or, end to end, the *original* flax model. Non-finite values must match the
reference position by position (a NaN or a zero row with ε=0 stays in its row).
"""

from __future__ import annotations

import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import randomize, rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jaxfold  # noqa: E402
import pallas_kernels as pk  # noqa: E402

# Relative to max |reference|: one rounding to the output dtype (float32 ops differ
# in summation order only).
TOL = {"float32": 2e-6, "bfloat16": 1e-2, "float16": 2e-3, "float64": 1e-13}


def _same(got, want, tol, what="", floor=1e-30):
  """Same dtype/shape, same NaN/±inf positions, finite values within ``tol`` relative
  to max(max |want|, ``floor``)."""
  assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{what}: NaN positions")
  np.testing.assert_array_equal(np.where(np.isinf(g), g, 0), np.where(np.isinf(w), w, 0), err_msg=f"{what}: inf")
  fin = np.isfinite(w)
  if fin.any():
    err = np.max(np.abs(g[fin] - w[fin])) / max(np.max(np.abs(w[fin])), floor)
    assert err <= tol, f"{what}: rel err {err:.3g} > {tol}"


def _vecs(h, dtype=jnp.float32, seed=1):
  ks, kb = jax.random.split(jax.random.key(seed))
  return ((1.0 + 0.5 * jax.random.normal(ks, (h,))).astype(dtype), (0.5 * jax.random.normal(kb, (h,))).astype(dtype))


def _dx_floor(x, scale, ct, eps):
  """|dy·γ|·rstd, the size of dx before its projection: dx ⟂ x̂ can cancel to ~0 (hidden 1)."""
  xf = np.asarray(x, np.float64)
  rstd = 1 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return float(np.max(np.abs(np.asarray(ct, np.float64) * np.asarray(scale, np.float64)) * rstd))


def _norm_vjp(fn, x, scale, bias, ct, eps):
  """(y, dx, dscale, dbias) of ``fn``, forward and VJP in one jit (one interpret compile)."""
  @jax.jit
  def run(x, scale, bias, ct):
    y, vjp = jax.vjp(lambda x, s, b: fn(x, s, b, eps=eps), x, scale, bias)
    return (y, *vjp(ct))
  return run(x, scale, bias, ct)


def _kernel(x, s, b, *, eps):
  return pk.rms_norm(x, s, b, eps=eps, interpret=True)


def _special_rows(h, dtype):
  """Rows: normal, zero, normal, one NaN, one +inf, large, one -inf."""
  x = np.random.RandomState(0).randn(7, h).astype(np.float32)
  x[1] = 0.0
  x[3, h // 2] = np.nan
  x[4, 0] = np.inf
  x[5] *= 1e3
  x[6, h - 1] = -np.inf
  return jnp.asarray(x, dtype)


# ---------------------------------------------------------------- rms_norm / fused kernel
@pytest.mark.parametrize("shape,dtype", [
    ((1, 1), "float32"), ((3, 3), "float32"), ((5, 127), "bfloat16"), ((2, 3, 129), "float16"),
    ((129,), "float32"), ((2, 1, 3, 768), "bfloat16"),
    pytest.param((3, 4097), "float32", marks=pytest.mark.slow),
    pytest.param((1, 4097), "float16", marks=pytest.mark.slow),
    pytest.param((2, 9, 127), "float32", marks=pytest.mark.slow),
])
def test_rms_norm_odd_widths_and_ranks(shape, dtype):
  """Widths not a multiple of 128 or of the block, ranks 1-4; vs rms_norm_reference."""
  x = (2.0 * jax.random.normal(jax.random.key(0), shape) + 0.3).astype(dtype)
  ct = jax.random.normal(jax.random.key(2), shape).astype(dtype)
  s, b = _vecs(shape[-1])
  got = _norm_vjp(_kernel, x, s, b, ct, 1e-6)
  want = _norm_vjp(pk.rms_norm_reference, x, s, b, ct, 1e-6)
  tol, floor = TOL[dtype], _dx_floor(x, s, ct, 1e-6)
  for g, w, what in zip(got, want, ("y", "dx", "dscale", "dbias")):
    # dx in a 16-bit dtype: the reference rounds x̂ and its intermediates to it
    _same(g, w, tol if what == "y" or dtype == "float32" else 5 * tol, what, floor if what == "dx" else 1e-30)


@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_special_rows_match_reference_and_stay_in_their_row(eps, dtype):
  """Zero row (rms = 0: NaN for ε = 0, 0 for ε > 0), NaN and ±inf rows, with and
  without β: forward and gradients equal rms_norm_reference's, NaN positions included."""
  h = 129
  x = _special_rows(h, dtype)
  ct = jax.random.normal(jax.random.key(3), x.shape).astype(dtype)
  s, b = _vecs(h)
  for bias in (None, b):
    got = _norm_vjp(_kernel, x, s, bias, ct, eps)
    want = _norm_vjp(pk.rms_norm_reference, x, s, bias, ct, eps)
    for g, w, what in zip(got, want, ("y", "dx", "dscale", "dbias")):
      if w is not None:
        _same(g, w, TOL[dtype] * (1 if what == "y" else 5), f"{what} bias={bias is not None}")
  y = np.asarray(got[0], np.float32)
  bad = [1, 3, 4, 6] if eps == 0.0 else [3, 4, 6]
  assert sorted(np.nonzero(np.isnan(y).any(axis=1))[0].tolist()) == bad   # no leak to rows 0, 2, 5


@pytest.mark.parametrize("dtype,big", [("float16", 6.0e4), ("bfloat16", 1.0e37)])
def test_near_overflow_accumulates_wide(dtype, big):
  """Σx² of values near the dtype's max overflows the dtype, not float32: a finite
  result equal to the references' (plain and fused: x + residual rounded to the stream)."""
  h = 129
  x = jnp.full((3, h), big, dtype).at[1].multiply(-0.5)
  s = jnp.ones((h,), dtype)
  y = pk.rms_norm(x, s, eps=1e-6, interpret=True)
  _same(y, pk.rms_norm_reference(x, s, eps=1e-6), TOL[dtype])
  assert np.isfinite(np.asarray(y, np.float32)).all()
  r = jnp.full((3, h), -big / 2, dtype)
  for g, w in zip(pk.fused_add_rms_norm(x, r, s, eps=1e-6, interpret=True),
                  pk.fused_add_rms_norm_reference(x, r, s, eps=1e-6)):
    _same(g, w, TOL[dtype])


def test_float64_accumulates_in_float64(x64):
  """Regression: interpret mode took float64 input but accumulated in float32
  (rel err ~1e-7 against the float64 reference, gradients too)."""
  h = 129
  x = jax.random.normal(jax.random.key(0), (5, h), jnp.float64) * 3 + 1 / 3
  ct = jax.random.normal(jax.random.key(1), (5, h), jnp.float64)
  s, b = _vecs(h, jnp.float64)
  for g, w in zip(_norm_vjp(_kernel, x, s, b, ct, 1e-6), _norm_vjp(pk.rms_norm_reference, x, s, b, ct, 1e-6)):
    _same(g, w, TOL["float64"])


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
def test_fused_float64_residual(x64, x_dtype):
  """Regression: a float64 residual stream (h = x + r is float64) was summed and
  normalized in float32 (rel err ~5e-8 in h); now float64 in interpret mode, and the
  compiled path (which only takes SUPPORTED_DTYPES) falls back to the XLA expression."""
  h = 129
  x = jax.random.normal(jax.random.key(0), (4, h)).astype(x_dtype)
  r = jax.random.normal(jax.random.key(1), (4, h), jnp.float64) * 1e3 + 1 / 3
  s, b = _vecs(h)
  want = pk.fused_add_rms_norm_reference(x, r, s, b, eps=1e-6)
  for g, w in zip(pk.fused_add_rms_norm(x, r, s, b, eps=1e-6, interpret=True), want):
    _same(g, w, TOL[np.dtype(w.dtype).name])
  cts = (jnp.ones((4, h), x_dtype), jnp.full((4, h), 0.25, jnp.float64))
  g_ker = jax.vjp(lambda *a: pk.fused_add_rms_norm(*a, eps=1e-6, interpret=True), x, r, s, b)[1](cts)
  g_ref = jax.vjp(lambda *a: pk.fused_add_rms_norm_reference(*a, eps=1e-6), x, r, s, b)[1](cts)
  for g, w in zip(g_ker, g_ref):
    _same(g, w, TOL["float64"] if x_dtype == "float32" or g.dtype != jnp.bfloat16 else TOL["bfloat16"])
  compiled = jax.make_jaxpr(lambda *a: pk.fused_add_rms_norm(*a, eps=1e-6, interpret=False))(x, r, s, b)
  assert "pallas_call" not in str(compiled)
  supported = jax.make_jaxpr(lambda *a: pk.fused_add_rms_norm(*a, eps=1e-6, interpret=False))(
      x, r.astype(jnp.float32), s, b)
  assert "pallas_call" in str(supported)   # the control: a supported residual keeps the kernel


def test_no_rows_takes_the_reference():
  """Regression: zero rows raised ValueError ("x must be non-empty") in every mode,
  so a folded model crashed on an empty batch; rms_matmul(_group) in interpret mode
  raised a TypeError from its zero-size grid. Now each is the reference's empty result."""
  s, b = _vecs(16)
  for interpret in (True, False, None):
    x = jnp.zeros((0, 3, 16))
    assert pk.rms_norm(x, s, b, eps=1e-6, interpret=interpret).shape == (0, 3, 16)
    y, hh = pk.fused_add_rms_norm(x, x, s, b, eps=1e-6, interpret=interpret)
    assert y.shape == hh.shape == (0, 3, 16)
    g = jax.grad(lambda x, i=interpret: pk.rms_norm(x, s, b, eps=1e-6, interpret=i).sum())(x)
    assert g.shape == x.shape
    assert pk.rms_matmul(x, jnp.ones((16, 5)), eps=1e-6, interpret=interpret).shape == (0, 3, 5)
    ys = pk.rms_matmul_group(x, [jnp.ones((16, 5)), jnp.ones((16, 2))], eps=1e-6, interpret=interpret)
    assert [a.shape for a in ys] == [(0, 3, 5), (0, 3, 2)]
  with pytest.raises(ValueError, match="hidden axis"):
    pk.rms_norm(jnp.float32(1.0), jnp.ones(()), eps=1e-6, interpret=True)


@pytest.mark.parametrize("fn", ["rms_norm", "fused_add_rms_norm", "rms_matmul"])
def test_a_traced_eps_is_refused_by_name(fn):
  """eps is compiled into the kernel: a traced one used to raise jax's bare
  ConcretizationTypeError from ``float``; a concrete jax scalar still works."""
  x = jnp.ones((2, 8))
  call = {"rms_norm": lambda x, e: pk.rms_norm(x, jnp.ones(8), eps=e, interpret=True),
          "fused_add_rms_norm": lambda x, e: pk.fused_add_rms_norm(x, x, jnp.ones(8), eps=e, interpret=True),
          "rms_matmul": lambda x, e: pk.rms_matmul(x, jnp.ones((8, 4)), eps=e, interpret=True)}[fn]
  with pytest.raises(TypeError, match=rf"pallas_kernels\.{fn}: eps must be .* got a traced value"):
    jax.jit(call)(x, 1e-6)
  assert np.all(np.isfinite(np.asarray(jax.tree_util.tree_leaves(call(x, jnp.float32(1e-6)))[0])))


def test_scale_and_bias_in_other_dtypes(x64):
  """γ bfloat16 / float64 and β float16 on a float32 x: accumulation is float32 as in
  the reference; output and cotangent dtypes are the reference's."""
  h = 127
  x = jax.random.normal(jax.random.key(0), (3, h), jnp.float32)
  ct = jax.random.normal(jax.random.key(1), (3, h), jnp.float32)
  s, b = _vecs(h)
  for sd, bd in (("bfloat16", "float16"), ("float64", "float32")):
    got = _norm_vjp(_kernel, x, s.astype(sd), b.astype(bd), ct, 1e-5)
    want = _norm_vjp(pk.rms_norm_reference, x, s.astype(sd), b.astype(bd), ct, 1e-5)
    for g, w, what in zip(got, want, ("y", "dx", "dscale", "dbias")):
      _same(g, w, TOL[np.dtype(w.dtype).name] if w.dtype != jnp.float64 else TOL["float32"], f"{sd}/{bd} {what}")


def test_vmap_jit_grad_and_strided_inputs():
  """vmap over grad, vmap with a batched γ, a transposed and a strided (sliced) x:
  all equal the same composition of rms_norm_reference."""
  h = 129
  x = jax.random.normal(jax.random.key(0), (2, 3, h))
  s, b = _vecs(h)

  def loss(fn):
    return lambda x, s: jnp.sum(fn(x, s, b, eps=1e-6) ** 2 * jnp.arange(h))

  got = jax.jit(jax.vmap(jax.grad(loss(_kernel), argnums=(0, 1)), (0, None)))(x, s)
  want = jax.jit(jax.vmap(jax.grad(loss(pk.rms_norm_reference), argnums=(0, 1)), (0, None)))(x, s)
  for g, w in zip(got, want):
    _same(g, w, 1e-5)
  ss = jnp.stack([s, -2 * s])
  _same(jax.vmap(lambda x, s: _kernel(x, s, b, eps=1e-6))(x, ss),
        jax.vmap(lambda x, s: pk.rms_norm_reference(x, s, b, eps=1e-6))(x, ss), TOL["float32"])
  xt = jax.random.normal(jax.random.key(1), (h, 2, 5))
  wide = jax.random.normal(jax.random.key(2), (4, 3 * h))
  for fn in (lambda xt, w: jnp.transpose(xt, (1, 2, 0)), lambda xt, w: w[:, 1::3]):
    want = pk.rms_norm_reference(fn(xt, wide), s, b, eps=1e-6)
    _same(jax.jit(lambda xt, w, fn=fn: _kernel(fn(xt, w), s, b, eps=1e-6))(xt, wide), want, TOL["float32"])


# ---------------------------------------------------------------- rms_matmul
@pytest.mark.parametrize("m,k,n,dtype,w_nk", [
    (1, 1, 1, "float32", False), (3, 3, 5, "float16", True), (5, 127, 129, "bfloat16", False),
    (65, 129, 33, "float32", True), (2, 129, 3, "float64", False),
    pytest.param(2, 4097, 3, "float32", True, marks=pytest.mark.slow),
    pytest.param(67, 768, 131, "float16", False, marks=pytest.mark.slow),
])
def test_rms_matmul_ragged_tiles_with_two_biases(x64, m, k, n, dtype, w_nk):
  """M, N, K not multiples of the tiles, two epilogue biases; vs rms_matmul_reference."""
  kx, kw, kb = jax.random.split(jax.random.key(m + k + n), 3)
  x = (2.0 * jax.random.normal(kx, (m, k)) + 0.5).astype(dtype)
  w = (jax.random.normal(kw, (n, k) if w_nk else (k, n)) / np.sqrt(k)).astype(dtype)
  bias = (jax.random.normal(kb, (n,)).astype(dtype), jnp.linspace(-1, 1, n).astype(dtype))
  got = pk.rms_matmul(x, w, bias, eps=1e-6, w_nk=w_nk, interpret=True)
  _same(got, pk.rms_matmul_reference(x, w, bias, eps=1e-6, w_nk=w_nk), TOL[dtype] * (1 if dtype == "float64" else 4))


@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_rms_matmul_special_rows(eps):
  """Zero, NaN and ±inf rows of x and a NaN column of w: the same NaN/inf pattern as
  rms_matmul_reference (a row's statistic reaches its row only), also for the group;
  the gradient (the reference's VJP) equals the reference's, zero row included."""
  h, n = 129, 40
  x = _special_rows(h, "float32")
  w = jax.random.normal(jax.random.key(1), (h, n)).at[:, 3].set(jnp.nan)
  want = pk.rms_matmul_reference(x, w, eps=eps)
  _same(pk.rms_matmul(x, w, eps=eps, interpret=True), want, 4e-6)
  g = pk.rms_matmul_group(x, [w, w[:, :7]], [None, jnp.ones(7)], eps=eps, interpret=True)
  _same(g[0], want, 4e-6)
  _same(g[1], pk.rms_matmul_reference(x, w[:, :7], jnp.ones(7), eps=eps), 4e-6)
  xf = jnp.where(jnp.isfinite(x), x, 0.0)
  wf = jnp.nan_to_num(w)
  got = jax.grad(lambda x, w: pk.rms_matmul(x, w, eps=eps, interpret=True).sum(), (0, 1))(xf, wf)
  ref = jax.grad(lambda x, w: pk.rms_matmul_reference(x, w, eps=eps).sum(), (0, 1))(xf, wf)
  for a, r in zip(got, ref):
    _same(a, r, 1e-6)


def test_rms_matmul_float16_sum_of_squares_does_not_overflow():
  """Σx² of float16 x past 65504 accumulates in float32 (the reference's), not float16."""
  x = jnp.full((3, 129), 300.0, jnp.float16).at[1].set(-250.0)
  w = jnp.full((129, 20), 0.01, jnp.float16)
  got = pk.rms_matmul(x, w, eps=1e-6, interpret=True)
  _same(got, pk.rms_matmul_reference(x, w, eps=1e-6), TOL["float16"])
  assert np.isfinite(np.asarray(got, np.float32)).all()


# ---------------------------------------------------------------- folded models
class _Net(nn.Module):
  """Pre-LN blocks: a residual add feeding a LayerNorm read by two Dense (one
  norm, two readers: the group kernel when deferred), a final bias-free norm and head."""
  hidden: int = 24
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=self.dtype, param_dtype=self.dtype)
    x = nn.Dense(self.hidden, **kw)(x)
    for _ in range(2):
      h = nn.LayerNorm(epsilon=1e-5, **kw)(x)
      x = x + nn.Dense(self.hidden, **kw)(nn.gelu(nn.Dense(self.hidden, **kw)(h)) * nn.Dense(self.hidden, **kw)(h))
    return nn.Dense(7, **kw)(nn.LayerNorm(use_bias=False, **kw)(x))


FOLD_CASES = [
    ("float32", "interpret", {"defer_norms": True}, 2e-5),
    ("float32", "pallas", {"fuse_affine": True}, 2e-5),
    ("float64", "interpret", {"defer_norms": True}, 1e-12),
    pytest.param("float32", "interpret", {}, 2e-5, marks=pytest.mark.slow),
    pytest.param("float32", "interpret", {"fuse_affine": True}, 2e-5, marks=pytest.mark.slow),
    pytest.param("float32", "pallas", {"defer_norms": True}, 2e-5, marks=pytest.mark.slow),
    pytest.param("float64", "pallas", {"defer_norms": True}, 1e-12, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dtype,impl,kw,tol", FOLD_CASES)
def test_folded_model_with_kernels_matches_original(x64, dtype, impl, kw, tol):
  """fold(norm_impl=...) [→ fuse_affine → defer_norms] vs the *original* model at two
  shapes (and an empty batch: regression, it raised in the kernel wrapper)."""
  m = _Net(dtype=jnp.dtype(dtype))
  x0 = jax.random.normal(jax.random.key(0), (2, 5, 16), dtype)
  p = randomize(m.init(jax.random.PRNGKey(0), x0))
  f = jaxfold.fold(p, m.apply, x0, norm_impl=impl, **kw)
  for shape in ((2, 5, 16), (3, 1, 16)):
    x = jax.random.normal(jax.random.key(1), shape, dtype)
    assert rel_err(m.apply(p, x), f.apply_fn(f.params, x)) < tol, shape
  if impl == "interpret" and dtype == "float32":
    assert "pallas_call" in str(jax.make_jaxpr(f.apply_fn)(f.params, x0))   # the kernels did run
  empty = jnp.zeros((0, 16), dtype)
  assert f.apply_fn(f.params, empty).shape == m.apply(p, empty).shape == (0, 7)
