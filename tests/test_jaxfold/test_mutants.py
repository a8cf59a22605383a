"""Adversarial programs from the mutation study (``tests/mutation_study.py``).

Each test closes a gap that a surviving mutant exposed: a program on which the
mutated analysis folds wrongly (folded != original in float64, random γ, β and
biases, two batch sizes), named after the mutant(s) it kills. Where obligation 1
(the centering's shift must be invisible) masks a wrong zero-sum claim in every
program, the facet is checked directly on the analysis (``Level.needs``), so the
second line of defence is tested on its own.
"""

import fuzz_programs as fp
import jax
import jax.numpy as jnp
import numpy as np
from fold_checks import DIN, assert_sound, x_args
from jax import lax

from jaxfold._src import pipeline
from jaxfold._src.analysis import Blocker, LeafNeed, find_sites
from jaxfold._src.layout import full_spec
from jaxfold._src.rules.base import freeze

F64 = jnp.float64
D = 8
DENSE = {"w": (DIN, D), "b": (D,), "g": (D,), "be": (D,)}
ln = fp.ln_fast


def _h(p, x):
  return x @ p["w"] + p["b"]


def sound(apply, expect, shapes=DENSE, args=None, **kw):
  return assert_sound(apply, shapes, args or x_args(), expect_folded=expect, **kw)


# ----------------------------------------------------------------------------
# Obligation 1: a centering's shift must stay visible where it is.


def test_square_minus_value_sees_the_shift(x64):
  # E9: (h + c)² − (h + c) = h² − h + (2h − 1)c + c², not h² − h: a square is no linear map.
  def apply(p, x):
    h = _h(p, x)
    return ln(h, p["g"], p["be"]), jnp.square(h) - h
  sound(apply, 0)


def test_a_negative_power_is_not_a_shift(x64):
  # E7: 1/(h + 3 + c) − (h + c) is not 1/(h + 3) − h moved by nothing: a negative power is no
  # linear map, so its shift cannot cancel the value's own.
  def apply(p, x):
    h = _h(p, x)
    return ln(h, p["g"], p["be"]), (h + 3.0) ** -1 - h
  sound(apply, 0)


def test_relu_is_not_a_shift(x64):
  # E15: max(h + c, 0) is not max(h, 0) + c: only a −inf (+inf for min) bound passes a shift.
  def apply(p, x):
    h = _h(p, x)
    return ln(h, p["g"], p["be"]), jax.nn.relu(h) - h
  sound(apply, 0)


def test_relu_is_not_the_identity_in_a_product(x64):
  # E16: max(0, z) = z only for z ≥ 0; h·relu(z) − h·z moves by c·(relu(z) − z) ≠ 0.
  def apply(p, x):
    h, z = _h(p, x), x @ p["w2"]
    return ln(h, p["g"], p["be"]) + h * jax.nn.relu(z) - h * z
  sound(apply, 0, dict(DENSE, w2=(DIN, D)))


def test_softmax_with_an_extra_one_is_not_shift_invariant(x64):
  # E17: exp(h + c) / (Σ exp(h + c) + 1) ≠ exp(h) / (Σ exp(h) + 1): the 1 does not scale.
  def apply(p, x):
    h = _h(p, x)
    e = jnp.exp(h)
    return ln(h, p["g"], p["be"]) + e / (e.sum(-1, keepdims=True) + 1.0)
  sound(apply, 0)


def test_log_of_a_sum_of_exps_plus_one_is_not_shift_invariant(x64):
  # E18: h − log(Σ exp(h) + 1) moves with c: only log Σ exp(h) (no + 1) is shifted by c.
  def apply(p, x):
    h = _h(p, x)
    return ln(h, p["g"], p["be"]), h - jnp.log(jnp.exp(h).sum(-1, keepdims=True) + 1.0)
  sound(apply, 0)


def test_batched_contraction_over_the_normalized_dim(x64):
  # C1: y[b, d] = Σ_t a[b, t, d]·h[b, t, d]: a batch dim d of the contraction along which c is
  # constant but a is not, so the shift Σ_t a·c varies along d and a norm over d keeps it.
  def apply(p, x, a):
    h = _h(p, x)
    return ln(h, p["g"], p["be"]), ln(jnp.einsum("btd,btd->bd", a, h), p["g2"], p["be2"])
  args = x_args(extra=lambda rng, b: (jnp.asarray(rng.standard_normal((b, 4, D)), F64),))
  sound(apply, 0, dict(DENSE, g2=(D,), be2=(D,)), args)


def test_attention_over_exp_values_sees_the_shift(x64):
  # C3: exp(h + c) = exp(h)(1 + d): the shift's coefficient exp(h) varies along d, so
  # Σ_t P[s, t]·exp(h[t, d])·d[t] varies along d after a contraction over tokens.
  def apply(p, x, pr):
    h = _h(p, x)
    return ln(h, p["g"], p["be"]), ln(jnp.einsum("bst,btd->bsd", pr, jnp.exp(h)), p["g2"], p["be2"])
  args = x_args(extra=lambda rng, b: (jnp.asarray(rng.random((b, 4, 4)), F64),))
  sound(apply, 0, dict(DENSE, g2=(D,), be2=(D,)), args)



def test_a_concatenation_of_shifted_and_unshifted_pieces(x64):
  # S7: concatenating h (shifted by c along d) with z (not shifted) along d shifts only the first
  # half: a norm over the whole concatenation sees it.
  def apply(p, x):
    h = _h(p, x)
    return ln(h, p["g"], p["be"]), ln(jnp.concatenate([h, x @ p["w2"]], -1), p["g2"], p["be2"])
  sound(apply, 0, dict(DENSE, w2=(DIN, D), g2=(2 * D,), be2=(2 * D,)))


def test_a_cumulative_sum_along_d_of_a_shift_varies(x64):
  # R5: cumsum_d(h + c) = cumsum_d(h) + (d + 1)·c: no longer constant along d, so the second
  # norm sees the first's centering.
  def apply(p, x):
    h = _h(p, x)
    return ln(h, p["g"], p["be"]), ln(lax.cumsum(h, 2), p["g2"], p["be2"])
  sound(apply, 0, dict(DENSE, g2=(D,), be2=(D,)))


def test_a_grouped_convolution_splits_a_kernel_shift_by_group(x64):
  # C7: centering the kernel over its 8 output channels (for the dense use of it) shifts every
  # output channel of group g by c·Σ x_g: constant within a group, not across the two groups, so
  # the LayerNorm over the conv's channels sees it. The fold needs an untied copy for the dense use.
  def apply(p, x, z):
    k = p["k"]
    h = lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                 feature_group_count=2)
    return ln(z @ k.reshape(-1, D), p["g"], p["be"]), ln(h, p["g2"], p["be2"])
  args = []
  for b in (2, 3):
    rng = np.random.default_rng([3, b])
    args.append((jnp.asarray(rng.standard_normal((b, 3, 3, 4)), F64), jnp.asarray(rng.standard_normal((b, 8)), F64)))
  sound(apply, 1, {"k": (2, 2, 2, D), "g": (D,), "be": (D,), "g2": (D,), "be2": (D,)}, args)


@jax.custom_vjp
def _squared_cotangent(h):
  return h


_squared_cotangent.defvjp(lambda h: (h, None), lambda _, g: (g * g,))


@jax.custom_vjp
def _doubled_squared_cotangent(h):
  return 2.0 * h


_doubled_squared_cotangent.defvjp(lambda h: (2.0 * h, None), lambda _, g: (g * g,))


def test_cbwc_keeps_a_custom_derivative_out_of_the_shift(x64):
  # A7, and a bug of the unmutated code: the identity with a custom backward rule (the cotangent
  # squared) between w and the norm. fold may center w (the forward pass is unchanged); CBWC must
  # not: its gradient would pass the rule the projected cotangent, and (P·u)² ≠ P·(u²). The call,
  # flattened, left no node inside it to say so, and CBWC folded (gradients off by 0.9).
  for fn in (_squared_cotangent, _doubled_squared_cotangent):   # (no node inside the first)
    res = sound(lambda p, x, fn=fn: ln(fn(_h(p, x)), p["g"], p["be"]), 1)
    assert res.cbwc_report.num_folded == 0, res.cbwc_report


# ----------------------------------------------------------------------------
# Loops: a carry is what every iteration makes of it.


def test_a_scan_carry_that_starts_at_zero_is_not_zero(x64):
  # K10: the carry starts at zeros, then accumulates u = x @ w2: out_t = h_t + carry_t is
  # zero-sum only with w2 centered too (the fold centers w, b and w2).
  def apply(p, x):
    h, u = jnp.swapaxes(_h(p, x), 0, 1), jnp.swapaxes(x @ p["w2"], 0, 1)

    def body(c, hu):
      ht, ut = hu
      return c + ut, ht + c
    _, ys = lax.scan(body, jnp.zeros(h.shape[1:], h.dtype), (h, u))
    return ln(jnp.swapaxes(ys, 0, 1), p["g"], p["be"])
  res = sound(apply, 1, dict(DENSE, w2=(DIN, D)))
  centered = {c.param for s in res.fold_report.sites for c in s.centered}
  assert any("w2" in c for c in centered), centered



def test_a_scan_carry_shift_is_a_fixed_point(x64):
  # K5: the carry starts as x_0 @ w + b, shifted by c constant along d, and each step maps it
  # through m: from the second step the shift is c·colsum(m), which varies along d. The
  # outputs read the carry before the step, so only a second pass over the body sees that.
  def apply(p, x):
    def body(c, _):
      return c @ p["m"], c
    _, ys = lax.scan(body, _h(p, x[:, 0]), None, length=3)
    return ln(ys, p["g"], p["be"])
  sound(apply, 0, dict(DENSE, m=(D, D)))

# ----------------------------------------------------------------------------
# The planner's commitments.


def test_an_auxiliary_centering_of_a_program_output(x64):
  # P5: one centering of u = gelu(x @ w) would let both norms fold, but u is also an output.
  def apply(p, x):
    u = jax.nn.gelu(x @ p["w"])
    return (ln(u + x @ p["w1"], p["g"], p["be"]), ln(u + x @ p["w2"], p["g2"], p["be2"]), u)
  sound(apply, 0, {"w": (DIN, D), "w1": (DIN, D), "w2": (DIN, D), "g": (D,), "be": (D,), "g2": (D,),
                   "be2": (D,)})


def test_an_auxiliary_centering_over_d_does_not_serve_a_norm_over_halves(x64):
  # P4: one centering of v = gelu(x @ w) over d lets the two LayerNorms fold; the GroupNorm over
  # halves of d would need v centered per half, which is another centering (its shift is not
  # constant along d: the LayerNorms would see it). Two sites fold.
  def apply(p, x):
    v = jax.nn.gelu(x @ p["w"])
    halves = v + x @ p["w3"]
    halves = ln(halves.reshape(halves.shape[:-1] + (2, D // 2)), p["g3"], p["be3"]).reshape(halves.shape)
    return ln(v + x @ p["w1"], p["g"], p["be"]), ln(v + x @ p["w2"], p["g2"], p["be2"]), halves
  sound(apply, 2, {"w": (DIN, D), "w1": (DIN, D), "w2": (DIN, D), "w3": (DIN, D), "g": (D,), "be": (D,), "g2": (D,),
                   "be2": (D,), "g3": (D // 2,), "be3": (D // 2,)})


# ----------------------------------------------------------------------------
# Obligation 2: the mean removed must be exactly zero.


def _needs(fn, params, *args):
  traced = pipeline.trace(fn, params, args)
  with pipeline.analyzer(traced) as an:
    (site,) = [s for s in find_sites(an.top) if len(s.input.shape) >= 3]
    needs = site.level.needs(site.input, freeze(full_spec(site.input.shape, site.axes)))
    return ([traced.names[n.var.index] for n in needs if isinstance(n, LeafNeed)],
            [n.reason for n in needs if isinstance(n, Blocker)])


def _mask_args(dtype=bool):
  def extra(rng, b):
    return (jnp.asarray(rng.random((b, 4, D)) < 0.5, dtype),)
  return x_args(extra=extra)


def test_a_selection_that_mixes_features_is_not_zero_sum(x64):
  # E10: both cases carry the same shift c (a roll along d keeps it), so the centering is
  # invisible; but picking h[d] or h[d-1] per feature does not keep a zero sum over d.
  def apply(p, x, m):
    h = _h(p, x)
    return ln(jnp.where(m, h, jnp.roll(h, 1, -1)), p["g"], p["be"])
  sound(apply, 0, args=_mask_args())


# Zero-sum facets whose wrong claims obligation 1 masks in any fold: a product, quotient or odd
# power that breaks the zero sum also moves the centering's shift off the constants, so the
# planner refuses the centering anyway. The walk itself must still refuse them.


def test_the_walk_refuses_products_quotients_and_odd_powers_that_break_a_zero_sum(x64):
  p = {k: np.ones(s) for k, s in DENSE.items()}
  x = np.ones((2, 4, DIN))
  m = np.ones((2, 4, D))
  g = np.random.default_rng(0).standard_normal(D)
  for what, fn, args in (
      ("E3: h·m, m varying along d", lambda p, x, m: ln(_h(p, x) * m, g, g), (x, m)),
      ("E3: m·h", lambda p, x, m: ln(m * _h(p, x), g, g), (x, m)),
      ("E4: over (t, d), m constant along t only", lambda p, x, m: ln(_h(p, x) * m[0, 0], g, g, (1, 2)), (x, m)),
      ("E5: h / m", lambda p, x, m: ln(_h(p, x) / (m * m + 1.0), g, g), (x, m)),
      ("E8: h³", lambda p, x: ln(_h(p, x) ** 3, g, g), (x,)),
  ):
    leaves, blockers = _needs(fn, p, *args)
    assert blockers, f"{what}: the walk claims a zero sum after centering {leaves}"


def _window(h):
  """h[..., 2:6] as a gather (start index 2 along d, window 4)."""
  dn = lax.GatherDimensionNumbers(offset_dims=(0, 1, 2), collapsed_slice_dims=(), start_index_map=(2,))
  return lax.gather(h, jnp.array([2]), dn, slice_sizes=h.shape[:2] + (4,))


def test_the_walk_refuses_rearrangements_that_break_a_zero_sum(x64):
  p = {k: np.ones(s) for k, s in DENSE.items()}
  x = np.ones((2, 4, DIN))
  one = 1.0
  for what, fn, xx in (
      ("S5: a slice across a group boundary", lambda p, x: ln(_h(p, x)[..., 1:5], one, one), x),
      ("S8: pieces that are not whole groups", lambda p, x: ln(
          jnp.concatenate([_h(p, x), _h(p, x)[..., :4]], -1).reshape(x.shape[:2] + (2, 6)), one, one), x),
      ("R4: a cumulative sum along d", lambda p, x: ln(lax.cumsum(_h(p, x), 2), one, one), x),
      ("S11: a window over part of d", lambda p, x: ln(_window(x @ p["w"]), one, one), x),
      ("S19: a strided group of a split axis", lambda p, x: ln(_h(p, x).reshape(x.shape[:2] + (2, D // 2)), one,
                                                                one, (-2,)), x),
  ):
    leaves, blockers = _needs(fn, p, xx)
    assert blockers, f"{what}: the walk claims a zero sum after centering {leaves}"
