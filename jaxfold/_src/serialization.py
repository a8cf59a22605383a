"""Save and load a fold: parameters with orbax-checkpoint, report and metadata as JSON.

Layout of a saved fold directory::

    DIR/params/        orbax checkpoint of ``folded.params``
    DIR/report.json    ``folded.report.to_json()``
    DIR/fold.json      what :func:`load_fold` needs to rebuild ``apply_fn``: fold options,
                       the example-argument signature, whether parameters were untied
    DIR/meta.json      free-form metadata given by the caller (model name, config, ...)

``folded.apply_fn`` re-traces the *original* apply function, so :func:`load_fold`
takes it (``jaxfold report DIR``/``jaxfold bench`` resolve it from the model name
stored in meta.json).  Loading re-runs the analysis on abstract shapes (no weights
are touched), checks that it makes the same decisions as the saved report, and
returns a fold whose ``apply_fn(params, *args)`` is bit-for-bit the saved one's.

Example:
    >>> save_fold(folded, "/tmp/f", meta={"model": "gpt2-tiny"})
    >>> again = load_fold("/tmp/f", apply_fn)
    >>> again.apply_fn(again.params, ids)
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxfold._src.report import Centering, Report, Site

__all__ = ["save_fold", "load_fold", "load_report", "load_meta", "LoadedFold",
           "report_from_dict", "FORMAT_VERSION"]

FORMAT_VERSION = 1


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
    return {"dict": {str(k): _encode_args(v) for k, v in args.items()}}
  if isinstance(args, tuple):
    return {"tuple": [_encode_args(v) for v in args]}
  if isinstance(args, list):
    return {"list": [_encode_args(v) for v in args]}
  if args is None:
    return {"none": None}
  if hasattr(args, "shape") and hasattr(args, "dtype"):
    return {"array": {"shape": [int(d) for d in np.shape(args)],
                      "dtype": jnp.dtype(args.dtype).name}}
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
  return jax.ShapeDtypeStruct(tuple(val["shape"]), jnp.dtype(val["dtype"]))


def report_from_dict(d: dict) -> Report:
  """Inverse of ``Report.as_dict()``."""
  sites = []
  for s in d.get("sites", []):
    s = dict(s)
    s["centered"] = tuple(Centering(**{**c, "spec": tuple(tuple(x) for x in c.get("spec", ()))})
                          for c in s.get("centered", ()))
    s["shape"] = tuple(s["shape"])
    s["axes"] = tuple(s["axes"])
    sites.append(Site(**s))
  return Report(tuple(sites), tuple(d.get("auxiliary", ())), int(d.get("untied_bytes", 0)))


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
  return bool(folded.params.untied)


# ----------------------------------------------------------------------------
# Public API.


def save_fold(folded: Any, directory: str | os.PathLike, *, meta: Optional[dict] = None,
              example_args: Any = None, overwrite: bool = False) -> str:
  """Writes ``folded`` (from :func:`jaxfold.fold`) under ``directory``.

  Args:
    folded: a :class:`jaxfold.Folded`.
    directory: created if missing; must be empty unless ``overwrite``.
    meta: JSON-serializable metadata stored in ``meta.json`` (model name,
      config, jax version, ...; anything non-JSON is stored as ``str``).
    example_args: the arguments ``fold`` was traced with; by default they are
      recovered from ``folded.apply_fn``.
    overwrite: replace an existing fold in ``directory``.

  Returns:
    The absolute path of ``directory``.
  """
  import orbax.checkpoint as ocp

  directory = os.path.abspath(os.fspath(directory))
  if os.path.exists(directory) and os.listdir(directory):
    if not overwrite:
      raise FileExistsError(f"{directory} is not empty: choose a new directory or pass "
                            "overwrite=True")
    import shutil
    for name in ("params", "report.json", "fold.json", "meta.json"):
      p = os.path.join(directory, name)
      if os.path.isdir(p):
        shutil.rmtree(p)
      elif os.path.exists(p):
        os.remove(p)
  os.makedirs(directory, exist_ok=True)
  options = _options_of(folded)
  args = example_args if example_args is not None else _example_args_of(folded)
  fold_info = {
      "format_version": FORMAT_VERSION,
      "options": options,
      "example_args": _encode_args(tuple(args)),
      "untied": _is_untied(folded),
      "jax_version": jax.__version__,
  }
  params = {"params": jax.tree_util.tree_map(np.asarray, folded.params.params)}
  if folded.params.untied:  # orbax does not store empty containers
    params["untied"] = {k: np.asarray(v) for k, v in folded.params.untied.items()}
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(directory, "params"), params)
    ckptr.wait_until_finished()
  with open(os.path.join(directory, "report.json"), "w") as f:
    f.write(folded.report.to_json() + "\n")
  _write_json(os.path.join(directory, "fold.json"), fold_info)
  _write_json(os.path.join(directory, "meta.json"), dict(meta or {}))
  return directory


def load_report(directory: str | os.PathLike) -> Report:
  """The :class:`jaxfold.Report` of a saved fold (no jax work, no weights read)."""
  path = os.path.join(os.fspath(directory), "report.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist: {directory} is not a saved fold "
                            "(expected params/, report.json, fold.json, meta.json)")
  return report_from_dict(_read_json(path))


def load_meta(directory: str | os.PathLike) -> dict:
  """The ``meta.json`` of a saved fold ({} if absent)."""
  path = os.path.join(os.fspath(directory), "meta.json")
  return _read_json(path) if os.path.exists(path) else {}


def _restore_params(path: str, target: Any = None) -> Any:
  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as ckptr:
    if target is not None:
      abstract = jax.tree_util.tree_map(
          lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), target)
      return ckptr.restore(path, abstract)
    try:
      meta = ckptr.metadata(path)
      tree = getattr(meta, "item_metadata", meta)
      tree = getattr(tree, "tree", tree)
      abstract = jax.tree_util.tree_map(
          lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree,
          is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))
      return ckptr.restore(path, abstract)
    except Exception:  # noqa: BLE001 - older orbax: restore as saved
      return ckptr.restore(path)


def load_fold(directory: str | os.PathLike, apply_fn: Callable, *,
              target: Any = None, verify: bool = True) -> LoadedFold:
  """Reads a fold written by :func:`save_fold`.

  Args:
    directory: the saved fold.
    apply_fn: the *original* ``apply_fn(params, *args)`` the fold was made from
      (for a ``models`` config: ``models.get(name).apply_fn()``).
    target: optional pytree with the structure of ``folded.params`` (arrays or
      ShapeDtypeStructs), for parameter pytrees that are not plain dicts.
    verify: check that re-analysing ``apply_fn`` makes the same per-site
      decisions as the saved report (fails when the model code changed).

  Returns:
    ``LoadedFold(params, apply_fn, report, meta)``; ``apply_fn(params, *args)``
    reproduces the saved fold's results bit-for-bit.
  """
  from jaxfold._src.fold import FoldedParams, fold as _fold

  directory = os.path.abspath(os.fspath(directory))
  info_path = os.path.join(directory, "fold.json")
  if not os.path.exists(info_path):
    raise FileNotFoundError(f"{info_path} does not exist: {directory} is not a saved fold "
                            "(write one with jaxfold.serialization.save_fold or `jaxfold fold`)")
  info = _read_json(info_path)
  if info.get("format_version", 0) > FORMAT_VERSION:
    raise ValueError(f"{directory} was written by a newer jaxfold (format "
                     f"{info['format_version']} > {FORMAT_VERSION}); upgrade jaxfold")
  if isinstance(target, FoldedParams):
    target = {"params": target.params, **({"untied": target.untied} if target.untied else {})}
  params = _restore_params(os.path.join(directory, "params"), target)
  params = jax.tree_util.tree_map(jnp.asarray, params)
  params = FoldedParams(params["params"], dict(params.get("untied") or {}))
  base = params.params
  abstract = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), base)
  args = _decode_args(info["example_args"])
  opts = dict(info["options"])
  opts.pop("through_dropout", None)  # a CBWC-only option; a saved fold never sets it
  refold = _fold(abstract, apply_fn, *args, **opts)
  saved = load_report(directory)
  if verify:
    got = [(s.folded, s.shape, s.axes) for s in refold.report.sites]
    want = [(s.folded, s.shape, s.axes) for s in saved.sites]
    if got != want or bool(refold.params.untied) != bool(info["untied"]):
      raise ValueError(
          f"re-analysing apply_fn does not reproduce the saved fold in {directory} "
          f"({sum(g[0] for g in got)}/{len(got)} sites folded now, "
          f"{sum(w[0] for w in want)}/{len(want)} when saved): pass the apply_fn of the "
          "model the fold was made from, or fold the model again")
  return LoadedFold(params, refold.apply_fn, refold.report, load_meta(directory))
