"""Adversarial programs for jaxfold: small JAX programs that try to make a fold wrong.

Each :class:`Program` is a hand-written JAX function with random (non-trivial)
parameters: every γ, β and bias is drawn at random (γ=1, β=0 hides bugs), and
biases have a non-zero mean so that a wrongly removed mean is visible.

``expect_fold``:
  * ``True``  — a correct analysis must fold at least one normalization;
  * ``False`` — folding anything would be wrong (a wrong centering or a
    wrongly removed mean), and no auxiliary centering would pay for itself
    (it would remove at most one mean reduction);
  * ``None``  — either is acceptable (only exactness is checked).

``make_args(seed, variant)``: variant 0 and 1 give different input shapes
(batch 2 × seq 5 and batch 3 × seq 7, or two image sizes).

All programs expect ``jax_enable_x64`` to be on (parameters are float64).

The root causes (``cause``) are those of the adversarial brief:
  rc1 sub-jaxpr reuse · rc2 pad/cumsum · rc3 quantizing casts ·
  rc4 multi-operand primitives · rc5 dynamic slices · rc6 gather fill ·
  rc7 grouped shifts · rc8 near-cancellation · rc9 kernel epilogues ·
  rc10 custom differentiation · rc12 other ideas · rc20 shape generality and
  Keras-3 spellings · rc21 core-fold adversaries (order statistics, pooling and
  cumulative ops along axes the shift varies on, differently shifted copies of
  one value combined along the features, shift-invariant "means" that are not
  zero on a zero-sum input; more in ``test_adversarial_core.py``).
(rc11, dtypes, is in ``DTYPE_PROGRAMS``: run without x64, in its own test.)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F64 = jnp.float64
D = 16        # hidden size
FF = 32       # MLP width
DIN = 6       # input features
V = 11        # vocabulary
MAXT = 8      # positions (max sequence length)
EPS = 1e-5
BT = [(2, 5), (3, 7)]            # (batch, seq) of variant 0 and 1
HW = [(2, 4, 4), (3, 5, 6)]      # (batch, height, width) of variant 0 and 1


@dataclasses.dataclass(frozen=True)
class Program:
  name: str
  init: Callable            # key -> params (dict of float64 arrays)
  apply: Callable           # (params, *args) -> outputs
  make_args: Callable       # (seed, variant) -> tuple of args
  note: str
  expect_fold: Optional[bool]
  cause: str = ""
  fold_kwargs: tuple = ()   # extra keyword arguments of jaxfold.fold, as pairs


# ----------------------------------------------------------------------------
# LayerNorm formulations.


def ln_fast(h, g, b, axes=(-1,), eps=EPS):
  """Flax-style fast variance: max(0, E[h²] − E[h]²)."""
  mu = h.mean(axes, keepdims=True)
  var = jnp.maximum(0.0, (h * h).mean(axes, keepdims=True) - mu * mu)
  return (h - mu) * lax.rsqrt(var + eps) * g + b


def ln_two_pass(h, g, b, axes=(-1,), eps=EPS):
  c = h - h.mean(axes, keepdims=True)
  return c / jnp.sqrt((c ** 2).mean(axes, keepdims=True) + eps) * g + b


def ln_jnp_var(h, g, b, axes=(-1,), eps=EPS):
  return (h - jnp.mean(h, axes, keepdims=True)) * lax.rsqrt(jnp.var(h, axes, keepdims=True) + eps) * g + b


def ln_standardize(h, g, b, eps=EPS):
  return jax.nn.standardize(h, axis=-1, epsilon=eps) * g + b


def ln_recip(h, g, b, eps=EPS):
  """Mean as sum * (1/n): the reciprocal rounded to the dtype."""
  inv = 1.0 / h.shape[-1]
  c = h - h.sum(-1, keepdims=True) * inv
  return c * lax.rsqrt((c * c).sum(-1, keepdims=True) * inv + eps) * g + b


def ln_nokeep(h, g, b, eps=EPS):
  """Reductions without keepdims, broadcast back by indexing."""
  mu = jnp.mean(h, -1)
  var = jnp.mean(jnp.square(h - mu[..., None]), -1)
  return (h - mu[..., None]) / jnp.sqrt(var[..., None] + eps) * g + b


def ln_flax(h, g, b, fast=True, eps=EPS):
  mod = nn.LayerNorm(epsilon=eps, use_fast_variance=fast, param_dtype=F64)
  return mod.apply({"params": {"scale": g, "bias": b}}, h)


def ln_flax_fast(h, g, b):
  return ln_flax(h, g, b, True)


def ln_flax_two_pass(h, g, b):
  return ln_flax(h, g, b, False)


def group_norm_tokens(h, g, b, groups, ln=ln_fast):
  """Per-token GroupNorm: (..., C) -> (..., G, C/G), normalized over the last axis."""
  c = h.shape[-1]
  n = ln(h.reshape(h.shape[:-1] + (groups, c // groups)), 1.0, 0.0)
  return n.reshape(h.shape) * g + b


# ----------------------------------------------------------------------------
# Parameters and inputs.


def _leaf(key, name, shape):
  if name.startswith("g"):                                  # γ: non-uniform
    return 1.0 + 0.5 * jax.random.normal(key, shape, F64)
  if name.startswith("b"):                                  # β / biases: non-zero mean
    return 0.3 + 0.5 * jax.random.normal(key, shape, F64)
  if name.startswith(("w", "k", "head", "u")):              # weights
    return jax.random.normal(key, shape, F64) / math.sqrt(shape[0])
  return 0.7 * jax.random.normal(key, shape, F64)           # embeddings, scales, …


def rand_tree(key, spec, name=""):
  """Random parameters for a nested dict/list whose leaves are shape tuples."""
  if isinstance(spec, dict):
    names = sorted(spec)
    keys = jax.random.split(key, max(len(names), 1))
    return {n: rand_tree(k, spec[n], n) for k, n in zip(keys, names)}
  if isinstance(spec, list):
    keys = jax.random.split(key, max(len(spec), 1))
    return [rand_tree(k, s, name) for k, s in zip(keys, spec)]
  return _leaf(key, name, tuple(spec))


def init_from(spec):
  return lambda key: rand_tree(key, spec)


def randomize_module_params(variables, key, scale=0.5):
  """flax variables -> float64, every leaf (γ, β, biases included) perturbed."""
  leaves, tree = jax.tree_util.tree_flatten(variables)
  keys = jax.random.split(key, len(leaves))
  out = [jnp.asarray(x, F64) + scale * jax.random.normal(k, np.shape(x), F64) + 0.1
         for k, x in zip(keys, leaves)]
  return jax.tree_util.tree_unflatten(tree, out)


def _key(seed, variant, salt=0):
  return jax.random.PRNGKey(100_003 * seed + 17 * variant + salt)


def x_args(seed, variant, din=DIN):
  b, t = BT[variant]
  return (jax.random.normal(_key(seed, variant), (b, t, din), F64),)


def ids_args(seed, variant):
  b, t = BT[variant]
  return (jax.random.randint(_key(seed, variant), (b, t), 0, V),)


def image_args(seed, variant, cin=3):
  b, h, w = HW[variant]
  return (jax.random.normal(_key(seed, variant), (b, h, w, cin), F64),)


def block_spec(d=D, ff=FF):
  return {"g": (d,), "be": (d,), "w1": (d, ff), "b1": (ff,), "w2": (ff, d), "b2": (d,)}


def preln_block(h, p, ln=ln_fast):
  """h + MLP(LN(h)): the pre-LN residual block."""
  return h + jax.nn.gelu(ln(h, p["g"], p["be"]) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


PROGRAMS: list = []


def _add(name, init, apply, make_args, note, expect, cause, **fold_kwargs):
  PROGRAMS.append(Program(name, init, apply, make_args, note, expect, cause,
                          tuple(sorted(fold_kwargs.items()))))


def _dense_ln_program(name, op, note, expect, cause, d_out=D, d_norm=None, ln=ln_fast,
                      extra_args=None, **fold_kwargs):
  """x @ w + b -> op(h, *extra) -> LayerNorm (over d_norm features) -> output."""
  d_norm = d_out if d_norm is None else d_norm
  spec = {"w": (DIN, d_out), "b": (d_out,), "g": (d_norm,), "be": (d_norm,)}

  def apply(p, x, *extra):
    h = x @ p["w"] + p["b"]
    return ln(op(h, *extra), p["g"], p["be"])

  def make_args(seed, variant):
    return x_args(seed, variant) + (extra_args(seed, variant) if extra_args else ())

  _add(name, init_from(spec), apply, make_args, note, expect, cause, **fold_kwargs)


# ============================================================================
# rc1: a sub-jaxpr called more than once (jit / checkpoint / custom_jvp reuse one
# traced jaxpr for every call with the same shapes).

_block_ckpt = jax.checkpoint(preln_block)


def _rc1_stack_apply(block):
  def apply(p, x):
    h = x @ p["w_in"] + p["b_in"]
    for lp in p["layers"]:
      h = block(h, lp)
    return ln_two_pass(h, p["g_f"], p["be_f"]) @ p["head"]
  return apply


_STACK_SPEC = {"w_in": (DIN, D), "b_in": (D,), "layers": [block_spec()] * 3,
               "g_f": (D,), "be_f": (D,), "head": (D, 5)}

_add("rc1_checkpoint_preln_stack", init_from(_STACK_SPEC), _rc1_stack_apply(_block_ckpt), x_args,
     "pre-LN residual stack, every block the same jax.checkpoint function (one jaxpr, 3 calls)",
     True, "rc1")

_block_jit = jax.jit(lambda h, p: preln_block(h, p, ln_jnp_var))
_add("rc1_jit_preln_stack", init_from(_STACK_SPEC), _rc1_stack_apply(_block_jit), x_args,
     "pre-LN residual stack, every block the same jax.jit function", True, "rc1")

_proj_jit = jax.jit(lambda x, w, b: x @ w + b)


def _rc1_proj_twice(p, x):
  raw = _proj_jit(x, p["w1"], p["b1"])        # first call: exposed as an output
  h = _proj_jit(x, p["w2"], p["b2"])          # second call: feeds a LayerNorm
  return raw, ln_fast(h, p["g"], p["be"]) @ p["head"]


_add("rc1_jit_proj_twice",
     init_from({"w1": (DIN, D), "b1": (D,), "w2": (DIN, D), "b2": (D,), "g": (D,), "be": (D,),
                "head": (D, 4)}),
     _rc1_proj_twice, x_args,
     "one jitted projection called with two weight sets; only the 2nd call's output is normalized "
     "(w1/b1 must stay uncentered)", True, "rc1")

_ln_dense_jit = jax.jit(lambda h, g, be, w, b: ln_two_pass(h, g, be) @ w + b)
_ln_dense_spec = {"w_in": (DIN, D), "b_in": (D,), "g1": (D,), "be1": (D,), "w1": (D, D), "b1": (D,),
                  "g2": (D,), "be2": (D,), "w2": (D, D), "b2": (D,), "ge": (D,), "bee": (D,)}


def _rc1_second_call_tanh(p, x):
  h = x @ p["w_in"] + p["b_in"]
  y1 = _ln_dense_jit(h, p["g1"], p["be1"], p["w1"], p["b1"])
  return _ln_dense_jit(jnp.tanh(y1), p["g2"], p["be2"], p["w2"], p["b2"])


_add("rc1_jit_block_second_call_tanh", init_from(_ln_dense_spec), _rc1_second_call_tanh, x_args,
     "jitted LN->Dense called twice: 1st input is a Dense output (foldable), 2nd is tanh(...) "
     "(not foldable): the shared jaxpr must not be rewritten for both", True, "rc1")

_ln_dense_ckpt = jax.checkpoint(lambda h, g, be, w, b: ln_fast(h, g, be) @ w + b)


def _rc1_second_call_ln(p, x):
  h = x @ p["w_in"] + p["b_in"]
  y1 = _ln_dense_ckpt(h, p["g1"], p["be1"], p["w1"], p["b1"])
  z = y1 + ln_jnp_var(y1, p["ge"], p["bee"])      # carries an LN output (not zero-mean)
  return _ln_dense_ckpt(z, p["g2"], p["be2"], p["w2"], p["b2"])


_add("rc1_checkpoint_second_call_ln_output", init_from(_ln_dense_spec), _rc1_second_call_ln, x_args,
     "checkpointed LN->Dense called twice; the 2nd call's input carries an LN output with "
     "non-uniform γ, so its LN is not foldable", True, "rc1")

_mean_jit = jax.jit(lambda v: v.mean(-1, keepdims=True))


def _rc1_shared_mean(p, x):
  h = x @ p["w"] + p["b"]
  c = h - _mean_jit(h)
  n = c * lax.rsqrt(_mean_jit(c * c) + EPS) * p["g"] + p["be"]
  u = jnp.tanh(x @ p["w2"] + p["b2"])
  return n, _mean_jit(u)          # the same jitted mean, on a value that is not zero-sum


_add("rc1_jit_shared_mean",
     init_from({"w": (DIN, D), "b": (D,), "g": (D,), "be": (D,), "w2": (DIN, D), "b2": (D,)}),
     _rc1_shared_mean, x_args,
     "one jitted mean helper serves a LayerNorm (foldable) and a returned mean of tanh(...): "
     "removing the reduction inside the shared jaxpr zeroes the second output", True, "rc1")


class _MlpBlock(nn.Module):
  @nn.compact
  def __call__(self, h):
    y = nn.LayerNorm(param_dtype=F64)(h)
    y = nn.gelu(nn.Dense(FF, param_dtype=F64)(y))
    return h + nn.Dense(D, param_dtype=F64)(y)


_RematBlock = nn.remat(_MlpBlock)


class _RematStack(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D, param_dtype=F64)(x)
    for _ in range(3):
      h = _RematBlock()(h)
    h = nn.LayerNorm(param_dtype=F64, use_fast_variance=False)(h)
    return nn.Dense(5, param_dtype=F64)(h)


def _flax_init(module, make_args):
  def init(key):
    variables = module.init(jax.random.PRNGKey(0), *make_args(0, 0))
    return randomize_module_params(variables, key)
  return init


_add("rc1_flax_remat_preln", _flax_init(_RematStack(), x_args), _RematStack().apply, x_args,
     "flax nn.remat(Block) class reused for 3 pre-LN blocks", True, "rc1")


class _LnDense(nn.Module):
  @nn.compact
  def __call__(self, h):
    return nn.Dense(D, param_dtype=F64)(nn.LayerNorm(param_dtype=F64)(h))


_JitLnDense = nn.jit(_LnDense)


class _JitTwice(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D, param_dtype=F64)(x)
    y1 = _JitLnDense()(h)
    return _JitLnDense()(jnp.tanh(y1))


_add("rc1_flax_jit_block_reuse", _flax_init(_JitTwice(), x_args), _JitTwice().apply, x_args,
     "flax nn.jit(LN->Dense) class used twice: 1st call foldable, 2nd after tanh not", True, "rc1")


@jax.custom_jvp
def _cj_ln(h, g, be):
  return ln_fast(h, g, be)


@_cj_ln.defjvp
def _cj_ln_jvp(primals, tangents):
  return jax.jvp(ln_fast, primals, tangents)   # the true derivative


def _rc1_custom_jvp_twice(p, x):
  h = x @ p["w"] + p["b"]
  z = jnp.tanh(_cj_ln(h, p["g1"], p["be1"]) @ p["w2"] + p["b2"])
  return _cj_ln(z, p["g2"], p["be2"]) @ p["head"]


_add("rc1_custom_jvp_ln_twice",
     init_from({"w": (DIN, D), "b": (D,), "g1": (D,), "be1": (D,), "w2": (D, D), "b2": (D,),
                "g2": (D,), "be2": (D,), "head": (D, 3)}),
     _rc1_custom_jvp_twice, x_args,
     "a custom_jvp LayerNorm (true jvp rule) called on a Dense output and then on tanh(...)",
     None, "rc1")

# ============================================================================
# rc2: pad and cumsum along the normalized axis.


def _pad_feat(h, lo, hi, interior=0, value=0.0):
  return lax.pad(h, jnp.asarray(value, h.dtype), [(0, 0, 0), (0, 0, 0), (lo, hi, interior)])


_dense_ln_program("rc2_pad_feature_zero", lambda h: jnp.pad(h, ((0, 0), (0, 0), (2, 2))),
                  "zero padding on the feature axis before an LN over 20 features", False, "rc2",
                  d_norm=D + 4)
_dense_ln_program("rc2_pad_feature_nonzero",
                  lambda h: jnp.pad(h, ((0, 0), (0, 0), (1, 3)), constant_values=1.5),
                  "padding with 1.5 on the feature axis before the LN", False, "rc2", d_norm=D + 4)
_dense_ln_program("rc2_pad_feature_crop_pad", lambda h: _pad_feat(h, -2, 2),
                  "lax.pad (-2, +2) on features: crop two, append two zeros", False, "rc2")
_dense_ln_program("rc2_pad_feature_crop", lambda h: _pad_feat(h, -2, -1),
                  "negative padding (cropping) of features: the cropped 13 are not zero-sum after "
                  "centering the 16 (a centering over the kept columns only would be sound)",
                  None, "rc2", d_norm=D - 3)
_dense_ln_program("rc2_pad_feature_interior", lambda h: _pad_feat(h, 0, 0, interior=1),
                  "interior padding of features (zeros interleaved)", False, "rc2", d_norm=2 * D - 1)
_dense_ln_program("rc2_pad_seq_zero", lambda h: jnp.pad(h, ((0, 0), (1, 2), (0, 0))),
                  "zero padding along the sequence (padded rows are zero: zero-sum)", True, "rc2")
_dense_ln_program("rc2_pad_seq_nonzero",
                  lambda h: jnp.pad(h, ((0, 0), (1, 2), (0, 0)), constant_values=0.7),
                  "padding the sequence with 0.7: the centering is invisible but the padded rows "
                  "have mean 0.7, so the mean cannot be removed", False, "rc2")
_dense_ln_program("rc2_cumsum_feature", lambda h: jnp.cumsum(h, axis=-1),
                  "cumsum along features before the LN", False, "rc2")
_dense_ln_program("rc2_cumsum_feature_reverse", lambda h: lax.cumsum(h, axis=2, reverse=True),
                  "reverse cumsum along features", False, "rc2")
_dense_ln_program("rc2_diff_feature", lambda h: jnp.diff(h, axis=-1),
                  "diff along features: the shift cancels (centering invisible) but the result is "
                  "not zero-sum, so the mean must stay", False, "rc2", d_norm=D - 1)

# ============================================================================
# rc3: quantizing casts on the producer -> norm path (f64 program).

_dense_ln_program("rc3_cast_int32", lambda h: (4 * h).astype(jnp.int32).astype(F64),
                  "h -> int32 -> float64", False, "rc3")
_dense_ln_program("rc3_round", lambda h: jnp.round(4 * h),
                  "jnp.round on the producer -> norm path", False, "rc3")
_dense_ln_program("rc3_cast_f32", lambda h: h.astype(jnp.float32).astype(F64),
                  "f64 -> f32 -> f64 round trip (relative rounding 6e-8)", False, "rc3")
_dense_ln_program("rc3_cast_bf16", lambda h: h.astype(jnp.bfloat16).astype(F64),
                  "f64 -> bf16 -> f64 round trip", False, "rc3")
_dense_ln_program("rc3_reduce_precision",
                  lambda h: lax.reduce_precision(h, exponent_bits=5, mantissa_bits=2),
                  "lax.reduce_precision(5, 2) on the producer -> norm path", False, "rc3")



def _quantized_stream_apply(dtype):
  def apply(p, x):
    # A quantized residual stream feeding two norms: an auxiliary centering pays
    # off, but stored at the bf16/f32 value it would round away its zero mean.
    h = (x @ p["w"] + p["b"]).astype(dtype)
    h = h.astype(F64)
    h = preln_block(h, p["blk"])
    return ln_fast(h, p["g"], p["be"])
  return apply


for _dt in (jnp.bfloat16, jnp.float32):
  _add(f"rc3_aux_on_quantized_{jnp.dtype(_dt).name}",
       init_from({"w": (DIN, D), "b": (D,), "blk": block_spec(), "g": (D,), "be": (D,)}),
       _quantized_stream_apply(_dt), x_args,
       f"f64 -> {jnp.dtype(_dt).name} -> f64 stream start feeding two norms: any auxiliary "
       "centering must sit on the float64 value", True, "rc3")

# ============================================================================
# rc4: multi-operand primitives.


def _rc4_barrier(p, x):
  hk = x @ p["wk"] + p["bk"]       # goes to a LayerNorm (foldable)
  h = x @ p["w"] + p["b"]          # goes to a LayerNorm AND to an output (not centerable)
  u = jnp.tanh(x @ p["wu"])
  n2 = ln_fast(h, p["g2"], p["be2"])
  o0, o1, o2 = lax.optimization_barrier((u, hk, h))
  return ln_two_pass(o1, p["g"], p["be"]), o2, o0, n2


_add("rc4_opt_barrier_cross",
     init_from({"wk": (DIN, D), "bk": (D,), "w": (DIN, D), "b": (D,), "wu": (DIN, D),
                "g": (D,), "be": (D,), "g2": (D,), "be2": (D,)}),
     _rc4_barrier, x_args,
     "optimization_barrier((u, hk, h)): hk (2nd operand) -> LN is foldable; h (3rd) is also "
     "returned raw, so its producer must stay", True, "rc4")


def _feature_mask_args(seed, variant):
  b, t = BT[variant]
  return (jax.random.bernoulli(_key(seed, variant, 1), 0.5, (b, t, D)),)


def _token_mask_args(seed, variant):
  b, t = BT[variant]
  return (jax.random.bernoulli(_key(seed, variant, 2), 0.5, (b, t, 1)),)


_dense_ln_program("rc4_select_pred_feature", lambda h, m: jnp.where(m, h, 0.3 * h),
                  "jnp.where with a predicate varying along features", False, "rc4",
                  extra_args=_feature_mask_args)


def _rc4_select_token(p, x, m):
  h1 = x @ p["w1"] + p["b1"]
  h2 = x @ p["w2"] + p["b2"]
  return ln_fast(lax.select_n(jnp.broadcast_to(m, h1.shape), h2, h1), p["g"], p["be"])


_add("rc4_select_pred_token",
     init_from({"w1": (DIN, D), "b1": (D,), "w2": (DIN, D), "b2": (D,), "g": (D,), "be": (D,)}),
     _rc4_select_token, lambda s, v: x_args(s, v) + _token_mask_args(s, v),
     "lax.select_n of two Dense outputs with a per-token predicate", True, "rc4")


def _rc4_concat_mixed(p, x):
  h = x @ p["w"] + p["b"]
  u = jnp.tanh(x @ p["wu"] + p["bu"])
  return ln_fast(jnp.concatenate([h, u], -1), p["g"], p["be"])


_add("rc4_concat_feature_mixed",
     init_from({"w": (DIN, D), "b": (D,), "wu": (DIN, D), "bu": (D,), "g": (2 * D,), "be": (2 * D,)}),
     _rc4_concat_mixed, x_args,
     "concatenate a Dense output and tanh(...) along the normalized axis", False, "rc4")


def _rc4_concat_grouped(p, x):
  h = jnp.concatenate([x @ p["w1"] + p["b1"], x @ p["w2"] + p["b2"]], -1)
  return group_norm_tokens(h, p["g"], p["be"], 2, ln_two_pass)


_add("rc4_concat_feature_grouped",
     init_from({"w1": (DIN, D), "b1": (D,), "w2": (DIN, D), "b2": (D,), "g": (2 * D,), "be": (2 * D,)}),
     _rc4_concat_grouped, x_args,
     "two Dense outputs concatenated on features, per-token GroupNorm whose groups are the halves",
     True, "rc4")


def _rc4_dus_feature(p, x, i):
  h = x @ p["w"] + p["b"]
  upd = jnp.tanh(x @ p["wu"])[..., :4]
  z = lax.dynamic_update_slice(h, upd, (jnp.int32(0), jnp.int32(0), i))
  return ln_fast(z, p["g"], p["be"])


def _index_args(*values):
  return lambda s, v: x_args(s, v) + tuple(jnp.asarray(a[v] if isinstance(a, tuple) else a, jnp.int32)
                                           for a in values)


_add("rc4_dynamic_update_slice_feature",
     init_from({"w": (DIN, D), "b": (D,), "wu": (DIN, D), "g": (D,), "be": (D,)}),
     _rc4_dus_feature, _index_args((5, 9)),
     "dynamic_update_slice of tanh values into some features of a Dense output", False, "rc4")


def _rc4_dus_seq(p, x, j):
  h = x @ p["w"] + p["b"]
  upd = x[:, :2] @ p["w2"] + p["b2"]
  z = lax.dynamic_update_slice(h, upd, (jnp.int32(0), j, jnp.int32(0)))
  return ln_jnp_var(z, p["g"], p["be"])


_add("rc4_dynamic_update_slice_seq",
     init_from({"w": (DIN, D), "b": (D,), "w2": (DIN, D), "b2": (D,), "g": (D,), "be": (D,)}),
     _rc4_dus_seq, _index_args((1, 4)),
     "dynamic_update_slice of one Dense output into another along the sequence", True, "rc4")

_dense_ln_program("rc4_scatter_add_feature_self",
                  lambda h: h.at[..., jnp.array([2, 2, 5])].add(h[..., :3]),
                  "scatter-add of features into features 2 (twice) and 5", False, "rc4")


def _rc4_scatter_seq(p, x):
  h = x @ p["w"] + p["b"]
  return ln_fast(h.at[:, jnp.array([0, 0, 2])].add(x[:, :3] @ p["w2"] + p["b2"]), p["g"], p["be"])


_add("rc4_scatter_add_seq",
     init_from({"w": (DIN, D), "b": (D,), "w2": (DIN, D), "b2": (D,), "g": (D,), "be": (D,)}),
     _rc4_scatter_seq, x_args,
     "scatter-add of Dense rows into tokens 0 (twice) and 2: shifts stay per-token", True, "rc4")

# ============================================================================
# rc5: dynamic slices.


def _rc5_tokens(combine):
  def apply(p, x, i, j):
    h = x @ p["w"] + p["b"]
    a = lax.dynamic_slice_in_dim(h, i, 2, axis=1)
    c = lax.dynamic_slice_in_dim(h, j, 2, axis=1)
    return ln_fast(combine(a, c), p["g"], p["be"])
  return apply


_SPEC1 = {"w": (DIN, D), "b": (D,), "g": (D,), "be": (D,)}
_add("rc5_dyn_slice_diff_tokens", init_from(_SPEC1), _rc5_tokens(lambda a, c: a - c),
     _index_args((0, 1), (3, 4)),
     "difference of two dynamic token slices: per-token shifts, zero-sum", True, "rc5")
_add("rc5_dyn_slice_product_tokens", init_from(_SPEC1), _rc5_tokens(lambda a, c: a * c),
     _index_args((0, 1), (3, 4)),
     "product of two dynamic token slices: the shift becomes feature-dependent", False, "rc5")
_dense_ln_program("rc5_dyn_slice_feature", lambda h, k: lax.dynamic_slice_in_dim(h, k, 8, axis=2),
                  "dynamic slice of 8 of the 16 features, then LN over them", False, "rc5",
                  d_norm=8, extra_args=lambda s, v: (jnp.asarray((3, 6)[v], jnp.int32),))
_dense_ln_program("rc5_dyn_slice_feature_diff",
                  lambda h, i, j: (lax.dynamic_slice_in_dim(h, i, 8, axis=2)
                                   - lax.dynamic_slice_in_dim(h, j, 8, axis=2)),
                  "difference of two dynamic feature slices: shift cancels, not zero-sum",
                  False, "rc5", d_norm=8,
                  extra_args=lambda s, v: (jnp.asarray((1, 2)[v], jnp.int32),
                                           jnp.asarray((6, 8)[v], jnp.int32)))

# ============================================================================
# rc6: gather with mode="fill" (non-zero fill) and mode="clip".


def _oob_ids_args(seed, variant):
  b, t = BT[variant]
  ids = jax.random.randint(_key(seed, variant), (b, t), 0, V + 4)   # some ids are out of range
  return (ids.at[0, 0].set(V + 2),)


def _rc6_take(mode, fill):
  def apply(p, ids):
    kw = {"fill_value": fill} if mode == "fill" else {}
    h = jnp.take(p["emb"], ids, axis=0, mode=mode, **kw) + p["pos"][: ids.shape[1]]
    return ln_fast(h, p["g"], p["be"]) @ p["head"]
  return apply


_EMB_SPEC = {"emb": (V, D), "pos": (MAXT, D), "g": (D,), "be": (D,), "head": (D, 4)}
_add("rc6_take_fill_nonzero", init_from(_EMB_SPEC), _rc6_take("fill", 3.0), _oob_ids_args,
     "embedding lookup with mode='fill', fill_value=3.0 and out-of-range ids: filled rows have "
     "mean 3, so the LN mean must stay", False, "rc6")
_add("rc6_take_fill_zero", init_from(_EMB_SPEC), _rc6_take("fill", 0.0), _oob_ids_args,
     "mode='fill', fill_value=0.0: filled rows are zero (zero-sum)", True, "rc6")
_add("rc6_take_clip", init_from(_EMB_SPEC), _rc6_take("clip", None), _oob_ids_args,
     "mode='clip' with out-of-range ids", True, "rc6")
_dense_ln_program("rc6_take_fill_feature_axis",
                  lambda h: jnp.take(h, jnp.array([15, 3, 3, 0, 20, 7, 8, 9]), axis=-1,
                                     mode="fill", fill_value=0.0),
                  "gather along features with duplicates and an out-of-range index (filled 0)",
                  False, "rc6", d_norm=8)

# ============================================================================
# rc7: grouped (block-wise) shifts.

_dense_ln_program("rc7_groupnorm_per_token", lambda h: h,
                  "per-token GroupNorm (4 groups of 4) of a Dense output", True, "rc7",
                  ln=lambda h, g, b: group_norm_tokens(h, g, b, 4))


def _rc7_scaled(p, x):
  h = (x @ p["w"] + p["b"]) * p["s"]
  return group_norm_tokens(h, p["g"], p["be"], 4)


_add("rc7_groupnorm_feature_scale",
     init_from({"w": (DIN, D), "b": (D,), "s": (D,), "g": (D,), "be": (D,)}), _rc7_scaled, x_args,
     "Dense output times a factor varying along C, then per-token GroupNorm", False, "rc7")


def _rc7_straddle(p, x):
  h = x @ p["w"] + p["b"]
  a = group_norm_tokens(h, p["g"], p["be"], 4)
  c = group_norm_tokens(h[..., 2:14], p["g2"], p["be2"], 3, ln_two_pass)
  return a, c


_add("rc7_groupnorm_slice_straddle",
     init_from({"w": (DIN, D), "b": (D,), "g": (D,), "be": (D,), "g2": (12,), "be2": (12,)}),
     _rc7_straddle, x_args,
     "GroupNorm over aligned groups of 4 and another over h[..., 2:14] in groups of 4 (straddling):"
     " no block centering serves both", False, "rc7")


def _rc7_offset(p, x):
  h = x @ p["w"] + p["b"]                  # 18 features
  return group_norm_tokens(h[..., 2:], p["g"], p["be"], 4)


_add("rc7_groupnorm_slice_offset",
     init_from({"w": (DIN, 18), "b": (18,), "g": (D,), "be": (D,)}), _rc7_offset, x_args,
     "GroupNorm of h[..., 2:] (groups not aligned with the producer's columns)", None, "rc7")


def _conv(x, k, b):
  return lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + b


def _rc7_spatial(p, x):
  h = _conv(x, p["k"], p["b"])                       # (B, H, W, 8)
  hh = h.reshape(h.shape[:-1] + (4, 2))
  mu = hh.mean((1, 2, 4), keepdims=True)
  var = ((hh - mu) ** 2).mean((1, 2, 4), keepdims=True)
  n = ((hh - mu) * lax.rsqrt(var + EPS)).reshape(h.shape)
  return n * p["g"] + p["be"]


_add("rc7_groupnorm_spatial_conv",
     init_from({"k": (3, 3, 3, 8), "b": (8,), "g": (8,), "be": (8,)}), _rc7_spatial, image_args,
     "standard GroupNorm over (H, W, C/G) of a conv output: must not fold", False, "rc7")


class _ConvGN(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Conv(8, (3, 3), param_dtype=F64)(x)
    return nn.GroupNorm(num_groups=4, epsilon=EPS, param_dtype=F64)(h)


_add("rc7_groupnorm_spatial_flax", _flax_init(_ConvGN(), image_args), _ConvGN().apply, image_args,
     "flax nn.Conv -> nn.GroupNorm(4) (statistics over H, W, C/G): must not fold", False, "rc7")


class _TokenGN(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D, param_dtype=F64)(x)
    n = nn.GroupNorm(num_groups=4, epsilon=EPS, param_dtype=F64)(h.reshape(-1, D))
    return n.reshape(h.shape)


_add("rc7_flax_groupnorm_tokens", _flax_init(_TokenGN(), x_args), _TokenGN().apply, x_args,
     "flax nn.GroupNorm applied per token (input reshaped to (B*T, C))", True, "rc7")

# ============================================================================
# rc8: near-cancellation (formulas that look like a LayerNorm but are not
# shift-invariant) and unusual but exact variants.


def near_cancel_mean_ln(h, g, b):
  c = h - (1 - 9e-7) * h.mean(-1, keepdims=True)
  return c * lax.rsqrt((c * c).mean(-1, keepdims=True) + EPS) * g + b


def bessel_ln(h, g, b):
  return (h - h.mean(-1, keepdims=True)) * lax.rsqrt(jnp.var(h, -1, ddof=1, keepdims=True) + EPS) * g + b


def rsqrt_4var_ln(h, g, b):
  c = h - h.mean(-1, keepdims=True)
  return c * lax.rsqrt(4 * (c * c).mean(-1, keepdims=True) + EPS) * g + b


def rounded_recip7_ln(h, g, b):
  c = h - h.sum(-1, keepdims=True) * 0.1428571     # not 1/7 to float64 precision
  return c * lax.rsqrt((c * c).sum(-1, keepdims=True) * 0.1428571 + EPS) * g + b


def near_cancel_var_ln(h, g, b):
  mu = h.mean(-1, keepdims=True)
  var = jnp.maximum(0.0, (h * h).mean(-1, keepdims=True) - (1 - 1e-6) * mu * mu)
  return (h - mu) * lax.rsqrt(var + EPS) * g + b


def split_mean_ln(h, g, b):
  mu = h.mean(-1, keepdims=True)
  c = (h - 0.5 * mu) - 0.5 * mu                    # exactly h - mu
  return c * lax.rsqrt((c * c).mean(-1, keepdims=True) + EPS) * g + b


_ident = lambda h: h
_dense_ln_program("rc8_near_cancel_mean", _ident,
                  "h - (1 - 9e-7) * mean(h), divided by an RMS: not shift-invariant", False, "rc8",
                  ln=near_cancel_mean_ln)
_dense_ln_program("rc8_bessel_var", _ident, "variance with ddof=1 (shift-invariant)", True, "rc8",
                  ln=bessel_ln)
_dense_ln_program("rc8_rsqrt_4var", _ident, "rsqrt(4 * var + eps)", True, "rc8", ln=rsqrt_4var_ln)
_dense_ln_program("rc8_rounded_recip_7", _ident,
                  "mean as sum * 0.1428571 over 7 features (not 1/7): leaks 3e-7 of the shift",
                  False, "rc8", d_out=7, ln=rounded_recip7_ln)
_dense_ln_program("rc8_near_cancel_var", _ident,
                  "variance E[h²] - (1 - 1e-6) E[h]²: the shift leaks into the variance", False, "rc8",
                  ln=near_cancel_var_ln)
_dense_ln_program("rc8_split_mean_exact", _ident,
                  "(h - 0.5 mu) - 0.5 mu: exactly h - mu (shift-invariant)", None, "rc8",
                  ln=split_mean_ln)

# ============================================================================
# rc9: the same kind of norms folded with the Pallas RMSNorm kernel in interpret
# mode: a kernel substituted for a non-matching epilogue is a wrong fold.

H9 = 32


def eps_outside_sqrt_ln(h, g, b):
  c = h - h.mean(-1, keepdims=True)
  return c / (jnp.sqrt((c * c).mean(-1, keepdims=True)) + 0.1) * g + b


def beta_before_gamma_ln(h, g, b):
  c = h - h.mean(-1, keepdims=True)
  return (c * lax.rsqrt((c * c).mean(-1, keepdims=True) + EPS) + b) * g


def large_eps_ln(h, g, b):
  return ln_flax(h, g, b, True, eps=0.5)


def _rc9_kernel(name, ln, note, expect):
  _dense_ln_program(name, _ident, note + " [norm_impl='interpret']", expect, "rc9", d_out=H9, ln=ln,
                    norm_impl="interpret")


_rc9_kernel("rc9_kernel_near_cancel_mean", near_cancel_mean_ln, "h - (1 - 9e-7) mean over an RMS", False)
_rc9_kernel("rc9_kernel_bessel_var", bessel_ln, "ddof=1 variance", True)
_rc9_kernel("rc9_kernel_rsqrt_4var", rsqrt_4var_ln, "rsqrt(4 var + eps)", True)
_rc9_kernel("rc9_kernel_eps_outside_sqrt", eps_outside_sqrt_ln, "c / (sqrt(var) + 0.1)", True)
_rc9_kernel("rc9_kernel_beta_before_gamma", beta_before_gamma_ln, "(n + β) * γ", True)
_rc9_kernel("rc9_kernel_large_eps", large_eps_ln, "flax LayerNorm with epsilon 0.5", True)


def _rc9_inv_out(p, x):
  h = x @ p["w"] + p["b"]
  c = h - h.mean(-1, keepdims=True)
  inv = lax.rsqrt((c * c).mean(-1, keepdims=True) + EPS)
  return c * inv * p["g"] + p["be"], inv


_add("rc9_kernel_inv_std_output", init_from({"w": (DIN, H9), "b": (H9,), "g": (H9,), "be": (H9,)}),
     _rc9_inv_out, x_args,
     "the LN's rsqrt(var + eps) is also returned: the kernel must not swallow it "
     "[norm_impl='interpret']", True, "rc9", norm_impl="interpret")

# ============================================================================
# rc10: custom differentiation rules (CBWC must give the original's gradients).


def _dense_ln(x, w, b, g, be):
  return ln_fast(x @ w + b, g, be)


def _make_custom_vjp(transform):
  @jax.custom_vjp
  def f(x, w, b, g, be):
    return _dense_ln(x, w, b, g, be)

  def fwd(x, w, b, g, be):
    return _dense_ln(x, w, b, g, be), (x, w, b, g, be)

  def bwd(res, ct):
    _, vjp = jax.vjp(_dense_ln, *res)
    return transform(res, ct, vjp)

  f.defvjp(fwd, bwd)
  return f


_cv_half = _make_custom_vjp(lambda res, ct, vjp: vjp(ct * 0.5))
_cv_wd = _make_custom_vjp(
    lambda res, ct, vjp: (lambda c: (c[0], c[1] + 0.1 * res[1], c[2] + 0.1 * res[2], c[3], c[4]))(vjp(ct)))
_cv_clip = _make_custom_vjp(
    lambda res, ct, vjp: (lambda c: (c[0], jnp.clip(c[1], -0.05, 0.05), jnp.clip(c[2], -0.05, 0.05),
                                     c[3], c[4]))(vjp(ct)))

_CV_SPEC = {"w": (DIN, D), "b": (D,), "g": (D,), "be": (D,), "w2": (D, D), "b2": (D,),
            "g2": (D,), "be2": (D,), "head": (D, 3)}


def _rc10_vjp_apply(f, twice):
  def apply(p, x):
    n = f(x, p["w"], p["b"], p["g"], p["be"])
    if twice:   # second call: input tanh(n) (not foldable), same custom_vjp jaxpr
      n = f(jnp.tanh(n), p["w2"], p["b2"], p["g2"], p["be2"])
    return n @ p["head"]
  return apply


_add("rc10_custom_vjp_scaled_cotangent", init_from(_CV_SPEC), _rc10_vjp_apply(_cv_half, True), x_args,
     "custom_vjp Dense+LN whose bwd scales the cotangent by 0.5, called twice "
     "(2nd on tanh(...))", None, "rc10")
_add("rc10_custom_vjp_weight_decay_bwd", init_from(_CV_SPEC), _rc10_vjp_apply(_cv_wd, False), x_args,
     "custom_vjp Dense+LN whose bwd adds 0.1*W to W's cotangent: centering W inside changes "
     "the gradient", None, "rc10")
_add("rc10_custom_vjp_clipped_param_grad", init_from(_CV_SPEC), _rc10_vjp_apply(_cv_clip, False), x_args,
     "custom_vjp Dense+LN whose bwd clips W's and b's cotangents to ±0.05", None, "rc10")


@jax.custom_jvp
def _ste_ln(h, g, be):
  return ln_two_pass(h, g, be)


@_ste_ln.defjvp
def _ste_ln_jvp(primals, tangents):
  h, g, be = primals
  dh, _, dbe = tangents
  return ln_two_pass(h, g, be), dh * g + dbe     # straight-through: ignores the normalization


_add("rc10_custom_jvp_straight_through",
     init_from({"w": (DIN, D), "b": (D,), "g": (D,), "be": (D,), "head": (D, 3)}),
     lambda p, x: _ste_ln(x @ p["w"] + p["b"], p["g"], p["be"]) @ p["head"], x_args,
     "custom_jvp LN with a straight-through tangent (dh*γ): gradients see the shift", None, "rc10")


def stop_gradient_mean_ln(h, g, b):
  c = h - lax.stop_gradient(h.mean(-1, keepdims=True))
  var = ((h - h.mean(-1, keepdims=True)) ** 2).mean(-1, keepdims=True)
  return c * lax.rsqrt(var + EPS) * g + b


_dense_ln_program("rc10_stop_gradient_mean", _ident,
                  "LN whose subtracted mean is under stop_gradient: same forward, but the "
                  "gradient has a component along the shift", None, "rc10", ln=stop_gradient_mean_ln)

# ============================================================================
# rc12: other ideas.


def _rc12_second_output(p, x):
  h = x @ p["w"] + p["b"]
  return ln_fast(h, p["g"], p["be"]), h


_add("rc12_second_output_dense", init_from(_SPEC1), _rc12_second_output, x_args,
     "Dense -> LN, and the Dense output is also a program output", False, "rc12")


def _rc12_nonlin_residual(p, x):
  h = x @ p["w0"] + p["b0"]
  h = jax.nn.gelu(preln_block(h, p["l"]))
  return ln_two_pass(h, p["g_f"], p["be_f"]) @ p["head"]


_add("rc12_nonlinearity_on_residual",
     init_from({"w0": (DIN, D), "b0": (D,), "l": block_spec(), "g_f": (D,), "be_f": (D,),
                "head": (D, 4)}),
     _rc12_nonlin_residual, x_args,
     "gelu applied to the residual stream after a pre-LN block", False, "rc12")


def _rc12_tied(p, ids):
  h = p["emb"][ids] + p["pos"][: ids.shape[1]]
  for lp in p["layers"]:
    h = preln_block(h, lp)
  return ln_fast(h, p["g_f"], p["be_f"]) @ p["emb"].T


_add("rc12_tied_embed_head",
     init_from({"emb": (V, D), "pos": (MAXT, D), "layers": [block_spec()] * 2, "g_f": (D,),
                "be_f": (D,)}),
     _rc12_tied, ids_args,
     "embedding table reused as the LM head (must not be centered in place)", True, "rc12")

_dense_ln_program("rc12_norm_two_axes", _ident,
                  "LayerNorm over (seq, features): per-token shifts are not ignored", False, "rc12",
                  ln=lambda h, g, b: ln_fast(h, g, b, axes=(1, 2)))


def _stack_spec(n):
  return {k: (n,) + s for k, s in block_spec().items()}


def _rc12_scan(p, x):
  h = x @ p["w_in"] + p["b_in"]
  h, _ = lax.scan(lambda c, lp: (preln_block(c, lp), None), h, p["layers"])
  return ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]


_SCAN_SPEC = {"w_in": (DIN, D), "b_in": (D,), "layers": _stack_spec(3), "g_f": (D,), "be_f": (D,),
              "head": (D, 5)}
_add("rc12_scan_layers_preln", init_from(_SCAN_SPEC), _rc12_scan, x_args,
     "lax.scan over 3 stacked pre-LN layers, residual stream as the carry", True, "rc12")


def _rc12_scan_leak(p, x):
  h = x @ p["w_in"] + p["b_in"]

  def body(c, lp):
    n = ln_two_pass(c, lp["g"], lp["be"])
    return c + jax.nn.gelu(n @ lp["w1"] + lp["b1"]) @ lp["w2"] + lp["b2"] + 0.1 * n, None

  h, _ = lax.scan(body, h, p["layers"])
  return ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]


_add("rc12_scan_carry_ln_leak", init_from(_SCAN_SPEC), _rc12_scan_leak, x_args,
     "scan body adds 0.1 * LN output to the carry: zero-sum only in the first iteration "
     "(no fixed point)", None, "rc12")


def _flag_args(seed, variant):
  return x_args(seed, variant) + (jnp.asarray(variant == 0),)


def _rc12_cond(p, x, flag):
  h = x @ p["w_in"] + p["b_in"]
  h = lax.cond(flag, lambda v: preln_block(v, p["la"]), lambda v: preln_block(v, p["lb"], ln_jnp_var), h)
  return ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]


_COND_SPEC = {"w_in": (DIN, D), "b_in": (D,), "la": block_spec(), "lb": block_spec(), "g_f": (D,),
              "be_f": (D,), "head": (D, 4)}
_add("rc12_cond_blocks", init_from(_COND_SPEC), _rc12_cond, _flag_args,
     "lax.cond between two pre-LN blocks on the residual stream", True, "rc12")


def _rc12_cond_tanh(p, x, flag):
  h = x @ p["w_in"] + p["b_in"]
  h = lax.cond(flag, lambda v: preln_block(v, p["la"]), jnp.tanh, h)
  return ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]


_add("rc12_cond_branch_tanh", init_from(_COND_SPEC), _rc12_cond_tanh, _flag_args,
     "lax.cond where one branch is a pre-LN block and the other tanh: nothing foldable", False, "rc12")


def _rc12_while(p, x):
  h = x @ p["w_in"] + p["b_in"]
  _, h = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, preln_block(c[1], p["l"])), (0, h))
  return ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]


_add("rc12_while_loop_block",
     init_from({"w_in": (DIN, D), "b_in": (D,), "l": block_spec(), "g_f": (D,), "be_f": (D,),
                "head": (D, 4)}),
     _rc12_while, x_args, "lax.while_loop applying one pre-LN block 3 times", True, "rc12")


def _rc12_vmap(p, x):
  h = x @ p["w_in"] + p["b_in"]
  h = jax.vmap(preln_block, in_axes=(0, None))(h, p["l"])
  return ln_two_pass(h, p["g_f"], p["be_f"]) @ p["head"]


_add("rc12_vmap_block",
     init_from({"w_in": (DIN, D), "b_in": (D,), "l": block_spec(), "g_f": (D,), "be_f": (D,),
                "head": (D, 4)}),
     _rc12_vmap, x_args, "jax.vmap of a pre-LN block over the batch", True, "rc12")


def _rc12_einsum_t(p, x):
  h = jnp.einsum("btd,od->bto", x, p["wt"]) + p["b"]      # kernel stored (out, in)
  return ln_fast(h, p["g"], p["be"])


_add("rc12_einsum_transposed_kernel",
     init_from({"wt": (D, DIN), "b": (D,), "g": (D,), "be": (D,)}), _rc12_einsum_t, x_args,
     "einsum producer with a transposed (out, in) kernel: center along axis 0", True, "rc12")


def _rc12_reshape_t(p, x):
  h = (x @ p["w"] + p["b"]).reshape(x.shape[:2] + (4, 4)).transpose(0, 2, 1, 3)   # (B, 4, T, 4)
  n = ln_fast(h, p["g"], p["be"])
  return n.transpose(0, 2, 1, 3).reshape(x.shape[:2] + (D,))


_add("rc12_reshape_transpose_heads",
     init_from({"w": (DIN, D), "b": (D,), "g": (4,), "be": (4,)}), _rc12_reshape_t, x_args,
     "Dense output reshaped to heads and transposed to (B, heads, T, 4), LN over the last axis",
     True, "rc12")


def _rc12_attention(p, x):
  q, k = x @ p["wq"], x @ p["wk"]
  v = x @ p["wv"] + p["bv"]
  a = jax.nn.softmax(q @ k.swapaxes(-1, -2) / math.sqrt(D), axis=-1)
  return ln_fast(a @ v, p["g"], p["be"]) @ p["head"]


_add("rc12_attention_seq_mix",
     init_from({"wq": (DIN, D), "wk": (DIN, D), "wv": (DIN, D), "bv": (D,), "g": (D,), "be": (D,),
                "head": (D, 4)}),
     _rc12_attention, x_args,
     "attention probabilities mix V along the sequence before the LN (V centerable, Q/K not)",
     True, "rc12")


def _postln_args(seed, variant):
  b, t = BT[variant]
  return ids_args(seed, variant) + (jax.random.randint(_key(seed, variant, 3), (b, t), 0, 2),)


def _rc12_postln(p, ids, tt):
  e = p["emb"][ids] + p["pos"][: ids.shape[1]] + p["typ"][tt]
  h = ln_fast(e, p["g_e"], p["be_e"])
  l = p["l"]
  h = ln_two_pass(h + jax.nn.gelu(h @ l["w1"] + l["b1"]) @ l["w2"] + l["b2"], l["g"], l["be"])
  return h @ p["head"]


_add("rc12_postln_bert",
     init_from({"emb": (V, D), "pos": (MAXT, D), "typ": (2, D), "g_e": (D,), "be_e": (D,),
                "l": block_spec(), "head": (D, 4)}),
     _rc12_postln, _postln_args,
     "BERT-like: embedding LN foldable, post-LN block's LN (input carries an LN output) not",
     True, "rc12")


def _rc12_mean_out(p, x):
  h = x @ p["w"] + p["b"]
  mu = h.mean(-1, keepdims=True)
  c = h - mu
  return c * lax.rsqrt((c * c).mean(-1, keepdims=True) + EPS) * p["g"] + p["be"], mu


_add("rc12_mean_reused_output", init_from(_SPEC1), _rc12_mean_out, x_args,
     "the LN's mean is also returned (it sees the shift)", False, "rc12")


def _rc12_var_out(p, x):
  h = x @ p["w"] + p["b"]
  mu = h.mean(-1, keepdims=True)
  var = jnp.maximum(0.0, (h * h).mean(-1, keepdims=True) - mu * mu)
  return (h - mu) * lax.rsqrt(var + EPS) * p["g"] + p["be"], var


_add("rc12_var_reused_output", init_from(_SPEC1), _rc12_var_out, x_args,
     "the LN's (fast) variance is also returned: shift-invariant, must stay equal", True, "rc12")

_W_CONST = np.random.default_rng(5).standard_normal((DIN, D)) / math.sqrt(DIN)


def _rc12_const(p, x):
  h0 = x @ jnp.asarray(_W_CONST)
  return ln_fast(h0 + p["b"], p["g"], p["be"]), h0


_add("rc12_const_weight_shared", init_from({"b": (D,), "g": (D,), "be": (D,)}), _rc12_const, x_args,
     "a captured constant kernel feeds an LN and is also an output (no in-place centering of it)",
     None, "rc12")


def _rc12_formulations(p, x):
  h = x @ p["w"] + p["b"]
  fmts = [ln_flax_fast, ln_flax_two_pass, ln_standardize, ln_jnp_var, ln_recip, ln_nokeep]
  for ln, lp in zip(fmts, p["layers"]):
    h = preln_block(h, lp, ln)
  return ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]


_add("rc12_formulations_stack",
     init_from({"w": (DIN, D), "b": (D,), "layers": [block_spec()] * 6, "g_f": (D,), "be_f": (D,),
                "head": (D, 4)}),
     _rc12_formulations, x_args,
     "pre-LN stack whose LNs are flax (fast / two-pass), standardize, jnp.var, sum*(1/16), "
     "no-keepdims", True, "rc12")


class _DG(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.DenseGeneral((4, 4), param_dtype=F64)(x)
    h = nn.LayerNorm(reduction_axes=(-2, -1), feature_axes=(-2, -1), param_dtype=F64)(h)
    return h.reshape(h.shape[:-2] + (D,))


_add("rc12_dense_general_two_axes", _flax_init(_DG(), x_args), _DG().apply, x_args,
     "flax DenseGeneral((4, 4)) -> LayerNorm over both feature axes", True, "rc12")


def _rc12_softmax(p, x):
  h = x @ p["w"] + p["b"]
  return ln_fast(h, p["g"], p["be"]), jax.nn.softmax(h, -1)


_add("rc12_softmax_second_consumer", init_from(_SPEC1), _rc12_softmax, x_args,
     "Dense output feeds an LN and a softmax over features (both shift-invariant; the softmax "
     "output is not zero-sum-dependent)", None, "rc12")

# ============================================================================
# rc11: dtype programs (run in float32 without x64, called with bfloat16).


# ============================================================================
# rc15: pieces of one value concatenated in another order along the normalized
# axis (jnp.roll, swapped halves) keep its sum; near misses must not fold.

_dense_ln_program("rc15_roll_features", lambda h: jnp.roll(h, 5, axis=-1),
                  "jnp.roll along the normalized features (slice + slice + concatenate)", True, "rc15")
_dense_ln_program("rc15_three_pieces_reordered",
                  lambda h: jnp.concatenate([h[..., 11:], h[..., 3:11], h[..., :3]], -1),
                  "three slices of one value that tile the features, reordered", True, "rc15")
_dense_ln_program("rc15_pieces_overlap",
                  lambda h: jnp.concatenate([h[..., 2:], h[..., :3]], -1),
                  "two slices that overlap by one feature (D+1 features): not a permutation",
                  False, "rc15", d_norm=D + 1)


def _rc15_two_sources(p, x):
  a = x @ p["w"] + p["b"]
  c = jnp.tanh(x @ p["w2"])
  return ln_fast(jnp.concatenate([a[..., D // 2:], c[..., :D // 2]], -1), p["g"], p["be"])


_add("rc15_pieces_of_two_values", init_from({"w": (DIN, D), "b": (D,), "w2": (DIN, D), "g": (D,), "be": (D,)}),
     _rc15_two_sources, x_args,
     "halves of a dense output and of tanh(dense): the tanh half cannot be made zero-sum",
     False, "rc15")


# ============================================================================
# rc19: every use of a parameter centered in place (direct reads of it as a
# value, a second use of the same kernel), and loops that run zero times.

_SPEC19 = {"w": (DIN, D), "b": (D,), "g": (D,), "be": (D,), "w2": (DIN, D), "b2": (D,)}


def _rc19_reads(read):
  def apply(p, x):
    return read(p, ln_fast(x @ p["w"] + p["b"], p["g"], p["be"]))
  return apply


for _name, _read, _note in [
    ("sum", lambda p, y: (y, jnp.sum(p["w"])), "jnp.sum of the kernel returned"),
    ("norm_scale", lambda p, y: y * jnp.linalg.norm(p["w"]), "the kernel's norm scales the output"),
    ("mean_added", lambda p, y: y + p["w"].mean(), "the kernel's mean added into the output"),
    ("l2", lambda p, y: (y, 0.5 * sum(jnp.sum(v * v) for v in jax.tree_util.tree_leaves(p))),
     "an L2 regularizer over every parameter, computed in apply_fn and returned"),
    ("axis_mean", lambda p, y: (y, p["w"].mean(-1)),
     "the kernel's mean along its output axis (exactly the shift a centering removes) returned"),
    ("bias_sum_in_loop", lambda p, y: y + lax.fori_loop(0, 2, lambda i, c: c + p["b"].sum(), 0.0),
     "the bias' sum accumulated in a loop and added to the output")]:
  _add(f"rc19_param_read_{_name}", init_from(_SPEC19), _rc19_reads(_read), x_args,
       f"Dense -> LN, and {_note}: the kernel/bias cannot be centered in place (a copy for the "
       "Dense's use folds)", True, "rc19")


def _rc19_transposed(p, x):
  y = ln_fast(x @ p["w"] + p["b"], p["g"], p["be"])
  return ln_two_pass(y @ p["w"].T, p["g2"], p["be2"])     # W.T: another layer's kernel


_add("rc19_kernel_transposed_reuse",
     init_from({"w": (DIN, D), "b": (D,), "g": (D,), "be": (D,), "g2": (DIN,), "be2": (DIN,)}),
     _rc19_transposed, x_args,
     "W used by a Dense before an LN and, transposed, as the next layer's kernel (contracting the "
     "centered axis)", True, "rc19")


def _rc19_group_norm_tied(p, x):
  y = ln_fast(x @ p["w"] + p["b"], p["g"], p["be"])
  return y + group_norm_tokens(0.5 * (x @ p["w"]), p["g"], p["be"], 4)


_add("rc19_kernel_tied_group_norm", init_from(_SPEC19), _rc19_group_norm_tied, x_args,
     "one kernel feeds an LN (centered over all features) and, in a second product, a per-position "
     "GroupNorm (centered per group)", True, "rc19")


def _rc19_two_uses(p, x):
  y = ln_fast(x @ p["w"] + p["b"], p["g"], p["be"])
  return y + jnp.tanh(x @ p["w"]) + 0.1 * (x @ p["w"]).sum(-1, keepdims=True)


_add("rc19_kernel_second_use_visible", init_from(_SPEC19), _rc19_two_uses, x_args,
     "the same kernel at a second use through tanh and a contraction over the centered axis",
     True, "rc19")


def _zero_trip_args(seed, variant):
  return x_args(seed, variant) + (jnp.asarray(variant, jnp.int32),)   # n = 0 or 1: n - 1 <= 0


def _rc19_loop(loop):
  """LN(final carry) where the carry starts at tanh(x @ w2) (not zero-sum) and
  the body overwrites it with x @ w + b (zero-sum after centering w, b)."""
  def apply(p, x, n):
    init = jnp.tanh(x @ p["w2"] + p["b2"])
    return ln_fast(loop(lambda c: x @ p["w"] + p["b"], init, n), p["g"], p["be"])
  return apply


for _name, _loop, _note in [
    ("scan_length0", lambda f, c, n: lax.scan(lambda c, _: (f(c), None), c, None, length=0)[0],
     "lax.scan of length 0"),
    ("fori_equal_static", lambda f, c, n: lax.fori_loop(3, 3, lambda i, c: f(c), c),
     "fori_loop(3, 3) (a scan of length 0)"),
    ("fori_equal_traced", lambda f, c, n: lax.fori_loop(n, n, lambda i, c: f(c), c),
     "fori_loop(n, n) with traced n (a while loop)"),
    ("while_false_at_entry", lambda f, c, n: lax.while_loop(lambda k: k[0] < n - 1,
                                                            lambda k: (k[0] + 1, f(k[1])), (0, c))[1],
     "while_loop whose condition is false at entry")]:
  _add(f"rc19_{_name}_overwrite", init_from(_SPEC19), _rc19_loop(_loop), _zero_trip_args,
       f"{_note}: the body overwrites the carry with a Dense output, but the loop runs zero times "
       "and the carry stays tanh(...)", False, "rc19")

_add("rc19_scan_length2_overwrite", init_from(_SPEC19),
     _rc19_loop(lambda f, c, n: lax.scan(lambda c, _: (f(c), None), c, None, length=2)[0]),
     _zero_trip_args, "control: lax.scan of length 2 whose body overwrites the carry with a Dense "
     "output (the final carry is that output)", True, "rc19")


def _rc19_scan0_passthrough(p, x):
  h = x @ p["w"] + p["b"]
  c, _ = lax.scan(lambda c, _: (jnp.zeros_like(c), None), h, None, length=0)
  return ln_fast(h, p["g"], p["be"]), c


_add("rc19_scan_length0_shift_passthrough", init_from(_SPEC19), _rc19_scan0_passthrough, x_args,
     "a Dense output feeds an LN and a length-0 scan whose body zeroes the carry: the carry (the "
     "Dense output) is returned unchanged, so centering the Dense is visible", False, "rc19")


def _rc19_scan0_stacked(p, x):
  h = x @ p["w"] + p["b"]
  c, ys = lax.scan(lambda c, _: (c, ln_two_pass(c, p["g"], p["be"])), h, None, length=0)
  return ln_fast(c, p["g"], p["be"]), ys


_add("rc19_scan_length0_stacked_outputs", init_from(_SPEC19), _rc19_scan0_stacked, x_args,
     "a length-0 scan that passes its carry through and stacks LN(carry) (an empty output): the "
     "LN after it folds", True, "rc19")



# ============================================================================
# rc20: shape generality and Keras-3 spellings (adv6). Every program is also
# folded at one shape and called at others by the shape tests; here at the two
# variants.

_SPEC20 = {"w": (DIN, D), "b": (D,), "g": (D,), "be": (D,), "head": (D, 5)}


def _keras_moments(h, axes=(-1,)):
  mean = jnp.mean(h, axis=axes, keepdims=True)
  return mean, jnp.mean(jnp.square(h), axis=axes, keepdims=True) - jnp.square(mean)


def _rc20_keras_inv_gamma(p, x):
  h = x @ p["w"] + p["b"]
  mean, var = _keras_moments(h)
  inv = lax.rsqrt(var + EPS) * p["g"]                        # Keras 3 LayerNormalization
  return (h * inv + (-mean * inv + p["be"])) @ p["head"]


_add("rc20_keras_ln_inv_gamma", init_from(_SPEC20), _rc20_keras_inv_gamma, x_args,
     "Keras 3 LayerNormalization: inv = rsqrt(E[h²] - E[h]² + eps)·γ; h·inv + (β - mean·inv)", True, "rc20")


def _rc20_keras_reduced_products(p, x):
  h = x @ p["w"] + p["b"]
  mean, var = _keras_moments(h)
  r = lax.rsqrt(var + EPS)
  return (h * r - mean * r) * p["g"] + p["be"]                # mean·r formed per row, then broadcast


_add("rc20_keras_ln_reduced_products", init_from(_SPEC20), _rc20_keras_reduced_products, x_args,
     "h·rsqrt(var) - mean·rsqrt(var) with the second product taken per row before its broadcast "
     "(shift-invariant: (h + c)·r - (mean + c)·r)", True, "rc20")


def _rc20_keras_variant(second):
  """h·r - second(mean, r, var) with r = rsqrt(E[h²] - E[h]² + eps), per row."""
  def apply(p, x):
    h = x @ p["w"] + p["b"]
    mean, var = _keras_moments(h)
    r = lax.rsqrt(var + EPS)
    return (h * r - second(mean, r, var)) * p["g"] + p["be"]
  return apply


for _name, _second, _note, _expect in [
    ("other_rsqrt", lambda m, r, v: m * lax.rsqrt(2 * v + EPS), "mean times another statistic", False),
    ("first_token_row", lambda m, r, v: (m * r)[:, :1], "mean·r of the first token only, broadcast over the "
     "sequence (the shift varies along it)", False),
    ("sequence_reversed", lambda m, r, v: (m * r)[:, ::-1], "mean·r of the tokens in reverse order", False)]:
  _add(f"rc20_keras_ln_{_name}", init_from(_SPEC20), _rc20_keras_variant(_second), x_args,
       f"h·r - (per-row product, then broadcast) with {_note}: not shift-invariant", _expect, "rc20")


def _rc20_keras_grouped(p, x):
  h = x @ p["w"] + p["b"]
  g2 = h.reshape(h.shape[:-1] + (4, 4))
  mean, var = _keras_moments(g2)
  r = lax.rsqrt(var + EPS)
  return (g2 * r - mean * r).reshape(h.shape) * p["g"] + p["be"]


_add("rc20_keras_group_norm_reduced_products", init_from(_SPEC20), _rc20_keras_grouped, x_args,
     "per-token GroupNorm (groups of 4) spelled g·r - mean·r, the second product per group", True, "rc20")

def _rc20_merge_batch_seq(p, x):
  h = x @ p["w"] + p["b"]
  y = ln_two_pass(h.reshape(-1, D), p["g"], p["be"]).reshape(h.shape)   # batch and sequence merged
  return y @ p["head"]


_add("rc20_merge_batch_seq", init_from(_SPEC20), _rc20_merge_batch_seq, x_args,
     "LN over the features of h.reshape(-1, d): rows are (batch, token) pairs", True, "rc20")


def _rc20_squeezed_token(p, x):
  h = x[:, :1] @ p["w"] + p["b"]
  return ln_fast(jnp.squeeze(h, 1), p["g"], p["be"]) @ p["head"]      # (B, D): one token per example


_add("rc20_squeezed_token", init_from(_SPEC20), _rc20_squeezed_token, x_args,
     "LN of jnp.squeeze(h[:, :1], 1): a size-1 axis removed before the norm", True, "rc20")


def _rc20_ln_batch_and_features(p, x):
  return ln_fast(x @ p["w"] + p["b"], p["g"], p["be"], axes=(0, 2)) @ p["head"]


_add("rc20_ln_over_batch_and_features", init_from(_SPEC20), _rc20_ln_batch_and_features, x_args,
     "a norm over (batch, features): the Dense's shift varies per example, which it does not remove "
     "(at batch 1 it would look per-token)", False, "rc20")


def _rc20_softmax_over_seq(p, x):
  h = x @ p["w"] + p["b"]
  return ln_fast(3.0 * jax.nn.softmax(h, axis=1) + h, p["g"], p["be"]) @ p["head"]


_add("rc20_softmax_over_seq_added", init_from(_SPEC20), _rc20_softmax_over_seq, x_args,
     "softmax of h over the sequence added to h before the LN: the per-token shift does not cancel "
     "in a softmax over the axis it varies along", False, "rc20")


def _rc20_gn_interleaved(p, x):
  h = x @ p["w"] + p["b"]
  b, t = h.shape[:2]
  g2 = jnp.swapaxes(h.reshape(b, t, 4, 4), -1, -2)          # group k: channels k, k + 4, k + 8, k + 12
  y = jnp.swapaxes(ln_fast(g2, 1.0, 0.0), -1, -2).reshape(b, t, D)
  return (y * p["g"] + p["be"]) @ p["head"]


_add("rc20_group_norm_interleaved_groups", init_from(_SPEC20), _rc20_gn_interleaved, x_args,
     "per-token GroupNorm whose groups interleave the channels (reshape (4, 4) then swapaxes): "
     "centering per contiguous block would be wrong", None, "rc20")


def _rc20_gn_straddles_concat(p, x):
  h = jnp.concatenate([x @ p["wa"] + p["ba"], x @ p["wb"] + p["bb"]], -1)   # 6 + 10 channels
  b, t = h.shape[:2]
  y = ln_fast(h.reshape(b, t, 4, 4), 1.0, 0.0).reshape(b, t, D)            # group 1 = 2 + 2 channels
  return (y * p["g"] + p["be"]) @ p["head"]


_add("rc20_group_norm_straddles_concat",
     init_from({"wa": (DIN, 6), "ba": (6,), "wb": (DIN, 10), "bb": (10,), "g": (D,), "be": (D,), "head": (D, 5)}),
     _rc20_gn_straddles_concat, x_args,
     "per-token GroupNorm (groups of 4) of two Dense outputs concatenated (6 + 10 channels): a group "
     "straddles the boundary", None, "rc20")

# ============================================================================
# rc21: core-fold adversaries. The weight's shift -mean_f(W)·x varies over
# tokens and pixels; an op that orders, pools or accumulates along those axes,
# or a selection of two copies shifted differently, breaks the constant shift.


def _rc21_max_pool_ln(p, x):
  h = lax.conv_general_dilated(x, p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  h = nn.max_pool(h + p["b"], (2, 2), strides=(2, 2))
  return ln_fast(h, p["g"], p["be"]) @ p["head"]


_add("rc21_max_pool_then_ln_channels",
     init_from({"w": (1, 1, 3, D), "b": (D,), "g": (D,), "be": (D,), "head": (D, 4)}),
     _rc21_max_pool_ln, image_args,
     "1x1 conv + bias, 2x2 max pool, LayerNorm over channels: the kernel's shift varies over pixels, "
     "so the pool picks other pixels (only the bias could be centered, which removes nothing)",
     False, "rc21")
_dense_ln_program("rc21_sort_features", lambda h: jnp.sort(h, axis=-1),
                  "sort along the normalized features: sort(h + c) = sort(h) + c", True, "rc21")
_dense_ln_program("rc21_sort_tokens", lambda h: jnp.sort(h, axis=1),
                  "sort along tokens: the kernel's shift varies over tokens and reorders them", False,
                  "rc21")
_dense_ln_program("rc21_cumsum_tokens", lambda h: jnp.cumsum(h, axis=1),
                  "cumsum over tokens: the accumulated shift is still constant over features", True,
                  "rc21")
_RC21_MASK = np.arange(D) < 5
_dense_ln_program("rc21_select_cumsum_vs_cumsum_of_rev",
                  lambda h: jnp.where(_RC21_MASK, jnp.cumsum(h, 1), jnp.cumsum(lax.rev(h, (1,)), 1)),
                  "features 0-4 from cumsum(h), 5-15 from cumsum(rev(h)) over tokens: both shifts vary "
                  "over tokens, differently, so their selection is not constant over features", False,
                  "rc21")


def _rc21_weighted_mean_ln(h, g, b, eps=EPS):
  w = np.linspace(0.5, 1.5, h.shape[-1])
  c = h - (h * (w / w.sum())).sum(-1, keepdims=True)
  return c * lax.rsqrt((c * c).mean(-1, keepdims=True) + eps) * g + b


_dense_ln_program("rc21_weighted_mean_norm", _ident,
                  "h - weighted_mean(h): shift-invariant, but a zero-sum h has a non-zero weighted mean, "
                  "so the reduction must stay", False, "rc21", ln=_rc21_weighted_mean_ln)


def _dtype_init(key):
  k = jax.random.split(key, 4)
  return {"w": jax.random.normal(k[0], (DIN, D), jnp.float32) / math.sqrt(DIN),
          "b": 0.3 + 0.5 * jax.random.normal(k[1], (D,), jnp.float32),
          "g": 1.0 + 0.5 * jax.random.normal(k[2], (D,), jnp.float32),
          "be": 0.3 + 0.5 * jax.random.normal(k[3], (D,), jnp.float32)}


def _dtype_args(seed, variant):
  b, t = BT[variant]
  return (jax.random.normal(_key(seed, variant), (b, t, DIN), jnp.float32),)


def _flax_ln32(h, g, b):
  return nn.LayerNorm(epsilon=EPS).apply({"params": {"scale": g, "bias": b}}, h)


DTYPE_PROGRAMS = [
    Program("rc11_bf16_hand_ln", _dtype_init,
            lambda p, x: ln_fast(x @ p["w"] + p["b"], p["g"], p["be"]), _dtype_args,
            "hand-written LN traced in float32, called with bfloat16 params", True, "rc11"),
    Program("rc11_bf16_flax_ln", _dtype_init,
            lambda p, x: _flax_ln32(x @ p["w"] + p["b"], p["g"], p["be"]), _dtype_args,
            "flax LayerNorm traced in float32, called with bfloat16 params", True, "rc11"),
]

_names = [p.name for p in PROGRAMS + DTYPE_PROGRAMS]
assert len(_names) == len(set(_names)), "duplicate program names"
