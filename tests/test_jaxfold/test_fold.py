"""Per-rule tests of jaxfold.fold: producers, propagation, norms, soundness.

Every model here has random γ, β and biases (tests/conftest.randomize) and is
checked in float64, where folded and original must agree to ~1e-9.
"""


import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import randomize, rel_err, x64_context
from flax import nnx

import jaxfold

F64 = jnp.float64
D = 16


def run(module, *xs, other=None, **kw):
  """Folds ``module`` at ``xs`` and checks it at ``xs`` and at ``other``."""
  p = randomize(module.init(jax.random.PRNGKey(0), *xs))
  f = jaxfold.fold(p, module.apply, *xs, **kw)
  ref, new = jax.jit(module.apply), jax.jit(f.apply_fn)
  for ys in [xs] + list(other or ()):
    assert rel_err(ref(p, *ys), new(f.params, *ys)) < 1e-9
  return f


def count_reduce_sum(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args)
  n = 0
  for eqn in _all_eqns(jaxpr.jaxpr):
    n += eqn.primitive is jax.lax.reduce_sum_p
  return n


def _all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _all_eqns(getattr(sub, "jaxpr", sub))


def x3(seed=1, shape=(3, 5, 8)):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, F64)


class DenseLN(nn.Module):
  norm: str = "linen"

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D, param_dtype=F64)(x)
    g = self.param("g", nn.initializers.ones, (D,), F64)
    b = self.param("b", nn.initializers.zeros, (D,), F64)
    if self.norm == "linen":
      return nn.LayerNorm(param_dtype=F64)(h)
    if self.norm == "linen_slow":
      return nn.LayerNorm(use_fast_variance=False, param_dtype=F64)(h)
    if self.norm == "jnp_var":
      return (h - h.mean(-1, keepdims=True)) / jnp.sqrt(jnp.var(h, -1, keepdims=True) + 1e-5) * g + b
    if self.norm == "hand":
      mu = jnp.sum(h, -1, keepdims=True) / D
      c = h - mu
      return c * jax.lax.rsqrt(jnp.mean(c * c, -1, keepdims=True) + 1e-6) * g + b
    if self.norm == "fast_hand":
      mu, m2 = jnp.mean(h, -1), jnp.mean(h ** 2, -1)
      return (h - mu[..., None]) * jax.lax.rsqrt(m2 - mu ** 2 + 1e-6)[..., None] * g + b
    if self.norm == "jit":
      ln = jax.jit(lambda y, g, b: (y - y.mean(-1, keepdims=True))
                   * jax.lax.rsqrt(y.var(-1, keepdims=True) + 1e-5) * g + b)
      return ln(h, g, b)
    if self.norm == "remat":
      return nn.remat(nn.LayerNorm)(param_dtype=F64)(h)
    if self.norm == "two_axes":
      h2 = h.reshape(h.shape[:-1] + (4, 4))
      return nn.LayerNorm(reduction_axes=(-2, -1), feature_axes=(-2, -1), param_dtype=F64)(h2)
    raise ValueError(self.norm)


@pytest.mark.parametrize("norm", ["linen", "linen_slow", "jnp_var", "hand", "fast_hand",
                                  "jit", "remat", "two_axes"])
def test_layernorm_formulations_fold(x64, norm):
  f = run(DenseLN(norm), x3(), other=[(x3(2, (2, 7, 8)),), (x3(3, (4, 8)),)])
  assert (f.report.num_sites, f.report.num_folded) == (1, 1)
  assert f.report.sites[0].folded


def test_folded_program_has_no_mean_reduction(x64):
  m, x = DenseLN("linen"), x3()
  p = randomize(m.init(jax.random.PRNGKey(0), x))
  f = jaxfold.fold(p, m.apply, x)
  assert count_reduce_sum(m.apply, p, x) == 2
  assert count_reduce_sum(f.apply_fn, f.params, x) == 1  # only E[h²] is left


def test_folded_norm_is_rmsnorm_with_same_gamma_beta_eps(x64):
  """The folded output is γ·h/sqrt(mean(h²)+ε)+β of the centered pre-activation."""
  m, x = DenseLN("linen"), x3()
  p = randomize(m.init(jax.random.PRNGKey(0), x))
  f = jaxfold.fold(p, m.apply, x)
  q = f.params.params["params"]
  h = x @ q["Dense_0"]["kernel"] + q["Dense_0"]["bias"]
  np.testing.assert_allclose(np.asarray(h.sum(-1)), 0, atol=1e-12)
  ln = q["LayerNorm_0"]
  rms = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * ln["scale"] + ln["bias"]
  assert rel_err(rms, f.apply_fn(f.params, x)) < 1e-12
  # γ and β are untouched; only the producer was centered.
  assert jnp.array_equal(ln["scale"], p["params"]["LayerNorm_0"]["scale"])
  assert jnp.array_equal(ln["bias"], p["params"]["LayerNorm_0"]["bias"])


def test_bfloat16_layernorm_with_double_convert():
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(64, dtype=jnp.bfloat16, param_dtype=jnp.float32)(x)
      return nn.LayerNorm(dtype=jnp.bfloat16, param_dtype=jnp.float32)(h.astype(jnp.float32).astype(jnp.bfloat16))
  m, x = M(), jax.random.normal(jax.random.PRNGKey(1), (4, 32), jnp.bfloat16)
  p = randomize(m.init(jax.random.PRNGKey(0), x))
  f = jaxfold.fold(p, m.apply, x)
  assert f.report.num_folded == 1
  assert rel_err(m.apply(p, x), f.apply_fn(f.params, x)) < 3e-2  # bf16 rounding only
  assert f.params.params["params"]["Dense_0"]["kernel"].dtype == jnp.float32


def test_nnx_layernorm_and_state(x64):
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(8, D, rngs=rngs, param_dtype=F64)
      self.norm = nnx.LayerNorm(D, rngs=rngs, param_dtype=F64)

    def __call__(self, x):
      return self.norm(self.dense(x))

  model = Net(nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  state = randomize(state)
  apply = lambda s, x: nnx.merge(graphdef, s)(x)
  x = x3()
  f = jaxfold.fold(state, apply, x)
  assert f.report.num_folded == 1
  assert isinstance(f.params.params, type(state))
  assert rel_err(apply(state, x), f.apply_fn(f.params, x)) < 1e-9


# -- producers ------------------------------------------------------------------


class Producers(nn.Module):
  kind: str

  @nn.compact
  def __call__(self, x, ids):
    if self.kind == "dense_general":
      h = nn.DenseGeneral((2, 8), axis=-1, param_dtype=F64)(x)
      return nn.LayerNorm(reduction_axes=(-2, -1), feature_axes=(-2, -1), param_dtype=F64)(h)
    if self.kind == "einsum":
      w = self.param("w", nn.initializers.normal(1.0), (8, D), F64)
      h = jnp.einsum("btd,de->bte", x, w)
    elif self.kind == "transposed":  # HF Conv1D-style storage: (out, in), transposed at use
      w = self.param("w", nn.initializers.normal(1.0), (D, 8), F64)
      h = x @ w.T
    elif self.kind == "embed_take":
      table = self.param("table", nn.initializers.normal(1.0), (30, D), F64)
      h = jnp.take(table, ids, axis=0)
    elif self.kind == "embed_onehot":
      table = self.param("table", nn.initializers.normal(1.0), (30, D), F64)
      h = jax.nn.one_hot(ids, 30, dtype=F64) @ table
    elif self.kind == "bias_and_pos":
      h = nn.Dense(D, use_bias=False, param_dtype=F64)(x)
      h = h + self.param("b", nn.initializers.normal(1.0), (D,), F64)
      h = h + self.param("pos", nn.initializers.normal(1.0), (16, D), F64)[: x.shape[1]]
      h = h + self.param("cls", nn.initializers.normal(1.0), (1, 1, D), F64)
    elif self.kind == "constant":
      table = np.sin(np.arange(16 * D).reshape(16, D) * 0.37)  # captured, not a parameter
      h = nn.Dense(D, param_dtype=F64)(x) + table[: x.shape[1]]
    else:
      raise ValueError(self.kind)
    return nn.LayerNorm(param_dtype=F64)(h)


@pytest.mark.parametrize("kind", ["dense_general", "einsum", "transposed", "embed_take",
                                  "embed_onehot", "bias_and_pos", "constant"])
def test_producers_are_centered(x64, kind):
  x, ids = x3(), jnp.arange(15).reshape(3, 5) % 30
  f = run(Producers(kind), x, ids, other=[(x3(4, (2, 7, 8)), jnp.arange(14).reshape(2, 7) % 30)])
  assert f.report.num_folded == 1, f.report


@pytest.mark.slow
def test_conv_producer_and_grouped_conv(x64):
  class M(nn.Module):
    groups: int

    @nn.compact
    def __call__(self, x):
      h = nn.Conv(8, (3, 3), feature_group_count=self.groups, param_dtype=F64)(x)
      return nn.LayerNorm(param_dtype=F64)(h)

  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 6, 4), F64)
  assert run(M(1), x).report.num_folded == 1
  f = run(M(4), x)  # conv groups (2 channels) are smaller than the norm's 8 channels
  assert f.report.num_folded == 0
  assert "convolution" in f.report.sites[0].reason


def test_depthwise_conv_can_feed_a_per_group_norm(x64):
  """Per-position GroupNorm with groups of 4 channels after a conv with 2 groups of 4."""
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Conv(8, (3, 3), feature_group_count=2, param_dtype=F64)(x)
      hh = h.reshape(h.shape[:-1] + (2, 4))
      return nn.LayerNorm(param_dtype=F64)(hh).reshape(h.shape)

  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 6, 4), F64)
  assert run(M(), x).report.num_folded == 1


# -- GroupNorm ---------------------------------------------------------------


class ConvGN(nn.Module):
  per_position: bool

  @nn.compact
  def __call__(self, x):
    h = nn.Conv(8, (3, 3), param_dtype=F64)(x)
    if self.per_position:
      hh = h.reshape(h.shape[:-1] + (2, 4))
      return nn.LayerNorm(param_dtype=F64)(hh).reshape(h.shape)
    return nn.GroupNorm(num_groups=2, param_dtype=F64)(h)


def test_standard_groupnorm_is_not_folded_and_says_why(x64):
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 6, 3), F64)
  f = run(ConvGN(False), x)
  assert (f.report.num_sites, f.report.num_folded) == (1, 0)
  assert "varies" in f.report.sites[0].reason and "(1, 2, 4)" in f.report.sites[0].reason


def test_naive_grouped_centering_of_standard_groupnorm_is_really_wrong(x64):
  """The refusal above is necessary: centering the conv per group changes the output."""
  m, x = ConvGN(False), jax.random.normal(jax.random.PRNGKey(1), (2, 6, 6, 3), F64)
  p = randomize(m.init(jax.random.PRNGKey(0), x))
  q = jax.tree_util.tree_map(lambda a: a, p)
  k = q["params"]["Conv_0"]["kernel"]
  kk = k.reshape(k.shape[:-1] + (2, 4))
  q["params"]["Conv_0"]["kernel"] = (kk - kk.mean(-1, keepdims=True)).reshape(k.shape)
  b = q["params"]["Conv_0"]["bias"].reshape(2, 4)
  q["params"]["Conv_0"]["bias"] = (b - b.mean(-1, keepdims=True)).reshape(-1)
  assert rel_err(m.apply(p, x), m.apply(q, x)) > 1e-3


def test_per_position_groupnorm_folds(x64):
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 6, 3), F64)
  f = run(ConvGN(True), x, other=[(jax.random.normal(jax.random.PRNGKey(2), (1, 5, 7, 3), F64),)])
  assert f.report.num_folded == 1


def test_layernorm_over_hwc_is_not_folded(x64):
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Conv(8, (3, 3), param_dtype=F64)(x)
      return nn.LayerNorm(reduction_axes=(1, 2, 3), feature_axes=-1, param_dtype=F64)(h)

  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 6, 3), F64)
  assert run(M(), x).report.num_folded == 0


# -- propagation ---------------------------------------------------------------


class Attention(nn.Module):
  """Pre-LN block whose value path carries the stream's shift (no LN on V)."""
  value_from_stream: bool = False

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(param_dtype=F64)(x)
    b, t, d = x.shape
    q = nn.Dense(d, param_dtype=F64)(h).reshape(b, t, 2, d // 2)
    k = nn.Dense(d, param_dtype=F64)(h).reshape(b, t, 2, d // 2)
    v_in = x if self.value_from_stream else h
    v = nn.Dense(d, param_dtype=F64)(v_in).reshape(b, t, 2, d // 2)
    mask = jnp.tril(jnp.ones((t, t), bool))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // 2)
    s = jnp.where(mask, s, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, d)
    return x + nn.Dense(d, param_dtype=F64)(a)


class Stream(nn.Module):
  block: str

  @nn.compact
  def __call__(self, x):
    s = nn.Dense(D, param_dtype=F64)(x)
    if self.block == "attention":
      s = Attention()(s)
    elif self.block == "slice_concat":  # along the sequence axis
      s = jnp.concatenate([s[:, :2], s[:, 2:] * 2.0], axis=1)
    elif self.block == "pad":
      s = jnp.pad(s, ((0, 0), (1, 0), (0, 0)))[:, :-1]
    elif self.block == "dus":
      s = jax.lax.dynamic_update_slice(s, nn.Dense(D, param_dtype=F64)(x[:, :1]), (0, 0, 0))
    elif self.block == "per_token_scale":
      s = s * jax.nn.sigmoid(nn.Dense(1, param_dtype=F64)(x))
    elif self.block == "select":
      keep = (jnp.arange(x.shape[1]) % 2 == 0)[None, :, None]
      s = jnp.where(keep, s, 0.5 * s)
    elif self.block == "heads_transpose":
      b, t, d = s.shape
      s = s.reshape(b, t, 2, d // 2).transpose(0, 2, 1, 3).transpose(0, 2, 1, 3).reshape(b, t, d)
    return nn.LayerNorm(param_dtype=F64)(s)


@pytest.mark.parametrize("block", ["attention", "slice_concat", "pad", "dus", "per_token_scale",
                                   "select", "heads_transpose"])
def test_shift_propagates_through(x64, block):
  f = run(Stream(block), x3(), other=[(x3(5, (2, 6, 8)),)])
  assert f.report.num_folded == f.report.num_sites, f.report


def test_attention_value_path_from_stream_is_followed(x64):
  """V computed from the raw stream: the stream's shift flows through P@V."""
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      s = nn.Dense(D, param_dtype=F64)(x)
      return nn.LayerNorm(param_dtype=F64)(Attention(value_from_stream=True)(s))

  f = run(M(), x3())
  assert f.report.num_sites == 2


# -- soundness -----------------------------------------------------------------


def test_extra_output_exposing_the_stream_blocks_the_fold(x64):
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(D, param_dtype=F64)(x)
      return nn.LayerNorm(param_dtype=F64)(h), h

  f = run(M(), x3())
  assert f.report.num_folded == 0
  assert "program output" in f.report.sites[0].reason


def test_contraction_over_normalized_axis_blocks_the_fold(x64):
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(D, param_dtype=F64)(x)
      return nn.LayerNorm(param_dtype=F64)(h) + nn.Dense(D, param_dtype=F64)(h)

  f = run(M(), x3())
  assert f.report.num_folded == 0


def test_nonlinearity_between_producer_and_norm(x64):
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.LayerNorm(param_dtype=F64)(nn.gelu(nn.Dense(D, param_dtype=F64)(x)))

  f = run(M(), x3())
  assert f.report.num_folded == 0


class PostLN(nn.Module):
  layers: int = 2

  @nn.compact
  def __call__(self, ids):
    x = nn.LayerNorm(param_dtype=F64)(nn.Embed(30, D, param_dtype=F64)(ids))
    for _ in range(self.layers):
      a = nn.Dense(D, param_dtype=F64)(nn.relu(nn.Dense(D, param_dtype=F64)(x)))
      x = nn.LayerNorm(param_dtype=F64)(x + a)
    return x


def test_post_ln_folds_only_the_embedding_norm(x64):
  ids = jnp.arange(10).reshape(2, 5)
  f = run(PostLN(), ids, other=[(jnp.arange(21).reshape(3, 7) % 30,)])
  assert (f.report.num_sites, f.report.num_folded) == (3, 1)
  assert f.report.sites[0].folded
  for s in f.report.sites[1:]:
    assert "output of normalization" in s.reason


def test_post_ln_paper_choice_is_wrong_with_trained_gamma(x64):
  """Folding a post-LN block anyway (as the paper counts it) changes the output."""
  m, ids = PostLN(1), jnp.arange(10).reshape(2, 5)
  p = randomize(m.init(jax.random.PRNGKey(0), ids))
  q = jax.tree_util.tree_map(lambda a: a, p)
  for name in ("Dense_1",):
    k = q["params"][name]["kernel"]
    q["params"][name]["kernel"] = k - k.mean(-1, keepdims=True)
    b = q["params"][name]["bias"]
    q["params"][name]["bias"] = b - b.mean()
  e = q["params"]["Embed_0"]["embedding"]
  q["params"]["Embed_0"]["embedding"] = e - e.mean(-1, keepdims=True)
  ln = lambda h, scale, bias: h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-6) * scale + bias

  def as_rms(params, ids):  # every LN replaced by RMSNorm, the paper's count
    P = params["params"]
    x = ln(P["Embed_0"]["embedding"][ids], **P["LayerNorm_0"])
    a = nn.relu(x @ P["Dense_0"]["kernel"] + P["Dense_0"]["bias"]) @ P["Dense_1"]["kernel"] + P["Dense_1"]["bias"]
    return ln(x + a, **P["LayerNorm_1"])

  assert rel_err(m.apply(p, ids), as_rms(q, ids)) > 1e-3


class EmbLNStream(nn.Module):
  """BLOOM-style: a pre-LN stream that starts at an embedding LayerNorm."""

  @nn.compact
  def __call__(self, ids):
    x = nn.LayerNorm(param_dtype=F64)(nn.Embed(30, D, param_dtype=F64)(ids))
    for _ in range(3):
      h = nn.LayerNorm(param_dtype=F64)(x)
      x = x + nn.Dense(D, param_dtype=F64)(nn.gelu(nn.Dense(2 * D, param_dtype=F64)(h)))
    return nn.LayerNorm(param_dtype=F64)(x)


def test_embedding_layernorm_stream_needs_auxiliary_centering(x64):
  ids = jnp.arange(10).reshape(2, 5)
  f = run(EmbLNStream(), ids, auxiliary_centering=False)
  assert (f.report.num_sites, f.report.num_folded, f.report.num_auxiliary) == (5, 1, 0)
  g = run(EmbLNStream(), ids, other=[(jnp.arange(18).reshape(3, 6) % 30,)])
  assert (g.report.num_sites, g.report.num_folded, g.report.num_auxiliary) == (5, 5, 1)
  p = randomize(EmbLNStream().init(jax.random.PRNGKey(0), ids))
  # One reduction added, four removed.
  assert count_reduce_sum(g.apply_fn, g.params, ids) == count_reduce_sum(EmbLNStream().apply, p, ids) - 5 + 1


def test_auxiliary_centering_is_not_inserted_when_it_does_not_pay(x64):
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.LayerNorm()(nn.Dense(D)(x))
      return nn.LayerNorm()(h + nn.Dense(D)(h))  # only one site would gain

  m, x = M(), x3().astype(jnp.float32)
  p = randomize(m.init(jax.random.PRNGKey(0), x))
  f = jaxfold.fold(p, m.apply, x)
  assert (f.report.num_folded, f.report.num_auxiliary) == (1, 0)


class Tied(nn.Module):
  @nn.compact
  def __call__(self, ids):
    emb = nn.Embed(30, D, param_dtype=F64)
    x = emb(ids)
    for _ in range(2):
      x = x + nn.Dense(D, param_dtype=F64)(nn.LayerNorm(param_dtype=F64)(x))
    return emb.attend(nn.LayerNorm(param_dtype=F64)(x))


def test_tied_embedding_is_untied_by_a_centered_copy(x64):
  ids = jnp.arange(10).reshape(2, 5)
  f = run(Tied(), ids, auxiliary_centering=False, other=[(jnp.arange(14).reshape(2, 7) % 30,)])
  assert f.report.num_folded == 3 and f.report.num_auxiliary == 0
  assert f.report.untied_bytes == 30 * D * 8
  assert isinstance(f.params, jaxfold.Params) and f.params.extras
  # The head still sees the original table.
  p = randomize(Tied().init(jax.random.PRNGKey(0), ids))
  assert jnp.array_equal(f.params.params["params"]["Embed_0"]["embedding"],
                         p["params"]["Embed_0"]["embedding"])


def test_tied_embedding_with_auxiliary_centering(x64):
  ids = jnp.arange(10).reshape(2, 5)
  f = run(Tied(), ids)
  assert (f.report.num_folded, f.report.num_auxiliary, f.report.untied_bytes) == (3, 1, 0)
  g = run(Tied(), ids, tied_weights="copy")
  assert (g.report.num_folded, g.report.num_auxiliary) == (3, 0)


def test_caller_pytree_is_not_modified(x64):
  m, x = DenseLN(), x3()
  p = randomize(m.init(jax.random.PRNGKey(0), x))
  before = jax.tree_util.tree_map(np.array, p)
  f = jaxfold.fold(p, m.apply, x)
  jax.tree_util.tree_map(np.testing.assert_array_equal, before, jax.tree_util.tree_map(np.array, p))
  assert f.params is not p


def test_abstract_params_are_analysed_without_allocation(x64):
  m, x = DenseLN(), x3().astype(jnp.float32)
  p = jax.eval_shape(lambda: m.init(jax.random.PRNGKey(0), x))
  f = jaxfold.fold(p, m.apply, jax.ShapeDtypeStruct(x.shape, x.dtype))
  assert f.report.num_folded == 1
  assert isinstance(jax.tree_util.tree_leaves(f.params)[0], jax.ShapeDtypeStruct)


# -- program structure -------------------------------------------------------------


def test_custom_jvp_and_custom_vjp_bodies_are_entered(x64):
  @jax.custom_vjp
  def ident(y):
    return y
  ident.defvjp(lambda y: (y, None), lambda _, g: (g,))

  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = ident(nn.Dense(D, param_dtype=F64)(x))
      y = nn.LayerNorm(param_dtype=F64)(h)
      return jax.nn.relu(y)  # relu is a custom_jvp

  assert run(M(), x3()).report.num_folded == 1


def test_no_norms_gives_identity_fold():
  m = nn.Dense(4)
  x = jnp.ones((2, 3))
  p = randomize(m.init(jax.random.PRNGKey(0), x))
  f = jaxfold.fold(p, m.apply, x)
  assert f.report.num_sites == 0 and "0/0" in str(f.report)
  np.testing.assert_array_equal(f.apply_fn(f.params, x), m.apply(p, x))


def test_report_table_and_json(x64):
  f = run(PostLN(), jnp.arange(10).reshape(2, 5))
  text = str(f.report)
  assert "1/3 normalization sites folded" in text and "PostLN/LayerNorm_0" in text
  import json
  d = json.loads(f.report.to_json())
  assert d["num_sites"] == 3 and len(d["sites"]) == 3


def test_jit_of_folded_apply(x64):
  m, x = DenseLN(), x3()
  p = randomize(m.init(jax.random.PRNGKey(0), x))
  f = jaxfold.fold(p, m.apply, x)
  assert rel_err(jax.jit(f.apply_fn)(f.params, x), m.apply(p, x)) < 1e-9


def test_sharding_of_params_is_preserved(x64):
  m, x = DenseLN(), x3().astype(jnp.float32)
  p = randomize(m.init(jax.random.PRNGKey(0), x))
  dev = jax.devices()[0]
  p = jax.device_put(p, jax.sharding.SingleDeviceSharding(dev))
  f = jaxfold.fold(p, m.apply, x)
  for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(f.params)):
    assert a.sharding == b.sharding and a.dtype == b.dtype


# -- loops and conditionals -----------------------------------------------------


class ScanBlock(nn.Module):
  post_ln: bool = False

  @nn.compact
  def __call__(self, x, _):
    if self.post_ln:
      return nn.LayerNorm(param_dtype=F64)(x + nn.Dense(D, param_dtype=F64)(x)), None
    h = nn.LayerNorm(param_dtype=F64)(x)
    return x + nn.Dense(D, param_dtype=F64)(nn.gelu(nn.Dense(2 * D, param_dtype=F64)(h))), None


class ScannedLayers(nn.Module):
  post_ln: bool = False

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(D, param_dtype=F64)(x)
    x, _ = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=3)(self.post_ln)(x, None)
    return nn.LayerNorm(param_dtype=F64)(x)


def test_nn_scan_over_layers_folds_with_stacked_params(x64):
  f = run(ScannedLayers(), x3(), other=[(x3(2, (2, 7, 8)),)])
  assert (f.report.num_sites, f.report.num_folded) == (2, 2)
  names = {c.param for s in f.report.sites for c in s.centered}
  assert any("Scan" in n and n.endswith("['kernel']") for n in names)
  m, x = ScannedLayers(), x3()
  p = randomize(m.init(jax.random.PRNGKey(0), x))
  assert count_reduce_sum(f.apply_fn, f.params, x) == count_reduce_sum(m.apply, p, x) - 2


def test_nn_scan_post_ln_is_refused(x64):
  f = run(ScannedLayers(post_ln=True), x3())
  assert f.report.num_folded == 0


def test_scan_over_time_carry_fixed_point(x64):
  """An RNN whose carry passes a LayerNorm each step: the carry is not zero-sum."""
  class RNN(nn.Module):
    @nn.compact
    def __call__(self, xs):
      w = self.param("w", nn.initializers.normal(1.0), (8, D), F64)
      u = self.param("u", nn.initializers.normal(1.0), (D, D), F64)
      g = self.param("g", nn.initializers.normal(1.0), (D,), F64)

      def step(h, x):
        z = x @ w + h @ u
        h = (z - z.mean(-1, keepdims=True)) * jax.lax.rsqrt(z.var(-1, keepdims=True) + 1e-5) * g
        return h, h

      h0 = jnp.zeros((xs.shape[0], D), F64)
      _, hs = jax.lax.scan(step, h0, xs.swapaxes(0, 1))
      return hs

  f = run(RNN(), x3())
  assert f.report.num_sites == 1
  # z = x·w + h·u: centering w and u over the output axis makes z zero-sum.
  assert f.report.num_folded == 1


def test_sites_inside_cond_and_while_are_reported_not_folded(x64):
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(D, param_dtype=F64)(x)
      ln = lambda y: (y - y.mean(-1, keepdims=True)) * jax.lax.rsqrt(y.var(-1, keepdims=True) + 1e-5)
      a = jax.lax.cond(x.sum() > 0, ln, lambda y: y, h)
      b = jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (ln(c[0]), c[1] + 1), (h, 0))[0]
      return a + b

  f = run(M(), x3())
  assert f.report.num_folded == 0
  assert all("body" in s.reason or "not" in s.reason for s in f.report.sites)


def test_symbolic_batch_and_untied_copies_keep_one_plan():
  """jax.export shapes: a symbolic batch through a reshape, and untied names
  that do not depend on where the use sits in the jaxpr."""
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Conv(8, (2, 2), strides=(2, 2))(x)
      return nn.LayerNorm()(h.reshape(h.shape[0], -1, h.shape[-1]))

  (b,) = jax.export.symbolic_shape("batch")
  m, x = M(), jnp.ones((2, 8, 8, 3))
  p = m.init(jax.random.PRNGKey(0), x)
  f = jaxfold.fold(p, m.apply, jax.ShapeDtypeStruct((b, 8, 8, 3), jnp.float32))
  assert f.report.num_folded == 1

  ids = jnp.arange(10).reshape(2, 5)
  t = Tied()
  q = randomize(t.init(jax.random.PRNGKey(0), ids))
  with x64_context():
    g = jaxfold.fold(q, t.apply, ids, auxiliary_centering=False)
    bs, s = jax.export.symbolic_shape("batch, seq")
    g.apply_fn.analysis_for((jax.ShapeDtypeStruct((bs, s), jnp.int32),))  # same params: no error
