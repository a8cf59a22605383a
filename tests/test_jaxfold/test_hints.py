"""Hints chosen from what the program and the options are (issue 39): a cast
refusal names Keras' floatx only for Keras code, a rotation stopped by a
stream that starts at an activation does not hint an option the fold used."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfold
from jaxfold._src import hints


def _randomized(p, seed=0):
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(
      lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.5 + (1.0 if a.ndim == 1 else 0.0), jnp.float64), p)


def _x(*shape, seed=1):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape))


class _UserCast(nn.Module):
  """The user's code casts float64 values to float32 before the norm."""
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    return nn.Dense(4)(nn.LayerNorm()(h.astype(jnp.float32)).astype(jnp.float64))


class _FlaxCast(nn.Module):
  """flax's LayerNorm(dtype=float32) casts the float64 values itself."""
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    return nn.Dense(4)(nn.LayerNorm(dtype=jnp.float32)(h).astype(jnp.float64))


@pytest.mark.parametrize("model, says", [(_UserCast(), ""), (_FlaxCast(), "flax: the module's dtype")])
def test_a_flax_cast_refusal_never_hints_keras(model, says, x64):
  p = _randomized(model.init(jax.random.PRNGKey(0), _x(2, 5, 8)))
  f = jaxfold.fold(p, model.apply, _x(2, 5, 8))
  (s,) = f.report.sites
  assert not s.folded and "a cast to float32 does not keep a zero sum" in s.reason, s.reason
  assert "keras" not in s.reason.lower() and "set_floatx" not in s.reason
  assert says in s.reason and "compute in float64 throughout" in s.reason
  for x in (_x(2, 5, 8), _x(1, 1, 8, seed=2)):   # refused, so the same function at every shape
    assert np.allclose(f.apply_fn(f.params, x), model.apply(p, x), rtol=1e-6, atol=1e-6)


def test_cast_hint_names_the_framework_that_cast():
  assert "keras.config.set_floatx('float64')" in hints.cast_hint("keras", "float64", "float32")
  assert "set_floatx" not in hints.cast_hint("flax", "float64", "float32")
  assert "(" not in hints.cast_hint("", "float64", "float32")


class _ActivationStream(nn.Module):
  """A stream that starts at an activation: proj(x) + gelu(pos_conv(proj(x)))."""
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    h = h + jax.nn.gelu(nn.Dense(16, name="pos_conv")(h))
    for _ in range(2):
      h = h + nn.Dense(16)(nn.LayerNorm()(h))
    return nn.Dense(4)(nn.LayerNorm()(h))


def test_rotation_of_an_activation_started_stream_gives_the_real_reason(x64):
  m = _ActivationStream()
  p = _randomized(m.init(jax.random.PRNGKey(0), _x(2, 5, 8)))
  f = jaxfold.fold(p, m.apply, _x(2, 5, 8), tied_weights="copy")
  assert f.report.num_auxiliary == 1 and f.report.num_folded == 3
  for x in (_x(2, 5, 8), _x(1, 1, 8, seed=2)):
    assert np.allclose(f.apply_fn(f.params, x), m.apply(p, x), rtol=1e-10, atol=1e-10)
  q = np.linalg.qr(np.random.default_rng(0).normal(size=(16, 16)))[0]
  with pytest.raises(jaxfold.RotateError) as e:
    jaxfold.rotate(jaxfold.fuse_affine(f), q, insert=False)
  text = str(e.value)
  assert "already used tied_weights=\"copy\"" in text and "no parameter rotation reaches" in text
  assert "fold with tied_weights" not in text and "computes x @ Q there" in text
  # By default the program computes x @ Q on the activation that starts the stream.
  r = jaxfold.rotate(jaxfold.fuse_affine(f), q)
  assert len(r.report.inserted) == 1 and r.report.inserted[0].startswith("x @ Q computed for the output of")
  for x in (_x(2, 5, 8), _x(1, 1, 8, seed=2)):
    np.testing.assert_allclose(r.apply_fn(r.params, x), m.apply(p, x), rtol=1e-10, atol=1e-10)


def test_rotation_hint_offers_copies_only_when_the_fold_did_not_use_them():
  class _R:
    auxiliary = ()
  assert "fold with tied_weights=\"copy\"" in hints.rotation_aux_hint(_R(), ties_copied=False)
  assert "fold with tied_weights" not in hints.rotation_aux_hint(_R(), ties_copied=True)
