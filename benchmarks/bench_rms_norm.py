"""Bandwidth benchmark: Pallas RMSNorm vs XLA RMSNorm / LayerNorm vs a copy.

RMSNorm is memory bound, so the figure of merit is achieved bandwidth
``(bytes read + bytes written) / time``, compared with an elementwise
device-to-device pass (``jit(lambda x: -x)``: read once, write once), which is
the practical limit.

Method (why each step):
* variants are interleaved inside every repetition (with a rotating order)
  so clock/thermal drift hits all of them alike;
* each timed sample runs ``--inner`` calls on *different* input buffers
  (a pool whose total size is >= 4x the 50 MB H100 L2) so the data cannot
  stay in L2, and so per-call Python dispatch overlaps with GPU work;
* ``block_until_ready`` ends every sample; the median per-call time is
  reported.

Usage (GPU)::

    python benchmarks/bench_rms_norm.py --out rms_norm_bench.md

CPU smoke test (tiny sizes, Pallas interpret mode)::

    JAX_PLATFORMS=cpu python benchmarks/bench_rms_norm.py --interpret --small --out /tmp/b.md

Example:
    >>> rows = main(["--interpret", "--small", "--hidden", "130", "--dtypes", "float32",
    ...              "--out", "/tmp/bench_doctest.md"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import pallas_kernels as pk  # noqa: E402

EPS = 1e-6
L2_BYTES = 50 * 2**20  # H100


def layer_norm_reference(x, scale, bias, *, eps: float):
  """XLA LayerNorm with float32 statistics, output in ``x.dtype``."""
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
  return ((xf - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


def make_variants(backends: Sequence[str], interpret: bool) -> dict[str, Callable]:
  """name -> jitted f(x, scale, bias). Pallas variants force the kernel."""
  variants: dict[str, Callable] = {}
  for b in backends:
    variants[f"pallas-{b}"] = jax.jit(
        lambda x, s, c, b=b: pk.rms_norm(x, s, c, eps=EPS, interpret=interpret, backend=b)
    )
  variants["xla-rmsnorm"] = jax.jit(lambda x, s, c: pk.rms_norm_reference(x, s, c, eps=EPS))
  variants["xla-layernorm"] = jax.jit(lambda x, s, c: layer_norm_reference(x, s, c, eps=EPS))
  variants["copy"] = jax.jit(lambda x, s, c: -x)  # read + write once: the limit
  return variants


def bytes_moved(rows: int, hidden: int, dtype, name: str) -> int:
  """Bytes read + written by one call (scale/bias count for the norms)."""
  io = 2 * rows * hidden * jnp.dtype(dtype).itemsize
  return io if name == "copy" else io + 2 * hidden * 4


def time_variants(
    variants: dict[str, Callable], bufs: list, scale, bias, reps: int, inner: int
) -> dict[str, float]:
  """Median seconds per call of each variant, interleaved and buffer-rotating."""
  names = list(variants)
  for f in variants.values():  # compile + warm up outside the timing
    jax.block_until_ready(f(bufs[0], scale, bias))
  samples: dict[str, list[float]] = {n: [] for n in names}
  k = 0
  for rep in range(reps):
    order = names[rep % len(names):] + names[: rep % len(names)]
    for n in order:
      f = variants[n]
      t0 = time.perf_counter()
      for _ in range(inner):
        out = f(bufs[k % len(bufs)], scale, bias)
        k += 1
      jax.block_until_ready(out)
      samples[n].append((time.perf_counter() - t0) / inner)
  return {n: statistics.median(v) for n, v in samples.items()}


def n_buffers(one_buffer_bytes: int, small: bool) -> int:
  """Enough input buffers that the pool is >= 4x L2 (at least 2, at most 32)."""
  if small:
    return 2
  return int(min(32, max(2, math.ceil(4 * L2_BYTES / one_buffer_bytes))))


def run(rows: int, hiddens: Sequence[int], dtypes: Sequence[str], backends: Sequence[str],
        interpret: bool, reps: int, inner: int, small: bool) -> list[dict]:
  """One result dict per (hidden, dtype, variant)."""
  results = []
  variants = make_variants(backends, interpret)
  key = jax.random.key(0)
  for hidden in hiddens:
    for dt in dtypes:
      dtype = jnp.dtype(dt)
      k1, k2, k3 = jax.random.split(jax.random.fold_in(key, hidden), 3)
      nb = n_buffers(rows * hidden * dtype.itemsize, small)
      bufs = [jax.random.normal(jax.random.fold_in(k1, i), (rows, hidden), dtype) for i in range(nb)]
      scale = 1.0 + 0.1 * jax.random.normal(k2, (hidden,), jnp.float32)
      bias = 0.1 * jax.random.normal(k3, (hidden,), jnp.float32)
      secs = time_variants(variants, bufs, scale, bias, reps, inner)
      copy_bw = bytes_moved(rows, hidden, dtype, "copy") / secs["copy"]
      for name, s in secs.items():
        bw = bytes_moved(rows, hidden, dtype, name) / s
        results.append(dict(rows=rows, hidden=hidden, dtype=dtype.name, variant=name,
                            us=s * 1e6, gbps=bw / 1e9, pct_copy=100.0 * bw / copy_bw))
      del bufs
  return results


def to_markdown(results: list[dict], header: str) -> str:
  lines = [header, "", "| rows | hidden | dtype | variant | time (us) | GB/s | % of copy |",
           "|---:|---:|---|---|---:|---:|---:|"]
  for r in results:
    lines.append(f"| {r['rows']} | {r['hidden']} | {r['dtype']} | {r['variant']} | "
                 f"{r['us']:.1f} | {r['gbps']:.1f} | {r['pct_copy']:.1f} |")
  return "\n".join(lines) + "\n"


def suggest_rules(results: list[dict]) -> list[pk.Rule]:
  """Per dtype: smallest measured hidden from which the fastest Pallas
  backend is at least as fast as XLA RMSNorm at every larger measured size.
  Feed the result to ``pallas_kernels.set_rules``."""
  rules = []
  for dt in sorted({r["dtype"] for r in results}):
    by_h: dict[int, tuple[float, float]] = {}
    for h in sorted({r["hidden"] for r in results if r["dtype"] == dt}):
      rs = [r for r in results if r["dtype"] == dt and r["hidden"] == h]
      pal = [r["us"] for r in rs if r["variant"].startswith("pallas-")]
      xla = [r["us"] for r in rs if r["variant"] == "xla-rmsnorm"]
      if pal and xla:
        by_h[h] = (min(pal), xla[0])
    wins = [h for h in by_h if all(by_h[g][0] <= by_h[g][1] for g in by_h if g >= h)]
    rows = results[0]["rows"] if results else 0
    if wins:
      rules.append(pk.Rule(dt, min_hidden=min(wins), max_hidden=max(by_h), min_rows=rows))
    else:
      rules.append(pk.Rule(dt, min_hidden=1, max_hidden=0, min_rows=0))  # never
  return rules


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rows", type=int, default=16384)
  p.add_argument("--hidden", type=int, nargs="+", default=[768, 1024, 4096, 8192])
  p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  p.add_argument("--backends", nargs="+", default=None,
                 help="Pallas backends (default: all available; 'triton' with --interpret)")
  p.add_argument("--reps", type=int, default=30)
  p.add_argument("--inner", type=int, default=10, help="calls per timed sample")
  p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke test)")
  p.add_argument("--small", action="store_true", help="tiny sizes for a smoke test")
  p.add_argument("--out", default="rms_norm_bench.md")
  p.add_argument("--update-table", action="store_true", help="print suggested dispatch rules")
  a = p.parse_args(argv)
  if a.small:
    a.rows = min(a.rows, 8)
    if a.hidden == [768, 1024, 4096, 8192]:
      a.hidden = [130, 256]
    a.reps, a.inner = min(a.reps, 2), 1
  return a


def main(argv: Sequence[str] | None = None) -> list[dict]:
  """Runs the benchmark, prints and writes the markdown table; returns rows."""
  a = parse_args(argv)
  backends = a.backends or (["triton"] if a.interpret else list(pk.available_backends()))
  for b in backends:  # fail early and clearly for an unusable backend
    pk.resolve_backend(b, interpret=a.interpret)
  results = run(a.rows, a.hidden, a.dtypes, backends, a.interpret, a.reps, a.inner, a.small)
  dev = jax.devices()[0]
  header = (f"## RMSNorm bandwidth ({dev.device_kind}, jax {jax.__version__}"
            f"{', interpret mode' if a.interpret else ''})")
  md = to_markdown(results, header)
  print(md)
  if a.update_table:
    print("suggested rules:", suggest_rules(results))
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    f.write(md)
  return results


if __name__ == "__main__":
  main()
