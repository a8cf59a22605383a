"""Tracing and the dataflow graph the analysis walks.

Call-like equations (jit, remat, custom_jvp/vjp) are transparent for the
analysis: their bodies are flattened into the enclosing graph, with the inner
variables aliased to the outer ones. Loops and conditionals keep their bodies
as sub-graphs. Every node remembers its *path* (the equation indices through
the nesting) so that the rewrite, which walks the original nested jaxpr, can
find it again.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterator

from jaxfold._src import compat

Path = tuple[int, ...]


@dataclasses.dataclass(eq=False)
class Node:
  """One primitive application in the flattened graph."""
  eqn: Any
  path: Path
  index: int
  invars: tuple[Any, ...]
  outvars: tuple[Any, ...]
  subgraphs: tuple["Graph", ...] = ()

  @property
  def prim(self) -> Any:
    return self.eqn.primitive

  @property
  def params(self) -> dict:
    return self.eqn.params

  def module(self) -> str:
    """The module path (JAX name stack), e.g. ``GPT2/h_0/ln_1``; may be empty."""
    return compat.name_stack(self.eqn)

  def source(self) -> str:
    return compat.source_summary(self.eqn)

  def where(self) -> str:
    stack = compat.name_stack(self.eqn)
    src = compat.source_summary(self.eqn)
    return f"{stack} @ {src}" if stack else src


class Graph:
  """A flattened view of one jaxpr level with cached dataflow maps."""

  def __init__(self, jaxpr: Any, consts: list[Any], prefix: Path = ()):
    jaxpr, inner_consts = compat.open_jaxpr(jaxpr)
    consts = consts if consts else inner_consts
    self.jaxpr = jaxpr
    self.prefix = prefix
    self.alias: dict[Any, Any] = {}
    self.const_values: dict[Any, Any] = {}
    self.const_keys: dict[Any, tuple] = {}
    for i, (v, c) in enumerate(zip(compat.constvars(jaxpr), consts)):
      self.const_values[v] = c
      self.const_keys[v] = (prefix, "const", i)
    self.nodes: list[Node] = []
    self._flatten(jaxpr, prefix)
    self.invars = list(jaxpr.invars)
    self.outvars = [self.resolve(v) for v in jaxpr.outvars]

  def resolve(self, a: Any) -> Any:
    while compat.is_var(a) and a in self.alias:
      a = self.alias[a]
    return a

  def _flatten(self, jaxpr: Any, prefix: Path) -> None:
    for i, eqn in enumerate(jaxpr.eqns):
      path = prefix + (i,)
      body = compat.call_jaxpr_of(eqn)
      if body is not None:
        inner, consts = compat.open_jaxpr(body)
        for v, c in zip(compat.constvars(inner), consts):
          self.const_values[v] = c
          self.const_keys[v] = (path, "const", compat.constvars(inner).index(v))
        for iv, ov in zip(inner.invars, eqn.invars):
          self.alias[iv] = self.resolve(ov)
        self._flatten(inner, path)
        for ov, iv in zip(eqn.outvars, inner.outvars):
          if compat.is_var(ov):
            self.alias[ov] = self.resolve(iv)
        continue
      subgraphs = tuple(
          Graph(j, [], path + (k,)) for k, j in enumerate(_control_bodies(eqn)))
      self.nodes.append(Node(
          eqn=eqn, path=path, index=len(self.nodes),
          invars=tuple(self.resolve(v) for v in eqn.invars),
          outvars=tuple(eqn.outvars), subgraphs=subgraphs))

  @functools.cached_property
  def producer(self) -> dict[Any, tuple[Node, int]]:
    return {v: (n, k) for n in self.nodes for k, v in enumerate(n.outvars)
            if compat.is_var(v)}

  @functools.cached_property
  def consumers(self) -> dict[Any, list[tuple[Node, int]]]:
    out: dict[Any, list[tuple[Node, int]]] = {}
    for n in self.nodes:
      for k, v in enumerate(n.invars):
        if compat.is_var(v):
          out.setdefault(v, []).append((n, k))
    return out

  @functools.cached_property
  def output_positions(self) -> dict[Any, list[int]]:
    out: dict[Any, list[int]] = {}
    for i, v in enumerate(self.outvars):
      if compat.is_var(v):
        out.setdefault(v, []).append(i)
    return out

  def var_key(self, v: Any) -> tuple:
    """A key that the rewrite can recognise for the value ``v``."""
    if v in self.producer:
      node, k = self.producer[v]
      return (node.path, "out", k)
    if v in self.const_keys:
      return self.const_keys[v]
    return (self.prefix, "in", self.invars.index(v))

  def walk(self) -> Iterator[Node]:
    """All nodes, sub-graphs included, outer first."""
    for n in self.nodes:
      yield n
      for g in n.subgraphs:
        yield from g.walk()


def _control_bodies(eqn: Any) -> list[Any]:
  if compat.is_scan(eqn):
    return [eqn.params["jaxpr"]]
  if compat.is_cond(eqn):
    return list(eqn.params["branches"])
  if compat.is_while(eqn):
    return [eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]]
  return []
