"""Shared helpers of the jaxfold benchmarks: timing, model setup, markdown and PNG output.

The timing core is ``jaxfold.benchmarking`` (the ``jaxfold bench``/``demo`` commands use
the same code): variants are timed *interleaved*, their order rotated every round, after
warm-up (compilation), with enough calls per measurement to last >= 20 ms; we report the
median of per-round ratios and an A/A figure (the original executable against itself)
that shows how much the device's noise alone moves a ratio.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Any, Iterable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python benchmarks/bench_*.py` from a source tree
  sys.path.insert(0, ROOT)

from jaxfold.benchmarking import compare_forward, device_string, summarize_timings, time_variants  # noqa: E402
from models import random_params  # noqa: E402

__all__ = ["compare_forward", "device_string", "random_params", "summarize_timings",
           "time_variants", "parse_sizes", "is_image", "max_positions", "markdown_table",
           "write_markdown", "bar_plot", "header", "model_header", "command_line", "package_versions",
           "log", "RESULTS"]

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
IMAGE_FAMILIES = {"vit", "swin", "cnn", "mlp", "vmamba"}


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def parse_sizes(text: str) -> list[tuple[int, int]]:
  """``"1x64,4x128"`` -> ``[(1, 64), (4, 128)]``."""
  out = []
  for part in text.split(","):
    part = part.strip()
    if not part:
      continue
    try:
      b, s = part.lower().split("x")
      out.append((int(b), int(s)))
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"sizes must look like 1x64,4x128 (batch x seq), got {part!r}") from None
  return out


def grid(batches: Iterable[int], seqs: Iterable[int]) -> list[tuple[int, int]]:
  return [(b, s) for b in batches for s in seqs]


def is_image(spec: Any) -> bool:
  """Vision/tabular models: their 'seq' argument is an image side (or ignored)."""
  return spec.family in IMAGE_FAMILIES


def max_positions(spec: Any) -> int | None:
  c = spec.config
  for k in ("n_positions", "max_position_embeddings"):
    if hasattr(c, k):
      return int(getattr(c, k))
  return None


def num_params(tree: Any) -> int:
  import jax
  import numpy as np
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


def header(title: str, argv: Sequence[str]) -> list[str]:
  now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
  cmd = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + list(argv))
  try:
    load = os.getloadavg()[0]
    load_s = f", 1-min load average at start {load:.1f} on {os.cpu_count()} cores"
  except OSError:
    load_s = ""
  return [f"# {title}", "", f"- device: {device_string()}{load_s}", f"- date: {now}",
          f"- command: `{cmd}`", ""]


def markdown_table(rows: list[dict], columns: Sequence[str]) -> list[str]:
  lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
  for r in rows:
    lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
  return lines


def command_line(script: str, argv: Sequence[str] | None) -> str:
  """The command as run from the repository root: ``python benchmarks/<script> <args>``."""
  return "python " + " ".join([os.path.relpath(os.path.abspath(script), ROOT)]
                              + list(sys.argv[1:] if argv is None else argv))


def package_versions(dists: Sequence[str], commit: bool = False) -> dict:
  """Installed versions of ``dists`` (None where missing), the repository's short commit if asked, python."""
  import importlib.metadata as md
  import subprocess

  out: dict = {}
  for d in dists:
    try:
      out[d] = md.version(d)
    except md.PackageNotFoundError:
      out[d] = None
  if commit:
    try:
      out["jaxfold_commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                             capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
      out["jaxfold_commit"] = None
  out["python"] = sys.version.split()[0]
  return out


def model_header(title: str, now: str, wall_text: str, command: str, versions: dict,
                 cores: int | None = None) -> list[str]:
  """Header of a deviceless (compiled-for-a-GPU, run-on-a-CPU) MODEL report: title, date, command, versions."""
  host = "a shared CPU-only host" + (f" ({cores} cores)" if cores else "")
  return [f"# {title}", "",
          f"- date: {now}; {wall_text} on {host}; no GPU was used",
          f"- command: `{command}`",
          "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items())]


def write_markdown(path: str, lines: list[str]) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    f.write("\n".join(lines).rstrip() + "\n")
  log(f"wrote {path}")


def bar_plot(path: str, labels: list[str], values: list[float], errors: list[float] | None,
             ylabel: str, title: str, hline: float | None = None, log_scale: bool = False) -> None:
  """A bar chart (matplotlib, Agg backend); silently skipped without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    log("matplotlib not installed: no PNG written")
    return
  fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(labels) + 2), 4))
  ax.bar(range(len(values)), values, yerr=errors, capsize=3, color="#4c72b0")
  if log_scale:
    ax.set_yscale("log")
  if hline is not None:
    ax.axhline(hline, color="k", lw=0.8, ls="--")
  ax.set_xticks(range(len(values)))
  ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  log(f"wrote {path}")
