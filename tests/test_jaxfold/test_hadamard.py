"""hadamard.py: normalized Hadamard matrices of model widths, the fast transform, Haar rotations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfold._src.hadamard import hadamard, hadamard_factorization, hadamard_transform, random_orthogonal

WIDTHS = (384, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192)
SMALL = (12, 20, 28, 36, 40, 44, 52, 60, 108, 140)


def _max_off_identity(a: np.ndarray) -> float:
  g = a @ a.T
  g[np.diag_indices_from(g)] -= 1.0
  return float(np.abs(g).max())


@pytest.mark.parametrize("n", [w if w <= 3072 else pytest.param(w, marks=pytest.mark.slow) for w in WIDTHS])
def test_model_widths_sampled_rows_orthonormal_with_entries_one_over_sqrt_n(n):
  h = hadamard(n)
  assert h.shape == (n, n) and h.dtype == np.float64
  assert np.all(np.abs(h) == 1.0 / np.sqrt(n))
  rows = np.random.default_rng(n).choice(n, size=8, replace=False)
  g = h[rows] @ h.T                          # 8 full rows of H Hᵀ
  g[np.arange(8), rows] -= 1.0
  assert np.abs(g).max() < 1e-12


@pytest.mark.parametrize("n", [w for w in WIDTHS if w <= 2048])
def test_model_widths_orthogonal_in_float64(n):
  assert _max_off_identity(hadamard(n)) < 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("n", [w for w in WIDTHS if w > 2048])
def test_large_model_widths_orthogonal_in_float64(n):
  assert _max_off_identity(hadamard(n)) < 1e-12


def test_factorizations_of_model_widths():
  got = {n: hadamard_factorization(n) for n in WIDTHS}
  assert got == {384: (12, 32), 768: (12, 64), 1024: (1, 1024), 1280: (20, 64), 1536: (12, 128),
                 2048: (1, 2048), 2560: (20, 128), 3072: (12, 256), 4096: (1, 4096), 5120: (20, 256),
                 6144: (12, 512), 8192: (1, 8192)}
  assert all(m * p == n for n, (m, p) in got.items())
  assert hadamard_factorization(11008) == (344, 32)   # LLaMA's MLP width: Paley I over GF(7³)


@pytest.mark.parametrize("m", SMALL + (144, 344))
def test_small_orders_are_exact_hadamard_matrices(m):
  signs = hadamard(m) * np.sqrt(m)
  ints = np.rint(signs).astype(np.int64)
  assert np.allclose(signs, ints, atol=1e-12) and set(np.unique(ints)) == {-1, 1}
  np.testing.assert_array_equal(ints @ ints.T, m * np.eye(m, dtype=np.int64))
  np.testing.assert_array_equal(ints.T @ ints, m * np.eye(m, dtype=np.int64))


def test_dtype_is_honoured():
  h = hadamard(768, np.float32)
  assert h.dtype == np.float32
  assert np.abs(h.astype(np.float64) @ h.T.astype(np.float64) - np.eye(768)).max() < 1e-5


@pytest.mark.parametrize("n", [1, 2, 12, 28, 52, 64, 96, 768])
def test_transform_equals_matmul(x64, n):
  rng = np.random.default_rng(n)
  h = hadamard(n)
  for shape in ((1, n), (3, 5, n)):
    x = rng.normal(size=shape)
    got = np.asarray(jax.jit(hadamard_transform)(jnp.asarray(x)))
    assert np.abs(got - x @ h).max() < 1e-12 * max(1.0, np.abs(x).max()) * np.sqrt(n)
  x = rng.normal(size=(n, 4))
  got = np.asarray(jax.jit(lambda v: hadamard_transform(v, axis=0))(jnp.asarray(x)))
  assert np.abs(got - np.einsum("ib,ic->cb", x, h)).max() < 1e-12 * np.sqrt(n) * np.abs(x).max()


def test_transform_of_integers_is_float(x64):
  x = np.arange(24).reshape(2, 12)
  got = np.asarray(jax.jit(hadamard_transform)(jnp.asarray(x)))
  assert got.dtype == np.float64 and np.abs(got - x @ hadamard(12)).max() < 1e-12


def test_transform_is_its_inverse_transposed(x64):
  x = np.random.default_rng(0).normal(size=(2, 384))
  y = np.asarray(jax.jit(hadamard_transform)(jnp.asarray(x)))
  np.testing.assert_allclose(y @ hadamard(384).T, x, atol=1e-12)


@pytest.mark.parametrize("n, named", [
    (6, ["n=6", "multiple of 4", "3·2^1"]),
    (156, ["n=156", "39·2^2", "78·2^1", "156·2^0", "Paley"]),
    (172, ["n=172", "43·2^2"]),
])
def test_impossible_orders_are_refused_with_the_factorizations_tried(n, named):
  with pytest.raises(ValueError) as e:
    hadamard(n)
  for part in named:
    assert part in str(e.value)
  with pytest.raises(ValueError, match=f"n={n}"):
    hadamard_transform(jnp.zeros((2, n)))


@pytest.mark.parametrize("bad", [0, -4, 4.0, True])
def test_non_orders_are_refused(bad):
  with pytest.raises(ValueError, match="positive integer"):
    hadamard(bad)


def test_random_orthogonal_is_orthogonal_and_sign_fixed():
  key = jax.random.PRNGKey(3)
  q = random_orthogonal(64, key)
  assert q.dtype == np.float64 and _max_off_identity(q) < 1e-12
  np.testing.assert_array_equal(q, random_orthogonal(64, key))
  assert np.abs(q - random_orthogonal(64, jax.random.PRNGKey(4))).max() > 0.1
  # Haar: Q is the QR factor of the key's Gaussian matrix whose R has a positive diagonal.
  z = np.asarray(jax.random.normal(key, (64, 64), jnp.float32), np.float64)
  r = q.T @ z
  assert np.abs(np.tril(r, -1)).max() < 1e-10 and np.all(np.diagonal(r) > 0)
  with pytest.raises(ValueError, match="positive integer"):
    random_orthogonal(0, key)
