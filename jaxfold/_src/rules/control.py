"""Control flow: scan (analysed through its body), cond and while (blocked).

Calls (``jit``, ``checkpoint``, ``custom_jvp``/``custom_vjp``) never reach a
rule: ``program.Program`` flattens them per call site. Loop bodies are
sub-programs; the scan rule hands the shift to the analysis' body driver,
which runs the same registry inside with a fixed point on the carries.
"""

from __future__ import annotations

from jaxfold._src.rules.base import Block, Rule, register
from jaxfold._src.rules.elementwise import _prims

try:  # the loop primitives live in lax's private control-flow module
  from jax._src.lax import control_flow as _cf
except ImportError:  # pragma: no cover
  _cf = None


def _prim(name):
  p = getattr(_cf, name, None) if _cf is not None else None
  return (p,) if p is not None else _prims(name)


def _scan_shift(node, ins, ctx):
  return ctx.scan_shift(node, ins)


def _blocked(what):
  def shift(node, ins, ctx):
    raise Block(f"the shift enters a `{node.prim.name}` ({what} are not analysed yet)")
  return shift


register(Rule("scan", _prim("scan_p"), shift=_scan_shift,
              variants=("stacked layers", "carry leak")))
register(Rule("cond", _prim("cond_p"), shift=_blocked("conditionals"),
              variants=("two branches",)))
register(Rule("while", _prim("while_p"), shift=_blocked("while loops"),
              variants=("fixed trip count",)))
