"""Which tables an exported program's integer inputs index, read from the program itself.

``jaxfold serve`` must refuse a token id the model cannot look up (a gather
out of range clamps or fills: a wrong answer, not an error) and a sequence
longer than the position table. Both bounds come from the program's dataflow,
never from parameter names or the artifact's metadata:

* a **vocabulary** of input ``k``: a gather whose indices are input ``k``'s
  values (reshaped, broadcast, converted, or put through jnp's negative-index
  normalization ``where(i < 0, i + n, i)``), or a one-hot of them contracted
  with a table, from a table that no input computes: the table's rows bound
  the ids;
* the **positions**: a gather by an ``arange`` of a symbolic size (the
  sequence), from such a table: its rows bound the sequence length.

An integer input that reaches an index any other way (``ids % 7``, a dynamic
slice, a loop or custom call the analysis does not enter) is reported in
``unbounded``: no bound is claimed from it. The StableHLO facts (which
operation gathers, moves, compares) come from ``compat``.

Example:
    >>> t = program_tables(load_exported("gpt2-tiny.jaxexport"))
    >>> t.inputs, t.positions
    ({0: 96}, 32)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jaxfold._src import compat

__all__ = ["Tables", "program_tables"]


@dataclasses.dataclass
class Tables:
  """Bounds read from a program: ``inputs[k]`` the rows of the smallest table
  input ``k`` indexes (absent: none found), ``positions`` those of the smallest
  table gathered by an arange of a symbolic size, ``unbounded[k]`` how input
  ``k`` also reaches an index the analysis cannot bound."""
  inputs: dict = dataclasses.field(default_factory=dict)
  positions: Optional[int] = None
  unbounded: dict = dataclasses.field(default_factory=dict)

  def cap(self, k: int, rows: int) -> None:
    self.inputs[k] = min(rows, self.inputs.get(k, rows))

  def cap_positions(self, rows: int) -> None:
    self.positions = min(rows, self.positions or rows)


# A value's label: (exact, taint). ``taint``: the inputs it depends on.
# ``exact``: what its elements are, where known — ("input", k) input k's values;
# ("arange", n) an arange (n: its static size, None when symbolic);
# ("const", v) a constant (v: its value where all elements are one integer);
# ("negative", X) the test X < 0; ("shifted", X) X plus a constant; ("onehot", k, n)
# a one-hot of input k over n classes.
_FREE = (None, frozenset())


def program_tables(fn: Any) -> Tables:
  """The :class:`Tables` of a loaded artifact (``load_exported``'s callable):
  its parameters are the first arguments of the program, its inputs the last."""
  exported = fn.exported
  n_inputs = len(fn.in_avals)
  out = Tables()
  with compat.hlo_functions(exported) as funcs:
    main = "main" if "main" in funcs else next(iter(funcs))
    args, _ = funcs[main]
    first = len(args) - n_inputs
    labels = [_FREE if i < first else (("input", i - first), frozenset({i - first})) for i in range(len(args))]
    _Walk(funcs, out).run(main, tuple(labels))
  return out


class _Walk:
  """Runs the label transfer over the functions, entering each call (memoized
  per function and argument labels)."""

  def __init__(self, funcs: dict, out: Tables):
    self.funcs, self.out, self.memo = funcs, out, {}

  def run(self, name: str, labels: tuple) -> tuple:
    key = (name, labels)
    if key in self.memo:
      return self.memo[key]
    self.memo[key] = tuple(_FREE for _ in labels)   # a recursive call: nothing known
    args, ops = self.funcs[name]
    env = dict(zip(args, labels))
    result: tuple = ()
    for h in ops:
      ins = [env.get(v, _FREE) for v in h.op.operands]
      if h.kind == "returns":
        result = tuple(ins)
        continue
      outs = self.step(h, ins)
      for v, lab in zip(h.op.results, outs):
        env[v] = lab
    self.memo[key] = result
    return result

  def step(self, h: Any, ins: list) -> list:
    op, n_out = h.op, len(h.op.results)
    taint = frozenset().union(*(t for _, t in ins)) if ins else frozenset()
    if h.kind == "calls" and h.callee in self.funcs:
      res = self.run(h.callee, tuple(ins))
      return list(res) if len(res) == n_out else [(None, taint)] * n_out
    exact = None
    if h.kind == "moves" and ins:
      exact, taint = ins[0]
    elif h.kind == "dimsize":
      taint = frozenset()                  # a dimension size: not the input's values
    elif h.kind == "constant":
      exact = ("const", h.splat)
    elif h.kind == "arange":
      shape = compat.hlo_shape(op.results[0])
      exact = ("arange", shape[h.axes[0]] if shape and h.axes[0] < len(shape) else None)
    elif h.kind == "compares" and len(ins) == 2:
      exact = self.compare(h.direction, ins[0][0], ins[1][0])
    elif h.kind in ("adds", "scales") and len(ins) == 2:
      a, b = ins[0][0], ins[1][0]
      x, c = (a, b) if _const(b) else (b, a) if _const(a) else (None, None)
      unit = 0 if h.kind == "adds" else 1
      if x and x[0] in ("input", "arange"):       # x + 0 and x * 1 are x (jnp.arange's lowering)
        exact = x if c == ("const", unit) else ("shifted", x) if h.kind == "adds" else None
    elif h.kind == "selects" and len(ins) == 3:
      exact = _normalized(*(e for e, _ in ins))
    elif h.kind == "gathers":
      self.gather(h, ins)
    elif h.kind == "contracts":
      self.dot(h, ins)
    elif h.kind in ("indexes", "opaque"):
      for v, (_, t) in zip(op.operands, ins):
        if compat.hlo_integer(v):
          self.unbounded(t, f"an integer operand of {op.name}")
    return [(exact, taint)] * n_out

  @staticmethod
  def compare(direction: Optional[str], a: Any, b: Any) -> Any:
    if direction == "LT" and a and a[0] in ("input", "arange") and b == ("const", 0):
      return ("negative", a)
    if direction == "EQ":
      for x, y in ((a, b), (b, a)):
        if x and y and x[0] == "input" and y[0] == "arange" and y[1] is not None:
          return ("onehot", x[1], y[1])
    return None

  def gather(self, h: Any, ins: list) -> None:
    (_, table_taint), (idx, idx_taint) = ins[0], ins[1]
    shape = compat.hlo_shape(h.op.operands[0])
    rows = [shape[a] for a in h.axes if a < len(shape)] if shape else []
    bounded = not table_taint and rows and all(r is not None for r in rows)
    if idx and idx[0] == "input" and bounded:
      self.out.cap(idx[1], min(rows))
    elif idx and idx[0] == "arange" and idx[1] is None and bounded:
      self.out.cap_positions(min(rows))
    else:
      self.unbounded(idx_taint, "the indices of a gather computed from it")

  def dot(self, h: Any, ins: list) -> None:
    """A one-hot of input k over n classes contracted with a table of n rows: a lookup."""
    if len(ins) != 2:
      return
    for i in (0, 1):
      hot, (_, table_taint) = ins[i][0], ins[1 - i]
      if not (hot and hot[0] == "onehot") or table_taint or len(h.axes[i]) != 1:
        continue
      _, k, n = hot
      hot_shape, table_shape = compat.hlo_shape(h.op.operands[i]), compat.hlo_shape(h.op.operands[1 - i])
      if hot_shape and table_shape and hot_shape[h.axes[i][0]] == n and table_shape[h.axes[1 - i][0]] == n:
        self.out.cap(k, n)

  def unbounded(self, taint: frozenset, how: str) -> None:
    for k in taint:
      self.out.unbounded.setdefault(k, how)


def _const(e: Any) -> bool:
  return bool(e) and e[0] == "const"


def _normalized(pred: Any, a: Any, b: Any) -> Any:
  """jnp's negative-index normalization ``where(x < 0, x + c, x)`` is ``x`` for
  the non-negative ids a server accepts."""
  if pred and pred[0] == "negative" and b and b == pred[1] and a == ("shifted", b):
    return b
  return None
