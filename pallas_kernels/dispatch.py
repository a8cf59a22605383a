"""Kernel-vs-XLA choice per shape: a small, overwritable heuristic table.

Why a table: an RMSNorm is memory bound, so the Pallas kernel only wins where
XLA's fusion is noticeably below copy bandwidth. For narrow rows (hidden <
256) one program handles too little data and launch/grid overhead dominates;
for very few rows the whole op is latency bound and both are equal, so the
simpler XLA path is kept. Hidden sizes above ``max_hidden`` would not fit a
single block in registers (the kernel keeps a whole row on chip).

The defaults below are a conservative *guess* (no GPU measurements were
available when they were written). ``benchmarks/bench_rms_norm.py --update-table``
prints measured rules; install them with :func:`set_rules`.

Example:
    >>> from pallas_kernels.dispatch import choose
    >>> choose((16384, 4096), "bfloat16")
    'pallas'
    >>> choose((2, 64), "float32")
    'xla'
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rule:
  """Use the kernel when ``min_hidden <= hidden <= max_hidden`` and rows >= min_rows."""

  dtype: str  # numpy dtype name, or "*" for any
  min_hidden: int
  max_hidden: int
  min_rows: int


DEFAULT_RULES: tuple[Rule, ...] = (
    Rule("*", min_hidden=256, max_hidden=8192, min_rows=1024),  # 8192 = rms_norm.MAX_HIDDEN
)

_rules: tuple[Rule, ...] = DEFAULT_RULES


# Pallas GPU backend of the kernels when a call names none (``backend=None``):
# None = the first available one, Triton (proven on GPUs). "mosaic_gpu" opts
# every such call in, e.g. a folded model's norms (``fold(norm_impl="pallas")``).
_backend: str | None = None


def set_backend(backend: str | None) -> None:
  """Default Pallas backend for calls with ``backend=None`` (None = automatic).

  Example:
      >>> set_backend("mosaic_gpu"); get_backend()
      'mosaic_gpu'
      >>> set_backend(None)
  """
  from pallas_kernels._compat import BACKENDS

  if backend is not None and backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
  global _backend
  _backend = backend


def get_backend() -> str | None:
  return _backend


def set_rules(rules: Sequence[Rule] | None) -> None:
  """Replaces the table (``None`` restores :data:`DEFAULT_RULES`)."""
  global _rules
  _rules = DEFAULT_RULES if rules is None else tuple(rules)


def get_rules() -> tuple[Rule, ...]:
  return _rules


def choose(shape: Sequence[int], dtype) -> str:
  """Returns ``"pallas"`` or ``"xla"`` for an input of ``shape``/``dtype``.

  The first rule whose dtype matches decides; no matching rule -> ``"xla"``.
  """
  hidden = int(shape[-1]) if len(shape) else 1
  rows = math.prod(int(d) for d in shape[:-1])
  name = np.dtype(dtype).name
  for rule in _rules:
    if rule.dtype not in ("*", name):
      continue
    ok = rule.min_hidden <= hidden <= rule.max_hidden and rows >= rule.min_rows
    return "pallas" if ok else "xla"
  return "xla"
