"""jaxfold.online_hadamard: QuaRot's online Hadamards before the MLP's
down-projection and attention's output projection, proved exact per weight.

Float64, random γ, β and biases; every transformed model must equal the
original at two input shapes (batch 1 included), with the rotated weights
really changed and the inserted transforms really in the program (the new
program with the old weights differs). Sites a proof cannot cover are skipped
with the reason; the rest of the model stays exact.
"""

import functools
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from zoo_fused import inputs, original, randomize_np

import jaxfold
from models.common import max_rel_err

TOL = 1e-6   # the zoo's attention scores run in float32 (see zoo_fused.ZOO_TOL)


def _shapes(name):
  return [(1, None), (2, None)] if name.startswith("vit") else [(1, 5), (2, 8)]


@functools.lru_cache(maxsize=None)
def _fused(name):
  apply, p = original(name)
  folded = jaxfold.fold(p, apply, *inputs(name, 2, 8 if not name.startswith("vit") else None),
                        tied_weights="copy")
  return jaxfold.fuse_affine(folded)


def _errors(name, model):
  apply, p = original(name)
  ref, new = jax.jit(apply), jax.jit(model.apply_fn)
  return [max_rel_err(ref(p, *inputs(name, b, s)), new(model.params, *inputs(name, b, s)))
          for b, s in _shapes(name)]


def _changed(before, after) -> int:
  return sum(not np.allclose(a, b) for a, b in zip(jax.tree_util.tree_leaves(before),
                                                  jax.tree_util.tree_leaves(after)))


@pytest.mark.parametrize("name", ["gpt2-tiny", "opt-tiny", "vit-tiny"])
def test_zoo_online_equals_original(x64, name):
  fu = _fused(name)
  r = jaxfold.online_hadamard(fu)
  kinds = sorted(s.kind for s in r.report.sites if s.rotated)
  assert kinds == ["attention"] * 2 + ["mlp"] * 2, str(r.report)
  assert max(_errors(name, r)) < TOL
  assert _changed(fu.params, r.params) == r.report.num_rotated
  # The transforms are in the program: with the unrotated weights it computes something else.
  apply, p = original(name)
  x = inputs(name, *_shapes(name)[1])
  assert max_rel_err(apply(p, *x), r.apply_fn(fu.params, *x)) > 1e-3


def test_composes_with_rotate_and_saves(x64):
  name = "gpt2-tiny"
  q, rr = np.linalg.qr(np.random.default_rng(3).normal(size=(32, 32)))
  rotated = jaxfold.rotate(_fused(name), q * np.sign(np.diag(rr)))
  r = jaxfold.online_hadamard(rotated)
  assert r.report.num_rotated == 4
  assert max(_errors(name, r)) < TOL
  with tempfile.TemporaryDirectory() as d:
    jaxfold.save_fold(r, d)
    loaded = jaxfold.load_fold(d, original(name)[0])
  assert str(loaded.report) == str(r.report)
  assert max(_errors(name, loaded)) < TOL
  exported = jaxfold.load_exported(jaxfold.export(r, *inputs(name, 2, 8)))   # symbolic batch and length
  apply, p = original(name)
  assert max_rel_err(apply(p, *inputs(name, 1, 5)), exported(*inputs(name, 1, 5))) < TOL


def _x(*shape, seed=1):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float64)


def _model(module, *xs):
  p = randomize_np(jax.eval_shape(module.init, jax.random.PRNGKey(0), *xs))
  return p, jaxfold.fuse_affine(jaxfold.fold(p, module.apply, *xs))


def _check(module, p, r, *shapes):
  for shape in shapes:
    x = _x(*shape)
    assert max_rel_err(module.apply(p, x), r.apply_fn(r.params, x)) < 1e-12


class Block(nn.Module):
  """A pre-LN MLP block with the given activation and inner width."""
  act: str = "gelu"
  inner: int = 32

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.inner)(nn.LayerNorm()(x))
    if self.act == "swiglu":
      h = nn.silu(h) * nn.Dense(self.inner)(nn.LayerNorm()(x))
    else:
      h = {"gelu": nn.gelu, "gelu_exact": functools.partial(nn.gelu, approximate=False),
           "relu": nn.relu, "silu": nn.silu}[self.act](h)
    return x + nn.Dense(x.shape[-1])(h)


@pytest.mark.parametrize("act", ["gelu", "gelu_exact", "relu", "silu", "swiglu"])
def test_mlp_activations(x64, act):
  m = Block(act)
  p, fu = _model(m, _x(2, 3, 8))
  r = jaxfold.online_hadamard(fu)
  (site,) = r.report.sites     # the readers of the norms (fc1, the gate) are no sites
  assert site.rotated and site.kind == "mlp" and site.width == 32 and site.order == "H_32"
  _check(m, p, r, (1, 5, 8), (2, 3, 8))


def test_kronecker_width_and_no_construction(x64):
  m = Block(inner=24)          # 24 = 12·2: Paley's H_12 ⊗ Sylvester's H_2
  p, fu = _model(m, _x(2, 3, 8))
  r = jaxfold.online_hadamard(fu)
  assert r.report.sites[0].rotated and r.report.sites[0].order == "H_12⊗H_2"
  _check(m, p, r, (1, 5, 8), (2, 3, 8))
  m = Block(inner=6)           # no Hadamard matrix of order 6: skipped, said why
  p, fu = _model(m, _x(2, 3, 8))
  r = jaxfold.online_hadamard(fu)
  (site,) = r.report.sites
  assert not site.rotated and "no Hadamard construction" in site.reason and "6" in site.reason
  assert _changed(fu.params, r.params) == 0
  assert "skipped" in str(r.report)
  _check(m, p, r, (1, 5, 8))


class SharedDown(nn.Module):
  """fc2's weight is also read by a contraction that is no site (of the input)."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(), (8, 8))
    return x @ w + nn.gelu(nn.Dense(8)(nn.LayerNorm()(x))) @ w


def test_weight_with_another_use_is_refused(x64):
  m = SharedDown()
  p, fu = _model(m, _x(2, 8))
  r = jaxfold.online_hadamard(fu)
  (site,) = r.report.sites
  assert not site.rotated and "another use of the weight" in site.reason, str(r.report)
  assert _changed(fu.params, r.params) == 0
  _check(m, p, r, (1, 8), (3, 8))


class MHA(nn.Module):
  """flax's attention: the output projection contracts heads and head dims as two axes."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    return x + nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16)(h, h)


def test_attention_heads_as_separate_axes(x64):
  m = MHA()
  p, fu = _model(m, _x(2, 3, 8))
  r = jaxfold.online_hadamard(fu)
  (site,) = r.report.sites
  # QuaRot's split: online across the 4 heads only; V's kernel, its bias and the
  # new bias fuse_affine made for it, and the output kernel, per head offline.
  assert site.rotated and site.kind == "attention" and (site.width, site.order) == (4, "H_4"), str(r.report)
  assert "per head offline" in site.reason and "value.kernel" in site.reason
  assert _changed(fu.params, r.params) == len(r.report.weights) == 4
  _check(m, p, r, (1, 5, 8), (2, 3, 8))


def test_where_selects_and_is_checked(x64):
  fu = _fused("gpt2-tiny")
  r = jaxfold.online_hadamard(fu, where="mlp")
  assert [s.kind for s in r.report.sites] == ["mlp", "mlp"]
  assert max(_errors("gpt2-tiny", r)) < TOL
  with pytest.raises(jaxfold.RotateError, match="where must name"):
    jaxfold.online_hadamard(fu, where="heads")


class Merged(nn.Module):
  """fc2's weight is a reshape merging two dims of the parameter into the contracted one."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(), (4, 8, 8))
    return x + nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))) @ w.reshape(32, 8)


def test_contracted_dim_not_one_parameter_dim_is_skipped(x64):
  m = Merged()
  p, fu = _model(m, _x(2, 8))
  r = jaxfold.online_hadamard(fu)
  (site,) = r.report.sites
  assert not site.rotated and "not one whole dim" in site.reason
  _check(m, p, r, (1, 8), (3, 8))


class ShapeBranch(nn.Module):
  """A Python branch on the sequence length: the activation exists at long inputs only."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(nn.LayerNorm()(x))
    return x + nn.Dense(8)(nn.gelu(h) if x.shape[1] > 4 else h)


def test_other_shapes_rotating_other_weights_are_refused(x64):
  m = ShapeBranch()
  p, fu = _model(m, _x(2, 6, 8))
  r = jaxfold.online_hadamard(fu)
  assert r.report.num_rotated == 1
  _check(m, p, r, (1, 5, 8), (2, 6, 8))
  with pytest.raises(jaxfold.RotateError, match="rotate other weights online"):
    r.apply_fn(r.params, _x(2, 3, 8))
