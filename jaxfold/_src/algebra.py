"""Exact canonical expressions over a program's values.

An ``Expr`` is a polynomial with exact rational coefficients over *factors*:
opaque values of the program (atoms), applications of functions to
canonical arguments, and strided views (reshape/transpose/broadcast/slice/rev
compositions) of those. Equal ``Expr``s denote equal tensors: every function
application includes all of its arguments and static parameters, rational
arithmetic is exact, and the only rewrites are identities of real arithmetic
(ring laws, linearity of sums and contractions, views commuting with
elementwise functions). So two expressions cancel only when the values they
stand for are provably equal, never within a tolerance.

Invariant: every factor of a non-constant ``Expr`` has the ``Expr``'s shape;
implicit broadcasting is made explicit by a view when operands meet.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from fractions import Fraction
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jaxfold._src import compat

Shape = tuple


class Unrepresentable(Exception):
  """An expression too large to keep canonical; callers fail closed."""


# ----------------------------------------------------------------------------
# Strided views: every composition of index-remapping primitives that numpy
# could express without a copy, in one canonical form.


def _concrete(shape) -> bool:
  return _INT.issuperset(map(type, shape)) or all(isinstance(d, (int, np.integer)) for d in shape)


_INT = frozenset([int])


class NotStrided(ValueError):
  """A view op whose result is no strided view (callers nest the op opaquely)."""


def _sym_dims(shape: Shape, strides: Sequence[int]) -> tuple:
  """``shape`` with its int dims as ``int``; a symbolic dim (``jax.export``) is
  kept only where its stride is 0: a concrete source repeated along it reads
  the same elements whatever its size (1 included). Anything else raises
  NotStrided."""
  out = []
  for n, s in zip(shape, strides):
    if isinstance(n, (int, np.integer)):
      out.append(int(n))
    elif type(s) is int and s == 0:
      out.append(n)
    else:
      raise NotStrided(f"a symbolic dim {n} with stride {s}")
  return tuple(out)


class View:
  """``out[i] = src.flat[offset + Σ_d strides[d] * i[d]]``.

  Size-1 output dims have stride 0, so equal index maps have equal views.
  ``src``, ``strides`` and ``offset`` are ints; an output dim may be symbolic
  (an export's batch) where its stride is 0 (see :func:`_sym_dims`).
  """
  __slots__ = ("src", "shape", "strides", "offset", "_hash")

  def __init__(self, src: Shape, shape: Shape, strides: Sequence[int], offset: int = 0):
    self.src = tuple(map(int, src))
    if _concrete(shape):
      self.shape = shape = tuple(map(int, shape))
      self.strides = tuple([0 if n == 1 else int(s) for n, s in zip(shape, strides)])
    else:
      self.shape = shape = _sym_dims(shape, strides)
      self.strides = tuple([0 if type(n) is not int or n == 1 else int(s) for n, s in zip(shape, strides)])
    self.offset = int(offset)
    self._hash = hash((self.src, self.shape, self.strides, self.offset))

  def __eq__(self, other):
    return (isinstance(other, View) and self._hash == other._hash and self.src == other.src
            and self.shape == other.shape and self.strides == other.strides
            and self.offset == other.offset)

  def __hash__(self):
    return self._hash

  def __repr__(self):
    return f"View({self.src}->{self.shape}, strides={self.strides}, offset={self.offset})"

  @staticmethod
  def identity(shape: Shape) -> "View":
    return _identity_view(tuple(shape))

  @property
  def is_identity(self) -> bool:
    return self.src == self.shape and self.offset == 0 and self.strides == _identity_strides(self.shape)

  def constant_along(self, d: int) -> bool:
    return self.strides[d] == 0

  # Each op returns the view of (op applied to this view), or None when the
  # composition is not strided (then the caller nests opaquely).

  def reshape(self, new_shape: Shape) -> Optional["View"]:
    if not (_concrete(new_shape) and _concrete(self.shape)):
      return self._sym_reshape(tuple(int(n) if isinstance(n, (int, np.integer)) else n for n in new_shape))
    new_shape = tuple(int(d) for d in new_shape)
    # Every layer reshapes views alike (heads split and merged): remembered
    # by value (Views are immutable).
    key = (self, new_shape)
    hit = _RESHAPED.get(key, _RESHAPED)
    if hit is _RESHAPED:
      hit = self._reshape(new_shape)
      if len(_RESHAPED) > 4096:
        _RESHAPED.clear()
      _RESHAPED[key] = hit
    return hit

  def _reshape(self, new_shape: tuple) -> Optional["View"]:
    if math.prod(new_shape) != math.prod(self.shape):
      return None
    # Drop size-1 dims, then split/merge like numpy's no-copy reshape.
    old = [(n, s) for n, s in zip(self.shape, self.strides) if n != 1]
    out: list[int] = []
    i = 0
    targets = [n for n in new_shape if n != 1]
    j = 0
    while j < len(targets):
      if i >= len(old):
        return None
      # Accumulate a group of old dims and a group of new dims of equal size.
      gi, gj = [old[i]], [targets[j]]
      pi, pj = old[i][0], targets[j]
      i += 1
      j += 1
      while pi != pj:
        if pi < pj:
          if i >= len(old):
            return None
          gi.append(old[i]); pi *= old[i][0]; i += 1
        else:
          if j >= len(targets):
            return None
          gj.append(targets[j]); pj *= targets[j]; j += 1
      # The old group must be contiguous in the strided sense.
      for (_, s0), (n1, s1) in zip(gi, gi[1:]):
        if s0 != s1 * n1:
          return None
      inner = gi[-1][1]
      strides = []
      acc = inner
      for n in reversed(gj):
        strides.append(acc)
        acc *= n
      out.extend(reversed(strides))
    if i != len(old):
      return None
    it = iter(out)
    full = [0 if n == 1 else next(it) for n in new_shape]
    return View(self.src, new_shape, full, self.offset)

  def _sym_reshape(self, new_shape: tuple) -> Optional["View"]:
    """A reshape with symbolic dims, one group at a time: runs of consecutive
    dims of both shapes whose products are provably equal (for every value of
    the symbols) split the row-major flat index alike, so the reshape acts on
    each group alone. A group the view is constant along (strides 0: where
    every symbolic dim is) stays constant whatever its new dims; an all-int
    group is reshaped as ints; anything else is None."""
    # Size-1 dims (stride 0) do not move the row-major index: set aside.
    keep_a = [i for i, n in enumerate(self.shape) if not (type(n) is int and n == 1)]
    keep_b = [j for j, n in enumerate(new_shape) if not (type(n) is int and n == 1)]
    groups = _reshape_groups(tuple(self.shape[i] for i in keep_a), tuple(new_shape[j] for j in keep_b))
    if groups is None:
      return None
    strides = [0] * len(new_shape)
    for gi, gj in groups:
      gi, gj = [keep_a[i] for i in gi], [keep_b[j] for j in gj]
      if all(self.strides[i] == 0 for i in gi):
        continue
      old, new = tuple(self.shape[i] for i in gi), tuple(new_shape[j] for j in gj)
      if not (_concrete(old) and _concrete(new)):
        return None
      v = View(self.src, old, tuple(self.strides[i] for i in gi), 0)._reshape(new)
      if v is None:
        return None
      for j, st in zip(gj, v.strides):
        strides[j] = st
    return View(self.src, new_shape, strides, self.offset)

  def transpose(self, perm: Sequence[int]) -> "View":
    return View(self.src, tuple(self.shape[p] for p in perm),
                tuple(self.strides[p] for p in perm), self.offset)

  def broadcast(self, out_shape: Shape, dims: Sequence[int]) -> Optional["View"]:
    """``broadcast_in_dim`` semantics: operand dim k goes to output dim dims[k]."""
    key = (self, tuple(out_shape), tuple(dims))   # (remembered as reshape is)
    hit = _BROADCAST.get(key, _BROADCAST)
    if hit is _BROADCAST:
      hit = self._broadcast(out_shape, dims)
      if len(_BROADCAST) > 4096:
        _BROADCAST.clear()
      _BROADCAST[key] = hit
    return hit

  def _broadcast(self, out_shape: Shape, dims: Sequence[int]) -> Optional["View"]:
    strides = [0] * len(out_shape)
    for k, d in enumerate(dims):
      if self.shape[k] not in (1, out_shape[d]):
        return None
      strides[d] = self.strides[k] if self.shape[k] == out_shape[d] else 0
    return View(self.src, out_shape, strides, self.offset)

  def slice(self, starts: Sequence[int], limits: Sequence[int],
            steps: Optional[Sequence[int]] = None) -> "View":
    steps = steps or (1,) * len(starts)
    if not (_concrete(self.shape) and _concrete(starts) and _concrete(limits)):
      return self._sym_slice(starts, limits, steps)
    shape = tuple(max(0, -(-(hi - lo) // st)) for lo, hi, st in zip(starts, limits, steps))
    offset = self.offset + sum(lo * s for lo, s in zip(starts, self.strides))
    return View(self.src, shape, tuple(s * st for s, st in zip(self.strides, steps)), offset)

  def _sym_slice(self, starts, limits, steps) -> "View":
    shape, strides, offset = [], [], self.offset
    for n, s, lo, hi, st in zip(self.shape, self.strides, starts, limits, steps):
      if _concrete((n, lo, hi, st)):
        shape.append(max(0, -(-(hi - lo) // st)))
        offset += lo * s
        strides.append(s * st)
      elif type(lo) is int and lo == 0 and st == 1 and _provably_equal(hi, n):
        shape.append(n)               # a symbolic dim sliced whole (stride 0: no offset)
        strides.append(s)
      elif _concrete((lo, hi, st)) and 0 <= lo <= hi and st > 0 and provably_le(hi, n):
        shape.append(-(-(hi - lo) // st))   # an int window of a symbolic dim: the same constant
        strides.append(s)
      else:
        raise NotStrided("a slice of part of a symbolic dim")
    return View(self.src, tuple(shape), strides, offset)

  def rev(self, dims: Sequence[int]) -> "View":
    strides = list(self.strides)
    offset = self.offset
    for d in dims:
      if strides[d]:   # (a symbolic dim has stride 0: reversing it changes nothing)
        offset += (self.shape[d] - 1) * strides[d]
        strides[d] = -strides[d]
    return View(self.src, self.shape, strides, offset)

  def drop(self, dims: Sequence[int]) -> "View":
    """Removes dims along which the view is constant (after a reduction)."""
    keep = [d for d in range(len(self.shape)) if d not in dims]
    return View(self.src, tuple(self.shape[d] for d in keep),
                tuple(self.strides[d] for d in keep), self.offset)


_RESHAPED: dict = {}
_BROADCAST: dict = {}


def _provably_equal(a, b) -> bool:
  """``a == b`` for every value of their symbolic dims (jax's ``==`` is False
  unless it can prove it; an undecidable comparison counts as unequal)."""
  try:
    return bool(a == b)
  except Exception:  # noqa: BLE001 - jax raises several types for undecidable symbolic comparisons
    return False


def provably_le(a, b) -> bool:
  """``a <= b`` for every value of the symbolic dims (else False)."""
  try:
    return bool(a <= b)
  except Exception:  # noqa: BLE001 - jax's InconclusiveDimensionOperation
    return False


def _reshape_groups(a: Shape, b: Shape) -> Optional[list]:
  """``[(dims of a, dims of b), ...]``: consecutive runs covering both shapes in
  order, each pair's products provably equal (for every value of the symbols);
  None when none is found. Any such partition is exact, so how it is searched
  only decides whether one is found: a run grows on the side of the smaller
  product, or on either where jax cannot compare them (``b`` and ``b·s``)."""
  budget = [64]

  def search(i, j):
    if i == len(a) and j == len(b):
      return []
    if i == len(a) or j == len(b):
      return None
    return grow(i + 1, j + 1, a[i], b[j])

  def grow(i, j, pi, pj):
    budget[0] -= 1
    if budget[0] < 0:
      return None
    if _provably_equal(pi, pj):
      rest = search(i, j)
      return None if rest is None else [(i, j)] + rest
    try:
      order = ("a", "b") if bool(pi < pj) else ("b", "a")
      order = order[:1]
    except Exception:  # noqa: BLE001 - jax's InconclusiveDimensionOperation: try both sides
      order = ("a", "b")
    for side in order:
      if side == "a" and i < len(a):
        out = grow(i + 1, j, pi * a[i], pj)
      elif side == "b" and j < len(b):
        out = grow(i, j + 1, pi, pj * b[j])
      else:
        continue
      if out is not None:
        return out
    return None

  ends = search(0, 0)
  if ends is None:
    return None
  out, i0, j0 = [], 0, 0
  for i, j in ends:
    out.append((list(range(i0, i)), list(range(j0, j))))
    i0, j0 = i, j
  return out


def _row_major(shape: Shape) -> tuple:
  out, acc = [], 1
  for n in reversed(shape):
    out.append(acc)
    acc *= int(n)
  return tuple(reversed(out))


@functools.lru_cache(maxsize=4096)
def _identity_view(shape: Shape) -> View:
  return View(shape, shape, _row_major(shape))   # (immutable: shared)


@functools.lru_cache(maxsize=4096)
def _identity_strides(shape: Shape) -> tuple:
  """``View.identity(shape).strides`` (size-1 dims stride 0), without building the view."""
  return tuple(0 if n == 1 else s for n, s in zip(shape, _row_major(shape)))


# ----------------------------------------------------------------------------
# Factors, interned so that a monomial is a sorted tuple of small ints.


class Factor:
  __slots__ = ("id", "kind", "key", "shape", "args", "elementwise")

  def __init__(self, fid, kind, key, shape, args, elementwise):
    self.id = fid
    self.kind = kind              # "atom" | "app" | "view"
    self.key = key                # atom: identity; app: tag; view: View
    self.shape = shape
    self.args = args              # app: tuple[Expr]; view: (base factor id,)
    self.elementwise = elementwise

  def __repr__(self):
    if self.kind == "atom":
      return f"atom{self.key!r}"
    if self.kind == "view":
      return f"view[{self.key}]({_FACTORS[self.args[0]]!r})"
    return f"{self.key}({', '.join(map(repr, self.args))})"


_FACTORS: list[Factor] = []
_INTERN: dict = {}
_DERIVED: dict = {}
# Results of the costlier pure operations on expressions, by their arguments:
# the shifts of different centerings meet the same values (a LayerNorm's
# square and sums) with the same coefficients, only their symbols differ.
_MEMO: dict = {}
_DEPTH = [0]
# The tables are the module's: analyses in two threads (a folded apply_fn
# called at new shapes from a thread pool, folds run in parallel) would
# interleave their factor ids, so that one key names another's factor.
_LOCK = threading.RLock()


class scope:
  """One analysis: factor tables are dropped when the outermost scope ends,
  so a long-running process does not accumulate them. One thread at a time
  (pure Python under the GIL: nothing ran in parallel anyway)."""

  def __enter__(self):
    _LOCK.acquire()
    _DEPTH[0] += 1

  def __exit__(self, *exc):
    try:
      _DEPTH[0] -= 1
      if not _DEPTH[0]:
        _FACTORS.clear()
        _INTERN.clear()
        _DERIVED.clear()
        _MEMO.clear()
    finally:
      _LOCK.release()


def _factor(kind: str, key: Any, shape: Shape, args: tuple = (), elementwise: bool = False) -> int:
  k = (kind, key, shape, args)
  fid = _INTERN.get(k)
  if fid is None:
    fid = len(_FACTORS)
    _FACTORS.append(Factor(fid, kind, key, shape, args, elementwise))
    _INTERN[k] = fid
  return fid


# ----------------------------------------------------------------------------
# Expressions.

MAX_TERMS = 64
_F0, _F1, _FM1 = Fraction(0), Fraction(1), Fraction(-1)   # shared: building a Fraction is a hot path's cost


class Expr:
  """A polynomial ``{monomial: Fraction}``; a monomial is a sorted factor-id tuple."""
  __slots__ = ("terms", "shape", "_hash")

  def __init__(self, terms: dict, shape: Optional[Shape]):
    self.terms = {m: c for m, c in terms.items() if c}
    if len(self.terms) > MAX_TERMS:
      raise Unrepresentable(f"an expression with {len(self.terms)} terms")
    self.shape = shape if any(self.terms) else None
    self._hash = None

  def __eq__(self, other):
    return isinstance(other, Expr) and self.terms == other.terms

  def __hash__(self):
    if self._hash is None:
      # The monomials only: equal terms have equal monomials, and hashing a
      # Fraction (a modular inverse, in Python) dominated the interning of
      # factors and the memo lookups; coefficients are compared on a match.
      self._hash = hash(frozenset(self.terms))
    return self._hash

  def __repr__(self):
    if not self.terms:
      return "0"
    parts = []
    for m, c in sorted(self.terms.items()):
      fs = "*".join(repr(_FACTORS[f]) for f in m)
      parts.append(f"{c}" + (f"*{fs}" if fs else ""))
    return " + ".join(parts)

  @property
  def is_zero(self) -> bool:
    return not self.terms

  @property
  def is_const(self) -> bool:
    t = self.terms   # (at most one monomial, (), is constant)
    return not t or (len(t) == 1 and () in t)

  @property
  def const_value(self) -> Fraction:
    return self.terms.get((), _F0)

  def monomials(self):
    return self.terms.items()


def _expr(terms: dict, shape: Optional[Shape]) -> Expr:
  """``Expr(terms, shape)`` for terms known canonical: no zero coefficient,
  at most MAX_TERMS, ``shape`` None when constant (what Expr.__init__ checks)."""
  e = object.__new__(Expr)
  e.terms, e.shape, e._hash = terms, shape, None
  return e


def _sum_expr(terms: dict, shape: Optional[Shape], cancelled: bool) -> Expr:
  """``Expr(terms, shape)`` for terms whose coefficients are non-zero unless
  ``cancelled`` (a sum came to zero): the filter only when it can remove one."""
  if cancelled:
    terms = {m: c for m, c in terms.items() if c}
  if len(terms) > MAX_TERMS:
    raise Unrepresentable(f"an expression with {len(terms)} terms")
  return _expr(terms, shape if any(terms) else None)


ZERO = Expr({}, None)
ONE = Expr({(): _F1}, None)


def const(k) -> Expr:
  if not k:
    return ZERO
  return _expr({(): k if type(k) is Fraction else Fraction(k)}, None)


def atom(key: Any, shape: Shape) -> Expr:
  shape = tuple(shape)
  return _expr({(_factor("atom", key, shape),): _F1}, shape)


def factor(fid: int) -> "Factor":
  """The interned factor ``fid`` of the current scope (what a monomial's ids name)."""
  return _FACTORS[fid]


def single(fid: int) -> Expr:
  """The expression made of factor ``fid`` alone."""
  return _expr({(fid,): _F1}, _FACTORS[fid].shape)


def add(a: Expr, b: Expr, kb=1) -> Expr:
  shape, a, b = _lift2(a, b)
  if not b.terms:
    return a
  out = dict(a.terms)
  cancelled = not kb
  for m, c in b.terms.items():
    if kb != 1:   # (Fraction arithmetic dominates the analysis: skip the identities)
      c = (_FM1 if c is _F1 else -c) if kb == -1 else kb * c
    prev = out.get(m)
    if prev is not None:
      c = prev + c
      cancelled = cancelled or not c
    out[m] = c
  return _sum_expr(out, shape, cancelled)


def sub(a: Expr, b: Expr) -> Expr:
  return add(a, b, -1)


def scale(a: Expr, k) -> Expr:
  if k == 1:
    return a
  if type(k) is not Fraction:
    k = Fraction(k)
  return _expr({m: c * k for m, c in a.terms.items()}, a.shape) if k else ZERO   # (k ≠ 0: no zero made)


def mul(a: Expr, b: Expr) -> Expr:
  if a.is_const:
    return scale(b, a.const_value)
  if b.is_const:
    return scale(a, b.const_value)
  key = ("*", a, b)
  hit = _MEMO.get(key)
  if hit is not None:
    return hit
  shape, a, b = _lift2(a, b)
  if len(a.terms) * len(b.terms) > 4 * MAX_TERMS:
    raise Unrepresentable("a product of large sums")
  out: dict = {}
  cancelled = False
  for (ma, ca), (mb, cb) in itertools.product(a.terms.items(), b.terms.items()):
    m = tuple(sorted(ma + mb))
    c = cb if ca is _F1 else ca if cb is _F1 else ca * cb   # (most coefficients are one)
    prev = out.get(m)
    if prev is not None:
      c = prev + c
      cancelled = cancelled or not c
    out[m] = c
  e = _MEMO[key] = _sum_expr(out, shape, cancelled)
  return e


def power(a: Expr, n: int) -> Expr:
  out = ONE
  for _ in range(n):
    out = mul(out, a)
  return out


def _lift2(a: Expr, b: Expr) -> tuple:
  """``(shape, a, b)``: both operands lifted to their broadcast shape."""
  sa, sb = a.shape, b.shape
  if sa is None:
    return sb, a, b
  if sb is None or sa == sb:
    return sa, a, b
  shape = _join(a, b)
  return shape, lift(a, shape), lift(b, shape)


def _join(a: Expr, b: Expr) -> Optional[Shape]:
  """The broadcast shape of two operands (equal rank with size-1 dims, or scalars)."""
  sa, sb = a.shape, b.shape
  if sa is None:
    return sb
  if sb is None or sa == sb:
    return sa
  if len(sa) == 0:
    return sb
  if len(sb) == 0:
    return sa
  if len(sa) != len(sb):
    raise Unrepresentable(f"operands of ranks {len(sa)} and {len(sb)}")
  return tuple(y if x == 1 else x for x, y in zip(sa, sb))


def lift(a: Expr, shape: Optional[Shape]) -> Expr:
  """Makes implicit broadcasting explicit so every factor has ``shape``."""
  if a.shape is None or shape is None or a.shape == shape:
    return a
  src = a.shape
  dims = tuple(range(len(shape) - len(src), len(shape))) if len(src) < len(shape) else tuple(
      range(len(src)))
  return view_op(a, shape, lambda v: v.broadcast(shape, dims), ("broadcast", dims))


# ----------------------------------------------------------------------------
# Functions of expressions.


# Tags of the applications algebra itself reasons about (inverses, signs,
# sums): symbols of this module, not primitive names (rules map primitives
# to them: ``sqrt`` to ``SQRT``).
SQRT = ("√",)
RSQRT = ("1/√",)
SUM = "Σ"           # app((SUM, axes, in_shape), ...): a sum over axes
BOXED = "≡"         # app((BOXED,), (e,)): e itself, kept as one opaque factor (see ``boxed``)
_DROP = ("drop size-1 dims",)
_EXP = "e^"         # derived shift symbols of exp_of


def app(tag: Any, args: Sequence[Expr], shape: Shape, elementwise: bool = True,
        commutative: bool = False) -> Expr:
  """An opaque function application, canonical in its (lifted) arguments."""
  shape = tuple(shape)
  args = tuple(lift(a, shape) if elementwise else a for a in args)
  if commutative:
    args = tuple(sorted(args, key=_expr_order))
  return single(_factor("app", tag, shape, args, elementwise))


def boxed(e: Expr, shape: Shape) -> Expr:
  """``e`` as a single opaque factor keyed by ``e`` itself: an expression too
  long to multiply out cheaply (a residual stream, a variance) stands for
  itself, and two values with equal expressions get the same factor, so that
  a statistic computed twice (two ``jnp.var`` calls) is one symbol. Not
  elementwise: views, sums and products treat it as they treat an atom."""
  if e.is_const:
    return e
  return app((BOXED,), (e,), shape, elementwise=False)


def _expr_order(e: Expr):
  return tuple(sorted((m, c) for m, c in e.terms.items()))


def inv(a: Expr, shape: Shape) -> Expr:
  if a.is_const:
    k = a.const_value
    if not k:
      raise Unrepresentable("division by zero")
    return const(1 / k)
  f = _only_factor(a)
  if f is not None and f.kind == "app" and f.key == SQRT:
    return app(RSQRT, f.args, f.shape)
  if f is not None and f.kind == "app" and f.key == RSQRT:
    return app(SQRT, f.args, f.shape)
  return app(("inv",), (a,), shape)


def _only_factor(a: Expr) -> Optional[Factor]:
  if len(a.terms) == 1:
    (m, c), = a.terms.items()
    if c == 1 and len(m) == 1:
      return _FACTORS[m[0]]
  return None


def view_op(a: Expr, out_shape: Shape, op: Callable[[View], Optional[View]], tag: Any) -> Expr:
  """Applies an index-remapping primitive: constants pass, views compose, and
  the op distributes over sums, products and elementwise functions.

  ``tag`` names the op: with the operand's shape and ``out_shape`` it must
  determine ``op`` (a non-strided result is the opaque application
  ``("layout", tag, shape)``, and results are memoised by tag within a scope:
  the shifts of different centerings view the same coefficients alike)."""
  if a.is_const:
    return a
  out_shape = tuple(out_shape)
  key = ("view", a, out_shape, tag)
  hit = _MEMO.get(key)
  if hit is not None:
    return hit
  out: dict = {}
  cancelled = False
  for m, c in a.terms.items():
    nm = tuple(sorted([_view_factor(f, out_shape, op, tag) for f in m]))
    prev = out.get(nm)
    if prev is not None:
      c = prev + c
      cancelled = cancelled or not c
    out[nm] = c
  e = _MEMO[key] = _sum_expr(out, out_shape, cancelled)
  return e


def _view_factor(fid: int, out_shape: Shape, op, tag) -> int:
  key = ("vf", fid, out_shape, tag)
  hit = _MEMO.get(key)
  if hit is not None:
    return hit
  f = _FACTORS[fid]
  if f.kind == "app" and f.elementwise:
    args = tuple(view_op(x, out_shape, op, tag) for x in f.args)
    res = _factor("app", f.key, out_shape, args, True)
  else:
    base, view = (f.args[0], f.key) if f.kind == "view" else (fid, None)
    new = None
    if _concrete(f.shape) and _concrete(out_shape):
      new = op(view if view is not None else View.identity(f.shape))
    elif view is not None or _concrete(f.shape):
      # A concrete source seen at symbolic shapes (an export's batch): a view
      # only where every symbolic dim repeats it (stride 0); anything a view
      # op cannot prove for every size of those dims nests opaquely.
      try:
        new = op(view if view is not None else View.identity(f.shape))
      except Exception:  # noqa: BLE001 - NotStrided, or jax's errors on undecidable symbolic arithmetic
        new = None
      if new is not None and not _provably_equal(new.shape, out_shape):
        new = None
    if new is None:
      # Not strided: nest the op opaquely around the whole factor.
      res = _factor("app", ("layout", tag, f.shape), out_shape, (single(fid),), False)
    elif new.is_identity and new.src == _FACTORS[base].shape:
      res = base
    else:
      res = _factor("view", new, out_shape, (base,))
  _MEMO[key] = res
  return res


def _constant_along(fid: int, dims: Sequence[int]) -> bool:
  f = _FACTORS[fid]
  if all(f.shape[d] == 1 for d in dims):
    return True
  if f.kind == "view":
    return all(f.key.constant_along(d) for d in dims)
  if f.kind == "app" and f.elementwise:
    return all(expr_constant_along(x, dims) for x in f.args)
  return False


def expr_constant_along(e: Expr, dims) -> bool:
  return all(_constant_along(f, dims) for m in e.terms for f in m)


def _drop_dims(fid: int, dims: Sequence[int], out_shape: Shape) -> int:
  """The factor with ``dims`` (along which it is constant) removed."""
  f = _FACTORS[fid]
  if f.kind == "view":
    v = f.key.drop(dims)
    base = f.args[0]
    return base if (v.is_identity and v.src == _FACTORS[base].shape) else _factor(
        "view", v, out_shape, (base,))
  if f.kind == "app" and f.elementwise:
    args = tuple(_drop_expr(x, dims, out_shape) for x in f.args)
    return _factor("app", f.key, out_shape, args, True)
  # An atom or opaque app with size 1 along dims: a reshape dropping them.
  return _view_factor(fid, out_shape, lambda v: v.reshape(out_shape), _DROP)


def _drop_expr(e: Expr, dims, out_shape) -> Expr:
  if e.is_const:
    return e
  out: dict = {}
  for m, c in e.terms.items():
    nm = tuple(sorted(_drop_dims(f, dims, out_shape) for f in m))
    prev = out.get(nm)
    out[nm] = c if prev is None else prev + c
  return Expr(out, out_shape)


def reduce_sum(a: Expr, axes: Sequence[int], in_shape: Shape) -> Expr:
  """Σ over ``axes``; linear, and factors constant along them come out."""
  axes = tuple(sorted(axes))
  out_shape = tuple(n for d, n in enumerate(in_shape) if d not in axes)
  if not _concrete([in_shape[d] for d in axes]):
    return app(("reduce_sum_sym", axes, tuple(map(str, in_shape))), (a,), out_shape, False)
  count = math.prod(int(in_shape[d]) for d in axes)
  if a.is_const:
    return scale(a, count)
  key = ("Σ", a, axes, tuple(in_shape)) if _concrete(in_shape) else None
  hit = _MEMO.get(key) if key is not None else None
  if hit is not None:
    return hit
  in_shape = tuple(in_shape)
  a = lift(a, in_shape)
  # Each term gives one monomial (the factors constant along ``axes`` times
  # the sum of the rest), summed as ``add`` would, one term after another.
  k = Fraction(count)
  out: dict = {}
  for m, c in a.terms.items():
    inside, outside = [], []
    for f in m:
      if _constant_along(f, axes):
        outside.append(_drop_dims(f, axes, out_shape))
      else:
        inside.append(f)
    if inside:
      body = _expr({tuple(inside): _F1}, in_shape)
      outside.append(_factor("app", (SUM, axes, in_shape), out_shape, (body,), False))
    elif count != 1:
      if not count:
        continue
      c = c * k
    mono = tuple(sorted(outside))
    prev = out.get(mono)
    if prev is None:
      out[mono] = c
    else:
      c = prev + c
      if c:
        out[mono] = c
      else:
        del out[mono]
    if len(out) > MAX_TERMS:
      raise Unrepresentable(f"an expression with {len(out)} terms")
  out = _expr(out, out_shape if any(out) else None)
  if key is not None:
    _MEMO[key] = out
  return out


def bilinear(tag: Any, a: Expr, b: Expr, out_shape: Shape) -> Expr:
  """A contraction: distributes over both operands' sums."""
  if a.is_zero or b.is_zero:
    return ZERO
  out: dict = {}
  for (ma, ca), (mb, cb) in itertools.product(a.terms.items(), b.terms.items()):
    ea = Expr({ma: _F1}, a.shape if ma else None)
    eb = Expr({mb: _F1}, b.shape if mb else None)
    fid = _factor("app", tag, tuple(out_shape), (ea, eb), False)
    c = ca * cb
    prev = out.get((fid,))
    out[(fid,)] = c if prev is None else prev + c
  return Expr(out, tuple(out_shape))


def nonneg(e: Expr) -> bool:
  """Provably ≥ 0 everywhere: positive sums of squares, sums of those, roots."""
  if e.is_const:
    return e.const_value >= 0
  for m, c in e.terms.items():
    if c < 0:
      return False
    for f in set(m):
      if m.count(f) % 2 and not _nonneg_factor(f):
        return False
  return True


def _nonneg_factor(fid: int) -> bool:
  f = _FACTORS[fid]
  if f.kind == "view":
    return _nonneg_factor(f.args[0])
  if f.kind == "app" and isinstance(f.key, tuple) and f.key:
    tag = f.key[0]
    if (tag,) in (RSQRT, SQRT):
      return True
    if tag in (SUM, "layout", BOXED):
      return nonneg(f.args[0])
  return False


# ----------------------------------------------------------------------------
# Exact scalars from a program's literals.


def exact(value: Any) -> Optional[Fraction]:
  """The exact rational value of a finite scalar, or None."""
  try:
    v = np.asarray(value)
    if v.dtype == bool:
      return Fraction(int(bool(v)))
    if np.issubdtype(v.dtype, np.integer):
      return Fraction(int(v))
    f = float(v)
  except (TypeError, ValueError):
    return None
  if not math.isfinite(f):
    return None
  return Fraction(f)


def ulp(x: Fraction, dtype: Any) -> Fraction:
  """One unit in the last place of ``x`` in the float ``dtype``."""
  minexp, nmant = _float_info(dtype)
  e = max(math.frexp(float(abs(x)))[1] - 1, minexp)
  return Fraction(2) ** (e - nmant)


@compat.per_dtype
def _float_info(dtype: Any) -> tuple:
  """``(finfo.minexp, finfo.nmant)`` of a float dtype (jnp.finfo is slow)."""
  import jax.numpy as jnp
  info = jnp.finfo(dtype)
  return int(info.minexp), int(info.nmant)


def snap(k: Fraction, dtype: Any) -> Fraction:
  """A rounded reciprocal ``fl(1/n)`` stands for ``1/n``.

  The residue this admits is at most one unit in the last place of the
  literal's own dtype, the rounding the program itself performed; anything
  further from ``1/n`` (e.g. ``1 - 9e-7`` in float64) stays as written.
  """
  if not k or k.denominator == 1 or not _is_float(dtype):
    return k
  mag = abs(k)
  if mag > Fraction(1, 2):
    return k
  n = round(1 / mag)
  if n < 2 or n > 2**40:
    return k
  target = Fraction(1, n)
  if mag != target and abs(mag - target) <= ulp(mag, dtype):
    return target if k > 0 else -target
  return k


@compat.per_dtype
def _is_float(dtype: Any) -> bool:
  import jax.numpy as jnp
  try:
    return bool(jnp.issubdtype(dtype, jnp.floating))
  except TypeError:
    return False


# ----------------------------------------------------------------------------
# Polynomials in a shift symbol.


class Poly:
  """The shift-dependent part of a value: ``v(c) = v + Σ_k coeffs[k-1] * c**k``.

  ``c`` stands for an arbitrary tensor; ``dims[d]`` says how it varies along
  the value's dim ``d``: ``None`` (constant) or ``(label, block)`` (varying,
  piecewise constant on aligned blocks of ``block`` elements). Two polys of
  the same ``sym`` with equal ``dims`` see the same ``c`` at every index:
  labels are derived deterministically from the index remapping that produced
  them, and any remapping not modelled gets a fresh label.
  """
  __slots__ = ("sym", "dims", "coeffs", "_pattern")
  MAX_DEGREE = 4

  def __init__(self, sym: int, dims: tuple, coeffs: tuple):
    self.sym, self.dims, self.coeffs = sym, tuple(dims), tuple(coeffs)
    self._pattern = None

  def __repr__(self):
    return f"Poly(sym={self.sym}, dims={self.dims}, coeffs={self.coeffs})"

  @property
  def is_pure(self) -> bool:
    """Degree one with a constant coefficient: ``v + k*c``."""
    return len(self.coeffs) == 1 and self.coeffs[0].is_const

  @property
  def is_linear(self) -> bool:
    return len(self.coeffs) == 1

  def same_symbol(self, other: "Poly") -> bool:
    return self.sym == other.sym and self.dims == other.dims

  def pattern(self) -> tuple:
    """The dims with labels renamed by first appearance (a memo key; asked
    at every step of a walk, so kept)."""
    if self._pattern is None:
      names: dict = {}
      out = []
      for e in self.dims:
        if e is None:
          out.append(None)
        else:
          out.append((names.setdefault(e[0], len(names)), e[1]))
      self._pattern = tuple(out)
    return self._pattern


_syms = itertools.count(1)
_labels = itertools.count(1)


def fresh_symbol() -> int:
  """A symbol no other value has (a shift that cancels with nothing)."""
  return next(_syms)


def fresh_label() -> tuple:
  return ("fresh", next(_labels))


def make(sym: int, dims: tuple, coeffs: Sequence[Expr]) -> Optional[Poly]:
  """A Poly, or None when every coefficient cancelled exactly."""
  coeffs = list(coeffs)
  while coeffs and coeffs[-1].is_zero:
    coeffs.pop()
  if not coeffs:
    return None
  if len(coeffs) > Poly.MAX_DEGREE:
    raise Unrepresentable("the shift enters a polynomial of too high degree")
  return Poly(sym, dims, tuple(coeffs))


def pure(dims: tuple) -> Poly:
  """A fresh arbitrary shift ``v + c`` varying as ``dims`` say (labels fresh)."""
  return Poly(next(_syms), tuple(None if e is None else (fresh_label(), e[1]) for e in dims),
              (ONE,))


def derived(p: Poly, factor: Expr, const_dims: frozenset, out_shape: Shape) -> Poly:
  """``k*c*y`` for a pure ``p = k*c`` and a shift-free canonical factor ``y``.

  The product is again an arbitrary shift, varying where ``c`` or ``y`` does,
  but not an independent one: its symbol stands for ``c0 * F``, the root
  shift ``c0`` times the canonical product ``F`` of every factor applied since,
  so the same product reached along two paths, in any association or order,
  carries one symbol and cancels exactly (``h*inv - mean*inv`` under
  ``h -> h + c``: Keras's LayerNorm).
  """
  info = _DERIVED.get(("info", p.sym))
  # Chain onto the product only while the shift is indexed as it was made
  # (no transpose or reshape since): F is written in those coordinates.
  if info is None or info[3] != p.dims or (info[2].shape is not None and len(info[2].shape) != len(out_shape)):
    base, base_dims, f = p.sym, p.dims, None
  else:
    base, base_dims, f = info[:3]
  try:
    f = _lift_mul(f, factor, out_shape)
  except Unrepresentable:
    return pure(tuple(e if d in const_dims else (None, 1) for d, e in enumerate(p.dims)))
  shape = tuple(None if (e is None and d in const_dims) else (e[1] if e is not None and d in const_dims else 1)
                for d, e in enumerate(p.dims))
  return Poly(*_derived_symbol(base, base_dims, f, shape, out_shape), p.coeffs)


def _derived_symbol(base, base_dims: tuple, f: Any, shape: tuple, out_shape: Shape) -> tuple:
  """``(sym, dims)`` of the shift ``c0·F`` (``c0`` the shift ``base`` indexed by
  ``base_dims``, ``F`` = ``f``) with per-dim block sizes ``shape`` at
  ``out_shape``: one symbol per such tensor, whichever way it was reached."""
  key = (base, base_dims, f, shape, tuple(out_shape))
  sym = _DERIVED.get(key)
  if sym is None:
    sym = _DERIVED[key] = next(_syms)
  dims = tuple(None if b is None else (("derived", sym, d), b) for d, b in enumerate(shape))
  _DERIVED[("info", sym)] = (base, base_dims, f, dims)
  return sym, dims


def broadcast_derived(p: Poly, q: Poly, in_shape: Shape, out_shape: Shape) -> Poly:
  """``q``, the size-1 expansion of a derived shift ``p`` (``c0·F`` at a shape
  with size-1 dims, e.g. ``mean·inv`` per row) to ``out_shape``, under the
  symbol :func:`derived` gives ``c0·lift(F)`` made at ``out_shape``: they are
  the same tensor (``c0`` is constant along the expanded dims, as ``p``'s dims
  say), so ``h·inv - bcast(mean·inv)`` cancels as ``h·inv - mean·inv`` at full
  shape does. ``q`` unchanged where ``p`` is no derived shift indexed as made,
  or the expansion moves a dim."""
  info = _DERIVED.get(("info", p.sym))
  if (info is None or info[3] != p.dims or q.sym != p.sym or len(q.dims) != len(p.dims)
      or len(out_shape) != len(p.dims) or len(in_shape) != len(p.dims) or not p.is_pure):
    return q
  base, base_dims, f = info[:3]
  grown = [d for d, (a, b) in enumerate(zip(in_shape, out_shape)) if a != b]
  if (len(base_dims) != len(p.dims) or any(in_shape[d] != 1 for d in grown)
      or any(base_dims[d] is not None or p.dims[d] is not None or q.dims[d] is not None for d in grown)):
    return q   # (c0 must be constant along every expanded dim: one block of a varying c0 is not c0)
  try:
    f = lift(f, tuple(out_shape)) if f is not None else None
  except Unrepresentable:
    return q
  shape = tuple(None if e is None else e[1] for e in q.dims)
  return Poly(*_derived_symbol(base, base_dims, f, shape, out_shape), q.coeffs)


def exp_of(p: Poly, value: Expr, out: Any) -> Poly:
  """``exp(x + k*c) = exp(x) * (1 + d)`` with ``d = exp(k*c) - 1``: a pure
  shift becomes a *proportional* one (coefficient = the value itself, here
  the atom of ``out``) in a symbol ``d`` derived from ``c``, constant where
  ``c`` is, and never ``-1``."""
  key = (_EXP, p.sym, p.dims, p.coeffs[0].const_value)
  sym = _DERIVED.get(key)
  if sym is None:
    sym = _DERIVED[key] = next(_syms)
    _DERIVED[("exp-info", sym)] = (p.sym, p.dims, p.coeffs[0].const_value)
    _DERIVED[("exp-vals", sym)] = []
  _DERIVED[("exp-vals", sym)].append(out)
  dims = tuple(None if e is None else ((_EXP, sym, d), e[1]) for d, e in enumerate(p.dims))
  return Poly(sym, dims, (value,))


def exp_values(p: Poly) -> list:
  """The ``exp`` outputs whose atoms the coefficients of ``p``'s symbol are written in."""
  return _DERIVED.get(("exp-vals", p.sym), [])


def is_proportional(p: Poly, value: Expr) -> bool:
  """``v(d) = v * (1 + d)`` with ``d`` from :func:`exp_of` (so ``1 + d > 0``)."""
  return (("exp-info", p.sym) in _DERIVED and p.is_linear and p.coeffs[0] == value
          and not value.is_zero)


def log_of(p: Poly) -> Poly:
  """``log(v * (1 + d)) = log(v) + k*c`` for ``d = exp(k*c) - 1``."""
  sym, dims, k = _DERIVED[("exp-info", p.sym)]
  return Poly(sym, dims, (const(k),))


def _lift_mul(f: Optional[Expr], factor: Expr, shape: Shape) -> Expr:
  factor = lift(factor, shape)
  return factor if f is None else mul(lift(f, shape), factor)


def pure_of(key: Any, dims: tuple) -> Poly:
  """A pure shift that is a *function* of ``key`` (the operation and the
  shifts and values it combines): the same computation reached twice (a
  projection written twice) gives the same symbol, so its copies cancel."""
  k = ("of", key, tuple(None if e is None else e[1] for e in dims))
  sym = _DERIVED.get(k)
  if sym is None:
    sym = _DERIVED[k] = next(_syms)
  return Poly(sym, tuple(None if e is None else (("of", sym, d), e[1]) for d, e in enumerate(dims)), (ONE,))


ANY_AXES = "any"   # ``replicate(p, ANY_AXES)``: site detection's seed, the same in every shard


def replicate(p: Poly, axes) -> None:
  """Records that the tensor ``p``'s symbol stands for is the same in every
  shard along the mesh ``axes`` (a shift entering a ``shard_map`` constant
  along every dim those axes split), as ``p.dims`` index it: a re-indexing
  that may differ from shard to shard (a dynamic slice, a gather) gives a
  varying dim a fresh label, and then ``replicated`` no longer holds."""
  labels = frozenset(e[0] for e in p.dims if e is not None)
  _DERIVED[("replicated", p.sym)] = (labels, axes if axes == ANY_AXES else frozenset(axes))


def replicated(p: Poly, axes) -> bool:
  """Whether every shard along ``axes`` sees the same ``c`` at every index of ``p``."""
  info = _DERIVED.get(("replicated", p.sym))
  if info is None:
    return False
  labels, over = info
  return (over == ANY_AXES or set(axes) <= over) and all(e is None or e[0] in labels for e in p.dims)


def replication_key(p: Poly) -> Optional[tuple]:
  """What ``replicated`` knows of ``p``, independent of its symbol and labels
  (a memo of shift results keyed by ``p.pattern()`` must tell a shift that is
  the same in every shard from one that is not): None when nothing."""
  info = _DERIVED.get(("replicated", p.sym))
  if info is None:
    return None
  labels, over = info
  return (over, tuple(e is not None and e[0] in labels for e in p.dims))


def poly_add(p: Poly, q: Poly, kq=1) -> Optional[Poly]:
  n = max(len(p.coeffs), len(q.coeffs))
  pc = list(p.coeffs) + [ZERO] * (n - len(p.coeffs))
  qc = list(q.coeffs) + [ZERO] * (n - len(q.coeffs))
  return make(p.sym, p.dims, [add(a, b, kq) for a, b in zip(pc, qc)])


def poly_mul(p: Poly, vp: Expr, q: Poly, vq: Expr) -> Optional[Poly]:
  """``(vp + Σ p_k c^k)(vq + Σ q_k c^k)`` minus its constant term."""
  key = ("p*", p.coeffs, vp, q.coeffs, vq)   # the coefficients depend on no symbol
  coeffs = _MEMO.get(key)
  if coeffs is None:
    pa = [vp] + list(p.coeffs)
    qa = [vq] + list(q.coeffs)
    out = [ZERO] * (len(pa) + len(qa) - 1)
    for i, a in enumerate(pa):
      for j, b in enumerate(qa):
        if i + j:
          out[i + j] = add(out[i + j], mul(a, b))
    coeffs = _MEMO[key] = tuple(out[1:])
  return make(p.sym, p.dims, coeffs)


def poly_map(p: Poly, fn: Callable[[Expr], Expr], dims: tuple) -> Optional[Poly]:
  """A linear map applied to every coefficient, with the dims it produces."""
  return make(p.sym, dims, [fn(c) for c in p.coeffs])
