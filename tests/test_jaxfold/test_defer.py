"""jaxfold.defer_norms: fused RMS norms whose readers contract the un-normalized input.

Float64, random non-uniform γ, β and biases; deferred and *original* (unfolded)
must agree to 1e-9 at two input shapes. Programs where deferral would be wrong
are refused with the reader or construct named, and still compute the original.
"""

import collections
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from zoo_fused import ZOO, errors, fused, randomize_np

import jaxfold
from jaxfold._src import compat, compiled, defer_analysis

D = 16


def _x(*shape, seed=1, dtype=jnp.float64):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, dtype)


def _defer(module, *xs, other=(), **kw):
  p = randomize_np(jax.eval_shape(module.init, jax.random.PRNGKey(0), *xs))
  d = jaxfold.fold(p, module.apply, *xs, defer_norms=True, **kw)
  for ys in [xs] + list(other):
    assert rel_err(module.apply(p, *ys), d.apply_fn(d.params, *ys)) < 1e-9
  return p, d


def _live_eqns(jaxpr):
  """The equations an output depends on (top level; no effects in these programs)."""
  live = {v for v in jaxpr.outvars if compat.is_var(v)}
  out = []
  for eqn in reversed(jaxpr.eqns):
    if any(v in live for v in eqn.outvars):
      out.append(eqn)
      live |= {v for v in eqn.invars if compat.is_var(v)}
  return out[::-1]


def normalized_reads(fn, *args) -> int:
  """Live contractions with an operand computed from an rsqrt or sqrt within four
  steps: the ones that read a normalized tensor."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  made = {v: e for e in jaxpr.eqns for v in e.outvars}
  count = 0
  for eqn in _live_eqns(jaxpr):
    if eqn.primitive.name != "dot_general":
      continue
    frontier, hit = list(eqn.invars), False
    for _ in range(4):
      nxt = []
      for v in frontier:
        e = made.get(v) if compat.is_var(v) else None
        if e is None:
          continue
        hit |= e.primitive.name in ("rsqrt", "sqrt")
        nxt += list(e.invars)
      frontier = nxt
    count += hit
  return count


class PreLN(nn.Module):
  bias: bool = True

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    h = h + nn.Dense(D)(nn.gelu(nn.Dense(2 * D, use_bias=self.bias)(nn.LayerNorm(use_bias=self.bias)(h))))
    return nn.Dense(5)(nn.LayerNorm(use_bias=self.bias)(h))


@pytest.mark.parametrize("bias", [True, False])
def test_pre_ln_defers_every_norm(x64, bias):
  x = _x(3, 7, 4)
  p, d = _defer(PreLN(bias), x, other=[(_x(2, 5, 4, seed=2),)])
  assert isinstance(d, jaxfold.Fused)
  assert d.report.num_fused == 2 and d.report.num_deferred == 2
  assert all(s.deferred and s.readers for s in d.report.deferred)
  # The normalized tensor is dead code: no live contraction reads it (the
  # fused model's readers all do).
  fu = jaxfold.fuse_affine(jaxfold.fold(p, PreLN(bias).apply, x))
  assert normalized_reads(fu.apply_fn, fu.params, x) == 2
  assert normalized_reads(d.apply_fn, d.params, x) == 0
  assert "2/2 fused norms deferred" in str(d.report)


def test_defer_norms_of_a_fused_model(x64):
  x = _x(3, 7, 4)
  p = randomize_np(jax.eval_shape(PreLN().init, jax.random.PRNGKey(0), x))
  fu = jaxfold.fuse_affine(jaxfold.fold(p, PreLN().apply, x))
  d = jaxfold.defer_norms(fu)
  assert d.report.num_deferred == 2 and fu.report.deferred == ()
  # Same parameters as the fused model: deferral only changes the program.
  assert d.params is fu.params
  assert rel_err(PreLN().apply(p, x), d.apply_fn(d.params, x)) < 1e-9
  assert rel_err(PreLN().apply(p, x), jax.jit(d.apply_fn)(d.params, x)) < 1e-9


def test_the_statistic_is_what_makes_it_exact(x64, monkeypatch):
  """Tripwires: the comparison fails when a reader is scaled by another norm's
  statistic, or not scaled at all."""
  x = _x(3, 7, 4)
  p, d = _defer(PreLN(), x)
  ref = PreLN().apply(p, x)
  sig = (d.apply_fn.bind((x,)).key, None)      # the wrapper's cache key for this call
  an = d.apply_fn.analysis_for((x,))
  e0, e1 = an.plan.deferred[0], an.plan.deferred[-1]
  assert e0.s != e1.s
  # (the later reader, scaled by the earlier norm's statistic)
  wrong = dataclasses.replace(an.plan, deferred=an.plan.deferred[:-1]
                              + (dataclasses.replace(e1, s=e0.s),))
  with monkeypatch.context() as m:
    m.setitem(d.apply_fn._cache, sig, dataclasses.replace(an, plan=wrong))
    assert rel_err(ref, d.apply_fn(d.params, x)) > 1e-3
  assert rel_err(ref, d.apply_fn(d.params, x)) < 1e-9

  def unscaled(entry, eqn, invals, values, *_):
    ins = list(invals)
    ins[entry.operand] = values[entry.x]
    return compat.bind_eqn(eqn, ins), False
  monkeypatch.setattr(defer_analysis, "run", unscaled)
  monkeypatch.setattr(compiled, "_CACHE", collections.OrderedDict())   # (re-trace: no program compiled before)
  assert rel_err(ref, d.apply_fn(d.params, x)) > 1e-3


def test_composes_with_rotate(x64):
  from test_rotate import hadamard
  _, fu = fused("gpt2-tiny")
  d = jaxfold.defer_norms(fu)
  rotated = jaxfold.rotate(d, hadamard(32))
  assert max(errors("gpt2-tiny", rotated)) < 1e-9
  with pytest.raises(jaxfold.FuseError, match="before rotate"):
    jaxfold.defer_norms(rotated)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_deferred_equals_original(x64, name):
  folded, fu = fused(name)
  d = jaxfold.defer_norms(fu)
  assert d.report.num_deferred == fu.report.num_fused == folded.report.num_folded
  assert max(errors(name, d)) < 1e-9
  from zoo_fused import inputs, shapes
  ids = inputs(name, *shapes(name)[0])
  assert normalized_reads(fu.apply_fn, fu.params, *ids) > 0
  assert normalized_reads(d.apply_fn, d.params, *ids) == 0


def test_post_ln_bert_nothing_deferred(x64):
  folded, fu = fused("bert-tiny")
  d = jaxfold.defer_norms(fu)
  assert d.report.num_deferred == 0 and len(d.report.deferred) == 5
  assert all("not deferred: not fused" in s.reason for s in d.report.deferred)
  assert max(errors("bert-tiny", d)) < 1e-9


# ----------------------------------------------------------------------------
# Programs where deferral would be wrong: refused, by name, and still exact.


def _ln(h, g, b, axis=-1):
  m = h.mean(axis, keepdims=True)
  v = jnp.square(h - m).mean(axis, keepdims=True)
  return (h - m) * jax.lax.rsqrt(v + 1e-6) * g + b


def _params(rng, **shapes):
  return {k: jnp.asarray((1.0 + 0.5 * rng.normal(size=s)) if len(s) == 1 else 0.3 * rng.normal(size=s))
          for k, s in shapes.items()}


def _base(rng, extra=()):
  return _params(rng, w1=(4, D), b1=(D,), g=(D,), beta=(D,), w2=(D, 6), b2=(6,), w3=(6, 3),
                 **dict(extra))


def _stem(p, x):
  return x @ p["w1"] + p["b1"]


def elementwise_too(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return y @ p["w2"] + y[..., :6] * 2.0                 # y is also read elementwise


def other_axis(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return jnp.einsum("bsd,sk->bdk", y, p["ws"])          # contracted over the sequence


def residual(p, x):
  h = _stem(p, x)
  y = _ln(h, p["g"], p["beta"])
  z = y + jnp.tanh(y @ p["w2"] @ p["w3"] @ p["w4"])     # the residual reads y
  return _ln(z, p["g2"], p["beta2"]) @ p["w2"]


def data_dependent(p, x):
  h = _stem(p, x)
  y = _ln(h, p["g"], p["beta"])
  return y @ jnp.einsum("bsd,bse->de", h, h)            # the other operand is data


def in_cond(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return jax.lax.cond(x[0, 0, 0] > 0, lambda y: y @ p["w2"], lambda y: 2.0 * (y @ p["w2"]), y)


def in_scan(p, x):
  def body(h, w):
    return h + jnp.tanh(_ln(h, p["g"], p["beta"]) @ w), None
  h, _ = jax.lax.scan(body, _stem(p, x), jnp.stack([p["wl"], 2 * p["wl"]]))
  return h @ p["w2"]


def rows_averaged(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return y[:, 1:3].mean(1) @ p["w2"]                    # rows mixed before the contraction


def swish_affine(p, x):
  h = _stem(p, x)
  return (p["g"] * (h * jax.nn.sigmoid(h)) + p["beta"]) @ p["w2"]   # γ ⊙ K + β, no statistic


def stat_over_tokens(p, x):
  h = _stem(p, x)
  s = jax.lax.rsqrt(jnp.square(h).mean(1, keepdims=True) + 1e-6)   # one value per feature
  return (h * s * p["g"] + p["beta"]) @ p["w2"]


NO_STAT = "not γ ⊙ x ⊙ s + β with a statistic s constant along the normalized dim"
ADVERSARIAL = [  # (program, extra parameters, reason of the first site, sites deferred)
    (elementwise_too, {}, "not fused: `slice` reads it", 0),
    (other_axis, {"ws": (7, 3)}, "not contract exactly the normalized dim", 0),
    (residual, {"w4": (3, D), "g2": (D,), "beta2": (D,)}, "not fused: `add` reads it", 1),
    (data_dependent, {}, "an operand that is not a parameter", 0),
    (in_cond, {}, "not fused", 0),
    (rows_averaged, {}, "reader w2 [at", 0),
    (swish_affine, {}, NO_STAT, 0),
    (stat_over_tokens, {}, NO_STAT, 0),
]


@pytest.mark.parametrize("fn, extra, why, n", ADVERSARIAL, ids=[a[0].__name__ for a in ADVERSARIAL])
def test_refused_with_reason(x64, fn, extra, why, n):
  rng = np.random.default_rng(0)
  p = _base(rng, extra.items())
  for shape in [(3, 7, 4), (2, 7, 4)]:
    x = _x(*shape)
    d = jaxfold.fold(p, fn, x, defer_norms=True)
    first = d.report.deferred[0]
    assert not first.deferred and why in first.reason, first.reason
    assert d.report.num_deferred == n
    assert rel_err(fn(p, x), d.apply_fn(d.params, x)) < 1e-9


def test_scan_body_norms_are_not_deferred(x64):
  rng = np.random.default_rng(0)
  p = _base(rng, {"wl": (D, D)}.items())
  x = _x(3, 7, 4)
  d = jaxfold.fold(p, in_scan, x, defer_norms=True)
  assert d.report.num_deferred == 0
  assert rel_err(in_scan(p, x), d.apply_fn(d.params, x)) < 1e-9
  assert rel_err(in_scan(p, _x(2, 3, 4)), d.apply_fn(d.params, _x(2, 3, 4))) < 1e-9


# ----------------------------------------------------------------------------
# Readers where deferral is right.


def bias_then_gelu(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return jax.nn.gelu(y @ p["w2"] + p["b2"]) @ p["w3"]   # the reader's bias comes after the scale


def transposed_reader(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return jnp.swapaxes(y, 0, 1) @ p["w2"] + jnp.einsum("bsd,dk->skb", y, p["w5"]).sum(1)[..., None]


def class_token(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return y[:, 0] @ p["w2"] + y[:, 2] @ p["w2"]           # rows sliced before the contraction


def rhs_reader(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  out = jax.lax.dot_general(p["w2"], y, (((0,), (2,)), ((), ())))   # y is the right operand
  return jnp.moveaxis(out, 0, -1) + p["b2"]


def divided_norm(p, x):
  h = _stem(p, x)
  m = h.mean(-1, keepdims=True)
  y = (h - m) / jnp.sqrt(jnp.square(h - m).mean(-1, keepdims=True) + 1e-5) * p["g"] + p["beta"]
  return y @ p["w2"]                                    # the statistic divides: x / s


@pytest.mark.parametrize("fn", [bias_then_gelu, transposed_reader, class_token, rhs_reader,
                                divided_norm])
def test_deferred_readers(x64, fn):
  rng = np.random.default_rng(1)
  p = _base(rng, {"w5": (D, 5)}.items())
  x = _x(3, 7, 4)
  d = jaxfold.fold(p, fn, x, defer_norms=True)
  assert d.report.num_deferred == 1, [s.reason for s in d.report.deferred]
  assert normalized_reads(d.apply_fn, d.params, x) == 0
  for shape, seed in [((3, 7, 4), 1), ((2, 5, 4), 2)]:
    x = _x(*shape, seed=seed)
    assert rel_err(fn(p, x), d.apply_fn(d.params, x)) < 1e-9


class Remat(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    blk = nn.remat(lambda mdl, h: nn.Dense(D)(nn.LayerNorm()(h)))
    return nn.Dense(3)(nn.LayerNorm()(h + blk(self, h)))


def test_remat(x64):
  _, d = _defer(Remat(), _x(3, 7, 4), other=[(_x(2, 5, 4, seed=2),)])
  assert d.report.num_fused == 2 and d.report.num_deferred == 2


# ----------------------------------------------------------------------------
# bf16: the norm's statistic in float32, the normalized value and the matmuls
# in bf16 (accumulating in float32).


def bf16_block(p, x):
  h = (x @ p["w1"] + p["b1"]).astype(jnp.bfloat16)
  hf = h.astype(jnp.float32)
  m = hf.mean(-1, keepdims=True)
  s = jax.lax.rsqrt(jnp.square(hf - m).mean(-1, keepdims=True) + 1e-6)
  y = (h - m.astype(jnp.bfloat16)) * s.astype(jnp.bfloat16) * p["g"] + p["beta"]
  z = jax.nn.gelu(jnp.dot(y, p["w2"], preferred_element_type=jnp.float32) + p["b2"])
  return jnp.dot(z.astype(jnp.bfloat16), p["w3"], preferred_element_type=jnp.float32)


def _np_ln(h, g, b):
  m = h.mean(-1, keepdims=True)
  return (h - m) / np.sqrt(np.square(h - m).mean(-1, keepdims=True) + 1e-6) * g + b


def _np_gelu(z):
  return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))


def bf16_f32_norm(p, x):
  hf = x @ p["w1"] + p["b1"]                                      # a float32 stream, bf16 matmuls
  m = hf.mean(-1, keepdims=True)
  s = jax.lax.rsqrt(jnp.square(hf - m).mean(-1, keepdims=True) + 1e-6)
  y = ((hf - m) * s * p["g"] + p["beta"]).astype(jnp.bfloat16)   # the norm in float32, one cast (flax)
  z = jax.nn.gelu(jnp.dot(y, p["w2"], preferred_element_type=jnp.float32) + p["b2"])
  return jnp.dot(z.astype(jnp.bfloat16), p["w3"], preferred_element_type=jnp.float32)


@pytest.mark.parametrize("fn, norm_impl, kernel", [
    (bf16_block, "auto", False), (bf16_f32_norm, "auto", False), (bf16_f32_norm, "interpret", True),
    (bf16_block, "interpret", False)])
def test_bf16_within_the_originals_own_rounding(fn, norm_impl, kernel):
  """Deferred bf16 is as close to the float64 function as the original bf16
  program is: max relative error ≤ 2× the original's (floor 1e-3), and ≤ 2⁻⁵;
  also through the RMS-matmul kernel (the statistic from the float32 stream, the
  dot in bf16), which a statistic rounded to bf16 before the product
  (``bf16_block``) does not get: its canonical form is not the kernel's."""
  rng = np.random.default_rng(2)
  p = {k: jnp.asarray(v, jnp.float32 if k in ("w1", "b1") else jnp.bfloat16)
       for k, v in _base(rng).items()}
  q = {k: np.asarray(v, np.float64) for k, v in p.items()}
  xs = [np.asarray(_x(*s, seed=k, dtype=jnp.float32)) for k, s in [(1, (4, 64, 4)), (2, (2, 9, 4))]]
  d = jaxfold.fold(p, fn, jnp.asarray(xs[0]), defer_norms=True, norm_impl=norm_impl)
  assert d.report.num_deferred == 1, d.report
  assert (KERNEL_SAYS in d.report.deferred[0].reason) == kernel, d.report
  for x in xs:
    ref = _np_gelu(_np_ln(x @ q["w1"] + q["b1"], q["g"], q["beta"]) @ q["w2"] + q["b2"]) @ q["w3"]
    orig = rel_err(ref, fn(p, jnp.asarray(x)))
    new = rel_err(ref, d.apply_fn(d.params, jnp.asarray(x)))
    assert new <= max(2 * orig, 1e-3) and new <= 2 ** -5, (orig, new)


def test_save_load_and_export_keep_the_deferral(x64, tmp_path):
  from zoo_fused import inputs, original, shapes
  _, fu = fused("gpt2-tiny")
  d = jaxfold.defer_norms(fu)
  jaxfold.save_fold(d, tmp_path / "d")
  apply, p = original("gpt2-tiny")
  back = jaxfold.load_fold(tmp_path / "d", apply)
  assert back.report.num_deferred == d.report.num_deferred == 5
  ids = inputs("gpt2-tiny", *shapes("gpt2-tiny")[1])
  assert normalized_reads(back.apply_fn, back.params, *ids) == 0
  assert max(errors("gpt2-tiny", back)) < 1e-9
  fn = jaxfold.load_exported(jaxfold.export(d, *ids, symbolic=None))
  # Against the compiled original: on jax 0.11 XLA:CPU's fused f64 program differs from eager
  # op-by-op evaluation by ~2e-8 for the original model itself.
  assert rel_err(jax.jit(apply)(p, *ids), fn(*ids)) < 1e-9


# ----------------------------------------------------------------------------
# The RMS-matmul kernel (norm_impl="interpret": Pallas interpret mode on the CPU):
# a proved reader computes (x @ W') · rsqrt(mean(x²) + ε) (+ the fused bias) in one
# kernel that recomputes the statistic from x itself.

KERNEL_SAYS = "the RMS-matmul kernel computes"


def _pallas_calls(fn, *args) -> int:
  return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


@functools.lru_cache(maxsize=None)
def _interpret_deferred(name):
  from zoo_fused import inputs, original, shapes
  apply, p = original(name)
  folded = jaxfold.fold(p, apply, *inputs(name, *shapes(name)[0]), tied_weights="copy", norm_impl="interpret")
  return jaxfold.defer_norms(jaxfold.fuse_affine(folded))


def _zoo_errors(name, d):
  """Max relative error at both zoo shapes against the jitted original; a fresh
  jit per call, so a monkeypatched kernel is traced again."""
  from zoo_fused import inputs, original, shapes
  apply, p = original(name)
  new = jax.jit(lambda q, *a: d.apply_fn(q, *a))
  return [rel_err(jax.jit(apply)(p, *inputs(name, b, s)), new(d.params, *inputs(name, b, s)))
          for b, s in shapes(name)]


@pytest.mark.parametrize("name, on_xla", [("gpt2-tiny", 0), ("opt-tiny", 0), ("vit-tiny", 1)])
def test_zoo_readers_run_the_rms_matmul_kernel(x64, name, on_xla):
  """A site's only reader (GPT-2's QKV, MLP-in, the tied head) runs the kernel;
  the sibling readers of one norm (OPT's and ViT's separate q, k, v) run as ONE
  grouped launch (``rms_matmul_group``: XLA merges their GEMMs, one launch per
  reader would not); ViT's classifier, which reads the class token's row only
  (a slice), keeps XLA's deferred form."""
  from zoo_fused import inputs, shapes
  d = _interpret_deferred(name)
  sites = d.report.deferred
  assert d.report.num_deferred == len(sites) == 5
  assert sum("XLA computes" in s.reason for s in sites) == on_xla, [s.reason for s in sites]
  for s in sites:
    if len(s.readers) > 1:
      assert KERNEL_SAYS in s.reason and "in one launch" in s.reason, s.reason
  if name == "vit-tiny":
    assert "classifier.kernel (it reads the normalized value re-indexed)" in sites[-1].reason
  ids = inputs(name, *shapes(name)[1])
  assert _pallas_calls(d.apply_fn, d.params, *ids) == sum(KERNEL_SAYS in s.reason for s in sites)
  assert normalized_reads(d.apply_fn, d.params, *ids) == 0
  assert max(_zoo_errors(name, d)) < 1e-9


def siblings(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return (y @ p["w2"] + p["b2"]) @ p["w3"] + jnp.tanh(y @ p["w5"])[..., :3]   # q, k-like readers


def siblings_other_layout(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return (y @ p["w2"]) @ p["w3"] + jnp.tanh(y @ p["w5t"].T)[..., :3]   # one weight read transposed


def siblings_cast(p, x):
  """Mixed precision: each sibling casts (and reshapes) its own float32 weight
  right before its matmul, the second one after the first reader has run."""
  y = _ln(_stem(p, x), p["g"], p["beta"])
  q = y @ p["w2"].astype(jnp.float64) + p["b2"]
  return q @ p["w3"] + jnp.tanh(y @ p["w5"].reshape(D, 5).astype(jnp.float64))[..., :3]


@pytest.mark.parametrize("fn, grouped", [(siblings, True), (siblings_other_layout, False),
                                         (siblings_cast, True)])
def test_sibling_readers_in_one_launch(x64, monkeypatch, fn, grouped):
  """Two readers of one norm: one grouped launch (each reader's fused β·W in its
  own epilogue), exact at two shapes; a tripwire swaps the readers' outputs. Not
  where the weights are read in different layouts: XLA's deferred form."""
  from jaxfold._src import kernels
  rng = np.random.default_rng(3)
  p = _base(rng, {"w5": (D, 5), "w5t": (5, D)}.items())
  tol = 1e-9
  if fn is siblings_cast:   # fuse's γ·W is rounded to the weights' float32
    p = dict(p, w2=p["w2"].astype(jnp.float32), w5=p["w5"].astype(jnp.float32)[None])
    tol = 1e-6
  x = _x(3, 7, 4)
  d = jaxfold.fold(p, fn, x, defer_norms=True, norm_impl="interpret")
  (site,) = d.report.deferred[:1]
  assert site.deferred and len(site.readers) == 2, site.reason
  assert (KERNEL_SAYS in site.reason and "in one launch" in site.reason) == grouped, site.reason
  if fn is siblings_other_layout:
    assert "different layouts" in site.reason, site.reason
  assert _pallas_calls(d.apply_fn, d.params, x) == grouped
  for shape, seed in [((3, 7, 4), 1), ((2, 5, 4), 2), ((1, 7, 4), 3), ((1, 1, 4), 4)]:
    xs = _x(*shape, seed=seed)
    assert rel_err(fn(p, xs), jax.jit(lambda q, a: d.apply_fn(q, a))(d.params, xs)) < tol
  if fn is siblings_cast:   # against XLA's deferred form of the same fused weights: exact
    dx = jaxfold.fold(p, fn, x, defer_norms=True, norm_impl="xla")
    for shape, seed in [((3, 7, 4), 1), ((1, 1, 4), 4)]:
      xs = _x(*shape, seed=seed)
      assert rel_err(dx.apply_fn(dx.params, xs), jax.jit(lambda q, a: d.apply_fn(q, a))(d.params, xs)) < 1e-12
  if grouped:
    run = kernels.run_rms_matmul_group

    def dropped(x, ws, bs, *a):   # the first reader's fused bias lost
      return run(x, ws, [None] + list(bs[1:]), *a)
    monkeypatch.setattr(kernels, "run_rms_matmul_group", dropped)
    assert rel_err(fn(p, x), jax.jit(lambda q, a: d.apply_fn(q, a))(d.params, x)) > 1e-3


def test_rms_matmul_tripwires(x64, monkeypatch):
  """The comparison sees a wrong ε in the kernel call, and a fused bias the
  kernel drops (the rewrite no longer adds it)."""
  from jaxfold._src import kernels
  d = _interpret_deferred("gpt2-tiny")
  run = kernels.run_rms_matmul
  with monkeypatch.context() as m:
    m.setattr(kernels, "run_rms_matmul", lambda x, w, b, eps, *a: run(x, w, b, 1e-2, *a))
    assert max(_zoo_errors("gpt2-tiny", d)) > 1e-6
  with monkeypatch.context() as m:
    m.setattr(kernels, "run_rms_matmul", lambda x, w, b, eps, *a: run(x, w, None, eps, *a))
    assert max(_zoo_errors("gpt2-tiny", d)) > 1e-3
  assert max(_zoo_errors("gpt2-tiny", d)) < 1e-9


def bessel_norm(p, x):
  h = _stem(p, x)
  c = h - h.mean(-1, keepdims=True)
  y = c * jax.lax.rsqrt(jnp.square(c).sum(-1, keepdims=True) / (D - 1) + 1e-6) * p["g"] + p["beta"]
  return y @ p["w2"]                                    # 1/(n-1): not the kernel's statistic


def doubled_stat(p, x):
  h = _stem(p, x)
  c = h - h.mean(-1, keepdims=True)
  s = 2.0 * jax.lax.rsqrt(jnp.square(c).mean(-1, keepdims=True) + 1e-6)   # a scaled statistic
  return (c * s * p["g"] + p["beta"]) @ p["w2"]


KERNEL_CASES = [  # (program, readers the kernel computes)
    (bias_then_gelu, 1), (divided_norm, 1), (bessel_norm, 0), (doubled_stat, 0),
    (rhs_reader, 0), (transposed_reader, 0), (class_token, 0)]


@pytest.mark.parametrize("fn, n", KERNEL_CASES, ids=[c[0].__name__ for c in KERNEL_CASES])
def test_rms_matmul_only_where_proved(x64, fn, n):
  rng = np.random.default_rng(1)
  p = _base(rng, {"w5": (D, 5)}.items())
  x = _x(3, 7, 4)
  d = jaxfold.fold(p, fn, x, defer_norms=True, norm_impl="interpret")
  site = d.report.deferred[0]
  calls = _pallas_calls(d.apply_fn, d.params, x)
  if n is not None:
    assert calls == n, site.reason
    assert (KERNEL_SAYS in site.reason) == (n > 0) and ("XLA computes" in site.reason) == (n == 0), site.reason
  for shape, seed in [((3, 7, 4), 1), ((2, 5, 4), 2)]:
    x = _x(*shape, seed=seed)
    assert rel_err(fn(p, x), jax.jit(d.apply_fn)(d.params, x)) < 1e-9


def own_bias_first(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return jax.nn.gelu(p["b2"] + y @ p["w2"]) @ p["w3"]   # the bias is the add's first operand


def own_bias_shared(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  z = y @ p["w2"]
  return jax.nn.gelu(z + p["b2"]) @ p["w3"] + z[..., :3]   # z without its bias is read too


def data_added(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return jax.nn.gelu(y @ p["w2"] + jnp.tanh(x[..., :1]) * p["b2"]) @ p["w3"]   # varies along the rows


def position_added(p, x):
  y = _ln(_stem(p, x), p["g"], p["beta"])
  return jax.nn.gelu(y @ p["w2"] + p["pos"]) @ p["w3"]     # (seq, N): varies along the sequence


OWN_BIAS_CASES = [  # (program, whether the kernel adds the reader's own bias)
    (bias_then_gelu, True), (own_bias_first, True), (own_bias_shared, False), (data_added, False),
    (position_added, False)]


@pytest.mark.parametrize("fn, own", OWN_BIAS_CASES, ids=[c[0].__name__ for c in OWN_BIAS_CASES])
def test_rms_matmul_adds_the_readers_own_bias(x64, monkeypatch, fn, own):
  """The add of a kernel reader's own bias (``y @ W + b``: GPT-2's c_attn, c_fc)
  joins the kernel's epilogue next to the fused β·W: the kernel gets both
  vectors (dropping the second loses b), and the add is gone. Not where the
  reader's output has another use or the added value varies along the rows."""
  from jaxfold._src import kernels
  rng = np.random.default_rng(1)
  p = _base(rng, {"pos": (7, 6)}.items())
  x = _x(3, 7, 4)
  d = jaxfold.fold(p, fn, x, defer_norms=True, norm_impl="interpret")
  site = d.report.deferred[0]
  assert KERNEL_SAYS in site.reason and ("with its bias" in site.reason) == own, site.reason
  run, got = kernels.run_rms_matmul, []
  with monkeypatch.context() as m:
    m.setattr(kernels, "run_rms_matmul", lambda x, w, b, *a: (got.append(b), run(x, w, b, *a))[1])
    assert _pallas_calls(d.apply_fn, d.params, x) == 1
  assert len(got) == 1 and (isinstance(got[0], tuple) and len(got[0]) == 2) == own, got
  shapes = [((3, 7, 4), 1), ((2, 7, 4), 2), ((1, 7, 4), 3)]   # batch 1 too
  if fn is not position_added:    # (its added (7, N) table fixes the sequence length)
    shapes += [((2, 5, 4), 4), ((1, 1, 4), 5)]
  for shape, seed in shapes:
    xs = _x(*shape, seed=seed)
    assert rel_err(fn(p, xs), jax.jit(d.apply_fn)(d.params, xs)) < 1e-9
  if own:
    with monkeypatch.context() as m:
      m.setattr(kernels, "run_rms_matmul", lambda x, w, b, *a: run(x, w, b[0], *a))
      assert rel_err(fn(p, x), jax.jit(lambda q, a: d.apply_fn(q, a))(d.params, x)) > 1e-3   # traced anew


def test_gpt2_kernel_readers_add_their_own_bias(x64):
  """GPT-2's QKV and MLP-in readers take their linear bias into the kernel (no add
  after it: the A100 launched it as one more kernel per layer); the tied head has
  none. Exact at both zoo shapes."""
  d = _interpret_deferred("gpt2-tiny")
  sites = d.report.deferred
  assert [("with its bias" in s.reason) for s in sites] == [True] * (len(sites) - 1) + [False], \
      [s.reason for s in sites]
  assert max(_zoo_errors("gpt2-tiny", d)) < 1e-9


def test_rms_matmul_gradient_and_auto_on_cpu(x64):
  """The kernel's backward is the XLA expression's VJP: gradients through a deferred
  model equal the original's. ``"auto"`` on a CPU host proves nothing and runs no kernel."""
  rng = np.random.default_rng(1)
  p = _base(rng)
  x = _x(3, 7, 4)
  d = jaxfold.fold(p, bias_then_gelu, x, defer_norms=True, norm_impl="interpret")
  assert _pallas_calls(d.apply_fn, d.params, x) == 1
  g = jax.grad(lambda x: jnp.sum(jnp.sin(d.apply_fn(d.params, x))))(x)
  ref = jax.grad(lambda x: jnp.sum(jnp.sin(bias_then_gelu(p, x))))(x)
  assert rel_err(ref, g) < 1e-9
  auto = jaxfold.fold(p, bias_then_gelu, x, defer_norms=True)
  assert auto.report.num_deferred == 1 and KERNEL_SAYS not in auto.report.deferred[0].reason
  assert _pallas_calls(auto.apply_fn, auto.params, x) == 0


# defer_norms(fused, x) re-analyses at x: inputs at which the norm fuses otherwise
# than at fuse_affine's example (here a Python branch on the rank: at rank 2 the
# normalized value is also an output, so its γ stays; at rank 3 only the matmul
# reads it) must be refused. Else the deferred model takes the fused parameters
# (γ kept, W unscaled) as if γ were in W: the result silently drops γ (mutant N8).
def _fuses_by_rank(p, x):
  c = x - jnp.mean(x, -1, keepdims=True)
  y = c / jnp.sqrt(jnp.mean(c * c, -1, keepdims=True) + 1e-5) * p["g"]
  out = jnp.tanh(y @ p["w"])
  return (out, y) if x.ndim == 2 else out


def test_defer_refuses_inputs_that_fuse_otherwise(x64):
  rng = np.random.default_rng(0)
  p = {"g": jnp.asarray(1 + rng.normal(size=D)), "w": jnp.asarray(rng.normal(size=(D, 5)))}
  fused = jaxfold.fuse_affine(jaxfold.fold(p, _fuses_by_rank, _x(2, D)))
  assert fused.report.num_fused == 0                       # y is an output at the example's rank
  assert jaxfold.fuse_affine(jaxfold.fold(p, _fuses_by_rank, _x(2, 3, D))).report.num_fused == 1
  with pytest.raises(jaxfold.FuseError, match="fuse differently"):
    jaxfold.defer_norms(fused, _x(2, 3, D))
  # at the example's own rank it defers what it can, and computes the original
  for x in (_x(1, D), _x(4, D)):
    d = jaxfold.defer_norms(fused, x)
    for a, b in zip(d.apply_fn(d.params, x), _fuses_by_rank(p, x)):
      assert rel_err(a, b) < 1e-12
