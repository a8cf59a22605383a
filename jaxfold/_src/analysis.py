"""The soundness analysis: which mean reductions can go, and what to center.

A fold has two proof obligations (numbered so throughout ``rules`` and
docs/contributing.md): (1) centering a producer is sound only if the shift it
introduces is invisible at every output of the program; (2) removing a mean
reduction is sound only if its input provably sums to zero over the reduced
axes. Each is a driver over the rule registry:

* ``Level.needs`` walks backwards from a normalization's input and lists what
  must be centered for it to sum to zero over the normalized axes
  (obligation 2: then the mean reduction is exactly zero).
* ``Level.invisible`` follows the shift a centering introduces forwards, as a
  polynomial in a shift symbol with exact rational coefficients, and proves
  that no output of the program sees it (obligation 1). Normalizations
  annihilate the shift by exact cancellation, not by matching a pattern.

A ``Level`` is one ``program.Program`` level (the top program or a loop
body) and the context every rule facet receives: structural facts, exact
canonical forms, constancy queries. All primitive knowledge lives in
``rules``; a primitive without an exact rule blocks, with its name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import math
from fractions import Fraction
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from jaxfold._src import algebra as A
from jaxfold._src import compat, layout
from jaxfold._src.program import Lit, Node, Program, Val, call_note
from jaxfold._src.rules import Block, Facts, rule_for
from jaxfold._src.rules.base import freeze, lit_facts, operand_const, size_one


@dataclasses.dataclass(frozen=True)
class LeafNeed:
  """Parameter (or captured constant) ``var`` must sum to zero over ``spec``.

  ``use`` is the operation (node, operand) that consumes it, reached through
  the value-preserving ``chain``; ``out_var``/``out_spec`` the value whose
  zero-sum the use provides (where an auxiliary centering could stand in).
  """
  var: Val
  spec: tuple
  use: Optional[tuple]
  out_var: Any
  out_spec: tuple
  chain: tuple


@dataclasses.dataclass(frozen=True)
class Blocker:
  """``var`` cannot be shown zero-sum over ``spec``; ``reason`` says why."""
  var: Any
  spec: tuple
  reason: str


@dataclasses.dataclass(frozen=True)
class MeanSite:
  """A mean reduction whose result is subtracted from the value it averages
  (a normalization site; ``report.Site`` is its row in the report)."""
  reduces: tuple          # reduce_sum nodes computing the site's mean
  input: Val              # the averaged value
  axes: tuple
  level: "Level"
  across: tuple = ()      # mesh axes a psum also sums the mean over (a mean over a sharded axis)
  unrecognised: str = ""  # why a value subtracted like a mean is not one jaxfold can prove (reported, refused)

  @property
  def node(self) -> Node:
    return self.reduces[0]

  def target(self) -> tuple:
    """``(level, value, spec)``: the value whose zero sum over ``spec`` makes
    this mean exactly zero. A local mean's is its input over the reduced axes.
    A mean summed across shards (``psum(Σ h) / n`` in a ``shard_map``) is zero
    when the whole tensor the shard_map splits is zero-sum over those axes,
    not each shard's block: that needs its input to be a value the shard_map
    reads, whose reduced axes the psum's mesh axes split exactly. Raises
    Block saying which of these fails."""
    spec = freeze({a: self.input.shape[a] for a in self.axes})
    if not self.across:
      return self.level, self.input, spec
    u, prog = self.input, self.level.program
    names = ", ".join(f"'{a}'" for a in self.across)
    what = f"the mean is summed across shards (a psum over {names})"
    if not isinstance(u, Val) or u.producer is not None or u.kind != "in" or prog.parent is None:
      raise Block(f"{what} of a value computed inside the shard_map: jaxfold proves a zero sum over a "
                  "sharded axis only for a value the shard_map reads")
    node, outer_prog = prog.parent
    shards = rule_for(node.prim).shards
    if shards is None:
      raise Block(f"{what} inside a `{node.prim.name}` body: only a `shard_map`'s own inputs are mapped to "
                  "the whole tensor")
    split = shards(node, u.index)
    over = frozenset().union(*[split[d] for d in self.axes])
    others = {d: split[d] & set(self.across) for d in range(len(split)) if d not in self.axes}
    if over != set(self.across) or any(others.values()):
      axes_txt = ", ".join(f"dim {d} over {sorted(split[d]) or 'no mesh axis'}" for d in range(len(split))
                           if split[d] or d in self.axes)
      raise Block(f"{what}, which are not exactly the mesh axes that split its reduced axes {self.axes} "
                  f"(the shard_map splits {axes_txt}): it is not the mean over the whole axes")
    a = node.ins[u.index]
    return self.level.an.level(outer_prog), a, freeze({d: a.shape[d] for d in self.axes})


_NEVER = float("inf")   # no key seen before the current call was met (``_Walk.hit``)


@dataclasses.dataclass
class _Walk:
  """The state of one zero-sum walk (``Level.needs``): the (value, spec, use)
  keys it has passed (coinductive assumptions for loop carries) with their
  order, the values where an auxiliary centering ends it, and the optional
  list it records its path in. Made per call and set on the Analyzer only
  while the walk runs (the walk crosses levels, which share the Analyzer);
  the memo of walk effects (``Analyzer._walk_memo``) outlives it."""
  seen: dict              # walk key -> its position in ``log``
  log: list               # the walk keys in the order they were first met
  stops: dict
  visited: Optional[list]
  stops_key: frozenset = frozenset()
  hit: float = _NEVER     # earliest already-seen key the current call met


CANON_TERMS = 8
DROPOUT_NOTE = " (INEXACT: a dropout mask was treated as constant, as through_dropout=True asks)"


class Analyzer:
  """Shared state of one analysis: options and the levels of the program."""

  def __init__(self, program: Program, *, cbwc: bool = False, through_dropout: bool = False):
    self.program = program
    self.cbwc = cbwc
    self.through_dropout = through_dropout
    self.random_uses = 0
    self.walk: Optional[_Walk] = None   # the zero-sum walk in progress (Level.needs)
    self._walk_memo: dict = {}    # Level._walk's memo, shared by the walks of every site
    self.tolerance = _tolerance(program)
    self.levels: dict = {}
    self.top = self.level(program)

  def level(self, program: Program) -> "Level":
    lv = self.levels.get(id(program))
    if lv is None:
      lv = Level(self, program)
      self.levels[id(program)] = lv
    return lv

  def release(self) -> None:
    """Drops every level's memos and breaks the program's reference cycles
    (``Program.release``): the analysis is over, and reference counting frees
    it at once instead of the cycle collector. Any later use fails loudly."""
    for lv in self.levels.values():
      lv._facts = lv._canon = lv._memo = lv.overrides = None
    self.levels = self._walk_memo = self.top = self.walk = None
    self.program.release()


def _keyed(vals) -> bool:
  """Whether any of ``vals`` is a PRNG key (asked of every node: a loop, not a generator)."""
  for a in vals:
    if compat.is_prng_key(a.dtype):
      return True
  return False


def _tolerance(program: Program):
  """The widest float dtype among the outputs: the precision at which a
  rewrite's rounding differences are invisible at EVERY output. (Not the
  narrowest: a bfloat16 side output, even one no parameter reaches such as
  ``x.astype(bfloat16)``, would otherwise let a bfloat16 round trip inside the
  float64 path of another output count as harmless rounding, and centering
  through it changed that float64 output by 4e-3.) Complex outputs count
  at the precision of their components."""
  best = None
  for v in program.outvars:
    dt = np.dtype(v.dtype) if not compat.is_prng_key(v.dtype) else None
    if dt is not None and jnp.issubdtype(dt, jnp.complexfloating):
      dt = np.dtype(jnp.finfo(dt).dtype)      # complex128 outputs are float64 precise
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
      continue
    if best is None or jnp.finfo(dt).nmant > jnp.finfo(best).nmant:
      best = dt
  return best if best is not None else np.dtype(np.float64)


class Level:
  """One program level, and the context rule facets are called with."""

  def __init__(self, an: Analyzer, program: Program):
    self.an = an
    self.program = program
    self._facts: dict = {}
    self._canon: dict = {}
    self.overrides: dict = {}
    self._memo: dict = {}
    self._compute_facts()

  # -- rule context: options -------------------------------------------------

  @property
  def cbwc(self) -> bool:
    return self.an.cbwc

  @property
  def tolerance(self):
    return self.an.tolerance

  @staticmethod
  def at_least_as_precise(a, b) -> bool:
    (ma, ea), (mb, eb) = compat.precision(a), compat.precision(b)
    return ma >= mb and ea >= eb

  @staticmethod
  def round_to(value: Fraction, dtype) -> Optional[Fraction]:
    dt = np.dtype(dtype)
    if jnp.issubdtype(dt, jnp.floating):
      with np.errstate(over="ignore"):
        r = np.asarray(float(value)).astype(dt)
      f = float(r)
      return Fraction(f) if math.isfinite(f) else None
    if dt == np.bool_:
      return Fraction(int(value != 0))
    if value.denominator != 1:
      return None
    info = np.iinfo(dt)
    return value if info.min <= value <= info.max else None

  # -- rule context: facts ---------------------------------------------------

  def facts(self, a: Any) -> Facts:
    if isinstance(a, Lit):
      return lit_facts(a)
    return self._facts.get(a) or Facts(size_one(a.shape))

  def is_zero(self, a: Any) -> bool:
    return self.facts(a).value == 0

  def constant_dims(self, a: Any, out_shape) -> frozenset:
    """Dims of ``out_shape`` along which operand ``a`` (broadcast) is constant."""
    const = operand_const(self, a, tuple(out_shape))
    if self.an.through_dropout and self.facts(a).random:
      self.an.random_uses += 1
      return frozenset(range(len(out_shape)))
    return const

  def constant_along(self, a: Any, dims, out_shape) -> bool:
    return set(dims) <= self.constant_dims(a, out_shape)

  @staticmethod
  def expr_constant_along(expr: A.Expr, d: int) -> bool:
    return A.expr_constant_along(expr, (d,))

  def _compute_facts(self) -> None:
    prog = self.program
    parent = prog.parent
    for i, v in enumerate(prog.invars):
      self._facts[v] = self._invar_facts(v, i, parent)
    for v in prog.consts:
      self._facts[v] = _const_facts(v)
    for node in prog.nodes:
      ins = [self.facts(a) for a in node.ins]
      try:
        outs = rule_for(node.prim).facts(node, ins, self)
      except Exception:  # noqa: BLE001 - a fact a rule cannot derive is just unknown
        outs = [Facts(size_one(o.shape)) for o in node.outs]
      keyed = _keyed(node.ins) or _keyed(node.outs)
      for o, f in zip(node.outs, outs):
        if keyed and not f.random:
          f = Facts(f.const, f.value, True)
        self._facts[o] = f

  def _invar_facts(self, v: Val, i: int, parent) -> Facts:
    random = compat.is_prng_key(v.dtype)
    base = Facts(size_one(v.shape), None, random)
    if parent is None:
      return base
    node, outer_prog = parent
    k = node.subs.index(self.program)
    return rule_for(node.prim).body_facts(node, k, i, self.an.level(outer_prog), base)

  # -- rule context: canonical forms ------------------------------------------

  def atom(self, v: Val) -> A.Expr:
    return A.atom(v, v.shape)

  def canon(self, a: Any) -> A.Expr:
    """The exact canonical expression of a value (iterative: streams are deep)."""
    if isinstance(a, Lit):
      return _lit_canon(a)
    memo = self._canon
    e = memo.get(a)
    if e is not None:
      return e
    stack = [a]
    expanded = set()   # values whose operands were pushed (not direct: no need to ask again)
    direct_canon = self._direct_canon
    while stack:
      v = stack[-1]
      if v in memo:
        stack.pop()
        continue
      if v not in expanded:
        direct = direct_canon(v)
        if direct is not None:
          memo[v] = direct
          stack.pop()
          continue
      node = v.producer
      pending = [x for x in node.ins if type(x) is Val and x not in memo]
      if pending:
        expanded.add(v)
        stack.extend(pending)
        continue
      stack.pop()
      # Every Val operand is in memo now (pending was empty).
      ins = [memo[x] if type(x) is Val else _lit_canon(x) for x in node.ins]
      try:
        outs = rule_for(node.prim).canon(node, ins, self)
      except Exception:  # noqa: BLE001 - an opaque atom is always sound
        outs = None
      for k, o in enumerate(node.outs):
        e = outs[k] if outs is not None else None
        # A long sum (a residual stream) stands for itself: cancellation
        # only ever needs the structure near one value, and expanding it
        # would make products grow quadratically. Boxed by its expression,
        # not by the value: equal expressions are equal values, so a
        # statistic the program computes twice is one symbol.
        if e is None:
          e = self.atom(o)
        elif len(e.terms) > CANON_TERMS:
          e = A.boxed(e, o.shape)
        memo[o] = e
    return memo[a]

  @contextlib.contextmanager
  def assuming(self, overrides: dict):
    """Canonical forms under ``overrides`` (e.g. removed reductions as zero)."""
    saved = self._canon, self.overrides
    self._canon, self.overrides = {}, dict(overrides)
    try:
      yield self
    finally:
      self._canon, self.overrides = saved

  def _direct_canon(self, v: Val) -> Optional[A.Expr]:
    if v in self.overrides:
      return self.overrides[v]
    f = self._facts.get(v)
    if f is not None and type(f.value) is Fraction:
      return A.const(A.snap(f.value, v.dtype))
    if v.producer is None or v.producer.subs:
      return self.atom(v)
    return None

  # -- obligation 1: the shift, forwards --------------------------------------

  def invisible(self, seeds: dict, skip: frozenset = frozenset()) -> Optional[str]:
    """None when no program output sees the shift in ``seeds``; else why."""
    reason, _ = self._run(dict(seeds), skip, collect=False)
    return reason

  def collect(self, seeds: dict) -> dict:
    """A body's output polys for input polys ``seeds``; raises Block."""
    reason, outputs = self._run(dict(seeds), frozenset(), collect=True)
    if reason is not None:
      raise Block(reason)
    return outputs

  def seed_through(self, node: Node, operand: int, poly: A.Poly) -> list:
    """Output polys of ``node`` when only ``operand`` carries ``poly``."""
    ins = [None] * len(node.ins)
    ins[operand] = poly
    return self._transfer(node, ins)

  def _transfer(self, node: Node, ins: list) -> list:
    if self.an.cbwc and node.custom_calls:
      c = node.custom_calls[-1]
      raise Block(f"the shift enters {c.kind} `{c.name}` (called at {c.source}); CBWC keeps "
                  "its custom differentiation rule, which would see different inputs")
    try:
      outs = rule_for(node.prim).shift(node, ins, self)
    except A.Unrepresentable as e:
      raise Block(f"the shift's expression grows too large to track exactly ({e})") from e
    return list(outs) + [None] * (len(node.outs) - len(outs))

  def _run(self, polys: dict, skip: frozenset, collect: bool):
    prog = self.program
    outputs: dict = {}
    for v, p in polys.items():
      for k in prog.output_positions.get(v, ()):
        if not collect:
          return f"the shift reaches program output #{k}", outputs
        outputs[k] = p
    consumers = prog.consumers
    # Only the nodes that read a live poly do anything (the memo below is
    # keyed by the state, which no other node changes): visit those, in
    # program order, from a heap of the live polys' consumers.
    todo = list({n.index for v in polys for n, _ in consumers.get(v, ())})
    if not todo:
      return None, outputs
    heapq.heapify(todo)
    nodes = prog.nodes
    last = prog.last_use
    tick = itertools.count()   # (heap ties: Vals do not compare)
    dying = [(last.get(v, -1), next(tick), v) for v in polys]   # by last use: when each dies
    heapq.heapify(dying)
    memo = self._memo
    trail: list = []
    result = None
    done = -1
    while todo:
      i = heapq.heappop(todo)
      if i <= done:
        continue
      done = i
      node = nodes[i]
      if len(polys) == 1 and not skip and not collect:
        (v, p), = polys.items()
        if p.is_pure:
          pat = (p.pattern(), A.replication_key(p))
          seen = memo.get((v, node.index))
          if seen is not None:
            hit = _memo_lookup(seen, pat)
            if hit is not _MISS:
              result = hit
              break
          trail.append((v, node.index, pat))
      if node.index in skip:
        continue
      ins = [polys.get(a) if isinstance(a, Val) else None for a in node.ins]
      if all(p is None for p in ins):
        continue
      try:
        outs = self._transfer(node, ins)
      except Block as e:
        result = f"{e} [at {node.where()}]"
        break
      for v, p in zip(node.outs, outs):
        if p is None:
          continue
        pos = prog.output_positions.get(v)
        if pos:
          if not collect:
            result = f"the shift reaches program output #{pos[0]} [from {node.where()}]"
            break
          for k in pos:
            outputs[k] = p
        polys[v] = p
        heapq.heappush(dying, (last.get(v, -1), next(tick), v))
        for n, _ in consumers.get(v, ()):
          heapq.heappush(todo, n.index)
      if result is not None:
        break
      while dying and dying[0][0] <= i:
        polys.pop(heapq.heappop(dying)[2], None)
      if not polys:
        break
    for v, index, pat in trail:
      memo.setdefault((v, index), {})[pat] = result
    return result, outputs

  # -- loop and branch bodies (for rules.control) -----------------------------

  def body(self, node: Node, k: int = 0) -> "Level":
    return self.an.level(node.subs[k])

  def invisible_inside(self, seeds: dict) -> Optional[str]:
    """``invisible`` for seeds inside this loop or branch body: the enclosing
    control-flow driver carries them out (fixed points included), and the
    enclosing level continues from the loop's outputs."""
    node, outer_prog = self.program.parent
    outer = self.an.level(outer_prog)
    try:
      outs = rule_for(node.prim).shift_inside(node, [None] * len(node.ins), outer, {self: seeds})
    except Block as e:
      return f"{e} [at {node.where()}]"
    except A.Unrepresentable as e:
      return f"the shift's expression grows too large to track exactly ({e})"
    out_seeds = {v: p for v, p in zip(node.outs, outs) if p is not None}
    if not out_seeds:
      return None
    if outer.program.is_top:
      return outer.invisible(out_seeds)
    return outer.invisible_inside(out_seeds)

  # -- obligation 2: zero-sum, backwards --------------------------------------

  def needs(self, v: Any, spec: tuple, stops: Optional[dict] = None,
            visited: Optional[list] = None) -> list:
    """What must hold for ``v`` to sum to zero over ``spec``: LeafNeeds and Blockers.

    ``stops`` maps values to the spec an auxiliary centering would give them:
    the walk ends there (a Blocker the planner turns into that centering).
    ``visited`` collects the (value, spec) pairs the walk passes through
    (candidate places for an auxiliary centering).
    """
    an, out = self.an, []
    stops = stops or {}
    outer, an.walk = an.walk, _Walk({}, [], stops, visited, frozenset(stops.items()))
    try:
      self._walk(v, spec, None, (), out, v, spec)
    finally:
      an.walk = outer
    return out

  def _walk(self, v, spec, use, chain, out, top_var, top_spec) -> None:
    """``_walk_fresh`` with its effect memoised across the walks of one analysis.

    The walks of successive sites share their upstream (site k's input is
    the residual stream that every earlier site's input flows into), so
    without this the planner's walks are quadratic in the depth. A call's
    effect (the needs and visits it appends, the walk keys it marks seen, the
    dropout masks it consults) depends only on its arguments, the stops and
    which keys were already seen; it is replayed only when it met no key
    seen before it began, and none of its keys is seen now: exactly what
    the walk itself would do.
    """
    an = self.an
    key = (id(self), v if isinstance(v, Val) else id(v), spec, id(use[0]) if use else None, use[1] if use else None)
    walk = an.walk
    seen = walk.seen
    pos = seen.get(key)
    if pos is not None:
      if pos < walk.hit:
        walk.hit = pos
      return
    visiting = walk.visited is not None
    mkey = (key, chain, top_var if isinstance(top_var, Val) else id(top_var), top_spec, walk.stops_key, visiting)
    hit = an._walk_memo.get(mkey)
    if hit is not None and seen.keys().isdisjoint(hit[0]):
      added, outs, visits, randoms = hit
      log = walk.log
      n = len(log)
      for i, k in enumerate(added):
        seen[k] = n + i
      log.extend(added)
      out.extend(outs)
      if visiting:
        walk.visited.extend(visits)
      an.random_uses += randoms
      return
    start = len(walk.log)
    seen[key] = start
    walk.log.append(key)
    outer_hit, walk.hit = walk.hit, _NEVER
    n_out, n_vis, randoms = len(out), len(walk.visited) if visiting else 0, an.random_uses
    self._walk_fresh(v, spec, use, chain, out, top_var, top_spec)
    inner_hit = walk.hit
    walk.hit = min(outer_hit, inner_hit)
    if inner_hit >= start:   # it met no key seen before it began: its effect is its own
      added = tuple(walk.log[start:])
      an._walk_memo[mkey] = (added, tuple(out[n_out:]),
                             tuple(walk.visited[n_vis:]) if visiting else (), an.random_uses - randoms)

  def _walk_fresh(self, v, spec, use, chain, out, top_var, top_spec) -> None:
    an, walk = self.an, self.an.walk
    if self.is_zero(v):
      return
    if isinstance(v, Lit):
      out.append(Blocker(v, spec, "a non-zero literal"))
      return
    if walk.stops and walk.stops.get(v) == spec:
      out.append(Blocker(v, spec, "centered by an auxiliary centering"))
      return
    if walk.visited is not None and spec:
      walk.visited.append((v, spec))
    prog = self.program
    if prog.is_top and (v.kind == "in" and v.index < an.num_leaves or v.kind == "const"):
      out.append(LeafNeed(v, spec, use, top_var, top_spec, chain))
      return
    if v.kind == "const":
      out.append(Blocker(v, spec, "a constant captured inside a loop body"))
      return
    node = v.producer
    if node is None:
      if prog.parent is not None:
        return self._loop_input(v, spec, out, use, chain, top_var, top_spec)
      out.append(Blocker(v, spec, "a program input (not a parameter)"))
      return
    rule = rule_for(node.prim)
    # A sum whose terms cancel over the blocks (``h - mean(h)``, a centering the
    # user wrote) is zero-sum whatever its operands are: decided on the exact
    # canonical form, before the facet asks the operands for more than needed.
    additive = rule.arith == "+" or rule.epilogue == "subtract"
    written = self.zero_as_written(v, spec) if additive else None
    if written is not None:
      if written is not True:
        out.append(Blocker(v, spec, f"{written} [at {node.where()}]"))
      return
    try:
      reqs = rule.zero_sum(node, v.index, spec, self)
    except Block as e:
      if not additive:   # (an additive node's form was asked above: it does not cancel)
        written = self.zero_as_written(v, spec)
      if written is not True:
        out.append(Blocker(v, spec, f"{written or e} [at {node.where()}]"))
      return
    for r in reqs:
      if r.source is not None:
        self._fresh(r, out)
        continue
      a = node.ins[r.operand]
      if r.transparent and len(node.ins) == 1:
        self._walk(a, r.spec, use, chain + (node,), out, top_var, top_spec)
      else:
        self._walk(a, r.spec, (node, r.operand), (), out, v, spec)

  def zero_as_written(self, v: Val, spec: tuple):
    """True when ``v``'s exact canonical form sums to zero over every block of
    ``spec``, for all parameter and input values (an identity, so it needs
    nothing centered), computed at least as precisely as the outputs; a
    reason when it sums to zero only in real arithmetic; None when it does
    not (or cannot tell: concrete sizes only)."""
    shape = tuple(v.shape)
    blocks = dict(spec)
    if not all(isinstance(n, int) for n in shape) or any(
        not isinstance(b, int) or b <= 0 or shape[d] % b for d, b in blocks.items()):
      return None
    split, axes = layout.blocks(shape, blocks)
    if not axes:
      return None
    try:
      e = self.canon(v)
      if not e.is_zero:
        if split != shape:
          e = A.view_op(e, split, lambda view: view.reshape(split), ("zero-sum blocks", split))
        if not A.reduce_sum(e, axes, split).is_zero:
          return None
    except Exception:  # noqa: BLE001 - an expression the algebra cannot sum proves nothing
      return None
    coarse = self._coarse_cancellation(v)
    if coarse is None:
      return True
    return (f"it sums to zero as written in real arithmetic, but `{coarse.prim.name}` computes part of it in "
            f"{np.dtype(coarse.outs[0].dtype).name}, coarser than the program's outputs "
            f"({np.dtype(self.tolerance).name}) [at {coarse.where()}]")

  _CANCEL_CONE = 64

  def _coarse_cancellation(self, v: Val) -> Optional[Node]:
    """A node of the arithmetic that cancels in ``v``'s canonical form that
    runs coarser than the program's outputs, else None: the canonical form is real
    arithmetic, so ``q - mean(q)`` computed in float32 inside a float64
    program sums to float32 rounding, not to zero at the outputs' precision.
    Walks back from ``v`` to the opaque values its form is written in (a
    single factor: whatever rounding made it, both sides read the same one);
    a cast is not arithmetic (a coarse one is opaque, a fine one exact)."""
    tol = self.tolerance
    todo, seen = [v], set()
    while todo:
      u = todo.pop()
      node = u.producer
      if u in seen or node is None or node.subs:
        continue
      seen.add(u)
      if len(seen) > self._CANCEL_CONE:
        return node
      if u is not v:
        e = self.canon(u)
        if len(e.terms) == 1 and next(iter(e.terms.values())) == 1 and len(next(iter(e.terms))) == 1:
          continue
      if rule_for(node.prim).cast is None and any(
          compat.is_floating(o.dtype) and not self.at_least_as_precise(o.dtype, tol) for o in node.outs):
        return node
      todo.extend(a for a in node.ins if isinstance(a, Val))
    return None

  def _fresh(self, r, out) -> None:
    """A ``Need`` on a value of its own (``source``, in program ``at`` or here):
    a new use, so no untied copy is taken through it."""
    lv = self if r.at is None else self.an.level(r.at)
    lv._walk(r.source, r.spec, None, (), out, r.source, r.spec)

  def _loop_input(self, v, spec, out, use=None, chain=(), top_var=None, top_spec=()) -> None:
    """A body input: the enclosing equation's rule says what it reads."""
    node, outer_prog = self.program.parent
    outer = self.an.level(outer_prog)
    try:
      reqs = rule_for(node.prim).body_zero_sum(node, node.subs.index(self.program), v.index, spec, outer)
    except Block as e:
      out.append(Blocker(v, spec, str(e)))
      return
    for r in reqs:
      if r.source is not None:
        outer._fresh(r, out)
      elif r.transparent:
        # The body reads the outer operand unchanged: a use inside the body is
        # still a use of it (an untied copy can stand in there).
        a = node.ins[r.operand]
        outer._walk(a, r.spec, use, chain, out, top_var if use is not None else a,
                    top_spec if use is not None else r.spec)
      else:
        outer._walk(node.ins[r.operand], r.spec, None, (), out, node.ins[r.operand], r.spec)


_MISS = object()


def _memo_lookup(seen: dict, pat: tuple):
  """The memoised result for a pure shift of pattern ``pat`` on one value.

  Exact hits return what was found. Otherwise a shift proved invisible for a
  more general pattern is invisible for ``pat`` too: every tensor ``pat``
  allows is one the general pattern allows. (A blocked general pattern says
  nothing about ``pat``, so only invisibility carries over.)
  """
  if pat in seen:
    return seen[pat]
  dims, rep = pat
  for (general, grep), result in seen.items():
    # (a shift the same in every shard is one arbitrary shift: only the latter subsumes the former)
    if result is None and (grep is None or grep == rep) and _subsumes(general, dims):
      return None
  return _MISS


def _subsumes(general: tuple, special: tuple) -> bool:
  """Whether every shift of pattern ``special`` is one of pattern ``general``.

  ``general`` must vary independently along each of its dims (distinct
  labels: an arbitrary tensor over them), and wherever ``special`` varies,
  ``general`` varies on blocks that tile ``special``'s blocks.
  """
  labels = [e[0] for e in general if e is not None]
  if len(labels) != len(set(labels)) or len(general) != len(special):
    return False
  for g, s in zip(general, special):
    if s is None:
      continue
    if g is None or s[1] % g[1]:
      return False
  return True


def _lit_canon(a: Lit) -> A.Expr:
  v = np.asarray(a.value)
  if v.size == 1:
    # A constant (no factor: valid in every scope) of the literal's bytes;
    # programs repeat a few literals many times.
    key = (v.dtype, v.shape, v.tobytes())
    e = _LIT_CANON.get(key, _MISS)
    if e is _MISS:
      k = A.exact(v.reshape(()))
      e = A.const(A.snap(k, v.dtype)) if k is not None else None
      if len(_LIT_CANON) > 4096:
        _LIT_CANON.clear()
      _LIT_CANON[key] = e
    if e is not None:
      return e
  return A.atom(("lit", v.dtype.str, v.shape, v.tobytes()), tuple(v.shape))


_LIT_CANON: dict = {}


_CONST_SCAN_LIMIT = 1 << 20


def _const_facts(v: Val) -> Facts:
  """Facts of a captured constant, read from its value when it is small."""
  shape = v.shape
  base = size_one(shape)
  c = v.const
  try:
    arr = np.asarray(c)
  except Exception:  # noqa: BLE001 - tracers, deleted buffers: nothing known
    return Facts(base)
  if arr.size == 0 or arr.size > _CONST_SCAN_LIMIT or arr.dtype.kind not in "biuf":
    return Facts(base)
  const = set(base)
  for d in range(arr.ndim):
    if np.array_equal(arr, np.take(arr, [0], axis=d).repeat(arr.shape[d], axis=d)):
      const.add(d)
  value = None
  if len(const) == arr.ndim:
    value = A.exact(arr.reshape(-1)[0])
  return Facts(frozenset(const), value)


# ----------------------------------------------------------------------------
# Sites.

_PASS = ("identity", "layout")


def find_sites(level: Level) -> list:
  """Mean reductions: sums (``reduce_sum``, a contraction with ones) whose
  result removes a shift of the summed value, i.e. is subtracted from it in
  whatever spelling the program uses."""
  sites: dict = {}
  prog = level.program
  for node in prog.nodes:
    summed = rule_for(node.prim).sums(node, level)
    if summed is None or not isinstance(node.ins[summed[0]], Val):
      continue
    k, axes = summed
    u = node.ins[k]
    root = _strip(u, _PASS)
    across = next((a for a in (_is_subtracted(level, node.outs[0], r) for r in _roots(level, root))
                   if a is not None), None)
    if across is None:
      across = next((a for a in (_shift_cancels(level, node, u, axes, r)
                                 for r in _roots(level, _strip(u, ("identity",)))) if a is not None), None)
    if across is None:
      continue
    key = (u, tuple(axes), across)
    if key in sites:
      sites[key] = dataclasses.replace(sites[key], reduces=sites[key].reduces + (node,))
    else:
      sites[key] = MeanSite((node,), u, tuple(axes), level, across)
  return sorted(list(sites.values()) + _loop_means(level), key=lambda s: s.node.index)


def _loop_means(level: Level) -> list:
  """Values subtracted from ``h`` like a mean (broadcast along some of its
  axes) that a loop or branch reading ``h`` computes (a Welford update or a
  chunked sum in a ``scan``): reported as sites jaxfold does not recognise,
  with that reason, instead of not at all. Never folded."""
  out, seen = [], set()
  prog = level.program
  for node in prog.nodes:
    if rule_for(node.prim).epilogue != "subtract" or not all(isinstance(a, Val) for a in node.ins):
      continue
    h, m = node.ins
    root, shape = _strip(h, _PASS), node.outs[0].shape
    if len(m.shape) != len(shape):
      continue
    axes = tuple(d for d in range(len(shape)) if m.shape[d] == 1 != shape[d])
    src = _strip(m, _PASS)
    while isinstance(src, Val) and src.producer is not None and rule_for(src.producer.prim).kind == "scale":
      # (a sum scaled by a known constant, acc / n)
      ops = [a for a in src.producer.ins if not (isinstance(a, Lit) or level.facts(a).value is not None)]
      if len(ops) != 1:
        break
      src = _strip(ops[0], _PASS)
    loop = src.producer if isinstance(src, Val) else None
    if not axes or h.shape != shape or loop is None or not loop.subs or (loop, axes) in seen:
      continue
    if not any(_strip(a, _PASS) is root for a in loop.ins if isinstance(a, Val)):
      continue
    seen.add((loop, axes))
    out.append(MeanSite((loop,), h, axes, level, unrecognised=(
        f"`{node.prim.name}` subtracts from its input a value that a `{loop.prim.name}` reading that input "
        f"computes [at {loop.where()}]: a mean accumulated in a loop or branch (a Welford update, a chunked "
        "sum) is not recognised as a mean, so it is not removed (written as a sum or jnp.mean over the "
        "axes, it would be)")))
  return out


_CANCEL_STEPS = 64
_CANCEL_DEPTH = 12


def _roots(level: Level, root: Any) -> tuple:
  """``root``, then the value it scales by a known constant where it does."""
  un = _unscaled(level, root)
  return (root,) if un is root else (root, un)


def _shift_cancels(level: Level, reduce: Node, u: Val, axes: tuple, root: Any) -> Optional[tuple]:
  """Whether a shift of ``u`` constant along ``axes``, carried through this
  sum, cancels against the shift ``u`` carries directly within a few steps:
  None if not, else the mesh axes a psum on the way sums it across (``()``
  for none; the seed counts as the same in every shard, so a mean over a
  sharded axis is found: whether it is one is proved per site).

  That is what makes a sum a norm's mean whatever the spelling: ``h - m``,
  ``E[h²] - m²``, ``h*inv - m*inv`` (Keras) all cancel; a mean pooling or an
  RMS statistic does not. Detection only: soundness is proved per site.
  The shift is seeded at ``root`` (``u`` itself, or what ``u`` scales by a
  known constant: ``jnp.average``'s ``h·w``).
  """
  seed = root if isinstance(root, Val) and root.shape == u.shape else u
  consumers = level.program.consumers
  # The seed must reach the cancelling node along two paths: a value read
  # only by this sum (a variance's squares, say) cannot cancel.
  if len(consumers.get(seed, ())) < 2 and (seed is u or len(consumers.get(u, ())) < 2):
    return None
  # Only the few steps after the sum matter (a norm is short); the stream
  # that continues past it is not followed.
  last, frontier, seen = reduce.index, [reduce.outs[0]], set()
  for _ in range(_CANCEL_DEPTH):
    nxt = []
    for v in frontier:
      for n, _ in consumers.get(v, ()):
        if n.index not in seen:
          seen.add(n.index)
          last = max(last, n.index)
          nxt.extend(n.outs)
    frontier = nxt
  polys = {seed: A.pure(tuple(None if d in axes else (None, 1) for d in range(len(u.shape))))}
  A.replicate(polys[seed], A.ANY_AXES)
  cone = {reduce.outs[0]}
  across: set = set()
  nodes = level.program.nodes
  todo = [n.index for n, _ in consumers.get(seed, ())]   # the readers of polys, as in Level._run
  heapq.heapify(todo)
  steps, done = 0, -1
  while todo:
    i = heapq.heappop(todo)
    if i <= done:
      continue
    if i > last:
      break
    done = i
    node = nodes[i]
    ins = [polys.get(a) if isinstance(a, Val) else None for a in node.ins]
    if all(p is None for p in ins):
      continue
    steps += 1
    if steps > _CANCEL_STEPS:
      return None
    try:
      outs = level._transfer(node, ins)
    except Exception:  # noqa: BLE001 - a step the rules cannot follow ends that path
      continue
    from_mean = any(p is not None and a in cone for a, p in zip(node.ins, ins))
    if from_mean:
      if sum(p is not None for p in ins) > 1 and all(p is None for p in outs):
        return tuple(sorted(across))
      cone.update(node.outs)
      over = rule_for(node.prim).across
      if over is not None:
        names = over(node)
        if names is None:
          return None
        across.update(names)
    for v, p in zip(node.outs, outs):
      if p is not None:
        polys[v] = p
        for n, _ in consumers.get(v, ()):
          heapq.heappush(todo, n.index)
  return None


def _strip(v: Any, kinds: tuple) -> Any:
  while isinstance(v, Val) and v.producer is not None:
    node = v.producer
    if rule_for(node.prim).kind in kinds and len(node.ins) == 1:
      v = node.ins[0]
    else:
      break
  return v


def _unscaled(level: Level, v: Any) -> Any:
  """``x`` where ``v = x * k`` with ``k`` a known non-zero constant of any shape
  (``jnp.average``'s weights of ones, summed as ``Σ h·w / Σ w``), else ``v``.
  Detection only: the site's input stays ``v``, whose zero sum the walk proves."""
  node = v.producer if isinstance(v, Val) else None
  if node is None or rule_for(node.prim).arith != "*" or len(node.ins) != 2:
    return v
  for i in (0, 1):
    x, k = node.ins[i], node.ins[1 - i]
    value = level.facts(k).value
    if isinstance(x, Val) and x.shape == v.shape and value is not None and value != 0:
      return _strip(x, _PASS)
  return v


def _is_subtracted(level: Level, mean: Val, root: Any) -> Optional[tuple]:
  """None unless ``mean`` (scaled by constants, re-indexed, summed across
  shards by a psum) is subtracted from ``root``; else the mesh axes the psums
  on the way sum it across (``()`` for none)."""
  prog = level.program
  frontier, seen = [(mean, ())], set()
  while frontier:
    v, across = frontier.pop()
    if v in seen:
      continue
    seen.add(v)
    for node, k in prog.consumers.get(v, ()):
      rule = rule_for(node.prim)
      kind = rule.kind
      if rule.epilogue == "subtract" and k == 1:
        if _strip(node.ins[0], _PASS) is root:
          return across
      scalar_scale = kind == "scale" and all(
          isinstance(a, Lit) or not a.shape or level.facts(a).value is not None
          for a in node.ins if a is not v)
      if kind in _PASS or scalar_scale:
        frontier.append((node.outs[0], across))
      elif rule.across is not None and k < len(node.outs):
        names = rule.across(node)
        if names is not None:
          frontier.append((node.outs[k], tuple(sorted(set(across) | set(names)))))
  return None


def nested_sites(level: Level) -> list:
  """Sites in bodies the analysis does not enter: none (scan, cond and while
  bodies are all analysed); kept for the report's interface."""
  return []


def scan_levels(level: Level) -> list:
  """This level and every loop or branch body below it (where sites can fold)."""
  out = [level]
  for n in level.program.nodes:
    for sub in n.subs:
      out += scan_levels(level.an.level(sub))
  return out


def where(v: Any) -> str:
  """A readable location of a value."""
  if isinstance(v, Val) and v.producer is not None:
    return v.producer.where() or f"the output of `{v.producer.prim.name}`"
  if isinstance(v, Val) and v.kind == "in":
    if v.program.parent is not None:
      node = v.program.parent[0]
      return f"input #{v.index} of a `{node.prim.name}` body [at {node.where()}]"
    return f"program input #{v.index}"
  return "a constant"


__all__ = ["Analyzer", "Blocker", "LeafNeed", "Level", "MeanSite", "call_note", "factor_leaf", "find_sites",
           "leaf_of", "nested_sites", "scan_levels", "vector_along", "where"]


# ----------------------------------------------------------------------------
# Parameters in canonical expressions: the matching that fuse_affine, rotate
# and defer_norms share (``γ ⊙ K + β``, a parameter vector along one dim).


def leaf_of(v: Any, level: Level) -> Optional[int]:
  """The parameter leaf index of ``v`` when it is a top-level parameter input."""
  if (isinstance(v, Val) and v.kind == "in" and v.program is level.program
      and level.program.is_top and v.index < level.an.num_leaves):
    return v.index
  return None


def param_operand(level: Level, a: Any):
  """``(leaf index, chain)`` when ``a`` is a parameter seen through single-operand
  re-indexing steps (identity or layout rules), the chain's nodes leaf-first; else None."""
  chain = []
  while isinstance(a, Val) and leaf_of(a, level) is None and a.producer is not None:
    node = a.producer
    if rule_for(node.prim).kind not in ("identity", "layout") or len(node.ins) != 1:
      return None
    chain.append(node)
    a = node.ins[0]
  i = leaf_of(a, level)
  return None if i is None else (i, tuple(reversed(chain)))


def single_use(level: Level, leaf: int, chain: tuple, use: tuple) -> bool:
  """Parameter ``leaf`` reaches only ``use`` (a ``(node, operand index)``), through
  ``chain`` (as ``param_operand`` returns it), and no program output."""
  prog = level.program
  v = prog.invars[leaf]
  for node in chain + (None,):
    if v in prog.output_positions:
      return False
    uses = prog.consumers.get(v, ())
    target = (node, 0) if node is not None else use
    if len(uses) != 1 or uses[0][0] is not target[0] or uses[0][1] != target[1]:
      return False
    if node is not None:
      v = node.outs[0]
  return True


def factor_leaf(fid: int, level: Level):
  """(leaf index, View) when the factor is a parameter or a view of one."""
  f = A.factor(fid)
  if f.kind == "atom":
    i = leaf_of(f.key, level)
    return (i, A.View.identity(f.shape)) if i is not None else None
  if f.kind == "view":
    base = A.factor(f.args[0])
    if base.kind == "atom":
      i = leaf_of(base.key, level)
      if i is not None:
        return i, f.key
  return None


def vector_along(view: A.View, shape: tuple) -> Optional[int]:
  """The dim along which the view reads its whole (flattened) source in
  order, constant along every other dim; else None."""
  varying = [d for d, s in enumerate(view.strides) if s != 0]
  if len(varying) != 1:
    return None
  d = varying[0]
  n = int(np.prod(view.src)) if view.src else 1
  if view.strides[d] == 1 and view.offset == 0 and shape[d] == n:
    return d
  return None
