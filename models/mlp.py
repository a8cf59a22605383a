"""LayerNorm MLP classifier for tabular / small-digit data: (Dense -> LayerNorm -> GELU) x N, head.

Every LayerNorm reads exactly one Dense output, and that output has no other consumer, so
centering the Dense kernel and bias along the output axis shifts the LN input by a per-row
constant the LN ignores: every LayerNorm folds, without auxiliary centering.

Example:
    >>> import jax
    >>> spec = CONFIGS["mlp-small"]
    >>> params = spec.init(jax.random.key(0))
    >>> (x,) = spec.example_inputs(4)
    >>> spec.apply_fn()(params, x).shape
    (4, 10)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.common import ModelSpec

__all__ = ["MLPConfig", "LayerNormMLP", "tabular_inputs", "CONFIGS"]


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  """``in_features`` inputs (64 = 8x8 digits), hidden widths, ``num_labels`` classes."""

  in_features: int = 64
  hidden: tuple[int, ...] = (128, 64)
  num_labels: int = 10
  layer_norm_eps: float = 1e-5


class MLPBlock(nn.Module):
  """Dense -> LayerNorm -> GELU."""

  features: int
  eps: float

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.Dense(self.features, name="dense")(x)
    return nn.gelu(nn.LayerNorm(self.eps, name="norm")(h))


class _Blocks(nn.Module):
  config: MLPConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i, width in enumerate(self.config.hidden):
      x = MLPBlock(width, self.config.layer_norm_eps, name=str(i))(x)
    return x


class LayerNormMLP(nn.Module):
  """(batch, in_features) -> (batch, num_labels) logits. Params: blocks/N/{dense,norm}, head."""

  config: MLPConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(self.config.num_labels, name="head")(_Blocks(self.config, name="blocks")(x))


def tabular_inputs(config: MLPConfig, batch: int = 1, seq: Any = None, *, abstract: bool = False,
                   seed: int = 0) -> tuple[jax.Array | jax.ShapeDtypeStruct]:
  """``(x,)`` of shape (batch, in_features). ``seq`` is accepted for ``ModelSpec`` and ignored:
  the feature count is fixed by the config.

  Example:
      >>> tabular_inputs(MLPConfig(), 3)[0].shape
      (3, 64)
  """
  shape = (batch, config.in_features)
  if abstract:
    return (jax.ShapeDtypeStruct(shape, jnp.float32),)
  return (jax.random.normal(jax.random.key(seed), shape, jnp.float32),)


CONFIGS: dict[str, ModelSpec] = {
    "mlp-small": ModelSpec(name="mlp-small", family="mlp", config=MLPConfig(), build=LayerNormMLP,
                           inputs=tabular_inputs),
}
