"""How long does `jaxfold.fold` take?  Trace + analysis + parameter transform, per model.

For each model and (batch, seq) the script measures, median of --repeats:

- trace:     `jax.make_jaxpr(apply_fn)` on abstract parameters (what any analysis pays),
- analysis:  `jaxfold.fold` on abstract parameters (ShapeDtypeStructs: no weights exist)
             minus the trace time,
- transform: `jaxfold.fold` on real parameters minus `fold` on abstract ones (centering
             the weights); only for models below --max-alloc parameters, since the weights
             must be allocated (random, numpy-drawn).

The paper reports 35-180 ms per fold on GPUs.  Example (the CPU defaults):

    python benchmarks/bench_fold.py --out benchmarks/results/fold_cpu.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import _common as C

DEFAULT_MODELS = ("gpt2-tiny,bert-tiny,vit-tiny,minilm-l6,gpt2,bert-base,opt-125m,vit-b/16,"
                  "bloom-560m,gpt2-medium,opt-1.3b,phi-2,gpt-j-6b-sized")


def median_time(fn, repeats: int, keep: list | None = None) -> float:
  """Cold timings: jax's tracing/compilation caches are cleared before each run, and
  ``fn`` builds a fresh apply function, so nothing is reused from the previous run."""
  import jax
  ts = []
  for _ in range(repeats):
    jax.clear_caches()
    t0 = time.perf_counter()
    r = fn()
    ts.append(time.perf_counter() - t0)
    if keep is not None:
      keep[:] = [r]
  return statistics.median(ts)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated zoo names")
  p.add_argument("--sizes", type=C.parse_sizes, default=C.parse_sizes("1x128"),
                 help="batch x seq list, e.g. 1x128,8x1024 (vision models: one size per batch)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--repeats-big", type=int, default=1,
                 help="repeats for models above --max-alloc (abstract only; slow to analyse on CPU)")
  p.add_argument("--max-alloc", type=float, default=2e8,
                 help="allocate real weights (to time the transform) below this many parameters")
  p.add_argument("--out", default=f"{C.RESULTS}/fold_cpu.md")
  p.add_argument("--png", default=None, help="PNG path (default: --out with .png)")
  args = p.parse_args(argv)

  import jax

  import jaxfold
  import models

  rows, labels, totals = [], [], []
  for name in [m.strip() for m in args.models.split(",") if m.strip()]:
    spec = models.get(name)
    seen = set()
    for batch, seq in args.sizes:
      seq = None if C.is_image(spec) else seq
      if (batch, seq) in seen:
        continue
      seen.add((batch, seq))
      ex = (spec.example_inputs(batch, abstract=True) if seq is None
            else spec.example_inputs(batch, seq, abstract=True))
      abstract = spec.abstract_init(batch, seq) if seq is not None else spec.abstract_init(batch)
      n = C.num_params(abstract)
      C.log(f"{name} {batch}x{seq or 'img'} ({n / 1e6:.1f}M params)")
      reps = args.repeats if n <= args.max_alloc else args.repeats_big
      t_trace = median_time(lambda s=spec, a=abstract, e=ex: jax.make_jaxpr(s.apply_fn())(a, *e), reps)
      kept = []
      t_abs = median_time(lambda s=spec, a=abstract, e=ex: jaxfold.fold(a, s.apply_fn(), *e), reps, kept)
      folded = kept[0]
      t_real = None
      if n <= args.max_alloc:
        params = jax.block_until_ready(C.random_params(spec, batch, seq, 0))

        def real(params=params, spec=spec, ex=ex):
          f = jaxfold.fold(params, spec.apply_fn(), *ex)
          jax.block_until_ready(f.params)
        real()
        t_real = median_time(real, args.repeats)
        del params
      rep = folded.report
      total = t_real if t_real is not None else t_abs
      rows.append({
          "model": name, "params": f"{n / 1e6:.1f}M",
          "batch x seq": f"{batch}x{seq if seq is not None else 'image'}",
          "sites folded": f"{rep.num_folded}/{rep.num_sites}", "aux": rep.num_auxiliary,
          "trace ms": f"{1e3 * t_trace:.0f}",
          "fold(abstract) ms": f"{1e3 * t_abs:.0f}",
          "analysis ms": f"{1e3 * max(t_abs - t_trace, 0):.0f}",
          "transform ms": "—" if t_real is None else f"{1e3 * max(t_real - t_abs, 0):.0f}",
          "fold total ms": f"{1e3 * total:.0f}" + ("" if t_real is not None else " (abstract)"),
      })
      labels.append(f"{name} {rows[-1]['batch x seq']}")
      totals.append(1e3 * total)
      C.log(f"  trace {1e3 * t_trace:.0f} ms, fold(abstract) {1e3 * t_abs:.0f} ms"
            + ("" if t_real is None else f", fold(real) {1e3 * t_real:.0f} ms"))

  cols = ["model", "params", "batch x seq", "sites folded", "aux", "trace ms", "fold(abstract) ms",
          "analysis ms",
          "transform ms", "fold total ms"]
  lines = C.header("jaxfold.fold time", sys.argv[1:] if argv is None else argv)
  lines += ["Median of %d cold runs each (%d for models above %.0fM parameters; jax caches cleared, a fresh "
            "apply function per run, so every run traces from scratch as a first fold in a process does). "
            "`analysis` = fold on abstract parameters minus the trace; "
            "`transform` = fold on real (random) parameters minus fold on abstract ones "
            "(— : not allocated, above --max-alloc); differences of separately measured medians, "
            "clipped at 0 where the noise exceeds them. Default options (auxiliary centering on, "
            "tied weights auto). The machine is shared; see the load average above." % (
                args.repeats, args.repeats_big, args.max_alloc / 1e6), ""]
  lines += C.markdown_table(rows, cols)
  C.write_markdown(args.out, lines)
  png = args.png or args.out.rsplit(".", 1)[0] + ".png"
  C.bar_plot(png, labels, totals, None, "fold time (ms, log scale)",
             f"jaxfold.fold time — {C.device_string()}", log_scale=True)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
