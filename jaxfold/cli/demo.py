"""jaxfold demo: fold a built-in pre-LN transformer, print the report, the error and the speed ratio."""

from __future__ import annotations

from jaxfold.benchmarking import compare_forward, device_string
from jaxfold.cli import _util as U
from jaxfold.cli._util import Step


def add_parser(sub) -> None:
  d = sub.add_parser("demo", help="fold a built-in pre-LN transformer and measure it")
  d.add_argument("--tiny", action="store_true", help="use the tiny zoo model (fast; for tests)")
  d.add_argument("--batch", type=U.positive("--batch"), default=4, help="batch size")
  d.add_argument("--seq", type=U.positive("--seq"), default=128, help="sequence length")
  d.add_argument("--rounds", type=U.positive("--rounds"), default=15, help="interleaved timing rounds")
  d.add_argument("--seed", type=int, default=0, help="seed of the random weights")
  U.fold_options(d)
  d.set_defaults(func=run)


def run(args) -> int:
  spec = U.demo_spec("tiny" if args.tiny else "small")
  batch, seq = args.batch, args.seq
  U.check_seq(spec, seq)
  print(f"jaxfold demo: {spec.name} ({U.describe(spec)}), batch {batch} x seq {seq}, "
        f"on {device_string()}")
  params = U.random_params(spec, batch, seq, args.seed)
  apply_fn = spec.apply_fn()
  example = U.example_args(spec, batch, seq)
  folded, t_fold = U.fold_model(params, apply_fn, example, auxiliary=not args.no_auxiliary,
                         tied=args.tied_weights)
  print()
  print(folded.report)
  print()
  print(folded.report.diff())
  print()
  jitted = U.jit_pair(apply_fn, folded)
  orig, fold_fn = jitted
  with Step("checking outputs (jit)"):
    errs = []
    for b, s in [(batch, seq), (max(1, batch // 2 + 1), max(2, seq // 2 + 1))]:
      a = U.example_args(spec, b, s)
      errs.append(((b, s), U.max_rel_err(orig(params, *a), fold_fn(folded.params, *a))))
  print(f"fold time: {1e3 * t_fold:.0f} ms")
  for (b, s), e in errs:
    print(f"max relative error vs original at batch {b} x seq {s}: {e:.2e}")
  with Step(f"timing forward ({args.rounds} interleaved rounds)"):
    s = compare_forward(apply_fn, params, folded, example, rounds=args.rounds, jitted=jitted)
  U.print_timing(s)
  U.print_gpu_context()
  return 0
