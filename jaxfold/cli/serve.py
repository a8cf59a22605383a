"""jaxfold serve: an HTTP inference service for an artifact or a saved fold."""

from __future__ import annotations

import os
import sys

from jaxfold.cli import _util as U
from jaxfold.cli._util import CLIError, Step


def add_parser(sub) -> None:
  v = sub.add_parser("serve", help="serve an exported artifact or a saved fold over HTTP",
                     description="POST /predict {\"inputs\": [[...]]}, GET /health, GET /metrics. "
                     "Validates requests against the model, batches concurrent ones into padded "
                     "shape buckets, and on SIGTERM finishes the requests in flight and exits 0.")
  v.add_argument("source", help="artifact from `jaxfold export`, or a fold directory from "
                                "`jaxfold fold`")
  v.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
  v.add_argument("--port", type=int, default=8000, help="0: let the OS pick a free port")
  v.add_argument("--max-batch", type=U.positive("--max-batch"), default=16,
                 help="rows per program call; batch buckets are powers of two up to it")
  v.add_argument("--max-seq", type=U.positive("--max-seq"), default=None,
                 help="longest sequence accepted (default: the model's positions)")
  v.add_argument("--max-queue", type=U.positive("--max-queue"), default=256,
                 help="waiting requests beyond this get 503 Retry-After")
  v.add_argument("--max-body", type=U.positive("--max-body"), default=1 << 20,
                 help="largest request body in bytes (413 beyond)")
  v.add_argument("--max-wait-ms", type=float, default=2.0,
                 help="how long a lone request waits for others to batch with")
  v.add_argument("--drain-timeout", type=float, default=30.0,
                 help="seconds to finish in-flight requests after SIGTERM")
  v.add_argument("--warmup", action="store_true", default=True,
                 help="compile the bucket set before serving (the default)")
  v.add_argument("--no-warmup", dest="warmup", action="store_false",
                 help="compile bucket programs on first use instead (still at most --compile-budget)")
  v.add_argument("--compile-budget", type=U.positive("--compile-budget"), default=64,
                 help="programs compiled in all; shapes beyond them get 503 (default 64)")
  v.add_argument("--vocab", type=U.positive("--vocab"), default=None,
                 help="integer inputs must lie in [0, N) (needed when the program gathers no table "
                      "by an input and the artifact carries no range for it; caps them otherwise)")
  v.add_argument("--header-timeout", type=float, default=10.0,
                 help="seconds a connection may take to send a request head before it is closed")
  v.add_argument("--keep-alive-timeout", type=int, default=5,
                 help="seconds an idle keep-alive connection stays open")
  v.add_argument("--body-timeout", type=float, default=30.0,
                 help="seconds to receive a request body (408 beyond)")
  v.add_argument("--max-connections", type=U.positive("--max-connections"), default=None,
                 help="open connections kept at most; beyond, the oldest idle one is closed "
                      "(default: the descriptor limit minus 128)")
  v.add_argument("--api-key", default=os.environ.get("JAXFOLD_API_KEY"),
                 help="require 'Authorization: Bearer KEY' on /predict and /metrics (default: "
                      "$JAXFOLD_API_KEY)")
  v.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
  v.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
  v.add_argument("--insecure", action="store_true",
                 help="allow a non-loopback --host without --api-key")
  v.add_argument("--verify-key", default=None, metavar="FILE",
                 help="refuse an artifact or fold not signed with the key in FILE "
                      "(export/save with key=...)")
  v.set_defaults(func=run)


def run(args) -> int:
  from jaxfold import serving
  try:
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
  except ImportError as e:
    raise CLIError(f"serve needs the `serve` extra ({e.name} is not installed): "
                   "pip install \"jaxfold[serve]\"") from None
  config = serving.ServeConfig(max_batch=args.max_batch, max_seq=args.max_seq,
                                 max_queue=args.max_queue, max_body=args.max_body,
                                 max_wait_ms=args.max_wait_ms, drain_timeout=args.drain_timeout,
                                 warmup=args.warmup, compile_budget=args.compile_budget,
                                 header_timeout=args.header_timeout,
                                 keep_alive_timeout=args.keep_alive_timeout,
                                 body_timeout=args.body_timeout,
                                 max_connections=args.max_connections, api_key=args.api_key or None,
                                 ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                                 insecure=args.insecure)
  if not config.api_key and not config.insecure and not serving.is_loopback(args.host):
    raise CLIError(f"refusing to serve on {args.host} (not a loopback address) without "
                   "authentication: pass --api-key KEY (ideally with --ssl-certfile/--ssl-keyfile), "
                   "or --insecure to serve anyone who can reach it")
  key = None
  if args.verify_key:
    try:
      with open(args.verify_key, "rb") as f:
        key = f.read().strip()
    except OSError as e:
      raise CLIError(f"cannot read --verify-key {args.verify_key}: {e}") from None
    if not key:
      raise CLIError(f"--verify-key {args.verify_key} is empty")

  def zoo(name):
    spec = U.spec_named(name)
    return spec.apply_fn(), U.serving_meta(spec)

  with Step(f"loading {args.source}"):
    try:
      model = serving.load_model(args.source, zoo_meta=zoo, max_batch=args.max_batch,
                                 max_seq=args.max_seq, vocab=args.vocab, key=key)
    except serving.ServeError as e:
      raise CLIError(str(e)) from None
  with Step("checking that padding leaves answers unchanged"):
    try:
      notes = model.self_check()
    except serving.ServeError as e:
      raise CLIError(str(e)) from None
  for n in model.notes + notes:
    print(f"serve: {n}", file=sys.stderr)
  d = model.describe()
  print(f"serve: inputs {d['inputs']}; batch buckets {d['batch_buckets']}, sequence buckets "
        f"{d['seq_buckets']} (padding: {d['seq_padding'] or 'none'}): at most "
        f"{d['max_programs']} compiled programs", file=sys.stderr)
  if args.warmup:
    with Step(f"compiling the bucket set (at most --compile-budget {args.compile_budget} programs)"):
      model.warmup(args.compile_budget)
      model.seal(0)
    print(f"serve: compiled {len(model.compiled)} programs {model.compiled_buckets()}; other shapes "
          "get 503", file=sys.stderr)
  else:
    model.seal(max(0, args.compile_budget - len(model.compiled)))
  sys.stderr.flush()
  try:
    code = serving.serve(model, args.host, args.port, config)
    if code:
      # A model call abandoned past --drain-timeout may still run on the worker
      # thread; interpreter shutdown under it would abort, so leave at once.
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
    return code
  except serving.ServeError as e:
    raise CLIError(str(e)) from None
  except OSError as e:
    raise CLIError(f"cannot listen on {args.host}:{args.port}: {e}") from None
