"""Own Flax-linen encoders and layer loops under control flow, folded as far as sound.

Re-implementations of the structures that matter (not the HF code):

* a Whisper-like encoder: ``gelu(conv2(gelu(conv1(x)))) + stop_gradient(positions)``
  starts a pre-LN residual stream; no parameter centering makes that sum
  zero-mean, one auxiliary centering of it folds every encoder norm;
* a Wav2Vec2-like encoder: conv feature encoder (its first conv with a
  per-channel GroupNorm over *time*, which no centering can fold), feature
  projection LN + Dense, ``h + gelu(grouped positional conv(h))``, then
  pre-LN ("stable layer norm") or post-LN blocks;
* layer loops under ``lax.cond``/``lax.switch``/``lax.while_loop``/
  ``lax.fori_loop`` (traced bounds) and flax's lifted ``nn.cond``/``nn.while_loop``.

Each is checked in float64 with randomized γ/β/biases at two input shapes
(``fold_checks.assert_sound``: folded == original, CBWC == original at unseen
parameters and in its gradients, every in-place centering invisible), with
the number of folded sites the mathematics allows.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fold_checks import assert_sound
from jax import lax

F64 = jnp.float64
D = 16
HEADS = 2
FF = 32
NMEL = 6


def _args(shapes, extra=()):
  """One argument tuple per input shape (different batch *and* length)."""
  out = []
  for i, s in enumerate(shapes):
    rng = np.random.default_rng([7, i])
    out.append((jnp.asarray(rng.standard_normal(s), F64),) + tuple(e(rng, s) for e in extra))
  return out


def _random_like(shapes, seed):
  """Random non-uniform float64 values for a linen variable tree (NumPy: no XLA
  compilation): γ = 1 + 0.5 N, β and biases 0.3 + 0.5 N, kernels N / sqrt(fan-in)."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = str(path[-1])
    n = rng.standard_normal(leaf.shape)
    if "scale" in name:
      v = 1.0 + 0.5 * n
    elif "bias" in name:
      v = 0.3 + 0.5 * n
    elif "kernel" in name:
      v = n / np.sqrt(max(1, int(np.prod(leaf.shape[:-1]))))
    else:
      v = 0.7 * n
    return jnp.asarray(v, F64)
  return jax.tree_util.tree_map_with_path(draw, shapes)


def _sound(model, args, **kw):
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), *args[0])
  return assert_sound(model.apply, lambda seed: _random_like(shapes, seed), args, **kw)


class Attention(nn.Module):
  @nn.compact
  def __call__(self, x):
    b, t, _ = x.shape
    dense = functools.partial(nn.Dense, param_dtype=F64)
    q = dense(D, name="q")(x).reshape(b, t, HEADS, D // HEADS)
    k = dense(D, use_bias=False, name="k")(x).reshape(b, t, HEADS, D // HEADS)
    v = dense(D, name="v")(x).reshape(b, t, HEADS, D // HEADS)
    a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS), -1)
    o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, D)
    return dense(D, name="out")(o)


class PreLNLayer(nn.Module):
  fast: bool = True

  @nn.compact
  def __call__(self, h):
    ln = functools.partial(nn.LayerNorm, epsilon=1e-5, param_dtype=F64,
                           use_fast_variance=self.fast)
    h = h + Attention()(ln(name="ln_att")(h))
    y = nn.Dense(FF, param_dtype=F64)(ln(name="ln_ff")(h))
    return h + nn.Dense(D, param_dtype=F64)(jax.nn.gelu(y))


class PostLNLayer(nn.Module):
  @nn.compact
  def __call__(self, h):
    ln = functools.partial(nn.LayerNorm, epsilon=1e-5, param_dtype=F64)
    h = ln(name="ln_att")(h + Attention()(h))
    y = nn.Dense(D, param_dtype=F64)(jax.nn.gelu(nn.Dense(FF, param_dtype=F64)(h)))
    return ln(name="ln_ff")(h + y)


# ----------------------------------------------------------------------------
# Whisper-like encoder.


class WhisperLikeEncoder(nn.Module):
  layers: int = 2
  max_positions: int = 16

  @nn.compact
  def __call__(self, x):                      # x: (batch, frames, mel bins)
    conv = functools.partial(nn.Conv, D, (3,), param_dtype=F64)
    h = jax.nn.gelu(conv(padding=((1, 1),), name="conv1")(x))
    h = jax.nn.gelu(conv(strides=(2,), padding=((1, 1),), name="conv2")(h))
    pos = nn.Embed(self.max_positions, D, param_dtype=F64, name="embed_positions")
    positions = lax.stop_gradient(pos(jnp.arange(h.shape[1])))   # frozen, as Whisper's
    h = h + positions
    for i in range(self.layers):
      h = PreLNLayer(name=f"layers_{i}")(h)
    return nn.LayerNorm(epsilon=1e-5, param_dtype=F64, name="layer_norm")(h)


def test_whisper_like_encoder(x64):
  # 2 layers x 2 norms + the final norm; the stream starts at a sum that no
  # parameter centering makes zero-mean: one auxiliary centering folds all 5.
  res = _sound(WhisperLikeEncoder(), _args([(2, 8, NMEL), (3, 12, NMEL)]), expect_folded=5)
  assert len(res.fold_report.auxiliary) == 1, res.fold_report


def test_whisper_like_encoder_without_auxiliary(x64):
  # Without it nothing folds, and the reason points at the model's own line.
  res = _sound(WhisperLikeEncoder(), _args([(2, 8, NMEL), (3, 12, NMEL)]), expect_folded=0,
               auxiliary_centering=False)
  assert "test_control_models.py" in res.fold_report.sites[0].reason, res.fold_report


# ----------------------------------------------------------------------------
# Wav2Vec2-like encoder.


class Wav2Vec2LikeEncoder(nn.Module):
  stable: bool = True           # pre-LN blocks ("stable layer norm"); else post-LN
  layers: int = 2

  @nn.compact
  def __call__(self, x):                      # x: (batch, samples, 1)
    conv = functools.partial(nn.Conv, D, param_dtype=F64)
    h = conv((3,), strides=(2,), padding="VALID", use_bias=False, name="conv0")(x)
    # Per-channel GroupNorm (groups == channels): normalizes over time.
    h = jax.nn.gelu(nn.GroupNorm(num_groups=D, epsilon=1e-5, param_dtype=F64, name="gn0")(h))
    h = jax.nn.gelu(conv((2,), strides=(2,), padding="VALID", use_bias=False, name="conv1")(h))
    h = nn.LayerNorm(epsilon=1e-5, param_dtype=F64, name="feat_ln")(h)
    h = nn.Dense(D, param_dtype=F64, name="projection")(h)
    # Grouped positional conv ('same' length after dropping one frame, as HF).
    p = conv((4,), padding=((2, 2),), feature_group_count=4, name="pos_conv")(h)[:, :-1]
    h = h + jax.nn.gelu(p)
    if self.stable:
      for i in range(self.layers):
        h = PreLNLayer(name=f"layers_{i}")(h)
      return nn.LayerNorm(epsilon=1e-5, param_dtype=F64, name="layer_norm")(h)
    h = nn.LayerNorm(epsilon=1e-5, param_dtype=F64, name="layer_norm")(h)
    for i in range(self.layers):
      h = PostLNLayer(name=f"layers_{i}")(h)
    return h


_W2V_SHAPES = [(2, 18, 1), (3, 26, 1)]


def test_wav2vec2_like_stable(x64):
  # gn0 (over time) and feat_ln (input gelu(conv)) cannot fold; the 4 block
  # norms and the final one fold with one auxiliary centering of
  # proj(x) + gelu(pos_conv(proj(x))) (centering the projection itself would
  # reach the positional conv).
  res = _sound(Wav2Vec2LikeEncoder(stable=True), _args(_W2V_SHAPES), expect_folded=5)
  rep = res.fold_report
  assert len(rep.auxiliary) == 1, rep
  gn = [s for s in rep.sites if "gn0" in s.where]
  assert gn and not gn[0].folded, rep


def test_wav2vec2_like_post_ln(x64):
  # Post-LN: every block norm's input carries the previous norm's output
  # (γ ⊙ n + β, not zero-mean); the encoder norm alone would trade one
  # reduction for one auxiliary centering. Nothing folds.
  _sound(Wav2Vec2LikeEncoder(stable=False), _args(_W2V_SHAPES), expect_folded=0)


# ----------------------------------------------------------------------------
# Layer loops under control flow.


class Embed(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(D, param_dtype=F64, name="proj")(x)


class CondEncoder(nn.Module):
  """Per layer, ``nn.cond`` picks one of two pre-LN blocks (two LN formulations)."""
  layers: int = 2

  def setup(self):
    self.embed = Embed()
    self.a = [PreLNLayer(fast=True) for _ in range(self.layers)]
    self.b = [PreLNLayer(fast=False) for _ in range(self.layers)]
    self.final = nn.LayerNorm(epsilon=1e-5, param_dtype=F64)

  def __call__(self, x, flags):
    h = self.embed(x)
    for i in range(self.layers):
      if self.is_initializing():   # lifted cond: both branches' variables must exist first
        self.a[i](h), self.b[i](h)
      h = nn.cond(flags[i], lambda m, v, i=i: m.a[i](v), lambda m, v, i=i: m.b[i](v), self, h)
    return self.final(h)


def _flags(rng, shape):
  return jnp.asarray([shape[0] == 2, shape[0] != 2])


def test_cond_layers(x64):
  # 2 layers x 2 branches x 2 norms, and the final norm: all fold (the input
  # projection and every block's output projections centered).
  _sound(CondEncoder(), _args([(2, 4, NMEL), (3, 6, NMEL)], (_flags,)), expect_folded=9)


class SwitchEncoder(nn.Module):
  """``nn.switch`` between a pre-LN block, a two-pass pre-LN block and a
  scalar rescaling (or, ``tanh_branch``, a tanh of the stream)."""
  tanh_branch: bool = False

  def setup(self):
    self.embed = Embed()
    self.a = PreLNLayer(fast=True)
    self.b = PreLNLayer(fast=False)
    self.final = nn.LayerNorm(epsilon=1e-5, param_dtype=F64)

  def __call__(self, x, index):
    h = self.embed(x)
    third = (lambda m, v: jnp.tanh(v)) if self.tanh_branch else (lambda m, v: 0.5 * v)
    if self.is_initializing():
      self.a(h), self.b(h)
    h = nn.switch(index, [lambda m, v: m.a(v), lambda m, v: m.b(v), third], self, h)
    return self.final(h)


def _index(rng, shape):
  return jnp.asarray(shape[0] % 3, jnp.int32)


@pytest.mark.parametrize("tanh_branch", [False, True])
def test_switch_layers(x64, tanh_branch):
  # Without tanh: both blocks' norms and the final one. With a tanh branch,
  # the input projection's shift reaches tanh in branch 2: the final norm
  # cannot fold, and each block's two norms fold with one auxiliary centering
  # of that branch's input (inside the branch: invisible in the others).
  res = _sound(SwitchEncoder(tanh_branch), _args([(2, 4, NMEL), (3, 6, NMEL)], (_index,)),
               expect_folded=4 if tanh_branch else 5)
  assert len(res.fold_report.auxiliary) == (2 if tanh_branch else 0), res.fold_report
  assert res.fold_report.sites[0].folded != tanh_branch, res.fold_report


def _ln(h, g, b, eps=1e-5):
  m = h.mean(-1, keepdims=True)
  return (h - m) * lax.rsqrt(((h - m) ** 2).mean(-1, keepdims=True) + eps) * g + b


def _block(h, p):
  return h + jax.nn.gelu(_ln(h, p["g"], p["be"]) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def _loop_params(seed, n=3):
  rng = np.random.default_rng(seed)
  nrm = lambda *s: jnp.asarray(rng.standard_normal(s), F64)
  return {"w_in": nrm(NMEL, D) / np.sqrt(NMEL), "b_in": 0.3 + 0.5 * nrm(D),
          "layers": {"g": 1 + 0.5 * nrm(n, D), "be": 0.3 + 0.5 * nrm(n, D),
                     "w1": nrm(n, D, FF) / np.sqrt(D), "b1": 0.3 + 0.5 * nrm(n, FF),
                     "w2": nrm(n, FF, D) / np.sqrt(FF), "b2": 0.3 + 0.5 * nrm(n, D)},
          "g_f": 1 + 0.5 * nrm(D), "be_f": 0.3 + 0.5 * nrm(D), "head": nrm(D, 3)}


def _layer(layers, i):
  return jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), layers)


def _trips(rng, shape):
  return jnp.asarray(2 + shape[0] % 2, jnp.int32)


@pytest.mark.parametrize("kind", ["fori", "while_stream_pred", "while_leak"])
def test_while_layers(x64, kind):
  """``fori_loop`` with a traced trip count (a while loop) over stacked layers."""
  def apply(p, x, n):
    h = x @ p["w_in"] + p["b_in"]
    if kind == "fori":
      h = lax.fori_loop(0, n, lambda i, c: _block(c, _layer(p["layers"], i)), h)
    elif kind == "while_stream_pred":   # the trip count depends on the stream
      h = lax.while_loop(lambda c: (c[0] < n) & (jnp.max(c[1]) < 50.0),
                         lambda c: (c[0] + 1, _block(c[1], _layer(p["layers"], c[0]))), (0, h))[1]
    else:                               # 0.1 * LN output joins the carry: no fixed point
      def body(i, c):
        lp = _layer(p["layers"], i)
        return _block(c, lp) + 0.1 * _ln(c, lp["g"], lp["be"])
      h = lax.fori_loop(0, n, body, h)
    return _ln(h, p["g_f"], p["be_f"]) @ p["head"]
  # fori: the body's norm (one site, every iteration) and the final one. The
  # leak makes the carry not zero-sum: one auxiliary centering of the body's
  # result (inside the loop) restores it for both norms. A trip count that
  # reads the stream makes every centering upstream of it visible.
  expect = {"fori": 2, "while_stream_pred": 0, "while_leak": 2}[kind]
  res = assert_sound(apply, _loop_params, _args([(2, 4, NMEL), (3, 6, NMEL)], (_trips,)),
                     grads=False, expect_folded=expect)
  assert len(res.fold_report.auxiliary) == (kind == "while_leak"), res.fold_report


def test_cond_index_from_stream(x64):
  """The branch index is computed from the stream: centering the input
  projection would change which branch runs."""
  def apply(p, x):
    h = x @ p["w_in"] + p["b_in"]
    lp = _layer(p["layers"], 0)
    h = lax.cond(jnp.max(h) > 0.5, lambda v: _block(v, lp), lambda v: 0.5 * v, h)
    return _ln(h, p["g_f"], p["be_f"]) @ p["head"]
  assert_sound(apply, _loop_params, _args([(2, 4, NMEL), (3, 6, NMEL)]), expect_folded=0)


def test_scan_with_cond_inside(x64):
  """A cond inside a scan body: the fixed point runs through both branches."""
  def apply(p, x, flag):
    h = x @ p["w_in"] + p["b_in"]

    def step(c, lp):
      return lax.cond(flag, lambda v: _block(v, lp), lambda v: v - 0.5 * _block(v, lp), c), None
    h, _ = lax.scan(step, h, p["layers"])
    return _ln(h, p["g_f"], p["be_f"]) @ p["head"]
  # The block's norm in each branch and the final norm.
  flag = lambda rng, s: jnp.asarray(s[0] == 2)
  assert_sound(apply, _loop_params, _args([(2, 4, NMEL), (3, 6, NMEL)], (flag,)), expect_folded=3)


V = 11


def _decoder_params(seed, n=2, t=8):
  rng = np.random.default_rng(seed)
  p = _loop_params(seed, n)
  p["wte"] = jnp.asarray(0.2 + 0.7 * rng.standard_normal((V, D)), F64)
  p["wpe"] = jnp.asarray(0.7 * rng.standard_normal((t, D)), F64)
  return p


def _decode(p, ids, n):
  """Greedy refinement loop with the embedding table tied to the LM head, in
  a ``fori_loop`` with a traced trip count (a while loop)."""
  t = ids.shape[1]

  def body(i, c):
    tok, acc = c
    h = p["wte"][tok] + p["wpe"][:t]
    for k in range(p["layers"]["g"].shape[0]):
      h = _block(h, _layer(p["layers"], k))
    logits = _ln(h, p["g_f"], p["be_f"]) @ p["wte"].T
    return jnp.argmax(logits, -1).astype(jnp.int32), acc + logits
  return lax.fori_loop(0, n, body, (ids, jnp.zeros(ids.shape + (V,), F64)))


def _ids_args():
  out = []
  for i, (b, t) in enumerate([(2, 5), (3, 7)]):
    rng = np.random.default_rng([11, i])
    out.append((jnp.asarray(rng.integers(0, V, (b, t)), jnp.int32), jnp.asarray(2 + i, jnp.int32)))
  return out


@pytest.mark.parametrize("tied", ["auto", "copy"])
def test_tied_decoder_loop(x64, tied):
  # The 2 block norms and the final norm inside the loop body fold: the tied
  # table gets an auxiliary centering of its lookup (inside the body) or a
  # centered copy for the lookup.
  res = assert_sound(_decode, _decoder_params, _ids_args(), grads=False, expect_folded=3,
                     tied_weights=tied)
  rep = res.fold_report
  if tied == "copy":
    assert rep.untied_bytes > 0 and not rep.auxiliary, rep
  else:
    assert len(rep.auxiliary) == 1, rep
