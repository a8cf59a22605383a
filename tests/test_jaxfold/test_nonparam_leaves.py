"""Leaves that are not parameters — typed PRNG keys, integer counters, nnx
``RngState``/``RngCount``, booleans — pass through fold, cbwc, save and export
untouched (issue 19, item 5).

Every model has random γ, β and biases and is checked in float64 at two input
shapes; the non-float leaves must come out bit-identical with their dtype.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import randomize, rel_err
from flax import nnx

import jaxfold
from jaxfold.exporting import load_exported
from jaxfold.optax_transforms import decay_centered_weights
from jaxfold.serialization import load_fold, save_fold

F64 = jnp.float64
D = 8


def _is_float(x) -> bool:
  return bool(jnp.issubdtype(x.dtype, jnp.floating))


def _bits(x) -> np.ndarray:
  """The stored bits of a leaf (a typed key through its key data)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(x))
  return np.asarray(x)


def _snapshot(tree) -> list:
  return [(str(x.dtype), _bits(x).copy()) for x in jax.tree_util.tree_leaves(tree)]


def assert_same_nonfloat(a, b):
  """Every non-float leaf of ``a`` is in ``b`` at the same path, same bits and dtype."""
  by_path = {jax.tree_util.keystr(k): y for k, y in jax.tree_util.tree_flatten_with_path(b)[0]}
  n = 0
  for k, x in jax.tree_util.tree_flatten_with_path(a)[0]:
    if not _is_float(x):
      n += 1
      y = by_path[jax.tree_util.keystr(k)]
      assert x.dtype == y.dtype and x.shape == y.shape
      np.testing.assert_array_equal(_bits(x), _bits(y))
  assert n >= 2   # the test trees all hold some


def assert_same_leaves(a, b):
  """The same leaves in the same order (a loaded artifact holds them as a flat list)."""
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(_bits(x), _bits(y))


def float_grad(fn, tree):
  """``grad fn`` with respect to the float leaves of ``tree`` only."""
  leaves, td = jax.tree_util.tree_flatten(tree)
  idx = [i for i, x in enumerate(leaves) if _is_float(x)]

  def of_floats(fl):
    full = list(leaves)
    for i, v in zip(idx, fl):
      full[i] = v
    return fn(jax.tree_util.tree_unflatten(td, full))

  return jax.grad(of_floats)([leaves[i] for i in idx])


# -- an nnx model whose split state holds RngKey/RngCount ------------------------


class DropNet(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, D, rngs=rngs, param_dtype=F64)
    self.ln1 = nnx.LayerNorm(D, rngs=rngs, param_dtype=F64)
    self.drop = nnx.Dropout(0.3, rngs=rngs)
    self.l2 = nnx.Linear(D, D, rngs=rngs, param_dtype=F64)
    self.ln2 = nnx.LayerNorm(D, rngs=rngs, param_dtype=F64)
    self.l3 = nnx.Linear(D, 3, rngs=rngs, param_dtype=F64)

  def __call__(self, x):
    return self.l3(self.ln2(self.l2(self.drop(self.ln1(self.l1(x))))))


@functools.lru_cache(maxsize=None)   # built once per worker (eager init is slow); never mutated
def _nnx(train: bool):
  model = DropNet(nnx.Rngs(0, dropout=1))
  model.train() if train else model.eval()
  graphdef, state = nnx.split(model)
  # Under jit, as jaxfold sees it: eagerly, merge shares the state's variables and
  # dropout would advance the caller's RngCount.
  apply = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
  return randomize(state), apply


def _xs():
  r = np.random.default_rng(0)
  return r.normal(size=(3, 4)), r.normal(size=(2, 5, 4))


def test_nnx_split_state_holds_keys_and_counts(x64):
  state, _ = _nnx(False)
  dtypes = {str(x.dtype) for x in jax.tree_util.tree_leaves(state)}
  assert "key<fry>" in dtypes and "uint32" in dtypes   # what crashed _param_sig


def test_nnx_dropout_fold(x64):
  state, apply = _nnx(False)
  before = _snapshot(state)
  x, y = _xs()
  f = jaxfold.fold(state, apply, x)
  assert f.report.num_folded == 2
  new = jax.jit(f.apply_fn)
  for z in (x, y):
    assert rel_err(apply(state, z), new(f.params, z)) < 1e-9
  assert isinstance(f.params.params, type(state))
  assert_same_nonfloat(state, f.params.params)
  fused = jaxfold.fold(state, apply, x, fuse_affine=True)
  for z in (x, np.concatenate([x, x])):   # fuse_affine re-plans at another rank (issue 19, item 4)
    assert rel_err(apply(state, z), fused.apply_fn(fused.params, z)) < 1e-9
  assert_same_nonfloat(state, fused.params.params)
  after = _snapshot(state)
  assert [d for d, _ in before] == [d for d, _ in after]
  for (_, a), (_, b) in zip(before, after):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_nnx_dropout_cbwc_values_and_float_grads(x64, train):
  state, apply = _nnx(train)
  before = _snapshot(state)
  x, y = _xs()
  r = jaxfold.cbwc(state, apply, x)
  assert r.report.num_folded >= 1
  other = randomize(state, seed=1)   # CBWC holds for every value of the parameters
  new = jax.jit(r.apply_fn)
  for s in (state, other):
    for z in (x, y):
      assert rel_err(apply(s, z), new(s, z)) < 1e-9
  loss = lambda fn: (lambda s: jnp.sum(jnp.tanh(fn(s, x))))
  assert rel_err(float_grad(loss(apply), other), float_grad(loss(new), other)) < 1e-9
  for (d0, a), (d1, b) in zip(before, _snapshot(state)):
    assert d0 == d1
    np.testing.assert_array_equal(a, b)


def test_nnx_dropout_save_load_and_export(x64, tmp_path):
  state, apply = _nnx(False)
  x, y = _xs()
  f = jaxfold.fold(state, apply, x)
  d = save_fold(f, tmp_path / "fold")
  loaded = load_fold(d, apply, target=f.params)
  assert type(loaded.params.params) is type(f.params.params)
  assert_same_nonfloat(f.params.params, loaded.params.params)
  assert_same_leaves(f.params, loaded.params)
  for z in (x, y):
    np.testing.assert_array_equal(np.asarray(f.apply_fn(f.params, z)),
                                  np.asarray(loaded.apply_fn(loaded.params, z)))
  fn = load_exported(jaxfold.export(f, x, symbolic=("batch",)))
  assert_same_leaves(f.params, fn.params)
  for z in (x, np.concatenate([x, x])):
    assert rel_err(apply(state, z), fn(z)) < 1e-9


@pytest.mark.parametrize("step", ["fuse", "defer"])
def test_nnx_transformed_save_load_takes_the_structure_from_target(x64, tmp_path, step):
  """A fuse_affine/defer_norms result of an nnx.State (RngKey/RngCount leaves
  included; a rotate result saves alike) saves (it raised 'needs parameters made of dicts'), and
  loads with target= the original state or its ShapeDtypeStructs; without a
  target, or with another structure, a FoldError says what to pass."""
  state, apply = _nnx(False)
  x, y = _xs()
  r = jaxfold.fold(state, apply, x, fuse_affine=True, defer_norms=step == "defer")
  d = save_fold(r, tmp_path / step)
  with pytest.raises(jaxfold.FoldError, match="State.*pass target="):
    load_fold(d, apply)
  with pytest.raises(jaxfold.FoldError, match="does not have the structure.*'l3'"):
    load_fold(d, apply, target={k: v for k, v in state.items() if k != "l3"})
  abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), state)
  for target in (state, abstract):
    loaded = load_fold(d, apply, target=target)
    assert type(loaded.report) is type(r.report)
    assert_same_leaves(r.params, loaded.params)
    for z in (x, y):
      np.testing.assert_array_equal(np.asarray(r.apply_fn(r.params, z)),
                                    np.asarray(loaded.apply_fn(loaded.params, z)))
      assert rel_err(apply(state, z), loaded.apply_fn(loaded.params, z)) < 1e-9


# -- a linen parameter dict with a counter, a flag and a typed key read by the program


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D, param_dtype=F64)(x)
    h = nn.Dense(D, param_dtype=F64)(nn.LayerNorm(param_dtype=F64)(h))
    return nn.Dense(3, param_dtype=F64)(nn.LayerNorm(param_dtype=F64)(h))


@functools.lru_cache(maxsize=None)
def _linen():
  net = Net()
  x, y = _xs()
  params = {
      "net": randomize(net.init(jax.random.PRNGKey(0), x)),
      "count": jnp.array(3, jnp.int32),
      "flag": jnp.array(True),
      "key": jax.random.key(7),
      "ibias": jnp.arange(D, dtype=jnp.int32) % 3,   # an integer producer before a norm
      "w": jnp.asarray(np.random.default_rng(1).normal(size=(4, D))),
      "g": jnp.asarray(np.random.default_rng(2).normal(size=(D,))),
  }

  def apply(p, x):
    h = net.apply(p["net"], x)
    noise = 1e-3 * jax.random.normal(p["key"], h.shape, h.dtype)
    h = jnp.where(p["flag"], h + noise, -h) * p["count"].astype(h.dtype)
    # Centering this norm's producers would have to center the int leaf: never.
    u = x @ p["w"] + p["ibias"].astype(x.dtype)
    u = u - u.mean(-1, keepdims=True)
    u = u * jax.lax.rsqrt((u * u).mean(-1, keepdims=True) + 1e-6) * p["g"]
    return h + u[..., :3]

  return params, jax.jit(apply)


def test_linen_nonfloat_leaves_fold(x64):
  params, apply = _linen()
  before = _snapshot(params)
  x, y = _xs()
  f = jaxfold.fold(params, apply, x)
  # The norm whose producers include the int leaf is refused, never centered through it.
  assert [s.folded for s in f.report.sites] == [True, True, False]
  assert "cast" in f.report.sites[2].reason
  new = jax.jit(f.apply_fn)
  for z in (x, y):
    assert rel_err(apply(params, z), new(f.params, z)) < 1e-9
  assert_same_nonfloat(params, f.params.params)
  for (d0, a), (d1, b) in zip(before, _snapshot(params)):
    assert d0 == d1
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_linen_nonfloat_leaves_cbwc(x64):
  params, apply = _linen()
  before = _snapshot(params)
  x, y = _xs()
  r = jaxfold.cbwc(params, apply, x)
  leaves = jax.tree_util.tree_leaves(params)
  assert r.leaf_specs and all(_is_float(leaves[i]) for i, _ in r.leaf_specs)
  other = randomize(params, seed=2)   # CBWC holds for every value of the parameters
  new = jax.jit(r.apply_fn)
  for z in (x, y):
    assert rel_err(apply(other, z), new(other, z)) < 1e-9
  loss = lambda fn: (lambda p: jnp.sum(jnp.sin(fn(p, y))))
  assert rel_err(float_grad(loss(apply), other), float_grad(loss(new), other)) < 1e-9
  for (d0, a), (d1, b) in zip(before, _snapshot(params)):
    assert d0 == d1
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_linen_nonfloat_leaves_save_load(x64, tmp_path):
  params, apply = _linen()
  x, y = _xs()
  f = jaxfold.fold(params, apply, x)
  loaded = load_fold(save_fold(f, tmp_path / "fold"), apply)
  assert_same_nonfloat(f.params.params, loaded.params.params)
  for z in (x, y):
    np.testing.assert_array_equal(np.asarray(f.apply_fn(f.params, z)),
                                  np.asarray(loaded.apply_fn(loaded.params, z)))


@pytest.mark.parametrize("mode", ["bundled", "argument", "baked"])
def test_linen_nonfloat_leaves_export(x64, mode):
  params, apply = _linen()
  x, _ = _xs()
  f = jaxfold.fold(params, apply, x)
  blob = jaxfold.export(f, x, symbolic=("batch",), params_as_argument=mode == "argument",
                        bundle_params=mode != "baked")
  fn = load_exported(blob)
  if mode == "bundled":
    assert_same_leaves(f.params, fn.params)
  for z in (x, np.concatenate([x, x])):
    got = fn(f.params, z) if mode == "argument" else fn(z)
    assert rel_err(apply(params, z), got) < 1e-9


class DropAfterNorm(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = False):
    h = nn.LayerNorm(param_dtype=F64)(nn.Dense(D, param_dtype=F64)(x))
    return nn.Dense(3, param_dtype=F64)(nn.Dropout(0.3, deterministic=not train)(h))


def test_typed_key_keyword_argument_saves_and_loads(x64, tmp_path):
  """A typed key among the example keyword arguments is recorded in fold.json."""
  m = DropAfterNorm()
  x, y = _xs()
  p = randomize(m.init(jax.random.PRNGKey(0), x))
  kw = {"train": True, "rngs": {"dropout": jax.random.key(3)}}
  f = jaxfold.fold(p, m.apply, x, example_kwargs=kw)
  assert f.report.num_folded == 1
  loaded = load_fold(save_fold(f, tmp_path / "fold"), m.apply)
  for z in (x, y):
    want = m.apply(p, z, **kw)
    assert rel_err(want, f.apply_fn(f.params, z, **kw)) < 1e-9
    np.testing.assert_array_equal(np.asarray(f.apply_fn(f.params, z, **kw)),
                                  np.asarray(loaded.apply_fn(loaded.params, z, **kw)))


def test_decay_centered_weights_leaves_nonfloat_leaves_alone(x64):
  params, apply = _linen()
  x, _ = _xs()
  r = jaxfold.cbwc(params, apply, x)
  zero = jax.tree_util.tree_map(lambda a: jnp.zeros_like(a) if _is_float(a) else a, params)
  opt = decay_centered_weights(0.5, r)
  u, _ = opt.update(zero, opt.init(params), params)
  assert_same_nonfloat(params, u)
  k = params["net"]["params"]["Dense_0"]["kernel"]
  want = 0.5 * (k - k.mean(-1, keepdims=True))   # Dense_0 feeds a LayerNorm: decayed on V
  assert rel_err(want, u["net"]["params"]["Dense_0"]["kernel"]) < 1e-12
