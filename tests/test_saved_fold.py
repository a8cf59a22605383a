"""jaxfold.serialization: a saved fold loads back bit-for-bit."""

import os

import jax
import numpy as np
import pytest

import jaxfold
from jaxfold.serialization import load_fold, load_meta, load_report, save_fold
from models import random_params

models = pytest.importorskip("models")


@pytest.fixture(scope="module")
def gpt2_tiny():
  spec = models.get("gpt2-tiny")
  params = random_params(spec, 2, 8, seed=0)   # numpy draws, γ/β randomized
  return spec, params, spec.apply_fn()


@pytest.mark.parametrize("opts", [dict(), dict(auxiliary_centering=False, tied_weights="copy")],
                         ids=["auto", "untied-copy"])
def test_round_trip_bit_for_bit(tmp_path, gpt2_tiny, opts):
  spec, params, apply = gpt2_tiny
  folded = jaxfold.fold(params, apply, *spec.example_inputs(2, 8), **opts)
  d = save_fold(folded, tmp_path / "fold", meta={"model": spec.name, "note": (1, 2)})
  assert sorted(os.listdir(d)) == ["fold.json", "manifest.json", "meta.json", "params", "program.json",
                                  "report.json"]
  loaded = load_fold(d, apply)
  assert jax.tree_util.tree_structure(loaded.params) == jax.tree_util.tree_structure(folded.params)
  for a, b in zip(jax.tree_util.tree_leaves(folded.params), jax.tree_util.tree_leaves(loaded.params)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  for shape in [(2, 8)]:   # eager: the folded interpreter itself, no compilation
    args = spec.example_inputs(*shape)
    want = folded.apply_fn(folded.params, *args)
    got = loaded.apply_fn(loaded.params, *args)
    np.testing.assert_array_equal(np.asarray(want), np.asarray(got))
  assert loaded.report.as_dict() == folded.report.as_dict()
  assert load_report(d).as_dict() == folded.report.as_dict()
  assert loaded.meta == {"model": "gpt2-tiny", "note": [1, 2]} == load_meta(d)
  if opts:
    assert loaded.params.extras


def test_refuses_non_empty_dir_and_wrong_model(tmp_path, gpt2_tiny):
  spec, params, apply = gpt2_tiny
  folded = jaxfold.fold(params, apply, *spec.example_inputs(2, 8))
  d = save_fold(folded, tmp_path / "f")
  with pytest.raises(FileExistsError, match="overwrite"):
    save_fold(folded, d)
  save_fold(folded, d, overwrite=True)
  # a model with the same parameter tree but no foldable norms: must not load silently
  def no_norm(p, ids):
    return p["wte"]["embedding"][ids]
  with pytest.raises(ValueError, match="does not reproduce|not the program the fold"):
    load_fold(d, no_norm)
  # without program.json (a fold saved before it was recorded; integrity=False as the manifest lists it)
  # the re-analysis' per-site decisions still refuse the other model
  os.remove(os.path.join(d, "program.json"))
  with pytest.raises(jaxfold.FoldError, match="does not reproduce the saved fold"):
    load_fold(d, no_norm, integrity=False)
  with pytest.raises(FileNotFoundError, match="not a saved fold"):
    load_fold(tmp_path, apply)
  with pytest.raises(FileNotFoundError, match="not a saved fold"):
    load_report(tmp_path)
  # a path that does not exist is said to be missing, not "not a saved fold"
  for load in (lambda p: load_fold(p, apply), load_report):
    with pytest.raises(FileNotFoundError, match=r"absent does not exist \(no such directory\)") as e:
      load(tmp_path / "absent")
    assert "not a saved fold" not in str(e.value)


def test_check_target_refuses_what_save_fold_refuses(tmp_path):
  from jaxfold.serialization import check_target
  check_target(str(tmp_path / "new"), overwrite=False)            # absent: fine
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x.txt").write_text("mine")
  with pytest.raises(FileExistsError, match="not empty"):
    check_target(str(tmp_path / "full"), overwrite=False)
  with pytest.raises(FileExistsError, match="not a saved fold"):
    check_target(str(tmp_path / "full"), overwrite=True)
