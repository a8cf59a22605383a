"""compose.py: ``jaxfold.fold`` is the fold, then ``fuse_affine``/``defer_norms`` on its result when asked."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from helpers import randomize, rel_err

import jaxfold


class PreLN(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    h = h + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(h))))
    return nn.Dense(5)(nn.LayerNorm()(h))


def _setup():
  x = jax.random.normal(jax.random.PRNGKey(1), (3, 7, 4))
  p = jax.tree_util.tree_map(lambda a: a.astype(np.float64), PreLN().init(jax.random.PRNGKey(0), x))
  p = randomize(p, seed=3)
  return p, x


def _leaves(tree):
  return [np.asarray(a) for a in jax.tree_util.tree_leaves(tree)]


def _same_params(a, b):
  la, lb = _leaves(a), _leaves(b)
  return len(la) == len(lb) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("option, then", [
    ({}, lambda f: f),
    ({"fuse_affine": True}, jaxfold.fuse_affine),
    ({"defer_norms": True}, lambda f: jaxfold.defer_norms(jaxfold.fuse_affine(f))),
])
def test_fold_with_options_is_the_chain_of_transforms(x64, option, then):
  p, x = _setup()
  one = jaxfold.fold(p, PreLN().apply, x, **option)
  chain = then(jaxfold.fold(p, PreLN().apply, x))
  assert type(one) is type(chain)
  assert str(one.report) == str(chain.report)
  assert _same_params(one.params, chain.params)
  for shape, seed in [((3, 7, 4), 2), ((1, 1, 4), 3)]:
    xs = jax.random.normal(jax.random.PRNGKey(seed), shape)
    want = PreLN().apply(p, xs)
    assert rel_err(want, one.apply_fn(one.params, xs)) < 1e-9
    assert rel_err(want, chain.apply_fn(chain.params, xs)) < 1e-9


def test_result_types(x64):
  p, x = _setup()
  assert isinstance(jaxfold.fold(p, PreLN().apply, x), jaxfold.Folded)
  fused = jaxfold.fold(p, PreLN().apply, x, defer_norms=True)          # defer implies fuse
  assert isinstance(fused, jaxfold.Fused) and fused.report.num_deferred == 2
