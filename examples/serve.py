"""Serve an exported (folded) model over HTTP: a thin wrapper around ``jaxfold serve``.

The artifact is a file written by ``jaxfold export`` or ``jaxfold.export``: it
holds the whole folded program with its parameters, so the server needs no
model code.  The service itself is :mod:`jaxfold.serving` (uvicorn + starlette,
the ``serve`` extra: ``pip install "jaxfold[serve]"``); this script shows how
to run it from Python.  ``jaxfold serve ARTIFACT`` has more options (batch and
queue limits, warm-up, fold directories).

    jaxfold export --model gpt2-tiny --out /tmp/gpt2-tiny.jaxexport
    python examples/serve.py /tmp/gpt2-tiny.jaxexport --host 127.0.0.1 --port 8000
    curl -s -X POST localhost:8000/predict -d '{"inputs": [[1, 2, 3, 4]]}'

Endpoints:
    POST /predict  {"inputs": [[...]]}        -> {"outputs": [...], "shape": [...]}
                   ({"inputs": [a, b, ...], "multiple": true} for programs with
                   several arguments, e.g. BERT's ids, mask and token types)
    GET  /health   -> {"status": "ok", "inputs": [[shape, dtype], ...], "buckets": {...}}
    GET  /metrics  -> request counts, latency percentiles, compiled bucket programs

Requests are validated against the artifact (token ids in [0, vocab), length
within the position table, integer dtypes): a bad one gets 400, not NaN.
``--port 0`` lets the OS choose a free port; the first line on stdout is always
``listening on http://HOST:PORT``.  SIGTERM finishes the requests in flight and
exits 0.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("artifact", help="file written by `jaxfold export` / jaxfold.export")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8000, help="0: let the OS pick a free port")
  p.add_argument("--max-batch", type=int, default=16, help="rows per batched program call")
  a = p.parse_args(argv)

  import jaxfold
  from jaxfold import serving  # needs the `serve` extra

  try:
    model = serving.load_model(a.artifact, max_batch=a.max_batch)
    for note in model.self_check():      # padding must not change any row's answer
      print(f"serve: {note}", file=sys.stderr)
  except (jaxfold.FoldError, serving.ServeError, OSError) as e:
    print(f"serve: error: {e}", file=sys.stderr)
    return 2
  try:
    return serving.serve(model, a.host, a.port, serving.ServeConfig(max_batch=a.max_batch))
  except OSError as e:
    print(f"serve: error: cannot listen on {a.host}:{a.port}: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
