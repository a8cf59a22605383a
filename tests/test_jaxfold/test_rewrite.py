"""jaxfold/_src/rewrite.py: ``evaluate`` re-runs a jaxpr under a Plan. With
an empty plan it is the program (loops, branches and calls included); each
plan entry changes exactly what it names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

from jaxfold._src import compat
from jaxfold._src.program import Program
from jaxfold._src.rewrite import Plan, evaluate

EMPTY = Plan()


def _run(fn, args, plan=EMPTY):
  closed = jax.make_jaxpr(fn)(*args)
  jaxpr, consts = compat.open_jaxpr(closed)
  return evaluate(jaxpr, consts, list(jax.tree_util.tree_leaves(args)), plan, {}), closed


@jax.custom_jvp
def _softclip(x):
  return jnp.tanh(x)


_softclip.defjvp(lambda p, t: (jnp.tanh(p[0]), t[0] * (1 - jnp.tanh(p[0]) ** 2)))


def _loops(w, x):
  def body(c, xi):
    c = jnp.tanh(c @ w + xi)
    return c, c.sum()
  c, ys = jax.lax.scan(body, x[0], x)
  c = jax.lax.cond(c.sum() > 0, lambda z: z * 2.0, lambda z: -z, c)
  c = jax.lax.fori_loop(0, 3, lambda i, z: jax.checkpoint(lambda u: u @ w)(z) * 0.5, c)
  return jax.jit(_softclip)(c), ys


@pytest.mark.parametrize("shape", [(4, 3), (6, 3)])
def test_an_empty_plan_is_the_program(shape, x64):
  r = np.random.default_rng(0)
  w = jnp.asarray(r.normal(size=(3, 3)))
  x = jnp.asarray(r.normal(size=shape))
  outs, closed = _run(_loops, (w, x))
  want = jax.tree_util.tree_leaves(_loops(w, x))
  assert len(outs) == len(want)
  for a, b in zip(outs, want):
    assert rel_err(b, a) < 1e-14
  # And under jit (the rewrite is traceable).
  jaxpr, consts = compat.open_jaxpr(closed)
  jitted = jax.jit(lambda w, x: evaluate(jaxpr, consts, [w, x], Plan(), {}))(w, x)
  for a, b in zip(jitted, want):
    assert rel_err(b, a) < 1e-12


def _layernorm(h):
  m = h.mean(-1, keepdims=True)
  c = h - m
  return c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-6)


def _mean_path(fn, args):
  """The path of the first reduce_sum (the mean of the LayerNorm)."""
  prog = Program(jax.make_jaxpr(fn)(*args))
  (node, *_) = [n for n in prog.nodes if n.prim is jax.lax.reduce_sum_p]
  return node.path


def test_a_zeroed_mean_is_removed_and_exact_on_zero_mean_inputs(x64):
  r = np.random.default_rng(1)
  h = jnp.asarray(r.normal(size=(5, 8)))
  h0 = h - h.mean(-1, keepdims=True)
  plan = Plan(zero=frozenset({_mean_path(_layernorm, (h,))}))
  (out,), closed = _run(_layernorm, (h0,), plan)
  assert rel_err(_layernorm(h0), out) < 1e-14
  # It is the RMSNorm: on a non-centered input it differs from the LayerNorm.
  (other,), _ = _run(_layernorm, (h,), plan)
  assert rel_err(_layernorm(h), other) > 1e-3
  # The rewritten program has one reduction fewer.
  jaxpr, consts = compat.open_jaxpr(closed)
  count = lambda fn: str(jax.make_jaxpr(fn)(h0)).count("reduce_sum")  # noqa: E731
  assert count(lambda a: evaluate(jaxpr, consts, [a], plan, {})) == count(_layernorm) - 1


def test_an_auxiliary_centering_centers_the_value_it_names(x64):
  r = np.random.default_rng(2)
  h = jnp.asarray(r.normal(size=(5, 8)) + 3.0)

  def fn(a):
    return _layernorm(jnp.sin(a) * 2.0)

  prog = Program(jax.make_jaxpr(fn)(h))
  mul = next(n for n in prog.nodes if n.prim is jax.lax.mul_p)
  plan = Plan(zero=frozenset({_mean_path(fn, (h,))}), aux=((mul.outs[0].key, ((1, 8),)),))
  (out,), _ = _run(fn, (h,), plan)
  # Centering the norm's input, then the RMSNorm: exactly the LayerNorm.
  assert rel_err(fn(h), out) < 1e-13


def test_plan_touched_covers_every_enclosing_level():
  plan = Plan(zero=frozenset({(3, 1, 2)}))
  assert {(), (3,), (3, 1), (3, 1, 2)} <= plan.touched
  assert (4,) not in plan.touched


def test_operand_map_rotates_only_the_operand_it_names(x64):
  """``OperandMap``: operand 0 of the matmul inside a jitted call reads ``x @ H``
  along axis 1; its other use (the add) and the other operand are unchanged."""
  from jaxfold._src.hadamard import hadamard
  from jaxfold._src.rewrite import OperandMap

  def fn(x, w):
    return jax.jit(lambda a, b: a @ b)(x, w) + x.sum()

  x = jax.random.normal(jax.random.PRNGKey(0), (3, 8), jnp.float64)
  w = jax.random.normal(jax.random.PRNGKey(1), (8, 5), jnp.float64)
  closed = jax.make_jaxpr(fn)(x, w)
  path = next((i, j) for i, e in enumerate(closed.jaxpr.eqns) for j, _ in enumerate(
      compat.open_jaxpr(e.params["jaxpr"])[0].eqns) if "jaxpr" in e.params)
  (out,), _ = _run(fn, (x, w), Plan(hadamards=(OperandMap(path, 0, 1),)))
  assert rel_err(out, (x @ hadamard(8)) @ w + x.sum()) < 1e-12
  assert rel_err(out, fn(x, w)) > 1e-3
