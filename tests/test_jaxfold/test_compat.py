"""jaxfold/_src/compat.py: the one place that knows how this jax spells
jaxprs, literals, dtypes, keys and loop parameters — checked against the
installed jax (0.10 and 0.11 run this file in CI)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from jaxfold._src import compat


def _eqn(fn, *args, prim=None):
  closed = jax.make_jaxpr(fn)(*args)
  jaxpr, _ = compat.open_jaxpr(closed)
  eqns = [e for e in jaxpr.eqns if prim is None or e.primitive is prim]
  return eqns[0]


def test_open_jaxpr_gives_the_equations_and_the_captured_constants():
  w = np.arange(3.0, dtype=np.float32)
  closed = jax.make_jaxpr(lambda x: x * jnp.asarray(w) + 2.0)(jnp.ones(3))
  jaxpr, consts = compat.open_jaxpr(closed)
  assert hasattr(jaxpr, "eqns") and len(compat.constvars(jaxpr)) == len(consts)
  # The constant is either captured (consts) or inlined as a literal, never lost.
  lits = [compat.literal_value(a) for e in jaxpr.eqns for a in e.invars if compat.is_literal(a)]
  assert any(np.array_equal(np.asarray(c), w) for c in consts) or any(
      np.shape(v) == (3,) for v in lits)
  assert any(float(np.asarray(v)) == 2.0 for v in lits if np.ndim(v) == 0)
  assert all(compat.is_var(v) for v in jaxpr.invars)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16, jnp.int8,
                                   jnp.uint32, jnp.bool_, ml_dtypes.float8_e4m3fn])
def test_dtype_names_round_trip(dtype):
  name = compat.dtype_name(dtype)
  assert isinstance(name, str) and compat.dtype_from_name(name) == jnp.dtype(dtype)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_typed_prng_keys_are_named_and_rebuilt(impl):
  key = jax.random.key(0, impl=impl)
  assert compat.is_prng_key(key.dtype) and not compat.is_prng_key(jnp.float32)
  assert compat.key_impl_name(key) == impl
  assert compat.key_impl_name(jax.ShapeDtypeStruct(key.shape, key.dtype)) == impl
  name = compat.dtype_name(key.dtype)
  assert name == f"prng_key:{impl}" and compat.dtype_from_name(name) == key.dtype


def test_bind_eqn_evaluates_one_equation_like_the_program():
  x = jnp.arange(6.0).reshape(2, 3)
  eqn = _eqn(lambda a: jnp.sum(jnp.sin(a), axis=1), x, prim=lax.reduce_sum_p)
  (out,) = compat.bind_eqn(eqn, [jnp.sin(x)])
  np.testing.assert_allclose(out, jnp.sum(jnp.sin(x), axis=1))


def test_scan_partition_and_length():
  def fn(c0, xs, k):
    def body(c, x):
      return c * k + x, c
    return lax.scan(body, c0, xs)

  eqn = _eqn(fn, jnp.ones(3), jnp.ones((5, 3)), jnp.float32(2.0), prim=compat.prims()["scan"])
  assert compat.scan_partition(eqn.params) == (1, 1)       # k is a constant, c the carry
  assert compat.scan_length(eqn.params) == 5


def test_while_partition():
  def fn(x, lim, step):
    return lax.while_loop(lambda c: c[0] < lim, lambda c: c + step, x)

  eqn = _eqn(fn, jnp.zeros(2), jnp.float32(3.0), jnp.float32(1.0), prim=compat.prims()["while"])
  assert compat.while_partition(eqn.params) == (1, 1)


def test_discovered_primitives_are_the_ones_jax_emits():
  p = compat.prims()
  x = jnp.ones(2)
  assert _eqn(jax.jit(lambda y: y + 1), x).primitive is p["jit"]
  assert _eqn(jax.checkpoint(lambda y: y * 2), x).primitive is p["remat"]
  assert _eqn(lambda y: lax.cond(y[0] > 0, lambda z: z, lambda z: -z, y), x,
              prim=p["cond"]).primitive is p["cond"]
  # A call's body is found on every JAX version's parameter name.
  body = compat.call_jaxpr_of(_eqn(jax.jit(lambda y: jnp.tanh(y)), x))
  inner, _ = compat.open_jaxpr(body)
  assert [e.primitive for e in inner.eqns] == [lax.tanh_p]
  assert compat.call_jaxpr_of(_eqn(jnp.tanh, x)) is None


def test_lax_prims_finds_public_and_private_primitives():
  (add,) = compat.lax_prims("add_p")
  assert add is lax.add_p
  assert compat.lax_prims("no_such_primitive_p") == ()


def test_user_source_points_at_this_file():
  eqn = _eqn(lambda y: jnp.exp(y), jnp.ones(2))
  assert "test_compat.py" in compat.user_source(eqn) or "test_compat.py" in compat.source_summary(eqn)


def test_squared_operand_finds_every_spelling_of_a_square():
  x = jnp.arange(6.0).reshape(2, 3)
  for fn in (lambda a: a ** 2, jnp.square, lambda a: a * a):
    eqn = _eqn(fn, x)
    assert compat.squared_operand(eqn) is eqn.invars[0]
  assert compat.squared_operand(_eqn(lambda a: a * jnp.sin(a), x, prim=lax.mul_p)) is None
  assert compat.squared_operand(_eqn(lambda a: a ** 3, x)) is None
