"""The tables a served program's integer inputs index, read from the program's
dataflow (serve/tables.py): whatever the parameters are named, for an artifact
and a fold directory; metadata that is forged or missing cannot widen them;
an input that reaches an index only through arithmetic bounds nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfold
from jaxfold import serving
from jaxfold._src.server.tables import program_tables

nn = pytest.importorskip("flax.linen")

VOCAB, POSITIONS, D = 50, 12, 16


class Plain(nn.Module):
  """A pre-LN model whose tables have names no list of known names holds."""
  lookup: str = "take"      # "take": nn.Embed; "onehot": one_hot(ids) @ table; "mod": table[ids % 7]

  @nn.compact
  def __call__(self, ids):
    if self.lookup == "take":
      h = nn.Embed(VOCAB, D, name="tok")(ids)
    else:
      table = self.param("tok", nn.initializers.normal(0.5), (VOCAB, D))
      h = (jax.nn.one_hot(ids, VOCAB) @ table if self.lookup == "onehot" else table[ids % 7])
    where = self.param("where", nn.initializers.normal(0.5), (POSITIONS, D))
    h = h + where[jnp.arange(ids.shape[1])]
    h = nn.LayerNorm(name="ln")(h)
    return nn.Dense(VOCAB, name="out")(h)


def _fold(lookup="take"):
  m = Plain(lookup)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 7, (2, 5)), jnp.int32)
  params = m.init(jax.random.PRNGKey(0), ids)
  return m, jaxfold.fold(params, m.apply, ids), ids


@pytest.fixture(scope="module")
def plain():
  return _fold()


@pytest.mark.parametrize("bundle", [True, False], ids=["bundled", "baked"])
def test_tables_found_whatever_their_names(plain, bundle):
  _, folded, ids = plain
  fn = jaxfold.load_exported(jaxfold.export(folded, ids, bundle_params=bundle))
  t = program_tables(fn)
  assert (t.inputs, t.positions, t.unbounded) == ({0: VOCAB}, POSITIONS, {})
  m = serving.ServedModel(fn, max_batch=2)          # no metadata: no --vocab, no --max-seq needed
  assert (m.inputs[0].low, m.inputs[0].high, m.max_seq) == (0, VOCAB, POSITIONS)
  m.validate({"inputs": [[0, VOCAB - 1]]})
  with pytest.raises(serving.InputError, match=f"value {VOCAB} at index"):
    m.validate({"inputs": [[1, VOCAB]]})
  with pytest.raises(serving.InputError, match="longer than"):
    m.validate({"inputs": [list(range(POSITIONS + 1))]})


def test_forged_metadata_cannot_widen(plain):
  _, folded, ids = plain
  forged = {"inputs": [{"name": "ids", "low": -3, "high": 10**6}], "max_seq": 10**6}
  fn = jaxfold.load_exported(jaxfold.export(folded, ids, meta=forged))
  m = serving.ServedModel(fn, meta=fn.meta, max_batch=2)
  assert (m.inputs[0].low, m.inputs[0].high, m.max_seq) == (0, VOCAB, POSITIONS)
  assert any(f"tables only {VOCAB}" in n for n in m.notes) and any("position table" in n for n in m.notes)
  # metadata may narrow: it is the model author's word and cannot index out of range
  narrow = jaxfold.load_exported(jaxfold.export(folded, ids, meta={"inputs": [{"high": 20}], "max_seq": 8}))
  m = serving.ServedModel(narrow, meta=narrow.meta, max_batch=2)
  assert (m.inputs[0].high, m.max_seq) == (20, 8)


def test_fold_directory(plain, tmp_path):
  model, folded, ids = plain
  jaxfold.save_fold(folded, tmp_path / "f", meta={"model": "mine"}, example_args=(ids,))
  m = serving.load_model(str(tmp_path / "f"), zoo_meta=lambda name: (model.apply, {}), max_batch=2)
  assert (m.inputs[0].high, m.max_seq) == (VOCAB, POSITIONS)
  with pytest.raises(serving.InputError, match=f"value {VOCAB}"):
    m.validate({"inputs": [[VOCAB]]})


def test_one_hot_lookup_is_a_table():
  _, folded, ids = _fold("onehot")
  t = program_tables(jaxfold.load_exported(jaxfold.export(folded, ids)))
  assert (t.inputs, t.positions) == ({0: VOCAB}, POSITIONS)


def test_an_index_through_arithmetic_bounds_nothing():
  _, folded, ids = _fold("mod")
  fn = jaxfold.load_exported(jaxfold.export(folded, ids))
  t = program_tables(fn)
  assert t.inputs == {} and 0 in t.unbounded and t.positions == POSITIONS
  with pytest.raises(serving.ServeError, match="--vocab"):
    serving.ServedModel(fn, max_batch=2)
  m = serving.ServedModel(fn, max_batch=2, vocab=30)
  assert m.inputs[0].high == 30
