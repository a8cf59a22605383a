"""Control flow: scan, cond (and switch), while (and fori_loop with traced bounds).

Calls (``jit``, ``checkpoint``, ``custom_jvp``/``custom_vjp``) never reach a
rule: ``program.Program`` flattens them per call site. Loop and branch bodies
are sub-programs; these rules hand the shift to the analysis' body drivers
(``Level.scan_shift``/``cond_shift``/``while_shift``), which run the same
registry inside: every branch of a cond (the branch index is a traced value,
so a shift must be invisible in all of them), a fixed point on the carries of
a scan or while loop.

The operand layout of each primitive (which body input reads which outer
operand, which are carries) is this module's knowledge: ``body_operand`` and
``carries`` answer it for the drivers.
"""

from __future__ import annotations

from typing import Optional

from jaxfold._src import compat
from jaxfold._src.rules.base import Rule, register
from jaxfold._src.rules.elementwise import _prims


def body_operand(node, k: int, i: int) -> Optional[int]:
  """The outer operand that input ``i`` of body ``k`` of ``node`` reads
  unchanged (a closed-over constant or a branch operand), or None for a
  loop-carried or per-iteration input."""
  if compat.is_cond(node.eqn):
    return i + 1                       # operand 0 is the branch index
  if compat.is_while(node.eqn):
    cn, bn = compat.while_partition(node.params)
    n = cn if k == 0 else bn
    if i < n:
      return i if k == 0 else cn + i
    return None
  if compat.is_scan(node.eqn):
    nc, _ = compat.scan_partition(node.params)
    return i if i < nc else None
  return None


def carries(node, k: int) -> Optional[tuple]:
  """For a while loop's body ``k``: ``(first carry input, first carry operand)``."""
  cn, bn = compat.while_partition(node.params)
  return (cn if k == 0 else bn), cn + bn


def may_skip(node) -> bool:
  """Whether a loop may run zero times, leaving its carries at their initial
  values (and a scan's stacked outputs empty): a ``while`` whose condition
  may be false at entry (``fori_loop`` with traced bounds), a scan whose
  length is 0 (``fori_loop`` with equal static bounds) or not a concrete int.
  Then every carry rule must hold for the initial carry too, and a centering
  placed in the body ("at every iteration") may never run."""
  if compat.is_scan(node.eqn):
    n = compat.scan_length(node.params)
    return n is None or n <= 0
  return compat.is_while(node.eqn)


def _scan_shift(node, ins, ctx):
  return ctx.scan_shift(node, ins)


def _cond_shift(node, ins, ctx):
  return ctx.cond_shift(node, ins)


def _while_shift(node, ins, ctx):
  return ctx.while_shift(node, ins)


register(Rule("scan", _prims("scan_p"), shift=_scan_shift,
              variants=("stacked layers", "carry leak", "zero length")))
register(Rule("cond", _prims("cond_p"), shift=_cond_shift,
              variants=("two branches", "switch", "index from stream")))
register(Rule("while", _prims("while_p"), shift=_while_shift,
              variants=("fixed trip count", "fori traced bounds", "stream predicate", "false at entry")))
