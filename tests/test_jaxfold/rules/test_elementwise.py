"""Per-rule tests of ``jaxfold/_src/rules/elementwise.py``: one small program per
rule variant, with the mathematically correct expectation.

Every test runs the checks of ``fold_checks.check_fold`` in float64 with random
non-uniform γ, β and biases (fold exact at two batch sizes, CBWC exact at other
parameters, CBWC gradients, every in-place centering invisible). Where the
mathematics clearly says how many norms are foldable, ``expect_folded`` also
pins ``report.num_folded`` (so an implementation that never folds fails too;
``0`` where no fold is sound).
"""

import fuzz_programs as fp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fold_checks import DIN, assert_sound, rel_err, x_args
from jax import lax

import jaxfold

F64, F32, I32 = jnp.float64, jnp.float32, jnp.int32
D = 8
EPS = 1e-5
DENSE = {"w": (DIN, D), "b": (D,), "g": (D,), "be": (D,)}


def dense_ln(op, ln=fp.ln_fast, **extra_shapes):
  """x @ w + b -> op(h, p, *rest) -> LayerNorm; returns (apply, shapes)."""
  def apply(p, x, *rest):
    return ln(op(x @ p["w"] + p["b"], p, *rest), p["g"], p["be"])
  return apply, dict(DENSE, **extra_shapes)


def run(op, expect, ln=fp.ln_fast, extra=None, extra_shapes=None, **kw):
  apply, shapes = dense_ln(op, ln, **(extra_shapes or {}))
  return assert_sound(apply, shapes, x_args(extra=extra), expect_folded=expect, **kw)


def token_mask(rng, b):
  return (jnp.asarray(rng.random((b, 4, 1)) < 0.6),)


def feature_mask(rng, b):
  return (jnp.asarray(rng.random((b, 4, D)) < 0.6),)


def ids(rng, b):
  return (jnp.asarray(rng.integers(0, 9, (b, 4)), I32),)


# ----------------------------------------------------------------------------
# add / sub / neg


def test_add_same_shift(x64):
  run(lambda h, p: h + 0.5 * h, 1)


def test_add_two_shifts(x64):
  def apply(p, x):
    return fp.ln_two_pass(x @ p["w"] + p["b"] + jnp.tanh(x) @ p["w2"] + p["b2"], p["g"], p["be"])
  assert_sound(apply, dict(DENSE, w2=(DIN, D), b2=(D,)), x_args(), expect_folded=1)


def test_add_scalar_operand(x64):
  # Centering is invisible, but h + 0.37 is not zero-sum: either refuse, or
  # (soundly) center the constant too. Only exactness is pinned.
  run(lambda h, p: h + 0.37, None)


def test_add_size1_broadcast(x64):
  run(lambda h, p: h + p["s"], None, extra_shapes={"s": (4, 1)})


def test_add_any_from_inner_gradient(x64):
  # jax.grad inside the program: its transpose sums cotangents with add_any.
  run(lambda h, p: h + 0.1 * jax.grad(lambda z: jnp.sum(jnp.sin(z) * z))(h), 0)


def test_sub_cancellation_explicit_centering(x64):
  # Two sites: the explicit centering's mean (folds by centering w, b) and the norm's, whose
  # input is zero-sum without centering anything, so its mean can go too (before: refused as
  # "the output of normalization #0 ... γ ⊙ n + β", pinned here as 1).
  run(lambda h, p: h - h.mean(-1, keepdims=True), 2)


def test_sub_near_cancellation_is_not_a_layernorm(x64):
  # h − (1 − 9e-7)·mean(h): a shift survives (×9e-7) at the outputs, float64 sees it.
  apply, shapes = dense_ln(lambda h, p: h, fp.ln_near_cancel)
  assert_sound(apply, shapes, x_args(), expect_folded=0)


def test_sub_near_cancellation_before_layernorm(x64):
  # The same near-cancellation as a pre-norm op: the LN ignores the leftover shift.
  run(lambda h, p: h - (1 - 9e-7) * h.mean(-1, keepdims=True), None)


def test_neg(x64):
  run(lambda h, p: -h, 1)


# ----------------------------------------------------------------------------
# mul / div / integer_pow


def test_mul_constant_factor(x64):
  run(lambda h, p: 2.5 * h, 1)


def test_mul_scalar_param_factor(x64):
  run(lambda h, p: h * p["s"], 1, extra_shapes={"s": ()})


def test_mul_per_token_factor(x64):
  run(lambda h, p: h * (1 + p["s"] ** 2), 1, extra_shapes={"s": (4, 1)})


def test_mul_varying_factor(x64):
  run(lambda h, p: h * p["gv"], 0, extra_shapes={"gv": (D,)})


def test_mul_same_shift(x64):
  run(lambda h, p: h + 0.1 * h * h, 0)


def test_mul_random_mask_varying(x64):
  # Dropout whose mask varies along the features: not zero-sum.
  run(lambda h, p, k: h * jax.random.bernoulli(k, 0.8, h.shape) / 0.8, 0,
      extra=lambda rng, b: (jax.random.PRNGKey(int(rng.integers(1000))),))


def test_div_constant_divisor(x64):
  run(lambda h, p: h / 4.0, 1)


def test_div_rounded_reciprocal(x64):
  run(lambda h, p: h * (1.0 / jnp.asarray(7.0, F64)) + h / 3.0, 1)


def test_div_per_token_divisor(x64):
  run(lambda h, p: h / (1 + p["s"] ** 2), 1, extra_shapes={"s": (4, 1)})


def test_div_shift_in_divisor(x64):
  run(lambda h, p: h / (2 + jnp.tanh(h)), 0)


@pytest.mark.parametrize("n", [2, 3, -1, -2])
def test_integer_pow(x64, n):
  if n > 0:
    run(lambda h, p: h + 0.05 * h ** n, 0)
  else:
    run(lambda h, p: h * (1 + h * h) ** n, 0)


def test_square_after_norm_then_dense_norm(x64):
  # A power on the post-norm path does not stop the next Dense -> LN fold.
  def apply(p, x):
    n = fp.ln_fast(x @ p["w"] + p["b"], p["g"], p["be"])
    return fp.ln_two_pass(jnp.square(n) @ p["w2"] + p["b2"], p["g2"], p["be2"])
  assert_sound(apply, dict(DENSE, w2=(D, D), b2=(D,), g2=(D,), be2=(D,)), x_args(), expect_folded=2)


# ----------------------------------------------------------------------------
# max / min / clamp / comparisons / select_n


@pytest.mark.parametrize("f", [lambda h: jnp.maximum(h, 0.0), lambda h: jnp.minimum(h, 1.0),
                               lambda h: lax.clamp(-1.5, h, 1.5)], ids=["max", "min", "clamp"])
def test_max_min_clamp_before_norm(x64, f):
  run(lambda h, p: f(h), 0)


def test_select_constant_predicate(x64):
  run(lambda h, p: lax.select_n(jnp.asarray(True), 0.5 * h, h), 1)


def test_select_per_token_predicate(x64):
  run(lambda h, p, m: jnp.where(m, h, 0.0), 1, extra=token_mask)


def test_select_per_token_between_two_dense(x64):
  def apply(p, x, m):
    h1, h2 = x @ p["w"] + p["b"], x @ p["w2"] + p["b2"]
    return fp.ln_jnp_var(lax.select_n(jnp.broadcast_to(m, h1.shape), h2, h1), p["g"], p["be"])
  assert_sound(apply, dict(DENSE, w2=(DIN, D), b2=(D,)), x_args(extra=token_mask), expect_folded=1)


def test_select_per_token_nested(x64):
  # where(m2, y, 0.5 y) with y = where(m1, h, 0.5 h): every operand reaches the
  # norm twice (a DAG); the Dense must still be centered for the fold.
  def sel(m, v):
    return jnp.where(m, v, 0.5 * v)
  run(lambda h, p, m1, m2: sel(m2, sel(m1, h)), 1,
      extra=lambda rng, b: token_mask(rng, b) + token_mask(rng, b))


def test_select_varying_predicate(x64):
  run(lambda h, p, m: jnp.where(m, h, 0.3 * h), 0, extra=feature_mask)


def test_select_shift_in_predicate(x64):
  run(lambda h, p: jnp.where(h > 0, h, 0.1 * h), 0)


# Integer side computations give per-token predicates: they never carry a shift.
INT_FNS = {
    "shift_left": lambda k: lax.shift_left(k, jnp.int32(2)) > 9,
    "shift_right_arithmetic": lambda k: lax.shift_right_arithmetic(3 * k - 7, jnp.int32(1)) > 0,
    "shift_right_logical": lambda k: lax.shift_right_logical(k + 5, jnp.int32(1)) > 4,
    "population_count": lambda k: lax.population_count(k) == 1,
    "clz": lambda k: lax.clz(k + 1) >= 29,
    "and_or_xor_not": lambda k: ((k & 5) | 2) ^ 3 != ~k,
    "mulhi": lambda k: lax.mulhi(k * 1000003, jnp.int32(77777777)) % 2 == 0,
    "rem": lambda k: lax.rem(k, jnp.int32(3)) == 1,
    "compare": lambda k: (k < 4) & (k >= 1) | (k == 7) & (k != 2) | (k <= 0),
    "iota": lambda k: (k + jnp.arange(k.shape[1], dtype=I32)) % 2 == 0,
    "reduce_and_or_xor": lambda k: (jnp.all(k > 0, 1, keepdims=True) | jnp.any(k > 7, 1, keepdims=True))
    & (lax.reduce_xor(k, (1,))[:, None] % 2 == 0) | (k > 5),
}


@pytest.mark.parametrize("name", sorted(INT_FNS))
def test_integer_side_computation_mask(x64, name):
  f = INT_FNS[name]
  run(lambda h, p, k: jnp.where(f(k)[..., None], h, 0.0), 1, extra=ids)


# ----------------------------------------------------------------------------
# casts and identities


@pytest.mark.parametrize("dt", [jnp.int8, I32], ids=["int8", "int32"])
def test_convert_int_target(x64, dt):
  run(lambda h, p: (4 * h + 0.37).astype(dt).astype(F64) / 4, 0)


@pytest.mark.parametrize("dt", [F32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
def test_convert_narrowing_beyond_tolerance(x64, dt):
  run(lambda h, p: h.astype(dt).astype(F64), 0)


def test_convert_narrowing_within_tolerance(x64):
  # The outputs are float32: a float32 rounding on the way is within tolerance.
  def apply(p, x):
    h = (x @ p["w"] + p["b"]).astype(F32)
    return fp.ln_fast(h, p["g"].astype(F32), p["be"].astype(F32))
  assert_sound(apply, DENSE, x_args(), tol=1e-5, grad_tol=1e-3)


def test_convert_widening(x64):
  # float32 kernel and bias widened to float64 (a centered float32 parameter is
  # exact only to float32 precision: tolerance 1e-5).
  def apply(p, x):
    return fp.ln_two_pass(x @ p["w"].astype(F64) + p["b"].astype(F64), p["g"], p["be"])

  def f32(p):
    return dict(p, w=p["w"].astype(F32), b=p["b"].astype(F32))
  assert_sound(apply, DENSE, x_args(), tol=1e-5, grad_tol=1e-4, expect_folded=1, convert=f32)


def test_reduce_precision_wide(x64):
  run(lambda h, p: lax.reduce_precision(h, exponent_bits=11, mantissa_bits=52), 1)


@pytest.mark.parametrize("bits", [(8, 7), (5, 10), (8, 23)], ids=["bf16", "f16", "f32"])
def test_reduce_precision_narrow(x64, bits):
  run(lambda h, p: lax.reduce_precision(h, *bits), 0)


def test_optimization_barrier_shifted_second_operand(x64):
  def apply(p, x):
    u, h = lax.optimization_barrier((jnp.tanh(x @ p["wu"]), x @ p["w"] + p["b"]))
    return fp.ln_fast(h, p["g"], p["be"]), u
  assert_sound(apply, dict(DENSE, wu=(DIN, D)), x_args(), expect_folded=1)


def test_optimization_barrier_with_a_parameter_operand(x64):
  def apply(p, x):
    u, h = lax.optimization_barrier((jnp.tanh(p["v"]), x @ p["w"] + p["b"]))
    return fp.ln_two_pass(h, p["g"], p["be"]) + u
  assert_sound(apply, dict(DENSE, v=(D,)), x_args(), expect_folded=1)


def test_optimization_barrier_shifted_value_also_returned(x64):
  def apply(p, x):
    hk = x @ p["w"] + p["b"]
    h2 = x @ p["w2"] + p["b2"]
    a, b = lax.optimization_barrier((h2, hk))
    return fp.ln_fast(b, p["g"], p["be"]), a, fp.ln_two_pass(h2, p["g2"], p["be2"])
  # hk's producer is centerable; h2 is also returned raw, so its producer is not.
  assert_sound(apply, dict(DENSE, w2=(DIN, D), b2=(D,), g2=(D,), be2=(D,)), x_args(), expect_folded=1)


def test_copy(x64):
  run(lambda h, p: jnp.copy(h), 1)


def test_sharding_constraint(x64):
  dev = jax.devices("cpu")[0]
  run(lambda h, p: lax.with_sharding_constraint(h, jax.sharding.SingleDeviceSharding(dev)), 1)


def test_stop_gradient_on_shifted_value(x64):
  # Forward: foldable. CBWC gradients must still equal the original's.
  run(lambda h, p: h + lax.stop_gradient(0.1 * h), 1)


def test_stop_gradient_mean_layernorm(x64):
  # Same forward as a LayerNorm (fold is sound); its JAX gradient has a component
  # along the shift, so CBWC must keep that gradient (checked by (d)).
  apply, shapes = dense_ln(lambda h, p: h, fp.ln_stopgrad_mean)
  assert_sound(apply, shapes, x_args(), expect_folded=1)


# ----------------------------------------------------------------------------
# Nonlinearities: before a norm they stop the fold; after it, the next
# Dense -> norm is still foldable.

UNARY = sorted(fp._UNARY)


# Exactly affine in h (real((h+i)(1+2i)) = h − 2, imag(...) = 2h + 1), the
# identity for finite h, or the identity up to one ulp: a fold may be sound.
MAYBE_AFFINE = {"real", "imag", "is_finite", "nextafter"}


@pytest.mark.parametrize("name", UNARY)
def test_nonlinearity_before_norm(x64, name):
  f = fp._UNARY[name][1]
  run(lambda h, p: f(h), None if name in MAYBE_AFFINE else 0)


@pytest.mark.parametrize("name", ["tanh", "erf", "logistic", "abs", "exp", "sign", "floor", "complex"])
def test_nonlinearity_between_two_norms(x64, name):
  f = fp._UNARY[name][1]

  def apply(p, x):
    n = fp.ln_two_pass(x @ p["w"] + p["b"], p["g"], p["be"])
    return fp.ln_fast(f(n) @ p["w2"] + p["b2"], p["g2"], p["be2"])
  assert_sound(apply, dict(DENSE, w2=(D, D), b2=(D,), g2=(D,), be2=(D,)), x_args(), expect_folded=2)


# ----------------------------------------------------------------------------
# dtypes: CBWC traced with float32 parameters, called with bfloat16 ones.


def _flax_ln32(h, g, b):
  return fp.nn.LayerNorm(epsilon=1e-5).apply({"params": {"scale": g, "bias": b}}, h)


@pytest.mark.parametrize("ln", [fp.ln_fast, _flax_ln32], ids=["hand", "flax"])
def test_cbwc_float32_trace_bfloat16_params(ln):
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", False)
  try:
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.standard_normal((DIN, D)) / np.sqrt(DIN), F32),
         "b": jnp.asarray(0.3 + 0.5 * rng.standard_normal(D), F32),
         "g": jnp.asarray(1 + 0.5 * rng.standard_normal(D), F32),
         "be": jnp.asarray(0.3 + 0.5 * rng.standard_normal(D), F32)}
    x = jnp.asarray(rng.standard_normal((2, 4, DIN)), F32)

    def apply(q, x):
      return ln(x @ q["w"] + q["b"], q["g"], q["be"])
    r = jaxfold.cbwc(p, apply, x)
    pb = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), p)
    ref = apply(pb, x)
    try:
      out = r.apply_fn(pb, x)
    except jaxfold.FoldError:
      return                      # a clear refusal is fine
    except Exception as e:  # noqa: BLE001
      pytest.fail(f"CBWC with bfloat16 params raised {type(e).__name__} (not a jaxfold.FoldError): {e}")
    assert jnp.result_type(out) == jnp.result_type(ref)
    err = rel_err(ref, out)
    assert err < 0.05, f"CBWC with bfloat16 params differs from the original: rel err {err:.3g}"
  finally:
    jax.config.update("jax_enable_x64", prev)


# ----------------------------------------------------------------------------
# exp / log / max with -inf: a shift constant along the features cancels in a
# softmax (exp(x + c) = exp(x)(1 + d), the ratio drops 1 + d; log gives c back).
# Each invariant enters as a per-token factor of h, so the norm folds only if
# centering w stays invisible through it.


def _per_token(f):
  return lambda h, p: h * (1.0 + jnp.max(f(h), -1, keepdims=True))


def _lse(h):
  return jnp.log(jnp.sum(jnp.exp(h), -1, keepdims=True))


def test_softmax_over_the_features_ignores_the_shift(x64):
  run(_per_token(lambda h: jax.nn.softmax(h, -1)), 1)


def test_exp_ratio_of_sums(x64):
  run(_per_token(lambda h: jnp.exp(h) / jnp.sum(jnp.exp(h), -1, keepdims=True)), 1)


def test_log_of_a_sum_of_exps(x64):
  run(_per_token(lambda h: (h - _lse(h)) ** 2), 1)


def test_max_with_minus_inf_passes_the_shift(x64):
  run(_per_token(lambda h: jnp.maximum(h, -jnp.inf) - jnp.max(h, -1, keepdims=True)), 1)


def test_softmax_over_the_tokens_sees_the_shift(x64):
  run(_per_token(lambda h: jax.nn.softmax(h, 1)), 0)


def test_exp_alone_sees_the_shift(x64):
  run(_per_token(jnp.exp), 0)


def test_declared_roles_of_casts_and_arithmetic():
  """The roles fuse_affine and defer_norms ask instead of a primitive's name:
  ``cast`` (present on the casts only; the narrowest float format a value
  passes through) and ``arith``."""
  from jaxfold._src.rules import all_rules, rule_for
  assert {r.name for r in all_rules() if r.cast is not None} == {"convert_element_type", "reduce_precision"}
  conv = rule_for(lax.convert_element_type_p).cast
  assert conv({}, jnp.float32, jnp.bfloat16) == (7, 8)
  assert conv({}, jnp.float16, jnp.float32) == (10, 5)
  assert conv({}, jnp.float32, jnp.float8_e4m3fn) == (3, 4)
  assert conv({}, jnp.float32, jnp.int32) is None and conv({}, jnp.int8, jnp.float32) is None
  rp = rule_for(lax.reduce_precision_p).cast
  assert rp({"mantissa_bits": 3, "exponent_bits": 4}, jnp.float32, jnp.float32) == (3, 4)
  assert rp({"mantissa_bits": 30, "exponent_bits": 11}, jnp.bfloat16, jnp.bfloat16) == (7, 8)
  assert rule_for(lax.add_p).arith == "+" and rule_for(lax.mul_p).arith == "*"
  assert rule_for(lax.div_p).arith == "/" and rule_for(lax.sub_p).arith == ""


def test_activation_facet_marks_what_activations_are_made_of():
  """online_hadamard finds an MLP's activation by the ``activation`` facet: the
  smooth activations' pieces and ReLU's max, never the affine steps or a norm's rsqrt."""
  from jaxfold._src.rules import rule_for
  made_of = [lax.tanh_p, lax.erf_p, lax.logistic_p, lax.exp_p, lax.expm1_p, lax.max_p]
  affine_or_norm = [lax.add_p, lax.mul_p, lax.div_p, lax.neg_p, lax.rsqrt_p, lax.sqrt_p, lax.integer_pow_p]
  assert all(rule_for(p).activation for p in made_of)
  assert not any(rule_for(p).activation for p in affine_or_norm)
