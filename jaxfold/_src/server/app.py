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
[0, vocab), a sequence longer than the positions, true/false for integers, ...),
401 without the bearer token (``api_key``), 408 for a body not received within
``body_timeout``, 413 for a body above ``max_body`` bytes, 503 (with
``Retry-After``) when the queue is full, the server is draining, or the request's
padded shape is not a compiled program (the bucket set is compiled at start;
at most ``compile_budget`` programs, see ``--compile-budget``), 500 when the model
produced non-finite outputs.

Hostile clients: a connection that has not sent a complete request header within
``header_timeout`` seconds is closed (also between keep-alive requests: uvicorn's
``timeout_keep_alive``), request heads are capped (``h11_max_incomplete_event_size``),
and when the open connections reach ``max_connections`` (default: the descriptor
limit minus a reserve) the oldest idle one is closed for each new one, so
``/health`` answers however many idle connections are held open.

On SIGTERM/SIGINT the server stops accepting connections and finishes the
requests in flight; those not answered within ``drain_timeout`` get a 503 with
a JSON body, are counted in the final summary, and the exit status is 1 (0
after a clean drain).

Example:
    >>> cfg = ServeConfig(max_batch=16)
    >>> serve("gpt2-tiny.jaxexport", "127.0.0.1", 0, cfg)   # prints "listening on http://..."
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import ipaddress
import json
import resource
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional

from jaxfold._src.server.batcher import Batcher, DrainTimeout, Metrics, QueueFull, ShuttingDown
from jaxfold._src.server.model import InputError, OutsideBuckets, ServedModel, ServeError

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
  warmup: bool = True            # compile the bucket set before accepting requests
  compile_budget: int = 64       # programs compiled in all (at start; with warmup=False on requests)
  header_timeout: float = 10.0   # seconds for a connection to send a complete request head
  keep_alive_timeout: int = 5    # seconds an idle keep-alive connection stays open
  body_timeout: float = 30.0     # seconds to receive a request body (408 beyond)
  max_header_bytes: int = 64 * 1024
  max_connections: Optional[int] = None   # default: RLIMIT_NOFILE minus a reserve
  api_key: Optional[str] = None  # required bearer token for /predict and /metrics
  ssl_certfile: Optional[str] = None
  ssl_keyfile: Optional[str] = None
  insecure: bool = False         # allow a non-loopback host without api_key


_FD_RESERVE = 128   # descriptors kept for the process itself (jax, logs, the listener)


def connection_limit(config: ServeConfig) -> int:
  """How many connections are kept open at most (the oldest idle ones are
  closed beyond it): ``max_connections`` or the soft descriptor limit minus
  a reserve."""
  soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  limit = soft - _FD_RESERVE if soft != resource.RLIM_INFINITY else 1 << 16
  if config.max_connections:
    limit = min(limit, config.max_connections) if limit > 0 else config.max_connections
  return max(8, limit)


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
  token = f"Bearer {config.api_key}".encode() if config.api_key else None

  def authorized(request) -> bool:
    if token is None:
      return True
    got = request.headers.get("authorization", "").encode("latin-1", "replace")
    return hmac.compare_digest(got, token)

  def unauthorized():
    metrics.observe(401)
    return _json(401, {"error": "missing or wrong bearer token: send the header "
                                "'Authorization: Bearer <key>' (--api-key)"},
                 {"WWW-Authenticate": "Bearer"})

  @contextlib.asynccontextmanager
  async def lifespan(app):
    batcher = Batcher(model, max_queue=config.max_queue, max_wait_ms=config.max_wait_ms,
                      metrics=metrics)
    batcher.start()
    state["loop"] = asyncio.get_running_loop()
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

    async def receive():
      nonlocal size
      async for chunk in request.stream():
        size += len(chunk)
        if size > config.max_body:
          raise OverflowError(size)
        chunks.append(chunk)
    await asyncio.wait_for(receive(), config.body_timeout)
    return b"".join(chunks)

  async def predict(request):
    t0 = time.perf_counter()
    batcher: Batcher = state["batcher"]
    if not authorized(request):
      return unauthorized()

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
    except asyncio.TimeoutError:
      return answer(408, {"error": f"the request body did not arrive within {config.body_timeout:g} s"},
                    {"Connection": "close"})
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
      check = getattr(model, "check_served", None)   # duck-typed models may not bucket
      if check is not None:
        check(req)
      out = await batcher.submit(req)
    except OutsideBuckets as e:
      return answer(503, {"error": str(e)})
    except DrainTimeout:
      return answer(503, {"error": f"the server stopped before answering this request (it did not "
                                   f"finish within --drain-timeout {config.drain_timeout:g} s): "
                                   "retry it elsewhere"}, {"Connection": "close"})
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
    if not authorized(request):   # open to load balancers, without the model's details
      return _json(200, {"status": status})
    return _json(200, {"status": status, "inputs": model.signature(), "model": model.meta,
                       "buckets": model.describe()})

  async def metrics_route(request):
    if not authorized(request):
      return unauthorized()
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
  app.state.state = state
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


def is_loopback(host: str) -> bool:
  """Whether every address ``host`` resolves to is a loopback address."""
  try:
    infos = socket.getaddrinfo(host, None)
  except OSError:
    return False
  return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def _guarded_protocol(config: ServeConfig, limit: int, counters: dict):
  """uvicorn's h11 protocol with a deadline for the request head and a cap on
  open connections (uvicorn closes idle keep-alive connections, but has no
  timeout before the first request: a connection that never sends one would
  hold a descriptor for ever)."""
  from uvicorn.protocols.http.h11_impl import H11Protocol

  conns: dict = {}   # insertion-ordered: the oldest first

  class Guarded(H11Protocol):
    _jf_timer = None
    _jf_cycle = None

    def connection_made(self, transport):
      super().connection_made(transport)
      conns[self] = None
      self._jf_arm()
      if len(conns) > limit:
        for other in list(conns):
          if len(conns) <= limit:
            break
          if other is not self and other._jf_waiting():
            conns.pop(other, None)
            counters["evicted"] = counters.get("evicted", 0) + 1
            other.transport.abort()

    def _jf_waiting(self) -> bool:
      return self.cycle is None or self.cycle.response_complete

    def _jf_arm(self):
      self._jf_cycle = self.cycle
      self._jf_timer = self.loop.call_later(config.header_timeout, self._jf_expire)

    def _jf_expire(self):
      self._jf_timer = None
      if self.cycle is self._jf_cycle and self._jf_waiting() and not self.transport.is_closing():
        counters["timed_out"] = counters.get("timed_out", 0) + 1
        self.transport.abort()

    def data_received(self, data):
      if self._jf_timer is None and self._jf_waiting():
        self._jf_arm()      # the start of another request on a kept-alive connection
      super().data_received(data)

    def connection_lost(self, exc):
      conns.pop(self, None)
      if self._jf_timer is not None:
        self._jf_timer.cancel()
        self._jf_timer = None
      super().connection_lost(exc)

  return Guarded


def serve(model: ServedModel, host: str = "127.0.0.1", port: int = 8000,
          config: ServeConfig = ServeConfig(), *, log: Callable[[str], None] = None) -> int:
  """Serves ``model`` until SIGTERM/SIGINT; prints ``listening on http(s)://HOST:PORT``
  as the first stdout line once the socket is bound.  Returns 0 after a clean
  drain, 1 when requests were still unanswered after ``drain_timeout`` (each got
  a 503).  Compiles the bucket set first unless ``config.warmup`` is off.

  Example:
    >>> serve(load_model("gpt2-tiny.jaxexport"), "127.0.0.1", 0, ServeConfig(api_key="s3cret"))
  """
  import uvicorn

  log = log or (lambda m: print(f"serve: {m}", file=sys.stderr, flush=True))
  if not config.api_key and not config.insecure and not is_loopback(host):
    raise ServeError(f"refusing to serve on {host} (not a loopback address) without "
                     "authentication: pass --api-key KEY (clients send 'Authorization: Bearer KEY'), "
                     "ideally with --ssl-certfile/--ssl-keyfile, or --insecure to serve anyone")
  if bool(config.ssl_certfile) != bool(config.ssl_keyfile):
    raise ServeError("TLS needs both --ssl-certfile and --ssl-keyfile")
  if not model.sealed:
    if config.warmup:
      shapes = model.warmup(config.compile_budget)
      log(f"compiled {len(model.compiled)} programs ({len(shapes)} bucket shapes at start); shapes "
          "outside them are answered 503")
      model.seal(0)
    else:
      model.seal(max(0, config.compile_budget - len(model.compiled)))
  sock = bind_socket(host, port, config.backlog)
  bound_host, bound_port = sock.getsockname()[:2]
  shown = f"[{bound_host}]" if ":" in bound_host else bound_host
  app = create_app(model, config)
  state = app.state.state

  class _Server(uvicorn.Server):
    # uvicorn re-raises a captured SIGTERM after its graceful shutdown (exit
    # status -15); we exit with our own status instead, and start draining the
    # batcher at once so that requests past drain_timeout get their 503 before
    # uvicorn's own deadline cancels their handlers.
    @contextlib.contextmanager
    def capture_signals(self):
      if threading.current_thread() is not threading.main_thread():
        yield
        return
      def on_signal(sig, frame):
        if not self.should_exit:
          log(f"received {signal.Signals(sig).name}: not accepting new connections, "
              f"finishing the requests in flight (at most {config.drain_timeout:g} s)")
          loop, batcher = state.get("loop"), state.get("batcher")
          if loop is not None and batcher is not None:
            loop.call_soon_threadsafe(batcher.begin_drain, config.drain_timeout)
        self.handle_exit(sig, frame)
      old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
      try:
        yield
      finally:
        for s, h in old.items():
          signal.signal(s, h)

  limit = connection_limit(config)
  counters: dict = {}
  ucfg = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                        http=_guarded_protocol(config, limit, counters),
                        backlog=config.backlog, limit_concurrency=limit + 16,
                        timeout_graceful_shutdown=config.drain_timeout + 10,
                        timeout_keep_alive=config.keep_alive_timeout, server_header=False,
                        h11_max_incomplete_event_size=config.max_header_bytes,
                        ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile)
  server = _Server(ucfg)
  scheme = "https" if config.ssl_certfile else "http"
  print(f"listening on {scheme}://{shown}:{bound_port}", flush=True)
  try:
    server.run(sockets=[sock])
  finally:
    sock.close()
  m = app.state.metrics.as_dict(0, 0)
  closed = (f"; closed {counters.get('timed_out', 0)} connections without a request head in "
            f"{config.header_timeout:g} s and {counters.get('evicted', 0)} idle ones over the "
            f"{limit}-connection cap") if counters else ""
  log(f"stopped after {m['requests_total']} requests ({m['requests']}), {m['batches']} batches{closed}")
  if m["dropped_at_shutdown"]:
    log(f"{m['dropped_at_shutdown']} requests were not answered within --drain-timeout "
        f"{config.drain_timeout:g} s (each got a 503): exit status 1")
    return 1
  return 0
