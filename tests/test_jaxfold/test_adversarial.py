"""Adversarial programs (``adversarial_programs.py``) against fold and CBWC.

For each program, in float64 and at two input shapes:

* ``test_fold_exact``: the folded program equals the original (eagerly at
  variant 0, under ``jax.jit`` on both sides at variant 1);
* ``test_cbwc_exact``: CBWC equals the original at parameters the analysis
  never saw;
* ``test_cbwc_grad``: CBWC's gradients equal the original's, leaf by leaf;
* ``test_centering_invisible``: for every in-place centering that fold or
  CBWC chose, adding any tensor constant over the centered blocks to that
  parameter leaves the original program's outputs unchanged;
* ``test_expect_fold``: the number of folded sites agrees with what the math
  requires (``expect_fold``).

Nothing may raise for these valid programs (refusing to fold is fine).
``test_bf16_params`` runs CBWC traced in float32 with bfloat16 parameters.
"""

import functools

import adversarial_programs as ap
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err, x64_context
from fold_checks import in_place_centerings, shift_along

import jaxfold

F64 = jnp.float64
TOL = 1e-9
GRAD_TOL = 1e-8

PROGRAMS = {p.name: p for p in ap.PROGRAMS}
NAMES = sorted(PROGRAMS)


# ----------------------------------------------------------------------------
# Helpers (results cached per program so each is analysed once).


@functools.lru_cache(maxsize=None)
def _setup(name):
  prog = PROGRAMS[name]
  with x64_context():
    p = prog.init(jax.random.PRNGKey(0))
    q = prog.init(jax.random.PRNGKey(7))
    args = [prog.make_args(1, 0), prog.make_args(2, 1)]
  return prog, p, q, args


@functools.lru_cache(maxsize=None)
def _folded(name):
  prog, p, _, args = _setup(name)
  with x64_context():
    return jaxfold.fold(p, prog.apply, *args[0], **dict(prog.fold_kwargs))


@functools.lru_cache(maxsize=None)
def _cbwc(name):
  prog, p, _, args = _setup(name)
  with x64_context():
    return jaxfold.cbwc(p, prog.apply, *args[0])


def _describe(report):
  return "\n" + str(report)


def _float_leaves(tree):
  return [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]


def _loss_fn(example_out):
  """Sum of squares of a fixed random projection of every float output."""
  mats = []
  for i, o in enumerate(_float_leaves(example_out)):
    rng = np.random.default_rng(1234 + i)
    mats.append(jnp.asarray(rng.standard_normal((int(np.size(o)), 3)), F64))

  def loss(out):
    total = 0.0
    for o, m in zip(_float_leaves(out), mats):
      proj = jnp.reshape(o, (-1,)).astype(F64) @ m
      total = total + jnp.sum(proj ** 2)
    return total
  return loss


# ----------------------------------------------------------------------------
# The checks.


@pytest.mark.slow
def test_program_library_is_sane():
  """The two variants of every program differ in shape, and its parameters are
  float64 (that every program runs to finite outputs at both variants is
  checked where they run, in test_fold_exact)."""
  assert 40 <= len(NAMES) <= 130
  with x64_context():
    for name in NAMES:
      _, p, _, args = _setup(name)
      shapes = [tuple(np.shape(a) for a in jax.tree_util.tree_leaves(x)) for x in args]
      assert shapes[0] != shapes[1], name
      for leaf in jax.tree_util.tree_leaves(p):
        assert leaf.dtype == F64, name


def _finite(out, name: str, variant: int) -> None:
  for o in _float_leaves(out):
    assert np.all(np.isfinite(np.asarray(o))), f"{name}: the original is not finite at variant {variant}"


@pytest.mark.parametrize("name", NAMES)
def test_fold_exact(name):
  prog, p, _, args = _setup(name)
  with x64_context():
    f = _folded(name)
    ref0 = prog.apply(p, *args[0])
    _finite(ref0, name, 0)
    err0 = rel_err(ref0, f.apply_fn(f.params, *args[0]))
    assert err0 < TOL, f"{name}: folded != original at variant 0, rel err {err0:.3g}" + _describe(f.report)
    ref1 = jax.jit(prog.apply)(p, *args[1])
    _finite(ref1, name, 1)
    err1 = rel_err(ref1, jax.jit(f.apply_fn)(f.params, *args[1]))
    assert err1 < TOL, f"{name}: folded != original at variant 1 (jit), rel err {err1:.3g}" + _describe(f.report)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_cbwc_exact(name):
  prog, _, q, args = _setup(name)
  with x64_context():
    r = _cbwc(name)
    for v, a in enumerate(args):
      err = rel_err(prog.apply(q, *a), r.apply_fn(q, *a))
      assert err < TOL, (f"{name}: CBWC != original at other params, variant {v}, rel err {err:.3g}"
                         + _describe(r.report))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_cbwc_grad(name):
  prog, _, q, args = _setup(name)
  with x64_context():
    r = _cbwc(name)
    for v, a in enumerate(args):
      loss = _loss_fn(prog.apply(q, *a))
      try:
        g_ref = jax.grad(lambda t, loss=loss, a=a: loss(prog.apply(t, *a)))(q)
      except ValueError as e:  # e.g. reverse mode through a dynamic while_loop
        pytest.skip(f"the original program is not reverse-differentiable: {str(e)[:80]}")
      try:
        g_cb = jax.grad(lambda t, loss=loss, a=a: loss(r.apply_fn(t, *a)))(q)
      except ValueError as e:
        # CBWC runs the program traced at abstract arguments: a fori_loop whose
        # bounds are arguments is a while loop there, as in the original under jit.
        try:
          jax.jit(lambda t, a, loss=loss: jax.grad(lambda u: loss(prog.apply(u, *a)))(t))(q, a)
        except ValueError:
          pytest.skip(f"the original program under jit is not reverse-differentiable: {str(e)[:80]}")
        raise
      paths = jax.tree_util.tree_flatten_with_path(g_ref)[0]
      ref_leaves = [np.asarray(x) for _, x in paths]
      cb_leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(g_cb)]
      scale = max(float(np.max(np.abs(x))) for x in ref_leaves)
      for (path, _), x, y in zip(paths, ref_leaves, cb_leaves):
        denom = max(float(np.max(np.abs(x))), 1e-3 * scale, 1e-30)
        err = float(np.max(np.abs(x - y))) / denom
        assert err < GRAD_TOL, (f"{name}: CBWC gradient of {jax.tree_util.keystr(path)} differs at "
                                f"variant {v}, rel err {err:.3g}" + _describe(r.report))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_centering_invisible(name):
  prog, p, _, args = _setup(name)
  with x64_context():
    f, r = _folded(name), _cbwc(name)
    paths_leaves, tree = jax.tree_util.tree_flatten_with_path(p)
    index = {jax.tree_util.keystr(path): i for i, (path, _) in enumerate(paths_leaves)}
    leaves = [x for _, x in paths_leaves]
    refs = [jax.jit(prog.apply)(p, *a) for a in args]
    for k, (param, spec) in enumerate(in_place_centerings(f.report, r.report)):
      assert param in index, f"{name}: centering names unknown parameter {param}"
      i = index[param]
      shifted = list(leaves)
      shifted[i] = leaves[i] + 3.0 * shift_along(100 + k, leaves[i].shape, spec)
      pt = jax.tree_util.tree_unflatten(tree, shifted)
      for v, a in enumerate(args):
        err = rel_err(refs[v], jax.jit(prog.apply)(pt, *a))
        assert err < TOL, (f"{name}: centering {param} over {spec} is visible (variant {v}, "
                           f"rel err {err:.3g})" + _describe(f.report))


# Sound folds the analysis does not find yet: control flow and scatter-add
# are the coverage issue's work. Strict, so a fix shows up as XPASS.
COVERAGE_TODO: set = set()  # programs a sound fold exists for but the analysis misses (strict xfail)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(
    strict=True, reason="coverage: not analysed yet")) if n in COVERAGE_TODO else n
    for n in NAMES])
def test_expect_fold(name):
  prog = PROGRAMS[name]
  if prog.expect_fold is None:
    _folded(name)   # must still not raise
    return
  rep = _folded(name).report
  if prog.expect_fold:
    assert rep.num_folded >= 1, f"{name}: nothing folded, but a sound fold exists ({prog.note})" + _describe(rep)
  else:
    assert rep.num_folded == 0, (f"{name}: folded {rep.num_folded} site(s), but no fold is sound ({prog.note})"
                                 + _describe(rep))


_LIBRARY_FRAMES = ("site-packages", "flax/", "jax/_src", "numpy/", "jaxfold/_src")


@pytest.mark.parametrize("name", NAMES)
def test_site_locations(name):
  # Every site reads differently, in the user's terms (module path or the
  # user's file:line), never a frame inside flax, jax or numpy.
  wheres = [s.where for s in _folded(name).report.sites]
  assert len(set(wheres)) == len(wheres), wheres
  for w in wheres:
    assert w and not any(k in w for k in _LIBRARY_FRAMES), w


# ----------------------------------------------------------------------------
# rc11: dtypes. CBWC traced with float32 parameters, called with bfloat16 ones.


def _is_clear_dtype_error(e: Exception) -> bool:
  return type(e) is not TypeError and "dtype" in str(e).lower()


@pytest.mark.parametrize("prog", ap.DTYPE_PROGRAMS, ids=lambda p: p.name)
@pytest.mark.parametrize("bf16_args", [False, True], ids=["f32_args", "bf16_args"])
def test_bf16_params(prog, bf16_args):
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", False)
  try:
    p = prog.init(jax.random.PRNGKey(0))
    (x,) = prog.make_args(1, 0)
    r = jaxfold.cbwc(p, prog.apply, x)
    pb = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), p)
    xb = x.astype(jnp.bfloat16) if bf16_args else x
    ref = prog.apply(pb, xb)
    try:
      out = r.apply_fn(pb, xb)
    except Exception as e:  # noqa: BLE001 - a clear refusal is acceptable
      assert _is_clear_dtype_error(e), f"{prog.name}: unclear error {type(e).__name__}: {e}"
      return
    assert jnp.result_type(out) == jnp.result_type(ref), (jnp.result_type(out), jnp.result_type(ref))
    err = rel_err(ref, out)
    assert err < 0.1, f"{prog.name}: CBWC with bf16 params differs from the original, rel err {err:.3g}"
  finally:
    jax.config.update("jax_enable_x64", prev)
