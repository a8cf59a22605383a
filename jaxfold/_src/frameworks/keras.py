"""Keras 3 (JAX backend): a model as ``(params, apply_fn)`` for fold, cbwc and export.

A Keras model holds its state in ``keras.Variable`` objects; ``Layer.stateless_call``
runs it on explicit values instead, which is the ``apply_fn(params, *args)`` shape
jaxfold analyses. Nothing here looks at layer classes or names: the analysis sees the
jaxpr of the stateless call, like any other function. keras is imported lazily (only a
caller that already has a Keras model reaches it), so jaxfold imports without keras.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple

import jax

from jaxfold._src.fold import Folded, FoldError
from jaxfold._src.step import Params


class KerasParams(NamedTuple):
  """``keras_params``' result: ``apply_fn(params, *args, **kwargs)`` is ``model(*args, **kwargs)``."""
  params: dict
  apply_fn: Callable


def _keras():
  keras = sys.modules.get("keras")
  if keras is None:
    try:
      import keras  # noqa: PLC0415 - optional dependency, imported on demand
    except ImportError as e:
      raise FoldError("jaxfold.keras_params needs keras 3 (pip install keras) with the JAX backend") from e
  backend = keras.backend.backend()
  if backend != "jax":
    raise FoldError(f"keras runs on the {backend!r} backend; jaxfold analyses JAX programs: set "
                    "KERAS_BACKEND=jax before keras is first imported (or keras.config.set_backend('jax') "
                    "and re-import)")
  return keras


def _variables(model: Any) -> tuple[list, list]:
  keras = _keras()
  if not isinstance(model, keras.Layer):
    raise FoldError(f"expected a keras.Model or keras.Layer, got {type(model).__name__}")
  if not model.built:
    raise FoldError(f"{type(model).__name__} is not built: its variables do not exist yet. Call it once on "
                    "example inputs (or model.build(input_shape)) first.")
  return list(model.trainable_variables), list(model.non_trainable_variables)


def _keys(variables: list) -> list[tuple[str, ...]]:
  """Nested-dict keys from the variables' paths (``block_0/attn/query/kernel``), so the
  report names sites after their layers; flat, numbered keys when paths collide (a path
  that is another's prefix, or the same variable path twice)."""
  keys = [tuple(str(v.path).split("/")) for v in variables]
  full = set(keys)
  prefixes = {k[:i] for k in keys for i in range(1, len(k))}
  if len(full) == len(keys) and not (full & prefixes):
    return keys
  return [(f"{i:04d}:{v.path}",) for i, v in enumerate(variables)]


def _nest(keys: list, values: list) -> dict:
  out: dict = {}
  for key, value in zip(keys, values):
    node = out
    for k in key[:-1]:
      node = node.setdefault(k, {})
    node[key[-1]] = value
  return out


def _get(tree: dict, key: tuple) -> Any:
  for k in key:
    if not isinstance(tree, dict) or k not in tree:
      raise FoldError(f"params has no entry {'/'.join(key)!r}: pass the pytree keras_params returned "
                      "(or one with its structure)")
    tree = tree[k]
  return tree


def keras_params(model: Any) -> KerasParams:
  """A built Keras 3 model (JAX backend) as ``(params, apply_fn)`` for ``jaxfold.fold``/``cbwc``.

  ``params`` is a nested dict of the values of all the model's variables, trainable and
  not (normalization statistics, RNG seed states), keyed by the variables' paths.
  ``apply_fn(params, *args, **kwargs)`` runs ``model.stateless_call`` with those values
  and returns only the outputs (``training=False`` unless passed): the model and its
  variables are never touched. Fold it like any function of a pytree; the folded
  ``apply_fn`` runs the folded program, and :func:`keras_assign` writes parameters back.

  Example:
    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    'jax'
    >>> import keras, numpy as np, jaxfold
    >>> model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32),
    ...                           keras.layers.LayerNormalization(), keras.layers.Dense(4)])
    >>> params, apply_fn = jaxfold.keras_params(model)
    >>> x = np.ones((2, 16), np.float32)
    >>> bool(np.allclose(apply_fn(params, x), model(x), atol=1e-6))
    True
    >>> folded = jaxfold.fold(params, apply_fn, x)
    >>> bool(np.allclose(folded.apply_fn(folded.params, x), model(x), atol=1e-5))
    True
  """
  trainable, non_trainable = _variables(model)
  keys = _keys(trainable + non_trainable)
  t_keys, n_keys = keys[:len(trainable)], keys[len(trainable):]
  params = _nest(keys, [v.value for v in trainable + non_trainable])

  def apply_fn(params: dict, *args: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("training", False)
    t = [_get(params, k) for k in t_keys]
    n = [_get(params, k) for k in n_keys]
    return model.stateless_call(t, n, *args, **kwargs)[0]

  return KerasParams(params, apply_fn)


def keras_assign(model: Any, params: Any) -> Any:
  """Writes a ``keras_params``-shaped pytree (or a ``Folded``'s centered parameters) into
  ``model``'s variables, in place, and returns the model.

  The centering a fold applies is invisible to the model's LayerNorms, so the Keras
  model computes the same function with the folded parameters; only ``folded.apply_fn``
  runs the cheaper program (RMSNorms, auxiliary centerings, centered copies of tied
  weights, which live in the fold, not in the Keras model). Assign into a clone
  (``keras.models.clone_model`` + ``set_weights``) to keep the original.

  Example:
    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    'jax'
    >>> import keras, numpy as np, jaxfold
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.LayerNormalization()])
    >>> params, apply_fn = jaxfold.keras_params(model)
    >>> x = np.ones((2, 8), np.float32); before = np.asarray(model(x))
    >>> folded = jaxfold.fold(params, apply_fn, x)
    >>> bool(np.allclose(jaxfold.keras_assign(model, folded)(x), before, atol=1e-5))
    True
  """
  if isinstance(params, Folded):
    params = params.params
  if isinstance(params, Params):
    params = params.params
  trainable, non_trainable = _variables(model)
  variables = trainable + non_trainable
  values = [_get(params, k) for k in _keys(variables)]
  for v, x in zip(variables, values):
    if tuple(v.shape) != tuple(x.shape):
      raise FoldError(f"variable {v.path} has shape {tuple(v.shape)}, the value for it {tuple(x.shape)}")
  for v, x in zip(variables, values):
    v.assign(jax.numpy.asarray(x, v.dtype))
  return model
