"""Seeded random JAX programs around LayerNorm/GroupNorm, for fuzzing jaxfold.

``make_program(seed)`` builds one valid, finite float64 program::

    x (B, T, DIN) | ids (B, T)
      -> input stage (Dense, embedding lookup, conv, transposed einsum, ...)
      -> 1-3 segments, each one of
           chain:     producer -> [pre-norm ops] -> norm -> [post-norm ops]
           residual:  h + Dense([post ops](norm([pre ops](h))))       (pre-LN)
           postln:    norm(h + MLP(h))                                (post-LN)
           wrapped:   one jax.jit / jax.checkpoint / custom_jvp / custom_vjp
                      block function called 2-3 times with different params,
                      or a custom one called once whose first norm's input the
                      caller normalizes too (one mean inside and outside)
           scan / cond / while / vmap over residual blocks
      -> outputs (head, final norm, tied head, side outputs, integer outputs)

The ops are drawn from ``OPS``, a table keyed by ``(rule name, variant)`` that
mirrors ``jaxfold._src.rules.all_rules()``: every rule and every variant has
at least one constructor that makes that primitive appear with that parameter
variant (``test_every_rule_is_generated`` checks it against the registry and
the traced jaxprs). Program ``seed`` always contains the op keyed
``KEYS[seed % len(KEYS)]`` (in the first segment), so the first ``len(KEYS)``
programs cover the whole table; every other op is random.

Parameters are float64 with non-uniform values: γ ~ 1 + 0.5 N, β and biases
~ 0.3 + 0.5 N (non-zero mean, so a wrongly removed mean is visible).
Everything expects ``jax_enable_x64``.

Reproduce one program::

    from conftest import x64_context
    import fuzz_programs as fp
    with x64_context():
      prog = fp.make_program(1234)
      print(prog.describe())
      out = prog.apply(prog.params, *prog.args[0])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import spellings as _S
from jax import lax

F64 = jnp.float64
F32 = jnp.float32
I32 = jnp.int32
DIN = 5          # input features
VOCAB = 9        # embedding rows
MAXT = 16        # positional table rows
EPS = 1e-5
BATCHES = (2, 3)  # batch sizes of the two argument sets (tokens and features are fixed per program)
# Few distinct shapes: eager kernels compiled for one program are reused by the next.
HIDDEN = (8, 8, 8, 12, 4)
TOKENS = (4, 4, 3, 5)
OTHER_T = 2       # the second argument set also has T0 + OTHER_T tokens (where the program accepts it)
TROWS = 48        # rows of per-token tables and masks, sliced to the stream's length at run time


def _rows(a, h, axis=0):
  """The first ``h.shape[1]`` rows of a per-token table (or mask, ``axis`` 1):
  one program for every sequence length."""
  return lax.slice_in_dim(a, 0, h.shape[1], axis=axis)


# ============================================================================
# Parameters.


@dataclasses.dataclass
class Scope:
  """Declares the parameters of one program part; values are drawn later.

  ``specs`` maps a name to ``(kind, shape)``, to a child ``Scope``, or to
  ``("list", k, Scope)`` (k independent copies) / ``("stack", k, Scope)``
  (k copies stacked along a new leading axis, for ``lax.scan``).
  """
  specs: dict = dataclasses.field(default_factory=dict)

  def param(self, kind: str, shape) -> str:
    name = f"{kind}{len(self.specs)}"
    self.specs[name] = (kind, tuple(int(s) for s in shape))
    return name

  def child(self, name: str) -> "Scope":
    s = Scope()
    self.specs[name] = s
    return s

  def repeated(self, name: str, how: str, k: int) -> "Scope":
    s = Scope()
    self.specs[name] = (how, k, s)
    return s


def _value(rng: np.random.Generator, kind: str, shape: tuple) -> np.ndarray:
  n = rng.standard_normal(shape)
  if kind == "w":                               # kernels: fan-in is every dim but the last
    return n / math.sqrt(max(1, int(np.prod(shape[:-1]))))
  if kind == "wt":                              # transposed (out, in) kernels
    return n / math.sqrt(shape[-1])
  if kind == "g":                               # γ: non-uniform
    return 1.0 + 0.5 * n
  if kind in ("b", "be"):                       # biases and β: non-zero mean
    return 0.3 + 0.5 * n
  if kind == "emb":
    return 0.2 + 0.7 * n
  if kind == "mix":                             # token mixing matrices
    return n / math.sqrt(shape[-1])
  return 0.7 * n                                # scales, per-token values, ...


def instantiate(scope: Scope, rng: np.random.Generator) -> dict:
  out = {}
  for name, spec in scope.specs.items():
    if isinstance(spec, Scope):
      out[name] = instantiate(spec, rng)
    elif spec[0] == "list":
      out[name] = [instantiate(spec[2], rng) for _ in range(spec[1])]
    elif spec[0] == "stack":
      copies = [instantiate(spec[2], rng) for _ in range(spec[1])]
      out[name] = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *copies)
    else:
      out[name] = _value(rng, *spec)
  return out


# ============================================================================
# Runtime environment of one call: the extra inputs and the side outputs.


class Env:
  """``a``: the extra input arrays (x, ids, indices, key, masks); ``outs``:
  side outputs (None inside wrapped blocks, where emitting is not allowed)."""

  def __init__(self, arrays: dict, outs: Optional[list]):
    self.a = arrays
    self.outs = outs

  def emit(self, v):
    assert self.outs is not None, "side outputs are only allowed at the top level"
    self.outs.append(v)


@dataclasses.dataclass
class St:
  """Shape and context of the stream where an op is placed."""
  T: int
  D: int
  T0: int                  # token count of the program input
  stage: str               # "pre" (producer -> norm) | "post" (after a norm)
  extras: bool = True      # may read Env.a (not inside custom_jvp/vjp or vmap blocks)
  emit: bool = True        # may emit side outputs (top level only)
  keep_t: bool = False     # must keep T (residual blocks)


@dataclasses.dataclass
class Op:
  name: str
  fn: Callable             # fn(P, h, E) -> h
  T: int
  D: int
  tags: frozenset = frozenset()
  masks: tuple = ()        # ((name, shape without batch, p), ...) boolean inputs it reads


class Gen:
  def __init__(self, seed: int):
    self.seed = seed
    self.rng = np.random.default_rng(seed)
    self.masks: dict = {}   # name -> (shape without batch, p)
    self.tags: set = set()
    self.out32 = False      # outputs are cast to float32 (tolerance 1e-5)
    self.differentiable = True   # False with lax.while_loop (no reverse mode)

  def choice(self, xs):
    return xs[int(self.rng.integers(len(xs)))]

  def coin(self, p=0.5) -> bool:
    return bool(self.rng.random() < p)

  def mask(self, shape, p=0.6) -> str:
    name = f"m{len(self.masks)}"
    self.masks[name] = (tuple(shape), p)
    return name


# ============================================================================
# LayerNorm / GroupNorm formulations (all take (h, γ, β) over the last axis).


def ln_fast(h, g, b, axes=(-1,), eps=EPS):
  mu = h.mean(axes, keepdims=True)
  var = jnp.maximum(0.0, (h * h).mean(axes, keepdims=True) - mu * mu)
  return (h - mu) * lax.rsqrt(var + eps) * g + b


def ln_e2(h, g, b, eps=EPS):
  """E[h²] − E[h]² without the clamp."""
  mu = jnp.mean(h, -1, keepdims=True)
  var = jnp.mean(jnp.square(h), -1, keepdims=True) - jnp.square(mu)
  return (h - mu) / jnp.sqrt(var + eps) * g + b


def ln_two_pass(h, g, b, axes=(-1,), eps=EPS):
  c = h - h.mean(axes, keepdims=True)
  return c / jnp.sqrt((c ** 2).mean(axes, keepdims=True) + eps) * g + b


def ln_jnp_var(h, g, b, eps=EPS):
  return (h - jnp.mean(h, -1, keepdims=True)) * lax.rsqrt(jnp.var(h, -1, keepdims=True) + eps) * g + b


def ln_bessel(h, g, b, eps=EPS):
  return (h - h.mean(-1, keepdims=True)) * lax.rsqrt(jnp.var(h, -1, ddof=1, keepdims=True) + eps) * g + b


def ln_rsqrt_4var(h, g, b, eps=EPS):
  c = h - h.mean(-1, keepdims=True)
  return c * lax.rsqrt(4 * (c * c).mean(-1, keepdims=True) + eps) * g + b


def ln_standardize(h, g, b, eps=EPS):
  return jax.nn.standardize(h, axis=-1, epsilon=eps) * g + b


def ln_recip(h, g, b, eps=EPS):
  """Mean as sum * (1/d), the reciprocal a rounded literal."""
  inv = 1.0 / h.shape[-1]
  c = h - h.sum(-1, keepdims=True) * inv
  return c * lax.rsqrt((c * c).sum(-1, keepdims=True) * inv + eps) * g + b


def ln_recip_traced(h, g, b, eps=EPS):
  """Mean as sum * (1/d) with the reciprocal computed in the program (a div eqn)."""
  inv = 1.0 / jnp.asarray(float(h.shape[-1]), h.dtype)
  c = h - h.sum(-1, keepdims=True) * inv
  return c * lax.rsqrt((c * c).sum(-1, keepdims=True) * inv + eps) * g + b


def ln_nokeep(h, g, b, eps=EPS):
  mu = jnp.mean(h, -1)
  var = jnp.mean(jnp.square(h - mu[..., None]), -1)
  return (h - mu[..., None]) / jnp.sqrt(var[..., None] + eps) * g + b


def ln_eps_outside(h, g, b):
  c = h - h.mean(-1, keepdims=True)
  return c / (jnp.sqrt((c * c).mean(-1, keepdims=True)) + 0.1) * g + b


def ln_beta_before_gamma(h, g, b, eps=EPS):
  c = h - h.mean(-1, keepdims=True)
  return (c * lax.rsqrt((c * c).mean(-1, keepdims=True) + eps) + b) * g


def ln_stopgrad_mean(h, g, b, eps=EPS):
  """Same forward as a LayerNorm; the subtracted mean is under stop_gradient."""
  c = h - lax.stop_gradient(h.mean(-1, keepdims=True))
  var = ((h - h.mean(-1, keepdims=True)) ** 2).mean(-1, keepdims=True)
  return c * lax.rsqrt(var + eps) * g + b


def ln_near_cancel(h, g, b, eps=EPS):
  """Not a LayerNorm: h − (1 − 9e-7)·mean(h) leaves 9e-7 of any shift."""
  c = h - (1 - 9e-7) * h.mean(-1, keepdims=True)
  return c * lax.rsqrt((c * c).mean(-1, keepdims=True) + eps) * g + b


def ln_flax(h, g, b, fast=True, eps=EPS):
  mod = nn.LayerNorm(epsilon=eps, use_fast_variance=fast, param_dtype=F64)
  return mod.apply({"params": {"scale": g, "bias": b}}, h)


def rms_norm(h, g, b, eps=EPS):
  """No mean reduction: not a LayerNorm site."""
  return h * lax.rsqrt((h * h).mean(-1, keepdims=True) + eps) * g + b


@jax.custom_jvp
def ln_custom_jvp(h, g, b):
  return ln_fast(h, g, b)


@ln_custom_jvp.defjvp
def _ln_custom_jvp_rule(primals, tangents):
  return jax.jvp(ln_fast, primals, tangents)   # the true derivative


def gn_tokens(h, g, b, groups, ln=ln_two_pass):
  """Per-token GroupNorm: (..., D) -> (..., G, D/G), normalized over the last axis."""
  d = h.shape[-1]
  n = ln(h.reshape(h.shape[:-1] + (groups, d // groups)), 1.0, 0.0)
  return n.reshape(h.shape) * g + b


def gn_tokens_scaled(h, g, b, groups, eps=EPS):
  """Per-token GroupNorm whose normalized value is scaled per group before γ."""
  d = h.shape[-1]
  hg = h.reshape(h.shape[:-1] + (groups, d // groups))
  c = hg - hg.mean(-1, keepdims=True)
  n = c * lax.rsqrt((c * c).mean(-1, keepdims=True) + eps)
  scale = jnp.arange(1, groups + 1, dtype=h.dtype)[:, None]     # varies along the group axis
  return (n * scale).reshape(h.shape) * g + b


def gn_spatial(h, g, b, groups, eps=EPS):
  """Standard GroupNorm on a sequence: reduces over (tokens, D/G)."""
  bsz, t, d = h.shape
  hg = h.reshape(bsz, t, groups, d // groups)
  mu = hg.mean((1, 3), keepdims=True)
  var = ((hg - mu) ** 2).mean((1, 3), keepdims=True)
  return ((hg - mu) * lax.rsqrt(var + eps)).reshape(h.shape) * g + b


def gn_flax(h, g, b, groups):
  mod = nn.GroupNorm(num_groups=groups, param_dtype=F64)
  return mod.apply({"params": {"scale": g, "bias": b}}, h)


def ln_tokens_features(h, g, b):
  """LayerNorm over (tokens, features): per-token shifts are not ignored."""
  return ln_fast(h, g, b, axes=(1, 2))


@dataclasses.dataclass(frozen=True)
class NormKind:
  name: str
  fn: Callable                 # fn(h, γ, β, groups) -> h
  grouped: bool = False        # needs D divisible by 2
  tags: tuple = ()


NORMS = [
    NormKind("ln_fast", lambda h, g, b, G: ln_fast(h, g, b)),
    NormKind("ln_e2", lambda h, g, b, G: ln_e2(h, g, b)),
    NormKind("ln_two_pass", lambda h, g, b, G: ln_two_pass(h, g, b)),
    NormKind("ln_jnp_var", lambda h, g, b, G: ln_jnp_var(h, g, b)),
    NormKind("ln_bessel_ddof1", lambda h, g, b, G: ln_bessel(h, g, b)),
    NormKind("ln_rsqrt_4var", lambda h, g, b, G: ln_rsqrt_4var(h, g, b)),
    NormKind("ln_standardize", lambda h, g, b, G: ln_standardize(h, g, b)),
    NormKind("ln_sum_times_recip", lambda h, g, b, G: ln_recip(h, g, b)),
    NormKind("ln_traced_recip", lambda h, g, b, G: ln_recip_traced(h, g, b),
             tags=(("div", "rounded reciprocal"),)),
    NormKind("ln_nokeepdims", lambda h, g, b, G: ln_nokeep(h, g, b)),
    NormKind("ln_eps_outside_sqrt", lambda h, g, b, G: ln_eps_outside(h, g, b)),
    NormKind("ln_beta_before_gamma", lambda h, g, b, G: ln_beta_before_gamma(h, g, b)),
    NormKind("ln_stop_gradient_mean", lambda h, g, b, G: ln_stopgrad_mean(h, g, b)),
    NormKind("near_cancel_not_ln", lambda h, g, b, G: ln_near_cancel(h, g, b),
             tags=(("sub", "near-cancellation"),)),
    NormKind("flax_layernorm_fast", lambda h, g, b, G: ln_flax(h, g, b, True)),
    NormKind("flax_layernorm_two_pass", lambda h, g, b, G: ln_flax(h, g, b, False)),
    NormKind("flax_layernorm_eps0.5", lambda h, g, b, G: ln_flax(h, g, b, True, 0.5)),
    NormKind("ln_custom_jvp", lambda h, g, b, G: ln_custom_jvp(h, g, b)),
    NormKind("rms_norm", lambda h, g, b, G: rms_norm(h, g, b)),
    NormKind("groupnorm_per_token", lambda h, g, b, G: gn_tokens(h, g, b, G), True,
             (("reshape", "grouped"),)),
    NormKind("groupnorm_per_token_fast", lambda h, g, b, G: gn_tokens(h, g, b, G, ln_fast), True,
             (("reshape", "grouped"),)),
    NormKind("groupnorm_per_token_group_scaled", lambda h, g, b, G: gn_tokens_scaled(h, g, b, G),
             True, (("reshape", "grouped"), ("mul", "varying factor"))),
    NormKind("groupnorm_spatial", lambda h, g, b, G: gn_spatial(h, g, b, G), True,
             (("reshape", "grouped"),)),
    NormKind("flax_groupnorm", lambda h, g, b, G: gn_flax(h, g, b, G), True,
             (("reshape", "grouped"),)),
    NormKind("ln_tokens_and_features", lambda h, g, b, G: ln_tokens_features(h, g, b)),
]
# The same norms in other spellings (``spellings.py``: random chains of ring
# identities, and the forms of Keras, Haiku, Equinox, penzai, torch): a fold
# must not depend on how the arithmetic is written.
NORMS += [NormKind(f"spelled_ln[{s.name}]", (lambda sp: lambda h, g, b, G: _S.layer_norm(sp, h, g, b, EPS))(s))
          for s in _S.sample(24, seed=11)]
NORMS += [NormKind(f"spelled_gn[{s.name}]", (lambda sp: lambda h, g, b, G: _S.group_norm(sp, h, g, b, G, EPS))(s),
                   True, (("reshape", "grouped"),)) for s in _S.sample(6, seed=12)]
NORMS += [NormKind(f"spelled_rms[{s.name}]", (lambda sp: lambda h, g, b, G: _S.rms_norm(sp, h, g, EPS) + b)(s))
          for s in _S.sample(4, seed=13)]
NORMS += [NormKind(f"library_ln[{k}]", (lambda fn: lambda h, g, b, G: fn(h, g, b, EPS))(f))
          for k, f in sorted(_S.LIBRARY_FORMS.items())]
NORMS_BY_NAME = {n.name: n for n in NORMS}


def make_norm(g: Gen, sc: Scope, st: St, kind: Optional[NormKind] = None) -> Op:
  kinds = [k for k in NORMS if not k.grouped or (st.D % 2 == 0 and st.D >= 4)]
  kind = kind or g.choice(kinds)
  groups = 2 if (st.D % 4 or g.coin()) else 4
  pg, pb = sc.param("g", (st.D,)), sc.param("be", (st.D,))
  fn = lambda P, h, E: kind.fn(h, P[pg], P[pb], groups)
  name = kind.name + (f"(G={groups})" if kind.grouped else "")
  return Op(name, fn, st.T, st.D, frozenset(kind.tags) | {("reduce_sum", "normalized axes")})


# ============================================================================
# The op table, keyed by (rule, variant).
#
# A constructor takes (g, sc, st) and returns an Op, or None when it does not
# apply at that place. ``where`` says where it goes: "any" (between a producer
# and a norm, or after a norm), "producer" (replaces a segment's Dense),
# "input" (the input stage), "segment" (a whole segment kind).

OPS: dict = {}


def op(*keys, where: str = "any"):
  def deco(fn):
    for k in keys:
      OPS.setdefault(k, []).append((fn, where))
    return fn
  return deco


def _dense_x(g, sc, st, d_out):
  """x @ W + b from the program input (needs the input's token count)."""
  if not st.extras or st.T != st.T0:
    return None
  pw, pb = sc.param("w", (DIN, d_out)), sc.param("b", (d_out,))
  return lambda P, E: E.a["x"] @ P[pw] + P[pb]


# ---------------------------------------------------------------------------
# add / sub / neg


@op(("add", "same shift"))
def _add_same(g, sc, st):
  ps = sc.param("s", ())
  return Op("h + s*h", lambda P, h, E: h + P[ps] * h, st.T, st.D, frozenset({("mul", "constant factor")}))


@op(("add", "two shifts"))
def _add_two(g, sc, st):
  dx = _dense_x(g, sc, st, st.D)
  if dx is None:
    return None
  return Op("h + (x@W2 + b2)", lambda P, h, E: h + dx(P, E), st.T, st.D)


@op(("add", "scalar operand"))
def _add_scalar(g, sc, st):
  return Op("h + 0.37", lambda P, h, E: h + 0.37, st.T, st.D)


@op(("add", "size-1 broadcast"))
def _add_size1(g, sc, st):
  pt = sc.param("s", (TROWS, 1))
  return Op("h + per-token bias (T,1)", lambda P, h, E: h + _rows(P[pt], h), st.T, st.D)


@op(("add", "size-1 broadcast"), ("broadcast_in_dim", "size-1 expansion"))
def _add_bcast_explicit(g, sc, st):
  pt = sc.param("s", (TROWS, 1))
  return Op("h + broadcast_to(per-token (T,1))", lambda P, h, E: h + jnp.broadcast_to(_rows(P[pt], h), h.shape),
            st.T, st.D)


@op(("add", "same shift"))
def _add_any_grad(g, sc, st):
  """An in-program gradient (its transpose sums cotangents with add_any)."""
  return Op("h + 0.1*grad(sum(sin(z)*z))(h)",
            lambda P, h, E: h + 0.1 * jax.grad(lambda z: jnp.sum(jnp.sin(z) * z))(h), st.T, st.D)


@op(("sub", "cancellation"))
def _sub_cancel(g, sc, st):
  return Op("h - mean_D(h)", lambda P, h, E: h - h.mean(-1, keepdims=True), st.T, st.D)


@op(("sub", "near-cancellation"))
def _sub_near(g, sc, st):
  return Op("h - (1-9e-7)*mean_D(h)", lambda P, h, E: h - (1 - 9e-7) * h.mean(-1, keepdims=True),
            st.T, st.D)


@op(("neg", ""))
def _neg(g, sc, st):
  return Op("-h", lambda P, h, E: -h, st.T, st.D)


# ---------------------------------------------------------------------------
# mul / div / integer_pow


@op(("exp", "ratio of sums"), ("max", "-inf bound"))
def _softmax_stream(g, sc, st):
  """softmax along the features ignores a shift constant along them."""
  if g.coin():
    return Op("h + softmax(h)", lambda P, h, E: h + jax.nn.softmax(h, -1), st.T, st.D)
  return Op("h + exp(h)/sum(exp(h))",
            lambda P, h, E: h + jnp.exp(h) / jnp.sum(jnp.exp(h), -1, keepdims=True), st.T, st.D)


@op(("log", "log of a sum of exps"))
def _log_softmax_stream(g, sc, st):
  return Op("h + (h - log(sum(exp(h))))",
            lambda P, h, E: h + (h - jnp.log(jnp.sum(jnp.exp(h), -1, keepdims=True))), st.T, st.D)


@op(("mul", "constant factor"))
def _mul_const(g, sc, st):
  if g.coin():
    return Op("h * 2.5", lambda P, h, E: h * 2.5, st.T, st.D)
  ps = sc.param("s", ())
  return Op("h * s (scalar param)", lambda P, h, E: h * P[ps], st.T, st.D)


@op(("mul", "per-token factor"))
def _mul_token(g, sc, st):
  if g.coin() and st.extras and st.T == st.T0:
    pw = sc.param("w", (DIN, 1))
    return Op("h * sigmoid(x @ w_gate) (per-token gate)",
              lambda P, h, E: h * jax.nn.sigmoid(E.a["x"] @ P[pw]), st.T, st.D)
  pt = sc.param("s", (TROWS, 1))
  return Op("h * (1 + s_t^2) (T,1)", lambda P, h, E: h * (1 + _rows(P[pt], h) ** 2), st.T, st.D)


@op(("mul", "varying factor"))
def _mul_vary(g, sc, st):
  pv = sc.param("g", (st.D,))
  return Op("h * v (D,)", lambda P, h, E: h * P[pv], st.T, st.D)


@op(("mul", "same shift"))
def _mul_same(g, sc, st):
  return Op("h + 0.1*h*h", lambda P, h, E: h + 0.1 * h * h, st.T, st.D)


@op(("div", "constant divisor"))
def _div_const(g, sc, st):
  return Op("h / 4.0", lambda P, h, E: h / 4.0, st.T, st.D)


@op(("div", "rounded reciprocal"))
def _div_recip(g, sc, st):
  k = g.choice([3.0, 7.0, 12.0])
  if g.coin():
    return Op(f"h / {k}", lambda P, h, E: h / k, st.T, st.D)
  return Op(f"h * (1/{k}) (traced div)", lambda P, h, E: h * (1.0 / jnp.asarray(k, h.dtype)), st.T, st.D)


@op(("div", "per-token divisor"))
def _div_token(g, sc, st):
  pt = sc.param("s", (TROWS, 1))
  return Op("h / (1 + s_t^2)", lambda P, h, E: h / (1 + _rows(P[pt], h) ** 2), st.T, st.D)


@op(("div", "shift in divisor"))
def _div_shift(g, sc, st):
  return Op("h / (2 + tanh(h))", lambda P, h, E: h / (2 + jnp.tanh(h)), st.T, st.D)


@op(("integer_pow", "square"))
def _square(g, sc, st):
  return Op("h + 0.1*square(h)", lambda P, h, E: h + 0.1 * jnp.square(h), st.T, st.D)


@op(("integer_pow", "cube"))
def _cube(g, sc, st):
  return Op("h + 0.05*h**3", lambda P, h, E: h + 0.05 * h ** 3, st.T, st.D)


@op(("integer_pow", "negative"))
def _negpow(g, sc, st):
  return Op("h * (1+h*h)**-2", lambda P, h, E: h * (1 + h * h) ** -2, st.T, st.D)


# ---------------------------------------------------------------------------
# max / min / clamp, select_n and comparisons


@op(("max", "clamp"))
def _relu(g, sc, st):
  return Op("relu(h)", lambda P, h, E: jnp.maximum(h, 0.0), st.T, st.D)


@op(("min", ""))
def _min(g, sc, st):
  return Op("min(h, 1)", lambda P, h, E: jnp.minimum(h, 1.0), st.T, st.D)


@op(("clamp", ""))
def _clamp(g, sc, st):
  return Op("clamp(-1.5, h, 1.5)", lambda P, h, E: lax.clamp(-1.5, h, 1.5), st.T, st.D)


@op(("select_n", "constant predicate"))
def _sel_const(g, sc, st):
  if g.coin():
    return Op("where(True, h, 0)", lambda P, h, E: jnp.where(True, h, 0.0), st.T, st.D)
  return Op("select_n(True, h, 0.5h)", lambda P, h, E: lax.select_n(jnp.asarray(True), h, 0.5 * h),
            st.T, st.D)


@op(("select_n", "per-token predicate"), ("ne", ""))
def _sel_token(g, sc, st):
  if not st.extras:
    return None
  if g.coin() and st.T == st.T0:
    return Op("where(ids != 0, h, 0) (per-token)",
              lambda P, h, E: jnp.where((E.a["ids"] != 0)[..., None], h, 0.0), st.T, st.D)
  m = g.mask((TROWS, 1))
  return Op(f"where(mask_tok {m}, h, 0)", lambda P, h, E: jnp.where(_rows(E.a[m], h, 1), h, 0.0), st.T, st.D)


@op(("select_n", "per-token predicate"))
def _dropout_token(g, sc, st):
  if not st.extras:
    return None
  return Op("per-token dropout (jax.random.bernoulli (B,T,1))",
            lambda P, h, E: jnp.where(jax.random.bernoulli(E.a["key"], 0.75, h.shape[:-1] + (1,)),
                                      h / 0.75, 0.0), st.T, st.D)


@op(("select_n", "varying predicate"))
def _sel_vary(g, sc, st):
  if not st.extras:
    return None
  if g.coin():
    m = g.mask((TROWS, st.D))
    return Op(f"where(mask_feat {m}, h, 0.3h)", lambda P, h, E: jnp.where(_rows(E.a[m], h, 1), h, 0.3 * h),
              st.T, st.D)
  return Op("dropout (jax.random.bernoulli (B,T,D))",
            lambda P, h, E: jnp.where(jax.random.bernoulli(E.a["key"], 0.8, h.shape), h / 0.8, 0.0),
            st.T, st.D)


@op(("select_n", "shift in predicate"), ("gt", ""))
def _leaky(g, sc, st):
  return Op("where(h > 0, h, 0.1h)", lambda P, h, E: jnp.where(h > 0, h, 0.1 * h), st.T, st.D)


@op(("lt", ""), ("le", ""), ("ge", ""), ("eq", ""), ("select_n", "varying predicate"))
def _cmp_select(g, sc, st):
  c = g.choice(["lt", "le", "ge", "eq"])
  f = {"lt": lambda h: h < 0.2, "le": lambda h: h <= -0.1, "ge": lambda h: h >= 0.4,
       "eq": lambda h: jnp.floor(3 * h + 0.37) == 0}[c]
  return Op(f"where({c}(h), 0.5h, h)", lambda P, h, E: jnp.where(f(h), 0.5 * h, h), st.T, st.D,
            frozenset({(c, "")}))


# ---------------------------------------------------------------------------
# casts and identities


@op(("convert_element_type", "widening"))
def _widen(g, sc, st):
  if not st.extras or st.T != st.T0:
    return None
  pw = sc.param("w", (DIN, st.D))
  return Op("h + x.astype(f32).astype(f64) @ W", lambda P, h, E: h + E.a["x"].astype(F32).astype(F64) @ P[pw],
            st.T, st.D, frozenset({("convert_element_type", "narrowing beyond tolerance")}))


@op(("convert_element_type", "narrowing within tolerance"))
def _narrow_ok(g, sc, st):
  g.out32 = True     # the program's outputs are float32: a float32 rounding is within tolerance
  return Op("h.astype(f32).astype(f64) [outputs f32]", lambda P, h, E: h.astype(F32).astype(F64),
            st.T, st.D, frozenset({("convert_element_type", "widening")}))


@op(("convert_element_type", "narrowing beyond tolerance"))
def _narrow_bad(g, sc, st):
  dt = g.choice([F32, jnp.bfloat16])
  return Op(f"h.astype({jnp.dtype(dt).name}).astype(f64)", lambda P, h, E: h.astype(dt).astype(F64),
            st.T, st.D, frozenset({("convert_element_type", "widening")}))


@op(("convert_element_type", "int target"))
def _to_int(g, sc, st):
  return Op("(4h + 0.37).astype(int32).astype(f64) / 4",
            lambda P, h, E: (4 * h + 0.37).astype(I32).astype(F64) / 4, st.T, st.D)


@op(("reduce_precision", "wide format"))
def _rp_wide(g, sc, st):
  return Op("reduce_precision(h, 11, 52)", lambda P, h, E: lax.reduce_precision(h, 11, 52), st.T, st.D)


@op(("reduce_precision", "narrow format"))
def _rp_narrow(g, sc, st):
  e, m = g.choice([(8, 7), (5, 10), (8, 23)])
  return Op(f"reduce_precision(h, {e}, {m})", lambda P, h, E: lax.reduce_precision(h, e, m), st.T, st.D)


@op(("optimization_barrier", "several operands"))
def _barrier(g, sc, st):
  pv = sc.param("s", (st.D,))
  use = g.coin()

  def fn(P, h, E):
    u, h2 = lax.optimization_barrier((jnp.tanh(P[pv]), h))
    return h2 + u if use else h2
  return Op("optimization_barrier((tanh(v), h))" + (" -> h + u" if use else ""), fn, st.T, st.D)


@op(("copy", ""))
def _copy(g, sc, st):
  return Op("jnp.copy(h)", lambda P, h, E: jnp.copy(h), st.T, st.D)


@op(("checkpoint_name", ""))
def _checkpoint_name(g, sc, st):
  from jax.ad_checkpoint import checkpoint_name
  return Op("checkpoint_name(h, 'h')", lambda P, h, E: checkpoint_name(h, "h"), st.T, st.D)


@op(("sharding_constraint", ""))
def _sharding(g, sc, st):
  dev = jax.devices("cpu")[0]
  return Op("with_sharding_constraint(h, single device)",
            lambda P, h, E: lax.with_sharding_constraint(h, jax.sharding.SingleDeviceSharding(dev)),
            st.T, st.D)


_MESH1 = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
_PS = jax.sharding.PartitionSpec


def _smap(fn, in_specs, out_specs, check_vma: bool = True):
  """A shard_map over a one-device mesh (the four-device cases: test_adversarial_spellings)."""
  return jax.shard_map(fn, mesh=_MESH1, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)


@op(("shard_map", "normalized axis local"), ("pvary", ""))
def _shard_map_norm(g, sc, st):
  pg, pb = sc.param("g", (st.D,)), sc.param("b", (st.D,))
  norm = g.choice([ln_two_pass, ln_jnp_var])
  body = _smap(lambda h, gg, bb: norm(h, gg, bb), (_PS("x"), _PS(), _PS()), _PS("x"))
  return Op(f"shard_map({norm.__name__}(h), batch sharded)", lambda P, h, E: body(h, P[pg], P[pb]), st.T, st.D,
            frozenset({("pvary", ""), ("shard_map", "normalized axis local")}))


@op(("shard_map", "normalized axis sharded"))
def _shard_map_sharded_norm(g, sc, st):
  # a mean over a sharded axis without a psum is a mean per shard (here one shard: the whole axis)
  pg, pb = sc.param("g", (st.D,)), sc.param("b", (st.D,))
  spec = _PS(None, None, "x")
  body = _smap(lambda h, gg, bb: ln_two_pass(h, gg, bb), (spec, _PS("x"), _PS("x")), spec)
  return Op("shard_map(ln(h), features sharded)", lambda P, h, E: body(h, P[pg], P[pb]), st.T, st.D,
            frozenset({("pvary", "")}))


@op(("shard_map", "replicated output"), ("psum", ""))
def _shard_map_psum(g, sc, st):
  ps = sc.param("s", ())
  # Without the replication check the body's psum is `psum`, with it `psum_invariant`:
  # chosen by the token count's parity, drawing nothing (seeds keep their programs).
  vma = st.T % 2 == 0
  body = _smap(lambda h, s: lax.psum(h * s, "x") + jnp.tanh(s), (_PS(), _PS()), _PS(), check_vma=vma)
  return Op(f"shard_map(psum(s*h) + tanh(s), check_vma={vma})", lambda P, h, E: body(h, P[ps]), st.T, st.D,
            frozenset({("psum", ""), ("shard_map", "replicated output")}))


@op(("stop_gradient", ""))
def _stopgrad(g, sc, st):
  if g.coin():
    return Op("h + stop_gradient(0.1h)", lambda P, h, E: h + lax.stop_gradient(0.1 * h), st.T, st.D)
  return Op("h - stop_gradient(mean_T(h))", lambda P, h, E: h - lax.stop_gradient(h.mean(1, keepdims=True)),
            st.T, st.D)


# ---------------------------------------------------------------------------
# Other elementwise functions: one safe-domain constructor each.

_UNARY = {
    "abs": ("abs(h)", lambda h: jnp.abs(h)),
    "sign": ("h + 0.1*sign(h+0.123)", lambda h: h + 0.1 * jnp.sign(h + 0.123)),
    "floor": ("h + 0.1*floor(4h+0.37)", lambda h: h + 0.1 * jnp.floor(4 * h + 0.37)),
    "ceil": ("h + 0.1*ceil(4h+0.37)", lambda h: h + 0.1 * jnp.ceil(4 * h + 0.37)),
    "round": ("h + 0.1*round(4h+0.37)", lambda h: h + 0.1 * jnp.round(4 * h + 0.37)),
    "exp": ("exp(0.5 tanh h)", lambda h: jnp.exp(0.5 * jnp.tanh(h))),
    "exp2": ("exp2(0.5 tanh h)", lambda h: jnp.exp2(0.5 * jnp.tanh(h))),
    "log": ("log(1 + h^2)", lambda h: jnp.log(1 + h * h)),
    "log1p": ("log1p(h^2)", lambda h: jnp.log1p(h * h)),
    "expm1": ("expm1(tanh h)", lambda h: jnp.expm1(jnp.tanh(h))),
    "tanh": ("tanh(h)", jnp.tanh),
    "logistic": ("silu(h)", jax.nn.silu),
    "erf": ("h * (1 + erf(h / sqrt2)) / 2", lambda h: h * (1 + jsp.erf(h / math.sqrt(2))) / 2),
    "erfc": ("erfc(h)", jsp.erfc),
    "erf_inv": ("erfinv(0.9 tanh h)", lambda h: jsp.erfinv(0.9 * jnp.tanh(h))),
    "sin": ("sin(h)", jnp.sin),
    "cos": ("cos(h)", jnp.cos),
    "tan": ("tan(0.5 tanh h)", lambda h: jnp.tan(0.5 * jnp.tanh(h))),
    "asin": ("asin(0.9 tanh h)", lambda h: jnp.arcsin(0.9 * jnp.tanh(h))),
    "acos": ("acos(0.9 tanh h)", lambda h: jnp.arccos(0.9 * jnp.tanh(h))),
    "atan": ("atan(h)", jnp.arctan),
    "sinh": ("sinh(tanh h)", lambda h: jnp.sinh(jnp.tanh(h))),
    "cosh": ("cosh(tanh h)", lambda h: jnp.cosh(jnp.tanh(h))),
    "asinh": ("asinh(h)", jnp.arcsinh),
    "acosh": ("acosh(1 + h^2)", lambda h: jnp.arccosh(1 + h * h)),
    "atanh": ("atanh(0.9 tanh h)", lambda h: jnp.arctanh(0.9 * jnp.tanh(h))),
    "sqrt": ("sqrt(1 + h^2)", lambda h: jnp.sqrt(1 + h * h)),
    "rsqrt": ("h*rsqrt(1 + h^2)", lambda h: h * lax.rsqrt(1 + h * h)),
    "cbrt": ("cbrt(h)", jnp.cbrt),
    "pow": ("(1 + h^2)**0.3", lambda h: jnp.power(1 + h * h, 0.3)),
    "atan2": ("atan2(h, 1 + h^2)", lambda h: jnp.arctan2(h, 1 + h * h)),
    "rem": ("h + 0.1*fmod(h, 1.7)", lambda h: h + 0.1 * lax.rem(h, 1.7)),
    "nextafter": ("h + stop_gradient(nextafter(h, 0) - h)",
                  lambda h: h + (lambda c: jnp.nextafter(c, jnp.zeros_like(c)) - c)(lax.stop_gradient(h))),
    "is_finite": ("where(isfinite(h), h, 0)", lambda h: jnp.where(jnp.isfinite(h), h, 0.0)),
    "lgamma": ("gammaln(1 + h^2)", lambda h: jsp.gammaln(1 + h * h)),
    "digamma": ("digamma(1 + h^2)", lambda h: jsp.digamma(1 + h * h)),
    "igamma": ("gammainc(1 + h^2, 1 + 0.5h^2)", lambda h: jsp.gammainc(1 + h * h, 1 + 0.5 * h * h)),
    "igammac": ("gammaincc(1 + h^2, 1 + 0.5h^2)", lambda h: jsp.gammaincc(1 + h * h, 1 + 0.5 * h * h)),
    "bessel_i0e": ("i0e(h)", jsp.i0e),
    "bessel_i1e": ("i1e(h)", jsp.i1e),
    "polygamma": ("polygamma(1, 1 + h^2)", lambda h: jsp.polygamma(1, 1 + h * h)),
    "zeta": ("zeta(2 + h^2, 1 + h^2)", lambda h: jsp.zeta(2 + h * h, 1 + h * h)),
    "complex": ("|complex(h, 0.5h)|^2",
                lambda h: jnp.real(lax.complex(h, 0.5 * h) * jnp.conj(lax.complex(h, 0.5 * h)))),
    "real": ("real(complex(h, 1) * (1+2j))", lambda h: jnp.real(lax.complex(h, jnp.ones_like(h)) * (1 + 2j))),
    "imag": ("imag(complex(h, 1) * (1+2j))", lambda h: jnp.imag(lax.complex(h, jnp.ones_like(h)) * (1 + 2j))),
    "conj": ("real(conj(complex(h, h^2)) * (0.5+1j))",
             lambda h: jnp.real(jnp.conj(lax.complex(h, h * h)) * (0.5 + 1j))),
}


def _unary_ctor(rule, label, f):
  def ctor(g, sc, st):
    return Op(label, lambda P, h, E: f(h), st.T, st.D)
  ctor.__name__ = f"_unary_{rule}"
  return ctor


for _rule, (_label, _f) in _UNARY.items():
  # exp and log also carry a shift in special forms (softmax, log-sum-exp): their plain use is a variant
  op((_rule, "nonlinear" if _rule in ("exp", "log") else ""))(_unary_ctor(_rule, _label, _f))


# ---------------------------------------------------------------------------
# Integer side computations: per-token ids -> integer transform -> back into the
# float stream (a per-token mask, an embedding lookup, or a per-token factor).

_INT_FNS = {
    "shift_left": ("shift_left(k, 2)", lambda k: lax.shift_left(k, jnp.int32(2))),
    "shift_right_arithmetic": ("shift_right_arithmetic(3k - 7, 1)",
                               lambda k: lax.shift_right_arithmetic(3 * k - 7, jnp.int32(1))),
    "shift_right_logical": ("shift_right_logical(k + 5, 1)",
                            lambda k: lax.shift_right_logical(k + 5, jnp.int32(1))),
    "population_count": ("population_count(k)", lax.population_count),
    "clz": ("clz(k + 1)", lambda k: lax.clz(k + 1)),
    "and": ("k & 5", lambda k: k & 5),
    "or": ("k | 2", lambda k: k | 2),
    "xor": ("k ^ 3", lambda k: k ^ 3),
    "not": ("~k", lambda k: ~k),
    "mulhi": ("mulhi(k * 1000003, 77777777)", lambda k: lax.mulhi(k * 1000003, jnp.int32(77777777))),
    "rem": ("k % 3", lambda k: lax.rem(k, jnp.int32(3))),
    "eq": ("k == 2", lambda k: (k == 2).astype(I32)),
    "ne": ("k != 1", lambda k: (k != 1).astype(I32)),
    "lt": ("k < 4", lambda k: (k < 4).astype(I32)),
    "le": ("k <= 3", lambda k: (k <= 3).astype(I32)),
    "gt": ("k > 5", lambda k: (k > 5).astype(I32)),
    "ge": ("k >= 2", lambda k: (k >= 2).astype(I32)),
    "max": ("max(k, 3)", lambda k: jnp.maximum(k, 3)),
    "min": ("min(k, 4)", lambda k: jnp.minimum(k, 4)),
    "clamp": ("clamp(1, k, 6)", lambda k: lax.clamp(jnp.int32(1), k, jnp.int32(6))),
    "abs": ("abs(k - 4)", lambda k: jnp.abs(k - 4)),
    "sign": ("sign(k - 4) + 1", lambda k: jnp.sign(k - 4) + 1),
    "iota": ("k + arange(T)", lambda k: k + jnp.arange(k.shape[-1], dtype=I32)),
    "reduce_and": ("k + all_T(k > 0)", lambda k: k + jnp.all(k > 0, axis=-1, keepdims=True).astype(I32)),
    "reduce_or": ("k + any_T(k > 6)", lambda k: k + jnp.any(k > 6, axis=-1, keepdims=True).astype(I32)),
    "reduce_xor": ("k ^ xor_T(k)", lambda k: k ^ lax.reduce_xor(k, (1,))[:, None]),
    "reduce_max": ("max_T(k) - k", lambda k: jnp.max(k, -1, keepdims=True) - k),
    "reduce_min": ("k - min_T(k)", lambda k: k - jnp.min(k, -1, keepdims=True)),
    "reduce_prod": ("prod_T(k % 2 + 1) % 5", lambda k: jnp.prod(k % 2 + 1, -1, keepdims=True) % 5 + 0 * k),
    "cumsum": ("cumsum_T(k) % 7", lambda k: jnp.cumsum(k, -1) % 7),
    "cummax": ("cummax_T(k)", lambda k: lax.cummax(k, 1)),
    "cummin": ("cummin_T(k)", lambda k: lax.cummin(k, 1)),
    "cumprod": ("cumprod_T(k % 2 + 1) % 5", lambda k: lax.cumprod(k % 2 + 1, 1) % 5),
    "rev": ("rev_T(k)", lambda k: jnp.flip(k, 1)),
}


def _int_ctor(rule, label, f):
  def ctor(g, sc, st):
    use = g.choice(["mask", "embed", "factor"])
    from_ids = st.extras and st.T == st.T0 and g.coin(0.6)
    base = "ids" if from_ids else g.choice(["argmax_D(h)", "argmin_D(h)"])
    pe = sc.param("emb", (VOCAB, st.D)) if use == "embed" else None

    def fn(P, h, E):
      if base == "ids":
        k = E.a["ids"]
      elif base == "argmax_D(h)":
        k = jnp.argmax(h, -1).astype(I32)
      else:
        k = jnp.argmin(h, -1).astype(I32)
      v = f(k)
      if use == "mask":
        return jnp.where((v % 2 == 0)[..., None], h, 0.5 * h)
      if use == "embed":
        return h + P[pe][jnp.abs(v) % VOCAB]
      return h * (1 + 0.1 * (jnp.abs(v) % 5).astype(h.dtype))[..., None]
    tags = {"embed": {("gather", "embedding lookup")}, "mask": {("select_n", "per-token predicate")},
            "factor": {("mul", "per-token factor")}}[use]
    if base != "ids":
      tags.add((base[:6], ""))
    return Op(f"int side: k={base}; {label}; -> {use}", fn, st.T, st.D, frozenset(tags))
  ctor.__name__ = f"_int_{rule}"
  return ctor


for _rule, (_label, _f) in _INT_FNS.items():
  op((_rule, {"cumsum": "other axis", "max": "clamp"}.get(_rule, "")),
     ("argmax", ""), ("argmin", ""))(_int_ctor(_rule, _label, _f))


# ---------------------------------------------------------------------------
# Reductions and cumulative ops on floats.


@op(("reduce_sum", "normalized axes"))
def _sum_feat(g, sc, st):
  return Op("h * (1 + 0.1 tanh(sum_D h))", lambda P, h, E: h * (1 + 0.1 * jnp.tanh(h.sum(-1, keepdims=True))),
            st.T, st.D)


@op(("reduce_sum", "shift-varying axes"))
def _sum_tokens(g, sc, st):
  if g.coin():
    return Op("h + mean_T(h)", lambda P, h, E: h + h.mean(1, keepdims=True), st.T, st.D)
  if st.keep_t:
    return None
  return Op("sum_T(h) -> (B,1,D)", lambda P, h, E: h.sum(1, keepdims=True), 1, st.D)


@op(("reduce_max", ""))
def _max_pool(g, sc, st):
  return Op("h + max_T(h)", lambda P, h, E: h + jnp.max(h, 1, keepdims=True), st.T, st.D)


@op(("sort", "along a constant-shift axis"))
def _sort_feat(g, sc, st):
  return Op("sort_D(h)", lambda P, h, E: jnp.sort(h, -1), st.T, st.D)


@op(("sort", "along the shift"))
def _sort_tokens(g, sc, st):
  return Op("h + 0.5 sort_T(h)", lambda P, h, E: h + 0.5 * jnp.sort(h, 1), st.T, st.D)


@op(("top_k", "values"))
def _top_k_values(g, sc, st):
  return Op("h - top_k_D(h, 1)", lambda P, h, E: h - lax.top_k(h, 1)[0], st.T, st.D)


@op(("top_k", "indices"))
def _top_k_indices(g, sc, st):
  return Op("h * (top_k_D(h, 2).indices[0] < D/2)",
            lambda P, h, E: h * (lax.top_k(h, 2)[1][..., :1] < st.D // 2), st.T, st.D)


@op(("scatter-add", "rows along tokens"))
def _scatter_rows(g, sc, st):
  if st.T < 3:
    return None
  idx = jnp.array([0, 0, st.T - 1])
  return Op("h.at[:, [0, 0, T-1]].add(0.5 h[:, :3])", lambda P, h, E: h.at[:, idx].add(0.5 * h[:, :3]),
            st.T, st.D)


@op(("scatter-add", "into features"))
def _scatter_features(g, sc, st):
  if st.D < 3:
    return None
  idx = jnp.array([1, 1, st.D - 1])
  return Op("h.at[..., [1, 1, D-1]].add(h[..., :3])", lambda P, h, E: h.at[..., idx].add(h[..., :3]),
            st.T, st.D)


@op(("reduce_min", ""))
def _min_feat(g, sc, st):
  return Op("h - 0.5*min_D(h)", lambda P, h, E: h - 0.5 * jnp.min(h, -1, keepdims=True), st.T, st.D)


@op(("reduce_prod", ""))
def _prod(g, sc, st):
  return Op("h * prod_T(1 + 0.1 tanh h)", lambda P, h, E: h * jnp.prod(1 + 0.1 * jnp.tanh(h), 1, keepdims=True),
            st.T, st.D)


@op(("cumsum", "other axis"))
def _cumsum_t(g, sc, st):
  rev = g.coin()
  return Op(f"cumsum_T(h, reverse={rev})", lambda P, h, E: lax.cumsum(h, 1, reverse=rev), st.T, st.D)


@op(("cumsum", "normalized axis"))
def _cumsum_d(g, sc, st):
  rev = g.coin()
  return Op(f"cumsum_D(h, reverse={rev})", lambda P, h, E: lax.cumsum(h, 2, reverse=rev), st.T, st.D)


@op(("cumprod", ""))
def _cumprod(g, sc, st):
  ax = g.choice([1, 2])
  return Op(f"h * cumprod_{'TD'[ax - 1]}(1 + 0.1 tanh h)",
            lambda P, h, E: h * lax.cumprod(1 + 0.1 * jnp.tanh(h), ax), st.T, st.D)


@op(("cummax", ""))
def _cummax(g, sc, st):
  ax = g.choice([1, 2])
  return Op(f"cummax_{'TD'[ax - 1]}(h)", lambda P, h, E: lax.cummax(h, ax), st.T, st.D)


@op(("cummin", ""))
def _cummin(g, sc, st):
  ax = g.choice([1, 2])
  return Op(f"h - 0.5*cummin_{'TD'[ax - 1]}(h)", lambda P, h, E: h - 0.5 * lax.cummin(h, ax), st.T, st.D)


@op(("cumlogsumexp", ""))
def _cumlse(g, sc, st):
  ax = g.choice([1, 2])
  return Op(f"cumlogsumexp_{'TD'[ax - 1]}(h)", lambda P, h, E: lax.cumlogsumexp(h, ax), st.T, st.D)


# ---------------------------------------------------------------------------
# Layout: transpose, broadcast, reshape, squeeze, rev.


@op(("transpose", ""), ("rev", ""))
def _transpose_flip(g, sc, st):
  return Op("swapaxes(T,D) -> flip(last) -> swapaxes back",
            lambda P, h, E: jnp.flip(h.swapaxes(1, 2), -1).swapaxes(1, 2), st.T, st.D)


@op(("broadcast_in_dim", "new dims"), ("reshape", "merge"))
def _bcast_new(g, sc, st):
  if st.keep_t or st.T > 7:
    return None
  return Op("broadcast h[:, :, None] to (B,T,2,D) -> (B,2T,D)",
            lambda P, h, E: jnp.broadcast_to(h[:, :, None, :], (h.shape[0], h.shape[1], 2, h.shape[2]))
            .reshape(h.shape[0], 2 * h.shape[1], h.shape[2]), 2 * st.T, st.D)


@op(("reshape", "split"), ("transpose", ""))
def _reshape_split(g, sc, st):
  if st.D % 2:
    return None
  return Op("reshape (B,T,2,D/2) -> swap 2<->3 -> (B,T,D) (feature permutation)",
            lambda P, h, E: h.reshape(h.shape[:2] + (2, st.D // 2)).swapaxes(2, 3).reshape(h.shape),
            st.T, st.D)


@op(("reshape", "merge"))
def _reshape_merge(g, sc, st):
  if g.coin():
    return Op("reshape (B*T, D) -> *1.5 -> back", lambda P, h, E: (h.reshape(-1, st.D) * 1.5).reshape(h.shape),
              st.T, st.D)
  return Op("reshape (B, T*D) -> cumsum over T*D -> back",
            lambda P, h, E: lax.cumsum(h.reshape(h.shape[0], -1), 1).reshape(h.shape), st.T, st.D,
            frozenset({("cumsum", "normalized axis")}))


@op(("reshape", "grouped"))
def _reshape_grouped(g, sc, st):
  if st.D % 2:
    return None
  return Op("reshape (B,T,2,D/2) -> flip groups -> back",
            lambda P, h, E: jnp.flip(h.reshape(h.shape[:2] + (2, st.D // 2)), 2).reshape(h.shape), st.T, st.D,
            frozenset({("rev", "")}))


@op(("squeeze", ""))
def _squeeze(g, sc, st):
  return Op("squeeze(h[:, :, None, :], 2)", lambda P, h, E: lax.squeeze(h[:, :, None, :], (2,)), st.T, st.D)


@op(("rev", ""))
def _rev(g, sc, st):
  ax = g.choice([1, 2])
  return Op(f"flip(h, {'TD'[ax - 1]})", lambda P, h, E: jnp.flip(h, ax), st.T, st.D)


# ---------------------------------------------------------------------------
# slice, dynamic_slice, split, tile.


@op(("slice", "other axis"))
def _slice_t(g, sc, st):
  if st.T < 3 or st.keep_t:
    return None
  return Op("h[:, 1:]", lambda P, h, E: h[:, 1:], st.T - 1, st.D)


@op(("slice", "aligned"))
def _slice_aligned(g, sc, st):
  if st.D % 4 or st.D < 8:
    return None
  half = st.D // 2
  if g.coin():
    return Op(f"h[..., {half}:]", lambda P, h, E: h[..., half:], st.T, half)
  return Op("h[..., ::2] + h[..., 1::2]", lambda P, h, E: h[..., ::2] + h[..., 1::2], st.T, half)


@op(("slice", "misaligned"))
def _slice_mis(g, sc, st):
  if st.D < 4:
    return None
  return Op("h[..., 1:]", lambda P, h, E: h[..., 1:], st.T, st.D - 1)


@op(("dynamic_slice", "other axis"))
def _dslice_t(g, sc, st):
  if not st.extras or st.T < 3 or st.keep_t:
    return None
  n = st.T - 1
  return Op(f"dynamic_slice_T(h, i, {n})", lambda P, h, E: lax.dynamic_slice_in_dim(h, E.a["i"], n, 1), n, st.D)


@op(("dynamic_slice", "normalized axis"))
def _dslice_d(g, sc, st):
  if not st.extras or st.D < 4:
    return None
  n = st.D - 2
  return Op(f"dynamic_slice_D(h, i, {n})", lambda P, h, E: lax.dynamic_slice_in_dim(h, E.a["i"], n, 2), st.T, n)


@op(("dynamic_slice", "cyclic window"))
def _dslice_cyclic(g, sc, st):
  # jnp.roll by a traced shift along D (exact), or a window over [h, 2h] (not).
  if not st.extras:
    return None
  if g.coin():
    return Op("roll_D(h, i)", lambda P, h, E: jnp.roll(h, E.a["i"], axis=-1), st.T, st.D)
  return Op("dslice_D(concat_D(h, 2h), i, D)",
            lambda P, h, E: lax.dynamic_slice_in_dim(jnp.concatenate([h, 2 * h], -1), E.a["i"], st.D, 2),
            st.T, st.D, frozenset({("concatenate", "normalized axis")}))


@op(("dynamic_slice", "two indices"))
def _dslice_two(g, sc, st):
  if not st.extras or st.T < 3 or st.keep_t:
    return None
  n = st.T - 1
  c = g.choice(["-", "+", "*"])
  f = {"-": lambda a, b: a - b, "+": lambda a, b: a + 0.5 * b, "*": lambda a, b: a * b}[c]
  return Op(f"dslice_T(h, i) {c} dslice_T(h, j)",
            lambda P, h, E: f(lax.dynamic_slice_in_dim(h, E.a["i"], n, 1), lax.dynamic_slice_in_dim(h, E.a["j"], n, 1)),
            n, st.D)


@op(("split", ""))
def _split(g, sc, st):
  if st.D % 2 == 0 and g.coin():
    return Op("split_D(h, 2): a + b", lambda P, h, E: (lambda a, b: a + b)(*jnp.split(h, 2, axis=-1)),
              st.T, st.D // 2)
  if st.T < 2:
    return None
  k = st.T // 2
  return Op(f"split_T(h, [{k}]): concat(b, a)", lambda P, h, E: (lambda a, b: jnp.concatenate([b, a], 1))(
      *lax.split(h, (k, st.T - k), 1)), st.T, st.D, frozenset({("concatenate", "other axis")}))


@op(("tile", ""))
def _tile(g, sc, st):
  if st.D <= 8 and g.coin():
    return Op("tile(h, (1,1,2))", lambda P, h, E: jnp.tile(h, (1, 1, 2)), st.T, 2 * st.D)
  if st.keep_t or st.T > 7:
    return None
  return Op("tile(h, (1,2,1))", lambda P, h, E: jnp.tile(h, (1, 2, 1)), 2 * st.T, st.D)


# ---------------------------------------------------------------------------
# concatenate, pad, dynamic_update_slice, gather.


@op(("concatenate", "other axis"))
def _concat_t(g, sc, st):
  if st.keep_t:
    return None
  dx = _dense_x(g, sc, st, st.D) if g.coin() else None
  if dx is not None:
    return Op("concat_T(h, x@W2 + b2)", lambda P, h, E: jnp.concatenate([h, dx(P, E)], 1), 2 * st.T, st.D)
  return Op("concat_T(h, 2*h[:, :1])", lambda P, h, E: jnp.concatenate([h, 2 * h[:, :1]], 1), st.T + 1, st.D)


@op(("concatenate", "normalized axis"))
def _concat_d(g, sc, st):
  dx = _dense_x(g, sc, st, st.D) if g.coin() else None
  if dx is not None:
    return Op("concat_D(h, x@W2 + b2)", lambda P, h, E: jnp.concatenate([h, dx(P, E)], -1), st.T, 2 * st.D)
  return Op("concat_D(h, tanh(h))", lambda P, h, E: jnp.concatenate([h, jnp.tanh(h)], -1), st.T, 2 * st.D)


@op(("concatenate", "permutation of one value"))
def _concat_perm(g, sc, st):
  # jnp.roll along D, or pieces of h in another order (exact only when they
  # tile D; the overlapping/gapped forms must be refused).
  k = g.choice([1, st.D // 2, st.D - 1])
  form = g.choice(["roll", "swap", "overlap", "three"])
  if form == "roll":
    return Op(f"roll_D(h, {k})", lambda P, h, E: jnp.roll(h, k, axis=-1), st.T, st.D)
  if form == "swap":
    return Op(f"concat_D(h[..., {k}:], h[..., :{k}])",
              lambda P, h, E: jnp.concatenate([h[..., k:], h[..., :k]], -1), st.T, st.D)
  if form == "overlap":
    return Op(f"concat_D(h[..., {k}:], h[..., :{k + 1}])",
              lambda P, h, E: jnp.concatenate([h[..., k:], h[..., :k + 1]], -1), st.T, st.D + 1)
  if st.D < 3:
    return None
  a, b = 1, st.D - 1
  return Op(f"concat_D(h[..., {b}:], h[..., {a}:{b}], h[..., :{a}])",
            lambda P, h, E: jnp.concatenate([h[..., b:], h[..., a:b], h[..., :a]], -1), st.T, st.D)


def _pad3(h, cfg, value=0.0):
  return lax.pad(h, jnp.asarray(value, h.dtype), cfg)


@op(("pad", "other axis"))
def _pad_t(g, sc, st):
  if st.keep_t:
    return None
  return Op("pad_T(h, (1, 2)) zeros", lambda P, h, E: jnp.pad(h, ((0, 0), (1, 2), (0, 0))), st.T + 3, st.D)


@op(("pad", "normalized axis"))
def _pad_d(g, sc, st):
  return Op("pad_D(h, (1, 2)) zeros", lambda P, h, E: jnp.pad(h, ((0, 0), (0, 0), (1, 2))), st.T, st.D + 3)


@op(("pad", "cropping"))
def _pad_crop(g, sc, st):
  if st.D < 4:
    return None
  lo, hi = g.choice([(-1, 1), (-1, -1), (-2, 0)])
  return Op(f"lax.pad_D(h, ({lo}, {hi}))", lambda P, h, E: _pad3(h, [(0, 0, 0), (0, 0, 0), (lo, hi, 0)]),
            st.T, st.D + lo + hi)


@op(("pad", "interior"))
def _pad_interior(g, sc, st):
  if g.coin() or st.keep_t:
    return Op("lax.pad_D(h, interior=1)", lambda P, h, E: _pad3(h, [(0, 0, 0), (0, 0, 0), (0, 0, 1)]),
              st.T, 2 * st.D - 1)
  return Op("lax.pad_T(h, interior=1)", lambda P, h, E: _pad3(h, [(0, 0, 0), (0, 0, 1), (0, 0, 0)]),
            2 * st.T - 1, st.D)


@op(("pad", "non-zero value"))
def _pad_value(g, sc, st):
  if g.coin() or st.keep_t:
    return Op("pad_D(h, (1, 1), 0.7)", lambda P, h, E: _pad3(h, [(0, 0, 0), (0, 0, 0), (1, 1, 0)], 0.7),
              st.T, st.D + 2)
  return Op("pad_T(h, (0, 2), 0.7)", lambda P, h, E: _pad3(h, [(0, 0, 0), (0, 2, 0), (0, 0, 0)], 0.7),
            st.T + 2, st.D)


@op(("dynamic_update_slice", ""))
def _dus(g, sc, st):
  if not st.extras:
    return None
  if g.coin():
    return Op("dynamic_update_slice(h, 2*h[:, :1], (0, i, 0))",
              lambda P, h, E: lax.dynamic_update_slice(h, 2 * h[:, :1], (jnp.int32(0), E.a["i"], jnp.int32(0))),
              st.T, st.D)
  if st.D < 4:
    return None
  return Op("dynamic_update_slice(h, tanh(h[..., :2]), (0, 0, i))",
            lambda P, h, E: lax.dynamic_update_slice(h, jnp.tanh(h[..., :2]),
                                                     (jnp.int32(0), jnp.int32(0), E.a["i"])), st.T, st.D)


@op(("gather", "fill mode"))
def _gather_fill(g, sc, st):
  fv = g.choice([0.0, 0.5])
  if g.coin():
    idx = np.array([0, st.T + 1, st.T - 1, 1], np.int32)
    return Op(f"h.at[:, {idx.tolist()}].get(fill, {fv})",
              lambda P, h, E: h.at[:, idx].get(mode="fill", fill_value=fv), len(idx), st.D)
  idx = np.array(list(range(st.D - 1)) + [st.D + 2], np.int32)
  return Op(f"h.at[..., 0..D-2 + [D+2]].get(fill, {fv})",
            lambda P, h, E: h.at[..., idx].get(mode="fill", fill_value=fv), st.T, st.D)


@op(("gather", "clip mode"))
def _gather_clip(g, sc, st):
  if st.keep_t or g.coin():
    idx = (np.arange(st.T) + 1).astype(np.int32)     # the last index is out of bounds: clipped
  else:
    idx = np.array([0, st.T + 3, 1], np.int32)
  return Op(f"take_T(h, {idx.tolist()}, clip)", lambda P, h, E: jnp.take(h, idx, axis=1, mode="clip"),
            len(idx), st.D)


@op(("gather", "embedding lookup"), ("iota", ""))
def _pos_lookup(g, sc, st):
  pe = sc.param("emb", (MAXT + st.T, st.D))
  return Op("h + pos_table[arange(T) + 2]", lambda P, h, E: h + P[pe][jnp.arange(h.shape[1]) + 2], st.T, st.D)


# ---------------------------------------------------------------------------
# Contractions in the middle of a path (producers are below).


@op(("dot_general", "activation side"))
def _token_mix(g, sc, st):
  if g.coin():
    pm = sc.param("mix", (st.T, st.T))
    return Op("einsum('st,btd->bsd', M, h) (token mixing)",
              lambda P, h, E: jnp.einsum("st,btd->bsd", P[pm], h), st.T, st.D)
  d2 = g.choice(HIDDEN)
  pw, pb = sc.param("w", (st.D, d2)), sc.param("b", (d2,))
  return Op(f"h @ W ({st.D}->{d2}) + b", lambda P, h, E: h @ P[pw] + P[pb], st.T, d2,
            frozenset({("dot_general", "weight side")}))


@op(("dot_general", "activation side"))
def _resize_tokens(g, sc, st):
  """An image resize along the tokens (a grid axis; Dinov2 resizes its
  position table so): a weight matrix the program computes, contracted with
  the tokens. Scaled and translated at the same length, outputs that sample
  outside the input get zero weight: its rows sum to one or to zero."""
  method = g.choice(["linear", "cubic", "lanczos3", "cubic-pytorch"])
  aa = g.coin()
  if not st.keep_t and g.coin():
    t2 = g.choice([2, 5, 9])
    return Op(f"jax.image.resize(h, T->{t2}, {method}, antialias={aa})",
              lambda P, h, E: jax.image.resize(h, (h.shape[0], t2, h.shape[2]), method, antialias=aa), t2, st.D)
  scale, shift = g.choice([0.7, 1.3, 2.0]), g.choice([0.0, 0.4, -1.2])
  return Op(f"jax.image.scale_and_translate(h, tokens, scale={scale}, translation={shift}, {method})",
            lambda P, h, E: jax.image.scale_and_translate(h, h.shape, (1,), jnp.array([scale], h.dtype),
                                                          jnp.array([shift], h.dtype), method, antialias=aa),
            st.T, st.D)


@op(("dot_general", "batched"), ("exp", "nonlinear"), ("reduce_max", ""))
def _attention(g, sc, st):
  causal = g.coin()
  pq, pk = sc.param("w", (st.D, st.D)), sc.param("w", (st.D, st.D))
  pv, pbv = sc.param("w", (st.D, st.D)), sc.param("b", (st.D,))

  def fn(P, h, E):
    q, k, v = h @ P[pq], h @ P[pk], h @ P[pv] + P[pbv]
    s = jnp.einsum("btd,bsd->bts", q, k) / math.sqrt(st.D)
    if causal:
      t = h.shape[1]
      s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    return jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), v)
  return Op(f"attention({'causal' if causal else 'full'}) probs @ (h Wv + bv)", fn, st.T, st.D,
            frozenset({("select_n", "constant predicate")} if causal else set()))


@op(("conv_general_dilated", "input"))
def _conv_mid(g, sc, st):
  return _conv_op(g, sc, st, groups=1, tag="input")


def _conv_op(g, sc, st, groups, tag):
  d2 = st.D if groups > 1 else g.choice(HIDDEN)
  if st.D % groups or d2 % groups:
    return None
  k = g.choice([1, 2, 3])
  pk, pb = sc.param("w", (k, st.D // groups, d2)), sc.param("b", (d2,))
  fn = lambda P, h, E: lax.conv_general_dilated(
      h, P[pk], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=groups) + P[pb]
  return Op(f"conv1d_T(k={k}, groups={groups}, {st.D}->{d2})", fn, st.T, d2,
            frozenset({("conv_general_dilated", tag)}))


# ---------------------------------------------------------------------------
# Side outputs (top level only): make a value visible at an output.


@op(("copy", ""))
def _tap(g, sc, st):
  if not st.emit:
    return None

  def fn(P, h, E):
    E.emit(h)
    return jnp.copy(h)
  return Op("tap: also return h as an output", fn, st.T, st.D)


# ---------------------------------------------------------------------------
# Producers: the linear layer at the head of a chain segment.


@op(("dot_general", "weight side"), where="producer")
def _dense(g, sc, st, d_out=None):
  d_out = d_out or g.choice(HIDDEN)
  pw = sc.param("w", (st.D, d_out))
  if g.coin(0.8):
    pb = sc.param("b", (d_out,))
    return Op(f"Dense({st.D}->{d_out})", lambda P, h, E: h @ P[pw] + P[pb], st.T, d_out)
  return Op(f"Dense({st.D}->{d_out}, no bias)", lambda P, h, E: h @ P[pw], st.T, d_out)


@op(("dot_general", "transposed kernel"), where="producer")
def _dense_t(g, sc, st, d_out=None):
  d_out = d_out or g.choice(HIDDEN)
  pw, pb = sc.param("wt", (d_out, st.D)), sc.param("b", (d_out,))
  return Op(f"einsum('btd,od->bto') transposed kernel ({st.D}->{d_out})",
            lambda P, h, E: jnp.einsum("btd,od->bto", h, P[pw]) + P[pb], st.T, d_out)


@op(("reshape", "merge"), ("dot_general", "weight side"), where="producer")
def _dense_general(g, sc, st, d_out=None):
  d_out = d_out or g.choice([8, 12, 16])
  pw, pb = sc.param("w", (st.D, 2, d_out // 2)), sc.param("b", (2, d_out // 2))
  return Op(f"DenseGeneral({st.D}->(2,{d_out // 2})) -> reshape",
            lambda P, h, E: (jnp.einsum("btd,dgk->btgk", h, P[pw]) + P[pb]).reshape(h.shape[:2] + (d_out,)),
            st.T, d_out)


@op(("conv_general_dilated", "kernel"), where="producer")
def _conv_prod(g, sc, st):
  return _conv_op(g, sc, st, 1, "kernel")


@op(("conv_general_dilated", "grouped kernel"), where="producer")
def _conv_grouped(g, sc, st):
  if st.D % 2:
    return None
  return _conv_op(g, sc, st, 2, "grouped kernel")


@op(("add", "two shifts"), where="producer")
def _two_dense(g, sc, st):
  d_out = g.choice(HIDDEN)
  dx = _dense_x(g, sc, st, d_out)
  if dx is None:
    return None
  pw = sc.param("w", (st.D, d_out))
  return Op(f"Dense({st.D}->{d_out}) + Dense_x({DIN}->{d_out})", lambda P, h, E: h @ P[pw] + dx(P, E),
            st.T, d_out, frozenset({("dot_general", "weight side")}))


@op(("concatenate", "normalized axis"), where="producer")
def _two_dense_concat(g, sc, st):
  d1, d2 = g.choice([4, 8]), g.choice([4, 8])
  pw1, pb1 = sc.param("w", (st.D, d1)), sc.param("b", (d1,))
  pw2, pb2 = sc.param("w", (st.D, d2)), sc.param("b", (d2,))
  return Op(f"concat_D(Dense({st.D}->{d1}), Dense({st.D}->{d2}))",
            lambda P, h, E: jnp.concatenate([h @ P[pw1] + P[pb1], h @ P[pw2] + P[pb2]], -1), st.T, d1 + d2,
            frozenset({("dot_general", "weight side")}))


REUSES = ("tanh", "emit", "transposed", "group_norm", "contract", "norm_scale", "sum_added")


@op(("dot_general", "weight side"), where="producer")
def _dense_reuse(g, sc, st):
  """Dense whose kernel is also read at a second use (soundness issue 19): a
  centering of the kernel in place changes that use too."""
  d_out = g.choice([8, 12])
  pw, pb = sc.param("w", (st.D, d_out)), sc.param("b", (d_out,))
  kind = g.choice(REUSES)
  if kind == "emit" and not st.emit:
    kind = "tanh"
  groups = g.choice([2, 4])

  def fn(P, h, E):
    w = P[pw]
    y = h @ w + P[pb]
    if kind == "tanh":                  # a nonlinear function of the same product
      return y + 0.2 * jnp.tanh(h @ w)
    if kind == "emit":                  # the product is also a program output
      E.emit(h @ w)
      return y
    if kind == "transposed":            # W.T as another layer's kernel (contracts the centered axis)
      return y + 0.2 * jnp.tanh(y @ w.T) @ w
    if kind == "group_norm":            # the product next to a per-position GroupNorm
      return y + gn_tokens(0.5 * (h @ w), 1.0, 0.0, groups)
    if kind == "contract":              # a contraction over the centered axis
      return y + 0.1 * (h @ w).sum(-1, keepdims=True)
    if kind == "norm_scale":            # a direct read: the weight's norm scales the output
      return y * (1 + 0.1 * jnp.linalg.norm(w))
    return y + jnp.sum(w, -1).mean()    # a direct read: a sum of the weight added in
  return Op(f"Dense({st.D}->{d_out}) whose kernel is reused: {kind}", fn, st.T, d_out)


PRODUCERS = [_dense, _dense, _dense, _dense_t, _dense_general, _conv_prod, _conv_grouped, _two_dense,
             _two_dense_concat, _dense_reuse]


# ---------------------------------------------------------------------------
# Input stages: (x, ids) -> (B, T0, D).


def _in_dense(g, sc, st):
  op_ = _dense(g, sc, St(st.T, DIN, st.T0, "pre"))
  op_.kernel = [k for k in sc.specs if k.startswith("w")][-1]   # for a transposed reuse at the head
  return op_


@op(("gather", "embedding lookup"), where="input")
def _in_embed(g, sc, st):
  d = g.choice(HIDDEN)
  pe, pp = sc.param("emb", (VOCAB, d)), sc.param("emb", (MAXT, d))
  op_ = Op(f"embed(ids) + pos[:T] (V={VOCAB}, D={d})",
           lambda P, h, E: P[pe][E.a["ids"]] + P[pp][: E.a["ids"].shape[1]], st.T, d)
  op_.table = pe    # for a tied head
  return op_


@op(("conv_general_dilated", "kernel"), where="input")
def _in_conv(g, sc, st):
  return _conv_op(g, sc, St(st.T, DIN, st.T0, "pre"), 1, "kernel")


@op(("dot_general", "transposed kernel"), where="input")
def _in_dense_t(g, sc, st):
  return _dense_t(g, sc, St(st.T, DIN, st.T0, "pre"))


INPUTS = [_in_dense, _in_dense, _in_dense, _in_embed, _in_conv, _in_dense_t]


# ============================================================================
# Segments.


@dataclasses.dataclass
class Segment:
  name: str
  lines: list              # description lines
  fn: Callable             # fn(P, h, E) -> h
  T: int
  D: int


def _random_ops(g: Gen, sc: Scope, st: St, n: int, lines: list, forced=None) -> tuple:
  """Draws n ops (plus ``forced`` first), returning (ops, st)."""
  ops = []
  todo = ([forced] if forced is not None else []) + [None] * n
  for want in todo:
    o = None
    for _ in range(30):
      ctor = want if want is not None else _random_ctor(g)
      cand = ctor(g, sc, st)
      if (cand is not None and 2 <= cand.D <= 32 and 1 <= cand.T <= 14
          and (not st.keep_t or cand.T == st.T)):
        o = cand
        break
    if o is None:
      if want is not None:
        raise AssertionError(f"forced op {want.__name__} does not apply at {st}")
      continue
    ops.append(o)
    g.tags |= o.tags
    lines.append(f"    [{st.stage}] {o.name}   (T={o.T}, D={o.D})")
    st = dataclasses.replace(st, T=o.T, D=o.D)
  return ops, st


def _run(ops, P, h, E):
  for o in ops:
    h = o.fn(P, h, E)
  return h


def _n_ops(g):
  return g.choice([0, 1, 1, 2, 2, 3])


def seg_chain(g, sc, st, forced=None, where=None) -> Segment:
  """producer -> [pre ops] -> norm -> [post ops]."""
  lines = []
  prod_ctor = forced if where == "producer" else g.choice(PRODUCERS)
  prod = None
  if where == "any":     # every "any" op applies right after a Dense(-> 8) at the input's tokens
    prod_ctor = lambda g, sc, st: _dense(g, sc, st, d_out=8)
  for _ in range(20):
    prod = prod_ctor(g, sc, dataclasses.replace(st, stage="pre"))
    if prod is not None:
      break
    if where == "producer":
      raise AssertionError(f"forced producer {prod_ctor.__name__} does not apply at {st}")
    prod_ctor = g.choice(PRODUCERS)
  g.tags |= prod.tags
  lines.append(f"  chain: {prod.name}   (T={prod.T}, D={prod.D})")
  s = dataclasses.replace(st, T=prod.T, D=prod.D, stage="pre")
  n_pre = 0 if where == "norm" else _n_ops(g)     # a forced (maybe grouped) norm sees the producer's D
  pre, s = _random_ops(g, sc, s, n_pre, lines, forced if where == "any" else None)
  norm = make_norm(g, sc, s, NORMS_BY_NAME.get(forced) if where == "norm" else None)
  g.tags |= norm.tags
  lines.append(f"    norm: {norm.name} over D={s.D}")
  post, s = _random_ops(g, sc, dataclasses.replace(s, stage="post"), _n_ops(g), lines)

  def fn(P, h, E):
    h = prod.fn(P, h, E)
    h = _run(pre, P, h, E)
    h = norm.fn(P, h, E)
    return _run(post, P, h, E)
  return Segment("chain", lines, fn, s.T, s.D)


def _residual_body(g, sc, st, lines, ff=True, forced=None, head: Optional[list] = None):
  """h -> h + Dense(post(norm(pre(h)))) with T and D preserved; returns fn.
  With ``head`` (a list), there are no pre-norm ops and the norm is appended
  to it, so that a caller can normalize the block's input the same way."""
  s = dataclasses.replace(st, stage="pre", keep_t=True)
  pre, s = _random_ops(g, sc, s, 0 if head is not None else g.choice([0, 1, 1, 2]), lines, forced)
  norm = make_norm(g, sc, s)
  if head is not None:
    head.append(norm)
  g.tags |= norm.tags
  lines.append(f"    norm: {norm.name} over D={s.D}")
  post, s = _random_ops(g, sc, dataclasses.replace(s, stage="post"), g.choice([0, 1, 1, 2]), lines)
  width = g.choice([8, 16])
  if ff:
    pw1, pb1 = sc.param("w", (s.D, width)), sc.param("b", (width,))
    pw2, pb2 = sc.param("w", (width, st.D)), sc.param("b", (st.D,))
    act = g.choice(["gelu", "relu", "tanh", "silu"])
    actf = {"gelu": jax.nn.gelu, "relu": jax.nn.relu, "tanh": jnp.tanh, "silu": jax.nn.silu}[act]
    lines.append(f"    MLP: Dense({s.D}->{width}) {act} Dense({width}->{st.D}); residual add")
  else:
    pw2, pb2 = sc.param("w", (s.D, st.D)), sc.param("b", (st.D,))
    lines.append(f"    Dense({s.D}->{st.D}); residual add")

  def fn(P, h, E):
    y = _run(post, P, norm.fn(P, _run(pre, P, h, E), E), E)
    if ff:
      y = actf(y @ P[pw1] + P[pb1])
    return h + y @ P[pw2] + P[pb2]
  return fn


def seg_residual(g, sc, st, forced=None, where=None) -> Segment:
  lines = ["  residual (pre-LN) block:"]
  fn = _residual_body(g, sc, st, lines, ff=g.coin(), forced=forced if where == "any" else None)
  return Segment("residual", lines, fn, st.T, st.D)


def seg_postln(g, sc, st, forced=None, where=None) -> Segment:
  lines = ["  post-LN block: norm(h + MLP(h))"]
  width = g.choice([8, 16])
  pw1, pb1 = sc.param("w", (st.D, width)), sc.param("b", (width,))
  pw2, pb2 = sc.param("w", (width, st.D)), sc.param("b", (st.D,))
  s = dataclasses.replace(st, stage="pre", keep_t=True)
  pre, s = _random_ops(g, sc, s, g.choice([0, 0, 1]), lines)
  norm = make_norm(g, sc, s)
  g.tags |= norm.tags
  lines.append(f"    norm: {norm.name} over D={s.D}")

  def fn(P, h, E):
    y = h + jax.nn.gelu(h @ P[pw1] + P[pb1]) @ P[pw2] + P[pb2]
    return norm.fn(P, _run(pre, P, y, E), E)
  return Segment("postln", lines, fn, s.T, s.D)


def seg_attention(g, sc, st, forced=None, where=None) -> Segment:
  lines = ["  attention block: h + Wo(attention(norm(h)))"]
  s = dataclasses.replace(st, stage="pre", keep_t=True)
  norm = make_norm(g, sc, s)
  g.tags |= norm.tags
  lines.append(f"    norm: {norm.name}")
  att = _attention(g, sc, s)
  g.tags |= att.tags | {("dot_general", "batched")}
  lines.append(f"    {att.name}")
  post, s2 = _random_ops(g, sc, dataclasses.replace(s, stage="post"), g.choice([0, 1]), lines)
  pwo, pbo = sc.param("w", (s2.D, st.D)), sc.param("b", (st.D,))

  def fn(P, h, E):
    return h + _run(post, P, att.fn(P, norm.fn(P, h, E), E), E) @ P[pwo] + P[pbo]
  return Segment("attention", lines, fn, st.T, st.D)


# --- wrapped blocks: one function object, several calls with different params.


def _block_template(g, sc, st, lines, forced=None, head: Optional[list] = None):
  """A residual body whose ops do not emit (and, for custom/vmap, read no extras)."""
  return _residual_body(g, sc, st, lines, ff=g.coin(), forced=forced, head=head)


def _make_custom_vjp(body, bwd_kind):
  @jax.custom_vjp
  def f(h, lp):
    return body(lp, h, Env({}, None))

  def fwd(h, lp):
    return f(h, lp), (h, lp)

  def bwd(res, ct):
    h, lp = res
    _, vjp = jax.vjp(lambda hh, pp: body(pp, hh, Env({}, None)), h, lp)
    if bwd_kind == "scaled":
      return vjp(0.5 * ct)
    dh, dlp = vjp(ct)
    if bwd_kind == "clipped":
      dlp = jax.tree_util.tree_map(lambda x: jnp.clip(x, -0.05, 0.05), dlp)
    return dh, dlp
  f.defvjp(fwd, bwd)
  return f


def _make_custom_jvp(body, straight_through):
  @jax.custom_jvp
  def f(h, lp):
    return body(lp, h, Env({}, None))

  @f.defjvp
  def f_jvp(primals, tangents):
    h, lp = primals
    if straight_through:   # d/dh ignores the block; d/dparams is the true derivative
      y, t_p = jax.jvp(lambda pp: body(pp, h, Env({}, None)), (lp,), (tangents[1],))
      return y, t_p + tangents[0]
    return jax.jvp(lambda hh, pp: body(pp, hh, Env({}, None)), primals, tangents)
  return f


WRAPPERS = ["jit", "checkpoint", "custom_jvp", "custom_jvp_straight_through", "custom_vjp",
            "custom_vjp_scaled_bwd", "custom_vjp_clipped_bwd"]
# A custom block called once whose input the caller also normalizes as the
# block's first norm does (a side output): one mean site whose sums of the
# same value lie outside and inside the custom call (CBWC crashed on it when
# the outside sum came first).
SHARED = {"custom_jvp+shared": "custom_jvp", "custom_vjp+shared": "custom_vjp"}


def seg_wrapped(g, sc, st, forced=None, where=None) -> Segment:
  if where == "segment" and forced in SHARED:
    kind, shared = SHARED[forced], True
  else:
    kind = forced if where == "segment" and forced in WRAPPERS else g.choice(WRAPPERS)
    shared = kind.startswith("custom") and st.emit and g.coin(0.2)
  k = 1 if shared else g.choice([2, 3])
  custom = kind.startswith("custom")
  lines = [f"  {kind} block function called {k} times with different params"
           + (" (its first norm's input also normalized by the caller, a side output)" if shared else "") + ":"]
  tsc = sc.repeated("blocks", "list", k)
  inner = dataclasses.replace(st, extras=st.extras and not custom, emit=False)
  head: Optional[list] = [] if shared else None
  body = _block_template(g, tsc, inner, lines, head=head)
  if kind == "jit":
    wrapped = jax.jit(lambda h, lp, arrays: body(lp, h, Env(arrays, None)))
    call = lambda h, lp, E: wrapped(h, lp, E.a)
  elif kind == "checkpoint":
    wrapped = jax.checkpoint(lambda h, lp, arrays: body(lp, h, Env(arrays, None)))
    call = lambda h, lp, E: wrapped(h, lp, E.a)
  elif kind.startswith("custom_vjp"):
    wrapped = _make_custom_vjp(body, {"custom_vjp": "true", "custom_vjp_scaled_bwd": "scaled",
                                      "custom_vjp_clipped_bwd": "clipped"}[kind])
    call = lambda h, lp, E: wrapped(h, lp)
  else:
    wrapped = _make_custom_jvp(body, kind.endswith("straight_through"))
    call = lambda h, lp, E: wrapped(h, lp)
  between = g.coin(0.3)     # a nonlinearity between the calls: later calls see a non-zero-sum input
  if between:
    lines.append("    (tanh between calls)")

  def fn(P, h, E):
    for i, lp in enumerate(P["blocks"]):
      if between and i:
        h = jnp.tanh(h)
      if shared:
        E.emit(head[0].fn(lp, h, E))
      h = call(h, lp, E)
    return h
  g.tags.add((_WRAP_RULE[kind], _WRAP_VARIANT[kind]))
  if shared:
    g.tags.add((_WRAP_RULE[kind], "norm shared with the caller"))
  return Segment(kind, lines, fn, st.T, st.D)


_WRAP_RULE = {"jit": "jit", "checkpoint": "checkpoint", "custom_jvp": "custom_jvp_call",
              "custom_jvp_straight_through": "custom_jvp_call", "custom_vjp": "custom_vjp_call",
              "custom_vjp_scaled_bwd": "custom_vjp_call", "custom_vjp_clipped_bwd": "custom_vjp_call"}
_WRAP_VARIANT = {"jit": "reused", "checkpoint": "reused", "custom_jvp": "true jvp",
                 "custom_jvp_straight_through": "modified jvp", "custom_vjp": "true vjp",
                 "custom_vjp_scaled_bwd": "modified bwd", "custom_vjp_clipped_bwd": "modified bwd"}


def seg_scan(g, sc, st, forced=None, where=None) -> Segment:
  k = g.choice([2, 3])
  leak = g.coin(0.25)
  lines = [f"  lax.scan over {k} stacked residual blocks" + (" (+0.1*norm(carry) leak)" if leak else "")]
  tsc = sc.repeated("layers", "stack", k)
  body = _block_template(g, tsc, dataclasses.replace(st, emit=False), lines)

  def fn(P, h, E):
    def step(c, lp):
      y = body(lp, c, E)
      if leak:
        y = y + 0.1 * ln_fast(c, 1.0, 0.3)
      return y, jnp.sum(y)
    h, _ = lax.scan(step, h, P["layers"])
    return h
  g.tags.add(("scan", "carry leak" if leak else "stacked layers"))
  return Segment("scan", lines, fn, st.T, st.D)


def seg_cond(g, sc, st, forced=None, where=None) -> Segment:
  lines = ["  lax.cond(flag, block_a, block_b):"]
  sa, sb = sc.child("a"), sc.child("b")
  inner = dataclasses.replace(st, emit=False)
  la, lb = ["   branch a:"], ["   branch b:"]
  fa = _block_template(g, sa, inner, la)
  tanh_b = g.coin(0.3)
  fb = (lambda P, h, E: jnp.tanh(h)) if tanh_b else _block_template(g, sb, inner, lb)
  lines += la + (["   branch b: tanh"] if tanh_b else lb)

  def fn(P, h, E):
    return lax.cond(E.a["flag"], lambda v: fa(P["a"], v, E), lambda v: fb(P["b"], v, E), h)
  g.tags.add(("cond", "two branches"))
  return Segment("cond", lines, fn, st.T, st.D)


def seg_while(g, sc, st, forced=None, where=None) -> Segment:
  k = g.choice([2, 3])
  lines = [f"  lax.while_loop(i < {k}) over one residual block (same params each step):"]
  body = _block_template(g, sc.child("blk"), dataclasses.replace(st, emit=False), lines)

  def fn(P, h, E):
    return lax.while_loop(lambda c: c[0] < k, lambda c: (c[0] + 1, body(P["blk"], c[1], E)),
                          (jnp.int32(0), h))[1]
  g.tags.add(("while", "fixed trip count"))
  g.differentiable = False
  return Segment("while", lines, fn, st.T, st.D)


def seg_vmap(g, sc, st, forced=None, where=None) -> Segment:
  lines = ["  jax.vmap(residual block) over the batch:"]
  body = _block_template(g, sc.child("blk"), dataclasses.replace(st, extras=False, emit=False), lines)

  def fn(P, h, E):
    return jax.vmap(lambda v: body(P["blk"], v[None], Env({}, None))[0])(h)
  g.tags.add(("vmap", "batch"))
  return Segment("vmap", lines, fn, st.T, st.D)


SEGMENTS = {"chain": seg_chain, "residual": seg_residual, "postln": seg_postln,
            "attention": seg_attention, "wrapped": seg_wrapped, "scan": seg_scan, "cond": seg_cond,
            "while": seg_while, "vmap": seg_vmap}
SEGMENT_WEIGHTS = {"chain": 34, "residual": 22, "postln": 8, "attention": 8, "wrapped": 12,
                   "scan": 5, "cond": 4, "while": 3, "vmap": 4}

# Segment-level table entries (control flow and wrappers; named as the
# control-flow rules are expected to be).
for _k in WRAPPERS:
  op((_WRAP_RULE[_k], _WRAP_VARIANT[_k]), where="segment")(_k)
for _k, _w in SHARED.items():
  op((_WRAP_RULE[_w], "norm shared with the caller"), where="segment")(_k)
for _k, _rv in (("scan", ("scan", "stacked layers")), ("scan", ("scan", "carry leak")),
                ("cond", ("cond", "two branches")), ("while", ("while", "fixed trip count")),
                ("vmap", ("vmap", "batch"))):
  op(_rv, where="segment")(_k)
for _n in NORMS:
  for _t in _n.tags:
    op(_t, where="norm")(_n.name)

# ---- control-flow variants (i10-flow) --------------------------------------
# switch, a cond whose index reads the stream, fori_loop with a traced trip
# count over stacked layers, a while loop whose condition reads the stream.


def _stream_stat(h):
  """A data-dependent scalar of the stream that any shift along D changes."""
  return jnp.mean(h[..., 0])


def seg_switch(g, sc, st, forced=None, where=None) -> Segment:
  lines = ["  lax.switch(i, [block_a, block_b, third]):"]
  inner = dataclasses.replace(st, emit=False)
  la, lb = ["   branch 0:"], ["   branch 1:"]
  fa = _block_template(g, sc.child("a"), inner, la)
  fb = _block_template(g, sc.child("b"), inner, lb)
  third = g.choice(["scale", "identity", "tanh"])
  fc = {"scale": lambda h: 0.5 * h, "identity": lambda h: h, "tanh": jnp.tanh}[third]
  lines += la + lb + [f"   branch 2: {third}"]

  def fn(P, h, E):
    return lax.switch(E.a["i"], [lambda v: fa(P["a"], v, E), lambda v: fb(P["b"], v, E), fc], h)
  g.tags.add(("cond", "switch"))
  return Segment("switch", lines, fn, st.T, st.D)


def seg_cond_stream(g, sc, st, forced=None, where=None) -> Segment:
  lines = ["  lax.cond(mean(h[..., 0]) > 0.3, block_a, 0.5 * h)  (index reads the stream):"]
  fa = _block_template(g, sc.child("a"), dataclasses.replace(st, emit=False), lines)

  def fn(P, h, E):
    return lax.cond(_stream_stat(h) > 0.3, lambda v: fa(P["a"], v, E), lambda v: 0.5 * v, h)
  g.tags.add(("cond", "index from stream"))
  return Segment("cond_stream", lines, fn, st.T, st.D)


def seg_fori(g, sc, st, forced=None, where=None) -> Segment:
  lines = ["  lax.fori_loop(0, i + 1, ...) over 3 stacked residual blocks (traced trip count):"]
  body = _block_template(g, sc.repeated("layers", "stack", 3), dataclasses.replace(st, emit=False),
                         lines)

  def fn(P, h, E):
    def step(i, c):
      lp = jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False),
                                  P["layers"])
      return body(lp, c, E)
    return lax.fori_loop(0, E.a["i"] + 1, step, h)
  g.tags.add(("while", "fori traced bounds"))
  g.differentiable = False
  return Segment("fori", lines, fn, st.T, st.D)


def seg_while_stream(g, sc, st, forced=None, where=None) -> Segment:
  lines = ["  lax.while_loop(i < 3 and mean(h[..., 0]) < 0.5) over one residual block:"]
  body = _block_template(g, sc.child("blk"), dataclasses.replace(st, emit=False), lines)

  def fn(P, h, E):
    return lax.while_loop(lambda c: (c[0] < 3) & (_stream_stat(c[1]) < 0.5),
                          lambda c: (c[0] + 1, body(P["blk"], c[1], E)), (jnp.int32(0), h))[1]
  g.tags.add(("while", "stream predicate"))
  g.differentiable = False
  return Segment("while_stream", lines, fn, st.T, st.D)


# ---- loops that run zero times (soundness issue 19) -------------------------
# The carry leaves as it entered and a scan's stacked outputs are empty: a
# rule that holds only after one iteration (the body makes the carry zero-sum,
# or drops its shift) is wrong here.

_INITS = {"h": lambda h: h, "tanh": jnp.tanh, "affine": lambda h: 0.5 * h + 1.0}


def _zero_trip(g, sc, st, lines, what):
  """(init, step) of a zero-trip loop: ``step(P, c, h, E)`` is the body, which
  either carries ``c`` through a residual block or overwrites it with a block
  of the loop-invariant stream ``h``."""
  init = g.choice(sorted(_INITS))
  overwrite = g.coin()
  body = _block_template(g, sc.child("blk"), dataclasses.replace(st, emit=False), lines)
  lines[0] += (f" [init {init}(h); body " + ("overwrites the carry with block(h)]" if overwrite
                                            else "carries it through a block]"))

  def step(P, c, h, E):
    return body(P["blk"], h if overwrite else c, E)
  return _INITS[init], step


def seg_scan0(g, sc, st, forced=None, where=None) -> Segment:
  how = g.choice(["scan", "fori_static"])
  lines = ["  " + ("lax.scan(length=0)" if how == "scan" else "lax.fori_loop(2, 2) (a scan of length 0)")]
  init, step = _zero_trip(g, sc, st, lines, how)
  emit_ys = how == "scan" and st.emit and g.coin()
  if emit_ys:
    lines.append("    the (empty) stacked outputs are a program output")

  def fn(P, h, E):
    if how == "fori_static":
      return lax.fori_loop(2, 2, lambda i, c: step(P, c, h, E), init(h))
    c, ys = lax.scan(lambda c, _: (step(P, c, h, E), step(P, c, h, E)), init(h), None, length=0)
    if emit_ys:
      E.emit(ys)
    return c
  g.tags.add(("scan", "zero length"))
  return Segment("scan0", lines, fn, st.T, st.D)


def seg_while0(g, sc, st, forced=None, where=None) -> Segment:
  how = g.choice(["while", "fori_traced"])
  lines = ["  " + ("lax.while_loop(i < n) with n <= 0 (false at entry)" if how == "while"
                   else "lax.fori_loop(i, i) (traced equal bounds)")]
  init, step = _zero_trip(g, sc, st, lines, how)

  def fn(P, h, E):
    if how == "fori_traced":
      return lax.fori_loop(E.a["i"], E.a["i"], lambda i, c: step(P, c, h, E), init(h))
    n = E.a["i"] - 2                    # traced; i is 0, 1 or 2
    return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, step(P, c[1], h, E)),
                          (jnp.int32(0), init(h)))[1]
  g.tags.add(("while", "false at entry"))
  g.differentiable = False
  return Segment("while0", lines, fn, st.T, st.D)


SEGMENTS.update({"switch": seg_switch, "cond_stream": seg_cond_stream, "fori": seg_fori,
                 "while_stream": seg_while_stream, "scan0": seg_scan0, "while0": seg_while0})
SEGMENT_WEIGHTS.update({"switch": 2, "cond_stream": 1, "fori": 2, "while_stream": 1, "scan0": 3,
                        "while0": 2})
for _k, _rv in (("switch", ("cond", "switch")), ("cond_stream", ("cond", "index from stream")),
                ("fori", ("while", "fori traced bounds")),
                ("while_stream", ("while", "stream predicate")),
                ("scan0", ("scan", "zero length")), ("while0", ("while", "false at entry"))):
  op(_rv, where="segment")(_k)
# ---- end of control-flow variants --------------------------------------------

KEYS = sorted(OPS)
# Random ops: a uniform (rule, variant) key first, then one of its constructors.
RANDOM_KEYS = [k for k in KEYS if any(w == "any" for _, w in OPS[k])]


def _random_ctor(g: Gen):
  key = RANDOM_KEYS[int(g.rng.integers(len(RANDOM_KEYS)))]
  return g.choice([fn for fn, w in OPS[key] if w == "any"])


# ============================================================================
# Programs.


@dataclasses.dataclass
class Program:
  seed: int
  forced: tuple             # the (rule, variant) this program was built around
  params: Any               # float64 parameters (fold/trace with these)
  other_params: Any         # another draw (CBWC is checked here)
  args: list                # [args at batch 2, args at batch 3 (and T0 + OTHER_T tokens if other_t)]
  apply: Callable           # apply(params, x, aux) -> tuple of outputs
  lines: list
  tags: frozenset
  fold_kwargs: dict
  tol: float                # relative tolerance of output comparisons
  grad_tol: float
  differentiable: bool      # reverse mode works (no lax.while_loop)
  other_t: bool = False     # the second argument set also has another sequence length

  def describe(self) -> str:
    head = (f"fuzz program seed={self.seed} (forced {self.forced}); fold kwargs {self.fold_kwargs}; "
            f"tol {self.tol:g}; reproduce: fuzz_programs.make_program({self.seed})")
    return "\n".join([head] + self.lines)


def _args(g: Gen, T0: int, B: int, salt: int) -> tuple:
  rng = np.random.default_rng([g.seed, B, salt])
  x = jnp.asarray(rng.standard_normal((B, T0, DIN)), F64)
  aux = {"ids": jnp.asarray(rng.integers(0, VOCAB, (B, T0)), I32),
         "i": jnp.asarray(int(rng.integers(0, 3)), I32),
         "j": jnp.asarray(int(rng.integers(0, 3)), I32),
         "key": jax.random.PRNGKey(int(rng.integers(0, 2**31))),
         "flag": jnp.asarray(bool(rng.integers(0, 2)))}
  for name, (shape, p) in g.masks.items():
    aux[name] = jnp.asarray(rng.random((B,) + shape) < p)
  return (x, aux)


READS = ("sum", "norm", "mean_added", "l2", "last_axis_mean", "first_axis_sum")


def _read_param(kind: str, i: int, params, outs: list) -> list:
  """``outs`` with a direct read of parameter leaf ``i`` (mod their number)."""
  leaves = [v for v in jax.tree_util.tree_leaves(params) if jnp.issubdtype(v.dtype, jnp.floating)]
  w = leaves[i % len(leaves)]
  if kind == "sum":
    return outs + [jnp.sum(w)]
  if kind == "norm":
    return outs + [jnp.linalg.norm(w)]
  if kind == "mean_added":
    return [outs[0] + w.mean()] + outs[1:]
  if kind == "l2":                      # a weight-decay term computed inside apply_fn
    return outs + [0.5 * sum(jnp.sum(v * v) for v in leaves)]
  if kind == "last_axis_mean":          # exactly the shift a centering along the last axis removes
    return outs + [w.mean(-1) if w.ndim else w]
  return outs + [w.sum(0) if w.ndim else w]


def make_program(seed: int, forced: Optional[tuple] = None) -> Program:
  """The program of ``seed`` (deterministic); needs jax_enable_x64."""
  assert jax.config.jax_enable_x64, "fuzz programs are float64: enable x64 first"
  g = Gen(seed)
  forced = forced or KEYS[seed % len(KEYS)]
  entries = OPS[forced]
  ctor, where = entries[int(g.rng.integers(len(entries)))]
  g.tags.add(forced)
  T0 = g.choice(TOKENS)
  lines = []
  root = Scope()
  st = St(T0, DIN, T0, "pre")

  # Input stage.
  in_ctor = ctor if where == "input" else g.choice(INPUTS)
  inp = in_ctor(g, root.child("in"), st)
  g.tags |= inp.tags
  lines.append(f"  input: {inp.name}   (T={T0}, D={inp.D})")
  st = dataclasses.replace(st, D=inp.D)

  # Segments.
  n_seg = g.choice([1, 2, 2, 3])
  kinds = list(SEGMENT_WEIGHTS)
  weights = np.array([SEGMENT_WEIGHTS[k] for k in kinds], float)
  segs = []
  for i in range(n_seg):
    if i == 0 and where == "segment":
      kind = "wrapped" if ctor in WRAPPERS or ctor in SHARED else ctor
      seg = SEGMENTS[kind](g, root.child(f"s{i}"), st, ctor, where)
    elif i == 0 and where in ("any", "producer", "norm"):
      seg = seg_chain(g, root.child(f"s{i}"), st, ctor, where)
    else:
      kind = kinds[int(g.rng.choice(len(kinds), p=weights / weights.sum()))]
      seg = SEGMENTS[kind](g, root.child(f"s{i}"), st)
    segs.append(seg)
    lines += seg.lines
    st = dataclasses.replace(st, T=seg.T, D=seg.D)

  # Outputs.
  out_sc = root.child("out")
  out_kind = g.choice(["head", "norm_head", "norm_head", "raw", "pool_head", "tied", "tied"])
  if out_kind == "pool_head" and segs and "h - stop_gradient(mean_T(h))" in segs[-1].lines[-1]:
    # The mean over T of h − mean_T(h) is zero: the output would be rounding
    # noise, which no fold can match (seed 5962; rel err 1.4 of outputs ~1e-17).
    out_kind = "head"
  if out_kind == "tied" and not (hasattr(inp, "table") and st.D == inp.D):
    out_kind = "tied_kernel" if hasattr(inp, "kernel") and st.D == inp.D else "norm_head"
  norm = make_norm(g, out_sc, st) if out_kind in ("norm_head", "tied", "tied_kernel") else None
  if norm is not None:
    g.tags |= norm.tags
  n_out = g.choice([2, 3])
  ph = out_sc.param("w", (st.D, n_out)) if out_kind in ("head", "norm_head", "pool_head") else None
  int_out = g.coin(0.15)
  lines.append(f"  output: {out_kind}" + (f" after {norm.name}" if norm else "")
               + ("; + argmax_D(h) int output" if int_out else "") + ("; outputs cast to f32" if g.out32 else ""))
  # Direct reads of the parameters as values (soundness issue 19): a centering
  # in place changes every one of them unless the analysis sees it.
  reads = [(g.choice(READS), int(g.rng.integers(1 << 20))) for _ in range(g.choice([0, 0, 0, 1, 2]))]
  if reads:
    lines.append("  parameter reads: " + ", ".join(f"{k}(leaf #{i})" for k, i in reads))
  out32 = g.out32
  table = getattr(inp, "table", None)
  kernel = getattr(inp, "kernel", None)

  def apply(params, x, aux):
    E = Env(dict(aux, x=x), [])
    h = inp.fn(params["in"], x, E)
    for i, seg in enumerate(segs):
      h = seg.fn(params[f"s{i}"], h, E)
    P = params["out"]
    if norm is not None:
      h_n = norm.fn(P, h, E)
    outs = []
    if out_kind == "head":
      outs.append(h @ P[ph])
    elif out_kind == "norm_head":
      outs.append(h_n @ P[ph])
    elif out_kind == "pool_head":
      outs.append(h.mean(1) @ P[ph])
    elif out_kind == "tied":
      outs.append(h_n @ params["in"][table].T)
    elif out_kind == "tied_kernel":       # the input Dense's kernel, transposed, as the head
      outs.append(h_n @ params["in"][kernel].T)
    else:
      outs.append(h)
    if int_out:
      outs.append(jnp.argmax(h, -1))
    outs += E.outs
    for kind, i in reads:
      outs = _read_param(kind, i, params, outs)
    if out32:
      outs = [o.astype(F32) if jnp.issubdtype(o.dtype, jnp.floating) else o for o in outs]
    return tuple(outs)

  # Fold options.
  kw = {}
  r = g.rng.random()
  if r < 0.08:
    kw["norm_impl"] = "interpret"
  elif r < 0.2:
    kw["auxiliary_centering"] = False
    if r < 0.14:   # (the CBWC crash's options: a tie by copy, no auxiliary centering)
      kw["tied_weights"] = "copy"
  elif r < 0.3:
    kw["tied_weights"] = "copy"

  params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, F64),
                                  instantiate(root, np.random.default_rng([seed, 1])))
  other = jax.tree_util.tree_map(lambda a: jnp.asarray(a, F64),
                                 instantiate(root, np.random.default_rng([seed, 2])))
  # The second argument set: another batch and, where the program accepts it
  # (no parameter or index sized by the token count), another sequence length.
  args = [_args(g, T0, BATCHES[0], 0), _args(g, T0 + OTHER_T, BATCHES[1], 0)]
  try:
    jax.eval_shape(apply, params, *args[1])
    other_t = True
  except Exception:  # noqa: BLE001 - the program is defined at T0 only
    args[1], other_t = _args(g, T0, BATCHES[1], 0), False
  lines.append(f"  argument sets: (B={BATCHES[0]}, T={T0}), (B={BATCHES[1]}, T={T0 + OTHER_T if other_t else T0})")
  tol, gtol = (1e-5, 1e-4) if out32 else (1e-9, 1e-8)
  return Program(seed, forced, params, other, args, apply, lines, frozenset(g.tags), kw, tol, gtol,
                 g.differentiable, other_t)


def batch_one(args: tuple, one_token: bool = False) -> tuple:
  """An argument set cut to batch 1 (and one token): the example of a fold
  that is proved again with its size-1 axes made 2 (or, with
  ``generic_shapes=False``, at the example alone)."""
  x, aux = args
  aux = dict(aux)
  for k in ("ids", *g_masks(aux)):
    aux[k] = aux[k][:1, :1] if (one_token and k == "ids") else aux[k][:1]
  return (x[:1, :1] if one_token else x[:1], aux)


def g_masks(aux: dict) -> list:
  """The per-row mask arguments of ``_args`` (leading dim: the batch)."""
  return [k for k in aux if k not in ("ids", "i", "j", "key", "flag")]


# ============================================================================
# Jaxpr walking (for the coverage meta-test).


def _sub_jaxprs(v):
  if hasattr(v, "eqns"):                     # a Jaxpr
    yield v
  elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):   # a ClosedJaxpr
    yield v.jaxpr
  elif isinstance(v, (tuple, list)):
    for x in v:
      yield from _sub_jaxprs(x)


def primitives_of(jaxpr) -> set:
  """Names of every primitive in ``jaxpr`` and all its nested jaxprs."""
  out = set()
  stack = [jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") and not hasattr(jaxpr, "eqns") else jaxpr]
  while stack:
    j = stack.pop()
    for e in j.eqns:
      out.add(e.primitive)
      for v in e.params.values():
        stack.extend(_sub_jaxprs(v))
  return out


if __name__ == "__main__":   # python tests/test_jaxfold/fuzz_programs.py SEED [SEED ...]
  import sys
  jax.config.update("jax_enable_x64", True)
  for _s in sys.argv[1:]:
    print(make_program(int(_s)).describe())


# ============================================================================
# Residual-stream programs (for ``rotate``): the fuzz programs above nearly
# always hold an op that no rotation commutes with.

STREAM_NORMS = [k for k in NORMS if not k.grouped and k.name not in ("ln_tokens_and_features",)]


def make_stream_program(seed: int) -> Program:
  """A pre-LN transformer over a residual stream of width D (deterministic;
  needs jax_enable_x64): embedding or Dense input (+ positions), 1-3 blocks
  ``h + MLP(norm(h))`` / ``h + Wo(attention(norm(h)))`` with random LayerNorm
  spellings, a final norm and a head (tied to the embedding or not)."""
  assert jax.config.jax_enable_x64, "fuzz programs are float64: enable x64 first"
  g = Gen(seed)
  T0, D = g.choice(TOKENS), g.choice([4, 8, 12])
  root = Scope()
  sc_in = root.child("in")
  embed = g.coin()
  if embed:
    pe, pp = sc_in.param("emb", (VOCAB, D)), sc_in.param("emb", (MAXT, D))
  else:
    pe, pb = sc_in.param("w", (DIN, D)), sc_in.param("b", (D,))
  lines = [f"  stream program (reproduce: fuzz_programs.make_stream_program({seed})): "
           f"{'embed(ids) + pos[:T]' if embed else 'Dense(x)'} (T={T0}, D={D})"]
  st = St(T0, D, T0, "pre", extras=True, emit=False, keep_t=True)
  blocks = []
  for i in range(g.choice([1, 2, 3])):
    sc = root.child(f"s{i}")
    norm = make_norm(g, sc, st, g.choice(STREAM_NORMS))
    if g.coin():
      att = _attention(g, sc, st)
      pwo, pbo = sc.param("w", (D, D)), sc.param("b", (D,))
      lines.append(f"  block: h + Wo({att.name}({norm.name}(h)))")
      blocks.append(lambda P, h, E, n=norm, a=att, w=pwo, b=pbo: h + a.fn(P, n.fn(P, h, E), E) @ P[w] + P[b])
    else:
      width = g.choice([8, 16])
      pw1, pb1 = sc.param("w", (D, width)), sc.param("b", (width,))
      pw2, pb2 = sc.param("w", (width, D)), sc.param("b", (D,))
      lines.append(f"  block: h + MLP({norm.name}(h)) (width {width})")
      blocks.append(lambda P, h, E, n=norm, w1=pw1, b1=pb1, w2=pw2, b2=pb2:
                    h + jax.nn.gelu(n.fn(P, h, E) @ P[w1] + P[b1]) @ P[w2] + P[b2])
  out_sc = root.child("out")
  final = make_norm(g, out_sc, st, g.choice(STREAM_NORMS))
  tied = embed and g.coin()
  ph = None if tied else out_sc.param("w", (D, g.choice([2, 3])))
  lines.append(f"  output: {'tied head' if tied else 'head'} after {final.name}")

  def apply(params, x, aux):
    E = Env(dict(aux, x=x), None)
    P = params["in"]
    if embed:
      h = P[pe][aux["ids"]] + P[pp][: aux["ids"].shape[1]]
    else:
      h = x @ P[pe] + P[pb]
    for i, blk in enumerate(blocks):
      h = blk(params[f"s{i}"], h, E)
    y = final.fn(params["out"], h, E)
    return (y @ (params["in"][pe].T if tied else params["out"][ph]),)

  params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, F64),
                                  instantiate(root, np.random.default_rng([seed, 1])))
  other = jax.tree_util.tree_map(lambda a: jnp.asarray(a, F64),
                                 instantiate(root, np.random.default_rng([seed, 2])))
  args = [_args(g, T0, BATCHES[0], 0), _args(g, T0 + OTHER_T, BATCHES[1], 0)]
  lines.append(f"  argument sets: (B={BATCHES[0]}, T={T0}), (B={BATCHES[1]}, T={T0 + OTHER_T})")
  kw = {"tied_weights": "copy"} if tied and g.coin() else {}
  return Program(seed, ("stream", ""), params, other, args, apply, lines, frozenset(g.tags), kw, 1e-9, 1e-8,
                 True, True)
