"""A small, bounded HTTP/1.1 load generator for loopback tests and benchmarks.

``concurrency`` clients each keep one keep-alive connection and send requests
from a shared list until it is exhausted; the whole run stops after
``timeout`` seconds whatever happens.  Standard library only (asyncio), so the
client costs little CPU next to the server it measures.

Example:
    >>> res = load_test("http://127.0.0.1:8000/predict", payloads, concurrency=64)
    >>> res.throughput, res.percentile(0.99)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import urllib.parse
from typing import Any, Optional, Sequence

__all__ = ["LoadResult", "load_test", "run_load"]


@dataclasses.dataclass
class LoadResult:
  """Per-request results in the order of ``payloads``."""
  status: list                 # HTTP status, or 0 when the connection failed
  body: list                   # parsed JSON (or the error text)
  latency: list                # seconds, send to last byte
  wall: float                  # seconds for the whole run
  errors: list                 # connection-level failures, as text

  @property
  def ok(self) -> int:
    return sum(s == 200 for s in self.status)

  @property
  def throughput(self) -> float:
    return self.ok / self.wall if self.wall > 0 else 0.0

  def percentile(self, q: float) -> Optional[float]:
    lat = sorted(l for l, s in zip(self.latency, self.status) if s == 200)
    if not lat:
      return None
    return lat[min(len(lat) - 1, int(q * len(lat)))]


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
  line = await reader.readline()
  if not line:
    raise ConnectionError("connection closed by the server")
  parts = line.decode("latin-1").split(" ", 2)
  status = int(parts[1])
  headers = {}
  while True:
    h = await reader.readline()
    if h in (b"\r\n", b"\n", b""):
      break
    k, _, v = h.decode("latin-1").partition(":")
    headers[k.strip().lower()] = v.strip()
  if "content-length" in headers:
    body = await reader.readexactly(int(headers["content-length"]))
  elif headers.get("transfer-encoding", "").lower() == "chunked":
    chunks = []
    while True:
      size = int((await reader.readline()).split(b";")[0], 16)
      if size == 0:
        await reader.readline()
        break
      chunks.append(await reader.readexactly(size))
      await reader.readline()
    body = b"".join(chunks)
  else:
    body = await reader.read()
  return status, headers, body


async def run_load(url: str, payloads: Sequence[Any], *, concurrency: int = 64,
                   timeout: float = 120.0, connect_timeout: float = 10.0,
                   keep_bodies: bool = True) -> LoadResult:
  """Sends every payload once (``POST`` JSON) over ``concurrency`` connections.

  ``keep_bodies=False`` neither parses nor keeps the bodies of 200 answers
  (``body`` is ``None`` for them): for throughput runs with large outputs."""
  u = urllib.parse.urlsplit(url)
  host, port, path = u.hostname, u.port or 80, u.path or "/"
  bodies = [p if isinstance(p, (bytes, bytearray)) else json.dumps(p).encode() for p in payloads]
  n = len(bodies)
  status, out, latency, errors = [0] * n, [None] * n, [0.0] * n, []
  next_i = 0

  async def client():
    nonlocal next_i
    reader = writer = None
    while next_i < n:
      i = next_i
      next_i += 1
      body = bodies[i]
      for attempt in range(2):      # one reconnect when the server closed an idle connection
        try:
          if writer is None:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                    connect_timeout)
          t0 = time.perf_counter()
          writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                       .encode() + body)
          await writer.drain()
          code, headers, data = await _read_response(reader)
          latency[i] = time.perf_counter() - t0
          status[i] = code
          if code == 200 and not keep_bodies:
            out[i] = None
          else:
            try:
              out[i] = json.loads(data)
            except ValueError:
              out[i] = data.decode("utf-8", "replace")
          if headers.get("connection", "").lower() == "close":
            writer.close()
            reader = writer = None
          break
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
          if writer is not None:
            writer.close()
          reader = writer = None
          if attempt == 1:
            errors.append(f"request {i}: {type(e).__name__}: {e}")
            out[i] = f"{type(e).__name__}: {e}"
    if writer is not None:
      writer.close()

  t0 = time.perf_counter()
  tasks = [asyncio.ensure_future(client()) for _ in range(max(1, min(concurrency, n)))]
  done, pending = await asyncio.wait(tasks, timeout=timeout)
  for t in pending:
    t.cancel()
  wall = time.perf_counter() - t0
  if pending:
    errors.append(f"stopped after the {timeout:.0f} s time limit")
  return LoadResult(status, out, latency, wall, errors)


def load_test(url: str, payloads: Sequence[Any], *, concurrency: int = 64,
              timeout: float = 120.0, keep_bodies: bool = True) -> LoadResult:
  """Blocking :func:`run_load` (its own event loop)."""
  return asyncio.run(run_load(url, payloads, concurrency=concurrency, timeout=timeout,
                              keep_bodies=keep_bodies))
