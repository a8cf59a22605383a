"""The training examples run (``--smoke``) and write their curves and tables;
LN and CBWC start from the same function, so their step-1 losses agree."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _load(name):
  # In-process (one interpreter start-up for both examples).
  spec = importlib.util.spec_from_file_location(f"_example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod   # flax dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.parametrize("name", ["train_digits", "train_char_gpt"])
def test_example_smoke(name, tmp_path):
  pytest.importorskip("matplotlib")
  if name == "train_digits":
    pytest.importorskip("sklearn")
  out = tmp_path / name
  _load(name).main(["--smoke", "--out", str(out)])
  assert (out / "curves.png").stat().st_size > 1000
  md = (out / "results.md").read_text()
  assert "CBWC + RMSNorm" in md and "LayerNorm" in md and "RMSNorm (swapped)" in md
  res = json.loads((out / "results.json").read_text())
  assert set(res) == {"ln", "rms", "cbwc"}
  ln, cbwc = res["ln"]["losses"], res["cbwc"]["losses"]
  assert len(ln) == len(cbwc) == 5
  assert abs(ln[0] - cbwc[0]) <= 1e-5 * abs(ln[0])        # same function at step 1
  assert max(abs(a - b) for a, b in zip(ln, cbwc)) <= 1e-4  # and (up to rounding) after
  assert "LayerNorms folded" in md


def test_folded_safetensors_run_in_a_plain_rmsnorm_model(tmp_path):
  """The guide's claim: the folded file + RMSNorm (same γ, β, ε) + the auxiliary
  centering reproduce the LayerNorm model; without the auxiliary centering they do not."""
  mod = _load("rmsnorm_from_folded")
  try:
    err = mod.main(["--out", str(tmp_path)])
  finally:
    import jax
    jax.config.update("jax_enable_x64", False)
  assert err < 1e-6 and (tmp_path / "model.safetensors").exists()
