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


def test_auxiliary_centering_gets_an_inserted_rotation(x64):
  # fold's auxiliary centering of the tied GPT-2 embedding subtracts a mean
  # over the stream dim, which no parameter rotation commutes with: the
  # program computes x @ Q on the centered embedding instead (insert=False refuses).
  apply, p = original("gpt2-tiny")
  fu = jaxfold.fuse_affine(jaxfold.fold(p, apply, *inputs("gpt2-tiny", 2, 8)))
  with pytest.raises(jaxfold.FuseError, match="not provably exact.*insert=True"):
    jaxfold.rotate(fu, hadamard(32), insert=False)
  r = jaxfold.rotate(fu, hadamard(32))
  assert len(r.report.inserted) == 1 and "x @ Q computed for the output of `sub`" in r.report.inserted[0]
  assert "1 rotation(s) computed in the program" in str(r.report)
  for b, t in ((2, 8), (1, 5)):
    args = inputs("gpt2-tiny", b, t)
    ref = apply(p, *args)
    for fn in (jax.jit(r.apply_fn), r.apply_fn):   # (first under a trace: Q must not leak from it)
      np.testing.assert_allclose(fn(r.params, *args), ref, rtol=1e-9, atol=1e-9)


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
def test_rotated_stream_as_an_output(x64, which):
  """A program that also returns the residual stream (hidden states): rotated,
  that output would be h·Q, so rotate computes (h·Q)·Qᵀ for it (insert=False
  refuses it)."""
  r = np.random.default_rng(1)
  params = {"w_in": jnp.asarray(r.normal(size=(5, D))), "b": jnp.asarray(r.normal(size=(D,))),
            "w_out": jnp.asarray(r.normal(size=(D, 3)))}

  def apply(p, x):
    h = x @ p["w_in"] + p["b"]
    return _rms(h) @ p["w_out"], (h if which == "stream" else h[:, -1])
  model = _Model(params, apply)
  with pytest.raises(jaxfold.FuseError, match="program output"):
    jaxfold.rotate(model, random_orthogonal(D, 7), _x(2, 4, 5), insert=False)
  r = jaxfold.rotate(model, random_orthogonal(D, 7), _x(2, 4, 5))
  assert r.report.inserted == ("y @ Qᵀ computed for program output #1: the rotated stream is an output",)
  for shape in ((2, 4, 5), (1, 3, 5)):
    x = _x(*shape)
    for got, ref in zip(r.apply_fn(r.params, x), apply(params, x)):
      assert rel_err(ref, got) < 1e-12


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


def _fused_pre_ln(d: int, seed: int):
  """(rng, model, example input, random params with non-trivial γ, β, biases, the fused fold)."""
  m = _pre_ln(d)
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(2, 3, 6)))
  p = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.5 + (a.ndim == 1)),
                             m.init(jax.random.PRNGKey(0), x))
  return rng, m, x, p, jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))


@pytest.mark.parametrize("d", [24, 32])
@pytest.mark.parametrize("name", ["hadamard", "random"])
def test_named_rotations_are_exact(d, name, x64, tmp_path):
  rng, m, x, p, fused = _fused_pre_ln(d, seed=0)
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
  rng, m, x, p, fused = _fused_pre_ln(d, seed=3)
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


# ----------------------------------------------------------------------------
# Streams no parameter rotation starts: the program computes x @ Q there.

_F = jnp.float64


class _Block(nn.Module):
  cross: bool = False

  @nn.compact
  def __call__(self, h, enc=None, mask=None):
    a = nn.LayerNorm(param_dtype=_F)(h)
    h = h + nn.MultiHeadDotProductAttention(2, param_dtype=_F)(a, a, mask=mask)
    if self.cross:
      c = nn.LayerNorm(param_dtype=_F)(h)
      h = h + nn.MultiHeadDotProductAttention(2, param_dtype=_F)(c, enc)
    m = nn.LayerNorm(param_dtype=_F)(h)
    return h + nn.Dense(h.shape[-1], param_dtype=_F)(nn.gelu(nn.Dense(4 * h.shape[-1], param_dtype=_F)(m)))


class _EncDec(nn.Module):
  """Whisper's shape: the encoder stream starts at gelu(conv(x)) + positions (an
  activation), the decoder's at a tied token table, read by cross-attention."""

  @nn.compact
  def __call__(self, mel, tokens):
    x = nn.gelu(nn.Conv(16, (3,), param_dtype=_F)(mel))
    x = nn.gelu(nn.Conv(16, (3,), strides=(2,), param_dtype=_F)(x))
    x = x + self.param("enc_pos", nn.initializers.normal(1.0), (32, 16), _F)[: x.shape[1]]
    enc = nn.LayerNorm(param_dtype=_F)(_Block()(x))
    emb = nn.Embed(11, 16, param_dtype=_F)
    h = emb(tokens) + self.param("dec_pos", nn.initializers.normal(1.0), (16, 16), _F)[: tokens.shape[1]]
    h = _Block(cross=True)(h, enc, nn.make_causal_mask(tokens))
    return emb.attend(nn.LayerNorm(param_dtype=_F)(h))


def _enc_dec_inputs(b, t, s, seed=0):
  return (jax.random.normal(jax.random.PRNGKey(seed), (b, t, 4), _F),
          jax.random.randint(jax.random.PRNGKey(seed + 1), (b, s), 0, 11))


@pytest.mark.parametrize("tied", ["copy", "auto"])
def test_encoder_decoder_stream_starting_at_an_activation(x64, tmp_path, tied):
  m = _EncDec()
  p = randomize_np(m.init(jax.random.PRNGKey(0), *_enc_dec_inputs(2, 12, 5)))
  fu = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, *_enc_dec_inputs(2, 12, 5), tied_weights=tied))
  with pytest.raises(jaxfold.RotateError, match="adds an unrotated value to the rotated stream"):
    jaxfold.rotate(fu, "hadamard", insert=False)
  r = jaxfold.rotate(fu, "hadamard")
  # x @ Q on the encoder's activation; and on the decoder's embedding where the
  # tied table is not copied (its aux-centered lookup starts that stream).
  assert len(r.report.inserted) == (1 if tied == "copy" else 2), r.report
  assert all(t.startswith("x @ Q computed for the output of `sub`") for t in r.report.inserted)
  assert r.report.norms == 7
  jaxfold.save_fold(r, tmp_path / "r")
  back = jaxfold.load_fold(tmp_path / "r", m.apply)
  assert back.report.inserted == r.report.inserted
  for b, t, s in ((2, 12, 5), (1, 8, 3)):
    args = _enc_dec_inputs(b, t, s, seed=b + 7)
    ref = m.apply(p, *args)
    for model in (r, back):
      assert rel_err(ref, model.apply_fn(model.params, *args)) < 1e-12
    assert rel_err(ref, jax.jit(r.apply_fn)(r.params, *args)) < 1e-12


class _EmbeddingNorm(nn.Module):
  """BLOOM's shape: the stream starts at a LayerNorm of the embeddings (its γ
  stays: the stream is no reader); optionally the final norm's output is also
  returned (last_hidden_state: its γ stays, and it reads the stream un-rotated)."""
  hidden: bool = False

  @nn.compact
  def __call__(self, ids):
    h = nn.LayerNorm(param_dtype=_F)(nn.Embed(13, D, param_dtype=_F)(ids))
    h = nn.LayerNorm(param_dtype=_F)(_Block()(_Block()(h)))
    logits = nn.Dense(7, param_dtype=_F)(h)
    return (logits, h) if self.hidden else logits


@pytest.mark.parametrize("hidden", [False, True])
def test_stream_starting_at_a_norm_output(x64, hidden):
  m = _EmbeddingNorm(hidden)
  ids = jnp.arange(10).reshape(2, 5) % 13
  p = randomize_np(m.init(jax.random.PRNGKey(0), ids))
  fu = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, ids))
  r = jaxfold.rotate(fu, random_orthogonal(D, 3))
  starts = [t for t in r.report.inserted if t.startswith("x @ Q")]
  outs = [t for t in r.report.inserted if t.startswith("y @ Qᵀ")]
  assert len(starts) == 1 and len(outs) == int(hidden), r.report
  assert r.report.norms == 5    # the embedding norm keeps its γ: the stream starts after it
  for ids2 in (ids, jnp.array([[3, 1, 4]])):
    for got, ref in zip(jax.tree.leaves(r.apply_fn(r.params, ids2)), jax.tree.leaves(m.apply(p, ids2))):
      assert rel_err(ref, got) < 1e-12


def test_stream_starting_at_an_input(x64):
  """The model takes embeddings (inputs_embeds): the input is rotated in the program."""
  r0 = np.random.default_rng(4)
  params = {"w1": r0.normal(size=(D, 4 * D)), "w2": r0.normal(size=(4 * D, D)), "wo": r0.normal(size=(D, 3))}

  def apply(p, x):
    h = x + jax.nn.gelu(_rms(x) @ p["w1"]) @ p["w2"]
    return _rms(h) @ p["wo"]
  r = jaxfold.rotate(_Model(params, apply), random_orthogonal(D, 5), _x(2, 3, D))
  assert len(r.report.inserted) == 1 and "input array #0 of the call" in r.report.inserted[0], r.report
  for shape in ((2, 3, D), (1, 1, D)):
    x = _x(*shape, seed=2)
    assert rel_err(apply(params, x), r.apply_fn(r.params, x)) < 1e-12


def test_unfused_norms_are_still_refused_with_insertions(x64):
  """A stream whose norms keep γ cannot go on rotated past any of them; rotate
  refuses (with the fuse hint) rather than un-rotate and re-rotate at every norm."""
  tokens = jnp.zeros((2, 6), jnp.int32)
  p = randomize_np(jax.eval_shape(PreLN().init, jax.random.PRNGKey(0), tokens))
  with pytest.raises(jaxfold.FuseError, match="(?s)varies along the rotated dim.*fuse_affine"):
    jaxfold.rotate(jaxfold.fold(p, PreLN().apply, tokens), random_orthogonal(D))
