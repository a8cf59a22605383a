"""jaxfold._src.step: transforms as steps of a chain, one result type, the registry
that save_fold/load_fold consult.

The toy ``identity`` step below is the proof that a transform is one module: it is
defined here, in a test, touching no file of jaxfold, and a chain ending in it saves,
loads and exports like the built-in ones (no branch on its name anywhere)."""

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

import jaxfold
from jaxfold._src import pipeline, step
from jaxfold._src.errors import JaxfoldError
from jaxfold._src.step import RestoreContext, Restored, Result, Step, StepRecord, register

# ----------------------------------------------------------------------------
# A sixth transform, in full: its result, its step, its record.


class IdentityReport(NamedTuple):
  """What the identity step did: nothing, to ``n`` parameters."""
  n: int

  def __str__(self) -> str:
    return f"identity: {self.n} parameters unchanged"


@register
class IdentityApply(Step):
  """Runs the step before it unchanged (a stand-in for a real transform, e.g. quantization)."""

  error = JaxfoldError
  kind = "identity-test-step"

  def record(self) -> StepRecord:
    return StepRecord({"name": self.kind, "n": len(jax.tree_util.tree_leaves(self.params_abstract))},
                      {"marker": np.arange(3.0)})

  @classmethod
  def parse(cls, info: dict, decode: Callable[[Any], Any]) -> int:
    return int(info["n"])

  @classmethod
  def restore(cls, inner: Callable, params: Any, parsed: int, ctx: RestoreContext) -> Restored:
    if ctx.verify and len(jax.tree_util.tree_leaves(params)) != parsed:
      raise ctx.refuse("identity step")
    assert np.array_equal(ctx.array("marker"), np.arange(3.0))
    return Restored(cls(inner, params, ctx.args, ctx.kwargs), IdentityReport(parsed), None)

  def __call__(self, params, *args, **kwargs):
    return self.inner(params, *args, **kwargs)


def identity(model: Result) -> Result:
  fn = model.apply_fn
  abstract = pipeline.abstract_tree(model.params)
  return Result(model.params, IdentityApply(fn, abstract, fn.example_args, fn.example_kwargs),
                IdentityReport(len(jax.tree_util.tree_leaves(abstract))))


# ----------------------------------------------------------------------------


class M(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8)(x)
    return nn.Dense(3)(nn.LayerNorm()(h))


@pytest.fixture
def model(x64):
  m, x = M(), jnp.ones((2, 5, 4), jnp.float64)
  p = m.init(jax.random.PRNGKey(0), x)
  leaves, tree = jax.tree_util.tree_flatten(p)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))   # random γ, β, biases
  p = jax.tree_util.tree_unflatten(tree, [jax.random.normal(k, a.shape, jnp.float64) for k, a in zip(keys, leaves)])
  return m, p, x


def _check(m, p, r):
  for shape in [(2, 5, 4), (1, 1, 4), (3, 7, 4)]:
    x = jax.random.normal(jax.random.PRNGKey(sum(shape)), shape, jnp.float64)
    assert rel_err(jax.jit(r.apply_fn)(r.params, x), m.apply(p, x)) < 1e-12


@pytest.mark.parametrize("on", ["fold", "fuse"])
def test_a_new_step_saves_loads_and_exports_with_no_change_to_jaxfold(model, tmp_path, on):
  m, p, x = model
  base = jaxfold.fold(p, m.apply, x)
  if on == "fuse":
    base = jaxfold.fuse_affine(base)
  r = identity(base)
  _check(m, p, r)
  assert [s.kind for s in r.steps] == ["fold"] + (["fuse_affine"] if on == "fuse" else []) + [IdentityApply.kind]
  jaxfold.save_fold(r, tmp_path / "f")
  assert np.array_equal(np.load(tmp_path / "f" / "marker-0.npy"), np.arange(3.0))
  back = jaxfold.load_fold(tmp_path / "f", m.apply)
  assert type(back.apply_fn) is IdentityApply and type(back.params) is type(r.params)
  assert back.report == r.report
  for a, b in zip(jax.tree_util.tree_leaves(r.params), jax.tree_util.tree_leaves(back.params)):
    assert np.array_equal(a, b)
  _check(m, p, back)
  art = jaxfold.load_exported(jaxfold.export(r, x, symbolic=None))
  assert rel_err(art(x), m.apply(p, x)) < 1e-12


def test_a_load_redoes_the_new_step_and_refuses_what_it_does_not_reproduce(model, tmp_path):
  import json
  m, p, x = model
  r = identity(jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x)))
  jaxfold.save_fold(r, tmp_path / "f")
  info = json.loads((tmp_path / "f" / "fold.json").read_text())
  info["transforms"][-1]["n"] += 1
  (tmp_path / "f" / "fold.json").write_text(json.dumps(info))
  with pytest.raises(jaxfold.FoldError, match="identity step"):
    jaxfold.load_fold(tmp_path / "f", m.apply, integrity=False)
  info["transforms"][-1]["name"] = "no-such-step"
  (tmp_path / "f" / "fold.json").write_text(json.dumps(info))
  with pytest.raises(jaxfold.IntegrityError, match="unknown transform 'no-such-step'"):
    jaxfold.load_fold(tmp_path / "f", m.apply, integrity=False)


def test_every_result_is_one_result_type_with_its_steps(model):
  m, p, x = model
  f = jaxfold.fold(p, m.apply, x)
  fu = jaxfold.fuse_affine(f)
  d = jaxfold.defer_norms(fu)
  q = np.linalg.qr(np.random.default_rng(0).normal(size=(8, 8)))[0]
  ro = jaxfold.rotate(fu, q)
  for r, kinds in [(f, ["fold"]), (fu, ["fold", "fuse_affine"]), (d, ["fold", "fuse_affine"]),
                   (ro, ["fold", "fuse_affine", "rotate"])]:
    assert isinstance(r, Result) and r._fields == ("params", "apply_fn", "report")
    params, apply_fn, report = r   # still a 3-tuple
    assert [s.kind for s in r.steps] == kinds and r.steps[-1] is apply_fn
    assert step.chain_of(apply_fn) == list(r.steps)
  assert step.chain_of(jaxfold.cbwc(p, m.apply, x).apply_fn) is None   # CBWC is no fold to save
  assert step.chain_of(m.apply) is None


def test_registry_refuses_what_is_not_a_step_and_a_second_class_of_a_kind():
  with pytest.raises(TypeError):
    register(int)
  with pytest.raises(ValueError, match="registered already"):
    register(type("Other", (Step,), {"kind": IdentityApply.kind}))
  assert register(IdentityApply) is IdentityApply   # the same class again is fine
  assert step.restorer("fuse_affine").kind == "fuse_affine" and step.restorer("rotate").kind == "rotate"
  assert step.restorer("no-such-step") is None and step.restorer(None) is None


def test_digest_is_the_sha256_of_the_repr():
  import hashlib
  key = ((1, 2), ("a", (3,)))
  assert step.digest(key) == hashlib.sha256(repr(key).encode()).hexdigest() != step.digest(((1, 2),))
