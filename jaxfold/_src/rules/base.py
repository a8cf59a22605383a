"""The rule type, its registry and the defaults every unknown primitive gets.

A ``Rule`` holds everything the analysis and the rewrite know about one
primitive family, as *facets*:

* ``facts``: structural facts of the outputs from those of the inputs
  (dims along which a value is constant, a known scalar value, whether it
  derives from a PRNG key).
* ``canon``: the canonical expression of the outputs (``algebra.Expr``);
  used to decide cancellation and to prove kernel epilogues equal.
* ``shift``: obligation 1, forwards: the polynomial in a shift symbol that
  each output carries, given the inputs'.
* ``zero_sum``: obligation 2, backwards: which operands must sum to zero over
  which blocks for an output to.
* ``simplify``: the rewrite, when some inputs are exactly zero (a removed
  mean reduction) — the outputs without materialising the zeros.
* Control flow (``rules/control.py``): ``bodies`` (the sub-jaxprs in the
  equation's params), ``inline`` (a call the program flattens),
  ``body_facts``/``body_zero_sum``/``shift_inside`` (how a body's inputs and
  outputs map to the equation's, for both obligations) and ``rebind`` (the
  rewrite of an equation whose bodies the plan changes).
* Declared roles that other passes ask instead of testing a rule's name:
  ``arith`` ("+" for the add family, "*" for mul, "/" for div), ``sum_axes``
  (a plain ``reduce_sum``), ``contraction`` (a ``dot_general``'s dimension
  numbers), ``reindex`` (a step that only moves or converts elements) and
  ``cast`` (the precision a cast keeps).

Defaults fail closed: an unknown primitive stops a shift, is never
zero-sum, and its outputs are opaque atoms. A facet is exact or absent.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence

from jaxfold._src import algebra as A
from jaxfold._src.rules import contracts as C

if TYPE_CHECKING:  # the program imports the registry (to flatten calls), not the reverse
  from jaxfold._src.program import Lit, Node, Val

class SpecEntry(NamedTuple):
  """One entry of a ``Spec``: zero-sum over aligned blocks of ``block`` along ``dim``."""
  dim: int
  block: int


# ((dim, block), ...) sorted by dim: zero-sum over aligned blocks along each dim. Entries
# are plain pairs or SpecEntry (equal and hashed alike); ``freeze`` makes SpecEntry.
Spec = tuple


class Block(Exception):
  """A step the analysis cannot prove; the message names the construct."""


@dataclasses.dataclass(frozen=True)
class Facts:
  """What the program's structure says about one value.

  Attributes:
    const: dims along which the value is constant.
    value: the exact scalar every element equals (``Fraction``, or ``float``
      for non-finite literals), when known.
    random: computed from a PRNG key (a dropout mask, say).
  """
  const: frozenset = frozenset()
  value: Any = None
  random: bool = False


@dataclasses.dataclass(frozen=True)
class Need:
  """Operand ``operand`` must be zero-sum over ``spec``; ``transparent`` when
  the operation only re-indexes or converts it (an untied copy of a
  parameter can be taken through such steps). With ``source``, that earlier
  value must be zero-sum instead: the operation's operands are pieces that
  together rearrange it (no use to untie)."""
  operand: int
  spec: Spec
  transparent: bool = False
  source: Any = None    # the value that must be zero-sum instead of the operand (see concatenate)
  at: Any = None        # the program (a loop or branch body) ``source`` lives in; None: the node's


def _no_facts(node: Node, ins: list, ctx) -> list:
  return [Facts(size_one(v.shape), None, any(f.random for f in ins)) for v in node.outs]


def _no_canon(node: Node, ins: list, ctx) -> list:
  return [ctx.atom(v) for v in node.outs]


def _no_shift(node: Node, ins: list, ctx) -> list:
  raise Block(f"the shift reaches `{node.prim.name}`, which has no exact rule")


def _no_zero_sum(node: Node, k: int, spec: Spec, ctx) -> list:
  raise Block(f"the output of `{node.prim.name}` is not provably zero-sum")


def _no_simplify(node: Node, zeros: list) -> Optional[Callable]:
  return None


def _no_sums(node: Node, ctx) -> Optional[tuple]:
  return None


def _no_rotate(node: Node, ins: list, ctx) -> list:
  raise Block(f"the rotated stream reaches `{node.prim.name}`, which has no rotation rule")


def _no_bodies(eqn: Any) -> tuple:
  return ()


def _no_inline(eqn: Any) -> None:
  return None


def _no_body_facts(node: Node, k: int, i: int, outer, base: Facts) -> Facts:
  random = base.random or any(outer.facts(a).random for a in node.ins)
  return Facts(base.const, None, random)


def _no_body_zero_sum(node: Node, k: int, i: int, spec: Spec, outer) -> list:
  raise Block(f"an input of a `{node.prim.name}` body")


def _no_shift_inside(node: Node, ins: list, ctx, inner: dict) -> list:
  raise Block(f"the value is inside a `{node.prim.name}` body")


def _no_sum_axes(node: Node) -> Optional[tuple]:
  return None


def _no_contraction(node: Node) -> Any:
  return None


@dataclasses.dataclass(frozen=True)
class Rule:
  """All facets of one primitive family (see the module docstring)."""
  name: str
  primitives: tuple
  facts: C.FactsFacet = _no_facts
  canon: C.CanonFacet = _no_canon
  shift: C.ShiftFacet = _no_shift
  zero_sum: C.ZeroSumFacet = _no_zero_sum
  simplify: C.SimplifyFacet = _no_simplify
  # jaxfold.rotate: output states given operand states (None: unchanged, or
  # rules.rotation.Lin / Quad); exact for any orthogonal Q, or absent.
  rotate: C.RotateFacet = _no_rotate
  # Whether the primitive's JVP is the derivative of what it computes; CBWC
  # gradients equal the original's only across such primitives.
  differentiable: bool = True
  # "identity" (each output is its operand's value), "layout" (re-indexes
  # one operand), "scale" (multiplies by another operand) or "": lets site
  # detection see through formulations, never used for soundness.
  kind: str = ""
  # Its role after a norm's reductions, for explaining where a value comes
  # from and finding the subtracted mean: "subtract" (in0 - in1), "step"
  # (carries the normalized value: neg, powers, (r)sqrt), "bias" (an add that
  # may join β) or "". Never used for soundness.
  epilogue: str = ""
  # ``(node, ctx) -> (operand, axes) | None``: the output is a constant times
  # the sum of that operand over those of its axes (a mean's numerator:
  # ``reduce_sum``, a contraction with ones). Site detection only.
  sums: C.SumsFacet = _no_sums
  # An elementwise function that is not affine in its operand (tanh, erf,
  # logistic, exp, max: what a GELU, SiLU or ReLU is made of): where
  # online_hadamard looks for an MLP's inner activation. Never used for soundness.
  activation: bool = False
  # Parameter variants the fuzzer must generate, e.g. ("int target", "float narrowing").
  variants: tuple = ()
  # ``(node) -> axes | None``: the output is the plain sum of operand 0 over
  # these axes (``reduce_sum``: what a fold removes and the report counts).
  sum_axes: C.SumAxesFacet = _no_sum_axes
  # ``(node) -> dims.DotDims | None``: a contraction's dimension numbers.
  contraction: C.ContractionFacet = _no_contraction
  # "+" (the output is the sum of its operands: add), "*" (their product:
  # mul), "/" (their quotient, operand 0 over operand 1: div) or "". The "+"
  # and "*" ones are the candidates for ``γ ⊙ K + β`` (fuse_affine, report
  # labels); "*" and "/" the factors defer_norms looks among.
  arith: str = ""
  # "move" (a single-operand step that only moves or copies elements:
  # reshape, transpose, broadcast_in_dim, squeeze, slice, rev, copy),
  # "convert" (a dtype conversion) or "": the steps that commute with an
  # elementwise product, ``chain(x ⊙ s) = chain(x) ⊙ chain(s)`` (defer_norms).
  reindex: str = ""
  # Present on the casts (convert_element_type, reduce_precision), None on
  # every other rule: ``(params, src, dst) -> (mantissa_bits, exponent_bits)
  # | None``, for a cast from dtype ``src`` to ``dst``, the precision of the
  # narrowest float format the value passes through; None when it is not a
  # float-to-float cast. fuse_affine sees through wide ones, blocks at others.
  cast: Optional[C.CastFacet] = None
  # ``(node) -> (mesh axis name, ...) | None``: output ``k`` is the sum of
  # operand ``k`` over the shards along these mesh axes (``psum``). Site
  # detection and the planner's mapping of a mean across shards.
  across: Optional[Callable] = None
  # ``(node, i) -> (frozenset of mesh axis names, ...)``: per dim of operand
  # ``i``, the mesh axes that split it; body input ``i`` is its local block
  # (``shard_map``).
  shards: Optional[Callable] = None
  # -- control flow (rules.control) --------------------------------------------
  # ``(eqn) -> (jaxpr, ...)``: the loop/branch bodies, each a sub-program.
  bodies: C.BodiesFacet = _no_bodies
  # ``(eqn) -> Inline | None``: a call whose body the program flattens at the
  # call site (its inputs and outputs are the equation's, in order).
  inline: C.InlineFacet = _no_inline
  # ``(node, k, i, outer, base) -> Facts``: facts of input ``i`` of body ``k``
  # (``outer``: the node's level; ``base``: what the input's own type says).
  body_facts: C.BodyFactsFacet = _no_body_facts
  # ``(node, k, i, spec, outer) -> [Need]``: input ``i`` of body ``k`` is
  # zero-sum over ``spec`` when these hold: ``Need(j, spec, transparent=True)``
  # is outer operand ``j`` read unchanged (the use continues through it),
  # ``Need(-1, spec, source=v, at=program)`` a value to show zero-sum afresh.
  body_zero_sum: C.BodyZeroSumFacet = _no_body_zero_sum
  # ``(node, ins, ctx, inner) -> [Poly | None]``: ``shift`` with extra seeds
  # ``inner`` ({body Level: {Val: Poly}}) placed inside the bodies.
  shift_inside: C.ShiftInsideFacet = _no_shift_inside
  # ``(eqn, invals, run) -> outs``: the rewrite of an equation whose bodies the
  # plan changes; ``run(body, args, sub=None, isolated=False)`` evaluates a
  # body with the plan (see ``rewrite.evaluate``). None: bound unchanged.
  rebind: Optional[C.RebindFacet] = None


DEFAULT = Rule("default", ())
_REGISTRY: dict = {}


class Inline(NamedTuple):
  """What ``Rule.inline`` returns for a call."""
  body: Any        # the called (closed) jaxpr; its inputs and outputs are the equation's
  kind: str        # "jit" | "remat" | "custom_jvp" | "custom_vjp" | "call"
  wrapper: bool    # computes exactly its body, with no boundary of its own (not a remat)


def register(rule: Rule, kind: str = "") -> Rule:
  if kind:
    rule = dataclasses.replace(rule, kind=kind)
  for p in rule.primitives:
    if p is None:
      continue
    if p in _REGISTRY:
      raise ValueError(f"primitive {p.name} has two rules: {_REGISTRY[p].name}, {rule.name}")
    _REGISTRY[p] = rule
  return rule


def set_facets(prims: Sequence, **facets) -> None:
  """Adds facets to the registered rules of ``prims`` (a facet family kept in
  its own module, e.g. ``rules.rotation``); every primitive of a family keeps
  sharing one rule object."""
  for old in {id(_REGISTRY[p]): _REGISTRY[p] for p in prims if p in _REGISTRY}.values():
    new = dataclasses.replace(old, **facets)
    for p, r in list(_REGISTRY.items()):
      if r is old:
        _REGISTRY[p] = new


def rule_for(prim: Any) -> Rule:
  return _REGISTRY.get(prim, DEFAULT)


def all_rules() -> list:
  """Every rule a program's node can reach (calls are flattened by
  ``program.Program`` and never reach the analysis: see ``call_rules``)."""
  return [r for r in _unique() if r.inline is _no_inline]


def call_rules() -> list:
  """The rules of call primitives (jit, remat, custom_jvp/vjp, closed calls)."""
  return [r for r in _unique() if r.inline is not _no_inline]


def _unique() -> list:
  seen, out = set(), []
  for r in _REGISTRY.values():
    if id(r) not in seen:
      seen.add(id(r))
      out.append(r)
  return out


# ----------------------------------------------------------------------------
# Helpers shared by the rule modules.


def size_one(shape: Sequence[int]) -> frozenset:
  if _INT.issuperset(map(type, shape)):   # (asked per operand of every node: cached)
    return _size_one_ints(tuple(shape))
  return frozenset(d for d, n in enumerate(shape) if _is_one(n))


_INT = frozenset([int])


@functools.lru_cache(maxsize=4096)
def _size_one_ints(shape: tuple) -> frozenset:
  return frozenset(d for d, n in enumerate(shape) if n == 1)


def _is_one(n) -> bool:
  try:
    return bool(n == 1)
  except Exception:  # symbolic dims: unknown, not one
    return False


def spec_dict(spec: Spec) -> dict:
  return dict(spec)


def freeze(spec: dict) -> Spec:
  return tuple(SpecEntry(d, b) for d, b in sorted(spec.items()))


def operand_spec(operand: Any, spec: Spec, out_shape: Sequence[int]) -> Optional[Spec]:
  """The spec an elementwise operand must satisfy, or None when it is
  broadcast along a spec dim (then it must be exactly zero)."""
  s = tuple(operand.shape)
  if len(s) != len(out_shape):
    return None if spec else ()
  for d, _ in spec:
    if s[d] != out_shape[d]:
      return None
  return spec


def full_dims(rank: int) -> frozenset:
  return frozenset(range(rank))


def lit_facts(a: Lit) -> Facts:
  import numpy as np
  v = np.asarray(a.value)
  key = (v.dtype, v.shape, v.tobytes(), len(a.shape))   # (programs repeat a few literals)
  f = _LIT_FACTS.get(key)
  if f is None:
    value = None
    if v.size == 1:
      value = A.exact(v.reshape(()))
      if value is None:
        value = float(v.reshape(())) if v.dtype.kind == "f" else None
    f = Facts(full_dims(len(a.shape)), value, False)
    if len(_LIT_FACTS) > 4096:
      _LIT_FACTS.clear()
    _LIT_FACTS[key] = f
  return f


_LIT_FACTS: dict = {}


def operand_const(ctx, a: Any, out_shape: Sequence[int]) -> frozenset:
  """Output dims along which operand ``a`` (implicitly broadcast) is constant."""
  s = tuple(a.shape)
  if len(s) != len(out_shape):
    return full_dims(len(out_shape)) if not s else frozenset()
  return ctx.facts(a).const | size_one(s)


def varying(poly: A.Poly, d: int) -> bool:
  return poly.dims[d] is not None


def fresh(block: int = 1) -> tuple:
  return (A.fresh_label(), block)


def lift_poly(p: A.Poly, a: Any, out_shape: Sequence[int]) -> A.Poly:
  """A poly on operand ``a`` seen at an elementwise op's (broadcast) output."""
  s = tuple(a.shape)
  out_shape = tuple(out_shape)
  if s == out_shape:
    return p
  if len(s) != len(out_shape):  # a scalar operand: the same c everywhere
    if any(e is not None for e in p.dims):
      raise Block("a varying shift on a scalar operand")
    dims = (None,) * len(out_shape)
  else:
    dims = p.dims  # size-1 dims are always constant in a poly
    # (a derived shift c0·F expanded from size-1 dims is c0·F made at the output's shape)
    return A.broadcast_derived(p, A.Poly(p.sym, dims, tuple(A.lift(c, out_shape) for c in p.coeffs)), s, out_shape)
  return A.Poly(p.sym, dims, tuple(A.lift(c, out_shape) for c in p.coeffs))


def is_zero(ctx, a: Any) -> bool:
  return ctx.facts(a).value == 0


def block_along(p: A.Poly, d: int) -> Optional[int]:
  e = p.dims[d]
  return None if e is None else e[1]


def out_val(node: Node, k: int = 0) -> Val:
  return node.outs[k]


def operands(node: Node) -> tuple:
  return node.ins
