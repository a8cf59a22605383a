"""Per-rule tests of ``jaxfold/_src/rules/contraction.py`` (dot_general and
conv_general_dilated): the producers whose output features get centered, and
contractions a shift flows through.

See ``test_elementwise.py`` for what every test checks.
"""

import math

import fuzz_programs as fp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fold_checks import DIN, assert_sound, x_args
from jax import lax

F64 = jnp.float64
D = 8
T = 4
GB = {"g": (D,), "be": (D,)}


def conv1d(h, k, groups=1):
  return lax.conv_general_dilated(h, k, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
                                  feature_group_count=groups)


# ----------------------------------------------------------------------------
# dot_general


@pytest.mark.parametrize("bias", [True, False])
def test_dense_weight_side(x64, bias):
  def apply(p, x):
    return fp.ln_fast(x @ p["w"] + (p["b"] if bias else 0.0), p["g"], p["be"]) @ p["head"]
  assert_sound(apply, dict(GB, w=(DIN, D), b=(D,), head=(D, 3)), x_args(), expect_folded=1)


def test_dense_transposed_kernel(x64):
  def apply(p, x):
    return fp.ln_two_pass(jnp.einsum("btd,od->bto", x, p["wt"]) + p["b"], p["g"], p["be"])
  assert_sound(apply, dict(GB, wt=(D, DIN), b=(D,)), x_args(), expect_folded=1)


def test_dense_general_two_feature_axes(x64):
  def apply(p, x):
    h = jnp.einsum("btd,dgk->btgk", x, p["w"]) + p["b"]
    return fp.ln_fast(h, p["g"], p["be"], axes=(-2, -1))
  assert_sound(apply, {"w": (DIN, 2, 4), "b": (2, 4), "g": (2, 4), "be": (2, 4)}, x_args(), expect_folded=1)


def test_dense_general_per_head_norm(x64):
  def apply(p, x):
    h = jnp.einsum("btd,dgk->btgk", x, p["w"]) + p["b"]
    return fp.ln_fast(h, p["g"], p["be"]).reshape(x.shape[:2] + (D,))
  assert_sound(apply, {"w": (DIN, 2, 4), "b": (2, 4), "g": (4,), "be": (4,)}, x_args(), expect_folded=1)


def test_activation_side_token_mixing(x64):
  # M (T, T) mixes tokens: a per-token shift stays constant along the features.
  def apply(p, x):
    return fp.ln_fast(jnp.einsum("st,btd->bsd", p["m"], x @ p["w"] + p["b"]), p["g"], p["be"])
  assert_sound(apply, dict(GB, m=(T, T), w=(DIN, D), b=(D,)), x_args(), expect_folded=1)


@pytest.mark.parametrize("method", ["linear", "cubic", "cubic-pytorch"])
def test_activation_side_image_resize(x64, method):
  # An image resize along the tokens (Dinov2 resizes its position table to the
  # patch grid) contracts the tokens with a weight matrix the program computes:
  # a shift constant along the features stays so, whatever the matrix's rows
  # sum to (jax's: one, or zero for outputs sampled outside the input, as in
  # the scaled and translated resize here), and a zero-sum input stays so.
  def apply(p, x):
    h = x @ p["w"] + p["b"]
    a = jax.image.resize(h, (h.shape[0], 6, D), method)
    c = jax.image.scale_and_translate(h, h.shape, (1,), jnp.array([0.7]), jnp.array([-1.2]), method)
    return fp.ln_fast(a, p["g"], p["be"]), fp.ln_two_pass(c, p["g2"], p["be2"])
  args = x_args() + x_args(seed=1, tokens=7)[1:]   # and another length
  assert_sound(apply, dict(GB, g2=(D,), be2=(D,), w=(DIN, D), b=(D,)), args, expect_folded=2)


def test_activation_side_contracts_the_shift(x64):
  # h1 = x W1 + b1 feeds h1 W2 + b2 directly: centering W1 is visible (contracted
  # over its features); W2 can be centered.
  def apply(p, x):
    h1 = x @ p["w1"] + p["b1"]
    return fp.ln_fast(h1 @ p["w2"] + p["b2"], p["g"], p["be"])
  res = assert_sound(apply, dict(GB, w1=(DIN, D), b1=(D,), w2=(D, D), b2=(D,)), x_args(), expect_folded=1)
  centered = {c.param for s in res.fold_report.sites for c in s.centered if c.mode == "in place"}
  assert not centered & {"['w1']", "['b1']"}, res.describe()


@pytest.mark.parametrize("causal", [False, True])
def test_batched_attention_values(x64, causal):
  # x -> Dense -> h (no norm) -> attention(h) -> LN: q/k see any shift of h
  # (softmax), so only Wv, bv can be centered.
  def apply(p, x):
    h = x @ p["w"] + p["b"]
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"] + p["bv"]
    s = jnp.einsum("btd,bsd->bts", q, k) / math.sqrt(D)
    if causal:
      s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    return fp.ln_fast(jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), v), p["g"], p["be"])
  shapes = dict(GB, w=(DIN, D), b=(D,), wq=(D, D), wk=(D, D), wv=(D, D), bv=(D,))
  assert_sound(apply, shapes, x_args(), expect_folded=1)


def test_batched_dot_over_normalized_batch_dim(x64):
  # A contraction batched over the normalized dim (per-feature token mixing):
  # the per-token shift becomes feature-dependent and the result is not
  # zero-sum: no fold is sound.
  def apply(p, x):
    h = x @ p["w"] + p["b"]                                  # (B, T, D)
    mixed = jnp.einsum("dst,btd->bsd", p["m"], h)            # batched over D
    return fp.ln_fast(mixed, p["g"], p["be"])
  assert_sound(apply, dict(GB, w=(DIN, D), b=(D,), m=(D, T, T)), x_args(), expect_folded=0)


def test_jit_projection_called_twice(x64):
  proj = jax.jit(lambda x, w, b: x @ w + b)

  def apply(p, x):
    raw = proj(x, p["w1"], p["b1"])           # exposed as an output: w1/b1 stay
    h = proj(x, p["w2"], p["b2"])             # normalized: w2/b2 centerable
    return raw, fp.ln_fast(h, p["g"], p["be"]) @ p["head"]
  assert_sound(apply, dict(GB, w1=(DIN, D), b1=(D,), w2=(DIN, D), b2=(D,), head=(D, 3)), x_args(),
               expect_folded=1)


# ----------------------------------------------------------------------------
# conv_general_dilated


@pytest.mark.parametrize("width", [1, 3])
def test_conv_kernel(x64, width):
  def apply(p, x):
    return fp.ln_fast(conv1d(x, p["w"]) + p["b"], p["g"], p["be"])
  assert_sound(apply, dict(GB, w=(width, DIN, D), b=(D,)), x_args(), expect_folded=1)


@pytest.mark.parametrize("norm_groups,expect", [(1, 0), (2, 1)])
def test_conv_grouped_kernel(x64, norm_groups, expect):
  # The two feature groups of the conv see different inputs: centering its
  # kernel leaves a shift constant per group only. A LayerNorm over all
  # channels sees it (no fold); a per-token GroupNorm with the conv's groups
  # ignores it (fold). x @ w0 feeds the conv directly (its shift is mixed).
  def apply(p, x):
    h = conv1d(x @ p["w0"], p["w"], groups=2) + p["b"]
    return fp.ln_fast(h, p["g"], p["be"]) if norm_groups == 1 else fp.gn_tokens(h, p["g"], p["be"], 2)
  assert_sound(apply, dict(GB, w0=(DIN, D), w=(3, D // 2, D), b=(D,)), x_args(), expect_folded=expect)


def test_conv_input_carries_a_shift(x64):
  # x -> Dense -> conv over tokens -> LN: the Dense's shift is mixed across
  # output channels by the kernel (visible); the conv kernel is centerable.
  def apply(p, x):
    return fp.ln_two_pass(conv1d(x @ p["w0"] + p["b0"], p["w"]) + p["b"], p["g"], p["be"])
  res = assert_sound(apply, dict(GB, w0=(DIN, D), b0=(D,), w=(3, D, D), b=(D,)), x_args(), expect_folded=1)
  centered = {c.param for s in res.fold_report.sites for c in s.centered if c.mode == "in place"}
  assert not centered & {"['w0']", "['b0']"}, res.describe()


def test_conv2d_groupnorm_over_space_is_not_foldable(x64):
  # Standard GroupNorm after a conv reduces over (H, W, C/G): a per-group
  # centering of the kernel leaves a shift varying over (H, W): no fold.
  def apply(p, img):
    h = lax.conv_general_dilated(img, p["w"], (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["b"]
    return fp.gn_flax(h, p["g"], p["be"], 2)

  def args():
    out = []
    for b, (hh, ww) in ((2, (4, 4)), (3, (4, 4))):
      rng = np.random.default_rng(b)
      out.append((jnp.asarray(rng.standard_normal((b, hh, ww, 3)), F64),))
    return out
  assert_sound(apply, dict(GB, w=(3, 3, 3, D), b=(D,)), args(), expect_folded=0)


def test_conv2d_per_position_groupnorm(x64):
  # GroupNorm per position (over C/G only) after a conv: foldable.
  def apply(p, img):
    h = lax.conv_general_dilated(img, p["w"], (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["b"]
    return fp.gn_tokens(h, p["g"], p["be"], 2)

  def args():
    out = []
    for b in (2, 3):
      rng = np.random.default_rng(b)
      out.append((jnp.asarray(rng.standard_normal((b, 4, 5, 3)), F64),))
    return out
  assert_sound(apply, dict(GB, w=(3, 3, 3, D), b=(D,)), args(), expect_folded=1)


# ----------------------------------------------------------------------------
# A contraction against a constant vector is a sum: a mean written as h @ ones / n
# or einsum('...d,d', h, ones / n) is a site and cancels a shift like jnp.mean.


@pytest.mark.parametrize("form", ["dot", "einsum"])
def test_mean_as_a_contraction_with_ones(x64, form):
  d = 8

  def mean(h):
    ones = jnp.ones((d,), h.dtype)
    m = h @ ones / d if form == "dot" else jnp.einsum("...d,d->...", h, ones / d)
    return m[..., None]

  def ln(h, g, b):
    m = mean(h)
    v = mean(h * h) - m * m      # E[h²] − m²: the mean is never subtracted from h directly
    inv = lax.rsqrt(v + 1e-5) * g
    return h * inv + (-m * inv + b)

  def apply(p, x):
    return ln(x @ p["w"] + p["b"], p["g"], p["be"])

  shapes = {"w": (DIN, d), "b": (d,), "g": (d,), "be": (d,)}
  assert_sound(apply, shapes, x_args(), expect_folded=1)


def test_contraction_with_a_varying_vector_is_not_a_mean(x64):
  def apply(p, x):
    h = x @ p["w"] + p["b"]
    m = (h @ p["u"])[..., None]        # a learned projection, not a mean
    return (h - m) * lax.rsqrt(jnp.mean((h - m) ** 2, -1, keepdims=True) + 1e-5) * p["g"] + p["be"]

  shapes = {"w": (DIN, 8), "b": (8,), "u": (8,), "g": (8,), "be": (8,)}
  assert_sound(apply, shapes, x_args(), expect_folded=0)
