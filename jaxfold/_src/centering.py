"""The centering engine: a fold's centered parameters, computed beside the main thread.

``fold.py`` decides *which* parameters are centered (``Centered``, ``UntiedCopy``
records of its analysis); this module computes them: NumPy on the host for
host arrays (no per-shape compile), on worker threads for large leaves (row
blocks for very large ones), XLA for a large group of same-shaped leaves, and
jax for device-resident or sharded leaves. ``CenteringPolicy`` holds every
threshold and the workers, so a caller (a test) injects its own instead of
patching this module.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import os
from typing import Any, Callable, Iterable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxfold._src import compat, layout


class Centered(NamedTuple):
  """A parameter centered in place: leaf ``leaf`` by ``spec`` (``((dim, block size), ...)``)."""
  leaf: int
  spec: tuple


class UntiedCopy(NamedTuple):
  """A centered copy ``name`` of leaf ``leaf`` (by ``spec``) for the uses that need it."""
  name: str
  leaf: int
  spec: tuple


def on_host(x) -> bool:
  """A concrete array on one CPU device (or NumPy): centered with NumPy."""
  sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
  return sharding is None or (all(d.platform == "cpu" for d in sharding.device_set)
                              and len(sharding.device_set) <= 1)


def host_center(x, spec: dict, out: Optional[np.ndarray] = None, pairwise: Optional[bool] = None) -> np.ndarray:
  """``x`` centered by ``spec`` with NumPy, into ``out`` (a new aligned array by default)."""
  # NumPy on the host: no per-shape compilation, which dominates a cold fold.
  # Written 64-byte aligned, jax's CPU client adopts the result without a
  # copy (an unaligned one is copied: as long as the centering itself).
  # The float64 mean of a float32 table is the fold's critical path; float32
  # rows take NumPy's pairwise sum (~2 ulp) unless jax computes in float64
  # (asked on the caller's thread: enable_x64 contexts are thread-local).
  out = aligned_empty(np.shape(x), x.dtype) if out is None else out
  pairwise = not compat.x64_enabled() if pairwise is None else pairwise
  return layout.center(x, spec, out=out, pairwise=pairwise)


def adopt(y, like):
  """``y`` (a centered NumPy or jax array) as a jax array placed like ``like``:
  on its sharding where it is committed to one, else uncommitted as ``like``
  is (committed to device 0, it refused a ``jit`` whose ``shard_map`` spans
  several devices: "incompatible devices")."""
  sharding = getattr(like, "sharding", None) if isinstance(like, jax.Array) else None
  if sharding is None or not getattr(like, "committed", True):
    # device_put, not jnp.asarray: jax 0.10's asarray copies even a 64-byte
    # aligned NumPy array (43 ms for GPT-2's token table); device_put adopts
    # it (the array is the fold's own, never the caller's).
    return jax.device_put(y)
  return jax.device_put(y, sharding)


def center_leaf(x, spec):
  """Centers one parameter, keeping its dtype, device and sharding."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  y = host_center(np.asarray(x), dict(spec)) if on_host(x) else center_jit(dict(spec))(x)
  return adopt(y, x)


_POOL: list = []   # the shared centering workers, made on first use
# A forked child has none of the parent's threads: it makes its own pool.
os.register_at_fork(after_in_child=_POOL.clear)


def _default_workers() -> int:
  return max(1, min(4, os.cpu_count() or 1))


def shared_pool() -> concurrent.futures.ThreadPoolExecutor:
  """The process's centering workers (``_default_workers()`` threads)."""
  if not _POOL:
    _POOL.append(concurrent.futures.ThreadPoolExecutor(
        max_workers=_default_workers(), thread_name_prefix="jaxfold-center"))
  return _POOL[0]


class Dispatched:
  """A centering XLA runs asynchronously, as a finished future: the array is
  returned at once, and whoever reads it waits for it."""

  def __init__(self, y):
    self._y = y

  def result(self):
    return self._y

  def cancel(self) -> bool:
    return False


class Blocks:
  """The futures of one leaf centered by row blocks into ``out``, as one future."""

  def __init__(self, out: np.ndarray, futures: list):
    self._out, self._futures = out, futures

  def result(self) -> np.ndarray:
    for f in self._futures:
      f.result()
    return self._out

  def cancel(self) -> bool:
    return all([f.cancel() for f in self._futures])

  def cancelled(self) -> bool:
    return all(f.cancelled() for f in self._futures)

  def done(self) -> bool:
    return all(f.done() for f in self._futures)


@dataclasses.dataclass(frozen=True)
class CenteringPolicy:
  """Where each centering runs. The defaults are the fold's; tests pass their own.

  A leaf of at least ``parallel_bytes`` centers on a worker (a thread hop
  costs a smaller one more than it saves); one of at least ``split_bytes``
  (an embedding table) also splits into row blocks; a group of same-shaped
  leaves holding at least ``xla_bytes`` centers in XLA (one compile per
  shape, ~25 ms, is what keeps smaller groups on NumPy). ``pool``/``workers``:
  the executor and its thread count (None: the shared pool); ``host`` centers
  one host array (``host_center``'s signature); ``dispatch`` wraps a started
  XLA centering as a future (``Dispatched``)."""
  parallel_bytes: int = 1 << 20
  split_bytes: int = 16 << 20
  xla_bytes: int = 64 << 20
  pool: Optional[concurrent.futures.Executor] = None
  workers: Optional[int] = None
  host: Callable = host_center
  dispatch: Callable = Dispatched

  def executor(self) -> concurrent.futures.Executor:
    return self.pool if self.pool is not None else shared_pool()

  def num_workers(self) -> int:
    if self.workers is not None:
      return self.workers
    return _default_workers() if self.pool is None else 1


DEFAULT_POLICY = CenteringPolicy()


class Centering:
  """The centered parameters of a fold, computed beside the main thread.

  Large leaves center on worker threads: NumPy releases the GIL in its
  loops, so they center in parallel with each other and beside Python work
  (the probe's trace at batch 1), and memory bandwidth, not one core, bounds
  the time. A group of leaves sharing shape, dtype and axes that holds at
  least ``policy.xla_bytes`` (a transformer's stacked MLP projections)
  centers in XLA instead: one compiled program per group (compiled on first
  use, then cached for the process), run asynchronously on XLA's threads in
  one fused pass, with no GIL to wait for (GPT-2 small's 12 MLP output
  projections: ~15 ms less per fold once compiled). Jobs are keyed by leaf
  and axes: a plan that another shape changes keeps the jobs it shares."""

  def __init__(self, leaves: list, policy: CenteringPolicy = DEFAULT_POLICY):
    self._leaves = leaves
    self._policy = policy
    self._x64 = compat.x64_enabled()   # asked here: the workers do not see an enable_x64 context
    self._pairwise = not self._x64
    self._futures: dict = {}   # (leaf index, spec) -> Future (or Blocks, Dispatched) of the centered array

  def jobs(self) -> dict:
    """``{(leaf, spec): "host" | "blocks" | "xla"}`` of the centerings started and not collected."""
    def kind(f):
      return "blocks" if isinstance(f, Blocks) else "host" if isinstance(f, concurrent.futures.Future) else "xla"
    return {k: kind(f) for k, f in self._futures.items()}

  def start(self, centered: Iterable[Centered], untied: Iterable[UntiedCopy]) -> None:
    """Starts every large centering of a plan not started yet, largest first."""
    p = self._policy
    jobs = {(c.leaf, c.spec) for c in centered} | {(u.leaf, u.spec) for u in untied}
    large = [(i, spec) for i, spec in jobs - self._futures.keys()
             if not isinstance(self._leaves[i], jax.ShapeDtypeStruct)
             and nbytes(self._leaves[i]) >= p.parallel_bytes and on_host(self._leaves[i])]
    groups = collections.Counter()
    for i, spec in large:
      groups[self._group(i, spec)] += nbytes(self._leaves[i])
    for i, spec in sorted(large, key=lambda k: -nbytes(self._leaves[k[0]])):
      x = self._leaves[i]
      if groups[self._group(i, spec)] >= p.xla_bytes and self._xla_exact(x):
        self._futures[(i, spec)] = p.dispatch(center_jit(dict(spec))(x))
      else:
        self._futures[(i, spec)] = self._submit(np.asarray(x), dict(spec))

  def _group(self, i: int, spec: tuple) -> tuple:
    x = self._leaves[i]
    return (tuple(np.shape(x)), np.dtype(x.dtype), spec)

  def _xla_exact(self, x) -> bool:
    """XLA's mean is as accurate as NumPy's pairwise float32 one, but under
    x64 the host takes a float64 mean of a float32 leaf, which XLA would not."""
    dt = np.dtype(x.dtype)
    return jnp.issubdtype(dt, jnp.floating) and (not self._x64 or dt == np.float64)

  def _submit(self, x: np.ndarray, spec: dict):
    # The mean is compute-bound (in float64 unless pairwise): one large table on
    # one thread is the fold's critical path. Blocks of rows along a dim the spec
    # does not center are independent and contiguous (dim 0 of a C-ordered array).
    p = self._policy
    pool, workers = p.executor(), p.num_workers()
    if nbytes(x) < p.split_bytes or workers < 2 or 0 in spec or x.ndim < 2 or x.shape[0] < workers:
      return pool.submit(p.host, x, spec, None, self._pairwise)
    out = aligned_empty(x.shape, x.dtype)
    cuts = np.linspace(0, x.shape[0], workers + 1).astype(int)
    return Blocks(out, [pool.submit(p.host, x[a:b], spec, out[a:b], self._pairwise)
                        for a, b in zip(cuts[:-1], cuts[1:])])

  def cancel(self) -> None:
    for f in self._futures.values():
      f.cancel()

  def result(self, centered: Iterable[Centered], untied: Iterable[UntiedCopy]) -> tuple:
    """``(new leaves, untied copies)`` of a plan; unused jobs are dropped."""
    centered, untied = tuple(centered), tuple(untied)
    done: dict = {}

    def get(i, spec):
      if (i, spec) not in done:
        f = self._futures.pop((i, spec), None)
        done[(i, spec)] = adopt(f.result(), self._leaves[i]) if f is not None else center_leaf(self._leaves[i], spec)
      return done[(i, spec)]

    self.start(centered, untied)
    try:
      new = list(self._leaves)
      for c in centered:
        new[c.leaf] = get(c.leaf, c.spec)
      copies = {u.name: get(u.leaf, u.spec) for u in untied}
    finally:
      self.cancel()   # speculation the final plan does not use
    return new, copies


def nbytes(x) -> int:
  return math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize


def aligned_empty(shape: tuple, dtype: Any) -> np.ndarray:
  """An uninitialised host array starting on a 64-byte boundary."""
  dtype = np.dtype(dtype)
  n = math.prod(shape) * dtype.itemsize
  buf = np.empty(n + 64, np.uint8)
  start = -buf.ctypes.data % 64
  return buf[start:start + n].view(dtype).reshape(shape)


@functools.lru_cache(maxsize=None)
def _center_jit_cached(spec_items: tuple):
  return jax.jit(lambda x: layout.center(x, dict(spec_items)))


def center_jit(spec: dict):
  """A jitted centering by ``spec`` (cached per spec): for device-resident leaves."""
  return _center_jit_cached(tuple(sorted(spec.items())))
