"""How real JAX frameworks spell normalizations and call models (adversarial campaign).

Flax linen and NNX modules with their less common options (``use_fast_variance=False``,
``reduction_axes``/``feature_axes`` that differ, ``GroupNorm(group_size=)`` with odd group
sizes, per token and on NHWC), layers stacked with ``nn.scan``/``nnx.scan`` and rematerialised
with policies and ``checkpoint_name`` (MaxText), per-example models ``jax.vmap``-ed over the
batch (Equinox style), apply functions with dict/tuple inputs, keyword flags
(``deterministic``, ``train``), a mutable ``batch_stats`` collection and an ``rngs`` key,
hand-written norms as T5X/MaxText/GPT-J/NeoX write them, parallel attention + MLP blocks,
rotary embeddings, tied embeddings, learned positions and top-k MoE routing between norms.

Each program is folded at its first argument set (batch 1 or one token among them) and
checked with ``fold_checks.assert_sound`` in float64 with random non-uniform γ, β and biases
at every argument set (folded == original, CBWC == original at unseen parameters and in its
gradients, every in-place centering invisible); the folded count a careful reader expects is
pinned, so that a coverage regression shows and a near miss (a variant that must not fold)
stays refused.

Findings:

* ``jax.ad_checkpoint.checkpoint_name`` (MaxText tags every projection output; remat policies
  ``save_only_these_names``/``save_and_offload_only_these_names`` read the tags) binds the
  ``name`` primitive, which had no rule: every norm whose input passed a tag was refused ("the
  output of `name` is not provably zero-sum") and ``rotate`` refused a tagged stream. It is now
  an identity rule (rules/elementwise.py, its rotation facet in rules/rotation.py).
* Not jaxfold: flax 0.12.8's ``nnx.GroupNorm(reduction_axes=-1)`` on (B, T, C) broadcasts the
  group statistics back interleaved (it is not a GroupNorm); jaxfold rightly refuses it.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import x64_context
from fold_checks import assert_sound, rel_err
from jax import lax

import jaxfold

F64 = jnp.float64
D = 8
FF = 16
HEADS = 2
DIN = 5
EPS = 1e-5


def xs(*shape, seed=0):
  return jnp.asarray(np.random.default_rng([seed, *shape]).standard_normal(shape), F64)


def tok_args(*shapes, din=DIN):
  return lambda: [(xs(b, t, din),) for b, t in shapes]


TOKENS = tok_args((1, 1), (2, 4), (4, 7))      # folded at batch 1 × one token
TOKENS_B2 = tok_args((2, 4), (1, 1), (4, 3))   # folded at batch 2 × 4 tokens


def img_args(*shapes, c=3):
  return lambda: [(xs(b, h, w, c),) for b, h, w in shapes]


def draw_like(shapes, seed):
  """Random non-uniform values for a variable tree, each leaf in its own dtype: γ (``scale``)
  1 + 0.5 N, β and biases 0.3 + 0.5 N, kernels N / sqrt(fan-in), running variances positive."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    n = rng.standard_normal(leaf.shape)
    if "scale" in name:
      v = 1.0 + 0.5 * n
    elif "var" in name:
      v = 0.5 + np.abs(n)
    elif "bias" in name or "mean" in name:
      v = 0.3 + 0.5 * n
    elif "kernel" in name or "embedding" in name:
      v = n / np.sqrt(max(1, int(np.prod(leaf.shape[:-1]))))
    else:
      v = 0.7 * n
    return jnp.asarray(v, leaf.dtype)
  return jax.tree_util.tree_map_with_path(draw, shapes)


def linen(module, args_fn, **apply_kw):
  """(apply, init) of a linen module: ``init(seed)`` draws random variables."""
  init_kw = {k: v for k, v in apply_kw.items() if k != "mutable"}

  def init(seed):
    shapes = jax.eval_shape(functools.partial(module.init, **init_kw), jax.random.PRNGKey(0),
                            *args_fn()[0])
    return draw_like(shapes, seed)
  return functools.partial(module.apply, **apply_kw), init


PROGRAMS: dict = {}


def prog(name, folded, args=TOKENS, slow=False, **fold_kw):
  """Registers ``make() -> (apply, init)``; ``init`` a function seed -> params."""
  def deco(make):
    PROGRAMS[name] = (make, args, folded, slow, fold_kw)
    return make
  return deco


def dense(features, **kw):
  return nn.Dense(features, param_dtype=F64, **kw)


def layer_norm(**kw):
  return nn.LayerNorm(epsilon=EPS, param_dtype=F64, **kw)


# ----------------------------------------------------------------------------
# Flax linen LayerNorm / GroupNorm options.

class DenseNorm(nn.Module):
  """x -> Dense(shape) -> norm."""
  norm: callable
  shape: tuple = (D,)

  @nn.compact
  def __call__(self, x):
    h = nn.DenseGeneral(self.shape, param_dtype=F64)(x)
    return self.norm()(h)


def _dense_norm(name, folded, norm, shape=(D,), args=TOKENS):
  prog(name, folded, args)(lambda: linen(DenseNorm(norm, shape), args))


_dense_norm("linen_ln_two_pass", 1, lambda: layer_norm(use_fast_variance=False))
_dense_norm("linen_ln_two_pass_no_scale_no_bias", 1,
            lambda: layer_norm(use_fast_variance=False, use_scale=False, use_bias=False))
# reduce over (heads, head_dim), γ/β per head_dim only (shared by the heads)
_dense_norm("linen_ln_reduce_two_axes_features_last", 1,
            lambda: layer_norm(reduction_axes=(-2, -1), feature_axes=-1), shape=(2, 4))
# reduce over head_dim only, γ/β per (head, head_dim): a per-head LayerNorm
_dense_norm("linen_ln_reduce_last_features_two_axes", 1,
            lambda: layer_norm(reduction_axes=-1, feature_axes=(-2, -1)), shape=(2, 4))
# reduce over three axes (a QK-norm over (heads, head_dim) after a 3-d DenseGeneral)
_dense_norm("linen_ln_reduce_three_axes", 1,
            lambda: layer_norm(reduction_axes=(-3, -2, -1), feature_axes=(-3, -2, -1),
                               use_fast_variance=False), shape=(3, 2, 2))
# group_size instead of num_groups, per token: 3 groups of 2, 2 groups of 3, 1 group of 6
for _gs in (2, 3, 6):
  _dense_norm(f"linen_gn_group_size_{_gs}_per_token", 1,
              lambda _gs=_gs: nn.GroupNorm(num_groups=None, group_size=_gs, reduction_axes=-1,
                                           epsilon=EPS, param_dtype=F64), shape=(6,))
_dense_norm("linen_gn_group_size_3_two_pass_per_token", 1,
            lambda: nn.GroupNorm(num_groups=None, group_size=3, reduction_axes=-1, epsilon=EPS,
                                 use_fast_variance=False, param_dtype=F64), shape=(9,))
# a GroupNorm whose groups are single channels has a zero variance: not a site that folds
_dense_norm("linen_gn_group_size_1_per_token", 0,
            lambda: nn.GroupNorm(num_groups=None, group_size=1, reduction_axes=-1, epsilon=EPS,
                                 param_dtype=F64), shape=(6,))
# the default GroupNorm on tokens reduces over (tokens, C/G): the shift varies by token
_dense_norm("linen_gn_group_size_3_over_tokens", 0,
            lambda: nn.GroupNorm(num_groups=None, group_size=3, epsilon=EPS, param_dtype=F64), shape=(6,))


class MergedHeadsGroupNorm(nn.Module):
  """RetNet-style: per-head outputs (b, t, heads, head_dim) merged to (b, t, heads·head_dim),
  then a GroupNorm with one group per head over each token's channels."""
  @nn.compact
  def __call__(self, x):
    h = nn.DenseGeneral((2, 3), param_dtype=F64)(x)
    h = h.reshape(h.shape[:-2] + (6,))
    return nn.GroupNorm(num_groups=2, reduction_axes=-1, epsilon=EPS, param_dtype=F64)(h)


prog("linen_retnet_merged_heads_groupnorm", 1)(lambda: linen(MergedHeadsGroupNorm(), TOKENS))


class ConvGroupNorm(nn.Module):
  group_size: int
  channels: int = 9
  per_position: bool = False

  @nn.compact
  def __call__(self, x):
    h = nn.Conv(self.channels, (3, 3), param_dtype=F64)(x)
    axes = {"reduction_axes": -1} if self.per_position else {}
    h = nn.GroupNorm(num_groups=None, group_size=self.group_size, epsilon=EPS, param_dtype=F64, **axes)(h)
    return nn.Conv(4, (1, 1), param_dtype=F64)(jax.nn.silu(h))


IMGS = img_args((1, 1, 1), (2, 5, 6), (3, 4, 4))
# standard GroupNorm over (H, W, C/G) of a conv: the centering's shift varies over (H, W)
prog("linen_gn_nhwc_group_size_3", 0, IMGS)(lambda: linen(ConvGroupNorm(3), IMGS))
prog("linen_gn_nhwc_per_position_group_size_3", 1, IMGS)(lambda: linen(ConvGroupNorm(3, per_position=True), IMGS))


# ----------------------------------------------------------------------------
# Transformer blocks as frameworks write them.

class Attention(nn.Module):
  rotary: bool = False

  @nn.compact
  def __call__(self, x, mask=None):
    b, t, _ = x.shape
    q = nn.DenseGeneral((HEADS, D // HEADS), param_dtype=F64, name="q")(x)
    k = nn.DenseGeneral((HEADS, D // HEADS), use_bias=False, param_dtype=F64, name="k")(x)
    v = nn.DenseGeneral((HEADS, D // HEADS), param_dtype=F64, name="v")(x)
    if self.rotary:
      q, k = rope(q), rope(k)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
    if mask is not None:
      s = jnp.where(mask, s, -1e9)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
    return nn.DenseGeneral(D, axis=(-2, -1), param_dtype=F64, name="out")(o)


def rope(x):
  """GPT-NeoX rotary embedding on (b, t, h, d): rotate halves by position-dependent angles."""
  t, d = x.shape[1], x.shape[-1]
  inv = 1.0 / (10000 ** (jnp.arange(0, d, 2, dtype=x.dtype) / d))
  ang = jnp.arange(t, dtype=x.dtype)[:, None] * inv[None]
  cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
  x1, x2 = jnp.split(x, 2, -1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x, deterministic=True):
    h = jax.nn.gelu(dense(FF)(x))
    h = nn.Dropout(0.5, deterministic=deterministic)(h)
    return dense(D)(h)


class PreLN(nn.Module):
  parallel: bool = False      # GPT-J: one LN feeds attention and MLP
  neox: bool = False          # GPT-NeoX: parallel, two LNs
  rotary: bool = False

  @nn.compact
  def __call__(self, h, deterministic=True):
    if self.parallel:
      a = layer_norm(name="ln_1")(h)
      m = layer_norm(name="ln_2")(h) if self.neox else a
      return h + Attention(self.rotary)(a) + Mlp()(m, deterministic)
    h = h + Attention(self.rotary)(layer_norm(name="ln_1")(h))
    return h + Mlp()(layer_norm(name="ln_2")(h), deterministic)


class ScanBlock(nn.Module):
  """A block with nn.scan's (carry, x) -> (carry, y) signature."""
  @nn.compact
  def __call__(self, h, _):
    return PreLN()(h), None


class Decoder(nn.Module):
  """Embedding (Dense of features, or ids with tied head) + positions, stacked pre-LN blocks,
  final LN; ``stack``: 'loop', 'scan', 'remat_scan' (MaxText style) or 'remat'."""
  layers: int = 2
  stack: str = "loop"
  tied: bool = False
  vocab: int = 11
  positions: bool = True
  block: dict = None

  @nn.compact
  def __call__(self, x, deterministic=True):
    if self.tied:
      emb = nn.Embed(self.vocab, D, param_dtype=F64, name="wte")
      h = emb(x)
    else:
      h = dense(D, name="embed")(x)
    if self.positions:
      h = h + nn.Embed(16, D, param_dtype=F64, name="wpe")(jnp.arange(x.shape[1]))[None]
    kw = dict(self.block or {})
    if self.stack in ("scan", "remat_scan"):
      blk = ScanBlock
      if self.stack == "remat_scan":
        blk = nn.remat(blk, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
      h, _ = nn.scan(blk, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=self.layers)(name="layers")(h, None)
    else:
      blk = nn.remat(PreLN, static_argnums=(2,)) if self.stack == "remat" else PreLN
      for i in range(self.layers):
        h = blk(name=f"layers_{i}", **kw)(h, deterministic)
    h = layer_norm(name="ln_f")(h)
    return emb.attend(h) if self.tied else dense(3, name="head")(h)


def ids_args(*shapes, vocab=11):
  def make():
    out = []
    for b, t in shapes:
      rng = np.random.default_rng([3, b, t])
      out.append((jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32),))
    return out
  return make


IDS = ids_args((1, 1), (2, 4), (4, 7))
# 2 layers × (ln_1, ln_2) + ln_f: every LN of a pre-LN stream that starts at centered
# producers (embedding kernel, bias, positions) folds.
prog("linen_decoder_loop", 5)(lambda: linen(Decoder(), TOKENS))
prog("linen_decoder_remat_static_argnums", 5, slow=True)(lambda: linen(Decoder(stack="remat"), TOKENS))
prog("linen_decoder_gptj_parallel_rotary", 3)(
    lambda: linen(Decoder(block=dict(parallel=True, rotary=True)), TOKENS))
# ln_1 and ln_2 read the same h: their means are one canonical value, one site (5 means removed)
prog("linen_decoder_neox_parallel_two_lns", 3, slow=True)(
    lambda: linen(Decoder(block=dict(parallel=True, neox=True, rotary=True), positions=False), TOKENS))
# nn.scan over layers: one body, its two LNs are two sites that fold for every layer
prog("linen_decoder_nn_scan", 3)(lambda: linen(Decoder(stack="scan", layers=3), TOKENS))
prog("linen_decoder_nn_scan_remat_nothing_saveable", 3)(
    lambda: linen(Decoder(stack="remat_scan", layers=3), TOKENS))
# tied embeddings: the lookup's table is untied (or the stream auxiliary-centered); the head
# reads the original
prog("linen_decoder_tied_embeddings", 5, IDS)(lambda: linen(Decoder(tied=True), IDS))



class BatchNormNet(nn.Module):
  """Dense -> BatchNorm -> gelu -> Dense -> LayerNorm (a ``batch_stats`` collection)."""
  @nn.compact
  def __call__(self, x, train=False):
    h = nn.BatchNorm(use_running_average=not train, momentum=0.9, param_dtype=F64)(dense(FF)(x))
    return layer_norm()(dense(D)(jax.nn.gelu(h)))


# eval: BatchNorm is affine per channel; train with mutable batch_stats: statistics over
# (batch, tokens) per channel, and the updated running stats are outputs. The LN folds either
# way (its producer is the last Dense).
prog("linen_batchnorm_eval", 1)(lambda: linen(BatchNormNet(), TOKENS, train=False))
prog("linen_batchnorm_train_mutable_batch_stats", 1, TOKENS_B2)(
    lambda: linen(BatchNormNet(), TOKENS_B2, train=True, mutable=["batch_stats"]))


class BatchNormAfterDense(nn.Module):
  """Dense -> LayerNorm -> BatchNorm(train): the LN's output feeds batch statistics."""
  @nn.compact
  def __call__(self, x):
    h = layer_norm()(dense(D)(x))
    return nn.BatchNorm(use_running_average=False, param_dtype=F64)(h)


prog("linen_ln_then_batchnorm_train", 1, TOKENS_B2)(
    lambda: linen(BatchNormAfterDense(), TOKENS_B2, mutable=["batch_stats"]))


# ----------------------------------------------------------------------------
# Remat with names and policies (MaxText), per-example models vmapped over the batch.

from jax.ad_checkpoint import checkpoint_name  # noqa: E402


def ln(h, g, b, eps=EPS):
  mu = h.mean(-1, keepdims=True)
  return (h - mu) * lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + eps) * g + b


def plain(shapes):
  """(apply, init) helpers for plain-dict programs: ``init(seed)`` as fold_checks.make_params."""
  from fold_checks import make_params
  return lambda seed: make_params(seed, **shapes)


MLP_P = dict(w=(DIN, D), b=(D,), g=(D,), be=(D,), w1=(D, FF), b1=(FF,), w2=(FF, D), b2=(D,),
             g2=(D,), be2=(D,))


def _named_block(p, x):
  h = checkpoint_name(x @ p["w"] + p["b"], "embed")
  y = checkpoint_name(ln(h, p["g"], p["be"]), "ln_out")
  y = checkpoint_name(jax.nn.gelu(y @ p["w1"] + p["b1"]), "mlpwi")
  h = h + checkpoint_name(y @ p["w2"] + p["b2"], "mlpwo")
  return ln(h, p["g2"], p["be2"])


@prog("checkpoint_name_inside_remat_save_only_these_names", 2)
def _():
  policy = jax.checkpoint_policies.save_only_these_names("mlpwo", "ln_out")
  return jax.checkpoint(_named_block, policy=policy), plain(MLP_P)


@prog("checkpoint_name_without_remat", 2)
def _():
  return _named_block, plain(MLP_P)


@prog("checkpoint_name_offload_policy", 2, slow=True)
def _():
  policy = jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=["ln_out"], names_which_can_be_offloaded=[],
      offload_src="device", offload_dst="pinned_host")
  return jax.checkpoint(_named_block, policy=policy), plain(MLP_P)


@prog("checkpoint_name_on_norm_statistics", 1)
def _():
  # the mean and the variance themselves tagged (a policy that saves the statistics)
  def apply(p, x):
    h = x @ p["w"] + p["b"]
    mu = checkpoint_name(h.mean(-1, keepdims=True), "mean")
    var = checkpoint_name(jnp.square(h - mu).mean(-1, keepdims=True), "var")
    return (h - mu) * lax.rsqrt(var + EPS) * p["g"] + p["be"]
  return jax.checkpoint(apply, policy=jax.checkpoint_policies.save_only_these_names("mean", "var")), plain(MLP_P)


def _eqx_ln(x, g, b, eps=EPS):
  """Equinox's LayerNorm on ONE vector (shape (D,)), vmapped by the user over tokens."""
  mean = jnp.mean(x, keepdims=True)
  var = jnp.maximum(0.0, jnp.var(x, keepdims=True))
  return (x - mean) * lax.rsqrt(var + eps) * g + b


def _eqx_model(p, x):
  """One example (T, DIN): an Equinox model is written per example."""
  h = jax.vmap(lambda t: p["w"].T @ t + p["b"])(x)
  y = jax.vmap(_eqx_ln, (0, None, None))(h, p["g"], p["be"])
  h = h + jax.vmap(lambda t: p["w2"].T @ jax.nn.gelu(p["w1"].T @ t + p["b1"]) + p["b2"])(y)
  return jax.vmap(_eqx_ln, (0, None, None))(h, p["g2"], p["be2"])


prog("equinox_style_per_example_vmapped", 2)(lambda: (jax.vmap(_eqx_model, (None, 0)), plain(MLP_P)))
prog("equinox_style_jit_of_vmap_filter_jit_like", 2, slow=True)(
    lambda: (jax.jit(jax.vmap(_eqx_model, (None, 0))), plain(MLP_P)))
# vmapped over the batch with the batch as axis 1 (in_axes=1, out_axes=1)
prog("equinox_style_vmapped_over_axis_1", 2)(
    lambda: (lambda p, x: jax.vmap(_eqx_model, (None, 1), 1)(p, x), plain(MLP_P)))


@prog("equinox_style_vmapped_norm_over_tokens_is_not_per_token", 0)
def _():
  # a norm vmapped over FEATURES normalizes each feature over tokens: the shift of a
  # centering varies by token, so nothing folds (and nothing may)
  def model(p, x):
    h = x @ p["w"] + p["b"]
    return jax.vmap(_eqx_ln, (1, 0, 0), 1)(h, p["g2"][0] + p["g"], p["be"])
  return jax.vmap(model, (None, 0)), plain(MLP_P)


# ----------------------------------------------------------------------------
# Hand-written norms as T5X / MaxText / GPT-J write them.

def _t5x_ln(x, g, b, eps=1e-6):
  """Compute in float32 (here float64 from float32), cast back."""
  dt = x.dtype
  x = x.astype(F64)
  mean = jnp.mean(x, axis=-1)[..., None]
  var = jnp.mean(lax.square(x - mean), axis=-1)[..., None]
  y = (x - mean) * lax.rsqrt(var + eps)
  return (y * g.astype(F64) + b.astype(F64)).astype(dt)


SPELLINGS = {
    "var_ddof0_eps_inside": lambda h: (h - h.mean(-1, keepdims=True))
    / jnp.sqrt(jnp.var(h, -1, ddof=0, keepdims=True) + EPS),
    "std_eps_outside": lambda h: (h - jnp.mean(h, axis=-1)[..., None]) / (jnp.std(h, -1)[..., None] + EPS),
    "expand_dims_mean": lambda h: (lambda m: (h - m) * lax.rsqrt(jnp.mean((h - m) ** 2, -1, keepdims=True) + EPS))(
        jnp.expand_dims(jnp.mean(h, axis=-1), -1)),
    "e_x2_minus_mu2_clipped": lambda h: (h - h.mean(-1, keepdims=True)) * lax.rsqrt(
        jnp.maximum(jnp.mean(h * h, -1, keepdims=True) - h.mean(-1, keepdims=True) ** 2, 0.0) + EPS),
    "sum_over_shape": lambda h: (lambda m: (h - m) / jnp.sqrt(jnp.sum((h - m) ** 2, -1, keepdims=True) / h.shape[-1]
                                                              + EPS))(jnp.sum(h, -1, keepdims=True) / h.shape[-1]),
    "einsum_mean": lambda h: (lambda m: (h - m) * lax.rsqrt(
        jnp.einsum("btd,btd->bt", h - m, h - m)[..., None] / D + EPS))(
        jnp.einsum("btd,d->bt", h, jnp.ones(D) / D)[..., None]),
    "standardize_given_mean_and_variance": lambda h: jax.nn.standardize(
        h, -1, mean=h.mean(-1, keepdims=True), variance=h.var(-1, keepdims=True), epsilon=EPS),
    "matmul_ones_mean": lambda h: (lambda m: (h - m) * lax.rsqrt(((h - m) ** 2) @ jnp.full((D, 1), 1.0 / D) + EPS))(
        h @ jnp.full((D, 1), 1.0 / D)),
}
for _name, _norm in SPELLINGS.items():
  prog(f"spelling_{_name}", 1)(
      lambda _norm=_norm: (lambda p, x: _norm(x @ p["w"] + p["b"]) * p["g"] + p["be"], plain(MLP_P)))


@prog("t5x_upcast_ln_f64_params_cast_to_f32_inside", 0)
def _():
  # float64 parameters cast to float32 by the program: a centered float64 kernel is not
  # zero-sum once rounded to float32, so no mean may be removed (refused: "a cast to float32
  # does not keep a zero sum"); the float32-stored model folds (test_t5x_low_precision_model)
  def apply(p, x):
    p = jax.tree_util.tree_map(lambda v: v.astype(jnp.float32), p)
    h = x.astype(jnp.float32) @ p["w"] + p["b"]
    h = h + jax.nn.gelu(_t5x_ln(h, p["g"], p["be"]) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return _t5x_ln(h, p["g2"], p["be2"]).astype(F64)
  return apply, plain(MLP_P)


@prog("t5x_upcast_ln_in_f64_model", 2)
def _():
  def apply(p, x):
    h = x @ p["w"] + p["b"]
    h = h + jax.nn.gelu(_t5x_ln(h, p["g"], p["be"]) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return _t5x_ln(h, p["g2"], p["be2"])
  return apply, plain(MLP_P)


@prog("mixed_param_dtypes_f32_gamma_f64_kernels", 2)
def _():
  def apply(p, x):
    h = x @ p["w"] + p["b"]
    h = h + jax.nn.gelu(ln(h, p["g"].astype(jnp.float32), p["be"]) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return ln(h, p["g2"], p["be2"].astype(jnp.float32))
  return apply, plain(MLP_P)


# ----------------------------------------------------------------------------
# Inputs as dict/tuple, post-LN, MoE routing.

def dict_args(*shapes):
  def make():
    out = []
    for b, t in shapes:
      rng = np.random.default_rng([5, b, t])
      mask = jnp.asarray(rng.random((b, 1, 1, t)) < 0.8) | jnp.eye(t, dtype=bool)[None, None]
      out.append(({"x": xs(b, t, DIN), "mask": mask},))
    return out
  return make


DICT = dict_args((1, 1), (2, 4), (3, 6))


class DictInputModel(nn.Module):
  @nn.compact
  def __call__(self, batch):
    h = dense(D)(batch["x"])
    h = h + Attention()(layer_norm()(h), batch["mask"])
    return {"out": layer_norm()(h), "pooled": h.mean(1)}


# the pooled un-normalized stream is an output: the first LN folds by centering the
# embedding only if the shift it leaves in h were invisible at "pooled" -- it is not
prog("linen_dict_input_dict_output_pooled_stream", 0, DICT)(lambda: linen(DictInputModel(), DICT))


class DictInputModelNormed(nn.Module):
  @nn.compact
  def __call__(self, batch):
    h = dense(D)(batch["x"])
    h = h + Attention()(layer_norm()(h), batch["mask"])
    out = layer_norm()(h)
    return {"out": out, "pooled": out.mean(1)}


prog("linen_dict_input_dict_output", 2, DICT)(lambda: linen(DictInputModelNormed(), DICT))


def tuple_args(*shapes):
  return lambda: [((xs(b, t, DIN), xs(b, t, DIN, seed=1)),) for b, t in shapes]


TUPLE = tuple_args((1, 1), (2, 4), (3, 5))


class TupleInputModel(nn.Module):
  """Encoder-decoder-ish: two streams from a tuple, cross attention."""
  @nn.compact
  def __call__(self, pair):
    src, tgt = pair
    e = layer_norm()(dense(D)(src))
    d = dense(D)(tgt)
    q = layer_norm()(d)
    a = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", dense(D)(q), dense(D)(e)) / np.sqrt(D), -1)
    d = d + dense(D)(jnp.einsum("bqk,bkd->bqd", a, e))
    return layer_norm()(d)


prog("linen_tuple_input_cross_attention", 3, TUPLE)(lambda: linen(TupleInputModel(), TUPLE))


class PostLN(nn.Module):
  @nn.compact
  def __call__(self, h):
    h = layer_norm()(h + Attention()(h))
    return layer_norm()(h + Mlp()(h))


class Bert(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = dense(D)(x) + nn.Embed(16, D, param_dtype=F64)(jnp.arange(x.shape[1]))[None]
    h = layer_norm(name="emb_ln")(h)
    for i in range(2):
      h = PostLN(name=f"layer_{i}")(h)
    return h


# post-LN with trained γ: only the embedding LN folds (the paper's 24/25 is wrong)
prog("linen_bert_post_ln", 1, slow=True)(lambda: linen(Bert(), TOKENS))


class MoE(nn.Module):
  """Mixtral-style top-2 routing: experts gathered per token, weighted by softmax of top-k."""
  experts: int = 4
  k: int = 2
  dispatch: str = "gather"

  @nn.compact
  def __call__(self, x):
    e, k = self.experts, self.k
    logits = nn.Dense(e, use_bias=False, param_dtype=F64, name="router")(x)
    vals, idx = lax.top_k(logits, k)
    w = jax.nn.softmax(vals, -1)
    init = nn.initializers.lecun_normal()
    w1 = self.param("w1", init, (e, D, FF), F64)
    w2 = self.param("w2", init, (e, FF, D), F64)
    b2 = self.param("b2", nn.initializers.zeros, (e, D), F64)
    if self.dispatch == "gather":
      h = jax.nn.gelu(jnp.einsum("btd,btkdf->btkf", x, w1[idx]))
      y = jnp.einsum("btkf,btkfd->btkd", h, w2[idx]) + b2[idx]
      return jnp.einsum("btkd,btk->btd", y, w)
    gate = jnp.einsum("btk,btke->bte", w, jax.nn.one_hot(idx, e, dtype=x.dtype))
    h = jax.nn.gelu(jnp.einsum("btd,edf->btef", x, w1))
    y = jnp.einsum("btef,efd->bted", h, w2) + b2
    return jnp.einsum("bted,bte->btd", y, gate)


class MoEDecoder(nn.Module):
  dispatch: str = "gather"

  @nn.compact
  def __call__(self, x):
    h = dense(D)(x)
    for _ in range(2):
      h = h + Attention(rotary=True)(layer_norm()(h))
      h = h + MoE(dispatch=self.dispatch)(layer_norm()(h))
    return layer_norm()(h)


class SwitchScatter(nn.Module):
  """Switch-style top-1 routing with capacity: tokens are gathered per expert (argsort by
  expert, first ``cap`` kept), run through their expert, and scatter-added back."""
  experts: int = 2

  @nn.compact
  def __call__(self, x):
    b, t, _ = x.shape
    flat = x.reshape(b * t, D)
    logits = nn.Dense(self.experts, use_bias=False, param_dtype=F64, name="router")(flat)
    e = jnp.argmax(logits, -1)
    gate = jax.nn.softmax(logits, -1)[jnp.arange(b * t), e]
    cap = max(1, (b * t) // self.experts)
    w1 = self.param("w1", nn.initializers.lecun_normal(), (self.experts, D, FF), F64)
    w2 = self.param("w2", nn.initializers.lecun_normal(), (self.experts, FF, D), F64)
    out = jnp.zeros_like(flat)
    for k in range(self.experts):
      rank = jnp.cumsum(e == k) - 1
      keep = (e == k) & (rank < cap)
      slot = jnp.where(keep, rank, cap)              # dropped tokens go to a spare slot
      buf = jnp.zeros((cap + 1, D), F64).at[slot].set(flat)
      y = jax.nn.gelu(buf @ w1[k]) @ w2[k]
      out = out.at[jnp.arange(b * t)].add(jnp.where(keep[:, None], y[slot] * gate[:, None], 0.0))
    return out.reshape(b, t, D)


class SwitchDecoder(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = dense(D)(x)
    h = h + SwitchScatter()(layer_norm()(h))
    return layer_norm()(h)


prog("linen_switch_capacity_scatter_add", 2)(lambda: linen(SwitchDecoder(), TOKENS))
prog("linen_moe_top2_gather", 5)(lambda: linen(MoEDecoder(), TOKENS))
prog("linen_moe_top2_one_hot_dispatch", 5, slow=True)(lambda: linen(MoEDecoder("one_hot"), TOKENS))




class QKNormBlock(nn.Module):
  """Flax's own MultiHeadDotProductAttention with ``normalize_qk=True`` (a LayerNorm without
  bias over each head's q and k, ViT-22B style) in a pre-LN block."""
  @nn.compact
  def __call__(self, h, deterministic=True):
    a = nn.MultiHeadDotProductAttention(HEADS, param_dtype=F64, normalize_qk=True, deterministic=deterministic)
    h = h + a(layer_norm(name="ln_1")(h))
    return h + Mlp()(layer_norm(name="ln_2")(h), deterministic)


class QKNormModel(nn.Module):
  @nn.compact
  def __call__(self, x, deterministic=True):
    h = dense(D)(x)
    for i in range(2):
      h = QKNormBlock(name=f"block_{i}")(h, deterministic)
    return layer_norm(name="ln_f")(h)


# per block ln_1, ln_2 and the q and k norms (over head_dim of a DenseGeneral), plus ln_f
prog("linen_mhdpa_normalize_qk", 9)(lambda: linen(QKNormModel(), TOKENS, deterministic=True))


class SharedScan(nn.Module):
  """ALBERT-style: one block's parameters broadcast to every scanned layer."""
  length: int = 3
  unroll: int = 1
  reverse: bool = False

  @nn.compact
  def __call__(self, x):
    h = dense(D)(x)
    h, _ = nn.scan(ScanBlock, variable_broadcast="params", split_rngs={"params": False}, length=self.length,
                   unroll=self.unroll, reverse=self.reverse)(name="shared")(h, None)
    return layer_norm(name="ln_f")(h)


prog("linen_scan_variable_broadcast_shared_layers", 3)(lambda: linen(SharedScan(), TOKENS))
prog("linen_scan_length_1", 3, slow=True)(lambda: linen(SharedScan(length=1), TOKENS))
prog("linen_scan_unroll_2_reverse", 3, slow=True)(lambda: linen(SharedScan(length=3, unroll=2, reverse=True), TOKENS))


class Sown(nn.Module):
  """A pre-LN decoder that sows a value per block into ``intermediates``."""
  what: str = "stream"

  @nn.compact
  def __call__(self, x):
    h = dense(D)(x)
    for i in range(2):
      y = layer_norm(name=f"ln_{i}")(h)
      self.sow("intermediates", f"v{i}", h if self.what == "stream" else y)
      h = h + Mlp(name=f"mlp_{i}")(y)
    return layer_norm(name="ln_f")(h)


# sown normalized values are outputs that a centering does not touch: all fold; the sown
# un-normalized stream is an output the shift would reach: nothing may fold
prog("linen_sow_normalized_intermediates", 3)(lambda: linen(Sown("normed"), TOKENS, mutable=["intermediates"]))
prog("linen_sow_residual_stream", 0)(lambda: linen(Sown("stream"), TOKENS, mutable=["intermediates"]))
# capture_intermediates returns every submodule's output (Dense outputs included)
prog("linen_capture_intermediates", 0)(lambda: linen(Sown("normed"), TOKENS, capture_intermediates=True,
                                                      mutable=["intermediates"]))


class VmappedPerExample(nn.Module):
  """Flax linen ``nn.vmap`` of a per-example module (parameters shared over the batch)."""
  @nn.compact
  def __call__(self, x):
    per = nn.vmap(Sown, in_axes=0, out_axes=0, variable_axes={"params": None}, split_rngs={"params": False})
    return per("normed", name="per")(x[:, None])[:, 0]


prog("linen_nn_vmap_per_example", 3)(lambda: linen(VmappedPerExample(), TOKENS))



# ----------------------------------------------------------------------------
# Vision and mixing architectures whose structure decides what may fold.

class ConvNeXt(nn.Module):
  """Stem conv -> LN; blocks: depthwise 3x3 conv -> LN -> Dense -> gelu -> Dense -> layer
  scale -> residual; downsample LN -> 1x1 conv; pooled head LN. The stem LN and the head LN
  (its input a spatial mean of the 1x1 conv's output) fold; the block LNs do not: a depthwise
  conv of a zero-sum stream is not zero-sum (each channel has its own kernel), nor does the
  downsample LN: the stream starts at the stem LN's output."""
  @nn.compact
  def __call__(self, x):
    h = layer_norm(name="stem_ln")(nn.Conv(D, (2, 2), strides=(2, 2), padding="VALID", param_dtype=F64)(x))
    for i in range(2):
      y = nn.Conv(D, (3, 3), feature_group_count=D, param_dtype=F64, name=f"dw_{i}")(h)
      y = dense(D)(jax.nn.gelu(dense(FF)(layer_norm(name=f"ln_{i}")(y))))
      h = h + self.param(f"layer_scale_{i}", nn.initializers.constant(0.5), (D,), F64) * y
    h = nn.Conv(D, (1, 1), param_dtype=F64, name="down")(layer_norm(name="down_ln")(h))
    return dense(3, name="head")(layer_norm(name="head_ln")(h.mean((1, 2))))


IMGS_EVEN = img_args((1, 2, 2), (2, 4, 6), (3, 6, 4))
prog("linen_convnext_depthwise", 2, IMGS_EVEN)(lambda: linen(ConvNeXt(), IMGS_EVEN))


class DepthwiseThenLN(nn.Module):
  """A depthwise conv with channel multiplier 2 straight into an LN over channels: the
  kernel's columns are per (input channel, multiplier), so no centering makes it zero-sum."""
  @nn.compact
  def __call__(self, x):
    h = nn.Conv(6, (3, 3), feature_group_count=3, param_dtype=F64)(x)
    return layer_norm()(h)


prog("linen_depthwise_multiplier_then_ln", 0, IMGS)(lambda: linen(DepthwiseThenLN(), IMGS))


class GroupedConvThenPerGroupNorm(nn.Module):
  """A grouped conv (2 groups) whose output channels are normalized per group and per pixel:
  each group's kernel block can be centered along its own output channels."""
  @nn.compact
  def __call__(self, x):
    h = nn.Conv(8, (3, 3), feature_group_count=2, param_dtype=F64)(x)
    return nn.GroupNorm(num_groups=2, reduction_axes=-1, epsilon=EPS, param_dtype=F64)(h)


IMGS4 = img_args((1, 1, 1), (2, 5, 6), (3, 4, 4), c=4)
prog("linen_grouped_conv_per_group_norm", 1, IMGS4)(lambda: linen(GroupedConvThenPerGroupNorm(), IMGS4))


class Mixer(nn.Module):
  """MLP-Mixer: token mixing is a Dense over the token axis (transpose, Dense, transpose).
  Its output is not zero-sum over channels and nothing in it can be centered along them: one
  auxiliary centering of each token mix's output (over channels) lets every later LN fold."""
  tokens: int = 4

  @nn.compact
  def __call__(self, x):
    h = dense(D, name="stem")(x)
    for i in range(2):
      y = jnp.swapaxes(layer_norm(name=f"ln_tok_{i}")(h), 1, 2)
      y = dense(self.tokens, name=f"tok_out_{i}")(jax.nn.gelu(dense(6, name=f"tok_in_{i}")(y)))
      h = h + jnp.swapaxes(y, 1, 2)
      h = h + dense(D)(jax.nn.gelu(dense(FF)(layer_norm(name=f"ln_ch_{i}")(h))))
    return dense(3)(layer_norm(name="ln_f")(h).mean(1))


MIX = tok_args((1, 4), (2, 4), (3, 4))
prog("linen_mlp_mixer", 5, MIX)(lambda: linen(Mixer(), MIX))
prog("linen_mlp_mixer_no_auxiliary", 1, MIX, auxiliary_centering=False)(lambda: linen(Mixer(), MIX))


class Perceiver(nn.Module):
  """Learned latents (a parameter tiled over the batch) cross-attend to the inputs."""
  @nn.compact
  def __call__(self, x):
    lat = self.param("latents", nn.initializers.normal(1.0), (3, D), F64)
    lat = jnp.broadcast_to(lat, (x.shape[0],) + lat.shape)
    kv = layer_norm(name="ln_in")(dense(D, name="embed")(x))
    q = layer_norm(name="ln_lat")(lat)
    a = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", dense(D)(q), dense(D)(kv)) / np.sqrt(D), -1)
    lat = lat + dense(D)(jnp.einsum("bqk,bkd->bqd", a, dense(D)(kv)))
    return layer_norm(name="ln_out")(lat)


prog("linen_perceiver_latents", 3)(lambda: linen(Perceiver(), TOKENS))



class CachedDecoder(nn.Module):
  """Autoregressive decoding with flax's attention cache (``decode=True``): the cached keys
  and values are inputs (variables) and outputs (the mutable ``cache`` collection)."""
  qk_norm: bool = False

  @nn.compact
  def __call__(self, x):
    h = dense(D, name="embed")(x)
    for i in range(2):
      a = nn.MultiHeadDotProductAttention(HEADS, param_dtype=F64, decode=True, normalize_qk=self.qk_norm,
                                          name=f"attn_{i}")
      h = h + a(layer_norm(name=f"ln_1_{i}")(h))
      h = h + Mlp(name=f"mlp_{i}")(layer_norm(name=f"ln_2_{i}")(h))
    return layer_norm(name="ln_f")(h)


def _decoder_init(model, batch=2, max_len=5):
  def init(seed):
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((batch, max_len, DIN), F64))
    v = draw_like(shapes, seed)
    # two positions already decoded
    v["cache"] = jax.tree_util.tree_map_with_path(
        lambda path, leaf: jnp.full(leaf.shape, 2, jnp.int32) if "index" in jax.tree_util.keystr(path) else leaf,
        v["cache"])
    return v
  return functools.partial(model.apply, mutable=["cache"]), init


ONE_TOKEN = lambda: [(xs(2, 1, DIN, seed=s),) for s in (0, 1)]   # noqa: E731
# (the int32 cache index has no gradient: CBWC gradients are not compared)
prog("linen_decode_with_kv_cache", 5, ONE_TOKEN, grads=False)(lambda: _decoder_init(CachedDecoder()))
prog("linen_decode_with_kv_cache_qk_norm", 9, ONE_TOKEN, grads=False)(
    lambda: _decoder_init(CachedDecoder(qk_norm=True)))




class HeadsFirst(nn.Module):
  """q as (b, heads, t, head_dim): an LN over the non-adjacent (heads, head_dim) axes (1, 3),
  γ of shape (heads, 1, head_dim); or (near miss) over (tokens, head_dim) (2, 3)."""
  axes: tuple = (1, 3)

  @nn.compact
  def __call__(self, x):
    q = jnp.transpose(nn.DenseGeneral((HEADS, D // HEADS), param_dtype=F64)(x), (0, 2, 1, 3))
    g = self.param("scale", nn.initializers.ones, (HEADS, 1, D // HEADS), F64)
    b = self.param("bias", nn.initializers.zeros, (HEADS, 1, D // HEADS), F64)
    mu = q.mean(self.axes, keepdims=True)
    var = jnp.square(q - mu).mean(self.axes, keepdims=True)
    return (q - mu) * lax.rsqrt(var + EPS) * g + b


prog("ln_over_non_adjacent_heads_and_head_dim", 1)(lambda: linen(HeadsFirst(), TOKENS))
prog("ln_over_tokens_and_head_dim_near_miss", 0)(lambda: linen(HeadsFirst((2, 3)), TOKENS))


class ChannelsFirstLN(nn.Module):
  """A torch-port ConvNeXt stem: NCHW conv, then ``LayerNorm(data_format="channels_first")``
  over axis 1 with weight[:, None, None]."""
  @nn.compact
  def __call__(self, x):
    w = self.param("kernel", nn.initializers.lecun_normal(), (D, 3, 2, 2), F64)
    h = lax.conv_general_dilated(jnp.transpose(x, (0, 3, 1, 2)), w, (1, 1), "SAME",
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"))
    h = h + self.param("bias", nn.initializers.zeros, (D,), F64)[:, None, None]
    u = h.mean(1, keepdims=True)
    s = ((h - u) ** 2).mean(1, keepdims=True)
    h = (h - u) / jnp.sqrt(s + 1e-6)
    g = self.param("scale", nn.initializers.ones, (D,), F64)
    return g[:, None, None] * h + self.param("ln_bias", nn.initializers.zeros, (D,), F64)[:, None, None]


prog("ln_channels_first_nchw_conv", 1, IMGS)(lambda: linen(ChannelsFirstLN(), IMGS))


class Sandwich(nn.Module):
  """Sandwich norm (Gemma 2, CogView): h + LN_post(f(LN_pre(h))) for attention and MLP."""
  @nn.compact
  def __call__(self, x):
    h = dense(D, name="embed")(x)
    for i in range(2):
      h = h + layer_norm(name=f"post_att_{i}")(Attention(name=f"att_{i}")(layer_norm(name=f"pre_att_{i}")(h)))
      h = h + layer_norm(name=f"post_mlp_{i}")(Mlp(name=f"mlp_{i}")(layer_norm(name=f"pre_mlp_{i}")(h)))
    return layer_norm(name="ln_f")(h)


# the first pre-norm and every post-norm fold (their inputs are centered producers); a post
# norm's output γ ⊙ n + β enters the stream, so the later pre-norms and ln_f do not: an
# auxiliary centering would buy one site each (not worth it)
prog("linen_sandwich_norm", 5, slow=True)(lambda: linen(Sandwich(), TOKENS))



class ScanBlockYs(nn.Module):
  """A scanned block that also emits a per-layer output (HF ``output_hidden_states``)."""
  emit: str = "stream"

  @nn.compact
  def __call__(self, h, scale):
    y = layer_norm(name="ln")(h)
    h = h + scale * Mlp()(y)
    return h, (h if self.emit == "stream" else y)


class ScanYs(nn.Module):
  """nn.scan with parameters stacked on axis 1 (T5X's param_scan_axis=1), a per-layer input
  (a scale per layer, scanned) and the per-layer outputs collected as ys."""
  emit: str = "stream"
  axis: int = 1

  @nn.compact
  def __call__(self, x):
    h = dense(D, name="embed")(x)
    scales = jnp.asarray([0.5, 1.0, 2.0], F64)
    h, ys = nn.scan(ScanBlockYs, variable_axes={"params": self.axis}, split_rngs={"params": True},
                    in_axes=0, out_axes=0, length=3)(self.emit, name="layers")(h, scales)
    return layer_norm(name="ln_f")(h), ys


# the stacked un-normalized hidden states are outputs: no centering of the stream is invisible
prog("linen_scan_param_axis_1_emits_hidden_states", 0)(lambda: linen(ScanYs("stream"), TOKENS))
prog("linen_scan_param_axis_1_emits_normed", 2)(lambda: linen(ScanYs("normed"), TOKENS))
prog("linen_scan_param_axis_0_emits_normed", 2, slow=True)(lambda: linen(ScanYs("normed", axis=0), TOKENS))


class CondLayer(nn.Module):
  """linen ``nn.cond``: a block applied or skipped by a traced flag (early exit / layer drop)."""
  @nn.compact
  def __call__(self, x, flag):
    h = dense(D, name="embed")(x)
    blk = PreLN(name="blk")
    if self.is_initializing():
      blk(h)
    h = nn.cond(flag, lambda m, h: m(h), lambda m, h: h, blk, h)
    return layer_norm(name="ln_f")(h)


def _flag_args(*shapes):
  return lambda: [(xs(b, t, DIN), jnp.asarray(bool(i % 2 == 0))) for i, (b, t) in enumerate(shapes)]


FLAGS = _flag_args((1, 1), (2, 4), (4, 7), (2, 3))
prog("linen_nn_cond_layer_skip", 3, FLAGS)(lambda: linen(CondLayer(), FLAGS))



class SharedDense(nn.Module):
  """One Dense module called on two inputs: one call feeds an LN, the other is an output."""
  @nn.compact
  def __call__(self, x):
    shared = dense(D, name="shared")
    return layer_norm()(shared(x)), shared(2.0 * x[:, :1])


prog("linen_shared_module_two_calls_one_normed", 1)(lambda: linen(SharedDense(), TOKENS))


class TiedAutoencoder(nn.Module):
  """Encoder W, decoder W.T (tied): LN(x W + b) W^T; centering W's columns for the LN would
  change the decoder's contraction, so the encoder's use gets a centered copy."""
  @nn.compact
  def __call__(self, x):
    w = self.param("kernel", nn.initializers.lecun_normal(), (DIN, D), F64)
    b = self.param("bias", nn.initializers.zeros, (D,), F64)
    return layer_norm()(x @ w + b) @ w.T


prog("linen_tied_autoencoder_transposed_use", 1)(lambda: linen(TiedAutoencoder(), TOKENS))


# ----------------------------------------------------------------------------
# Parameters transformed before use: weight norm, spectral norm, weight standardization,
# LoRA, int8 kernels with float scales.

class Reparam(nn.Module):
  kind: str

  @nn.compact
  def __call__(self, x):
    if self.kind == "weight_norm":
      h = nn.WeightNorm(dense(D))(x)
    elif self.kind == "spectral_norm":
      h = nn.SpectralNorm(dense(D), n_steps=2)(x, update_stats=False)
    elif self.kind == "lora":
      h = dense(D)(x) + 0.5 * nn.Dense(D, use_bias=False, param_dtype=F64, name="lora_b")(
          nn.Dense(2, use_bias=False, param_dtype=F64, name="lora_a")(x))
    elif self.kind == "int8":
      q = self.param("kernel_q", lambda k, s: jnp.zeros(s, jnp.int8), (x.shape[-1], D))
      scale = self.param("kernel_scale", nn.initializers.ones, (D,), F64)
      h = x @ (q.astype(F64) * scale) + self.param("bias", nn.initializers.zeros, (D,), F64)
    else:   # standardized kernel (BiT's StdConv, here a Dense): per output feature over inputs
      w = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], D), F64)
      w = (w - w.mean(0)) / jnp.sqrt(w.var(0) + 1e-10)
      h = x @ w + self.param("bias", nn.initializers.zeros, (D,), F64)
    return dense(3)(layer_norm()(h))


def _int8_init(seed):
  v = draw_like(jax.eval_shape(Reparam("int8").init, jax.random.PRNGKey(0), jnp.zeros((1, 1, DIN), F64)), seed)
  q = np.random.default_rng(seed).integers(-127, 128, (DIN, D))
  v["params"]["kernel_q"] = jnp.asarray(q, jnp.int8)
  return v


# weight norm: W[:, d] = scale[d] · v[:, d] / |v[:, d]|: v enters nonlinearly per column and
# bias alone cannot make h zero-sum, nothing folds
prog("reparam_weight_norm", 0)(lambda: linen(Reparam("weight_norm"), TOKENS))
# spectral norm: W / σ(W), σ by power iteration on W itself. The kernel is untied: a centered
# copy for x @ (W / σ) (P W / σ = P (W / σ)), the original for σ
prog("reparam_spectral_norm", 1)(lambda: linen(Reparam("spectral_norm"), TOKENS))
# standardized kernel (W − mean) / std per output: itself a norm over the kernel's input dim,
# which folds by centering the kernel along dim 0; h is not zero-sum over features, so the LN
# after it does not
prog("reparam_standardized_kernel", 1)(lambda: linen(Reparam("standardized"), TOKENS))
# LoRA: the base kernel and lora_b are centered, lora_a is not needed
prog("reparam_lora", 1)(lambda: linen(Reparam("lora"), TOKENS))
# int8 kernel times a float scale per output feature: nothing can center an int8 tensor
prog("reparam_int8_kernel_float_scale", 0, grads=False)(lambda: (Reparam("int8").apply, _int8_init))


# ----------------------------------------------------------------------------
# Flax NNX: layers created with nnx.vmap, run with nnx.scan, rematerialised with nnx.remat;
# a per-example model nnx.vmap-ed over the batch.

def nnx_model(build, args_fn):
  """(apply, init) of an NNX module: ``apply(state, *args)`` merges the state into the graph."""
  from flax import nnx
  model = build(nnx.Rngs(0))
  graphdef, state = nnx.split(model)

  def apply(st, *a):
    return nnx.merge(graphdef, st)(*a)
  return apply, lambda seed: draw_like(state, seed)


def _nnx_classes():
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.ln_1 = nnx.LayerNorm(D, epsilon=EPS, param_dtype=F64, rngs=rngs)
      self.ln_2 = nnx.LayerNorm(D, epsilon=EPS, use_fast_variance=False, param_dtype=F64, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(HEADS, D, D, decode=False, param_dtype=F64, rngs=rngs)
      self.fc = nnx.Linear(D, FF, param_dtype=F64, rngs=rngs)
      self.proj = nnx.Linear(FF, D, param_dtype=F64, rngs=rngs)

    def __call__(self, h):
      h = h + self.attn(self.ln_1(h))
      return h + self.proj(jax.nn.gelu(self.fc(self.ln_2(h))))

  class Stack(nnx.Module):
    def __init__(self, rngs, layers=3, remat=False, per_example=False):
      self.embed = nnx.Linear(DIN, D, param_dtype=F64, rngs=rngs)

      @nnx.split_rngs(splits=layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def create(r):
        return Block(r)
      self.blocks = create(rngs)
      self.ln_f = nnx.LayerNorm(D, epsilon=EPS, param_dtype=F64, rngs=rngs)
      self.remat, self.per_example = remat, per_example

    def run(self, x):
      h = self.embed(x)

      def step(h, blk):
        return blk(h)
      if self.remat:
        step = nnx.remat(step, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)

      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(h, blk):
        return step(h, blk)
      return self.ln_f(body(h, self.blocks))

    def __call__(self, x):
      if self.per_example:
        return nnx.vmap(lambda m, t: m.run(t[None])[0], in_axes=(None, 0))(self, x)
      return self.run(x)
  return Stack


def _nnx_norms(kind):
  from flax import nnx

  class NnxNorms(nnx.Module):
    def __init__(self, rngs):
      self.proj = nnx.LinearGeneral(DIN, (2, 3), param_dtype=F64, rngs=rngs)
      if kind == "ln_two_axes":
        self.norm = nnx.LayerNorm(3, reduction_axes=(-2, -1), feature_axes=-1, param_dtype=F64, rngs=rngs)
      else:
        self.norm = nnx.GroupNorm(6, num_groups=None, group_size=3, reduction_axes=-1, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
      h = self.proj(x)
      return self.norm(h if kind == "ln_two_axes" else h.reshape(h.shape[:-2] + (6,)))
  return NnxNorms


prog("nnx_layernorm_reduce_two_axes_features_last", 1)(lambda: nnx_model(_nnx_norms("ln_two_axes"), TOKENS))
# flax 0.12.8's nnx.GroupNorm(reduction_axes=-1) on (B, T, C) computes each contiguous group's
# statistics but broadcasts them back interleaved (channel c gets group c % groups's mean: 5.0
# off the linen GroupNorm). A per-group shift is then not annihilated: refusing is required
prog("nnx_groupnorm_group_size_3_per_token_interleaved_stats", 0)(lambda: nnx_model(_nnx_norms("gn"), TOKENS))


# 3 scanned blocks: ln_1 and ln_2 are two sites of the scan body (each folds for every layer), ln_f
prog("nnx_scan_over_vmap_created_layers", 3)(lambda: nnx_model(_nnx_classes(), TOKENS))
prog("nnx_scan_remat_dots_saveable", 3)(lambda: nnx_model(lambda r: _nnx_classes()(r, remat=True), TOKENS))
prog("nnx_vmap_per_example_over_scan", 3)(
    lambda: nnx_model(lambda r: _nnx_classes()(r, per_example=True), TOKENS))


# ----------------------------------------------------------------------------

NAMES = sorted(PROGRAMS)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if PROGRAMS[n][3] else n
                                  for n in NAMES])
def test_program_sound(name):
  make, args, folded, _, fold_kw = PROGRAMS[name]
  with x64_context():
    apply, init = make()
    assert_sound(apply, init, args(), expect_folded=folded, **fold_kw)


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16])
def test_t5x_low_precision_model(dtype):
  """T5X/MaxText: parameters and activations in float32 or bfloat16, each LayerNorm upcast
  to float64 (float32 in the real models) and cast back. Both norms fold; the folded model
  is as close to the exact (float64) result as the original is."""
  with x64_context():
    apply, init = PROGRAMS["t5x_upcast_ln_in_f64_model"][0]()
    p = jax.tree_util.tree_map(lambda v: v.astype(dtype), init(0))
    f = jaxfold.fold(p, apply, xs(1, 1, DIN).astype(dtype))
    assert f.report.num_folded == 2, f.report
    up = functools.partial(jax.tree_util.tree_map, lambda v: v.astype(F64))
    for b, t in ((1, 1), (2, 4), (4, 7)):
      x = xs(b, t, DIN).astype(dtype)
      exact = jax.jit(apply)(up(p), x.astype(F64))
      orig_err = rel_err(exact, jax.jit(apply)(p, x))
      fold_err = rel_err(exact, jax.jit(f.apply_fn)(f.params, x))
      assert fold_err <= max(2 * orig_err, float(jnp.finfo(dtype).eps)), (b, t, orig_err, fold_err)


def test_equinox_style_folded_per_example_then_vmapped():
  """Equinox users fold the per-example function (one sequence, at one token or four) and
  ``jax.vmap``/``jax.jit`` the FOLDED function over the batch themselves."""
  with x64_context():
    p = plain(MLP_P)(0)
    batched = jax.jit(jax.vmap(_eqx_model, (None, 0)))
    for t in (1, 4):
      f = jaxfold.fold(p, _eqx_model, xs(t, DIN))
      assert f.report.num_folded == 2, f.report
      run = jax.jit(jax.vmap(f.apply_fn, (None, 0)))
      for b, tt in ((1, 1), (3, 5), (2, 4)):
        x = xs(b, tt, DIN)
        assert rel_err(batched(p, x), run(f.params, x)) < 1e-12, (t, b, tt)


def test_checkpoint_name_through_fuse_defer_and_rotate():
  """``checkpoint_name`` tags (MaxText) pass fuse_affine, defer_norms and rotate."""
  with x64_context():
    p = dict(plain(MLP_P)(0), wh=xs(D, 3))
    policy = jax.checkpoint_policies.save_only_these_names("mlpwo")
    fn = jax.checkpoint(lambda p, x: _named_block(p, x) @ p["wh"], policy=policy)
    x, x2 = xs(2, 4, DIN), xs(3, 6, DIN)
    q = np.linalg.qr(np.random.default_rng(0).normal(size=(D, D)))[0]
    ref = jax.jit(fn)(p, x2)
    for kw in (dict(fuse_affine=True), dict(defer_norms=True)):
      f = jaxfold.fold(p, fn, x, **kw)
      assert rel_err(ref, jax.jit(f.apply_fn)(f.params, x2)) < 1e-12, kw
    r = jaxfold.rotate(jaxfold.fold(p, fn, x, fuse_affine=True), q)
    assert rel_err(ref, jax.jit(r.apply_fn)(r.params, x2)) < 1e-12


def test_dropout_rngs_and_deterministic_through_example_kwargs():
  """A linen decoder called as users do in training: ``deterministic=False`` and
  ``rngs={"dropout": key}`` as keyword arguments of the folded apply_fn (dropout sits
  before the MLP's output Dense, so every LN still folds), jitted, at other shapes."""
  with x64_context():
    apply, init = linen(Decoder(), TOKENS)
    p = init(0)
    key = jax.random.PRNGKey(3)
    kw = {"deterministic": False, "rngs": {"dropout": key}}
    f = jaxfold.fold(p, apply, xs(1, 1, DIN), example_kwargs=kw)
    assert f.report.num_folded == 5, f.report
    run = jax.jit(f.apply_fn, static_argnames="deterministic")
    ref = jax.jit(apply, static_argnames="deterministic")
    for b, t in ((1, 1), (4, 7)):
      x = xs(b, t, DIN)
      for k in (key, jax.random.PRNGKey(4)):
        want = ref(p, x, deterministic=False, rngs={"dropout": k})
        assert rel_err(want, run(f.params, x, deterministic=False, rngs={"dropout": k})) < 1e-12, (b, t)
      assert rel_err(ref(p, x, deterministic=True), run(f.params, x, deterministic=True)) < 1e-12
