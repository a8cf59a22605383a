"""Fuzzing jaxfold with seeded random programs (``fuzz_programs.py``).

``test_fuzz[seed]``: for each program, in float64 (see ``fold_checks.check_fold``):
  (a) fold and cbwc (both with the program's options) never raise (refusing a
      site is fine);
  (b) folded == original (rel err < 1e-9) at the example arguments (batch 2)
      and at batch 3 with ``fuzz_programs.OTHER_T`` more tokens (at batch 3 only
      where the program is defined for one sequence length: ~8%); a FoldError
      saying the other shape needs other folded parameters is allowed there;
  (c) CBWC at parameters the analysis never saw == original;
  (d) CBWC gradients == original gradients, leaf by leaf (< 1e-8);
  (e) every in-place centering is invisible in the original program.

The generators include direct reads of parameters (sums, norms, an L2
regularizer, a kernel at a second use, a transposed tied head) and loops that
run zero times (scan of length 0, fori_loop with equal static or traced
bounds, a while loop false at entry).

N programs: ``len(fuzz_programs.KEYS)`` (184) by default, one built around each
(rule, variant) key (seeds 0..N-1, ``JAXFOLD_FUZZ_N`` overrides);
``pytest -m slow`` runs ``test_fuzz_slow`` over seeds 0..4999
(``JAXFOLD_FUZZ_N_SLOW``). A failure prints the program (op list, seed); rerun it
with ``-k "test_fuzz and [SEED]"`` or ``fuzz_programs.make_program(SEED)``.

``test_fuzz_batch_one[seed]``: (a), (b) and (e) with the example cut to batch 1
(and to one token where the program takes another length), folded with and
without ``generic_shapes`` (every 8th default seed; ``test_fuzz_batch_one_slow``
over seeds 0..999, ``JAXFOLD_FUZZ_N_SLOW_BATCH_ONE``).

``test_every_rule_is_generated``: over the default programs, every
(rule, variant) of ``jaxfold._src.rules.all_rules()`` was generated and every
registered primitive appears in some program's jaxpr (nested jaxprs included).
"""

import os

import fold_checks as fc
import fuzz_programs as fp
import jax
import np_eval
import numpy as np
import pytest
from conftest import x64_context

# One program per (rule, variant) key (seed % len(KEYS) picks the key a program is built
# around), so the default run generates every rule; the slow run covers seeds 0..N_SLOW-1.
N_DEFAULT = int(os.environ.get("JAXFOLD_FUZZ_N", str(len(fp.KEYS))))
N_SLOW = int(os.environ.get("JAXFOLD_FUZZ_N_SLOW", "5000"))
N_SLOW_BATCH_ONE = int(os.environ.get("JAXFOLD_FUZZ_N_SLOW_BATCH_ONE", "1000"))

# Registered primitives that cannot occur in a float program around a
# normalization (keep short; every entry needs a reason).
EXEMPT: dict = {}


def _check(seed: int):
  with x64_context():
    prog = fp.make_program(seed)
    # The program itself must be valid and finite at both argument sets.
    for a in prog.args:
      out = np_eval.run(prog.apply, prog.params, *a)
      for o in fc.float_leaves(out):
        assert np.all(np.isfinite(np.asarray(o))), "invalid fuzz program (non-finite output)\n" + prog.describe()
    res = fc.check_fold(prog.apply, prog.params, prog.args, prog.other_params,
                        fold_kwargs=prog.fold_kwargs, tol=prog.tol, grad_tol=prog.grad_tol,
                        grads=prog.differentiable)
  if res.failures:
    pytest.fail("\n".join([prog.describe(), "", "failures:"] + ["  " + f for f in res.failures]
                          + ["", res.describe()]), pytrace=False)


def _check_batch_one(seed: int):
  """The program folded at batch 1 (and at one token, where it takes another
  length), with and without ``generic_shapes``: exact at the example and at
  both fuzz argument sets, or a clear refusal there."""
  with x64_context():
    prog = fp.make_program(seed)
    examples = [fp.batch_one(prog.args[0])] + ([fp.batch_one(prog.args[0], True)] if prog.other_t else [])
    fails = []
    for ex in examples:
      try:
        out = np_eval.run(prog.apply, prog.params, *ex)
      except Exception:  # noqa: BLE001 - the program is not defined at one row or token
        continue
      if not all(np.all(np.isfinite(np.asarray(o))) for o in fc.float_leaves(out)):
        continue
      for generic in (True, False):
        res = fc.check_fold(prog.apply, prog.params, [ex] + list(prog.args), fold_kwargs=dict(
            prog.fold_kwargs, generic_shapes=generic), tol=prog.tol, cbwc=False)
        fails += [f"example {np.shape(ex[0])}, generic_shapes={generic}: {f}" for f in res.failures]
  if fails:
    pytest.fail("\n".join([prog.describe(), "", "failures:"] + ["  " + f for f in fails]), pytrace=False)


@pytest.mark.parametrize("seed", range(N_DEFAULT))
def test_fuzz(seed):
  _check(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(N_SLOW))
def test_fuzz_slow(seed):
  _check(seed)


@pytest.mark.parametrize("seed", range(0, N_DEFAULT, 8))
def test_fuzz_batch_one(seed):
  _check_batch_one(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(N_SLOW_BATCH_ONE))
def test_fuzz_batch_one_slow(seed):
  _check_batch_one(seed)


def _registry():
  from jaxfold._src.rules import all_rules
  return all_rules()


@pytest.mark.slow
def test_every_rule_is_generated():
  rules = _registry()
  tags, prims = set(), set()
  with x64_context():
    for seed in range(N_DEFAULT):
      prog = fp.make_program(seed)
      tags |= prog.tags
      prims |= fp.primitives_of(jax.make_jaxpr(prog.apply)(prog.params, *prog.args[0]))
  missing = [(r.name, v) for r in rules for v in (r.variants or ("",)) if (r.name, v) not in tags]
  assert not missing, (f"(rule, variant) pairs never generated in {N_DEFAULT} programs: {missing}; "
                       "add op constructors for them to fuzz_programs.OPS")
  absent = sorted({p.name for r in rules for p in r.primitives
                   if p is not None and p not in prims and p.name not in EXEMPT})
  assert not absent, (f"registered primitives that appear in none of the {N_DEFAULT} programs' "
                      f"jaxprs: {absent}")
  stale = sorted(EXEMPT.keys() & {p.name for p in prims})
  assert not stale, f"exempted primitives that do appear (drop them from EXEMPT): {stale}"


def test_op_table_mirrors_registry():
  """Every registry key has a constructor; table keys name registered rules and
  variants (or the control-flow rules to come)."""
  rules = {r.name: r for r in _registry()}
  for r in rules.values():
    for v in r.variants or ("",):
      assert (r.name, v) in fp.OPS, f"no op constructor for rule {r.name!r} variant {v!r}"
  future = {"jit", "checkpoint", "custom_jvp_call", "custom_vjp_call", "scan", "cond", "while", "vmap"}
  for name, variant in fp.OPS:
    if name in rules:
      assert variant in (rules[name].variants or ("",)), f"op table key {(name, variant)} is not a variant of {name}"
    else:
      assert name in future, f"op table key {(name, variant)} names no registered rule"
