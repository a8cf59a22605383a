"""One proof for every spelling: algebraically equal norms fold alike.

``spellings.py`` writes LayerNorm, per-position GroupNorm and RMSNorm as
random chains of identities of real arithmetic (how the mean, the variance
and its inverse square root are written, how the output is assembled). Each
spelling sits in the same two-norm pre-LN program; every one must fold the
same sites with the same centerings as the plain spelling, and the folded
program must equal the original in float64 at two input shapes.
"""

import os

import jax
import jax.numpy as jnp
import np_eval
import pytest
import spellings as S
from conftest import rel_err, x64_context

import jaxfold

D = 16


def _params(seed: int = 0) -> dict:
  k = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
  n = lambda *shape, s=1.0: s * jax.random.normal(next(k), shape)
  return {"W1": n(8, D), "b1": n(D), "g1": 1 + n(D, s=0.5), "n1": n(D), "W2": n(D, 2 * D, s=0.3),
          "b2": n(2 * D), "W3": n(2 * D, D, s=0.3), "b3": n(D), "g2": 1 + n(D, s=0.5), "n2": n(D),
          "Wo": n(D, 5)}


def _program(norm):
  """A pre-LN block: the stream starts at a projection, a residual MLP
  branch, a final norm, a head. ``norm(h, γ, β)``."""
  def apply(p, x):
    h = x @ p["W1"] + p["b1"]
    y = norm(h, p["g1"], p["n1"])
    s = h + jax.nn.gelu(y @ p["W2"] + p["b2"]) @ p["W3"] + p["b3"]
    return norm(s, p["g2"], p["n2"]) @ p["Wo"]
  return apply


def _inputs():
  """The example (3, 8), then other batch sizes and ranks, batch 1 included."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(7), 3)
  return jax.random.normal(k1, (3, 8)), jax.random.normal(k2, (2, 5, 8)), jax.random.normal(k3, (1, 4, 8))


def _fold_summary(norm, tol: float = 1e-9) -> tuple:
  """(folded sites with their centerings, number of sites), checked exact."""
  p = _params()
  f = _program(norm)
  xs = _inputs()
  r = jaxfold.fold(p, f, xs[0])
  for xx in xs:   # NumPy evaluation of both jaxprs: no XLA compile per spelling and shape
    assert rel_err(np_eval.run(r.apply_fn, r.params, xx), np_eval.run(f, p, xx)) < tol
  folded = tuple(tuple(sorted(c.label() for c in s.centered)) for s in r.report.sites if s.folded)
  return folded, len(r.report.sites), r.report.num_auxiliary


def _layer(s):
  return lambda h, g, b: S.layer_norm(s, h, g, b)


def _group(s):
  return lambda h, g, b: S.group_norm(s, h, g, b, groups=4)


def _rms(s):
  return lambda h, g, b: S.rms_norm(s, h, g) + b


PLAIN = S.Spelling("mean", "two_pass", "rsqrt", "centered")
LAYER = S.sample(36, seed=1)
GROUP = S.sample(8, seed=2)
RMS = S.sample(8, seed=3)


def test_the_generator_makes_distinct_spellings():
  assert len(set(LAYER)) == 36
  assert len(S.all_spellings()) >= 1000
  # Distinct as programs, not only as names: their jaxprs differ.
  x = jnp.ones((3, D))
  texts = {str(jax.make_jaxpr(_layer(s))(x, x[0], x[0])) for s in LAYER}
  assert len(texts) >= 30


@pytest.fixture(scope="module")
def reference():
  with x64_context():
    return {"layer": _fold_summary(_layer(PLAIN)), "group": _fold_summary(_group(PLAIN)),
            "rms": _fold_summary(_rms(PLAIN))}


def test_reference_folds_every_norm(reference, x64):
  folded, sites, aux = reference["layer"]
  assert sites == 2 and len(folded) == 2 and aux == 0
  assert folded[0] == ("W1[1]", "b1[0]")
  assert set(folded[1]) == {"W3[1]", "b3[0]"}
  folded, sites, _ = reference["group"]
  assert sites == 2 and len(folded) == 2 and "W1[1/4]" in folded[0]
  assert reference["rms"][:2] == ((), 0)


def _check(kind, s, reference):
  wrap = {"layer": _layer, "group": _group, "rms": _rms}[kind]
  folded, sites, aux = _fold_summary(wrap(s))
  ref_folded, ref_sites, ref_aux = reference[kind]
  assert folded == ref_folded, f"{s.name}: {folded} != {ref_folded}"
  assert aux == ref_aux
  if s.var != "halves":   # its halves' own means are sites too (not zero-sum: not folded)
    assert sites == ref_sites


@pytest.mark.parametrize("s", LAYER, ids=lambda s: s.name)
def test_layer_norm_spelling(s, reference, x64):
  _check("layer", s, reference)


@pytest.mark.parametrize("s", GROUP, ids=lambda s: s.name)
def test_group_norm_spelling(s, reference, x64):
  _check("group", s, reference)


@pytest.mark.parametrize("s", RMS, ids=lambda s: s.name)
def test_rms_norm_spelling(s, reference, x64):
  _check("rms", s, reference)


@pytest.mark.parametrize("name", sorted(S.LIBRARY_FORMS))
def test_library_form(name, reference, x64):
  folded, sites, aux = _fold_summary(S.LIBRARY_FORMS[name])
  assert (folded, sites, aux) == reference["layer"]


def test_keras_ops_layer_normalization(reference):
  """Keras 3's own op (JAX backend), in float32: Keras computes in its
  ``floatx`` and casts float64 inputs down, which a float64 fold refuses."""
  os.environ.setdefault("KERAS_BACKEND", "jax")
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip("keras is imported with another backend than jax")

  def norm(h, g, b):
    return keras.ops.layer_normalization(h, g, b, axis=-1, epsilon=1e-5)

  assert not jax.config.jax_enable_x64
  assert _fold_summary(norm, tol=1e-5) == reference["layer"]


@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "manual_softmax", "manual_log_softmax"])
def test_softmax_ignores_a_constant_shift(kind, x64):
  """A stream read by softmax over the normalized axis: centering the
  producer changes nothing there (exp(x + c) = exp(c) exp(x) cancels in the
  ratio), so the projection is centered in place, not copied."""
  sm = {"softmax": jax.nn.softmax, "log_softmax": jax.nn.log_softmax,
        "manual_softmax": lambda h: jnp.exp(h) / jnp.sum(jnp.exp(h), -1, keepdims=True),
        "manual_log_softmax": lambda h: h - jnp.log(jnp.sum(jnp.exp(h), -1, keepdims=True))}[kind]

  def f(p, x):
    h = x @ p["W1"] + p["b1"]
    return sm(h) @ p["Wo"] + S.layer_norm(PLAIN, h, p["g1"], p["n1"]) @ p["Wo"]

  p = _params()
  xs = _inputs()
  r = jaxfold.fold(p, f, xs[0])
  (site,) = r.report.sites
  assert site.folded and not r.params.extras
  assert sorted(c.label() for c in site.centered) == ["W1[1]", "b1[0]"]
  for xx in xs:
    assert rel_err(r.apply_fn(r.params, xx), f(p, xx)) < 1e-9


def test_softmax_over_other_axis_sees_the_shift(x64):
  """Softmax over the tokens does not ignore a shift that varies along them."""
  def f(p, x):
    h = x @ p["W1"] + p["b1"]
    return jax.nn.softmax(h, axis=0) @ p["Wo"] + S.layer_norm(PLAIN, h, p["g1"], p["n1"]) @ p["Wo"]

  p = _params()
  x = _inputs()[0]
  r = jaxfold.fold(p, f, x)
  assert rel_err(r.apply_fn(r.params, x), f(p, x)) < 1e-9
  (site,) = r.report.sites
  assert not site.folded or r.params.extras


@pytest.mark.slow
def test_every_spelling(x64):
  ref = {"layer": _fold_summary(_layer(PLAIN)), "group": _fold_summary(_group(PLAIN)),
         "rms": _fold_summary(_rms(PLAIN))}
  for s in S.all_spellings():
    _check("layer", s, ref)
