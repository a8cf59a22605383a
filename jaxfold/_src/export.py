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

The bytes are a small container around the ``jax.export`` serialization::

    b"JAXFOLDX" | header length (uint64 LE) | header (JSON) | SHA-256 of the header | program

The header records the program's SHA-256 and size, the versions that wrote it
and caller metadata (``meta=``: model name, the valid range of token ids, the
number of positions, ... — what ``jaxfold serve`` validates requests against).
:func:`load_exported` checks all of it before ``jax.export`` parses a byte, so a
flipped bit, a truncated download or a foreign file is one clear
:class:`jaxfold.IntegrityError` instead of a wrong answer or a parser crash.

Example:
    >>> blob = jaxfold.export(folded, ids, meta={"model": "gpt2-tiny"})  # symbolic ("batch", "seq")
    >>> open("model.jaxexport", "wb").write(blob)
    >>> fn = jaxfold.load_exported("model.jaxexport")       # a path, or the bytes
    >>> logits = fn(ids_of_any_batch_and_length)
    >>> fn.meta["model"]
    'gpt2-tiny'
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from jaxfold._src.fold import FoldedParams
from jaxfold._src.integrity import IntegrityError, IsADirectory, NotFoundError, versions

# Artifacts exported with params as an argument carry FoldedParams in their
# input tree; registered once, under a stable name.
jax_export.register_namedtuple_serialization(FoldedParams, serialized_name="jaxfold.FoldedParams")

__all__ = ["export", "load_exported", "ExportWarning", "exported_signature", "read_artifact",
           "wrap_artifact", "MAGIC", "ARTIFACT_VERSION"]

MAGIC = b"JAXFOLDX"
ARTIFACT_VERSION = 1
_LEN = struct.Struct("<Q")
_MAX_HEADER = 16 * 2**20


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
           check: bool = True, rtol: float = 1e-4, meta: Optional[dict] = None) -> bytes:
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
    meta: JSON-serializable metadata stored in the artifact's header (read
      back as ``load_exported(...).meta``).  ``jaxfold serve`` validates
      requests against ``meta["inputs"]`` — one dict per positional argument
      with ``name`` and, for integer inputs, ``low``/``high`` (valid values are
      ``low <= v < high``, e.g. ``0`` and the vocabulary size) — and
      ``meta["max_seq"]`` (the longest sequence, e.g. the position-table size);
      ``meta["seq_padding"] = "causal"`` tells it that right-padding a sequence
      leaves the outputs at earlier positions unchanged.

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

  blob = wrap_artifact(bytes(exported.serialize()), meta, params_as_argument=params_as_argument)
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

  def __init__(self, exported, header: Optional[dict] = None, source: str = "<bytes>"):
    self.exported = exported
    self.header = dict(header or {})
    self.meta = dict(self.header.get("meta") or {})
    self.source = source
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


def wrap_artifact(program: bytes, meta: Optional[dict] = None, *,
                  params_as_argument: bool = False) -> bytes:
  """Puts a ``jax.export`` serialization in jaxfold's hashed container."""
  header = {
      "format": "jaxfold-export", "format_version": ARTIFACT_VERSION,
      "params_as_argument": bool(params_as_argument),
      "payload_bytes": len(program), "payload_sha256": hashlib.sha256(program).hexdigest(),
      "written_by": versions(), "meta": dict(meta or {}),
  }
  try:
    raw = json.dumps(header, sort_keys=True, allow_nan=False).encode()
  except (TypeError, ValueError) as e:
    raise TypeError(f"export: meta must be JSON-serializable (str/int/float/bool/None, lists, "
                    f"dicts; finite numbers): {e}") from None
  return MAGIC + _LEN.pack(len(raw)) + raw + hashlib.sha256(raw).digest() + program


_REEXPORT = "re-export it (`jaxfold export ...` or jaxfold.export) or copy it again from a good source"


def read_artifact(data: bytes, source: str = "<bytes>") -> tuple[dict, bytes]:
  """Checks the container and returns ``(header, jax.export serialization)``;
  :class:`IntegrityError` naming ``source`` on any damage."""
  n = len(data)
  lead = len(MAGIC) + _LEN.size
  if n < lead or data[:len(MAGIC)] != MAGIC:
    if n == 0:
      raise IntegrityError(f"{source} is empty (0 bytes): {_REEXPORT}")
    if n < lead and MAGIC.startswith(bytes(data[:len(MAGIC)])):
      raise IntegrityError(f"{source} is truncated ({n} bytes): {_REEXPORT}")
    raise IntegrityError(
        f"{source} is not a jaxfold artifact (it does not start with the jaxfold header): it is "
        "another kind of file, damaged at the start, a raw jax.export serialization or an "
        "artifact of jaxfold 0.1 (no content hash). Re-export it with `jaxfold export`; a raw "
        "jax.export serialization you trust loads with load_exported(..., verify=False)")
  (hlen,) = _LEN.unpack_from(data, len(MAGIC))
  if hlen > _MAX_HEADER:
    raise IntegrityError(f"{source}: the header length field is damaged ({hlen} bytes): {_REEXPORT}")
  if n < lead + hlen + 32:
    raise IntegrityError(f"{source} is truncated ({n} bytes, its header alone needs "
                         f"{lead + hlen + 32}): {_REEXPORT}")
  raw = bytes(data[lead:lead + hlen])
  if hashlib.sha256(raw).digest() != bytes(data[lead + hlen:lead + hlen + 32]):
    raise IntegrityError(f"{source}: the header does not match its SHA-256 (damaged): {_REEXPORT}")
  try:
    header = json.loads(raw)
  except ValueError as e:
    raise IntegrityError(f"{source}: the header is not valid JSON ({e}): {_REEXPORT}") from None
  version = header.get("format_version")
  by = (header.get("written_by") or {}).get("jaxfold", "?")
  if header.get("format") != "jaxfold-export" or not isinstance(version, int):
    raise IntegrityError(f"{source}: the header does not describe a jaxfold artifact: {_REEXPORT}")
  if version > ARTIFACT_VERSION:
    raise IntegrityError(f"{source} was written by jaxfold {by} (artifact format {version}); this "
                         f"jaxfold reads format <= {ARTIFACT_VERSION}: upgrade jaxfold")
  program = data[lead + hlen + 32:]
  want = header.get("payload_bytes")
  if len(program) != want:
    what = "truncated" if len(program) < (want or 0) else "longer than written (trailing bytes)"
    raise IntegrityError(f"{source} is {what}: its program has {len(program)} bytes, {want} were "
                         f"written: {_REEXPORT}")
  if hashlib.sha256(program).hexdigest() != header.get("payload_sha256"):
    raise IntegrityError(f"{source}: the program does not match its SHA-256 (corrupted, e.g. flipped "
                         f"bits): {_REEXPORT}")
  return header, bytes(program)


def _deserialize(program: bytes, source: str, header: dict):
  try:
    return jax_export.deserialize(bytearray(program))
  except Exception as e:  # noqa: BLE001 - flatbuffers/jax raise many types on foreign input
    by = header.get("written_by") or {}
    first = (str(e).strip().splitlines() or [""])[0][:200]
    hint = (f"it was written with jax {by.get('jax')}, this is jax {jax.__version__}: use a jax "
            "that can read it or re-export it with this one" if by else
            "it is not a jax.export serialization or is damaged")
    raise IntegrityError(f"{source}: jax.export cannot read the program ({type(e).__name__}: "
                         f"{first}); {hint}") from None


def load_exported(data: bytes | str | os.PathLike, *, verify: bool = True) -> Callable[..., Any]:
  """Loads an artifact from :func:`export` (its bytes or its path) into a jitted callable.

  Needs only jax: not the model's code, not jaxfold's analysis.  The callable
  takes ``*args`` (or ``params, *args`` for ``params_as_argument=True``
  artifacts) and has ``.in_avals``, ``.out_avals``, ``.exported``, ``.meta``
  (the ``meta=`` given to :func:`export`) and ``.header``.

  The container is checked first (:class:`jaxfold.IntegrityError` naming the
  file on a truncated, damaged or foreign file).  ``verify=False`` also accepts
  a raw ``jax.export`` serialization (no hash: nothing is verified).

  Example:
    >>> fn = jaxfold.load_exported("model.jaxexport")
    >>> logits = fn(ids)
  """
  source = "<bytes>"
  if isinstance(data, (str, os.PathLike)):
    source = os.path.abspath(os.fspath(data))
    if os.path.isdir(source):
      raise IsADirectory(f"{source} is a directory: a saved fold loads with "
                              "jaxfold.load_fold; load_exported takes an artifact file")
    try:
      with open(source, "rb") as f:
        data = f.read()
    except FileNotFoundError:
      raise NotFoundError(f"{source} does not exist: write an artifact with `jaxfold export "
                              "--model NAME --out FILE` or jaxfold.export") from None
  elif not isinstance(data, (bytes, bytearray, memoryview)):
    raise TypeError(f"load_exported takes the artifact's bytes or its path, got "
                    f"{type(data).__name__}")
  data = bytes(data)
  if not verify and not data.startswith(MAGIC):
    return _Loaded(_deserialize(data, source, {}), {}, source)
  header, program = read_artifact(data, source)
  return _Loaded(_deserialize(program, source, header), header, source)


def exported_signature(fn: Any) -> list:
  """``[(shape with symbolic names as str, dtype name), ...]`` of a loaded artifact's inputs."""
  return [(tuple(d if isinstance(d, int) else str(d) for d in a.shape), str(a.dtype))
          for a in fn.in_avals]
