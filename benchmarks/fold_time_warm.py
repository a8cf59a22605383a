"""Fold time of GPT-2 small in a warm process (the issue's ≤ 0.5 s target).

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
  t = time.perf_counter()
  jax.block_until_ready(jaxfold.fold(p, fn, *x).params)
  first = time.perf_counter() - t
  times = []
  for _ in range(args.repeats):
    t = time.perf_counter()
    jax.block_until_ready(jaxfold.fold(p, fn, *x).params)
    times.append(time.perf_counter() - t)
  line = (f"{args.model} batch {args.batch} x {args.seq} on {jax.devices()[0].device_kind}: "
          f"first fold {first * 1e3:.0f} ms, later folds median {statistics.median(times) * 1e3:.0f} ms "
          f"(min {min(times) * 1e3:.0f} ms, {args.repeats} runs)")
  print(line)
  return line


if __name__ == "__main__":
  main()
