"""jaxfold report: the per-site table (and --diff) of a zoo model or a saved fold."""

from __future__ import annotations

import os

from jaxfold.cli import _util as U
from jaxfold.cli._util import CLIError, Step


def add_parser(sub) -> None:
  r = sub.add_parser("report", help="per-site table (and what changed) for a model or a saved fold")
  r.add_argument("dir", nargs="?", help="a saved fold directory")
  r.add_argument("--model", help="model name (abstract init, nothing allocated; see `jaxfold models`)")
  r.add_argument("--json", action="store_true", help="print the report as JSON (for tools)")
  r.add_argument("--diff", action="store_true",
                 help="also print what changed: reductions removed per site, auxiliary "
                      "centerings, kernels substituted, parameters centered, untied copies")
  r.add_argument("--all", action="store_true", help="one row per site (no grouping of layers)")
  U.fold_options(r)
  U.shape_options(r, 1, None)
  r.set_defaults(func=run)


def _show(report, args) -> None:
  if args.all:
    print(report.table(group=False))
    print(report.summary())
  else:
    print(report)
  if args.diff:
    print()
    print(report.diff())


def run(args) -> int:
  from jaxfold import serialization
  if args.dir and args.model:
    raise CLIError("report: give either a saved fold DIR or --model NAME, not both")
  if not args.dir and not args.model:
    raise CLIError("report: give a saved fold DIR (from `jaxfold fold --out DIR`) or --model NAME "
                   "(`jaxfold models` lists them)")
  if args.dir:
    if not os.path.isdir(args.dir):
      raise CLIError(f"report: {args.dir} is not a directory; pass the --out DIR of `jaxfold fold`, "
                     "or use --model NAME")
    try:
      report = serialization.load_report(args.dir)
    except FileNotFoundError as e:
      raise CLIError(f"report: {e}") from e
    meta = serialization.load_meta(args.dir)
    if args.json:
      print(report.to_json())
      return 0
    if meta:
      print(f"saved fold of {meta.get('model', '?')} ({meta.get('weights', '?')}), "
            f"options {meta.get('options', {})}, jax {meta.get('jax_version', '?')}")
    _show(report, args)
    return 0
  import jaxfold
  spec = U.spec_named(args.model)
  U.check_seq(spec, args.seq)
  apply_fn = spec.apply_fn()
  with Step(f"abstract init of {spec.name} (no weights allocated)"):
    params = (spec.abstract_init(args.batch, args.seq) if args.seq is not None
              else spec.abstract_init(args.batch))
  example = U.example_args(spec, args.batch, args.seq, abstract=True)
  with Step("analysing") as st:
    folded = jaxfold.fold(params, apply_fn, *example, auxiliary_centering=not args.no_auxiliary,
                          tied_weights=args.tied_weights)
  if args.json:
    print(folded.report.to_json())
    return 0
  print(f"{spec.name}: analysis took {1e3 * st.elapsed:.0f} ms")
  _show(folded.report, args)
  return 0
