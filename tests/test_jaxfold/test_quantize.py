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
