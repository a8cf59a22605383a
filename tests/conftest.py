"""Fixtures; the shared helpers live in ``helpers.py`` (re-exported here for
modules that import them from conftest)."""

import jax
import pytest
from helpers import randomize, rel_err, x64_context  # noqa: F401


@pytest.fixture
def x64():
  """Float64 for algebraic exactness checks, restored afterwards."""
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", prev)
