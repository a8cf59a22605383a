"""First-call time of an un-jitted ``folded.apply_fn`` at each new shape, beside ``jax.jit`` of it
and the original ``apply_fn`` (what a user who calls the folded function directly waits).

Each variant runs in a fresh process (nothing compiled yet), at two shapes in turn, then once
more at the first shape (a cached call).

    python benchmarks/first_call.py [--model gpt2-tiny --shapes 2x16,3x9]
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def _one(model: str, variant: str, shapes: list) -> dict:
  import jax

  import jaxfold
  import models
  spec = models.get(model)
  b0, s0 = shapes[0]
  params = models.random_params(spec, b0, s0, seed=0)
  folded = jaxfold.fold(params, spec.apply_fn(), *spec.example_inputs(b0, s0))
  fn, p = {"folded": (folded.apply_fn, folded.params),
           "folded, jax.jit": (jax.jit(folded.apply_fn), folded.params),
           "original": (spec.apply_fn(), params)}[variant]
  out = {}
  for b, s in shapes + shapes[:1]:
    args = spec.example_inputs(b, s)
    t = time.perf_counter()
    jax.block_until_ready(fn(p, *args))
    out.setdefault(f"{b}x{s}", []).append(round(time.perf_counter() - t, 3))
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="gpt2-tiny")
  ap.add_argument("--shapes", default="2x16,3x9")
  ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)   # the child process
  args = ap.parse_args(argv)
  shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
  if args.variant:
    print(json.dumps(_one(args.model, args.variant, shapes)))
    return
  print(f"{args.model}, first call at each shape then again at the first (seconds, fresh process each):")
  for variant in ("folded", "folded, jax.jit", "original"):
    r = subprocess.run([sys.executable, __file__, "--model", args.model, "--shapes", args.shapes,
                        "--variant", variant], capture_output=True, text=True, check=True)
    print(f"  {variant:16s} {r.stdout.strip().splitlines()[-1]}")


if __name__ == "__main__":
  main()
