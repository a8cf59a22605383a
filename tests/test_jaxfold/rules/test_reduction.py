"""Per-rule tests of ``jaxfold/_src/rules/reduction.py`` (sums, max/min/prod,
arg-reductions, cumulative ops), including every LayerNorm formulation the
sum over the normalized axes appears in.

See ``test_elementwise.py`` for what every test checks.
"""

import fuzz_programs as fp
import jax.numpy as jnp
import pytest
from fold_checks import DIN, assert_sound, x_args
from jax import lax

F64, I32 = jnp.float64, jnp.int32
D = 8
T = 4
DENSE = {"w": (DIN, D), "b": (D,), "g": (D,), "be": (D,)}


def run(op, expect, ln=fp.ln_fast, extra=None, extra_shapes=None, **kw):
  def apply(p, x, *rest):
    return ln(op(x @ p["w"] + p["b"], p, *rest), p["g"], p["be"])
  return assert_sound(apply, dict(DENSE, **(extra_shapes or {})), x_args(extra=extra),
                      expect_folded=expect, **kw)


# ----------------------------------------------------------------------------
# reduce_sum over the normalized axes: every LayerNorm formulation.

FOLDABLE_NORMS = ["ln_fast", "ln_e2", "ln_two_pass", "ln_jnp_var", "ln_bessel_ddof1", "ln_rsqrt_4var",
                  "ln_standardize", "ln_sum_times_recip", "ln_traced_recip", "ln_nokeepdims",
                  "ln_eps_outside_sqrt", "ln_beta_before_gamma", "flax_layernorm_fast",
                  "flax_layernorm_two_pass", "flax_layernorm_eps0.5"]


@pytest.mark.parametrize("name", FOLDABLE_NORMS)
def test_layernorm_formulation(x64, name):
  kind = fp.NORMS_BY_NAME[name]
  run(lambda h, p: h, 1, ln=lambda h, g, b: kind.fn(h, g, b, None))


@pytest.mark.parametrize("name", ["ln_rsqrt_4var", "ln_bessel_ddof1", "ln_eps_outside_sqrt",
                                  "ln_beta_before_gamma", "flax_layernorm_eps0.5", "ln_fast"])
def test_layernorm_formulation_interpret_kernel(x64, name):
  # The folded norm run as the Pallas kernel (interpret mode): its epilogue must
  # compute what the original formulation computes.
  kind = fp.NORMS_BY_NAME[name]
  run(lambda h, p: h, 1, ln=lambda h, g, b: kind.fn(h, g, b, None), grads=False, norm_impl="interpret")


def test_layernorm_inv_std_also_returned_interpret_kernel(x64):
  def apply(p, x):
    h = x @ p["w"] + p["b"]
    c = h - h.mean(-1, keepdims=True)
    inv = lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-5)
    return c * inv * p["g"] + p["be"], inv
  assert_sound(apply, DENSE, x_args(), expect_folded=1, grads=False, norm_impl="interpret")


def test_rms_norm_is_not_a_site(x64):
  run(lambda h, p: h, 0, ln=fp.rms_norm)


def test_layernorm_mean_also_returned(x64):
  # The mean is an output: it sees the shift, so the Dense cannot be centered.
  def apply(p, x):
    h = x @ p["w"] + p["b"]
    mu = h.mean(-1, keepdims=True)
    c = h - mu
    return c * lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-5) * p["g"] + p["be"], mu
  assert_sound(apply, DENSE, x_args(), expect_folded=0)


def test_layernorm_over_tokens_and_features(x64):
  run(lambda h, p: h, 0, ln=lambda h, g, b: fp.ln_tokens_features(h, g, b))


def test_reduce_sum_normalized_axes_feeds_a_factor(x64):
  # tanh(sum_D h) sees the shift (×D): visible.
  run(lambda h, p: h * (1 + 0.1 * jnp.tanh(h.sum(-1, keepdims=True))), 0)


def test_reduce_sum_over_tokens_mean_pool(x64):
  # Mean over tokens of zero-sum rows is zero-sum; the shift stays constant along D.
  def apply(p, x):
    return fp.ln_two_pass((x @ p["w"] + p["b"]).mean(1), p["g"], p["be"])
  assert_sound(apply, DENSE, x_args(), expect_folded=1)


def test_reduce_sum_over_tokens_added_back(x64):
  run(lambda h, p: h + h.mean(1, keepdims=True), 1)


# ----------------------------------------------------------------------------
# max / min / prod, argmax / argmin, and / or / xor


def test_max_pool_over_tokens(x64):
  def apply(p, x):
    return fp.ln_fast(jnp.max(x @ p["w"] + p["b"], 1), p["g"], p["be"])
  assert_sound(apply, DENSE, x_args(), expect_folded=0)


def test_min_over_features(x64):
  # min_D(h + c) = min_D(h) + c: the centering is invisible, but the result is not zero-sum.
  run(lambda h, p: h - 0.5 * jnp.min(h, -1, keepdims=True), 0)


def test_prod_over_tokens(x64):
  run(lambda h, p: h * jnp.prod(1 + 0.1 * jnp.tanh(h), 1, keepdims=True), 0)


@pytest.mark.parametrize("f", [jnp.argmax, jnp.argmin], ids=["argmax", "argmin"])
def test_arg_reduction_over_features_gates_tokens(x64, f):
  # argmax_D(h + c) = argmax_D(h): a sound analysis may fold; exactness is what counts.
  run(lambda h, p: jnp.where((f(h, -1) % 2 == 0)[..., None], h, 0.0), None)


def test_bool_reductions_of_ids_gate_tokens(x64):
  def ids(rng, b):
    return (jnp.asarray(rng.integers(0, 9, (b, T)), I32),)

  def gate(k):
    return (jnp.all(k > 0, 1, keepdims=True) | jnp.any(k > 7, 1, keepdims=True)) ^ (k % 2 == 0)
  run(lambda h, p, k: jnp.where(gate(k)[..., None], h, -h), 1, extra=ids)


def test_reduce_max_min_of_ids_scale_tokens(x64):
  def ids(rng, b):
    return (jnp.asarray(rng.integers(0, 9, (b, T)), I32),)

  def scale(k):
    return (jnp.max(k, 1, keepdims=True) - jnp.min(k, 1, keepdims=True) + k).astype(F64)[..., None]
  run(lambda h, p, k: h * (1 + 0.1 * scale(k)), 1, extra=ids)


# ----------------------------------------------------------------------------
# Cumulative ops


@pytest.mark.parametrize("reverse", [False, True])
def test_cumsum_other_axis(x64, reverse):
  run(lambda h, p: lax.cumsum(h, 1, reverse=reverse), 1)


@pytest.mark.parametrize("reverse", [False, True])
def test_cumsum_normalized_axis(x64, reverse):
  run(lambda h, p: lax.cumsum(h, 2, reverse=reverse), 0)


def test_diff_normalized_axis(x64):
  # The shift cancels in a difference along the features (invisible), but the
  # result is not zero-sum, so the mean must stay.
  def apply(p, x):
    return fp.ln_fast(jnp.diff(x @ p["w"] + p["b"], axis=-1), p["g"], p["be"])
  assert_sound(apply, {"w": (DIN, D), "b": (D,), "g": (D - 1,), "be": (D - 1,)}, x_args(), expect_folded=0)


@pytest.mark.parametrize("name", ["cumprod", "cummax", "cummin", "cumlogsumexp"])
def test_other_cumulative_before_norm(x64, name):
  f = {"cumprod": lambda h: h * lax.cumprod(1 + 0.1 * jnp.tanh(h), 1),
       "cummax": lambda h: lax.cummax(h, 1), "cummin": lambda h: lax.cummin(h, 1),
       "cumlogsumexp": lambda h: lax.cumlogsumexp(h, 1)}[name]
  run(lambda h, p: f(h), 0)


@pytest.mark.parametrize("name", ["cumprod", "cummax", "cummin", "cumlogsumexp", "cumsum_features"])
def test_cumulative_between_two_norms(x64, name):
  f = {"cumprod": lambda h: lax.cumprod(1 + 0.1 * jnp.tanh(h), 2),
       "cummax": lambda h: lax.cummax(h, 2), "cummin": lambda h: lax.cummin(h, 1),
       "cumlogsumexp": lambda h: lax.cumlogsumexp(h, 2), "cumsum_features": lambda h: lax.cumsum(h, 2)}[name]

  def apply(p, x):
    n = fp.ln_two_pass(x @ p["w"] + p["b"], p["g"], p["be"])
    return fp.ln_fast(f(n) @ p["w2"] + p["b2"], p["g2"], p["be2"])
  assert_sound(apply, dict(DENSE, w2=(D, D), b2=(D,), g2=(D,), be2=(D,)), x_args(), expect_folded=2)


# ----------------------------------------------------------------------------
# max/min/argmax/argmin over the normalized features: a per-token shift is
# constant along them, so max(h + c) = max(h) + c and the indices do not move.

def test_reduce_max_over_features(x64):
  # The softmax normalizer Σ exp(h - max h) is shift-invariant and constant along
  # the features, so h times it stays zero-sum and the shift stays per-token.
  run(lambda h, p: h * jnp.exp(h - jnp.max(h, -1, keepdims=True)).sum(-1, keepdims=True), 1)


def test_reduce_max_subtracted_is_not_zero_sum(x64):
  # h - max(h) is not zero-mean: no fold (the shift rule alone does not make one).
  run(lambda h, p: h - jnp.max(h, -1, keepdims=True), 0)


def test_reduce_min_over_features(x64):
  run(lambda h, p: h * jnp.exp(jnp.min(h, -1, keepdims=True) - h).mean(-1, keepdims=True), 1)


def test_argmax_gate(x64):
  run(lambda h, p: h * (jnp.argmax(h, -1)[..., None] > 3), 1)


def test_argmin_over_tokens_blocks(x64):
  # Over the tokens the per-token shift varies: argmin may move, no fold.
  run(lambda h, p: h * (jnp.argmin(h, 1)[:, None, :] > 1), 0)
