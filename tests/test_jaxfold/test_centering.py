"""jaxfold._src.centering: the engine that computes a fold's centered parameters
(NumPy on the host, worker threads, row blocks, XLA groups). Its thresholds,
workers and hooks are injected as a ``CenteringPolicy``: no module global is patched."""

import concurrent.futures
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err

from jaxfold._src import centering as C
from jaxfold._src import fold as F
from jaxfold._src import layout
from jaxfold._src.centering import Centered, Centering, CenteringPolicy, UntiedCopy


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16])
def test_centered_leaves_equal_host_centering_and_keep_dtype_and_sharding(x64, dtype):
  x = jax.random.normal(jax.random.PRNGKey(0), (48, 24), jnp.float64).astype(dtype) + 3
  y = C.center_leaf(x, ((1, 8),))
  assert isinstance(y, jax.Array) and y.dtype == x.dtype and y.sharding == x.sharding
  np.testing.assert_array_equal(np.asarray(y), layout.center(np.asarray(x), {1: 8}))
  # A leaf off the host (an accelerator's, a sharded one) is centered by jax: every dim of its spec.
  x3 = x.reshape(4, 12, 24)
  spec = {1: 6, 2: 24}
  got = np.asarray(C.center_jit(spec)(x3), np.float64)
  want = np.asarray(layout.center(np.asarray(x3), spec), np.float64)
  np.testing.assert_allclose(got, want, rtol=0, atol=float(jnp.finfo(dtype).eps) * 16)
  assert np.abs(got.reshape(4, 2, 6, 24).mean(axis=(2, 3))).max() < float(jnp.finfo(dtype).eps) * 16
  out = C.aligned_empty((5, 7), dtype)
  assert out.shape == (5, 7) and out.dtype == dtype and out.ctypes.data % 64 == 0
  assert C.aligned_empty((0, 3), dtype).shape == (0, 3)


def test_the_records_are_named_and_equal_their_tuples():
  # The planner's outcome is plain tuples; the fold's records equal them (a fixed
  # plan compares and hashes alike) while naming their fields.
  c, u = Centered(3, ((1, 8),)), UntiedCopy("w@centered", 2, ((0, 4),))
  assert c == (3, ((1, 8),)) and hash(c) == hash((3, ((1, 8),))) and c.leaf == 3 and c.spec == ((1, 8),)
  assert u == ("w@centered", 2, ((0, 4),)) and (u.name, u.leaf) == ("w@centered", 2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_large_leaves_center_by_row_blocks(x64, dtype):
  """A large leaf is centered by blocks of rows on the workers (not along a
  centered dim 0), with exactly ``center_leaf``'s values; inputs untouched."""
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=3)
  policy = CenteringPolicy(split_bytes=1 << 20, pool=pool, workers=3)
  key = jax.random.PRNGKey(2)
  shapes = [(2001, 520), (8, 300, 256), (2048, 300), (1200, 1024)]
  specs = (((1, 520),), ((2, 64),), ((0, 2048),), ((1, 1024),))   # the third centers dim 0: whole
  leaves = [jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32).astype(dtype) * 3 + 1
            for i, s in enumerate(shapes)]
  before = [np.asarray(x).copy() for x in leaves]
  centered = tuple(Centered(i, s) for i, s in enumerate(specs))
  engine = Centering(leaves, policy)
  engine.start(centered, ())
  jobs = engine.jobs()
  assert [jobs[(i, s)] for i, s in enumerate(specs)] == ["blocks", "blocks", "host", "blocks"]
  new, _ = engine.result(centered, ())
  pool.shutdown(wait=True)
  assert engine.jobs() == {}
  for i, spec in enumerate(specs):
    assert new[i].dtype == dtype and new[i].shape == shapes[i]
    np.testing.assert_array_equal(np.asarray(new[i]), np.asarray(C.center_leaf(leaves[i], spec)))
  for x, b in zip(leaves, before):
    np.testing.assert_array_equal(np.asarray(x), b)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_threaded_centering_equals_leaf_by_leaf(x64, dtype):
  """``Centering`` (large leaves on worker threads, kept when the final plan
  shares them; small ones inline, abstract ones kept, untied copies) gives
  exactly ``center_leaf``'s values for the final plan and leaves the inputs
  untouched."""
  key = jax.random.PRNGKey(1)
  shapes = [(600, 512), (24, 16), (512,), (300, 2048)]   # two above the thread threshold
  leaves = [jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32).astype(dtype) + 2
            for i, s in enumerate(shapes)] + [jax.ShapeDtypeStruct((8, 8), dtype)]
  before = [np.asarray(x).copy() for x in leaves[:-1]]
  specs = (((0, 600),), ((1, 4),), ((0, 128),), ((1, 2048),), ((1, 8),))
  centered = tuple(Centered(i, s) for i, s in enumerate(specs) if i != 2)
  untied = (UntiedCopy("copy", 2, specs[2]), UntiedCopy("big", 3, ((0, 300),)))
  # The dropped job blocks until released: result() returning while it is
  # still queued (then cancelled) or still running shows it was not waited for.
  release, started, dropped_done = threading.Event(), {}, []

  def blocking(x, spec, *rest):
    if spec == {1: 1024}:
      release.wait(timeout=10)
      dropped_done.append(spec)
    return C.host_center(x, spec, *rest)

  pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)   # one blocked, one for the plan's jobs
  engine = Centering(leaves, CenteringPolicy(pool=pool, workers=2, host=blocking))
  engine.start((Centered(0, specs[0]), Centered(3, ((1, 1024),))), ())   # the example's plan, changed
  started.update(engine.jobs())
  assert started[(3, ((1, 1024),))] == "host"   # (leaf 0 is below the thread threshold in bfloat16)
  try:
    new, copies = engine.result(centered, untied)
    assert dropped_done == []   # returned while the dropped job was queued or blocked: not waited for
  finally:
    release.set()
    pool.shutdown(wait=True)
  assert new[2] is leaves[2] and new[4] is leaves[4]
  for i in (0, 1, 3):
    assert new[i].dtype == dtype
    np.testing.assert_array_equal(np.asarray(new[i]), np.asarray(C.center_leaf(leaves[i], specs[i])))
  np.testing.assert_array_equal(np.asarray(copies["copy"]), np.asarray(C.center_leaf(leaves[2], specs[2])))
  np.testing.assert_array_equal(np.asarray(copies["big"]), np.asarray(C.center_leaf(leaves[3], ((0, 300),))))
  assert np.abs(np.asarray(new[3], np.float64).sum(axis=1)).max() < 1e-2 * 2048
  for x, b in zip(leaves, before):
    np.testing.assert_array_equal(np.asarray(x), b)


class _Stack(nn.Module):
  """Four blocks whose output projections share shape, dtype and axes: one group."""
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(32)(x)
    for _ in range(4):
      h = h + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(h))))
    return nn.Dense(5)(nn.LayerNorm()(h))


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_a_large_group_of_leaves_centers_in_xla_with_the_folds_values(precision, request):
  """A group of same-shaped leaves of at least ``xla_bytes`` centers in XLA
  (asynchronously): the fold is exact in float64 at two shapes, and in float32 its
  parameters match the NumPy centering's to rounding, dtype and placement kept.
  Under x64 a float32 leaf stays on the host (a float64 mean XLA would not take)."""
  if precision == "float64":
    request.getfixturevalue("x64")
  dtype = jnp.float64 if precision == "float64" else jnp.float32
  m, x = _Stack(), jax.random.normal(jax.random.PRNGKey(3), (3, 7, 24), dtype)
  leaves, tree = jax.tree_util.tree_flatten(m.init(jax.random.PRNGKey(0), x))
  keys = jax.random.split(jax.random.PRNGKey(4), len(leaves))   # random γ, β and biases, not 1 and 0
  p = jax.tree_util.tree_unflatten(tree, [jax.random.normal(k, a.shape, dtype) for k, a in zip(keys, leaves)])
  dispatched = []

  def policy(xla_bytes):   # records every XLA dispatch, then dispatches as the fold does
    return CenteringPolicy(parallel_bytes=1, xla_bytes=xla_bytes,
                           dispatch=lambda y: dispatched.append(y) or C.Dispatched(y))

  f = F.fold(p, m.apply, x, centering=policy(4 * 64 * 32 * np.dtype(dtype).itemsize))   # the 4 (64, 32) kernels
  assert f.report.num_folded == 5
  assert sorted(y.shape for y in dispatched) == [(64, 32)] * 4
  g = F.fold(p, m.apply, x, centering=policy(1 << 60))
  for a, b in zip(jax.tree_util.tree_leaves(f.params), jax.tree_util.tree_leaves(g.params)):
    assert a.dtype == b.dtype and a.sharding == b.sharding and a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=8 * float(jnp.finfo(dtype).eps))
  for shape in [(3, 7, 24), (2, 5, 24), (1, 1, 24)]:
    xs = jax.random.normal(jax.random.PRNGKey(5), shape, dtype)
    assert rel_err(f.apply_fn(f.params, xs), m.apply(p, xs)) < (1e-12 if precision == "float64" else 1e-4)
  if precision == "float64":   # x64 on: float32 leaves keep the host's float64 mean
    dispatched.clear()
    p32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), p)
    F.fold(p32, m.apply, x.astype(jnp.float32), centering=policy(4 * 64 * 32 * 4))
    assert dispatched == []
