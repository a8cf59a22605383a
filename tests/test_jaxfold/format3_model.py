"""A tiny tied-embedding language model whose fold, saved by jaxfold 0.1.0 in
format 3 (parameters nested per step: ``FusedParams(base=FoldedParams(...))``),
is kept under ``data/format3_*``: ``test_serialization_formats`` loads it.

Re-make the fixtures only with a jaxfold that writes format 3 (git history
before ``jaxfold.Params``)::

  PYTHONPATH=<old checkout> python tests/test_jaxfold/format3_model.py tests/test_jaxfold/data
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

V, T, D, H = 11, 5, 8, 12
ROTATION_SEED = 3


def params() -> dict:
  """Float64 parameters with non-trivial γ, β and biases."""
  rng = np.random.default_rng(0)
  n = lambda *s: jnp.asarray(rng.normal(size=s))   # noqa: E731
  return {"wte": n(V, D), "wpe": n(T, D), "g1": 1 + n(D), "b1": n(D), "w1": n(D, H), "c1": n(H),
          "w2": n(H, D), "gf": 1 + n(D), "bf": n(D)}


def _ln(x, g, b):
  c = x - jnp.mean(x, -1, keepdims=True)
  return c / jnp.sqrt(jnp.mean(c * c, -1, keepdims=True) + 1e-5) * g + b


def apply(p: dict, ids):
  """Embedding, one pre-LN MLP block, a final LN and the tied head."""
  h = p["wte"][ids] + p["wpe"][:ids.shape[-1]]
  h = h + jnp.tanh(_ln(h, p["g1"], p["b1"]) @ p["w1"] + p["c1"]) @ p["w2"]
  return _ln(h, p["gf"], p["bf"]) @ p["wte"].T


def ids(batch: int = 2):
  return jnp.asarray(np.arange(batch * T).reshape(batch, T) % V, jnp.int32)


def rotation() -> np.ndarray:
  return np.linalg.qr(np.random.default_rng(ROTATION_SEED).normal(size=(D, D)))[0]


def make(out: str) -> None:   # run with a jaxfold that writes format 3 (see the module docstring)
  import jaxfold
  jax.config.update("jax_enable_x64", True)
  folded = jaxfold.fold(params(), apply, ids(), tied_weights="copy")
  fused = jaxfold.fuse_affine(folded)
  for name, res in [("fused", fused), ("rotated", jaxfold.rotate(fused, rotation())),
                    ("deferred", jaxfold.defer_norms(folded))]:
    jaxfold.save_fold(res, f"{out}/format3_{name}", overwrite=True)


if __name__ == "__main__":
  make(sys.argv[1])
