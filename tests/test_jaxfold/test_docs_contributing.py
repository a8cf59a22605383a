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
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

import jaxfold
from jaxfold._src.hadamard import hadamard
from jaxfold._src.rules import base, elementwise, rotation

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "contributing.md"


def _example_blocks() -> list:
  text = DOC.read_text(encoding="utf-8")
  section = text.split("## Worked example", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```python\n(.*?)```", section, re.S)


def _rotate_snippet() -> str:
  """The guide's one-line ``rotate`` facet (inline code, not a block)."""
  (line,) = re.findall(r"`(set_facets\(\(my_lib\.scale_p,\), rotate=\w+\))`", DOC.read_text(encoding="utf-8"))
  return line


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


def test_the_rotate_facet_of_the_example_is_exact(x64, my_lib):
  env = dict(vars(elementwise), my_lib=my_lib)
  exec(compile(_example_blocks()[0], f"{DOC}:rule", "exec"), env)   # noqa: S102
  exec(_rotate_snippet(), dict(vars(rotation), my_lib=my_lib))       # noqa: S102
  r = np.random.default_rng(0)
  params = {"w_in": jnp.asarray(r.normal(size=(5, 12))), "b": jnp.asarray(r.normal(size=(12,))),
            "w_out": jnp.asarray(r.normal(size=(12, 3)))}

  def apply(p, x):
    h = my_lib.scale(x @ p["w_in"] + p["b"], factor=2.5)
    return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) @ p["w_out"]

  model = types.SimpleNamespace(params=params, apply_fn=apply)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 5), jnp.float64)
  rot = jaxfold.rotate(model, hadamard(12), x)
  assert len(rot.report.rotated) == 3
  for xs in (x, x[:1, :1]):
    want, got = np.asarray(apply(params, xs)), np.asarray(rot.apply_fn(rot.params, xs))
    assert np.abs(want - got).max() < 1e-12 * np.abs(want).max()
