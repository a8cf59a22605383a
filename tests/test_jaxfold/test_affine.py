"""jaxfold.fuse_affine: γ/β of folded norms moved into the contractions that read them.

Float64, random non-uniform γ, β and biases; fused and original must agree at
two input shapes. Sites whose output has another reader are refused, by name.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import real_eval
from conftest import rel_err
from zoo_fused import ZOO, ZOO_TOL, errors, fused, randomize_np

import jaxfold

D = 16


def _fuse(module, *xs, other=(), **kw):
  p = randomize_np(jax.eval_shape(module.init, jax.random.PRNGKey(0), *xs))
  fu = jaxfold.fuse_affine(jaxfold.fold(p, module.apply, *xs, **kw))
  for ys in [xs] + list(other):
    assert rel_err(module.apply(p, *ys), fu.apply_fn(fu.params, *ys)) < 1e-9
  return p, fu


def _x(*shape, seed=1):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float64)


class PreLN(nn.Module):
  bias: bool = True

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    h = h + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm(use_bias=self.bias)(h))))
    return nn.Dense(5)(nn.LayerNorm(use_bias=self.bias)(h))


@pytest.mark.parametrize("bias", [True, False])
def test_pre_ln_fuses_every_norm(x64, bias):
  p, fu = _fuse(PreLN(bias), _x(3, 7, 4), other=[(_x(2, 5, 4, seed=2),)])
  assert fu.report.num_fused == 2
  removed = [x for x in jax.tree_util.tree_leaves(fu.params.params, is_leaf=lambda x: x is None)
             if x is None]
  assert len(removed) == (4 if bias else 2)          # γ (and β) of both norms
  assert bool(fu.params.extras) == bias               # β·W biases only when there is a β


def test_bias_is_what_makes_it_exact(x64):
  x = _x(3, 7, 4)
  p, fu = _fuse(PreLN(), x)
  zeroed = fu.params._replace(extras={k: 0 * v for k, v in fu.params.extras.items()})
  assert rel_err(PreLN().apply(p, x), fu.apply_fn(zeroed, x)) > 1e-3


class Tied(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(D)
    h = nn.Dense(D)(x)
    return dense(nn.LayerNorm()(h)) + dense(x)         # one kernel, two readers


def test_weight_with_another_use_gets_an_untied_copy(x64):
  p, fu = _fuse(Tied(), _x(3, D))
  assert fu.report.num_fused == 1 and fu.report.extra_bytes > 0
  assert any("@fused" in k for k in fu.params.extras)


class PostLN(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(nn.Dense(D)(x))
    return nn.LayerNorm()(h + nn.Dense(D)(h))          # the residual reads the norm output


class Gelu(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.gelu(nn.LayerNorm()(nn.Dense(D)(x))))


class OtherAxis(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.LayerNorm()(nn.Dense(D)(x))                 # normalized over features
    w = self.param("w", nn.initializers.normal(), (x.shape[1], 3))
    return jnp.einsum("bsd,sk->bdk", y, w)             # contracted over the sequence


class GammaElsewhere(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    g = self.param("g", nn.initializers.ones, (D,))
    n = h * jax.lax.rsqrt(jnp.mean(jnp.square(h - h.mean(-1, keepdims=True)), -1, keepdims=True)
                          + 1e-6)
    return nn.Dense(3)(n * g) + g[:3]                  # γ also reaches the output directly


@pytest.mark.parametrize("module, shape, why", [
    (PostLN(), (3, 4), "`add` reads it"),
    (Gelu(), (3, 4), "not a contraction"),
    (OtherAxis(), (2, 5, 4), "not contract exactly the normalized dim"),
])
def test_refused_with_reason(x64, module, shape, why):
  _, fu = _fuse(module, _x(*shape))
  kept = [s for s in fu.report.sites if not s.fused]
  assert kept and all("not fused" in s.reason for s in kept)
  assert any(why in s.reason for s in kept), [s.reason for s in kept]


def test_gamma_with_another_use_is_not_fused(x64):
  _, fu = _fuse(GammaElsewhere(), _x(3, 4))
  assert fu.report.num_fused == 0


def test_takes_only_fused_params(x64):
  x = _x(3, 7, 4)
  p, fu = _fuse(PreLN(), x)
  with pytest.raises(jaxfold.FuseError, match="jaxfold.Params"):
    fu.apply_fn(p, x)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_fused_equals_original(x64, name):
  folded, fu = fused(name)
  assert fu.report.num_fused == folded.report.num_folded == len(fu.report.sites)
  assert max(errors(name, fu)) < ZOO_TOL


def test_post_ln_bert_refused(x64):
  from zoo_fused import inputs, original
  apply, p = original("bert-tiny")
  folded = jaxfold.fold(p, apply, *inputs("bert-tiny", 2, 8))
  fu = jaxfold.fuse_affine(folded)
  assert fu.report.num_fused == 0 and len(fu.report.sites) == 5
  assert all("not fused" in s.reason for s in fu.report.sites)
  assert max(errors("bert-tiny", fu)) < ZOO_TOL


def test_fold_flag_is_the_composition(x64):
  x = _x(3, 7, 4)
  p = randomize_np(jax.eval_shape(PreLN().init, jax.random.PRNGKey(0), x))
  fu = jaxfold.fold(p, PreLN().apply, x, fuse_affine=True)
  assert isinstance(fu, jaxfold.Fused) and fu.report.num_fused == 2
  assert rel_err(PreLN().apply(p, x), fu.apply_fn(fu.params, x)) < 1e-9


class Readers(nn.Module):
  """DenseGeneral (kernel reshaped at use) and an einsum whose output is transposed."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    y = nn.LayerNorm()(h)
    q = nn.DenseGeneral((4, D // 4))(y)
    w = self.param("w", nn.initializers.normal(), (D, 5))
    e = jnp.einsum("bsd,dk->bks", y, w)
    h = h + nn.DenseGeneral(D, axis=(-2, -1))(q)
    return nn.Dense(3)(nn.LayerNorm()(h)), e


def test_dense_general_and_einsum_readers(x64):
  x = _x(2, 5, 3)
  _, fu = _fuse(Readers(), x, other=[(_x(3, 4, 3, seed=2),)])
  assert fu.report.num_fused == 2
  assert len(fu.report.sites[0].readers) == 2


# --------------------------------------------------------------------------
# Deployed models: bf16/f16 programs (a cast between the norm and its matmul)
# and folds whose norms run as the Pallas RMSNorm kernel.


class Cast(nn.Module):
  """A pre-LN block as a deployed model writes it: flax computes the norm in
  float32 and casts its output to the compute dtype for the matmul."""
  dtype: object = jnp.bfloat16
  bias: bool = True

  @nn.compact
  def __call__(self, x):
    dense = lambda n: nn.Dense(n, dtype=self.dtype, param_dtype=self.dtype)
    norm = lambda: nn.LayerNorm(epsilon=1e-5, use_bias=self.bias, dtype=self.dtype,
                                param_dtype=self.dtype)
    h = dense(D)(x)
    h = h + dense(D)(nn.gelu(dense(2 * D)(norm()(h))))
    return dense(5)(norm()(h))


def _low(module, shape, dtype, seed=0):
  x = _x(*shape).astype(dtype)
  p = randomize_np(jax.eval_shape(module.init, jax.random.PRNGKey(0), x), seed)
  return jax.tree_util.tree_map(lambda a: a.astype(dtype), p), x


def _real_fold_fuse(folded, fu, p, xs):
  """The fold's and the fusion's parameters re-made from ``p``'s values in
  float64 (exact: they are bf16/f16 values), with the analyses the low-precision
  program was given: what real arithmetic says the deployed parameters are."""
  from jaxfold import Params
  from jaxfold._src import affine, layout
  leaves, tree = jax.tree_util.tree_flatten(p)
  wide = [np.asarray(w, np.float64) for w in leaves]
  fan = folded.apply_fn.analysis_for(xs)
  specs = dict(fan.leaf_specs)
  centered = [jnp.asarray(layout.center(w, dict(specs[i])) if i in specs else w)
              for i, w in enumerate(wide)]
  untied = {name: jnp.asarray(layout.center(wide[i], dict(spec))) for name, i, spec in fan.untied}
  folded64 = Params(jax.tree_util.tree_unflatten(tree, centered), untied)
  leaves64, tree64 = jax.tree_util.tree_flatten(folded64)
  return affine._fused_params(fu.apply_fn.analysis_for(xs), leaves64, tree64, np.float64)


def _real(fn, params, params_real, *xs):
  closed = jax.make_jaxpr(fn)(params, *xs)
  outs = real_eval.run(closed, jax.tree_util.tree_leaves((params_real, xs)))
  return outs


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_low_precision_fuses_exactly_in_real_arithmetic(x64, dtype, bias):
  m = Cast(dtype, bias)
  p, x = _low(m, (3, 7, 4), dtype)
  folded = jaxfold.fold(p, m.apply, x, norm_impl="xla")
  fu = jaxfold.fuse_affine(folded)
  name = jnp.dtype(dtype).name
  assert folded.report.num_folded == 2 and fu.report.num_fused == 2, str(fu.report)
  assert all(f"cast to {name}" in s.reason for s in fu.report.sites)
  # The program still holds the casts (it is the bf16 program), and the float64
  # re-evaluation of both programs (every cast the identity) agrees to ~1e-12 at
  # two shapes: the fusion is exact in real arithmetic.
  assert "convert_element_type" in str(jax.make_jaxpr(fu.apply_fn)(fu.params, x))
  for xs in [(x,), (_x(2, 5, 4, seed=2).astype(dtype),)]:
    p64 = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)
    ref = _real(m.apply, p, p64, *xs)
    got = _real(fu.apply_fn, fu.params, _real_fold_fuse(folded, fu, p, xs), *xs)
    assert rel_err(ref, got) < 1e-9
    # and the real check can fail: the same fused program without its β·W biases
    if bias:
      broken = _real_fold_fuse(folded, fu, p, xs)
      broken = broken._replace(extras={k: 0 * v if "@bias" in k else v
                                       for k, v in broken.extras.items()})
      assert rel_err(ref, _real(fu.apply_fn, fu.params, broken, *xs)) > 1e-3


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.slow
def test_low_precision_rounds_like_the_unfused_model(x64, dtype):
  """Fusing moves γ's and β's rounding from the activation into W' = γ·W and the
  bias β·W: one rounding per operand, as in the unfused model. So against the
  exact function (the real-arithmetic evaluation), the fused model is as
  accurate as the unfused one — within a factor 2 of its error (measured
  0.6-1.4× over seeds) — and the two differ by at most 4 ulps of 1 in the
  compute dtype (measured ≤ 1.1 ulp: bf16 ≤ 0.0080, f16 ≤ 0.0010)."""
  m = Cast(dtype)
  p, x = _low(m, (3, 7, 4), dtype, seed=1)
  fu = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x, norm_impl="xla"))
  p64 = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)
  eps = float(jnp.finfo(dtype).eps)
  for xs in [(x,), (_x(2, 5, 4, seed=2).astype(dtype),)]:
    exact = _real(m.apply, p, p64, *xs)
    orig, new = m.apply(p, *xs), fu.apply_fn(fu.params, *xs)
    assert rel_err(exact, new) <= 2 * rel_err(exact, orig)
    assert rel_err(orig, new) <= 4 * eps


@pytest.mark.parametrize("name", [ZOO[0]] + [pytest.param(n, marks=pytest.mark.slow) for n in ZOO[1:]])
def test_zoo_bf16_fuses_every_folded_site_exactly(x64, name):
  from zoo_fused import inputs, original, shapes
  apply, p = original(name)
  p = _bf16(p)
  folded = jaxfold.fold(p, apply, *_bf16(inputs(name, *shapes(name)[0])), tied_weights="copy")
  fu = jaxfold.fuse_affine(folded)
  assert fu.report.num_fused == folded.report.num_folded == len(fu.report.sites) > 0
  p64 = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64) if _is_float(a) else a, p)
  for b, s in shapes(name):
    xs = tuple(_bf16(inputs(name, b, s)))
    exact = _real(apply, p, p64, *xs)
    assert rel_err(exact, _real(fu.apply_fn, fu.params, _real_fold_fuse(folded, fu, p, xs), *xs)) < 1e-9


def _is_float(a):
  return jnp.issubdtype(a.dtype, jnp.floating)


def _bf16(tree):
  return jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16) if _is_float(a) else a, tree)


class Quantized(nn.Module):
  emulated: bool = False

  @nn.compact
  def __call__(self, x):
    y = nn.LayerNorm()(nn.Dense(D)(x))
    if self.emulated:   # float8 e4m3 rounding emulated in float32
      return nn.Dense(3)(jax.lax.reduce_precision(y, exponent_bits=4, mantissa_bits=3))
    return nn.Dense(3)(y.astype(jnp.float8_e4m3fn).astype(jnp.float32))


@pytest.mark.parametrize("emulated", [False, True])
def test_float8_cast_is_a_quantizer_not_fused(x64, emulated):
  x = _x(3, 4).astype(jnp.float32)
  m = Quantized(emulated)
  p = randomize_np(jax.eval_shape(m.init, jax.random.PRNGKey(0), x))
  p = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), p)
  fu = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
  assert len(fu.report.sites) == 1 and fu.report.num_fused == 0
  assert "quantizes" in fu.report.sites[0].reason, fu.report.sites[0].reason


def test_float16_overflow_of_fused_weights_is_refused(x64):
  m = Cast(jnp.float16)
  p, x = _low(m, (3, 7, 4), jnp.float16)
  big = jax.tree_util.tree_map_with_path(
      lambda path, a: a * 1000 if "LayerNorm_1" in jax.tree_util.keystr(path) or "Dense_3" in
      jax.tree_util.keystr(path) else a, p)
  with pytest.raises(jaxfold.FuseError, match="overflows float16"):
    jaxfold.fuse_affine(jaxfold.fold(big, m.apply, x, norm_impl="xla"))


# Folds whose norms run as the Pallas RMSNorm kernel ("interpret": the kernel
# itself, on the CPU; "pallas": the kernel when lowered for CUDA).


def _pallas_names(fn, *args):
  from test_kernels import _kernel_calls
  return _kernel_calls(fn, *args)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_fold_fuses_and_runs_the_kernel_without_gamma_beta(dtype):
  m = Cast(dtype)
  x = _x(3, 7, 4).astype(dtype)
  p = jax.tree_util.tree_map(lambda a: a.astype(dtype),
                             randomize_np(jax.eval_shape(m.init, jax.random.PRNGKey(0), x)))
  ker = jaxfold.fold(p, m.apply, x, norm_impl="interpret")
  fu = jaxfold.fuse_affine(ker)
  fx = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x, norm_impl="xla"))
  assert fu.report.num_fused == fx.report.num_fused == 2 and fu.report.kernels == 2
  assert all("RMSNorm kernel" in s.reason and "without γ, β" in s.reason for s in fu.report.sites)
  eps = fu.apply_fn.analysis_for((x,)).plan.epilogues
  assert len(eps) == 2 and all(e.gamma is None and e.beta is None for e in eps)
  assert [e.add_path is not None for e in eps] == [False, True]
  # The fused program runs the fold's kernels (the residual add fused), with
  # the fold's own program untouched by fuse_affine's XLA-level trace.
  names = ["rms_norm_fwd", "fused_add_rms_norm_fwd"]
  assert _pallas_names(ker.apply_fn, ker.params, x) == names
  assert _pallas_names(fu.apply_fn, fu.params, x) == names
  assert "pallas_call" not in str(jax.make_jaxpr(fx.apply_fn)(fx.params, x))
  tol = 2e-6 if dtype == jnp.float32 else 4 * float(jnp.finfo(dtype).eps)
  for xs in [(x,), (_x(2, 5, 4, seed=2).astype(dtype),)]:
    assert rel_err(fx.apply_fn(fx.params, *xs), fu.apply_fn(fu.params, *xs)) < tol
    if dtype == jnp.float32:
      assert rel_err(m.apply(p, *xs), fu.apply_fn(fu.params, *xs)) < 2e-5


def test_pallas_fold_fuses_as_the_xla_fold():
  """norm_impl="pallas" on a CPU host: the same fusions, the kernels proved
  (they run when lowered for CUDA; here the XLA expression)."""
  m, x = Cast(jnp.float32), _x(3, 7, 4).astype(jnp.float32)
  p = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32),
                             randomize_np(jax.eval_shape(m.init, jax.random.PRNGKey(0), x)))
  fu = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x, norm_impl="pallas"))
  assert fu.report.num_fused == 2 and fu.report.kernels == 2 and fu.report.norm_impl == "pallas"
  plan = fu.apply_fn.analysis_for((x,)).plan
  assert plan.norm_impl == "pallas" and all(e.gamma is None for e in plan.epilogues)
  assert rel_err(m.apply(p, x), fu.apply_fn(fu.params, x)) < 2e-5


def test_kept_site_keeps_its_kernel_with_gamma_beta():
  x = _x(3, 7, 4).astype(jnp.float32)
  p = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32),
                             randomize_np(jax.eval_shape(Gelu().init, jax.random.PRNGKey(0), x)))
  ker = jaxfold.fold(p, Gelu().apply, x, norm_impl="interpret")
  fu = jaxfold.fuse_affine(ker)
  (site,) = fu.report.sites
  assert not site.fused and "not a contraction" in site.reason and "with its γ, β" in site.reason
  (ep,) = fu.apply_fn.analysis_for((x,)).plan.epilogues
  assert ep.gamma is not None and ep.beta is not None
  assert _pallas_names(fu.apply_fn, fu.params, x) == ["rms_norm_fwd"]
  assert rel_err(Gelu().apply(p, x), fu.apply_fn(fu.params, x)) < 2e-5


@pytest.mark.parametrize("module,dtype", [(PreLN(), jnp.float32), (Tied(), jnp.float32),
                                          (Cast(), jnp.bfloat16)])
def test_abstract_params_fuse_to_the_shapes_of_concrete_ones(x64, module, dtype):
  """A fold of ShapeDtypeStructs (a deviceless compile, a 70B plan) fuses to the
  shapes and dtypes the concrete fuse produces, without computing anything."""
  x = _x(3, 7, D if isinstance(module, Tied) else 4).astype(dtype)
  p = randomize_np(jax.eval_shape(module.init, jax.random.PRNGKey(0), x))
  p = jax.tree_util.tree_map(lambda a: a.astype(dtype), p)
  concrete = jaxfold.fuse_affine(jaxfold.fold(p, module.apply, x))
  abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), p)
  fu = jaxfold.fuse_affine(jaxfold.fold(abstract, module.apply, x))
  assert fu.report.num_fused == concrete.report.num_fused >= 1
  shapes = lambda t: [(tuple(a.shape), jnp.dtype(a.dtype)) for a in jax.tree_util.tree_leaves(t)]  # noqa: E731
  assert shapes(fu.params) == shapes(concrete.params)
  assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree_util.tree_leaves(fu.params))
  out = jax.eval_shape(fu.apply_fn, fu.params, x)
  assert out.shape == module.apply(p, x).shape


@pytest.mark.parametrize("transform", ["fuse_affine", "defer_norms"])
def test_new_biases_serve_inputs_of_other_ranks(x64, transform):
  """Fused at rank 3, called at ranks 2, 3 and 4, with W on either side of the
  contraction: a new bias β·W keeps its values and only moves its size-1 axes
  (was "call fuse_affine again" at any other rank)."""
  rng = np.random.default_rng(0)
  p = {k: jnp.asarray(rng.normal(size=s)) for k, s in
       dict(W=(5, 8), b=(8,), g=(8,), be=(8,), V=(8, 3), U=(3, 8), c=(3,)).items()}

  def f(p, x):
    h = x @ p["W"] + p["b"]
    m = h.mean(-1, keepdims=True)
    y = (h - m) / jnp.sqrt(((h - m) ** 2).mean(-1, keepdims=True) + 1e-5) * p["g"] + p["be"]
    w_left = jnp.tensordot(p["U"], y, axes=((1,), (y.ndim - 1,)))   # U on the left: (3, ...)
    return y @ p["V"] + p["c"], jnp.moveaxis(w_left, 0, -1)

  fu = jaxfold.fold(p, f, jnp.asarray(rng.normal(size=(2, 4, 5))), **{transform: True})
  assert fu.report.num_fused == 1 and len(fu.params.extras) == 2
  for shape in [(6, 5), (3, 7, 5), (1, 1, 5), (2, 2, 3, 5)]:
    x = jnp.asarray(rng.normal(size=shape))
    assert rel_err(f(p, x), jax.jit(fu.apply_fn)(fu.params, x)) < 1e-12, shape


# γ or β cast on its own way to the norm's output (``g.astype(bf16)`` in a float32 program:
# rounded, then promoted back). A real cast is the identity in real arithmetic and fuses,
# reported as such; a quantizing one is named as what keeps the site (before: the bfloat16
# round trip hid γ from the match at the β add, and the site was "kept" because "`add`
# reads it"; a float8 γ made no site at all).

GD = 8


def _gamma_cast_block(cast_g, cast_b):
  def ln(h, g, b):
    c = h - h.mean(-1, keepdims=True)
    return c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-5) * cast_g(g) + cast_b(b)

  def apply(p, x):
    h = x @ p["w1"] + p["b1"]
    h = h + jax.nn.gelu(ln(h, p["g1"], p["be1"]) @ p["w2"] + p["b2"]) @ p["w3"]
    return ln(h, p["g2"], p["be2"]) @ p["wo"]
  return apply


def _gamma_cast_params(seed=0):
  rng = np.random.default_rng(seed)
  shapes = dict(w1=(4, GD), b1=(GD,), g1=(GD,), be1=(GD,), w2=(GD, 2 * GD), b2=(2 * GD,), w3=(2 * GD, GD),
                g2=(GD,), be2=(GD,), wo=(GD, 3))
  out = {}
  for k, s in shapes.items():
    n = rng.standard_normal(s)
    out[k] = (1 + 0.5 * n if k[0] == "g" else 0.3 + 0.5 * n if k[0] == "b" else n / np.sqrt(s[0]))
  return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), out)


_BF16 = lambda v: v.astype(jnp.bfloat16)         # noqa: E731 - promoted back to float32 by the product
_F8 = lambda v: v.astype(jnp.float8_e4m3fn).astype(jnp.float32)   # noqa: E731
_SAME = lambda v: v                               # noqa: E731


@pytest.mark.parametrize("cast_g, cast_b", [(_BF16, _SAME), (_BF16, _BF16)], ids=["γ", "γ and β"])
def test_a_bf16_cast_of_gamma_itself_fuses_exactly_in_real_arithmetic(x64, cast_g, cast_b):
  f, p = _gamma_cast_block(cast_g, cast_b), _gamma_cast_params()
  x = _x(3, 7, 4).astype(jnp.float32)
  folded = jaxfold.fold(p, f, x, norm_impl="xla")
  fu = jaxfold.fuse_affine(folded)
  assert folded.report.num_folded == 2 and fu.report.num_fused == 2, str(fu.report)
  assert all("cast to bfloat16" in s.reason and s.beta for s in fu.report.sites), str(fu.report)
  p64 = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)
  for xs in [(x,), (_x(2, 5, 4, seed=2).astype(jnp.float32),)]:
    ref = _real(f, p, p64, *xs)
    assert rel_err(ref, _real(fu.apply_fn, fu.params, _real_fold_fuse(folded, fu, p, xs), *xs)) < 1e-9


@pytest.mark.parametrize("cast_g, cast_b, why", [(_F8, _SAME, "γ is cast to float8_e4m3fn"),
                                                 (_SAME, _F8, "β is cast to float8_e4m3fn")], ids=["γ", "β"])
def test_a_float8_cast_of_gamma_or_beta_keeps_the_site_and_is_named(x64, cast_g, cast_b, why):
  f, p = _gamma_cast_block(cast_g, cast_b), _gamma_cast_params()
  x = _x(3, 7, 4).astype(jnp.float32)
  folded = jaxfold.fold(p, f, x, norm_impl="xla")
  fu = jaxfold.fuse_affine(folded)
  assert folded.report.num_folded == 2 and fu.report.num_fused == 0 and len(fu.report.sites) == 2, str(fu.report)
  assert all(why in s.reason and "quantiz" in s.reason for s in fu.report.sites), str(fu.report)
  for xs in [(x,), (_x(2, 5, 4, seed=2).astype(jnp.float32),)]:
    assert rel_err(f(p, *xs), fu.apply_fn(fu.params, *xs)) < 1e-5
