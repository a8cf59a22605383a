"""Orthogonal matrices for rotating a residual stream: normalized Hadamard
matrices of the widths real models have, and Haar-random orthogonal ones.

A Hadamard matrix of order ``n`` has entries ±1 and ``H Hᵀ = n I``; divided by
``√n`` it is orthogonal with every entry ``±1/√n``, which spreads an outlier
channel evenly over all channels (QuaRot). Orders are 1, 2 or multiples of 4.
This module builds order ``n = m · 2^k`` as the Kronecker product
``H_m ⊗ H_{2^k}`` of

* Sylvester's ``H_{2^k} = [[1, 1], [1, -1]]^{⊗k}``, and
* a small factor ``H_m``: Paley's construction I (``m = q + 1``, ``q`` a prime
  power ≡ 3 mod 4: 12, 20, 28, 44, 60, 108, 140, ...), Paley's construction II
  (``m = 2(q + 1)``, ``q`` a prime power ≡ 1 mod 4: 28, 36, 52, ...), or a
  Kronecker product of such factors (144 = 12 · 12),

computed here from the finite field GF(q), never from a pasted table, and
checked (``H Hᵀ = m I`` in integers) before use. Widths 384, 768, 1280, 1536,
2560, 3072, 5120, 6144 are 12 or 20 times a power of two. Orders with no such
factorization (e.g. 156 and 172, which need Williamson-type constructions) are
refused with a ``ValueError`` naming ``n`` and the factorizations tried.

``hadamard_transform(x, axis)`` computes ``x @ H`` along ``axis`` as one small
dense matmul per Kronecker factor (``H_m`` and Sylvester factors of at most 256):
``O(n (m + Σ p_i))`` operations in a few GEMMs rather than ``log2 n`` passes.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["hadamard", "hadamard_factorization", "hadamard_transform", "random_orthogonal"]

_CONSTRUCTIONS = ("n = m·2^k with m = 1 (Sylvester), m = q+1 for a prime power q ≡ 3 (mod 4) (Paley I), "
                  "m = 2(q+1) for a prime power q ≡ 1 (mod 4) (Paley II), or m a product of such orders")


# ----------------------------------------------------------------------------
# Public API.


def hadamard(n: int, dtype: Any = np.float64) -> np.ndarray:
  """The normalized (orthogonal) Hadamard matrix of order ``n``, as ``H_m ⊗ H_{2^k} / √n``.

  Args:
    n: the order; ``n = m · 2^k`` for a constructible ``m`` (see the module docstring).
    dtype: the NumPy dtype of the result.

  Returns:
    An ``(n, n)`` NumPy array with entries ``±1/√n`` and ``H Hᵀ = I``.

  Raises:
    ValueError: no construction of order ``n`` is known here (the message names
      ``n`` and the factorizations tried).

  Example:
    >>> h = hadamard(12)
    >>> bool(np.allclose(h @ h.T, np.eye(12)))
    True
  """
  m, p2 = hadamard_factorization(n)
  signs = np.kron(_small(m), _sylvester(p2))
  return (signs * (1.0 / np.sqrt(n))).astype(dtype, copy=False)


def hadamard_factorization(n: int) -> tuple[int, int]:
  """``(m, 2^k)`` with ``n = m · 2^k``: the smallest constructible factor ``m``
  (1 for a power of two) and the power of two (a Sylvester matrix).

  Example:
    >>> hadamard_factorization(768), hadamard_factorization(1024)
    ((12, 64), (1, 1024))
  """
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"hadamard: the order must be a positive integer, got {n!r}")
  n = int(n)
  tried = []
  p2 = n & -n                     # the largest power of two dividing n
  while p2 >= 1:
    m = n // p2
    if m == 1 or _constructible(m):
      return m, p2
    tried.append(f"{m}·2^{p2.bit_length() - 1}")
    p2 //= 2
  why = ("a Hadamard order must be 1, 2 or a multiple of 4" if n > 2 and n % 4 else
         "none of its factors m below has a construction here")
  raise ValueError(f"hadamard: no Hadamard matrix of order n={n}: {why}. Supported: {_CONSTRUCTIONS}; "
                   f"tried n = {', '.join(tried)}")


def hadamard_transform(x: Any, axis: int = -1) -> jax.Array:
  """``x @ H`` along ``axis``, for ``H = hadamard(x.shape[axis])``, without forming ``H``.

  ``H = H_m ⊗ H_{2^k}`` and a Sylvester ``H_{2^k}`` is itself a Kronecker
  product of Sylvester factors, so the transform runs as one small dense
  matmul per factor (``m`` and powers of two of at most ``_FACTOR``: for
  3072 = 12·256, a 12×12 and a 256×256 one) over the axis reshaped into the
  factors: each a GEMM a GPU runs on its tensor cores, where a butterfly's
  ``log2 n`` passes would each read and write ``x``. Up to ``_BUTTERFLY_ROWS``
  rows (decode: a few tokens, where reading the factor matrices costs more than
  the passes) the power-of-two factor runs as a butterfly of sums and
  differences instead. ``1/√n`` scales the first factor. Traceable (jit, vmap, grad).

  Example:
    >>> x = jnp.arange(24.0).reshape(2, 12)
    >>> bool(jnp.allclose(hadamard_transform(x), x @ hadamard(12, np.float32), atol=1e-4))
    True
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.inexact):   # integers: the 1/√n scale needs a float
    x = x.astype(jnp.result_type(float))
  axis = axis % x.ndim
  n = x.shape[axis]
  m, p2 = hadamard_factorization(n)
  sizes = ([m] if m > 1 else []) + _power_factors(p2)
  y = jnp.moveaxis(x, axis, -1)
  lead = y.shape[:-1]
  if p2 > 1 and _rows(lead) <= _BUTTERFLY_ROWS:
    y = _butterfly(y.reshape(lead + (m, p2)))
    if m > 1:
      hm = jnp.asarray(_small(m), dtype=y.dtype)
      y = jnp.einsum("...ab,ac->...cb", y, hm, precision=jax.lax.Precision.HIGHEST)
    y = y.reshape(lead + (n,)) * jnp.asarray(1.0 / np.sqrt(n), dtype=y.dtype)
    return jnp.moveaxis(y, -1, axis)
  y = y.reshape(lead + tuple(sizes))
  letters = "abcdefgh"[:len(sizes)]
  scale = 1.0 / np.sqrt(n)
  for j, size in enumerate(sizes):
    h = (_small(m) if (j == 0 and m > 1) else _sylvester(size)).astype(np.float64)
    h = jnp.asarray(h * scale if j == 0 else h, dtype=y.dtype)
    out = letters[:j] + "z" + letters[j + 1:]
    y = jnp.einsum(f"...{letters},{letters[j]}z->...{out}", y, h, precision=jax.lax.Precision.HIGHEST)
  return jnp.moveaxis(y.reshape(lead + (n,)), -1, axis)


_FACTOR = 256          # the largest power-of-two factor run as one dense matmul
_BUTTERFLY_ROWS = 64   # rows up to which the power-of-two factor runs as a butterfly (decode)


def _rows(lead: tuple) -> float:
  """The number of rows, or infinity where a dim is symbolic (jax.export: any size)."""
  try:
    return float(np.prod([int(d) for d in lead]))
  except Exception:  # noqa: BLE001 - jax's InconclusiveDimensionOperation and kin: not a constant
    return float("inf")


def _butterfly(y: jax.Array) -> jax.Array:
  """``y @ H_{2^k}`` (unnormalized Sylvester) along the last axis: one
  ``(a + b, a - b)`` step per bit of the index; the factors are all
  ``[[1, 1], [1, -1]]``, so their order does not matter."""
  lead, n = y.shape[:-1], y.shape[-1]
  h = 1
  while h < n:
    y = y.reshape(lead + (n // (2 * h), 2, h))
    a, b = y[..., 0, :], y[..., 1, :]
    y = jnp.stack([a + b, a - b], axis=-2)
    h *= 2
  return y.reshape(lead + (n,))


def _power_factors(p2: int) -> list:
  """``p2`` (a power of two) as a product of powers of two of at most ``_FACTOR``, near-equal."""
  if p2 == 1:
    return []
  k = p2.bit_length() - 1
  parts = -(-k // (_FACTOR.bit_length() - 1))
  bits = [k // parts + (1 if i < k % parts else 0) for i in range(parts)]
  return [1 << b for b in bits]


def random_orthogonal(n: int, key: jax.Array, dtype: Any = np.float64) -> np.ndarray:
  """A Haar-distributed random orthogonal ``(n, n)`` matrix: the ``Q`` of a
  Gaussian matrix's QR decomposition, its columns' signs fixed by ``R``'s
  diagonal (without the fix ``Q`` is not Haar-distributed). Computed in float64.

  Example:
    >>> q = random_orthogonal(5, jax.random.PRNGKey(0))
    >>> bool(np.allclose(q @ q.T, np.eye(5)))
    True
  """
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"random_orthogonal: n must be a positive integer, got {n!r}")
  z = np.asarray(jax.random.normal(key, (int(n), int(n)), jnp.float32), np.float64)
  q, r = np.linalg.qr(z)
  d = np.sign(np.diagonal(r))
  d[d == 0] = 1.0
  return (q * d).astype(dtype)


# ----------------------------------------------------------------------------
# The ±1 constructions (int8, unnormalized, checked).


def _sylvester(n: int) -> np.ndarray:
  h = np.ones((1, 1), np.int8)
  h2 = np.array([[1, 1], [1, -1]], np.int8)
  while h.shape[0] < n:
    h = np.kron(h2, h)
  return h


@functools.lru_cache(maxsize=None)
def _small(m: int) -> np.ndarray:
  """The ±1 Hadamard matrix of a constructible order ``m`` (read-only, cached)."""
  h = _build(m)
  if h is None:   # pragma: no cover - _constructible said yes
    raise ValueError(f"hadamard: no construction of order {m}")
  g = h.astype(np.int64)
  if not np.array_equal(g @ g.T, m * np.eye(m, dtype=np.int64)):   # a certificate, not an assumption
    raise AssertionError(f"hadamard: the construction of order {m} is not a Hadamard matrix")
  h.setflags(write=False)
  return h


def _constructible(m: int) -> bool:
  return _plan(m) is not None


@functools.lru_cache(maxsize=None)
def _plan(m: int) -> Optional[tuple]:
  """How to build order ``m``: ("sylvester",), ("paley1", q), ("paley2", q) or
  ("kron", a, b); None when none applies. Direct constructions first."""
  if m >= 1 and m & (m - 1) == 0:
    return ("sylvester",)
  if m % 4:
    return None
  if _prime_power(m - 1) and (m - 1) % 4 == 3:
    return ("paley1", m - 1)
  if m % 2 == 0 and _prime_power(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
    return ("paley2", m // 2 - 1)
  for a in range(4, int(m ** 0.5) + 1, 2):
    if m % a == 0 and _plan(a) is not None and _plan(m // a) is not None:
      return ("kron", a, m // a)
  return None


def _build(m: int) -> Optional[np.ndarray]:
  plan = _plan(m)
  if plan is None:
    return None
  if plan[0] == "sylvester":
    return _sylvester(m)
  if plan[0] == "kron":
    return np.kron(_small(plan[1]), _small(plan[2]))
  q = plan[1]
  jac = _jacobsthal(q)
  if plan[0] == "paley1":
    # H = I + S with S = [[0, 1ᵀ], [-1, Q]] skew (Q is skew-symmetric for q ≡ 3 mod 4).
    s = np.zeros((q + 1, q + 1), np.int8)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, jac
    return (s + np.eye(q + 1, dtype=np.int8)).astype(np.int8)
  # Paley II: C = [[0, 1ᵀ], [1, Q]] is a symmetric conference matrix (q ≡ 1 mod 4);
  # H = C ⊗ [[1, 1], [1, -1]] + I ⊗ [[1, -1], [-1, -1]].
  c = np.zeros((q + 1, q + 1), np.int8)
  c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, jac
  return (np.kron(c, np.array([[1, 1], [1, -1]], np.int8))
          + np.kron(np.eye(q + 1, dtype=np.int8), np.array([[1, -1], [-1, -1]], np.int8))).astype(np.int8)


# ----------------------------------------------------------------------------
# GF(q) for a prime power q = p^k: elements are coefficient vectors of
# polynomials of degree < k over GF(p), modulo a monic irreducible one.


def _prime_power(q: int) -> Optional[tuple[int, int]]:
  """``(p, k)`` with ``q = p^k`` for a prime ``p``, else None."""
  if q < 2:
    return None
  p = next((d for d in range(2, int(q ** 0.5) + 1) if q % d == 0), q)
  k = 0
  while q % p == 0:
    q //= p
    k += 1
  return (p, k) if q == 1 else None


def _polymod(a: list, mod: tuple, p: int) -> list:
  """``a`` (coefficients, lowest first) modulo the monic ``mod`` over GF(p)."""
  a = [c % p for c in a]
  k = len(mod) - 1
  for i in range(len(a) - 1, k - 1, -1):
    c = a[i]
    if c:
      for j in range(k + 1):
        a[i - k + j] = (a[i - k + j] - c * mod[j]) % p
  return (a + [0] * k)[:k]


def _irreducible(p: int, k: int) -> tuple:
  """The first monic polynomial of degree ``k`` over GF(p) with no monic factor
  of degree 1..k//2 (coefficients, lowest first, leading 1 included)."""
  def monic(deg):
    for low in itertools.product(range(p), repeat=deg):
      yield tuple(low) + (1,)
  for cand in monic(k):
    if cand[0] == 0:
      continue
    if not any(not any(_polymod(list(cand), f, p)) for d in range(1, k // 2 + 1) for f in monic(d)):
      return cand
  raise AssertionError(f"no irreducible polynomial of degree {k} over GF({p})")   # pragma: no cover


def _jacobsthal(q: int) -> np.ndarray:
  """``Q[i, j] = χ(x_i - x_j)`` over GF(q), ``χ`` the quadratic character (0 at 0)."""
  p, k = _prime_power(q)
  coef = np.array(list(itertools.product(range(p), repeat=k)), np.int64)[:, ::-1]   # element e's digits, lowest first
  weights = p ** np.arange(k)
  mod = _irreducible(p, k) if k > 1 else (0, 1)
  chi = -np.ones(q, np.int8)
  chi[0] = 0
  for e in range(1, q):
    square = _polymod(list(np.convolve(coef[e], coef[e])), mod, p)
    chi[int(np.dot(square, weights))] = 1
  diff = (coef[:, None, :] - coef[None, :, :]) % p
  return chi[diff @ weights]
