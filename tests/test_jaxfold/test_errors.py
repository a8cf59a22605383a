"""Bad input gets a clear message that names the problem and the fix."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfold


class M(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.LayerNorm()(nn.Dense(8)(x))


@pytest.fixture
def model():
  m, x = M(), jnp.ones((2, 4))
  return m, m.init(jax.random.PRNGKey(0), x), x


def test_non_traceable_apply_fn(model):
  m, p, x = model

  def bad(params, x):
    if x.sum() > 0:  # Python control flow on a traced value
      return m.apply(params, x)
    return x

  with pytest.raises(jaxfold.FoldError, match="could not trace apply_fn") as e:
    jaxfold.fold(p, bad, x)
  assert "traceable" in str(e.value)


def test_params_that_do_not_match(model):
  m, p, x = model
  wrong = {"params": {"Dense_0": p["params"]["Dense_0"]}}
  with pytest.raises(jaxfold.FoldError, match="params/example_args must be what apply_fn expects"):
    jaxfold.fold(wrong, m.apply, x)


def test_example_args_of_the_wrong_shape(model):
  m, p, _ = model
  with pytest.raises(jaxfold.FoldError, match="could not trace"):
    jaxfold.fold(p, m.apply, jnp.ones((2, 5)))


def test_non_array_leaf_is_named(model):
  m, p, x = model
  bad = {"params": dict(p["params"], note="hello")}
  with pytest.raises(jaxfold.FoldError, match=r"\['params'\]\['note'\].*not an array"):
    jaxfold.fold(bad, m.apply, x)


def test_empty_params():
  with pytest.raises(jaxfold.FoldError, match="no array leaves"):
    jaxfold.fold({}, lambda p, x: x, jnp.ones(3))


def test_integer_leaves_and_none_are_accepted_but_never_centered():
  def apply(p, x):
    h = x @ p["w"] + p["step"].astype(x.dtype) * 0
    return (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)

  p = {"w": jnp.ones((4, 8)) + jnp.arange(32.).reshape(4, 8), "step": jnp.array(3), "unused": None}
  f = jaxfold.fold(p, apply, jnp.ones((2, 4)))
  assert f.params.params["step"].dtype == jnp.int32 and f.params.params["unused"] is None
  np.testing.assert_allclose(f.apply_fn(f.params, jnp.ones((2, 4))), apply(p, jnp.ones((2, 4))), atol=1e-5)


def test_not_callable(model):
  _, p, x = model
  with pytest.raises(jaxfold.FoldError, match="callable"):
    jaxfold.fold(p, "not a function", x)


def test_folded_apply_with_original_params_after_untie():
  class Tied(nn.Module):
    @nn.compact
    def __call__(self, ids):
      e = nn.Embed(10, 8)
      return e.attend(nn.LayerNorm()(e(ids)))

  m, ids = Tied(), jnp.arange(6).reshape(2, 3)
  p = m.init(jax.random.PRNGKey(0), ids)
  f = jaxfold.fold(p, m.apply, ids, auxiliary_centering=False)
  assert f.report.untied_bytes > 0
  with pytest.raises(jaxfold.FoldError, match="jaxfold.Params"):
    f.apply_fn(p, ids)


def test_unsupported_construct_is_reported_not_folded():
  """A shift entering a primitive without a rule (an FFT): the site is left
  alone, with the reason naming it."""
  def apply(p, x):
    h = x @ p["w"]
    h = jnp.fft.ifft(jnp.fft.fft(h)).real
    return (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)

  p = {"w": jnp.arange(32.).reshape(4, 8)}
  f = jaxfold.fold(p, apply, jnp.ones((2, 4)))
  assert f.report.num_folded == 0
  assert "`real`" in f.report.sites[0].reason or "`fft`" in f.report.sites[0].reason


def test_fold_under_jit_says_to_call_it_outside(model):
  m, p, x = model
  with pytest.raises(jaxfold.FoldError, match="outside jit"):
    jax.jit(lambda p, x: jaxfold.fold(p, m.apply, x).params)(p, x)
  with pytest.raises(jaxfold.FoldError, match="tracer"):
    jax.grad(lambda p: jnp.sum(jaxfold.fold(p, m.apply, x).params.params["params"]
                               ["Dense_0"]["kernel"]))(p)
  # traced inputs with concrete params, and cbwc under jit, are fine
  f = jax.jit(lambda x: jaxfold.fold(p, m.apply, x).params)(x)
  assert isinstance(f, jaxfold.Params)
  r = jax.jit(lambda p, x: jaxfold.cbwc(p, m.apply, x).apply_fn(p, x))(p, x)
  np.testing.assert_allclose(r, m.apply(p, x), atol=1e-5)
