"""LN vs RMSNorm vs CBWC+RMSNorm on sklearn's bundled digits (offline).

An MLP of Dense → LayerNorm → GELU blocks. ``jaxfold.cbwc`` folds every
LayerNorm (each follows a Dense) into an RMSNorm by centering that Dense's
kernel and bias in the forward pass.

    python examples/train_digits.py --out out/digits            # ~1 minute per variant
    python examples/train_digits.py --smoke --out /tmp/digits   # seconds
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _train_common as common  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


class MLP(nn.Module):
  hidden: int = 128
  blocks: int = 3
  classes: int = 10
  norm: str = "ln"

  @nn.compact
  def __call__(self, x):
    for _ in range(self.blocks):
      x = nn.gelu(common.make_norm(self.norm)(nn.Dense(self.hidden)(x)))
    return nn.Dense(self.classes)(x)


def load_digits(seed: int):
  from sklearn.datasets import load_digits as _load
  d = _load()
  x = (d.data / 16.0).astype(np.float32)
  y = d.target.astype(np.int32)
  perm = np.random.default_rng(seed).permutation(len(x))
  x, y = x[perm], y[perm]
  n_test = len(x) // 6
  return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  common.add_common_args(p, steps=3000, seconds=60)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--blocks", type=int, default=3)
  args = p.parse_args(argv)
  if args.smoke:
    args.steps, args.seconds, args.hidden, args.blocks, args.eval_every = 5, 10, 32, 2, 5

  (xtr, ytr), (xte, yte) = load_digits(args.seed)
  xte_j, yte_j = jnp.asarray(xte), jnp.asarray(yte)
  rng = np.random.default_rng(args.seed + 1)
  order = np.concatenate([rng.permutation(len(xtr)) for _ in range(args.steps * args.batch // len(xtr) + 2)])

  def batches(t):
    idx = order[t * args.batch:(t + 1) * args.batch]
    return jnp.asarray(xtr[idx]), jnp.asarray(ytr[idx])

  def loss_fn(apply_fn, params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(apply_fn(params, x), y).mean()

  def evaluate(apply_fn, params):
    logits = apply_fn(params, xte_j)
    return {"test loss": optax.softmax_cross_entropy_with_integer_labels(logits, yte_j).mean(),
            "test accuracy": jnp.mean(jnp.argmax(logits, -1) == yte_j)}

  make_model = lambda kind: MLP(args.hidden, args.blocks, 10, kind)
  return common.run_variants(args, make_model, batches(0)[0], loss_fn, batches, evaluate,
                             f"digits MLP ({args.blocks}x[Dense {args.hidden} → norm → GELU])")


if __name__ == "__main__":
  main()
