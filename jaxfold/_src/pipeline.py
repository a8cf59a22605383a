"""The front end every transform shares: abstract values, call binding, the
trace → Program → Analyzer bootstrap and one apply wrapper.

``fold``/``cbwc`` (``FoldedApply``), ``fuse_affine`` (``FusedApply``) and
``rotate`` (``RotatedApply``) each return an apply function that takes the
original's arguments and re-analyses per input signature. What they have in
common lives here, once:

* ``abstract``: an argument or parameter as a ``jax.ShapeDtypeStruct`` keeping
  its shape, dtype, weak type and sharding (a sharded parameter is traced as
  sharded);
* ``signature``/``bind``: the cache key of one call, with array keyword
  arguments (PRNG keys, masks) traced like positional ones and the others
  (``train=True``) static, one analysis per value;
* ``trace`` and ``analyzer``: ``jax.make_jaxpr`` at abstract values, then a
  ``Program`` and an ``Analyzer`` inside one ``algebra.scope()``;
* ``PipelineApply``: the wrapper (the original function, the example it was
  made from, the per-signature cache); each transform's subclass says only
  how to analyse one signature and how to run it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from typing import Any, Callable, Iterator, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxfold._src import algebra, compat
from jaxfold._src.analysis import Analyzer
from jaxfold._src.errors import FoldError, JaxfoldError
from jaxfold._src.frameworks import flax_linen
from jaxfold._src.program import Program

# ----------------------------------------------------------------------------
# Abstract values and signatures.


def dtype_of(x: Any) -> Any:
  """``x``'s dtype; never ``jnp.dtype(x.dtype)``: typed PRNG keys (``key<fry>``)
  have no numpy dtype."""
  return x.dtype if hasattr(x, "dtype") else jnp.result_type(x)


def is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def abstract(x: Any, error: type = FoldError) -> jax.ShapeDtypeStruct:
  """``x`` as a ``jax.ShapeDtypeStruct``: shape, dtype, weak type and (for a
  ``jax.Array``) sharding kept; anything without shape and dtype is refused
  with ``error``.

  Example:
    >>> import jax.numpy as jnp
    >>> abstract(jnp.ones((2, 3))).shape
    (2, 3)
    >>> abstract(jnp.asarray(1.0)).weak_type
    True
  """
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise error(f"expected an array or jax.ShapeDtypeStruct, got {type(x).__name__}: {x!r:.80}")
  sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding,
                              weak_type=bool(getattr(x, "weak_type", False)))


def abstract_tree(tree: Any, error: type = FoldError) -> Any:
  """Every leaf of ``tree`` made ``abstract`` (``None`` leaves stay absent)."""
  return jax.tree_util.tree_map(lambda x: abstract(x, error), tree)


def leaves_signature(leaves: list) -> tuple:
  """``((shape, dtype, weak type), ...)``: what tracing a leaf depends on
  (shardings are not part of it: one analysis serves every placement)."""
  return tuple((tuple(np.shape(x)), str(dtype_of(x)), bool(getattr(x, "weak_type", False)))
               for x in leaves)


def signature(args: Any) -> tuple:
  """The pytree structure and the leaves' signature of ``args``."""
  leaves, tree = jax.tree_util.tree_flatten(args)
  return (tree, leaves_signature(leaves))


def shapes_text(args: Any, dtypes: bool = False) -> str:
  """``(2, 8), (2, 8)``: the shapes of ``args``' leaves, for messages (with
  ``dtypes``: ``(2, 8) float32, ...``)."""
  return ", ".join(str(tuple(np.shape(x))).replace("'", "") + (f" {_dtype_text(x)}" if dtypes else "")
                   for x in jax.tree_util.tree_leaves(args)) or "()"


def _dtype_text(x: Any) -> str:
  return str(x.dtype) if hasattr(x, "dtype") else type(x).__name__   # (an example's static keyword value)


def shapes_texts(args: Any, example: Any) -> tuple:
  """``shapes_text`` of a call's arguments and of the example, with dtypes
  where those differ: a call at the example's shapes in float32 would read
  as two equal shapes that need different parameters."""
  def dtypes(tree):
    return [str(x.dtype) for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")]
  typed = dtypes(args) != dtypes(example)
  return shapes_text(args, typed), shapes_text(example, typed)


# ----------------------------------------------------------------------------
# One call: positional arguments and keyword arguments.


@dataclasses.dataclass(frozen=True)
class Call:
  """One call's arguments: array leaves of the keyword arguments (PRNG keys,
  masks) are traced like positional ones, the rest (``train=True``) are
  static: a new value is a new analysis."""
  key: tuple         # the cache key: signature, and the static keyword values
  fn: Callable       # fn(params, *args): the function with the keyword arguments bound
  args: tuple        # positional args, then the list of array kwargs (when any)

  def abstract_args(self, error: type = FoldError) -> tuple:
    """``args`` as ``jax.ShapeDtypeStruct``s: what a transform's analysis traces."""
    return abstract_tree(self.args, error)


def _hashable(x: Any) -> bool:
  try:
    hash(x)
    return True
  except TypeError:
    return False


def _check_positional(args: tuple, error: type) -> None:
  """Every leaf of the positional arguments is an array: a positional flag or
  string (``train=False`` passed positionally) would otherwise surface as an
  unexplained failure of ``jax`` (``Value 'a' ... is not a valid JAX array
  type``) or a message that names neither the argument nor the remedy."""
  for path, x in jax.tree_util.tree_flatten_with_path(tuple(args))[0]:
    if is_array(x) or (hasattr(x, "shape") and hasattr(x, "dtype")):
      continue
    where = "positional argument " + str(path[0].idx) + jax.tree_util.keystr(tuple(path[1:]))
    raise error(
        f"{where} is of type {type(x).__name__} ({x!r:.60}), not an array: positional arguments are "
        "traced, so each must be an array or jax.ShapeDtypeStruct (e.g. jnp.asarray(...)). "
        "Pass a static value (a flag, a string, a Python number the function branches on) as a "
        "keyword argument (example_kwargs= of jaxfold.fold/cbwc, the same keyword when calling "
        "the folded apply_fn) or bind it with functools.partial.")


def bind(apply_fn: Callable, args: tuple, kwargs: Optional[dict], error: type = FoldError) -> Call:
  """``apply_fn`` called with ``args`` and ``kwargs`` as a function of the
  parameters and the arrays only (what ``trace`` takes)."""
  _check_positional(args, error)
  if not kwargs:
    return Call(signature(tuple(args)), apply_fn, tuple(args))
  leaves, tree = jax.tree_util.tree_flatten(kwargs)
  dyn = tuple(is_array(x) for x in leaves)
  static = tuple(x for x, d in zip(leaves, dyn) if not d)
  if not _hashable(static):
    bad = next(x for x in static if not _hashable(x))
    raise error(f"keyword argument value {bad!r:.60} is neither an array nor hashable: "
                "a folded apply_fn traces array keyword arguments and re-analyses per value "
                "of the others")
  arrays = [x for x, d in zip(leaves, dyn) if d]
  n = len(args)

  def bound(params, *a):
    it = iter(a[n])
    full = [next(it) if d else x for x, d in zip(leaves, dyn)]
    return apply_fn(params, *a[:n], **jax.tree_util.tree_unflatten(tree, full))

  call_args = (*args, arrays)
  # Typed: 1 == 1.0 == True hash alike, but a program may branch on the type
  # (isinstance(n, int), jnp.arange(n)); one value's analysis must not serve another.
  typed = tuple((type(x), x) for x in static)
  return Call((signature(call_args), tree, dyn, typed), bound, call_args)


class _Traced:
  def __repr__(self) -> str:
    return "<array>"


def key_kwargs_text(key: tuple) -> str:
  """The keyword arguments of a ``Call.key``, for messages: static values, and
  ``<array>`` for traced leaves ("" without keyword arguments)."""
  if len(key) != 4:
    return ""
  _, tree, dyn, static = key
  it = iter(static)
  kwargs = jax.tree_util.tree_unflatten(tree, [_Traced() if d else next(it)[1] for d in dyn])   # (type, value)
  return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def kwargs_text(kwargs: dict) -> str:
  return ", ".join(f"{k}={'<array>' if is_array(v) else repr(v)}" for k, v in kwargs.items())


# ----------------------------------------------------------------------------
# The bootstrap: trace → Program → Analyzer.


class Traced(NamedTuple):
  """``fn(params, *args)`` traced: the closed jaxpr (whose identity keys the
  analysis cache), its open form, the output tree and the parameter names."""
  closed: Any
  jaxpr: Any
  consts: list
  out_tree: Any
  names: tuple       # jax.tree_util.keystr of every parameter leaf


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
  """Tracing and the analysis allocate many small, short-lived objects and no
  cycles worth collecting mid-way: the collector's pauses are pure overhead
  (a third of a cold fold)."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()


def trace_session() -> contextlib.AbstractContextManager:
  """Within it, traces of one function at several shapes (a fold's example and
  its probe) share what tracing can reuse: linen's parameter checks."""
  return flax_linen.memoized_param_checks()


def trace(fn: Callable, params: Any, args: tuple, error: Optional[type] = None,
          later: Optional[str] = None) -> Traced:
  """Traces ``fn(params, *args)`` (abstract or concrete values); with
  ``error``, a failure to trace is re-raised as that class with what to fix.
  ``later``: these are a later call's arguments, not the example (its shapes,
  for the message: the example traced, so the call's arguments are at fault)."""
  try:
    with no_gc(), trace_session():
      closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(params, *args)
  except JaxfoldError:
    raise
  except Exception as e:  # noqa: BLE001 - re-raised with context below
    if error is None:
      raise
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    what, args_name = ("apply_fn(params, *example_args)", "params/example_args") if later is None else (
        f"apply_fn(params, *args) with this call's arguments ({later})", "params and these arguments")
    raise error(
        f"could not trace {what}: {type(e).__name__}: {first}\n"
        "jaxfold analyses the function's jaxpr, so apply_fn must be traceable by jax "
        "(no Python control flow on array values, no numpy conversion of inputs) and "
        f"{args_name} must be what apply_fn expects (same pytree structure and shapes)."
    ) from e
  jaxpr, consts = compat.open_jaxpr(closed)
  names = tuple(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])
  return Traced(closed, jaxpr, consts, jax.tree_util.tree_structure(out_shape), names)


@contextlib.contextmanager
def analyzer(traced: Traced, *, cbwc: bool = False, through_dropout: bool = False) -> Iterator[Analyzer]:
  """An ``Analyzer`` of the traced program, its first ``len(names)`` inputs
  the parameters, valid inside the ``with`` (which owns the factor tables of
  ``algebra``); on leaving it the analyzer is released (``Analyzer.release``)."""
  with algebra.scope(), no_gc():
    an = Analyzer(Program(traced.closed, custom_boundaries=cbwc), cbwc=cbwc, through_dropout=through_dropout)
    an.num_leaves = len(traced.names)
    try:
      yield an
    finally:
      an.release()


def model_parts(model: Any, example_args: tuple, takes: str, error: type) -> tuple:
  """``(params, apply_fn, example_args)`` of a transform's input (a
  ``Folded``, ``Fused``, ...: anything with ``params`` and ``apply_fn``); the
  example arguments default to those its apply function recorded. ``takes``
  says what the transform expects, for the message."""
  params, fn = getattr(model, "params", None), getattr(model, "apply_fn", None)
  if params is None or not callable(fn):
    raise error(f"{takes}, got {type(model).__name__}")
  if not example_args:
    example_args = getattr(fn, "example_args", None)
    if example_args is None:
      raise error("pass example_args: the model's apply_fn does not record them")
  return params, fn, tuple(example_args)


def holds_array(value: Any) -> bool:
  """Whether a keyword argument's value has an array leaf (traced, not static)."""
  return any(is_array(x) for x in jax.tree_util.tree_leaves(value))


def model_kwargs(model: Any, example_args: tuple) -> dict:
  """The example keyword arguments a transform analyses at: those the model's
  apply function recorded (the fold's ``example_kwargs``). Where the caller
  passed other example arguments, only the static ones (``train=False``: which
  program the model is) are kept; array ones (a mask) go with the example's
  shapes and are dropped with them."""
  kwargs = dict(getattr(getattr(model, "apply_fn", None), "example_kwargs", None) or {})
  if example_args:
    kwargs = {k: v for k, v in kwargs.items() if not holds_array(v)}
  return kwargs


# ----------------------------------------------------------------------------
# The apply wrapper.


class PipelineApply:
  """An apply function made by a transform: takes the original's arguments
  and keyword arguments, analyses (and caches) per input signature.

  ``inner`` is the function transformed (the user's ``apply_fn`` for a fold,
  the fold's apply function for ``fuse_affine``, ...); ``params_abstract`` the
  abstract parameters it takes. A subclass analyses one signature in
  ``_analyse(call)`` and runs in ``__call__``; ``analysis_for(args, kwargs)``
  is the one way to ask for the analysis at some arguments (``_cached(call)``
  its lookup in the per-signature cache; ``seed`` records the example's).
  ``error`` is the transform's error class. Every transform's
  apply function is a ``step.Step`` (this wrapper with a ``kind`` and its
  save/load records); ``save_fold`` walks a chain of steps through ``inner``.
  """

  error: type = JaxfoldError

  def __init__(self, inner: Callable, params_abstract: Any, example_args: tuple = (),
               example_kwargs: Optional[dict] = None):
    self._inner = inner
    self._params = params_abstract
    self._cache: dict = {}
    self._example = jax.tree_util.tree_map(lambda v: abstract(v, self.error) if is_array(v) else v,
                                           (tuple(example_args), dict(example_kwargs or {})))
    functools.update_wrapper(self, inner, updated=())

  @property
  def inner(self) -> Callable:
    """The function this transform was applied to."""
    return self._inner

  @property
  def original_fn(self) -> Callable:
    """The user's apply function at the start of the chain of transforms."""
    fn = self._inner
    return fn.original_fn if isinstance(fn, PipelineApply) else fn

  @property
  def params_abstract(self) -> Any:
    """The abstract parameters ``inner`` takes."""
    return self._params

  @property
  def example_args(self) -> tuple:
    """The abstract example arguments the transform was traced with."""
    return self._example[0]

  @property
  def example_kwargs(self) -> dict:
    """The abstract example keyword arguments the transform was traced with."""
    return self._example[1]

  def bind(self, args: tuple, kwargs: Optional[dict] = None) -> Call:
    return bind(self._inner, tuple(args), kwargs, self.error)

  def analysis_for(self, args: tuple, kwargs: Optional[dict] = None) -> Any:
    """The analysis of a call with these arguments (cached per signature), e.g.
    ``folded.apply_fn.analysis_for((x,)).plan``."""
    return self._cached(self.bind(args, kwargs))

  def _cached(self, call: Call, extra: Any = None, make: Optional[Callable[[], Any]] = None) -> Any:
    """The cached analysis for ``call`` (``extra``: more of the cache key, e.g.
    the parameters' signature), made by ``make()`` (default ``_analyse(call)``)
    on a miss."""
    k = (call.key, extra)
    if k not in self._cache:
      self._cache[k] = make() if make is not None else self._analyse(call)
    return self._cache[k]

  def seed(self, call: Call, analysis: Any, extra: Any = None) -> None:
    """Records the analysis the transform made at its example."""
    self._cache[(call.key, extra)] = analysis

  def _analyse(self, call: Call) -> Any:
    raise NotImplementedError

  def __call__(self, params, *args, **kwargs):
    raise NotImplementedError


__all__ = ["Call", "PipelineApply", "Traced", "abstract", "abstract_tree", "analyzer", "bind",
           "dtype_of", "holds_array", "is_array", "key_kwargs_text", "kwargs_text", "leaves_signature", "model_parts",
           "no_gc", "shapes_text", "shapes_texts", "signature", "trace"]
