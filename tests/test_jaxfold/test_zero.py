"""zero.py: the rewrite's marker for an exactly-zero value (a removed mean)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfold._src.rules.elementwise import ctx_zero
from jaxfold._src.zero import Zero


@pytest.mark.parametrize("shape, dtype", [((2, 3, 1), jnp.float32), ((), jnp.bfloat16), ((4,), jnp.int32)])
def test_materialize_is_zeros_of_the_aval(shape, dtype):
  z = Zero(jax.ShapeDtypeStruct(shape, dtype))
  m = z.materialize()
  assert m.shape == shape and m.dtype == dtype
  assert not np.asarray(m, np.float32).any()


def test_is_a_frozen_value():
  aval = jax.ShapeDtypeStruct((2,), jnp.float32)
  z = Zero(aval)
  assert z == Zero(aval) and hash(z) == hash(Zero(aval))
  assert z != Zero(jax.ShapeDtypeStruct((3,), jnp.float32))
  with pytest.raises(dataclasses.FrozenInstanceError):
    z.aval = None


def test_the_rules_make_one_for_a_node_output():
  """What a simplify facet returns for a removed reduction: a Zero of that output's aval."""
  jaxpr = jax.make_jaxpr(lambda x: -x)(jnp.ones((2, 5), jnp.float32))
  out = jaxpr.jaxpr.eqns[0].outvars[0]
  z = ctx_zero(out)
  assert isinstance(z, Zero) and z.aval.shape == (2, 5) and z.materialize().dtype == jnp.float32
