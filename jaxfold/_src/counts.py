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
  import jax

  from jaxfold._src import pipeline
  params, folded_params = pipeline.abstract_tree(params), pipeline.abstract_tree(folded_params)
  args, kwargs = call.abstract_args(), dict(example_kwargs or {})
  return ProgramCounts(
      lambda: jax.make_jaxpr(call.fn)(params, *args),
      lambda: jax.make_jaxpr(lambda p: folded_fn(p, *example_args, **kwargs))(folded_params))
