"""Adversarial shapes: a fold made at one example must be exact at every later
call shape, or refuse with a FoldError, with generic_shapes=True and False.

Examples with size-1 axes (batch 1, one token, one channel per group, a size-1
feature axis, size-1 parameters), programs that branch on a size in Python,
reduce over an axis that is size 1 in the example, or slice a size-1 token and
broadcast it back; each through fold, cbwc, fuse_affine, defer_norms and save/
load, compared with the original in float64 at other batch sizes, lengths and
ranks (every output, side outputs included), with the folded counts pinned.
"""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from fold_checks import make_params, rel_err

import jaxfold
from jaxfold.exporting import ExportWarning

D = 6


def ln(h, g, b, axes=(-1,), eps=1e-5):
  m = h.mean(axes, keepdims=True)
  v = ((h - m) ** 2).mean(axes, keepdims=True)
  return (h - m) / jnp.sqrt(v + eps) * g + b


def xs(*shape, seed=0):
  return jnp.asarray(np.random.default_rng([seed, *shape]).standard_normal(shape), jnp.float64)


def _params(seed=0, **extra):
  return make_params(seed, **{"w": (4, D), "bw": (D,), "g": (D,), "be": (D,), "v": (D, 3), **extra})


# ----------------------------------------------------------------------------
# export: a Python branch on a symbolic size.


def _twice_at_batch_one(p, x):
  y = ln(x @ p["w"] + p["bw"], p["g"], p["be"]) @ p["v"]
  return y * 2.0 if x.shape[0] == 1 else y


def _twice_at_even_batch(p, x):
  y = ln(x @ p["w"] + p["bw"], p["g"], p["be"]) @ p["v"]
  return y * 2.0 if x.shape[0] % 2 == 0 else y


@pytest.mark.parametrize("fn,example_batch", [(_twice_at_batch_one, 2), (_twice_at_batch_one, 1),
                                              (_twice_at_even_batch, 3)])
def test_export_of_a_size_branching_program_is_not_symbolic_where_it_differs(x64, fn, example_batch):
  """jax.export decides `b == 1` (and `b % 2 == 0`) as False for a symbolic b:
  the artifact exported at batch 2 computed the other branch at batch 1 (rel.
  error 0.5), and at a batch-1 example export raised an AssertionError. The
  program is now run where such branches flip (every symbolic dim 1, and one
  larger) and exported with fewer symbolic dims where it differs."""
  p = _params()
  x = xs(example_batch, 3, 4)
  folded = jaxfold.fold(p, fn, x)
  assert folded.report.num_folded == 1
  with pytest.warns(ExportWarning, match="differs from folded.apply_fn"):
    g = jaxfold.load_exported(jaxfold.export(folded, x))
  for b, t in [(1, 3), (2, 3), (3, 3), (4, 3), (1, 1), (2, 5)]:
    y = xs(b, t, 4, seed=9)
    try:
      got = g(y)
    except ValueError:   # a concrete artifact refuses other shapes: fine
      continue
    assert rel_err(fn(p, y), got) < 1e-9, (b, t)


def test_export_of_a_plain_program_stays_symbolic(x64):
  p = _params()
  f = lambda p, x: ln(x @ p["w"] + p["bw"], p["g"], p["be"]) @ p["v"]   # noqa: E731
  for b in (1, 2):
    folded = jaxfold.fold(p, f, xs(b, 3, 4))
    with warnings.catch_warnings():
      warnings.simplefilter("error", ExportWarning)
      g = jaxfold.load_exported(jaxfold.export(folded, xs(b, 3, 4)))
    for shape in [(1, 1, 4), (3, 5, 4)]:
      assert rel_err(f(p, xs(*shape)), g(xs(*shape))) < 1e-9


def _with_sample_std(p, x):
  return ln(x @ p["w"] + p["bw"], p["g"], p["be"]) @ p["v"], jnp.std(x, 0, ddof=1)   # NaN at batch 1


def test_export_compares_a_programs_own_nans_as_equal(x64):
  """The program's own NaN (a sample std over a batch of 1) at a resized
  example is no difference: the export stays symbolic and serves batch 1."""
  p = _params()
  folded = jaxfold.fold(p, _with_sample_std, xs(2, 3, 4))
  with warnings.catch_warnings():
    warnings.simplefilter("error", ExportWarning)
    g = jaxfold.load_exported(jaxfold.export(folded, xs(2, 3, 4)))
  for shape in [(1, 3, 4), (3, 2, 4)]:
    want, got = _with_sample_std(p, xs(*shape)), g(xs(*shape))
    assert rel_err(want[0], got[0]) < 1e-9
    np.testing.assert_allclose(got[1], want[1], rtol=1e-9)   # (NaN == NaN here)


# ----------------------------------------------------------------------------
# A call at shapes apply_fn cannot take.


def _plain(p, x):
  return ln(x @ p["w"] + p["bw"], p["g"], p["be"]) @ p["v"]


@pytest.mark.parametrize("how", ["fold", "example only", "fused", "cbwc"])
def test_a_call_that_cannot_trace_names_the_calls_shapes(x64, how):
  """The example traced; a later call with a wrong feature size said 'could not
  trace apply_fn(params, *example_args) ... params/example_args must be what
  apply_fn expects', blaming the example and naming no shape."""
  p = _params()
  x = xs(1, 4)
  if how == "cbwc":
    fn, params = jaxfold.cbwc(p, _plain, x).apply_fn, p
  else:
    m = jaxfold.fold(p, _plain, x, generic_shapes=how != "example only", fuse_affine=how == "fused")
    fn, params = m.apply_fn, m.params
  with pytest.raises(jaxfold.FoldError) as e:
    fn(params, xs(3, 5))
  msg = str(e.value)
  assert "this call's arguments (shapes (3, 5);" in msg and "was given (1, 4)" in msg, msg
  assert "example_args" not in msg and "contracting dimensions" in msg, msg
