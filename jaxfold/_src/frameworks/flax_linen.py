"""Flax linen's parameter checks, made once per distinct initializer in a trace.

When a linen module reads an existing parameter, ``Scope.param`` checks its
shape against the module's hyperparameters by abstractly evaluating the
initializer (``jax.eval_shape(lambda: init_fn(key, *init_args, **init_kwargs))``):
a small trace per parameter, close to half the cost of tracing GPT-2. The
layers of a stack repeat the same few initializers with the same arguments, so
jaxfold's own traces answer repeated checks from a memo keyed by the
initializer and its arguments. Each parameter is still compared with the
initializer's shape (a mismatch raises flax's own error), the program traced is
the same, and nothing changes outside jaxfold's traces or when flax's code
differs from what is recognised here (then every check runs as usual).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from typing import Any, Callable, Iterator, Optional

import numpy as np

_LOCAL = threading.local()   # .memo: the active trace's memo (None outside one)
_LOCK = threading.Lock()
_USERS = [0]                 # traces in progress, all threads: the proxy stays while any runs
_PARAM_LAMBDA = "Scope.param.<locals>.<lambda>"
_CLOSURE = frozenset({"init_fn", "init_args", "init_kwargs"})


def _value_key(x: Any, depth: int = 0) -> Any:
  """A hashable key equal only for values an initializer cannot tell apart:
  scalars with their type, containers by content, functions by code, defaults
  and closure values (``normal(0.02)`` makes a new closure per module), other
  objects by identity. Raises TypeError for anything else (arrays)."""
  if depth > 8:
    raise TypeError("nested too deeply")
  if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
    return (type(x), x)
  if isinstance(x, (tuple, list)):
    return (type(x), tuple(_value_key(v, depth + 1) for v in x))
  if isinstance(x, dict):
    return (dict, tuple(sorted((k, _value_key(v, depth + 1)) for k, v in x.items())))
  if isinstance(x, types.FunctionType):
    cells = tuple(c.cell_contents for c in x.__closure__ or ())
    return (types.FunctionType, x.__code__, id(x.__globals__), _value_key(x.__defaults__, depth + 1),
            _value_key(x.__kwdefaults__, depth + 1), _value_key(cells, depth + 1))
  if isinstance(x, functools.partial):
    return (functools.partial, _value_key(x.func, depth + 1), _value_key(x.args, depth + 1),
            _value_key(x.keywords, depth + 1))
  if isinstance(x, (np.dtype, type)):
    return (type(x), x)
  if type(x).__hash__ is object.__hash__:   # identity: the same object
    return (type(x), id(x))
  raise TypeError(f"no key for {type(x).__name__}")


def _check_key(fun: Callable) -> Optional[tuple]:
  """The key of Scope.param's check ``fun`` (its initializer and arguments); None
  for any other function or arguments without a key."""
  code = getattr(fun, "__code__", None)
  if code is None or getattr(fun, "__qualname__", "") != _PARAM_LAMBDA or set(code.co_freevars) != _CLOSURE:
    return None
  try:
    cells = {name: cell.cell_contents for name, cell in zip(code.co_freevars, fun.__closure__)}
    return _value_key((cells["init_fn"], cells["init_args"], cells["init_kwargs"]))
  except (TypeError, ValueError):   # an empty cell, an argument without a key
    return None


class _JaxForScope:
  """``flax.core.scope``'s name ``jax`` while jaxfold traces: jax itself, except
  that ``eval_shape`` of a parameter check is answered from the active memo."""

  def __init__(self, jax_module: Any):
    self._jax = jax_module

  def __getattr__(self, name: str) -> Any:
    return getattr(self._jax, name)

  def eval_shape(self, fun: Callable, *args: Any, **kwargs: Any) -> Any:
    memo = getattr(_LOCAL, "memo", None)
    key = _check_key(fun) if memo is not None and not args and not kwargs else None
    if key is None:
      return self._jax.eval_shape(fun, *args, **kwargs)
    if key not in memo:
      # (fun kept alive with its answer: identity keys stay unique in the trace)
      memo[key] = (self._jax.eval_shape(fun), fun)
    return memo[key][0]


def _install() -> bool:
  scope = sys.modules.get("flax.core.scope")
  jax = sys.modules.get("jax")
  if scope is None or jax is None:
    return False
  current = getattr(scope, "jax", None)
  if isinstance(current, _JaxForScope):
    return True
  if current is not jax:
    return False
  scope.jax = _JaxForScope(jax)
  return True


def _uninstall() -> None:
  scope = sys.modules.get("flax.core.scope")
  current = getattr(scope, "jax", None)
  if isinstance(current, _JaxForScope):
    scope.jax = current._jax


@contextlib.contextmanager
def memoized_param_checks() -> Iterator[None]:
  """Within the ``with`` (a trace, or a fold's traces at several shapes), this
  thread's repeated linen parameter checks are made once."""
  with _LOCK:
    active = _install()
    _USERS[0] += active
  if not active:   # no linen loaded (or not the code recognised here): nothing to memoize
    yield
    return
  saved = getattr(_LOCAL, "memo", None)
  _LOCAL.memo = {} if saved is None else saved   # nested: one memo (a fold's shapes share it)
  try:
    yield
  finally:
    _LOCAL.memo = saved
    with _LOCK:
      _USERS[0] -= 1
      if not _USERS[0]:
        _uninstall()


def refuse_as_variables(*classes: type) -> None:
  """Lets ``model.apply`` given one of ``classes`` (a fold's parameters) reach
  the class's own ``__getattr__`` message instead of flax's generic
  ``ApplyScopeInvalidVariablesTypeError``.

  Flax checks that each collection of ``model.apply({'params': folded.params})``
  is a dict or ``FrozenDict`` before reading its keys; registered as a virtual
  ``FrozenDict`` (``Mapping.register``-style, no behaviour inherited), the
  object passes that check and its ``keys`` raises what to pass instead. Only
  where flax is loaded (it cannot be handed a fold before it is).
  """
  frozen = sys.modules.get("flax.core.frozen_dict")
  cls = getattr(frozen, "FrozenDict", None)
  if cls is None or not hasattr(cls, "register"):
    return
  for c in classes:
    if not issubclass(c, cls):
      cls.register(c)
