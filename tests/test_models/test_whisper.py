"""Whisper encoder: HF layout, and every norm folding after one auxiliary centering.

The stream starts at ``gelu(conv2(gelu(conv1(x)))) + embed_positions``: no parameter centering
makes a GELU's output zero-mean, so without auxiliary centering nothing folds; one auxiliary
centering of that sum folds all 2L + 1 norms.
"""

from __future__ import annotations

import jax
import pytest
from helpers import rel_err

import jaxfold
from models.common import randomize_norms
from models.whisper import CONFIGS, mel_inputs

TINY = CONFIGS["whisper-tiny-test"]


def test_hf_layout():
  p = jax.eval_shape(lambda k: TINY.init(k, 1, 16), jax.random.key(0))
  assert set(p) == {"conv1", "conv2", "embed_positions", "layers", "layer_norm"}
  layer = p["layers"]["0"]
  assert set(layer) == {"self_attn_layer_norm", "self_attn", "final_layer_norm", "fc1", "fc2"}
  assert "bias" not in layer["self_attn"]["k_proj"]


@pytest.mark.parametrize("aux,folded", [(True, 5), (False, 0)])
def test_fold(aux, folded):
  params = randomize_norms(jax.jit(lambda k: TINY.init(k, 1, 16))(jax.random.key(0)), jax.random.key(1))
  apply = jax.jit(TINY.apply_fn())
  f = jaxfold.fold(params, apply, *TINY.example_inputs(2, 16), auxiliary_centering=aux)
  assert (f.report.num_sites, f.report.num_folded, f.report.num_auxiliary) == (5, folded, int(aux)), f.report
  for batch, frames, seed in ((2, 16, 0), (3, 10, 4)):
    (x,) = mel_inputs(TINY.config, batch, frames, seed=seed)
    assert rel_err(apply(params, x), jax.jit(f.apply_fn)(f.params, x)) < 1e-5


def test_real_size_abstract_fold():
  spec = CONFIGS["whisper-base-encoder"]
  f = jaxfold.fold(spec.abstract_init(1, 64), spec.apply_fn(), *spec.example_inputs(1, 64, abstract=True))
  assert (f.report.num_sites, f.report.num_folded, f.report.num_auxiliary) == (13, 13, 1), f.report
