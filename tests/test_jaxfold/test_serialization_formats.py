"""Folds saved by older jaxfolds still load: format 3 nested each step's
parameters in the next's (``FusedParams(base=FoldedParams(params, untied),
extras)``); this jaxfold reads them into one ``jaxfold.Params`` (leaves
renamed and reordered by name, each step's saved decisions still checked)."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

import jaxfold
from tests.test_jaxfold import format3_model as M

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.mark.parametrize("name", ["fused", "rotated", "deferred"])
def test_format3_chain_loads_into_one_params(x64, name):
  d = os.path.join(DATA, f"format3_{name}")
  with open(os.path.join(d, "fold.json")) as f:
    saved = json.load(f)
  assert saved["format_version"] == 3 and any(".base." in row[0] for row in saved["leaves"])
  loaded = jaxfold.load_fold(d, M.apply)
  assert isinstance(loaded.params, jaxfold.Params)
  # the fold's untied copy and fuse_affine's new biases, all in one extras dict
  assert sorted(loaded.params.extras) == sorted(
      [".params['w1']@bias.params['b1']", ".params['wte']@bias.params['bf']", "['wte']@centered(1)"])
  assert all(".base" not in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(loaded.params)[0])
  p = M.params()
  for batch in (1, 3):   # the original function, at the example's batch and others
    x = M.ids(batch)
    np.testing.assert_allclose(loaded.apply_fn(loaded.params, x), M.apply(p, x), rtol=1e-9, atol=1e-9)
  if name == "rotated":
    assert loaded.report.rotated and np.allclose(loaded.apply_fn.q, M.rotation())


def test_format3_chain_with_other_decisions_is_refused_naming_its_writer(x64, tmp_path):
  d = shutil.copytree(os.path.join(DATA, "format3_rotated"), tmp_path / "f")
  info = json.load(open(d / "fold.json"))
  info["transforms"][-1]["rotated"] = info["transforms"][-1]["rotated"][1:]   # one rotated leaf fewer
  json.dump(info, open(d / "fold.json", "w"))
  with pytest.raises(jaxfold.FoldError, match=r"rotation .*saved in format 3 by jaxfold 0\.1\.0"):
    jaxfold.load_fold(d, M.apply, integrity=False)


def test_a_chain_saved_now_is_format_4_and_round_trips(x64, tmp_path):
  p, x = M.params(), M.ids()
  fused = jaxfold.fuse_affine(jaxfold.fold(p, M.apply, x, tied_weights="copy"))
  d = jaxfold.save_fold(fused, tmp_path / "f")
  assert json.load(open(os.path.join(d, "fold.json")))["format_version"] == 4
  loaded = jaxfold.load_fold(d, M.apply)
  assert jax.tree_util.tree_structure(loaded.params) == jax.tree_util.tree_structure(fused.params)
  for a, b in zip(jax.tree_util.tree_leaves(loaded.params), jax.tree_util.tree_leaves(fused.params)):
    np.testing.assert_array_equal(a, b)
