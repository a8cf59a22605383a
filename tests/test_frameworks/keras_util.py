"""Keras test utilities that need keras but not keras_hub."""

import contextlib

import jax.numpy as jnp
import numpy as np


@contextlib.contextmanager
def random_init(seed=0, scale=0.5):
  """Every float variable created inside starts at N(0, scale²) + (1 for a 1-D one), drawn
  in NumPy: Keras' own initializers compile one XLA program per shape (~1 s each on a busy
  CPU), and γ=1, β=0, zero biases would hide wrong folds anyway. Other dtypes (RNG seed
  states) keep their initializer. Falls back to Keras' initializers if its internals moved."""
  try:
    from keras.src.backend.jax.core import JaxVariable
    original = JaxVariable._initialize_with_initializer
  except (ImportError, AttributeError):  # pragma: no cover - another keras layout
    yield False
    return
  rng = np.random.default_rng(seed)

  def init(self, initializer):
    dtype = np.dtype(self._dtype) if self._dtype in ("float16", "float32", "float64") else None
    if dtype is None:
      return original(self, initializer)
    value = scale * rng.standard_normal(self._shape) + (1.0 if len(self._shape) == 1 else 0.0)
    self._initialize(jnp.asarray(value.astype(dtype)))

  JaxVariable._initialize_with_initializer = init
  try:
    yield True
  finally:
    JaxVariable._initialize_with_initializer = original
