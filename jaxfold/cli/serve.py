"""jaxfold serve: an HTTP inference service for an artifact or a saved fold."""

from __future__ import annotations

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
  v.add_argument("--warmup", action="store_true", help="compile every bucket before serving")
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
                                 warmup=args.warmup)

  def zoo(name):
    spec = U.spec_named(name)
    return spec.apply_fn(), U.serving_meta(spec)

  with Step(f"loading {args.source}"):
    try:
      model = serving.load_model(args.source, zoo_meta=zoo, max_batch=args.max_batch,
                                     max_seq=args.max_seq)
    except serving.ServeError as e:
      raise CLIError(str(e)) from None
  with Step("checking that padding leaves answers unchanged"):
    try:
      notes = model.self_check()
    except serving.ServeError as e:
      raise CLIError(str(e)) from None
  for n in notes:
    print(f"serve: {n}", file=sys.stderr)
  d = model.describe()
  print(f"serve: inputs {d['inputs']}; batch buckets {d['batch_buckets']}, sequence buckets "
        f"{d['seq_buckets']} (padding: {d['seq_padding'] or 'none'}): at most "
        f"{d['max_programs']} compiled programs", file=sys.stderr)
  if args.warmup:
    with Step("compiling every bucket (--warmup)"):
      shapes = model.warmup()
    print(f"serve: compiled {len(shapes)} programs {shapes}", file=sys.stderr)
  sys.stderr.flush()
  try:
    return serving.serve(model, args.host, args.port, config)
  except OSError as e:
    raise CLIError(f"cannot listen on {args.host}:{args.port}: {e}") from None
