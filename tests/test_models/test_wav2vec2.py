"""Wav2Vec2 encoder: HF layout, and how far each layout folds.

* base (group-norm feature encoder, post-LN blocks): the per-channel GroupNorm normalizes over
  time, the feature projection's norm reads a GELU, and every block norm reads the previous
  norm's output γ ⊙ n + β: nothing folds, each with its reason.
* stable (layer-norm feature encoder, pre-LN blocks): the conv LayerNorms fold (bias-free
  convs), the projection's does not, the stream ``proj(x) + gelu(pos_conv(proj(x)))`` takes one
  auxiliary centering, after which every block norm and the final one fold.
"""

from __future__ import annotations

import jax
import pytest
from helpers import rel_err

import jaxfold
from models.common import randomize_norms
from models.wav2vec2 import CONFIGS, audio_inputs


def test_hf_layout():
  spec = CONFIGS["wav2vec2-stable-tiny-test"]
  p = jax.eval_shape(lambda k: spec.init(k, 1, 8), jax.random.key(0))
  assert set(p) == {"feature_extractor", "feature_projection", "encoder"}
  assert set(p["feature_extractor"]["conv_layers"]["1"]) == {"conv", "layer_norm"}
  assert set(p["feature_projection"]) == {"layer_norm", "projection"}
  assert set(p["encoder"]["pos_conv_embed"]) == {"weight_g", "weight_v", "bias"}
  assert set(p["encoder"]["layers"]["0"]) == {"attention", "layer_norm", "feed_forward", "final_layer_norm"}


def test_samples_for_frames():
  cfg = CONFIGS["wav2vec2-base"].config

  def frames(n):
    for k, s in zip(cfg.conv_kernel, cfg.conv_stride):
      n = (n - k) // s + 1
    return n
  assert frames(16_000) == 49          # 20 ms frames, 25 ms receptive field: 49 per second
  for f in (1, 49):
    assert frames(cfg.samples_for(f)) == f and frames(cfg.samples_for(f) - 1) == f - 1
  (x,) = audio_inputs(cfg, 1, 49, abstract=True)
  assert x.shape == (1, cfg.samples_for(49))


@pytest.mark.parametrize("name,sites,folded,aux", [("wav2vec2-tiny-test", 7, 0, 0),
                                                   ("wav2vec2-stable-tiny-test", 8, 7, 1)])
def test_fold(name, sites, folded, aux):
  spec = CONFIGS[name]
  params = randomize_norms(jax.jit(lambda k: spec.init(k, 1, 8))(jax.random.key(0)), jax.random.key(1))
  apply = jax.jit(spec.apply_fn())
  f = jaxfold.fold(params, apply, *spec.example_inputs(2, 8))
  rep = f.report
  assert (rep.num_sites, rep.num_folded, rep.num_auxiliary) == (sites, folded, aux), rep
  gn = [s for s in rep.sites if "conv_layers/0/layer_norm" in s.where]
  if name == "wav2vec2-tiny-test":
    assert not gn[0].folded and "not over its channels" in gn[0].reason, gn[0].reason
  for batch, frames, seed in ((2, 8, 0), (3, 11, 2)):
    (x,) = audio_inputs(spec.config, batch, frames, seed=seed)
    assert rel_err(apply(params, x), jax.jit(f.apply_fn)(f.params, x)) < 1e-5


@pytest.mark.parametrize("name,sites,folded", [("wav2vec2-base", 27, 0), ("wav2vec2-large-lv60", 57, 56)])
@pytest.mark.slow
def test_real_size_abstract_fold(name, sites, folded):
  spec = CONFIGS[name]
  f = jaxfold.fold(spec.abstract_init(1, 8), spec.apply_fn(), *spec.example_inputs(1, 8, abstract=True))
  assert (f.report.num_sites, f.report.num_folded) == (sites, folded), f.report
