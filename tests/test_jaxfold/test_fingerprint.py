"""jaxfold/_src/fingerprint.py: one line per primitive application, blind to
values, names and wrappers, and the first difference named."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxfold._src.fingerprint import difference, fingerprint


def _mlp(p, x):
  return jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]


def _params(d=4, h=8, seed=0):
  r = np.random.default_rng(seed)
  return {"w": r.normal(size=(d, h)).astype(np.float32), "b": r.normal(size=(h,)).astype(np.float32),
          "v": r.normal(size=(h, 2)).astype(np.float32)}


X = np.ones((3, 4), np.float32)


def test_values_do_not_matter_structure_does():
  a = fingerprint(_mlp, _params(seed=0), (X,), {})
  b = fingerprint(_mlp, _params(seed=1), (X,), {})
  assert a["sha256"] == b["sha256"] and difference(a, b) is None
  wider = fingerprint(_mlp, _params(h=16), (X,), {})
  assert wider["sha256"] != a["sha256"]
  assert "first difference at operation 0" in difference(a, wider)


def test_wrappers_are_inlined_and_extra_ops_are_named():
  a = fingerprint(_mlp, _params(), (X,), {})
  assert fingerprint(jax.jit(_mlp), _params(), (X,), {})["sha256"] == a["sha256"]
  more = fingerprint(lambda p, x: _mlp(p, x) * 2, _params(), (X,), {})
  msg = difference(a, more)
  assert f"{a['equations']} operations when saved, {a['equations'] + 1} now" in msg
  assert "is new" in msg and "mul" in msg


def test_keyword_arguments_static_and_traced():
  def fn(p, x, *, scale, train=False):
    y = _mlp(p, x) * scale
    return y if not train else y + 1

  a = fingerprint(fn, _params(), (X,), {"scale": jnp.float32(2.0)})
  b = fingerprint(fn, _params(), (X,), {"scale": jnp.float32(5.0)})
  assert a["sha256"] == b["sha256"]
  c = fingerprint(fn, _params(), (X,), {"scale": jnp.float32(2.0), "train": True})
  assert c["sha256"] != a["sha256"]


def test_output_shapes_are_part_of_the_fingerprint():
  a = fingerprint(lambda p, x: x @ p, np.ones((4, 2), np.float32), (X,), {})
  b = fingerprint(lambda p, x: (x @ p).T.T, np.ones((4, 2), np.float32), (X,), {})
  assert a["outputs"] == ["float32[3, 2]"]
  assert a["sha256"] != b["sha256"]


def _sub(a, b):
  return a - b


def _rsub(a, b):
  return b - a


def test_same_operations_other_parameters_constants_or_wiring_differ():
  """Programs with the same primitives and shapes that compute other
  functions: another primitive parameter (a power, the reduced axis), another
  literal, operands swapped. Each is another program."""
  p = _params()

  def fp(f):
    return fingerprint(lambda p, x: f(_mlp(p, x)), p, (X,), {})

  pairs = [(lambda y: y ** 2, lambda y: y ** 3),                         # integer_pow's y
           (lambda y: y.sum(0), lambda y: y.sum(1)[:2]),                 # reduce_sum's axes
           (lambda y: y * 2.0, lambda y: y * 3.0),                       # a literal
           (lambda y: _sub(y[:, :1], y[:, 1:]), lambda y: _rsub(y[:, :1], y[:, 1:]))]   # which value flows where
  for f, g in pairs:
    a, b = fp(f), fp(g)
    assert a["sha256"] != b["sha256"] and difference(a, b) is not None
