"""A traced program as a dataflow graph with call-site identity.

JAX reuses one jaxpr object when the same ``jit``/``checkpoint``/``custom_*``
function is called again with the same shapes, so a jaxpr variable does not
identify a value. Here every value is a ``Val`` created per *occurrence*:
call-like equations are flattened into the enclosing program, and the body's
variables get fresh ``Val``s at every call site. A block called N times is N
blocks' worth of analysis.

Loops and conditionals keep their bodies as sub-``Program``s (their values
are per iteration, not per occurrence). Every node and value carries the
*path* (equation indices through the nesting) by which the rewrite, which
walks the original nested jaxpr, finds it again.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import numpy as np

from jaxfold._src import compat
from jaxfold._src.rules import rule_for

Path = tuple


class Lit:
  """A literal operand (a scalar written into the program)."""
  __slots__ = ("value", "aval")

  def __init__(self, value: Any, aval: Any):
    self.value, self.aval = value, aval

  @property
  def shape(self) -> tuple:
    return tuple(self.aval.shape)

  @property
  def dtype(self):
    return self.aval.dtype

  def __repr__(self):
    return f"Lit({self.value!r})"


class Val:
  """One value at one call site.

  ``key`` locates it for the rewrite: ``(eqn path, "out", k)`` for an
  equation output, ``(level path, "in" | "const", i)`` for a program input or
  captured constant of the level that defines it.
  """
  __slots__ = ("aval", "producer", "index", "key", "const", "program", "_shape", "__weakref__")

  def __init__(self, aval, key, program, producer=None, index=0, const=None):
    self.aval = aval
    self._shape = None
    self.key = key
    self.program = program
    self.producer = producer      # Node or None
    self.index = index            # output position in producer, or input/const position
    self.const = const            # the captured array, for constants

  @property
  def shape(self) -> tuple:
    if self._shape is None:   # asked tens of thousands of times per analysis
      self._shape = tuple(self.aval.shape)
    return self._shape

  @property
  def dtype(self):
    return self.aval.dtype

  @property
  def kind(self) -> str:
    return self.key[1]

  def __repr__(self):
    return f"Val{self.key}:{self.aval}"


@dataclasses.dataclass(frozen=True)
class CallSite:
  """A flattened call-like equation (jit, checkpoint, custom_jvp/vjp)."""
  path: Path
  kind: str          # "jit" | "remat" | "custom_jvp" | "custom_vjp" | "call"
  name: str
  source: str        # the line that made the call
  stack: str         # its module path (name stack)


class Node:
  """One primitive application at one call site."""
  __slots__ = ("eqn", "path", "ins", "outs", "subs", "calls", "index", "program", "_tag")

  def __init__(self, eqn, path, ins, calls, index, program):
    self.eqn, self.path, self.ins, self.calls = eqn, path, tuple(ins), tuple(calls)
    self.index, self.program = index, program
    self.outs: tuple = ()
    self.subs: tuple = ()
    self._tag = None

  @property
  def prim(self) -> Any:
    return self.eqn.primitive

  @property
  def params(self) -> dict:
    return self.eqn.params

  def tag(self) -> tuple:
    """The operation as a key: the primitive's name and its parameters'
    reprs, sorted (rules name their canonical forms by it; kept, as the
    reprs are costly and asked at every step)."""
    if self._tag is None:
      self._tag = (self.prim.name,) + tuple(sorted((k, repr(v)) for k, v in self.params.items()))
    return self._tag

  @property
  def custom_calls(self) -> tuple:
    """Enclosing custom-differentiation calls (innermost last)."""
    return tuple(c for c in self.calls if c.kind in ("custom_jvp", "custom_vjp"))

  def module(self) -> str:
    """The module path (JAX name stack), e.g. ``GPT2/h_0/ln_1``; may be empty."""
    return compat.name_stack(self.eqn)

  def source(self) -> str:
    """The user's line that made this equation (``file.py:line (function)``),
    skipping frames inside jax and libraries such as flax."""
    return compat.user_source(self.eqn) or compat.source_summary(self.eqn)

  def where(self) -> str:
    stack, src = self.module(), self.source()
    text = f"{stack} @ {src}" if stack else src
    if self.calls:
      text += " " + call_note(self.calls)
    return text

  def __repr__(self):
    return f"Node({self.prim.name}@{self.path})"


def read_at(var: "Val") -> str:
  """Where a captured constant entered the trace: the user's line of the first
  equation that reads it (``file.py:12 (fn)``), or "" when none is known."""
  readers = var.program.consumers.get(var) or []
  return readers[0][0].source() if readers else ""


def call_note(calls: tuple) -> str:
  """Names the call site, so two calls of one function read differently."""
  c = calls[-1]
  return f"(in {c.kind} `{c.name}` called at {c.source})"


class Program:
  """One level of a traced program: nodes in execution order."""

  def __init__(self, jaxpr: Any, consts: Optional[list] = None, prefix: Path = (),
               parent: Optional[tuple] = None, calls: tuple = (), custom_boundaries: bool = False):
    inner, inner_consts = compat.open_jaxpr(jaxpr)
    consts = list(consts) if consts else inner_consts
    self.prefix = prefix
    # CBWC: a custom_jvp/custom_vjp call that returns an input unchanged stays a node (see _kept)
    self.custom_boundaries = custom_boundaries
    self.parent = parent                       # (Node, Program) for loop/branch bodies
    self.nodes: list[Node] = []
    self.consts: list[Val] = []
    env: dict = {}
    for i, (v, c) in enumerate(zip(compat.constvars(inner), consts)):
      val = Val(v.aval, (prefix, "const", i), self, index=i, const=c)
      self.consts.append(val)
      env[v] = val
    self.invars = []
    for i, v in enumerate(inner.invars):
      val = Val(v.aval, (prefix, "in", i), self, index=i)
      self.invars.append(val)
      env[v] = val
    self._flatten(inner, prefix, env, calls)
    self.outvars = [_read(env, v) for v in inner.outvars]

  def _flatten(self, jaxpr: Any, prefix: Path, env: dict, calls: tuple) -> None:
    for i, eqn in enumerate(jaxpr.eqns):
      path = prefix + (i,)
      ins = [_read(env, a) for a in eqn.invars]
      rule = rule_for(eqn.primitive)
      call = rule.inline(eqn)
      own = ()
      if call is not None and self._kept(call):
        own = (CallSite(path, call.kind, compat.call_name(eqn), compat.user_source(eqn) or compat.source_summary(eqn),
                        compat.name_stack(eqn)),)
        call = None
      if call is not None:
        inner, consts = compat.open_jaxpr(call.body)
        sub = {}
        for k, (v, c) in enumerate(zip(compat.constvars(inner), consts)):
          val = Val(v.aval, (path, "const", k), self, index=k, const=c)
          self.consts.append(val)
          sub[v] = val
        for v, a in zip(inner.invars, ins):
          sub[v] = a
        site = CallSite(path, call.kind, compat.call_name(eqn),
                        compat.user_source(eqn) or compat.source_summary(eqn),
                        compat.name_stack(eqn))
        self._flatten(inner, path, sub, calls + (site,))
        for ov, iv in zip(eqn.outvars, inner.outvars):
          env[ov] = _read(sub, iv)
        continue
      node = Node(eqn, path, ins, calls + own, len(self.nodes), self)
      node.outs = tuple([Val(v.aval, (path, "out", k), self, producer=node, index=k)
                         for k, v in enumerate(eqn.outvars)])
      for v, val in zip(eqn.outvars, node.outs):
        env[v] = val
      node.subs = tuple(Program(j, None, path + (k,), (node, self), calls + own, self.custom_boundaries)
                        for k, j in enumerate(rule.bodies(eqn)))
      self.nodes.append(node)

  def _kept(self, call: Any) -> bool:
    """A custom-differentiation call kept as a node: flattened, an output that is an input
    unchanged (``clip_gradient(x) = x`` with its own backward rule) has no node inside the call,
    so nothing would tell CBWC that a shift crosses the custom rule (whose gradient then sees the
    projected cotangent). As a node it is opaque: its ``custom_calls`` name it."""
    if not self.custom_boundaries or call.kind not in ("custom_jvp", "custom_vjp"):
      return False
    inner, _ = compat.open_jaxpr(call.body)
    ins = {id(v) for v in inner.invars}
    return any(id(v) in ins for v in inner.outvars)

  # -- dataflow maps ----------------------------------------------------------

  @functools.cached_property
  def consumers(self) -> dict:
    out: dict = {}
    for n in self.nodes:
      for k, v in enumerate(n.ins):
        if isinstance(v, Val):
          out.setdefault(v, []).append((n, k))
    return out

  @functools.cached_property
  def output_positions(self) -> dict:
    out: dict = {}
    for i, v in enumerate(self.outvars):
      if isinstance(v, Val):
        out.setdefault(v, []).append(i)
    return out

  @functools.cached_property
  def last_use(self) -> dict:
    """Index of the last node reading each value (outputs: past the end)."""
    last = {}
    for n in self.nodes:
      for v in n.ins:
        if isinstance(v, Val):
          last[v] = n.index
    for v in self.output_positions:
      last[v] = len(self.nodes)
    return last

  def programs(self):
    """This level and every loop/branch body below it."""
    yield self
    for n in self.nodes:
      for s in n.subs:
        yield from s.programs()

  @property
  def is_top(self) -> bool:
    return self.parent is None

  def release(self) -> None:
    """Breaks the graph's reference cycles (a node and its outputs, a
    program and its nodes, values and their program), so that reference
    counting frees an analysed program at once: left to the cycle collector,
    its ~20 000 objects made a fold's largest collection. Afterwards the
    program is unusable (its node and value lists are gone); a value keeps its
    key, shape and producer, a node its operands."""
    if self.nodes is None:
      return
    for n in self.nodes:
      for s in n.subs:
        s.release()
      n.outs = n.subs = None
    self.nodes = self.invars = self.outvars = self.consts = None
    for k in ("consumers", "output_positions", "last_use"):
      self.__dict__.pop(k, None)


def _read(env: dict, a: Any):
  if compat.is_literal(a):
    return Lit(compat.literal_value(a), a.aval)
  return env[a]


def is_val(a: Any) -> bool:
  return isinstance(a, Val)


def shape(a: Any) -> tuple:
  return tuple(a.aval.shape)


def literal_array(a: Lit) -> np.ndarray:
  return np.asarray(a.value)


def upstream(v: Val, depth: int, keep=None) -> list:
  """What ``v`` is computed from, within ``depth`` producers: ``depth + 1``
  layers ``[[v], v's operands, ...]``, each value once, in first-seen order.

  ``keep(node, a)`` says whether to follow operand ``a`` of ``node``. Loop and
  branch nodes end the walk: their bodies are another level's values."""
  layers, seen = [[v]], {v}
  for _ in range(depth):
    nxt = []
    for u in layers[-1]:
      node = u.producer
      if node is None or node.subs:
        continue
      for a in node.ins:
        if isinstance(a, Val) and a not in seen and (keep is None or keep(node, a)):
          seen.add(a)
          nxt.append(a)
    layers.append(nxt)
  return layers
