"""jaxfold._src.pipeline (the front end fold, fuse_affine and rotate share), the error
hierarchy, the typed fold options and the planner's frozen outcome."""

import dataclasses
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

import jaxfold
from jaxfold._src import kernels, pipeline
from jaxfold._src.affine import FusedApply
from jaxfold._src.errors import FoldError, FuseError, JaxfoldError, RotateError
from jaxfold._src.fold import FoldedApply, FoldOptions, NormImpl, TiedWeights
from jaxfold._src.planner import Outcome, Planner, SiteEntry
from jaxfold._src.rotate import RotatedApply

D = 8


class M(nn.Module):
  @nn.compact
  def __call__(self, x, scale: float = 1.0):
    h = nn.Dense(D)(x)
    return nn.Dense(3)(nn.LayerNorm()(h)) * scale


def _randomize(p, seed=1):
  leaves, tree = jax.tree_util.tree_flatten(p)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree_util.tree_unflatten(tree, [jax.random.normal(k, x.shape, jnp.float64) for k, x in zip(keys, leaves)])


@pytest.fixture
def model(x64):
  m, x = M(), jnp.ones((2, 4), jnp.float64)
  p = _randomize(m.init(jax.random.PRNGKey(0), x))
  return m, p, x


def _hadamard(n):
  h = np.ones((1, 1))
  while len(h) < n:
    h = np.block([[h, h], [h, -h]])
  return h / np.sqrt(n)


# -- abstract values and signatures ------------------------------------------------


def test_abstract_keeps_dtype_weak_type_and_sharding():
  x = jnp.ones((2, 3), jnp.float32)
  a = pipeline.abstract(x)
  assert (a.shape, a.dtype, a.weak_type) == ((2, 3), jnp.float32, False)
  assert a.sharding == x.sharding
  assert pipeline.abstract(jnp.asarray(1.0)).weak_type
  s = jax.ShapeDtypeStruct((4,), jnp.int32)
  assert pipeline.abstract(s) is s
  assert pipeline.abstract(np.zeros(2, np.float16)).dtype == np.float16
  key = jax.random.key(0)   # typed PRNG keys have no numpy dtype
  assert pipeline.abstract(key).dtype == key.dtype


def test_abstract_refuses_non_arrays_with_the_callers_error():
  with pytest.raises(FoldError, match="expected an array"):
    pipeline.abstract("text")
  with pytest.raises(FuseError, match="expected an array"):
    pipeline.abstract(3, FuseError)


def test_signature_tells_shapes_dtypes_and_weak_types_apart():
  sig = pipeline.signature
  assert sig((jnp.ones((2, 3)),)) == sig((jax.ShapeDtypeStruct((2, 3), jnp.float32),))
  assert sig((jnp.ones((2, 3)),)) != sig((jnp.ones((2, 4)),))
  assert sig((jnp.ones(3, jnp.float32),)) != sig((jnp.ones(3, jnp.int32),))
  assert sig((jnp.asarray(1.0),)) != sig((jnp.asarray(1.0, jnp.float32),))   # weak vs strong


def test_bind_traces_array_kwargs_and_keys_static_ones():
  f = lambda p, x, scale=1.0, mask=None: x * scale if mask is None else x * mask  # noqa: E731
  x = jnp.ones(3)
  a = pipeline.bind(f, (x,), {"scale": 2.0})
  b = pipeline.bind(f, (x,), {"scale": 3.0})
  c = pipeline.bind(f, (x,), {"mask": jnp.zeros(3)})
  d = pipeline.bind(f, (x,), {"mask": jnp.ones(3)})
  assert a.key != b.key and c.key == d.key
  assert np.array_equal(a.fn(None, *a.args), 2 * x)
  assert np.array_equal(d.fn(None, *d.args), x)
  with pytest.raises(FuseError, match="neither an array nor hashable"):
    pipeline.bind(f, (x,), {"scale": {1.0}}, FuseError)


def test_trace_wraps_failures_only_when_asked():
  def bad(p, x):
    if x.sum() > 0:
      return x
    return -x
  with pytest.raises(FoldError, match="could not trace apply_fn"):
    pipeline.trace(bad, {}, (jnp.ones(2),), error=FoldError)
  with pytest.raises(jax.errors.TracerBoolConversionError):
    pipeline.trace(bad, {}, (jnp.ones(2),))
  t = pipeline.trace(lambda p, x: {"y": x @ p["w"]}, {"w": jnp.ones((2, 3))}, (jnp.ones(2),))
  assert t.names == ("['w']",) and t.out_tree == jax.tree_util.tree_structure({"y": 0})


# -- one apply wrapper, one signature cache ----------------------------------------------


def _results(m, p, x):
  folded = jaxfold.fold(p, m.apply, x)
  fused = jaxfold.fuse_affine(folded)
  rotated = jaxfold.rotate(fused, _hadamard(D))
  return folded, fused, rotated


def test_every_transform_returns_the_one_wrapper_type(model):
  m, p, x = model
  folded, fused, rotated = _results(m, p, x)
  for r, cls in ((folded, FoldedApply), (fused, FusedApply), (rotated, RotatedApply)):
    assert type(r.apply_fn) is cls and isinstance(r.apply_fn, pipeline.PipelineApply)
    assert r.apply_fn.original_fn == m.apply
    assert r.apply_fn.example_args[0].shape == x.shape and r.apply_fn.example_kwargs == {}
    assert repr(r).startswith(f"{type(r).__name__}(params=") and f"<{cls.__name__} of apply>" in repr(r)
  assert fused.apply_fn.inner is folded.apply_fn and rotated.apply_fn.inner is fused.apply_fn


@pytest.mark.parametrize("which", [0, 1, 2])
def test_signature_cache_hits_and_misses(model, which):
  m, p, x = model
  res = _results(m, p, x)[which]
  fn = res.apply_fn
  assert len(fn._cache) == 1                     # the example's analysis
  want = m.apply(p, x)
  assert rel_err(fn(res.params, x), want) < 1e-10
  assert len(fn._cache) == 1                     # hit: same signature
  x3 = jnp.ones((5, 4), jnp.float64)
  assert rel_err(fn(res.params, x3), m.apply(p, x3)) < 1e-10
  assert len(fn._cache) == 2                     # miss: a new shape, analysed once
  fn(res.params, x3 * 2)
  assert len(fn._cache) == 2                     # hit: same shapes, other values
  assert rel_err(fn(res.params, x, scale=2.0), m.apply(p, x, scale=2.0)) < 1e-10
  assert len(fn._cache) == 3                     # miss: a static keyword value


def test_fused_and_rotated_keep_parameter_shardings(model):
  m, p, x = model
  folded, fused, rotated = _results(m, p, x)
  for fn in (folded.apply_fn, fused.apply_fn, rotated.apply_fn):
    shardings = [a.sharding for a in jax.tree_util.tree_leaves(fn.params_abstract)]
    assert shardings and all(s is not None for s in shardings), type(fn).__name__


# -- one error hierarchy ----------------------------------------------------------------


def test_error_hierarchy():
  assert jaxfold.JaxfoldError is JaxfoldError and issubclass(JaxfoldError, ValueError)
  for cls in (FoldError, FuseError, RotateError, jaxfold.IntegrityError):
    assert issubclass(cls, JaxfoldError)
  assert issubclass(RotateError, FuseError) and not issubclass(FuseError, FoldError)
  assert issubclass(jaxfold.IntegrityError, FoldError)
  # the old import paths name the same classes
  from jaxfold._src import affine, fold
  assert fold.FoldError is jaxfold.FoldError and affine.FuseError is jaxfold.FuseError


def test_rotate_raises_rotate_error_that_except_fuse_error_still_catches(model):
  m, p, x = model
  fused = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
  with pytest.raises(RotateError, match="not orthogonal"):
    jaxfold.rotate(fused, np.ones((D, D)))
  try:
    jaxfold.rotate(fused, np.eye(D + 1))
  except jaxfold.FuseError as e:    # what callers wrote before RotateError existed
    assert type(e) is RotateError
  else:
    raise AssertionError("rotate accepted a q of the wrong size")


def test_fuse_refusal_is_a_fuse_error_not_a_rotate_error(model):
  m, p, x = model
  fused = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
  with pytest.raises(FuseError, match="jaxfold.Params") as e:
    fused.apply_fn(p, x)
  assert type(e.value) is FuseError


# -- typed options ---------------------------------------------------------------------------


def test_option_literals():
  assert typing.get_args(TiedWeights) == ("auto", "copy", "auxiliary")
  assert typing.get_args(NormImpl) == kernels.IMPLS
  hints = typing.get_type_hints(FoldOptions)
  assert hints["tied_weights"] == TiedWeights and hints["norm_impl"] == NormImpl


@pytest.mark.parametrize("name,bad,allowed", [
    ("tied_weights", "cpy", "'auto', 'copy', 'auxiliary'"),
    ("norm_impl", "cuda", "'auto', 'xla', 'pallas', 'interpret'"),
    ("norm_impl", None, "'auto', 'xla', 'pallas', 'interpret'"),
    ("tied_weights", ["copy"], "'auto', 'copy', 'auxiliary'"),
])
def test_bad_option_names_the_value_and_the_allowed_ones(name, bad, allowed):
  msg = f"{name} must be one of {allowed}; got {bad!r}"
  with pytest.raises(FoldError) as e:
    FoldOptions(**{name: bad})
  assert str(e.value) == msg
  with pytest.raises(FoldError, match=name):
    jaxfold.fold({"w": jnp.ones(2)}, lambda p, x: x, jnp.ones(2), **{name: bad})


# -- the planner's frozen outcome ------------------------------------------------------------


def test_planner_outcome_is_frozen_and_builds_the_plan(model):
  m, p, x = model
  traced = pipeline.trace(m.apply, pipeline.abstract_tree(p), (pipeline.abstract(x),))
  with pipeline.analyzer(traced) as an:
    planner = Planner(an, list(traced.names), FoldOptions()).run()
    out = planner.outcome()
    assert an.walk is None              # the zero-sum walks left no state behind
  assert isinstance(out, Outcome) and all(isinstance(e, SiteEntry) for e in out.sites)
  assert [e.index for e in out.sites] == list(range(len(out.sites))) and len(out.folded) == 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    out.sites[0].decision.folded = False
  with pytest.raises(AttributeError):
    out.aux = ()
  an_ = jaxfold.fold(p, m.apply, x).apply_fn.analysis_for((x,))
  assert an_.leaf_specs == out.leaf_specs and an_.untied == out.untied_specs
  assert an_.plan.zero == frozenset(r.path for e in out.folded for r in e.site.reduces)


# -- the batch-1 probe and the centered leaves (fold speed, issue 20) --------------------------


def test_probe_check_agrees_with_a_fixed_analysis(model):
  """``_check_fixed`` (what settles a batch-1 fold's second shape) passes and fails exactly
  where ``analyse(..., fixed=...)`` does, with the same message."""
  from jaxfold._src import fold as F
  from jaxfold._src.planner import PlanConflict
  from jaxfold._src.rules.base import freeze
  m, p, x = model
  x1 = x[:1]
  opts = FoldOptions()
  an = F.analyse(m.apply, p, (x1,), opts)
  probe = F._probe_args((x1,))
  assert probe[0].shape == (2, 4)
  F._check_fixed(m.apply, p, probe, opts, an.param_key)
  assert F.analyse(m.apply, p, probe, opts, fixed=an.param_key).leaf_specs == an.leaf_specs
  # Centering the last kernel's output columns shifts the program's output: visible.
  names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(p)[0]]
  i = next(i for i, n in enumerate(names) if "Dense_1" in n and "kernel" in n)
  bad = (an.leaf_specs + ((i, freeze({1: 3})),), an.untied)
  with pytest.raises(PlanConflict) as fast:
    F._check_fixed(m.apply, p, probe, opts, bad)
  with pytest.raises(PlanConflict) as full:
    F.analyse(m.apply, p, probe, opts, fixed=bad)
  assert str(fast.value) == str(full.value)


def test_batch_one_fold_is_the_fold_its_probe_shape_proves(model):
  m, p, x = model
  f1, f2 = jaxfold.fold(p, m.apply, x[:1]), jaxfold.fold(p, m.apply, x)
  assert f1.apply_fn._base.param_key == f2.apply_fn._base.param_key
  assert str(f1.report).replace("1x8", "2x8") == str(f2.report)
  assert rel_err(f1.apply_fn(f1.params, x), m.apply(p, x)) < 1e-12


def test_the_analyzer_is_released_on_leaving_its_context():
  # Valid inside the ``with`` only: afterwards every level memo is gone and a use fails
  # loudly (never silently with empty facts); the program's cycles are broken.
  x = jnp.ones((2, 4))
  p = M().init(jax.random.PRNGKey(0), x)
  traced = pipeline.trace(M().apply, p, (x,))
  with pipeline.analyzer(traced) as an:
    top = an.top
    v = top.program.invars[0]
    assert top.program.nodes and top.facts(v) is not None
  assert an.levels is None and an.top is None and top.program.nodes is None
  with pytest.raises((AttributeError, TypeError)):
    an.level(top.program)
  with pytest.raises((AttributeError, TypeError)):
    top.facts(v)
