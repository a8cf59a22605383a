"""Train a byte-level GPT-2-style model on the Python standard library's sources (offline).

Vocabulary 256 (bytes, no tokenizer), held-out split by file (every 10th .py file, sorted),
the zoo's GPT-2 Flax model (public `models` API) and optax AdamW, deterministic seed. Saves
params to ``~/.cache/jaxfold/trained/<name>.msgpack`` (``--out`` overrides) and a JSON of the
config and the final train/held-out loss beside it. Weights are never committed.

    nice -n 10 python benchmarks/train_stdlib_gpt2.py --minutes 30      # d=256, 4 layers, 4 heads
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import sysconfig
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import serialization  # noqa: E402

from models.gpt2 import GPT2Config, GPT2LMHeadModel  # noqa: E402

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxfold", "trained")


def stdlib_bytes(max_files: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(train, held-out) uint8 arrays of the stdlib's .py sources; every 10th file (sorted) is held out."""
  root = sysconfig.get_paths()["stdlib"]
  files = []
  for d, subdirs, names in os.walk(root):
    subdirs[:] = sorted(s for s in subdirs if s not in ("site-packages", "test", "tests", "idlelib", "__pycache__"))
    files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
  files = sorted(files)[:max_files]
  train, held = [], []
  for i, f in enumerate(files):
    with open(f, "rb") as fh:
      (held if i % 10 == 0 else train).append(np.frombuffer(fh.read(), np.uint8))
  return np.concatenate(train), np.concatenate(held)


def batches(data: np.ndarray, batch: int, ctx: int, rng: np.random.Generator) -> np.ndarray:
  """A (batch, ctx + 1) int32 array of random windows of `data`."""
  starts = rng.integers(0, len(data) - ctx - 1, size=batch)
  return np.stack([data[s:s + ctx + 1] for s in starts]).astype(np.int32)


def loss_fn(model, params, seqs):
  """Mean next-byte cross-entropy (nats)."""
  logits = model.apply({"params": params}, seqs[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, seqs[:, 1:]).mean()


def eval_loss(model, params, data: np.ndarray, ctx: int, windows: int = 64) -> float:
  """Mean loss over `windows` evenly spaced, non-random windows of `data`."""
  starts = np.linspace(0, len(data) - ctx - 2, windows).astype(int)
  seqs = np.stack([data[s:s + ctx + 1] for s in starts]).astype(np.int32)
  return float(jax.jit(lambda p, s: loss_fn(model, p, s))(params, seqs))


def config_for(args) -> GPT2Config:
  return GPT2Config(vocab_size=256, n_positions=args.ctx, n_embd=args.d, n_layer=args.layers, n_head=args.heads)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--name", default="stdlib-gpt2-256x4")
  ap.add_argument("--d", type=int, default=256)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--ctx", type=int, default=128)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--steps", type=int, default=100000)
  ap.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget; stops at whichever comes first")
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--max-files", type=int, default=None)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  out = args.out or os.path.join(CACHE, args.name + ".msgpack")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

  train, held = stdlib_bytes(args.max_files)
  cfg = config_for(args)
  model = GPT2LMHeadModel(cfg)
  params = model.init(jax.random.key(args.seed), jnp.zeros((1, args.ctx), jnp.int32))["params"]
  sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(200, args.steps // 10 + 1), args.steps, args.lr / 10)
  opt = optax.adamw(sched, weight_decay=0.01)
  state = opt.init(params)

  @jax.jit
  def step(params, state, seqs):
    loss, g = jax.value_and_grad(lambda p: loss_fn(model, p, seqs))(params)
    upd, state = opt.update(g, state, params)
    return optax.apply_updates(params, upd), state, loss

  rng = np.random.default_rng(args.seed)
  t0, n, loss = time.time(), 0, float("nan")
  while n < args.steps and time.time() - t0 < args.minutes * 60:
    params, state, loss = step(params, state, batches(train, args.batch, args.ctx, rng))
    n += 1
    if n % 100 == 0:
      print(f"step {n} loss {float(loss):.4f} ({time.time() - t0:.0f} s)", flush=True)
  with open(out, "wb") as fh:
    fh.write(serialization.to_bytes(params))
  config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("dtype", "param_dtype")}
  meta = {"name": args.name, "config": config,
          "batch": args.batch, "lr": args.lr, "seed": args.seed, "steps": n, "seconds": round(time.time() - t0, 1),
          "train_bytes": int(len(train)), "held_out_bytes": int(len(held)),
          "final_train_loss": eval_loss(model, params, train, args.ctx),
          "final_held_out_loss": eval_loss(model, params, held, args.ctx), "params": os.path.abspath(out)}
  with open(os.path.splitext(out)[0] + ".json", "w") as fh:
    json.dump(meta, fh, indent=1)
  print(json.dumps(meta), flush=True)
  return meta


def load(path: str) -> tuple[GPT2Config, dict]:
  """(config, params) of a model saved by `main` (its .json beside the .msgpack)."""
  with open(os.path.splitext(path)[0] + ".json") as fh:
    meta = json.load(fh)
  cfg = GPT2Config(**meta["config"])
  model = GPT2LMHeadModel(cfg)
  template = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  template = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), template)
  with open(path, "rb") as fh:
    return cfg, serialization.from_bytes(template, fh.read())


if __name__ == "__main__":
  main()
