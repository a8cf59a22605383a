"""BERT (post-LN): shapes, safetensors round-trip, fold equivalence and site counts.

Fold expectation.  The embedding LayerNorm's input is word + position + token_type, and its
only consumer is that LN, so centering the three tables folds it.  Every later LN's input is
`LN_prev(x) + branch(LN_prev(x))`: the residual carries an LN output, whose mean over
features is mean(γ ⊙ n) + mean(β) ≠ 0 for trained (here: random) γ, β; moreover that tensor
also feeds the Q/K/V projections (or the FFN), so it cannot be centered in place.  So without
auxiliary centering exactly 1 of 2L+1 sites folds.  With auxiliary centering each later fold
needs its own extra reduction (one per LN), so folds beyond the embedding LN can never
outnumber auxiliary centerings.
"""

import jax
import numpy as np
import pytest
from helpers import rel_err
from safetensors.numpy import save_file

import models
from models.common import check_fold, randomize_norms
from models.safetensors_io import load_safetensors, save_safetensors, to_hf_tensors

SPEC = models.get("bert-tiny")
CFG = SPEC.config


@pytest.fixture(scope="module")
def params():
  return randomize_norms(SPEC.init(jax.random.key(0)), jax.random.key(1))


@pytest.mark.slow
def test_forward_shapes(params):
  for b, s in [(1, 8), (3, 5)]:
    out = SPEC.apply_fn()(params, *SPEC.example_inputs(b, s))
    assert out.shape == (b, s, CFG.hidden_size)


def test_configs():
  assert CFG.layer_norm_eps == 1e-12
  mini = models.get("minilm-l6").config
  assert (mini.num_hidden_layers, mini.hidden_size, mini.num_attention_heads,
          mini.intermediate_size, mini.vocab_size) == (6, 384, 12, 1536, 30522)


def test_safetensors_roundtrip_and_prefix_variants(params, tmp_path):
  hf = {k: np.asarray(v) for k, v in to_hf_tensors(params, "bert").items()}
  assert {"embeddings.LayerNorm.weight", "encoder.layer.1.output.LayerNorm.bias",
          "encoder.layer.0.attention.output.dense.weight"} <= set(hf)
  # torch Linear weights are (out, in)
  assert hf["encoder.layer.0.intermediate.dense.weight"].shape == (CFG.intermediate_size,
                                                                    CFG.hidden_size)
  # BertForPreTraining-style file: `bert.` prefix, old gamma/beta names, extra buffers/heads.
  file = {"bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma")
          .replace("LayerNorm.bias", "LayerNorm.beta"): v for k, v in hf.items()}
  file["bert.embeddings.position_ids"] = np.arange(CFG.max_position_embeddings)[None]
  file["bert.pooler.dense.weight"] = np.zeros((CFG.hidden_size,) * 2, np.float32)
  file["cls.predictions.bias"] = np.zeros((CFG.vocab_size,), np.float32)
  for name, tensors in [("plain", hf), ("prefixed", file)]:
    save_file(tensors, str(tmp_path / f"{name}.safetensors"))  # torch-free writer
    loaded = load_safetensors(tmp_path / f"{name}.safetensors", "bert")
    jax.tree.map(np.testing.assert_array_equal, params, loaded)
  save_safetensors(params, tmp_path / "ours.safetensors", "bert")
  jax.tree.map(np.testing.assert_array_equal, params,
               load_safetensors(tmp_path / "ours.safetensors", "bert"))


def _fold(params, aux):
  return check_fold(SPEC, params, auxiliary_centering=aux)


def test_fold_only_embedding_ln(params):
  folded, errors = _fold(params, aux=False)
  assert max(errors) < 1e-4, errors
  report = folded.report
  assert report.num_sites == 2 * CFG.num_hidden_layers + 1
  assert report.num_folded == 1
  assert all(site.reason for site in report.sites if not site.folded)


def test_fold_auxiliary_post_ln_never_free(params):
  folded, errors = _fold(params, aux=True)
  assert max(errors) < 1e-4, errors
  report = folded.report
  assert report.num_sites == 2 * CFG.num_hidden_layers + 1
  assert report.num_folded >= 1
  assert report.num_folded - 1 <= report.num_auxiliary


@pytest.mark.reference
def test_matches_transformers(params):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  hf_cfg = transformers.BertConfig(
      vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_size,
      num_hidden_layers=CFG.num_hidden_layers, num_attention_heads=CFG.num_attention_heads,
      intermediate_size=CFG.intermediate_size, hidden_act="gelu",
      max_position_embeddings=CFG.max_position_embeddings, layer_norm_eps=CFG.layer_norm_eps)
  model = transformers.BertModel(hf_cfg, add_pooling_layer=False).eval()
  state = {k: torch.from_numpy(np.array(v)) for k, v in to_hf_tensors(params, "bert").items()}
  missing, unexpected = model.load_state_dict(state, strict=False)
  assert not [m for m in missing if "position_ids" not in m] and not unexpected
  ids, mask, types = SPEC.example_inputs(2, 8)
  t = lambda a: torch.from_numpy(np.array(a)).long()  # noqa: E731
  with torch.no_grad():
    ref = model(input_ids=t(ids), attention_mask=t(mask), token_type_ids=t(types))
  ours = SPEC.apply_fn()(params, ids, mask, types)
  keep = np.asarray(mask, bool)  # padded positions are not compared
  assert rel_err(ref.last_hidden_state.numpy()[keep], np.asarray(ours)[keep]) < 1e-5
