"""pallas_kernels.rms_matmul: ``(x @ w) * rsqrt(mean(x²) + ε)`` in one kernel.

CPU: the kernel in Pallas interpret mode against the pure-jnp reference (float32,
bfloat16, float64; ragged M/N/K, one row, both weight layouts), the XLA path,
and the gradient (custom VJP = the reference's). ``gpu_aot``: compiled ahead of
time for the H100 and A100, one launch and no reduction besides it, no register spills.
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
from pallas_kernels import aot  # noqa: E402
from pallas_kernels.rms_matmul import KERNEL, tiles  # noqa: E402

EPS = 1e-5


def _operands(m, k, n, dtype, w_nk=False, lead=()):
  kx, kw = jax.random.split(jax.random.key(m * 1000 + k + n))
  # A non-zero mean per row, so the statistic is not ~1 and a wrong one shows.
  x = (jax.random.normal(kx, (*lead, m, k)) * 2.0 + 0.5).astype(dtype)
  w = (jax.random.normal(kw, (n, k) if w_nk else (k, n)) / np.sqrt(k)).astype(dtype)
  return x, w


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _numpy(x, w, eps, w_nk):
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  s = 1 / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
  return (x @ (w.T if w_nk else w)) * s


# (m, k, n, w_nk, lead): one row; ragged M, N and K against every tile; a leading batch dim;
# the (N, K) layout of a tied head.
SHAPES = [(1, 40, 24, False, ()), (70, 130, 50, False, ()), (5, 33, 17, True, ()), (3, 64, 40, False, (2,)),
          (1, 16, 70, True, (3,))]


@pytest.mark.parametrize("m,k,n,w_nk,lead", SHAPES)
def test_float32_matches_the_reference(m, k, n, w_nk, lead):
  x, w = _operands(m, k, n, jnp.float32, w_nk, lead)
  got = pk.rms_matmul(x, w, eps=EPS, w_nk=w_nk, interpret=True)
  assert got.shape == (*lead, m, n) and got.dtype == jnp.float32
  assert _rel(got, pk.rms_matmul_reference(x, w, eps=EPS, w_nk=w_nk)) < 1e-5
  assert _rel(got, _numpy(x, w, EPS, w_nk)) < 1e-5
  b = jnp.linspace(-1.0, 2.0, n, dtype=jnp.float32)
  got = pk.rms_matmul(x, w, b, eps=EPS, w_nk=w_nk, interpret=True)
  assert _rel(got, _numpy(x, w, EPS, w_nk) + np.asarray(b)) < 1e-5


@pytest.mark.parametrize("m,k,n,w_nk,lead", SHAPES[:3])
def test_bfloat16_within_one_rounding(m, k, n, w_nk, lead):
  x, w = _operands(m, k, n, jnp.bfloat16, w_nk, lead)
  got = pk.rms_matmul(x, w, eps=EPS, w_nk=w_nk, interpret=True)
  assert got.dtype == jnp.bfloat16
  # float32 accumulation, one rounding to bf16 at the end (2^-8 relative).
  assert _rel(got, _numpy(x, w, EPS, w_nk)) < 2 ** -7
  assert _rel(got, pk.rms_matmul_reference(x, w, eps=EPS, w_nk=w_nk)) < 2 ** -7


def test_wider_x_for_the_statistic_and_out_dtype():
  """x in float32 (the statistic's precision), w in bf16 (the dot's), a float32 result."""
  x, _ = _operands(9, 48, 20, jnp.float32)
  _, w = _operands(9, 48, 20, jnp.bfloat16)
  got = pk.rms_matmul(x, w, eps=EPS, out_dtype=jnp.float32, interpret=True)
  ref = pk.rms_matmul_reference(x, w, eps=EPS, out_dtype=jnp.float32)
  assert got.dtype == jnp.float32 and _rel(got, ref) < 1e-5


def test_float64_in_interpret_mode(x64):
  x, w = _operands(7, 50, 30, jnp.float64)
  got = pk.rms_matmul(x, w, eps=EPS, interpret=True)
  assert got.dtype == jnp.float64 and _rel(got, _numpy(x, w, EPS, False)) < 1e-13
  # (a wrong ε is visible at this precision)
  assert _rel(pk.rms_matmul(x, w, eps=2 * EPS, interpret=True), _numpy(x, w, EPS, False)) > 1e-7


@pytest.mark.parametrize("m,k,n,w_nk,lead", SHAPES[1:3])
def test_two_biases_in_the_epilogue(x64, m, k, n, w_nk, lead):
  """A tuple of bias vectors (a deferred reader's fused β·W and its own bias): each
  added after the scale, in the accumulator; the same as their sum added once."""
  x, w = _operands(m, k, n, jnp.float64, w_nk, lead)
  b1 = jnp.linspace(-1.0, 2.0, n, dtype=jnp.float64)
  b2 = jnp.cos(jnp.arange(n, dtype=jnp.float64))
  want = _numpy(x, w, EPS, w_nk) + np.asarray(b1) + np.asarray(b2)
  for bias in ((b1, b2), [b1, b2]):
    assert _rel(pk.rms_matmul(x, w, bias, eps=EPS, w_nk=w_nk, interpret=True), want) < 1e-13
    assert _rel(pk.rms_matmul_reference(x, w, bias, eps=EPS, w_nk=w_nk), want) < 1e-13
  assert _rel(pk.rms_matmul(x, w, (b1,), eps=EPS, w_nk=w_nk, interpret=True), want - np.asarray(b2)) < 1e-13
  with pytest.raises(ValueError, match="bias must have shape"):
    pk.rms_matmul(x, w, (b1, b2[:-1]), eps=EPS, w_nk=w_nk)
  ct = jnp.ones_like(want)
  gb = jax.vjp(lambda b: pk.rms_matmul(x, w, b, eps=EPS, w_nk=w_nk, interpret=True), (b1, b2))[1](ct)[0]
  assert all(np.allclose(g, np.prod(want.shape[:-1])) for g in gb)


@pytest.mark.parametrize("w_nk", [False, True])
def test_group_is_one_rms_matmul_per_weight(x64, w_nk):
  """``rms_matmul_group``: each weight's output (ragged widths, a leading batch dim,
  per-weight biases: none, one, two) equals ``rms_matmul`` of that weight alone;
  the XLA path and the gradient are the reference's."""
  x, _ = _operands(5, 33, 1, jnp.float64, lead=(2,))
  ns = (24, 17, 70)
  ws = [_operands(5, 33, n, jnp.float64, w_nk)[1] * (1 + i) for i, n in enumerate(ns)]
  bs = [None, jnp.linspace(-1.0, 2.0, 17), (jnp.cos(jnp.arange(70.0)), jnp.ones(70))]
  got = pk.rms_matmul_group(x, ws, bs, eps=EPS, w_nk=w_nk, interpret=True)
  assert [g.shape for g in got] == [(2, 5, n) for n in ns]
  for g, w, b in zip(got, ws, bs):
    extra = () if b is None else b if isinstance(b, tuple) else (b,)
    want = _numpy(x, w, EPS, w_nk) + sum(np.asarray(v) for v in extra)
    assert _rel(g, want) < 1e-13
    assert _rel(g, pk.rms_matmul(x, w, b, eps=EPS, w_nk=w_nk, interpret=True)) < 1e-13
  for g, r in zip(pk.rms_matmul_group(x, ws, bs, eps=EPS, w_nk=w_nk), got):
    assert _rel(g, r) < 1e-13
  ct = [jnp.ones_like(g) for g in got]
  f = lambda x, ws: pk.rms_matmul_group(x, ws, bs, eps=EPS, w_nk=w_nk, interpret=True)
  r = lambda x, ws: tuple(pk.rms_matmul_reference(x, w, b, eps=EPS, w_nk=w_nk) for w, b in zip(ws, bs))
  for g, h in zip(jax.tree.leaves(jax.vjp(f, x, ws)[1](tuple(ct))), jax.tree.leaves(jax.vjp(r, x, ws)[1](tuple(ct)))):
    assert _rel(g, h) < 1e-12
  with pytest.raises(ValueError, match="one dtype"):
    pk.rms_matmul_group(x, [ws[0], ws[1].astype(jnp.float32)], eps=EPS, w_nk=w_nk)


def test_xla_path_off_cuda_is_the_reference():
  x, w = _operands(4, 32, 8, jnp.float32)
  ref = jax.jit(lambda x, w: pk.rms_matmul_reference(x, w, eps=EPS))(x, w)
  for interpret in (None, False):
    f = jax.jit(lambda x, w, i=interpret: pk.rms_matmul(x, w, eps=EPS, interpret=i))
    assert "triton" not in f.lower(x, w).as_text()    # the CPU lowering keeps the XLA branch only
    assert np.array_equal(f(x, w), ref)
  with pytest.raises(ValueError, match="K = 32"):
    pk.rms_matmul(x, w.T, eps=EPS)


def test_gradient_is_the_references():
  x, w = _operands(6, 40, 12, jnp.float32)
  ct = jax.random.normal(jax.random.key(3), (6, 12))
  def grads(f):
    return jax.vjp(f, x, w)[1](ct)
  got = grads(lambda x, w: pk.rms_matmul(x, w, eps=EPS, interpret=True))
  ref = grads(lambda x, w: pk.rms_matmul_reference(x, w, eps=EPS))
  for g, r in zip(got, ref):
    assert _rel(g, r) < 1e-5


def test_tiles_fill_an_h100_at_decode():
  bm, bn, bk, _, _ = tiles(8, 2304, 768)
  assert bm == 16 and (2304 // bn) >= 132 and bk <= 128
  assert tiles(2048, 3072, 768)[:2] == (128, 128)


# --------------------------------------------------------------------------
# Deviceless H100 compilation.
REASON = aot.unavailable_reason()
PTXAS = aot.ptxas_path()


def S(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


# GPT-2 small's readers: c_attn at decode (8 rows) and prefill (2x1024), c_fc, the tied head (N, K);
# ragged odd shapes in float32 and float16; the A100 (sm_80) at decode and prefill.
AOT_CASES = [("h100", 8, 768, 2304, False, "bfloat16"), ("h100", 2048, 768, 3072, False, "bfloat16"),
             ("h100", 8, 768, 50257, True, "bfloat16"), ("h100", 7, 130, 50, False, "float32"),
             ("h100", 1000, 1000, 1000, True, "float16"), ("h100", 2048, 768, 2304, False, "float32"),
             ("a100", 8, 768, 2304, False, "bfloat16"), ("a100", 2048, 768, 3072, False, "bfloat16")]


@pytest.mark.gpu_aot
@pytest.mark.skipif(REASON is not None, reason=f"deviceless CUDA compilation unavailable: {REASON}")
@pytest.mark.skipif(PTXAS is None, reason="ptxas not found (nvidia-cuda-nvcc-cu12, gpu-aot extra)")
@pytest.mark.parametrize("target,m,k,n,w_nk,dtype", AOT_CASES)
def test_one_launch_no_reduction(target, m, k, n, w_nk, dtype):
  dt = jnp.dtype(dtype)
  c = aot.compile(lambda x, w: pk.rms_matmul(x, w, eps=EPS, w_nk=w_nk, interpret=False),
                  S((m, k), dt), S((n, k) if w_nk else (k, n), dt), target=target)
  # One launch: the Pallas Triton kernel; no reduce fusion, no rsqrt fusion, no cuBLAS GEMM.
  assert [(kk.name, kk.kind) for kk in c.kernels] == [(KERNEL, "kCustomKernel")], c.kernels
  assert c.reductions() == 0 and "reduce(" not in c.hlo
  (kern,) = c.kernels
  assert kern.custom_call_target == "__gpu$xla.gpu.triton"
  assert kern.shared_memory <= c.target.shared_memory_per_block_optin
  if m <= 64 and n >= 16 * c.target.core_count:   # decode: enough programs for the SMs
    assert np.prod(kern.grid) >= c.target.core_count, kern.grid
  info = c.ptxas(KERNEL)
  assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_frame == 0, info


@pytest.mark.gpu_aot
@pytest.mark.skipif(REASON is not None, reason=f"deviceless CUDA compilation unavailable: {REASON}")
@pytest.mark.parametrize("target", ["h100", "a100"])
def test_two_biases_one_launch(target):
  """GPT-2's QKV at decode with the fused β·W and c_attn's own bias: still one launch."""
  dt = jnp.dtype("bfloat16")
  c = aot.compile(lambda x, w, b1, b2: pk.rms_matmul(x, w, (b1, b2), eps=EPS, interpret=False),
                  S((8, 768), dt), S((768, 2304), dt), S((2304,), dt), S((2304,), dt), target=target)
  assert [(kk.name, kk.kind) for kk in c.kernels] == [(KERNEL, "kCustomKernel")], c.kernels


@pytest.mark.gpu_aot
@pytest.mark.skipif(REASON is not None, reason=f"deviceless CUDA compilation unavailable: {REASON}")
@pytest.mark.skipif(PTXAS is None, reason="ptxas not found (nvidia-cuda-nvcc-cu12, gpu-aot extra)")
@pytest.mark.parametrize("target,m", [("h100", 8), ("a100", 8), ("a100", 2048)])
def test_group_one_launch_no_spills(target, m):
  """OPT's q, k, v (with their fused biases) as one grouped launch, no register spills."""
  dt = jnp.dtype("bfloat16")
  c = aot.compile(lambda x, a, b, v, bias: pk.rms_matmul_group(x, [a, b, v], [bias, bias, None], eps=EPS),
                  S((m, 768), dt), S((768, 768), dt), S((768, 768), dt), S((768, 768), dt), S((768,), dt),
                  target=target)
  assert [(kk.name, kk.kind) for kk in c.kernels] == [(KERNEL, "kCustomKernel")], c.kernels
  assert c.reductions() == 0
  info = c.ptxas(KERNEL)
  assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_frame == 0, info
