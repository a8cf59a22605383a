"""report.diff()'s counts are the programs' own (issue 39): on zoo models and
every option set, the reductions and per-primitive counts the diff gives equal
those of ``jax.make_jaxpr`` of the original and of the result's apply_fn,
counted here independently (equation by equation, calls flattened)."""

import collections

import jax
import pytest

import jaxfold
from jaxfold._src import counts

models = pytest.importorskip("models")

OPTIONS = {
    "default": {},
    "no-aux": {"auxiliary_centering": False},
    "copy": {"tied_weights": "copy"},
    "fuse": {"fuse_affine": True},
    "defer": {"defer_norms": True},
}
# (call-like equations: their bodies are counted, as the fold sees them)
_CALLS = {"pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
          "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}


def _subjaxprs(params):
  for v in params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      if hasattr(x, "eqns"):
        yield x
      elif hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
        yield x.jaxpr


def _count(jaxpr, out=None) -> collections.Counter:
  out = collections.Counter() if out is None else out
  for e in jaxpr.eqns:
    if e.primitive.name not in _CALLS:
      out[e.primitive.name] += 1
    for sub in _subjaxprs(e.params):
      _count(sub, out)
  return out


def _check(name, option):
  spec = models.get(name)
  fn, params = spec.apply_fn(), spec.abstract_init(1)
  args = spec.example_inputs(1, abstract=True)
  result = jaxfold.fold(params, fn, *args, **OPTIONS[option])
  before = _count(jax.make_jaxpr(fn)(params, *args).jaxpr)
  after = _count(jax.make_jaxpr(result.apply_fn)(result.params, *args).jaxpr)
  want = tuple((k, before[k], after[k]) for k in sorted(set(before) | set(after)) if before[k] != after[k])
  report = result.report
  if option in ("fuse", "defer"):
    got = report.programs()
    assert got == (before["reduce_sum"], after["reduce_sum"], want)
    assert f"reduce_sum, all): {before['reduce_sum']} -> {after['reduce_sum']}" in report.diff()
    return
  ch = report.counted_changes()
  assert (ch.counted_before, ch.counted_after, ch.primitives) == (before["reduce_sum"], after["reduce_sum"], want)
  assert ch.counted_before == ch.reductions_before and ch.counted_after == ch.planned_after, report.diff()
  diff = report.diff()
  assert f"{before['reduce_sum']} -> {after['reduce_sum']}" in diff and "[planned" not in diff
  assert all(f"{k} {a} -> {b}" in diff for k, a, b in want)


@pytest.mark.parametrize("name, option", [
    ("gpt2-tiny", "default"), ("bert-tiny", "no-aux"), ("gpt2-tiny", "copy"),
    ("opt-tiny", "fuse"), ("gpt2-tiny", "defer"), ("whisper-tiny-test", "default"),
])
def test_diff_counts_are_the_programs(name, option):
  _check(name, option)


@pytest.mark.slow
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("name", models.names())
def test_diff_counts_are_the_programs_on_every_zoo_model(name, option):
  _check(name, option)


def test_counts_are_taken_once_and_released():
  calls = []

  def trace(n):
    def f():
      calls.append(n)
      return jax.make_jaxpr(lambda x: x.sum() + 1.0)(jax.ShapeDtypeStruct((2, 3), "float32"))
    return f
  c = counts.ProgramCounts(trace("a"), trace("b"))
  assert c() == c() == (1, 1, ())
  assert calls == ["a", "b"] and c._trace is None
