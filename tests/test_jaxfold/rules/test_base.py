"""jaxfold/_src/rules/base.py: the registry and its fail-closed default."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jaxfold._src.rules import base as B
from jaxfold._src.rules import rule_for


def test_unknown_primitives_get_the_default_which_fails_closed():
  unknown = jax.extend.core.Primitive("jaxfold_test_unknown")
  r = rule_for(unknown)
  assert r is B.DEFAULT
  # No facet claims anything about it.
  assert r.rebind is None and r.inline is B.DEFAULT.inline
  assert r not in B.all_rules()


def test_a_primitive_has_one_rule():
  with pytest.raises(ValueError, match="two rules"):
    B.register(B.Rule("duplicate", (lax.add_p,)))
  assert rule_for(lax.add_p).name != "duplicate"


def test_every_registered_rule_is_reachable_or_a_call():
  rules, calls = B.all_rules(), B.call_rules()
  assert rules and calls and not {id(r) for r in rules} & {id(r) for r in calls}
  names = {r.name for r in rules}
  assert {"add", "mul", "reduce_sum", "dot_general", "scan", "cond", "while"} <= names


def test_specs_freeze_sorted_and_compare_as_pairs():
  spec = B.freeze({2: 4, 0: 3})
  assert spec == ((0, 3), (2, 4)) and hash(spec) == hash(((0, 3), (2, 4)))
  assert spec[0].dim == 0 and spec[1].block == 4
  assert B.spec_dict(spec) == {0: 3, 2: 4}


def test_operand_spec_refuses_broadcast_operands():
  x = jax.ShapeDtypeStruct((3, 4), jnp.float32)
  row = jax.ShapeDtypeStruct((3, 1), jnp.float32)
  spec = B.freeze({1: 4})
  assert B.operand_spec(x, spec, (3, 4)) == spec
  assert B.operand_spec(row, spec, (3, 4)) is None       # constant along the spec dim
  assert B.operand_spec(row, B.freeze({0: 3}), (3, 4)) == B.freeze({0: 3})


def test_size_one_dims_including_symbolic():
  assert B.size_one((1, 3, 1)) == frozenset({0, 2})
  (b,) = jax.export.symbolic_shape("b")
  assert B.size_one((b, 1)) == frozenset({1})
