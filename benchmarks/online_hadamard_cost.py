"""What ``jaxfold.online_hadamard`` rotates on the zoo, its error and its measured cost.

Per model: the contractions rotated online (kind, width, Hadamard), the
analysis time, the max relative error of fold → fuse_affine → online_hadamard
against the original (random non-uniform γ, β and biases; float32, or float64
with ``--f64``), and the forward time of the fused program with and without
the online Hadamards (interleaved rounds, median and the ratio's 95% interval),
on this machine's default device.

    python benchmarks/online_hadamard_cost.py                         # gpt2, opt-125m at 1×128
    python benchmarks/online_hadamard_cost.py --models gpt2-tiny --f64 --rounds 3
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
from jaxfold import benchmarking  # noqa: E402


def _random(spec, batch, seq, dtype, seed=0):
  """Float parameters of ``dtype`` with non-uniform vectors (γ, β, biases) of non-zero mean."""
  rng = np.random.default_rng(seed)
  shapes_ = jax.eval_shape(lambda: spec.init(jax.random.key(0), batch, seq))

  def leaf(s):
    if len(s.shape) <= 1:
      return np.asarray(1.0 + 0.5 * (rng.normal(size=s.shape) + rng.uniform(-1, 1)), dtype)
    return np.asarray(0.02 * rng.normal(size=s.shape), dtype)
  return jax.tree_util.tree_map(leaf, shapes_)


def run(name: str, batch: int, seq: int, dtype, rounds: int) -> None:
  spec = models.get(name)
  params = _random(spec, batch, seq, dtype)
  args = spec.example_inputs(batch, seq)
  apply = spec.apply_fn()
  fused = jaxfold.fuse_affine(jaxfold.fold(params, apply, *args, tied_weights="copy"))
  t0 = time.perf_counter()
  online = jaxfold.online_hadamard(fused)
  analysis_s = time.perf_counter() - t0
  print(f"\n## {name} ({batch}×{seq}, {np.dtype(dtype).name}): online_hadamard analysis {analysis_s:.2f} s")
  print(online.report)
  ref = jax.jit(apply)(params, *args)
  f_fused, f_online = jax.jit(fused.apply_fn), jax.jit(online.apply_fn)
  err = benchmarking.max_rel_err(ref, f_online(online.params, *args))
  print(f"max relative error against the original: {err:.2e} "
        f"(fused alone: {benchmarking.max_rel_err(ref, f_fused(fused.params, *args)):.2e})")
  times = benchmarking.time_variants({
      "fused": lambda: jax.block_until_ready(f_fused(fused.params, *args)),
      "online": lambda: jax.block_until_ready(f_online(online.params, *args))}, rounds=rounds)
  s = benchmarking.summarize_timings(times, "fused", ["online"])
  lo, hi = s["ratio_ci"]["online"]
  print(f"forward on {benchmarking.device_string()}: fused {s['median_ms']['fused']:.3f} ms, with online "
        f"Hadamards {s['median_ms']['online']:.3f} ms: ratio {s['ratio']['online']:.3f} "
        f"(95% CI {lo:.3f}–{hi:.3f}, {s['verdict']['online']})")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", default="gpt2,opt-125m")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--seq", type=int, default=128)
  ap.add_argument("--rounds", type=int, default=9)
  ap.add_argument("--f64", action="store_true", help="float64 (exactness) instead of float32")
  a = ap.parse_args()
  if a.f64:
    jax.config.update("jax_enable_x64", True)
  for name in a.models.split(","):
    run(name, a.batch, a.seq, np.float64 if a.f64 else np.float32, a.rounds)


if __name__ == "__main__":
  main()
