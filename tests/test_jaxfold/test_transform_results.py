"""fuse_affine and rotate results deploy like folds: save_fold/load_fold, export/load_exported,
and the safetensors writer refuses what it cannot represent (float64, GPT-2-tiny)."""

import json
import os
import warnings

import jax
import numpy as np
import pytest
from test_rotate import hadamard
from zoo_fused import ZOO_TOL, errors, fused, inputs, original, shapes

import jaxfold
from jaxfold._src.artifact import ExportWarning
from models.common import max_rel_err
from models.safetensors_io import NotRepresentable, save_safetensors

NAME = "gpt2-tiny"


def _result(kind):
  folded, fu = fused(NAME)
  if kind == "fused":
    return fu
  return jaxfold.rotate(fu, hadamard(32))


@pytest.mark.parametrize("kind", ["fused", "rotated"])
def test_save_load_roundtrip(x64, tmp_path, kind):
  res = _result(kind)
  d = tmp_path / kind
  jaxfold.save_fold(res, d, meta={"model": NAME})
  apply, _ = original(NAME)
  back = jaxfold.load_fold(d, apply)
  assert type(back.apply_fn) is type(res.apply_fn) and type(back.params) is type(res.params)
  assert type(back.report) is type(res.report)
  # Bit for bit the saved parameters, and the original model's outputs at two shapes.
  for a, b in zip(jax.tree_util.tree_leaves(res.params), jax.tree_util.tree_leaves(back.params)):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  assert max(errors(NAME, back)) < ZOO_TOL
  info = json.loads((d / "fold.json").read_text())
  assert [t["name"] for t in info["transforms"]] == (
      ["fuse_affine"] if kind == "fused" else ["fuse_affine", "rotate"])
  if kind == "rotated":
    assert np.array_equal(np.load(d / "rotation-0.npy"), hadamard(32))
    assert np.array_equal(back.apply_fn.q, hadamard(32))
    assert dict(back.report.rotated) == dict(res.report.rotated)
  else:
    assert back.report.num_fused == res.report.num_fused == 5
  # A loaded result saves again (the same chain), and loads again.
  jaxfold.save_fold(back, tmp_path / "again")
  again = jaxfold.load_fold(tmp_path / "again", apply)
  ids = inputs(NAME, *shapes(NAME)[1])
  assert np.array_equal(again.apply_fn(again.params, *ids), back.apply_fn(back.params, *ids))


def test_load_refuses_another_program(x64, tmp_path):
  fu = _result("fused")
  jaxfold.save_fold(fu, tmp_path / "f")
  apply, _ = original(NAME)
  with pytest.raises(jaxfold.FoldError, match="not the program"):
    jaxfold.load_fold(tmp_path / "f", lambda p, x: apply(p, x) * 2)


@pytest.mark.parametrize("kind", ["fused", "rotated"])
def test_load_refuses_a_chain_the_analysis_does_not_reproduce(x64, tmp_path, kind):
  """fold.json records each step's decisions (fuse_affine's analysis key, the
  rotated parameters); one that re-analysing apply_fn does not reproduce (a
  fold.json of another model's chain; integrity=False, as an edited file fails
  the manifest first) is refused, not loaded into another plan."""
  d = tmp_path / kind
  jaxfold.save_fold(_result(kind), d)
  info = json.loads((d / "fold.json").read_text())
  step = info["transforms"][-1]
  if kind == "fused":
    step["key_sha256"] = "0" * 64
  else:
    step["rotated"] = step["rotated"][:-1]
  (d / "fold.json").write_text(json.dumps(info))
  apply, _ = original(NAME)
  with pytest.raises(jaxfold.FoldError, match="does not reproduce the saved"):
    jaxfold.load_fold(d, apply, integrity=False)


# The rotated program is the fused one (rotate changes parameters only): slow run only.
@pytest.mark.parametrize("kind", ["fused", pytest.param("rotated", marks=pytest.mark.slow)])
def test_export_load_exported(x64, kind):
  res = _result(kind)
  apply, p = original(NAME)
  for batch, seq in shapes(NAME):
    ids = inputs(NAME, batch, seq)
    with warnings.catch_warnings():
      warnings.simplefilter("error", ExportWarning)
      blob = jaxfold.export(res, *ids, symbolic=None, meta={"model": NAME})
    fn = jaxfold.load_exported(blob)
    assert max_rel_err(apply(p, *ids), fn(*ids)) < ZOO_TOL
  # Parameters as an argument: the Params pytree goes in as the caller passes it.
  blob = jaxfold.export(res, *ids, symbolic=None, params_as_argument=True, check=False)
  fn = jaxfold.load_exported(blob)
  assert max_rel_err(apply(p, *ids), fn(res.params, *ids)) < ZOO_TOL


def test_safetensors_refuses_what_it_cannot_represent(x64, tmp_path):
  apply, p = original(NAME)
  ids = inputs(NAME, *shapes(NAME)[0])
  folded_copy, fu = fused(NAME)     # tied_weights="copy": an untied centered copy
  folded_aux = jaxfold.fold(p, apply, *ids, tied_weights="auxiliary")
  assert folded_copy.params.extras and folded_aux.report.num_auxiliary
  cases = {
      "fused": (fu, "fuse_affine result"),
      "fused params": (fu.params, "fuse_affine parameters"),
      "fused base": (fu.params.params, "are None"),
      "rotated": (_result("rotated"), "rotated"),
      "untied": (folded_copy, "untied centered copies"),
      "untied params": (folded_copy.params, "untied centered copies"),
      "auxiliary": (folded_aux, "auxiliary centering"),
  }
  for what, (obj, why) in cases.items():
    path = tmp_path / f"{what}.safetensors"
    with pytest.raises(NotRepresentable, match=why):
      save_safetensors(obj, path, "gpt2")
    assert not os.path.exists(path), what
  # What it can represent still writes: the original parameters.
  save_safetensors(p, tmp_path / "ok.safetensors", "gpt2")
  assert os.path.getsize(tmp_path / "ok.safetensors") > 0


def test_serve_loads_a_fused_fold_dir(x64, tmp_path):
  pytest.importorskip("uvicorn")
  from jaxfold._src.server.model import load_model
  fu = _result("fused")
  jaxfold.save_fold(fu, tmp_path / "f", meta={"model": NAME})
  apply, p = original(NAME)
  served = load_model(str(tmp_path / "f"), zoo_meta=lambda name: (apply, {"model": name}))
  ids = inputs(NAME, *shapes(NAME)[0])
  assert max_rel_err(apply(p, *ids), served.fn(*ids)) < ZOO_TOL
