"""Whisper's audio encoder in Flax linen, with Hugging Face ``WhisperModel`` parameter names.

Parameter paths mirror ``WhisperModel.encoder`` (``conv1``, ``conv2``, ``embed_positions``,
``layers.N.{self_attn_layer_norm,self_attn.{q,k,v,out}_proj,final_layer_norm,fc1,fc2}``,
``layer_norm``); ``k_proj`` has no bias, as in Whisper.

The residual stream starts at ``gelu(conv2(gelu(conv1(x)))) + embed_positions``: no parameter
centering makes the GELU's output zero-mean, so no norm folds by centering alone; one auxiliary
centering of that sum (one reduction) lets all 2L + 1 norms fold.

Example:
    >>> import jax
    >>> spec = CONFIGS["whisper-tiny-test"]
    >>> params = spec.init(jax.random.key(0), 1, 16)
    >>> spec.apply_fn()(params, *spec.example_inputs(1, 16)).shape
    (1, 8, 32)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.common import ModelSpec, attention, gelu_exact, split_heads

__all__ = ["WhisperEncoderConfig", "WhisperEncoder", "mel_inputs", "CONFIGS"]


@dataclasses.dataclass(frozen=True)
class WhisperEncoderConfig:
  """Hyper-parameters of Whisper's encoder (names follow HF ``WhisperConfig``)."""

  num_mel_bins: int = 80
  d_model: int = 512
  encoder_layers: int = 6
  encoder_attention_heads: int = 8
  encoder_ffn_dim: int = 2048
  max_source_positions: int = 1500


_INIT = nn.initializers.normal(0.02)


class WhisperAttention(nn.Module):
  config: WhisperEncoderConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    d, heads = self.config.d_model, self.config.encoder_attention_heads
    q = split_heads(nn.Dense(d, kernel_init=_INIT, name="q_proj")(x), heads)
    k = split_heads(nn.Dense(d, use_bias=False, kernel_init=_INIT, name="k_proj")(x), heads)
    v = split_heads(nn.Dense(d, kernel_init=_INIT, name="v_proj")(x), heads)
    return nn.Dense(d, kernel_init=_INIT, name="out_proj")(attention(q, k, v, None).reshape(x.shape))


class WhisperEncoderLayer(nn.Module):
  config: WhisperEncoderConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    x = x + WhisperAttention(cfg, name="self_attn")(nn.LayerNorm(1e-5, name="self_attn_layer_norm")(x))
    h = nn.LayerNorm(1e-5, name="final_layer_norm")(x)
    h = gelu_exact(nn.Dense(cfg.encoder_ffn_dim, kernel_init=_INIT, name="fc1")(h))
    return x + nn.Dense(cfg.d_model, kernel_init=_INIT, name="fc2")(h)


class WhisperLayers(nn.Module):
  config: WhisperEncoderConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    # Submodules named "0", "1", ... so paths read layers/N/... as in HF.
    for i in range(self.config.encoder_layers):
      x = WhisperEncoderLayer(self.config, name=str(i))(x)
    return x


class WhisperEncoder(nn.Module):
  """Log-mel features (B, frames, n_mels), channels last -> hidden states (B, frames/2, d)."""

  config: WhisperEncoderConfig

  @nn.compact
  def __call__(self, mels: jax.Array) -> jax.Array:
    cfg = self.config
    x = gelu_exact(nn.Conv(cfg.d_model, (3,), padding=((1, 1),), kernel_init=_INIT, name="conv1")(mels))
    x = gelu_exact(nn.Conv(cfg.d_model, (3,), strides=(2,), padding=((1, 1),), kernel_init=_INIT,
                           name="conv2")(x))
    if x.shape[1] > cfg.max_source_positions:
      raise ValueError(f"at most {2 * cfg.max_source_positions} frames; got {mels.shape[1]}")
    pos = nn.Embed(cfg.max_source_positions, cfg.d_model, embedding_init=_INIT, name="embed_positions")
    x = x + pos(jnp.arange(x.shape[1]))[None]
    x = WhisperLayers(cfg, name="layers")(x)
    return nn.LayerNorm(1e-5, name="layer_norm")(x)


def mel_inputs(config: Any, batch: int = 1, seq: int = 16, *, abstract: bool = False,
               seed: int = 0) -> tuple:
  """``(mels,)`` of shape (batch, seq frames, n_mels).

  Example:
      >>> (x,) = mel_inputs(WhisperEncoderConfig(num_mel_bins=8), 2, 10)
      >>> x.shape
      (2, 10, 8)
  """
  shape = (batch, seq, config.num_mel_bins)
  if abstract:
    return (jax.ShapeDtypeStruct(shape, jnp.float32),)
  return (jax.random.normal(jax.random.key(seed), shape, jnp.float32),)


def _spec(name: str, **kw: Any) -> ModelSpec:
  return ModelSpec(name=name, family="whisper", config=WhisperEncoderConfig(**kw), build=WhisperEncoder,
                   inputs=mel_inputs)


CONFIGS: dict[str, ModelSpec] = {
    "whisper-base-encoder": _spec("whisper-base-encoder"),
    "whisper-tiny-test": _spec("whisper-tiny-test", num_mel_bins=8, d_model=32, encoder_layers=2,
                               encoder_attention_heads=4, encoder_ffn_dim=64, max_source_positions=64),
}
