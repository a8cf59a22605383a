"""Sites deferred by ``jaxfold.defer_norms`` on the zoo, and the error against the original.

Per model: norm sites folded, affine sites fused, fused norms deferred (readers
contract the un-normalized input), the deferral's analysis time, and the max
relative error of the deferred model against the *original* (unfolded) one with
random non-uniform γ, β and biases, in float64 at two input shapes (float32 with
``--f32``). Sites not deferred are listed with the reason.

    python benchmarks/defer_sites.py                      # tiny configurations, float64
    python benchmarks/defer_sites.py --models gpt2,opt-125m --f32
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jaxfold  # noqa: E402
import models  # noqa: E402
from models.common import max_rel_err  # noqa: E402


def _random(spec, shape, dtype, seed=0):
  """Float parameters of ``dtype`` with non-uniform vectors (γ, β, biases) of non-zero mean."""
  rng = np.random.default_rng(seed)
  shapes_ = jax.eval_shape(lambda: spec.init(jax.random.key(0), *shape))

  def leaf(s):
    if len(s.shape) <= 1:
      return np.asarray(1.0 + 0.5 * (rng.normal(size=s.shape) + rng.uniform(-1, 1)), dtype)
    return np.asarray(0.1 * rng.normal(size=s.shape), dtype)
  return jax.tree_util.tree_map(leaf, shapes_)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", default="gpt2-tiny,opt-tiny,phi-tiny,vit-tiny,bert-tiny")
  ap.add_argument("--f32", action="store_true", help="float32 instead of float64")
  a = ap.parse_args()
  if not a.f32:
    jax.config.update("jax_enable_x64", True)
  print("| model | folded | fused | deferred | defer analysis | max rel. error vs original |")
  print("|---|---:|---:|---:|---:|---:|")
  notes = []
  for name in a.models.split(","):
    spec = models.get(name)
    shapes = [(2, None), (3, None)] if name.startswith("vit") else [(2, 8), (3, 5)]
    params = _random(spec, shapes[0], np.float32 if a.f32 else np.float64)
    apply = spec.apply_fn()
    folded = jaxfold.fold(params, apply, *spec.example_inputs(*shapes[0]), tied_weights="copy")
    fused = jaxfold.fuse_affine(folded)
    t = time.perf_counter()
    d = jaxfold.defer_norms(fused)
    dt = time.perf_counter() - t
    err = max(max_rel_err(jax.jit(apply)(params, *spec.example_inputs(*s)),
                          jax.jit(d.apply_fn)(d.params, *spec.example_inputs(*s))) for s in shapes)
    r = d.report
    print(f"| {name} | {folded.report.num_folded}/{len(folded.report.sites)} | "
          f"{r.num_fused}/{len(r.sites)} | {r.num_deferred}/{len(r.deferred)} | {dt:.2f} s | "
          f"{err:.1e} |", flush=True)
    notes += [f"* {name}: {s.where}: {s.reason}" for s in r.deferred if not s.deferred]
  print("\n".join(notes[:20]))


if __name__ == "__main__":
  main()
