"""Character-level GPT on Python's own standard-library sources (offline).

A pre-LN GPT (embeddings + learned positions, attention and MLP blocks, final
LayerNorm, LM head) trained three ways: LayerNorm, RMSNorm swapped in, and
``jaxfold.cbwc`` of the LayerNorm model (every LayerNorm folded into an
RMSNorm: the embeddings, attention output and MLP output projections are
centered in the forward pass). The text is the bytes of ``*.py`` files under
``os.path.dirname(os.__file__)`` in sorted order.

    python examples/train_char_gpt.py --out out/char_gpt          # a few minutes
    python examples/train_char_gpt.py --smoke --out /tmp/char_gpt # seconds
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _train_common as common  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


def load_text(max_bytes: int) -> np.ndarray:
  """Bytes of the stdlib's *.py files (sorted, deterministic), as uint8."""
  root = os.path.dirname(os.__file__)
  chunks, total = [], 0
  for path in sorted(glob.glob(os.path.join(root, "*.py"))):
    with open(path, "rb") as f:
      data = f.read()
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  if not chunks:
    raise SystemExit(f"no *.py files under {root}")
  return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  common.add_common_args(p, steps=2000, seconds=60)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--seq", type=int, default=64)
  p.add_argument("--d", type=int, default=64)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--max-bytes", type=int, default=2_000_000)
  args = p.parse_args(argv)
  if args.smoke:
    args.steps, args.seconds, args.eval_every = 5, 10, 5
    args.batch, args.seq, args.d, args.heads, args.layers = 8, 32, 32, 2, 1
    args.max_bytes = 200_000

  data = load_text(args.max_bytes)
  n_val = max(len(data) // 10, args.seq * 16 + 1)
  train_data, val_data = data[:-n_val], data[-n_val:]
  rng = np.random.default_rng(args.seed)
  starts = rng.integers(0, len(train_data) - args.seq - 1, size=(args.steps, args.batch))
  val_starts = np.random.default_rng(args.seed + 1).integers(0, len(val_data) - args.seq - 1, 16)
  window = np.arange(args.seq + 1)
  val_batch = jnp.asarray(val_data[val_starts[:, None] + window], jnp.int32)

  def batches(t):
    return jnp.asarray(train_data[starts[t][:, None] + window], jnp.int32)

  def loss_fn(apply_fn, params, tokens):
    logits = apply_fn(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def evaluate(apply_fn, params):
    logits = apply_fn(params, val_batch[:, :-1])
    return {"val loss": optax.softmax_cross_entropy_with_integer_labels(logits, val_batch[:, 1:]).mean(),
            "val next-char accuracy": jnp.mean(jnp.argmax(logits, -1) == val_batch[:, 1:])}

  make_model = lambda kind: common.GPT(256, args.d, args.heads, args.layers, args.seq, kind)
  print(f"{len(data):,} bytes of stdlib source ({len(train_data):,} train / {len(val_data):,} val)")
  return common.run_variants(args, make_model, batches(0)[:, :-1], loss_fn, batches, evaluate,
                             f"char GPT on stdlib sources (d={args.d}, {args.layers} layers, "
                             f"seq {args.seq}, batch {args.batch})")


if __name__ == "__main__":
  main()
