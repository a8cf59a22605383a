"""jaxfold.fuse_affine: γ/β of folded norms moved into the contractions that read them.

Float64, random non-uniform γ, β and biases; fused and original must agree at
two input shapes. Sites whose output has another reader are refused, by name.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import rel_err
from zoo_fused import ZOO, ZOO_TOL, errors, fused, randomize_np

import jaxfold

D = 16


def _fuse(module, *xs, other=(), **kw):
  p = randomize_np(jax.eval_shape(module.init, jax.random.PRNGKey(0), *xs))
  fu = jaxfold.fuse_affine(jaxfold.fold(p, module.apply, *xs, **kw))
  for ys in [xs] + list(other):
    assert rel_err(module.apply(p, *ys), fu.apply_fn(fu.params, *ys)) < 1e-9
  return p, fu


def _x(*shape, seed=1):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float64)


class PreLN(nn.Module):
  bias: bool = True

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    h = h + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm(use_bias=self.bias)(h))))
    return nn.Dense(5)(nn.LayerNorm(use_bias=self.bias)(h))


@pytest.mark.parametrize("bias", [True, False])
def test_pre_ln_fuses_every_norm(x64, bias):
  p, fu = _fuse(PreLN(bias), _x(3, 7, 4), other=[(_x(2, 5, 4, seed=2),)])
  assert fu.report.num_fused == 2
  removed = [x for x in jax.tree_util.tree_leaves(fu.params.base, is_leaf=lambda x: x is None)
             if x is None]
  assert len(removed) == (4 if bias else 2)          # γ (and β) of both norms
  assert bool(fu.params.extras) == bias               # β·W biases only when there is a β


def test_bias_is_what_makes_it_exact(x64):
  x = _x(3, 7, 4)
  p, fu = _fuse(PreLN(), x)
  zeroed = fu.params._replace(extras={k: 0 * v for k, v in fu.params.extras.items()})
  assert rel_err(PreLN().apply(p, x), fu.apply_fn(zeroed, x)) > 1e-3


class Tied(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(D)
    h = nn.Dense(D)(x)
    return dense(nn.LayerNorm()(h)) + dense(x)         # one kernel, two readers


def test_weight_with_another_use_gets_an_untied_copy(x64):
  p, fu = _fuse(Tied(), _x(3, D))
  assert fu.report.num_fused == 1 and fu.report.extra_bytes > 0
  assert any("@fused" in k for k in fu.params.extras)


class PostLN(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(nn.Dense(D)(x))
    return nn.LayerNorm()(h + nn.Dense(D)(h))          # the residual reads the norm output


class Gelu(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.gelu(nn.LayerNorm()(nn.Dense(D)(x))))


class OtherAxis(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.LayerNorm()(nn.Dense(D)(x))                 # normalized over features
    w = self.param("w", nn.initializers.normal(), (x.shape[1], 3))
    return jnp.einsum("bsd,sk->bdk", y, w)             # contracted over the sequence


class GammaElsewhere(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    g = self.param("g", nn.initializers.ones, (D,))
    n = h * jax.lax.rsqrt(jnp.mean(jnp.square(h - h.mean(-1, keepdims=True)), -1, keepdims=True)
                          + 1e-6)
    return nn.Dense(3)(n * g) + g[:3]                  # γ also reaches the output directly


@pytest.mark.parametrize("module, shape, why", [
    (PostLN(), (3, 4), "`add` reads it"),
    (Gelu(), (3, 4), "not a contraction"),
    (OtherAxis(), (2, 5, 4), "not contract exactly the normalized dim"),
])
def test_refused_with_reason(x64, module, shape, why):
  _, fu = _fuse(module, _x(*shape))
  kept = [s for s in fu.report.sites if not s.fused]
  assert kept and all("not fused" in s.reason for s in kept)
  assert any(why in s.reason for s in kept), [s.reason for s in kept]


def test_gamma_with_another_use_is_not_fused(x64):
  _, fu = _fuse(GammaElsewhere(), _x(3, 4))
  assert fu.report.num_fused == 0


def test_takes_only_fused_params(x64):
  x = _x(3, 7, 4)
  p, fu = _fuse(PreLN(), x)
  with pytest.raises(jaxfold.FuseError, match="FusedParams"):
    fu.apply_fn(p, x)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_fused_equals_original(x64, name):
  folded, fu = fused(name)
  assert fu.report.num_fused == folded.report.num_folded == len(fu.report.sites)
  assert max(errors(name, fu)) < ZOO_TOL


def test_post_ln_bert_refused(x64):
  from zoo_fused import inputs, original
  apply, p = original("bert-tiny")
  folded = jaxfold.fold(p, apply, *inputs("bert-tiny", 2, 8))
  fu = jaxfold.fuse_affine(folded)
  assert fu.report.num_fused == 0 and len(fu.report.sites) == 5
  assert all("not fused" in s.reason for s in fu.report.sites)
  assert max(errors("bert-tiny", fu)) < ZOO_TOL


def test_fold_flag_is_the_composition(x64):
  x = _x(3, 7, 4)
  p = randomize_np(jax.eval_shape(PreLN().init, jax.random.PRNGKey(0), x))
  fu = jaxfold.fold(p, PreLN().apply, x, fuse_affine=True)
  assert isinstance(fu, jaxfold.Fused) and fu.report.num_fused == 2
  assert rel_err(PreLN().apply(p, x), fu.apply_fn(fu.params, x)) < 1e-9


class Readers(nn.Module):
  """DenseGeneral (kernel reshaped at use) and an einsum whose output is transposed."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    y = nn.LayerNorm()(h)
    q = nn.DenseGeneral((4, D // 4))(y)
    w = self.param("w", nn.initializers.normal(), (D, 5))
    e = jnp.einsum("bsd,dk->bks", y, w)
    h = h + nn.DenseGeneral(D, axis=(-2, -1))(q)
    return nn.Dense(3)(nn.LayerNorm()(h)), e


def test_dense_general_and_einsum_readers(x64):
  x = _x(2, 5, 3)
  _, fu = _fuse(Readers(), x, other=[(_x(3, 4, 3, seed=2),)])
  assert fu.report.num_fused == 2
  assert len(fu.report.sites[0].readers) == 2
