"""docs/contributing.md's worked example (a rule for a new primitive) runs against the code.

The guide's three code blocks are executed as written: the rule (block 1) is
registered for a real ``scale_p`` primitive defined here, the per-rule test
(block 2) runs ``fold_checks.assert_sound`` through it (fold exact in float64
at two batch sizes, CBWC and its gradients, every centering invisible, one
site folded), and the fuzzer constructor (block 3) builds an op computing
``scale``. The rule is removed from the registry afterwards, so the rest of
the suite sees the registry unchanged."""

import importlib
import pathlib
import re
import types

import fuzz_programs as fp
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxfold._src.rules import base, elementwise

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "contributing.md"


def _example_blocks() -> list:
  text = DOC.read_text(encoding="utf-8")
  section = text.split("## Worked example", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```python\n(.*?)```", section, re.S)


def _my_lib():
  """The library of the example: ``scale(x, factor) = x * factor`` as its own primitive."""
  scale_p = Primitive("scale")

  def scale(x, factor):
    return scale_p.bind(x, factor=factor)

  scale_p.def_impl(lambda x, factor: x * factor)
  scale_p.def_abstract_eval(lambda x, factor: x)
  mlir.register_lowering(scale_p, mlir.lower_fun(lambda x, factor: x * factor, multiple_results=False))
  ad.deflinear2(scale_p, lambda ct, x, factor: [scale(ct, factor)])
  batching.defvectorized(scale_p)
  return types.SimpleNamespace(scale_p=scale_p, scale=scale)


@pytest.fixture
def my_lib():
  lib = _my_lib()
  before = dict(base._REGISTRY)
  yield lib
  base._REGISTRY.clear()
  base._REGISTRY.update(before)


def test_the_guide_has_the_three_blocks():
  blocks = _example_blocks()
  assert len(blocks) == 3
  assert "register(Rule(\"scale\"" in blocks[0] and "def test_scale" in blocks[1] and "@op(" in blocks[2]
  # the example's helpers are its own: no redefinition of a function the rule module already has
  defined = set(re.findall(r"^def (\w+)", blocks[0], re.M))
  assert not defined & set(vars(elementwise)), defined & set(vars(elementwise))


def test_the_worked_example_folds_through_the_new_primitive(x64, my_lib):
  rule_block, test_block, fuzz_block = _example_blocks()
  env = dict(vars(elementwise), my_lib=my_lib)
  exec(compile(rule_block, f"{DOC}:rule", "exec"), env)           # noqa: S102 - our own docs
  rule = base.rule_for(my_lib.scale_p)
  assert rule.name == "scale" and rule.shift is env["_factor_shift"]

  test_mod = importlib.import_module("rules.test_elementwise")
  tenv = dict(vars(test_mod), my_lib=my_lib)
  exec(compile(test_block, f"{DOC}:test", "exec"), tenv)          # noqa: S102
  tenv["test_scale"](None)                                          # assert_sound: folds 1 site exactly

  ops: list = []
  fenv = dict(vars(fp), my_lib=my_lib, op=lambda *keys, **kw: (lambda fn: ops.append((keys, fn)) or fn))
  exec(compile(fuzz_block, f"{DOC}:fuzz", "exec"), fenv)          # noqa: S102
  ((keys, ctor),) = ops
  assert keys == (("scale", ""),) and ("scale", "") in [(rule.name, "")]
  made = ctor(fp.Gen(0), fp.Scope(), fp.St(T=3, D=4, T0=3, stage="pre"))
  h = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4)))
  out = np.asarray(made.fn({}, h, None))
  assert (made.T, made.D) == (3, 4)
  assert any(np.allclose(out, np.asarray(h) * f) for f in (-2.0, 0.5, 3.0))
