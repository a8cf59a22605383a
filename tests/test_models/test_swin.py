"""Swin: shapes, HF parameter layout, window helpers, and which LayerNorms may fold.

The math, for ``swin-tiny-test`` (depths (2, 1): 1 + 4 + 1 + 2 + 1 = 9 LayerNorms):

1. ``embeddings.norm`` reads the patch conv, whose only consumer it is. Centering the conv's
   output channels shifts each position by a constant along C, which the LN ignores:
   FOLDS (with or without auxiliary centering).
2. The stage-0 stream starts at ``embeddings.norm``'s output γ⊙n + β, whose mean over C is
   γ·n/C + mean(β) ≠ 0 for non-uniform γ, so its block LNs cannot lose their mean as is.
   Auxiliary centering of that tensor (or centering the blocks' dense outputs) shifts the
   stream at each position by a constant along C. But the stream also feeds the patch
   merging, which concatenates 4 *different* positions along channels: the shift becomes
   (c₀, c₁, c₂, c₃) piecewise along 4C, not constant along the 4C axes the merging LN
   reduces, so it changes that LN's output. Obligation 1 fails for every producer of a
   stream that reaches a patch merging. Hence stage-0 block LNs (4) do NOT fold, with or
   without auxiliary centering.
3. The merging LN reads the concatenated stage-0 stream, which is not zero-sum (2.), and no
   centering upstream is allowed (2.): does NOT fold. (Its input *would* be zero-sum over 4C
   if every part were zero-sum over C, but that needs the centering ruled out in 2.;
   centering its own input would cost the reduction it saves.)
4. The stage-1 (last) stream starts at ``downsample.reduction`` — a bias-free Linear, so
   centerable along 2C — plus centered block outputs, and reaches only LNs over 2C at one
   position (block LNs and the final ``layernorm``): 2 + 1 = 3 FOLD without auxiliary
   centering.

So 4 of 9 fold in both modes and auxiliary centering adds nothing. A single-stage Swin (no
merging) shows auxiliary centering at work: the stream starts at ``embeddings.norm``'s
output and reaches only per-position LNs, so without it only ``embeddings.norm`` folds, and
with one auxiliary centering all 2·depth + 2 LNs fold.

(Brief for this piece suggested "with auxiliary centering, later LNs are foldable" for
Swin; that holds only for stages that do not feed a patch merging, per 2.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err

from models.common import randomize_norms
from models.swin import (
    CONFIGS,
    SwinConfig,
    SwinForImageClassification,
    relative_position_index,
    shifted_window_mask,
    window_partition,
    window_reverse,
)
from models.vit import ImageModelSpec, image_inputs

TINY = CONFIGS["swin-tiny-test"]
ONE_STAGE = ImageModelSpec(
    name="swin-one-stage", family="swin", build=SwinForImageClassification,
    config=SwinConfig(image_size=32, embed_dim=16, depths=(2,), num_heads=(2,), window_size=4, num_labels=10))


def _init(spec, seed: int = 0):
  """Jitted init: eager (op-by-op) init of the attention models costs seconds on CPU."""
  return jax.jit(lambda key: spec.init(key))(jax.random.key(seed))


def _with_row_offsets(params, rng: jax.Array, scale: float = 0.3):
  """Add a random constant to each input row of every kernel.

  Trained kernels have columns that are not zero-mean, so x·W has a mean over the output
  channels that varies from position to position. That is exactly what makes centering a
  stage-0 producer unsound (the merging LN sees a different shift in each of its 4 parts);
  with init-like kernels the resulting error is ~1e-6 and would hide under the tolerance,
  with these offsets it is ~1e-2 (measured), while sound folds stay ~1e-6.
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(rng, len(leaves))
  out = [leaf + scale * jax.random.normal(key, leaf.shape[:-1] + (1,)) if path[-1].key == "kernel" else leaf
         for (path, leaf), key in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(treedef, out)


def _random_params(spec, seed: int = 0):
  """Init, move every 1-D leaf (LN γ/β, all biases) away from 1/0 (design brief §3), and
  give kernels non-zero column means."""
  params = randomize_norms(_init(spec, seed), jax.random.key(seed + 1))
  params = _with_row_offsets(params, jax.random.key(seed + 2))
  assert float(jnp.std(params["swin"]["embeddings"]["norm"]["scale"])) > 0.1
  return params


def _fold_and_check(spec, aux: bool):
  import jaxfold

  params = _random_params(spec)
  apply = jax.jit(spec.apply_fn())
  folded = jaxfold.fold(params, apply, *spec.example_inputs(2), auxiliary_centering=aux)
  for batch, seed in ((2, 0), (3, 4)):
    (x,) = image_inputs(spec.config, batch, seed=seed)
    assert rel_err(apply(params, x), jax.jit(folded.apply_fn)(folded.params, x)) < 1e-4
  return folded.report


@pytest.mark.slow
def test_forward_shape():
  params = _init(TINY)
  assert jax.jit(TINY.apply_fn())(params, *TINY.example_inputs(3)).shape == (3, 10)


@pytest.mark.slow
def test_hf_layout():
  swin = _init(TINY)["swin"]
  assert swin["embeddings"]["patch_embeddings"]["projection"]["kernel"].shape == (4, 4, 3, 16)
  block = swin["encoder"]["layers"]["0"]["blocks"]["1"]
  assert set(block) == {"layernorm_before", "attention", "layernorm_after", "intermediate", "output"}
  assert set(block["attention"]["self"]) == {"query", "key", "value", "relative_position_bias_table"}
  assert block["attention"]["self"]["relative_position_bias_table"].shape == (49, 2)
  down = swin["encoder"]["layers"]["0"]["downsample"]
  assert down["norm"]["scale"].shape == (64,) and set(down["reduction"]) == {"kernel"}  # no bias
  assert "downsample" not in swin["encoder"]["layers"]["1"]
  assert swin["layernorm"]["scale"].shape == (32,)


def test_swin_t_abstract_init_matches_hf_count():
  """SwinForImageClassification (swin-tiny-patch4-window7-224) has 28,288,354 parameters."""
  leaves = jax.tree_util.tree_leaves(CONFIGS["swin-t"].abstract_init())
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
  assert sum(int(np.prod(leaf.shape)) for leaf in leaves) == 28_288_354


def test_window_helpers():
  x = np.arange(2 * 8 * 8 * 3, dtype=np.float32).reshape(2, 8, 8, 3)
  np.testing.assert_array_equal(window_reverse(window_partition(x, 4), 4, 8, 8), x)
  index = relative_position_index(4)
  assert index.shape == (16, 16) and index.min() == 0 and index.max() == 48
  assert np.all(np.diag(index) == 24)  # zero offset sits at the table's centre
  mask = shifted_window_mask(8, 8, 4, 2)
  assert mask.shape == (4, 16, 16) and np.all(mask[0] == 0) and np.any(mask[3] != 0)
  assert shifted_window_mask(8, 8, 4, 0) is None


@pytest.mark.parametrize("aux", [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.slow
def test_fold_tiny(aux: bool):
  report = _fold_and_check(TINY, aux)
  assert report.num_sites == 9
  assert report.num_folded == 4, [(s.folded, s.reason) for s in report.sites]
  assert report.num_auxiliary == 0


@pytest.mark.parametrize("aux", [pytest.param(False, marks=pytest.mark.slow), True])
def test_fold_single_stage(aux: bool):
  report = _fold_and_check(ONE_STAGE, aux)
  assert report.num_sites == 6
  assert report.num_folded == (6 if aux else 1), [(s.folded, s.reason) for s in report.sites]
  assert report.num_auxiliary == (1 if aux else 0)
