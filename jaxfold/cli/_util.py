"""What the ``jaxfold`` commands share: argument errors, progress on stderr,
model-zoo access, checkpoint loading and argument types."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import threading
import time
from typing import Any, Optional

from jaxfold import benchmarking


class CLIError(Exception):
  """A problem with the command's arguments; the message says how to fix it."""


class Step(contextlib.AbstractContextManager):
  """``with Step("tracing"):`` prints ``tracing ... done (1.2 s)`` on stderr,
  with a spinner while it runs when stderr is a terminal."""

  quiet = False

  def __init__(self, msg: str):
    self.msg = msg
    self._stop = threading.Event()
    self._thread = None

  def __enter__(self):
    self.t0 = time.perf_counter()
    if self.quiet:
      return self
    err = sys.stderr
    if err.isatty():
      def spin():
        chars = "|/-\\"
        i = 0
        while not self._stop.wait(0.12):
          err.write(f"\r{self.msg} ... {chars[i % 4]} {time.perf_counter() - self.t0:5.1f} s")
          err.flush()
          i += 1
      err.write(f"{self.msg} ...")
      err.flush()
      self._thread = threading.Thread(target=spin, daemon=True)
      self._thread.start()
    else:
      err.write(f"{self.msg} ...")
      err.flush()
    return self

  def __exit__(self, exc_type, exc, tb):
    self.elapsed = time.perf_counter() - self.t0
    if self.quiet:
      return False
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      sys.stderr.write(f"\r{self.msg} ... ")
    else:
      sys.stderr.write(" ")
    sys.stderr.write(("failed" if exc_type else "done") + f" ({self.elapsed:.2f} s)   \n")
    sys.stderr.flush()
    return False


def zoo():
  try:
    import models
  except Exception as e:  # noqa: BLE001
    raise CLIError(f"the model zoo (`models` package) cannot be imported ({type(e).__name__}: {e}); "
                   "install jaxfold from its source tree (pip install -e .)") from e
  hint = shadowed_zoo(models)
  if hint:
    raise CLIError(hint)
  return models


def shadowed_zoo(module: Any) -> Optional[str]:
  """What to do when ``import models`` found another module than jaxfold's
  model zoo (a user's own models.py in the working directory shadows it), or None."""
  if callable(getattr(module, "get", None)) and callable(getattr(module, "names", None)):
    return None
  found = getattr(module, "__file__", None) or getattr(module, "__path__", None) or repr(module)
  import jaxfold
  zoo_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(jaxfold.__file__))), "models")
  where = f" (jaxfold's zoo is {zoo_dir})" if os.path.isdir(zoo_dir) else ""
  return (f"`import models` found {found}, which is not jaxfold's model zoo{where}: a models.py or "
          "models/ of your own in the working directory (or earlier on sys.path) shadows it. Rename "
          "yours, or run jaxfold from another directory.")


def spec_named(name: str):
  models = zoo()
  names = models.names()
  if name not in names and name not in getattr(models, "ALIASES", {}):
    import difflib
    close = difflib.get_close_matches(name, names, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise CLIError(f"--model: unknown model {name!r}.{hint} Valid names: {', '.join(names)}")
  return models.get(name)


def demo_spec(size: str = "small"):
  """The demo's built-in pre-LN transformer, from the zoo: ``gpt2-256x4``, a
  GPT-2 shaped model (d=256, 4 layers, vocab 2048; formerly called
  demo-gpt2-small), or ``gpt2-tiny`` for ``tiny``."""
  return spec_named("gpt2-tiny" if size == "tiny" else "gpt2-256x4")


def example_args(spec, batch: int, seq: Optional[int], abstract: bool = False):
  if seq is None:
    return spec.example_inputs(batch, abstract=abstract)
  return spec.example_inputs(batch, seq, abstract=abstract)


def config_dict(cfg: Any) -> Any:
  if dataclasses.is_dataclass(cfg):
    out = {}
    for f in dataclasses.fields(cfg):
      v = getattr(cfg, f.name)
      out[f.name] = v if isinstance(v, (int, float, str, bool, type(None))) else (
          list(v) if isinstance(v, tuple) else getattr(v, "__name__", str(v)))
    return out
  return str(cfg)


def random_params(spec, batch, seq, seed: int):
  with Step(f"initializing {spec.name} (random weights, randomized norms, seed {seed})"):
    return zoo().random_params(spec, batch, seq, seed)


def load_checkpoint(spec, path: str, batch, seq):
  import jax
  import numpy as np
  if not os.path.exists(path):
    raise CLIError(f"--checkpoint: {path} does not exist; pass the path of a .safetensors file "
                   "(e.g. .../model.safetensors) or leave --checkpoint out for random weights")
  try:
    from models.safetensors_io import LAYOUTS, load_safetensors
  except ImportError as e:
    raise CLIError(f"--checkpoint: models.safetensors_io is not available ({e})") from e
  if spec.family not in LAYOUTS:
    raise CLIError(f"--checkpoint: loading checkpoints is supported for the families "
                   f"{', '.join(sorted(LAYOUTS))}, not {spec.family!r} ({spec.name}); "
                   "leave --checkpoint out for random weights")
  with Step(f"loading {path}"):
    try:
      params = load_safetensors(path, spec.family)
    except Exception as e:  # noqa: BLE001
      raise CLIError(f"--checkpoint: cannot read {path} as a {spec.family} checkpoint: "
                     f"{type(e).__name__}: {e}") from e
  want = spec.abstract_init(batch, seq) if seq is not None else spec.abstract_init(batch)
  want_l = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(want)[0]}
  got_l = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  missing = sorted(set(want_l) - set(got_l))
  extra = sorted(set(got_l) - set(want_l))
  bad = [k for k in set(want_l) & set(got_l) if tuple(want_l[k].shape) != tuple(np.shape(got_l[k]))]
  if missing or extra or bad:
    parts = []
    if missing:
      parts.append(f"missing {len(missing)} (e.g. {missing[0]})")
    if extra:
      parts.append(f"unexpected {len(extra)} (e.g. {extra[0]})")
    if bad:
      k = sorted(bad)[0]
      parts.append(f"{len(bad)} with other shapes (e.g. {k}: file {tuple(np.shape(got_l[k]))}, "
                   f"model {tuple(want_l[k].shape)})")
    raise CLIError(f"--checkpoint: {path} does not match --model {spec.name}: "
                   + "; ".join(parts) + ". Pick the --model whose config matches the checkpoint.")
  return params


def params_for(spec, args, batch, seq):
  if args.checkpoint:
    return load_checkpoint(spec, args.checkpoint, batch, seq), f"checkpoint {os.path.abspath(args.checkpoint)}"
  return random_params(spec, batch, seq, args.seed), f"random (seed {args.seed}, randomized norms)"


def fold_model(params, apply_fn, example, *, auxiliary: bool, tied: str):
  import jaxfold
  with Step("folding (trace + analysis + parameter transform)") as st:
    folded = jaxfold.fold(params, apply_fn, *example, auxiliary_centering=auxiliary,
                          tied_weights=tied)
  return folded, st.elapsed


def max_rel_err(a: Any, b: Any, what: str = "outputs") -> float:
  """:func:`jaxfold.benchmarking.max_rel_err`, non-finite outputs as a :class:`CLIError`."""
  try:
    return benchmarking.max_rel_err(a, b, what)
  except benchmarking.NonFiniteError as e:
    raise CLIError(str(e)) from None


def serving_meta(spec) -> dict:
  return zoo().serving_meta(spec)


def check_seq(spec, seq: Optional[int]) -> None:
  limit = zoo().max_positions(spec)
  if seq is not None and limit is not None and seq > limit:
    raise CLIError(f"--seq {seq} is longer than {spec.name}'s {limit} positions (its position "
                   f"table has {limit} rows): use --seq {limit} or less")


def print_timing(s: dict, out=None) -> None:
  out = out or sys.stdout
  med = s["median_ms"]
  r = s["ratio"]["folded"]
  lo, hi = s["ratio_ci"]["folded"]
  aa_lo, aa_hi = s["ratio_ci"]["original A/A"]
  print(f"forward time (jit, interleaved, median of {s['rounds']} rounds x {s['number']} calls): "
        f"original {med['original']:.4g} ms, folded {med['folded']:.4g} ms", file=out)
  print(f"folded/original = {med['folded']:.4g} / {med['original']:.4g} = {r:.3f} "
        f"(95% bootstrap CI {lo:.3f}-{hi:.3f}); A/A (original vs itself): "
        f"{s['ratio']['original A/A']:.3f} (CI {aa_lo:.3f}-{aa_hi:.3f})", file=out)
  v = s["verdict"]["folded"]
  if v == "not resolved":
    print("  -> not resolved: the interval contains 1 (no difference measurable on this device)", file=out)
  else:
    print(f"  -> folded is {v} (the interval excludes 1)", file=out)


def print_gpu_context(out=None) -> None:
  """What this run's timing can show, and the project's modelled GPU figure beside it."""
  import jax
  out = out or sys.stdout
  if jax.default_backend() == "cpu":
    print("  on a CPU this ratio is expected near 1: the norms are a negligible share of the time "
          "(the matrix products dominate), and what folding saves (a reduction pass per norm, "
          "memory traffic) is a GPU effect that a CPU run cannot show", file=out)
  print(f"  {benchmarking.modelled_gpu().line()}", file=out)


def describe(spec) -> str:
  c = spec.config
  bits = []
  for k in ("n_embd", "hidden_size", "d_model", "n_layer", "num_hidden_layers", "encoder_layers",
            "vocab_size"):
    if hasattr(c, k):
      bits.append(f"{k}={getattr(c, k)}")
  return ", ".join(bits) or spec.family


def jit_pair(apply_fn, folded):
  import jax
  return (jax.jit(lambda p, *a: apply_fn(p, *a)), jax.jit(lambda p, *a: folded.apply_fn(p, *a)))


class DefaultsHelpFormatter(argparse.HelpFormatter):
  """Adds ``(default: X)`` to every option's help that does not already say its default."""

  def _get_help_string(self, action) -> str:
    text = action.help or ""
    if (not action.option_strings or "default" in text
        or action.default in (None, False, argparse.SUPPRESS)):
      return text
    return f"{text} (default: %(default)s)"


def positive(name):
  def conv(s):
    try:
      v = int(s)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {s!r}") from None
    if v < 1:
      raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {v}")
    return v
  return conv


def fold_options(p):
  p.add_argument("--no-auxiliary", action="store_true",
                 help="never insert an auxiliary centering (the folded program has no op the "
                      "original lacks)")
  p.add_argument("--tied-weights", choices=("copy", "auxiliary", "auto"), default="auto",
                 help="tied weights (e.g. embedding = LM head): centered copy, auxiliary "
                      "centering, or auto (default)")


def shape_options(p, batch=2, seq=16, fit: bool = False):
  """``fit=True``: ``--seq`` defaults to None and :func:`fit_seq` picks ``seq``
  or the model's position count if that is shorter."""
  p.add_argument("--batch", type=positive("--batch"), default=batch, help="batch size")
  note = f"{seq}, or the model's position count if shorter" if fit else f"{seq}"
  p.add_argument("--seq", type=positive("--seq"), default=None if fit else seq,
                 help=f"sequence length; image side for vision models (default: {note})")


def fit_seq(spec, seq: Optional[int], default: int) -> int:
  """``seq`` if given (checked against the positions), else ``default`` capped
  at the model's position table, so a command's own default is always valid."""
  if seq is not None:
    check_seq(spec, seq)
    return seq
  limit = zoo().max_positions(spec)
  if limit is not None and limit < default:
    print(f"--seq: {spec.name} has {limit} positions, using --seq {limit}", file=sys.stderr)
    return limit
  return default


def sign_key_option(p) -> None:
  p.add_argument("--sign-key", default=None, metavar="FILE",
                 help="sign the output with the key in FILE (HMAC-SHA256); loads and `jaxfold serve` "
                      "with --verify-key FILE then refuse anything unsigned or modified")


def read_key(path: Optional[str], flag: str = "--sign-key") -> Optional[bytes]:
  """The key in the file ``path`` (surrounding whitespace stripped), or None."""
  if not path:
    return None
  try:
    with open(path, "rb") as f:
      key = f.read().strip()
  except OSError as e:
    raise CLIError(f"cannot read {flag} {path}: {e}") from None
  if not key:
    raise CLIError(f"{flag} {path} is empty")
  return key
