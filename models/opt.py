"""OPT decoder in Flax linen: pre-LN (125m, 1.3b) and post-LN with project_in/out (350m).

Parameter tree mirrors HF `OPTForCausalLM` with the `model.decoder.` prefix stripped::

    model.decoder.embed_tokens.weight                  -> params['embed_tokens']['embedding']
    model.decoder.embed_positions.weight               -> params['embed_positions']['embedding'] (max_pos + 2 rows)
    model.decoder.project_in.weight                    -> params['project_in']['kernel'] (transposed; 350m only)
    model.decoder.layers.0.self_attn.q_proj.weight     -> params['layers_0']['self_attn']['q_proj']['kernel'] (transp.)
    model.decoder.layers.0.self_attn_layer_norm.weight -> params['layers_0']['self_attn_layer_norm']['scale']
    model.decoder.final_layer_norm.weight              -> params['final_layer_norm']['scale'] (pre-LN only)
    lm_head.weight                                     -> tied to embed_tokens, not stored

Example:
    >>> spec = models.get("opt-tiny")
    >>> logits = spec.apply_fn()(spec.init(jax.random.key(0)), ids)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from models.common import ModelSpec, attention, causal_bias, dense, embed, layer_norm, merge_heads, split_heads

POSITION_OFFSET = 2  # OPT's learned positions start at row 2 (a fairseq legacy)


@dataclasses.dataclass(frozen=True)
class OPTConfig:
  """OPT hyper-parameters (HF names); LayerNorm ε is 1e-5 (torch's default, used by OPT)."""

  vocab_size: int = 50272
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  ffn_dim: int = 3072
  max_position_embeddings: int = 2048
  word_embed_proj_dim: int | None = None  # None -> hidden_size (no project_in/out)
  do_layer_norm_before: bool = True
  layer_norm_eps: float = 1e-5
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @property
  def embed_dim(self) -> int:
    return self.word_embed_proj_dim or self.hidden_size

  @property
  def has_projections(self) -> bool:
    return self.embed_dim != self.hidden_size


class OPTAttention(nn.Module):
  config: OPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    d, dt, pdt = c.hidden_size, c.dtype, c.param_dtype
    q, k, v = (split_heads(dense(d, n, dt, pdt)(x), c.num_attention_heads)
               for n in ("q_proj", "k_proj", "v_proj"))
    out = merge_heads(attention(q, k, v, causal_bias(x.shape[1])))
    return dense(d, "out_proj", dt, pdt)(out)


class OPTDecoderLayer(nn.Module):
  """Pre-LN: x + f(LN(x)).  Post-LN (350m): LN(x + f(x)) — as HF's `do_layer_norm_before`."""

  config: OPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    pre = c.do_layer_norm_before
    ln_attn = layer_norm(c.layer_norm_eps, "self_attn_layer_norm", c.dtype, c.param_dtype)
    ln_ffn = layer_norm(c.layer_norm_eps, "final_layer_norm", c.dtype, c.param_dtype)
    attn = OPTAttention(c, name="self_attn")
    fc1 = dense(c.ffn_dim, "fc1", c.dtype, c.param_dtype)
    fc2 = dense(c.hidden_size, "fc2", c.dtype, c.param_dtype)

    x = x + attn(ln_attn(x) if pre else x)
    x = x if pre else ln_attn(x)
    x = x + fc2(nn.relu(fc1(ln_ffn(x) if pre else x)))
    return x if pre else ln_ffn(x)


class OPTForCausalLM(nn.Module):
  """Returns logits (batch, seq, vocab); LM head tied to `embed_tokens`."""

  config: OPTConfig

  @nn.compact
  def __call__(self, input_ids: jax.Array) -> jax.Array:
    c = self.config
    dt, pdt = c.dtype, c.param_dtype
    tokens = embed(c.vocab_size, c.embed_dim, "embed_tokens", dt, pdt)
    positions = embed(c.max_position_embeddings + POSITION_OFFSET, c.hidden_size,
                      "embed_positions", dt, pdt)
    x = tokens(input_ids)
    if c.has_projections:
      x = dense(c.hidden_size, "project_in", dt, pdt, use_bias=False)(x)
    x = x + positions(jnp.arange(input_ids.shape[1])[None, :] + POSITION_OFFSET)
    for i in range(c.num_hidden_layers):
      x = OPTDecoderLayer(c, name=f"layers_{i}")(x)
    if c.do_layer_norm_before:  # HF builds no final LN for post-LN OPT (350m)
      x = layer_norm(c.layer_norm_eps, "final_layer_norm", dt, pdt)(x)
    if c.has_projections:
      x = dense(c.embed_dim, "project_out", dt, pdt, use_bias=False)(x)
    return tokens.attend(x)


def _spec(name: str, **kw: Any) -> ModelSpec:
  return ModelSpec(name=name, family="opt", config=OPTConfig(**kw), build=OPTForCausalLM)


_TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             ffn_dim=64, max_position_embeddings=32)

CONFIGS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        _spec("opt-125m"),
        _spec("opt-350m", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
              ffn_dim=4096, word_embed_proj_dim=512, do_layer_norm_before=False),
        _spec("opt-1.3b", hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
              ffn_dim=8192),
        _spec("opt-tiny", **_TINY),
        _spec("opt-350m-tiny", **{**_TINY, "word_embed_proj_dim": 16},
              do_layer_norm_before=False),
    ]
}
