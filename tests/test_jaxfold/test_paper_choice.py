"""jaxfold/_src/paper_choice.py: the paper's unsound baseline (every norm
folded, no checks) is what jaxfold's fold computes where the fold is sound,
and differs from the original where it is not — that difference is what
benchmarks/paper_choice_error.py measures."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from conftest import randomize, rel_err

import jaxfold
from jaxfold.benchmarking import paper_choice

F64 = jnp.float64
D = 8


class PreLN(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D, param_dtype=F64)(x)
    h = h + nn.Dense(D, param_dtype=F64)(nn.gelu(nn.LayerNorm(param_dtype=F64)(h)))
    return nn.Dense(3, param_dtype=F64)(nn.LayerNorm(param_dtype=F64)(h))


class PostLN(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(param_dtype=F64)(nn.Dense(D, param_dtype=F64)(x))
    h = nn.LayerNorm(param_dtype=F64)(h + nn.Dense(D, param_dtype=F64)(nn.relu(h)))
    return nn.Dense(3, param_dtype=F64)(h)


def _setup(module, shape):
  x = jax.random.normal(jax.random.PRNGKey(1), shape, F64)
  return randomize(module.init(jax.random.PRNGKey(0), x)), x


def test_pre_ln_paper_choice_is_the_fold(x64):
  for shape in [(3, 4), (2, 5, 4)]:
    p, x = _setup(PreLN(), shape)
    out, n = paper_choice(p, PreLN().apply, x)
    assert n == 2
    assert rel_err(PreLN().apply(p, x), out) < 1e-9
    f = jaxfold.fold(p, PreLN().apply, x)
    assert rel_err(f.apply_fn(f.params, x), out) < 1e-9


def test_post_ln_paper_choice_changes_the_output(x64):
  p, x = _setup(PostLN(), (3, 4))
  out, n = paper_choice(p, PostLN().apply, x)
  assert n == 2
  assert rel_err(PostLN().apply(p, x), out) > 1e-3
  # jaxfold refuses the unsound site and stays exact.
  f = jaxfold.fold(p, PostLN().apply, x)
  assert f.report.num_folded < 2
  assert rel_err(PostLN().apply(p, x), f.apply_fn(f.params, x)) < 1e-9


def test_sites_restricts_the_choice_to_those_sites(x64):
  p, x = _setup(PostLN(), (3, 4))
  want = PostLN().apply(p, x)
  out, n = paper_choice(p, PostLN().apply, x, sites=[0])   # the first LN reads a Dense only: sound
  assert n == 1 and rel_err(want, out) < 1e-9
  out, n = paper_choice(p, PostLN().apply, x, sites=[1])   # the second reads the first's output
  assert n == 1 and rel_err(want, out) > 1e-3
