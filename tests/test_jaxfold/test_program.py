"""jaxfold/_src/program.py: call sites flattened per occurrence, loop bodies
kept as sub-programs, dataflow maps and the paths the rewrite finds values by."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxfold._src.program import Lit, Program, Val, is_val, upstream


def _prog(fn, *args):
  return Program(jax.make_jaxpr(fn)(*args))


def _prims(p: Program) -> list:
  return [n.prim.name for n in p.nodes]


def test_a_jitted_block_called_twice_is_two_occurrences():
  @jax.jit
  def block(x):
    return jnp.tanh(x) * 2.0

  p = _prog(lambda x: block(block(x)), jnp.ones(3))
  tanhs = [n for n in p.nodes if n.prim.name == "tanh"]
  assert len(tanhs) == 2
  # Same jaxpr object, distinct values and call sites.
  assert tanhs[0].eqn is tanhs[1].eqn
  assert tanhs[0].outs[0] is not tanhs[1].outs[0]
  assert tanhs[0].calls[-1].path != tanhs[1].calls[-1].path
  assert tanhs[0].calls[-1].kind == "jit"
  assert "jit" in tanhs[0].where()
  # The second call reads the first call's result through the flattening.
  mul1 = next(n for n in p.nodes if n.prim.name == "mul")
  assert tanhs[1].ins[0] is mul1.outs[0]


def test_loop_bodies_are_sub_programs_with_their_own_values():
  def fn(x):
    def body(c, _):
      return jnp.sin(c) + 1.0, None
    return jax.lax.scan(body, x, None, length=3)[0]

  p = _prog(fn, jnp.ones(4))
  (scan,) = [n for n in p.nodes if n.subs]
  (sub,) = scan.subs
  assert not sub.is_top and sub.parent == (scan, p)
  assert "sin" in _prims(sub) and "sin" not in _prims(p)
  assert list(p.programs()) == [p, sub]
  # A body value's path goes through the loop equation.
  sin = next(n for n in sub.nodes if n.prim.name == "sin")
  assert sin.path[:len(scan.path)] == scan.path and len(sin.path) > len(scan.path)


def test_literals_constants_and_inputs():
  w = np.arange(3.0)

  def fn(x):
    return x * 3.0 + jnp.asarray(w)

  p = _prog(fn, jnp.ones(3))
  mul = next(n for n in p.nodes if n.prim.name == "mul")
  lits = [a for a in mul.ins if isinstance(a, Lit)]
  assert lits and float(np.asarray(lits[0].value)) == 3.0 and not is_val(lits[0])
  assert p.invars[0].kind == "in" and p.invars[0].shape == (3,)
  # The captured array is a constant value of the program, with its data.
  consts = [v for v in p.consts if v.const is not None]
  assert any(np.array_equal(np.asarray(v.const), w) for v in consts) or any(
      isinstance(a, Lit) for n in p.nodes for a in n.ins)


def test_dataflow_maps():
  def fn(x):
    a = jnp.exp(x)
    b = a * a
    return b, a

  p = _prog(fn, jnp.ones(2))
  exp, mul = p.nodes
  a = exp.outs[0]
  assert isinstance(a, Val) and a.producer is exp
  assert [(n.prim.name, k) for n, k in p.consumers[a]] == [("mul", 0), ("mul", 1)]
  assert p.output_positions[a] == [1] and p.output_positions[mul.outs[0]] == [0]
  # Outputs live past the last node.
  assert p.last_use[a] == len(p.nodes) and p.last_use[p.invars[0]] == exp.index


def test_values_have_unique_keys_across_levels():
  @jax.jit
  def inner(x):
    return jnp.cos(x)

  def fn(x):
    y = inner(x) + inner(x * 2)
    return jax.lax.fori_loop(0, 2, lambda i, c: inner(c), y)

  p = _prog(fn, jnp.ones(3))
  keys = []
  for level in p.programs():
    keys += [v.key for v in level.invars + level.consts]
    keys += [v.key for n in level.nodes for v in n.outs]
  assert len(keys) == len(set(keys))


def test_upstream_walks_producers_by_layer():
  def fn(x, y):
    a = jnp.exp(x)
    return jnp.sin(a * y) * jnp.sum(a), jax.lax.fori_loop(0, 2, lambda i, c: c * 2, a)

  p = _prog(fn, jnp.ones(3), jnp.ones(3))
  out, looped = p.outvars
  x, y = p.invars
  layers = upstream(out, 2)
  assert len(layers) == 3 and layers[0] == [out]
  assert layers[1] == [v for v in out.producer.ins if is_val(v)]
  flat = [v for layer in layers for v in layer]
  # `a` is reached through both factors but listed once; x is a 3rd step away.
  assert len(flat) == len(set(flat)) and x not in flat
  assert set(upstream(out, 3)[3]) == {x, y}
  # Kept to one shape, the walk skips the sum and reaches x a step later.
  same = upstream(out, 4, keep=lambda _, v: v.shape == out.shape)
  assert x in same[4] and all(v.shape == (3,) for layer in same for v in layer)
  # A loop's body is another level: the walk stops at the loop.
  assert upstream(looped, 2) == [[looped], [], []]


def _freed_without_collector(release: bool) -> bool:
  """Whether an output value of a program (with a loop body) is freed by reference
  counting alone once the program is dropped."""
  import gc
  import weakref

  def f(x):
    return jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c) * 2.0, jnp.sin(x) + 1.0)

  enabled = gc.isenabled()
  gc.disable()
  try:
    p = _prog(f, jnp.ones(3))
    ref = weakref.ref(p.nodes[0].outs[0])
    if release:
      p.release()
    del p
    return ref() is None
  finally:
    if enabled:
      gc.enable()


def test_release_breaks_the_cycles_so_reference_counting_frees_the_program():
  # Unreleased, a node and its outputs (and a program and its nodes) keep each other
  # alive until the cycle collector runs: the fold's largest collection.
  assert not _freed_without_collector(release=False)
  assert _freed_without_collector(release=True)


def test_release_keeps_what_a_value_is_and_refuses_graph_walks():
  p = _prog(lambda x: jnp.tanh(x) * 2.0, jnp.ones(3))
  y = p.nodes[-1].outs[0]
  p.release()
  p.release()   # idempotent
  assert y.shape == (3,) and y.key[1] == "out" and y.producer.prim.name == "mul"
  assert p.nodes is None and y.producer.outs is None
