"""``jaxfold.rotate``: an orthogonal change of basis of the residual stream, proved exact.

Every parameter that touches the stream is replaced by ``p ×_d Q`` along its
stream dim d: writers (output projections, embeddings, position tables,
biases) and readers (input projections, heads; ``(xQ)·(Qᵀ W) = x·W``). The
program is unchanged. The proof follows the rotation forwards through the
traced program with the rules' ``rotate`` facets (``rules.rotation``): every
value is unchanged, rotated (``Lin``) or a sum of squares of rotated values
(``Quad``, unchanged once summed: the parameter-free RMS norm), and no output
may be anything but unchanged. Which parameters to rotate is proposed by the
zero-sum analysis (what writes each norm's input) and completed where a
facet asks for a rotated operand (``Want``); the forward pass alone decides.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxfold._src import compat, compiled, display, kernels, pipeline
from jaxfold._src.analysis import LeafNeed, Level, factor_leaf, leaf_of
from jaxfold._src.errors import RotateError
from jaxfold._src.fold import FoldedApply
from jaxfold._src.hadamard import hadamard, random_orthogonal
from jaxfold._src.hints import rotation_aux_hint
from jaxfold._src.pipeline import Call
from jaxfold._src.program import Val
from jaxfold._src.report import param_label
from jaxfold._src.rewrite import Plan, RotationAt
from jaxfold._src.rules import Block, rule_for
from jaxfold._src.rules.rotation import Lin, Quad, Want
from jaxfold._src.step import RestoreContext, Restored, Result, Step, StepRecord, digest, register


@dataclasses.dataclass(frozen=True)
class RotateReport:
  """What ``rotate`` changed: ``rotated`` is ``((leaf name, dims), ...)``;
  ``inserted``: one line per rotation the program computes (``x @ Q`` where a
  stream starts at a value no parameter writes, ``y @ Qᵀ`` where it reaches an
  output), empty when only parameters were rotated."""
  rotated: tuple
  norms: int            # parameter-free norms whose input is the rotated stream
  size: int
  inserted: tuple = ()

  def __str__(self) -> str:
    lines = [f"rotated the residual stream (d={self.size}) through {self.norms} norm(s); "
             f"{len(self.rotated)} parameters rotated:"]
    lines += [f"  {param_label(name)} along dim {', '.join(map(str, dims))}" for name, dims in self.rotated]
    if self.inserted:
      lines.append(f"{len(self.inserted)} rotation(s) computed in the program (a {self.size}x{self.size} "
                   "matrix product per row each):")
      lines += [f"  {why}" for why in self.inserted]
    return "\n".join(lines)


class Rotated(Result):
  """Result of :func:`rotate` (a ``step.Result``): ``apply_fn(params, *args)``
  computes the original; ``params`` has the structure of the model rotated
  (a ``jaxfold.Params``), ``report`` is a :class:`RotateReport`."""
  __slots__ = ()
  __repr__ = display.result_repr

  @property
  def stream_axes(self) -> dict:
    """``{leaf name: dims}``: where each rotated parameter meets the stream. A
    parameter of the user's is named by its path in the user's parameters
    (``"['params']['wte']['embedding']"``); one that fuse_affine made (an untied
    copy, a new bias) by its path in ``params`` (``".extras[...]"``).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, flax.linen as nn, jaxfold
      >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(3)])
      >>> x = jnp.ones((2, 4)); p = m.init(jax.random.PRNGKey(0), x)
      >>> fused = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
      >>> q = np.linalg.qr(np.random.default_rng(0).normal(size=(8, 8)))[0]
      >>> sorted(jaxfold.rotate(fused, q).stream_axes)
      ["['params']['layers_0']['bias']", "['params']['layers_0']['kernel']", "['params']['layers_2']['kernel']"]
    """
    return {_user_path(name): dims for name, dims in self.report.rotated}


def _user_path(name: str) -> str:
  """A leaf's path in the user's parameters (``jaxfold.Params.params``), else unchanged."""
  prefix = ".params"
  if name.startswith(prefix) and name[len(prefix):len(prefix) + 1] in ("[", "."):
    return name[len(prefix):]
  return name


# ----------------------------------------------------------------------------
# The proof.


def _norm_inputs(level: Level, n: int) -> list:
  """``(x, axis)`` for every sum over an axis of size n (a ``reduce_sum`` or a
  contraction with a constant, the fold's mean spellings: the rules' ``sums``)
  of what the rotation facets show to be a sum of squares of ``x`` (the RMS of
  ``x``), where the summing node's own facet shows its output unchanged, and
  for every contraction of ``x`` with itself over such an axis."""
  out = []
  for node in level.program.nodes:
    rule = rule_for(node.prim)
    gram = _self_contraction(node, level, n)
    if gram is not None:
      out.append(gram)
      continue
    try:
      summed = rule.sums(node, level)
    except Block:
      continue
    if summed is None or len(summed[1]) != 1:
      continue
    k, (axis,) = summed
    v = node.ins[k]
    if not isinstance(v, Val) or v.producer is None or v.shape[axis] != n:
      continue
    pn = v.producer
    for x in {a for a in pn.ins if isinstance(a, Val) and a.shape == v.shape}:
      lin = Lin(frozenset({axis}))
      try:
        outs = rule_for(pn.prim).rotate(pn, [lin if a is x else None for a in pn.ins], level)
        if outs[v.index] != Quad(axis):
          continue
        summed_states = rule.rotate(node, [Quad(axis) if j == k else None for j in range(len(node.ins))], level)
      except Block:
        continue
      if all(s is None for s in summed_states):
        out.append((x, axis))
        break
  return out


def _self_contraction(node: Any, level: Level, n: int) -> Optional[tuple]:
  """``(x, axis)`` where ``node`` contracts ``x`` with itself over one axis of
  size n, row by row (a variance as ``einsum('...d,...d->...', x, x)``:
  ``<xQ, xQ> = <x, x>``), as its rotate facet shows; else None."""
  dd = rule_for(node.prim).contraction(node)
  if dd is None or len(node.ins) != 2 or node.ins[0] is not node.ins[1] or not isinstance(node.ins[0], Val):
    return None
  if len(dd.lc) != 1 or tuple(dd.lc) != tuple(dd.rc) or node.ins[0].shape[dd.lc[0]] != n:
    return None
  if tuple(dd.lb) != tuple(dd.rb) or len(dd.lb) + 1 != len(node.ins[0].shape):
    return None   # (row by row only: a Gram matrix x·xᵀ is no norm)
  lin = Lin(frozenset({dd.lc[0]}))
  try:
    outs = rule_for(node.prim).rotate(node, [lin, lin], level)
  except Block:
    return None
  return (node.ins[0], dd.lc[0]) if all(s is None for s in outs) else None


def _leaf_dims(level: Level, a: Any, dims: frozenset) -> Optional[tuple]:
  """(leaf index, leaf dims) when ``a`` is a view of a parameter in which
  each of ``dims`` reads one whole parameter dim, untouched by the others."""
  e = level.canon(a)
  if len(e.terms) != 1:
    return None
  (m, c), = e.terms.items()
  if c != 1 or len(m) != 1:
    return None
  lv = factor_leaf(m[0], level)
  if lv is None:
    return None
  i, view = lv
  src = view.src
  lstrides = [int(np.prod(src[k + 1:])) for k in range(len(src))]
  out = []
  for d in dims:
    match = [k for k in range(len(src)) if src[k] == a.shape[d] and src[k] > 1
             and view.strides[d] == lstrides[k]]
    if len(match) != 1:
      return None
    k = match[0]
    ls, nk = lstrides[k], src[k]
    if (view.offset // ls) % nk:
      return None
    inner = view.offset % ls
    for j, s in enumerate(view.strides):
      if j == d or s == 0 or abs(s) % (ls * nk) == 0:
        continue
      if s < 0:
        return None
      inner += s * (a.shape[j] - 1)
    if inner >= ls:  # the other dims' offsets would carry into dim k
      return None
    out.append(k)
  return i, frozenset(out)


def _writers(level: Level, a: Any, dims: frozenset, depth: int = 12, memo: Optional[dict] = None) -> Optional[dict]:
  """``{leaf index: dims}``: parameters whose rotation would make ``a`` rotated
  along ``dims`` (``Lin(dims)``), found backwards: ``a`` is a parameter seen
  through re-indexing, or a node whose own rotation facet, given one operand
  rotated (and every operand it then asks for, ``Want``), outputs ``a`` so
  rotated (a writer ``o @ Wo + b`` however ``o`` was computed, an embedding
  lookup plus a position table). A proposal only: the forward pass proves."""
  hit = _leaf_dims(level, a, dims)
  if hit is not None:
    return {hit[0]: hit[1]}
  node = getattr(a, "producer", None)
  if node is None or depth == 0 or len(dims) != 1:
    return None
  memo = {} if memo is None else memo   # (a residual chain with T == d would branch at every add)
  if (a, dims) not in memo:
    memo[(a, dims)] = None              # (a cycle through it proposes nothing)
    memo[(a, dims)] = _writers_of(level, node, a, dims, depth, memo)
  return memo[(a, dims)]


def _writers_of(level: Level, node: Any, a: Any, dims: frozenset, depth: int, memo: dict) -> Optional[dict]:
  size = a.shape[next(iter(dims))]
  rule = rule_for(node.prim)
  for k, b in enumerate(node.ins):
    if not isinstance(b, Val) or level.facts(b).value == 0:
      continue
    for d in range(len(b.shape)):
      if b.shape[d] != size:
        continue
      states = [None] * len(node.ins)
      states[k] = Lin(frozenset({d}))
      for _ in range(len(node.ins)):
        try:
          outs = rule.rotate(node, states, level)
        except Want as w:
          if states[w.operand] is not None or not isinstance(node.ins[w.operand], Val):
            break
          states[w.operand] = Lin(w.dims)
          continue
        except Block:
          break
        if outs[a.index] != Lin(dims):
          break
        found: dict = {}   # every rotated operand's writers, agreeing on shared leaves
        for j, st in enumerate(states):
          sub = None if st is None else _writers(level, node.ins[j], st.dims, depth - 1, memo)
          if st is not None and (sub is None or any(found.get(i, q) != q for i, q in sub.items())):
            break
          found.update(sub or {})
        else:
          return found
        break
  return None


def _propagate(level: Level, seeds: dict, inserted: dict, ends: Optional[dict], n: int = 0):
  """Forward states from rotated parameters and inserted rotations (``inserted``:
  value -> its state once multiplied by Q where it is made): the states, or
  (Want, node) / a reason. With ``ends`` a dict (rotations may be inserted), a
  rotated stream may also leave: a program output reached rotated along one
  dim of size ``n`` is recorded as ``ends[("output", i)] = dim``, and an
  operation that would block on such an operand reads it un-rotated instead,
  ``ends[(path, "operand", k)] = dim`` (the rewrite multiplies each by Qᵀ);
  with ``ends=None`` both are refused."""
  prog = level.program
  exits: list = []   # (node, why): where the stream was un-rotated before an operation
  rounded: set = set()   # rotated values rounded on the way (a narrowing cast): y @ Qᵀ would not undo that
  states = {prog.invars[i]: Lin(frozenset(d)) for i, d in seeds.items()}
  for v, s in inserted.items():
    if v.producer is None:
      if v in states:
        return f"an inserted rotation of a rotated parameter [{v.key}]"
      states[v] = s
  for v in list(states):
    if v in prog.output_positions:
      why = _end(prog, v, states[v], ends, n, "a rotated parameter")
      if why is not None:
        return why
  for node in prog.nodes:
    ins = [states.get(a) if isinstance(a, Val) else None for a in node.ins]
    outs = [None] * len(node.outs)
    if any(s is not None for s in ins):
      try:
        outs = rule_for(node.prim).rotate(node, ins, level)
      except Want as w:
        return (w, node)
      except Block as err:
        cut = _leaving(node, ins, ends, n, rounded)
        if cut is None:
          return _Blocked(node, f"{err} [at {node.where()}]", states)
        ends.update(cut)   # (the node reads what it read before: its outputs are unchanged)
        exits.append((node, f"{err} [at {node.where()}]"))
    for k, o in enumerate(node.outs):
      if o in inserted:
        if outs[k] is not None:
          return f"a value rotated twice (an inserted rotation of a rotated value) [at {node.where()}]"
        outs[k] = inserted[o]
    if any(s is not None for s in outs) and (_rounds(node) or any(a in rounded for a in node.ins)):
      rounded.update(o for o, s in zip(node.outs, outs) if s is not None)
    why = advance(prog, node, outs, states, ends, n, rounded)
    if why is not None:
      return why
  for node, why in exits:
    if _rejoins(prog, node, states):
      return _Blocked(node, f"{why}; the rotated stream may end there (y @ Qᵀ) only where nothing "
                            "after it is rotated again, and here the stream goes on", states)
  return states


class _Blocked(NamedTuple):
  """The forward pass stopped: ``node`` cannot take its rotated operands."""
  node: Any
  why: str
  states: dict


def _blocked_site(b: _Blocked, sites: list) -> Optional[tuple]:
  """The norm site ``(x, axis)`` nearest upstream of the blocked node through
  rotated values: the norm whose output the stream could not carry on (a
  post-LN or embedding LayerNorm keeping its γ, whose output starts the stream)."""
  by_x = {x: (x, axis) for x, axis in sites}
  seen, layer = set(), [a for a in b.node.ins if isinstance(a, Val) and b.states.get(a) is not None]
  while layer:
    nxt = []
    for v in layer:
      if v in seen:
        continue
      seen.add(v)
      if v in by_x:
        return by_x[v]
      node = v.producer
      if node is not None:
        nxt += [a for a in node.ins if isinstance(a, Val) and b.states.get(a) is not None]
    layer = nxt
  return None


def _rejoins(prog: Any, node: Any, states: dict) -> bool:
  """Whether a value computed from ``node``'s outputs is rotated (the stream goes on after it)."""
  seen, todo = set(), list(node.outs)
  while todo:
    v = todo.pop()
    if v in seen:
      continue
    seen.add(v)
    if states.get(v) is not None:
      return True
    for nd, _ in prog.consumers.get(v, ()):
      todo.extend(nd.outs)
  return False


def _rounds(node: Any) -> bool:
  """``node`` rounds its operand to a narrower precision (reduce_precision, a narrowing float cast:
  the rules' ``cast`` facet): the rotation passes it only up to that rounding, which ``y @ Qᵀ``
  after it would expose."""
  cast = rule_for(node.prim).cast
  bits = None if cast is None or len(node.ins) != 1 else cast(node.params, node.ins[0].dtype, node.outs[0].dtype)
  if bits is None:
    return False
  src = jnp.finfo(node.ins[0].dtype)
  return bits[0] < src.nmant or bits[1] < src.nexp


def _leaving(node: Any, ins: list, ends: Optional[dict], n: int, rounded: set = frozenset()) -> Optional[dict]:
  """``{(path, "operand", k): dim}`` un-rotating every rotated operand of
  ``node`` (each ``Lin`` along one dim of size n, not rounded since it was
  rotated), or None (refused, or a state no ``y @ Qᵀ`` undoes: a sum of
  squares, two dims, a rounded value)."""
  if ends is None:
    return None
  cut = {}
  for k, s in enumerate(ins):
    if s is None:
      continue
    d = _undoable(node.ins[k], s, n)
    if d is None or node.ins[k] in rounded:
      return None
    cut[(node.path, "operand", k)] = d
  return cut


def _undoable(v: Any, s: Any, n: int) -> Optional[int]:
  """The dim along which ``y @ Qᵀ`` undoes ``v``'s rotation ``s`` (``Lin`` along one dim of size n), else None."""
  if not isinstance(s, Lin) or len(s.dims) != 1:
    return None
  (d,) = s.dims
  return d if v.shape[d] == n else None


def _end(prog: Any, v: Any, s: Any, ends: Optional[dict], n: int, what: str,
         rounded: set = frozenset()) -> Optional[str]:
  """Records program output ``v`` rotated by ``s`` in ``ends``; the reason when it cannot be un-rotated."""
  d = None if ends is None else _undoable(v, s, n)
  if d is None:
    return f"{what} reaches program output #{prog.output_positions[v][0]}"
  if v in rounded:
    return (f"{what} reaches program output #{prog.output_positions[v][0]} after a rounding to a narrower "
            "precision, which y @ Qᵀ there would not undo")
  for i in prog.output_positions[v]:
    ends[("output", i)] = d
  return None


def advance(prog: Any, node: Any, outs: list, states: dict, ends: Optional[dict] = None,
            n: int = 0, rounded: set = frozenset()) -> Optional[str]:
  """Records the rotation states of ``node``'s outputs (its rotate facet's
  ``outs``) in ``states``; the reason, when one reaches an output of ``prog``
  (unless ``ends`` records it to be un-rotated there, see ``_propagate``)."""
  for o, s in zip(node.outs, outs):
    if s is None:
      continue
    if o in prog.output_positions:
      why = _end(prog, o, s, ends, n, f"the rotation [from {node.where()}]", rounded)
      if why is not None:
        return why
    states[o] = s
  return None


class Solution(NamedTuple):
  """One signature's proven rotation: the leaves rotated (``key``), the norms
  it passes, the rotations inserted into the program and, where there are
  any, the traced program and the plan that computes them."""
  key: tuple            # ((leaf, dims), ...)
  norms: int
  names: tuple
  lines: tuple          # the report's line per inserted rotation (un-rotations of one value together)
  jaxpr: Any
  consts: list
  out_tree: Any
  plan: Any             # rewrite.Plan of the inserted rotations; None: only parameters rotated

  @property
  def inserted(self) -> tuple:
    """The rotations the program computes (``rewrite.RotationAt``, in report order)."""
    return () if self.plan is None else self.plan.rotations


def _where_made(a: Any, num_params: int = 0) -> str:
  node = getattr(a, "producer", None)
  if node is not None:
    return f"the output of `{node.prim.name}`"
  return {"in": f"input array #{a.index - num_params} of the call (after the parameters) {tuple(a.shape)}",
          "const": f"a captured constant {tuple(a.shape)}"}.get(a.kind, str(a.key))


def _solve(fn: Callable, params: Any, args: tuple, n: int, insert: bool = True) -> Solution:
  """The proven rotation of ``fn``'s stream of width ``n``, or raises RotateError.

  Parameters are proposed first (what writes each norm's input, then what a
  facet asks for: ``Want``). A value that must be rotated but that no
  parameter rotation reaches (an activation, a norm's output, a program input)
  gets an inserted ``x @ Q`` where it is made, and a program output reached
  rotated an inserted ``y @ Qᵀ`` (``insert=False``: both refused)."""
  # The proof reads the XLA expression of every kernel the program would run (the
  # fold's RMSNorm, a deferred reader's RMS-matmul): each computes that expression
  # exactly in real arithmetic, so the rotation is exact for the kernels too; traced
  # as they run, a kernel is an opaque pallas_call that no rotation passes.
  with kernels.xla_level() as asked:
    traced = pipeline.trace(fn, params, args)
  names = traced.names
  with pipeline.analyzer(traced) as an:
    level = an.top
    sites = _norm_inputs(level, n)
    if not sites:
      raise RotateError(f"no sum of squares over an axis of size {n} (a parameter-free RMS norm "
                        f"of a stream of width {n}): nothing to rotate; q must match the stream "
                        "width, and the model must be folded and fused (jaxfold.fuse_affine)")
    active = list(sites)
    seeds, inserted, asked_at = _proposal(level, active, n), {}, {}
    # inserted: value -> Lin, rotated where it is made; asked_at: the node that needed it (for the report)
    ends: Optional[dict] = None
    first: Optional[str] = None   # the first block, the reason given if no norm is left
    for _ in range(4 * len(names) + 4 + len(level.program.nodes) + 2 * len(sites)):
      ends = {} if insert else None
      res = _propagate(level, {i: frozenset(d) for i, d in seeds.items()}, inserted, ends, n)
      if isinstance(res, dict):
        break
      if isinstance(res, _Blocked):
        site = _blocked_site(res, active) if insert else None
        first = first or res.why
        if site is None:
          raise RotateError(f"the rotation is not provably exact: {first}")
        # The stream cannot go on from this norm's output (it keeps its γ, say): it
        # starts after it instead. Propose again without it.
        active.remove(site)
        seeds, inserted, asked_at = _proposal(level, active, n), {}, {}
        continue
      if isinstance(res, str):
        raise RotateError(f"the rotation is not provably exact: {res}")
      want, node = res
      a = node.ins[want.operand]
      hits = _writers(level, a, want.dims)
      if hits and all(set(d) <= seeds.get(i, set()) for i, d in hits.items()):
        hits = None   # (the parameters proposed are rotated already, and the value is still not)
      if not hits:
        (d,) = want.dims if len(want.dims) == 1 else (None,)
        if insert and isinstance(a, Val) and d is not None and a.shape[d] == n and a not in inserted:
          inserted[a] = Lin(want.dims)   # (x @ Q where x is made: every reader sees it rotated)
          asked_at[a] = node
          continue
        src = f"the output of `{a.producer.prim.name}`" if getattr(a, "producer", None) else "it"
        raise RotateError(f"the rotation is not provably exact: {want} and {src} is neither a "
                          f"parameter seen through re-indexing nor written by parameters that a "
                          f"rotation would rotate [at {node.where()}]"
                          + ("" if insert else "; rotate(..., insert=True) would multiply it by "
                             "Q in the program"))
      for i, dims in hits.items():
        # A weight that both reads and writes the stream (a square W in
        # h + f(h) @ W ... read along one dim, written along the other) is
        # rotated along both: Qᵀ·W·Q; the forward pass proves the whole.
        seeds.setdefault(i, set()).update(dims)
    else:
      raise RotateError("the rotation did not settle on a set of parameters")
    norms = sum(1 for x, axis in sites if res.get(x) == Lin(frozenset({axis})))
    if not norms:
      raise RotateError(f"the rotation is not provably exact: {first}" if first else
                        "no norm reads the rotated stream")
    starts = sorted(inserted.items(), key=lambda kv: _key_order(kv[0].key))
    exits = sorted((ends or {}).items(), key=lambda kv: _key_order(kv[0]))
    lines = tuple(f"x @ Q computed for {_where_made(a, len(names))}: `{asked_at[a].prim.name}` [at "
                  f"{asked_at[a].where()}] meets it with the rotated stream, and no parameter rotation reaches it"
                  for a, _ in starts) + _exit_lines(level, [k for k, _ in exits])
    made = [(a.key, next(iter(st.dims))) for a, st in starts] + exits
    plan = None
    if made:
      norm_impl = next(iter(asked)) if len(asked) == 1 else "xla"
      epilogues = ()
      if kernels.may_use_kernel(norm_impl):   # (the program runs at the XLA level: choose the kernels again)
        epilogues = tuple(ep for ep, _ in kernels.prove_epilogues(level, {}))
      plan = Plan(rotations=tuple(RotationAt(k, ax, _Q) for k, ax in made), epilogues=epilogues,
                  norm_impl=norm_impl)
  key = tuple(sorted((i, tuple(sorted(d))) for i, d in seeds.items()))
  return Solution(key, norms, names, lines, traced.jaxpr if made else None,
                  traced.consts if made else [], traced.out_tree, plan)


_Q = "rotation"   # the extras' name of Q in a plan with inserted rotations


def _exit_lines(level: Level, keys: list) -> tuple:
  """The report's lines for the stream's exits: one per program output, one per
  value read un-rotated (by every operation that does not commute with Q)."""
  nodes = {nd.path: nd for nd in level.program.nodes}
  out, by_value = [], {}
  for key in keys:
    if key[0] == "output":
      out.append(f"y @ Qᵀ computed for program output #{key[1]}: the rotated stream is an output")
    else:
      node = nodes[key[0]]
      by_value.setdefault(node.ins[key[2]], []).append(node)
  for v, readers in by_value.items():
    ops = ", ".join(dict.fromkeys(f"`{nd.prim.name}`" for nd in readers))
    out.append(f"y @ Qᵀ computed for {_where_made(v)} (the stream), which {ops} [at {readers[0].where()}] "
               "read: they do not commute with the rotation, and nothing after them is rotated")
  return tuple(out)


def _proposal(level: Level, sites: list, n: int) -> dict:
  """``{leaf: dims}``: the parameters that write each norm's input (``level.needs``)."""
  seeds: dict = {}
  for x, axis in sites:
    for need in level.needs(x, ((axis, n),)):
      if isinstance(need, LeafNeed):
        i = leaf_of(need.var, level)
        spec = dict(need.spec)
        if i is not None and len(spec) == 1 and all(b == need.var.shape[d] == n for d, b in spec.items()):
          seeds.setdefault(i, set()).update(spec)
  return seeds


def _key_order(key: tuple) -> tuple:
  """A sort key for value, operand and output keys alike (outputs last): the report's order."""
  if key[0] == "output":
    return (1, (), key[0], key[1])
  path, kind, i = key
  return (0, tuple(path), kind, i)


def _stream_widths(fn: Callable, params: Any, args: tuple) -> list:
  """Widths n with a parameter-free RMS norm over an axis of size n (the
  streams a rotation could be proved on), widest first."""
  with kernels.xla_level():
    traced = pipeline.trace(fn, params, args)
  sizes = set()
  with pipeline.analyzer(traced) as an:
    level = an.top
    for node in level.program.nodes:
      try:
        summed = rule_for(node.prim).sums(node, level)
      except Block:
        continue
      if summed is not None and len(summed[1]) == 1 and isinstance(node.ins[summed[0]], Val):
        sizes.add(node.ins[summed[0]].shape[summed[1][0]])
      dd = rule_for(node.prim).contraction(node)
      if dd is not None and len(dd.lc) == 1 and isinstance(node.ins[0], Val):
        sizes.add(node.ins[0].shape[dd.lc[0]])
    return sorted((n for n in sizes if n > 1 and _norm_inputs(level, n)), reverse=True)


def _named(name: str, n: int, seed: int, pca: Optional[Callable[[int], np.ndarray]] = None) -> np.ndarray:
  """The orthogonal matrix a name stands for, of order ``n``."""
  if name == "pca":
    return pca(n)
  if name == "hadamard":
    try:
      return hadamard(n)
    except ValueError as e:
      raise RotateError(f"rotate(..., \"hadamard\"): the stream has width {n}, and {e}; rotate by "
                        "\"random\" (or an explicit orthogonal matrix) instead") from None
  return random_orthogonal(n, jax.random.PRNGKey(seed))


NAMED = ("hadamard", "random", "pca")


def _stream_samples(jaxpr: Any, consts: list, args: list, n: int, out: list) -> list:
  """Evaluates ``jaxpr`` and appends to ``out`` every value, flattened to rows
  of width ``n``, that the program squares along a last axis of size ``n``:
  the inputs of the RMS norms, i.e. the residual stream the rotation acts on.
  Sub-programs (``pjit``, ``custom_jvp_call``) are entered so that norms
  inside jitted functions are seen."""
  env = dict(zip(compat.constvars(jaxpr), consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if compat.is_literal(v) else env[v]   # noqa: E731
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    sub = compat.call_jaxpr_of(eqn)
    if sub is not None:
      outs = _stream_samples(*compat.open_jaxpr(sub), ins, n, out)
    else:
      outs = compat.bind_eqn(eqn, ins)
    x = compat.squared_operand(eqn)
    if x is not None and getattr(x.aval, "shape", ()) and x.aval.shape[-1] == n:
      out.append(np.asarray(read(x), np.float64).reshape(-1, n))
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _pca(fn: Callable, params: Any, calibration: Any, kwargs: dict, n: int) -> np.ndarray:
  """Eigenvectors (columns, largest eigenvalue first) of the second-moment
  matrix ``E[x xᵀ]`` of the stream rows ``x`` at every RMS norm's input over
  the calibration inputs: the rotation that makes the stream's leading
  directions its first channels (SliceGPT's PCA)."""
  batches = [calibration] if isinstance(calibration, tuple) else list(calibration)
  rows: list = []
  for args in batches:
    args = args if isinstance(args, tuple) else (args,)
    closed = jax.make_jaxpr(lambda p, *a: fn(p, *a, **kwargs))(params, *args)
    _stream_samples(*compat.open_jaxpr(closed), jax.tree_util.tree_leaves((params, args)), n, rows)
  if not rows:
    raise RotateError(f"rotate(..., \"pca\"): the calibration inputs reach no RMS norm over a stream of width {n}")
  x = np.concatenate(rows)
  w, v = np.linalg.eigh(x.T @ x / len(x))
  return np.ascontiguousarray(v[:, ::-1])


def _hints(model: Any) -> str:
  """What to change when a rotation fails: the usual causes are a fold that
  was not fused (norms still multiply by γ) and auxiliary centerings (a mean
  over the stream, which a rotation does not commute with)."""
  hints = []
  if isinstance(model.apply_fn, FoldedApply):
    hints.append("the model is folded but not fused: call jaxfold.fuse_affine(folded) first, so "
                 "that the norms keep no γ/β")
  fn = model.apply_fn
  while fn is not None and not isinstance(fn, FoldedApply):
    fn = getattr(fn, "__wrapped__", None)
  if fn is not None:
    report = fn.analysis_for(fn.example_args, kwargs=fn.example_kwargs).report
    if report.num_auxiliary:
      hints.append(rotation_aux_hint(report, not fn.options.tie_by_aux()))
    unfolded = [s for s in report.sites if not s.folded and not s.auxiliary]
    if unfolded:   # a LayerNorm the fold kept still subtracts a mean over the stream
      hints.append(f"the fold left {len(unfolded)} of {len(report.sites)} norm site(s) unfolded (they "
                   f"keep a mean over the stream), e.g. {unfolded[0].where}: {unfolded[0].reason}")
  kept = [s for s in getattr(getattr(model, "report", None), "sites", ()) if getattr(s, "fused", True) is False]
  if kept:         # a norm fuse_affine kept still multiplies the stream by γ
    hints.append(f"fuse_affine kept {len(kept)} norm(s) with their γ/β, e.g. {kept[0].where}: "
                 f"{kept[0].reason}")
  return "".join(f"\n  hint: {h}" for h in hints)


def _apply(x, dims: tuple, q: np.ndarray):
  y = np.asarray(x, np.float64)
  for d in dims:
    y = np.moveaxis(np.tensordot(y, q, axes=([d], [0])), -1, d)
  return jnp.asarray(y.astype(x.dtype))


class _RotateRecord(NamedTuple):
  """A saved rotate step, decoded."""
  size: int
  rotated: tuple    # ((leaf, dims), ...), as _solve's key spells them
  has_q: bool
  insert: bool      # rotations may be inserted into the program
  inserted: str     # digest of the inserted rotations ("": none)


@register
class RotatedApply(Step):
  """The model's apply function, re-proving the rotation per input signature.
  Only parameters rotated: the program is the model's. With rotations
  inserted (a stream that starts at an activation), it runs the traced program
  with them (``rewrite.RotationAt``, Q passed as an argument)."""

  error = RotateError
  kind = "rotate"

  def __init__(self, fn: Callable, params_abstract: Any, base: Solution, n: int, args: tuple,
               kwargs: Optional[dict] = None, q: Optional[np.ndarray] = None, insert: bool = True):
    super().__init__(fn, params_abstract, args, kwargs)
    self._key, self._n, self._insert = base.key, n, insert
    self._q = q   # the rotation, kept so that save_fold records it and inserted rotations compute it
    self._q_device = None
    self._tree = jax.tree_util.tree_structure(params_abstract)
    if base.inserted and q is None:
      raise RotateError("this rotation computes x @ Q in the program, and Q was not kept; rotate again")
    self.seed(self.bind(args, kwargs), base)

  @property
  def q(self) -> Optional[np.ndarray]:
    """The orthogonal matrix the parameters were rotated by (None: not kept)."""
    return self._q

  def record(self) -> StepRecord:
    base = self._cached(self.bind(self.example_args, self.example_kwargs))
    info = {"name": self.kind, "size": self._n,
            "rotated": [[int(i), [int(d) for d in dims]] for i, dims in self._key],
            "q": self._q is not None, "insert": self._insert,
            "inserted": digest(_inserted_key(base)) if base.inserted else ""}
    return StepRecord(info, {} if self._q is None else {"rotation": np.asarray(self._q, np.float64)})

  @classmethod
  def parse(cls, info: dict, decode: Callable[[Any], Any]) -> _RotateRecord:
    rotated = tuple((int(i), tuple(int(d) for d in dims)) for i, dims in info["rotated"])
    return _RotateRecord(int(info["size"]), rotated, bool(info.get("q")), bool(info.get("insert", False)),
                         str(info.get("inserted", "")))

  @classmethod
  def restore(cls, inner: Callable, params: Any, parsed: _RotateRecord, ctx: RestoreContext) -> Restored:
    args = tuple(ctx.args)
    call = pipeline.bind(inner, args, ctx.kwargs, ctx.error)
    sol = _solve(call.fn, params, call.abstract_args(ctx.error), parsed.size, parsed.insert)
    if ctx.verify and sol.key != tuple(sorted((ctx.leaf(i), d) for i, d in parsed.rotated)):
      raise ctx.refuse("rotation (other parameters meet the residual stream)")
    if ctx.verify and (digest(_inserted_key(sol)) if sol.inserted else "") != parsed.inserted:
      raise ctx.refuse("rotation (the program computes the rotation at other values)")
    q = ctx.array("rotation") if parsed.has_q else None
    return Restored(cls(inner, params, sol, parsed.size, args, ctx.kwargs, q=q, insert=parsed.insert),
                    _report(sol, parsed.size), None)

  def _analyse(self, call: Call) -> Solution:
    sol = _solve(call.fn, self._params, call.abstract_args(RotateError), self._n, self._insert)
    if sol.key != self._key:
      raise RotateError("inputs of these shapes rotate different parameters; call rotate again")
    if sol.inserted and self._q is None:
      raise RotateError("inputs of these shapes need x @ Q computed in the program, and Q was not kept; "
                        "call rotate again")
    return sol

  def __call__(self, params, *args, **kwargs):
    call = self.bind(args, kwargs)
    sol = self._cached(call)
    if not sol.inserted:
      return self._inner(params, *args, **kwargs)
    if self._q_device is None:   # (on the device once, not copied there at every eager call)
      with jax.ensure_compile_time_eval():   # (a concrete array even when first called under a trace)
        self._q_device = jnp.asarray(self._q)
    return compiled.run_on(sol, self._tree, params, call.args, {_Q: self._q_device}, RotateError,
                           "params do not have the structure of the rotate result's params")


def _inserted_key(sol: Solution) -> tuple:
  return tuple((m.key, m.axis) for m in sol.inserted)


def _report(sol: Solution, n: int) -> RotateReport:
  return RotateReport(tuple((sol.names[i], d) for i, d in sol.key), sol.norms, n, sol.lines)


def _rotate_named(model: Any, name: str, params: Any, fn: Callable, args: tuple, kwargs: dict, given: tuple,
                  seed: int, size: Optional[int], calibration: Any = None, insert: bool = True) -> Rotated:
  """``rotate`` by a named matrix of the stream's width: ``size``, or the widest
  width whose stream the rotation is proved on."""
  if name not in NAMED:
    raise RotateError(f"rotate: q must be an orthogonal matrix or one of {NAMED}, got {name!r}")
  if name == "pca" and calibration is None:
    raise RotateError("rotate(..., \"pca\") needs calibration= (example args: a tuple, or a list of tuples)")
  pca = lambda n: _pca(fn, params, calibration, kwargs, n)   # noqa: E731
  if size is not None:
    return rotate(model, _named(name, int(size), seed, pca), *given, insert=insert)
  abstract = pipeline.abstract_tree(params, RotateError)
  call = pipeline.bind(fn, tuple(pipeline.abstract_tree(args, RotateError)), kwargs, RotateError)
  widths = _stream_widths(call.fn, abstract, call.abstract_args(RotateError))
  if not widths:
    raise RotateError(f"rotate(..., {name!r}): no parameter-free RMS norm in the program: fold and "
                      f"fuse_affine the model first{_hints(model)}")
  first: Optional[RotateError] = None
  for n in widths:   # the residual stream is the widest normalized width in every model we know
    try:
      return rotate(model, _named(name, n, seed, pca), *given, insert=insert)
    except RotateError as e:
      first = first or e
  raise first


def rotate(model: Any, q: Any, *example_args: Any, seed: int = 0, size: Optional[int] = None,
           calibration: Any = None, insert: bool = True) -> Rotated:
  """Rotates the residual stream of a fused model by an orthogonal ``q`` (d×d).

  ``q`` is a matrix, or ``"hadamard"`` (the normalized Hadamard matrix of the
  stream's width, also for widths like 384, 768, 1280: ``jaxfold.hadamard``)
  or ``"random"`` (Haar-random, from ``seed``), which spread outlier channels
  over all channels before quantization (QuaRot), or ``"pca"``: the
  eigenvectors, largest first, of ``E[x xᵀ]`` over the rows ``x`` of every
  value the program squares along the stream axis (the inputs of its RMS
  norms) when run on ``calibration`` (example args: a tuple, or a list of
  tuples) — SliceGPT's rotation. Any orthogonal q is exact, so the choice of
  samples affects only quality, never correctness. A named matrix takes the
  width of the widest stream whose rotation is proved (``size`` to choose).

  Every parameter meeting the stream becomes ``p ×_d q`` along its stream dim
  (writers' outputs, readers' inputs, embeddings, position tables, heads);
  the program is unchanged. Exactness is proved on the traced program:
  everything touching the stream must be a contraction, a sum, a
  re-indexing, or a parameter-free RMS norm over the rotated axis — so fold
  and ``fuse_affine`` first. Raises ``RotateError`` with the reason otherwise.

  Where the stream starts at a value no parameter writes (a GELU output plus
  positions, a norm's output, an input of embeddings) the program computes
  ``x @ Q`` there, and where the rotated stream is itself an output it
  computes ``y @ Qᵀ`` for that output; ``report.inserted`` lists them (each a
  d×d product per row). ``insert=False`` refuses those instead.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, flax.linen as nn, jaxfold
    >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(3)])
    >>> x = jnp.ones((2, 4)); p = m.init(jax.random.PRNGKey(0), x)
    >>> fused = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
    >>> q = np.linalg.qr(np.random.default_rng(0).normal(size=(8, 8)))[0]
    >>> r = jaxfold.rotate(fused, q)
    >>> bool(jnp.allclose(r.apply_fn(r.params, x), m.apply(p, x), atol=1e-5))
    True
  """
  given = example_args
  kwargs = pipeline.model_kwargs(model, example_args)
  params, fn, example_args = pipeline.model_parts(
      model, example_args, "rotate takes a model with params and apply_fn (jaxfold.Fused)", RotateError)
  if isinstance(q, str):
    return _rotate_named(model, q, params, fn, tuple(example_args), kwargs, given, seed, size, calibration, insert)
  q = np.asarray(q, np.float64)
  if q.ndim != 2 or q.shape[0] != q.shape[1]:
    raise RotateError(f"q must be a square matrix, got shape {q.shape}")
  if not np.allclose(q.T @ q, np.eye(len(q)), atol=1e-6):
    err = np.abs(q.T @ q - np.eye(len(q))).max()
    raise RotateError(f"q is not orthogonal (max |qᵀq - I| = {err:.2e}); an RMS norm commutes "
                      "only with orthogonal maps")
  args = pipeline.abstract_tree(example_args, RotateError)
  abstract = pipeline.abstract_tree(params, RotateError)
  call = pipeline.bind(fn, tuple(args), kwargs, RotateError)
  try:
    sol = _solve(call.fn, abstract, call.abstract_args(RotateError), len(q), insert)
  except RotateError as e:
    raise RotateError(f"{e}{_hints(model)}") from None
  leaves, tree = jax.tree_util.tree_flatten(params)
  dims = dict(sol.key)
  new = [_apply(x, dims[i], q) if i in dims else x for i, x in enumerate(leaves)]
  apply = RotatedApply(fn, abstract, sol, len(q), args, kwargs, q=q, insert=insert)
  return Rotated(jax.tree_util.tree_unflatten(tree, new), apply, _report(sol, len(q)))
