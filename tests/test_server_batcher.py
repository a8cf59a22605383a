"""The serving stack in-process, with a fake model whose calls block until released:
queue bounds (503), batching into buckets and draining are checked by order of
events, not by timing."""

import asyncio
import json
import threading

import numpy as np
import pytest

pytest.importorskip("starlette")

# this file mirrors jaxfold/_src/server/batcher.py (its private Batcher and Request)
from jaxfold._src.server.batcher import Batcher, QueueFull, ShuttingDown  # noqa: E402
from jaxfold._src.server.model import Request  # noqa: E402
from jaxfold.serving import InputError, ServeConfig, create_app, pow2_buckets  # noqa: E402


class FakeModel:
  """Rows of ints -> each row's sum; ``run`` waits for ``release``."""
  batch_sym, meta = "batch", {}

  def __init__(self, max_batch=4):
    self.max_batch = max_batch
    self.batch_buckets = pow2_buckets(max_batch)
    self.calls = []
    self.entered = threading.Event()
    self.release = threading.Event()

  def validate(self, payload):
    if not isinstance(payload, dict) or "inputs" not in payload:
      raise InputError("expected inputs")
    a = np.asarray(payload["inputs"], np.int32)
    return Request([a], a.shape[0], a.shape[1])

  def bucket_key(self, req):
    return (req.seq, ())

  def batch_rows(self, rows):
    return next(b for b in self.batch_buckets if b >= rows)

  def run(self, reqs, key):
    self.calls.append((key, [r.rows for r in reqs]))
    self.entered.set()
    assert self.release.wait(30)
    return [r.args[0].sum(axis=1) for r in reqs]

  def signature(self):
    return [[["batch", "seq"], "int32"]]

  def describe(self):
    return {"batch_buckets": list(self.batch_buckets)}

  def compiled_buckets(self):
    return []

  def max_programs(self):
    return len(self.batch_buckets)


async def _until(cond, what):
  for _ in range(3000):           # polls the event loop's own state, 10 ms apart
    if cond():
      return
    await asyncio.sleep(0.01)
  raise AssertionError(f"timed out waiting for {what}")


def test_batcher_batches_by_key_bounds_queue_and_drains():
  m = FakeModel(max_batch=4)

  async def main():
    b = Batcher(m, max_queue=3, max_wait_ms=0)
    b.start()
    first = asyncio.ensure_future(b.submit(m.validate({"inputs": [[1, 2]]})))
    await _until(m.entered.is_set, "the first call")
    # while the worker is busy: two rows of length 2, one of length 3, then the queue is full
    queued = [asyncio.ensure_future(b.submit(m.validate({"inputs": x})))
              for x in ([[1, 1], [2, 2]], [[5, 5, 5]], [[3, 3]])]
    await _until(lambda: len(b.pending) == 3, "three queued requests")
    with pytest.raises(QueueFull):
      await b.submit(m.validate({"inputs": [[9, 9]]}))
    m.release.set()
    assert list(await first) == [3]
    outs = [list(x) for x in await asyncio.gather(*queued)]
    assert outs == [[2, 4], [15], [6]]
    # same key (seq 2) batched together: 2 + 1 rows; seq 3 on its own
    assert m.calls == [((2, ()), [1]), ((2, ()), [2, 1]), ((3, ()), [1])]
    await b.drain(10)
    with pytest.raises(ShuttingDown):
      await b.submit(m.validate({"inputs": [[1]]}))
    assert b.metrics.batches == 3 and b.metrics.requests_batched == 4

  asyncio.run(main())


async def _asgi(app, method, path, body=b""):
  """One HTTP request through the ASGI app; returns (status, parsed JSON)."""
  scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
           "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
           "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
           "headers": [(b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode())]}
  sent = {"body": b""}
  chunks = [{"type": "http.request", "body": body, "more_body": False}]

  async def receive():
    if chunks:
      return chunks.pop()
    await asyncio.Event().wait()      # the client never disconnects

  async def send(msg):
    if msg["type"] == "http.response.start":
      sent["status"] = msg["status"]
    elif msg["type"] == "http.response.body":
      sent["body"] += msg.get("body", b"")
  await app(scope, receive, send)
  return sent["status"], json.loads(sent["body"])


def test_app_answers_503_when_the_queue_is_full_and_413_for_big_bodies():
  m = FakeModel(max_batch=1)
  app = create_app(m, ServeConfig(max_queue=1, max_body=100, max_wait_ms=0))

  async def main():
    async with app.router.lifespan_context(app):
      batcher = app.state.batcher
      one = asyncio.ensure_future(_asgi(app, "POST", "/predict", b'{"inputs": [[1, 2]]}'))
      await _until(m.entered.is_set, "the first call")
      two = asyncio.ensure_future(_asgi(app, "POST", "/predict", b'{"inputs": [[3, 4]]}'))
      await _until(lambda: len(batcher.pending) == 1, "a queued request")
      code, body = await _asgi(app, "POST", "/predict", b'{"inputs": [[5, 6]]}')
      assert code == 503 and "--max-queue" in body["error"]
      code, body = await _asgi(app, "POST", "/predict", b'{"inputs": [[' + b"1, " * 60 + b"1]]}")
      assert code == 413
      m.release.set()
      assert await one == (200, {"outputs": [3], "shape": [1]})
      assert await two == (200, {"outputs": [7], "shape": [1]})
      code, metrics = await _asgi(app, "GET", "/metrics")
      assert metrics["requests"] == {"200": 2, "413": 1, "503": 1}
      assert metrics["max_queue_depth_seen"] == 1

  asyncio.run(main())
