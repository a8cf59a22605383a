"""Phi (phi-1.5 / phi-2) in Flax linen: one LayerNorm per block feeding parallel attention and
MLP, partial rotary embedding, final LayerNorm, untied `lm_head` with bias.

Parameter tree mirrors HF `PhiForCausalLM` with the `model.` prefix stripped::

    model.embed_tokens.weight                  -> params['embed_tokens']['embedding']
    model.layers.0.input_layernorm.weight      -> params['layers_0']['input_layernorm']['scale']
    model.layers.0.self_attn.q_proj.weight     -> params['layers_0']['self_attn']['q_proj']['kernel'] (transposed)
    model.layers.0.self_attn.dense.bias        -> params['layers_0']['self_attn']['dense']['bias']
    model.final_layernorm.weight               -> params['final_layernorm']['scale']
    lm_head.weight / lm_head.bias              -> params['lm_head']['kernel'] (transposed) / ['bias']

Example:
    >>> spec = models.get("phi-tiny")
    >>> logits = spec.apply_fn()(spec.init(jax.random.key(0)), ids)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from models.common import (
    ModelSpec,
    attention,
    causal_bias,
    dense,
    embed,
    gelu_new,
    layer_norm,
    merge_heads,
    split_heads,
)


@dataclasses.dataclass(frozen=True)
class PhiConfig:
  """Phi hyper-parameters (HF names); `layer_norm_eps` is Phi's real 1e-5.

  `attention_bias=False` drops the q/k/v/dense biases (GPT-J style); real Phi has them.
  """

  vocab_size: int = 51200
  hidden_size: int = 2560
  intermediate_size: int = 10240
  num_hidden_layers: int = 32
  num_attention_heads: int = 32
  partial_rotary_factor: float = 0.4
  rope_theta: float = 10000.0
  layer_norm_eps: float = 1e-5
  attention_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_attention_heads

  @property
  def rotary_dim(self) -> int:
    return int(self.partial_rotary_factor * self.head_dim)


def apply_partial_rotary(x: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
  """Rotate the first `rotary_dim` features of each head of x (b, s, h, d), HF "rotate_half"
  convention; the remaining features pass through.

  Example:
      >>> apply_partial_rotary(q, 32, 10000.0).shape == q.shape
  """
  seq = x.shape[1]
  inv_freq = 1.0 / theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
  freqs = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]  # (1, s, 1, rot)
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  rot, rest = x[..., :rotary_dim].astype(jnp.float32), x[..., rotary_dim:]
  half = rotary_dim // 2
  rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
  out = (rot * cos + rotated * sin).astype(x.dtype)
  return jnp.concatenate([out, rest], axis=-1)


class PhiAttention(nn.Module):
  config: PhiConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    d, dt, pdt, ub = c.hidden_size, c.dtype, c.param_dtype, c.attention_bias
    q, k, v = (split_heads(dense(d, n, dt, pdt, use_bias=ub)(x), c.num_attention_heads)
               for n in ("q_proj", "k_proj", "v_proj"))
    q = apply_partial_rotary(q, c.rotary_dim, c.rope_theta)
    k = apply_partial_rotary(k, c.rotary_dim, c.rope_theta)
    out = merge_heads(attention(q, k, v, causal_bias(x.shape[1])))
    return dense(d, "dense", dt, pdt, use_bias=ub)(out)


class PhiMLP(nn.Module):
  config: PhiConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    y = gelu_new(dense(c.intermediate_size, "fc1", c.dtype, c.param_dtype)(x))
    return dense(c.hidden_size, "fc2", c.dtype, c.param_dtype)(y)


class PhiDecoderLayer(nn.Module):
  """x + attn(LN(x)) + mlp(LN(x)): one LN, two parallel consumers."""

  config: PhiConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    h = layer_norm(c.layer_norm_eps, "input_layernorm", c.dtype, c.param_dtype)(x)
    return x + PhiAttention(c, name="self_attn")(h) + PhiMLP(c, name="mlp")(h)


class PhiForCausalLM(nn.Module):
  """Returns logits (batch, seq, vocab) from an untied `lm_head` with bias."""

  config: PhiConfig

  @nn.compact
  def __call__(self, input_ids: jax.Array) -> jax.Array:
    c = self.config
    x = embed(c.vocab_size, c.hidden_size, "embed_tokens", c.dtype, c.param_dtype)(input_ids)
    for i in range(c.num_hidden_layers):
      x = PhiDecoderLayer(c, name=f"layers_{i}")(x)
    x = layer_norm(c.layer_norm_eps, "final_layernorm", c.dtype, c.param_dtype)(x)
    return dense(c.vocab_size, "lm_head", c.dtype, c.param_dtype)(x)


def _spec(name: str, **kw: Any) -> ModelSpec:
  return ModelSpec(name=name, family="phi", config=PhiConfig(**kw), build=PhiForCausalLM)


CONFIGS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        _spec("phi-2"),
        _spec("phi-1.5", hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
              partial_rotary_factor=0.5),
    # GPT-J-6B sizes on the Phi-style parallel block (one LN feeding attention and MLP,
    # partial rotary, untied head with bias) -- which is GPT-J's own block structure.
    # Differences from real GPT-J: GPT-J rotates interleaved pairs ("rotate_every_two")
    # rather than halves, and has no q/k/v/out biases (hence attention_bias=False).
    # rotary_dim 64 of head_dim 256 -> factor 0.25.  Parameter names are Phi's, not GPT-J's.
        _spec("gpt-j-6b-sized", vocab_size=50400, hidden_size=4096, intermediate_size=16384,
              num_hidden_layers=28, num_attention_heads=16, partial_rotary_factor=0.25,
              attention_bias=False),
        _spec("phi-tiny", vocab_size=96, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=4, partial_rotary_factor=0.5),
        _spec("gpt-j-tiny", vocab_size=96, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=2, partial_rotary_factor=0.25,
              attention_bias=False),
    ]
}
