"""Perturbed real architectures: seeded programs for fuzzing ``jaxfold.fold``.

``make_program(seed)`` picks one architecture written the way model code is
written (pre-LN GPT, post-LN BERT/OPT, parallel attention + MLP, ViT with a
class token, a GroupNorm conv block, top-k MoE routing, an encoder-decoder with
cross-attention, a KV-cache decode step, a ``lax.scan`` over stacked layers)
and perturbs it: each architecture calls ``mut(name, h, kind)`` at the points
of its dataflow where a perturbation can change what a fold may do —

  ``w``  a residual writer's output before it is added to the stream,
  ``s``  the stream (or the writer sum) right before a norm,
  ``n``  a norm's output before its readers,

and ``make_program`` replaces 1-3 of those points (never more than one per
point) by a random ``MUTATIONS`` entry: a per-feature scale or bias (fixed or a
parameter), a permutation or a gather with repeats of the features, a slice and
pad, reshape/transpose/split-merge of the feature axis, a concatenation with
another stream, f32/bf16 round trips, ``stop_gradient``, ``custom_jvp`` /
``custom_vjp`` / ``jax.checkpoint`` wrappers, ``jnp.where`` with batch or
feature masks, a cumsum along the sequence, a mean subtracted along the wrong
axis, a second use of the value as an output or a loss term, ``.at[]`` updates,
``lax.cond``/``lax.switch`` on a traced predicate, Python branches on a shape
size, and reuses of one of the model's own parameters (a kernel along the other
axis, a γ as a bias, ...). Architectures also tie weights (an LM head that is
the embedding, an MLP whose second kernel is the first transposed).

``PARAM_MUTATIONS`` perturb 0-2 of the architecture's own leaves where the
program reads them (an ``.at[]`` update of a column, a permutation or gather, a
mask, a symmetrised or transposed square kernel, a cast, a tie to another leaf
of the same shape, a nonlinearity, a mean already subtracted along either
axis); ``fold_options`` draws ``jaxfold.fold``'s options (``fuse_affine`` and
``defer_norms`` included) and the example is one of the shapes at random.

Every value is float64 with non-uniform γ, β and biases; every program expects
``jax_enable_x64``. ``Program.shapes`` lists (batch, length) pairs: the first is
the example, the others are where the fold must still be exact (batch 1/2/3,
length 1/5; for images, length is the side).

Reproduce one program::

    from conftest import x64_context
    import mutation_programs as mp
    with x64_context():
      prog = mp.make_program(1234)
      print(prog.describe())
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import spellings as S
from jax import lax

F64 = jnp.float64
D = 8            # residual stream width (2 heads of 4)
H = 2            # heads
FF = 16          # MLP width
V = 11           # vocabulary
MAXT = 8         # position table rows
DIN = 5          # input features (patches, images)
E = 3            # experts
CACHE = 4        # KV-cache length of the decode step's example
EPS = 1e-5
EXAMPLE = (2, 4)
OTHER = ((1, 4), (3, 5), (2, 1), (1, 1))


# ============================================================================
# Parameters: numpy float64 values drawn by kind.


def _value(rng: np.random.Generator, kind: str, shape: tuple) -> np.ndarray:
  n = rng.standard_normal(shape)
  if kind == "w":
    return n / math.sqrt(max(1, int(np.prod(shape[:-1]))))
  if kind == "g":
    return 1.0 + 0.5 * n
  if kind == "b":
    return 0.3 + 0.5 * n
  if kind == "emb":
    return 0.2 + 0.7 * n
  return 0.7 * n


class Params:
  """Collects parameter declarations; ``values(rng)`` draws them."""

  def __init__(self):
    self.specs: dict = {}

  def __call__(self, path: str, kind: str, shape) -> str:
    assert path not in self.specs, path
    self.specs[path] = (kind, tuple(int(s) for s in shape))
    return path

  def values(self, rng: np.random.Generator) -> dict:
    out: dict = {}
    for path, (kind, shape) in self.specs.items():
      node = out
      *parents, leaf = path.split("/")
      for p in parents:
        node = node.setdefault(p, {})
      node[leaf] = _value(rng, kind, shape)
    return out


def get(P, path: str):
  for p in path.split("/"):
    P = P[p]
  return P


# ============================================================================
# Norms.


def _norm_fn(rng: np.random.Generator) -> tuple:
  k = int(rng.integers(5))
  if k == 0:
    return "two-pass", lambda h, g, b: _ln_two_pass(h, g, b)
  if k == 1:
    return "flax-fast", lambda h, g, b: nn.LayerNorm(epsilon=EPS, param_dtype=F64).apply(
        {"params": {"scale": g, "bias": b}}, h)
  if k == 2:
    return "flax-two-pass", lambda h, g, b: nn.LayerNorm(epsilon=EPS, use_fast_variance=False, param_dtype=F64).apply(
        {"params": {"scale": g, "bias": b}}, h)
  sp = S.sample(40, 0)[int(rng.integers(40))]
  return f"spelling {sp.name}", lambda h, g, b: S.layer_norm(sp, h, g, b, EPS)


def _ln_two_pass(h, g, b):
  c = h - h.mean(-1, keepdims=True)
  return c * lax.rsqrt((c * c).mean(-1, keepdims=True) + EPS) * g + b


def _gn_spatial(h, g, b, groups=2):
  """Standard GroupNorm over (H, W, C/G) of NHWC."""
  B, Hh, W, C = h.shape
  x = h.reshape(B, Hh, W, groups, C // groups)
  m = x.mean((1, 2, 4), keepdims=True)
  v = ((x - m) ** 2).mean((1, 2, 4), keepdims=True)
  return ((x - m) * lax.rsqrt(v + EPS)).reshape(h.shape) * g + b


def _gn_flax(h, g, b, groups=2):
  return nn.GroupNorm(num_groups=groups, epsilon=EPS, param_dtype=F64).apply(
      {"params": {"scale": g, "bias": b}}, h)


# ============================================================================
# Mutations: (name, build) where build(rng, ctx) -> fn(h, P, m) keeping h's shape
# (..., D). ``ctx``: feature width, the kinds of parameters the architecture has,
# and where the point is (may it emit, does axis 1 exist).


@dataclasses.dataclass
class Point:
  name: str
  kind: str             # "w" | "s" | "n"
  shape: tuple          # at the example
  emit: bool            # may add a side output (not inside a loop body or branch)
  seq: bool             # axis 1 is a sequence/spatial axis


@dataclasses.dataclass
class Ctx:
  rng: np.random.Generator
  point: Point
  params: Params
  pname: str            # parameter prefix for this mutation
  flags: set = dataclasses.field(default_factory=set)   # shared by a program's mutations

  @property
  def d(self) -> int:
    return self.point.shape[-1]

  def param(self, kind, shape) -> str:
    return self.params(f"{self.pname}/{kind}{len([k for k in self.params.specs if k.startswith(self.pname)])}",
                       kind, shape)

  def vec(self, kind="x") -> np.ndarray:
    return _value(self.rng, kind, (self.d,))

  def shared_leaf(self, shape_pred) -> Optional[str]:
    """A parameter of the architecture (not a mutation's) whose shape fits."""
    cands = [p for p, (_, s) in self.params.specs.items()
             if not p.startswith("mut/") and shape_pred(s)]
    return cands[int(self.rng.integers(len(cands)))] if cands else None


MUTATIONS: dict = {}


def mutation(name: str, *, needs_emit: bool = False, needs_seq: bool = False, weight: float = 1.0):
  def deco(fn):
    MUTATIONS[name] = (fn, needs_emit, needs_seq, weight)
    return fn
  return deco


@mutation("scale_fixed")
def _scale_fixed(c: Ctx):
  s = c.vec("g")
  return lambda h, P, m: h * jnp.asarray(s, h.dtype)


@mutation("scale_param")
def _scale_param(c: Ctx):
  p = c.param("g", (c.d,))
  return lambda h, P, m: h * get(P, p)


@mutation("scale_scalar_param")
def _scale_scalar(c: Ctx):
  p = c.param("g", ())
  return lambda h, P, m: get(P, p) * h


@mutation("bias_fixed")
def _bias_fixed(c: Ctx):
  s = c.vec("b")
  return lambda h, P, m: h + jnp.asarray(s, h.dtype)


@mutation("bias_param")
def _bias_param(c: Ctx):
  p = c.param("b", (c.d,))
  return lambda h, P, m: h + get(P, p)


@mutation("affine_param")
def _affine_param(c: Ctx):
  g, b = c.param("g", (c.d,)), c.param("b", (c.d,))
  return lambda h, P, m: h * get(P, g) + get(P, b)


@mutation("permute")
def _permute(c: Ctx):
  perm = c.rng.permutation(c.d)
  return lambda h, P, m: h[..., perm]


@mutation("gather_repeats")
def _gather_rep(c: Ctx):
  idx = c.rng.integers(0, c.d, c.d)
  return lambda h, P, m: jnp.take(h, jnp.asarray(idx), axis=-1)


@mutation("roll")
def _roll(c: Ctx):
  k = int(c.rng.integers(1, c.d))
  return lambda h, P, m: jnp.roll(h, k, axis=-1)


@mutation("slice_pad")
def _slice_pad(c: Ctx):
  k = int(c.rng.integers(1, c.d))
  val = float(c.rng.choice([0.0, 0.5]))
  return lambda h, P, m: jnp.pad(h[..., :k], [(0, 0)] * (h.ndim - 1) + [(0, c.d - k)], constant_values=val)


@mutation("pad_slice")
def _pad_slice(c: Ctx):
  return lambda h, P, m: jnp.pad(h, [(0, 0)] * (h.ndim - 1) + [(1, 2)])[..., 1:-2]


@mutation("reshape_transpose")
def _reshape_t(c: Ctx):
  a = 2 if c.d % 2 == 0 else 1
  return lambda h, P, m: jnp.swapaxes(h.reshape(h.shape[:-1] + (a, c.d // a)), -1, -2).reshape(h.shape)


@mutation("split_merge")
def _split_merge(c: Ctx):
  k = int(c.rng.integers(3))
  s = c.vec("g")[: c.d // 2]

  def f(h, P, m):
    a, b = jnp.split(h, 2, axis=-1)
    if k == 0:
      return jnp.concatenate([b, a], -1)
    if k == 1:
      return jnp.concatenate([a, b * jnp.asarray(s, h.dtype)], -1)
    return jnp.stack([a, b], -2).reshape(h.shape)
  return f


@mutation("concat_other")
def _concat_other(c: Ctx):
  k = int(c.rng.integers(1, c.d))

  def f(h, P, m):
    o = m.other if m.other is not None and m.other.shape == h.shape else 2.0 * h + 1.0
    return jnp.concatenate([h[..., :k], o[..., k:]], -1)
  return f


@mutation("cast_bf16")
def _cast_bf16(c: Ctx):
  return lambda h, P, m: h.astype(jnp.bfloat16).astype(h.dtype)


@mutation("cast_f32")
def _cast_f32(c: Ctx):
  return lambda h, P, m: h.astype(jnp.float32).astype(h.dtype)


@mutation("stop_gradient")
def _stopgrad(c: Ctx):
  k = int(c.rng.integers(2))
  return lambda h, P, m: lax.stop_gradient(h) if k == 0 else h + lax.stop_gradient(0.5 * h)


@mutation("custom_jvp")
def _cjvp(c: Ctx):
  s = c.vec("g")

  @jax.custom_jvp
  def f(h):
    return h * jnp.asarray(s, h.dtype)

  @f.defjvp
  def _f(primals, tangents):
    return f(primals[0]), tangents[0] * jnp.asarray(s, primals[0].dtype)
  return lambda h, P, m: f(h)


@mutation("custom_vjp")
def _cvjp(c: Ctx):
  p = c.param("b", (c.d,))

  @jax.custom_vjp
  def f(h, b):
    return h + b

  def fwd(h, b):
    return h + b, None

  def bwd(_, g):
    return g, jnp.sum(g.reshape(-1, g.shape[-1]), 0)
  f.defvjp(fwd, bwd)
  return lambda h, P, m: f(h, get(P, p))


@mutation("checkpoint")
def _ckpt(c: Ctx):
  g, b = c.param("g", (c.d,)), c.param("b", (c.d,))
  return lambda h, P, m: jax.checkpoint(lambda t, gg, bb: t * gg + bb)(h, get(P, g), get(P, b))


@mutation("where_feature")
def _where_feat(c: Ctx):
  mask = c.rng.random(c.d) < 0.6
  alt = float(c.rng.choice([0.0, 1.5]))
  return lambda h, P, m: jnp.where(jnp.asarray(mask), h, alt * h)


@mutation("where_batch")
def _where_batch(c: Ctx):
  return lambda h, P, m: jnp.where((jnp.arange(h.shape[0]) % 2 == 0).reshape((-1,) + (1,) * (h.ndim - 1)),
                                   h, 0.5 * h + 0.25)


@mutation("where_data")
def _where_data(c: Ctx):
  return lambda h, P, m: jnp.where(h > 0.1, h, 0.2 * h)


@mutation("cumsum_seq", needs_seq=True)
def _cumsum_seq(c: Ctx):
  return lambda h, P, m: jnp.cumsum(h, axis=1)


@mutation("cumsum_feature")
def _cumsum_feat(c: Ctx):
  return lambda h, P, m: jnp.cumsum(h, axis=-1)


@mutation("mean_sub_seq", needs_seq=True)
def _msub_seq(c: Ctx):
  return lambda h, P, m: h - h.mean(1, keepdims=True)


@mutation("mean_sub_batch")
def _msub_batch(c: Ctx):
  return lambda h, P, m: h - h.mean(0, keepdims=True)


@mutation("mean_sub_feature")
def _msub_feat(c: Ctx):
  return lambda h, P, m: h - h.mean(-1, keepdims=True)


@mutation("half_mean_sub_feature")
def _hmsub_feat(c: Ctx):
  return lambda h, P, m: h - 0.5 * h.mean(-1, keepdims=True)


@mutation("emit_skip", needs_emit=True, weight=2.0)
def _emit_skip(c: Ctx):
  def f(h, P, m):
    m.emit(h)
    return h
  return f


@mutation("emit_loss", needs_emit=True)
def _emit_loss(c: Ctx):
  k = int(c.rng.integers(3))

  def f(h, P, m):
    m.emit(jnp.sum(h * h) if k == 0 else jnp.mean(h) if k == 1 else jnp.sum(h[..., 0]))
    return h
  return f


@mutation("emit_rowmean", needs_emit=True)
def _emit_rowmean(c: Ctx):
  def f(h, P, m):
    m.emit(h.mean(-1))
    return h
  return f


@mutation("at_set")
def _at_set(c: Ctx):
  i = int(c.rng.integers(c.d))
  k = int(c.rng.integers(3))
  p = c.param("x", ())

  def f(h, P, m):
    if k == 0:
      return h.at[..., i].set(0.0)
    if k == 1:
      return h.at[..., i].add(get(P, p))
    return h.at[..., i].multiply(2.0)
  return f


@mutation("at_add_vector")
def _at_add(c: Ctx):
  idx = np.sort(c.rng.choice(c.d, 3, replace=False))
  p = c.param("b", (3,))
  return lambda h, P, m: h.at[..., jnp.asarray(idx)].add(get(P, p))


@mutation("cond_traced")
def _cond(c: Ctx):
  k = int(c.rng.integers(3))
  s = c.vec("b")

  def f(h, P, m):
    pred = (jnp.mean(h) > 0.0) if k == 0 else (jnp.max(h) > 1.0) if k == 1 else (jnp.var(h, -1).mean() > 0.5)
    return lax.cond(pred, lambda t: t * 2.0, lambda t: t + jnp.asarray(s, t.dtype), h)
  return f


@mutation("cond_same")
def _cond_same(c: Ctx):
  p = c.param("b", (c.d,))

  def f(h, P, m):
    pred = jnp.sum(jnp.abs(h)) > 3.0
    return lax.cond(pred, lambda t, b: t + b, lambda t, b: t + 2.0 * b, h, get(P, p))
  return f


@mutation("switch_traced")
def _switch(c: Ctx):
  s = c.vec("g")

  def f(h, P, m):
    i = jnp.clip(jnp.floor(jnp.abs(h[0, ..., 0].sum())), 0, 2).astype(jnp.int32)
    return lax.switch(i, [lambda t: t, lambda t: t * jnp.asarray(s, t.dtype), lambda t: -t], h)
  return f


@mutation("shape_branch")
def _shape_branch(c: Ctx):
  axis = int(c.rng.integers(2))
  s = c.vec("b")

  def f(h, P, m):
    n = h.shape[axis] if h.ndim > axis + 1 else 1
    return h * 1.5 if n > 2 else h + jnp.asarray(s, h.dtype)
  return f


@mutation("shape_branch_mean")
def _shape_branch_mean(c: Ctx):
  def f(h, P, m):
    return h - h.mean(-1, keepdims=True) if h.shape[0] == 1 else h
  return f


@mutation("share_vector", weight=2.0)
def _share_vec(c: Ctx):
  leaf = c.shared_leaf(lambda s: s == (c.d,))
  if leaf is None:
    return None
  k = int(c.rng.integers(2))
  return lambda h, P, m: h * get(P, leaf) if k == 0 else h + get(P, leaf)


@mutation("share_matrix", weight=2.0)
def _share_mat(c: Ctx):
  leaf = c.shared_leaf(lambda s: s == (c.d, c.d))
  if leaf is None:
    return None
  k = int(c.rng.integers(2))
  return lambda h, P, m: h + 0.5 * (h @ get(P, leaf) if k == 0 else h @ get(P, leaf).T)


@mutation("insert_dense")
def _insert_dense(c: Ctx):
  w, b = c.param("w", (c.d, c.d)), c.param("b", (c.d,))
  return lambda h, P, m: h @ get(P, w) + get(P, b)


@mutation("insert_norm")
def _insert_norm(c: Ctx):
  g, b = c.param("g", (c.d,)), c.param("b", (c.d,))
  return lambda h, P, m: _ln_two_pass(h, get(P, g), get(P, b))


@mutation("tanh")
def _tanh(c: Ctx):
  return lambda h, P, m: jnp.tanh(h)


@mutation("double_use")
def _double_use(c: Ctx):
  return lambda h, P, m: h + 0.5 * jnp.flip(h, -1)


@mutation("stat_scale")
def _stat_scale(c: Ctx):
  return lambda h, P, m: h * lax.rsqrt((h * h).mean(-1, keepdims=True) + 1.0)


@mutation("gate_from_stream")
def _gate(c: Ctx):
  w = c.param("w", (c.d, 1))
  return lambda h, P, m: h * jax.nn.sigmoid(h @ get(P, w))


@mutation("fori_loop")
def _fori(c: Ctx):
  b = c.param("b", (c.d,))
  n = int(c.rng.integers(0, 3))
  return lambda h, P, m: lax.fori_loop(0, n, lambda i, t: 0.5 * t + get(P, b), h)


@mutation("while_traced")
def _while(c: Ctx):
  s = c.vec("g")
  c.flags.add("no reverse mode")

  def f(h, P, m):
    def body(st):
      i, t = st
      return i + 1, t * jnp.asarray(s, t.dtype)
    return lax.while_loop(lambda st: st[0] < 2, body, (jnp.asarray(0), h))[1]
  return f


@mutation("vmap_batch")
def _vmap(c: Ctx):
  g, b = c.param("g", (c.d,)), c.param("b", (c.d,))
  return lambda h, P, m: jax.vmap(lambda t, gg, bb: t * gg + bb, (0, None, None))(h, get(P, g), get(P, b))


@mutation("dynamic_update_feature")
def _dus(c: Ctx):
  def f(h, P, m):
    i = jnp.argmax(h[(0,) * (h.ndim - 1)]).astype(jnp.int32)
    upd = jnp.zeros(h.shape[:-1] + (1,), h.dtype) + 0.25
    return lax.dynamic_update_slice_in_dim(h, upd, i, h.ndim - 1)
  return f


@mutation("emit_argmax", needs_emit=True)
def _emit_argmax(c: Ctx):
  def f(h, P, m):
    m.emit(jnp.argmax(h, -1))
    return h
  return f


@mutation("softmax_feature")
def _softmax_feat(c: Ctx):
  k = int(c.rng.integers(3))
  return lambda h, P, m: (jax.nn.softmax(h, -1) * c.d if k == 0 else jax.nn.log_softmax(h, -1) if k == 1
                          else h - lax.stop_gradient(h.max(-1, keepdims=True)))


@mutation("round_quantize")
def _round(c: Ctx):
  return lambda h, P, m: jnp.round(h * 8.0) / 8.0


@mutation("sort_feature")
def _sort(c: Ctx):
  return lambda h, P, m: jnp.sort(h, -1)


@mutation("inner_jit")
def _inner_jit(c: Ctx):
  g = c.param("g", (c.d,))
  return lambda h, P, m: jax.jit(lambda t, gg: t * gg - 0.5 * t)(h, get(P, g))


@mutation("named_scope")
def _named(c: Ctx):
  b = c.param("b", (c.d,))

  def f(h, P, m):
    with jax.named_scope("mutated"):
      return jax.named_call(lambda t, bb: t + bb, name="mut_block")(h, get(P, b))
  return f


@mutation("chain2", weight=2.0)
def _chain2(c: Ctx):
  names = [n for n, (_, e, q, _w) in MUTATIONS.items()
           if n != "chain2" and (not e or c.point.emit) and (not q or c.point.seq)]
  fs = []
  for _ in range(2):
    fn = MUTATIONS[names[int(c.rng.integers(len(names)))]][0](c)
    if fn is not None:
      fs.append(fn)

  def f(h, P, m):
    for fn in fs:
      h = fn(h, P, m)
    return h
  return f


# ============================================================================
# Parameter mutations: applied to one of the architecture's leaves where the
# program reads it (build(rng, shape, params) -> fn(w, P) keeping the shape).

PARAM_MUTATIONS: dict = {}


def pmutation(name: str, *, min_ndim: int = 1, square: bool = False):
  def deco(fn):
    PARAM_MUTATIONS[name] = (fn, min_ndim, square)
    return fn
  return deco


@pmutation("col_set")
def _p_col_set(rng, shape, prm, path):
  i, k = int(rng.integers(shape[-1])), int(rng.integers(3))
  return lambda w, P: w.at[..., i].set(0.0) if k == 0 else w.at[..., i].add(0.7) if k == 1 else w.at[..., i].mul(-2.0)


@pmutation("row_set", min_ndim=2)
def _p_row_set(rng, shape, prm, path):
  i = int(rng.integers(shape[-2]))
  return lambda w, P: w.at[..., i, :].set(0.3)


@pmutation("perm_last")
def _p_perm(rng, shape, prm, path):
  perm = rng.permutation(shape[-1])
  return lambda w, P: w[..., perm]


@pmutation("gather_last")
def _p_gather(rng, shape, prm, path):
  idx = rng.integers(0, shape[-1], shape[-1])
  return lambda w, P: jnp.take(w, jnp.asarray(idx), axis=-1)


@pmutation("flip_first", min_ndim=2)
def _p_flip(rng, shape, prm, path):
  return lambda w, P: jnp.flip(w, -2)


@pmutation("mask_last")
def _p_mask(rng, shape, prm, path):
  mask = (rng.random(shape[-1]) < 0.7).astype(np.float64)
  return lambda w, P: w * jnp.asarray(mask)


@pmutation("symmetrize", min_ndim=2, square=True)
def _p_sym(rng, shape, prm, path):
  return lambda w, P: 0.5 * (w + jnp.swapaxes(w, -1, -2))


@pmutation("transpose_square", min_ndim=2, square=True)
def _p_tsq(rng, shape, prm, path):
  return lambda w, P: jnp.swapaxes(w, -1, -2)


@pmutation("scale")
def _p_scale(rng, shape, prm, path):
  return lambda w, P: 2.5 * w


@pmutation("cast_f32")
def _p_cast(rng, shape, prm, path):
  return lambda w, P: w.astype(jnp.float32).astype(w.dtype)


@pmutation("stop_gradient")
def _p_sg(rng, shape, prm, path):
  return lambda w, P: lax.stop_gradient(w)


@pmutation("tie_other")
def _p_tie(rng, shape, prm, path):
  cands = [p for p, (_, s) in prm.specs.items() if s == tuple(shape) and p != path and not p.startswith("mut/")]
  if not cands:
    return None
  other = cands[int(rng.integers(len(cands)))]
  return lambda w, P: w + 0.5 * get(P, other)


@pmutation("reshape_heads", min_ndim=2)
def _p_reshape(rng, shape, prm, path):
  if shape[-1] % 2:
    return None
  return lambda w, P: jnp.swapaxes(w.reshape(w.shape[:-1] + (2, w.shape[-1] // 2)), -1, -2).reshape(w.shape)


@pmutation("relu")
def _p_relu(rng, shape, prm, path):
  return lambda w, P: jnp.maximum(w, 0.0)


@pmutation("precenter_last")
def _p_precenter(rng, shape, prm, path):
  return lambda w, P: w - w.mean(-1, keepdims=True)


@pmutation("precenter_first", min_ndim=2)
def _p_precenter0(rng, shape, prm, path):
  return lambda w, P: w - w.mean(-2, keepdims=True)


@pmutation("split_concat")
def _p_split(rng, shape, prm, path):
  k = int(rng.integers(1, shape[-1])) if shape[-1] > 1 else 1
  return lambda w, P: jnp.concatenate([w[..., :k], 1.0 * w[..., k:]], -1)


class ParamView:
  """``P`` as the architecture sees it: leaves in ``plan`` mutated where they are read."""

  def __init__(self, P, plan: dict, root, prefix: str = ""):
    self.P, self.plan, self.root, self.prefix = P, plan, root, prefix

  def __getitem__(self, k):
    path = self.prefix + k
    v = self.P[k]
    if isinstance(v, dict):
      if k == "layers":      # lax.scan needs the pytree itself
        flat = jax.tree_util.tree_flatten_with_path(v)[0]
        leaves = []
        for kp, leaf in flat:
          lp = path + "/" + "/".join(str(getattr(e, "key", e)) for e in kp)
          leaves.append(self.plan[lp](leaf, self.root) if lp in self.plan else leaf)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(v), leaves)
      return ParamView(v, self.plan, self.root, path + "/")
    fn = self.plan.get(path)
    return v if fn is None else fn(v, self.root)

  def __contains__(self, k):
    return k in self.P

  def materialize(self) -> dict:
    return {k: (self[k].materialize() if isinstance(self[k], ParamView) else self[k]) for k in self.P}


# ============================================================================
# The mutator an architecture calls.


class Recorder:
  """First pass: lists the points (at the example's shapes)."""

  def __init__(self):
    self.points: dict = {}
    self.other = None
    self.P = None

  def __call__(self, name, h, kind, other=None, emit=True):
    if name not in self.points:
      self.points[name] = Point(name, kind, tuple(h.shape), emit, h.ndim >= 3)
    return h

  def emit(self, v):
    pass


class Mutator:
  def __init__(self, plan: dict):
    self.plan = plan
    self.aux: list = []
    self.other = None

  def bind(self, P):
    self.P = P
    return self

  def __call__(self, name, h, kind, other=None, emit=True):
    fn = self.plan.get(name)
    if fn is None:
      return h
    self.other = other
    return fn(h, self.P, self)

  def emit(self, v):
    self.aux.append(v)


class NoMut:
  other = None

  def __call__(self, name, h, kind, other=None, emit=True):
    return h


# ============================================================================
# Architecture pieces.


def dense(P, pre, h):
  return h @ get(P, pre + "/w") + get(P, pre + "/b")


def decl_dense(prm: Params, pre: str, din: int, dout: int):
  prm(pre + "/w", "w", (din, dout))
  prm(pre + "/b", "b", (dout,))


def decl_norm(prm: Params, pre: str, d: int = D):
  prm(pre + "/g", "g", (d,))
  prm(pre + "/b", "b", (d,))


class Arch:
  """Shared structure: ``prm`` parameters, ``norm`` the LN spelling, options."""

  def __init__(self, rng: np.random.Generator):
    self.rng = rng
    self.prm = Params()
    self.norm_name, self.norm_fn = _norm_fn(rng)
    self.opts: dict = {}

  def opt(self, name, p=0.5):
    self.opts[name] = bool(self.rng.random() < p)
    return self.opts[name]

  def choice(self, name, xs):
    self.opts[name] = xs[int(self.rng.integers(len(xs)))]
    return self.opts[name]

  def ln(self, P, pre, h):
    return self.norm_fn(h, get(P, pre + "/g"), get(P, pre + "/b"))

  # -- attention ------------------------------------------------------------
  def decl_attn(self, pre, tie=False):
    decl_dense(self.prm, pre + "/q", D, D)
    decl_dense(self.prm, pre + "/k", D, D)
    decl_dense(self.prm, pre + "/v", D, D)
    if not tie:
      decl_dense(self.prm, pre + "/o", D, D)
    else:
      self.prm(pre + "/o/b", "b", (D,))

  def attn(self, P, pre, hq, hkv=None, causal=True, kv_cache=None, tie=False):
    hkv = hq if hkv is None else hkv
    B, T, _ = hq.shape
    q, k, v = dense(P, pre + "/q", hq), dense(P, pre + "/k", hkv), dense(P, pre + "/v", hkv)
    if kv_cache is not None:
      k = jnp.concatenate([kv_cache[0], k], 1)
      v = jnp.concatenate([kv_cache[1], v], 1)
    S_ = k.shape[1]
    split = lambda t: t.reshape(t.shape[0], t.shape[1], H, D // H)  # noqa: E731
    s = jnp.einsum("bthd,bshd->bhts", split(q), split(k)) / math.sqrt(D // H)
    if causal:
      mask = jnp.tril(jnp.ones((T, S_), bool), S_ - T)
      s = jnp.where(mask, s, -1e9)
    a = jax.nn.softmax(s, -1)
    o = jnp.einsum("bhts,bshd->bthd", a, split(v)).reshape(B, T, D)
    wo = get(P, pre + "/q/w").T if tie else get(P, pre + "/o/w")
    return o @ wo + get(P, pre + "/o/b"), (k, v)

  # -- MLP ------------------------------------------------------------------
  def decl_mlp(self, pre, tie=False):
    decl_dense(self.prm, pre + "/fc", D, FF)
    if tie:
      self.prm(pre + "/proj/b", "b", (D,))
    else:
      decl_dense(self.prm, pre + "/proj", FF, D)

  def mlp(self, P, pre, h, tie=False):
    u = jax.nn.gelu(dense(P, pre + "/fc", h))
    w2 = get(P, pre + "/fc/w").T if tie else get(P, pre + "/proj/w")
    return u @ w2 + get(P, pre + "/proj/b")


# Each architecture: build(A) -> (apply(P, *args, m), args(batch, length, rng) -> tuple).


def _ids(rng, b, t):
  return jnp.asarray(rng.integers(0, V, (b, t)), jnp.int32)


def _x(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), F64)


def arch_gpt(A: Arch):
  L = int(A.rng.integers(1, 3))
  tie_head, tie_mlp, tie_o = A.opt("tie_head", 0.6), A.opt("tie_mlp", 0.25), A.opt("tie_o", 0.15)
  A.prm("wte", "emb", (V, D))
  A.prm("wpe", "emb", (MAXT, D))
  for i in range(L):
    decl_norm(A.prm, f"h{i}/ln1")
    A.decl_attn(f"h{i}/attn", tie_o)
    decl_norm(A.prm, f"h{i}/ln2")
    A.decl_mlp(f"h{i}/mlp", tie_mlp)
  decl_norm(A.prm, "lnf")
  if not tie_head:
    A.prm("head", "w", (D, V))

  wrap = A.choice("wrap", ("none", "none", "checkpoint", "jit", "custom_vjp", "custom_jvp"))

  def block(P, h, i, m, emit):
    n1 = m(f"h{i}.n1", A.ln(P, f"h{i}/ln1", m(f"h{i}.s1", h, "s", emit=emit)), "n", emit=emit)
    a = A.attn(P, f"h{i}/attn", n1, tie=tie_o)[0]
    h = h + m(f"h{i}.wa", a, "w", other=h, emit=emit)
    n2 = m(f"h{i}.n2", A.ln(P, f"h{i}/ln2", m(f"h{i}.s2", h, "s", emit=emit)), "n", emit=emit)
    f = A.mlp(P, f"h{i}/mlp", n2, tie_mlp)
    return h + m(f"h{i}.wm", f, "w", other=h, emit=emit)

  def apply(P, ids, m):
    T = ids.shape[1]
    h = m("emb", P["wte"][ids], "w") + P["wpe"][:T]
    for i in range(L):
      h = run_block(wrap, block, P, h, i, m)
    y = m("nf", A.ln(P, "lnf", m("sf", h, "s")), "n")
    return y @ (P["wte"].T if tie_head else P["head"])
  return apply, lambda b, t, rng: (_ids(rng, b, t),)


def run_block(wrap: str, block: Callable, P, h, i: int, m):
  """``block(P, h, i, m, emit)`` called as real code calls a residual block: plainly, or
  under ``jax.checkpoint`` / ``jax.jit`` / a ``custom_vjp`` or ``custom_jvp`` whose rule
  is the true derivative. A wrapped block takes the whole parameter dict (the mutated
  leaves materialised), and its points may not emit."""
  if wrap == "none":
    return block(P, h, i, m, True)
  Pd = P.materialize() if isinstance(P, ParamView) else P

  def fn(Pw, h):
    saved, m.P = m.P, Pw      # the mutations' own parameters are read from the argument too
    try:
      return block(Pw, h, i, m, False)
    finally:
      m.P = saved
  if wrap == "checkpoint":
    return jax.checkpoint(fn)(Pd, h)
  if wrap == "jit":
    return jax.jit(fn)(Pd, h)
  if wrap == "custom_vjp":
    f = jax.custom_vjp(fn)
    f.defvjp(lambda Pw, h: jax.vjp(fn, Pw, h), lambda vjp, g: vjp(g))
    return f(Pd, h)
  f = jax.custom_jvp(fn)
  f.defjvp(lambda primals, tangents: jax.jvp(fn, primals, tangents))
  return f(Pd, h)


def arch_post_ln(A: Arch):
  """BERT / OPT-350m style: LN after each residual add; embeddings LN first."""
  L = int(A.rng.integers(1, 3))
  emb_in = A.opt("ids")
  if emb_in:
    A.prm("wte", "emb", (V, D))
  else:
    decl_dense(A.prm, "inp", DIN, D)
  A.prm("wpe", "emb", (MAXT, D))
  decl_norm(A.prm, "ln_emb")
  for i in range(L):
    A.decl_attn(f"l{i}/attn")
    decl_norm(A.prm, f"l{i}/ln1")
    A.decl_mlp(f"l{i}/mlp")
    decl_norm(A.prm, f"l{i}/ln2")
  pool = A.opt("pool")
  if pool:
    decl_dense(A.prm, "pool", D, D)

  def apply(P, x, m):
    T = x.shape[1]
    e = P["wte"][x] if emb_in else dense(P, "inp", x)
    h = m("ne", A.ln(P, "ln_emb", m("se", m("emb", e, "w") + P["wpe"][:T], "s")), "n")
    for i in range(L):
      a = A.attn(P, f"l{i}/attn", h, causal=False)[0]
      h = m(f"l{i}.n1", A.ln(P, f"l{i}/ln1", m(f"l{i}.s1", h + m(f"l{i}.wa", a, "w", other=h), "s")), "n")
      f = A.mlp(P, f"l{i}/mlp", h)
      h = m(f"l{i}.n2", A.ln(P, f"l{i}/ln2", m(f"l{i}.s2", h + m(f"l{i}.wm", f, "w", other=h), "s")), "n")
    if pool:
      return h, jnp.tanh(dense(P, "pool", h[:, 0]))
    return h
  return apply, (lambda b, t, rng: (_ids(rng, b, t),)) if emb_in else (lambda b, t, rng: (_x(rng, b, t, DIN),))


def arch_parallel(A: Arch):
  """GPT-J / Phi: one LN read by attention and MLP, both added to the stream;
  NeoX style (two LNs) with probability 1/2."""
  L = int(A.rng.integers(1, 3))
  two = A.opt("two_ln")
  decl_dense(A.prm, "inp", DIN, D)
  for i in range(L):
    decl_norm(A.prm, f"b{i}/ln")
    if two:
      decl_norm(A.prm, f"b{i}/ln2")
    A.decl_attn(f"b{i}/attn")
    A.decl_mlp(f"b{i}/mlp")
  decl_norm(A.prm, "lnf")
  decl_dense(A.prm, "head", D, 3)

  def apply(P, x, m):
    h = m("inp", dense(P, "inp", x), "w")
    for i in range(L):
      n = m(f"b{i}.n", A.ln(P, f"b{i}/ln", m(f"b{i}.s", h, "s")), "n")
      n2 = m(f"b{i}.n2", A.ln(P, f"b{i}/ln2", h), "n") if two else n
      a = A.attn(P, f"b{i}/attn", n)[0]
      f = A.mlp(P, f"b{i}/mlp", n2)
      h = h + m(f"b{i}.wa", a, "w", other=h) + m(f"b{i}.wm", f, "w", other=h)
    return dense(P, "head", m("nf", A.ln(P, "lnf", m("sf", h, "s")), "n"))
  return apply, lambda b, t, rng: (_x(rng, b, t, DIN),)


def arch_vit(A: Arch):
  L = int(A.rng.integers(1, 3))
  decl_dense(A.prm, "patch", DIN, D)
  A.prm("cls", "emb", (1, 1, D))
  A.prm("pos", "emb", (MAXT + 1, D))
  for i in range(L):
    decl_norm(A.prm, f"e{i}/ln1")
    A.decl_attn(f"e{i}/attn")
    decl_norm(A.prm, f"e{i}/ln2")
    A.decl_mlp(f"e{i}/mlp")
  decl_norm(A.prm, "lnf")
  decl_dense(A.prm, "head", D, 4)
  mean_pool = A.opt("mean_pool")

  def apply(P, x, m):
    B, T, _ = x.shape
    p = m("patch", dense(P, "patch", x), "w")
    h = jnp.concatenate([jnp.broadcast_to(P["cls"], (B, 1, D)), p], 1) + P["pos"][: T + 1]
    for i in range(L):
      a = A.attn(P, f"e{i}/attn", m(f"e{i}.n1", A.ln(P, f"e{i}/ln1", m(f"e{i}.s1", h, "s")), "n"), causal=False)[0]
      h = h + m(f"e{i}.wa", a, "w", other=h)
      f = A.mlp(P, f"e{i}/mlp", m(f"e{i}.n2", A.ln(P, f"e{i}/ln2", m(f"e{i}.s2", h, "s")), "n"))
      h = h + m(f"e{i}.wm", f, "w", other=h)
    y = m("nf", A.ln(P, "lnf", m("sf", h, "s")), "n")
    return dense(P, "head", y.mean(1) if mean_pool else y[:, 0])
  return apply, lambda b, t, rng: (_x(rng, b, t, DIN),)


def arch_gn_conv(A: Arch):
  """A ResNet/UNet block: conv -> GroupNorm -> SiLU -> conv -> GroupNorm, skip by a 1x1 conv.
  GroupNorm per position (over channel groups only) or spatial (standard, over H, W, C/G)."""
  spatial = A.opt("spatial")
  flax_gn = spatial and A.opt("flax_gn")
  A.prm("c1/w", "w", (3, 3, DIN, D))
  A.prm("c1/b", "b", (D,))
  decl_norm(A.prm, "gn1")
  A.prm("c2/w", "w", (3, 3, D, D))
  A.prm("c2/b", "b", (D,))
  decl_norm(A.prm, "gn2")
  A.prm("skip/w", "w", (1, 1, DIN, D))
  A.prm("skip/b", "b", (D,))
  decl_norm(A.prm, "gnf")
  decl_dense(A.prm, "head", D, 3)

  def conv(P, pre, x):
    y = lax.conv_general_dilated(x, get(P, pre + "/w"), (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + get(P, pre + "/b")

  def gn(P, pre, h):
    g, b = get(P, pre + "/g"), get(P, pre + "/b")
    if flax_gn:
      return _gn_flax(h, g, b)
    if spatial:
      return _gn_spatial(h, g, b)
    return S.group_norm(S.Spelling("mean", "two_pass", "rsqrt", "centered"), h, g, b, 2, EPS)

  def apply(P, x, m):
    h = m("c1", conv(P, "c1", x), "w")
    h = m("n1", gn(P, "gn1", m("s1", h, "s")), "n")
    h = m("c2", conv(P, "c2", jax.nn.silu(h)), "w")
    h = m("n2", gn(P, "gn2", m("s2", h, "s")), "n")
    h = h + m("skip", conv(P, "skip", x), "w", other=h)
    y = m("nf", gn(P, "gnf", m("sf", h, "s")), "n")
    return dense(P, "head", y.mean((1, 2)))
  return apply, lambda b, t, rng: (_x(rng, b, t, t + 1, DIN),)


def arch_moe(A: Arch):
  """Pre-LN block whose MLP is top-k routed over E experts (dense compute, gathered)."""
  k = int(A.rng.integers(1, 3))
  decl_dense(A.prm, "inp", DIN, D)
  decl_norm(A.prm, "ln1")
  A.decl_attn("attn")
  decl_norm(A.prm, "ln2")
  A.prm("router", "w", (D, E))
  A.prm("ex/w1", "w", (E, D, FF))
  A.prm("ex/b1", "b", (E, FF))
  A.prm("ex/w2", "w", (E, FF, D))
  A.prm("ex/b2", "b", (E, D))
  decl_norm(A.prm, "lnf")

  def apply(P, x, m):
    h = m("inp", dense(P, "inp", x), "w")
    a = A.attn(P, "attn", m("n1", A.ln(P, "ln1", m("s1", h, "s")), "n"))[0]
    h = h + m("wa", a, "w", other=h)
    n = m("n2", A.ln(P, "ln2", m("s2", h, "s")), "n")
    logits = n @ P["router"]
    vals, idx = lax.top_k(logits, k)
    gates = jax.nn.softmax(vals, -1)
    u = jax.nn.relu(jnp.einsum("btd,edf->btef", n, P["ex"]["w1"]) + P["ex"]["b1"])
    ys = jnp.einsum("btef,efd->bted", u, P["ex"]["w2"]) + P["ex"]["b2"]
    sel = jnp.take_along_axis(ys, idx[..., None], axis=2)
    f = (gates[..., None] * sel).sum(2)
    h = h + m("wm", f, "w", other=h)
    return m("nf", A.ln(P, "lnf", m("sf", h, "s")), "n"), logits
  return apply, lambda b, t, rng: (_x(rng, b, t, DIN),)


def arch_cross(A: Arch):
  """Encoder (one pre-LN block + final LN) and a decoder block with cross-attention."""
  decl_dense(A.prm, "enc_in", DIN, D)
  decl_norm(A.prm, "enc/ln1")
  A.decl_attn("enc/attn")
  decl_norm(A.prm, "enc/ln2")
  A.decl_mlp("enc/mlp")
  decl_norm(A.prm, "enc/lnf")
  A.prm("wte", "emb", (V, D))
  decl_norm(A.prm, "dec/ln1")
  A.decl_attn("dec/self")
  decl_norm(A.prm, "dec/ln2")
  A.decl_attn("dec/cross")
  decl_norm(A.prm, "dec/ln3")
  A.decl_mlp("dec/mlp")
  decl_norm(A.prm, "dec/lnf")

  def apply(P, x, ids, m):
    e = m("enc_in", dense(P, "enc_in", x), "w")
    e = e + m("ewa", A.attn(P, "enc/attn", m("en1", A.ln(P, "enc/ln1", m("es1", e, "s")), "n"), causal=False)[0], "w")
    e = e + m("ewm", A.mlp(P, "enc/mlp", m("en2", A.ln(P, "enc/ln2", m("es2", e, "s")), "n")), "w")
    mem = m("enf", A.ln(P, "enc/lnf", m("esf", e, "s")), "n")
    h = m("emb", P["wte"][ids], "w")
    h = h + m("dws", A.attn(P, "dec/self", m("dn1", A.ln(P, "dec/ln1", m("ds1", h, "s")), "n"))[0], "w", other=h)
    h = h + m("dwc", A.attn(P, "dec/cross", m("dn2", A.ln(P, "dec/ln2", m("ds2", h, "s")), "n"), mem,
                            causal=False)[0], "w", other=h)
    h = h + m("dwm", A.mlp(P, "dec/mlp", m("dn3", A.ln(P, "dec/ln3", m("ds3", h, "s")), "n")), "w")
    y = m("dnf", A.ln(P, "dec/lnf", m("dsf", h, "s")), "n")
    return y @ P["wte"].T
  return apply, lambda b, t, rng: (_x(rng, b, t + 1, DIN), _ids(rng, b, t))


def arch_decode(A: Arch):
  """One KV-cache decode step of a pre-LN GPT: one new token per row, the cache
  (keys and values of ``length`` earlier tokens) is an input; returns logits and the new cache."""
  A.prm("wte", "emb", (V, D))
  A.prm("wpe", "emb", (MAXT + 1, D))
  decl_norm(A.prm, "ln1")
  A.decl_attn("attn")
  decl_norm(A.prm, "ln2")
  A.decl_mlp("mlp")
  decl_norm(A.prm, "lnf")

  def apply(P, ids, ck, cv, m):
    S_ = ck.shape[1]
    h = m("emb", P["wte"][ids], "w") + P["wpe"][S_: S_ + 1]
    a, (k, v) = A.attn(P, "attn", m("n1", A.ln(P, "ln1", m("s1", h, "s")), "n"), kv_cache=(ck, cv))
    h = h + m("wa", a, "w", other=h)
    h = h + m("wm", A.mlp(P, "mlp", m("n2", A.ln(P, "ln2", m("s2", h, "s")), "n")), "w", other=h)
    y = m("nf", A.ln(P, "lnf", m("sf", h, "s")), "n")
    return y @ P["wte"].T, k, v
  return apply, lambda b, t, rng: (_ids(rng, b, 1), _x(rng, b, t, D), _x(rng, b, t, D))


def arch_scan(A: Arch):
  """Pre-LN layers stacked and run by ``lax.scan`` (points inside the body cannot emit)."""
  L = int(A.rng.integers(1, 4))
  A.prm("wte", "emb", (V, D))
  A.prm("wpe", "emb", (MAXT, D))
  for name, kind, shape in [("ln1/g", "g", (D,)), ("ln1/b", "b", (D,)), ("q/w", "w", (D, D)), ("q/b", "b", (D,)),
                            ("k/w", "w", (D, D)), ("k/b", "b", (D,)), ("v/w", "w", (D, D)), ("v/b", "b", (D,)),
                            ("o/w", "w", (D, D)), ("o/b", "b", (D,)), ("ln2/g", "g", (D,)), ("ln2/b", "b", (D,)),
                            ("fc/w", "w", (D, FF)), ("fc/b", "b", (FF,)), ("proj/w", "w", (FF, D)),
                            ("proj/b", "b", (D,))]:
    A.prm("layers/" + name, kind, (L,) + shape)
  decl_norm(A.prm, "lnf")
  remat = A.opt("remat")

  def apply(P, ids, m):
    T = ids.shape[1]
    h = m("emb", P["wte"][ids], "w") + P["wpe"][:T]

    def body(h, lp):
      a = A.attn(lp, "attn", m("n1", A.ln(lp, "ln1", m("s1", h, "s", emit=False)), "n", emit=False))[0]
      h = h + m("wa", a, "w", other=h, emit=False)
      f = A.mlp(lp, "mlp", m("n2", A.ln(lp, "ln2", m("s2", h, "s", emit=False)), "n", emit=False))
      return h + m("wm", f, "w", other=h, emit=False), None

    def body_p(h, lp):
      lp = {"ln1": lp["ln1"], "ln2": lp["ln2"],
            "attn": {k: lp[k] for k in ("q", "k", "v", "o")},
            "mlp": {"fc": lp["fc"], "proj": lp["proj"]}}
      return body(h, lp)
    h, _ = lax.scan(jax.checkpoint(body_p) if remat else body_p, h, P["layers"])
    y = m("nf", A.ln(P, "lnf", m("sf", h, "s")), "n")
    return y @ P["wte"].T
  return apply, lambda b, t, rng: (_ids(rng, b, t),)


ARCHS = {"gpt": arch_gpt, "post_ln": arch_post_ln, "parallel": arch_parallel, "vit": arch_vit,
         "gn_conv": arch_gn_conv, "moe": arch_moe, "cross": arch_cross, "decode": arch_decode,
         "scan": arch_scan}
ARCH_NAMES = tuple(ARCHS)


# ============================================================================
# Programs.


@dataclasses.dataclass
class Program:
  seed: int
  arch: str
  norm: str
  opts: dict
  mutations: list       # [(point name, kind, mutation name)]
  apply: Callable       # (params, *args) -> outputs
  params: dict
  other_params: dict
  args: list            # argument tuples: the example first
  shapes: list          # (batch, length) of each argument tuple
  fold_kwargs: dict = dataclasses.field(default_factory=dict)
  differentiable: bool = True    # False with a lax.while_loop (no reverse mode)

  def describe(self) -> str:
    muts = ", ".join(f"{p}[{k}] <- {n}" for p, k, n in self.mutations) or "none"
    return (f"mutation_programs.make_program({self.seed}): arch {self.arch} {self.opts}, norm {self.norm}\n"
            f"  mutations: {muts}\n  shapes (batch, length): {self.shapes}\n  fold kwargs: {self.fold_kwargs}")


def fold_options(rng: np.random.Generator) -> dict:
  """Random options of ``jaxfold.fold`` (defaults most of the time)."""
  kw: dict = {}
  if rng.random() < 0.2:
    kw["auxiliary_centering"] = False
  if rng.random() < 0.3:
    kw["tied_weights"] = str(rng.choice(["copy", "auxiliary"]))
  if rng.random() < 0.2:
    kw["generic_shapes"] = False
  r = rng.random()
  if r < 0.15:
    kw["defer_norms"] = True
  elif r < 0.4:
    kw["fuse_affine"] = True
  return kw


def make_program(seed: int, n_mut: Optional[int] = None, arch: Optional[str] = None,
                 mutations: Optional[list] = None, param_mutations: Optional[list] = None,
                 example: Optional[int] = None, fold_kwargs: Optional[dict] = None) -> Program:
  """Program ``seed``: architecture ``ARCH_NAMES[seed % 9]`` unless ``arch`` is
  given; ``mutations`` ([(point, mutation name)]) replaces the random choice
  (for minimised reproductions)."""
  rng = np.random.default_rng([seed, 7])
  arch = arch or ARCH_NAMES[seed % len(ARCH_NAMES)]
  A = Arch(rng)
  body, make_args = ARCHS[arch](A)
  arg_rng = np.random.default_rng([seed, 11])
  shapes = [EXAMPLE] + list(OTHER)
  if example is None:
    example = int(rng.integers(len(shapes))) if rng.random() < 0.3 else 0
  shapes = [shapes[example]] + [s for i, s in enumerate(shapes) if i != example]
  args = [make_args(b, t, arg_rng) for b, t in shapes]
  base_params = A.prm.values(np.random.default_rng([seed, 1]))
  rec = Recorder()
  jax.eval_shape(lambda P, *a: body(P, *a, rec), base_params, *args[0])
  points = list(rec.points.values())
  chosen = []
  plan: dict = {}
  if mutations is None:
    n_mut = int(rng.integers(1, 4)) if n_mut is None else n_mut
    names = list(MUTATIONS)
    weights = np.asarray([MUTATIONS[n][3] for n in names], float)
    tries = 0
    while len(chosen) < n_mut and tries < 50:
      tries += 1
      pt = points[int(rng.integers(len(points)))]
      if pt.name in plan:
        continue
      mname = names[int(rng.choice(len(names), p=weights / weights.sum()))]
      chosen.append((pt, mname))
      plan[pt.name] = None
  else:
    by_name = {p.name: p for p in points}
    chosen = [(by_name[p], mname) for p, mname in mutations]
  plan = {}
  done = []
  flags: set = set()
  for k, (pt, mname) in enumerate(chosen):
    build, needs_emit, needs_seq, _ = MUTATIONS[mname]
    if (needs_emit and not pt.emit) or (needs_seq and not pt.seq):
      continue
    fn = build(Ctx(rng, pt, A.prm, f"mut/{k}", flags))
    if fn is None:
      continue
    plan[pt.name] = fn
    done.append((pt.name, pt.kind, mname))

  pplan: dict = {}
  if param_mutations is None:
    leaves = [p for p in A.prm.specs if not p.startswith("mut/")]
    param_mutations = []
    for _ in range(int(rng.choice([0, 0, 1, 1, 2]))):
      param_mutations.append((leaves[int(rng.integers(len(leaves)))],
                              list(PARAM_MUTATIONS)[int(rng.integers(len(PARAM_MUTATIONS)))]))
  for path, mname in param_mutations:
    build, min_ndim, square = PARAM_MUTATIONS[mname]
    shape = A.prm.specs[path][1]
    if path in pplan or len(shape) < min_ndim or (square and shape[-1] != shape[-2]):
      continue
    fn = build(rng, shape, A.prm, path)
    if fn is None:
      continue
    pplan[path] = fn
    done.append((path, "param", mname))

  def apply(P, *a):
    m = Mutator(plan).bind(P)
    out = body(ParamView(P, pplan, P) if pplan else P, *a, m)
    return (out, tuple(m.aux)) if m.aux else out

  params = jax.tree_util.tree_map(lambda v: jnp.asarray(v, F64), A.prm.values(np.random.default_rng([seed, 1])))
  other = jax.tree_util.tree_map(lambda v: jnp.asarray(v, F64), A.prm.values(np.random.default_rng([seed, 2])))
  kw = fold_options(np.random.default_rng([seed, 3])) if fold_kwargs is None else fold_kwargs
  return Program(seed, arch, A.norm_name, dict(A.opts), done, apply, params, other, args, shapes, kw,
                 "no reverse mode" not in flags)
