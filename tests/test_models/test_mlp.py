"""LayerNorm MLP: shapes and folding of every LayerNorm.

Why all fold: each LayerNorm reads one Dense output that nothing else consumes; centering that
Dense's kernel and bias along its output axis shifts the LN input by a per-row constant the
LN ignores and makes it exactly zero-mean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import rel_err

from models.common import randomize_norms
from models.mlp import CONFIGS, tabular_inputs

SPEC = CONFIGS["mlp-small"]


def _init(spec, seed: int = 0):
  """Jitted init: eager (op-by-op) init of the attention models costs seconds on CPU."""
  return jax.jit(lambda key: spec.init(key))(jax.random.key(seed))


def _random_params(seed: int = 0):
  """Init, then move every 1-D leaf (LN γ/β, all biases) away from 1/0 (design brief §3)."""
  params = randomize_norms(_init(SPEC, seed), jax.random.key(seed + 1))
  assert float(jnp.std(params["blocks"]["0"]["norm"]["scale"])) > 0.1
  return params


@pytest.mark.slow
def test_forward_shape():
  params = _init(SPEC)
  assert jax.jit(SPEC.apply_fn())(params, *SPEC.example_inputs(4)).shape == (4, 10)
  assert set(params) == {"blocks", "head"}
  assert set(params["blocks"]["1"]) == {"dense", "norm"}


def test_abstract_init_allocates_nothing():
  leaves = jax.tree_util.tree_leaves(SPEC.abstract_init())
  assert leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)


def test_fold_every_layernorm():
  import jaxfold

  params = _random_params()
  apply = jax.jit(SPEC.apply_fn())
  folded = jaxfold.fold(params, apply, *SPEC.example_inputs(3), auxiliary_centering=False)

  n = len(SPEC.config.hidden)
  assert folded.report.num_sites == n
  assert folded.report.num_folded == n, [s.reason for s in folded.report.sites if not s.folded]
  assert folded.report.num_auxiliary == 0
  for batch, seed in ((3, 0), (8, 5)):
    (x,) = tabular_inputs(SPEC.config, batch, seed=seed)
    assert rel_err(apply(params, x), jax.jit(folded.apply_fn)(folded.params, x)) < 1e-4
