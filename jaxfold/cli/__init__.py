"""The ``jaxfold`` command line: one module per command.

Commands::

    jaxfold demo                          fold a built-in pre-LN transformer (random, honest
                                          γ/β), print the report, the error and the speed ratio
    jaxfold models                        the model zoo's names, families and sizes
    jaxfold fold --model NAME [--checkpoint model.safetensors] [--out DIR] ...
                                          fold a model and save it (orbax + safetensors + JSON)
    jaxfold report --model NAME | DIR [--diff] [--json]
                                          the per-site table, what changed (abstract init: no weights)
    jaxfold bench --model NAME --batch B --seq S
                                          folded vs original forward time (jit, interleaved)
    jaxfold export (--model NAME | --from DIR) --out FILE
                                          a serialized, content-hashed jax.export artifact
    jaxfold serve ARTIFACT_OR_FOLD_DIR [--host 127.0.0.1] [--port 8000]
                                          an HTTP inference service (needs the `serve` extra)

Errors in the arguments print what is wrong and how to fix it, and exit with status 2.
``--debug`` (before the command) shows tracebacks.

Example:
    >>> from jaxfold.cli import main
    >>> main(["report", "--model", "gpt2-tiny", "--diff"])   # prints; returns the exit status
    0
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from jaxfold.cli import bench, demo, export, fold, report, serve
from jaxfold.cli import models as models_cmd
from jaxfold.cli._util import CLIError, DefaultsHelpFormatter, Step

__all__ = ["main", "build_parser", "CLIError"]

COMMANDS = (demo, models_cmd, fold, report, bench, export, serve)


def build_parser() -> argparse.ArgumentParser:
  """The argument parser of every command."""
  p = argparse.ArgumentParser(prog="jaxfold", description="Fold LayerNorm into RMSNorm, exactly.")
  p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
  p.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
  sub = p.add_subparsers(dest="command", metavar="COMMAND")
  for cmd in COMMANDS:
    cmd.add_parser(sub)
  for command_parser in sub.choices.values():
    command_parser.formatter_class = DefaultsHelpFormatter
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Entry point of the ``jaxfold`` console script; returns the exit status."""
  parser = build_parser()
  args = parser.parse_args(argv)
  if not getattr(args, "func", None):
    parser.print_help(sys.stderr)
    return 2
  Step.quiet = bool(args.quiet)
  if getattr(args, "model", None) == "?":   # the old way to list the zoo
    return models_cmd.run(args)
  try:
    return int(args.func(args) or 0)
  except CLIError as e:
    print(f"jaxfold {args.command}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130
  except Exception as e:  # noqa: BLE001
    if args.debug:
      raise
    from jaxfold import IntegrityError, JaxfoldError
    msg = str(e).strip() or type(e).__name__
    if isinstance(e, (JaxfoldError, IntegrityError, FileNotFoundError, FileExistsError,
                      NotADirectoryError, IsADirectoryError)):
      if isinstance(e, OSError) and e.filename and e.strerror and e.filename not in msg:
        msg = f"{e.filename}: {e.strerror}"
      elif isinstance(e, OSError) and e.strerror and len(e.args) >= 2:
        msg = e.strerror
      print(f"jaxfold {args.command}: error: {msg}", file=sys.stderr)
      return 2
    print(f"jaxfold {args.command}: internal error: {type(e).__name__}: {msg}\n"
          "(rerun with `jaxfold --debug ...` for the traceback)", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
