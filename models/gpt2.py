"""GPT-2 (pre-LN, learned positions, LM head tied to `wte` via `wte.attend`) in Flax linen.

Parameter tree mirrors the HF `GPT2Model` safetensors layout::

    wte.weight                -> params['wte']['embedding']
    h.3.attn.c_attn.weight    -> params['h_3']['attn']['c_attn']['kernel']   (Conv1D: (in, out), no transpose)
    h.3.ln_1.weight / .bias   -> params['h_3']['ln_1']['scale'] / ['bias']
    ln_f.weight               -> params['ln_f']['scale']

Example:
    >>> spec = models.get("gpt2-tiny")
    >>> params = spec.init(jax.random.key(0))
    >>> logits = spec.apply_fn()(params, ids)          # (batch, seq, vocab)
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
class GPT2Config:
  """GPT-2 hyper-parameters (HF names); `layer_norm_epsilon` is GPT-2's real 1e-5."""

  vocab_size: int = 50257
  n_positions: int = 1024
  n_embd: int = 768
  n_layer: int = 12
  n_head: int = 12
  n_inner: int | None = None  # defaults to 4 * n_embd, as in HF
  layer_norm_epsilon: float = 1e-5
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @property
  def inner(self) -> int:
    return self.n_inner or 4 * self.n_embd


class GPT2Attention(nn.Module):
  """Causal self-attention with a fused `c_attn` (in, 3*d) projection."""

  config: GPT2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    qkv = dense(3 * c.n_embd, "c_attn", c.dtype, c.param_dtype)(x)
    q, k, v = jnp.split(qkv, 3, axis=-1)
    q, k, v = (split_heads(t, c.n_head) for t in (q, k, v))
    out = merge_heads(attention(q, k, v, causal_bias(x.shape[1])))
    return dense(c.n_embd, "c_proj", c.dtype, c.param_dtype)(out)


class GPT2MLP(nn.Module):
  config: GPT2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    h = gelu_new(dense(c.inner, "c_fc", c.dtype, c.param_dtype)(x))
    return dense(c.n_embd, "c_proj", c.dtype, c.param_dtype)(h)


class GPT2Block(nn.Module):
  """x + attn(ln_1(x)), then + mlp(ln_2(x))."""

  config: GPT2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    eps = c.layer_norm_epsilon
    x = x + GPT2Attention(c, name="attn")(layer_norm(eps, "ln_1", c.dtype, c.param_dtype)(x))
    return x + GPT2MLP(c, name="mlp")(layer_norm(eps, "ln_2", c.dtype, c.param_dtype)(x))


class GPT2LMHeadModel(nn.Module):
  """Returns logits (batch, seq, vocab) through the tied head `wte.attend`."""

  config: GPT2Config

  @nn.compact
  def __call__(self, input_ids: jax.Array) -> jax.Array:
    c = self.config
    wte = embed(c.vocab_size, c.n_embd, "wte", c.dtype, c.param_dtype)
    wpe = embed(c.n_positions, c.n_embd, "wpe", c.dtype, c.param_dtype, std=0.01)
    positions = jnp.arange(input_ids.shape[1])[None, :]
    x = wte(input_ids) + wpe(positions)
    for i in range(c.n_layer):
      x = GPT2Block(c, name=f"h_{i}")(x)
    x = layer_norm(c.layer_norm_epsilon, "ln_f", c.dtype, c.param_dtype)(x)
    return wte.attend(x)


def _spec(name: str, **kw: Any) -> ModelSpec:
  return ModelSpec(name=name, family="gpt2", config=GPT2Config(**kw), build=GPT2LMHeadModel)


CONFIGS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        _spec("gpt2"),
        _spec("gpt2-medium", n_embd=1024, n_layer=24, n_head=16),
        _spec("gpt2-tiny", vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4),
        # `jaxfold demo`'s model: GPT-2 shaped, d=256, 4 layers (not GPT-2 small: 768, 12)
        _spec("gpt2-256x4", vocab_size=2048, n_positions=256, n_embd=256, n_layer=4, n_head=4),
    ]
}
