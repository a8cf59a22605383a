"""BLOOM in Flax linen: `word_embeddings_layernorm`, ALiBi, fused `query_key_value`, tied head.

Parameter tree mirrors HF `BloomModel` (the `transformer.` prefix of `BloomForCausalLM`
checkpoints is stripped by the loader)::

    word_embeddings.weight                       -> params['word_embeddings']['embedding']
    word_embeddings_layernorm.weight             -> params['word_embeddings_layernorm']['scale']
    h.0.self_attention.query_key_value.weight    -> params['h_0']['self_attention']['query_key_value']
                                                    ['kernel'] (transposed)
    h.0.mlp.dense_4h_to_h.bias                   -> params['h_0']['mlp']['dense_4h_to_h']['bias']
    ln_f.weight                                  -> params['ln_f']['scale']

The fused projection's output is laid out per head as [q | k | v] (HF views it as
(batch, seq, heads, 3, head_dim)).  Note the residual stream *starts at an LN output*,
which matters to folding: see tests/models/test_bloom.py.

Example:
    >>> spec = models.get("bloom-tiny")
    >>> logits = spec.apply_fn()(spec.init(jax.random.key(0)), ids)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from models.common import ModelSpec, attention, causal_bias, dense, embed, gelu_new, layer_norm, merge_heads


@dataclasses.dataclass(frozen=True)
class BloomConfig:
  """BLOOM hyper-parameters (HF names); `layer_norm_epsilon` is BLOOM's real 1e-5."""

  vocab_size: int = 250880
  hidden_size: int = 1024
  n_layer: int = 24
  n_head: int = 16
  layer_norm_epsilon: float = 1e-5
  dtype: Any = None
  param_dtype: Any = jnp.float32


def alibi_slopes(num_heads: int) -> np.ndarray:
  """HF `build_alibi_tensor`'s per-head slopes (geometric; interleaved extras when the
  head count is not a power of two).

  Example:
      >>> alibi_slopes(8)[:2]      # array([0.5 , 0.25])
  """
  closest = 2 ** math.floor(math.log2(num_heads))
  base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
  slopes = base ** np.arange(1, closest + 1)
  if closest != num_heads:
    extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
    n_extra = min(closest, num_heads - closest)
    slopes = np.concatenate([slopes, extra_base ** np.arange(1, 1 + 2 * n_extra, 2)])
  return slopes.astype(np.float32)


def alibi_bias(num_heads: int, seq: int) -> jax.Array:
  """(1, h, 1, s) bias slope_h * key_position.  HF adds the same; softmax ignores the
  per-query constant that distinguishes it from slope * (key - query)."""
  slopes = jnp.asarray(alibi_slopes(num_heads))
  return (slopes[:, None] * jnp.arange(seq, dtype=jnp.float32)[None, :])[None, :, None, :]


class BloomAttention(nn.Module):
  config: BloomConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    b, s, d = x.shape
    h = c.n_head
    fused = dense(3 * d, "query_key_value", c.dtype, c.param_dtype)(x)
    fused = fused.reshape(b, s, h, 3, d // h)
    q, k, v = fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]
    bias = alibi_bias(h, s) + causal_bias(s)
    out = merge_heads(attention(q, k, v, bias))
    return dense(d, "dense", c.dtype, c.param_dtype)(out)


class BloomMLP(nn.Module):
  config: BloomConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    y = gelu_new(dense(4 * c.hidden_size, "dense_h_to_4h", c.dtype, c.param_dtype)(x))
    return dense(c.hidden_size, "dense_4h_to_h", c.dtype, c.param_dtype)(y)


class BloomBlock(nn.Module):
  """Pre-LN block (apply_residual_connection_post_layernorm=False, as all released BLOOMs)."""

  config: BloomConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    eps = c.layer_norm_epsilon
    x = x + BloomAttention(c, name="self_attention")(
        layer_norm(eps, "input_layernorm", c.dtype, c.param_dtype)(x))
    return x + BloomMLP(c, name="mlp")(
        layer_norm(eps, "post_attention_layernorm", c.dtype, c.param_dtype)(x))


class BloomForCausalLM(nn.Module):
  """Returns logits (batch, seq, vocab); LM head tied to `word_embeddings`."""

  config: BloomConfig

  @nn.compact
  def __call__(self, input_ids: jax.Array) -> jax.Array:
    c = self.config
    eps, dt, pdt = c.layer_norm_epsilon, c.dtype, c.param_dtype
    wte = embed(c.vocab_size, c.hidden_size, "word_embeddings", dt, pdt)
    x = layer_norm(eps, "word_embeddings_layernorm", dt, pdt)(wte(input_ids))
    for i in range(c.n_layer):
      x = BloomBlock(c, name=f"h_{i}")(x)
    return wte.attend(layer_norm(eps, "ln_f", dt, pdt)(x))


def _spec(name: str, **kw: Any) -> ModelSpec:
  return ModelSpec(name=name, family="bloom", config=BloomConfig(**kw), build=BloomForCausalLM)


CONFIGS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        _spec("bloom-560m"),
    # 6 heads: not a power of two, so the interleaved extra ALiBi slopes are exercised.
        _spec("bloom-tiny", vocab_size=96, hidden_size=48, n_layer=2, n_head=6),
    ]
}
