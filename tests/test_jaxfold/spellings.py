"""Algebraically equal spellings of LayerNorm, GroupNorm and RMSNorm.

A spelling is a random chain of choices, each an identity of real arithmetic:
how the mean is written (a sum over n, ``jnp.mean``, a contraction with a
vector of ones), how the variance is written (two-pass, ``E[h²] − E[h]²``,
``jnp.var``, a clamp at zero, a pairwise combination of halves), how its
inverse square root is written (``rsqrt``, ``1/sqrt``, ``pow(·, −½)``,
``sqrt`` then division) and how the output is assembled (centered first,
distributed as Keras does, γ before or after). Every spelling computes the
same function, so a fold must treat them alike.
"""

from __future__ import annotations

import itertools
import random
import zlib
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

MEANS = ("mean", "sum_div", "sum_mul", "dot_ones", "einsum_ones", "mean_nokeep")
VARS = ("two_pass", "fast", "jnp_var", "clamped_fast", "sq_mean_minus", "halves", "centered_dot")
INVS = ("rsqrt", "one_over_sqrt", "pow", "div_sqrt", "rsqrt_times_gamma")
OUTS = ("centered", "keras", "distributed", "gamma_first", "sub_scaled", "standardize_like",
        "chain0", "chain1", "chain2", "chain3")


class Spelling(NamedTuple):
  mean: str
  var: str
  inv: str
  out: str

  @property
  def name(self) -> str:
    return "-".join(self)


def _mean(kind: str, h, axes: tuple):
  n = 1
  for a in axes:
    n *= h.shape[a]
  if kind == "mean":
    return jnp.mean(h, axis=axes, keepdims=True)
  if kind == "sum_div":
    return jnp.sum(h, axis=axes, keepdims=True) / n
  if kind == "sum_mul":
    return jnp.sum(h, axis=axes, keepdims=True) * (1.0 / n)
  if kind == "mean_nokeep":
    m = jnp.mean(h, axis=axes)
    return jnp.expand_dims(m, axes)
  if len(axes) != 1 or axes[0] != h.ndim - 1:
    return jnp.mean(h, axis=axes, keepdims=True)
  ones = jnp.ones((h.shape[-1],), h.dtype)
  if kind == "dot_ones":
    return (h @ ones)[..., None] / n
  if kind == "einsum_ones":
    return jnp.einsum("...d,d->...", h, ones / n)[..., None]
  raise ValueError(kind)


def _var(kind: str, mean_kind: str, h, m, axes: tuple):
  mean = lambda x: _mean(mean_kind, x, axes)
  if kind == "two_pass":
    return mean((h - m) ** 2)
  if kind == "fast":
    return mean(h * h) - m * m
  if kind == "clamped_fast":
    return jnp.maximum(mean(jnp.square(h)) - jnp.square(m), 0.0)
  if kind == "sq_mean_minus":
    return mean(h ** 2) - m ** 2
  if kind == "jnp_var":
    return jnp.var(h, axis=axes, keepdims=True)
  if kind == "centered_dot":
    d = h - m
    return mean(d * d)
  if kind == "halves" and len(axes) == 1 and h.shape[axes[0]] % 2 == 0:
    # Chan et al.'s pairwise combination of two halves' moments.
    a, b = jnp.split(h, 2, axis=axes[0])
    ma, mb = jnp.mean(a, axes, keepdims=True), jnp.mean(b, axes, keepdims=True)
    va, vb = jnp.var(a, axes, keepdims=True), jnp.var(b, axes, keepdims=True)
    return (va + vb) / 2 + ((ma - mb) / 2) ** 2
  return mean((h - m) ** 2)


def _inv(kind: str, v, eps, g):
  if kind == "rsqrt":
    return jax.lax.rsqrt(v + eps), False
  if kind == "one_over_sqrt":
    return 1.0 / jnp.sqrt(v + eps), False
  if kind == "pow":
    return (v + eps) ** -0.5, False
  if kind == "div_sqrt":
    return jnp.sqrt(v + eps), False           # divided by below
  if kind == "rsqrt_times_gamma":
    return jax.lax.rsqrt(v + eps) * g, True   # γ already inside (Keras, Haiku)
  raise ValueError(kind)


def layer_norm(s: Spelling, h, g, b, eps=1e-5, axes=(-1,)):
  """LayerNorm of ``h`` over ``axes`` (γ, β broadcast over them) as ``s`` spells it."""
  axes = tuple(a % h.ndim for a in axes)
  m = _mean(s.mean, h, axes)
  v = _var(s.var, s.mean, h, m, axes)
  r, has_g = _inv(s.inv, v, eps, g)
  div = s.inv == "div_sqrt"
  scale = (lambda x: x / r) if div else (lambda x: x * r)
  gg = (lambda x: x) if has_g else (lambda x: x * g)
  if s.out == "centered":
    return gg(scale(h - m)) + b
  if s.out == "keras":             # y = h * inv + (-mean * inv + beta), γ folded into inv
    if div:
      return gg(h / r) + (gg(-m / r) + b)
    inv = r if has_g else r * g
    return h * inv + (-m * inv + b)
  if s.out == "distributed":
    return gg(scale(h)) - gg(scale(m)) + b
  if s.out == "gamma_first":
    if has_g:
      return scale(h - m) + b
    return (g * (h - m)) / r + b if div else g * ((h - m) * r) + b
  if s.out == "sub_scaled":
    return b + gg(scale(h)) - gg(scale(m))
  if s.out == "standardize_like":
    z = scale(h - m)
    return gg(z) + b
  if s.out.startswith("chain"):
    return _chain(random.Random(zlib.crc32(s.name.encode())), h, m, r, g, b, div, has_g)
  raise ValueError(s.out)


def _chain(rng: random.Random, h, m, r, g, b, div: bool, has_g: bool):
  """``γ(h − m)/σ + β`` assembled by a random chain of ring identities:
  distribute or not, commute factors, associate products either way, write
  a difference as a sum with a negation or as a negated reversed difference,
  put β first or last."""
  factors = [(lambda x: x / r) if div else (lambda x: x * r)]
  if not has_g:
    factors.append(lambda x: x * g if rng.random() < 0.5 else g * x)
  rng.shuffle(factors)

  def apply(x):
    for f in factors:
      x = f(x)
    return x

  def diff(a, c):
    k = rng.randrange(3)
    return a - c if k == 0 else a + (-c) if k == 1 else -(c - a)

  if rng.random() < 0.5:
    core = apply(diff(h, m))
  else:
    core = diff(apply(h), apply(m))
  return core + b if rng.random() < 0.5 else b + core


def rms_norm(s: Spelling, h, g, eps=1e-6, axes=(-1,)):
  axes = tuple(a % h.ndim for a in axes)
  ms = _mean(s.mean, h * h, axes)
  r, has_g = _inv(s.inv, ms, eps, g)
  out = h / r if s.inv == "div_sqrt" else h * r
  return out if has_g else out * g


def group_norm(s: Spelling, h, g, b, groups: int, eps=1e-5):
  """A per-position GroupNorm over the last axis in ``groups`` groups."""
  *lead, c = h.shape
  hg = h.reshape(*lead, groups, c // groups)
  gg = g.reshape(groups, c // groups)
  bb = b.reshape(groups, c // groups)
  return layer_norm(s, hg, gg, bb, eps, axes=(-1,)).reshape(h.shape)


def all_spellings() -> list:
  return [Spelling(*t) for t in itertools.product(MEANS, VARS, INVS, OUTS)]


def sample(n: int, seed: int = 0) -> list:
  """``n`` distinct spellings, always including the plain one and Keras's."""
  rng = random.Random(seed)
  pool = all_spellings()
  rng.shuffle(pool)
  fixed = [Spelling("mean", "two_pass", "rsqrt", "centered"),
           Spelling("mean", "sq_mean_minus", "rsqrt_times_gamma", "keras")]
  out = fixed + [s for s in pool if s not in fixed][: max(0, n - len(fixed))]
  return out


def spellings_of(kind: str) -> Callable:
  return {"layer": layer_norm, "rms": rms_norm, "group": group_norm}[kind]


# ----------------------------------------------------------------------------
# The forms of well-known libraries, written out (the packages are not needed).


def haiku_style(h, g, b, eps=1e-5):
  """Haiku's ``LayerNorm``: ``inv = scale * rsqrt(var + eps); inv * (x - mean) + offset``."""
  mean = jnp.mean(h, axis=-1, keepdims=True)
  var = jnp.var(h, axis=-1, keepdims=True)
  inv = g * jax.lax.rsqrt(var + eps)
  return inv * (h - mean) + b


def equinox_style(h, g, b, eps=1e-5):
  """Equinox's ``LayerNorm``: a clamped variance, then ``weight * out + bias``."""
  mean = jnp.mean(h, axis=-1, keepdims=True)
  var = jnp.maximum(0.0, jnp.var(h, axis=-1, keepdims=True))
  out = (h - mean) * jax.lax.rsqrt(var + eps)
  return g * out + b


def torch_style(h, g, b, eps=1e-5):
  """``F.layer_norm`` spelled out: biased variance, ``/ sqrt(var + eps)``."""
  mean = h.mean(-1, keepdims=True)
  var = ((h - mean) ** 2).mean(-1, keepdims=True)
  return (h - mean) / jnp.sqrt(var + eps) * g + b


def penzai_style(h, g, b, eps=1e-5):
  """penzai's ``LayerNorm``: a standardization layer, then scale and shift layers."""
  mean = jnp.mean(h, axis=-1, keepdims=True)
  centered = h - mean
  var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
  return centered * jax.lax.rsqrt(var + eps) * g + b


def keras_style(h, g, b, eps=1e-5):
  """Keras 3's ``LayerNormalization``: ``ops.moments``, then γ folded into the
  inverse and the mean distributed: ``h * inv + (-mean * inv + beta)``."""
  mean = jnp.mean(h, axis=-1, keepdims=True)
  var = jnp.maximum(jnp.mean(jnp.square(h), axis=-1, keepdims=True) - jnp.square(mean), 0.0)
  inv = jax.lax.rsqrt(var + eps) * g
  return h * inv + (-mean * inv + b)


def standardize_style(h, g, b, eps=1e-5):
  return jax.nn.standardize(h, axis=-1, epsilon=eps) * g + b


def two_moments_style(h, g, b, eps=1e-5):
  """The mean and the variance recomputed for each term of the distributed
  form (no common subexpression): ``h*inv(var(h)) - mean(h)*inv(var(h))``."""
  inv = lambda: jax.lax.rsqrt(jnp.var(h, axis=-1, keepdims=True) + eps)
  return (h * inv() - jnp.mean(h, axis=-1, keepdims=True) * inv()) * g + b


def average_style(h, g, b, eps=1e-5):
  """``jnp.average`` with uniform weights for both moments: ``Σ h·w / Σ w``."""
  w = jnp.ones(h.shape[-1], h.dtype)
  mean = jnp.average(h, axis=-1, weights=w, keepdims=True)
  var = jnp.average(jnp.square(h - mean), axis=-1, weights=w, keepdims=True)
  return (h - mean) * jax.lax.rsqrt(var + eps) * g + b


def welford_style(h, g, b, eps=1e-5):
  """Welford's running mean and M2 in a ``lax.scan`` over the features (not
  recognised as a mean: no site, no fold; kept out of LIBRARY_FORMS)."""
  def body(c, xi):
    n, m, m2 = c
    n = n + 1
    d = xi - m
    m = m + d / n
    return (n, m, m2 + d * (xi - m)), None
  zeros = jnp.zeros(h.shape[:-1])
  (n, m, m2), _ = jax.lax.scan(body, (0.0, zeros, zeros), jnp.moveaxis(h, -1, 0))
  return (h - m[..., None]) * jax.lax.rsqrt(m2[..., None] / n + eps) * g + b


LIBRARY_FORMS = {"haiku": haiku_style, "equinox": equinox_style, "torch": torch_style,
                 "penzai": penzai_style, "keras": keras_style, "standardize": standardize_style,
                 "two_moments": two_moments_style, "average": average_style}
