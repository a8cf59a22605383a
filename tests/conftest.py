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
