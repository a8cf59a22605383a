"""GPT-2 (linen and nnx): shapes, safetensors round-trip, fold equivalence and site counts.

Fold expectation (pre-LN, stream = wte[ids] + wpe[pos] + Σ c_proj outputs): centering the
two tables and every c_proj makes the stream zero-mean, so all 2L+1 LayerNorms fold.  The
tied head (wte.attend) needs an auxiliary centering or an untied copy; either is fine here,
so only num_sites and num_folded are asserted.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import rel_err
from safetensors.numpy import save_file

import models
from models.common import check_fold, randomize_norms
from models.gpt2_nnx import GPT2LMHeadModelNNX, make_apply_fn, split_params
from models.safetensors_io import load_safetensors, save_safetensors, to_hf_tensors

SPEC = models.get("gpt2-tiny")
CFG = SPEC.config


@pytest.fixture(scope="module")
def params():
  return randomize_norms(SPEC.init(jax.random.key(0)), jax.random.key(1))


@pytest.mark.slow
def test_forward_shapes(params):
  for b, s in [(1, 8), (3, 5)]:
    out = SPEC.apply_fn()(params, *SPEC.example_inputs(b, s))
    assert out.shape == (b, s, CFG.vocab_size) and out.dtype == jnp.float32


def test_epsilon_and_layout():
  assert CFG.layer_norm_epsilon == 1e-5
  p = SPEC.abstract_init()
  assert p["h_0"]["attn"]["c_attn"]["kernel"].shape == (CFG.n_embd, 3 * CFG.n_embd)
  assert "lm_head" not in p  # tied head


def test_abstract_init_allocates_nothing():
  shapes = models.get("gpt-j-6b-sized").abstract_init(1, 8)
  leaves = jax.tree.leaves(shapes)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  assert 6.0e9 < sum(x.size for x in leaves) < 6.1e9


def test_safetensors_roundtrip(params, tmp_path):
  hf = {k: np.asarray(v) for k, v in to_hf_tensors(params, "gpt2").items()}
  # HF GPT-2 Conv1D weights are stored (in, out): no transpose.
  assert {"h.0.ln_1.weight", "h.1.ln_2.bias", "ln_f.weight", "wpe.weight"} <= set(hf)
  assert hf["h.0.attn.c_attn.weight"].shape == (CFG.n_embd, 3 * CFG.n_embd)
  assert hf["h.1.mlp.c_fc.weight"].shape == (CFG.n_embd, CFG.inner)
  # A GPT2LMHeadModel-style file: `transformer.` prefix, tied lm_head, mask buffers.
  file = {"transformer." + k: v for k, v in hf.items()}
  file["lm_head.weight"] = hf["wte.weight"]
  file["transformer.h.0.attn.bias"] = np.tril(np.ones((1, 1, 4, 4), np.float32))
  save_file(file, str(tmp_path / "hf.safetensors"))  # torch-free writer
  loaded = load_safetensors(tmp_path / "hf.safetensors", "gpt2")
  jax.tree.map(np.testing.assert_array_equal, params, loaded)
  save_safetensors(loaded, tmp_path / "ours.safetensors", "gpt2")
  again = load_safetensors(tmp_path / "ours.safetensors", "gpt2")
  jax.tree.map(np.testing.assert_array_equal, params, again)


def test_untied_head_rejected(params, tmp_path):
  hf = {k: np.asarray(v) for k, v in to_hf_tensors(params, "gpt2").items()}
  hf["lm_head.weight"] = hf["wte.weight"] + 1.0
  save_file(hf, str(tmp_path / "bad.safetensors"))
  with pytest.raises(ValueError, match="not tied"):
    load_safetensors(tmp_path / "bad.safetensors", "gpt2")


def test_bf16_dtype_kept(params, tmp_path):
  p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  save_safetensors(p16, tmp_path / "bf16.safetensors", "gpt2")
  loaded = load_safetensors(tmp_path / "bf16.safetensors", "gpt2")
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(loaded))


def _fold(params, spec=SPEC, aux=True):
  return check_fold(spec, params, auxiliary_centering=aux)


def test_fold_all_sites_and_save_folded(params, tmp_path):
  folded, errors = _fold(params)
  assert max(errors) < 1e-4, errors
  assert folded.report.num_sites == 2 * CFG.n_layer + 1
  assert folded.report.num_folded == 2 * CFG.n_layer + 1
  # Folded parameters can be written back in HF naming and read again unchanged.
  save_safetensors(folded.params.params, tmp_path / "folded.safetensors", "gpt2")
  again = load_safetensors(tmp_path / "folded.safetensors", "gpt2")
  jax.tree.map(np.testing.assert_array_equal, folded.params.params, again)


# ---------------------------------------------------------------- nnx


def _nnx_model():
  return GPT2LMHeadModelNNX(CFG, rngs=nnx.Rngs(0))


def test_nnx_tree_matches_linen_and_outputs_agree(params):
  graphdef, nnx_params = split_params(_nnx_model())
  assert jax.tree.structure(nnx_params) == jax.tree.structure(params)
  apply = make_apply_fn(graphdef)
  (ids,) = SPEC.example_inputs(2, 8)
  assert rel_err(SPEC.apply_fn()(params, ids), apply(params, ids)) < 1e-6


def test_nnx_spec_and_fold(params):
  spec = models.get("gpt2-nnx-tiny")
  p = randomize_norms(spec.init(jax.random.key(3)), jax.random.key(4))
  out = spec.apply_fn()(p, *spec.example_inputs(3, 5))
  assert out.shape == (3, 5, CFG.vocab_size)
  folded, errors = _fold(p, spec)
  assert max(errors) < 1e-4, errors
  assert folded.report.num_sites == folded.report.num_folded == 2 * CFG.n_layer + 1


# ---------------------------------------------------------------- independent reference


@pytest.mark.reference
def test_matches_transformers(params):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  hf_cfg = transformers.GPT2Config(vocab_size=CFG.vocab_size, n_positions=CFG.n_positions,
                                   n_embd=CFG.n_embd, n_layer=CFG.n_layer, n_head=CFG.n_head,
                                   activation_function="gelu_new")
  model = transformers.GPT2LMHeadModel(hf_cfg).eval()
  state = {k: np.asarray(v) for k, v in to_hf_tensors(params, "gpt2").items()}
  missing, _ = model.transformer.load_state_dict(
      {k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=False)
  assert not [m for m in missing if not m.endswith("attn.bias")]
  (ids,) = SPEC.example_inputs(2, 8)
  with torch.no_grad():
    ref = model(torch.from_numpy(np.array(ids)).long()).logits.numpy()
  assert rel_err(ref, SPEC.apply_fn()(params, ids)) < 1e-5
