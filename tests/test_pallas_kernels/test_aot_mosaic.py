"""Deviceless H100 (sm_90a) compilation of the Mosaic GPU kernels (backend="mosaic_gpu").

XLA compiles the Mosaic GPU custom call on the CPU host through the CUDA plugin;
``aot.compile`` reads back its PTX, ptxas -v and launch (grid, threads,
dynamic SMEM) from the Mosaic dump. Marker ``gpu_aot``; skipped with the reason
without the gpu-aot extra. Default: forward + backward of both kernels at one
shape; the sweep is ``slow``.
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
from pallas_kernels import rms_norm_mosaic as mgpu  # noqa: E402

EPS = 1e-6
REASON = aot.unavailable_reason()
pytestmark = [
  pytest.mark.gpu_aot,
  pytest.mark.skipif(REASON is not None, reason=f"deviceless CUDA compilation unavailable: {REASON}"),
  pytest.mark.skipif("mosaic_gpu" not in pk.available_backends(), reason="no Mosaic GPU kernel API"),
]
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _program(kind):
  def norm(x, r, s, b):
    if kind == "rms_norm":
      return pk.rms_norm(x, s, b, eps=EPS, interpret=False, backend="mosaic_gpu")
    return pk.fused_add_rms_norm(x, r, s, b, eps=EPS, interpret=False, backend="mosaic_gpu")

  def f(x, r, s, b, dy, dh):
    out, vjp = jax.vjp(norm, x, r, s, b)
    return out, vjp(dy if kind == "rms_norm" else (dy, dh))

  return f


def compile_and_check(kind, dtype, rows, hidden):
  x = jax.ShapeDtypeStruct((rows, hidden), DTYPES[dtype])
  v = jax.ShapeDtypeStruct((hidden,), jnp.float32)
  c = aot.compile(_program(kind), x, x, v, v, x, x, target="h100")
  t = c.target
  itemsize = jnp.dtype(dtype).itemsize
  for name in (f"{kind}_fwd", f"{kind}_bwd"):
    assert c.launches([name]) == 1, [k.name for k in c.kernels]
    (k,) = [k for k in c.kernels if k.name == name]
    assert k.custom_call_target == aot.MOSAIC_CUSTOM_CALL_TARGET, k
    assert k.threads == (128, 1, 1), k  # one warpgroup
    # The tiles of one block of rows at least, within what a block may opt into.
    tiles = (2 if name.endswith("fwd") and kind == "rms_norm" else 3) * hidden * itemsize
    assert tiles <= k.shared_memory <= t.shared_memory_per_block_optin, k
    assert f".target {t.arch}" in c.ptx[name]
    info = c.ptxas(name)
    assert info.spill_stores == info.spill_loads == info.stack_frame == 0, info
    assert 0 < info.registers and info.registers * 128 <= t.registers_per_block_limit, info
  (fwd,) = [k for k in c.kernels if k.name == f"{kind}_fwd"]
  res = kind != "rms_norm"
  row_bytes = hidden * itemsize * (4 if res else 2)
  assert fwd.grid[0] == -(-rows // mgpu.block_rows(rows, row_bytes, hidden * 8)), fwd
  return c


@pytest.mark.parametrize("kind", ["rms_norm", "fused_add_rms_norm"])
def test_mosaic_kernels_compile_for_h100(kind):
  compile_and_check(kind, "bfloat16", 4096, 768)


SWEEP = list(itertools.product(["rms_norm", "fused_add_rms_norm"], DTYPES, (1, 7, 16384), (128, 768, 4096, 8192)))


@pytest.mark.slow
@pytest.mark.parametrize("kind,dtype,rows,hidden", SWEEP)
def test_every_mosaic_variant(kind, dtype, rows, hidden):
  compile_and_check(kind, dtype, rows, hidden)


def test_compare_backends_table():
  """Both backends launch the same kernels; the primal forward moves the same bytes
  (read the inputs once, write the outputs once, no statistics)."""
  if aot.ptxas_path() is None:
    pytest.skip("ptxas not found (nvidia-cuda-nvcc-cu12, gpu-aot extra)")
  rows = aot.compare_backends([(8, 768)])
  assert len(rows) == 8
  by = {(r["variant"], r["pass"], r["backend"]): r for r in rows}
  for variant, pass_ in itertools.product(("rms_norm", "fused_add_rms_norm"), ("fwd", "fwd+bwd")):
    tri, mos = by[(variant, pass_, "triton")], by[(variant, pass_, "mosaic_gpu")]
    if str(tri["launches"]) == "-":
      pytest.skip(f"Triton does not compile here: {tri['norm kernels']}")
    assert tri["launches"] == mos["launches"], (tri, mos)
    assert "regs" in mos["norm kernels"] and "spill 0/0" in mos["norm kernels"], mos
    if pass_ == "fwd":
      assert tri["MB"] == mos["MB"], (tri, mos)
  assert aot.markdown(rows).count("\n") == len(rows) + 1
  assert np.isfinite(float(by[("rms_norm", "fwd", "mosaic_gpu")]["us @ peak BW"]))
