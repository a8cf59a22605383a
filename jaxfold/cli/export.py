"""jaxfold export: a serialized, content-hashed jax.export artifact of a fold."""

from __future__ import annotations

import os
import sys

from jaxfold.cli import _util as U
from jaxfold.cli._util import CLIError, Step


def add_parser(sub) -> None:
  e = sub.add_parser("export", help="write a serialized jax.export artifact of a fold")
  e.add_argument("--model", help="model to fold now")
  e.add_argument("--from", dest="from_dir", help="a saved fold directory")
  e.add_argument("--checkpoint", help="HF .safetensors file (with --model)")
  e.add_argument("--out", required=True, help="artifact file to write")
  e.add_argument("--no-symbolic", action="store_true",
                 help="export the example shapes exactly (default: symbolic batch and seq)")
  e.add_argument("--seed", type=int, default=0, help="seed of the random weights")
  e.add_argument("--no-fold", action="store_true",
                 help="export the original (unfolded) model, e.g. as a baseline to compare with")
  U.fold_options(e)
  U.shape_options(e, 1, None)
  U.sign_key_option(e)
  e.set_defaults(func=run)


def run(args) -> int:
  import types
  import warnings

  from jaxfold import exporting as jexport
  from jaxfold import serialization
  if bool(args.model) == bool(args.from_dir):
    raise CLIError("export: give exactly one of --model NAME (fold now) or --from DIR "
                   "(a saved fold from `jaxfold fold`)")
  key = U.read_key(args.sign_key)
  if args.from_dir:
    if args.no_fold:
      raise CLIError("export: --no-fold goes with --model (a saved fold is folded already)")
    meta = serialization.load_meta(args.from_dir) if os.path.isdir(args.from_dir) else None
    if not meta or "model" not in meta:
      raise CLIError(f"--from: {args.from_dir} is not a saved fold made by `jaxfold fold` "
                     "(no meta.json with a model name)")
    spec = U.spec_named(meta["model"])
    U.check_seq(spec, args.seq)
    with Step(f"loading fold from {args.from_dir}"):
      folded = serialization.load_fold(args.from_dir, spec.apply_fn())
  else:
    spec = U.spec_named(args.model)
    U.check_seq(spec, args.seq)
    params, _ = U.params_for(spec, args, args.batch, args.seq)
    if args.no_fold:   # the original model, e.g. as a baseline to serve beside the fold
      folded = types.SimpleNamespace(params=params, apply_fn=spec.apply_fn())
    else:
      folded, _ = U.fold_model(params, spec.apply_fn(), U.example_args(spec, args.batch, args.seq, True),
                        auxiliary=not args.no_auxiliary, tied=args.tied_weights)
  example = U.example_args(spec, args.batch, args.seq)
  symbolic = None if args.no_symbolic else ("batch", "seq")
  meta = {**U.serving_meta(spec), "folded": not args.no_fold}
  if hasattr(getattr(folded, "report", None), "num_folded"):   # fuse_affine/rotate reports differ
    meta["sites_folded"] = [folded.report.num_folded, folded.report.num_sites]
  with Step("exporting (jax.export)"), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", jexport.ExportWarning)
    blob = jexport.export(folded, *example, symbolic=symbolic, meta=meta, key=key)
  for w in caught:
    print(f"warning: {w.message}", file=sys.stderr)
  out = os.path.abspath(args.out)
  if os.path.isdir(out):
    raise CLIError(f"--out: {out} is a directory; give a file name, e.g. {out}/model.jaxexport")
  jexport.write_artifact(out, blob)   # a reader never sees half an artifact
  fn = jexport.load_exported(blob)
  print(f"wrote {out} ({len(blob) / 2**20:.2f} MiB{', signed' if key else ''}); inputs: "
        + ", ".join(f"{d}[{','.join(map(str, s))}]" for s, d in jexport.exported_signature(fn)))
  return 0
