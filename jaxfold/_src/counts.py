"""Equation counts of the original and the folded program, for ``Report.diff``.

The diff's counts are the programs' own: the original is traced as the fold
traced it, the folded ``apply_fn`` is traced at the example's shapes, and
both are counted equation by equation (calls flattened, loop and branch
bodies once each, as ``program.Program`` sees them). Tracing the folded
program costs a trace, so it runs on first use (``report.diff()``,
``report.to_json()``), not at fold time.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import jax

from jaxfold._src import pipeline
from jaxfold._src.program import Program
from jaxfold._src.rules import rule_for


def program_counts(closed_jaxpr: Any) -> tuple:
  """``(reductions, {primitive name: equations})`` of a traced program; a
  reduction is an equation whose rule sums over axes (``reduce_sum``)."""
  prog = Program(closed_jaxpr)
  counts: collections.Counter = collections.Counter()
  reductions = 0
  for p in prog.programs():
    for n in p.nodes:
      counts[n.prim.name] += 1
      reductions += rule_for(n.prim).sum_axes(n) is not None
  return reductions, dict(counts)


class ProgramCounts:
  """Counts both programs on first call: ``(reductions before, after,
  ((primitive, before, after), ...) for every primitive whose count changed)``.

  ``original`` and ``folded`` trace the two programs (``jax.make_jaxpr`` at
  the example's shapes); they are dropped once counted.
  """

  def __init__(self, original: Callable[[], Any], folded: Callable[[], Any]):
    self._trace = (original, folded)
    self._result = None

  def __call__(self) -> tuple:
    if self._result is None:
      original, folded = self._trace
      before, after = program_counts(original()), program_counts(folded())
      names = sorted(set(before[1]) | set(after[1]))
      changed = tuple((k, before[1].get(k, 0), after[1].get(k, 0)) for k in names
                      if before[1].get(k, 0) != after[1].get(k, 0))
      self._result = (before[0], after[0], changed)
      self._trace = None   # nothing kept alive once counted
    return self._result


def fold_counts(call: Any, params: Any, folded_fn: Callable, folded_params: Any, example_args: tuple,
                example_kwargs: Any) -> ProgramCounts:
  """The counts of a fold: ``call`` (``pipeline.Call``) as the analysis traced
  it, the folded ``apply_fn`` at the example's arguments (abstract parameters)."""
  params, folded_params = pipeline.abstract_tree(params), pipeline.abstract_tree(folded_params)
  folded = pipeline.bind(folded_fn, tuple(example_args), example_kwargs)
  return ProgramCounts(lambda: jax.make_jaxpr(call.fn)(params, *call.abstract_args()),
                       lambda: jax.make_jaxpr(folded.fn)(folded_params, *folded.abstract_args()))


def result_counts(params: Any, apply_fn: Any) -> ProgramCounts:
  """The counts of a transform's result (``fuse_affine``, ``defer_norms``):
  the user's original program (the start of ``apply_fn``'s chain of
  transforms, at its abstract parameters) and ``apply_fn`` at ``params``,
  both at the example's arguments."""
  first = apply_fn
  while isinstance(first.inner, pipeline.PipelineApply):
    first = first.inner
  args, kwargs = apply_fn.example_args, apply_fn.example_kwargs
  original = pipeline.bind(first.inner, args, kwargs)
  after = pipeline.bind(apply_fn, args, kwargs)
  before_params, after_params = first.params_abstract, pipeline.abstract_tree(params)
  return ProgramCounts(lambda: jax.make_jaxpr(original.fn)(before_params, *original.abstract_args()),
                       lambda: jax.make_jaxpr(after.fn)(after_params, *after.abstract_args()))


def diff_text(programs: ProgramCounts, what: str) -> str:
  """``report.diff()`` of a transform whose report has no per-site counts:
  the two programs' reductions and every primitive count that changed."""
  before, after, prims = programs()
  lines = [f"what changed (original -> {what} program), counted in the two programs:",
           f"  reductions (reduce_sum, all): {before} -> {after}"]
  if prims:
    lines.append("  equations per primitive: " + ", ".join(f"{k} {a} -> {b}" for k, a, b in prims))
  return "\n".join(lines)
