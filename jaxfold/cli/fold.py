"""jaxfold fold: fold a zoo model (random weights or a checkpoint) and save it."""

from __future__ import annotations

import os
import time

from jaxfold.benchmarking import device_string
from jaxfold.cli import _util as U
from jaxfold.cli._util import CLIError, Step


def add_parser(sub) -> None:
  f = sub.add_parser("fold", help="fold a model and save it")
  f.add_argument("--model", required=True, help="model name (`jaxfold models` lists them)")
  f.add_argument("--checkpoint", help="HF .safetensors file (default: random weights)")
  f.add_argument("--out", help="output directory (default ./folded-NAME)")
  f.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
  f.add_argument("--seed", type=int, default=0, help="seed of the random weights")
  U.fold_options(f)
  U.shape_options(f, 1, None)
  U.sign_key_option(f)
  f.set_defaults(func=run)


def run(args) -> int:
  import jax

  import jaxfold
  from jaxfold import serialization
  spec = U.spec_named(args.model)
  U.check_seq(spec, args.seq)
  out = args.out or f"folded-{args.model.replace('/', '_')}"
  out = os.path.abspath(out)
  try:   # before any work: the same checks save_fold makes again when it commits
    serialization.check_target(out, args.force)
  except FileExistsError as e:
    raise CLIError(f"--out: {_in_cli_words(e)}") from None
  key = U.read_key(args.sign_key)   # before the work: a bad key file fails fast
  params, source = U.params_for(spec, args, args.batch, args.seq)
  apply_fn = spec.apply_fn()
  example = U.example_args(spec, args.batch, args.seq, abstract=True)
  folded, t_fold = U.fold_model(params, apply_fn, example, auxiliary=not args.no_auxiliary,
                         tied=args.tied_weights)
  meta = {
      "model": spec.name, "family": spec.family, "config": U.config_dict(spec.config),
      "weights": source,
      "options": {"auxiliary_centering": not args.no_auxiliary, "tied_weights": args.tied_weights,
                  "batch": args.batch, "seq": args.seq},
      "jax_version": jax.__version__, "jaxfold_version": jaxfold.__version__,
      "device": device_string(), "fold_seconds": t_fold,
      "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
  }
  written: list = []
  with Step(f"saving to {out}"):
    try:
      # The safetensors files go into the same temporary directory, so the
      # whole fold (no stale untied copy) replaces the old one in one rename.
      serialization.save_fold(folded, out, meta=meta, overwrite=args.force, key=key,
                              extra_files=lambda tmp: written.extend(
                                  _save_safetensors(folded, spec, tmp)))
    except FileExistsError as e:
      raise CLIError(f"--out: {_in_cli_words(e)}") from None
  print(folded.report)
  print()
  print(f"saved fold of {spec.name} to {out}" + (" (signed)" if key else ""))
  signed = ["signature.json"] if key else []
  for name in ["params/", "report.json", "meta.json", "fold.json", "manifest.json"] + signed + written:
    print(f"  {os.path.join(out, name)}")
  return 0


def _in_cli_words(e: FileExistsError) -> str:
  """save_fold's refusal naming this command's flag, not the Python argument."""
  return (str(e).replace("overwrite=True (`--force` on the command line)", "--force")
          .replace("overwrite=True", "--force"))


def _save_safetensors(folded, spec, out) -> list:
  try:
    from models.safetensors_io import LAYOUTS, save_safetensors
  except ImportError:
    return []
  if spec.family not in LAYOUTS:
    return []
  params = folded.params.params
  written = []
  if folded.params.extras:   # a fold's extras: its untied centered copies
    import numpy as np
    from safetensors.numpy import save_file

    from jaxfold._src.integrity import default_file_mode
    untied = os.path.join(out, "untied.safetensors")
    save_file({k: np.asarray(v) for k, v in folded.params.extras.items()}, untied,
              metadata={"format": "jaxfold-untied"})
    os.chmod(untied, default_file_mode())   # safetensors creates files 0600
    written.append("untied.safetensors")
  save_safetensors(params, os.path.join(out, "model.safetensors"), spec.family,
                   metadata={"jaxfold": "folded"})
  written.insert(0, "model.safetensors")
  return written
