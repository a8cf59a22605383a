"""jaxfold/_src/algebra.py: strided views against NumPy, canonical expressions
against a float64 evaluation, exact scalars, and shift polynomials.

The analysis rests on one promise: equal ``Expr``s denote equal tensors. These
tests check it from both sides on random inputs — every canonical form
evaluates to what the expression it came from computes, and expressions equal
in real arithmetic (commuted, re-associated, distributed) get one form.
"""

from fractions import Fraction

import numpy as np
import pytest

from jaxfold._src import algebra as A

# ----------------------------------------------------------------------------
# Views: whenever a composition is claimed strided, it is NumPy's result.


def _materialize(view: A.View, base: np.ndarray) -> np.ndarray:
  idx = np.indices(view.shape, dtype=np.int64) if view.shape else np.zeros((0,), np.int64)
  flat = view.offset + sum(s * i for s, i in zip(view.strides, idx)) if view.shape else view.offset
  return base.ravel()[flat]


def _random_view_program(rng, src):
  """A random chain of index-remapping ops, applied to a View and to NumPy."""
  base = np.arange(int(np.prod(src)), dtype=np.int64).reshape(src)
  v, x = A.View.identity(src), base
  for _ in range(rng.integers(1, 6)):
    op = rng.choice(["transpose", "reshape", "slice", "rev", "broadcast"])
    if op == "transpose":
      perm = tuple(rng.permutation(x.ndim))
      v, x = v.transpose(perm), np.transpose(x, perm)
    elif op == "reshape":
      n = x.size
      divisors = [d for d in range(1, n + 1) if n % d == 0]
      a = int(rng.choice(divisors))
      shape = (a, n // a) if rng.random() < 0.5 else (1, a, n // a)
      nv = v.reshape(shape)
      if nv is None:
        # Not strided: the analysis nests the op opaquely. Soundness needs no more.
        return base, None, None
      v, x = nv, x.reshape(shape)
    elif op == "slice" and x.ndim:
      starts = [int(rng.integers(0, max(1, s))) for s in x.shape]
      limits = [int(rng.integers(st, s + 1)) for st, s in zip(starts, x.shape)]
      steps = [int(rng.integers(1, 3)) for _ in x.shape]
      v = v.slice(starts, limits, steps)
      x = x[tuple(slice(a, b, c) for a, b, c in zip(starts, limits, steps))]
    elif op == "rev" and x.ndim:
      dims = tuple(d for d in range(x.ndim) if rng.random() < 0.5)
      v, x = v.rev(dims), np.flip(x, dims) if dims else x
    elif op == "broadcast":
      out = (int(rng.integers(1, 3)),) + tuple(x.shape)
      nv = v.broadcast(out, tuple(range(1, x.ndim + 1)))
      assert nv is not None
      v, x = nv, np.broadcast_to(x, out)
    if x.size == 0:
      return base, None, None
  return base, v, x


@pytest.mark.parametrize("seed", range(40))
def test_view_chains_match_numpy(seed):
  rng = np.random.default_rng(seed)
  src = tuple(int(s) for s in rng.integers(1, 5, size=rng.integers(1, 4)))
  base, v, x = _random_view_program(rng, src)
  if v is None:
    return
  assert v.shape == x.shape
  np.testing.assert_array_equal(_materialize(v, base), x)


def test_view_contiguous_reshapes_stay_strided():
  v = A.View.identity((2, 3, 4))
  for shape in [(6, 4), (2, 12), (24,), (1, 2, 1, 12), (4, 6)]:
    assert v.reshape(shape) is not None, shape
  assert v.reshape((5, 5)) is None                          # wrong size
  # A transposed view cannot merge dims that are no longer adjacent in memory.
  assert v.transpose((0, 2, 1)).reshape((2, 12)) is None


def test_view_equality_ignores_strides_of_size_one_dims():
  a = A.View((4,), (1, 4), (99, 1))
  b = A.View((4,), (1, 4), (0, 1))
  assert a == b and hash(a) == hash(b)
  assert A.View.identity((3, 1)).is_identity


# ----------------------------------------------------------------------------
# Expressions: a float64 evaluator over the interned factors.


def _eval_expr(e: A.Expr, env: dict, shape) -> np.ndarray:
  out = np.zeros(shape if shape is not None else (), np.float64)
  for m, c in e.monomials():
    term = np.full(shape if shape is not None else (), float(c))
    for fid in m:
      term = term * _eval_factor(fid, env)
    out = out + term
  return out


def _eval_factor(fid: int, env: dict) -> np.ndarray:
  f = A.factor(fid)
  if f.kind == "atom":
    return env[f.key]
  if f.kind == "view":
    return _materialize(f.key, _eval_factor(f.args[0], env))
  tag = f.key if f.key in (A.SQRT, A.RSQRT) else f.key[0]
  args = [_eval_expr(a, env, a.shape if a.shape is not None else f.shape) for a in f.args]
  if tag == A.SUM:
    return np.sum(args[0], axis=f.key[1])
  if tag == A.RSQRT:
    return 1 / np.sqrt(args[0])
  if tag == A.SQRT:
    return np.sqrt(args[0])
  if tag == "inv":
    return 1 / args[0]
  if tag == "tanh":
    return np.tanh(args[0])
  raise NotImplementedError(tag)


SHAPE = (3, 4)


def _random_tree(rng, depth):
  """A random expression as a nested tuple over atoms x0..x2 of shape SHAPE."""
  if depth == 0 or rng.random() < 0.25:
    if rng.random() < 0.2:
      return ("const", Fraction(int(rng.integers(-3, 4)), int(rng.integers(1, 4))))
    return ("atom", f"x{rng.integers(0, 3)}")
  op = rng.choice(["add", "sub", "mul", "scale", "tanh", "rowsum"])
  if op in ("add", "sub", "mul"):
    return (op, _random_tree(rng, depth - 1), _random_tree(rng, depth - 1))
  if op == "scale":
    return (op, _random_tree(rng, depth - 1), Fraction(int(rng.integers(1, 5)), 2))
  return (op, _random_tree(rng, depth - 1))


def _build(t):
  """The canonical Expr of a tree, always of shape SHAPE."""
  kind = t[0]
  if kind == "const":
    return A.lift(A.const(t[1]), SHAPE) if t[1] else A.ZERO
  if kind == "atom":
    return A.atom(t[1], SHAPE)
  if kind == "add":
    return A.add(_build(t[1]), _build(t[2]))
  if kind == "sub":
    return A.sub(_build(t[1]), _build(t[2]))
  if kind == "mul":
    return A.mul(_build(t[1]), _build(t[2]))
  if kind == "scale":
    return A.scale(_build(t[1]), t[2])
  if kind == "tanh":
    return A.app(("tanh",), (_build(t[1]),), SHAPE)
  # Row sum broadcast back along the rows: a factor constant along dim 1.
  s = A.reduce_sum(_build(t[1]), (1,), SHAPE)
  if s.is_const:
    return A.lift(s, SHAPE)
  return A.lift(A.view_op(s, (3, 1), lambda v: v.reshape((3, 1)), ("reshape",)), SHAPE)


def _numpy(t, env):
  kind = t[0]
  if kind == "const":
    return np.full(SHAPE, float(t[1]))
  if kind == "atom":
    return env[t[1]]
  if kind == "add":
    return _numpy(t[1], env) + _numpy(t[2], env)
  if kind == "sub":
    return _numpy(t[1], env) - _numpy(t[2], env)
  if kind == "mul":
    return _numpy(t[1], env) * _numpy(t[2], env)
  if kind == "scale":
    return _numpy(t[1], env) * float(t[2])
  if kind == "tanh":
    return np.tanh(_numpy(t[1], env))
  return np.broadcast_to(_numpy(t[1], env).sum(axis=1, keepdims=True), SHAPE)


def _env(rng):
  # Atom keys are the names used in the trees; values are random float64.
  return {f"x{i}": rng.normal(size=SHAPE) for i in range(3)}


@pytest.mark.parametrize("seed", range(60))
def test_canonical_form_evaluates_to_the_expression(seed):
  rng = np.random.default_rng(seed)
  tree = _random_tree(rng, 4)
  with A.scope():
    try:
      e = _build(tree)
    except A.Unrepresentable:
      return                                                   # callers fail closed
    env = _env(np.random.default_rng(seed + 1000))
    got = _eval_expr(e, env, SHAPE)
  np.testing.assert_allclose(np.broadcast_to(got, SHAPE), _numpy(tree, env), rtol=1e-10, atol=1e-10)


def _rewrite(rng, t):
  """An equal expression in real arithmetic: commute, re-associate, distribute, x - x."""
  kind = t[0]
  if kind in ("const", "atom"):
    if rng.random() < 0.2:           # t == (t + u) - u for a random u
      u = _random_tree(rng, 1)
      return ("sub", ("add", t, u), u)
    return t
  if kind in ("add", "mul"):
    a, b = _rewrite(rng, t[1]), _rewrite(rng, t[2])
    if kind == "mul" and b[0] == "add" and rng.random() < 0.5:
      return ("add", ("mul", a, b[1]), ("mul", a, b[2]))      # distribute
    return (kind, b, a) if rng.random() < 0.5 else (kind, a, b)
  if kind == "sub":
    a, b = _rewrite(rng, t[1]), _rewrite(rng, t[2])
    return ("add", a, ("scale", b, Fraction(-1))) if rng.random() < 0.5 else ("sub", a, b)
  if kind == "scale":
    return ("mul", ("const", t[2]), _rewrite(rng, t[1])) if t[2] else t
  return (kind, _rewrite(rng, t[1]))


@pytest.mark.parametrize("seed", range(60))
def test_equal_in_real_arithmetic_means_one_canonical_form(seed):
  rng = np.random.default_rng(seed)
  tree = _random_tree(rng, 3)
  other = _rewrite(rng, tree)
  with A.scope():
    try:
      a, b = _build(tree), _build(other)
    except A.Unrepresentable:
      return
    assert a == b, (tree, other)
    assert A.sub(a, b).is_zero


def test_different_values_never_share_a_form():
  with A.scope():
    x, y = A.atom("x", SHAPE), A.atom("y", SHAPE)
    assert A.mul(x, y) != A.mul(x, x)
    assert A.add(x, y) != A.add(x, A.scale(y, Fraction(1, 2)))
    # A sum over rows is not a sum over columns.
    assert A.reduce_sum(x, (0,), SHAPE) != A.reduce_sum(x, (1,), SHAPE)
    # The same op on atoms of another shape is another value.
    assert A.atom("x", (4, 3)) != x


def test_reduce_sum_is_linear_and_pulls_out_constants():
  with A.scope():
    x, y = A.atom("x", SHAPE), A.atom("y", SHAPE)
    s = lambda e: A.reduce_sum(e, (1,), SHAPE)   # noqa: E731
    assert s(A.add(x, y)) == A.add(s(x), s(y))
    assert s(A.scale(x, 3)) == A.scale(s(x), 3)
    # A factor constant along the summed axis comes out of the sum.
    row = A.atom("r", (3, 1))
    assert s(A.mul(A.lift(row, SHAPE), x)) == A.mul(A.view_op(row, (3,), lambda v: v.reshape((3,)), ("reshape",)), s(x))
    # The sum of a constant is the constant times the count.
    assert A.reduce_sum(A.const(2), (1,), SHAPE) == A.const(8)


def test_unrepresentable_instead_of_approximate():
  with A.scope():
    big = A.ZERO
    for i in range(A.MAX_TERMS):
      big = A.add(big, A.atom(f"a{i}", SHAPE))
    with pytest.raises(A.Unrepresentable):
      A.add(big, A.atom("one more", SHAPE))
    with pytest.raises(A.Unrepresentable):
      A.inv(A.ZERO, SHAPE)


def test_rsqrt_and_sqrt_invert_each_other():
  with A.scope():
    v = A.atom("v", SHAPE)
    r = A.app(A.RSQRT, (v,), SHAPE)
    assert A.inv(r, SHAPE) == A.app(A.SQRT, (v,), SHAPE)
    assert A.inv(A.inv(r, SHAPE), SHAPE) == r


def test_nonneg_only_when_provable():
  with A.scope():
    x, y = A.atom("x", SHAPE), A.atom("y", SHAPE)
    assert A.nonneg(A.add(A.mul(x, x), A.mul(y, y)))
    assert A.nonneg(A.reduce_sum(A.mul(x, x), (1,), SHAPE))
    assert A.nonneg(A.app(A.RSQRT, (x,), SHAPE))
    assert not A.nonneg(A.mul(x, y))
    assert not A.nonneg(A.sub(A.mul(x, x), A.mul(y, y)))
    assert not A.nonneg(x)


# ----------------------------------------------------------------------------
# Exact scalars.


def test_exact_is_the_binary_value():
  assert A.exact(np.float32(0.1)) == Fraction(float(np.float32(0.1)))
  assert A.exact(np.float32(0.1)) != Fraction(1, 10)
  assert A.exact(np.int32(-7)) == -7 and A.exact(np.bool_(True)) == 1
  assert A.exact(np.inf) is None and A.exact(np.nan) is None
  assert A.exact("not a number") is None


def _reciprocals_within_an_ulp(k, dtype):
  lo, hi = int(0.9 / k), int(1.1 / k) + 2
  return {m for m in range(max(2, lo), hi) if abs(k - Fraction(1, m)) <= A.ulp(k, dtype)}


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", [3, 7, 10, 768, 4096, 12288])
def test_snap_restores_rounded_reciprocals_only(dtype, n):
  k = Fraction(float(dtype(1) / dtype(n)))
  near = _reciprocals_within_an_ulp(k, dtype)
  assert n in near
  got = A.snap(k, dtype)
  if near == {n}:
    assert got == Fraction(1, n) and A.snap(-k, dtype) == Fraction(-1, n)
  else:   # float16 at large n: the literal is 1/m for several m; one of them
    assert got.numerator == 1 and got.denominator in near
  # Two units in the last place away is another number: kept as written,
  # unless it is itself within an ulp of another reciprocal.
  off = k + 2 * A.ulp(k, dtype)
  got = A.snap(off, dtype)
  assert got == off or (got.numerator == 1 and got.denominator in _reciprocals_within_an_ulp(off, dtype))


def test_snap_leaves_other_literals_alone():
  assert A.snap(Fraction(1) - Fraction(9e-7), np.float64) == Fraction(1) - Fraction(9e-7)
  assert A.snap(Fraction(3, 4), np.float32) == Fraction(3, 4)
  assert A.snap(Fraction(1, 3), np.int32) == Fraction(1, 3)     # not a float literal


# ----------------------------------------------------------------------------
# Shift polynomials.


def test_poly_cancels_exactly_or_not_at_all():
  with A.scope():
    p = A.pure(((None, 1), None))
    assert p.is_pure and p.is_linear
    assert A.poly_add(p, p, -1) is None                             # (v + c) - (v + c)
    q = A.poly_add(p, p)
    assert q.coeffs == (A.const(2),)
    assert A.make(p.sym, p.dims, [A.ONE, A.ZERO, A.ZERO]).coeffs == (A.ONE,)
    # Two fresh shifts are independent: they never cancel.
    r = A.pure(((None, 1), None))
    assert not p.same_symbol(r)


def test_poly_mul_expands_products():
  with A.scope():
    p = A.pure(((None, 4),))
    v = A.atom("v", (4,))
    sq = A.poly_mul(p, v, p, v)                          # (v + c)^2 - v^2 = 2 v c + c^2
    assert sq.coeffs == (A.scale(v, 2), A.ONE)
    assert not sq.is_linear


def test_derived_shift_is_one_symbol_along_two_paths():
  with A.scope():
    p = A.pure(((None, 4),))
    y, z = A.atom("y", (4,)), A.atom("z", (4,))
    a = A.derived(A.derived(p, y, frozenset({0}), (4,)), z, frozenset({0}), (4,))
    b = A.derived(A.derived(p, z, frozenset({0}), (4,)), y, frozenset({0}), (4,))
    assert a.same_symbol(b)                               # c*y*z == c*z*y
    other = A.derived(p, A.mul(y, y), frozenset({0}), (4,))
    assert not a.same_symbol(other)


def test_pure_of_is_a_function_of_its_key():
  with A.scope():
    d = ((None, 3), None)
    assert A.pure_of(("dot", 1, 2), d).same_symbol(A.pure_of(("dot", 1, 2), d))
    assert not A.pure_of(("dot", 1, 2), d).same_symbol(A.pure_of(("dot", 2, 1), d))


def test_scope_drops_the_factor_tables():
  with A.scope():
    A.atom("x", SHAPE)
    assert A._FACTORS
  assert not A._FACTORS and not A._INTERN
