"""Export a folded model as a self-contained, serialized ``jax.export`` artifact.

Design choice: by default the folded parameters are **baked into** the
artifact as constants (``params_as_argument=False``).  The bytes then hold the
whole inference program, and :func:`load_exported` returns a callable that
needs neither the model's Python code nor jaxfold's analysis — only jax.  Pass
``params_as_argument=True`` to export ``f(params, *args)`` instead (smaller
artifact, parameters shipped separately, e.g. with :mod:`jaxfold.serialization`).

Batch and sequence dimensions are exported symbolically where the program
allows it (``jax.export.symbolic_shape``), so one artifact serves any batch
size and sequence length.  When the program does not support symbolic shapes
(Python control flow on a shape, shape-dependent slicing that jax cannot
prove in range, ...) ``export`` retries with a symbolic batch only and then
with the concrete example shapes, warning each time.

Example:
    >>> blob = jaxfold.export(folded, ids)                  # symbolic ("batch", "seq")
    >>> open("model.jaxexport", "wb").write(blob)
    >>> fn = jaxfold.load_exported(open("model.jaxexport", "rb").read())
    >>> logits = fn(ids_of_any_batch_and_length)
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from jaxfold._src.fold import FoldedParams

# Artifacts exported with params as an argument carry FoldedParams in their
# input tree; registered once, under a stable name.
jax_export.register_namedtuple_serialization(FoldedParams, serialized_name="jaxfold.FoldedParams")

__all__ = ["export", "load_exported", "ExportWarning", "exported_signature"]


class ExportWarning(UserWarning):
  """The artifact was exported with fewer symbolic dimensions than asked for."""


def _leaf_spec(x: Any, names: Sequence[str], dims: dict) -> jax.ShapeDtypeStruct:
  shape = list(np.shape(x))
  for i, name in enumerate(names):
    if i < len(shape):
      shape[i] = dims[name]
  return jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x))


def _arg_specs(args: tuple, names: Sequence[str]) -> tuple:
  """ShapeDtypeStructs for ``args``; leading axis i of every array gets ``names[i]``."""
  if names:
    symbols = jax_export.symbolic_shape(", ".join(names))
    dims = dict(zip(names, symbols))
  else:
    dims = {}
  return jax.tree_util.tree_map(lambda x: _leaf_spec(x, names, dims), args)


def _check_symbolic(symbolic) -> tuple:
  if symbolic is None:
    return ()
  if isinstance(symbolic, str):
    symbolic = tuple(s.strip() for s in symbolic.split(",") if s.strip())
  symbolic = tuple(symbolic)
  for s in symbolic:
    if not (isinstance(s, str) and s.isidentifier()):
      raise ValueError(f"symbolic dimension names must be identifiers, got {s!r} "
                       "(e.g. symbolic=('batch', 'seq'))")
  if len(set(symbolic)) != len(symbolic):
    raise ValueError(f"symbolic dimension names must be distinct, got {symbolic}")
  return symbolic


def export(folded: Any, *example_args: Any, symbolic: Optional[Sequence[str]] = ("batch", "seq"),
           params_as_argument: bool = False, platforms: Optional[Sequence[str]] = None,
           check: bool = True, rtol: float = 1e-4) -> bytes:
  """Serializes ``folded.apply_fn(folded.params, *args)`` with ``jax.export``.

  Args:
    folded: the result of :func:`jaxfold.fold` (anything with ``.params`` and
      ``.apply_fn``).
    *example_args: arrays (or ``jax.ShapeDtypeStruct``) giving the argument
      structure, dtypes and the shapes of the non-symbolic dimensions.
    symbolic: names for the leading dimensions of every array argument, e.g.
      ``("batch", "seq")`` (axis 0 is ``batch``, axis 1 is ``seq`` wherever an
      argument has it); ``None`` or ``()`` exports the example shapes exactly.
      When tracing with these fails, ``export`` falls back to ``symbolic[:1]``
      and then to concrete shapes, with an :class:`ExportWarning`.
    params_as_argument: ``False`` (default) bakes the folded parameters into
      the artifact; ``True`` exports ``f(params, *args)``.
    platforms: lowering platforms, e.g. ``("cpu", "cuda")``; default: the
      current backend.
    check: run the exported program on the example arguments (when they are
      concrete arrays) and compare with ``folded.apply_fn``; raises
      ``AssertionError`` on a relative difference above ``rtol``.

  Returns:
    The serialized artifact (``bytes``), loadable with :func:`load_exported`.
  """
  if not (hasattr(folded, "params") and hasattr(folded, "apply_fn")):
    raise TypeError(f"export expects the result of jaxfold.fold (with .params and .apply_fn), "
                    f"got {type(folded).__name__}")
  if not example_args:
    raise ValueError("export needs example arguments: export(folded, *example_args)")
  names = _check_symbolic(symbolic)
  apply_fn, params = folded.apply_fn, folded.params

  if params_as_argument:
    fn = jax.jit(lambda p, *a: apply_fn(p, *a))
  else:
    fn = jax.jit(lambda *a: apply_fn(params, *a))
  kwargs = {"platforms": tuple(platforms)} if platforms else {}
  exporter = jax_export.export(fn, **kwargs)
  p_spec = (jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)),
                                   params),) if params_as_argument else ()

  attempts = [names]
  if len(names) > 1:
    attempts.append(names[:1])
  if names:
    attempts.append(())
  errors = []
  exported = None
  for attempt in attempts:
    try:
      exported = exporter(*p_spec, *_arg_specs(example_args, attempt))
    except Exception as e:  # noqa: BLE001 - shape polymorphism errors come in many types
      if not attempt:
        raise
      first = (str(e).strip().splitlines() or [""])[0]
      errors.append(f"symbolic {attempt}: {type(e).__name__}: {first[:300]}")
      continue
    if errors:
      what = f"symbolic dimensions {attempt}" if attempt else "the concrete example shapes"
      warnings.warn("the program does not support all the requested symbolic dimensions; "
                    f"exported with {what} instead ({'; '.join(errors)})", ExportWarning,
                    stacklevel=2)
    break

  blob = bytes(exported.serialize())
  if check and all(isinstance(x, (jax.Array, np.ndarray)) for x in jax.tree_util.tree_leaves(example_args)):
    fn_loaded = load_exported(blob)
    got = fn_loaded(params, *example_args) if params_as_argument else fn_loaded(*example_args)
    want = fn(params, *example_args) if params_as_argument else fn(*example_args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
      scale = max(float(np.max(np.abs(w))) if w.size else 0.0, 1e-30)
      err = float(np.max(np.abs(g - w))) / scale if w.size else 0.0
      if not err <= rtol:
        raise AssertionError(f"exported program differs from folded.apply_fn: relative error "
                             f"{err:.3g} > rtol={rtol:g}")
  return blob


class _Loaded:
  """Callable wrapper around a deserialized ``jax.export.Exported``."""

  def __init__(self, exported):
    self.exported = exported
    self._call = jax.jit(exported.call)

  @property
  def in_avals(self):
    return self.exported.in_avals

  @property
  def out_avals(self):
    return self.exported.out_avals

  def __call__(self, *args):
    return self._call(*args)

  def __repr__(self):
    ins = ", ".join(str(a) for a in self.exported.in_avals)
    return f"<exported jaxfold program ({ins}) on {', '.join(self.exported.platforms)}>"


def load_exported(data: bytes) -> Callable[..., Any]:
  """Deserializes an artifact from :func:`export` into a jitted callable.

  Needs only jax: not the model's code, not jaxfold's analysis.  The callable
  takes ``*args`` (or ``params, *args`` for ``params_as_argument=True``
  artifacts) and has ``.in_avals``, ``.out_avals`` and ``.exported``.
  """
  if isinstance(data, str):
    raise TypeError("load_exported takes the artifact's bytes; read the file with "
                    "open(path, 'rb').read()")
  return _Loaded(jax_export.deserialize(bytearray(data)))


def exported_signature(fn: Any) -> list:
  """``[(shape with symbolic names as str, dtype name), ...]`` of a loaded artifact's inputs."""
  return [(tuple(d if isinstance(d, int) else str(d) for d in a.shape), str(a.dtype))
          for a in fn.in_avals]
