"""The typed contracts of the rule facets: what a facet is called with and
returns, and the context (``ctx``) it may ask.

``analysis.Level`` is the one implementation of ``Context`` (and
``rewrite``'s equation view the ``node`` of ``Simplify``); the Protocols
say which of its methods a facet may rely on, so a type checker sees a
facet that asks for more. Runtime behaviour does not depend on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

if TYPE_CHECKING:
  from fractions import Fraction

  from jaxfold._src import algebra as A
  from jaxfold._src.program import Node, Program, Val
  from jaxfold._src.rules.base import Facts, Inline, Need, Spec


class Context(Protocol):
  """What a facet may ask about the program level it runs in."""
  cbwc: bool                     # the analysis serves CBWC (custom rules see changed inputs)
  tolerance: Any                 # the widest output float dtype
  overrides: dict                # values with assumed canonical forms (see ``assuming``)

  def facts(self, a: Any) -> "Facts": ...
  def is_zero(self, a: Any) -> bool: ...
  def constant_dims(self, a: Any, out_shape: Sequence[int]) -> frozenset: ...
  def constant_along(self, a: Any, dims: Any, out_shape: Sequence[int]) -> bool: ...
  def expr_constant_along(self, expr: "A.Expr", d: int) -> bool: ...
  def at_least_as_precise(self, a: Any, b: Any) -> bool: ...
  def round_to(self, value: "Fraction", dtype: Any) -> Optional["Fraction"]: ...
  def atom(self, v: "Val") -> "A.Expr": ...
  def canon(self, a: Any) -> "A.Expr": ...
  def assuming(self, overrides: dict) -> Any: ...
  def body(self, node: "Node", k: int = 0) -> "BodyContext": ...


class BodyContext(Context, Protocol):
  """A loop or branch body's level, as the control-flow facets drive it."""
  program: "Program"

  def collect(self, seeds: dict) -> dict: ...


class FactsFacet(Protocol):
  def __call__(self, node: "Node", ins: list, ctx: Context) -> list: ...


class CanonFacet(Protocol):
  def __call__(self, node: "Node", ins: list, ctx: Context) -> list: ...


class ShiftFacet(Protocol):
  """Output polys (``A.Poly`` or None) from the operands'; raises ``Block``."""
  def __call__(self, node: "Node", ins: list, ctx: Context) -> list: ...


class ZeroSumFacet(Protocol):
  """The ``Need``s for output ``k`` to be zero-sum over ``spec``; raises ``Block``."""
  def __call__(self, node: "Node", k: int, spec: "Spec", ctx: Context) -> "list[Need]": ...


class SimplifyFacet(Protocol):
  """With ``zeros[i]`` marking ``rewrite.Zero`` operands: a function from the
  operands to the outputs, or None (the operands are materialised)."""
  def __call__(self, node: Any, zeros: list) -> Optional[Callable[[list], list]]: ...


class RotateFacet(Protocol):
  def __call__(self, node: "Node", ins: list, ctx: Context) -> list: ...


class SumsFacet(Protocol):
  def __call__(self, node: "Node", ctx: Context) -> Optional[tuple]: ...


class SumAxesFacet(Protocol):
  def __call__(self, node: "Node") -> Optional[tuple]: ...


class ContractionFacet(Protocol):
  def __call__(self, node: "Node") -> Any: ...


class CastFacet(Protocol):
  """``(mantissa_bits, exponent_bits)`` a float-to-float cast keeps (equation
  ``params``, operand and output dtypes), or None when it is not one."""
  def __call__(self, params: dict, src: Any, dst: Any) -> Optional[tuple]: ...


class BodiesFacet(Protocol):
  def __call__(self, eqn: Any) -> tuple: ...


class InlineFacet(Protocol):
  def __call__(self, eqn: Any) -> Optional["Inline"]: ...


class BodyFactsFacet(Protocol):
  def __call__(self, node: "Node", k: int, i: int, outer: Context, base: "Facts") -> "Facts": ...


class BodyZeroSumFacet(Protocol):
  def __call__(self, node: "Node", k: int, i: int, spec: "Spec", outer: Context) -> "list[Need]": ...


class ShiftInsideFacet(Protocol):
  def __call__(self, node: "Node", ins: list, ctx: Context, inner: dict) -> list: ...


class Run(Protocol):
  """``rewrite.evaluate``'s callback for ``rebind``: a body evaluated with the plan."""
  def __call__(self, body: Any, args: Sequence[Any], sub: Optional[int] = None,
               isolated: bool = False) -> list: ...


class RebindFacet(Protocol):
  def __call__(self, eqn: Any, invals: list, run: Run) -> list: ...
