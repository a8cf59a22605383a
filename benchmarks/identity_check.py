"""Behaviour identity across a refactor: SHA-256s of every zoo model × option set.

For each tiny zoo model and each option set (default; auxiliary_centering=False;
tied_weights="copy"; fuse_affine; defer_norms; rotate by a fixed random
orthogonal q; cbwc) this writes the SHA-256 of ``str(report)``, of
``report.to_json()`` (where the report has one), of the bytes of every
parameter leaf (with its path, shape and dtype; and, free of paths and order,
of the leaves' bytes alone) and of the jitted outputs at
the example shape, or the refusal's type and message, to a JSON file.
Run it before and after a change and compare::

  python benchmarks/identity_check.py /tmp/identity_before.json
  python benchmarks/identity_check.py /tmp/identity_after.json --compare /tmp/identity_before.json

Uses only the public API (and the ``models`` zoo).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import jax
import numpy as np

import jaxfold
import models

OPTION_SETS = ("default", "no_aux", "tied_copy", "fuse_affine", "defer_norms", "rotate", "cbwc")


# Reports and messages name source locations: the checkout's own path is
# dropped, so that two checkouts (before and after a change) compare.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jaxfold.__file__)))


def _text(s: str) -> bytes:
  return s.replace(_ROOT + os.sep, "").replace(os.path.basename(_ROOT) + os.sep, "").encode()


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _tree_sha(tree) -> str:
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    a = np.asarray(leaf)
    h.update(f"{jax.tree_util.keystr(path)}|{a.shape}|{a.dtype}|".encode())
    h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()


def _leaves_sha(tree) -> str:
  """The leaves' bytes, shapes and dtypes as a multiset: free of their paths and
  order, so a change of the parameters' tree type alone keeps it."""
  parts = sorted(_sha(f"{a.shape}|{a.dtype}|".encode() + np.ascontiguousarray(a).tobytes())
                 for a in map(np.asarray, jax.tree_util.tree_leaves(tree)))
  return _sha("".join(parts).encode())


def _width(spec) -> int | None:
  for name in ("hidden_size", "n_embd", "d_model", "embed_dim", "dim"):
    n = getattr(spec.config, name, None)
    if isinstance(n, int):
      return n
  return None


def _result(spec, option: str, params, args):
  apply = spec.apply_fn()
  if option == "cbwc":
    return jaxfold.cbwc(params, apply, *args), params
  kw = {"no_aux": {"auxiliary_centering": False}, "tied_copy": {"tied_weights": "copy"},
        "fuse_affine": {"fuse_affine": True}, "defer_norms": {"defer_norms": True},
        "rotate": {"tied_weights": "copy", "fuse_affine": True}}.get(option, {})
  r = jaxfold.fold(params, apply, *args, **kw)
  if option == "rotate":
    n = _width(spec)
    if n is None:
      raise ValueError("no stream width in the config")
    q = np.linalg.qr(np.random.default_rng(1).normal(size=(n, n)))[0]
    r = jaxfold.rotate(r, q)
  return r, r.params


def _inputs(spec) -> tuple:
  """Random parameters and example inputs at batch 2: 8 tokens for text models,
  the model's own size for vision and audio ones (whose seq is no token count)."""
  try:
    args = spec.example_inputs(2, 8)
    jax.eval_shape(spec.apply_fn(), spec.abstract_init(2, 8), *args)
    return models.random_params(spec, 2, 8), args
  except Exception:  # noqa: BLE001 - a model whose inputs are not tokens
    return models.random_params(spec, 2), spec.example_inputs(2, None)


def one(name: str, option: str) -> dict:
  spec = models.get(name)
  try:
    params, args = _inputs(spec)
  except Exception as e:  # noqa: BLE001
    return {"setup error": f"{type(e).__name__}: {e}"}
  try:
    r, p = _result(spec, option, params, args)
  except Exception as e:  # noqa: BLE001 - a refusal is behaviour too
    return {"error": _sha(_text(f"{type(e).__name__}: {e}")), "error_head": str(e)[:120]}
  out = {"str_report": _sha(_text(str(r.report)))}
  to_json = getattr(r.report, "to_json", None)
  if callable(to_json):
    j = to_json()
    out["report_json"] = _sha(_text(j if isinstance(j, str) else json.dumps(j, sort_keys=True)))
  out["params"] = _tree_sha(p)
  out["param_bytes"] = _leaves_sha(p)
  try:
    out["outputs"] = _tree_sha(jax.jit(r.apply_fn)(p, *args))
  except Exception as e:  # noqa: BLE001
    out["outputs"] = "error " + _sha(_text(f"{type(e).__name__}: {e}"))
  return out


def tiny_models() -> list:
  return [n for n in models.names() if any(t in n for t in ("tiny", "small", "test", "cnn"))]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("out")
  ap.add_argument("--compare", help="a JSON file written before: report every difference")
  ap.add_argument("--models", nargs="*", default=None)
  ap.add_argument("--options", nargs="*", default=list(OPTION_SETS))
  a = ap.parse_args(argv)
  names = a.models or tiny_models()
  result = {}
  for name in names:
    for option in a.options:
      result[f"{name}|{option}"] = one(name, option)
      print(name, option, "error" if "error" in result[f"{name}|{option}"] else "ok", flush=True)
  with open(a.out, "w") as f:
    json.dump(result, f, indent=1, sort_keys=True)
  if a.compare:
    with open(a.compare) as f:
      before = json.load(f)
    keys = sorted(set(before) & set(result))
    diff = [k for k in keys if before[k] != result[k]]
    for k in diff:
      print("DIFFERS", k, json.dumps(before[k])[:300], "->", json.dumps(result[k])[:300])
    missing = sorted(set(before) ^ set(result))
    print(f"{len(keys) - len(diff)}/{len(keys)} combinations identical; {len(missing)} not in both")
    return 1 if diff else 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
