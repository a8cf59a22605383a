"""A folded program run as one compiled XLA program, not primitive by primitive.

``rewrite.evaluate`` replays the analysed jaxpr with the plan applied under the
current trace. Called outside ``jit`` that means eager dispatch: one XLA
compilation per primitive and shape on the first call at each shape (seconds
for a small transformer), which a user calling ``folded.apply_fn`` directly
pays at every new shape. :func:`run` evaluates under ``jax.jit`` instead,
one wrapper per analysis (jit caches one program per shape under it); inside
an outer ``jit``/``grad``/``vmap`` the inner ``jit`` is an ordinary nested call.

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

__all__ = ["run"]

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
  with _LOCK:
    _CACHE[key] = (weakref.ref(analysis), fn)
    while len(_CACHE) > _SIZE:
      _CACHE.popitem(last=False)
  return fn


def run(analysis: Any, flat: Sequence[Any], extras: dict) -> list:
  """``evaluate(analysis.jaxpr, analysis.consts, flat, analysis.plan, extras)`` compiled."""
  return _jitted(analysis)(list(analysis.consts), list(flat), dict(extras))
