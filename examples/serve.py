"""A small HTTP inference service for an exported (folded) model.

The artifact is a file written by ``jaxfold export`` or ``jaxfold.export``:
it holds the whole folded program with its parameters, so this server needs
neither the model's code nor jaxfold — only jax.

    jaxfold export --model gpt2-tiny --out /tmp/gpt2-tiny.jaxexport
    python examples/serve.py /tmp/gpt2-tiny.jaxexport --host 127.0.0.1 --port 8000
    curl -s -X POST localhost:8000/predict -d '{"inputs": [[1, 2, 3, 4]]}'

Endpoints:
    POST /predict  {"inputs": [[...]]}        -> {"outputs": [...], "shape": [...]}
                   ({"inputs": [a, b, ...]} with {"multiple": true} for programs with
                   several arguments, e.g. BERT's ids, mask and token types)
    GET  /health   -> {"status": "ok", "inputs": [[shape, dtype], ...]}

``--port 0`` lets the OS choose a free port; the first line on stdout is always
``listening on http://HOST:PORT``.
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

MAX_BODY = 64 * 2**20


def _signature(fn):
  return [([d if isinstance(d, int) else str(d) for d in a.shape], str(a.dtype))
          for a in fn.in_avals]


def _to_args(payload, fn):
  """JSON payload -> positional numpy arguments with the artifact's dtypes."""
  if not isinstance(payload, dict) or "inputs" not in payload:
    raise ValueError('expected a JSON object {"inputs": [[...]]}')
  avals = fn.in_avals
  raw = payload["inputs"]
  if payload.get("multiple") or len(avals) > 1:
    if not isinstance(raw, list) or len(raw) != len(avals):
      raise ValueError(f"this program takes {len(avals)} arguments: send "
                       f'{{"inputs": [arg0, ..., arg{len(avals) - 1}], "multiple": true}}')
    raws = raw
  else:
    raws = [raw]
  args = []
  for i, (x, aval) in enumerate(zip(raws, avals)):
    try:
      arr = np.asarray(x, dtype=np.dtype(aval.dtype))
    except (TypeError, ValueError) as e:
      raise ValueError(f"input {i}: cannot convert to {aval.dtype}: {e}") from None
    if arr.ndim != len(aval.shape):
      raise ValueError(f"input {i}: expected rank {len(aval.shape)} (shape "
                       f"{[str(d) for d in aval.shape]}), got shape {list(arr.shape)}")
    for k, d in enumerate(aval.shape):
      if isinstance(d, int) and arr.shape[k] != d:
        raise ValueError(f"input {i}: axis {k} must have size {d}, got shape {list(arr.shape)}")
    args.append(arr)
  return args


def make_handler(fn):
  import jax

  class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # keep the server quiet; one line per request
      sys.stderr.write("serve: " + (fmt % args) + "\n")

    def _send(self, code, obj):
      body = json.dumps(obj).encode()
      self.send_response(code)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def do_GET(self):
      if self.path.rstrip("/") == "/health":
        self._send(200, {"status": "ok", "inputs": _signature(fn)})
      else:
        self._send(404, {"error": f"no such endpoint {self.path}; use POST /predict or GET /health"})

    def do_POST(self):
      if self.path.rstrip("/") != "/predict":
        self._send(404, {"error": f"no such endpoint {self.path}; use POST /predict"})
        return
      try:
        n = int(self.headers.get("Content-Length", "0"))
      except ValueError:
        n = -1
      if n <= 0 or n > MAX_BODY:
        self._send(400, {"error": f"need a JSON body of 1..{MAX_BODY} bytes (Content-Length)"})
        return
      try:
        payload = json.loads(self.rfile.read(n))
        args = _to_args(payload, fn)
      except (ValueError, json.JSONDecodeError) as e:
        self._send(400, {"error": str(e)})
        return
      try:
        out = fn(*args)    # jitted; jax is thread-safe (one compile per new shape)
        out = jax.tree_util.tree_map(np.asarray, out)
      except Exception as e:  # noqa: BLE001 - report, keep serving
        self._send(400, {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
        return
      leaves = jax.tree_util.tree_leaves(out)
      if len(leaves) == 1:
        self._send(200, {"outputs": leaves[0].tolist(), "shape": list(leaves[0].shape)})
      else:
        self._send(200, {"outputs": [x.tolist() for x in leaves],
                         "shape": [list(x.shape) for x in leaves]})

  return Handler


def serve(artifact: str, host: str = "127.0.0.1", port: int = 0):
  """Loads ``artifact`` and returns a started-not-yet-serving ThreadingHTTPServer."""
  from jaxfold._src.export import load_exported  # tiny; only jax.export underneath

  with open(artifact, "rb") as f:
    fn = load_exported(f.read())
  server = ThreadingHTTPServer((host, port), make_handler(fn))
  server.daemon_threads = True
  return server


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("artifact", help="file written by `jaxfold export` / jaxfold.export")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8000, help="0: let the OS pick a free port")
  a = p.parse_args(argv)
  try:
    server = serve(a.artifact, a.host, a.port)
  except FileNotFoundError:
    print(f"serve: error: artifact {a.artifact} does not exist; write one with "
          "`jaxfold export --model NAME --out FILE`", file=sys.stderr)
    return 2
  except OSError as e:
    print(f"serve: error: cannot listen on {a.host}:{a.port}: {e}", file=sys.stderr)
    return 2
  host, port = server.server_address[:2]
  print(f"listening on http://{host}:{port}", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
