"""Folded vs original forward time, per model and batch x sequence size.

Each (model, size) is folded once (random weights with randomized γ/β), then the
jitted original, the jitted folded program and the original again (A/A) are timed
interleaved with rotated order (see `_common.py`).  The table gives medians, the
folded/original ratio (of the median times; IQR of the per-round ratios) and the A/A ratio:
a folded/original ratio inside the A/A band is not a measured difference.

CPU defaults are modest.  The paper's grid (batch 2-128 x seq 64-16384) is
`--grid paper`; combinations above --max-gib (attention scores + activations
estimate) or beyond a model's position table are skipped and listed.

    python benchmarks/bench_forward.py --out benchmarks/results/forward_cpu.md
    python benchmarks/bench_forward.py --grid paper --models gpt2,bert-base,opt-125m \\
        --out benchmarks/results/forward_gpu.md                     # on a GPU
"""

from __future__ import annotations

import argparse
import sys

import _common as C

PAPER_BATCHES = (2, 8, 32, 128)
PAPER_SEQS = (64, 256, 1024, 4096, 16384)


def estimate_gib(spec, batch: int, seq: int) -> float:
  """Rough peak activation memory: fp32 attention scores of one layer (x3 for softmax
  temporaries) plus a few residual-stream-sized buffers per layer."""
  c = spec.config
  heads = next((getattr(c, k) for k in ("n_head", "num_attention_heads") if hasattr(c, k)), 1)
  d = next((getattr(c, k) for k in ("n_embd", "hidden_size") if hasattr(c, k)), 1)
  layers = next((getattr(c, k) for k in ("n_layer", "num_hidden_layers") if hasattr(c, k)), 1)
  scores = 3 * 4 * batch * heads * seq * seq
  acts = 4 * batch * seq * d * 8 * layers
  return (scores + acts) / 2**30


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="minilm-l6,gpt2,opt-125m,vit-b/16")
  p.add_argument("--sizes", type=C.parse_sizes, default=C.parse_sizes("1x64,4x128"),
                 help="batch x seq list (vision models: the batch only, at the configured image size)")
  p.add_argument("--grid", choices=("paper",), help="use the paper's batch x seq grid instead of --sizes")
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--max-gib", type=float, default=4.0, help="skip sizes estimated above this")
  p.add_argument("--no-auxiliary", action="store_true")
  p.add_argument("--out", default=f"{C.RESULTS}/forward_cpu.md")
  p.add_argument("--png", default=None, help="PNG path (default: --out with .png)")
  args = p.parse_args(argv)
  sizes = C.grid(PAPER_BATCHES, PAPER_SEQS) if args.grid == "paper" else args.sizes

  import jax

  import jaxfold
  import models
  from jaxfold.benchmarking import max_rel_err as _max_rel_err

  rows, skipped, labels, ratios, noise = [], [], [], [], []
  for name in [m.strip() for m in args.models.split(",") if m.strip()]:
    spec = models.get(name)
    seen = set()
    for batch, seq in sizes:
      if C.is_image(spec):
        seq = None
      if (batch, seq) in seen:
        continue
      seen.add((batch, seq))
      size = f"{batch}x{seq if seq is not None else 'image'}"
      if seq is not None:
        mp = C.max_positions(spec)
        if mp is not None and seq > mp:
          skipped.append(f"{name} {size}: seq > {mp} positions")
          continue
        if estimate_gib(spec, batch, seq) > args.max_gib:
          skipped.append(f"{name} {size}: ~{estimate_gib(spec, batch, seq):.1f} GiB > --max-gib")
          continue
      C.log(f"{name} {size}")
      params = C.random_params(spec, batch, seq, 0)
      apply = spec.apply_fn()
      ex = spec.example_inputs(batch) if seq is None else spec.example_inputs(batch, seq)
      folded = jaxfold.fold(params, apply, *ex, auxiliary_centering=not args.no_auxiliary)
      orig_j = jax.jit(lambda p_, *a, g=apply: g(p_, *a))
      fold_j = jax.jit(lambda p_, *a, f=folded: f.apply_fn(p_, *a))
      err = _max_rel_err(orig_j(params, *ex), fold_j(folded.params, *ex))
      s = C.compare_forward(apply, params, folded, ex, rounds=args.rounds, warmup=args.warmup,
                            jitted=(orig_j, fold_j))
      r = s["ratio"]["folded"]
      q1, q3 = s["ratio_iqr"]["folded"]
      rep = folded.report
      rows.append({
          "model": name, "batch x seq": size,
          "folded": f"{rep.num_folded}/{rep.num_sites}" + (f" +{rep.num_auxiliary} aux" if rep.num_auxiliary else ""),
          "original ms": f"{s['median_ms']['original']:.2f}", "folded ms": f"{s['median_ms']['folded']:.2f}",
          "folded/original": f"{r:.3f}", "IQR": f"{q1:.3f}–{q3:.3f}",
          "A/A": f"{s['ratio']['original A/A']:.3f}", "max rel err": f"{err:.1e}",
      })
      labels.append(f"{name} {size}")
      ratios.append(r)
      noise.append(s["aa_noise"])
      C.log(f"  ratio {r:.3f} (A/A {s['ratio']['original A/A']:.3f}), err {err:.1e}")
      del params, folded

  cols = ["model", "batch x seq", "folded", "original ms", "folded ms", "folded/original", "IQR",
          "A/A", "max rel err"]
  lines = C.header("Folded vs original forward time", sys.argv[1:] if argv is None else argv)
  lines += [f"jit, interleaved with rotated order, {args.rounds} rounds after {args.warmup} warm-up "
            "calls; ratio = median of per-round folded/original; A/A = the original executable "
            "timed against itself in the same rounds (|A/A − 1| is the noise floor). Random "
            "weights with randomized γ/β; max rel err = max|orig − folded| / max|orig|.", ""]
  lines += C.markdown_table(rows, cols)
  if skipped:
    lines += ["", "Skipped: " + "; ".join(skipped) + "."]
  C.write_markdown(args.out, lines)
  png = args.png or args.out.rsplit(".", 1)[0] + ".png"
  C.bar_plot(png, labels, ratios, noise, "folded / original time (error bar: A/A noise)",
             f"forward time ratio — {C.device_string()}", hline=1.0)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
