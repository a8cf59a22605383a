"""models.common.kv_cache: one decode step against a KV cache (used by benchmarks/gpu_model.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfold
import models
from models.common import attention, causal_bias, kv_cache


def test_decode_step_equals_the_last_position_of_the_full_sequence():
  rng = np.random.default_rng(0)
  b, prefix, h, d = 2, 5, 3, 4
  q, k, v = (jnp.asarray(rng.standard_normal((b, prefix + 1, h, d)), jnp.float32) for _ in range(3))
  full = attention(q, k, v, causal_bias(prefix + 1))[:, -1:]
  with kv_cache([k[:, :prefix]], [v[:, :prefix]]) as cache:
    step = attention(q[:, -1:], k[:, -1:], v[:, -1:], causal_bias(1))
  assert cache.calls == 1
  np.testing.assert_allclose(step, full, rtol=1e-5, atol=1e-6)


def test_each_attention_call_reads_its_own_layer_and_the_context_resets():
  spec = models.get("gpt2-tiny")
  c = spec.config
  params = models.random_params(spec, 2, 1)
  ids = jnp.array([[3], [7]], jnp.int32)
  hd = c.n_embd // c.n_head
  caches = [jnp.full((2, 4, c.n_head, hd), float(i)) for i in range(c.n_layer)]
  with kv_cache(caches, caches) as cache:
    a = spec.apply_fn()(params, ids)
  assert cache.calls == c.n_layer
  with kv_cache(caches[::-1], caches[::-1]):
    b = spec.apply_fn()(params, ids)
  assert not np.allclose(a, b)  # layer i reads cache i
  np.testing.assert_allclose(spec.apply_fn()(params, ids), spec.apply_fn()(params, ids))  # no cache outside
  with pytest.raises(ValueError, match="attention called"):
    with kv_cache(caches[:1], caches[:1]):
      spec.apply_fn()(params, ids)


def test_a_decode_step_folds_exactly(x64):
  spec = models.get("gpt2-tiny")
  c = spec.config
  params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), models.random_params(spec, 2, 1))
  hd = c.n_embd // c.n_head
  rng = np.random.default_rng(1)
  keys = tuple(jnp.asarray(rng.standard_normal((2, 6, c.n_head, hd))) for _ in range(c.n_layer))
  values = tuple(jnp.asarray(rng.standard_normal((2, 6, c.n_head, hd))) for _ in range(c.n_layer))
  fn = spec.apply_fn()

  def decode(p, ids, ks, vs):
    with kv_cache(ks, vs):
      return fn(p, ids)

  ids = jnp.array([[3], [7]], jnp.int32)
  folded = jaxfold.fold(params, decode, ids, keys, values)
  assert folded.report.num_folded == folded.report.num_sites == 2 * c.n_layer + 1
  # The folded apply_fn runs compiled (one program per shape); compare with the
  # compiled original: eager and compiled float64 differ by ~1e-9 for the
  # original itself here (XLA CPU's fused transcendentals), a rounding, not a fold, difference.
  np.testing.assert_allclose(folded.apply_fn(folded.params, ids, keys, values),
                             jax.jit(decode)(params, ids, keys, values), rtol=1e-12, atol=1e-12)
