"""Wav2Vec2's encoder in Flax linen, with Hugging Face ``Wav2Vec2Model`` parameter names.

Parameter paths mirror ``Wav2Vec2Model`` (``feature_extractor.conv_layers.N.{conv,layer_norm}``,
``feature_projection.{layer_norm,projection}``, ``encoder.pos_conv_embed.conv.{weight_g,weight_v,
bias}``, ``encoder.layer_norm``, ``encoder.layers.N.{attention.{q,k,v,out}_proj,layer_norm,
feed_forward.{intermediate_dense,output_dense},final_layer_norm}``).

Two layouts, as in HF:

* ``wav2vec2-base`` (``feat_extract_norm="group"``, post-LN blocks): the first conv is followed
  by a per-channel GroupNorm, which normalizes over *time* (no centering of the conv's output
  channels can make those sums zero); every block norm's input carries the previous norm's
  output γ ⊙ n + β. Neither folds.
* ``wav2vec2-large-lv60`` (``feat_extract_norm="layer"``, "stable layer norm": pre-LN blocks):
  every conv's LayerNorm folds (bias-free convs, centered kernels), the feature projection's
  LayerNorm does not (its input is a GELU of the last one), and the stream
  ``proj(x) + gelu(pos_conv(proj(x)))`` needs one auxiliary centering, after which every
  block norm and the final one fold.

Example:
    >>> import jax
    >>> spec = CONFIGS["wav2vec2-tiny-test"]
    >>> params = spec.init(jax.random.key(0), 1, 8)
    >>> spec.apply_fn()(params, *spec.example_inputs(1, 8)).shape
    (1, 8, 32)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.common import ModelSpec, attention, gelu_exact, split_heads

__all__ = ["Wav2Vec2Config", "Wav2Vec2Model", "audio_inputs", "CONFIGS"]


@dataclasses.dataclass(frozen=True)
class Wav2Vec2Config:
  """Hyper-parameters (names follow HF ``Wav2Vec2Config``)."""

  conv_dim: tuple = (512,) * 7
  conv_kernel: tuple = (10, 3, 3, 3, 3, 2, 2)
  conv_stride: tuple = (5, 2, 2, 2, 2, 2, 2)
  feat_extract_norm: str = "group"          # "group" | "layer"
  do_stable_layer_norm: bool = False        # pre-LN blocks and a final encoder norm
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  num_conv_pos_embeddings: int = 128
  num_conv_pos_embedding_groups: int = 16
  layer_norm_eps: float = 1e-5

  def samples_for(self, frames: int) -> int:
    """Audio samples that give ``frames`` feature frames."""
    n = frames
    for k, s in reversed(list(zip(self.conv_kernel, self.conv_stride))):
      n = (n - 1) * s + k
    return n


_INIT = nn.initializers.normal(0.02)


class ConvLayer(nn.Module):
  config: Wav2Vec2Config
  index: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg, i = self.config, self.index
    ch = cfg.conv_dim[i]
    x = nn.Conv(ch, (cfg.conv_kernel[i],), strides=(cfg.conv_stride[i],), padding="VALID",
                use_bias=False, kernel_init=_INIT, name="conv")(x)
    if cfg.feat_extract_norm == "layer":
      x = nn.LayerNorm(cfg.layer_norm_eps, name="layer_norm")(x)
    elif i == 0:
      # One group per channel: normalizes each channel over time.
      x = nn.GroupNorm(num_groups=ch, epsilon=cfg.layer_norm_eps, name="layer_norm")(x)
    return gelu_exact(x)


class ConvLayers(nn.Module):
  config: Wav2Vec2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i in range(len(self.config.conv_dim)):
      x = ConvLayer(self.config, i, name=str(i))(x)
    return x


class FeatureEncoder(nn.Module):
  config: Wav2Vec2Config

  @nn.compact
  def __call__(self, audio: jax.Array) -> jax.Array:
    return ConvLayers(self.config, name="conv_layers")(audio[..., None])


class FeatureProjection(nn.Module):
  config: Wav2Vec2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.LayerNorm(self.config.layer_norm_eps, name="layer_norm")(x)
    return nn.Dense(self.config.hidden_size, kernel_init=_INIT, name="projection")(x)


class PositionalConv(nn.Module):
  """Grouped conv over time with weight normalization (norm per kernel tap, as HF)."""

  config: Wav2Vec2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    k, g, d = cfg.num_conv_pos_embeddings, cfg.num_conv_pos_embedding_groups, cfg.hidden_size
    v = self.param("weight_v", _INIT, (k, d // g, d))
    gain = self.param("weight_g", nn.initializers.ones, (k, 1, 1))
    bias = self.param("bias", nn.initializers.zeros, (d,))
    kernel = gain * v / jnp.linalg.norm(v, axis=(1, 2), keepdims=True)
    y = jax.lax.conv_general_dilated(x, kernel.astype(x.dtype), (1,), [(k // 2, k // 2)],
                                     dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=g)
    y = y + bias
    if k % 2 == 0:   # an even kernel with padding k/2 makes one frame too many
      y = y[:, :-1]
    return gelu_exact(y)


class Wav2Vec2Attention(nn.Module):
  config: Wav2Vec2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    d, heads = self.config.hidden_size, self.config.num_attention_heads
    q, k, v = (split_heads(nn.Dense(d, kernel_init=_INIT, name=n)(x), heads)
               for n in ("q_proj", "k_proj", "v_proj"))
    return nn.Dense(d, kernel_init=_INIT, name="out_proj")(attention(q, k, v, None).reshape(x.shape))


class FeedForward(nn.Module):
  config: Wav2Vec2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = gelu_exact(nn.Dense(self.config.intermediate_size, kernel_init=_INIT, name="intermediate_dense")(x))
    return nn.Dense(self.config.hidden_size, kernel_init=_INIT, name="output_dense")(h)


class EncoderLayer(nn.Module):
  config: Wav2Vec2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    ln = lambda name: nn.LayerNorm(cfg.layer_norm_eps, name=name)
    attn, ff = Wav2Vec2Attention(cfg, name="attention"), FeedForward(cfg, name="feed_forward")
    if cfg.do_stable_layer_norm:
      x = x + attn(ln("layer_norm")(x))
      return x + ff(ln("final_layer_norm")(x))
    x = ln("layer_norm")(x + attn(x))
    return ln("final_layer_norm")(x + ff(x))


class EncoderLayers(nn.Module):
  config: Wav2Vec2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i in range(self.config.num_hidden_layers):
      x = EncoderLayer(self.config, name=str(i))(x)
    return x


class Encoder(nn.Module):
  config: Wav2Vec2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    x = x + PositionalConv(cfg, name="pos_conv_embed")(x)
    norm = nn.LayerNorm(cfg.layer_norm_eps, name="layer_norm")
    if not cfg.do_stable_layer_norm:
      x = norm(x)
    x = EncoderLayers(cfg, name="layers")(x)
    return norm(x) if cfg.do_stable_layer_norm else x


class Wav2Vec2Model(nn.Module):
  """Raw audio (B, samples) -> hidden states (B, frames, hidden)."""

  config: Wav2Vec2Config

  @nn.compact
  def __call__(self, audio: jax.Array) -> jax.Array:
    x = FeatureEncoder(self.config, name="feature_extractor")(audio)
    x = FeatureProjection(self.config, name="feature_projection")(x)
    return Encoder(self.config, name="encoder")(x)


def audio_inputs(config: Wav2Vec2Config, batch: int = 1, seq: int = 8, *, abstract: bool = False,
                 seed: int = 0) -> tuple:
  """``(audio,)``: (batch, samples) with as many samples as ``seq`` feature frames need.

  Example:
      >>> (x,) = audio_inputs(Wav2Vec2Config(), 1, 49)
      >>> x.shape
      (1, 15995)
  """
  shape = (batch, config.samples_for(seq))
  if abstract:
    return (jax.ShapeDtypeStruct(shape, jnp.float32),)
  return (jax.random.normal(jax.random.key(seed), shape, jnp.float32),)


def _spec(name: str, **kw: Any) -> ModelSpec:
  return ModelSpec(name=name, family="wav2vec2", config=Wav2Vec2Config(**kw), build=Wav2Vec2Model,
                   inputs=audio_inputs)


_TINY = dict(conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), hidden_size=32,
             num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4)

CONFIGS: dict[str, ModelSpec] = {
    "wav2vec2-base": _spec("wav2vec2-base"),
    "wav2vec2-large-lv60": _spec("wav2vec2-large-lv60", feat_extract_norm="layer", do_stable_layer_norm=True,
                                 hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                 intermediate_size=4096),
    "wav2vec2-tiny-test": _spec("wav2vec2-tiny-test", **_TINY),
    "wav2vec2-stable-tiny-test": _spec("wav2vec2-stable-tiny-test", feat_extract_norm="layer",
                                       do_stable_layer_norm=True, **_TINY),
}
