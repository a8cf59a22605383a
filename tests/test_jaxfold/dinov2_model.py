"""A Dinov2-style ViT in Flax linen, written after Hugging Face's ``FlaxDinov2Model``
(transformers v4; v5 has no Flax models), for jaxfold's resolution tests.

What matters for folding is kept as HF writes it: a patch convolution, a CLS token
prepended along the sequence, a learned position table of the pretraining grid that is
read directly when the patch grid is the table's and square, and otherwise interpolated
exactly like HF's ``interpolate_pos_encoding`` (CLS position kept apart, the patch table
reshaped to its square grid, ``jax.image.scale_and_translate`` bicubic without
antialiasing at scale ``(h + 0.1) / √N``), pre-LN blocks with layer scale, a final
LayerNorm. Two differences: by default the interpolation runs in the table's dtype (HF
casts to float32 and back, a no-op for float32 models; ``interpolate_in_float32=True``
does as HF does), and the resized table is reshaped to batch 1, not the input's batch
(HF's ``reshape((batch, -1, dim))`` fails for a batch > 1 at another resolution).

Example:
    >>> import jax, jax.numpy as jnp
    >>> cfg = Dinov2Config()
    >>> m = Dinov2Model(cfg)
    >>> x = jnp.zeros((1, 3, 32, 32))
    >>> p = m.init(jax.random.key(0), x)
    >>> m.apply(p, jnp.zeros((1, 3, 24, 24))).shape
    (1, 10, 32)
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Dinov2Config:
  image_size: int = 32
  patch_size: int = 8
  num_channels: int = 3
  hidden_size: int = 32
  num_hidden_layers: int = 2
  num_attention_heads: int = 4
  mlp_ratio: int = 2
  layer_norm_eps: float = 1e-6
  layerscale_value: float = 1.0
  interpolate_in_float32: bool = False   # HF's cast (a rounding in a float64 model)

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2


def interpolate_pos_encoding(config: Dinov2Config, num_patches: int, height: int, width: int,
                             position_embeddings: jax.Array) -> jax.Array:
  """HF ``FlaxDinov2Embeddings.interpolate_pos_encoding`` (see the module docstring)."""
  num_positions = position_embeddings.shape[1] - 1
  if num_patches == num_positions and height == width:
    return position_embeddings
  class_pos_embed = position_embeddings[:, 0]
  patch_pos_embed = position_embeddings[:, 1:]
  dim = position_embeddings.shape[-1]
  h, w = height // config.patch_size, width // config.patch_size
  height, width = h + 0.1, w + 0.1
  side = int(math.sqrt(num_positions))
  patch_pos_embed = jnp.transpose(patch_pos_embed.reshape((1, side, side, dim)), (0, 3, 1, 2))
  target_dtype = patch_pos_embed.dtype
  if config.interpolate_in_float32:
    patch_pos_embed = patch_pos_embed.astype(jnp.float32)
  scale = jnp.array([height / math.sqrt(num_positions), width / math.sqrt(num_positions)], dtype=jnp.float32)
  patch_pos_embed = jax.image.scale_and_translate(
      patch_pos_embed, shape=(1, dim, h, w), spatial_dims=(2, 3), scale=scale,
      translation=jnp.array([0.0, 0.0], dtype=jnp.float32), method="bicubic", antialias=False)
  patch_pos_embed = jnp.transpose(patch_pos_embed.astype(target_dtype), (0, 2, 3, 1)).reshape((1, -1, dim))
  return jnp.concatenate((class_pos_embed[jnp.newaxis, :], patch_pos_embed), axis=1)


class Dinov2Embeddings(nn.Module):
  config: Dinov2Config

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    cfg = self.config
    init = nn.initializers.truncated_normal(0.02)
    cls = self.param("cls_token", init, (1, 1, cfg.hidden_size))
    pos = self.param("position_embeddings", init, (1, cfg.num_patches + 1, cfg.hidden_size))
    p = cfg.patch_size
    x = nn.Conv(cfg.hidden_size, (p, p), strides=(p, p), padding="VALID", name="projection")(pixels)
    b = x.shape[0]
    x = x.reshape(b, -1, cfg.hidden_size)
    x = jnp.concatenate((jnp.broadcast_to(cls, (b, 1, cfg.hidden_size)), x), axis=1)
    return x + interpolate_pos_encoding(cfg, x.shape[1] - 1, pixels.shape[1], pixels.shape[2], pos)


class Dinov2LayerScale(nn.Module):
  config: Dinov2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    lam = self.param("lambda1", nn.initializers.ones, (self.config.hidden_size,))
    return self.config.layerscale_value * lam * self.config.layerscale_value * x


class Dinov2Layer(nn.Module):
  """``x + ls1(attn(norm1(x)))``, then ``x + ls2(mlp(norm2(x)))``."""

  config: Dinov2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    d, heads = cfg.hidden_size, cfg.num_attention_heads
    y = nn.LayerNorm(cfg.layer_norm_eps, name="norm1")(x)
    split = lambda t: t.reshape(t.shape[:2] + (heads, d // heads))
    q, k, v = (split(nn.Dense(d, name=n)(y)) for n in ("query", "key", "value"))
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(x.shape)
    x = Dinov2LayerScale(cfg, name="layer_scale1")(nn.Dense(d, name="output")(o)) + x
    y = nn.LayerNorm(cfg.layer_norm_eps, name="norm2")(x)
    y = nn.Dense(d, name="fc2")(nn.gelu(nn.Dense(d * cfg.mlp_ratio, name="fc1")(y), approximate=False))
    return Dinov2LayerScale(cfg, name="layer_scale2")(y) + x


class Dinov2Model(nn.Module):
  """Pixels NCHW (as HF's wrapper takes them) -> the final LayerNorm's sequence output."""

  config: Dinov2Config

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    x = Dinov2Embeddings(self.config, name="embeddings")(jnp.transpose(pixels, (0, 2, 3, 1)))
    for i in range(self.config.num_hidden_layers):
      x = Dinov2Layer(self.config, name=f"layer_{i}")(x)
    return nn.LayerNorm(self.config.layer_norm_eps, name="layernorm")(x)
