"""The Mosaic GPU (plgpu.kernel) RMSNorm kernels in Mosaic GPU's interpreter on the CPU.

``backend="mosaic_gpu", interpret=True`` runs the kernel bodies with simulated
SMEM, TMA copies and barriers (jax 0.10.2 and 0.11.2). Numerics are checked
against a float64 NumPy reference, forward and backward (``jax.vjp``), at
shapes whose row count is not a multiple of the row block: the last block
then overlaps its predecessor, which the backward pass must not count twice.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import rms_norm_mosaic as mgpu  # noqa: E402

EPS = 1e-6
MISSING = "mosaic_gpu" not in pk.available_backends()
pytestmark = pytest.mark.skipif(MISSING, reason="jax has no usable Mosaic GPU kernel API")
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _inputs(shape, dtype, seed):
  rng = np.random.default_rng(seed)
  h = shape[-1]
  x = (2.0 * rng.standard_normal(shape) + 0.3).astype(np.float32)
  return dict(
    x=jnp.asarray(x, dtype), res=jnp.asarray(rng.standard_normal(shape), dtype),
    scale=jnp.asarray(1.0 + 0.5 * rng.standard_normal(h), jnp.float32),
    bias=jnp.asarray(0.5 * rng.standard_normal(h), jnp.float32),
    dy=jnp.asarray(rng.standard_normal(shape), dtype), dh=jnp.asarray(rng.standard_normal(shape), dtype))


def _f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _reference(x, scale, bias, dy, res=None, dh=None):
  """float64 (y, h, dx, dres, dscale, dbias) of (fused add +) RMSNorm and its VJP."""
  x, scale, bias, dy = map(_f64, (x, scale, bias, dy))
  h = x if res is None else x + _f64(res)
  rstd = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS)
  xhat = h * rstd
  y = xhat * scale + bias
  g = dy * scale
  dh_total = (g - xhat * np.mean(xhat * g, axis=-1, keepdims=True)) * rstd
  if dh is not None:
    dh_total = dh_total + _f64(dh)
  axes = tuple(range(x.ndim - 1))
  return y, h, dh_total, dh_total, np.sum(dy * xhat, axis=axes), np.sum(dy, axis=axes)


def _close(got, want, tol, what):
  got = _f64(got)
  assert got.shape == want.shape, what
  err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6)
  assert err <= tol, f"{what}: rel err {err:.3g} > {tol}"


def _few_ctas(monkeypatch):
  # Row blocks of several rows, a ragged last block, backward CTAs that loop
  # over several blocks (one skipped), and rows in several chunks (hidden 384),
  # as for large inputs.
  monkeypatch.setattr(mgpu, "_TARGET_CTAS", 4)
  monkeypatch.setattr(mgpu, "_BWD_TARGET_CTAS", 2)
  monkeypatch.setattr(mgpu, "_CHUNK", 2)


@pytest.mark.parametrize("shape,dtype", [((37, 256), jnp.float32), ((3, 7, 384), jnp.bfloat16)])
def test_rms_norm_fwd_bwd_vs_float64(monkeypatch, shape, dtype):
  _few_ctas(monkeypatch)
  rows = int(np.prod(shape[:-1]))
  br, steps, ctas = mgpu.bwd_grid(rows, shape[-1] * 16)
  assert rows % br and steps > 1, (rows, br, steps)  # the cases this test is about
  a = _inputs(shape, dtype, seed=0)

  @jax.jit
  def run(x, scale, bias, dy):
    f = lambda x, s, b: pk.rms_norm(x, s, b, eps=EPS, interpret=True, backend="mosaic_gpu")
    y, vjp = jax.vjp(f, x, scale, bias)
    return (y, *vjp(dy))

  y, dx, ds, db = run(a["x"], a["scale"], a["bias"], a["dy"])
  assert y.dtype == dx.dtype == dtype
  ry, _, rdx, _, rds, rdb = _reference(a["x"], a["scale"], a["bias"], a["dy"])
  tol = TOL[dtype]
  for got, want, what in [(y, ry, "y"), (dx, rdx, "dx"), (ds, rds, "dscale"), (db, rdb, "dbias")]:
    _close(got, want, tol, what)


@pytest.mark.parametrize("shape,dtype", [((37, 256), jnp.float32), ((5, 128), jnp.bfloat16)])
def test_fused_add_rms_norm_fwd_bwd_vs_float64(monkeypatch, shape, dtype):
  _few_ctas(monkeypatch)
  a = _inputs(shape, dtype, seed=1)

  @jax.jit
  def run(x, res, scale, bias, dy, dh):
    f = lambda x, r, s, b: pk.fused_add_rms_norm(x, r, s, b, eps=EPS, interpret=True, backend="mosaic_gpu")
    (y, h), vjp = jax.vjp(f, x, res, scale, bias)
    return (y, h, *vjp((dy, dh)))

  y, h, dx, dr, ds, db = run(a["x"], a["res"], a["scale"], a["bias"], a["dy"], a["dh"])
  want = _reference(a["x"], a["scale"], a["bias"], a["dy"], a["res"], a["dh"])
  tol = TOL[dtype]
  for got, w, what in zip((y, h, dx, dr, ds, db), want, ("y", "h", "dx", "dres", "dscale", "dbias")):
    _close(got, w, tol, what)


def test_without_bias_grad_via_jax_grad():
  a = _inputs((6, 128), jnp.float32, seed=2)
  loss = lambda x, s: jnp.sum(pk.rms_norm(x, s, eps=EPS, interpret=True, backend="mosaic_gpu") * a["dy"])
  dx, ds = jax.jit(jax.grad(loss, argnums=(0, 1)))(a["x"], a["scale"])
  _, _, rdx, _, rds, _ = _reference(a["x"], a["scale"], jnp.zeros(128), a["dy"])
  _close(dx, rdx, 2e-5, "dx")
  _close(ds, rds, 2e-5, "dscale")


def test_hidden_not_multiple_of_128_is_refused():
  with pytest.raises(ValueError, match="multiple of 128"):
    pk.rms_norm(jnp.ones((2, 96)), jnp.ones(96), eps=EPS, interpret=True, backend="mosaic_gpu")
  assert not pk.supports((2, 96), "float32", backend="mosaic_gpu") and pk.supports((2, 96), "float32")


def _staged(backend=None):
  x = jnp.ones((4, 128))
  return str(jax.make_jaxpr(
    lambda x: pk.rms_norm(x, jnp.ones(128), eps=EPS, interpret=False, backend=backend))(x))


def test_mosaic_is_opt_in_and_staged_as_plgpu_kernel():
  assert pk.resolve_backend(None, interpret=False) == "triton"
  auto, mosaic = _staged(), _staged("mosaic_gpu")
  assert "pallas_call" in auto and "copy_gmem_to_smem" not in auto
  assert "copy_gmem_to_smem" in mosaic and "pallas_call" not in mosaic
  assert "pallas_kernels_cuda_only" in mosaic  # compiled for CUDA only
  # On the CPU the compiled path is the XLA expression (platform_dependent).
  x = jnp.ones((4, 128))
  y = jax.jit(lambda x: pk.rms_norm(x, jnp.ones(128), eps=EPS, interpret=False, backend="mosaic_gpu"))(x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(pk.rms_norm_reference(x, jnp.ones(128), eps=EPS)))


def test_set_backend_switches_calls_that_name_none():
  try:
    pk.set_backend("mosaic_gpu")
    assert pk.resolve_backend(None, interpret=False) == "mosaic_gpu"
    assert "copy_gmem_to_smem" in _staged()
    assert "pallas_call" in _staged("triton")  # an explicit backend still wins
  finally:
    pk.set_backend(None)
  assert "pallas_call" in _staged()
  with pytest.raises(ValueError, match="backend"):
    pk.set_backend("cuda")


def test_export_for_cpu_and_cuda():
  """One artifact for both platforms (jax 0.10.2 and 0.11.2 lower Mosaic GPU without a
  GPU; the Pallas Triton lowering needs one on 0.11): the CUDA module holds the Mosaic
  kernel, the CPU one runs the XLA expression."""
  from jax import export

  f = jax.jit(lambda x, r, s: pk.add_rms_norm(x, r, s, eps=EPS, interpret=False, backend="mosaic_gpu"))
  a = _inputs((64, 256), jnp.bfloat16, seed=3)
  exp = export.export(f, platforms=("cpu", "cuda"))(a["x"], a["res"], a["scale"])
  assert "mosaic_gpu_v2" in exp.mlir_module()
  y, h = exp.call(a["x"], a["res"], a["scale"])
  ry, rh = pk.fused_add_rms_norm_reference(a["x"], a["res"], a["scale"], eps=EPS)
  np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(rh, np.float32))
  _close(y, _f64(ry), 1e-2, "y")
