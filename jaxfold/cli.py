"""The ``jaxfold`` command line.

Subcommands::

    jaxfold demo                          fold a built-in pre-LN transformer (random, honest
                                          γ/β), print the report, the error and the speed ratio
    jaxfold fold --model NAME [--checkpoint model.safetensors] [--out DIR] ...
                                          fold a model and save it (orbax + safetensors + JSON)
    jaxfold report --model NAME | DIR     the per-site table (abstract init: no weights)
    jaxfold bench --model NAME --batch B --seq S
                                          folded vs original forward time (jit, interleaved)
    jaxfold export (--model NAME | --from DIR) --out FILE
                                          a serialized, content-hashed jax.export artifact
    jaxfold serve ARTIFACT_OR_FOLD_DIR [--host 127.0.0.1] [--port 8000]
                                          an HTTP inference service (needs the `serve` extra)

Errors in the arguments print what is wrong and how to fix it, and exit with status 2.
``--debug`` (before the subcommand) shows tracebacks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

__all__ = ["main", "time_variants", "summarize_timings", "device_string", "CLIError",
           "demo_spec", "random_params", "compare_forward", "max_rel_err", "check_finite",
           "model_meta", "max_positions"]


class CLIError(Exception):
  """A problem with the command's arguments; the message says how to fix it."""


# ----------------------------------------------------------------------------
# Progress on stderr.


class _Step(contextlib.AbstractContextManager):
  """``with _Step("tracing"):`` prints ``tracing ... done (1.2 s)`` on stderr,
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


# ----------------------------------------------------------------------------
# Timing: interleaved, rotated, median, with an A/A noise figure.


def device_string() -> str:
  """E.g. ``'cpu: cpu (2 cores), jax 0.10.2'`` or ``'gpu: NVIDIA H100 80GB HBM3, jax 0.11.0'``."""
  import jax
  d = jax.devices()[0]
  kind = getattr(d, "device_kind", "") or d.platform
  extra = f" ({os.cpu_count()} cores)" if d.platform == "cpu" else ""
  return f"{d.platform}: {kind}{extra}, jax {jax.__version__}"


def _block(x):
  import jax
  return jax.block_until_ready(x)


def time_variants(thunks: dict, *, rounds: int = 9, warmup: int = 2,
                  min_seconds: float = 0.02, progress: Optional[Callable[[int], None]] = None) -> dict:
  """Times zero-argument callables interleaved, rotating their order each round.

  Each thunk is called ``warmup`` times first (compilation), then calibrated to
  ``number`` calls per measurement so one measurement lasts ≥ ``min_seconds``.
  Returns ``{name: [seconds per call, one per round]}`` and the key
  ``"_number"``.
  """
  names = list(thunks)
  for _ in range(max(warmup, 1)):
    for n in names:
      _block(thunks[n]())
  single = {}
  for n in names:
    t0 = time.perf_counter()
    _block(thunks[n]())
    single[n] = time.perf_counter() - t0
  number = max(1, int(math.ceil(min_seconds / max(min(single.values()), 1e-9))))
  number = min(number, 1000)
  times = {n: [] for n in names}
  for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for n in order:
      fn = thunks[n]
      t0 = time.perf_counter()
      for _ in range(number):
        out = fn()
      _block(out)
      times[n].append((time.perf_counter() - t0) / number)
    if progress:
      progress(r)
  times["_number"] = number
  return times


def summarize_timings(times: dict, base: str, others: Sequence[str]) -> dict:
  """Median time per variant and the median of per-round ratios ``other/base``.

  Returns ``{"median_ms": {...}, "ratio": {other: r}, "ratio_iqr": {other: (q1, q3)}}``.
  """
  out = {"median_ms": {n: 1e3 * statistics.median(v) for n, v in times.items()
                       if not n.startswith("_")},
         "ratio": {}, "ratio_iqr": {}, "rounds": len(times[base]),
         "number": times.get("_number", 1)}
  for o in others:
    rs = sorted(a / b for a, b in zip(times[o], times[base]))
    out["ratio"][o] = statistics.median(rs)
    q = statistics.quantiles(rs, n=4) if len(rs) >= 2 else [rs[0], rs[0], rs[0]]
    out["ratio_iqr"][o] = (q[0], q[2])
  return out


def compare_forward(apply_fn, params, folded, args, *, rounds: int = 9, warmup: int = 2,
                    progress=None, jitted: Optional[tuple] = None) -> dict:
  """Jitted original vs folded forward on ``args``, interleaved.  A third
  variant runs the original executable again ("A/A"): its ratio to the
  original is the noise figure.  ``jitted=(orig, folded)`` reuses compiled
  functions.  Returns :func:`summarize_timings` plus ``"aa_noise"``."""
  orig, fold_fn = jitted or _jit_pair(apply_fn, folded)
  fp = folded.params
  thunks = {"original": lambda: orig(params, *args),
            "folded": lambda: fold_fn(fp, *args),
            "original A/A": lambda: orig(params, *args)}
  times = time_variants(thunks, rounds=rounds, warmup=warmup, progress=progress)
  s = summarize_timings(times, "original", ["folded", "original A/A"])
  s["aa_noise"] = abs(s["ratio"]["original A/A"] - 1.0)
  return s


def _jit_pair(apply_fn, folded):
  import jax
  return (jax.jit(lambda p, *a: apply_fn(p, *a)), jax.jit(lambda p, *a: folded.apply_fn(p, *a)))


# ----------------------------------------------------------------------------
# Models.


def _models():
  try:
    import models
  except Exception as e:  # noqa: BLE001
    raise CLIError(f"the model zoo (`models` package) cannot be imported ({type(e).__name__}: {e}); "
                   "install jaxfold from its source tree (pip install -e .)") from e
  return models


def _spec(name: str):
  models = _models()
  names = models.names()
  if name not in names:
    import difflib
    close = difflib.get_close_matches(name, names, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise CLIError(f"--model: unknown model {name!r}.{hint} Valid names: {', '.join(names)}")
  return models.get(name)


def demo_spec(size: str = "small"):
  """The demo's built-in pre-LN transformer: a GPT-2 shaped model
  (``small``: d=256, 4 layers, vocab 2048; ``tiny``: the zoo's gpt2-tiny)."""
  models = _models()
  base = models.get("gpt2-tiny")
  if size == "tiny":
    return base
  cfg = dataclasses.replace(base.config, vocab_size=2048, n_positions=256, n_embd=256,
                            n_layer=4, n_head=4)
  return dataclasses.replace(base, name="demo-gpt2-small", config=cfg)


def _example_args(spec, batch: int, seq: Optional[int], abstract: bool = False):
  if seq is None:
    return spec.example_inputs(batch, abstract=abstract)
  return spec.example_inputs(batch, seq, abstract=abstract)


def _config_dict(cfg: Any) -> Any:
  if dataclasses.is_dataclass(cfg):
    out = {}
    for f in dataclasses.fields(cfg):
      v = getattr(cfg, f.name)
      out[f.name] = v if isinstance(v, (int, float, str, bool, type(None))) else (
          list(v) if isinstance(v, tuple) else getattr(v, "__name__", str(v)))
    return out
  return str(cfg)


def random_params(spec, batch: int = 1, seq: Optional[int] = None, seed: int = 0):
  """Random weights with non-trivial norms for a ``models`` spec, drawn with
  numpy from its abstract init (no init program to trace or compile):
  kernels/tables N(0, 0.02²); 1-D leaves (norm scales/biases, biases)
  ``base + 0.5·(N(0,1) + c)`` with a per-leaf offset c ∈ [-1, 1], base 1 for
  a leaf named ``scale`` else 0, so γ is non-uniform and β has a non-zero
  mean (like ``models.randomize_norms``)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  shapes = spec.abstract_init(batch, seq) if seq is not None else spec.abstract_init(batch)
  rng = np.random.default_rng(seed)

  def draw(path, sds):
    dtype = jnp.dtype(sds.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
      return jnp.zeros(sds.shape, dtype)
    if len(sds.shape) <= 1:
      last = getattr(path[-1], "key", getattr(path[-1], "name", "")) if path else ""
      base = 1.0 if last == "scale" else 0.0
      x = base + 0.5 * (rng.standard_normal(sds.shape) + rng.uniform(-1, 1))
    else:
      x = 0.02 * rng.standard_normal(sds.shape, dtype=np.float32)
    return jnp.asarray(x, dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _random_params(spec, batch, seq, seed: int):
  with _Step(f"initializing {spec.name} (random weights, randomized norms, seed {seed})"):
    return random_params(spec, batch, seq, seed)


def _load_checkpoint(spec, path: str, batch, seq):
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
  with _Step(f"loading {path}"):
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


def _params_for(spec, args, batch, seq):
  if args.checkpoint:
    return _load_checkpoint(spec, args.checkpoint, batch, seq), f"checkpoint {os.path.abspath(args.checkpoint)}"
  return _random_params(spec, batch, seq, args.seed), f"random (seed {args.seed}, randomized norms)"


def _fold(params, apply_fn, example, *, auxiliary: bool, tied: str):
  import jaxfold
  with _Step("folding (trace + analysis + parameter transform)") as st:
    folded = jaxfold.fold(params, apply_fn, *example, auxiliary_centering=auxiliary,
                          tied_weights=tied)
  return folded, st.elapsed


def check_finite(tree: Any, what: str) -> None:
  """Raises :class:`CLIError` if any float leaf of ``tree`` has a NaN or an inf:
  an error measured on non-finite outputs would be meaningless (NaN compares as 0)."""
  import jax
  import numpy as np
  for x in jax.tree_util.tree_leaves(tree):
    x = np.asarray(x)
    if x.dtype.kind in "fc" and not np.all(np.isfinite(x)):
      n = int(np.size(x) - np.count_nonzero(np.isfinite(x)))
      raise CLIError(f"{what} has {n} non-finite value(s) (NaN/inf) out of {x.size}: no error or "
                     "timing is reported for it. Check the inputs (e.g. --seq within the model's "
                     "positions) and the weights")


def max_rel_err(a: Any, b: Any, what: str = "outputs") -> float:
  """``max |a − b| / max |a|`` over the leaves; refuses non-finite values in
  either (:class:`CLIError`), since NaN − NaN would otherwise read as 0."""
  import jax
  import numpy as np
  check_finite(a, f"the original model's {what}")
  check_finite(b, f"the folded model's {what}")
  worst = 0.0
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    worst = max(worst, float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(x))), 1e-30)))
  return worst


_max_rel_err = max_rel_err   # the name benchmarks used before


def max_positions(spec) -> Optional[int]:
  """The length of a text model's position table (None without one)."""
  c = spec.config
  for k in ("n_positions", "max_position_embeddings"):
    if hasattr(c, k):
      return int(getattr(c, k))
  return None


def _check_seq(spec, seq: Optional[int]) -> None:
  limit = max_positions(spec)
  if seq is not None and limit is not None and seq > limit:
    raise CLIError(f"--seq {seq} is longer than {spec.name}'s {limit} positions (its position "
                   f"table has {limit} rows): use --seq {limit} or less")


_CAUSAL_FAMILIES = {"gpt2", "gpt2_nnx", "gpt2-nnx", "opt", "bloom", "phi"}


def model_meta(spec) -> dict:
  """What ``jaxfold serve`` validates requests against, for a model-zoo spec:
  per-argument names and value ranges (token ids in ``[0, vocab)``), the
  longest sequence (``max_seq``) and whether right-padding is invisible
  (``seq_padding``: ``"causal"`` decoders, ``"mask"`` for BERT's attention mask)."""
  c = spec.config
  meta: dict = {"model": spec.name, "family": spec.family}
  vocab = getattr(c, "vocab_size", None)
  if spec.family == "bert":
    meta["inputs"] = [{"name": "input_ids", "low": 0, "high": int(vocab)},
                      {"name": "attention_mask", "low": 0, "high": 2, "role": "attention_mask"},
                      {"name": "token_type_ids", "low": 0, "high": int(c.type_vocab_size)}]
    meta["seq_padding"] = "mask"
  elif vocab is not None:
    meta["inputs"] = [{"name": "input_ids", "low": 0, "high": int(vocab)}]
    if spec.family in _CAUSAL_FAMILIES or spec.family.startswith("gpt2"):
      meta["seq_padding"] = "causal"
  else:
    meta["inputs"] = [{"name": "x"}]
  limit = max_positions(spec)
  if limit is not None:
    meta["max_seq"] = limit
  return meta


def _print_timing(s: dict, out=None) -> None:
  out = out or sys.stdout
  med = s["median_ms"]
  r = s["ratio"]["folded"]
  q1, q3 = s["ratio_iqr"]["folded"]
  print(f"forward time (jit, interleaved, median of {s['rounds']} rounds x {s['number']} calls): "
        f"original {med['original']:.3f} ms, folded {med['folded']:.3f} ms", file=out)
  print(f"folded/original time ratio: {r:.3f} (IQR {q1:.3f}-{q3:.3f}); "
        f"A/A noise (original vs itself): {s['ratio']['original A/A']:.3f} "
        f"(±{100 * s['aa_noise']:.1f}%)", file=out)
  if abs(r - 1) <= max(2 * s["aa_noise"], 0.01):
    print("  -> the difference is within measurement noise on this device", file=out)


# ----------------------------------------------------------------------------
# Subcommands.


def cmd_demo(args) -> int:
  spec = demo_spec("tiny" if args.tiny else "small")
  batch, seq = args.batch, args.seq
  _check_seq(spec, seq)
  print(f"jaxfold demo: {spec.name} ({_describe(spec)}), batch {batch} x seq {seq}, "
        f"on {device_string()}")
  params = _random_params(spec, batch, seq, args.seed)
  apply_fn = spec.apply_fn()
  example = _example_args(spec, batch, seq)
  folded, t_fold = _fold(params, apply_fn, example, auxiliary=not args.no_auxiliary,
                         tied=args.tied_weights)
  print()
  print(folded.report)
  print()
  jitted = _jit_pair(apply_fn, folded)
  orig, fold_fn = jitted
  with _Step("checking outputs (jit)"):
    errs = []
    for b, s in [(batch, seq), (max(1, batch // 2 + 1), max(2, seq // 2 + 1))]:
      a = _example_args(spec, b, s)
      errs.append(((b, s), _max_rel_err(orig(params, *a), fold_fn(folded.params, *a))))
  print(f"fold time: {1e3 * t_fold:.0f} ms")
  for (b, s), e in errs:
    print(f"max relative error vs original at batch {b} x seq {s}: {e:.2e}")
  with _Step(f"timing forward ({args.rounds} interleaved rounds)"):
    s = compare_forward(apply_fn, params, folded, example, rounds=args.rounds, jitted=jitted)
  _print_timing(s)
  return 0


def _describe(spec) -> str:
  c = spec.config
  bits = []
  for k in ("n_embd", "hidden_size", "n_layer", "num_hidden_layers", "vocab_size"):
    if hasattr(c, k):
      bits.append(f"{k}={getattr(c, k)}")
  return ", ".join(bits) or spec.family


def cmd_fold(args) -> int:
  import jax
  import jaxfold
  from jaxfold import serialization
  spec = _spec(args.model)
  _check_seq(spec, args.seq)
  out = args.out or f"folded-{args.model.replace('/', '_')}"
  out = os.path.abspath(out)
  try:   # before any work: the same checks save_fold makes again when it commits
    serialization.check_target(out, args.force)
  except FileExistsError as e:
    raise CLIError(f"--out: {e}") from None
  params, source = _params_for(spec, args, args.batch, args.seq)
  apply_fn = spec.apply_fn()
  example = _example_args(spec, args.batch, args.seq, abstract=True)
  folded, t_fold = _fold(params, apply_fn, example, auxiliary=not args.no_auxiliary,
                         tied=args.tied_weights)
  meta = {
      "model": spec.name, "family": spec.family, "config": _config_dict(spec.config),
      "weights": source,
      "options": {"auxiliary_centering": not args.no_auxiliary, "tied_weights": args.tied_weights,
                  "batch": args.batch, "seq": args.seq},
      "jax_version": jax.__version__, "jaxfold_version": jaxfold.__version__,
      "device": device_string(), "fold_seconds": t_fold,
      "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
  }
  written: list = []
  with _Step(f"saving to {out}"):
    try:
      # The safetensors files go into the same temporary directory, so the
      # whole fold (no stale untied copy) replaces the old one in one rename.
      serialization.save_fold(folded, out, meta=meta, overwrite=args.force,
                              extra_files=lambda tmp: written.extend(
                                  _save_safetensors(folded, spec, tmp)))
    except FileExistsError as e:
      raise CLIError(f"--out: {e}") from None
  print(folded.report)
  print()
  print(f"saved fold of {spec.name} to {out}")
  for name in ["params/", "report.json", "meta.json", "fold.json", "manifest.json"] + written:
    print(f"  {os.path.join(out, name)}")
  return 0


def _save_safetensors(folded, spec, out) -> list:
  try:
    from models.safetensors_io import LAYOUTS, save_safetensors
  except ImportError:
    return []
  if spec.family not in LAYOUTS:
    return []
  params = folded.params.params
  written = []
  if folded.params.untied:
    import numpy as np
    from safetensors.numpy import save_file
    save_file({k: np.asarray(v) for k, v in folded.params.untied.items()},
              os.path.join(out, "untied.safetensors"), metadata={"format": "jaxfold-untied"})
    written.append("untied.safetensors")
  save_safetensors(params, os.path.join(out, "model.safetensors"), spec.family,
                   metadata={"jaxfold": "folded"})
  written.insert(0, "model.safetensors")
  return written


def cmd_report(args) -> int:
  from jaxfold import serialization
  if args.dir and args.model:
    raise CLIError("report: give either a saved fold DIR or --model NAME, not both")
  if not args.dir and not args.model:
    raise CLIError("report: give a saved fold DIR (from `jaxfold fold --out DIR`) or --model NAME")
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
    print(report)
    return 0
  import jaxfold
  spec = _spec(args.model)
  _check_seq(spec, args.seq)
  apply_fn = spec.apply_fn()
  with _Step(f"abstract init of {spec.name} (no weights allocated)"):
    params = (spec.abstract_init(args.batch, args.seq) if args.seq is not None
              else spec.abstract_init(args.batch))
  example = _example_args(spec, args.batch, args.seq, abstract=True)
  with _Step("analysing") as st:
    folded = jaxfold.fold(params, apply_fn, *example, auxiliary_centering=not args.no_auxiliary,
                          tied_weights=args.tied_weights)
  if args.json:
    print(folded.report.to_json())
    return 0
  print(f"{spec.name}: analysis took {1e3 * st.elapsed:.0f} ms")
  print(folded.report)
  return 0


def cmd_bench(args) -> int:
  spec = _spec(args.model)
  _check_seq(spec, args.seq)
  print(f"jaxfold bench: {spec.name}, batch {args.batch} x seq {args.seq}, on {device_string()}")
  params, source = _params_for(spec, args, args.batch, args.seq)
  apply_fn = spec.apply_fn()
  example = _example_args(spec, args.batch, args.seq)
  folded, t_fold = _fold(params, apply_fn, example, auxiliary=not args.no_auxiliary,
                         tied=args.tied_weights)
  print(f"{folded.report.num_folded}/{folded.report.num_sites} sites folded, "
        f"{folded.report.num_auxiliary} auxiliary; fold time {1e3 * t_fold:.0f} ms; weights: {source}")
  jitted = _jit_pair(apply_fn, folded)
  with _Step("checking outputs (jit)"):
    err = _max_rel_err(jitted[0](params, *example), jitted[1](folded.params, *example))
  print(f"max relative error vs original: {err:.2e}")
  with _Step(f"timing forward ({args.rounds} interleaved rounds)"):
    s = compare_forward(apply_fn, params, folded, example, rounds=args.rounds, warmup=args.warmup,
                        jitted=jitted)
  _print_timing(s)
  if args.json:
    print(json.dumps({"model": spec.name, "batch": args.batch, "seq": args.seq,
                      "device": device_string(), "fold_ms": 1e3 * t_fold, "max_rel_err": err,
                      **s}, default=str))
  return 0


def cmd_export(args) -> int:
  import types
  import warnings
  from jaxfold import exporting as jexport
  from jaxfold import serialization
  if bool(args.model) == bool(args.from_dir):
    raise CLIError("export: give exactly one of --model NAME (fold now) or --from DIR "
                   "(a saved fold from `jaxfold fold`)")
  if args.from_dir:
    if args.no_fold:
      raise CLIError("export: --no-fold goes with --model (a saved fold is folded already)")
    meta = serialization.load_meta(args.from_dir) if os.path.isdir(args.from_dir) else None
    if not meta or "model" not in meta:
      raise CLIError(f"--from: {args.from_dir} is not a saved fold made by `jaxfold fold` "
                     "(no meta.json with a model name)")
    spec = _spec(meta["model"])
    _check_seq(spec, args.seq)
    with _Step(f"loading fold from {args.from_dir}"):
      folded = serialization.load_fold(args.from_dir, spec.apply_fn())
  else:
    spec = _spec(args.model)
    _check_seq(spec, args.seq)
    params, _ = _params_for(spec, args, args.batch, args.seq)
    if args.no_fold:   # the original model, e.g. as a baseline to serve beside the fold
      folded = types.SimpleNamespace(params=params, apply_fn=spec.apply_fn())
    else:
      folded, _ = _fold(params, spec.apply_fn(), _example_args(spec, args.batch, args.seq, True),
                        auxiliary=not args.no_auxiliary, tied=args.tied_weights)
  example = _example_args(spec, args.batch, args.seq)
  symbolic = None if args.no_symbolic else ("batch", "seq")
  meta = {**model_meta(spec), "folded": not args.no_fold}
  if hasattr(folded, "report"):
    meta["sites_folded"] = [folded.report.num_folded, folded.report.num_sites]
  with _Step("exporting (jax.export)"), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", jexport.ExportWarning)
    blob = jexport.export(folded, *example, symbolic=symbolic, meta=meta)
  for w in caught:
    print(f"warning: {w.message}", file=sys.stderr)
  out = os.path.abspath(args.out)
  if os.path.isdir(out):
    raise CLIError(f"--out: {out} is a directory; give a file name, e.g. {out}/model.jaxexport")
  jexport.write_artifact(out, blob)   # a reader never sees half an artifact
  fn = jexport.load_exported(blob)
  print(f"wrote {out} ({len(blob) / 2**20:.2f} MiB); inputs: "
        + ", ".join(f"{d}[{','.join(map(str, s))}]" for s, d in jexport.exported_signature(fn)))
  return 0


def cmd_serve(args) -> int:
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
    spec = _spec(name)
    return spec.apply_fn(), model_meta(spec)

  with _Step(f"loading {args.source}"):
    try:
      model = serving.load_model(args.source, zoo_meta=zoo, max_batch=args.max_batch,
                                     max_seq=args.max_seq)
    except serving.ServeError as e:
      raise CLIError(str(e)) from None
  with _Step("checking that padding leaves answers unchanged"):
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
    with _Step("compiling every bucket (--warmup)"):
      shapes = model.warmup()
    print(f"serve: compiled {len(shapes)} programs {shapes}", file=sys.stderr)
  sys.stderr.flush()
  try:
    return serving.serve(model, args.host, args.port, config)
  except OSError as e:
    raise CLIError(f"cannot listen on {args.host}:{args.port}: {e}") from None


# ----------------------------------------------------------------------------
# Argument parsing.


def _positive(name):
  def conv(s):
    try:
      v = int(s)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {s!r}") from None
    if v < 1:
      raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {v}")
    return v
  return conv


def _fold_options(p):
  p.add_argument("--no-auxiliary", action="store_true",
                 help="never insert an auxiliary centering (the folded program has no op the "
                      "original lacks)")
  p.add_argument("--tied-weights", choices=("copy", "auxiliary", "auto"), default="auto",
                 help="tied weights (e.g. embedding = LM head): centered copy, auxiliary "
                      "centering, or auto (default)")


def _shape_options(p, batch=2, seq=16):
  p.add_argument("--batch", type=_positive("--batch"), default=batch, help=f"batch size (default {batch})")
  p.add_argument("--seq", type=_positive("--seq"), default=seq,
                 help=f"sequence length; image side for vision models (default {seq})")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxfold", description="Fold LayerNorm into RMSNorm, exactly.")
  p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
  p.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
  sub = p.add_subparsers(dest="command", metavar="COMMAND")

  d = sub.add_parser("demo", help="fold a built-in pre-LN transformer and measure it")
  d.add_argument("--tiny", action="store_true", help="use the tiny zoo model (fast; for tests)")
  d.add_argument("--batch", type=_positive("--batch"), default=4)
  d.add_argument("--seq", type=_positive("--seq"), default=128)
  d.add_argument("--rounds", type=_positive("--rounds"), default=15)
  d.add_argument("--seed", type=int, default=0)
  _fold_options(d)
  d.set_defaults(func=cmd_demo)

  f = sub.add_parser("fold", help="fold a model and save it")
  f.add_argument("--model", required=True, help="model name (see `jaxfold report --model ?`)")
  f.add_argument("--checkpoint", help="HF .safetensors file (default: random weights)")
  f.add_argument("--out", help="output directory (default ./folded-NAME)")
  f.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
  f.add_argument("--seed", type=int, default=0, help="seed of the random weights")
  _fold_options(f)
  _shape_options(f, 1, None)
  f.set_defaults(func=cmd_fold)

  r = sub.add_parser("report", help="per-site table for a model or a saved fold")
  r.add_argument("dir", nargs="?", help="a saved fold directory")
  r.add_argument("--model", help="model name (abstract init, nothing allocated)")
  r.add_argument("--json", action="store_true", help="print the report as JSON")
  _fold_options(r)
  _shape_options(r, 1, None)
  r.set_defaults(func=cmd_report)

  b = sub.add_parser("bench", help="folded vs original forward time")
  b.add_argument("--model", required=True)
  b.add_argument("--checkpoint", help="HF .safetensors file (default: random weights)")
  b.add_argument("--rounds", type=_positive("--rounds"), default=9)
  b.add_argument("--warmup", type=_positive("--warmup"), default=2)
  b.add_argument("--seed", type=int, default=0)
  b.add_argument("--json", action="store_true", help="also print the numbers as one JSON line")
  _fold_options(b)
  _shape_options(b, 2, 64)
  b.set_defaults(func=cmd_bench)

  e = sub.add_parser("export", help="write a serialized jax.export artifact of a fold")
  e.add_argument("--model", help="model to fold now")
  e.add_argument("--from", dest="from_dir", help="a saved fold directory")
  e.add_argument("--checkpoint", help="HF .safetensors file (with --model)")
  e.add_argument("--out", required=True, help="artifact file to write")
  e.add_argument("--no-symbolic", action="store_true",
                 help="export the example shapes exactly (default: symbolic batch and seq)")
  e.add_argument("--seed", type=int, default=0)
  e.add_argument("--no-fold", action="store_true",
                 help="export the original (unfolded) model, e.g. as a baseline to compare with")
  _fold_options(e)
  _shape_options(e, 1, None)
  e.set_defaults(func=cmd_export)

  v = sub.add_parser("serve", help="serve an exported artifact or a saved fold over HTTP",
                     description="POST /predict {\"inputs\": [[...]]}, GET /health, GET /metrics. "
                     "Validates requests against the model, batches concurrent ones into padded "
                     "shape buckets, and on SIGTERM finishes the requests in flight and exits 0.")
  v.add_argument("source", help="artifact from `jaxfold export`, or a fold directory from "
                                "`jaxfold fold`")
  v.add_argument("--host", default="127.0.0.1")
  v.add_argument("--port", type=int, default=8000, help="0: let the OS pick a free port")
  v.add_argument("--max-batch", type=_positive("--max-batch"), default=16,
                 help="rows per program call; batch buckets are powers of two up to it")
  v.add_argument("--max-seq", type=_positive("--max-seq"), default=None,
                 help="longest sequence accepted (default: the model's positions)")
  v.add_argument("--max-queue", type=_positive("--max-queue"), default=256,
                 help="waiting requests beyond this get 503 Retry-After")
  v.add_argument("--max-body", type=_positive("--max-body"), default=1 << 20,
                 help="largest request body in bytes (413 beyond)")
  v.add_argument("--max-wait-ms", type=float, default=2.0,
                 help="how long a lone request waits for others to batch with")
  v.add_argument("--drain-timeout", type=float, default=30.0,
                 help="seconds to finish in-flight requests after SIGTERM")
  v.add_argument("--warmup", action="store_true", help="compile every bucket before serving")
  v.set_defaults(func=cmd_serve)
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Entry point of the ``jaxfold`` console script; returns the exit status."""
  parser = build_parser()
  args = parser.parse_args(argv)
  if not getattr(args, "func", None):
    parser.print_help(sys.stderr)
    return 2
  _Step.quiet = bool(args.quiet)
  if getattr(args, "model", None) == "?":
    print("\n".join(_models().names()))
    return 0
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
    from jaxfold import FoldError, IntegrityError
    msg = str(e).strip() or type(e).__name__
    if isinstance(e, (FoldError, IntegrityError, FileNotFoundError, FileExistsError,
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
