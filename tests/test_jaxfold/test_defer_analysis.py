"""defer_analysis.py: the analysis that lets a fused norm's readers contract the
un-normalized input, and its rewrite (front end: test_defer.py).

Float64 with random non-uniform γ, β and biases; deferred against the original
at two shapes, batch 1 with one token included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

import jaxfold
from jaxfold._src.defer_analysis import DeferSite

D = 16


def _ln(h, g, b):
  m = h.mean(-1, keepdims=True)
  v = jnp.square(h - m).mean(-1, keepdims=True)
  return (h - m) * jax.lax.rsqrt(v + 1e-5) * g + b


def _params(dtype=jnp.float64, seed=0):
  rng = np.random.default_rng(seed)
  shapes = dict(w1=(4, D), b1=(D,), g=(D,), beta=(D,), w2=(D, 6), b2=(6,))
  return {k: jnp.asarray((1.0 + 0.5 * rng.normal(size=s)) if k in ("g",) else 0.4 * rng.normal(size=s), dtype)
          for k, s in shapes.items()}


def reader(p, x):
  y = _ln(x @ p["w1"] + p["b1"], p["g"], p["beta"])
  return jnp.tanh(y @ p["w2"] + p["b2"])


def reader_and_elementwise(p, x):
  y = _ln(x @ p["w1"] + p["b1"], p["g"], p["beta"])
  return y @ p["w2"] + jnp.sum(y * y, -1, keepdims=True)     # y is also read elementwise


def _x(shape, seed, dtype=jnp.float64):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, dtype)


def test_a_reader_defers_and_stays_exact_at_batch_one(x64):
  p = _params()
  d = jaxfold.fold(p, reader, _x((3, 7, 4), 1), defer_norms=True)
  (site,) = d.report.deferred
  assert isinstance(site, DeferSite) and site.deferred, site
  assert len(site.readers) == 1 and "w2" in site.readers[0] and "per-row statistic" in site.reason
  for shape, seed in [((3, 7, 4), 2), ((1, 1, 4), 3)]:
    x = _x(shape, seed)
    assert rel_err(reader(p, x), d.apply_fn(d.params, x)) < 1e-9


def test_another_use_of_the_normalized_value_keeps_the_site_fused(x64):
  p = _params()
  d = jaxfold.fold(p, reader_and_elementwise, _x((3, 7, 4), 1), defer_norms=True)
  (site,) = d.report.deferred
  assert not site.deferred and "not fused" in site.reason, site.reason
  for shape, seed in [((3, 7, 4), 2), ((1, 1, 4), 3)]:
    x = _x(shape, seed)
    assert rel_err(reader_and_elementwise(p, x), d.apply_fn(d.params, x)) < 1e-9


def test_a_float16_reader_is_not_deferred_for_its_range():
  """x @ W in float16 is rms(x) times the normalized product: it may overflow
  where the original does not (defer_analysis._check_range)."""
  p = _params(jnp.float16)
  x = _x((3, 7, 4), 1, jnp.float16)
  d = jaxfold.fold(p, reader, x, defer_norms=True)
  (site,) = d.report.deferred
  assert not site.deferred and "float16" in site.reason and "narrower" in site.reason, site.reason
  got = np.asarray(d.apply_fn(d.params, x), np.float32)
  assert np.isfinite(got).all()
  assert np.abs(got - np.asarray(reader(p, x), np.float32)).max() < 0.05


@pytest.mark.parametrize("field", ["where", "readers", "deferred", "reason"])
def test_defer_site_is_frozen(field):
  s = DeferSite("h", ("w2",), True, "")
  with pytest.raises(Exception, match="cannot assign"):
    setattr(s, field, None)
