"""Beyond RMSNorm: fuse γ/β, rotate the residual stream, slice it (SliceGPT) or flatten it (QuaRot).

A GPT-2-style character model (``models.gpt2``, pre-LN, tied head) is trained
briefly on the bytes of Python's standard library, then:

1. ``jaxfold.fold`` turns every LayerNorm into an RMSNorm (``tied_weights="copy"``:
   the embedding lookup gets a centered copy, the head keeps the table);
2. ``jaxfold.fuse_affine`` moves each norm's γ and β into the layers reading it,
   leaving parameter-free ``x / rms(x)`` norms;
3. ``jaxfold.rotate`` applies an orthogonal Q to the residual stream, proved exact.

With Q the PCA basis of the stream (eigenvectors of its covariance, largest
first), zeroing the last coordinates of every stream-touching parameter deletes
the smallest-variance directions (SliceGPT); the loss is plotted against the
sliced fraction, next to the same slicing in the original basis and in a random
orthogonal basis. With a Hadamard Q the per-channel max |activation| of the
stream is compared before/after (QuaRot's motivation: no outlier channels).

    python examples/slice_rotate.py --out out/slice_rotate          # ~1 minute on a CPU
    python examples/slice_rotate.py --smoke --out /tmp/slice_rotate # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from train_char_gpt import load_text  # noqa: E402

import jaxfold  # noqa: E402
from models.gpt2 import GPT2Config, GPT2LMHeadModel  # noqa: E402


def batches(data: np.ndarray, batch: int, seq: int, seed: int):
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - seq - 1, batch)
    yield np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)


def xent(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train(model, data, args):
  it = batches(data, args.batch, args.seq, 0)
  params = model.init(jax.random.key(0), next(it)[:, :-1])["params"]
  opt = optax.adam(args.lr)
  state = opt.init(params)

  @jax.jit
  def step(p, s, b):
    loss, g = jax.value_and_grad(lambda p: xent(model.apply({"params": p}, b[:, :-1]), b[:, 1:]))(p)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  for i in range(args.steps):
    params, state, loss = step(params, state, next(it))
    if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
      print(f"step {i:5d}  loss {float(loss):.4f}")
  return params


def stream_samples(model, params, ids) -> np.ndarray:
  """Residual-stream vectors (every block's output), centered as fold makes them."""
  _, inter = model.apply({"params": params}, ids, capture_intermediates=True)
  inter = inter["intermediates"]
  xs = [np.asarray(inter[k]["__call__"][0]) for k in sorted(inter) if k.startswith("h_")]
  x = np.concatenate([a.reshape(-1, a.shape[-1]) for a in xs]).astype(np.float64)
  return x - x.mean(-1, keepdims=True)


def pca_basis(x: np.ndarray) -> np.ndarray:
  w, v = np.linalg.eigh(x.T @ x / len(x))
  return v[:, np.argsort(w)[::-1]]


def hadamard(n: int) -> np.ndarray:
  h = np.ones((1, 1))
  while len(h) < n:
    h = np.block([[h, h], [h, -h]])
  if len(h) != n:
    raise SystemExit(f"--d must be a power of two for the Hadamard rotation, got {n}")
  return h / np.sqrt(n)


def sliced(rotated, keep: int):
  """Zeroes stream coordinates >= keep in every parameter that meets the stream."""
  axes = rotated.stream_axes

  def cut(path, x):
    dims = axes.get(jax.tree_util.keystr(path))
    if dims is None:
      return x
    x = np.array(x)
    for d in dims:
      idx = [slice(None)] * x.ndim
      idx[d] = slice(keep, None)
      x[tuple(idx)] = 0
    return jnp.asarray(x)
  return jax.tree_util.tree_map_with_path(cut, rotated.params)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default="out/slice_rotate")
  p.add_argument("--steps", type=int, default=600)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--seq", type=int, default=64)
  p.add_argument("--d", type=int, default=64)
  p.add_argument("--layers", type=int, default=3)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--max-bytes", type=int, default=2_000_000)
  p.add_argument("--smoke", action="store_true")
  args = p.parse_args(argv)
  if args.smoke:
    args.steps, args.batch, args.seq, args.d, args.layers, args.max_bytes = 20, 8, 32, 32, 1, 100_000
  os.makedirs(args.out, exist_ok=True)

  data = load_text(args.max_bytes)
  split = int(0.9 * len(data))
  cfg = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.d, n_layer=args.layers,
                   n_head=4 if args.d >= 64 else 2)
  model = GPT2LMHeadModel(cfg)
  params = train(model, data[:split], args)
  apply = lambda p, ids: model.apply({"params": p}, ids)
  ev = next(batches(data[split:], 4 * args.batch, args.seq, 1))
  ids, targets = jnp.asarray(ev[:, :-1]), jnp.asarray(ev[:, 1:])

  folded = jaxfold.fold(params, apply, ids, tied_weights="copy")
  fused = jaxfold.fuse_affine(folded)
  print(fused.report)
  run = jax.jit(fused.apply_fn)   # rotate changes parameters only: one program throughout
  loss = lambda p: float(xent(run(p, ids), targets))
  base = float(xent(apply(params, ids), targets))
  res = {"loss": base, "loss_fused": loss(fused.params), "norms_fused": fused.report.num_fused}

  x = stream_samples(model, params, ids)
  bases = {"PCA": pca_basis(x),
           "random orthogonal": np.linalg.qr(np.random.default_rng(0).normal(size=(args.d, args.d)))[0],
           "original basis": np.eye(args.d)}
  fractions = [i / 10 for i in range(10)]
  curves = {}
  for name, q in bases.items():
    r = jaxfold.rotate(fused, q)
    res[f"loss_rotated[{name}]"] = loss(r.params)
    curves[name] = [loss(sliced(r, args.d - round(f * args.d))) for f in fractions]
    print(f"{name:18s} " + " ".join(f"{v:.3f}" for v in curves[name]))
  res["slicing"] = {"fractions": fractions, **curves}

  h = jaxfold.rotate(fused, hadamard(args.d))
  res["loss_rotated[Hadamard]"] = loss(h.params)
  before, after = np.abs(x).max(0), np.abs(x @ hadamard(args.d)).max(0)
  res["outliers"] = {"max/median before": float(before.max() / np.median(before)),
                     "max/median after": float(after.max() / np.median(after)),
                     "max before": float(before.max()), "max after": float(after.max())}
  print(json.dumps({k: v for k, v in res.items() if k != "slicing"}, indent=1))

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 2, figsize=(11, 4))
  for name, ys in curves.items():
    ax[0].plot([100 * f for f in fractions], ys, marker="o", label=name)
  ax[0].axhline(base, color="gray", ls=":", label="original")
  ax[0].set(xlabel="stream directions deleted (%)", ylabel="held-out loss (nats/char)",
            title="SliceGPT-style slicing after fuse_affine + rotate")
  ax[0].legend()
  ax[1].bar(np.arange(args.d), np.sort(before)[::-1], alpha=0.6, label="stream (folded)")
  ax[1].bar(np.arange(args.d), np.sort(after)[::-1], alpha=0.6, label="after Hadamard rotate")
  ax[1].set(xlabel="channel (sorted)", ylabel="max |activation|",
            title="outlier channels before/after a Hadamard Q")
  ax[1].legend()
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, "slice_rotate.png"), dpi=110)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(res, f, indent=1)
  return res


if __name__ == "__main__":
  main()
