"""GPT-2 written with flax.nnx; same math and the *same parameter tree* as `models/gpt2.py`.

Blocks are attributes named `h_0`, `h_1`, ... (not an nnx list) so that the pure-dict state
equals the linen params pytree: the safetensors loader and linen checkpoints work unchanged.

To fold an nnx model, split it into a pure params dict and a function of those params::

    >>> model = GPT2LMHeadModelNNX(models.get("gpt2-tiny").config, rngs=nnx.Rngs(0))
    >>> graphdef, params = split_params(model)          # params: plain nested dict
    >>> apply = make_apply_fn(graphdef)                 # apply(params, ids) -> logits
    >>> folded = jaxfold.fold(params, apply, ids)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models.common import ModelSpec, attention, causal_bias, gelu_new, merge_heads, split_heads, token_inputs
from models.gpt2 import GPT2Config

_INIT = nnx.initializers.normal(0.02)


def _linear(n_in: int, n_out: int, c: GPT2Config, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(n_in, n_out, kernel_init=_INIT, dtype=c.dtype, param_dtype=c.param_dtype,
                    rngs=rngs)


def _ln(c: GPT2Config, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(c.n_embd, epsilon=c.layer_norm_epsilon, dtype=c.dtype,
                       param_dtype=c.param_dtype, rngs=rngs)


class Attention(nnx.Module):
  def __init__(self, c: GPT2Config, rngs: nnx.Rngs):
    self.n_head = c.n_head
    self.c_attn = _linear(c.n_embd, 3 * c.n_embd, c, rngs)
    self.c_proj = _linear(c.n_embd, c.n_embd, c, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    q, k, v = (split_heads(t, self.n_head) for t in jnp.split(self.c_attn(x), 3, axis=-1))
    return self.c_proj(merge_heads(attention(q, k, v, causal_bias(x.shape[1]))))


class MLP(nnx.Module):
  def __init__(self, c: GPT2Config, rngs: nnx.Rngs):
    self.c_fc = _linear(c.n_embd, c.inner, c, rngs)
    self.c_proj = _linear(c.inner, c.n_embd, c, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.c_proj(gelu_new(self.c_fc(x)))


class Block(nnx.Module):
  def __init__(self, c: GPT2Config, rngs: nnx.Rngs):
    self.ln_1 = _ln(c, rngs)
    self.attn = Attention(c, rngs)
    self.ln_2 = _ln(c, rngs)
    self.mlp = MLP(c, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModelNNX(nnx.Module):
  """GPT-2 with the tied head `wte.attend`; returns logits (batch, seq, vocab)."""

  def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
    c = config
    self.n_layer = c.n_layer
    self.wte = nnx.Embed(c.vocab_size, c.n_embd, embedding_init=_INIT, dtype=c.dtype,
                         param_dtype=c.param_dtype, rngs=rngs)
    self.wpe = nnx.Embed(c.n_positions, c.n_embd,
                         embedding_init=nnx.initializers.normal(0.01), dtype=c.dtype,
                         param_dtype=c.param_dtype, rngs=rngs)
    for i in range(c.n_layer):
      setattr(self, f"h_{i}", Block(c, rngs))  # linen-compatible names
    self.ln_f = _ln(c, rngs)

  def __call__(self, input_ids: jax.Array) -> jax.Array:
    x = self.wte(input_ids) + self.wpe(jnp.arange(input_ids.shape[1])[None, :])
    for i in range(self.n_layer):
      x = getattr(self, f"h_{i}")(x)
    return self.wte.attend(self.ln_f(x))


def split_params(model: nnx.Module) -> tuple[Any, dict]:
  """(graphdef, params as a plain nested dict) of an nnx model."""
  graphdef, state = nnx.split(model)
  return graphdef, nnx.to_pure_dict(state)


def make_apply_fn(graphdef: Any) -> Callable[..., jax.Array]:
  """`apply(params, *args)`: rebuild the module from a pure params dict and call it."""

  def apply(params: dict, *args: Any) -> jax.Array:
    return nnx.merge(graphdef, params)(*args)

  return apply


@dataclasses.dataclass(frozen=True)
class NNXModelSpec(ModelSpec):
  """A `ModelSpec` whose `build(config, rngs)` makes an nnx module; params are pure dicts."""

  def make_model(self, seed: int = 0) -> nnx.Module:
    return self.build(self.config, rngs=nnx.Rngs(seed))

  def _graphdef(self) -> Any:
    return nnx.split(nnx.eval_shape(lambda: self.make_model()))[0]

  def apply_fn(self) -> Callable[..., Any]:
    return make_apply_fn(self._graphdef())

  def init(self, rng: jax.Array, batch: int = 1, seq: int = 8) -> dict:
    seed = int(jax.random.randint(rng, (), 0, 2**31 - 1))
    return split_params(self.make_model(seed))[1]

  def abstract_init(self, batch: int = 1, seq: int = 8) -> dict:
    return jax.eval_shape(lambda: split_params(self.make_model())[1])


def _spec(name: str, **kw: Any) -> NNXModelSpec:
  return NNXModelSpec(name=name, family="gpt2", config=GPT2Config(**kw),
                      build=GPT2LMHeadModelNNX, inputs=token_inputs)


CONFIGS: dict[str, NNXModelSpec] = {
    s.name: s
    for s in [
        _spec("gpt2-nnx"),
        _spec("gpt2-nnx-tiny", vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4),
    ]
}
