"""jaxfold._src.compiled: a folded apply_fn called outside jit runs as one compiled
program per shape (not one XLA compilation per primitive), with the same results."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfold
from jaxfold._src import compiled

nn = pytest.importorskip("flax.linen")


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.LayerNorm()(nn.Dense(16)(x)))
    return nn.LayerNorm()(nn.Dense(8)(h))


def _block(seed: int, shape: tuple):
  """(rng, model, example input, random non-trivial params: γ, β, biases included)."""
  rng = np.random.default_rng(seed)
  m = Block()
  x = jnp.asarray(rng.standard_normal(shape))
  params = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.standard_normal(a.shape)) * 0.7 + 0.2,
                                  m.init(jax.random.PRNGKey(0), x))
  return rng, m, x, params


def test_eager_call_is_one_program_per_shape_and_exact(x64):
  rng, m, x, params = _block(0, (3, 5, 12))
  folded = jaxfold.fold(params, m.apply, x)
  assert folded.report.num_folded == 2
  before = {id(e[1]): e[1] for e in compiled._CACHE.values()}   # (held: no new function reuses their ids)
  shapes = [(3, 5, 12), (1, 1, 12), (1, 4, 12)]
  for s in shapes:
    xs = jnp.asarray(rng.standard_normal(s))
    np.testing.assert_allclose(folded.apply_fn(folded.params, xs), m.apply(params, xs), rtol=1e-10, atol=1e-10)
  # every call went through one jitted evaluation per analysis, each shape compiled once
  jitted = {id(e[1]): e[1] for e in compiled._CACHE.values() if e[0]() is not None and id(e[1]) not in before}
  assert sum(f._cache_size() for f in jitted.values()) == len(shapes)
  # inside the user's own trace the plan is evaluated inline: the caller's program is the folded one
  top = {e.primitive.name for e in jax.make_jaxpr(folded.apply_fn)(folded.params, x).jaxpr.eqns}
  assert not top & {"pjit", "jit"}, top
  g = jax.jit(jax.grad(lambda p, x: folded.apply_fn(p, x).sum(), argnums=1))(folded.params, x)
  g0 = jax.grad(lambda x: m.apply(params, x).sum())(x)
  np.testing.assert_allclose(g, g0, rtol=1e-9, atol=1e-9)


def test_a_fused_apply_fn_runs_compiled_too(x64):
  rng, m, x, params = _block(1, (2, 3, 12))
  fused = jaxfold.fuse_affine(jaxfold.fold(params, m.apply, x))
  before = {id(e[1]): e[1] for e in compiled._CACHE.values()}   # (held: no new function reuses their ids)
  for s in [(2, 3, 12), (1, 1, 12)]:
    xs = jnp.asarray(rng.standard_normal(s))
    np.testing.assert_allclose(fused.apply_fn(fused.params, xs), jax.jit(m.apply)(params, xs), rtol=1e-12, atol=1e-12)
  made = [e[1] for e in compiled._CACHE.values() if id(e[1]) not in before and e[0]() is not None]
  assert made and sum(f._cache_size() for f in made) == 2   # one compiled program per shape
