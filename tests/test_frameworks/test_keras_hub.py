"""keras-hub backbones built from tiny configs fold to their sound counts (keras_models.py
says why each count), with every variable random, compared with the original at two input
shapes: in float32 as Keras runs them (≤ 1e-5 relative), and in float64 with Keras' 32-bit
promotion cap lifted (≤ 1e-9; see keras_checks.keras_float64)."""

import jax
import pytest
from keras_checks import assert_same, cast_inputs, require_keras_jax

require_keras_jax()
pytest.importorskip("keras_hub")

import keras_models as km  # noqa: E402

import jaxfold  # noqa: E402


def _cases(default):
  return [pytest.param(n, marks=() if n in default else pytest.mark.slow) for n in km.BACKBONES]


def _check(name, dtype):
  model, inputs = km.build(name, dtype, seed=len(name))
  assert {str(v.dtype) for v in model.weights} <= {dtype, "uint32", "int32"}
  params, f = jaxfold.keras_params(model)
  folded = jaxfold.fold(params, f, cast_inputs(inputs(2, 5), dtype))
  for batch, seq in ((2, 5), (3, 7)):      # the traced shape and another one
    assert_same(f, params, folded, cast_inputs(inputs(batch, seq), dtype))
  _, _, sites, sound, aux, reason = km.BACKBONES[name]
  r = folded.report
  assert (r.num_sites, r.num_folded, r.num_auxiliary) == (sites, sound, aux), (reason, str(r))


# The seven in the default run (~5 s each on a busy 2-core CPU); the others are slow.
@pytest.mark.parametrize("name", _cases(["gpt2", "opt", "bloom", "bert", "vit", "whisper", "clip"]))
@pytest.mark.slow
def test_backbone_folds_to_its_sound_count_float32(name):
  _check(name, "float32")


@pytest.mark.parametrize("name", _cases(["gpt2", "bloom"]))
def test_backbone_folds_to_its_sound_count_float64(name, keras_float64):
  _check(name, "float64")


def test_assign_folded_params_back_into_the_keras_model(keras_float64):
  """Bloom (an auxiliary centering): the centered variables in the Keras model compute
  the original function; the folded program runs through folded.apply_fn."""
  model, inputs = km.build("bloom", "float64", seed=3)
  params, f = jaxfold.keras_params(model)
  x = cast_inputs(inputs(2, 5), "float64")
  before = jax.jit(f)(params, x)
  folded = jaxfold.fold(params, f, x)
  assert folded.report.num_auxiliary == 1
  jaxfold.keras_assign(model, folded)
  after, f2 = jaxfold.keras_params(model)
  assert any(not bool((a == b).all()) for a, b in zip(jax.tree_util.tree_leaves(params),
                                                       jax.tree_util.tree_leaves(after)))
  y = jax.jit(f2)(after, x)
  assert float(abs(y - before).max() / abs(before).max()) < 1e-9
