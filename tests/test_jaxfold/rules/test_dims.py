"""rules/dims.py: reshape groups and the dimension maps of dot_general, conv and gather.

The reshape maps are checked against what they claim on real arrays: a value
zero-sum over the spec ``reshape_spec_back`` returns is zero-sum over the
output's spec after the reshape, and a shift the forward map says is constant
along an output dim is."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxfold._src.rules.dims import ConvDims, DotDims, GatherDims, reshape_dims, reshape_groups, reshape_spec_back

RESHAPES = [((2, 3, 4), (6, 4)), ((6, 4), (2, 3, 4)), ((2, 3, 4), (2, 12)), ((4, 6), (4, 2, 3)),
            ((2, 1, 3), (6,)), ((8,), (2, 2, 2)), ((3, 4, 5), (12, 5)), ((3, 4, 5), (3, 20)),
            ((2, 6), (3, 4))]


def _divisors(n):
  return [d for d in range(1, n + 1) if n % d == 0]


def _block_sums(x, spec: dict):
  """Sums of ``x`` over the joint blocks of ``spec`` ({dim: block})."""
  shape, axes = [], []
  for d, n in enumerate(x.shape):
    if d in spec:
      shape += [n // spec[d], spec[d]]
      axes.append(len(shape) - 1)
    else:
      shape.append(n)
  return x.reshape(shape).sum(axis=tuple(axes))


def _center(x, spec: dict):
  shape, axes = [], []
  for d, n in enumerate(x.shape):
    if d in spec:
      shape += [n // spec[d], spec[d]]
      axes.append(len(shape) - 1)
    else:
      shape.append(n)
  y = x.reshape(shape)
  return (y - y.mean(axis=tuple(axes), keepdims=True)).reshape(x.shape)


def test_reshape_groups():
  assert reshape_groups((2, 3, 4), (6, 4)) == [([0, 1], [0]), ([2], [1])]
  assert reshape_groups((6, 4), (2, 3, 4)) == [([0], [0, 1]), ([1], [2])]
  assert reshape_groups((2, 6), (3, 4)) == [([0, 1], [0, 1])]


@pytest.mark.parametrize("in_shape, out_shape", RESHAPES)
def test_spec_back_is_sound_on_arrays(in_shape, out_shape):
  rng = np.random.default_rng(0)
  checked = 0
  for k in range(1, len(out_shape) + 1):
    for dims in itertools.combinations(range(len(out_shape)), k):
      for blocks in itertools.product(*[_divisors(out_shape[d]) for d in dims]):
        spec = dict(zip(dims, blocks))
        back = reshape_spec_back(spec, in_shape, out_shape)
        if back is None:
          continue
        x = _center(rng.normal(size=in_shape), back)
        assert np.abs(_block_sums(x.reshape(out_shape), spec)).max() < 1e-12, (spec, back)
        checked += 1
  assert checked > 0


def test_spec_back_refuses_what_it_cannot_map():
  # a block of 4 along the output (6,) of (2, 3): rows of 3 do not tile it
  assert reshape_spec_back({0: 4}, (2, 3), (6,)) is None
  assert reshape_spec_back({1: 4}, (2, 3, 4), (6, 4)) == {2: 4}
  assert reshape_spec_back({0: 6}, (2, 3, 4), (6, 4)) == {0: 2, 1: 3}


@pytest.mark.parametrize("in_shape, out_shape", RESHAPES)
def test_forward_dims_claim_only_true_constancy(in_shape, out_shape):
  rng = np.random.default_rng(1)
  for i, n in enumerate(in_shape):
    for block in _divisors(n):
      dims = tuple(("c", block) if d == i else None for d in range(len(in_shape)))
      out = reshape_dims(dims, in_shape, out_shape)
      if out is None:
        continue
      # c varies along dim i in runs of `block`, and is constant along every other dim
      runs = np.repeat(rng.normal(size=n // block), block)
      c = np.broadcast_to(runs.reshape([n if d == i else 1 for d in range(len(in_shape))]), in_shape)
      y = c.reshape(out_shape)
      for o, entry in enumerate(out):
        moved = np.moveaxis(y, o, 0)
        if entry is None:
          assert np.array_equal(moved, np.broadcast_to(moved[:1], moved.shape)), (dims, out)
        elif isinstance(entry[0], str):
          b = entry[1]
          runs_o = moved.reshape((out_shape[o] // b, b) + moved.shape[1:])
          assert np.array_equal(runs_o, np.broadcast_to(runs_o[:, :1], runs_o.shape)), (dims, out)
      assert math.prod(out_shape) == math.prod(in_shape)


def _eqn(fn, *args, prim):
  (e,) = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == prim]
  return e


def test_dot_dims_map_every_output_dim():
  lhs, rhs = jnp.ones((2, 3, 5, 4)), jnp.ones((2, 4, 7))
  e = _eqn(lambda a, b: lax.dot_general(a, b, (((3,), (1,)), ((0,), (0,)))), lhs, rhs, prim="dot_general")
  dd = DotDims(e.params, lhs.shape, rhs.shape)
  out = e.outvars[0].aval.shape
  assert dd.rank == len(out) == 4 and dd.batch == {0: (0, 0)}
  assert dd.contracting(0) == (3,) and dd.contracting(1) == (1,)
  for o, (side, d) in dd.owner.items():
    assert out[o] == (lhs, rhs)[side].shape[d]
  assert dd.free == ([1, 2], [2])


def test_conv_dims():
  x, w = jnp.ones((1, 4, 8, 8)), jnp.ones((6, 2, 3, 3))
  e = _eqn(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=2,
                                                 dimension_numbers=("NCHW", "OIHW", "NCHW")),
           x, w, prim="conv_general_dilated")
  cd = ConvDims(e.params)
  assert (cd.out_channel, cd.out_batch, cd.kernel_out, cd.lhs_batch, cd.groups, cd.batch_groups) == (1, 0, 0, 0, 2, 1)


def test_gather_dims():
  x, idx = jnp.ones((4, 5, 6)), jnp.array([0, 2])
  e = _eqn(lambda x, i: x[:, i], x, idx, prim="gather")
  gd = GatherDims(e.params, x.shape, e.outvars[0].aval.shape)
  assert 1 in gd.indexed and 0 not in gd.indexed and 2 not in gd.indexed
  assert sorted(gd.offset.values()) == [0, 2] and gd.full(0) and gd.full(2)
  for fill, harmless in [(0.0, True), (1.0, False)]:
    e = _eqn(lambda x, i, f=fill: x.at[:, i].get(mode="fill", fill_value=f), x, idx, prim="gather")
    gd = GatherDims(e.params, x.shape, e.outvars[0].aval.shape)
    assert gd.may_fill and gd.fill_is_harmless() == harmless
