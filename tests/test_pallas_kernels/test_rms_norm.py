"""CPU tests of pallas_kernels.rms_norm in Pallas interpret mode.

Each case jits forward + VJP together so that one compilation covers both
kernels (interpret-mode compiles dominate the runtime).
"""

from __future__ import annotations

import importlib.util
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
from pallas_kernels import dispatch  # noqa: E402

EPS = 1e-6
# Relative (to the max |reference|) error bounds: output/dx are rounded to
# the input dtype, dscale/dbias are float32-accumulated sums.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def _inputs(shape, dtype, seed=0, residual_dtype=None):
  ks = jax.random.split(jax.random.key(seed), 6)
  h = shape[-1]
  x = (2.0 * jax.random.normal(ks[0], shape, jnp.float32) + 0.3).astype(dtype)
  scale = 1.0 + 0.5 * jax.random.normal(ks[1], (h,), jnp.float32)  # non-trivial
  bias = 0.5 * jax.random.normal(ks[2], (h,), jnp.float32)
  ct = jax.random.normal(ks[3], shape, jnp.float32).astype(dtype)
  res = jax.random.normal(ks[4], shape, jnp.float32).astype(residual_dtype or dtype)
  ct_h = jax.random.normal(ks[5], shape, jnp.float32).astype(jnp.result_type(dtype, res.dtype))
  return x, scale, bias, ct, res, ct_h


def _close(got, want, tol, what):
  got = np.asarray(jnp.asarray(got, jnp.float32))
  want = np.asarray(jnp.asarray(want, jnp.float32))
  assert got.shape == want.shape, what
  err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6)
  assert err <= tol, f"{what}: rel err {err:.3g} > {tol}"


def _f32(*a):
  return [None if v is None else v.astype(jnp.float32) for v in a]


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((1, 768), jnp.float32),
        ((3, 5, 1000), jnp.float32),
        ((7, 4096), jnp.float32),
        ((2, 130), jnp.float32),
        ((3, 5, 1000), jnp.bfloat16),
        ((1, 768), jnp.bfloat16),
        ((2, 130), jnp.float16),
        ((7, 4096), jnp.float16),
    ],
)
def test_rms_norm_forward_and_grads(shape, dtype):
  x, scale, bias, ct, _, _ = _inputs(shape, dtype)

  @jax.jit
  def run(x, scale, bias, ct):
    f = lambda x, s, b: pk.rms_norm(x, s, b, eps=EPS, interpret=True)
    y, vjp = jax.vjp(f, x, scale, bias)
    return (y, *vjp(ct))

  y, dx, ds, db = run(x, scale, bias, ct)
  assert y.dtype == dtype and dx.dtype == dtype and ds.dtype == jnp.float32 and db.dtype == jnp.float32
  # Reference: float32 math on the same (already rounded) inputs.
  x32, ct32 = _f32(x, ct)
  ry, rvjp = jax.vjp(lambda x, s, b: pk.rms_norm_reference(x, s, b, eps=EPS), x32, scale, bias)
  rdx, rds, rdb = rvjp(ct32)
  tol = TOL[dtype]
  _close(y, ry, tol, "y")
  _close(dx, rdx, tol, "dx")
  _close(ds, rds, tol, "dscale")
  _close(db, rdb, tol, "dbias")


def test_rms_norm_without_bias_and_bf16_scale():
  x, scale, _, ct, _, _ = _inputs((3, 200), jnp.bfloat16, seed=1)
  scale = scale.astype(jnp.bfloat16)
  f = jax.jit(lambda x, s: jax.vjp(lambda x, s: pk.rms_norm(x, s, eps=EPS, interpret=True), x, s)[1](ct))
  dx, ds = f(x, scale)
  assert ds.dtype == jnp.bfloat16
  rdx, rds = jax.vjp(lambda x, s: pk.rms_norm_reference(x, s, eps=EPS), *_f32(x, scale))[1](ct.astype(jnp.float32))
  _close(dx, rdx, 2e-2, "dx")
  _close(ds, rds, 2e-2, "dscale")


@pytest.mark.parametrize(
    "shape,dtype,res_dtype",
    [
        ((3, 5, 1000), jnp.float32, None),
        ((1, 768), jnp.bfloat16, None),
        ((2, 130), jnp.bfloat16, jnp.float32),  # bf16 activations, f32 residual stream
        ((7, 4096), jnp.float16, None),
    ],
)
def test_fused_add_rms_norm_forward_and_grads(shape, dtype, res_dtype):
  x, scale, bias, ct, res, ct_h = _inputs(shape, dtype, seed=2, residual_dtype=res_dtype)

  @jax.jit
  def run(x, res, scale, bias, ct, ct_h):
    f = lambda x, r, s, b: pk.fused_add_rms_norm(x, r, s, b, eps=EPS, interpret=True)
    (y, h), vjp = jax.vjp(f, x, res, scale, bias)
    return (y, h, *vjp((ct, ct_h)))

  y, h, dx, dr, ds, db = run(x, res, scale, bias, ct, ct_h)
  h_dtype = jnp.result_type(x.dtype, res.dtype)
  assert (y.dtype, h.dtype, dx.dtype, dr.dtype) == (dtype, h_dtype, dtype, res.dtype)
  (ry, rh), rvjp = jax.vjp(
      lambda x, r, s, b: pk.fused_add_rms_norm_reference(x, r, s, b, eps=EPS), *_f32(x, res), scale, bias
  )
  rdx, rdr, rds, rdb = rvjp(tuple(_f32(ct, ct_h)))
  tol = TOL[dtype]
  for got, want, what in [(y, ry, "y"), (h, rh, "h"), (dx, rdx, "dx"), (dr, rdr, "dres"),
                          (ds, rds, "dscale"), (db, rdb, "dbias")]:
    _close(got, want, tol, what)


@pytest.mark.slow
def test_backward_loop_over_several_row_blocks(monkeypatch):
  """Few backward programs, each looping over several row blocks (the layout of
  large inputs), with a ragged last program (masked body). The Mosaic GPU
  kernels have their own tests (test_rms_norm_mosaic.py)."""
  backend = "triton"
  mod = sys.modules["pallas_kernels.rms_norm"]
  monkeypatch.setattr(mod, "_BWD_TARGET_PROGRAMS", 2)
  shape = (37, 130)
  br, steps, n_prog = mod.bwd_grid(shape[0], shape[1])
  assert steps > 1 and n_prog >= 2, (br, steps, n_prog)
  x, scale, bias, ct, res, ct_h = _inputs(shape, jnp.float32, seed=5)

  @jax.jit
  def run(x, res, scale, bias, ct, ct_h):
    f = lambda x, r, s, b: pk.add_rms_norm(x, r, s, b, eps=EPS, interpret=True, backend=backend)
    (y, h), vjp = jax.vjp(f, x, res, scale, bias)
    g = jax.vjp(lambda x, s, b: pk.rms_norm(x, s, b, eps=EPS, interpret=True, backend=backend),
                x, scale, bias)[1](ct)
    return (y, h, *vjp((ct, ct_h)), *g)

  got = run(x, res, scale, bias, ct, ct_h)
  (ry, rh), rvjp = jax.vjp(lambda x, r, s, b: pk.fused_add_rms_norm_reference(x, r, s, b, eps=EPS),
                           x, res, scale, bias)
  rg = jax.vjp(lambda x, s, b: pk.rms_norm_reference(x, s, b, eps=EPS), x, scale, bias)[1](ct)
  want = (ry, rh, *rvjp((ct, ct_h)), *rg)
  names = ("y", "h", "dx", "dres", "dscale", "dbias", "rms dx", "rms dscale", "rms dbias")
  for g, w, what in zip(got, want, names):
    _close(g, w, 2e-5, what)


def test_default_on_cpu_is_xla_path():
  x, scale, bias, *_ = _inputs((4, 256), jnp.bfloat16)
  got = pk.rms_norm(x, scale, bias, eps=EPS)  # interpret=None on CPU -> XLA
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(pk.rms_norm_reference(x, scale, bias, eps=EPS), np.float32))
  y, h = pk.fused_add_rms_norm(x, x, scale, eps=EPS)
  assert y.dtype == h.dtype == jnp.bfloat16


def test_errors():
  x = jnp.ones((2, 8))
  with pytest.raises(ValueError, match="backend"):
    pk.rms_norm(x, jnp.ones(8), eps=EPS, interpret=True, backend="cuda")
  with pytest.raises(ValueError, match="scale"):
    pk.rms_norm(x, jnp.ones(7), eps=EPS)


@pytest.mark.slow
def test_compiled_mode_off_cuda_is_the_xla_expression():
  """interpret=False is decided per lowering platform: on the CPU it lowers the
  reference expression (the kernel is staged only in the CUDA branch)."""
  x, scale, bias, ct, res, _ = _inputs((4, 256), jnp.float32)
  f = jax.jit(lambda x, s, b: pk.rms_norm(x, s, b, eps=EPS, interpret=False))
  np.testing.assert_array_equal(f(x, scale, bias), jax.jit(
      lambda x, s, b: pk.rms_norm_reference(x, s, b, eps=EPS))(x, scale, bias))
  jaxpr = str(jax.make_jaxpr(f)(x, scale, bias))
  assert "platform_index" in jaxpr and "pallas_call" in jaxpr
  assert "pallas_call" not in f.lower(x, scale, bias).as_text()
  # Gradients flow through the branch (the XLA one on the CPU).
  g = jax.grad(lambda x, s, b: (pk.rms_norm(x, s, b, eps=EPS, interpret=False) * ct).sum(), argnums=(0, 1, 2))
  gr = jax.grad(lambda x, s, b: (pk.rms_norm_reference(x, s, b, eps=EPS) * ct).sum(), argnums=(0, 1, 2))
  for a, b_ in zip(jax.jit(g)(x, scale, bias), gr(x, scale, bias)):
    _close(a, b_, 1e-6, "grad")
  y, h = jax.jit(lambda x, r: pk.fused_add_rms_norm(x, r, scale, eps=EPS, interpret=False))(x, res)
  ry, rh = pk.fused_add_rms_norm_reference(x, res, scale, eps=EPS)
  _close(y, ry, 1e-6, "fused y")
  _close(h, rh, 0.0, "fused h")


def test_export_for_cpu_and_cuda():
  """jax.export with both platforms: one artifact, kernel in the CUDA branch, runs on CPU.

  Lowering for CUDA needs no CUDA plugin, so this runs in every environment."""
  from jax import export

  def f(x, r, s):
    return pk.add_rms_norm(x, r, s, eps=EPS, interpret=False)

  x = jax.random.normal(jax.random.key(1), (64, 256), jnp.bfloat16)
  s = jnp.linspace(0.5, 1.5, 256)
  exp = export.export(jax.jit(f), platforms=("cpu", "cuda"),
                      disabled_checks=pk.export_disabled_checks())(x, x, s)
  assert exp.platforms == ("cpu", "cuda")
  text = exp.mlir_module()
  assert text.count("__gpu$xla.gpu.triton") == 1, "the kernel is lowered once, in the CUDA branch"
  exp2 = export.deserialize(exp.serialize())
  got = exp2.call(x, x, s)
  want = pk.fused_add_rms_norm_reference(x, x, s, eps=EPS)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))

  # A training step: the CUDA branches hold the forward and the backward kernel.
  def loss(x, r, s, b):
    y, h = pk.add_rms_norm(x, r, s, b, eps=EPS, interpret=False)
    return (y.astype(jnp.float32) ** 2).sum() + (h.astype(jnp.float32) * 0.5).sum()

  def ref_loss(x, r, s, b):
    y, h = pk.fused_add_rms_norm_reference(x, r, s, b, eps=EPS)
    return (y.astype(jnp.float32) ** 2).sum() + (h.astype(jnp.float32) * 0.5).sum()

  x32, b = x.astype(jnp.float32), jnp.full((256,), 0.1)
  grad = jax.grad(loss, argnums=(0, 1, 2, 3))
  exp = export.export(jax.jit(grad), platforms=("cpu", "cuda"),
                      disabled_checks=pk.export_disabled_checks())(x32, x32, s, b)
  text = exp.mlir_module()
  assert text.count("__gpu$xla.gpu.triton") == 2
  assert "fused_add_rms_norm_fwd" in text and "fused_add_rms_norm_bwd" in text
  got = export.deserialize(exp.serialize()).call(x32, x32, s, b)
  want = jax.grad(ref_loss, argnums=(0, 1, 2, 3))(x32, x32, s, b)
  for g, w in zip(got, want):
    _close(g, w, 1e-6, "exported grad")


def test_gpu_target_sets_the_gpu_the_kernels_lower_for():
  """jax 0.11 lowers Triton kernels for the GPU of the abstract mesh (a CPU host has none)."""
  from pallas_kernels import _compat

  info = _compat._triton_gpu_info()
  if info is None:
    assert isinstance(_compat.gpu_target(), type(_compat.gpu_target("NVIDIA A100")))
    pytest.skip(f"jax {jax.__version__} lowers without an abstract GPU (compute capability 9.0 without one)")
  has_gpu = any(d.platform == "gpu" for d in jax.local_devices())
  if not has_gpu:
    with pytest.raises(ValueError):
      info.get_gpu_info()  # what the export failed on
  with _compat.gpu_target():
    want = info.get_gpu_info_from_version(info.GpuVersion.H100)
    assert has_gpu or info.get_gpu_info() == want
  with _compat.gpu_target("NVIDIA A100-SXM4-80GB"):
    assert info.get_gpu_info().compute_capability == 80
  # A GPU the caller chose with an abstract mesh wins over the default.
  a100 = jax.sharding.AbstractDevice(device_kind="NVIDIA A100", num_cores=None, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=a100)):
    with _compat.gpu_target():
      assert info.get_gpu_info().compute_capability == 80
  with pytest.raises(ValueError, match="not a GPU"):
    _compat.gpu_target("cpu")


def test_supports():
  assert pk.supports((2, 3, 768), jnp.bfloat16) and pk.supports((1, 1), "float16")
  assert pk.supports((8, pk.MAX_HIDDEN), jnp.float32)
  assert not pk.supports((8, pk.MAX_HIDDEN + 1), jnp.float32)
  assert not pk.supports((8, 64), jnp.float64) and not pk.supports((8, 64), jnp.int32)
  assert not pk.supports((0, 64), jnp.float32) and not pk.supports((), jnp.float32)
  assert "hidden size" in pk.unsupported_reason((2, 10**5), jnp.float32)
  # Unsupported shapes take the XLA expression, even with interpret=False.
  def staged(shape):
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    return "pallas_call" in str(jax.make_jaxpr(
        lambda x: pk.rms_norm(x, jnp.ones(shape[-1]), eps=EPS, interpret=False))(x))

  assert staged((2, 8)) and not staged((2, 2 * pk.MAX_HIDDEN))


def test_backend_availability_is_explicit():
  assert "triton" in pk.available_backends()
  for b in ("triton", "mosaic_gpu"):
    if b in pk.available_backends():
      assert pk.resolve_backend(b, interpret=False) == b
    else:
      with pytest.raises(RuntimeError, match="unavailable"):
        pk.resolve_backend(b, interpret=False)


def test_choose_table_and_override():
  assert pk.choose((16384, 4096), jnp.bfloat16) == "pallas"
  assert pk.choose((16384, 128), jnp.float32) == "xla"
  assert pk.choose((8, 4096), jnp.float32) == "xla"
  try:
    pk.set_rules([pk.Rule("float32", 1, 10**9, 1)])
    assert pk.choose((8, 64), jnp.float32) == "pallas"
    assert pk.choose((8, 64), jnp.bfloat16) == "xla"  # no matching rule
  finally:
    pk.set_rules(None)
  assert dispatch.get_rules() == dispatch.DEFAULT_RULES


def test_benchmark_smoke(tmp_path):
  path = os.path.join(ROOT, "benchmarks", "bench_rms_norm.py")
  spec = importlib.util.spec_from_file_location("bench_rms_norm", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = tmp_path / "bench.md"
  rows = bench.main(["--interpret", "--small", "--hidden", "130", "--dtypes", "bfloat16", "--out", str(out)])
  text = out.read_text()
  assert "| pallas-triton |" in text and "| copy |" in text and "xla-layernorm" in text
  assert {r["variant"] for r in rows} == {"pallas-triton", "xla-rmsnorm", "xla-layernorm", "copy"}
  assert all(r["gbps"] > 0 for r in rows)
  assert isinstance(bench.suggest_rules(rows), list)


@pytest.mark.parametrize("fused", [False, True])
def test_a_large_eps_is_added_to_the_mean_square(fused):
  """ε against a float64 NumPy formula where it dominates (x ~ 0.1, ε = 0.5,
  a ragged hidden of 20): ``rsqrt(Σx²/n + ε)``, not ``rsqrt((Σx² + ε)/n)``."""
  r = np.random.default_rng(6)
  x = (r.normal(size=(5, 20)) * 0.1).astype(np.float32)
  res = (r.normal(size=(5, 20)) * 0.1).astype(np.float32)
  scale, bias = r.normal(size=20).astype(np.float32), r.normal(size=20).astype(np.float32)
  h = x.astype(np.float64) + (res if fused else 0)
  want = h / np.sqrt((h * h).mean(-1, keepdims=True) + 0.5) * scale + bias
  if fused:
    got, _ = pk.add_rms_norm(jnp.asarray(x), jnp.asarray(res), jnp.asarray(scale), jnp.asarray(bias), eps=0.5,
                             interpret=True)
  else:
    got = pk.rms_norm(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias), eps=0.5, interpret=True)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,hidden", [(jnp.bfloat16, 130), (jnp.float16, 64)])
def test_fused_add_normalizes_the_rounded_sum_it_writes(dtype, hidden):
  """``add_rms_norm``'s y is rms_norm of the h it returns (the sum rounded to the
  stream's dtype, what the next layer reads back), not of the unrounded float32
  sum. β ≈ −(normalized h)·γ leaves y small, so the rounding of h (≈ 2⁻⁹ of h in
  bf16) is many ulps of y: y must match the float64 formula of the rounded h to
  within y's own rounding, which normalizing the float32 sum misses by far
  (mutant Q6 of tests/mutation_study.py). A ragged and an even hidden size."""
  r = np.random.default_rng(7)
  shape = (6, hidden)
  x = jnp.asarray(r.normal(size=shape) * 2.0 + 0.3, dtype)
  res = jnp.asarray(r.normal(size=shape), dtype)
  scale = r.normal(size=hidden) * 0.5 + 1.0
  h32 = np.asarray(x, np.float64) + np.asarray(res, np.float64)   # exact in float64
  h = np.asarray(jnp.asarray(h32, jnp.float32).astype(dtype), np.float64)
  assert np.mean(h != h32) > 0.5                          # the rounding of h matters

  def formula(v, bias):
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + EPS) * scale + bias
  small = r.normal(size=hidden) * 0.01
  bias = small - formula(h, 0)[0]          # cancels row 0 exactly; other rows stay O(1)
  scale32, bias32 = jnp.asarray(scale, jnp.float32), jnp.asarray(bias, jnp.float32)
  y, h_out = pk.add_rms_norm(x, res, scale32, bias32, eps=EPS, interpret=True)
  assert bool(jnp.array_equal(h_out, jnp.asarray(h, dtype)))
  bias64 = np.asarray(bias32, np.float64)
  scale = np.asarray(scale32, np.float64)
  want = formula(h, bias64)
  got = np.asarray(y, np.float64)
  ulp = np.abs(want) * float(jnp.finfo(dtype).eps) + 1e-6
  # row 0: y ~ 0.01, where h's rounding (unnormalized: 1e-2 of |h|·γ/rms) dominates
  assert np.max(np.abs(got[0] - want[0]) / ulp[0]) <= 2, np.max(np.abs(got[0] - want[0]) / ulp[0])
  assert np.max(np.abs(got - want) / (np.abs(want) + 1)) < 2 * float(jnp.finfo(dtype).eps)
