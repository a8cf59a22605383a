"""GroupNorm CNNs: standard GroupNorm cannot fold, per-position GroupNorm always can.

Centering a conv's output channels within each group shifts its output by c(b, h, w, g):
constant over the C/G in-group channels, varying over (H, W). A norm ignores a shift only if
every axis it reduces is an axis the shift is constant along (design brief §3):

* standard GroupNorm reduces (H, W, C/G) ⊄ {C/G}: the shift is not ignored, and no weight
  centering makes the input zero-sum over H and W → 0 of 2 fold, even with auxiliary
  centering (that would cost the very reduction it saves);
* per-position GroupNorm reduces C/G only ⊆ {C/G}: both norms fold by per-group centering.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from helpers import rel_err

from models.cnn import CONFIGS
from models.common import randomize_norms
from models.vit import image_inputs


def _init(spec, seed: int = 0):
  """Jitted init: eager (op-by-op) init of the attention models costs seconds on CPU."""
  return jax.jit(lambda key: spec.init(key))(jax.random.key(seed))


def _random_params(spec, seed: int = 0):
  """Init, then move every 1-D leaf (GN γ/β, all biases) away from 1/0 (design brief §3)."""
  params = randomize_norms(_init(spec, seed), jax.random.key(seed + 1))
  assert float(jnp.std(params["norm_0"]["scale"])) > 0.1
  return params


def _fold_and_check(spec):
  import jaxfold

  params = _random_params(spec)
  apply = jax.jit(spec.apply_fn())
  folded = jaxfold.fold(params, apply, *spec.example_inputs(2), auxiliary_centering=True)
  for batch, seed in ((2, 0), (5, 3)):
    (x,) = image_inputs(spec.config, batch, seed=seed)
    assert rel_err(apply(params, x), jax.jit(folded.apply_fn)(folded.params, x)) < 1e-4
  return folded.report


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.slow
def test_forward_shape(name: str):
  spec = CONFIGS[name]
  params = _init(spec)
  assert jax.jit(spec.apply_fn())(params, *spec.example_inputs(3)).shape == (3, 10)
  assert jax.jit(spec.apply_fn())(params, *spec.example_inputs(1, 24)).shape == (1, 10)  # any size
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree_util.tree_leaves(spec.abstract_init()))


@pytest.mark.slow
def test_variants_differ_only_in_statistics():
  std, per_pos = CONFIGS["cnn-gn"], CONFIGS["cnn-gn-per-position"]
  params = _init(std)
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(_init(per_pos))
  (x,) = std.example_inputs(2)
  assert rel_err(std.apply_fn()(params, x), per_pos.apply_fn()(params, x)) > 1e-3


@pytest.mark.slow
def test_standard_groupnorm_does_not_fold():
  report = _fold_and_check(CONFIGS["cnn-gn"])
  assert report.num_sites == 2
  assert report.num_folded == 0
  assert report.num_auxiliary == 0
  for site in report.sites:
    assert not site.folded
    # The refusal must be about the spatial axes the norm reduces over.
    assert re.search(r"spatial|\bH\b|\bW\b|ax[ei]s", site.reason, re.IGNORECASE), site.reason


def test_per_position_groupnorm_folds():
  report = _fold_and_check(CONFIGS["cnn-gn-per-position"])
  assert report.num_sites == 2
  assert report.num_folded == 2, [s.reason for s in report.sites if not s.folded]
  assert report.num_auxiliary == 0
