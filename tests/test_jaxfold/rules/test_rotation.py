"""rules/rotation.py: the rotate facets, each through a small program on a rotated stream.

``jaxfold.rotate`` with an orthogonal Q (a Paley Hadamard of order 12 and a
Haar-random one, from hadamard.py) must leave the output unchanged in float64
at two shapes, batch 1 included, where every primitive on the stream has an
exact facet (``Lin`` through re-indexing and gathers along other dims, ``Quad``
for products contracted over the rotated dim), and refuse where one does not
commute with the rotation."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

import jaxfold
from jaxfold._src.hadamard import hadamard, random_orthogonal

D = 12


def _rms(h):
  return h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + 1e-6)


def _attention(h):
  s = jnp.einsum("bsd,btd->bst", h, h) / np.sqrt(D)     # a product contracted over d: Quad, unchanged
  return h + jnp.einsum("bst,btd->bsd", jax.nn.softmax(s, -1), h)


EXACT = {
    "attention scores": _attention,
    "gather tokens": lambda h: h[:, jnp.array([0, 2, 1])],
    "broadcast and sum": lambda h: (h[:, :, None, :] * jnp.arange(1.0, 4.0)[None, None, :, None]).sum(2),
    "square norm statistic": lambda h: h * (1 + jnp.sum(h ** 2, -1, keepdims=True)),
}
REFUSED = {
    "gather along d": lambda h: h[..., jnp.array([1, 0] + list(range(2, D)))],
    "elementwise square": lambda h: h ** 2,
    "tanh": jnp.tanh,
}


def _model(op):
  r = np.random.default_rng(0)
  params = {"w_in": jnp.asarray(r.normal(size=(5, D))), "b": jnp.asarray(r.normal(size=(D,))),
            "w_out": jnp.asarray(r.normal(size=(D, 3)))}

  def apply(p, x):
    return _rms(op(x @ p["w_in"] + p["b"])) @ p["w_out"]
  return types.SimpleNamespace(params=params, apply_fn=apply)


def _x(*shape, seed=1):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float64)


@pytest.mark.parametrize("q", ["hadamard", "random"])
@pytest.mark.parametrize("name", sorted(EXACT))
def test_rotation_passes_exactly(x64, name, q):
  m = _model(EXACT[name])
  mat = hadamard(D) if q == "hadamard" else random_orthogonal(D, jax.random.PRNGKey(2))
  r = jaxfold.rotate(m, mat, _x(2, 4, 5))
  assert {n for n, _ in r.report.rotated} == {"['w_in']", "['b']", "['w_out']"}
  before, after = jax.tree_util.tree_leaves(m.params), jax.tree_util.tree_leaves(r.params)
  assert len(before) == len(after) and sum(not np.allclose(a, b) for a, b in zip(before, after)) == 3
  for x in (_x(2, 4, 5), _x(1, 4, 5, seed=3)):
    assert rel_err(m.apply_fn(m.params, x), r.apply_fn(r.params, x)) < 1e-12


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_rotation_refused_where_a_primitive_does_not_commute(x64, name):
  with pytest.raises(jaxfold.FuseError):
    jaxfold.rotate(_model(REFUSED[name]), hadamard(D), _x(2, 4, 5))
