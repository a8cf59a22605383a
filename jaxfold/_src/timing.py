"""Timing and comparison helpers shared by ``jaxfold bench``/``demo`` and the
benchmark scripts (public as :mod:`jaxfold.benchmarking`).

Variants are timed *interleaved*, their order rotated every round, after
warm-up (compilation), with enough calls per measurement to last >= 20 ms; the
result is the ratio of the median times (the numbers printed next to it), a
bootstrap confidence interval over rounds, and an A/A figure (the original
executable against itself) that shows how much the device's noise alone moves
a ratio.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from typing import Any, Callable, Optional, Sequence


class NonFiniteError(ValueError):
  """Outputs with NaN/inf: an error or a timing measured on them means nothing."""


def device_string() -> str:
  """E.g. ``'cpu: cpu (2 cores), jax 0.10.2'`` or ``'gpu: NVIDIA H100 80GB HBM3, jax 0.11.0'``."""
  import jax
  d = jax.devices()[0]
  kind = getattr(d, "device_kind", "") or d.platform
  extra = f" ({os.cpu_count()} cores)" if d.platform == "cpu" else ""
  return f"{d.platform}: {kind}{extra}, jax {jax.__version__}"


def _block(x):
  import jax
  return jax.block_until_ready(x)


def time_variants(thunks: dict, *, rounds: int = 9, warmup: int = 2,
                  min_seconds: float = 0.02, progress: Optional[Callable[[int], None]] = None) -> dict:
  """Times zero-argument callables interleaved, rotating their order each round.

  Each thunk is called ``warmup`` times first (compilation), then calibrated to
  ``number`` calls per measurement so one measurement lasts ≥ ``min_seconds``.
  Returns ``{name: [seconds per call, one per round]}`` and the key
  ``"_number"``.
  """
  names = list(thunks)
  for _ in range(max(warmup, 1)):
    for n in names:
      _block(thunks[n]())
  single = {}
  for n in names:
    t0 = time.perf_counter()
    _block(thunks[n]())
    single[n] = time.perf_counter() - t0
  number = max(1, int(math.ceil(min_seconds / max(min(single.values()), 1e-9))))
  number = min(number, 1000)
  times = {n: [] for n in names}
  for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for n in order:
      fn = thunks[n]
      t0 = time.perf_counter()
      for _ in range(number):
        out = fn()
      _block(out)
      times[n].append((time.perf_counter() - t0) / number)
    if progress:
      progress(r)
  times["_number"] = number
  return times


def ratio_of_medians(other: Sequence[float], base: Sequence[float]) -> float:
  """``median(other) / median(base)``: the ratio of the times one prints."""
  return statistics.median(other) / statistics.median(base)


def bootstrap_ratio_ci(other: Sequence[float], base: Sequence[float], *, level: float = 0.95,
                       resamples: int = 2000, seed: int = 0) -> tuple:
  """Percentile bootstrap interval of :func:`ratio_of_medians`.

  Rounds are resampled in pairs (``other[i]`` with ``base[i]``): interleaved
  rounds share the machine's state, so pairing keeps that noise common to both.
  Deterministic for a given ``seed``.

  Example:
    >>> lo, hi = bootstrap_ratio_ci([2.0, 2.1, 1.9, 2.0], [1.0, 1.0, 1.1, 0.9])
    >>> 1.5 < lo <= hi < 2.5
    True
  """
  import numpy as np
  a, b = np.asarray(other, np.float64), np.asarray(base, np.float64)
  if len(a) != len(b) or len(a) == 0:
    raise ValueError(f"need paired rounds, got {len(a)} and {len(b)}")
  idx = np.random.default_rng(seed).integers(0, len(a), size=(resamples, len(a)))
  ratios = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
  tail = 100 * (1 - level) / 2
  return float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))


def verdict(ratio: float, ci: tuple) -> str:
  """``"faster"``/``"slower"`` when the interval excludes 1, else ``"not resolved"``."""
  lo, hi = ci
  if lo <= 1.0 <= hi:
    return "not resolved"
  return "faster" if ratio < 1 else "slower"


def summarize_timings(times: dict, base: str, others: Sequence[str]) -> dict:
  """Median time per variant, and per other variant the ratio of medians
  ``other/base`` with a 95% bootstrap interval and its verdict.

  Returns ``{"median_ms": {...}, "ratio": {other: r}, "ratio_ci": {other: (lo, hi)},
  "verdict": {other: "faster" | "slower" | "not resolved"}, "ratio_iqr": {other: (q1, q3)}}``;
  ``ratio_iqr`` is the spread of the per-round ratios.
  """
  out = {"median_ms": {n: 1e3 * statistics.median(v) for n, v in times.items()
                       if not n.startswith("_")},
         "ratio": {}, "ratio_ci": {}, "verdict": {}, "ratio_iqr": {}, "rounds": len(times[base]),
         "number": times.get("_number", 1)}
  for o in others:
    r = ratio_of_medians(times[o], times[base])
    ci = bootstrap_ratio_ci(times[o], times[base])
    out["ratio"][o], out["ratio_ci"][o], out["verdict"][o] = r, ci, verdict(r, ci)
    rs = sorted(a / b for a, b in zip(times[o], times[base]))
    q = statistics.quantiles(rs, n=4) if len(rs) >= 2 else [rs[0], rs[0], rs[0]]
    out["ratio_iqr"][o] = (q[0], q[2])
  return out


def compare_forward(apply_fn, params, folded, args, *, rounds: int = 9, warmup: int = 2,
                    progress=None, jitted: Optional[tuple] = None) -> dict:
  """Jitted original vs folded forward on ``args``, interleaved.  A third
  variant runs the original executable again ("A/A"): its ratio to the
  original is the noise figure.  ``jitted=(orig, folded)`` reuses compiled
  functions.  Returns :func:`summarize_timings` plus ``"aa_noise"``."""
  orig, fold_fn = jitted or _jit_pair(apply_fn, folded)
  fp = folded.params
  thunks = {"original": lambda: orig(params, *args),
            "folded": lambda: fold_fn(fp, *args),
            "original A/A": lambda: orig(params, *args)}
  times = time_variants(thunks, rounds=rounds, warmup=warmup, progress=progress)
  s = summarize_timings(times, "original", ["folded", "original A/A"])
  s["aa_noise"] = abs(s["ratio"]["original A/A"] - 1.0)
  return s


def _jit_pair(apply_fn, folded):
  import jax
  return (jax.jit(lambda p, *a: apply_fn(p, *a)), jax.jit(lambda p, *a: folded.apply_fn(p, *a)))


def check_finite(tree: Any, what: str) -> None:
  """Raises :class:`NonFiniteError` if any float leaf of ``tree`` has a NaN or an inf:
  an error measured on non-finite outputs would be meaningless (NaN compares as 0)."""
  import jax
  import numpy as np
  for x in jax.tree_util.tree_leaves(tree):
    x = np.asarray(x)
    if x.dtype.kind in "fc" and not np.all(np.isfinite(x)):
      n = int(np.size(x) - np.count_nonzero(np.isfinite(x)))
      raise NonFiniteError(f"{what} has {n} non-finite value(s) (NaN/inf) out of {x.size}: no error or "
                     "timing is reported for it. Check the inputs (e.g. --seq within the model's "
                     "positions) and the weights")


def max_rel_err(a: Any, b: Any, what: str = "outputs") -> float:
  """``max |a − b| / max |a|`` over the leaves; refuses non-finite values in
  either (:class:`NonFiniteError`), since NaN − NaN would otherwise read as 0."""
  import jax
  import numpy as np
  check_finite(a, f"the original model's {what}")
  check_finite(b, f"the folded model's {what}")
  worst = 0.0
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    worst = max(worst, float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(x))), 1e-30)))
  return worst


@dataclasses.dataclass(frozen=True)
class ModelledGpu:
  """Committed figures of the project's GPU traffic model: a MODEL, not a
  measurement (``benchmarks/gpu_model.py``: programs compiled ahead of time for
  H100/A100, time = per-launch roofline of their bytes and flops)."""
  model: str
  setting: str
  ratios: tuple          # ((target, "batch x seq", folded/original modelled time), ...)
  source: str
  date: str

  def line(self) -> str:
    """One line for ``jaxfold demo``/``bench``: each target's range over the shapes modelled."""
    parts = []
    for target in dict.fromkeys(t for t, _, _ in self.ratios):
      rows = sorted((r, shape) for t, shape, r in self.ratios if t == target)
      parts.append(f"{target} {rows[0][0]:.3f} ({rows[0][1]}) to {rows[-1][0]:.3f} ({rows[-1][1]})")
    return (f"modelled GPU folded/original time, {self.model} ({self.setting}), batch x seq: "
            + "; ".join(parts) + f". A MODEL, not a measurement: {self.source}, {self.date}")


# From benchmarks/results/gpu_model.md (`python benchmarks/gpu_model.py`, 2026-11-23), the
# "time folded/orig" column of the gpt2 rows; update both together.
_GPT2_MODELLED = ModelledGpu(
    model="GPT-2 small", setting='bf16, jaxfold.fold(..., norm_impl="pallas")',
    ratios=(("H100", "2x256", 1.0138), ("H100", "2x1024", 0.9892), ("H100", "2x4096", 0.9976),
            ("H100", "2x16384", 0.9993), ("H100", "8x256", 0.9478), ("H100", "32x256", 0.9775),
            ("H100", "128x256", 0.9837),
            ("A100", "2x256", 0.8417), ("A100", "2x1024", 0.9624), ("A100", "2x4096", 0.9924),
            ("A100", "2x16384", 0.9983), ("A100", "8x256", 0.9246), ("A100", "32x256", 0.9531),
            ("A100", "128x256", 0.9605)),
    source="benchmarks/results/gpu_model.md", date="2026-11-23")


def modelled_gpu() -> ModelledGpu:
  """The project's modelled GPU figure for GPT-2 small (committed numbers, no
  computation, no GPU): what ``jaxfold demo``/``bench`` print beside a CPU timing.

  Example:
      >>> modelled_gpu().ratios[0]
      ('H100', '2x256', 1.0138)
  """
  return _GPT2_MODELLED


__all__ = ["ModelledGpu", "modelled_gpu", "NonFiniteError", "device_string", "time_variants", "summarize_timings",
           "ratio_of_medians",
           "bootstrap_ratio_ci", "verdict", "compare_forward", "check_finite", "max_rel_err"]
