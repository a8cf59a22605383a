"""The folded program with the Pallas RMSNorm kernel (interpret mode) equals the XLA path."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from adversarial_programs import (
  bessel_ln,
  beta_before_gamma_ln,
  eps_outside_sqrt_ln,
  large_eps_ln,
  ln_flax,
  rsqrt_4var_ln,
)
from conftest import randomize, rel_err

import jaxfold


class PreLN(nn.Module):
  hidden: int = 24

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(40, self.hidden)(ids)
    for _ in range(2):
      h = nn.LayerNorm(epsilon=1e-5)(x)
      x = x + nn.Dense(self.hidden)(nn.gelu(nn.Dense(2 * self.hidden)(h)))
    return nn.LayerNorm(use_bias=False)(x)


def test_kernel_is_used_at_folded_sites_and_matches_xla():
  m, ids = PreLN(), jnp.arange(14).reshape(2, 7) % 40
  p = randomize(m.init(jax.random.PRNGKey(0), ids))
  xla = jaxfold.fold(p, m.apply, ids, norm_impl="xla")
  ker = jaxfold.fold(p, m.apply, ids, norm_impl="interpret")
  assert xla.report.num_folded == 3
  assert len(ker.apply_fn.analysis_for((ids,)).plan.epilogues) == 3
  # The embedding's norm reads a value made inside the lookup's jit call: the
  # kernel runs there too (one launch per folded site), the two residual adds
  # feeding the other norms run fused with them.
  assert _kernel_calls(ker.apply_fn, ker.params, ids) == [
      "rms_norm_fwd", "fused_add_rms_norm_fwd", "fused_add_rms_norm_fwd"]
  assert "pallas_call" not in str(jax.make_jaxpr(xla.apply_fn)(xla.params, ids))
  assert rel_err(xla.apply_fn(xla.params, ids), ker.apply_fn(ker.params, ids)) < 2e-6
  assert rel_err(m.apply(p, ids), ker.apply_fn(ker.params, ids)) < 2e-5


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 1)])
def test_one_row_and_one_token_shapes_use_the_kernel(shape):
  """At one row (decode at batch 1) γ is as large as the norm's input; the
  search must still reach the norm's output (it once stopped there)."""
  m, ids = PreLN(), jnp.arange(int(jnp.prod(jnp.array(shape)))).reshape(shape) % 40
  p = randomize(m.init(jax.random.PRNGKey(0), ids))
  ker = jaxfold.fold(p, m.apply, ids, norm_impl="interpret")
  assert _kernel_calls(ker.apply_fn, ker.params, ids) == [
      "rms_norm_fwd", "fused_add_rms_norm_fwd", "fused_add_rms_norm_fwd"]
  assert rel_err(m.apply(p, ids), ker.apply_fn(ker.params, ids)) < 2e-5


def test_auto_keeps_xla_on_cpu():
  m, ids = PreLN(), jnp.arange(14).reshape(2, 7) % 40
  p = randomize(m.init(jax.random.PRNGKey(0), ids))
  f = jaxfold.fold(p, m.apply, ids)
  if jax.default_backend() == "cpu":
    assert "pallas_call" not in str(jax.make_jaxpr(f.apply_fn)(f.params, ids))


def test_bad_norm_impl_is_named():
  m, ids = PreLN(), jnp.arange(14).reshape(2, 7) % 40
  p = m.init(jax.random.PRNGKey(0), ids)
  with pytest.raises(jaxfold.FoldError, match="norm_impl"):
    jaxfold.fold(p, m.apply, ids, norm_impl="cuda")


# --------------------------------------------------------------------------
# Fused residual add + RMSNorm.


def _epilogues(folded, *args):
  return folded.apply_fn.analysis_for(tuple(args)).plan.epilogues


def _kernel_calls(fn, *args, dtypes: bool = False) -> list:
  """Names of the pallas_calls in fn's jaxpr, in order (nested jaxprs included),
  with the dtype of the kernel's first input if ``dtypes``."""
  names = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        info = eqn.params.get("name_and_src_info") or eqn.params.get("name")
        name = str(getattr(info, "name", info))
        names.append((name, str(eqn.invars[0].aval.dtype)) if dtypes else name)
        continue
      for v in eqn.params.values():
        j = getattr(v, "jaxpr", v)
        if hasattr(j, "eqns"):
          walk(j)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return names


class Residual(nn.Module):
  """A pre-LN block; also returns differences of the sum's features (they
  cancel the fold's shift, so the sum itself is observable)."""
  hidden: int = 24
  op: str = "add"
  dtype: object = None

  @nn.compact
  def __call__(self, x):
    a = nn.Dense(self.hidden, dtype=self.dtype)(x)
    f = nn.Dense(self.hidden, dtype=self.dtype)(jnp.tanh(x))
    h = a + f if self.op == "add" else a - f
    y = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype)(h)
    d = h[..., : self.hidden // 2] - h[..., self.hidden // 2:]
    return nn.Dense(5, dtype=self.dtype)(jnp.tanh(y)), d, 2.0 * d


def _folds(m, x):
  p = randomize(m.init(jax.random.PRNGKey(1), x), seed=3)
  return p, jaxfold.fold(p, m.apply, x, norm_impl="interpret"), jaxfold.fold(p, m.apply, x, norm_impl="xla")


def test_fused_sum_is_the_value_used_downstream():
  m, x = Residual(), jax.random.normal(jax.random.PRNGKey(2), (3, 5, 16))
  p, ker, xla = _folds(m, x)
  (ep,) = _epilogues(ker, x)
  assert ep.add_path is not None
  assert _kernel_calls(ker.apply_fn, ker.params, x) == ["fused_add_rms_norm_fwd"]
  out, d, d2 = ker.apply_fn(ker.params, x)
  ref_out, ref_d, ref_d2 = xla.apply_fn(xla.params, x)
  # The kernel's sum replaces the add for every consumer: the same float32 sum.
  assert bool(jnp.array_equal(d, ref_d)) and bool(jnp.array_equal(d2, ref_d2))
  assert rel_err(ref_out, out) < 2e-6
  assert rel_err(m.apply(p, x), (out, d, d2)) < 2e-5


@pytest.mark.slow
def test_fused_kernel_gradients_match():
  m, x = Residual(), jax.random.normal(jax.random.PRNGKey(2), (3, 5, 16))
  p, ker, _ = _folds(m, x)
  r = jaxfold.cbwc(p, m.apply, x)

  def loss(fn, params):
    out, d, _ = fn(params, x)
    return jnp.sum(jnp.sin(out)) + jnp.sum(d * d) / 7

  g_ker = jax.grad(lambda q: loss(ker.apply_fn, q))(ker.params)
  g_xla = jax.grad(lambda q: loss(jaxfold.fold(p, m.apply, x, norm_impl="xla").apply_fn, q))(ker.params)
  assert rel_err(g_xla, g_ker) < 5e-5
  # And the original model's gradients, through CBWC (same function of p).
  assert rel_err(jax.grad(lambda q: loss(m.apply, q))(p), jax.grad(lambda q: loss(r.apply_fn, q))(p)) < 5e-5


def test_difference_is_not_fused():
  m, x = Residual(op="sub"), jax.random.normal(jax.random.PRNGKey(2), (3, 5, 16))
  p, ker, _ = _folds(m, x)
  (ep,) = _epilogues(ker, x)
  assert ep.add_path is None
  assert _kernel_calls(ker.apply_fn, ker.params, x) == ["rms_norm_fwd"]
  assert rel_err(m.apply(p, x), ker.apply_fn(ker.params, x)) < 2e-5


class Broadcast(nn.Module):
  explicit: bool = False

  @nn.compact
  def __call__(self, x):
    pos = self.param("pos", nn.initializers.normal(1.0), (1,) + x.shape[1:])
    h = nn.Dense(x.shape[-1])(x)
    # A (1, T, d) operand, or its full-size broadcast: fusing would make XLA
    # materialize the broadcast for the kernel, so the add stays in XLA.
    h = jax.lax.add(h, jnp.broadcast_to(pos, h.shape)) if self.explicit else h + pos
    return nn.LayerNorm()(h)


@pytest.mark.parametrize("explicit", [False, True])
def test_broadcast_add_is_not_fused(explicit):
  m, x = Broadcast(explicit), jax.random.normal(jax.random.PRNGKey(2), (3, 5, 16))
  p, ker, _ = _folds(m, x)
  (ep,) = _epilogues(ker, x)
  assert ep.add_path is None
  assert rel_err(m.apply(p, x), ker.apply_fn(ker.params, x)) < 2e-5


def test_bf16_stream_reads_the_source_and_fuses():
  # Flax's bf16 LayerNorm converts its input to float32 twice; the kernel reads
  # the bf16 sum itself (its float32 widening is the kernel's own).
  m, x = Residual(dtype=jnp.bfloat16), jax.random.normal(jax.random.PRNGKey(2), (4, 8, 16))
  p, ker, xla = _folds(m, x)
  (ep,) = _epilogues(ker, x)
  assert ep.add_path is not None
  assert _kernel_calls(ker.apply_fn, ker.params, x, dtypes=True) == [("fused_add_rms_norm_fwd", "bfloat16")]
  out, d, _ = ker.apply_fn(ker.params, x)
  ref_out, ref_d, _ = xla.apply_fn(xla.params, x)
  assert d.dtype == jnp.bfloat16 and bool(jnp.array_equal(d, ref_d))
  assert rel_err(ref_out, out) < 2e-2


def test_wider_output_reads_the_widened_value():
  # bf16 stream, float32 LayerNorm output (dtype=None, float32 γ/β): the kernel
  # must compute a float32 result, so it reads the float32 widening, unfused.
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(16, dtype=jnp.bfloat16)(x) + nn.Dense(16, dtype=jnp.bfloat16)(jnp.tanh(x))
      y = nn.LayerNorm()(h)
      assert y.dtype == jnp.float32
      return nn.Dense(5)(y).astype(jnp.bfloat16)

  x = jax.random.normal(jax.random.PRNGKey(2), (4, 8, 16))
  p, ker, xla = _folds(M(), x)
  (ep,) = _epilogues(ker, x)
  assert ep.add_path is None
  assert _kernel_calls(ker.apply_fn, ker.params, x, dtypes=True) == [("rms_norm_fwd", "float32")]
  assert rel_err(xla.apply_fn(xla.params, x), ker.apply_fn(ker.params, x)) < 1e-2


@pytest.mark.parametrize("rev", ["gamma", "beta"])
def test_a_reversed_gamma_or_beta_keeps_xla(rev):
  """``γ[::-1]`` (or ``β[::-1]``) in the norm's epilogue is a view of the
  parameter read backwards: the kernel takes its γ/β as stored, so the site
  keeps XLA's expression (the fold stays exact), at two shapes."""
  r = np.random.default_rng(4)
  p = {k: jnp.asarray(r.normal(size=s), jnp.float32) for k, s in
       (("w", (6, 16)), ("b", (16,)), ("g", (16,)), ("be", (16,)), ("w2", (16, 5)))}

  def apply(p, x):
    h = x @ p["w"] + p["b"]
    c = h - h.mean(-1, keepdims=True)
    g = p["g"][::-1] if rev == "gamma" else p["g"]
    be = p["be"][::-1] if rev == "beta" else p["be"]
    return (c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-5) * g + be) @ p["w2"]
  x = jax.random.normal(jax.random.PRNGKey(2), (3, 5, 6))
  ker = jaxfold.fold(p, apply, x, norm_impl="interpret")
  assert ker.report.num_folded == 1
  for xs in (x, x[:1, :2]):
    assert rel_err(apply(p, xs), ker.apply_fn(ker.params, xs)) < 2e-5


# The rc9 adversarial norms of test_adversarial run in float64, where no kernel runs (it computes in
# float32): here in float32, where norm_impl="interpret" substitutes the kernel wherever the proof accepts.
EPILOGUES = {"flax": (ln_flax, 1), "large_eps": (large_eps_ln, 1), "bessel_var": (bessel_ln, 0),
             "rsqrt_4var": (rsqrt_4var_ln, 0), "eps_outside_sqrt": (eps_outside_sqrt_ln, 0),
             "beta_before_gamma": (beta_before_gamma_ln, 1)}


@pytest.mark.parametrize("name", sorted(EPILOGUES))
def test_kernel_epilogue_near_misses_in_float32(name):
  """Only the kernel's exact formula (any ε) runs the kernel; a Bessel-corrected
  or rescaled variance and ε outside the root keep XLA's expression; with β
  before γ the kernel computes ``n + β`` (γ = 1) and XLA multiplies by γ.
  Every fold equals the original at two shapes."""
  ln, kernels = EPILOGUES[name]
  r = np.random.default_rng(5)
  p = {k: jnp.asarray(r.normal(size=s), jnp.float32) for k, s in
       (("w", (6, 32)), ("b", (32,)), ("g", (32,)), ("be", (32,)), ("w2", (32, 5)))}

  def apply(p, x):
    return ln(x @ p["w"] + p["b"], p["g"], p["be"]) @ p["w2"]
  x = jax.random.normal(jax.random.PRNGKey(3), (3, 5, 6))
  ker = jaxfold.fold(p, apply, x, norm_impl="interpret")
  assert ker.report.num_folded == 1 and len(_epilogues(ker, x)) == kernels
  for xs in (x, x[:1, :2]):
    assert rel_err(apply(p, xs), ker.apply_fn(ker.params, xs)) < 1e-4


def test_size_of_a_symbolic_operand_bounds_the_search_instead_of_raising():
  """At symbolic shapes (export's analysis) an operand's size is no int: jax raises
  InconclusiveDimensionOperation, which is no TypeError. The kernel proof's search
  bound treats such an operand as larger than any concrete one (the fuzz export test
  that once caught this no longer reaches it)."""
  import types

  from jaxfold._src import kernels
  sym = jax.export.symbolic_shape("b, 4")
  assert kernels._size(types.SimpleNamespace(shape=sym)) > kernels._size(types.SimpleNamespace(shape=(1 << 20, 4)))
  assert kernels._size(types.SimpleNamespace(shape=(3, 4))) == 12


def _ln_f32(h, g, b, eps=1e-5):
  c = h - h.mean(-1, keepdims=True)
  return c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + eps) * g + b


def test_a_centered_widening_of_the_source_is_what_the_kernel_reads():
  """A bf16 program input widened to float32 starts the stream of two norms (bf16
  outputs, like flax's ``dtype=bfloat16``): the fold inserts one auxiliary centering
  of the float32 widening (the bf16 input itself is also read raw, by the second
  output). The kernel of the first norm must then read that centered widening, not
  the bf16 source it exactly widens: reading the source normalized the uncentered
  input (0.54 off; mutant N2 of tests/mutation_study.py)."""
  bf = jnp.bfloat16
  r = np.random.default_rng(4)
  p = {k: jnp.asarray(r.normal(size=s), jnp.float32) for k, s in
       (("g1", (16,)), ("b1", (16,)), ("g2", (16,)), ("b2", (16,)), ("w1", (16, 16)), ("c1", (16,)),
        ("w2", (16, 5)))}

  def apply(p, x):
    xf = x.astype(jnp.float32)
    y1 = _ln_f32(xf, p["g1"], p["b1"]).astype(bf)
    h = xf + jnp.tanh(y1).astype(jnp.float32) @ p["w1"] + p["c1"]
    return _ln_f32(h, p["g2"], p["b2"]).astype(bf) @ p["w2"].astype(bf), x[..., :1] * 2
  x = (jax.random.normal(jax.random.PRNGKey(2), (3, 5, 16)) + 1.5).astype(bf)
  ker = jaxfold.fold(p, apply, x, norm_impl="interpret")
  xla = jaxfold.fold(p, apply, x, norm_impl="xla")
  assert ker.report.num_folded == 2 and ker.report.num_auxiliary == 1, str(ker.report)
  assert "centers the output of `convert_element_type`" in str(ker.report), str(ker.report)
  assert len(_epilogues(ker, x)) == 2
  for xs in (x, x[:1, :2]):
    want, got = xla.apply_fn(xla.params, xs), ker.apply_fn(ker.params, xs)
    assert rel_err(want, got) < 2e-2
    assert rel_err(apply(p, xs), got) < 2e-2


def test_a_norm_wider_than_its_source_keeps_xla(x64):
  """A float32 stream, centered in float32, then widened: the norm's statistic and
  output are float64. No value the float32 kernel could read gives a float64 result
  (mutant N3: the kernel read the float32 source and its float32 output was widened,
  8e-8 off XLA's expression), so the site keeps XLA's: bit-identical, at two shapes."""
  f32, f64 = jnp.float32, jnp.float64
  r = np.random.default_rng(4)
  p = {"w": jnp.asarray(r.normal(size=(6, 16)), f32), "b": jnp.asarray(r.normal(size=16), f32),
       "g": jnp.asarray(r.normal(size=16), f64), "be": jnp.asarray(r.normal(size=16), f64),
       "w2": jnp.asarray(r.normal(size=(16, 5)), f64)}

  def apply(p, x):
    h = x @ p["w"] + p["b"]
    c = (h - h.mean(-1, keepdims=True)).astype(f64)
    return (c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-5) * p["g"] + p["be"]) @ p["w2"]
  x = jax.random.normal(jax.random.PRNGKey(2), (3, 5, 6), f32)
  ker = jaxfold.fold(p, apply, x, norm_impl="interpret")
  xla = jaxfold.fold(p, apply, x, norm_impl="xla")
  assert ker.report.num_folded == 1 and _epilogues(ker, x) == ()
  for xs in (x, x[:1, :2]):
    got = ker.apply_fn(ker.params, xs)
    assert got.dtype == f64 and bool(jnp.array_equal(got, xla.apply_fn(xla.params, xs)))
    assert rel_err(apply(p, xs), got) < 1e-6
