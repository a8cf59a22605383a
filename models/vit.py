"""Vision Transformer (pre-LN) in Flax linen, with Hugging Face ``ViTModel`` parameter names.

Parameter paths mirror ``ViTForImageClassification`` (``vit.embeddings.patch_embeddings.
projection``, ``vit.encoder.layer.N.attention.attention.query`` ..., ``vit.layernorm``,
``classifier``), so a real checkpoint maps by replacing ``.`` with ``/`` and
``weight``/``bias`` with Flax's ``kernel``/``scale``/``bias`` (transposing Linear and Conv
kernels).

Why every LayerNorm folds: the residual stream starts as patch-conv output + positions, with
the CLS token concatenated along the sequence axis. Every producer added into it (conv,
cls token, position table, attention output dense, MLP output dense) is a parameter or a
linear output centerable along d, and every consumer of the stream is a LayerNorm over d.
So a ViT with L layers has 2L + 1 LayerNorms, all foldable without auxiliary centering.

With ``interpolate_pos_encoding=True`` (HF's ``ViTModel(..., interpolate_pos_encoding=True)``)
other resolutions are accepted: the patch positions are resized bicubically to the patch
grid (PyTorch's kernel, ``jax.image.resize(..., "bicubic-pytorch", antialias=False)``), the
CLS position kept apart. The resize is a linear map along the grid, so a shift constant
along the channels stays one: the same fold serves every resolution.

Example:
    >>> import jax
    >>> spec = CONFIGS["vit-tiny"]
    >>> params = spec.init(jax.random.key(0))
    >>> (x,) = spec.example_inputs(2)
    >>> spec.apply_fn()(params, x).shape
    (2, 10)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.common import ModelSpec

__all__ = ["ViTConfig", "ViTForImageClassification", "ImageModelSpec", "image_inputs", "CONFIGS"]


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  """Hyper-parameters of a ViT classifier (names follow HF ``ViTConfig``)."""

  image_size: int = 224
  patch_size: int = 16
  num_channels: int = 3
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  num_labels: int = 1000
  layer_norm_eps: float = 1e-12
  interpolate_pos_encoding: bool = False   # accept other resolutions (bicubic positions)

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2


_INIT = nn.initializers.truncated_normal(0.02)


class ViTPatchEmbeddings(nn.Module):
  """Non-overlapping patches via a Conv with kernel = stride = patch size."""

  config: ViTConfig

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    p = self.config.patch_size
    x = nn.Conv(self.config.hidden_size, (p, p), strides=(p, p), padding="VALID",
                kernel_init=_INIT, name="projection")(pixels)
    return x.reshape(x.shape[0], -1, x.shape[-1])


class ViTEmbeddings(nn.Module):
  """Patch embeddings, CLS token (prepended along the sequence) and learned positions."""

  config: ViTConfig

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    cfg = self.config
    cls = self.param("cls_token", _INIT, (1, 1, cfg.hidden_size))
    pos = self.param("position_embeddings", _INIT, (1, cfg.num_patches + 1, cfg.hidden_size))
    x = ViTPatchEmbeddings(cfg, name="patch_embeddings")(pixels)
    grid = (pixels.shape[1] // cfg.patch_size, pixels.shape[2] // cfg.patch_size)
    side = cfg.image_size // cfg.patch_size
    if grid != (side, side):
      if not cfg.interpolate_pos_encoding:  # positions are learned per patch
        raise ValueError(f"ViT expects {cfg.image_size}px images; got {pixels.shape[1:3]}")
      patches = jax.image.resize(pos[:, 1:].reshape(1, side, side, -1), (1, *grid, cfg.hidden_size),
                                 "bicubic-pytorch", antialias=False)
      pos = jnp.concatenate([pos[:, :1], patches.reshape(1, -1, cfg.hidden_size)], axis=1)
    cls = jnp.broadcast_to(cls, (x.shape[0], 1, cfg.hidden_size))
    return jnp.concatenate([cls, x], axis=1) + pos


class ViTSelfAttention(nn.Module):
  config: ViTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    heads, d = cfg.num_attention_heads, cfg.hidden_size
    split = lambda t: t.reshape(t.shape[:-1] + (heads, d // heads))
    q, k, v = (split(nn.Dense(d, kernel_init=_INIT, name=n)(x)) for n in ("query", "key", "value"))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // heads).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    return out.reshape(out.shape[:-2] + (d,))


class ViTSelfOutput(nn.Module):
  config: ViTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(self.config.hidden_size, kernel_init=_INIT, name="dense")(x)


class ViTAttention(nn.Module):
  config: ViTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return ViTSelfOutput(self.config, name="output")(ViTSelfAttention(self.config, name="attention")(x))


class ViTIntermediate(nn.Module):
  config: ViTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    # HF ViT uses the exact (erf) GELU.
    return nn.gelu(nn.Dense(self.config.intermediate_size, kernel_init=_INIT, name="dense")(x),
                   approximate=False)


class ViTOutput(nn.Module):
  config: ViTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return nn.Dense(self.config.hidden_size, kernel_init=_INIT, name="dense")(x)


class ViTLayer(nn.Module):
  """Pre-LN block: x + Attn(LN(x)), then x + MLP(LN(x))."""

  config: ViTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    eps = self.config.layer_norm_eps
    x = x + ViTAttention(self.config, name="attention")(nn.LayerNorm(eps, name="layernorm_before")(x))
    h = ViTIntermediate(self.config, name="intermediate")(nn.LayerNorm(eps, name="layernorm_after")(x))
    return x + ViTOutput(self.config, name="output")(h)


class ViTLayerCollection(nn.Module):
  config: ViTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    # Submodules named "0", "1", ... so paths read encoder/layer/N/... as in HF.
    for i in range(self.config.num_hidden_layers):
      x = ViTLayer(self.config, name=str(i))(x)
    return x


class ViTEncoder(nn.Module):
  config: ViTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return ViTLayerCollection(self.config, name="layer")(x)


class ViTModel(nn.Module):
  """Backbone: returns the final-LayerNorm sequence output, shape (B, 1 + patches, d)."""

  config: ViTConfig

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    x = ViTEmbeddings(self.config, name="embeddings")(pixels)
    x = ViTEncoder(self.config, name="encoder")(x)
    return nn.LayerNorm(self.config.layer_norm_eps, name="layernorm")(x)


class ViTForImageClassification(nn.Module):
  """ViT backbone + linear classifier on the CLS token. Input NHWC pixels, output logits."""

  config: ViTConfig

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    seq = ViTModel(self.config, name="vit")(pixels)
    return nn.Dense(self.config.num_labels, kernel_init=_INIT, name="classifier")(seq[:, 0])


def image_inputs(config: Any, batch: int = 1, size: int | None = None, *,
                 abstract: bool = False, seed: int = 0) -> tuple[jax.Array | jax.ShapeDtypeStruct]:
  """``(pixels,)``: NHWC float32 images of side ``size`` (None: ``config.image_size``).

  Example:
      >>> (x,) = image_inputs(ViTConfig(image_size=32), 2)
      >>> x.shape
      (2, 32, 32, 3)
  """
  size = config.image_size if size is None else size
  shape = (batch, size, size, config.num_channels)
  if abstract:
    return (jax.ShapeDtypeStruct(shape, jnp.float32),)
  return (jax.random.normal(jax.random.key(seed), shape, jnp.float32),)


@dataclasses.dataclass(frozen=True)
class ImageModelSpec(ModelSpec):
  """A ``ModelSpec`` whose size argument is the image side in pixels.

  ``ModelSpec`` defaults its size argument to a sequence length of 8; for images the
  default is ``None``, meaning ``config.image_size``.

  Example:
      >>> spec = CONFIGS["vit-tiny"]
      >>> params = spec.init(jax.random.key(0), batch=2)          # 32px images
      >>> logits = spec.apply_fn()(params, *spec.example_inputs(2))
  """

  inputs: Callable[..., tuple] = image_inputs

  def example_inputs(self, batch: int = 1, seq: int | None = None, *, abstract: bool = False) -> tuple:
    """``(pixels,)`` with side ``seq`` pixels (None: the configured image size)."""
    return self.inputs(self.config, batch, seq, abstract=abstract)

  def init(self, rng: jax.Array, batch: int = 1, seq: int | None = None) -> Any:
    """Random parameters (the bare 'params' collection)."""
    return super().init(rng, batch, seq)

  def abstract_init(self, batch: int = 1, seq: int | None = None) -> Any:
    """ShapeDtypeStructs of the parameters; allocates nothing (``jax.eval_shape``)."""
    return super().abstract_init(batch, seq)


def _spec(name: str, **kw: Any) -> ImageModelSpec:
  return ImageModelSpec(name=name, family="vit", config=ViTConfig(**kw), build=ViTForImageClassification)


CONFIGS: dict[str, ImageModelSpec] = {
    "vit-b/16": _spec("vit-b/16"),
    "vit-tiny": _spec("vit-tiny", image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64, num_labels=10),
}
