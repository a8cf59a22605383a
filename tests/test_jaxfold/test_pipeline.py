"""jaxfold._src.pipeline (the front end fold, fuse_affine and rotate share), the error
hierarchy, the typed fold options and the planner's frozen outcome."""

import concurrent.futures
import dataclasses
import threading
import types
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
  with pytest.raises(FuseError, match="FusedParams") as e:
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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16])
def test_centered_leaves_equal_host_centering_and_keep_dtype_and_sharding(x64, dtype):
  from jaxfold._src import fold as F
  from jaxfold._src import layout
  x = jax.random.normal(jax.random.PRNGKey(0), (48, 24), jnp.float64).astype(dtype) + 3
  y = F._center_leaf(x, ((1, 8),))
  assert isinstance(y, jax.Array) and y.dtype == x.dtype and y.sharding == x.sharding
  np.testing.assert_array_equal(np.asarray(y), layout.center(np.asarray(x), {1: 8}))
  # A leaf off the host (an accelerator's, a sharded one) is centered by jax: every dim of its spec.
  x3 = x.reshape(4, 12, 24)
  spec = {1: 6, 2: 24}
  got = np.asarray(F._center_jit(spec)(x3), np.float64)
  want = np.asarray(layout.center(np.asarray(x3), spec), np.float64)
  np.testing.assert_allclose(got, want, rtol=0, atol=float(jnp.finfo(dtype).eps) * 16)
  assert np.abs(got.reshape(4, 2, 6, 24).mean(axis=(2, 3))).max() < float(jnp.finfo(dtype).eps) * 16
  out = F._aligned_empty((5, 7), dtype)
  assert out.shape == (5, 7) and out.dtype == dtype and out.ctypes.data % 64 == 0
  assert F._aligned_empty((0, 3), dtype).shape == (0, 3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_large_leaves_center_by_row_blocks(x64, dtype, monkeypatch):
  """A large leaf is centered by blocks of rows on the workers (not along a
  centered dim 0), with exactly ``_center_leaf``'s values; inputs untouched."""
  from jaxfold._src import fold as F
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=3)
  monkeypatch.setattr(F, "_POOL", [pool])
  monkeypatch.setattr(F._Centering, "_SPLIT_BYTES", 1 << 20)
  key = jax.random.PRNGKey(2)
  shapes = [(2001, 520), (8, 300, 256), (2048, 300), (1200, 1024)]
  specs = (((1, 520),), ((2, 64),), ((0, 2048),), ((1, 1024),))   # the third centers dim 0: whole
  leaves = [jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32).astype(dtype) * 3 + 1
            for i, s in enumerate(shapes)]
  before = [np.asarray(x).copy() for x in leaves]
  an = types.SimpleNamespace(leaf_specs=tuple(enumerate(specs)), untied=())
  centering = F._Centering(leaves)
  centering.start(an)
  assert [type(centering._futures[(i, s)]) is F._Blocks for i, s in enumerate(specs)] == [True, True, False, True]
  new, _ = centering.result(an)
  pool.shutdown(wait=True)
  for i, spec in enumerate(specs):
    assert new[i].dtype == dtype and new[i].shape == shapes[i]
    np.testing.assert_array_equal(np.asarray(new[i]), np.asarray(F._center_leaf(leaves[i], spec)))
  for x, b in zip(leaves, before):
    np.testing.assert_array_equal(np.asarray(x), b)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_threaded_centering_equals_leaf_by_leaf(x64, dtype, monkeypatch):
  """``_Centering`` (large leaves on worker threads, kept when the final plan
  shares them; small ones inline, abstract ones kept, untied copies) gives
  exactly ``_center_leaf``'s values for the final plan and leaves the inputs
  untouched."""
  from jaxfold._src import fold as F
  key = jax.random.PRNGKey(1)
  shapes = [(600, 512), (24, 16), (512,), (300, 2048)]   # two above the thread threshold
  leaves = [jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32).astype(dtype) + 2
            for i, s in enumerate(shapes)] + [jax.ShapeDtypeStruct((8, 8), dtype)]
  before = [np.asarray(x).copy() for x in leaves[:-1]]
  specs = (((0, 600),), ((1, 4),), ((0, 128),), ((1, 2048),), ((1, 8),))
  an = types.SimpleNamespace(param_key=None, leaf_specs=tuple((i, s) for i, s in enumerate(specs) if i != 2),
                             untied=(("copy", 2, specs[2]), ("big", 3, ((0, 300),))))
  # The dropped job blocks until released: result() returning while it is
  # still queued (then cancelled) or still running shows it was not waited for.
  release, host_center = threading.Event(), F._host_center

  def blocking(x, spec, *rest):
    if spec == {1: 1024}:
      release.wait(timeout=10)
    return host_center(x, spec, *rest)

  monkeypatch.setattr(F, "_host_center", blocking)
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)   # one blocked, one for the plan's jobs
  monkeypatch.setattr(F, "_POOL", [pool])
  centering = F._Centering(leaves)
  first = types.SimpleNamespace(leaf_specs=((0, specs[0]), (3, ((1, 1024),))), untied=())
  centering.start(first)                         # the example's plan, changed at another shape:
  unused = centering._futures[(3, ((1, 1024),))]   # a centering the final plan drops
  try:
    new, untied = centering.result(an)
    assert unused.cancelled() or not unused.done()   # not waited for, not used
  finally:
    release.set()
    pool.shutdown(wait=True)
  assert new[2] is leaves[2] and new[4] is leaves[4]
  for i in (0, 1, 3):
    assert new[i].dtype == dtype
    np.testing.assert_array_equal(np.asarray(new[i]), np.asarray(F._center_leaf(leaves[i], specs[i])))
  np.testing.assert_array_equal(np.asarray(untied["copy"]), np.asarray(F._center_leaf(leaves[2], specs[2])))
  np.testing.assert_array_equal(np.asarray(untied["big"]), np.asarray(F._center_leaf(leaves[3], ((0, 300),))))
  assert np.abs(np.asarray(new[3], np.float64).sum(axis=1)).max() < 1e-2 * 2048
  for x, b in zip(leaves, before):
    np.testing.assert_array_equal(np.asarray(x), b)


class _Stack(nn.Module):
  """Four blocks whose output projections share shape, dtype and axes: one group."""
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(32)(x)
    for _ in range(4):
      h = h + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(h))))
    return nn.Dense(5)(nn.LayerNorm()(h))


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_a_large_group_of_leaves_centers_in_xla_with_the_folds_values(precision, monkeypatch, request):
  """A group of same-shaped leaves of at least ``_XLA_BYTES`` centers in XLA
  (asynchronously): the fold is exact in float64 at two shapes, and in float32 its
  parameters match the NumPy centering's to rounding, dtype and placement kept.
  Under x64 a float32 leaf stays on the host (a float64 mean XLA would not take)."""
  from jaxfold._src import fold as F
  if precision == "float64":
    request.getfixturevalue("x64")
  dtype = jnp.float64 if precision == "float64" else jnp.float32
  m, x = _Stack(), jax.random.normal(jax.random.PRNGKey(3), (3, 7, 24), dtype)
  leaves, tree = jax.tree_util.tree_flatten(m.init(jax.random.PRNGKey(0), x))
  keys = jax.random.split(jax.random.PRNGKey(4), len(leaves))   # random γ, β and biases, not 1 and 0
  p = jax.tree_util.tree_unflatten(tree, [jax.random.normal(k, a.shape, dtype) for k, a in zip(keys, leaves)])
  dispatched, dispatch = [], F._Dispatched
  monkeypatch.setattr(F, "_Dispatched", lambda y: dispatched.append(y) or dispatch(y))
  monkeypatch.setattr(F._Centering, "_PARALLEL_BYTES", 1)
  monkeypatch.setattr(F._Centering, "_XLA_BYTES", 4 * 64 * 32 * np.dtype(dtype).itemsize)   # the 4 (64, 32) kernels
  f = jaxfold.fold(p, m.apply, x)
  assert f.report.num_folded == 5
  assert sorted(y.shape for y in dispatched) == [(64, 32)] * 4
  monkeypatch.setattr(F._Centering, "_XLA_BYTES", 1 << 60)
  g = jaxfold.fold(p, m.apply, x)
  for a, b in zip(jax.tree_util.tree_leaves(f.params), jax.tree_util.tree_leaves(g.params)):
    assert a.dtype == b.dtype and a.sharding == b.sharding and a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=8 * float(jnp.finfo(dtype).eps))
  for shape in [(3, 7, 24), (2, 5, 24), (1, 1, 24)]:
    xs = jax.random.normal(jax.random.PRNGKey(5), shape, dtype)
    assert rel_err(f.apply_fn(f.params, xs), m.apply(p, xs)) < (1e-12 if precision == "float64" else 1e-4)
  if precision == "float64":   # x64 on: float32 leaves keep the host's float64 mean
    dispatched.clear()
    p32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), p)
    monkeypatch.setattr(F._Centering, "_XLA_BYTES", 4 * 64 * 32 * 4)
    jaxfold.fold(p32, m.apply, x.astype(jnp.float32))
    assert dispatched == []


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
