"""The folded program with the Pallas RMSNorm kernel (interpret mode) equals the XLA path."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxfold
from conftest import randomize, rel_err


class PreLN(nn.Module):
  hidden: int = 24

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(40, self.hidden)(ids)
    for _ in range(2):
      h = nn.LayerNorm(epsilon=1e-5)(x)
      x = x + nn.Dense(self.hidden)(nn.gelu(nn.Dense(2 * self.hidden)(h)))
    return nn.LayerNorm(use_bias=False)(x)


def test_kernel_is_used_at_folded_sites_and_matches_xla():
  m, ids = PreLN(), jnp.arange(14).reshape(2, 7) % 40
  p = randomize(m.init(jax.random.PRNGKey(0), ids))
  xla = jaxfold.fold(p, m.apply, ids, norm_impl="xla")
  ker = jaxfold.fold(p, m.apply, ids, norm_impl="interpret")
  assert xla.report.num_folded == 3
  assert len(ker.apply_fn.analysis_for((ids,)).plan.epilogues) == 3
  assert "pallas_call" in str(jax.make_jaxpr(ker.apply_fn)(ker.params, ids))
  assert "pallas_call" not in str(jax.make_jaxpr(xla.apply_fn)(xla.params, ids))
  assert rel_err(xla.apply_fn(xla.params, ids), ker.apply_fn(ker.params, ids)) < 2e-6
  assert rel_err(m.apply(p, ids), ker.apply_fn(ker.params, ids)) < 2e-5


def test_auto_keeps_xla_on_cpu():
  m, ids = PreLN(), jnp.arange(14).reshape(2, 7) % 40
  p = randomize(m.init(jax.random.PRNGKey(0), ids))
  f = jaxfold.fold(p, m.apply, ids)
  if jax.default_backend() == "cpu":
    assert "pallas_call" not in str(jax.make_jaxpr(f.apply_fn)(f.params, ids))


def test_bad_norm_impl_is_named():
  m, ids = PreLN(), jnp.arange(14).reshape(2, 7) % 40
  p = m.init(jax.random.PRNGKey(0), ids)
  with pytest.raises(jaxfold.FoldError, match="norm_impl"):
    jaxfold.fold(p, m.apply, ids, norm_impl="cuda")
