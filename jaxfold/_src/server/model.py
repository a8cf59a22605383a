"""The program behind ``jaxfold serve``: loading, request validation and padded shape buckets.

A served model is always a ``jax.export`` program: an artifact file is loaded
(and verified) as it is; a saved fold directory is loaded with the model zoo's
apply function and exported in-process.  Its signature (dtypes, fixed and
symbolic dimensions) and the metadata in the artifact's header (valid ranges
of token ids, the number of positions, whether right-padding a sequence is
invisible) decide what a request may contain and how requests are batched.

Batching pads every batch to a *bucket* shape (batch rows a power of two up to
``max_batch``; sequence lengths to powers of two up to ``max_seq`` when padding
is invisible, else the exact length), so jit compiles at most
``len(batch_buckets) * len(seq_buckets)`` programs.  Rows added to fill a
bucket repeat a real row (valid input for any model) and are dropped from the
answer; :meth:`ServedModel.self_check` verifies at start-up that padding does
not change a real row's outputs.

Example:
    >>> m = load_model("gpt2-tiny.jaxexport")
    >>> req = m.validate({"inputs": [[1, 2, 3]]})
    >>> outs = m.run([req], m.bucket_for([req]))[0]
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence

import numpy as np

__all__ = ["ServeError", "InputError", "OutsideBuckets", "InputSpec", "Request", "ServedModel",
           "load_model", "pow2_buckets", "program_bounds"]


class ServeError(Exception):
  """The model cannot be served as configured (the message says why and what to do)."""


class InputError(ValueError):
  """A request does not fit the model's signature (answered with HTTP 400)."""


class OutsideBuckets(Exception):
  """The request's padded shape is not one of the compiled programs and the
  budget for compiling on the request path is spent (answered with HTTP 503)."""


def program_bounds(fn: Any) -> dict:
  """What the program's own tables bound, read from its dataflow (never from
  parameter names or metadata; :mod:`jaxfold._src.server.tables`):
  ``{"inputs": {k: rows}, "vocab", "positions", "unbounded": {k: how}}`` —
  the rows of the smallest table each integer input ``k`` is gathered from,
  ``vocab`` the first integer input's, ``positions`` the rows of the table an
  arange of the sequence gathers from; ``None`` / absent where none is found.

  Example:
      >>> program_bounds(load_exported("gpt2-tiny.jaxexport"))
      {'inputs': {0: 96}, 'vocab': 96, 'positions': 32, 'unbounded': {}}
  """
  from jaxfold._src.server.tables import program_tables
  t = program_tables(fn)
  ints = [k for k, a in enumerate(fn.in_avals) if np.dtype(a.dtype).kind in "iu"]
  vocab = t.inputs.get(ints[0]) if ints else None
  return {"inputs": dict(t.inputs), "vocab": vocab, "positions": t.positions, "unbounded": dict(t.unbounded)}


def _has_bool(x: Any, limit: int = 1 << 22) -> bool:
  """Whether a JSON value holds a true/false anywhere (numpy turns them into 1/0)."""
  stack, seen = [x], 0
  while stack:
    v = stack.pop()
    seen += 1
    if isinstance(v, bool):
      return True
    if isinstance(v, list) and seen < limit:
      stack.extend(v)
  return False


@dataclasses.dataclass(frozen=True)
class InputSpec:
  """One positional argument: its dtype, dimensions (int or symbol name) and value range."""
  name: str
  dtype: np.dtype
  dims: tuple                       # int (fixed) or str (symbolic name, e.g. "batch")
  low: Optional[float] = None       # valid values: low <= v < high
  high: Optional[float] = None
  role: Optional[str] = None        # "attention_mask": padded positions get 0


@dataclasses.dataclass
class Request:
  """A validated request: its arrays, rows and sequence length."""
  args: list
  rows: int
  seq: Optional[int]


def pow2_buckets(limit: int, start: int = 1) -> tuple:
  """``(start, 2 start, 4 start, ..., limit)``: powers of two, ``limit`` included."""
  out, b = [], max(1, start)
  while b < limit:
    out.append(b)
    b *= 2
  out.append(limit)
  return tuple(sorted(set(out)))


def _dim(d: Any) -> Any:
  return d if isinstance(d, int) else str(d)


class ServedModel:
  """A loaded program with its input specs, buckets and output layout."""

  def __init__(self, fn: Any, *, meta: Optional[dict] = None, source: str = "",
               max_batch: int = 16, max_seq: Optional[int] = None, min_seq_bucket: int = 8,
               seq_padding: Optional[str] = "auto", vocab: Optional[int] = None):
    import jax
    self.fn = fn
    self.source = source
    self.meta = dict(meta or {})
    header = getattr(fn, "header", {}) or {}
    if header.get("params_as_argument"):
      raise ServeError(f"{source} was exported with params_as_argument=True: serving needs the "
                       "parameters baked in (export without params_as_argument)")
    avals = list(fn.in_avals)
    in_tree = getattr(fn, "in_tree", None) or fn.exported.in_tree   # parameters excluded
    if in_tree != jax.tree_util.tree_structure((tuple(range(len(avals))), {})):
      raise ServeError(f"{source}: the program's arguments are not a flat list of arrays "
                       f"({in_tree}); serving needs f(array, ...)")
    described = list(self.meta.get("inputs") or [])
    self.bounds = program_bounds(fn)
    self.notes: list = []
    specs = []
    for i, a in enumerate(avals):
      d = described[i] if i < len(described) and isinstance(described[i], dict) else {}
      name = str(d.get("name", f"input {i}"))
      low, high, role = d.get("low"), d.get("high"), d.get("role")
      if np.dtype(a.dtype).kind in "iu":
        # The metadata may be absent or forged: the tables the program gathers
        # from by this input and the operator's --vocab cap it; ids are never negative.
        low = max(0, int(low)) if isinstance(low, (int, float)) else 0
        high = int(high) if isinstance(high, (int, float)) and not isinstance(high, bool) else None
        table = self.bounds["inputs"].get(i)
        caps = ([vocab] if vocab else []) + ([table] if table else []) + ([2] if role == "attention_mask" else [])
        if high is not None and caps and high > min(caps):
          self.notes.append(f"{name}: the metadata allows ids below {high}, the program's tables "
                            f"only {min(caps)}: serving [0, {min(caps)})")
        how = self.bounds["unbounded"].get(i)
        if how and table:
          self.notes.append(f"{name}: also reaches {how}, which no table bounds: serving the "
                            f"[0, {min(caps)}) the tables it is gathered from allow")
        high = min(caps + ([high] if high is not None else []), default=None)
        if high is None:
          found = f" (it reaches {how})" if how else ""
          raise ServeError(f"{source}: cannot tell how many ids input {name!r} may index: the program "
                           f"gathers no parameter table by it{found} and the artifact's metadata gives "
                           "no range; pass --vocab N (ids are then checked to lie in [0, N)) rather "
                           "than risk indexing out of range")
      specs.append(InputSpec(name=name, dtype=np.dtype(a.dtype),
                             dims=tuple(_dim(x) for x in a.shape), low=low, high=high, role=role))
    self.inputs = specs
    firsts = {s.dims[0] if s.dims else None for s in specs}
    self.batch_sym = next(iter(firsts)) if len(firsts) == 1 and isinstance(next(iter(firsts)), str) else None
    seconds = {s.dims[1] if len(s.dims) > 1 else None for s in specs}
    self.seq_sym = (next(iter(seconds)) if len(seconds) == 1
                    and isinstance(next(iter(seconds)), str) else None)
    self.out_tree = fn.exported.out_tree
    self.out_axes = []
    for a in fn.out_avals:
      dims = [_dim(x) for x in a.shape]
      b_ax = dims.index(self.batch_sym) if self.batch_sym in dims else None
      s_ax = dims.index(self.seq_sym) if self.seq_sym and self.seq_sym in dims else None
      odd = [x for x in dims if isinstance(x, str) and x not in (self.batch_sym, self.seq_sym)]
      if odd:   # e.g. "seq + 1": rows cannot be sliced back out of a padded batch
        raise ServeError(f"{source}: output dimension {odd[0]!r} is not one of the input "
                         "dimensions; export the model with concrete shapes (--no-symbolic)")
      self.out_axes.append((b_ax, s_ax))
    if self.batch_sym is None or any(b is None for b, _ in self.out_axes):
      max_batch = 1            # every request is a program call of its own
    self.max_batch = int(max_batch)
    model_max_seq = self.meta.get("max_seq")
    if not isinstance(model_max_seq, int) or isinstance(model_max_seq, bool) or model_max_seq < 1:
      model_max_seq = None
    if self.bounds["positions"]:
      if model_max_seq and model_max_seq > self.bounds["positions"]:
        self.notes.append(f"the metadata allows sequences of {model_max_seq}, the position table "
                          f"has {self.bounds['positions']} rows: serving at most that")
      model_max_seq = min(model_max_seq or self.bounds["positions"], self.bounds["positions"])
    if self.seq_sym is None:
      self.max_seq = None
    elif max_seq is not None:
      self.max_seq = int(min(max_seq, model_max_seq) if model_max_seq else max_seq)
    elif model_max_seq:
      self.max_seq = int(model_max_seq)
    else:
      raise ServeError(f"{source}: the sequence length is symbolic but the artifact does not say "
                       "how long a sequence may be (meta['max_seq']); pass --max-seq N")
    if seq_padding == "auto":
      seq_padding = self.meta.get("seq_padding")
    if seq_padding not in (None, "causal", "mask"):
      raise ServeError(f"unknown seq_padding {seq_padding!r}: use 'causal', 'mask' or None")
    if seq_padding == "mask" and not any(s.role == "attention_mask" for s in specs):
      seq_padding = None
    if self.seq_sym is None or any(s_ax is None for _, s_ax in self.out_axes):
      seq_padding = None
    self.seq_padding = seq_padding
    self.batch_buckets = pow2_buckets(self.max_batch)
    if self.seq_sym is None:
      self.seq_buckets: tuple = ()
    elif seq_padding:
      self.seq_buckets = pow2_buckets(self.max_seq, min(min_seq_bucket, self.max_seq))
    else:
      self.seq_buckets = tuple(range(1, self.max_seq + 1))   # exact lengths
    self._call = fn
    self.compiled: set = set()     # bucket shapes run so far (one jit program each)
    self.sealed = False            # after start-up: compiling is limited to request_budget
    self.request_budget = 0

  # ---------------------------------------------------------------- description

  def signature(self) -> list:
    """``[[dims, dtype], ...]`` with symbolic dims as names (the /health format)."""
    return [[list(s.dims), str(s.dtype)] for s in self.inputs]

  def max_programs(self) -> int:
    return len(self.batch_buckets) * max(1, len(self.seq_buckets))

  def describe(self) -> dict:
    return {
        "inputs": self.signature(),
        "input_ranges": [{"name": s.name, "low": s.low, "high": s.high} for s in self.inputs],
        "max_batch": self.max_batch, "max_seq": self.max_seq,
        "seq_padding": self.seq_padding,
        "batch_buckets": list(self.batch_buckets),
        "seq_buckets": (list(self.seq_buckets) if self.seq_padding or len(self.seq_buckets) <= 16
                        else f"exact lengths 1..{self.max_seq}"),
        "max_programs": self.max_programs(),
        "compiled": self.compiled_buckets(),
    }

  def compiled_buckets(self) -> list:
    """``[[rows, seq], ...]`` (``[rows]`` without a sequence axis): the padded
    shapes run so far, one compiled program each."""
    return sorted(list(k) for k in self.compiled)

  # ---------------------------------------------------------------- validation

  def validate(self, payload: Any) -> Request:
    """JSON payload -> :class:`Request`; :class:`InputError` says what is wrong."""
    if not isinstance(payload, dict) or "inputs" not in payload:
      raise InputError('expected a JSON object {"inputs": [[...]]}')
    raw = payload["inputs"]
    if any(s.dtype.kind in "iu" for s in self.inputs) and _has_bool(raw):
      raise InputError("inputs hold true/false: send integers (true is not accepted as 1)")
    n = len(self.inputs)
    if payload.get("multiple") or n > 1:
      if not isinstance(raw, list) or len(raw) != n:
        names = ", ".join(s.name for s in self.inputs)
        raise InputError(f"this program takes {n} arguments ({names}): send "
                         f'{{"inputs": [arg0, ..., arg{n - 1}], "multiple": true}}')
      raws = raw
    else:
      raws = [raw]
    args, sizes = [], {}
    for x, spec in zip(raws, self.inputs):
      arr = self._convert(x, spec)
      if arr.ndim != len(spec.dims):
        raise InputError(f"{spec.name}: expected rank {len(spec.dims)} (shape {list(spec.dims)}), "
                         f"got shape {list(arr.shape)}")
      for k, d in enumerate(spec.dims):
        if isinstance(d, int):
          if arr.shape[k] != d:
            raise InputError(f"{spec.name}: axis {k} must have size {d}, got shape "
                             f"{list(arr.shape)}")
        elif sizes.setdefault(d, arr.shape[k]) != arr.shape[k]:
          raise InputError(f"{spec.name}: axis {k} ({d}) has size {arr.shape[k]}, another input "
                           f"has {sizes[d]}: all inputs must agree")
      args.append(arr)
    rows = sizes.get(self.batch_sym, 1) if self.batch_sym else 1
    seq = sizes.get(self.seq_sym) if self.seq_sym else None
    if rows < 1 or (seq is not None and seq < 1) or any(a.size == 0 for a in args):
      raise InputError("inputs must not be empty")
    if self.batch_sym and rows > max(self.batch_buckets):
      raise InputError(f"at most {max(self.batch_buckets)} rows per request, got {rows}: split the "
                       "request")
    if seq is not None and self.max_seq and seq > self.max_seq:
      raise InputError(f"sequence length {seq} is longer than the model's {self.max_seq} "
                       "positions: shorten the input")
    return Request(args, rows, seq)

  @staticmethod
  def _convert(x: Any, spec: InputSpec) -> np.ndarray:
    try:
      arr = np.asarray(x)
    except (ValueError, TypeError, OverflowError) as e:
      raise InputError(f"{spec.name}: not a rectangular array of numbers "
                       f"({str(e).splitlines()[0][:120]})") from None
    if arr.size == 0:
      raise InputError(f"{spec.name}: the input is empty (shape {list(arr.shape)}): send at least "
                       "one value per row")
    if arr.dtype == object or arr.dtype.kind in "USV":
      # Python ints beyond 64 bits land here, as do strings and nulls.
      raise InputError(f"{spec.name}: expected numbers of type {spec.dtype}, got values that are "
                       "not (strings, nulls, or integers too large for 64 bits)")
    if arr.dtype.kind == "b":
      raise InputError(f"{spec.name}: expected {spec.dtype} values, got true/false")
    if spec.dtype.kind in "iu":
      if arr.dtype.kind == "f":
        bad = np.argwhere(~np.isfinite(arr) | (arr != np.round(arr)))
        where = tuple(int(i) for i in bad[0]) if bad.size else None
        if where is not None:
          raise InputError(f"{spec.name}: expected integers, got {float(arr[where])!r} at index "
                           f"{list(where)}")
        raise InputError(f"{spec.name}: expected integers, got floats (write 3, not 3.0)")
      info = np.iinfo(spec.dtype)
      low = max(int(spec.low), info.min) if spec.low is not None else info.min
      high = min(int(spec.high), info.max + 1) if spec.high is not None else info.max + 1
      if arr.size:
        lo, hi = arr.min(), arr.max()
        if lo < low or hi >= high:
          bad = arr < low if lo < low else arr >= high
          where = tuple(int(i) for i in np.argwhere(bad)[0])
          what = (f"[{low}, {high})" if spec.high is not None else f"the range of {spec.dtype}")
          raise InputError(f"{spec.name}: value {int(arr[where])} at index {list(where)} is "
                           f"outside {what}")
      return arr.astype(spec.dtype)
    if spec.dtype.kind == "f":
      if arr.dtype.kind not in "iuf":
        raise InputError(f"{spec.name}: expected numbers of type {spec.dtype}")
      out = arr.astype(spec.dtype)
      if out.size and not np.all(np.isfinite(out)):
        raise InputError(f"{spec.name}: values must be finite numbers within {spec.dtype}'s range")
      if spec.low is not None and out.size and out.min() < spec.low:
        raise InputError(f"{spec.name}: values must be >= {spec.low}")
      if spec.high is not None and out.size and out.max() >= spec.high:
        raise InputError(f"{spec.name}: values must be < {spec.high}")
      return out
    try:
      return arr.astype(spec.dtype)
    except (TypeError, ValueError) as e:
      raise InputError(f"{spec.name}: cannot convert to {spec.dtype}: {e}") from None

  # ---------------------------------------------------------------- batching

  def bucket_key(self, req: Request) -> tuple:
    """Requests with the same key can share one padded program call."""
    seq = None
    if self.seq_sym is not None:
      seq = (next(b for b in self.seq_buckets if b >= req.seq) if self.seq_padding else req.seq)
    # Other symbolic dims (none for the zoo's exports) must match exactly.
    rest = tuple(tuple(a.shape[2:]) for a in req.args)
    return (seq, rest)

  def batch_rows(self, rows: int) -> int:
    return next(b for b in self.batch_buckets if b >= rows)

  def _shape_of(self, rows: int, key: tuple) -> tuple:
    total = self.batch_rows(rows) if self.batch_sym else rows
    return (total, key[0]) if key[0] is not None else (total,)

  def seal(self, request_budget: int = 0) -> None:
    """Ends start-up: from now on a shape that was not compiled runs only while
    ``request_budget`` programs may still be compiled on the request path."""
    self.sealed = True
    self.request_budget = max(0, int(request_budget))

  def served_seqs(self) -> list:
    return sorted({k[1] for k in self.compiled if len(k) > 1})

  def check_served(self, req: Request) -> None:
    """:class:`OutsideBuckets` for a request whose program is not compiled
    when no compilation budget is left (before it is queued)."""
    if not self.sealed or self.request_budget > 0:
      return
    shape = self._shape_of(req.rows, self.bucket_key(req))
    if shape not in self.compiled:
      raise OutsideBuckets(self._outside_message(shape))

  def _outside_message(self, shape: tuple) -> str:
    seqs = self.served_seqs()
    served = (f"sequence lengths {seqs[:16]}{' ...' if len(seqs) > 16 else ''} (padded)"
              if self.seq_padding else f"sequence lengths {seqs[:16]}{' ...' if len(seqs) > 16 else ''}")
    return (f"no compiled program for this request's shape {list(shape)} and the budget for "
            f"compiling on the request path is spent: this server answers {served if seqs else 'the compiled shapes'} "
            "(start it with a larger --compile-budget or a smaller --max-seq)")

  def run(self, reqs: Sequence[Request], key: tuple) -> list:
    """One program call for ``reqs`` (same key, ≤ max_batch rows in total);
    returns each request's outputs (a pytree of numpy arrays) or an Exception."""
    import jax
    seq, _ = key
    rows = sum(r.rows for r in reqs)
    total = self.batch_rows(rows) if self.batch_sym else rows
    args = []
    for i in range(len(self.inputs)):
      parts = []
      for r in reqs:
        a = r.args[i]
        if seq is not None and a.shape[1] < seq:
          pad = [(0, 0)] * a.ndim
          pad[1] = (0, seq - a.shape[1])
          a = np.pad(a, pad, constant_values=0)   # id 0 / mask 0: invisible (checked at start-up)
        parts.append(a)
      a = np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
      if total > rows:    # filler rows repeat the last real row: valid input for any model
        a = np.concatenate([a, np.repeat(a[-1:], total - rows, axis=0)], axis=0)
      args.append(a)
    shape = (total, seq) if seq is not None else (total,)
    if self.sealed and shape not in self.compiled:
      if self.request_budget <= 0:
        raise OutsideBuckets(self._outside_message(shape))
      self.request_budget -= 1
    outs = jax.tree_util.tree_leaves(self._call(*args))
    self.compiled.add(shape)
    outs = [np.asarray(o) for o in outs]
    results, off = [], 0
    for r in reqs:
      leaves = []
      for o, (b_ax, s_ax) in zip(outs, self.out_axes):
        idx = [slice(None)] * o.ndim
        if b_ax is not None:
          idx[b_ax] = slice(off, off + r.rows)
        if s_ax is not None and r.seq is not None:
          idx[s_ax] = slice(0, r.seq)
        leaves.append(o[tuple(idx)])
      off += r.rows
      bad = [k for k, x in enumerate(leaves) if x.dtype.kind in "fc" and not np.all(np.isfinite(x))]
      if bad:
        results.append(FloatingPointError(
            "the model produced non-finite outputs (NaN or inf) for this input; nothing is "
            "returned rather than a wrong answer"))
      else:
        results.append(jax.tree_util.tree_unflatten(self.out_tree, leaves))
    return results

  # ---------------------------------------------------------------- start-up checks

  def _random_input(self, rng, rows: int, seq: Optional[int]) -> Request:
    args = []
    for spec in self.inputs:
      shape = []
      for d in spec.dims:
        shape.append(d if isinstance(d, int) else rows if d == self.batch_sym else
                     seq if d == self.seq_sym else 1)
      if spec.role == "attention_mask":
        a = np.ones(shape, spec.dtype)
      elif spec.dtype.kind in "iu":
        low = int(spec.low) if spec.low is not None else 0
        high = int(spec.high) if spec.high is not None else low + 2
        a = rng.integers(low, high, shape).astype(spec.dtype)
      else:
        a = rng.standard_normal(shape).astype(spec.dtype)
      args.append(a)
    return Request(args, rows, seq)

  def self_check(self, rtol: float = 1e-4) -> list:
    """Runs a few padded calls and checks that padding leaves real rows unchanged.

    Sequence padding that turns out visible is switched off (exact lengths are
    served instead); batch padding that is visible (a program that mixes rows)
    is a :class:`ServeError`.  Returns notes for the start-up log."""
    import jax
    notes = []
    rng = np.random.default_rng(0)

    def rel(a, b):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-30)) if a.size else 0.0

    seq = None
    if self.seq_sym is not None:
      seq = self.seq_buckets[0] if self.seq_padding else min(4, self.max_seq)
    if self.seq_padding and (len(self.seq_buckets) > 1 or seq > 1):
      # An exact-length row vs. the same row padded to a longer bucket; both
      # shapes are buckets when there are two (no program outside the set).
      short, long = ((self.seq_buckets[0], self.seq_buckets[1]) if len(self.seq_buckets) > 1
                     else (max(1, seq // 2), seq))
      base = self._random_input(rng, 1, short)
      noisy = self._random_input(rng, 1, long)
      padded = []
      for spec, a, n in zip(self.inputs, base.args, noisy.args):
        if spec.role == "attention_mask":
          n = np.zeros_like(n)
        n[:, :short] = a
        padded.append(n)
      exact = self.run([base], (short, tuple(tuple(a.shape[2:]) for a in base.args)))[0]
      other = self.run([Request(padded, 1, long)], self.bucket_key(Request(padded, 1, long)))[0]
      other_prefix = [o[:, :short] if s_ax == 1 else o for o, (_, s_ax)
                      in zip(jax.tree_util.tree_leaves(other), self.out_axes)]
      err = max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(exact), other_prefix))
      if not err <= rtol:
        notes.append(f"right-padding a sequence changes the outputs (rel. error {err:.1e}): "
                     "serving exact sequence lengths instead")
        self.seq_padding = None
        self.seq_buckets = tuple(range(1, self.max_seq + 1))
    if self.max_batch > 1:
      one = self._random_input(rng, 1, seq)
      two = self._random_input(rng, 1, seq)
      key = self.bucket_key(one)
      alone = self.run([one], key)[0]
      both = self.run([two, one], key)[1]
      err = max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(alone),
                                          jax.tree_util.tree_leaves(both)))
      if not err <= rtol:
        raise ServeError(f"{self.source}: a row's outputs depend on the other rows of its batch "
                         f"(rel. error {err:.1e}); serve it with --max-batch 1")
      notes.append(f"padding check passed (a row alone vs. batched: rel. error {err:.1e})")
    return notes

  def warmup(self, budget: Optional[int] = None) -> list:
    """Compiles the bucket programs (returns their shapes): every batch bucket
    for each sequence bucket, shortest first, while ``budget`` programs (all
    when ``None``) are not exceeded."""
    shapes = []
    rng = np.random.default_rng(1)
    seqs = [None] if self.seq_sym is None else list(self.seq_buckets)
    for s in seqs:
      todo = [b for b in self.batch_buckets if ((b, s) if s is not None else (b,)) not in self.compiled]
      if budget is not None and len(self.compiled) + len(todo) > budget:
        break
      for b in self.batch_buckets:
        req = self._random_input(rng, b, s)
        self.run([req], self.bucket_key(req))
        shapes.append([b, s] if s is not None else [b])
    return shapes


def _is_fold_dir(path: str) -> bool:
  return os.path.isdir(path) and any(os.path.exists(os.path.join(path, n))
                                     for n in ("manifest.json", "fold.json"))


def load_model(source: str, *, zoo_meta=None, key: Optional[bytes] = None,
               **kwargs: Any) -> ServedModel:
  """An artifact file (``jaxfold export``) or a saved fold directory (``jaxfold fold``).

  ``zoo_meta(model_name) -> (apply_fn, meta)`` resolves a fold
  directory's model (the CLI passes the model zoo's); keyword arguments go to
  :class:`ServedModel`.  ``key``: refuse an artifact or fold that is not signed
  with it (``--verify-key``).
  """
  from jaxfold._src.artifact import export, load_exported
  source = os.path.abspath(os.fspath(source))
  if not os.path.exists(source):
    raise FileNotFoundError(f"{source} does not exist: pass an artifact from `jaxfold export` or "
                            "a fold directory from `jaxfold fold`")
  if os.path.isdir(source):
    if not _is_fold_dir(source):
      raise ServeError(f"{source} is a directory but not a saved fold (no manifest.json): pass a "
                       "fold directory from `jaxfold fold` or an artifact file")
    if zoo_meta is None:
      raise ServeError("serving a fold directory needs the model's code: use `jaxfold serve DIR`")
    from jaxfold._src.saved_fold import load_fold, load_meta
    name = load_meta(source).get("model")
    if not name:
      raise ServeError(f"{source}/meta.json names no model: export the fold with the Python API "
                       "(jaxfold.export) and serve the artifact instead")
    apply_fn, meta = zoo_meta(name)
    folded = load_fold(source, apply_fn, key=key)
    args = folded.apply_fn.example_args
    import warnings

    from jaxfold._src.artifact import ExportWarning
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", ExportWarning)
      blob = export(folded, *args, meta=meta, check=False)
    fn = load_exported(blob)
    fn.source = source
  else:
    fn = load_exported(source, key=key)
  return ServedModel(fn, meta=fn.meta, source=source, **kwargs)
