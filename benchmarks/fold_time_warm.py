"""Fold time of GPT-2 small in a process: the first fold, and later ones.

`bench_fold.py` measures cold folds (caches cleared, as the first fold of a process);
this measures the first fold and then the median of later ones, real weights included.

    python benchmarks/fold_time_warm.py [--model gpt2 --batch 1 --seq 256 --repeats 5]
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402

import jaxfold  # noqa: E402
import models  # noqa: E402
from models.common import randomize_norms  # noqa: E402


def main(argv=None) -> str:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="gpt2")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args(argv)
  spec = models.get(args.model)
  fn = spec.apply_fn()
  p = randomize_norms(spec.init(jax.random.PRNGKey(0), args.batch, args.seq), jax.random.PRNGKey(1))
  x = spec.example_inputs(args.batch, args.seq)
  jax.block_until_ready((p, x))  # the fold's time, not the pending init's
  t = time.perf_counter()
  jax.block_until_ready(jaxfold.fold(p, fn, *x).params)
  first = time.perf_counter() - t
  times, fresh = [], []
  for _ in range(args.repeats):
    t = time.perf_counter()
    jax.block_until_ready(jaxfold.fold(p, fn, *x).params)
    times.append(time.perf_counter() - t)
    # A new function object: jax re-traces it, so jaxfold re-analyses the program.
    new_fn = lambda *a, _f=fn: _f(*a)  # noqa: E731
    t = time.perf_counter()
    jax.block_until_ready(jaxfold.fold(p, new_fn, *x).params)
    fresh.append(time.perf_counter() - t)
  ms = lambda v: f"{v * 1e3:.0f} ms"  # noqa: E731
  line = (f"{args.model} batch {args.batch} x {args.seq} on {jax.devices()[0].device_kind}: "
          f"first fold {ms(first)}; later folds (same program, analysis reused) median "
          f"{ms(statistics.median(times))}; later folds of a new function object (re-traced and "
          f"re-analysed) median {ms(statistics.median(fresh))} ({args.repeats} runs each)")
  print(line)
  return line


if __name__ == "__main__":
  main()
