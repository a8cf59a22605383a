"""The HTTP service of ``jaxfold serve``: a Starlette app run by uvicorn.

Protocol (unchanged from ``examples/serve.py``)::

    POST /predict  {"inputs": [[...]]}   -> 200 {"outputs": [...], "shape": [...]}
                   {"inputs": [a, b, ...], "multiple": true} for programs with several arguments
                   {"inputs": ..., "encoding": "base64"} -> {"outputs": "<base64 of the raw
                   little-endian bytes>", "shape": [...], "dtype": "float32", "encoding": "base64"}
    GET  /health   -> {"status": "ok", "inputs": [[dims, dtype], ...], "buckets": ...}
    GET  /metrics  -> request counts by status, latency p50/p90/p99, batches, queue depth,
                      compiled bucket programs

Answers: 400 for a request that does not fit the model (shape, dtype, ids outside
[0, vocab), a sequence longer than the positions, ...), 413 for a body above
``max_body`` bytes, 503 (with ``Retry-After``) when the queue is full or the server
is draining, 500 when the model produced non-finite outputs.  On SIGTERM/SIGINT the
server stops accepting connections, finishes the requests in flight and exits 0.

Example:
    >>> cfg = ServeConfig(max_batch=16)
    >>> serve("gpt2-tiny.jaxexport", "127.0.0.1", 0, cfg)   # prints "listening on http://..."
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional

from jaxfold._src.serve.batcher import Batcher, Metrics, QueueFull, ShuttingDown
from jaxfold._src.serve.model import InputError, ServedModel

__all__ = ["ServeConfig", "create_app", "serve", "bind_socket"]


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """Limits and batching of ``jaxfold serve`` (the CLI flags of the same names)."""
  max_batch: int = 16            # rows per program call (buckets: powers of two up to this)
  max_seq: Optional[int] = None  # cap on the sequence length (default: the model's positions)
  max_queue: int = 256           # waiting requests beyond this get 503
  max_body: int = 1 << 20        # bytes per request body (413 beyond)
  max_wait_ms: float = 2.0       # how long a lone request waits for company
  backlog: int = 2048            # listen backlog: bursts of connections are queued, not reset
  drain_timeout: float = 30.0    # seconds to finish in-flight requests after SIGTERM
  warmup: bool = False           # compile every bucket before accepting requests


def _json(code: int, obj: Any, headers: Optional[dict] = None):
  from starlette.responses import Response
  body = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
  return Response(body, status_code=code, media_type="application/json", headers=headers)


ENCODINGS = ("json", "base64")


def _to_json(out: Any, encoding: str = "json") -> dict:
  """Outputs as nested lists, or (``encoding="base64"``) as the base64 of the
  raw little-endian array bytes with their dtype: an LM's logits are megabytes
  of JSON numbers, which cost more to format and parse than to compute."""
  import base64

  import jax
  import numpy as np
  leaves = jax.tree_util.tree_leaves(out)
  if encoding == "base64":
    enc = [base64.b64encode(np.ascontiguousarray(x, x.dtype.newbyteorder("<")).tobytes()).decode()
           for x in leaves]
    dtypes = [str(x.dtype) for x in leaves]
    if len(leaves) == 1:
      return {"outputs": enc[0], "shape": list(leaves[0].shape), "dtype": dtypes[0],
              "encoding": "base64"}
    return {"outputs": enc, "shape": [list(x.shape) for x in leaves], "dtype": dtypes,
            "encoding": "base64"}
  if len(leaves) == 1:
    return {"outputs": leaves[0].tolist(), "shape": list(leaves[0].shape)}
  return {"outputs": [x.tolist() for x in leaves], "shape": [list(x.shape) for x in leaves]}


def create_app(model: ServedModel, config: ServeConfig = ServeConfig(),
               on_ready: Optional[Callable[[], None]] = None):
  """The Starlette application serving ``model``."""
  from starlette.applications import Starlette
  from starlette.requests import ClientDisconnect
  from starlette.routing import Route

  metrics = Metrics()
  state: dict = {}

  @contextlib.asynccontextmanager
  async def lifespan(app):
    batcher = Batcher(model, max_queue=config.max_queue, max_wait_ms=config.max_wait_ms,
                      metrics=metrics)
    batcher.start()
    state["batcher"] = app.state.batcher = batcher
    if on_ready is not None:
      on_ready()
    try:
      yield
    finally:
      await batcher.drain(config.drain_timeout)

  async def read_body(request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
      try:
        n = int(declared)
      except ValueError:
        raise InputError("invalid Content-Length header") from None
      if n > config.max_body:
        raise OverflowError(n)
    chunks, size = [], 0
    async for chunk in request.stream():
      size += len(chunk)
      if size > config.max_body:
        raise OverflowError(size)
      chunks.append(chunk)
    return b"".join(chunks)

  async def predict(request):
    t0 = time.perf_counter()
    batcher: Batcher = state["batcher"]

    def answer(code, obj, headers=None):
      metrics.observe(code, time.perf_counter() - t0)
      return _json(code, obj, headers)

    if batcher.closing:
      return answer(503, {"error": "the server is shutting down"}, {"Retry-After": "1",
                                                                    "Connection": "close"})
    try:
      body = await read_body(request)
    except OverflowError:
      return answer(413, {"error": f"the request body is larger than {config.max_body} bytes "
                                   "(--max-body)"}, {"Connection": "close"})
    except InputError as e:
      return answer(400, {"error": str(e)})
    except ClientDisconnect:
      metrics.observe(499)
      return _json(400, {"error": "client disconnected"})
    if not body:
      return answer(400, {"error": 'empty body: send a JSON object {"inputs": [[...]]}'})
    try:
      payload = json.loads(body)
    except (ValueError, RecursionError) as e:
      return answer(400, {"error": f"the body is not valid JSON: {str(e)[:200]}"})
    encoding = payload.get("encoding", "json") if isinstance(payload, dict) else "json"
    if encoding not in ENCODINGS:
      return answer(400, {"error": f"encoding must be one of {list(ENCODINGS)}, got {encoding!r}"})
    try:
      req = model.validate(payload)
    except InputError as e:
      return answer(400, {"error": str(e)})
    try:
      out = await batcher.submit(req)
    except QueueFull:
      return answer(503, {"error": f"too many requests waiting (--max-queue {config.max_queue}); "
                                   "retry later"}, {"Retry-After": "1"})
    except ShuttingDown:
      return answer(503, {"error": "the server is shutting down"}, {"Retry-After": "1"})
    except FloatingPointError as e:
      return answer(500, {"error": str(e)})
    except Exception as e:  # noqa: BLE001 - report, keep serving
      first = (str(e).strip().splitlines() or [""])[0][:300]
      return answer(500, {"error": f"{type(e).__name__}: {first}"})
    return answer(200, _to_json(out, encoding))

  async def health(request):
    batcher = state.get("batcher")
    status = "draining" if batcher is not None and batcher.closing else "ok"
    return _json(200, {"status": status, "inputs": model.signature(), "model": model.meta,
                       "buckets": model.describe()})

  async def metrics_route(request):
    batcher = state.get("batcher")
    out = metrics.as_dict(len(batcher.pending) if batcher else 0,
                          batcher.in_flight if batcher else 0)
    out["programs_compiled"] = model.compiled_buckets()   # start-up checks and warm-up included
    out["max_programs"] = model.max_programs()
    return _json(200, out)

  async def not_found(request, exc):
    return _json(404, {"error": f"no such endpoint {request.url.path}; use POST /predict, "
                                "GET /health or GET /metrics"})

  async def not_allowed(request, exc):
    return _json(405, {"error": f"{request.method} is not allowed on {request.url.path}"})

  routes = [Route("/predict", predict, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"])]
  app = Starlette(routes=routes, lifespan=lifespan,
                  exception_handlers={404: not_found, 405: not_allowed})
  app.state.metrics = metrics
  return app


def bind_socket(host: str, port: int, backlog: int) -> socket.socket:
  """A listening TCP socket (``port=0``: the OS picks a free one)."""
  infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
  family, _, _, _, addr = infos[0]
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind(addr)
  sock.listen(backlog)
  sock.set_inheritable(True)
  return sock


def serve(model: ServedModel, host: str = "127.0.0.1", port: int = 8000,
          config: ServeConfig = ServeConfig(), *, log: Callable[[str], None] = None) -> int:
  """Serves ``model`` until SIGTERM/SIGINT; prints ``listening on http://HOST:PORT``
  as the first stdout line once the socket is bound.  Returns 0 after a clean drain."""
  import uvicorn

  log = log or (lambda m: print(f"serve: {m}", file=sys.stderr, flush=True))
  sock = bind_socket(host, port, config.backlog)
  bound_host, bound_port = sock.getsockname()[:2]
  shown = f"[{bound_host}]" if ":" in bound_host else bound_host

  class _Server(uvicorn.Server):
    # uvicorn re-raises a captured SIGTERM after its graceful shutdown (exit
    # status -15); a drained server exits 0 instead.
    @contextlib.contextmanager
    def capture_signals(self):
      if threading.current_thread() is not threading.main_thread():
        yield
        return
      def on_signal(sig, frame):
        if not self.should_exit:
          log(f"received {signal.Signals(sig).name}: not accepting new connections, "
              "finishing the requests in flight")
        self.handle_exit(sig, frame)
      old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
      try:
        yield
      finally:
        for s, h in old.items():
          signal.signal(s, h)

  app = create_app(model, config)
  ucfg = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                        backlog=config.backlog, timeout_graceful_shutdown=config.drain_timeout,
                        timeout_keep_alive=30, server_header=False)
  server = _Server(ucfg)
  print(f"listening on http://{shown}:{bound_port}", flush=True)
  try:
    server.run(sockets=[sock])
  finally:
    sock.close()
  m = app.state.metrics.as_dict(0, 0)
  log(f"stopped after {m['requests_total']} requests ({m['requests']}), {m['batches']} batches")
  return 0
