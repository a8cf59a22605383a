"""ViT: shapes, HF parameter layout, and exact folding of all 2L + 1 LayerNorms.

Why all fold (no auxiliary centering needed): the residual stream is
``concat([cls_token], conv(patches)) + position_embeddings`` plus, per block, the outputs of
``attention.output.dense`` and ``output.dense``. Each term is a parameter or a linear output
that can be centered along d; the shift this creates is constant along d at every token and
the stream's only consumers are LayerNorms over d (the 2L block LNs and the final LN), which
ignore it. So with the stream exactly zero-sum, every LN is an RMSNorm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err

from models.common import randomize_norms
from models.vit import CONFIGS, image_inputs

TINY = CONFIGS["vit-tiny"]


def _init(spec, seed: int = 0):
  """Jitted init: eager (op-by-op) init of the attention models costs seconds on CPU."""
  return jax.jit(lambda key: spec.init(key))(jax.random.key(seed))


def _random_params(spec, seed: int = 0):
  """Init, then move every 1-D leaf (LN γ/β, all biases) away from 1/0 (design brief §3)."""
  params = randomize_norms(_init(spec, seed), jax.random.key(seed + 1))
  gamma = params["vit"]["layernorm"]["scale"]
  assert float(jnp.std(gamma)) > 0.1, "γ must be non-uniform"
  return params


@pytest.mark.slow
def test_forward_shape():
  params = _init(TINY)
  assert jax.jit(TINY.apply_fn())(params, *TINY.example_inputs(3)).shape == (3, 10)


@pytest.mark.slow
def test_hf_layout():
  params = _init(TINY)
  vit = params["vit"]
  assert vit["embeddings"]["patch_embeddings"]["projection"]["kernel"].shape == (8, 8, 3, 32)
  assert vit["embeddings"]["cls_token"].shape == (1, 1, 32)
  assert vit["embeddings"]["position_embeddings"].shape == (1, 17, 32)
  layer = vit["encoder"]["layer"]["1"]
  assert set(layer) == {"layernorm_before", "attention", "layernorm_after", "intermediate", "output"}
  assert set(layer["attention"]["attention"]) == {"query", "key", "value"}
  assert "dense" in layer["attention"]["output"]
  assert params["classifier"]["kernel"].shape == (32, 10)


def test_vit_b16_abstract_init_matches_hf_count():
  """ViTForImageClassification (vit-base-patch16-224) has 86,567,656 parameters."""
  shapes = CONFIGS["vit-b/16"].abstract_init()
  leaves = jax.tree_util.tree_leaves(shapes)
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
  assert sum(int(np.prod(leaf.shape)) for leaf in leaves) == 86_567_656


@pytest.mark.slow
def test_wrong_image_size_is_rejected():
  params = _init(TINY)
  with pytest.raises(ValueError):
    jax.jit(TINY.apply_fn())(params, *TINY.example_inputs(1, 48))


@pytest.mark.parametrize("aux", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_fold_all_layernorms(aux: bool):
  import jaxfold

  params = _random_params(TINY)
  apply = jax.jit(TINY.apply_fn())
  folded = jaxfold.fold(params, apply, *TINY.example_inputs(2), auxiliary_centering=aux)

  layers = TINY.config.num_hidden_layers
  report = folded.report
  assert report.num_sites == 2 * layers + 1
  assert report.num_folded == 2 * layers + 1, [s.reason for s in report.sites if not s.folded]
  assert report.num_auxiliary == 0  # nothing starts at an LN output: no centering to add
  for batch, seed in ((2, 0), (5, 7)):  # traced shape and another batch / input
    (x,) = image_inputs(TINY.config, batch, seed=seed)
    assert rel_err(apply(params, x), jax.jit(folded.apply_fn)(folded.params, x)) < 1e-4
