"""jaxfold.quantize: contractions reading a parameter run through qwix, checked
against an independent NumPy quantizer, in the program as integer GEMMs, on
folded/fused/rotated/online results and the original model, saved and loaded."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfold
from jaxfold._src import quantize as Q

pytest.importorskip("qwix")
models = pytest.importorskip("models")


class _MLP(nn.Module):
  width: int = 32
  out: int = 8

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.width, name="up")(nn.LayerNorm()(x))
    return nn.Dense(self.out, name="down")(nn.gelu(h))


def _init(m, x, seed=0):
  p = m.init(jax.random.PRNGKey(seed), x)
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.5 + (1.0 if a.ndim == 1 else 0.0),
                                                      a.dtype), p)


def _x(*shape, seed=1, dtype=jnp.float64):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _np_int8(w):
  """Per-output-channel absmax int8 in float64, qwix's convention (scale = absmax / 127.5),
  and where ``w / scale`` is a half-integer to rounding (the channel's absmax: ±127.5) the
  two roundings either way may pick."""
  w = np.asarray(w, np.float64)
  scale = np.abs(w).max(axis=0, keepdims=True) / 127.5
  r = w / scale
  return np.clip(np.round(r), -128, 127), scale, np.abs(np.abs(r - np.floor(r)) - 0.5) < 1e-9


def test_int8_weights_match_an_independent_numpy_quantizer(x64):
  m = _MLP()
  p = _init(m, _x(2, 5, 16))
  q = jaxfold.quantize((p, m.apply), _x(2, 5, 16), weights="int8")
  assert q.report.num_quantized == 2
  ref = jax.tree_util.tree_map(np.asarray, p)
  for name in ("up", "down"):
    ints, scale, tie = _np_int8(ref["params"][name]["kernel"])
    (w,) = [w for w in q.params.weights.values() if w.data.shape == ints.shape]
    got = np.asarray(w.data, np.float64)
    assert np.array_equal(got[~tie], ints[~tie]) and np.all(np.abs(got - ints)[tie] <= 1)
    np.testing.assert_allclose(np.asarray(w.scale), scale, rtol=1e-15)
    ref["params"][name]["kernel"] = np.where(tie, got, ints) * scale
  for x in (_x(2, 5, 16), _x(1, 1, 16, seed=2), _x(3, 7, 16, seed=3)):
    np.testing.assert_allclose(q.apply_fn(q.params, x), m.apply(ref, x), rtol=1e-10, atol=1e-10)


def test_w8a8_is_an_integer_gemm_in_the_program():
  m = _MLP()
  x = _x(2, 5, 16, dtype=jnp.float32)
  p = _init(m, x)
  q = jaxfold.quantize(jaxfold.fold(p, m.apply, x), weights="int8", activations="int8")
  dots = [e for e in jax.make_jaxpr(q.apply_fn)(q.params, x).jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 2
  for e in dots:
    assert [v.aval.dtype for v in e.invars] == [jnp.int8, jnp.int8]
    assert e.params["preferred_element_type"] == jnp.int32
  err = np.abs(np.asarray(q.apply_fn(q.params, x)) - np.asarray(m.apply(p, x))).max()
  assert 0 < err < 0.05 * np.abs(np.asarray(m.apply(p, x))).max()


@pytest.mark.parametrize("kw, tol", [(dict(weights="int4", group_size=8, activations="int8"), 0.15),
                                     (dict(weights="fp8", activations="fp8"), 0.15),
                                     (dict(weights="int8", activations="int8"), 0.03)])
def test_formats_run_with_small_errors_that_the_report_measures(kw, tol):
  m = _MLP()
  x = _x(4, 6, 16, dtype=jnp.float32)
  p = _init(m, x)
  q = jaxfold.quantize((p, m.apply), x, **kw, calibration=[(x,), (_x(2, 3, 16, seed=5, dtype=jnp.float32),)])
  out, ref = np.asarray(q.apply_fn(q.params, x)), np.asarray(m.apply(p, x))
  rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
  assert 0 < rel < tol, rel
  errs = [s.error for s in q.report.sites]
  assert all(0 < e < tol for e in errs), errs
  assert q.report.bytes_after < q.report.bytes_before
  text = str(q.report)
  assert "up.kernel" in text and kw["weights"] in text


def test_int4_is_stored_packed():
  w = jnp.asarray(np.random.default_rng(0).integers(-8, 8, size=(6, 5)), jnp.int8)
  packed = Q._pack_int4(w.astype(jnp.int4))
  assert packed.dtype == jnp.uint8 and packed.size == 15
  np.testing.assert_array_equal(np.asarray(Q._unpack_int4(packed, (6, 5)), np.int8), np.asarray(w))


def test_a_tied_head_two_activations_and_skip_stay_in_float():
  spec = models.get("gpt2-tiny")
  params, ids = models.random_params(spec, 2, 8), spec.example_inputs(2, 8)
  fn = spec.apply_fn()
  q = jaxfold.quantize((params, fn), *ids, weights="int8", activations="int8", skip=("h_1",))
  kept = [s for s in q.report.sites if not s.quantized]
  assert any("read elsewhere" in s.reason for s in kept)          # wte: embedding and LM head
  assert any("skip" in s.reason and "h_1" in s.weight for s in kept)
  assert q.report.num_quantized == 4                               # h_0's four projections
  out = q.apply_fn(q.params, *ids)
  ref = fn(params, *ids)
  assert np.linalg.norm(np.asarray(out - ref)) / np.linalg.norm(np.asarray(ref)) < 0.05


def test_after_fold_fuse_rotate_and_online_hadamard(x64):
  spec = models.get("gpt2-tiny")
  params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), models.random_params(spec, 2, 8))
  ids = spec.example_inputs(2, 8)
  fn = spec.apply_fn()
  fused = jaxfold.fuse_affine(jaxfold.fold(params, fn, *ids, tied_weights="copy"))
  qm = np.linalg.qr(np.random.default_rng(0).normal(size=(spec.config.n_embd,) * 2))[0]
  rotated = jaxfold.rotate(fused, qm)
  online = jaxfold.online_hadamard(rotated)
  ref = np.asarray(fn(params, *ids))
  for model in (rotated, online):
    q = jaxfold.quantize(model, weights="int8", activations="int8", calibration=[ids])
    assert q.report.num_quantized >= 8
    for args in (ids, spec.example_inputs(1, 3)):
      out = np.asarray(q.apply_fn(q.params, *args))
      r = np.asarray(fn(params, *args))
      assert np.linalg.norm(out - r) / np.linalg.norm(r) < 0.05
  assert ref.shape == out.shape[:0] + ref.shape


def test_bad_options_are_refused_with_the_fix():
  m = _MLP()
  x = _x(2, 16, dtype=jnp.float32)
  p = _init(m, x)
  with pytest.raises(jaxfold.QuantizeError, match="weights must be one of"):
    jaxfold.quantize((p, m.apply), x, weights="int3")
  with pytest.raises(jaxfold.QuantizeError, match="pick matching formats"):
    jaxfold.quantize((p, m.apply), x, weights="int8", activations="fp8")
  with pytest.raises(jaxfold.QuantizeError, match="pass example arguments"):
    jaxfold.quantize((p, m.apply))
  q = jaxfold.quantize((p, m.apply), x, group_size=5)
  assert all("not a multiple of group_size=5" in s.reason for s in q.report.sites)
  with pytest.raises(jaxfold.QuantizeError, match="QuantParams"):
    q.apply_fn(p, x)


def test_save_and_load_a_quantized_result(tmp_path):
  m = _MLP(width=1024, out=256)
  x = _x(2, 5, 256, dtype=jnp.float32)
  p = _init(m, x)
  fused = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
  q4 = jaxfold.quantize(fused, weights="int4", group_size=64, activations="int8")
  jaxfold.save_fold(q4, tmp_path / "q4")
  back = jaxfold.load_fold(tmp_path / "q4", m.apply)
  for xx in (x, _x(1, 1, 256, seed=3, dtype=jnp.float32)):
    np.testing.assert_array_equal(back.apply_fn(back.params, xx), q4.apply_fn(q4.params, xx))
  # int4 weights are stored two per byte (+ a float32 scale per group of 64): the saved
  # parameters are about 1/7 of float32's, not the 1/4 of int8 or the 1/2 of widened int4 in bytes
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "q4" / "params") for f in fs)
  floats = sum(a.size * 4 for a in jax.tree_util.tree_leaves(p))
  assert size < floats / 5, (size, floats)


def test_smooth_matches_an_independent_numpy_smoothquant(x64):
  """SmoothQuant: s = max|x|^α / max|W|^(1-α) per input channel over the
  calibration inputs, W quantized as s·W, x divided by s in the program."""
  m = nn.Dense(8)
  scale = np.ones(16)
  scale[[2, 11]] = [30.0, 12.0]   # outlier input channels
  cal = [(_x(4, 6, 16, seed=s) * scale,) for s in (5, 6)]
  p = _init(m, cal[0][0])
  alpha = 0.6
  q = jaxfold.quantize((p, m.apply), cal[0][0], weights="int8", calibration=cal, smooth=alpha)
  assert q.report.smooth == alpha and "smoothed α=0.6" in q.report.sites[0].formats
  w = np.asarray(p["params"]["kernel"], np.float64)
  amax = np.max([np.abs(np.asarray(c[0])).reshape(-1, 16).max(0) for c in cal], axis=0)
  s = amax ** alpha / np.abs(w).max(1) ** (1 - alpha)
  (stored,) = [v for k, v in q.params.weights.items() if k.endswith(".s")]
  np.testing.assert_allclose(np.asarray(stored), s, rtol=1e-13)
  ints, wscale, tie = _np_int8(s[:, None] * w)
  got = np.asarray(next(v for k, v in q.params.weights.items() if not k.endswith(".s")).data, np.float64)
  assert np.array_equal(got[~tie], ints[~tie]) and np.all(np.abs(got - ints)[tie] <= 1)
  wq = np.where(tie, got, ints) * wscale
  b = np.asarray(p["params"]["bias"], np.float64)
  for x in (_x(2, 5, 16, seed=7) * scale, _x(1, 1, 16, seed=8) * scale, _x(3, 7, 16, seed=9) * scale):
    ref = (np.asarray(x, np.float64) / s) @ wq + b     # (x/s)(s W) = x W before quantization
    np.testing.assert_allclose(q.apply_fn(q.params, x), ref, rtol=1e-10, atol=1e-10)
    exact = (np.asarray(x, np.float64) / s) @ (s[:, None] * w) + b
    np.testing.assert_allclose(exact, m.apply(p, x), rtol=1e-12, atol=1e-12)


def test_smooth_lowers_the_error_of_a_reader_gamma_widened(tmp_path):
  """Fusing an outlier γ widens the reader's weight range (the fuse report says
  so); W8A8 with smooth=0.5 measures a smaller error there than without."""
  m = _MLP()
  x = _x(4, 6, 16, dtype=jnp.float32)
  p = _init(m, x)
  g = np.ones(16, np.float32)
  g[[3, 9]] = [40.0, -25.0]
  p["params"]["LayerNorm_0"]["scale"] = jnp.asarray(g)
  fu = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
  (wd,) = fu.report.widened
  w = np.asarray(p["params"]["up"]["kernel"], np.float64)
  crest = lambda a: np.median(np.abs(a).max(0) / np.sqrt((a * a).mean(0)))   # noqa: E731
  assert wd.before == pytest.approx(crest(w)) and wd.after == pytest.approx(crest(g[:, None] * w))
  assert wd.ratio > 1.5 and "γ widens the weight range of 1 reader(s)" in str(fu.report)
  cal = [(_x(4, 6, 16, seed=s, dtype=jnp.float32),) for s in (2, 3)]
  err = {}
  for sm in (None, 0.5):
    q = jaxfold.quantize(fu, weights="int8", activations="int8", calibration=cal, smooth=sm)
    (site,) = [t for t in q.report.sites if "up" in t.weight]
    err[sm] = site.error
  assert 0 < err[0.5] < 0.7 * err[None], err
  jaxfold.save_fold(q, tmp_path / "q")
  back = jaxfold.load_fold(tmp_path / "q", m.apply)
  assert back.report.smooth == 0.5
  for shape in ((4, 6, 16), (1, 3, 16)):
    xx = _x(*shape, seed=4, dtype=jnp.float32)
    np.testing.assert_array_equal(back.apply_fn(back.params, xx), q.apply_fn(q.params, xx))
  q = np.ones(16, np.float32)   # a uniform γ scales every row alike: no widening, no line
  p["params"]["LayerNorm_0"]["scale"] = jnp.asarray(2 * q)
  plain = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
  assert plain.report.widened[0].ratio == pytest.approx(1.0) and "γ widens" not in str(plain.report)
  with pytest.raises(jaxfold.QuantizeError, match="smooth must be"):
    jaxfold.quantize(fu, weights="int8", smooth=2.0)


def test_static_activation_scales_match_an_independent_numpy_reference(x64, tmp_path):
  """activation_scale="static": one scale per contraction, absmax over the
  calibration inputs / 127.5; x rounded to int8 with it (saturating), W per channel."""
  m = _MLP()
  cal = [(_x(4, 6, 16, seed=s),) for s in (5, 6)]
  p = _init(m, cal[0][0])
  fu = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, cal[0][0]))
  q = jaxfold.quantize(fu, weights="int8", activations="int8", calibration=cal, activation_scale="static")
  assert q.report.activation_scale == "static" and "activations int8 static" in str(q.report)
  assert all("A int8 static" in s.formats for s in q.report.sites)
  scales = {k: float(v) for k, v in q.params.weights.items() if k.endswith(".a")}
  assert len(scales) == 2
  # The up projection reads the normalized input: its calibrated scale is the largest |y| there.
  ln = lambda x: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)   # noqa: E731
  y_cal = [ln(np.asarray(c[0], np.float64)) for c in cal]
  assert min(scales.values()) > 0
  want = max(np.abs(y).max() for y in y_cal) / 127.5
  assert min(abs(v / want - 1) for v in scales.values()) < 1e-6, (scales, want)
  jaxfold.save_fold(q, tmp_path / "q")
  back = jaxfold.load_fold(tmp_path / "q", m.apply)
  for shape in ((2, 5, 16), (1, 1, 16)):
    x = _x(*shape, seed=9)
    out = q.apply_fn(q.params, x)
    np.testing.assert_array_equal(back.apply_fn(back.params, x), out)
    assert float(jnp.linalg.norm(out - m.apply(p, x)) / jnp.linalg.norm(m.apply(p, x))) < 0.05
  with pytest.raises(jaxfold.QuantizeError, match="pass calibration"):
    jaxfold.quantize(fu, weights="int8", activations="int8", activation_scale="static")
  with pytest.raises(jaxfold.QuantizeError, match="pass activations="):
    jaxfold.quantize(fu, weights="int8", activation_scale="static", calibration=cal)


def test_static_w8a8_matches_numpy_end_to_end(x64):
  """The original MLP quantized W8A8 with static scales, recomputed in NumPy from
  the stored int8 weights and scales: LN -> int8(x / a1)·a1 @ W1 -> GELU -> int8(h / a2)·a2 @ W2."""
  m = _MLP()
  cal = [(_x(4, 6, 16, seed=s),) for s in (5, 6)]
  p = _init(m, cal[0][0])
  q = jaxfold.quantize((p, m.apply), cal[0][0], weights="int8", activations="int8", calibration=cal,
                       activation_scale="static")
  P = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)["params"]
  stored = {k: v for k, v in q.params.weights.items()}
  by_shape = {tuple(v.data.shape): (np.asarray(v.data, np.float64) * np.asarray(v.scale, np.float64),
                                    float(stored[k + ".a"])) for k, v in stored.items() if not k.endswith(".a")}
  (w1, a1), (w2, a2) = by_shape[(16, 32)], by_shape[(32, 8)]
  q8 = lambda v, a: np.clip(np.round(v / a), -128, 127) * a   # noqa: E731

  def ref(x):
    x = np.asarray(x, np.float64)
    y = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
    y = y * P["LayerNorm_0"]["scale"] + P["LayerNorm_0"]["bias"]
    h = np.asarray(jax.nn.gelu(q8(y, a1) @ w1 + P["up"]["bias"]), np.float64)
    return q8(h, a2) @ w2 + P["down"]["bias"]
  for shape in ((2, 5, 16), (1, 1, 16), (3, 4, 16)):
    x = _x(*shape, seed=11) * 1.5     # (beyond the calibrated range in places: saturates)
    np.testing.assert_allclose(q.apply_fn(q.params, x), ref(x), rtol=1e-6, atol=1e-6)
