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
prove in range, ...) ``export`` retries with a symbolic batch only, a
symbolic sequence only and then the concrete example shapes, warning each
time. An axis is named only on the arguments whose size there is the
example's for that name (the first argument's): a raw PRNG key of shape (2,)
or a position table of 48 rows keeps its size, and a typed key its shape. A Python branch on a size
that tracing *can* decide (``x.shape[0] == 1``, ``b % 4 == 0``, ``b == 5`` are
False for a symbolic batch unless provably true) is decided once for every
size: such a comparison, made by the program (not by jax or jaxfold) while it
is traced, makes ``export`` use fewer symbolic dims; and with ``check=True`` the
symbolic program is also run with every symbolic dim 1 and one larger than the
example, and a program that differs there from ``folded.apply_fn`` is exported
with fewer symbolic dims.

The bytes are a small container around the ``jax.export`` serialization::

    b"JAXFOLDX" | header length (uint64 LE) | header (JSON) | SHA-256 of the header | program
             | parameter tensors (format 2)

The header records the program's SHA-256 and size, each parameter tensor's
name, dtype, shape, offset and SHA-256, the versions that wrote it and caller
metadata (``meta=``: model name, the valid range of token ids, the
number of positions, ... — what ``jaxfold serve`` validates requests against).
:func:`load_exported` checks all of it before ``jax.export`` parses a byte, so a
flipped bit, a truncated download or a foreign file is one clear
:class:`jaxfold.IntegrityError` instead of a wrong answer or a parser crash.

These SHA-256s are unkeyed: they catch accidents, not tampering (anyone can
edit the metadata and re-hash).  ``export(..., key=K)`` adds
``hmac_sha256`` to the header (HMAC-SHA256 under ``K`` of the header without
it, which holds every other hash), and ``load_exported(..., key=K)`` /
``jaxfold serve --verify-key FILE`` refuse an artifact that is unsigned or
whose signature does not match.  The file is read once and verified and parsed
from the same bytes in memory.

The parameters are stored beside the program (not baked into it as constants)
and passed to it as arguments, so each input shape compiled (``jaxfold serve``
compiles one program per padded bucket) shares one copy of the weights.

Example:
    >>> blob = jaxfold.export(folded, ids, meta={"model": "gpt2-tiny"})  # symbolic ("batch", "seq")
    >>> open("model.jaxexport", "wb").write(blob)
    >>> fn = jaxfold.load_exported("model.jaxexport")       # a path, or the bytes
    >>> logits = fn(ids_of_any_batch_and_length)
    >>> fn.meta["model"]
    'gpt2-tiny'
"""

from __future__ import annotations

import functools
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

from jaxfold._src import compat, pipeline
from jaxfold._src.integrity import (
  IntegrityError,
  IsADirectory,
  NotFoundError,
  atomic_write_bytes,
  hmac_hex,
  hmac_matches,
  versions,
)

# Artifacts exported with params as an argument carry each step's parameter type
# in their input tree: every step module registers its own (step.register_params).

__all__ = ["export", "load_exported", "ExportWarning", "exported_signature", "read_artifact",
           "read_weights", "wrap_artifact", "MAGIC", "ARTIFACT_VERSION"]

MAGIC = b"JAXFOLDX"
# 1: header + program (parameters baked in or passed by the caller);
# 2: also the parameter tensors after the program, each hashed.
ARTIFACT_VERSION = 2
_LEN = struct.Struct("<Q")
_MAX_HEADER = 16 * 2**20


def _host_tensor(x: Any) -> Any:
  """A parameter on the host; typed PRNG keys stay key arrays (numpy has no key
  dtype: ``wrap_artifact`` stores their ``key_data``)."""
  x = jax.device_get(x)
  return x if compat.is_prng_key(getattr(x, "dtype", None)) else np.asarray(x)


class ExportWarning(UserWarning):
  """The artifact was exported with fewer symbolic dimensions than asked for."""


def _naming(args: tuple, names: Sequence[str]) -> list:
  """Per flattened leaf of ``args``, the symbolic name of each leading axis or
  None (kept at the example's size).

  Axis ``i`` of a leaf is named ``names[i]`` where its size is the example's
  size for that name: the size of axis ``i`` of the first argument leaf that
  has one. A leaf of another size there (a position table of 48 rows beside 4
  tokens, a raw PRNG key of shape (2,) beside a batch of 4) keeps its size, and
  typed PRNG keys keep their shape. (Where the program then needs the two
  sizes to agree, tracing fails and ``export`` tries fewer names.)
  """
  leaves = jax.tree_util.tree_leaves(args)
  shapes = [tuple(getattr(x, "shape", np.shape(x))) for x in leaves]
  ref = {i: next((s[i] for s in shapes if len(s) > i), None) for i in range(len(names))}
  out = []
  for x, s in zip(leaves, shapes):
    key = compat.is_prng_key(getattr(x, "dtype", None))
    out.append(tuple(None if key or names[i] is None or s[i] != ref[i] else names[i]
                     for i in range(min(len(names), len(s)))))
  return out


def _shown(attempt: Sequence[Optional[str]]) -> str:
  """An attempt's names as the warnings show them: ``('batch', 'seq')``, ``(axis 1: 'seq')``."""
  if all(n is not None for n in attempt):
    return str(tuple(attempt))
  return "(" + ", ".join(f"axis {i}: {n!r}" for i, n in enumerate(attempt) if n is not None) + ")"


def _unnamed(args: tuple, names: Sequence[str]) -> Optional[str]:
  """Which argument axes keep the example's size although ``names`` asks for
  them to be symbolic (the warning's text), or None."""
  kept = []
  for path_leaf, named in zip(jax.tree_util.tree_flatten_with_path(args)[0], _naming(args, names)):
    path, x = path_leaf
    if compat.is_prng_key(getattr(x, "dtype", None)):
      continue   # a key's shape is never a batch or a sequence
    fixed = [i for i, n in enumerate(named) if n is None and names[i] is not None]
    if fixed:
      shape = tuple(getattr(x, "shape", np.shape(x)))
      kept.append(f"args{jax.tree_util.keystr(path)} {list(shape)} axis {', '.join(map(str, fixed))}")
  return "; ".join(kept) or None


def _arg_specs(args: tuple, names: Sequence[str]) -> tuple:
  """ShapeDtypeStructs for ``args``, leading axes named as ``_naming`` says."""
  given = [n for n in names if n is not None]
  dims = dict(zip(given, jax_export.symbolic_shape(", ".join(given)))) if given else {}
  leaves, tree = jax.tree_util.tree_flatten(args)
  specs = []
  for x, named in zip(leaves, _naming(args, names)):
    shape = list(np.shape(x))
    for i, n in enumerate(named):
      if n is not None:
        shape[i] = dims[n]
    specs.append(jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x)))
  return jax.tree_util.tree_unflatten(tree, specs)


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
           check: bool = True, rtol: float = 1e-4, meta: Optional[dict] = None,
           bundle_params: bool = True, key: Optional[bytes | str] = None,
           example_kwargs: Optional[dict] = None) -> bytes:
  """Serializes ``folded.apply_fn(folded.params, *args, **kwargs)`` with ``jax.export``.

  Args:
    folded: the result of :func:`jaxfold.fold` (anything with ``.params`` and
      ``.apply_fn``).
    *example_args: arrays (or ``jax.ShapeDtypeStruct``) giving the argument
      structure, dtypes and the shapes of the non-symbolic dimensions.
    symbolic: names for the leading dimensions of every array argument, e.g.
      ``("batch", "seq")`` (axis 0 is ``batch``, axis 1 is ``seq`` wherever an
      argument has it); ``None`` or ``()`` exports the example shapes exactly.
      An argument whose axis has another size than the first argument's keeps
      it (a key, a position table). When tracing with these fails,
      ``export`` falls back to ``symbolic[:1]``, then to ``symbolic[1]`` alone
      and then to concrete shapes, with an :class:`ExportWarning`.
    params_as_argument: ``False`` (default) ships the folded parameters in
      the artifact; ``True`` exports ``f(params, *args)`` (the caller supplies
      them).
    bundle_params: with ``params_as_argument=False``: ``True`` (default)
      stores the parameters beside the program, one hashed tensor each, and
      passes them as arguments when it runs, so every compiled shape shares one
      copy of the weights; ``False`` bakes them into the program as constants
      (every compilation then embeds its own copy).
    platforms: lowering platforms, e.g. ``("cpu", "cuda")``; default: the
      current backend.
    check: run the exported program on the example arguments (when they are
      concrete arrays) and compare with ``folded.apply_fn``; raises
      ``AssertionError`` on a relative difference above ``rtol``. A symbolic
      export is also compared at the example resized (entries repeated) to
      every symbolic dim 1 and one larger; where it differs, ``export`` falls
      back to fewer symbolic dims (:class:`ExportWarning`).
    meta: JSON-serializable metadata stored in the artifact's header (read
      back as ``load_exported(...).meta``).  ``jaxfold serve`` validates
      requests against ``meta["inputs"]`` — one dict per positional argument
      with ``name`` and, for integer inputs, ``low``/``high`` (valid values are
      ``low <= v < high``, e.g. ``0`` and the vocabulary size) — and
      ``meta["max_seq"]`` (the longest sequence, e.g. the position-table size);
      ``meta["seq_padding"] = "causal"`` tells it that right-padding a sequence
      leaves the outputs at earlier positions unchanged.
    key: sign the artifact (HMAC-SHA256 of its header, which holds the hash
      of every other byte); ``load_exported(..., key=key)`` then refuses an
      unsigned or modified one.
    example_kwargs: keyword arguments bound into the program (``{"train":
      False}``: which program the model is); the artifact takes positional
      arguments only, so array inputs go in ``example_args``. Default: the
      non-array keyword arguments the model was folded with (its
      ``example_kwargs``), as ``fuse_affine``/``defer_norms``/``rotate`` use them.

  Returns:
    The serialized artifact (``bytes``), loadable with :func:`load_exported`.
  """
  if not (hasattr(folded, "params") and hasattr(folded, "apply_fn")):
    raise TypeError(f"export expects the result of jaxfold.fold (with .params and .apply_fn), "
                    f"got {type(folded).__name__}")
  if not example_args:
    raise ValueError("export needs example arguments: export(folded, *example_args)")
  names = _check_symbolic(symbolic)
  bound = _bound_kwargs(folded, example_args, example_kwargs)
  apply_fn = functools.partial(folded.apply_fn, **bound) if bound else folded.apply_fn
  params = folded.params

  bundled = bundle_params and not params_as_argument
  # The program takes the parameters as a flat list: jax.export serializes only the
  # pytree nodes it knows, not e.g. nnx.State and its Param/RngKey/RngCount variables.
  p_leaves, p_tree = jax.tree_util.tree_flatten(params)
  if params_as_argument or bundled:
    fn = jax.jit(lambda p, *a: apply_fn(jax.tree_util.tree_unflatten(p_tree, p), *a))
  else:
    fn = jax.jit(lambda *a: apply_fn(params, *a))
  kwargs = {"platforms": tuple(platforms)} if platforms else {}
  exporter = jax_export.export(fn, **kwargs)
  p_spec = ([jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in p_leaves],) \
      if (params_as_argument or bundled) else ()

  # Fewer symbolic dims each time tracing (or the check) refuses: batch only,
  # then sequence only (a program that branches on its batch size), then none.
  attempts = [names]
  if len(names) > 1:
    attempts += [names[:1], (None, *names[1:2])]
  if names:
    attempts.append(())
  errors = []
  exported = None
  concrete = all(isinstance(x, (jax.Array, np.ndarray)) for x in jax.tree_util.tree_leaves(example_args))
  flat = (p_leaves,) if (params_as_argument or bundled) else ()
  for attempt in attempts:
    try:
      with compat.undecided_size_comparisons() as undecided:
        exported = exporter(*p_spec, *_arg_specs(example_args, attempt))
    except Exception as e:  # noqa: BLE001 - shape polymorphism errors come in many types
      if not attempt:
        raise
      first = (str(e).strip().splitlines() or [""])[0]
      errors.append(f"symbolic {_shown(attempt)}: {type(e).__name__}: {first[:300]}")
      continue
    if attempt and undecided:
      # ``b == 5`` is False for a symbolic b (True would need a proof): a
      # branch on it was traced once for every size, right only where it holds.
      errors.append(f"symbolic {_shown(attempt)}: the program compares symbolic sizes in Python, which jax.export "
                    f"decides as unequal for every size ({'; '.join(dict.fromkeys(undecided))})")
      exported = None
      continue
    if attempt and check and concrete:
      # A Python branch on a symbolic size is decided once, for all sizes
      # (``b == 1`` is False, so is ``b % 2 == 0``): the program may then be
      # another one at sizes the example does not have. Run it where such
      # branches flip (every symbolic dim 1, and one larger than the example).
      differs = _differs_at_other_sizes(exported, fn, flat, example_args, attempt, rtol)
      if differs:
        errors.append(f"symbolic {_shown(attempt)}: {differs}")
        exported = None
        continue
    kept = _unnamed(example_args, attempt)
    if kept:
      errors.append(f"these argument axes keep the example's size: {kept}")
    if errors:
      what = (f"symbolic dimensions {_shown(attempt)}" if any(attempt)
              else "the concrete example shapes")
      warnings.warn("the program does not support all the requested symbolic dimensions; "
                    f"exported with {what} instead ({'; '.join(errors)})", ExportWarning,
                    stacklevel=2)
    break

  weights = None
  if bundled:
    weights = [(jax.tree_util.keystr(path), _host_tensor(x))
               for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]
  blob = wrap_artifact(bytes(exported.serialize()), meta, params_as_argument=params_as_argument,
                       weights=weights, flat_params=params_as_argument or bundled, key=key)
  if check and concrete:
    fn_loaded = load_exported(blob)
    got = fn_loaded(params, *example_args) if params_as_argument else fn_loaded(*example_args)
    want = fn(p_leaves, *example_args) if (params_as_argument or bundled) else fn(*example_args)
    err = _max_rel_diff(got, want)
    if not err <= rtol:
      raise AssertionError(f"exported program differs from folded.apply_fn: relative error "
                           f"{err:.3g} > rtol={rtol:g}")
  return blob


def _bound_kwargs(folded: Any, example_args: tuple, example_kwargs: Optional[dict]) -> dict:
  """The keyword arguments ``export`` binds into the program (see its docstring)."""
  if example_kwargs is None:
    return pipeline.model_kwargs(folded, example_args)
  if not isinstance(example_kwargs, dict):
    raise TypeError(f"export's example_kwargs must be a dict of keyword arguments, got "
                    f"{type(example_kwargs).__name__}")
  arrays = sorted(k for k, v in example_kwargs.items() if pipeline.holds_array(v))
  if arrays:
    raise ValueError(f"export's example_kwargs {arrays} hold arrays: the artifact takes positional "
                     "arguments only, and an array bound here would be a constant of the example's "
                     "shape. Pass it among example_args (wrap apply_fn to take it positionally).")
  return dict(example_kwargs)


def _resized(args: tuple, names: Sequence[str], size: Callable[[int], int]) -> tuple:
  """``args`` with the axes that ``_naming`` names resized to ``size(n)``: the
  example's entries repeated cyclically (valid inputs, e.g. token ids)."""
  leaves, tree = jax.tree_util.tree_flatten(args)

  def one(x, named):
    if all(n is None for n in named):
      return x
    x = np.asarray(x)
    for i, n in enumerate(named):
      if n is not None:
        x = np.take(x, np.arange(size(x.shape[i])) % x.shape[i], axis=i)
    return x
  return jax.tree_util.tree_unflatten(tree, [one(x, n) for x, n in zip(leaves, _naming(args, names))])


def _differs_at_other_sizes(exported: Any, fn: Callable, flat: tuple, args: tuple, names: Sequence[str],
                            rtol: float) -> Optional[str]:
  """Where the symbolic program differs from ``fn`` at the example's arguments
  with every symbolic dim made 1 or one larger, the reason; else None (also
  where ``fn`` itself does not run at those sizes: nothing to compare)."""
  for size in (lambda n: n, lambda n: 1, lambda n: n + 1):
    try:
      probe = _resized(args, names, size)
      want = fn(*flat, *probe)
    except Exception:  # noqa: BLE001 - not a valid input of the folded program (or not resizable)
      continue
    try:
      got = exported.call(*flat, *probe)
    except Exception:  # noqa: BLE001 - the artifact refuses these sizes: not a wrong result
      continue
    err = _max_rel_diff(got, want)
    if not err <= rtol:
      shapes = ", ".join(str(np.shape(x)) for x in jax.tree_util.tree_leaves(probe))
      return (f"the program traced at symbolic sizes differs from folded.apply_fn at shapes {shapes} "
              f"(relative error {err:.3g}): Python control flow on a size (e.g. `x.shape[0] == 1`) "
              "is decided once for every symbolic size")
  return None


def _max_rel_diff(got: Any, want: Any) -> float:
  """Max over the leaves of max|got − want| / max|want| over the finite entries
  (inf where the non-finite ones differ)."""
  lg, lw = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
  if len(lg) != len(lw):
    return float("inf")
  worst = 0.0
  for g, w in zip(lg, lw):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    if g.shape != w.shape:
      return float("inf")
    # Non-finite entries must match exactly (a NaN the program itself makes is no difference).
    fg, fw = np.isfinite(g), np.isfinite(w)
    if not (np.array_equal(fg, fw) and np.array_equal(g[~fg], w[~fw], equal_nan=True)):
      return float("inf")
    if not fw.any():
      continue
    err = float(np.max(np.abs(g[fw] - w[fw]))) / max(float(np.max(np.abs(w[fw]))), 1e-30)
    worst = max(worst, err)
  return worst


class _Loaded:
  """Callable wrapper around a deserialized ``jax.export.Exported``."""

  def __init__(self, exported, header: Optional[dict] = None, source: str = "<bytes>",
               weights: Optional[list] = None):
    self.exported = exported
    self.header = dict(header or {})
    self.meta = dict(self.header.get("meta") or {})
    self.source = source
    self._call = jax.jit(exported.call)
    self.params = None
    self._n_params = 0
    args_def = exported.in_tree.children()[0]
    if weights is not None:      # bundled: the first argument is the parameter pytree
      params_def = args_def.children()[0]
      if params_def.num_leaves != len(weights):
        raise IntegrityError(f"{source}: the program takes {params_def.num_leaves} parameter "
                             f"tensors, the artifact holds {len(weights)}: {_REEXPORT}")
      for w, a in zip(weights, exported.in_avals):
        if tuple(w.shape) != tuple(a.shape) or w.dtype != a.dtype:   # key dtypes have no np.dtype
          raise IntegrityError(f"{source}: a stored tensor {w.dtype}{list(w.shape)} does not fit "
                               f"the program's parameter {a.str_short()}: {_REEXPORT}")
      self.params = jax.tree_util.tree_unflatten(params_def, [jnp.asarray(w) for w in weights])
      self._n_params = len(weights)
      args_def = jax.tree_util.treedef_tuple(args_def.children()[1:])
    self.in_tree = jax.tree_util.treedef_tuple(
        [args_def, exported.in_tree.children()[1]])   # ((*args), {}) as the caller passes them

  @property
  def in_avals(self):
    return self.exported.in_avals[self._n_params:]

  @property
  def out_avals(self):
    return self.exported.out_avals

  def __call__(self, *args):
    if args and self.header.get("params_as_argument") and self.header.get("flat_params"):
      args = (jax.tree_util.tree_leaves(args[0]), *args[1:])
    try:
      if self.params is not None:
        return self._call(self.params, *args)
      return self._call(*args)
    except (ValueError, TypeError) as e:
      why = self._mismatch(args)
      if why is None:
        raise
      raise type(e)(why) from e

  def _mismatch(self, args: tuple) -> Optional[str]:
    """Which input does not fit the exported shapes (jax's own message names
    ``args[k]`` of the flattened program), or None."""
    leaves = jax.tree_util.tree_leaves(args)
    avals = self.exported.in_avals[self._n_params if self.params is not None else 0:]
    if len(leaves) != len(avals):
      return None
    for k, (x, a) in enumerate(zip(leaves, avals)):
      shape = tuple(np.shape(x))
      fixed = len(shape) == len(a.shape) and all(
          not isinstance(d, (int, np.integer)) or d == n for d, n in zip(a.shape, shape))
      if not fixed:
        exported = "fixed shapes" if all(isinstance(d, (int, np.integer)) for d in a.shape) else "these shapes"
        return (f"{self.source}: input #{k} has shape {shape}, but the program was exported for {exported} "
                f"{a.str_short()} (its int dims are fixed: not asked to be symbolic, or kept at the example's "
                "size, with an ExportWarning, where the program could not be proved symbolic in them): call it "
                "at that shape, or export again with example arguments of the shapes you will call with")
    return None

  def __repr__(self):
    ins = ", ".join(str(a) for a in self.in_avals)
    return f"<exported jaxfold program ({ins}) on {', '.join(self.exported.platforms)}>"


def wrap_artifact(program: bytes, meta: Optional[dict] = None, *,
                  params_as_argument: bool = False, weights: Optional[list] = None,
                  flat_params: bool = False, key: Optional[bytes | str] = None) -> bytes:
  """Puts a ``jax.export`` serialization in jaxfold's hashed container.

  ``weights``: ``[(name, array), ...]`` stored after the program, each with its
  dtype, shape, offset and SHA-256 in the header (format 2); a typed PRNG key
  array is stored as its ``key_data`` with the implementation's name.
  ``flat_params``: the program takes the parameters as the flat list of their
  leaves (a ``params_as_argument`` artifact then flattens the caller's pytree)."""
  header = {
      "format": "jaxfold-export", "format_version": 1 if weights is None else ARTIFACT_VERSION,
      "params_as_argument": bool(params_as_argument), "flat_params": bool(flat_params),
      "payload_bytes": len(program), "payload_sha256": hashlib.sha256(program).hexdigest(),
      "written_by": versions(), "meta": dict(meta or {}),
  }
  chunks = []
  if weights is not None:
    table, offset = [], 0
    for name, w in weights:
      kinfo = {}
      if compat.is_prng_key(getattr(w, "dtype", None)):
        kinfo = {"key_impl": compat.key_impl_name(w)}
        w = jax.random.key_data(w)
      w = np.asarray(w)   # not ascontiguousarray: it makes a scalar 1-d
      data = w.tobytes()  # C order whatever w's layout
      table.append({"name": name, "dtype": jnp.dtype(w.dtype).name, "shape": list(w.shape),
                    "offset": offset, "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(), **kinfo})
      chunks.append(data)
      offset += len(data)
    header["weights"] = {"bytes": offset, "tensors": table}
  try:
    raw = json.dumps(header, sort_keys=True, allow_nan=False).encode()
    if key is not None:
      header["hmac_sha256"] = hmac_hex(key, raw)
      raw = json.dumps(header, sort_keys=True, allow_nan=False).encode()
  except (TypeError, ValueError) as e:
    raise TypeError(f"export: meta must be JSON-serializable (str/int/float/bool/None, lists, "
                    f"dicts; finite numbers): {e}") from None
  return b"".join([MAGIC, _LEN.pack(len(raw)), raw, hashlib.sha256(raw).digest(), program,
                   *chunks])


_REEXPORT = "re-export it (`jaxfold export ...` or jaxfold.export) or copy it again from a good source"


def _check_signed(header: dict, key: Any, source: str) -> None:
  mac = header.get("hmac_sha256")
  if mac is None:
    raise IntegrityError(f"{source} is not signed and a verification key was given: refusing it; "
                         "export it with key=... (`jaxfold export --sign-key FILE`)")
  rest = {k: v for k, v in header.items() if k != "hmac_sha256"}
  if not hmac_matches(key, json.dumps(rest, sort_keys=True, allow_nan=False).encode(), mac):
    raise IntegrityError(f"{source}: the signature does not match under the given key: the "
                         "artifact was modified after it was signed (e.g. its metadata edited and "
                         "re-hashed), or signed with another key; refusing it")


def write_artifact(path: str, data: bytes) -> None:
  """Writes the artifact ``data`` to ``path`` atomically: a reader sees the old
  file or the new one, never a prefix."""
  atomic_write_bytes(path, data)


def read_artifact(data: bytes, source: str = "<bytes>", *,
                  key: Optional[bytes | str] = None) -> tuple[dict, bytes]:
  """Checks the container and returns ``(header, jax.export serialization)``;
  :class:`IntegrityError` naming ``source`` on any damage (and, with ``key``,
  on a missing or wrong signature)."""
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
  if key is not None:
    _check_signed(header, key, source)
  body = memoryview(data)[lead + hlen + 32:]
  want = header.get("payload_bytes")
  weights = header.get("weights")
  want_total = (want or 0) + (int(weights.get("bytes", 0)) if isinstance(weights, dict) else 0)
  if not isinstance(want, int) or len(body) != want_total:
    what = "truncated" if len(body) < want_total else "longer than written (trailing bytes)"
    raise IntegrityError(f"{source} is {what}: {len(body)} bytes follow its header, {want_total} "
                         f"were written: {_REEXPORT}")
  program = bytes(body[:want])
  if hashlib.sha256(program).hexdigest() != header.get("payload_sha256"):
    raise IntegrityError(f"{source}: the program does not match its SHA-256 (corrupted, e.g. flipped "
                         f"bits): {_REEXPORT}")
  return header, program


def read_weights(data: bytes, header: dict, source: str = "<bytes>") -> Optional[list]:
  """The parameter tensors stored after the program (format 2), each checked
  against its SHA-256; ``None`` for an artifact without them."""
  weights = header.get("weights")
  if weights is None:
    return None
  start = len(data) - int(weights["bytes"])
  view = memoryview(data)[start:]
  out = []
  for k, t in enumerate(weights.get("tensors", [])):
    chunk = view[t["offset"]:t["offset"] + t["bytes"]]
    if hashlib.sha256(chunk).hexdigest() != t["sha256"]:
      raise IntegrityError(f"{source}: parameter tensor {k} ({t.get('name', '?')}, "
                           f"{t['dtype']}{t['shape']}) does not match its SHA-256 (corrupted, e.g. "
                           f"flipped bits): {_REEXPORT}")
    try:
      w = np.frombuffer(chunk, dtype=jnp.dtype(t["dtype"])).reshape(t["shape"])
      out.append(jax.random.wrap_key_data(w, impl=t["key_impl"]) if "key_impl" in t else w)
    except (TypeError, ValueError, KeyError) as e:
      raise IntegrityError(f"{source}: parameter tensor {k} ({t.get('name', '?')}) cannot be "
                           f"read ({e}): {_REEXPORT}") from None
  return out


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


def load_exported(data: bytes | str | os.PathLike, *, verify: bool = True,
                  key: Optional[bytes | str] = None) -> Callable[..., Any]:
  """Loads an artifact from :func:`export` (its bytes or its path) into a jitted callable.

  Needs only jax: not the model's code, not jaxfold's analysis.  The callable
  takes ``*args`` (or ``params, *args`` for ``params_as_argument=True``
  artifacts) and has ``.in_avals``, ``.out_avals``, ``.exported``, ``.meta``
  (the ``meta=`` given to :func:`export`) and ``.header``.

  The container is checked first (:class:`jaxfold.IntegrityError` naming the
  file on a truncated, damaged or foreign file).  ``verify=False`` also accepts
  a raw ``jax.export`` serialization (no hash: nothing is verified).  With
  ``key``, an artifact that is not signed with it (:func:`export` ``key=``) is
  refused.  The file is read once: the bytes verified are the bytes loaded.

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
  if key is not None and not verify:
    raise ValueError("load_exported: key= needs verify=True")
  if not verify and not data.startswith(MAGIC):
    return _Loaded(_deserialize(data, source, {}), {}, source)
  header, program = read_artifact(data, source, key=key)
  weights = read_weights(data, header, source)
  return _Loaded(_deserialize(program, source, header), header, source, weights)


def exported_signature(fn: Any) -> list:
  """``[(shape with symbolic names as str, dtype name), ...]`` of a loaded artifact's inputs."""
  return [(tuple(d if isinstance(d, int) else str(d) for d in a.shape), str(a.dtype))
          for a in fn.in_avals]
