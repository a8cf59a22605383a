"""jaxfold/_src/analysis.py: sites, canonical forms, facts and the zero-sum
walk on small programs whose answers are known."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfold._src import pipeline
from jaxfold._src.analysis import Blocker, LeafNeed, find_sites
from jaxfold._src.layout import full_spec
from jaxfold._src.rules.base import freeze

P = {"w": np.ones((4, 6), np.float32), "b": np.ones((6,), np.float32),
     "g": np.ones((6,), np.float32)}
X = np.ones((3, 4), np.float32)


def _ln(h, g):
  m = h.mean(-1, keepdims=True)
  return (h - m) * jax.lax.rsqrt(((h - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g


def _analyse(fn, params=P, x=X):
  traced = pipeline.trace(fn, params, (x,))
  return traced, pipeline.analyzer(traced)


def _sites(fn):
  traced, ctx = _analyse(fn)
  with ctx as an:
    return [(s.axes, tuple(s.input.shape)) for s in find_sites(an.top)]


def test_a_layernorm_is_a_site_and_other_means_are_not():
  assert _sites(lambda p, x: _ln(x @ p["w"] + p["b"], p["g"])) == [((1,), (3, 6))]
  # RMSNorm, mean pooling, a mean that is only added: no site.
  rms = lambda p, x: (h := x @ p["w"]) * jax.lax.rsqrt((h * h).mean(-1, keepdims=True))  # noqa: E731
  assert _sites(rms) == []
  assert _sites(lambda p, x: (x @ p["w"]).mean(-1)) == []
  assert _sites(lambda p, x: (h := x @ p["w"]) + h.mean(-1, keepdims=True)) == []
  # A norm over the other axis is a site over that axis.
  assert _sites(lambda p, x: _ln((x @ p["w"]).T, 1.0)) == [((1,), (6, 3))]


def test_two_spellings_of_one_value_have_one_canonical_form():
  def fn(p, x):
    h = x @ p["w"] + p["b"]
    a = (h - h.mean(-1, keepdims=True)) * 2.0
    b = 2.0 * h - jnp.sum(h, -1, keepdims=True) * (2.0 / 6)
    c = h * 2.0 - h.mean(-1, keepdims=True)            # another value
    return a, b, c

  traced, ctx = _analyse(fn)
  with ctx as an:
    a, b, c = an.top.program.outvars
    lv = an.top
    assert lv.canon(a) == lv.canon(b)
    assert lv.canon(a) != lv.canon(c)


def test_facts_say_what_is_constant_along_which_dims():
  def fn(p, x):
    h = x @ p["w"]
    return h, jnp.broadcast_to(h.sum(-1, keepdims=True), h.shape), h + p["b"]

  traced, ctx = _analyse(fn)
  with ctx as an:
    h, rowsum, biased = an.top.program.outvars
    lv = an.top
    assert lv.constant_along(rowsum, (1,), (3, 6))
    assert not lv.constant_along(h, (1,), (3, 6)) and not lv.constant_along(h, (0,), (3, 6))
    assert not lv.constant_along(biased, (0,), (3, 6))


def _needs(fn):
  traced, ctx = _analyse(fn)
  with ctx as an:
    (site,) = find_sites(an.top)
    spec = freeze(full_spec(site.input.shape, site.axes))
    needs = site.level.needs(site.input, spec)
    names = traced.names
    return ([(names[n.var.index], n.spec) for n in needs if isinstance(n, LeafNeed)],
            [n.reason for n in needs if isinstance(n, Blocker)])


def test_the_walk_names_the_parameters_to_center():
  leaves, blockers = _needs(lambda p, x: _ln(x @ p["w"] + p["b"], p["g"]))
  assert blockers == []
  assert sorted(leaves) == [("['b']", ((0, 6),)), ("['w']", ((1, 6),))]


def test_the_walk_stops_at_what_it_cannot_center():
  # The input itself: nothing to center.
  leaves, blockers = _needs(lambda p, x: _ln(x * 2.0, 1.0))
  assert leaves == [] and blockers and all("program input" in r for r in blockers)
  # Repeating part of the normalized group.
  leaves, blockers = _needs(lambda p, x: _ln(jnp.tile(x @ p["w"], (1, 2))[:, :6] * 1.0, p["g"]))
  assert leaves == [] and any("repeats part of a normalized group" in r for r in blockers)
  # A nonlinearity between the producer and the norm.
  leaves, blockers = _needs(lambda p, x: _ln(jnp.tanh(x @ p["w"]), p["g"]))
  assert leaves == [] and blockers


@pytest.mark.parametrize("shape", [(3, 4), (2, 5, 4)])
def test_sites_do_not_depend_on_the_batch_shape(shape):
  x = np.ones(shape, np.float32)
  traced, ctx = _analyse(lambda p, x: _ln(x @ p["w"] + p["b"], p["g"]), x=x)
  with ctx as an:
    (site,) = find_sites(an.top)
    assert site.axes == (len(shape) - 1,)


# -- memoised algebra (fold speed, issue 20) ----------------------------------------------


def test_memoised_products_and_sums_equal_fresh_ones_and_end_with_the_scope():
  from jaxfold._src import algebra as A
  with A.scope():
    a, b = A.atom("a", (3, 4)), A.atom("b", (3, 4))
    s = A.add(a, A.scale(b, 2))
    p1, r1 = A.mul(s, s), A.reduce_sum(A.mul(s, a), (1,), (3, 4))
    A._MEMO.clear()
    assert A.mul(s, s) == p1 and A.reduce_sum(A.mul(s, a), (1,), (3, 4)) == r1
    assert A.mul(s, s) is A.mul(s, s)
    # A shift product depends on the coefficients, not the symbol: each poly keeps its own.
    c1, c2 = A.pure((None, (None, 1))), A.pure((None, (None, 1)))
    q1, q2 = A.poly_mul(c1, s, c1, s), A.poly_mul(c2, s, c2, s)
    assert (q1.sym, q1.dims) == (c1.sym, c1.dims) and (q2.sym, q2.dims) == (c2.sym, c2.dims)
    assert q1.coeffs == q2.coeffs == (A.scale(s, 2), A.ONE)
    assert A._MEMO
  assert not A._MEMO


# -- a value that is zero-sum as written (an explicit centering) ----------------------------
# The walk decides ``h - mean(h)`` on its exact canonical form: it sums to zero over the
# normalized axes whatever the parameters are, so a norm reading it needs nothing centered.
# (Before: the ``sub`` facet asked its broadcast operand to be zero-sum and blocked.)

XD = 8
XSHAPES = dict(w1=(5, XD), b1=(XD,), g1=(XD,), be1=(XD,), wo=(XD, 3))


def _xmean(h):
  return jnp.mean(h, -1, keepdims=True)


def _xln(h, g, b):
  c = h - _xmean(h)
  return c * jax.lax.rsqrt(_xmean(c * c) + 1e-5) * g + b


def _centered_first(center):
  def apply(p, x):
    h = x @ p["w1"] + p["b1"]
    return _xln(center(h, p), p["g1"], p["be1"]) @ p["wo"]
  return apply


ZERO_SUM_AS_WRITTEN = {
    "h - mean(h)": lambda h, p: h - _xmean(h),
    "(h - mean(h)) * 3": lambda h, p: (h - _xmean(h)) * 3.0,
    "h - sum(h) / d, mean broadcast first": lambda h, p: h - jnp.broadcast_to(h.sum(-1, keepdims=True), h.shape) / XD,
    "a LayerNorm without γ, β": lambda h, p: _xln(h, 1.0, 0.0),
}


@pytest.mark.parametrize("name", list(ZERO_SUM_AS_WRITTEN))
def test_a_norm_of_an_explicitly_centered_value_folds_with_nothing_centered(x64, name):
  from fold_checks import assert_sound, x_args
  res = assert_sound(_centered_first(ZERO_SUM_AS_WRITTEN[name]), XSHAPES, x_args(3), expect_folded=2)
  first, second = res.fold_report.sites
  assert [c.label() for c in first.centered] == ["w1[1]", "b1[0]"]
  assert second.centered == () and second.requires == 0 and "as written" in second.reason


def test_the_walk_proves_an_explicit_centering_zero_sum_with_no_needs(x64):
  traced, ctx = _analyse(lambda p, x: (x @ p["w"] + p["b"]) - (x @ p["w"] + p["b"]).mean(-1, keepdims=True))
  with ctx as an:
    (out,) = an.top.program.outvars
    assert an.top.needs(out, freeze({1: 6})) == []
    assert an.top.zero_as_written(out, freeze({1: 6})) is True
    # zero-sum over the features, not over the batch: there the walk asks for centerings
    assert an.top.zero_as_written(out, freeze({0: 3})) is not True


NOT_ZERO_SUM_AS_WRITTEN = {
    "h - 0.5 mean(h)": (lambda h, p: h - 0.5 * _xmean(h), "`sub` subtracts an operand broadcast"),
    "the mean of another value": (lambda h, p: h - _xmean(h * h), "`sub` subtracts an operand broadcast"),
    "h - mean(h) + an offset": (lambda h, p: h - _xmean(h) + 0.25, "`add` adds an operand broadcast"),
    # zero-sum in real arithmetic, but to float32 rounding only: removing the next mean would change
    # a float64 program's output by ~1e-8
    "centered in float32": (lambda h, p: (lambda q: q - _xmean(q))(h.astype(jnp.float32)).astype(jnp.float64),
                            "computes part of it in float32, coarser than the program's outputs (float64)"),
}


@pytest.mark.parametrize("name", list(NOT_ZERO_SUM_AS_WRITTEN))
def test_a_near_miss_of_an_explicit_centering_is_refused_with_the_true_reason(x64, name):
  from fold_checks import assert_sound, x_args
  center, why = NOT_ZERO_SUM_AS_WRITTEN[name]
  res = assert_sound(_centered_first(center), XSHAPES, x_args(3))
  last = res.fold_report.sites[-1]      # the LayerNorm of the near miss
  assert not last.folded and why in last.reason, res.fold_report
  assert not any("γ" in s.reason for s in res.fold_report.sites), res.fold_report


# -- a mean accumulated in a loop: reported, with why it is not recognised -----------------


def _chunked_mean(h, g, b):
  """The mean as a sum of two halves accumulated in a fori_loop."""
  half = XD // 2
  acc = jax.lax.fori_loop(0, 2, lambda i, a: a + jax.lax.dynamic_slice_in_dim(h, i * half, half, -1).sum(-1),
                          jnp.zeros(h.shape[:-1]))
  c = h - (acc / XD)[..., None]
  return c * jax.lax.rsqrt(_xmean(c * c) + 1e-5) * g + b


@pytest.mark.parametrize("norm", ["welford", "chunked"])
def test_a_mean_accumulated_in_a_loop_is_a_refused_site_that_says_why(x64, norm):
  import spellings
  from fold_checks import assert_sound, x_args
  ln = spellings.welford_style if norm == "welford" else _chunked_mean
  # (the norm after it reads a value the loop's "mean" leaves unproved: refused too)
  res = assert_sound(_centered_first(lambda h, p: ln(h, 1.0, 0.0)), XSHAPES, x_args(3), expect_folded=0)
  first, _ = res.fold_report.sites
  assert not first.folded and "not recognised as a mean" in first.reason and first.axes == (2,), first
  assert "a `scan` reading that input" in first.reason, first.reason


def test_a_loop_output_that_does_not_read_the_value_is_no_site(x64):
  def fn(p, x):
    h = x @ p["w"] + p["b"]
    s = jax.lax.fori_loop(0, 3, lambda i, a: a * 0.5 + 1.0, jnp.ones(h.shape[:-1]))
    return h - s[..., None]
  traced, ctx = _analyse(fn)
  with ctx as an:
    assert find_sites(an.top) == []
