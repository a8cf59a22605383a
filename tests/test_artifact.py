"""jaxfold.export: serialized, self-contained folded programs with symbolic shapes."""

import warnings

import flax.linen as nn
import jax
import pytest
from helpers import randomize, rel_err

import jaxfold
from jaxfold.exporting import ExportWarning, export, exported_signature, load_exported
from models import random_params

models = pytest.importorskip("models")


@pytest.fixture(scope="module")
def gpt2_tiny():
  spec = models.get("gpt2-tiny")
  params = random_params(spec, 2, 8, seed=0)   # numpy draws, γ/β randomized
  apply = jax.jit(spec.apply_fn())
  folded = jaxfold.fold(params, apply, *spec.example_inputs(2, 8))
  return spec, params, apply, folded


def test_symbolic_export_runs_any_batch_and_length(gpt2_tiny):
  spec, params, apply, folded = gpt2_tiny
  with warnings.catch_warnings():
    warnings.simplefilter("error", ExportWarning)
    blob = export(folded, *spec.example_inputs(2, 8))
  assert isinstance(blob, bytes) and len(blob) > 1000
  fn = load_exported(blob)
  assert exported_signature(fn) == [(("batch", "seq"), "int32")]
  for b, s in [(3, 5), (1, 16)]:
    args = spec.example_inputs(b, s)
    got = fn(*args)
    assert got.shape == (b, s, spec.config.vocab_size)
    assert rel_err(apply(params, *args), got) < 1e-5


def test_params_as_argument(gpt2_tiny):
  spec, params, apply, folded = gpt2_tiny
  blob = export(folded, *spec.example_inputs(2, 8), params_as_argument=True)
  fn = load_exported(blob)
  args = spec.example_inputs(3, 6)
  assert rel_err(apply(params, *args), fn(folded.params, *args)) < 1e-5
  assert exported_signature(fn)[-1] == (("batch", "seq"), "int32")


def test_concrete_export(gpt2_tiny):
  spec, params, apply, folded = gpt2_tiny
  fn = load_exported(export(folded, *spec.example_inputs(2, 8), symbolic=None))
  assert exported_signature(fn) == [((2, 8), "int32")]
  args = spec.example_inputs(2, 8, )
  assert rel_err(apply(params, *args), fn(*args)) < 1e-5
  with pytest.raises(ValueError, match=r"input #0 has shape \(3, 8\).*exported for fixed shapes int32\[2,8\]"):
    fn(*spec.example_inputs(3, 8))    # (jax said only "Shape mismatch for args[0].shape[0]")


class ShapeBranch(nn.Module):
  """Python control flow on the sequence length: not exportable with a symbolic seq."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    if x.shape[1] >= 4:
      h = h * 2.0
    return nn.LayerNorm()(h)


def test_falls_back_to_fewer_symbolic_dims_with_warning():
  m = ShapeBranch()
  x = jax.random.normal(jax.random.key(0), (2, 6, 8))
  p = models.randomize_norms(m.init(jax.random.key(1), x), jax.random.key(2))
  folded = jaxfold.fold(p, m.apply, x)
  assert folded.report.num_folded == 1
  with pytest.warns(ExportWarning, match="batch"):
    blob = export(folded, x)
  fn = load_exported(blob)
  assert exported_signature(fn) == [(("batch", 6, 8), "float32")]
  x3 = jax.random.normal(jax.random.key(3), (5, 6, 8))
  assert rel_err(m.apply(p, x3), fn(x3)) < 1e-5
  with pytest.raises(ValueError, match=r"\(5, 3, 8\).*exported for these shapes float32\[batch,6,8\]"):
    fn(x3[:, :3])


def test_bad_arguments(gpt2_tiny):
  spec, _, _, folded = gpt2_tiny
  with pytest.raises(ValueError, match="example arguments"):
    export(folded)
  with pytest.raises(ValueError, match="identifiers"):
    export(folded, *spec.example_inputs(2, 8), symbolic=("batch size",))
  with pytest.raises(TypeError, match="jaxfold.fold"):
    export(object(), *spec.example_inputs(2, 8))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_exported("no-such-model.jaxexport")
  with pytest.raises(TypeError, match="bytes or its path"):
    load_exported(123)


class Flagged(nn.Module):
  """A static keyword argument picks the program (like flax's ``deterministic``)."""

  @nn.compact
  def __call__(self, x, *, flag=False):
    h = nn.Dense(16)(x)
    h = nn.LayerNorm()(h)
    y = nn.Dense(4)(h)
    return y if flag else y + 2.0 * h[..., :4]   # flag=False: h has a reader fuse_affine cannot take


@pytest.mark.parametrize("fuse", [False, True])
def test_export_binds_the_folds_static_keyword_arguments(fuse):
  """Finding: export traced apply_fn(params, *args) with the function's
  defaults: a fold made with example_kwargs={"flag": True} exported the
  flag=False program (a fused one refused: 'fuse differently')."""
  from helpers import x64_context
  with x64_context():
    m = Flagged()
    x = jax.random.normal(jax.random.key(0), (2, 5, 8), "float64")
    p = jax.tree_util.tree_map(lambda a: a.astype("float64"), m.init(jax.random.key(1), x))
    p = randomize(p, seed=2)   # γ, β and the Dense biases all non-trivial
    r = jaxfold.fold(p, m.apply, x, example_kwargs={"flag": True})
    if fuse:
      r = jaxfold.fuse_affine(r)
      assert r.report.num_fused == 1
    fn = load_exported(export(r, x))                        # the fold's flag=True
    assert exported_signature(fn) == [(("batch", "seq", 8), "float64")]
    for shape in [(3, 7, 8), (1, 1, 8)]:
      x2 = jax.random.normal(jax.random.key(4), shape, "float64")
      assert rel_err(m.apply(p, x2, flag=True), fn(x2)) < 1e-9
    if not fuse:   # a fold serves every flag; say which one
      fn0 = load_exported(export(r, x, example_kwargs={"flag": False}))
      x2 = jax.random.normal(jax.random.key(5), (3, 7, 8), "float64")
      assert rel_err(m.apply(p, x2, flag=False), fn0(x2)) < 1e-9
      assert rel_err(m.apply(p, x2, flag=True), fn0(x2)) > 1e-3
    with pytest.raises(ValueError, match=r"example_kwargs \['mask'\] hold arrays"):
      export(r, x, example_kwargs={"mask": x})
    with pytest.raises(TypeError, match="must be a dict"):
      export(r, x, example_kwargs=[("flag", True)])


def test_write_artifact_replaces_atomically(tmp_path):
  import types

  from jaxfold.exporting import MAGIC, read_artifact, write_artifact
  scaled = types.SimpleNamespace(params=jax.numpy.float32(2.0), apply_fn=lambda p, x: x * p)
  blob = export(scaled, jax.numpy.ones((2, 3)), symbolic=None)
  path = tmp_path / "m.jaxexport"
  path.write_bytes(b"old")
  write_artifact(str(path), blob)
  assert path.read_bytes() == blob and blob.startswith(MAGIC)
  header, program = read_artifact(path.read_bytes(), str(path))
  assert isinstance(header, dict) and program
  assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jaxexport"]   # no temporary left behind
