"""jaxfold._src.notices: a fold that succeeds but would mislead says so — no
normalization at all (a warning and a report line), and an apply_fn that
ignores its params (a warning; the constants it centers named by the line
that reads them)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfold
from jaxfold._src.report import NO_SITES

nn = pytest.importorskip("flax.linen")


class NoNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(nn.relu(nn.Dense(16)(x)))


class DenseLN(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.LayerNorm()(nn.Dense(64)(x))


def _fold(params, fn, x):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    folded = jaxfold.fold(params, fn, x)
  return folded, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_no_normalization_warns_and_the_report_says_so():
  x = jnp.ones((2, 12))
  m = NoNorm()
  folded, said = _fold(m.init(jax.random.PRNGKey(0), x), m.apply, x)
  assert folded.report.num_sites == 0
  assert any("no normalization found" in s for s in said)
  assert NO_SITES in str(folded.report)


def test_a_fold_with_sites_and_read_params_is_quiet():
  x = jnp.ones((2, 12))
  m = DenseLN()
  folded, said = _fold(m.init(jax.random.PRNGKey(0), x), m.apply, x)
  assert folded.report.num_folded == 1 and not said
  assert NO_SITES not in str(folded.report)


def test_apply_fn_that_ignores_params_warns_and_names_the_constant_by_its_line(x64):
  rng = np.random.default_rng(0)
  m = DenseLN()
  x = jnp.asarray(rng.standard_normal((2, 100)))
  params = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.standard_normal(a.shape)) + 0.3,
                                  m.init(jax.random.PRNGKey(0), x))

  def closed(p, x):
    return m.apply(params, x)    # reads the enclosing scope's params, not p

  folded, said = _fold(params, closed, x)
  assert any("does not read its params argument" in s and "4 parameter leaves" in s for s in said)
  label = folded.report.sites[0].centered[0].label()
  assert "captured constant (100, 64) read at" in label and "test_notices.py" in label, label
  for b in (1, 3):   # still exact: the constant is centered inside the folded program
    xb = jnp.asarray(rng.standard_normal((b, 100)))
    np.testing.assert_allclose(folded.apply_fn(folded.params, xb), m.apply(params, xb), rtol=1e-9, atol=1e-9)
