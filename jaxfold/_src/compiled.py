"""A folded program run as one compiled XLA program, not primitive by primitive.

``rewrite.evaluate`` replays the analysed jaxpr with the plan applied under the
current trace. Called outside ``jit`` that means eager dispatch: one XLA
compilation per primitive and shape on the first call at each shape (seconds
for a small transformer), which a user calling ``folded.apply_fn`` directly
pays at every new shape. :func:`run` evaluates under ``jax.jit`` instead,
one wrapper per analysis (jit caches one program per shape under it); inside
an outer ``jit``/``grad``/``vmap`` the plan is evaluated inline, as before.

Example:
    >>> outs = run(analysis, leaves_and_args, extras)   # what FoldedApply.__call__ does
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable, Sequence

import jax

from jaxfold._src.rewrite import evaluate

__all__ = ["run", "run_on"]

_SIZE = 32
_CACHE: collections.OrderedDict = collections.OrderedDict()   # id(analysis) -> (weakref, jitted)
_LOCK = threading.Lock()


def _jitted(analysis: Any) -> Callable:
  """``jax.jit`` of ``evaluate`` for ``analysis``, reused while it lives (a few kept)."""
  key = id(analysis)
  with _LOCK:
    entry = _CACHE.get(key)
    if entry is not None and entry[0]() is analysis:
      _CACHE.move_to_end(key)
      return entry[1]
  jaxpr, plan = analysis.jaxpr, analysis.plan
  fn = jax.jit(lambda consts, flat, extras: evaluate(jaxpr, consts, flat, plan, extras))
  try:
    ref = weakref.ref(analysis)
  except TypeError:   # (a NamedTuple analysis: held while cached, so its id is not reused)
    ref = (lambda a: lambda: a)(analysis)
  with _LOCK:
    _CACHE[key] = (ref, fn)
    while len(_CACHE) > _SIZE:
      _CACHE.popitem(last=False)
  return fn


def _traced(values: Sequence[Any]) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(values))


def run(analysis: Any, flat: Sequence[Any], extras: dict) -> list:
  """``evaluate(analysis.jaxpr, analysis.consts, flat, analysis.plan, extras)`` compiled.

  Under a caller's trace (``jit``, ``grad``, ``make_jaxpr``) the plan is evaluated
  inline, so the caller's program is the folded program itself, not a nested call
  (what the report's counts and a user reading the jaxpr see); only an eager call
  goes through the cached ``jit``.
  """
  if _traced((flat, extras)):
    return evaluate(analysis.jaxpr, analysis.consts, list(flat), analysis.plan, dict(extras))
  return _jitted(analysis)(list(analysis.consts), list(flat), dict(extras))


def run_on(analysis: Any, tree: Any, params: Any, args: Any, extras: dict, error: type, what: str,
           fill: Callable[[list], list] | None = None) -> Any:
  """A step's apply: ``params`` flattened to the step's parameter ``tree`` (else
  ``error(what)``), optionally ``fill``-ed (leaves the plan no longer reads), then
  ``args``' leaves, run by :func:`run`; the outputs in ``analysis.out_tree``."""
  try:
    leaves = jax.tree_util.tree_leaves(tree.flatten_up_to(params))
  except (ValueError, TypeError) as err:
    raise error(what) from err
  flat = (fill(leaves) if fill is not None else leaves) + jax.tree_util.tree_leaves(args)
  return jax.tree_util.tree_unflatten(analysis.out_tree, run(analysis, flat, extras))
