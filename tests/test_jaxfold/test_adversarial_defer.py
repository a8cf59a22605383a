"""Adversarial programs against ``defer_norms`` and ``fuse_affine`` (adv6).

Each program is compared with the *original* (unfolded) function in float64 with
random non-uniform γ, β and biases, at the example shape and at others (batch 1,
one token); where jaxfold must refuse, the refusal is checked by its reason and
the result must still equal the original.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from helpers import named_params
from jax import lax

import jaxfold

D = 16


def _x(*shape, seed=1, dtype=jnp.float64):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, dtype)


_params = named_params


BASE = dict(w1=(4, D), b1=(D,), g=(D,), beta=(D,), w2=(D, 6), b2=(6,), w3=(6, 3))


def _stem(p, x):
  return x @ p["w1"] + p["b1"]


def _ln(h, g, b, eps=1e-6):
  m = h.mean(-1, keepdims=True)
  return (h - m) * lax.rsqrt(jnp.square(h - m).mean(-1, keepdims=True) + eps) * g + b


def _check(fn, p, d, shapes, tol=1e-9):
  for k, shape in enumerate(shapes):
    x = _x(*shape, seed=10 + k)
    err = rel_err(fn(p, x), jax.jit(lambda q, a: d.apply_fn(q, a))(d.params, x))
    assert err < tol, (shape, err, [s.reason for s in d.report.deferred])


# ----------------------------------------------------------------------------
# Shapes: a deferred model folded at one shape serves others. The deferral's
# decisions are per site (which readers are deferred), not the paths of its
# readers, which a batch-1 trace numbers differently (bug: FuseError "fuse
# differently ... call fuse_affine again" for identical fused parameters).


def keras_ln_block(p, x):
  h = _stem(p, x)
  mean = h.mean(-1, keepdims=True)
  var = jnp.square(h).mean(-1, keepdims=True) - jnp.square(mean)   # Keras 3: E[h²] − E[h]²
  inv = lax.rsqrt(var + 1e-6) * p["g"]
  return (h * inv + (-mean * inv + p["beta"])) @ p["w2"] + p["b2"]


def keras_reduced_products(p, x):
  h = _stem(p, x)
  mean = h.mean(-1, keepdims=True)
  r = lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) - jnp.square(mean) + 1e-6)
  return ((h * r - mean * r) * p["g"] + p["beta"]) @ p["w2"] + p["b2"]   # mean·r per row, then broadcast


def squeezed_token(p, x):
  y = _ln(jnp.squeeze(_stem(p, x[:, :1]), 1), p["g"], p["beta"])   # (B, D): one token per example
  return y @ p["w2"]


SHAPES = [(3, 7, 4), (1, 1, 4), (1, 7, 4), (4, 1, 4)]


@pytest.mark.parametrize("fn", [keras_ln_block, keras_reduced_products, squeezed_token])
@pytest.mark.parametrize("norm_impl", ["xla", "interpret"])
@pytest.mark.parametrize("at", [(1, 1, 4), (3, 7, 4)])
def test_deferred_model_serves_other_shapes(x64, fn, norm_impl, at):
  p = _params(**BASE)
  d = jaxfold.fold(p, fn, _x(*at), defer_norms=True, norm_impl=norm_impl)
  assert d.report.num_fused == d.report.num_deferred == 1, d.report
  if norm_impl == "interpret":
    assert "the RMS-matmul kernel computes" in d.report.deferred[0].reason, d.report
  _check(fn, p, d, SHAPES)


# ----------------------------------------------------------------------------
# Range: deferral contracts the un-normalized input. In float16 (5 exponent bits)
# a residual stream of a few ten thousand overflows to inf where the original,
# which rounds the normalized value, is finite (bug: NaN outputs). Refused with
# the dtype named; the result is the fused model's.


def f16_reader(p, x):
  h = (x @ p["w1"] + p["b1"]) * 40000.0                # a large float32 residual stream
  y = _ln(h, p["g"], p["beta"], 1e-5).astype(jnp.float16)
  return jnp.dot(y, p["w2"], preferred_element_type=jnp.float32) + p["b2"]


def f16_reader_f16_out(p, x):
  h = (x @ p["w1"] + p["b1"]) * 40000.0
  y = _ln(h, p["g"], p["beta"], 1e-5).astype(jnp.float16)
  return (y @ p["w2"]).astype(jnp.float32) + p["b2"]


def f32_reader_of_f64(p, x):
  y = _ln(_stem(p, x) * 1e300, p["g"], p["beta"]).astype(jnp.float32)   # x past float32's range
  return jnp.dot(y, p["w2"].astype(jnp.float32), preferred_element_type=jnp.float64)


@pytest.mark.parametrize("fn", [f16_reader, f16_reader_f16_out, f32_reader_of_f64])
@pytest.mark.parametrize("norm_impl", ["xla", "interpret"])
def test_narrow_range_reader_is_not_deferred(x64, fn, norm_impl):
  p = _params(**BASE)
  if fn is not f32_reader_of_f64:
    p = {k: v.astype(jnp.float16 if k == "w2" else jnp.float32) for k, v in p.items()}
  x = _x(3, 7, 4, dtype=jnp.float32 if fn is not f32_reader_of_f64 else jnp.float64)
  d = jaxfold.fold(p, fn, x, defer_norms=True, norm_impl=norm_impl)
  (site,) = d.report.deferred
  assert not site.deferred and "range is narrower" in site.reason, site.reason
  ref, out = fn(p, x), d.apply_fn(d.params, x)
  assert bool(jnp.all(jnp.isfinite(ref))) and bool(jnp.all(jnp.isfinite(out)))
  fu = jaxfold.fuse_affine(jaxfold.fold(p, fn, x, norm_impl=norm_impl))
  assert rel_err(fu.apply_fn(fu.params, x), out) == 0.0


# ----------------------------------------------------------------------------
# One weight read twice under one norm, along different axes (bug: fuse_affine
# named both untied copies "W@fusedγ" and both biases "W@biasβ", so the second
# overwrote the first: rel err 0.5, or a broadcasting TypeError). Each reading
# gets its own copy and bias; equal readings share one.


def square_both_ways(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return jnp.tanh(y @ p["wsq"]) + y @ p["wsq"].T           # W (D, D) contracted on either axis


def lhs_and_rhs(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return y @ p["w2"] + (p["w2"].T @ jnp.swapaxes(y, -1, -2)).swapaxes(-1, -2)   # y on either side


def same_weight_twice(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return jnp.tanh(y @ p["w2"]) + y @ p["w2"]                # one reading: one copy, one bias


@pytest.mark.parametrize("fn, copies, biases",
                         [(square_both_ways, 2, 2), (lhs_and_rhs, 1, 2), (same_weight_twice, 1, 1)])
@pytest.mark.parametrize("defer", [False, True])
def test_one_weight_read_differently_by_one_norm(x64, fn, copies, biases, defer):
  p = _params(**BASE, wsq=(D, D))
  x = _x(3, 7, 4)
  fo = jaxfold.fold(p, fn, x)
  d = jaxfold.fuse_affine(fo)
  if defer:
    d = jaxfold.defer_norms(d)
    assert d.report.num_deferred == 1, d.report
  assert d.report.num_fused == 1, d.report
  assert len([k for k in d.params.extras if "@fused" in k]) == copies, sorted(d.params.extras)
  assert len([k for k in d.params.extras if "@bias" in k]) == biases, sorted(d.params.extras)
  _check(fn, p, d, [(3, 7, 4), (2, 5, 4), (1, 1, 4)])


# ----------------------------------------------------------------------------
# rotate(defer_norms(fused), q), the documented order, with kernel readers (bug:
# RotateError "the rotated stream reaches `pallas_call`": the proof traced the
# kernels as they run). The proof reads their XLA expression, which each kernel
# computes exactly; the rotated model still runs the kernels.


def two_blocks(p, x):
  h = _stem(p, x)
  h = h + jnp.tanh(_ln(h, p["g"], p["beta"]) @ p["wa"] + p["ba"]) @ p["wb"]
  y = _ln(h, p["g2"], p["beta2"])
  return y @ p["w2"] + p["b2"], y @ p["w5"]             # one reader with its bias, then two siblings


def test_rotate_a_deferred_model_with_kernel_readers(x64):
  p = _params(**BASE, wa=(D, 8), ba=(8,), wb=(8, D), g2=(D,), beta2=(D,), w5=(D, 5))
  d = jaxfold.fold(p, two_blocks, _x(3, 7, 4), defer_norms=True, norm_impl="interpret")
  assert all("the RMS-matmul kernel computes" in s.reason for s in d.report.deferred), d.report
  q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(D, D)))
  r = jaxfold.rotate(d, jnp.asarray(q))
  assert str(jax.make_jaxpr(r.apply_fn)(r.params, _x(3, 7, 4))).count("pallas_call") == 2
  for k, shape in enumerate([(3, 7, 4), (1, 1, 4), (2, 5, 4)]):
    x = _x(*shape, seed=20 + k)
    assert rel_err(two_blocks(p, x), jax.jit(lambda q_, a: r.apply_fn(q_, a))(r.params, x)) < 1e-9
