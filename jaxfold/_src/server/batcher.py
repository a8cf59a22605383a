"""Dynamic batching: concurrent requests become one padded program call per bucket.

One asyncio task takes every queued request that fits the oldest request's
bucket (up to ``max_batch`` rows), runs the call on a single worker thread
(jax releases the GIL while it computes, so the event loop keeps accepting),
and resolves each request's future with its own slice of the outputs.  While a
call runs, new requests queue up and form the next batch; when the worker is
idle, the task waits ``max_wait_ms`` for company before running a lone request.
The queue is bounded: beyond ``max_queue`` waiting requests :meth:`submit`
raises :class:`QueueFull` (HTTP 503) instead of letting memory grow.

Example:
    >>> b = Batcher(model, max_queue=256, max_wait_ms=2)
    >>> b.start()
    >>> outputs = await b.submit(model.validate({"inputs": [[1, 2, 3]]}))
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import queue
import threading
import time
from typing import Any, Optional

from jaxfold._src.server.model import Request, ServedModel

__all__ = ["Batcher", "QueueFull", "ShuttingDown", "DrainTimeout", "Metrics"]


class QueueFull(Exception):
  """More requests are waiting than ``max_queue`` allows."""


class ShuttingDown(Exception):
  """The server is draining after SIGTERM and takes no new requests."""


class DrainTimeout(Exception):
  """The server stopped before this request was answered (past ``--drain-timeout``)."""


class _Worker:
  """One daemon thread running model calls: unlike a ThreadPoolExecutor's, it
  does not hold the process at exit when a call outlives the drain timeout."""

  def __init__(self):
    self._q: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=self._run, name="jaxfold-model", daemon=True).start()

  def _run(self):
    while True:
      job = self._q.get()
      if job is None:
        return
      fn, args, loop, fut = job
      try:
        res, err = fn(*args), None
      except BaseException as e:  # noqa: BLE001 - handed to the waiting coroutine
        res, err = None, e

      def settle(fut=fut, res=res, err=err):
        if not fut.done():
          fut.set_exception(err) if err is not None else fut.set_result(res)
      try:
        loop.call_soon_threadsafe(settle)
      except RuntimeError:   # the loop is closed: nobody waits any more
        pass

  def submit(self, fn, *args) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    self._q.put((fn, args, loop, fut))
    return fut

  def stop(self):
    self._q.put(None)


@dataclasses.dataclass
class _Item:
  req: Request
  key: tuple
  future: asyncio.Future
  t0: float


class Metrics:
  """Counters and a window of recent latencies (for GET /metrics)."""

  def __init__(self, window: int = 8192):
    self.status = collections.Counter()
    self.latency = collections.deque(maxlen=window)
    self.batches = 0
    self.rows = 0
    self.padded_rows = 0
    self.requests_batched = 0
    self.max_queue_seen = 0
    self.dropped = 0               # requests answered 503 past the drain timeout
    self.programs = set()
    self.started = time.time()

  def observe(self, status: int, seconds: Optional[float] = None) -> None:
    self.status[int(status)] += 1
    if seconds is not None and status == 200:
      self.latency.append(seconds)

  def as_dict(self, queue_depth: int, in_flight: int) -> dict:
    lat = sorted(self.latency)

    def q(p):
      return round(1e3 * lat[min(len(lat) - 1, int(p * len(lat)))], 3) if lat else None
    return {
        "uptime_s": round(time.time() - self.started, 3),
        "requests": {str(k): v for k, v in sorted(self.status.items())},
        "requests_total": sum(self.status.values()),
        "latency_ms": {"p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "window": len(lat)},
        "batches": self.batches,
        "mean_requests_per_batch": (round(self.requests_batched / self.batches, 3)
                                    if self.batches else None),
        "rows": self.rows, "padded_rows": self.padded_rows,
        "queue_depth": queue_depth, "max_queue_depth_seen": self.max_queue_seen,
        "in_flight": in_flight,
        "dropped_at_shutdown": self.dropped,
        "programs_run": sorted([list(p) for p in self.programs]),
    }


class Batcher:
  """Queues validated requests and runs them in padded, bucketed batches."""

  def __init__(self, model: ServedModel, *, max_queue: int = 256, max_wait_ms: float = 2.0,
               metrics: Optional[Metrics] = None):
    self.model = model
    self.max_queue = int(max_queue)
    self.max_wait = max(0.0, float(max_wait_ms)) / 1e3
    self.metrics = metrics or Metrics()
    self.pending: collections.deque = collections.deque()
    self.in_flight = 0
    self.closing = False
    self._wake: Optional[asyncio.Event] = None
    self._task: Optional[asyncio.Task] = None
    self._pool = _Worker()
    self._running: list = []
    self._drain: Optional[asyncio.Task] = None

  def start(self) -> None:
    self._wake = asyncio.Event()
    self._task = asyncio.get_running_loop().create_task(self._loop())

  async def submit(self, req: Request) -> Any:
    """Waits for ``req``'s outputs (raises what the model raised for it)."""
    if self.closing:
      raise ShuttingDown()
    if len(self.pending) >= self.max_queue:
      raise QueueFull()
    fut = asyncio.get_running_loop().create_future()
    self.pending.append(_Item(req, self.model.bucket_key(req), fut, time.perf_counter()))
    self.metrics.max_queue_seen = max(self.metrics.max_queue_seen, len(self.pending))
    self.in_flight += 1
    self._wake.set()
    try:
      return await fut
    finally:
      self.in_flight -= 1

  def _take(self) -> list:
    """The oldest item and every queued item with its key, within max_batch rows."""
    first = self.pending[0]
    budget = self.model.max_batch
    take, keep, rows = [], collections.deque(), 0
    for item in self.pending:
      if item.key == first.key and rows + item.req.rows <= budget:
        take.append(item)
        rows += item.req.rows
      else:
        keep.append(item)
    self.pending = keep
    return take

  async def _loop(self) -> None:
    idle = True
    while True:
      if not self.pending:
        if self.closing:
          return
        self._wake.clear()
        await self._wake.wait()
        idle = True
        continue
      if idle and self.max_wait and len(self.pending) < self.model.max_batch:
        await asyncio.sleep(self.max_wait)    # let concurrent requests join this batch
      items = self._take()
      items = [it for it in items if not it.future.done()]   # client went away
      if not items:
        continue
      idle = False
      reqs = [it.req for it in items]
      key = items[0].key
      self._running = items
      try:
        results = await self._pool.submit(self.model.run, reqs, key)
      except Exception as e:  # noqa: BLE001 - the whole call failed: every request learns why
        results = [e] * len(items)
      finally:
        self._running = []
      m = self.metrics
      rows = sum(r.rows for r in reqs)
      m.batches += 1
      m.requests_batched += len(items)
      m.rows += rows
      padded = self.model.batch_rows(rows) if self.model.batch_sym else rows
      m.padded_rows += padded - rows
      m.programs.add((padded, key[0]) if key[0] is not None else (padded,))
      for it, res in zip(items, results):
        if it.future.done():
          continue
        if isinstance(res, BaseException):
          it.future.set_exception(res)
        else:
          it.future.set_result(res)
      if not self.pending:
        idle = True

  def begin_drain(self, timeout: float = 30.0) -> asyncio.Task:
    """Starts draining (once; later calls return the same task)."""
    if self._drain is None:
      self._drain = asyncio.get_running_loop().create_task(self._drain_for(timeout))
    return self._drain

  async def drain(self, timeout: float = 30.0) -> None:
    """Stops taking requests and finishes the queued ones; those still waiting
    after ``timeout`` seconds get :class:`DrainTimeout` (each counted in
    ``metrics.dropped``).  Stops the worker."""
    await asyncio.shield(self.begin_drain(timeout))

  async def _drain_for(self, timeout: float) -> None:
    self.closing = True
    if self._wake is not None:
      self._wake.set()
    if self._task is not None:
      try:
        await asyncio.wait_for(asyncio.shield(self._task), timeout)
      except asyncio.TimeoutError:
        self._task.cancel()
        for it in list(self._running) + list(self.pending):
          if not it.future.done():
            it.future.set_exception(DrainTimeout())
            self.metrics.dropped += 1
        self.pending.clear()
    self._pool.stop()
