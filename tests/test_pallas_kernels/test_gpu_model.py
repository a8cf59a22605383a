"""benchmarks/gpu_model.py: its hand-written launch lists of the Pallas kernels equal what
XLA compiles for the H100 and A100 (so the analytic model and the AOT-compiled HLO agree),
and the script runs end to end."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from pallas_kernels import aot  # noqa: E402

REASON = aot.unavailable_reason()
needs_aot = pytest.mark.skipif(REASON is not None, reason=f"deviceless CUDA compilation unavailable: {REASON}")


def _gpu_model():
  spec = importlib.util.spec_from_file_location("gpu_model", os.path.join(ROOT, "benchmarks", "gpu_model.py"))
  mod = importlib.util.module_from_spec(spec)
  sys.modules["gpu_model"] = mod  # dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.gpu_aot
@needs_aot
@pytest.mark.parametrize("target", aot.TARGETS)
@pytest.mark.parametrize("rows,hidden", [(1024, 768), (5000, 1000)])
@pytest.mark.slow
def test_analytic_pallas_launches_match_the_compiled_program(target, rows, hidden):
  gm = _gpu_model()
  for variant in ("RMSNorm (Pallas)", "add+RMSNorm (Pallas)"):
    for pass_ in gm.PASSES:
      an = gm.analytic(variant, pass_, rows, hidden)
      c = gm.compiled(variant, pass_, rows, hidden, target)
      what = (variant, pass_, [k.name for k in c.kernels])
      assert len(an) == len(c.launches), what
      # The kernels' own launches agree byte for byte; XLA's adds/sums in total.
      for name in ("rms_norm_fwd", "rms_norm_bwd", "fused_add_rms_norm_fwd", "fused_add_rms_norm_bwd"):
        a = [(x.read, x.written) for x in an if x.name == name]
        b = [(x.read, x.written) for x in c.launches if x.name == name]
        assert a == b, (name, what)
      assert sum(x.read + x.written for x in an) == sum(x.read + x.written for x in c.launches), what
      # The fused kernel is one launch per site in the forward pass.
      if variant.startswith("add+") and pass_ == "fwd":
        assert [x.name for x in c.launches] == ["fused_add_rms_norm_fwd"]


def test_script_runs_analytic_only(tmp_path, capsys):
  gm = _gpu_model()
  out = tmp_path / "gm.md"
  assert gm.main(["--no-compile", "--sizes", "2x64", "--plot-size", "2x64", "--out", str(out)]) == 0
  text = out.read_text()
  assert "a MODEL, not a measurement" in text and "not available (--no-compile)" in text
  assert text.count("| gpt2 | 2x64 |") == 8 and text.count("| gpt2-medium | 2x64 |") == 8
  # The fused kernel moves 4 activations per forward site against 5 for add + norm
  # (+ the parameter vectors and row statistics, ~0.2% here).
  fused = next(l for l in text.splitlines() if "| gpt2 | 2x64 | fwd | add+RMSNorm (Pallas)" in l)
  ratios = [float(v) for v in fused.split("|")[-2].split("/")]
  assert all(abs(r - 0.8) < 0.005 for r in ratios), ratios
  assert "| model |" in capsys.readouterr().out


# (model, batch, seq, folded sites that keep XLA's expression): ViT's final LayerNorm is
# read only at the class token, so XLA normalizes just those rows (jaxfold keeps it).
# Tiny ViT at batch 8: 136 rows, a multiple of 8 (XLA pads GEMM rows otherwise, and the
# kernel's operand would need a slice copy).
ZOO_FAST = [("gpt2-tiny", 2, 16, 0), ("opt-tiny", 2, 16, 0), ("vit-tiny", 8, None, 1)]
ZOO_FULL = [("gpt2", 2, 1024, 0), ("opt-125m", 2, 1024, 0), ("vit-b/16", 8, None, 1)]


def _check_zoo(name, batch, seq, xla_sites, target):
  gm = _gpu_model()
  r = gm.zoo_compile(name, batch, seq, target)
  orig, fold = r["orig"], r["fold"]
  what = (name, target, orig, fold)
  assert r["folded"] == r["sites"] and orig["norm_kernels"] == 0, what
  # The kernel at every folded site whose output is read in full, fused with the
  # residual add wherever an add of two activations feeds the norm (all but the
  # embeddings' norm).
  assert fold["norm_kernels"] == r["folded"] - xla_sites, what
  assert fold["fused"] == fold["norm_kernels"] - 1, what
  assert fold["spills"] == 0, what
  assert fold["launches"] < orig["launches"], what
  assert fold["bytes"] < orig["bytes"], what
  assert fold["reductions"] < orig["reductions"], what
  assert fold["flops"] == orig["flops"], what
  return r


# The bar, in the default run (~40 s): the full-size folded GPT-2, OPT and ViT
# compile for both targets with the kernel at every folded site and fewer launches/bytes.
@pytest.mark.gpu_aot
@needs_aot
@pytest.mark.parametrize("target", aot.TARGETS)
@pytest.mark.parametrize("name,batch,seq,xla_sites", ZOO_FULL)
def test_folded_zoo_launches_fewer_kernels_and_moves_fewer_bytes(name, batch, seq, xla_sites, target):
  _check_zoo(name, batch, seq, xla_sites, target)


@pytest.mark.gpu_aot
@pytest.mark.slow
@needs_aot
@pytest.mark.parametrize("target", aot.TARGETS)
@pytest.mark.parametrize("name,batch,seq,xla_sites", ZOO_FAST)
def test_folded_tiny_zoo_launches_fewer_kernels(name, batch, seq, xla_sites, target):
  _check_zoo(name, batch, seq, xla_sites, target)


@pytest.mark.gpu_aot
@needs_aot
def test_rms_matmul_launches_are_charged_their_gemm():
  """An opaque rms_matmul launch is charged 2·M·N·K flops; a grouped one (the sibling
  readers of one norm) 2·M·ΣN_i·K, one (M, N_i) result per weight."""
  import jax
  import jax.numpy as jnp

  import pallas_kernels as pk

  gm, S, bf = _gpu_model(), jax.ShapeDtypeStruct, jnp.bfloat16
  one = aot.compile(lambda x, a: pk.rms_matmul(x, a, eps=1e-5), S((8, 768), bf), S((768, 512), bf),
                    target="a100")
  group = aot.compile(lambda x, a, b: pk.rms_matmul_group(x, [a, b], eps=1e-5), S((8, 768), bf),
                      S((768, 768), bf), S((768, 512), bf), target="a100")
  for c, n in ((one, 512), (group, 1280)):
    gm.rms_matmul_work(c)
    assert [(k.name, k.flops, k.flops_dtype) for k in c.kernels] == [("rms_matmul_fwd", 2.0 * 8 * n * 768, "bf16")]
