"""VMamba (v2 structure): the cross-scan, the selective scan, and which LayerNorms fold.

The argument, for a VMamba with S stages of depths d_0..d_{S-1} (2 + 3·Σd + (S-1) + 1 LNs;
the paper's configuration (2, 2, 9, 2) has 51):

1. The stem's two LNs and the S-1 downsampling LNs read a convolution that nothing else
   reads: centering its output channels shifts each position by a constant along C, which
   the LN ignores. FOLD.
2. The residual stream of stage s < S-1 starts at an LN output (γ⊙n + β, not zero-mean for
   non-uniform γ) and feeds the next downsampling conv, a contraction over C: a per-position
   shift of the stream becomes a shift that varies along the conv's output channels, which
   the downsampling LN does not ignore. So neither an auxiliary centering of the stream nor
   centering the blocks' out_proj/fc2 is allowed: the 2·d_s block LNs (``norm``, ``norm2``)
   do NOT fold.
3. The last stage's stream reaches only per-position LNs (its blocks' and the head's): with
   one auxiliary centering of the last downsampling LN's output, 2·d_{S-1} + 1 LNs FOLD
   (without it they do not: the stream starts at that LN's output).
4. Every SS2D ``out_norm`` reads the selective scan's output, a product with factors (C_t,
   exp(Δ_t A)) that vary along its channels and depend on the input: does NOT fold.

So 2 + (S-1) + 2·d_{S-1} + 1 fold: 10 of 51 for (2, 2, 9, 2), where the paper counts 36.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err

import jaxfold
import models
from jaxfold.benchmarking import paper_choice
from models.vit import image_inputs
from models.vmamba import CONFIGS, cross_merge, cross_scan, num_layer_norms, selective_scan

MINI = CONFIGS["vmamba-mini"]      # depths (1, 1, 1, 1): 18 LNs, tiny widths
PAPER = CONFIGS["vmamba-t"]        # depths (2, 2, 9, 2) at 224 px: 51 LNs (analysed abstractly)
_RUN_MINI = jax.jit(MINI.apply_fn())  # one compile per input shape, shared by the tests

SCAN_REASON = "a product with a factor that varies along the normalized axes"
STREAM_REASON = "γ ⊙ n + β is not zero-mean"


def _expected_folded(config, aux: bool) -> set[str]:
  """Module paths of the LNs that fold, by the argument in the module docstring."""
  stages = len(config.depths)
  out = {"VMamba/patch_embed/norm1", "VMamba/patch_embed/norm2"}
  out |= {f"VMamba/layers/{s}/downsample/norm" for s in range(stages - 1)}
  if aux:
    last = stages - 1
    out |= {f"VMamba/layers/{last}/blocks/{b}/{n}" for b in range(config.depths[last]) for n in ("norm", "norm2")}
    out.add("VMamba/classifier/norm")
  return out


def _params64(spec, seed: int = 0):
  """Random weights (γ non-uniform, β and biases with non-zero mean) in float64."""
  return jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), models.random_params(spec, seed=seed))


def _inputs64(spec, batch: int, size: int | None = None, seed: int = 0):
  (x,) = image_inputs(spec.config, batch, size, seed=seed)
  return x.astype(jnp.float64)


def test_cross_scan_orders_and_merge():
  x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)  # (b, h, w, d)
  xs = np.asarray(cross_scan(jnp.asarray(x)))
  assert xs.shape == (2, 4, 5, 12)
  np.testing.assert_array_equal(xs[:, 0], x.reshape(2, 12, 5).transpose(0, 2, 1))          # row-major
  np.testing.assert_array_equal(xs[:, 1], x.transpose(0, 2, 1, 3).reshape(2, 12, 5).transpose(0, 2, 1))
  np.testing.assert_array_equal(xs[:, 2], xs[:, 0, :, ::-1])
  np.testing.assert_array_equal(xs[:, 3], xs[:, 1, :, ::-1])
  # Each direction read back in place: merging the scan itself sums 4 copies of x.
  np.testing.assert_array_equal(np.asarray(cross_merge(jnp.asarray(xs), 3, 4)), 4 * x)


def test_selective_scan_matches_the_recurrence(x64):
  rng = np.random.default_rng(0)
  b, k, d, n, length = 2, 4, 3, 2, 5
  u, delta = rng.normal(size=(b, k, d, length)), np.abs(rng.normal(size=(b, k, d, length)))
  A, D = -np.exp(rng.normal(size=(k, d, n))), rng.normal(size=(k, d))
  B, C = rng.normal(size=(b, k, n, length)), rng.normal(size=(b, k, n, length))
  want = np.zeros((b, k, d, length))
  h = np.zeros((b, k, d, n))
  for t in range(length):
    h = np.exp(delta[..., t, None] * A) * h + (delta[..., t] * u[..., t])[..., None] * B[:, :, None, :, t]
    want[..., t] = np.einsum("bkdn,bkn->bkd", h, C[..., t]) + D * u[..., t]
  got = selective_scan(*map(jnp.asarray, (u, delta, A, B, C, D)))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


def test_paper_config_counts_51_layer_norms_and_is_registered():
  assert num_layer_norms(PAPER.config) == 51
  assert {"vmamba-t", "vmamba-tiny", "vmamba-mini"} <= set(models.names())
  assert models.get("vmamba-tiny").config.depths == PAPER.config.depths


@pytest.mark.parametrize("aux", [False, True])
def test_paper_config_fold_count_and_reasons(aux: bool):
  """The paper's configuration at 224 px, analysed without weights (abstract parameters)."""
  params = PAPER.abstract_init(1)
  report = jaxfold.fold(params, PAPER.apply_fn(), *PAPER.example_inputs(1, abstract=True),
                        auxiliary_centering=aux).report
  assert report.num_sites == num_layer_norms(PAPER.config) == 51
  folded = {s.where for s in report.sites if s.folded}
  assert folded == _expected_folded(PAPER.config, aux)
  assert report.num_folded == (10 if aux else 5)
  assert report.num_auxiliary == (1 if aux else 0)
  for s in report.sites:
    if s.folded:
      continue
    if s.where.endswith("/op/out_norm"):
      assert SCAN_REASON in s.reason and "selective_scan" in s.reason, s
    else:  # a block or head LN of a stage's stream, which starts at an LN output
      assert ("/blocks/" in s.where or s.where == "VMamba/classifier/norm") and STREAM_REASON in s.reason, s
      if aux:  # the stream of a stage that is not the last reaches the next downsampling LN
        assert "would change the result" in s.reason and "downsample/norm" in s.reason, s


def test_exact_fold_float64_at_two_resolutions(x64):
  spec = MINI
  params, fn = _params64(spec), spec.apply_fn()
  folded = jaxfold.fold(params, fn, _inputs64(spec, 2), auxiliary_centering=True)
  assert {s.where for s in folded.report.sites if s.folded} == _expected_folded(spec.config, True)
  run_folded = jax.jit(folded.apply_fn)
  for batch, size, seed in ((1, 32, 1), (3, 64, 2)):
    x = _inputs64(spec, batch, size, seed)
    assert rel_err(_RUN_MINI(params, x), run_folded(folded.params, x)) < 1e-12, (batch, size)


def test_paper_baseline_is_not_exact(x64):
  """Removing every LN's mean (the paper's choice), or the paper's 36 of 51 (every LN but
  ``out_norm``), changes the logits; jaxfold's fold of the same parameters does not."""
  spec = MINI
  params, fn = _params64(spec), spec.apply_fn()
  x = _inputs64(spec, 1, 32, 1)
  want = _RUN_MINI(params, x)
  report = jaxfold.fold(params, fn, x, auxiliary_centering=True).report
  out_all, n_all = paper_choice(params, fn, x)
  paper_sites = [s.index for s in report.sites if not s.where.endswith("/op/out_norm")]
  out_paper, n_paper = paper_choice(params, fn, x, sites=paper_sites)
  assert (n_all, n_paper) == (num_layer_norms(spec.config), num_layer_norms(spec.config) - sum(spec.config.depths))
  assert rel_err(want, out_all) > 1e-3
  assert rel_err(want, out_paper) > 1e-3


@pytest.mark.slow
def test_tiny_paper_depths_fold_exactly(x64):
  """The 51-LN depths with tiny widths, with weights: 10 fold, exact at two shapes."""
  spec = CONFIGS["vmamba-tiny"]
  params, fn = _params64(spec), spec.apply_fn()
  folded = jaxfold.fold(params, fn, _inputs64(spec, 2), auxiliary_centering=True)
  assert folded.report.num_sites == 51 and folded.report.num_folded == 10
  run, run_folded = jax.jit(fn), jax.jit(folded.apply_fn)
  for batch, size, seed in ((1, 32, 1), (2, 64, 2)):
    x = _inputs64(spec, batch, size, seed)
    assert rel_err(run(params, x), run_folded(folded.params, x)) < 1e-12, (batch, size)
