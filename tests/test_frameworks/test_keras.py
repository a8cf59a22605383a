"""Plain Keras 3 models through jaxfold.keras_params: fold, cbwc and keras_assign, random
variables, two input shapes; errors that say what to do. Needs keras, not keras_hub."""

import jax
import numpy as np
import pytest
from keras_checks import assert_same, require_keras_jax

keras = require_keras_jax()

from keras_util import random_init  # noqa: E402

import jaxfold  # noqa: E402


def _model(dtype, seed=0):
  """Dense → LN → GELU MLP with a residual → LN → head: both LNs foldable (pre-LN-like),
  the head reads the last LN."""
  with random_init(seed):
    x = keras.Input((None, 16), dtype=dtype)
    h = keras.layers.Dense(32, dtype=dtype)(x)
    a = keras.layers.LayerNormalization(epsilon=1e-5, dtype=dtype)(h)
    h = h + keras.layers.Dense(32, dtype=dtype)(keras.layers.Dense(48, activation="gelu", dtype=dtype)(a))
    y = keras.layers.Dense(4, dtype=dtype)(keras.layers.LayerNormalization(dtype=dtype)(h))
    return keras.Model(x, y)


def _x(batch, seq, dtype, seed=0):
  return np.random.default_rng(seed).normal(size=(batch, seq, 16)).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fold_keras_model_exactly(dtype, request):
  if dtype == "float64":
    request.getfixturevalue("keras_float64")
  model = _model(dtype)
  params, f = jaxfold.keras_params(model)
  assert np.allclose(f(params, _x(2, 3, dtype)), model(_x(2, 3, dtype)), rtol=1e-6, atol=1e-6)
  folded = jaxfold.fold(params, f, _x(2, 3, dtype))
  assert (folded.report.num_sites, folded.report.num_folded) == (2, 2), str(folded.report)
  assert "dense" in str(folded.report)           # sites and centerings named after the layers' variables
  for batch, seq in ((2, 3), (5, 7)):
    assert_same(f, params, folded, _x(batch, seq, dtype, seed=batch))


def test_float64_keras_layernorm_runs_in_float32_and_is_refused(x64):
  """Without the test's lifted cap Keras computes LayerNorm in float32 for a float64
  model: the cast breaks the exact zero sum, so nothing folds and the report says why."""
  model = _model("float64")
  params, f = jaxfold.keras_params(model)
  folded = jaxfold.fold(params, f, _x(2, 3, "float64"))
  assert folded.report.num_folded == 0
  assert "float32" in str(folded.report)
  assert "keras.config.set_floatx('float64')" in str(folded.report)   # Keras' cast: Keras' setting
  assert_same(f, params, folded, _x(3, 5, "float64"))


def test_cbwc_keras_model_same_function_for_other_params(keras_float64):
  model = _model("float64")
  params, f = jaxfold.keras_params(model)
  r = jaxfold.cbwc(params, f, _x(2, 3, "float64"))
  assert r.report.num_folded == 2
  other = jax.tree_util.tree_map(lambda a: a * 1.5 - 0.1, params)
  x = _x(4, 6, "float64")
  y, z = jax.jit(lambda p: (f(p, x), r.apply_fn(p, x)))(other)
  assert float(np.max(np.abs(y - z)) / np.max(np.abs(y))) < 1e-9


def test_keras_assign_and_training_kwarg(keras_float64):
  with random_init(1):
    model = keras.Sequential([keras.Input((8,), dtype="float64"), keras.layers.Dense(8, dtype="float64"),
                              keras.layers.Dropout(0.5, dtype="float64"),
                              keras.layers.LayerNormalization(dtype="float64")])
  params, f = jaxfold.keras_params(model)
  x = np.random.default_rng(2).normal(size=(3, 8))
  np.testing.assert_allclose(f(params, x), model(x, training=False), rtol=1e-12)   # inference by default
  folded = jaxfold.fold(params, f, x)
  assert folded.report.num_folded == 1
  before = np.asarray(model(x))
  jaxfold.keras_assign(model, folded)
  np.testing.assert_allclose(model(x), before, rtol=1e-9, atol=1e-12)
  kernel = next(v for v in model.trainable_variables if len(v.shape) == 2)
  np.testing.assert_allclose(np.asarray(kernel.value).mean(axis=1), 0, atol=1e-12)   # centered in place


def test_errors_say_what_to_do():
  with pytest.raises(jaxfold.FoldError, match="keras.Model or keras.Layer"):
    jaxfold.keras_params(object())
  with pytest.raises(jaxfold.FoldError, match="not built"):
    jaxfold.keras_params(keras.layers.Dense(3))
  model = _model("float32")
  params, f = jaxfold.keras_params(model)
  first = next(iter(params))
  del params[first]
  with pytest.raises(jaxfold.FoldError, match=f"no entry '{first}/"):
    f(params, _x(1, 2, "float32"))
