"""Phi (and the GPT-J-sized parallel block): one LN per block feeding attention and MLP.

Fold expectation.  Stream = embed_tokens[ids] + Σ (dense + fc2 outputs); the head is untied.
Centering the table, every `dense` and every `fc2` makes each LN input zero-mean: all L+1
sites fold with or without auxiliary centering.
"""

import jax
import numpy as np
import pytest
from helpers import rel_err
from safetensors.numpy import save_file

import models
from models.common import check_fold, randomize_norms, torch_reference_logits
from models.phi import apply_partial_rotary
from models.safetensors_io import load_safetensors, save_safetensors, to_hf_tensors


@pytest.fixture(scope="module", params=["phi-tiny", "gpt-j-tiny"])
def case(request):
  spec = models.get(request.param)
  return spec, randomize_norms(spec.init(jax.random.key(0)), jax.random.key(1))


@pytest.mark.slow
def test_forward_shapes(case):
  spec, params = case
  for b, s in [(1, 8), (3, 5)]:
    assert spec.apply_fn()(params, *spec.example_inputs(b, s)).shape == (
        b, s, spec.config.vocab_size)


def test_configs_and_rotary():
  phi2 = models.get("phi-2").config
  assert (phi2.rotary_dim, phi2.layer_norm_eps) == (32, 1e-5)
  gptj = models.get("gpt-j-6b-sized").config
  assert (gptj.num_hidden_layers, gptj.hidden_size, gptj.num_attention_heads,
          gptj.vocab_size, gptj.rotary_dim) == (28, 4096, 16, 50400, 64)
  x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
  y = apply_partial_rotary(x, 4, 10000.0)
  np.testing.assert_array_equal(x[..., 4:], y[..., 4:])  # only the rotary part moves
  np.testing.assert_allclose(x[:, 0], y[:, 0], rtol=1e-6)  # position 0: identity
  np.testing.assert_allclose(np.linalg.norm(x[..., :4], axis=-1),
                             np.linalg.norm(y[..., :4], axis=-1), rtol=1e-5)


def test_safetensors_roundtrip(case, tmp_path):
  spec, params = case
  hf = {k: np.asarray(v) for k, v in to_hf_tensors(params, "phi").items()}
  assert {"model.embed_tokens.weight", "model.layers.1.input_layernorm.weight",
          "model.final_layernorm.bias", "lm_head.weight"} <= set(hf)
  assert hf["lm_head.weight"].shape == (spec.config.vocab_size, spec.config.hidden_size)
  plain = {k.removeprefix("model."): v for k, v in hf.items()}
  for name, tensors in [("causal_lm", hf), ("no_prefix", plain)]:
    save_file(tensors, str(tmp_path / f"{name}.safetensors"))  # torch-free writer
    jax.tree.map(np.testing.assert_array_equal, params,
                 load_safetensors(tmp_path / f"{name}.safetensors", "phi"))
  save_safetensors(params, tmp_path / "ours.safetensors", "phi")
  jax.tree.map(np.testing.assert_array_equal, params,
               load_safetensors(tmp_path / "ours.safetensors", "phi"))


@pytest.mark.parametrize("aux", [False, True])
def test_fold_all(case, aux):
  spec, params = case
  folded, errors = check_fold(spec, params, auxiliary_centering=aux)
  assert max(errors) < 1e-4, errors
  n = spec.config.num_hidden_layers + 1
  assert (folded.report.num_sites, folded.report.num_folded) == (n, n)


@pytest.mark.reference
def test_matches_transformers(case):
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  spec, params = case
  if not spec.config.attention_bias:
    pytest.skip("HF Phi always has attention biases")
  c = spec.config
  hf_cfg = transformers.PhiConfig(
      vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
      num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
      partial_rotary_factor=c.partial_rotary_factor, rope_theta=c.rope_theta,
      layer_norm_eps=c.layer_norm_eps, hidden_act="gelu_new", max_position_embeddings=32,
      tie_word_embeddings=False)
  (ids,) = spec.example_inputs(2, 8)
  ref = torch_reference_logits(transformers.PhiForCausalLM(hf_cfg), params, "phi", ids)
  assert rel_err(ref, spec.apply_fn()(params, ids)) < 1e-5
