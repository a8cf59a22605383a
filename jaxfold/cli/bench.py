"""jaxfold bench: folded vs original forward time, interleaved."""

from __future__ import annotations

import json

from jaxfold.benchmarking import compare_forward, device_string
from jaxfold.cli import _util as U
from jaxfold.cli._util import Step


def add_parser(sub) -> None:
  b = sub.add_parser("bench", help="folded vs original forward time")
  b.add_argument("--model", required=True, help="model name (`jaxfold models` lists them)")
  b.add_argument("--checkpoint", help="HF .safetensors file (default: random weights)")
  b.add_argument("--rounds", type=U.positive("--rounds"), default=9, help="interleaved timing rounds")
  b.add_argument("--warmup", type=U.positive("--warmup"), default=2,
                 help="untimed calls per variant first (compilation)")
  b.add_argument("--seed", type=int, default=0, help="seed of the random weights")
  b.add_argument("--json", action="store_true", help="also print the numbers as one JSON line")
  U.fold_options(b)
  U.shape_options(b, 2, 64, fit=True)
  b.set_defaults(func=run)


def run(args) -> int:
  spec = U.spec_named(args.model)
  args.seq = U.fit_seq(spec, args.seq, 64)
  print(f"jaxfold bench: {spec.name}, batch {args.batch} x seq {args.seq}, on {device_string()}")
  params, source = U.params_for(spec, args, args.batch, args.seq)
  apply_fn = spec.apply_fn()
  example = U.example_args(spec, args.batch, args.seq)
  folded, t_fold = U.fold_model(params, apply_fn, example, auxiliary=not args.no_auxiliary,
                         tied=args.tied_weights)
  print(f"{folded.report.num_folded}/{folded.report.num_sites} sites folded, "
        f"{folded.report.num_auxiliary} auxiliary; fold time {1e3 * t_fold:.0f} ms; weights: {source}")
  jitted = U.jit_pair(apply_fn, folded)
  with Step("checking outputs (jit)"):
    err = U.max_rel_err(jitted[0](params, *example), jitted[1](folded.params, *example))
  print(f"max relative error vs original: {err:.2e}")
  with Step(f"timing forward ({args.rounds} interleaved rounds)"):
    s = compare_forward(apply_fn, params, folded, example, rounds=args.rounds, warmup=args.warmup,
                        jitted=jitted)
  U.print_timing(s)
  U.print_gpu_context()
  if args.json:
    print(json.dumps({"model": spec.name, "batch": args.batch, "seq": args.seq,
                      "device": device_string(), "fold_ms": 1e3 * t_fold, "max_rel_err": err,
                      **s}, default=str))
  return 0
