"""Shared pieces of the model zoo: `ModelSpec`, attention helpers and `randomize_norms`.

Every model in `models/` is an ordinary Flax program (linen, or nnx for `gpt2_nnx`) whose
parameter pytree mirrors the Hugging Face safetensors layout of its family; see
`models/safetensors_io.py` for the mapping rule.

Example:
    >>> import jax, models
    >>> spec = models.get("gpt2-tiny")
    >>> params = spec.init(jax.random.key(0), batch=1, seq=8)
    >>> logits = spec.apply_fn()(params, *spec.example_inputs(1, 8))
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

PyTree = Any
Dtype = Any


# --------------------------------------------------------------------------------------
# ModelSpec
# --------------------------------------------------------------------------------------


def token_inputs(
    config: Any, batch: int, seq: int, *, abstract: bool = False, seed: int = 0
) -> tuple[jax.Array | jax.ShapeDtypeStruct, ...]:
  """`(input_ids,)` of shape (batch, seq), ids drawn below `config.vocab_size`.

  Example:
      >>> (ids,) = token_inputs(cfg, 2, 5)
  """
  if abstract:
    return (jax.ShapeDtypeStruct((batch, seq), jnp.int32),)
  ids = jax.random.randint(jax.random.key(seed), (batch, seq), 0, config.vocab_size, jnp.int32)
  return (ids,)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A named model configuration.

  `build(config)` returns the linen module; `inputs(config, batch, seq, abstract=...)`
  returns the positional arguments of its `__call__` (after the params).

  Example:
      >>> spec = models.get("bert-tiny")
      >>> params = spec.abstract_init(batch=1, seq=8)     # ShapeDtypeStructs, no memory
      >>> out = spec.apply_fn()(spec.init(jax.random.key(0), 1, 8), *spec.example_inputs(1, 8))
  """

  name: str
  family: str
  config: Any
  build: Callable[[Any], Any]
  inputs: Callable[..., tuple] = token_inputs

  def make_model(self) -> Any:
    """A fresh module for this configuration."""
    return self.build(self.config)

  def example_inputs(self, batch: int = 1, seq: int = 8, *, abstract: bool = False) -> tuple:
    """Positional call arguments; ShapeDtypeStructs when `abstract`."""
    return self.inputs(self.config, batch, seq, abstract=abstract)

  def apply_fn(self) -> Callable[..., Any]:
    """`f(params, *args)` running the model; `params` is the bare 'params' collection."""
    model = self.make_model()

    def apply(params: PyTree, *args: Any) -> Any:
      return model.apply({"params": params}, *args)

    return apply

  def init(self, rng: jax.Array, batch: int = 1, seq: int = 8) -> PyTree:
    """Random parameters (the bare 'params' collection)."""
    args = self.example_inputs(batch, seq)
    return self.make_model().init(rng, *args)["params"]

  def abstract_init(self, batch: int = 1, seq: int = 8) -> PyTree:
    """Parameter shapes/dtypes as ShapeDtypeStructs; allocates no weights (jax.eval_shape)."""
    args = self.example_inputs(batch, seq, abstract=True)
    model = self.make_model()
    return jax.eval_shape(lambda r, *a: model.init(r, *a)["params"], jax.random.key(0), *args)


# --------------------------------------------------------------------------------------
# Test helper
# --------------------------------------------------------------------------------------


def randomize_norms(params: PyTree, rng: jax.Array, *, vector_scale: float = 0.5,
                    matrix_scale: float = 0.02) -> PyTree:
  """Perturb every leaf so no LayerNorm keeps γ=1, β=0 and no bias stays zero.

  1-D leaves (LayerNorm scales/biases and all Dense/conv biases) get
  `leaf + vector_scale * (N(0,1) + c)` with a per-leaf random offset `c ∈ [-1, 1]`, so γ is
  non-uniform and β has a clearly non-zero mean (the cases that expose a dropped β or a
  wrongly assumed zero-mean LN output).  Higher-rank leaves get a small
  `matrix_scale * N(0,1)` so kernels and tables also lose any structure from init.
  Dtypes are kept.  Decides from the leaf's rank only, never from names.

  Example:
      >>> params = randomize_norms(spec.init(jax.random.key(0)), jax.random.key(1))
  """
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(rng, 2 * max(len(leaves), 1))
  out = []
  for i, leaf in enumerate(leaves):
    x = jnp.asarray(leaf)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      out.append(leaf)
      continue
    noise = jax.random.normal(keys[2 * i], x.shape, jnp.float32)
    if x.ndim <= 1:
      offset = jax.random.uniform(keys[2 * i + 1], (), jnp.float32, -1.0, 1.0)
      new = x.astype(jnp.float32) + vector_scale * (noise + offset)
    else:
      new = x.astype(jnp.float32) + matrix_scale * noise
    out.append(new.astype(x.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


# --------------------------------------------------------------------------------------
# Layers shared by several families
# --------------------------------------------------------------------------------------


def gelu_new(x: jax.Array) -> jax.Array:
  """GPT-2 / Phi / BLOOM "gelu_new": the tanh approximation."""
  return nn.gelu(x, approximate=True)


def gelu_exact(x: jax.Array) -> jax.Array:
  """BERT "gelu": the erf form."""
  return nn.gelu(x, approximate=False)


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
  """(b, s, h*d) -> (b, s, h, d)."""
  b, s, e = x.shape
  return x.reshape(b, s, num_heads, e // num_heads)


def merge_heads(x: jax.Array) -> jax.Array:
  """(b, s, h, d) -> (b, s, h*d)."""
  b, s, h, d = x.shape
  return x.reshape(b, s, h * d)


def causal_bias(seq: int, dtype: Dtype = jnp.float32) -> jax.Array:
  """(1, 1, s, s) additive mask: 0 on/below the diagonal, a large negative value above."""
  mask = jnp.tril(jnp.ones((seq, seq), bool))
  return jnp.where(mask, 0.0, jnp.finfo(dtype).min)[None, None].astype(dtype)


def padding_bias(attention_mask: jax.Array, dtype: Dtype = jnp.float32) -> jax.Array:
  """(b, s) 1/0 key mask -> (b, 1, 1, s) additive bias."""
  keep = attention_mask.astype(bool)[:, None, None, :]
  return jnp.where(keep, 0.0, jnp.finfo(dtype).min).astype(dtype)


class _KVCache:
  """The K/V caches of one decode step, handed to the attention calls in call order."""

  def __init__(self, keys: Sequence[jax.Array], values: Sequence[jax.Array]):
    if len(keys) != len(values):
      raise ValueError(f"{len(keys)} key caches but {len(values)} value caches")
    self.keys, self.values, self.calls = tuple(keys), tuple(values), 0

  def extend(self, k: jax.Array, v: jax.Array, bias: jax.Array | None):
    i = self.calls
    if i >= len(self.keys):
      raise ValueError(f"attention called {i + 1} times inside kv_cache with {len(self.keys)} caches")
    self.calls += 1
    ck, cv = self.keys[i], self.values[i]
    k = jnp.concatenate([ck.astype(k.dtype), k], axis=1)
    v = jnp.concatenate([cv.astype(v.dtype), v], axis=1)
    if bias is not None:  # every cached position is visible to every new token
      bias = jnp.pad(bias, [(0, 0)] * (bias.ndim - 1) + [(ck.shape[1], 0)])
    return k, v, bias


_KV_CACHE: contextvars.ContextVar = contextvars.ContextVar("models_kv_cache", default=None)


@contextlib.contextmanager
def kv_cache(keys: Sequence[jax.Array], values: Sequence[jax.Array]) -> Iterator[_KVCache]:
  """Decode against a KV cache: inside, the i-th call of :func:`attention` attends from its
  queries to ``keys[i]``/``values[i]`` ((b, L, h, d), the cached positions) followed by its
  own k/v; the causal bias is extended so every cached position is visible.

  A minimal decode step for cost models (one new token per sequence against a cache of
  length L); positions and rotary phases are those of a sequence starting at the new
  tokens, which changes the values, not the work. Used by ``benchmarks/gpu_model.py``.

  Example:
      >>> spec = models.get("gpt2-tiny"); c = spec.config
      >>> cache = [jnp.zeros((2, 16, c.n_head, c.n_embd // c.n_head))] * c.n_layer
      >>> with kv_cache(cache, cache):
      ...   logits = spec.apply_fn()(params, ids)          # ids: (2, 1)
  """
  state = _KVCache(keys, values)
  token = _KV_CACHE.set(state)
  try:
    yield state
  finally:
    _KV_CACHE.reset(token)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None,
              scale: float | None = None) -> jax.Array:
  """Softmax attention on (b, s, h, d) tensors with an additive (b|1, h|1, s, s) bias.

  Scores and softmax run in float32 (as the HF reference implementations do for
  half-precision inputs), the result is cast back to `v.dtype`.
  """
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  cache = _KV_CACHE.get()
  if cache is not None:  # decoding: the new tokens' q against the cached K/V + their own
    k, v, bias = cache.extend(k, v, bias)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(jnp.float32))
  return out.astype(v.dtype)


def layer_norm(eps: float, name: str, dtype: Dtype | None, param_dtype: Dtype) -> nn.LayerNorm:
  """flax's own LayerNorm (so jaxfold sees an ordinary program), with the family's ε."""
  return nn.LayerNorm(epsilon=eps, dtype=dtype, param_dtype=param_dtype, name=name)


def dense(features: int, name: str, dtype: Dtype | None, param_dtype: Dtype,
          use_bias: bool = True, std: float = 0.02) -> nn.Dense:
  """nn.Dense with the GPT-style N(0, 0.02) init."""
  return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                  kernel_init=nn.initializers.normal(std), name=name)


def embed(num: int, features: int, name: str, dtype: Dtype | None, param_dtype: Dtype,
          std: float = 0.02) -> nn.Embed:
  """nn.Embed with N(0, 0.02) init."""
  return nn.Embed(num, features, dtype=dtype, param_dtype=param_dtype,
                  embedding_init=nn.initializers.normal(std), name=name)


def max_rel_err(a: Any, b: Any) -> float:
  """max|a-b| / max|a| (the "relative to output scale" error used by the tests)."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))


def check_fold(spec: ModelSpec, params: PyTree, *, auxiliary_centering: bool,
               shapes: tuple[tuple[int, int], ...] = ((2, 8), (3, 5))) -> tuple[Any, list[float]]:
  """Fold `params` with `jaxfold.fold` (traced at `shapes[0]`) and return
  `(folded, [max_rel_err(original, folded) for each (batch, seq) in shapes])`.

  Raises ImportError when `jaxfold.fold` does not exist (tests turn that into a skip).

  Example:
      >>> folded, errs = check_fold(spec, randomize_norms(p, key), auxiliary_centering=True)
      >>> assert max(errs) < 1e-4 and folded.report.num_folded == 5
  """
  import jaxfold  # local: models must import without jaxfold

  if not hasattr(jaxfold, "fold"):
    raise ImportError("jaxfold.fold is not available yet")
  apply = spec.apply_fn()
  folded = jaxfold.fold(params, apply, *spec.example_inputs(*shapes[0]),
                        auxiliary_centering=auxiliary_centering)
  errors = []
  # Both sides compiled: one XLA program each instead of one per primitive (3x faster here).
  run, run_folded = jax.jit(apply), jax.jit(folded.apply_fn)
  for batch, seq in shapes:
    args = spec.example_inputs(batch, seq)
    errors.append(max_rel_err(run(params, *args), run_folded(folded.params, *args)))
  return folded, errors


def torch_reference_logits(hf_model: Any, params: PyTree, family: str, input_ids: Any) -> np.ndarray:
  """Load `params` (HF naming via `to_hf_tensors`) into a transformers model and return its
  logits for `input_ids` — an independent implementation to compare against (needs torch).

  Raises AssertionError when a checkpoint key of the model is left unfilled.

  Example:
      >>> ref = torch_reference_logits(transformers.OPTForCausalLM(cfg), params, "opt", ids)
  """
  import torch

  from models.safetensors_io import to_hf_tensors

  state = {k: torch.from_numpy(np.array(v)) for k, v in to_hf_tensors(params, family).items()}
  expected = set(hf_model.state_dict())
  # Files may or may not carry the wrapper prefix; align ours with the model's own keys.
  aligned = {}
  for key, value in state.items():
    match = [e for e in expected if e == key or e.endswith("." + key)]
    aligned[match[0] if match else key] = value
  missing, unexpected = hf_model.load_state_dict(aligned, strict=False)
  tied = {k for k in missing if k.endswith("lm_head.weight")}
  buffers = {k for k in missing if k.endswith("attn.bias") or k.endswith("position_ids")}
  assert not (set(missing) - tied - buffers) and not unexpected, (missing, unexpected)
  if tied:
    hf_model.tie_weights()
  hf_model.eval()
  with torch.no_grad():
    return hf_model(torch.from_numpy(np.array(input_ids)).long()).logits.numpy()
