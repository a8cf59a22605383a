"""Deviceless (ahead-of-time) CUDA compilation of the Pallas kernels for H100 and A100.

No GPU is needed: JAX's CUDA PJRT plugin compiles against the target descriptions in
``pallas_kernels/targets`` (``pip install -e ".[gpu-aot]"``). Each case compiles forward
and backward together and checks, from XLA's thunk sequence and ptxas -v on the
emitted PTX, that exactly the expected kernels are launched, for the right
architecture, without register spills and within the per-block limits.

Marker ``gpu_aot``. Default run: both kernels x both targets x f32/bf16/f16, with hidden
768/1000/4096 and 1/16384 rows rotating through them, plus odd shapes, no bias and the widest
row (18 compilations); every variant (578 compilations, about 8 min with ``-n 2``):
``python -m pytest -m "slow and gpu_aot" tests/test_pallas_kernels``.
Without the plugin wheels every test here is skipped with the reason.
"""

from __future__ import annotations

import itertools
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

EPS = 1e-6
REASON = aot.unavailable_reason()
PTXAS = aot.ptxas_path()
needs_aot = pytest.mark.skipif(REASON is not None, reason=f"deviceless CUDA compilation unavailable: {REASON}")
needs_ptxas = pytest.mark.skipif(PTXAS is None, reason="ptxas not found (nvidia-cuda-nvcc-cu12, gpu-aot extra)")
pytestmark = pytest.mark.gpu_aot
# The custom-call target of a compiled Pallas Triton kernel (jax 0.10 and 0.11).
TRITON = "__gpu$xla.gpu.triton"

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def S(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def _program(kind: str, grad: bool, bias: bool):
  """f(x, residual, scale, bias, cotangents): the kernel (and its VJP) on CUDA."""

  def norm(x, r, s, b):
    if kind == "rms_norm":
      return pk.rms_norm(x, s, b, eps=EPS, interpret=False)
    return pk.fused_add_rms_norm(x, r, s, b, eps=EPS, interpret=False)

  def f(x, r, s, b, ct):
    if not grad:
      return norm(x, r, s, b)
    out, vjp = jax.vjp(norm, x, r, s, b)
    return out, vjp(ct)

  if not bias:
    return lambda x, r, s, ct: f(x, r, s, None, ct)
  return f


def _args(kind, rows, hidden, dtype, bias):
  x = S((rows, hidden), dtype)
  vec = S((hidden,), jnp.float32)
  ct = x if kind == "rms_norm" else (x, x)
  return (x, x, vec, vec, ct) if bias else (x, x, vec, ct)


def compile_and_check(kind: str, target: str, dtype: str, hidden: int, rows: int, *, grad: bool = True,
                      bias: bool = True) -> aot.Compilation:
  c = aot.compile(_program(kind, grad, bias), *_args(kind, rows, hidden, DTYPES[dtype], bias), target=target)
  fwd, bwd = ("rms_norm_fwd", "rms_norm_bwd") if kind == "rms_norm" else (
      "fused_add_rms_norm_fwd", "fused_add_rms_norm_bwd")
  ours = [fwd, bwd] if grad else [fwd]
  assert c.launches([fwd]) == 1, [k.name for k in c.kernels]
  assert c.launches([bwd]) == int(grad), [k.name for k in c.kernels]
  t = c.target
  for k in c.kernels:
    if k.name in ours:
      # The thunk sequence launches it as a custom kernel running the Pallas Triton call.
      assert k.kind == "kCustomKernel" and k.custom_call_target == TRITON, k
      assert k.shared_memory <= t.shared_memory_per_block_optin, k
      assert 0 < np.prod(k.threads) <= 1024, k
      assert np.prod(k.grid) >= 1, k
  for name in ours:
    assert f".target {t.arch}" in c.ptx[name], f"{name} not compiled for {t.arch}"
    info = c.ptxas(name)
    assert info.spill_stores == 0 and info.spill_loads == 0, info
    assert info.stack_frame == 0, info
    threads = next(int(np.prod(k.threads)) for k in c.kernels if k.name == name)
    assert 0 < info.registers and info.registers * threads <= t.registers_per_block_limit, (info, threads)
  return c


KINDS = ("rms_norm", "fused_add_rms_norm")
# Default run: every kernel (fwd + bwd) x target x dtype once, the hidden sizes of the issue
# (768, 1000, 4096) and 1 / 16k rows rotating through them so that each kernel meets every
# (hidden, rows) pair and each target every hidden size; the full product of these (72
# compilations) is part of test_every_kernel_variant (slow) ...
DEFAULT_CASES = [(k, t, d, (768, 1000, 4096)[i % 3], (1, 16384)[(i // 3 + i // 6) % 2], True)
                 for i, (k, t, d) in enumerate(itertools.product(KINDS, aot.TARGETS, tuple(DTYPES)))]
# ... plus the widest supported row, odd row counts and no bias.
DEFAULT_CASES += [
    ("rms_norm", "h100", "float16", 8192, 16384, True),
    ("rms_norm", "a100", "bfloat16", 4096, 16384, False),
    ("fused_add_rms_norm", "h100", "float16", 4096, 7, True),
    ("fused_add_rms_norm", "a100", "bfloat16", 8192, 16384, True),
    ("fused_add_rms_norm", "h100", "float32", 5120, 1024, False),
    ("fused_add_rms_norm", "a100", "float16", 130, 3, True),
]


@needs_aot
@needs_ptxas
@pytest.mark.parametrize("kind,target,dtype,hidden,rows,bias", DEFAULT_CASES)
def test_kernel_compiles_without_spills(kind, target, dtype, hidden, rows, bias):
  compile_and_check(kind, target, dtype, hidden, rows, bias=bias)


HIDDEN_SWEEP = (128, 130, 768, 1000, 2048, 4096, 5120, 8192)
ALL_CASES = [(*c, True) for c in itertools.product(KINDS, aot.TARGETS, tuple(DTYPES), HIDDEN_SWEEP,
                                                   (1, 7, 1000, 4096, 16384))]
ALL_CASES += [(*c, 4096, False) for c in itertools.product(KINDS, aot.TARGETS, tuple(DTYPES), HIDDEN_SWEEP)]


@needs_aot
@needs_ptxas
@pytest.mark.slow
@pytest.mark.parametrize("kind,target,dtype,hidden,rows,bias", ALL_CASES)
def test_every_kernel_variant(kind, target, dtype, hidden, rows, bias):
  compile_and_check(kind, target, dtype, hidden, rows, bias=bias)


@needs_aot
@needs_ptxas
@pytest.mark.slow
@pytest.mark.parametrize("target", aot.TARGETS)
def test_max_hidden_is_where_the_backward_kernel_starts_to_spill(target):
  """MAX_HIDDEN is not arbitrary: the next supported-looking width (1.5x) spills in the
  backward kernel. If this fails, the kernels improved and MAX_HIDDEN can be raised."""
  mod = sys.modules["pallas_kernels.rms_norm"]
  wider = mod.MAX_HIDDEN * 3 // 2
  old = mod.MAX_HIDDEN
  mod.MAX_HIDDEN = wider
  try:
    c = aot.compile(_program("rms_norm", True, True), *_args("rms_norm", 16384, wider, jnp.float32, True),
                    target=target)
  finally:
    mod.MAX_HIDDEN = old
  assert c.ptxas("rms_norm_fwd").spill_stores == 0
  assert c.ptxas("rms_norm_bwd").spill_stores > 0


@needs_aot
@needs_ptxas
@pytest.mark.parametrize("kind", KINDS)
def test_forward_only_has_no_backward_kernel_and_writes_no_statistics(kind):
  rows, hidden = 4096, 2048
  c = compile_and_check(kind, "h100", "bfloat16", hidden, rows, grad=False)
  (k,) = [k for k in c.kernels if k.name in pk.FWD_KERNELS]
  act = rows * hidden * 2
  vecs = 2 * hidden * 4  # f32 scale and bias
  # Reads x (and the residual) and the vectors; writes y (and the sum): no per-row rstd.
  n = 1 if kind == "rms_norm" else 2
  assert (k.operand_bytes, k.result_bytes) == (n * act + vecs, n * act), k


@needs_aot
def test_one_function_lowers_per_platform():
  """The same jitted function runs the XLA expression on the CPU and compiles to
  the kernel for CUDA: the choice is made at lowering time."""
  f = jax.jit(lambda x, s, b: pk.rms_norm(x, s, b, eps=EPS, interpret=False))
  x = jax.random.normal(jax.random.key(0), (1024, 512), jnp.float32)
  s, b = jnp.full((512,), 1.5), jnp.full((512,), 0.25)
  np.testing.assert_allclose(f(x, s, b), pk.rms_norm_reference(x, s, b, eps=EPS), rtol=1e-6, atol=1e-6)
  assert pk.FWD_KERNELS[0] not in f.lower(x, s, b).compile().as_text()  # CPU: no kernel
  c = aot.compile(f, x, s, b, target="h100")
  assert [k.name for k in c.kernels] == ["rms_norm_fwd"]


@needs_aot
@pytest.mark.parametrize("kind", ["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("interpret", [None, False])
def test_compiled_hlo_has_the_kernel_for_h100_and_not_for_cpu(kind, interpret):
  """One jitted function, compiled twice: for the H100 its optimized HLO runs the
  Pallas Triton kernel (automatic choice included: this shape is one ``choose``
  picks), for the CPU the XLA expression with no trace of the kernel."""
  def f(x, r, s, b):
    if kind == "rms_norm":
      return pk.rms_norm(x + r, s, b, eps=EPS, interpret=interpret)
    return pk.add_rms_norm(x, r, s, b, eps=EPS, interpret=interpret)

  x, vec = S((16384, 1024), jnp.bfloat16), S((1024,), jnp.float32)
  assert pk.choose(x.shape, x.dtype) == "pallas"
  jf = jax.jit(f)
  name = "rms_norm_fwd" if kind == "rms_norm" else "fused_add_rms_norm_fwd"
  gpu = aot.compile(jf, x, x, vec, vec, target="h100")
  gpu_text = gpu.compiled.as_text()
  assert gpu_text.count(f'custom_call_target="{TRITON}"') == 1, "one kernel launch"
  assert f'name = "{name}"' in gpu_text
  assert [k.name for k in gpu.kernels if k.custom_call_target == TRITON] == [name]
  cpu_text = jf.lower(x, x, vec, vec).compile().as_text()
  for needle in (TRITON, "custom-call", "pallas_call", name):
    assert needle not in cpu_text, needle
  assert "rsqrt" in cpu_text  # ... but the XLA expression


@needs_aot
@pytest.mark.parametrize("rows,hidden,want", [(16384, 4096, 1), (8, 4096, 0), (16384, 128, 0), (16384, 16384, 0)])
def test_auto_uses_the_kernel_only_where_chosen(rows, hidden, want):
  assert pk.choose((rows, hidden), jnp.bfloat16) == ("pallas" if want else "xla") or hidden > pk.MAX_HIDDEN
  c = aot.compile(lambda x, s: pk.rms_norm(x, s, eps=EPS), S((rows, hidden), jnp.bfloat16),
                  S((hidden,), jnp.float32), target="a100")
  assert c.launches(["rms_norm_fwd"]) == want


@needs_aot
def test_vmap_of_the_kernel_compiles_to_one_launch():
  f = jax.vmap(lambda x, s: pk.rms_norm(x, s, eps=EPS, interpret=False), in_axes=(1, None))
  c = aot.compile(f, S((512, 4, 1024), jnp.bfloat16), S((1024,), jnp.float32), target="h100")
  assert c.launches(["rms_norm_fwd"]) == 1


@needs_aot
@pytest.mark.parametrize("fused", [False, True])
def test_gather_is_charged_for_the_rows_it_reads(fused):
  """An embedding lookup reads the gathered rows, not the table: the traffic model
  charges the gather's result for an operand read only by gathers (plain or fused)."""
  vocab, d, b, s = 50000, 768, 2, 16
  table = jax.ShapeDtypeStruct((vocab, d), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((b, s), jnp.int32)
  fn = (lambda t, i: (t[i] * 2).astype(jnp.float32)) if fused else (lambda t, i: t[i])
  c = aot.compile(fn, table, ids, target="h100")
  rows = b * s * d * 2
  assert c.hbm_bytes < vocab * d * 2 / 10, [(k.name, k.operand_bytes, k.result_bytes) for k in c.kernels]
  reads = sum(k.operand_bytes for k in c.kernels)
  assert rows <= reads <= rows + b * s * 4 + 64, [(k.name, k.operand_bytes) for k in c.kernels]
