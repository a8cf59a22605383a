"""benchmarks/train_stdlib_gpt2.py and benchmarks/quant_quality_stdlib.py: data/metric helpers, end to end (slow)."""

import json
import math
import os
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import quant_quality_stdlib as Q  # noqa: E402
import train_stdlib_gpt2 as T  # noqa: E402


def test_metrics_against_hand_computed():
  rng = np.random.default_rng(0)
  logits, ref = rng.normal(size=(2, 5, 7)), rng.normal(size=(2, 5, 7))
  targets = rng.integers(0, 7, size=(2, 5))
  m = Q.metrics(logits, targets, ref)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = -np.mean([logp[b, t, targets[b, t]] for b in range(2) for t in range(5)])
  assert m["bits_per_byte"] == pytest.approx(nll / math.log(2))
  assert m["ppl"] == pytest.approx(math.exp(nll))
  assert m["argmax_agree"] == pytest.approx(np.mean(logits.argmax(-1) == ref.argmax(-1)))
  assert Q.metrics(ref, targets, ref)["argmax_agree"] == 1.0


def test_split_by_file_and_batches():
  train, held = T.stdlib_bytes(max_files=20)
  assert len(train) > 0 and len(held) > 0 and train.dtype == np.uint8
  b = T.batches(train, 3, 16, np.random.default_rng(0))
  assert b.shape == (3, 17) and b.max() < 256


@pytest.mark.slow
def test_train_then_quality_end_to_end(tmp_path):
  out = str(tmp_path / "m.msgpack")
  meta = T.main(["--d", "32", "--layers", "1", "--heads", "2", "--ctx", "16", "--batch", "4", "--steps", "30",
                 "--max-files", "20", "--out", out])
  assert meta["steps"] == 30 and meta["final_held_out_loss"] < math.log(256)
  assert Q.main(["--params", out, "--windows", "2", "--out", str(tmp_path / "qq")]) == 0
  res = json.loads((tmp_path / "qq.json").read_text())
  formats = {r["format"] for r in res["rows"]}
  assert formats == {"float", "W8A8", "W4A8", "W4A4"}
  assert any(r["model"] == "fold+fuse+rotate(hadamard)" for r in res["rows"])
  assert "## Targets" in (tmp_path / "qq.md").read_text()
