"""OPT: pre-LN (125m-style) and post-LN with project_in/out (350m-style).

Fold expectations.
* Pre-LN (opt-tiny): stream = embed_tokens[ids] + embed_positions[pos+2] + Σ out_proj/fc2
  outputs; centering those makes every LN input zero-mean: all 2L+1 sites fold (tied head
  handled by the tool; only counts asserted).
* Post-LN (opt-350m-tiny): 2L sites (HF builds no decoder final_layer_norm when
  do_layer_norm_before=False).  Layer 0's attention LN sees h0 + attn(h0) where
  h0 = project_in(e) + pos also feeds q/k/v, so h0 cannot be centered in place; every later
  LN sees the previous LN's output on the residual (mean(γ ⊙ n) + mean(β) ≠ 0).  So without
  auxiliary centering no site folds; with it, each fold needs its own auxiliary centering.
"""

import jax
import numpy as np
import pytest
from helpers import rel_err
from safetensors.numpy import save_file

import models
from models.common import check_fold, randomize_norms, torch_reference_logits
from models.safetensors_io import load_safetensors, save_safetensors, to_hf_tensors

PRE = models.get("opt-tiny")
POST = models.get("opt-350m-tiny")


@pytest.fixture(scope="module", params=["opt-tiny", "opt-350m-tiny"])
def case(request):
  spec = models.get(request.param)
  return spec, randomize_norms(spec.init(jax.random.key(0)), jax.random.key(1))


@pytest.mark.slow
def test_forward_shapes(case):
  spec, params = case
  for b, s in [(1, 8), (3, 5)]:
    assert spec.apply_fn()(params, *spec.example_inputs(b, s)).shape == (
        b, s, spec.config.vocab_size)


def test_layouts():
  pre, post = PRE.abstract_init(), POST.abstract_init()
  assert "final_layer_norm" in pre and "project_in" not in pre
  assert "final_layer_norm" not in post
  assert post["project_in"]["kernel"].shape == (16, 32)
  assert post["embed_positions"]["embedding"].shape[0] == POST.config.max_position_embeddings + 2
  big = models.get("opt-350m").config
  assert (big.word_embed_proj_dim, big.hidden_size, big.do_layer_norm_before) == (512, 1024, False)
  assert PRE.config.layer_norm_eps == 1e-5


def test_safetensors_roundtrip(case, tmp_path):
  spec, params = case
  hf = {k: np.asarray(v) for k, v in to_hf_tensors(params, "opt").items()}
  assert "model.decoder.layers.1.self_attn_layer_norm.weight" in hf
  assert hf["model.decoder.layers.0.fc1.weight"].shape == (spec.config.ffn_dim,
                                                           spec.config.hidden_size)
  variants = {
      "causal_lm": {**hf, "lm_head.weight": hf["model.decoder.embed_tokens.weight"]},
      "opt_model": {k.replace("model.decoder.", "decoder."): v for k, v in hf.items()},
  }
  for name, tensors in variants.items():
    save_file(tensors, str(tmp_path / f"{name}.safetensors"))  # torch-free writer
    jax.tree.map(np.testing.assert_array_equal, params,
                 load_safetensors(tmp_path / f"{name}.safetensors", "opt"))
  save_safetensors(params, tmp_path / "ours.safetensors", "opt")
  jax.tree.map(np.testing.assert_array_equal, params,
               load_safetensors(tmp_path / "ours.safetensors", "opt"))


def _fold(spec, params, aux):
  return check_fold(spec, params, auxiliary_centering=aux)


def test_fold_pre_ln_all(case):
  spec, params = case
  if spec is not PRE:
    pytest.skip("pre-LN expectation")
  folded, errors = _fold(spec, params, aux=True)
  assert max(errors) < 1e-4, errors
  n = 2 * spec.config.num_hidden_layers + 1
  assert (folded.report.num_sites, folded.report.num_folded) == (n, n)


@pytest.mark.parametrize("aux", [False, True])
def test_fold_post_ln(case, aux):
  spec, params = case
  if spec is not POST:
    pytest.skip("post-LN expectation")
  folded, errors = _fold(spec, params, aux=aux)
  assert max(errors) < 1e-4, errors
  report = folded.report
  assert report.num_sites == 2 * spec.config.num_hidden_layers
  if aux:
    assert report.num_folded <= report.num_auxiliary
  else:
    assert report.num_folded == 0
  assert all(site.reason for site in report.sites if not site.folded)


@pytest.mark.reference
def test_matches_transformers(case):
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  spec, params = case
  c = spec.config
  hf_cfg = transformers.OPTConfig(
      vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
      num_attention_heads=c.num_attention_heads, ffn_dim=c.ffn_dim,
      max_position_embeddings=c.max_position_embeddings,
      word_embed_proj_dim=c.embed_dim, do_layer_norm_before=c.do_layer_norm_before,
      activation_function="relu", enable_bias=True, pad_token_id=1)
  (ids,) = spec.example_inputs(2, 8)
  ref = torch_reference_logits(transformers.OPTForCausalLM(hf_cfg), params, "opt", ids)
  assert rel_err(ref, spec.apply_fn()(params, ids)) < 1e-5
