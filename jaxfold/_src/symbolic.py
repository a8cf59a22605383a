"""Polynomials in a shift symbol with canonical symbolic coefficients.

A value ``v`` downstream of a perturbation is tracked as

    v(c) = v + a1 * c + a2 * c**2 + ...

where ``c`` is a symbol standing for an arbitrary tensor that is constant
along some dimensions (its *embedding*, below) and the ``a_k`` are canonical
polynomials over opaque atoms (jaxpr values), reductions and layout changes.
A value whose non-constant coefficients all cancel (``h - mean(h)`` or
``E[h^2] - E[h]^2``) does not depend on the shift: this is how a
normalization is recognised as shift-invariant without matching one exact
sequence of equations. Anything not understood stays symbolic, so two
expressions only cancel when they are provably equal (fail closed).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional

# A coefficient: {monomial: scalar}; a monomial is a sorted tuple of factors.
Coef = dict
_TOL = 1e-6
_MAX_DEGREE = 4
_ids = itertools.count()


def const(k: float) -> Coef:
  return {(): float(k)} if k else {}


def atom(key: Any) -> Coef:
  return {(("atom", key),): 1.0}


def is_const(a: Coef) -> bool:
  return all(m == () for m in a)


def const_value(a: Coef) -> float:
  return a.get((), 0.0)


def freeze(a: Coef) -> tuple:
  return tuple(sorted(a.items(), key=lambda kv: hash(kv[0])))


def _clean(a: Coef) -> Coef:
  scale = max((abs(v) for v in a.values()), default=0.0)
  return {m: v for m, v in a.items() if abs(v) > _TOL * max(scale, 1.0)}


def add(a: Coef, b: Coef, kb: float = 1.0) -> Coef:
  out = dict(a)
  for m, v in b.items():
    out[m] = out.get(m, 0.0) + kb * v
  # Cancellation is judged relative to the terms that met, not the result.
  scale = max([abs(v) for v in a.values()] + [abs(v) for v in b.values()] + [1.0])
  return {m: v for m, v in out.items() if abs(v) > _TOL * scale}


def scale(a: Coef, k: float) -> Coef:
  return {m: v * k for m, v in a.items()} if k else {}


def mul(a: Coef, b: Coef) -> Coef:
  out: Coef = {}
  for (ma, va), (mb, vb) in itertools.product(a.items(), b.items()):
    # Hash order is canonical within a process; a collision can only hide a
    # cancellation (fail closed), never invent one.
    m = tuple(sorted(ma + mb, key=hash))
    out[m] = out.get(m, 0.0) + va * vb
  return _clean(out)


def wrap(a: Coef, tag: tuple, const_rule=None) -> Coef:
  """Applies a linear map ``tag`` monomial by monomial.

  ``const_rule(k)`` gives the image of a constant (layouts keep it,
  reductions multiply it by the number of reduced elements).
  """
  out: Coef = {}
  for m, v in a.items():
    if m == ():
      k = const_rule(v) if const_rule else v
      out[()] = out.get((), 0.0) + k
    else:
      f = (tag[0], tag[1:], ((m, 1.0),))
      out[(f,)] = out.get((f,), 0.0) + v
  return out


def inverse(a: Coef) -> Coef:
  if is_const(a) and const_value(a):
    return const(1.0 / const_value(a))
  return {(("inv", freeze(a)),): 1.0}


@dataclasses.dataclass(frozen=True)
class Poly:
  """The shift-dependent part of one value.

  Attributes:
    sym: identity of the shift symbol.
    emb: per dimension of the value, ``None`` where the shift is constant
      along it, else ``(home, block)``: the symbol varies along that
      dimension, in blocks of ``block`` elements (grouped centering).
    coeffs: coefficients of c, c**2, ... (at least one non-zero).
  """
  sym: int
  emb: tuple
  coeffs: tuple

  @property
  def is_pure(self) -> bool:
    """Degree one with a constant coefficient: ``v + k * c``."""
    return len(self.coeffs) == 1 and is_const(self.coeffs[0])

  def same_symbol(self, other: "Poly") -> bool:
    return self.sym == other.sym and self.emb == other.emb


def new_symbol() -> int:
  return next(_ids)


def make(sym: int, emb: tuple, coeffs: list[Coef]) -> Optional[Poly]:
  """Builds a Poly, or returns None when every coefficient cancelled."""
  coeffs = list(coeffs)
  while coeffs and not coeffs[-1]:
    coeffs.pop()
  if not coeffs:
    return None
  if len(coeffs) > _MAX_DEGREE:
    raise Unsupported("the shift enters a polynomial of too high degree")
  return Poly(sym, tuple(emb), tuple(coeffs))


def pure(emb: tuple) -> Poly:
  """A fresh pure shift ``v + c`` with the given embedding."""
  return Poly(new_symbol(), tuple(emb), (const(1.0),))


def poly_add(p: Poly, q: Poly, kq: float) -> Optional[Poly]:
  n = max(len(p.coeffs), len(q.coeffs))
  pc = list(p.coeffs) + [{}] * (n - len(p.coeffs))
  qc = list(q.coeffs) + [{}] * (n - len(q.coeffs))
  return make(p.sym, p.emb, [add(a, b, kq) for a, b in zip(pc, qc)])


def poly_mul(p: Poly, cp: Coef, q: Poly, cq: Coef) -> Optional[Poly]:
  """(cp + sum p_k c^k) * (cq + sum q_k c^k), minus the constant term."""
  pa = [cp] + list(p.coeffs)
  qa = [cq] + list(q.coeffs)
  out = [{} for _ in range(len(pa) + len(qa) - 1)]
  for i, a in enumerate(pa):
    for j, b in enumerate(qa):
      if i + j:
        out[i + j] = add(out[i + j], mul(a, b))
  return make(p.sym, p.emb, out[1:])


def poly_scale(p: Poly, factor: Coef) -> Optional[Poly]:
  return make(p.sym, p.emb, [mul(a, factor) for a in p.coeffs])


class Unsupported(Exception):
  """The analysis cannot follow the shift further; the message says why."""
