"""Save and load a fold: parameters with orbax-checkpoint, report and metadata as JSON.

Layout of a saved fold directory::

    DIR/manifest.json  SHA-256 and size of every other file, and the versions that wrote them
    DIR/params/        orbax checkpoint of ``folded.params``
    DIR/report.json    ``folded.report.to_json()``
    DIR/fold.json      what :func:`load_fold` needs to rebuild ``apply_fn``: fold options,
                       the example-argument signature, whether parameters were untied
    DIR/meta.json      free-form metadata given by the caller (model name, config, ...)
    DIR/program.json   a structural fingerprint of the original apply_fn's traced program
    DIR/signature.json with ``key=``: HMAC-SHA256 of manifest.json (not listed in it)

``folded.apply_fn`` re-traces the *original* apply function, so :func:`load_fold`
takes it (``jaxfold report DIR``/``jaxfold bench`` resolve it from the model name
stored in meta.json).  Loading re-runs the analysis on abstract shapes (no weights
are touched), checks that it makes the same decisions as the saved report, and
returns a fold whose ``apply_fn(params, *args)`` is bit-for-bit the saved one's.

Saves are atomic (a temporary sibling renamed into place; temporary siblings of
writers that died are removed by the next save).  Loads read a *snapshot*: every
file is read once through one descriptor of the directory, hashed while it is
copied to a private temporary directory and compared with the manifest, and only
that copy is parsed; so a damaged, truncated or foreign fold is refused with an
:class:`jaxfold.IntegrityError` that names the file, and a fold replaced while it
is read is never mixed with its successor.  The SHA-256s are unkeyed: they catch
accidents (bit flips, partial copies, concurrent writers), not tampering: with
``key=`` the manifest is signed (HMAC-SHA256) and a load with the key refuses
anything unsigned or modified.

Example:
    >>> save_fold(folded, "/tmp/f", meta={"model": "gpt2-tiny"})
    >>> again = load_fold("/tmp/f", apply_fn)
    >>> again.apply_fn(again.params, ids)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
import threading
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxfold._src import compat
from jaxfold._src.integrity import (
  MANIFEST,
  DiskFullError,
  IntegrityError,
  NotADirectory,
  NotFoundError,
  commit_directory,
  is_disk_full,
  read_verified,
  remove_stale,
  sign_directory,
  snapshot,
  verify_manifest,
  write_manifest,
  writer_tag,
)
from jaxfold._src.integrity import versions as _versions
from jaxfold._src.report import Report
from jaxfold._src.step import Params, RestoreContext, chain_of, digest, restorer

__all__ = ["save_fold", "load_fold", "load_report", "load_meta", "LoadedFold",
           "report_from_dict", "FORMAT_VERSION", "IntegrityError"]

# 2: manifest.json with content hashes; atomic commits (program.json and
# signature.json are optional additions that format-2 readers ignore).
# 3: fuse_affine/rotate results (fold.json "transforms", flat parameter leaves);
# plain folds are still written as format 2, so older readers keep reading them.
# 4: as 3, the leaves those of one jaxfold.Params (format 3 nested the
# parameters of each step in the next's: FusedParams(base=FoldedParams(...))).
FORMAT_VERSION = 4          # the newest format this version reads
CHAIN_FORMAT_VERSION = 4    # a fold with fuse_affine/rotate steps
NESTED_FORMAT_VERSION = 3   # chains whose parameters were nested per step (read, never written)
PLAIN_FORMAT_VERSION = 2    # a plain fold: older readers still load it


class LoadedFold(NamedTuple):
  """A fold read back from disk (same fields as :class:`jaxfold.Folded`, plus meta)."""
  params: Any
  apply_fn: Callable
  report: Report
  meta: dict


# ----------------------------------------------------------------------------
# Small JSON encodings.


def _encode_args(args: Any) -> Any:
  """Pytree of arrays -> JSON (dict/list/tuple/None kept, arrays as shape+dtype)."""
  if isinstance(args, dict):
    bad = [k for k in args if not isinstance(k, str)]
    if bad:   # JSON object keys are strings: {0: x} would load as {"0": x}
      raise TypeError(f"cannot record a dict with the key {bad[0]!r} of type {type(bad[0]).__name__} "
                      "among the example arguments: only string keys survive a save")
    return {"dict": {k: _encode_args(v) for k, v in args.items()}}
  if isinstance(args, tuple):
    return {"tuple": [_encode_args(v) for v in args]}
  if isinstance(args, list):
    return {"list": [_encode_args(v) for v in args]}
  if args is None:
    return {"none": None}
  if type(args) in (bool, int, float, str):   # static keyword arguments (train=True)
    return {"value": args}
  if isinstance(args, (bool, int, float, str)):   # a subclass: an Enum member, ...
    base = next(t for t in (bool, int, float, str) if isinstance(args, t)).__name__
    raise TypeError(f"cannot record the example argument {args!r} of type {type(args).__name__}: it "
                    f"would load as a plain {base}, another static value for apply_fn; pass plain "
                    "bool/int/float/str values (e.g. its .value)")
  if hasattr(args, "shape") and hasattr(args, "dtype"):
    return {"array": {"shape": [int(d) for d in np.shape(args)],
                      "dtype": compat.dtype_name(args.dtype)}}
  raise TypeError(f"cannot record an example argument of type {type(args).__name__}: "
                  "example arguments must be arrays or dicts/lists/tuples of arrays")


def _decode_args(obj: Any) -> Any:
  (kind, val), = obj.items()
  if kind == "dict":
    return {k: _decode_args(v) for k, v in val.items()}
  if kind == "tuple":
    return tuple(_decode_args(v) for v in val)
  if kind == "list":
    return [_decode_args(v) for v in val]
  if kind == "none":
    return None
  if kind == "value":
    return val
  return jax.ShapeDtypeStruct(tuple(val["shape"]), compat.dtype_from_name(val["dtype"]))


def report_from_dict(d: dict) -> Report:
  """Inverse of ``Report.as_dict()``."""
  return Report.from_dict(d)


def _json_default(o: Any) -> Any:
  if isinstance(o, (np.integer,)):
    return int(o)
  if isinstance(o, (np.floating,)):
    return float(o)
  if isinstance(o, (tuple, set, frozenset)):
    return list(o)
  return str(o)


def _write_json(path: str, obj: Any) -> None:
  with open(path, "w") as f:
    json.dump(obj, f, indent=2, default=_json_default)
    f.write("\n")


def _read_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


def _options_of(folded: Any) -> dict:
  opts = getattr(folded.apply_fn, "options", None)
  if opts is None:
    raise TypeError("save_fold expects the result of jaxfold.fold (its apply_fn carries the "
                    f"fold options), got apply_fn of type {type(folded.apply_fn).__name__}")
  return opts.to_dict()


def _example_args_of(folded: Any) -> Any:
  """The abstract example arguments the fold was traced with."""
  return folded.apply_fn.example_args


def _is_untied(folded: Any) -> bool:
  return bool(folded.params.extras)   # a fold's only extras are its untied copies


# ----------------------------------------------------------------------------
# Checks before anything is written.

_FOLD_FILES = ("params", "report.json", "fold.json", "meta.json")


def _check_folded(folded: Any) -> None:
  """Refuses anything but a fold (or a chain of steps on one) *before* a
  byte is written or removed."""
  params = getattr(folded, "params", None)
  apply_fn = getattr(folded, "apply_fn", None)
  chain = chain_of(apply_fn)
  if chain is not None and len(chain) > 1 and hasattr(folded, "report"):
    return
  if (not isinstance(params, Params) or getattr(apply_fn, "options", None) is None
      or not hasattr(apply_fn, "example_args") or not hasattr(folded, "report")):
    got = type(folded).__name__
    if params is not None and not isinstance(params, Params):
      got += f" whose .params is a {type(params).__name__}, not a jaxfold.Params"
    raise TypeError(f"save_fold expects the result of jaxfold.fold(...), of fuse_affine or rotate "
                    f"applied to one, or of jaxfold.load_fold(...), got {got}; nothing was written")


def _transforms_info(chain: list) -> tuple:
  """What load_fold needs to redo (abstractly) and check each step after the
  fold, and the arrays they save (``(file stem, array)``, numbered per name)."""
  out, arrays, count = [], [], {}
  for fn in chain[1:]:
    rec = fn.record()
    info = dict(rec.info)
    if "example_args" in info:
      info["example_args"] = _encode_args(info["example_args"])
    # The parameters this step's inner function takes: load redoes the next step on
    # them (a step that changes the tree, e.g. quantize, makes them unlike the saved leaves).
    info.setdefault("inner_leaves", _leaf_table(fn.params_abstract))
    out.append(info)
    for name, array in rec.arrays.items():
      arrays.append((f"{name}-{count.get(name, 0)}", array))
      count[name] = count.get(name, 0) + 1
  return out, arrays


def _leaf_table(params: Any) -> list:
  return [[jax.tree_util.keystr(p), [int(d) for d in np.shape(x)], compat.dtype_name(jnp.result_type(x))]
          for p, x in jax.tree_util.tree_flatten_with_path(params)[0]]


def _looks_like_fold(directory: str) -> bool:
  names = set(os.listdir(directory))
  return bool({MANIFEST, "fold.json"} & names)


def _check_replaceable(directory: str) -> None:
  if not os.path.isdir(directory):
    raise FileExistsError(f"{directory} exists and is not a directory: choose another path")
  if os.listdir(directory) and not _looks_like_fold(directory):
    raise FileExistsError(f"{directory} is not empty and is not a saved fold (no manifest.json or "
                          "fold.json): refusing to replace it even with overwrite=True; choose "
                          "another directory or remove it yourself")


def check_target(directory: str, overwrite: bool) -> None:
  """Raises (FileExistsError, IntegrityError) if ``save_fold`` would refuse ``directory``."""
  if os.path.islink(directory):
    raise IntegrityError(
        f"{directory} is a symbolic link (to {os.path.realpath(directory)}): a fold is replaced "
        "by renaming a new directory into place, which would replace the link, not what it points "
        f"to; pass the real path {os.path.realpath(directory)} or remove the link")
  if not os.path.lexists(directory):
    return
  if not os.path.isdir(directory):
    raise FileExistsError(f"{directory} exists and is not a directory: choose another path")
  if not os.listdir(directory):
    return
  if not overwrite:
    raise FileExistsError(f"{directory} is not empty: choose a new directory or pass "
                          "overwrite=True (`--force` on the command line) to replace the fold in it")
  _check_replaceable(directory)


# ----------------------------------------------------------------------------
# Multi-process (jax.distributed) coordination.


def _multi() -> bool:
  return jax.process_count() > 1


def _broadcast_int(x: int) -> int:
  from jax.experimental import multihost_utils
  return int(multihost_utils.broadcast_one_to_all(np.asarray(x, np.int32)))


def _barrier(name: str) -> None:
  from jax.experimental import multihost_utils
  multihost_utils.sync_global_devices(name)


# orbax's checkpointers share process-wide state (signal contracts, a step
# directory registry): concurrent saves from threads of one process time out or
# collide inside orbax, so they take turns here.  Processes need no such lock:
# each writes its own temporary directory and the commit is a rename.
_ORBAX_LOCK = threading.RLock()


def _umask() -> int:
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def _host_array(x: Any) -> Any:
  # Sharded jax.Arrays go to orbax as they are (each process writes its shards).
  return x if isinstance(x, jax.Array) else np.asarray(x)


# ----------------------------------------------------------------------------
# Public API.


def save_fold(folded: Any, directory: str | os.PathLike, *, meta: Optional[dict] = None,
              example_args: Any = None, overwrite: bool = False,
              extra_files: Optional[Callable[[str], Any]] = None,
              key: Optional[bytes | str] = None) -> str:
  """Writes ``folded`` (from :func:`jaxfold.fold`) under ``directory``, atomically.

  Everything is written to a temporary sibling ``.NAME.tmp-*``, hashed into
  ``manifest.json`` and then renamed into place: until the new fold is
  complete the previous one stays intact, ``overwrite=True`` replaces the
  whole directory (no stale files survive), and concurrent writers end with
  exactly one complete fold (without ``overwrite`` the losers get
  ``FileExistsError``).  Under ``jax.distributed`` every process must call it
  (each writes its shards; process 0 writes the rest and commits).

  Args:
    folded: a :class:`jaxfold.Folded` (or a fold returned by :func:`load_fold`).
    directory: must be absent or empty unless ``overwrite``.
    meta: JSON-serializable metadata stored in ``meta.json`` (model name,
      config, ...; anything non-JSON is stored as ``str``).
    example_args: the arguments ``fold`` was traced with; by default they are
      recovered from ``folded.apply_fn``.
    overwrite: replace an existing fold in ``directory`` (a non-empty directory
      that is not a fold is never replaced).
    extra_files: ``f(tmp_dir)`` writing more files into the fold before it is
      hashed and committed (``jaxfold fold`` writes its safetensors this way).
    key: sign the fold (HMAC-SHA256 of its manifest, in ``signature.json``);
      ``load_fold(..., key=...)`` then refuses it if anything was changed.

  Raises:
    DiskFullError (an :class:`jaxfold.IntegrityError`) when the disk fills up
    (nothing is committed, the temporary directory is removed);
    IntegrityError when ``directory`` is a symbolic link.

  Returns:
    The absolute path of ``directory``.

  Example:
    >>> save_fold(folded, "/tmp/gpt2-fold", meta={"model": "gpt2-tiny"}, overwrite=True)
    '/tmp/gpt2-fold'
  """
  import orbax.checkpoint as ocp

  _check_folded(folded)
  directory = os.path.abspath(os.fspath(directory))
  check_target(directory, overwrite)
  chain = chain_of(folded.apply_fn)
  transformed = chain is not None and len(chain) > 1
  base = chain[0] if transformed else folded.apply_fn   # the fold step
  options = base.options.to_dict()
  args = example_args if example_args is not None else base.example_args
  fold_info = {
      "format_version": CHAIN_FORMAT_VERSION if transformed else PLAIN_FORMAT_VERSION,
      "options": options,
      "example_args": _encode_args(tuple(args)),
      "example_kwargs": _encode_args(dict(getattr(base, "example_kwargs", {}))),
      "jax_version": jax.__version__,
  }
  arrays = []
  if transformed:
    # A chain of steps on the fold: the parameters as a flat list of leaves (their
    # tree holds None for fused-away γ/β), rebuilt on load by redoing each step
    # abstractly on the original parameter shapes recorded here.
    original = base.params_abstract
    try:
      fold_info["params_abstract"] = _encode_args(original)
    except TypeError:
      # Another pytree (an nnx.State, ...): JSON cannot rebuild it, so load_fold
      # takes its structure from target= and checks it against this table.
      fold_info["params_abstract"] = None
      fold_info["params_type"] = type(original).__name__
    fold_info["params_leaves"] = _leaf_table(original)
    fold_info["transforms"], arrays = _transforms_info(chain)
    fold_info["untied"] = base.unties
    fold_info["leaves"] = _leaf_table(folded.params)
    leaves = jax.tree_util.tree_leaves(folded.params)
    params = {"leaves": {f"{i:05d}": _host_array(x) for i, x in enumerate(leaves)}}
    report_json = base.analysis_for(base.example_args, kwargs=base.example_kwargs).report.to_json() + "\n"
    program = _program_of_fn(base, original, args)
  else:
    fold_info["untied"] = _is_untied(folded)
    program = _program_of(folded, args)
    params = {"params": jax.tree_util.tree_map(_host_array, folded.params.params)}
    if folded.params.extras:  # orbax does not store empty containers
      params["untied"] = {k: _host_array(v) for k, v in folded.params.extras.items()}
    report_json = folded.report.to_json() + "\n"

  parent, name = os.path.split(directory)
  os.makedirs(parent, exist_ok=True)
  multi = _multi()
  lead = not multi or jax.process_index() == 0
  if multi:
    token = _broadcast_int(secrets.randbelow(2**31) if lead else 0)
    tmp = os.path.join(parent, f".{name}.tmp-{token:08x}")
    if lead:
      os.makedirs(tmp)
    _barrier(f"jaxfold_save_fold_mkdir_{token}")
  else:
    remove_stale(parent, name)
    # The writer's host and pid in the name let the next save remove it if we die.
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-{writer_tag()}-", dir=parent)
    os.chmod(tmp, 0o777 & ~_umask())   # mkdtemp's 0700 would become the fold's mode
  err: Optional[BaseException] = None
  try:
    with _ORBAX_LOCK, ocp.StandardCheckpointer() as ckptr:
      ckptr.save(os.path.join(tmp, "params"), params)
      ckptr.wait_until_finished()
    if lead:
      with open(os.path.join(tmp, "report.json"), "w") as f:
        f.write(report_json)
      _write_json(os.path.join(tmp, "fold.json"), fold_info)
      _write_json(os.path.join(tmp, "meta.json"), dict(meta or {}))
      if program is not None:
        _write_json(os.path.join(tmp, "program.json"), program)
      for stem, array in arrays:   # arrays the steps keep (a rotation's Q), for the record
        np.save(os.path.join(tmp, f"{stem}.npy"), array)
      if extra_files is not None:
        extra_files(tmp)
      write_manifest(tmp, kind="jaxfold-fold", extra={"format_version": fold_info["format_version"]})
      if key is not None:
        sign_directory(tmp, key)
      commit_directory(tmp, directory, overwrite=overwrite, may_replace=_check_replaceable)
  except BaseException as e:  # noqa: BLE001 - re-raised below, after cleaning up
    err = e
    if is_disk_full(e):
      first = (str(e).strip().splitlines() or [""])[0][:200]
      err = DiskFullError(f"no space left on the disk holding {parent} while saving the fold "
                          f"({type(e).__name__}: {first}); nothing was written to {directory} "
                          "(a previous fold there is intact): free space or save elsewhere")
  committed = err is None
  if multi:
    # Every process takes part, so none waits forever for a failed process 0.
    committed = bool(_broadcast_int(int(err is None) if lead else 0))
  if lead and os.path.isdir(tmp):
    shutil.rmtree(tmp, ignore_errors=True)
  if isinstance(err, DiskFullError):
    raise err from None
  if err is not None:
    raise err
  if not committed:
    raise RuntimeError(f"save_fold: process 0 failed to write {directory} (see its error)")
  return directory


def _program_of(folded: Any, args: Any) -> Optional[dict]:
  """The fingerprint of the original apply_fn at the fold's example arguments
  (None when it cannot be traced here: then loads skip the comparison)."""
  return _program_of_fn(folded.apply_fn, folded.params.params, args)


def _program_of_fn(folded_apply: Any, params: Any, args: Any) -> Optional[dict]:
  from jaxfold._src.fingerprint import fingerprint
  fn = getattr(folded_apply, "original_fn", None)
  if fn is None:
    return None
  kwargs = dict(getattr(folded_apply, "example_kwargs", {}) or {})
  try:
    return {"jax_version": jax.__version__,
            **fingerprint(fn, params, tuple(args), kwargs)}
  except Exception:  # noqa: BLE001 - the fold itself was traced; this is an extra check
    return None


def _check_program(directory: str, saved: Any, apply_fn: Callable, params: Any, args: Any,
                   kwargs: dict) -> None:
  from jaxfold._src.fingerprint import difference, fingerprint
  from jaxfold._src.fold import FoldError
  if not isinstance(saved, dict) or "sha256" not in saved:
    return
  try:
    now = fingerprint(apply_fn, params, tuple(args), kwargs)
  except Exception as e:  # noqa: BLE001 - whatever apply_fn raises while traced
    first = (str(e).strip().splitlines() or [""])[0][:300]
    raise FoldError(f"apply_fn is not the program the fold in {directory} was made for: it cannot "
                    f"be traced with the saved parameters and example arguments ({type(e).__name__}: "
                    f"{first}). Pass the apply_fn of the model the fold was made from (same "
                    "architecture and code), or fold this model again") from e
  diff = difference(saved, now)
  if diff is None:
    return
  if saved.get("jax_version") != jax.__version__:
    import warnings
    warnings.warn(f"the program traced from apply_fn differs from the one {directory} was saved "
                  f"for, but it was saved with jax {saved.get('jax_version')} (this is "
                  f"{jax.__version__}), whose traces may differ: {diff}", stacklevel=3)
    return
  raise FoldError(f"apply_fn is not the program the fold in {directory} was made for: {diff}. "
                  "Pass the apply_fn of the model the fold was made from (same architecture and "
                  "code), or fold this model again")


def _verify(directory: str, *, integrity: bool) -> Optional[dict]:
  """Checks the manifest of a saved fold; returns it (None when unchecked)."""
  if not integrity:
    return None
  if not os.path.exists(os.path.join(directory, MANIFEST)):
    if os.path.exists(os.path.join(directory, "fold.json")):
      raise IntegrityError(
          f"{directory} has no manifest.json (it was written by jaxfold 0.1, before saved folds "
          "carried content hashes), so its files cannot be verified: re-save it (`jaxfold fold "
          "--force ...` or jaxfold.save_fold), or pass integrity=False to load it unchecked")
    raise NotFoundError(f"{os.path.join(directory, MANIFEST)} does not exist: {directory} is "
                            "not a saved fold (write one with jaxfold.save_fold or `jaxfold fold`)")
  manifest = verify_manifest(directory, strict_under=("params",))
  _check_format(directory, manifest)
  return manifest


def _check_dir(directory: str) -> None:
  if not os.path.exists(directory):
    raise NotFoundError(f"{directory} does not exist (no such directory): pass the directory written by "
                        "jaxfold.save_fold or `jaxfold fold --out DIR`")
  if not os.path.isdir(directory):
    raise NotADirectory(f"{directory} is a file, not a saved fold directory (an exported "
                             "artifact loads with jaxfold.load_exported)")


def load_report(directory: str | os.PathLike, *, integrity: bool = True,
                key: Optional[bytes | str] = None) -> Report:
  """The :class:`jaxfold.Report` of a saved fold (no jax work, no weights read;
  only ``report.json`` is checked against the manifest, from the bytes parsed).

  Example:
    >>> load_report("/tmp/gpt2-fold").num_folded
  """
  directory = os.path.abspath(os.fspath(directory))
  path = os.path.join(directory, "report.json")
  _check_dir(directory)
  if not os.path.exists(path):
    raise NotFoundError(f"{path} does not exist: {directory} is not a saved fold "
                            "(expected params/, report.json, fold.json, meta.json)")
  try:
    if key is not None or (integrity and os.path.exists(os.path.join(directory, MANIFEST))):
      raw = read_verified(directory, ["report.json"], key=key)["report.json"]
    else:
      with open(path, "rb") as f:
        raw = f.read()
    return report_from_dict(json.loads(raw))
  except (ValueError, TypeError, KeyError) as e:
    raise IntegrityError(f"{path} is not a jaxfold report ({type(e).__name__}: {e}); re-create "
                         "the fold") from None


def load_meta(directory: str | os.PathLike) -> dict:
  """The ``meta.json`` of a saved fold ({} if absent)."""
  path = os.path.join(os.fspath(directory), "meta.json")
  if not os.path.exists(path):
    return {}
  try:
    meta = _read_json(path)
  except ValueError as e:
    raise IntegrityError(f"{path} is not valid JSON ({e}); re-create the fold") from None
  return meta if isinstance(meta, dict) else {}


def _abstract_of(x: Any) -> jax.ShapeDtypeStruct:
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  sharding = x.sharding if isinstance(x, jax.Array) else None
  return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=sharding)


def _restore_params(path: str, target: Any = None) -> Any:
  import orbax.checkpoint as ocp

  with _ORBAX_LOCK, ocp.StandardCheckpointer() as ckptr:
    if target is not None:
      return ckptr.restore(path, jax.tree_util.tree_map(_abstract_of, target))
    try:
      meta = ckptr.metadata(path)
      tree = getattr(meta, "item_metadata", meta)
      tree = getattr(tree, "tree", tree)
      # Whole arrays on this process's first device, whatever sharding (and
      # number of processes) they were saved with.
      device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      abstract = jax.tree_util.tree_map(
          lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device), tree,
          is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))
      return ckptr.restore(path, abstract)
    except Exception:  # noqa: BLE001 - older orbax: restore as saved
      return ckptr.restore(path)


def load_fold(directory: str | os.PathLike, apply_fn: Callable, *,
              target: Any = None, verify: bool = True, integrity: bool = True,
              key: Optional[bytes | str] = None) -> LoadedFold:
  """Reads a fold written by :func:`save_fold`.

  Args:
    directory: the saved fold.
    apply_fn: the *original* ``apply_fn(params, *args)`` the fold was made from
      (for a ``models`` config: ``models.get(name).apply_fn()``).
    target: optional pytree with the structure of ``folded.params`` (arrays or
      ``ShapeDtypeStruct``s, with ``sharding=`` to restore sharded, e.g. across
      the processes of ``jax.distributed``), for parameter pytrees that are not
      plain dicts; a fold's :class:`jaxfold.Params` is accepted. For a
      ``fuse_affine``/``defer_norms``/``rotate`` result, the *original*
      parameters (or their ``ShapeDtypeStruct``s): required when they are not
      dicts and lists (e.g. an ``nnx.State``), whose structure ``fold.json``
      cannot describe.
    verify: check that ``apply_fn`` traces to the program the fold was saved
      for (``program.json``: a :class:`jaxfold.FoldError` saying what differs,
      e.g. another number of heads) and that re-analysing it makes the same
      per-site decisions as the saved report.
    integrity: read a verified snapshot: every file is read once, checked
      against the SHA-256 in ``manifest.json`` (:class:`jaxfold.IntegrityError`
      on a mismatch) and parsed from that copy, so a fold replaced meanwhile is
      never mixed with another (the copy needs temporary space, see ``TMPDIR``).
    key: refuse the fold unless its ``signature.json`` is the HMAC-SHA256 of
      its manifest under this key (see :func:`save_fold`).

  Returns:
    ``LoadedFold(params, apply_fn, report, meta)``; ``apply_fn(params, *args)``
    reproduces the saved fold's results bit-for-bit.

  Example:
    >>> again = load_fold("/tmp/gpt2-fold", models.get("gpt2-tiny").apply_fn())
    >>> logits = again.apply_fn(again.params, ids)
  """
  directory = os.path.abspath(os.fspath(directory))
  _check_dir(directory)
  if key is not None and not integrity:
    raise ValueError("load_fold: key= needs integrity=True (a signature is checked with the hashes)")
  if not integrity:
    return _load_from(directory, directory, apply_fn, target=target, verify=verify)
  _verify_present(directory)
  with snapshot(directory, strict_under=("params",), key=key) as (copy, manifest):
    _check_format(directory, manifest)
    return _load_from(copy, directory, apply_fn, target=target, verify=verify)


def _verify_present(directory: str) -> None:
  """Clear messages for a directory that has no manifest at all."""
  if not os.path.exists(os.path.join(directory, MANIFEST)):
    _verify(directory, integrity=True)     # raises the right error


def _check_format(directory: str, manifest: dict) -> None:
  version = manifest.get("format_version", 0)
  if not isinstance(version, int) or version > FORMAT_VERSION:
    by = manifest.get("written_by", {}).get("jaxfold", "?")
    raise IntegrityError(f"{directory} was written by jaxfold {by} (format {version}); this "
                         f"jaxfold {_versions().get('jaxfold')} reads format <= {FORMAT_VERSION}: "
                         "upgrade jaxfold")


def _load_from(copy: str, directory: str, apply_fn: Callable, *, target: Any,
               verify: bool) -> LoadedFold:
  """Loads the fold whose files are in ``copy`` (messages name ``directory``)."""
  from jaxfold._src.fold import FoldError

  info_path = os.path.join(copy, "fold.json")
  if not os.path.exists(info_path):
    raise NotFoundError(f"{info_path} does not exist: {directory} is not a saved fold "
                            "(write one with jaxfold.save_fold or `jaxfold fold`)")
  try:
    info = _read_json(info_path)
    version = info.get("format_version", 0)
    if not isinstance(version, int):
      raise TypeError(f"format_version is {version!r}")
    args = _decode_args(info["example_args"])
    kwargs = _decode_args(info["example_kwargs"]) if "example_kwargs" in info else {}
    opts = dict(info["options"])
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise IntegrityError(f"{info_path} is not a jaxfold fold description ({type(e).__name__}: "
                         f"{e}); re-create the fold") from None
  if version > FORMAT_VERSION:
    raise IntegrityError(f"{directory} was written by a newer jaxfold (format {version} > "
                         f"{FORMAT_VERSION}); upgrade jaxfold")
  if "transforms" in info:
    return _load_chain(copy, directory, apply_fn, info, args, kwargs, opts, verify=verify, target=target)
  if isinstance(target, Params):
    target = {"params": target.params, **({"untied": target.extras} if target.extras else {})}
  try:
    params = _restore_params(os.path.join(copy, "params"), target)
  except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
    first = (str(e).strip().splitlines() or [""])[0][:300]
    raise IntegrityError(
        f"cannot restore the parameters in {os.path.join(directory, 'params')} with "
        f"orbax-checkpoint {_versions().get('orbax-checkpoint', '?')} ({type(e).__name__}: {first}); "
        "if a target was given, it must have the saved structure, shapes and dtypes; "
        "otherwise re-create the fold with this version") from None
  params = jax.tree_util.tree_map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x),
                                  params)
  params = Params(params["params"], dict(params.get("untied") or {}))
  abstract = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params.params)
  refold = _refold(copy, directory, apply_fn, abstract, args, kwargs, opts, verify=verify)
  saved = load_report(copy, integrity=False)
  if verify:
    got = [(s.folded, s.shape, s.axes) for s in refold.report.sites]
    want = [(s.folded, s.shape, s.axes) for s in saved.sites]
    if not isinstance(info.get("untied"), bool):
      raise IntegrityError(f"{info_path} does not say whether the fold has untied copies; "
                           "re-create the fold")
    if got != want or bool(refold.params.extras) != info["untied"]:
      raise FoldError(
          f"re-analysing apply_fn does not reproduce the saved fold in {directory} "
          f"({sum(g[0] for g in got)}/{len(got)} sites folded now, "
          f"{sum(w[0] for w in want)}/{len(want)} when saved): pass the apply_fn of the "
          "model the fold was made from, or fold the model again")
  return LoadedFold(params, refold.apply_fn, refold.report, load_meta(copy))


def _refold(copy: str, directory: str, apply_fn: Callable, abstract: Any, args: Any, kwargs: dict,
            opts: dict, *, verify: bool) -> Any:
  """The fold redone on abstract parameters with the saved options, after
  checking (``verify``) that ``apply_fn`` is the program that was saved."""
  from jaxfold._src.fold import FoldOptions
  from jaxfold._src.fold import fold as _fold
  opts = dict(opts)
  opts.pop("through_dropout", None)  # a CBWC-only option; a saved fold never sets it
  opts = FoldOptions.from_dict(opts).to_dict()
  opts.pop("through_dropout", None)
  if verify and os.path.exists(os.path.join(copy, "program.json")):
    _check_program(directory, _read_json(os.path.join(copy, "program.json")), apply_fn, abstract,
                   args, kwargs)
  return _fold(abstract, apply_fn, *args, example_kwargs=kwargs, **opts)


def _chain_params(directory: str, info: dict, saved: Any, want: Optional[list], target: Any) -> Any:
  """The original parameters' abstract pytree of a transformed fold: from
  ``target`` when given (any pytree: an ``nnx.State``, ...), else ``saved``
  (decoded from ``fold.json``); a target must match the saved leaf table ``want``."""
  from jaxfold._src.fold import FoldError
  if target is None:
    if saved is None:
      raise FoldError(
          f"{directory} holds a transformed fold whose parameters are a {info.get('params_type', '?')}, "
          "a pytree fold.json cannot describe: pass target= with the original parameters (arrays or "
          "jax.ShapeDtypeStructs in their pytree structure; e.g. nnx.state(model) for an nnx model)")
    return saved
  if isinstance(target, Params):
    target = target.params
  abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), target)
  if want is not None and _leaf_table(abstract) != want:
    got = _leaf_table(abstract)
    diff = next((f"{g} instead of {w}" for g, w in zip(got, want) if g != w),
                f"{len(got)} leaves instead of {len(want)}")
    raise FoldError(f"target= does not have the structure of the parameters the fold in {directory} was "
                    f"made from ({diff}): pass the original parameters (or their jax.ShapeDtypeStructs)")
  return abstract


def _load_chain(copy: str, directory: str, apply_fn: Callable, info: dict, args: Any, kwargs: dict,
                opts: dict, *, verify: bool, target: Any = None) -> LoadedFold:
  """Loads a chain of steps on a fold: refolds and redoes every step on abstract
  parameters (no weights touched), checks that each makes the saved decisions,
  and puts the saved leaves into the tree the last step takes."""
  from jaxfold._src.fold import FoldError
  nested = info.get("format_version") == NESTED_FORMAT_VERSION
  by = ""
  if nested:
    manifest = next((m for m in (os.path.join(copy, MANIFEST), os.path.join(directory, MANIFEST))
                     if os.path.exists(m)), None)
    written = _read_json(manifest) if manifest else {}
    by = (f" (saved in format {NESTED_FORMAT_VERSION} by jaxfold "
          f"{written.get('written_by', {}).get('jaxfold', '?')}: if apply_fn is the model's, save the "
          "fold again with this jaxfold)")

  def refuse(what: str) -> FoldError:
    return FoldError(f"re-analysing apply_fn does not reproduce the saved {what} in {directory}: "
                     "pass the apply_fn of the model the fold was made from, or fold the model again" + by)

  try:
    records = list(info["transforms"])
    table = list(info["leaves"])
    if not records:
      raise ValueError("no transforms")
    parsed = []   # (step class, decoded record), checked before anything is restored
    for k, record in enumerate(records):   # well-formed steps (a fold loaded with integrity=False)
      if not isinstance(record, dict):
        raise TypeError(f"transform {k} is a {type(record).__name__}, not an object")
      cls = restorer(record.get("name"))
      parsed.append((k, record.get("name"), cls, None if cls is None else cls.parse(record, _decode_args)))
    abstract = None if info["params_abstract"] is None else _decode_args(info["params_abstract"])
    want = info.get("params_leaves")   # (absent in folds saved before it was recorded)
    if want is not None and not isinstance(want, list):
      raise TypeError(f"params_leaves is a {type(want).__name__}")
  except (KeyError, TypeError, ValueError, AttributeError) as e:
    raise IntegrityError(f"{directory}/fold.json does not describe a transformed fold "
                         f"({type(e).__name__}: {e}); re-create the fold") from None
  for k, name, cls, _ in parsed:
    if cls is None:
      raise IntegrityError(f"{directory}/fold.json: unknown transform {name!r} (step {k}); this "
                           f"jaxfold {_versions().get('jaxfold')} may be too old: upgrade jaxfold")
  abstract = _chain_params(directory, info, abstract, want, target)   # (its refusals are no IntegrityError)
  try:
    restored = _restore_params(os.path.join(copy, "params"))
    leaves = [restored["leaves"][k] for k in sorted(restored["leaves"])]
  except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
    first = (str(e).strip().splitlines() or [""])[0][:300]
    raise IntegrityError(f"cannot restore the parameters in {os.path.join(directory, 'params')} "
                         f"({type(e).__name__}: {first}); re-create the fold") from None
  leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in leaves]
  refold = _refold(copy, directory, apply_fn, abstract, args, kwargs, opts, verify=verify)
  if verify and refold.apply_fn.unties != bool(info.get("untied")):
    raise refuse("fold")
  count: dict = {}

  def array(name: str) -> Optional[np.ndarray]:
    """A step's next saved array of this name (numbered per name along the chain)."""
    path = os.path.join(copy, f"{name}-{count.get(name, 0)}.npy")
    if not os.path.exists(path):
      return None
    count[name] = count.get(name, 0) + 1
    return np.load(path, allow_pickle=False)

  saved_at: dict = {}   # format 3: a saved leaf index -> its index now (identity until a step reorders)
  ctx = RestoreContext(tuple(args), kwargs, verify, refuse, FoldError, array)
  if nested:
    ctx = ctx._replace(same_key=lambda key, sha: sha in (digest(key), _nested_digest(key)),
                       leaf=lambda i: saved_at.get(i, i))
  fn, report, struct = refold.apply_fn, refold.report, refold.params
  treedef = jax.tree_util.tree_structure(struct)
  ordered, order = leaves, list(range(len(leaves)))
  for j, (_, _, cls, record) in enumerate(parsed):
    fn, report, tree = cls.restore(fn, struct, record, ctx)
    treedef = treedef if tree is None else tree
    # What the next step's inner takes: its recorded table (a step that changes the
    # tree, e.g. quantize, makes it unlike the saved leaves), else the saved leaves.
    nxt = records[j + 1].get("inner_leaves") if j + 1 < len(records) else None
    if nxt:
      if treedef.num_leaves != len(nxt):
        raise refuse(f"parameters ({treedef.num_leaves} tensors now, {len(nxt)} recorded)")
      struct = jax.tree_util.tree_unflatten(
          treedef, [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype)) for _, shape, dtype in nxt])
      continue
    if treedef.num_leaves != len(leaves):
      raise refuse(f"parameters ({treedef.num_leaves} tensors now, {len(leaves)} saved)")
    if nested:
      order = _nested_order(treedef, table)
      if order is None:
        raise refuse("parameter names")
      ordered = [leaves[k] for k in order]
      saved_at = {k: j for j, k in enumerate(order)}
    struct = jax.tree_util.tree_unflatten(
        treedef, [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in ordered])
  params = jax.tree_util.tree_unflatten(treedef, ordered)
  now = _leaf_table(params)
  if nested:   # the saved table in this order, spelt as now
    now, table = _unnested_table(now), _unnested_table([table[k] for k in order])
  if now != table:
    raise refuse("parameter names, shapes or dtypes")
  return LoadedFold(params, fn, report, load_meta(copy))


# Format 3 nested each step's parameters in the next's (``FusedParams(base=
# FoldedParams(params, untied), extras)``): its leaf paths read ``.base.params[...]``
# and ``.untied[...]`` (also inside the names of leaves made from those), and its
# leaves came in that nesting's order. One ``jaxfold.Params`` spells them
# ``.params[...]``/``.extras[...]``, in its own order.
_NESTED_FIELD = re.compile(r"\.base(?=[.\[])")


def _unnested(path: str) -> str:
  """A format-3 leaf path as one ``jaxfold.Params`` spells it.

  Example:
    >>> _unnested('.base.untied["w@centered(1)"]')
    '.extras["w@centered(1)"]'
  """
  return _NESTED_FIELD.sub("", path).replace(".untied[", ".extras[")


def _unnested_table(table: list) -> list:
  return [[_unnested(row[0]), *row[1:]] for row in table]


def _nested_order(treedef: Any, table: list) -> Optional[list]:
  """``order[j]``: the index in a format-3 save's leaf table of leaf ``j`` of
  ``treedef``, matched by name (None: the names do not match one to one)."""
  dummy = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
  now = [_unnested(jax.tree_util.keystr(p)) for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]
  saved = {_unnested(row[0]): i for i, row in enumerate(table)}
  if len(saved) != len(table) or sorted(now) != sorted(saved):
    return None
  return [saved[name] for name in now]


def _nested_digest(key: Any) -> str:
  """``step.digest`` of a step's key as format 3 spelt it: the fold's untied
  copies (the only extras a step on a fold reads) were ``.untied[...]``."""
  return hashlib.sha256(repr(key).replace(".extras[", ".untied[").encode()).hexdigest()
