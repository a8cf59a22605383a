"""Fuzzing the transforms on a fold with the programs of ``fuzz_programs.py``.

``test_fuzz_transforms[seed]``: for each program, in float64, fold it at the
example arguments and apply ``fuse_affine``, ``defer_norms`` (on the fused
result), ``rotate`` (fused and deferred, by a random orthogonal Q at each
candidate stream size; a ``RotateError`` is a refusal), a
``save_fold``/``load_fold`` round trip of every result, and ``export`` at
symbolic (batch, seq) of the last result (an ``ExportWarning`` fallback is
fine). Every result must equal the ORIGINAL program (rel err < ``prog.tol``,
or the precision of a float cast that fuse_affine moved γ/β through, by design)
at both fuzz argument sets; at the second one a ``JaxfoldError`` is accepted
only where the fold itself refuses there. Nothing may raise but a
``JaxfoldError`` (a refusal: counted, not failed).

The fuzz programs nearly always hold an op no rotation commutes with, so
``test_fuzz_transforms_stream`` also runs ``fuzz_programs.make_stream_program``
(pre-LN transformers with random LayerNorm spellings, where rotate has work).

The default tier runs ``N_DEFAULT`` seeds spread over the (rule, variant) keys
(``JAXFOLD_FUZZX_N``) and ``N_STREAM`` stream programs; ``pytest -m slow`` runs
``test_fuzz_transforms_slow`` over seeds 0..N_SLOW-1 (``JAXFOLD_FUZZX_N_SLOW``)
and ``test_fuzz_transforms_stream_slow`` over N_STREAM_SLOW stream programs;
``test_fuzz_transforms_batch_one_slow`` folds (and transforms) at the example
cut to batch 1 and checks at both argument sets (``JAXFOLD_FUZZX_N_SLOW_BATCH_ONE``).
Reproduce one program with ``python tests/test_jaxfold/test_fuzz_transforms.py
SEED ...`` (``STREAM=1`` for stream programs, ``BATCH_ONE=1`` to fold at batch 1, ``FULL=1``
for tracebacks).
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
import warnings
from typing import Any, Callable, NamedTuple

import fold_checks as fc
import fuzz_programs as fp
import jax
import np_eval
import numpy as np
import pytest
from conftest import x64_context

import jaxfold
from jaxfold._src.artifact import ExportWarning

N_DEFAULT = int(os.environ.get("JAXFOLD_FUZZX_N", "6"))
N_SLOW = int(os.environ.get("JAXFOLD_FUZZX_N_SLOW", "400"))
N_STREAM = int(os.environ.get("JAXFOLD_FUZZX_N_STREAM", "4"))
N_STREAM_SLOW = int(os.environ.get("JAXFOLD_FUZZX_N_STREAM_SLOW", "200"))
N_SLOW_BATCH_ONE = int(os.environ.get("JAXFOLD_FUZZX_N_SLOW_BATCH_ONE", "150"))
# Default seeds: spread over the key table (seed % len(KEYS) picks the forced op).
DEFAULT_SEEDS = [(37 * i) % len(fp.KEYS) for i in range(N_DEFAULT)]
# Candidate residual-stream sizes: the fuzz programs' hidden and input widths.
STREAM_SIZES = sorted(set(fp.HIDDEN) | {fp.DIN})


def _orthogonal(n: int, seed: int) -> np.ndarray:
  return np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))[0]


def _exc(e: BaseException) -> str:
  return "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-6)).rstrip()


class _Model(NamedTuple):
  params: Any
  apply_fn: Callable


class _Run:
  """The checks of one program: ``failures`` (bugs) and ``refusals`` (fine)."""

  def __init__(self, prog):
    self.prog = prog
    self.failures: list = []
    self.refusals: list = []
    self.refs = [np_eval.run(prog.apply, prog.params, *a) for a in prog.args]
    self.fold_refuses: set = set()     # argument sets where the fold itself refuses (FoldError)
    self.tol = prog.tol
    self.rotated = 0

  def call(self, label: str, what, *, ok_refuse: bool = False):
    """``what()``, recording a JaxfoldError as a refusal (``ok_refuse``) or a
    failure, anything else as a failure; None when it raised."""
    try:
      return what()
    except jaxfold.JaxfoldError as e:
      (self.refusals if ok_refuse else self.failures).append(f"{label}: {type(e).__name__}: {e}"
                                                              + ("" if ok_refuse else "\n" + _exc(e)))
    except Exception as e:  # noqa: BLE001 - anything but a jaxfold error is a bug
      self.failures.append(f"{label} raised {type(e).__name__}: {e}\n{_exc(e)}")
    return None

  def check_outputs(self, label: str, fn, params, *, jax_only: bool = False):
    """``fn(params, *args)`` == the original at both argument sets."""
    for v, a in enumerate(self.prog.args):
      try:
        out = fn(params, *a) if jax_only else np_eval.run(fn, params, *a)
      except jaxfold.JaxfoldError as e:
        if v in self.fold_refuses:
          continue
        self.failures.append(f"{label} at argument set {v}: {type(e).__name__}: {e}\n{_exc(e)}")
        continue
      except Exception as e:  # noqa: BLE001
        self.failures.append(f"{label} at argument set {v} raised {type(e).__name__}: {e}\n{_exc(e)}")
        continue
      err = fc.rel_err(self.refs[v], out)
      if not err < self.tol:
        if not jax_only:      # re-check with JAX: np_eval is the test's own evaluator
          try:
            err = fc.rel_err(jax.jit(self.prog.apply)(self.prog.params, *a), jax.jit(fn)(params, *a))
          except Exception as e:  # noqa: BLE001
            self.failures.append(f"{label} at argument set {v}: rel err {err:.3g}; the JAX re-check "
                                 f"raised {type(e).__name__}: {e}")
            continue
        if not err < self.tol:
          self.failures.append(f"{label} != original at argument set {v}: rel err {err:.3g}")

  def roundtrip(self, label: str, res):
    with tempfile.TemporaryDirectory() as tmp:
      d = os.path.join(tmp, "fold")
      if self.call(f"save_fold({label})", lambda: jaxfold.save_fold(res, d)) is None:
        return
      back = self.call(f"load_fold({label})", lambda: jaxfold.load_fold(d, self.prog.apply))
    if back is not None:
      self.check_outputs(f"load_fold(save_fold({label}))", back.apply_fn, back.params)

  def export(self, label: str, res):
    # ``symbolic`` names axis 0 of every array "batch", the (2,) PRNG key's
    # too: export with the example's key bound (and compare to the original there).
    a0, a1 = self.prog.args
    key = a0[1]["key"]
    a0, a1 = [(x, {k: v for k, v in aux.items() if k != "key"}) for x, aux in (a0, a1)]
    ref1 = np_eval.run(self.prog.apply, self.prog.params, a1[0], dict(a1[1], key=key))
    keyed = _Model(res.params, lambda p, x, aux: res.apply_fn(p, x, dict(aux, key=key)))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always", ExportWarning)
      blob = self.call(f"export({label})", lambda: jaxfold.export(keyed, *a0))
    if blob is None:
      return
    fn = self.call(f"load_exported(export({label}))", lambda: jaxfold.load_exported(blob))
    if fn is None:
      return
    fell_back = any(issubclass(w.category, ExportWarning) for w in caught)
    for v, a in enumerate((a0, a1)):
      try:
        out = fn(*a)
      except Exception as e:  # noqa: BLE001
        if v and (fell_back or v in self.fold_refuses):   # exported at the example's shapes only
          continue
        self.failures.append(f"exported {label} at argument set {v} raised {type(e).__name__}: {e}")
        continue
      err = fc.rel_err((self.refs[0], ref1)[v], out)
      if not err < self.tol:    # re-check against JAX's original (an argmax near a tie may flip)
        err = fc.rel_err(jax.jit(self.prog.apply)(self.prog.params, a[0], dict(a[1], key=key)), out)
      if not err < self.tol:
        self.failures.append(f"exported {label} != original at argument set {v}: rel err {err:.3g}")


def check_transforms(seed: int, export: bool = True, stream: bool = False,
                     batch_one: bool = False) -> _Run:
  """The checks of program ``seed`` (``fuzz_programs.make_stream_program`` with
  ``stream``); with ``batch_one`` folded (and so transformed) at the example cut
  to batch 1, and checked at both fuzz argument sets."""
  with x64_context():
    prog = (fp.make_stream_program if stream else fp.make_program)(seed)
    run = _Run(prog)
    a0 = fp.batch_one(prog.args[0]) if batch_one else prog.args[0]
    folded = run.call("fold", lambda: jaxfold.fold(prog.params, prog.apply, *a0, **prog.fold_kwargs))
    if folded is None:
      return run          # test_fuzz's concern
    for v, a in enumerate(prog.args):
      try:
        np_eval.run(folded.apply_fn, folded.params, *a)
      except jaxfold.FoldError:
        run.fold_refuses.add(v)
      except Exception:  # noqa: BLE001 - test_fuzz reports it
        return run
    results = []
    fused = run.call("fuse_affine", lambda: jaxfold.fuse_affine(folded), ok_refuse=True)
    if fused is not None:
      results.append(("fused", fused))
      run.tol = max(run.tol, fc.cast_tol(fused.report))
      deferred = run.call("defer_norms", lambda: jaxfold.defer_norms(fused), ok_refuse=True)
      if deferred is not None:
        results.append(("deferred", deferred))
      for name, base in list(results):
        for n in STREAM_SIZES:
          q = _orthogonal(n, seed + n)
          rot = run.call(f"rotate({name}, d={n})", lambda b=base, q=q: jaxfold.rotate(b, q),
                         ok_refuse=True)
          if rot is not None:
            run.rotated += 1
            results.append((f"rotate({name}, d={n})", rot))
    for name, res in results:
      run.check_outputs(name, res.apply_fn, res.params)
      run.roundtrip(name, res)
    if export and results:
      run.export(*results[-1])
  return run


def _fail(run: _Run):
  if run.failures:
    pytest.fail("\n".join([run.prog.describe(), "", "failures:"] + ["  " + f for f in run.failures]
                          + ["", "refusals:"] + ["  " + r.splitlines()[0] for r in run.refusals]),
                pytrace=False)


@pytest.mark.parametrize("seed", DEFAULT_SEEDS)
def test_fuzz_transforms(seed):
  _fail(check_transforms(seed))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(N_SLOW))
def test_fuzz_transforms_slow(seed):
  _fail(check_transforms(seed, export=seed % 4 == 0))


@pytest.mark.parametrize("seed", range(N_STREAM))
def test_fuzz_transforms_stream(seed):
  run = check_transforms(seed, stream=True)
  _fail(run)
  # Keeps rotate exercised (fused and deferred). Seed 2 has an auxiliary centering
  # (a tied head) and seed 3's final norm a variance from two halves (Chan's
  # form), both of which rotate refuses; the ones-vector means that seed 3 drew
  # before the spelling table grew are pinned in test_adversarial_rotate.
  if seed in (0, 1):
    assert run.rotated == 2, run.refusals


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(N_STREAM_SLOW))
def test_fuzz_transforms_stream_slow(seed):
  _fail(check_transforms(seed, export=seed % 4 == 0, stream=True))


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["fuzz", "stream"])
@pytest.mark.parametrize("seed", range(N_SLOW_BATCH_ONE))
def test_fuzz_transforms_batch_one_slow(seed, stream):
  _fail(check_transforms(seed, export=seed % 8 == 0, stream=stream, batch_one=True))


if __name__ == "__main__":   # python tests/test_jaxfold/test_fuzz_transforms.py SEED [SEED ...]
  stream, one = os.environ.get("STREAM") == "1", os.environ.get("BATCH_ONE") == "1"
  for s in map(int, sys.argv[1:]):
    r = check_transforms(s, stream=stream, batch_one=one)
    rot = sum(1 for x in r.refusals if x.startswith("rotate"))
    print(f"seed {s}: {len(r.failures)} failure(s), {len(r.refusals)} refusal(s), {rot} rotate refusal(s)",
          flush=True)
    for f in r.failures:
      print("  FAIL " + f.splitlines()[0][:400] + ("\n" + f if os.environ.get("FULL") else ""), flush=True)
