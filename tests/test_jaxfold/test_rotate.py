"""jaxfold.rotate: an orthogonal change of basis of a fused model's residual stream.

Float64, random γ, β and biases folded in; the rotated model must equal the
original at two input shapes for random orthogonal and Hadamard Q, with the
parameters really changed. Anything that does not commute with a rotation is
refused with the reason.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from zoo_fused import ZOO, ZOO_TOL, errors, fused, inputs, original, randomize_np

import jaxfold

D = 16


def random_orthogonal(n, seed=0):
  q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
  return q * np.sign(np.diag(r))


def hadamard(n):
  h = np.ones((1, 1))
  while len(h) < n:
    h = np.block([[h, h], [h, -h]])
  return h / np.sqrt(n)


Q = {"orthogonal": random_orthogonal, "hadamard": hadamard}


# One Q per model in the default run, the other in the slow run.
_DEFAULT_Q = {"gpt2-tiny": "hadamard", "vit-tiny": "hadamard", "opt-tiny": "orthogonal",
              "phi-tiny": "orthogonal"}


@pytest.mark.parametrize("name, qname", [
    pytest.param(n, q, marks=() if _DEFAULT_Q[n] == q else pytest.mark.slow)
    for n in ZOO for q in sorted(Q)])
def test_zoo_rotated_equals_original(x64, name, qname):
  _, fu = fused(name)
  r = jaxfold.rotate(fu, Q[qname](32))
  assert r.report.norms == len(fu.report.sites)
  # The program is the fused one (rotate changes parameters only): reuse its compile.
  assert max(errors(name, r, fu.apply_fn)) < ZOO_TOL
  before = jax.tree_util.tree_leaves(fu.params)
  after = jax.tree_util.tree_leaves(r.params)
  changed = sum(not np.allclose(a, b) for a, b in zip(before, after))
  assert changed == len(r.report.rotated) > 4


def _fused(module, *xs, **kw):
  p = randomize_np(jax.eval_shape(module.init, jax.random.PRNGKey(0), *xs))
  return p, jaxfold.fuse_affine(jaxfold.fold(p, module.apply, *xs, **kw))


def _x(*shape, seed=1):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float64)


class PreLN(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    emb = self.param("emb", nn.initializers.normal(), (11, D))
    pos = self.param("pos", nn.initializers.normal(), (tokens.shape[1], D))
    h = emb[tokens] + pos
    for _ in range(2):
      h = h + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(h))))
    return nn.Dense(7)(nn.LayerNorm()(h))


def test_writers_readers_embeddings_positions(x64):
  tokens = jnp.arange(12).reshape(2, 6) % 11
  p, fu = _fused(PreLN(), tokens)
  r = jaxfold.rotate(fu, random_orthogonal(D, 3))
  assert rel_err(PreLN().apply(p, tokens), jax.jit(r.apply_fn)(r.params, tokens)) < 1e-9
  names = " ".join(n for n, _ in r.report.rotated)
  assert "emb" in names and "pos" in names and r.report.norms == 3
  # stream_axes names the user's parameters (paths in p), not their place in jaxfold.Params.
  user = {jax.tree_util.keystr(k): np.shape(x) for k, x in jax.tree_util.tree_flatten_with_path(p)[0]}
  assert r.stream_axes and set(r.stream_axes) <= set(user)
  assert all(user[n][d] == D for n, dims in r.stream_axes.items() for d in dims)


def test_other_input_shapes_are_reproved(x64):
  p, fu = _fused(PreLN(), jnp.zeros((2, 6), jnp.int32))
  r = jaxfold.rotate(fu, hadamard(D))
  tokens = jnp.arange(18).reshape(3, 6) % 11            # another batch size: proved again
  assert rel_err(PreLN().apply(p, tokens), jax.jit(r.apply_fn)(r.params, tokens)) < 1e-9


def test_not_orthogonal_refused(x64):
  _, fu = _fused(PreLN(), jnp.zeros((2, 6), jnp.int32))
  with pytest.raises(jaxfold.FuseError, match="not orthogonal"):
    jaxfold.rotate(fu, 2 * np.eye(D))


def test_norm_with_gamma_refused(x64):
  tokens = jnp.zeros((2, 6), jnp.int32)
  p = randomize_np(jax.eval_shape(PreLN().init, jax.random.PRNGKey(0), tokens))
  folded = jaxfold.fold(p, PreLN().apply, tokens)          # γ, β still in the norms
  with pytest.raises(jaxfold.FuseError, match="varies along the rotated dim|unrotated"):
    jaxfold.rotate(folded, random_orthogonal(D))


class Nonlinear(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    h = h + nn.gelu(h)                                     # the stream itself passes a gelu
    return nn.Dense(3)(nn.LayerNorm()(h))


class NoFinalNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    return h + nn.Dense(D)(nn.LayerNorm()(h))              # the stream is the output


@pytest.mark.parametrize("module", [Nonlinear(), NoFinalNorm()])
def test_refused_with_reason(x64, module):
  _, fu = _fused(module, _x(3, 4))
  with pytest.raises(jaxfold.FuseError, match="not provably exact"):
    jaxfold.rotate(fu, random_orthogonal(D))


def test_auxiliary_centering_refused(x64):
  # fold's auxiliary centering of the tied GPT-2 embedding subtracts a mean
  # over the stream dim, which no rotation commutes with.
  apply, p = original("gpt2-tiny")
  fu = jaxfold.fuse_affine(jaxfold.fold(p, apply, *inputs("gpt2-tiny", 2, 8)))
  with pytest.raises(jaxfold.FuseError, match="not provably exact"):
    jaxfold.rotate(fu, hadamard(32))


@pytest.mark.slow
def test_example_smoke(tmp_path):
  pytest.importorskip("matplotlib")
  import importlib.util
  import os
  import sys
  path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "slice_rotate.py")
  spec = importlib.util.spec_from_file_location("_example_slice_rotate", path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod
  spec.loader.exec_module(mod)
  res = mod.main(["--smoke", "--out", str(tmp_path)])
  assert (tmp_path / "slice_rotate.png").stat().st_size > 1000
  for k in ("loss_fused", "loss_rotated[PCA]", "loss_rotated[Hadamard]"):
    assert abs(res[k] - res["loss"]) < 1e-4 * res["loss"]
  assert res["slicing"]["PCA"][0] == pytest.approx(res["loss"], rel=1e-4)


class _Model:
  """A bare (params, apply_fn) model: rotate accepts any, given example args."""

  def __init__(self, params, apply_fn):
    self.params, self.apply_fn = params, apply_fn


def _rms(h):
  return h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + 1e-6)


STREAM_OPS = {
    "neg-sub": lambda h: h - (-h) * 0.5,
    "select per token": lambda h: jnp.where((jnp.arange(h.shape[1]) % 2 == 0)[None, :, None], h, 2 * h),
    "split-concat seq": lambda h: jnp.concatenate(jnp.split(h, 2, axis=1)[::-1], axis=1),
    "slice seq": lambda h: h[:, 1:],
    "dynamic_slice seq": lambda h: jax.lax.dynamic_slice_in_dim(h, 1, 2, axis=1),
    "transpose": lambda h: jnp.swapaxes(h, 0, 1),
    "reshape merge batch": lambda h: h.reshape(-1, D)[None],
    "expand-squeeze": lambda h: jnp.squeeze(h[:, :, None, :], 2),
    "per-token scale": lambda h: h * jnp.linspace(1, 2, h.shape[1])[None, :, None],
    "divide per token": lambda h: h / (1 + jnp.arange(h.shape[1]))[None, :, None],
}
REFUSED_OPS = {
    "reverse d": lambda h: h[..., ::-1],
    "cumsum d": lambda h: jnp.cumsum(h, -1),
    "scale along d": lambda h: h * jnp.linspace(1, 2, D),
    "relu": jax.nn.relu,
    "mean over d": lambda h: h - h.mean(-1, keepdims=True),
    # per-token statistics that a rotation changes: Σh⁴ (not a sum of squares), Σ over half of d
    "fourth-power statistic": lambda h: h * (1 + jnp.mean(h ** 4, -1, keepdims=True)),
    "statistic of half of d": lambda h: h * jax.lax.rsqrt(1 + jnp.mean(h[..., :D // 2] ** 2, -1, keepdims=True)),
}


def _stream_model(op):
  r = np.random.default_rng(0)
  params = {"w_in": jnp.asarray(r.normal(size=(5, D))), "b": jnp.asarray(r.normal(size=(D,))),
            "w_out": jnp.asarray(r.normal(size=(D, 3)))}

  def apply(p, x):
    h = x @ p["w_in"] + p["b"]
    h = op(h)
    return _rms(h) @ p["w_out"]
  return _Model(params, apply)


@pytest.mark.parametrize("name", sorted(STREAM_OPS))
def test_rotation_facets_are_exact(x64, name):
  m = _stream_model(STREAM_OPS[name])
  x = _x(2, 4, 5)
  r = jaxfold.rotate(m, random_orthogonal(D, 7), x)
  assert {n for n, _ in r.report.rotated} == {"['w_in']", "['b']", "['w_out']"}
  assert rel_err(m.apply_fn(m.params, x), r.apply_fn(r.params, x)) < 1e-12


@pytest.mark.parametrize("name", sorted(REFUSED_OPS))
def test_rotation_refused_where_it_does_not_commute(x64, name):
  m = _stream_model(REFUSED_OPS[name])
  with pytest.raises(jaxfold.FuseError):
    jaxfold.rotate(m, random_orthogonal(D, 7), _x(2, 4, 5))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-j-tiny"])
def test_more_zoo_models(x64, name):
  folded, fu = fused(name)
  assert fu.report.num_fused == folded.report.num_folded and max(errors(name, fu)) < ZOO_TOL
  r = jaxfold.rotate(fu, hadamard(32))
  assert max(errors(name, r, fu.apply_fn)) < ZOO_TOL


@pytest.mark.parametrize("which", ["stream", "stream slice"])
def test_rotated_stream_as_an_output_refused(x64, which):
  """A program that also returns the residual stream (hidden states): rotated,
  that output would be h·Q, so rotate refuses it."""
  r = np.random.default_rng(1)
  params = {"w_in": jnp.asarray(r.normal(size=(5, D))), "b": jnp.asarray(r.normal(size=(D,))),
            "w_out": jnp.asarray(r.normal(size=(D, 3)))}

  def apply(p, x):
    h = x @ p["w_in"] + p["b"]
    return _rms(h) @ p["w_out"], (h if which == "stream" else h[:, -1])
  with pytest.raises(jaxfold.FuseError, match="program output"):
    jaxfold.rotate(_Model(params, apply), random_orthogonal(D, 7), _x(2, 4, 5))


def test_inputs_that_rotate_other_parameters_are_refused(x64):
  """A shape branch that adds a parameter to the stream only for longer
  sequences: the example's rotation leaves it unrotated, so calling with the
  longer shape must refuse, not compute with a half-rotated stream."""
  r = np.random.default_rng(2)
  params = {"w_in": jnp.asarray(r.normal(size=(5, D))), "b": jnp.asarray(r.normal(size=(D,))),
            "b_long": jnp.asarray(r.normal(size=(D,))), "w_out": jnp.asarray(r.normal(size=(D, 3)))}

  def apply(p, x):
    h = x @ p["w_in"] + p["b"]
    if x.shape[1] > 4:
      h = h + p["b_long"]
    return _rms(h) @ p["w_out"]
  m = _Model(params, apply)
  rot = jaxfold.rotate(m, random_orthogonal(D, 5), _x(2, 4, 5))
  assert "['b_long']" not in {n for n, _ in rot.report.rotated}
  assert rel_err(apply(params, _x(3, 4, 5, seed=2)), rot.apply_fn(rot.params, _x(3, 4, 5, seed=2))) < 1e-12
  with pytest.raises(jaxfold.FuseError, match="rotate different parameters"):
    rot.apply_fn(rot.params, _x(2, 6, 5))


def test_a_parameter_rotated_along_both_dims_and_sliced_is_refused(x64):
  """A square parameter that both reads the stream (dim 0) and writes it
  (dim 1) is rotated along both (Qᵀ·m·Q, test_adversarial_rotate); its row
  ``m[0]`` added to the stream is then a slice of a rotated dim: refused,
  at the line that slices it."""
  r = np.random.default_rng(2)
  params = {"w_in": jnp.asarray(r.normal(size=(5, D))), "m": jnp.asarray(r.normal(size=(D, D))),
            "w_out": jnp.asarray(r.normal(size=(D, 3)))}

  def apply(p, x):
    h = x @ p["w_in"]
    h = h + h @ p["m"] + p["m"][0]
    return _rms(h) @ p["w_out"]
  with pytest.raises(jaxfold.FuseError, match=r"a slice of the rotated dim \[at .*test_rotate.py"):
    jaxfold.rotate(_Model(params, apply), random_orthogonal(D, 5), _x(2, 4, 5))


# -- named rotations (issue 36): rotate(result, "hadamard" | "random") -----------------------

def _pre_ln(d):
  class Pre(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(d)(x)
      for _ in range(2):
        h = h + nn.Dense(d)(jax.nn.gelu(nn.Dense(2 * d)(nn.LayerNorm()(h))))
      return nn.Dense(5)(nn.LayerNorm()(h))
  return Pre()


@pytest.mark.parametrize("d", [24, 32])
@pytest.mark.parametrize("name", ["hadamard", "random"])
def test_named_rotations_are_exact(d, name, x64, tmp_path):
  m = _pre_ln(d)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 3, 6)))
  p = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.5 + (a.ndim == 1)),
                             m.init(jax.random.PRNGKey(0), x))
  fused = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
  r = jaxfold.rotate(fused, name)
  assert r.report.size == d and r.report.norms == 3
  q = r.apply_fn.q
  assert np.allclose(q @ q.T, np.eye(d), atol=1e-12)
  if name == "hadamard":   # entries ±1/√d: the outlier-spreading property
    assert np.allclose(np.abs(q), 1 / np.sqrt(d))
  else:
    assert not np.allclose(np.abs(q), 1 / np.sqrt(d))
  for xx in (x, jnp.asarray(rng.normal(size=(1, 1, 6)))):
    np.testing.assert_allclose(r.apply_fn(r.params, xx), m.apply(p, xx), rtol=1e-10, atol=1e-10)
  assert not np.allclose(jaxfold.rotate(fused, "random", seed=1).apply_fn.q, jaxfold.rotate(fused, "random").apply_fn.q)
  jaxfold.save_fold(r, tmp_path / "r")
  back = jaxfold.load_fold(tmp_path / "r", m.apply)
  np.testing.assert_array_equal(back.apply_fn(back.params, x), r.apply_fn(r.params, x))


def test_named_rotation_refusals(x64):
  m = _pre_ln(156)   # 156 = 12 · 13: no Hadamard construction known here
  x = jnp.ones((2, 3, 6))
  p = m.init(jax.random.PRNGKey(0), x)
  fused = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
  with pytest.raises(jaxfold.RotateError, match=r"width 156.*rotate by \"random\""):
    jaxfold.rotate(fused, "hadamard")
  assert jaxfold.rotate(fused, "random").report.size == 156
  with pytest.raises(jaxfold.RotateError, match="one of"):
    jaxfold.rotate(fused, "pca2")


def test_pca_rotation_is_exact_and_orders_the_stream(x64, tmp_path):
  d = 16
  m = _pre_ln(d)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, 3, 6)))
  p = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.5 + (a.ndim == 1)),
                             m.init(jax.random.PRNGKey(0), x))
  fused = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
  with pytest.raises(jaxfold.RotateError, match="calibration="):
    jaxfold.rotate(fused, "pca")
  calib = [(jnp.asarray(rng.normal(size=(4, 5, 6))),), (jnp.asarray(rng.normal(size=(1, 7, 6))),)]
  r = jaxfold.rotate(fused, "pca", calibration=calib)
  q = np.asarray(r.apply_fn.q)
  assert np.allclose(q @ q.T, np.eye(d), atol=1e-10)
  for xx in (x, jnp.asarray(rng.normal(size=(1, 1, 6)))):
    np.testing.assert_allclose(r.apply_fn(r.params, xx), m.apply(p, xx), rtol=1e-10, atol=1e-10)
  jaxfold.save_fold(r, tmp_path / "r")
  back = jaxfold.load_fold(tmp_path / "r", m.apply)
  np.testing.assert_array_equal(back.apply_fn(back.params, x), r.apply_fn(r.params, x))


def test_pca_rotation_sorts_the_stream_energy(x64):
  d = 12   # one norm: the stream is the centered Dense output, computed independently below
  m = nn.Sequential([nn.Dense(d), nn.LayerNorm(), nn.Dense(3)])
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(2, 5)))
  p = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(size=a.shape) + (a.ndim == 1)),
                             m.init(jax.random.PRNGKey(0), x))
  fused = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
  calib = jnp.asarray(rng.normal(size=(64, 5)) * rng.uniform(0.1, 3, size=5))
  q = np.asarray(jaxfold.rotate(fused, "pca", calibration=(calib,)).apply_fn.q)
  k = p["params"]["layers_0"]
  h = np.asarray(calib) @ np.asarray(k["kernel"]) + np.asarray(k["bias"])
  h = h - h.mean(-1, keepdims=True)
  e = ((h @ q) ** 2).sum(0)
  assert np.all(np.diff(e) <= 1e-9 * e[0]) and e[0] > 10 * e[-1]
