"""CLIP's vision tower in Flax linen, with Hugging Face ``CLIPModel`` parameter names.

Parameter paths mirror ``CLIPModel``'s vision half (``vision_model.embeddings.patch_embedding``,
``class_embedding``, ``position_embedding``, ``pre_layrnorm``,
``encoder.layers.N.{layer_norm1,self_attn.{q,k,v,out}_proj,layer_norm2,mlp.fc1,mlp.fc2}``,
``post_layernorm``, ``visual_projection``).

The residual stream starts at ``pre_layrnorm``'s output γ ⊙ n + β, which is not zero-mean:
``pre_layrnorm`` itself folds (its input ``concat(tile(class_embedding), patch_conv) +
positions`` is made of centerable parameters); every later norm folds after one auxiliary
centering of that output, *unless* the un-normalized stream is returned
(``clip-vit-b/32-hidden`` returns ``last_hidden_state`` as ``FlaxCLIPVisionModel`` does; any
centering of the stream would change it, so only ``pre_layrnorm`` folds there).

Example:
    >>> import jax
    >>> spec = CONFIGS["clip-vit-tiny"]
    >>> params = spec.init(jax.random.key(0))
    >>> spec.apply_fn()(params, *spec.example_inputs(2)).shape
    (2, 16)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.common import attention, split_heads
from models.vit import ImageModelSpec

__all__ = ["CLIPVisionConfig", "CLIPVision", "CONFIGS"]


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
  """Hyper-parameters of CLIP's vision tower (names follow HF ``CLIPVisionConfig``)."""

  image_size: int = 224
  patch_size: int = 32
  num_channels: int = 3
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  projection_dim: int = 512
  layer_norm_eps: float = 1e-5
  output: str = "image_embeds"     # or "hidden": (last_hidden_state, pooled) as FlaxCLIPVisionModel

  @property
  def num_positions(self) -> int:
    return (self.image_size // self.patch_size) ** 2 + 1


_INIT = nn.initializers.normal(0.02)


def quick_gelu(x: jax.Array) -> jax.Array:
  return x * jax.nn.sigmoid(1.702 * x)


class CLIPEmbeddings(nn.Module):
  config: CLIPVisionConfig

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    cfg = self.config
    p = cfg.patch_size
    x = nn.Conv(cfg.hidden_size, (p, p), strides=(p, p), padding="VALID", use_bias=False,
                kernel_init=_INIT, name="patch_embedding")(pixels)
    x = x.reshape(x.shape[0], -1, cfg.hidden_size)
    if x.shape[1] + 1 != cfg.num_positions:
      raise ValueError(f"CLIP expects {cfg.image_size}px images; got {pixels.shape[1:3]}")
    cls = self.param("class_embedding", _INIT, (cfg.hidden_size,))
    x = jnp.concatenate([jnp.tile(cls, (x.shape[0], 1, 1)), x], axis=1)
    pos = nn.Embed(cfg.num_positions, cfg.hidden_size, embedding_init=_INIT, name="position_embedding")
    return x + pos(jnp.arange(cfg.num_positions))[None]


class CLIPAttention(nn.Module):
  config: CLIPVisionConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    d, heads = cfg.hidden_size, cfg.num_attention_heads
    q, k, v = (split_heads(nn.Dense(d, kernel_init=_INIT, name=n)(x), heads)
               for n in ("q_proj", "k_proj", "v_proj"))
    out = attention(q, k, v, None)
    return nn.Dense(d, kernel_init=_INIT, name="out_proj")(out.reshape(x.shape))


class CLIPMLP(nn.Module):
  config: CLIPVisionConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = quick_gelu(nn.Dense(self.config.intermediate_size, kernel_init=_INIT, name="fc1")(x))
    return nn.Dense(self.config.hidden_size, kernel_init=_INIT, name="fc2")(h)


class CLIPEncoderLayer(nn.Module):
  config: CLIPVisionConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    eps = self.config.layer_norm_eps
    x = x + CLIPAttention(self.config, name="self_attn")(nn.LayerNorm(eps, name="layer_norm1")(x))
    return x + CLIPMLP(self.config, name="mlp")(nn.LayerNorm(eps, name="layer_norm2")(x))


class CLIPLayers(nn.Module):
  config: CLIPVisionConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    # Submodules named "0", "1", ... so paths read encoder/layers/N/... as in HF.
    for i in range(self.config.num_hidden_layers):
      x = CLIPEncoderLayer(self.config, name=str(i))(x)
    return x


class CLIPEncoder(nn.Module):
  config: CLIPVisionConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return CLIPLayers(self.config, name="layers")(x)


class CLIPVisionTransformer(nn.Module):
  config: CLIPVisionConfig

  @nn.compact
  def __call__(self, pixels: jax.Array) -> tuple[jax.Array, jax.Array]:
    eps = self.config.layer_norm_eps
    x = CLIPEmbeddings(self.config, name="embeddings")(pixels)
    x = nn.LayerNorm(eps, name="pre_layrnorm")(x)
    x = CLIPEncoder(self.config, name="encoder")(x)
    return x, nn.LayerNorm(eps, name="post_layernorm")(x[:, 0])


class CLIPVision(nn.Module):
  """The vision tower: ``image_embeds`` (as ``CLIPModel.get_image_features``) or, with
  ``output="hidden"``, ``(last_hidden_state, pooled_output)``."""

  config: CLIPVisionConfig

  @nn.compact
  def __call__(self, pixels: jax.Array) -> Any:
    hidden, pooled = CLIPVisionTransformer(self.config, name="vision_model")(pixels)
    if self.config.output == "hidden":
      return hidden, pooled
    return nn.Dense(self.config.projection_dim, use_bias=False, kernel_init=_INIT,
                    name="visual_projection")(pooled)


def _spec(name: str, **kw: Any) -> ImageModelSpec:
  return ImageModelSpec(name=name, family="clip", config=CLIPVisionConfig(**kw), build=CLIPVision)


_TINY = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=64, projection_dim=16)

CONFIGS: dict[str, ImageModelSpec] = {
    "clip-vit-b/32": _spec("clip-vit-b/32"),
    "clip-vit-b/32-hidden": _spec("clip-vit-b/32-hidden", output="hidden"),
    "clip-vit-tiny": _spec("clip-vit-tiny", **_TINY),
    "clip-vit-tiny-hidden": _spec("clip-vit-tiny-hidden", output="hidden", **_TINY),
}
