"""A folded apply_fn takes the original's keyword arguments: arrays (PRNG keys)
are traced, static values (``train=True``) re-analyse per value."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import randomize, rel_err

import jaxfold

F64 = jnp.float64


class DropBeforeDense(nn.Module):
  """Dropout feeds a Dense whose output is normalized: foldable in both modes."""
  @nn.compact
  def __call__(self, x, train: bool = False):
    h = nn.relu(nn.Dense(16, param_dtype=F64)(x))
    h = nn.Dropout(0.3, deterministic=not train)(h)
    return nn.LayerNorm(param_dtype=F64)(nn.Dense(8, param_dtype=F64)(h))


class DropBeforeNorm(nn.Module):
  """Dropout between the Dense and the norm: centering is visible in training mode."""
  @nn.compact
  def __call__(self, x, train: bool = False):
    h = nn.Dropout(0.3, deterministic=not train)(nn.Dense(8, param_dtype=F64)(x))
    return nn.LayerNorm(param_dtype=F64)(h)


def _setup(model, seed=0):
  x = jnp.asarray(np.random.default_rng(seed).standard_normal((3, 5)))
  p = randomize(model.init(jax.random.PRNGKey(0), x), seed=seed)
  return x, p


def test_fold_accepts_train_and_rngs(x64):
  m = DropBeforeDense()
  x, p = _setup(m)
  f = jaxfold.fold(p, m.apply, x)
  assert f.report.num_folded == 1
  for key in (jax.random.PRNGKey(3), jax.random.key(4)):
    want = m.apply(p, x, train=True, rngs={"dropout": key})
    got = f.apply_fn(f.params, x, train=True, rngs={"dropout": key})
    assert rel_err(want, got) < 1e-12
    assert rel_err(m.apply(p, x, train=False), f.apply_fn(f.params, x, train=False)) < 1e-12
  # keys are traced: one jitted function serves every key
  step = jax.jit(lambda q, k: f.apply_fn(q, x, train=True, rngs={"dropout": k}))
  for s in (5, 6):
    k = jax.random.PRNGKey(s)
    assert rel_err(m.apply(p, x, train=True, rngs={"dropout": k}), step(f.params, k)) < 1e-12


def test_fold_refuses_training_mode_that_needs_other_params(x64):
  m = DropBeforeNorm()
  x, p = _setup(m)
  f = jaxfold.fold(p, m.apply, x)
  assert f.report.num_folded == 1
  with pytest.raises(jaxfold.FoldError, match="train=True.*cbwc"):
    f.apply_fn(f.params, x, train=True, rngs={"dropout": jax.random.PRNGKey(0)})


def test_cbwc_in_training_mode_matches_gradients(x64):
  m = DropBeforeNorm()
  x, p = _setup(m, 1)
  key = jax.random.PRNGKey(2)
  r = jaxfold.cbwc(p, m.apply, x, example_kwargs={"train": True, "rngs": {"dropout": key}})
  assert r.report.num_folded == 0          # the mask makes the input not zero-mean
  r2 = jaxfold.cbwc(p, m.apply, x, through_dropout=True,
                    example_kwargs={"train": True, "rngs": {"dropout": key}})
  assert r2.report.num_folded == 1 and not r2.report.sites[0].exact

  def loss(fn, q):
    return jnp.sum(fn(q, x, train=True, rngs={"dropout": key}) ** 2)
  assert rel_err(jax.grad(lambda q: loss(m.apply, q))(p), jax.grad(lambda q: loss(r.apply_fn, q))(p)) < 1e-10
  # eval mode re-analyses: the site folds there, exactly
  assert rel_err(m.apply(p, x), r.apply_fn(p, x, train=False)) < 1e-12


def test_unhashable_static_kwarg_is_refused(x64):
  m = DropBeforeDense()
  x, p = _setup(m)
  f = jaxfold.fold(p, lambda q, a, opts=None: m.apply(q, a), x)
  with pytest.raises(jaxfold.FoldError, match="neither an array nor hashable"):
    f.apply_fn(f.params, x, opts=object.__new__(_Unhashable))


class _Unhashable:
  __hash__ = None


def test_save_load_keeps_kwargs_and_options(x64, tmp_path):
  m = DropBeforeDense()
  x, p = _setup(m)
  f = jaxfold.fold(p, m.apply, x, example_kwargs={"train": False}, norm_impl="xla")
  jaxfold.save_fold(f, tmp_path / "f")
  g = jaxfold.load_fold(tmp_path / "f", m.apply)
  assert g.apply_fn.options == f.apply_fn.options
  assert g.apply_fn.example_kwargs == {"train": False}
  assert rel_err(m.apply(p, x), g.apply_fn(g.params, x, train=False)) < 1e-12
