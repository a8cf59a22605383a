"""Small GroupNorm CNN classifiers, in two variants that differ only in the norm's statistics.

* ``cnn-gn``: standard ``nn.GroupNorm`` — statistics over (H, W, C/G) per sample and group.
  NOT foldable by weight centering: centering the conv's output channels per group shifts
  each position by a value constant over C/G but varying over (H, W), and a norm that also
  reduces over H, W does not ignore such a shift (design brief §3, "GroupNorm over spatial
  axes").
* ``cnn-gn-per-position``: the same GroupNorm with ``reduction_axes=(-1,)``, i.e. statistics
  over the C/G in-group channels at each position (the paper's "grouped LayerNorm"). Centering
  the producing conv's kernel and bias within each output group makes the shift constant over
  exactly the reduced axes, so every such norm folds.

Layout: ``conv_N`` (3x3, SAME; stride 2 from the second on) -> ``norm_N`` -> ReLU, then a global
average pool and a Dense ``head``. NHWC input.

Example:
    >>> import jax
    >>> spec = CONFIGS["cnn-gn-per-position"]
    >>> params = spec.init(jax.random.key(0))
    >>> (x,) = spec.example_inputs(2)
    >>> spec.apply_fn()(params, x).shape
    (2, 10)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax

from models.vit import ImageModelSpec

__all__ = ["CNNConfig", "GroupNormCNN", "group_norm", "CONFIGS"]


@dataclasses.dataclass(frozen=True)
class CNNConfig:
  """``widths`` conv channels, each normalized with ``num_groups`` groups."""

  image_size: int = 16
  num_channels: int = 3
  widths: tuple[int, ...] = (16, 32)
  num_groups: int = 4
  per_position: bool = False
  num_labels: int = 10
  eps: float = 1e-5


def group_norm(config: CNNConfig, name: str) -> nn.GroupNorm:
  """flax's own GroupNorm; per-position statistics when ``config.per_position``.

  ``reduction_axes=(-1,)`` keeps only the in-group channel axis in the statistics (flax
  reshapes channels to (G, C/G) and reduces the last axis), so the spatial axes are no
  longer reduced.

  Example:
      >>> group_norm(CNNConfig(per_position=True), "norm_0").reduction_axes
      (-1,)
  """
  axes = (-1,) if config.per_position else None
  return nn.GroupNorm(num_groups=config.num_groups, epsilon=config.eps, reduction_axes=axes, name=name)


class GroupNormCNN(nn.Module):
  """(B, H, W, C) images -> (B, num_labels) logits."""

  config: CNNConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i, width in enumerate(self.config.widths):
      stride = 1 if i == 0 else 2
      x = nn.Conv(width, (3, 3), strides=(stride, stride), padding="SAME", name=f"conv_{i}")(x)
      x = nn.relu(group_norm(self.config, f"norm_{i}")(x))
    return nn.Dense(self.config.num_labels, name="head")(x.mean(axis=(1, 2)))


def _spec(name: str, **kw: Any) -> ImageModelSpec:
  return ImageModelSpec(name=name, family="cnn", config=CNNConfig(**kw), build=GroupNormCNN)


CONFIGS: dict[str, ImageModelSpec] = {
    "cnn-gn": _spec("cnn-gn"),
    "cnn-gn-per-position": _spec("cnn-gn-per-position", per_position=True),
}
