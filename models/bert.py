"""BERT encoder (post-LN) in Flax linen; `minilm-l6` is sentence-transformers' all-MiniLM-L6-v2.

Parameter tree mirrors the HF `BertModel` safetensors layout (the `bert.` prefix of
`BertFor*` checkpoints is stripped by the loader)::

    embeddings.word_embeddings.weight              -> params['embeddings']['word_embeddings']['embedding']
    embeddings.LayerNorm.weight                    -> params['embeddings']['LayerNorm']['scale']
    encoder.layer.0.attention.self.query.weight    -> params['encoder']['layer_0']['attention']['self']['query']
                                                      ['kernel'] (transposed)
    encoder.layer.0.output.LayerNorm.bias          -> params['encoder']['layer_0']['output']['LayerNorm']['bias']

`__call__(input_ids, attention_mask=None, token_type_ids=None)` returns the last hidden
state (batch, seq, hidden) — the "token embeddings" that sentence-transformers mean-pools.

Example:
    >>> spec = models.get("minilm-l6")
    >>> hidden = spec.apply_fn()(params, ids, mask, types)
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
    dense,
    embed,
    gelu_exact,
    layer_norm,
    merge_heads,
    padding_bias,
    split_heads,
)


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """BERT hyper-parameters (HF names); `layer_norm_eps` is BERT's real 1e-12."""

  vocab_size: int = 30522
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  dtype: Any = None
  param_dtype: Any = jnp.float32


class BertEmbeddings(nn.Module):
  """LayerNorm(word + position + token_type)."""

  config: BertConfig

  @nn.compact
  def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
    c = self.config
    d, dt, pdt = c.hidden_size, c.dtype, c.param_dtype
    positions = jnp.arange(input_ids.shape[1])[None, :]
    x = (embed(c.vocab_size, d, "word_embeddings", dt, pdt)(input_ids)
         + embed(c.max_position_embeddings, d, "position_embeddings", dt, pdt)(positions)
         + embed(c.type_vocab_size, d, "token_type_embeddings", dt, pdt)(token_type_ids))
    return layer_norm(c.layer_norm_eps, "LayerNorm", dt, pdt)(x)


class BertSelfAttention(nn.Module):
  config: BertConfig

  @nn.compact
  def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
    c = self.config
    h, d = c.num_attention_heads, c.hidden_size
    q, k, v = (split_heads(dense(d, n, c.dtype, c.param_dtype)(x), h)
               for n in ("query", "key", "value"))
    return merge_heads(attention(q, k, v, bias))


class BertAddNorm(nn.Module):
  """HF's `BertSelfOutput` / `BertOutput`: LayerNorm(dense(h) + residual) — the post-LN."""

  config: BertConfig

  @nn.compact
  def __call__(self, h: jax.Array, residual: jax.Array) -> jax.Array:
    c = self.config
    y = dense(c.hidden_size, "dense", c.dtype, c.param_dtype)(h)
    return layer_norm(c.layer_norm_eps, "LayerNorm", c.dtype, c.param_dtype)(y + residual)


class BertAttention(nn.Module):
  config: BertConfig

  @nn.compact
  def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
    ctx = BertSelfAttention(self.config, name="self")(x, bias)
    return BertAddNorm(self.config, name="output")(ctx, x)


class BertLayer(nn.Module):
  config: BertConfig

  @nn.compact
  def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
    c = self.config
    a = BertAttention(c, name="attention")(x, bias)
    h = gelu_exact(_Intermediate(c, name="intermediate")(a))
    return BertAddNorm(c, name="output")(h, a)


class _Intermediate(nn.Module):
  """HF `BertIntermediate` (only its `dense`; gelu applied by the caller)."""

  config: BertConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    return dense(c.intermediate_size, "dense", c.dtype, c.param_dtype)(x)


class BertEncoder(nn.Module):
  config: BertConfig

  @nn.compact
  def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
    for i in range(self.config.num_hidden_layers):
      x = BertLayer(self.config, name=f"layer_{i}")(x, bias)
    return x


class BertModel(nn.Module):
  """Encoder without pooler; returns the last hidden state."""

  config: BertConfig

  @nn.compact
  def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
               token_type_ids: jax.Array | None = None) -> jax.Array:
    if attention_mask is None:
      attention_mask = jnp.ones_like(input_ids)
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    x = BertEmbeddings(self.config, name="embeddings")(input_ids, token_type_ids)
    return BertEncoder(self.config, name="encoder")(x, padding_bias(attention_mask))


def bert_inputs(config: BertConfig, batch: int, seq: int, *, abstract: bool = False,
                seed: int = 0) -> tuple:
  """`(input_ids, attention_mask, token_type_ids)`; the last row is right-padded by 2 and
  the second half of each row is segment 1, so masks and token types are exercised."""
  if abstract:
    s = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return (s, s, s)
  ids = jax.random.randint(jax.random.key(seed), (batch, seq), 0, config.vocab_size, jnp.int32)
  mask = jnp.ones((batch, seq), jnp.int32)
  if seq > 2:
    mask = mask.at[-1, -2:].set(0)
  types = jnp.broadcast_to((jnp.arange(seq) >= seq // 2).astype(jnp.int32), (batch, seq))
  return ids, mask, types


def _spec(name: str, **kw: Any) -> ModelSpec:
  return ModelSpec(name=name, family="bert", config=BertConfig(**kw), build=BertModel,
                   inputs=bert_inputs)


CONFIGS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        _spec("bert-base"),
        _spec("minilm-l6", hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536),
        _spec("bert-tiny", vocab_size=96, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=64, max_position_embeddings=32),
    ]
}
