"""The foldability table: what jaxfold folds in each model the paper evaluates.

For every model at its real configuration: normalization sites, folded without
and with auxiliary centering, auxiliary centerings inserted, extra bytes of
untied copies, fold time (analysis of the abstract model: no weights are
allocated) and the max relative error of the folded model against the
original with random γ/β and biases in float32. The error needs real weights,
so it is measured at the real configuration up to ``--max-params`` parameters
and on the family's tiny configuration above that (the table says which).

    python benchmarks/foldability_table.py --out benchmarks/results/foldability.md
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jaxfold  # noqa: E402
import models  # noqa: E402
from models.common import randomize_norms  # noqa: E402

# (name shown, registry name, tiny stand-in for the error column, paper's counts)
ROWS = [
    ("GPT-2", "gpt2", "gpt2-tiny", "0/25/25"),
    ("GPT-2 medium", "gpt2-medium", "gpt2-tiny", "–"),
    ("BERT-base", "bert-base", "bert-tiny", "24/25/25"),
    ("MiniLM-L6", "minilm-l6", "bert-tiny", "–"),
    ("ViT-B/16", "vit-b/16", "vit-tiny", "0/25/25"),
    ("OPT-125m", "opt-125m", "opt-tiny", "0/25/25"),
    ("OPT-350m", "opt-350m", "opt-350m-tiny", "–"),
    ("OPT-1.3b", "opt-1.3b", "opt-tiny", "0/25/25"),
    ("BLOOM-560m", "bloom-560m", "bloom-tiny", "5/6/6"),
    ("Phi-2", "phi-2", "phi-tiny", "0/25/25"),
    ("GPT-J-6B-sized", "gpt-j-6b-sized", "gpt-j-tiny", "–"),
    ("Swin-T", "swin-t", "swin-tiny-test", "–"),
    ("VMamba (VSSM default, depths 2-2-9-2)", "vmamba-t", "vmamba-tiny", "0/36/51"),
    ("CLIP ViT-B/32 (image features)", "clip-vit-b/32", "clip-vit-tiny", "–"),
    ("CLIP ViT-B/32 (last hidden state)", "clip-vit-b/32-hidden", "clip-vit-tiny-hidden", "–"),
    ("Whisper-base encoder", "whisper-base-encoder", "whisper-tiny-test", "–"),
    ("Wav2Vec2-base", "wav2vec2-base", "wav2vec2-tiny-test", "–"),
    ("Wav2Vec2-large-lv60", "wav2vec2-large-lv60", "wav2vec2-stable-tiny-test", "–"),
    ("LN MLP", "mlp-small", "mlp-small", "–"),
    ("GroupNorm CNN", "cnn-gn", "cnn-gn", "–"),
    ("per-position GN CNN", "cnn-gn-per-position", "cnn-gn-per-position", "–"),
]


def _inputs(spec, abstract):
  seq = None if getattr(spec, "family", "") in ("vit", "swin", "cnn", "mlp", "clip", "vmamba") else 16
  if seq is None:
    return spec.example_inputs(1, abstract=abstract)
  return spec.example_inputs(1, seq, abstract=abstract)


def _init(spec, abstract):
  seq = None if getattr(spec, "family", "") in ("vit", "swin", "cnn", "mlp", "clip", "vmamba") else 16
  if abstract:
    return spec.abstract_init(1, seq) if seq else spec.abstract_init(1)
  return spec.init(jax.random.PRNGKey(0), 1, seq) if seq else spec.init(jax.random.PRNGKey(0), 1)


def _num_params(tree) -> int:
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree))


def measure(name: str, registry: str, tiny: str, max_params: float) -> dict:
  spec = models.get(registry)
  fn = spec.apply_fn()
  abstract = _init(spec, True)
  xs = _inputs(spec, True)
  jaxfold.fold(abstract, fn, *xs, auxiliary_centering=False)  # warm-up: imports, lowering rules
  # Timed cold: a fresh function (re-traced, so no analysis is reused) and jax's caches cleared.
  fn = spec.apply_fn()
  jax.clear_caches()
  t = time.perf_counter()
  plain = jaxfold.fold(abstract, fn, *xs, auxiliary_centering=False)
  fold_s = time.perf_counter() - t
  aux = jaxfold.fold(abstract, fn, *xs, auxiliary_centering=True)
  n = _num_params(abstract)
  err_spec = spec if n <= max_params else models.get(tiny)
  p = randomize_norms(_init(err_spec, False), jax.random.PRNGKey(1))
  efn = err_spec.apply_fn()
  x = _inputs(err_spec, False)
  f = jaxfold.fold(p, efn, *x)
  ref = jax.jit(efn)(p, *x)
  out = jax.jit(f.apply_fn)(f.params, *x)
  err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
            for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(out)))
  return dict(name=name, params=n, sites=plain.report.num_sites,
              folded_plain=plain.report.num_folded, folded_aux=aux.report.num_folded,
              aux=aux.report.num_auxiliary,
              untied=max(plain.report.untied_bytes, aux.report.untied_bytes),
              untied_plain=plain.report.untied_bytes, untied_aux=aux.report.untied_bytes,
              err=err, err_on=err_spec.name, fold_s=fold_s)


def to_markdown(rows: list[dict]) -> str:
  head = ("| model | params | norm sites | folded (no aux) | folded (with aux) | aux centerings "
          "| untied copy bytes (no aux / aux) | max rel. error (f32) | fold time | paper F/F+ext/total |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
  lines = []
  for r in rows:
    err_on = "" if r["err_on"] == r["registry"] else f" ({r['err_on']})"
    lines.append(
        f"| {r['name']} | {r['params'] / 1e6:.0f}M | {r['sites']} | {r['folded_plain']} | "
        f"{r['folded_aux']} | {r['aux']} | {r['untied_plain'] / 2**20:.1f} MiB / "
        f"{r['untied_aux'] / 2**20:.1f} MiB | {r['err']:.1e}{err_on} | {r['fold_s'] * 1e3:.0f} ms | "
        f"{r['paper']} |")
  return head + "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None, help="markdown file to write")
  ap.add_argument("--only", nargs="*", default=None, help="registry names to include")
  ap.add_argument("--max-params", type=float, default=4e8,
                  help="largest model whose error is measured at full size")
  args = ap.parse_args(argv)
  rows = []
  for name, reg, tiny, paper in ROWS:
    if args.only and reg not in args.only:
      continue
    print(f"[foldability] {name} ...", file=sys.stderr, flush=True)
    r = measure(name, reg, tiny, args.max_params)
    r.update(registry=reg, paper=paper)
    rows.append(r)
  md = (f"Measured {time.strftime('%Y-%m-%d')} on {jax.devices()[0].device_kind} "
        f"(jax {jax.__version__}); fold time = trace + analysis + plan of the abstract model "
        f"(a fresh function, jax caches cleared).\n\n"
        + to_markdown(rows))
  print(md)
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
      fh.write(md)
  return rows


if __name__ == "__main__":
  main()
