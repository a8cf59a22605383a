"""Adversarial exports: ``jaxfold.export`` of folds, fused, deferred and rotated
results at symbolic batch and sequence, compared with the ORIGINAL program in
float64 at other sizes (1 included) — a wrong artifact is the worst outcome,
a fallback to fewer symbolic dims (ExportWarning) an acceptable one.

Findings (each test failed before its fix):

* A Python branch on a symbolic size that the size probes (every symbolic dim
  1, and one larger than the example) do not flip: ``x.shape[0] == 5``,
  ``b % 4 == 0``, ``b in (4, 8)``, ``b == t``. jax.export decides each as False
  for every size, so the artifact exported at batch 2 computed the other branch
  at batch 5 (or 4, 8, ...; relative error 0.5), silently. ``export`` now
  records, while it traces, every ``==`` on a symbolic size that code outside
  jax and jaxfold makes and that jax decides without proof
  (``compat.undecided_size_comparisons``), and exports with fewer symbolic dims.
* Example arguments that give one symbolic dim two sizes (a per-token mask
  table of 48 rows sliced to the stream's length, where x has 4 tokens: seed
  214 of ``test_fuzz_transforms``): ``export`` exported at symbolic ``seq``
  anyway, then its own check raised jax's "Input shapes do not match the
  polymorphic shapes specification" ValueError (with ``check=False`` it returned
  an artifact that refuses the example). ``export`` now names an axis only on the
  arguments of the example's size for it (``_naming``): the mask keeps its 48
  rows, the program cannot slice it to a symbolic length and falls back to a
  symbolic batch, with an ExportWarning.

Pinned (passed when written; they kill a ``_gather_canon`` that forgets its
in-bounds condition): constant-index gathers at concrete shapes, a first-token
readout by ``jnp.take`` and γ read through a gather, in range and out of range
with clip and fill, folded and deferred, exact and exported at a symbolic batch.
"""

import warnings

import jax
import jax.numpy as jnp
import np_eval
import numpy as np
import pytest
from helpers import rel_err
from jax import export as jax_export

import jaxfold
from jaxfold._src import compat
from jaxfold.exporting import ExportWarning, exported_signature, load_exported


def _ln(h, g, b):
  m = h.mean(-1, keepdims=True)
  v = ((h - m) ** 2).mean(-1, keepdims=True)
  return (h - m) / jnp.sqrt(v + 1e-5) * g + b


def _params(seed=0):
  rng = np.random.default_rng(seed)
  shapes = dict(W=(8, 16), g=(16,), b=(16,), V=(16, 4))
  return {k: jnp.asarray((1.0 + 0.5 * rng.normal(size=s)) if len(s) == 1 else 0.3 * rng.normal(size=s), jnp.float64)
          for k, s in shapes.items()}


def _x(b, t, seed=0):
  return jnp.asarray(np.random.default_rng([seed, b, t]).normal(size=(b, t, 8)))


def _block(p, x):
  return _ln(x @ p["W"], p["g"], p["b"]) @ p["V"]


# ----------------------------------------------------------------------------
# Python branches on a symbolic size that the size probes do not flip.


def _twice_at_batch_5(p, x):
  return _block(p, x) * (2.0 if x.shape[0] == 5 else 1.0)


def _twice_at_batch_multiple_of_4(p, x):
  return _block(p, x) * (2.0 if x.shape[0] % 4 == 0 else 1.0)


def _twice_at_batch_4_or_8(p, x):
  return _block(p, x) * (2.0 if x.shape[0] in (4, 8) else 1.0)


def _twice_when_square(p, x):
  return _block(p, x) * (2.0 if x.shape[0] == x.shape[1] else 1.0)


@pytest.mark.parametrize("fn", [_twice_at_batch_5, _twice_at_batch_multiple_of_4, _twice_at_batch_4_or_8,
                                _twice_when_square])
@pytest.mark.parametrize("how", ["fold", "defer"])
def test_a_size_branch_the_probes_miss_is_not_exported_symbolically(x64, fn, how):
  p = _params()
  r = jaxfold.fold(p, fn, _x(2, 4), defer_norms=how == "defer")
  with pytest.warns(ExportWarning, match="compares symbolic sizes in Python"):
    fn_loaded = load_exported(jaxfold.export(r, _x(2, 4)))
  # A branch on the batch size alone leaves the sequence symbolic; one on both, neither.
  seq = fn is not _twice_when_square
  assert exported_signature(fn_loaded) == [((2, "seq" if seq else 4, 8), "float64")]
  for t in ((4, 1, 7) if seq else (4,)):
    assert rel_err(np_eval.run(fn, p, _x(2, t)), fn_loaded(_x(2, t))) < 1e-9
  for b, t in [(4, 4), (5, 4), (8, 4), (5, 2)]:
    with pytest.raises(ValueError, match="exported for fixed shapes" if not seq else "its int dims are fixed"):
      fn_loaded(_x(b, t))


def test_undecided_size_comparisons_records_only_the_users_unproved_ones():
  b, t = jax_export.symbolic_shape("b, t")
  cls = type(b)
  eq = cls.__eq__
  with compat.undecided_size_comparisons() as seen:
    assert not b == 5 and b != 0 and b == b and not b == t      # noqa: PLR0124
    assert not (b % 4 == 0) and b * 2 != 1 and b >= 1
    jnp.broadcast_shapes((b, 16), (1, 16))                     # jax's own b == 1: safe there
  assert [s.split(" at ")[0] for s in seen] == ["`b == 5`", "`b == t`", "`mod(b, 4) == 0`"]
  assert all("test_adversarial_export.py:" in s for s in seen)
  assert cls.__eq__ is eq                                      # jax's own comparison again
  assert not b == 5


def test_a_plain_program_still_exports_symbolically(x64):
  """The detector must not refuse ordinary programs (jax's and jaxfold's own
  size comparisons are decided soundly): fused, batch and length symbolic."""
  p = _params()
  r = jaxfold.fold(p, _block, _x(2, 4), fuse_affine=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ExportWarning)
    fn = load_exported(jaxfold.export(r, _x(2, 4)))
  for b, t in [(1, 1), (5, 3)]:
    assert rel_err(np_eval.run(_block, p, _x(b, t)), fn(_x(b, t))) < 1e-9


def _masked(p, x, m):
  """A mask table longer than any sequence, sliced to the stream's length."""
  return _block(p, x) * m[:, : x.shape[1], None]


def _mask(b, seed=0):
  return jnp.asarray(np.random.default_rng([seed, b]).random((b, 48)) < 0.6, jnp.float64)


def test_an_example_with_two_sizes_for_seq_falls_back_to_a_symbolic_batch(x64):
  p = _params()
  r = jaxfold.fold(p, _masked, _x(2, 4), _mask(2), fuse_affine=True)
  for check in (True, False):
    with pytest.warns(ExportWarning, match=r"exported with symbolic dimensions \('batch',\) .*min\(48, seq\)"):
      fn = load_exported(jaxfold.export(r, _x(2, 4), _mask(2), check=check))
    for b in (2, 5):
      assert rel_err(np_eval.run(_masked, p, _x(b, 4), _mask(b)), fn(_x(b, 4), _mask(b))) < 1e-9


# ----------------------------------------------------------------------------
# A gather of a constant window (rules/structural._gather_canon) is canonically
# that window of its operand at concrete shapes too: a first-token readout by
# jnp.take and γ read through a gather of a whole leaf fuse. Only a window
# inside the operand is one: clip moves an out-of-range start, fill reads the
# fill value (2.0 here, not γ); neither fuses. Pinned counts, exact values.

_G = dict(W=(8, 16), V=(16, 4), g=(16,), be=(16,), g1=(1, 16))


def _gparams(seed=0):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray((1.0 + 0.5 * rng.normal(size=s)) if k[0] == "g" else 0.3 * rng.normal(size=s), jnp.float64)
          for k, s in _G.items()}


def _n(p, x):
  return _ln(x @ p["W"], 1.0, 0.0)


_GATHERS = {   # name: (program, number fused)
    "first token": (lambda p, x: jnp.take(_n(p, x) * p["g"] + p["be"], 0, axis=1) @ p["V"], 1),
    "token, fill out of range": (lambda p, x: jnp.take(_n(p, x) * p["g"] + p["be"], 9, axis=1, mode="fill",
                                                       fill_value=0.5) @ p["V"], 0),
    "token, clip out of range": (lambda p, x: jnp.take(_n(p, x) * p["g"] + p["be"], 9, axis=1, mode="clip")
                                 @ p["V"], 0),
    "γ, row of a leaf": (lambda p, x: (_n(p, x) * jnp.take(p["g1"], 0, axis=0) + p["be"]) @ p["V"], 1),
    "γ, fill out of range": (lambda p, x: (_n(p, x) * jnp.take(p["g1"], 3, axis=0, mode="fill", fill_value=2.0)
                                           + p["be"]) @ p["V"], 0),
    "γ, clip out of range": (lambda p, x: (_n(p, x) * jnp.take(p["g1"], 3, axis=0, mode="clip") + p["be"])
                             @ p["V"], 0),
    "γ, row of its broadcast": (lambda p, x: (_n(p, x) * jnp.take(jnp.broadcast_to(p["g"], (3, 16)), 2, axis=0)
                                              + p["be"]) @ p["V"], 1),
}


@pytest.mark.parametrize("name", list(_GATHERS))
def test_constant_gathers_fuse_exactly_and_export(x64, name):
  fn, fused = _GATHERS[name]
  p = _gparams()
  r = jaxfold.fold(p, fn, _x(2, 4), defer_norms=True)
  assert r.report.num_fused == fused
  for b, t in [(2, 4), (3, 5), (1, 1)]:
    assert rel_err(np_eval.run(fn, p, _x(b, t)), np_eval.run(r.apply_fn, r.params, _x(b, t))) < 1e-9, (b, t)
  fn_loaded = load_exported(jaxfold.export(r, _x(2, 4), symbolic=("batch",)))
  for b in (1, 5):
    assert rel_err(np_eval.run(fn, p, _x(b, 4)), fn_loaded(_x(b, 4))) < 1e-9, b


# ----------------------------------------------------------------------------
# Arguments whose leading axes are not the batch or the sequence: a typed PRNG
# key, a raw key of shape (2,), a position table of the example's length. Each
# used to make every symbolic export fail the consistency check (the example
# gave `batch` two sizes) and fell back to concrete shapes; now such an argument
# keeps its own size and the stream stays symbolic where the program allows.


def _noisy(p, x, key):
  """Deterministic in the key: a per-feature scale drawn from it."""
  return _block(p, x * (1.0 + 0.1 * jax.random.uniform(key, x.shape[-1:], x.dtype)))


def _positioned(p, x, pos):
  return _block(p, x + pos[:, None])


@pytest.mark.parametrize("key", ["typed", "raw"])
def test_a_key_argument_keeps_its_shape_and_the_stream_stays_symbolic(x64, key):
  p = _params()
  k = jax.random.key(7) if key == "typed" else jax.random.PRNGKey(7)
  r = jaxfold.fold(p, _noisy, _x(3, 4), k, fuse_affine=True)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always", ExportWarning)
    fn = load_exported(jaxfold.export(r, _x(3, 4), k))
  # A raw key is a uint32 array like any other: the warning names the axis it keeps.
  msgs = [str(w.message) for w in seen if issubclass(w.category, ExportWarning)]
  assert len(msgs) == (key == "raw") and all("args[1] [2] axis 0" in m for m in msgs), msgs
  assert exported_signature(fn)[0] == (("batch", "seq", 8), "float64")
  want = jax.jit(_noisy)
  for b, t in [(1, 1), (5, 3), (3, 4)]:
    assert rel_err(want(p, _x(b, t), k), fn(_x(b, t), k)) < 1e-9


def test_a_position_table_falls_back_to_a_symbolic_batch_not_to_concrete_shapes(x64):
  p = _params()
  pos = jnp.linspace(-1.0, 1.0, 4)
  r = jaxfold.fold(p, _positioned, _x(2, 4), pos)
  with pytest.warns(ExportWarning, match=r"exported with symbolic dimensions \('batch',\)"):
    fn = load_exported(jaxfold.export(r, _x(2, 4), pos))
  assert exported_signature(fn)[0] == (("batch", 4, 8), "float64")
  for b in (1, 5):
    assert rel_err(np_eval.run(_positioned, p, _x(b, 4), pos), fn(_x(b, 4), pos)) < 1e-9


# ----------------------------------------------------------------------------
# The size probes behind the comparison detector: a size looked up in a dict
# (hash first, so no symbolic `==` is ever made) is decided by the symbolic
# trace as "not 1"; only running the artifact at size 1 shows that the program
# differs there.

_SCALE_BY_BATCH = {1: 2.0}


def _twice_at_batch_1_by_lookup(p, x):
  return _block(p, x) * _SCALE_BY_BATCH.get(x.shape[0], 1.0)


def test_a_size_decided_without_a_comparison_is_caught_by_the_size_probes(x64):
  p = _params()
  r = jaxfold.fold(p, _twice_at_batch_1_by_lookup, _x(2, 4))
  # (were a dim's hash ever to equal 1's, the dict would compare them: the detector's warning)
  with pytest.warns(ExportWarning, match="differs from folded.apply_fn|compares symbolic sizes"):
    fn = load_exported(jaxfold.export(r, _x(2, 4)))
  assert exported_signature(fn)[0][0][0] == 2      # the batch is not symbolic
  for b, t in [(2, 4), (2, 1), (2, 6)] if exported_signature(fn)[0][0][1] == "seq" else [(2, 4)]:
    assert rel_err(np_eval.run(_twice_at_batch_1_by_lookup, p, _x(b, t)), fn(_x(b, t))) < 1e-9


def test_max_rel_diff_counts_a_non_finite_mismatch_as_a_difference():
  from jaxfold._src.artifact import _max_rel_diff
  w = np.array([1.0, 2.0, np.nan, np.inf])
  assert _max_rel_diff([w], [w]) == 0.0                        # the program's own NaN/inf: no difference
  assert _max_rel_diff([np.array([1.0, np.nan, np.nan, np.inf])], [w]) == np.inf
  assert _max_rel_diff([np.array([1.0, 2.0, np.nan, -np.inf])], [w]) == np.inf
  assert _max_rel_diff([np.array([1.0, 2.5, np.nan, np.inf])], [w]) == pytest.approx(0.25)
