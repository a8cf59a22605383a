"""CLIP vision tower: HF layout, and how far folding goes with each output.

Returning the projected image features, every norm folds: ``pre_layrnorm`` by centering
the class embedding, the patch kernel's output channels and the position table, the rest
after one auxiliary centering of ``pre_layrnorm``'s output (the stream's start). Returning
``last_hidden_state`` (the un-normalized stream) as ``FlaxCLIPVisionModel`` does, any
centering of the stream would change that output: only ``pre_layrnorm`` folds.
"""

from __future__ import annotations

import jax
import pytest
from helpers import rel_err

import jaxfold
from models.clip import CONFIGS
from models.common import randomize_norms
from models.vit import image_inputs


def _params(spec, seed=0):
  params = jax.jit(lambda k: spec.init(k))(jax.random.key(seed))
  return randomize_norms(params, jax.random.key(seed + 1))


def test_hf_layout():
  p = jax.eval_shape(lambda k: CONFIGS["clip-vit-tiny"].init(k), jax.random.key(0))
  vm = p["vision_model"]
  assert set(vm) == {"embeddings", "pre_layrnorm", "encoder", "post_layernorm"}
  assert vm["embeddings"]["class_embedding"].shape == (32,)
  assert vm["embeddings"]["patch_embedding"]["kernel"].shape == (8, 8, 3, 32)
  assert vm["embeddings"]["position_embedding"]["embedding"].shape == (17, 32)
  layer = vm["encoder"]["layers"]["1"]
  assert set(layer) == {"layer_norm1", "self_attn", "layer_norm2", "mlp"}
  assert set(layer["self_attn"]) == {"q_proj", "k_proj", "v_proj", "out_proj"}
  assert p["visual_projection"]["kernel"].shape == (32, 16)


@pytest.mark.parametrize("name,folded,aux", [("clip-vit-tiny", 6, 1), ("clip-vit-tiny-hidden", 1, 0)])
def test_fold(name, folded, aux):
  spec = CONFIGS[name]
  params = _params(spec)
  apply = jax.jit(spec.apply_fn())
  f = jaxfold.fold(params, apply, *spec.example_inputs(2))
  assert (f.report.num_sites, f.report.num_folded, f.report.num_auxiliary) == (6, folded, aux), f.report
  if name.endswith("hidden"):
    assert all("program output #0" in s.reason for s in f.report.sites[1:]), f.report
  for batch, seed in ((2, 0), (3, 5)):
    (x,) = image_inputs(spec.config, batch, seed=seed)
    assert rel_err(apply(params, x), jax.jit(f.apply_fn)(f.params, x)) < 1e-5


@pytest.mark.parametrize("name,folded", [("clip-vit-b/32", 26), ("clip-vit-b/32-hidden", 1)])
@pytest.mark.slow
def test_real_size_abstract_fold(name, folded):
  spec = CONFIGS[name]
  f = jaxfold.fold(spec.abstract_init(), spec.apply_fn(), *spec.example_inputs(1, abstract=True))
  assert (f.report.num_sites, f.report.num_folded) == (26, folded), f.report
