"""Fixtures; the shared helpers live in ``helpers.py`` (re-exported here for
modules that import them from conftest)."""

import os

# Keras picks its backend at first import (TensorFlow by default): ours is JAX. A keras
# already imported with another backend makes the Keras tests skip with that reason.
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import pytest  # noqa: E402
from helpers import randomize, rel_err, x64_context  # noqa: F401, E402


@pytest.fixture
def x64():
  """Float64 for algebraic exactness checks, restored afterwards."""
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", prev)


@pytest.fixture
def keras_float64(monkeypatch, x64):
  """Float64 end to end. Keras' JAX backend caps type promotion at 32 bits
  (``result_type(float64, float32)`` is float32: ``BIT64_TO_BIT32_DTYPE``), so its
  LayerNorm computes in float32 even for a float64 model, and jaxfold rightly refuses
  to remove a mean whose zero sum a cast to float32 breaks. The tests lift that cap to
  check the folds at float64 exactness; test_keras.py checks the refusal without it."""
  dtypes = pytest.importorskip("keras.src.backend.common.dtypes")
  if not isinstance(getattr(dtypes, "BIT64_TO_BIT32_DTYPE", None), dict):
    pytest.skip("this keras has no BIT64_TO_BIT32_DTYPE table to lift its 32-bit cap")
  monkeypatch.setitem(dtypes.BIT64_TO_BIT32_DTYPE, "float64", "float64")
