"""Train-step time: LayerNorm vs CBWC+RMSNorm (jaxfold.cbwc) vs plain RMSNorm.

One jitted adamw step (forward + backward + update) of a fixed small pre-LN GPT
(``examples/_train_common.GPT``) at growing sequence lengths, with a fixed
number of tokens per step (batch = tokens // seq).

Why the ratio moves with the sequence length (the paper's s·b > p argument):
CBWC's extra work is per *parameter* — centering the producer weights (and
projecting their gradients) once per step, O(p) — while the saving, one mean
reduction (and its backward) per LayerNorm, is per *token*, O(s·b·d). With a
fixed token count the saving is constant and so is the cost, but attention
grows with s, which dilutes both; with a fixed batch the saving grows with s.

Method:
* the four variants (LN, an A/A copy of LN compiled separately, CBWC+RMSNorm,
  RMSNorm) are interleaved in one process; the order rotates every repetition
  so drift hits all alike;
* after ``--warmup`` untimed steps, each repetition times ``--inner``
  consecutive steps ending with ``block_until_ready``; the median over
  ``--reps`` repetitions (>= 5) is reported;
* the LN-vs-LN (A/A) ratio shows the noise floor: differences smaller than its
  distance from 1.00 are not resolved.

    python benchmarks/bench_train_step.py --out benchmarks/results          # defaults
    python benchmarks/bench_train_step.py --seqs 128,256 --reps 5 --out /tmp/b  # quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import numpy as np
import optax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import _train_common as common  # noqa: E402

import jaxfold  # noqa: E402

ORDER = ("ln", "ln_b", "cbwc", "rms")


def make_steps(args, seq: int):
  batch = max(1, args.tokens // seq)
  tok = jax.random.randint(jax.random.PRNGKey(1), (batch, seq + 1), 0, 256)
  x = tok[:, :-1]
  ln_model = common.GPT(256, args.d, args.heads, args.layers, seq, "ln")
  rms_model = common.GPT(256, args.d, args.heads, args.layers, seq, "rms")
  key = jax.random.PRNGKey(0)
  p_ln = ln_model.init(key, x)
  p_rms = rms_model.init(key, x)
  r = jaxfold.cbwc(p_ln, ln_model.apply, x)
  opt = optax.adamw(1e-3, weight_decay=0.01)

  def make(apply_fn):
    def loss(p, t):
      return optax.softmax_cross_entropy_with_integer_labels(apply_fn(p, t[:, :-1]), t[:, 1:]).mean()

    def step(p, s, t):
      l, g = jax.value_and_grad(loss)(p, t)
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s, l
    return jax.jit(step)

  steps = {"ln": (make(ln_model.apply), p_ln), "ln_b": (make(lambda p, t: ln_model.apply(p, t)), p_ln),
           "cbwc": (make(r.apply_fn), p_ln), "rms": (make(rms_model.apply), p_rms)}
  state = {k: [p, opt.init(p)] for k, (_, p) in steps.items()}
  n_params = sum(int(np.prod(l.shape)) for l in jax.tree_util.tree_leaves(p_ln))
  n_centered = sum(int(np.prod(jax.tree_util.tree_leaves(p_ln)[i].shape))
                   for i, _ in r.leaf_specs)
  info = dict(batch=batch, seq=seq, params=n_params, centered=n_centered,
              folded=f"{r.report.num_folded}/{r.report.num_sites}")
  return steps, state, tok, info


def bench_one(args, seq: int, log=print):
  steps, state, tok, info = make_steps(args, seq)

  def run(name, n):
    fn = steps[name][0]
    p, s = state[name]
    for _ in range(n):
      p, s, l = fn(p, s, tok)
    jax.block_until_ready((p, s, l))
    state[name] = [p, s]

  t0 = time.perf_counter()
  for name in ORDER:
    run(name, args.warmup)
  compile_s = time.perf_counter() - t0
  times = {k: [] for k in ORDER}
  for rep in range(args.reps):
    order = ORDER[rep % len(ORDER):] + ORDER[:rep % len(ORDER)]
    for name in order:
      t = time.perf_counter()
      run(name, args.inner)
      times[name].append((time.perf_counter() - t) / args.inner)
  med = {k: statistics.median(v) for k, v in times.items()}
  row = dict(info, **{f"{k}_ms": 1e3 * v for k, v in med.items()},
             aa=med["ln_b"] / med["ln"], cbwc=med["cbwc"] / med["ln"], rms=med["rms"] / med["ln"],
             spread=max((max(v) - min(v)) / statistics.median(v) for v in times.values()),
             warmup_s=compile_s)
  log(f"seq {seq:5d} batch {row['batch']:3d}: LN {row['ln_ms']:.2f} ms, CBWC {row['cbwc_ms']:.2f} ms "
      f"({row['cbwc']:.3f}x), RMS {row['rms_ms']:.2f} ms ({row['rms']:.3f}x), A/A {row['aa']:.3f}x")
  return row


def device_line() -> str:
  d = jax.devices()[0]
  return (f"{d.platform} / device_kind `{d.device_kind}`, {len(jax.devices())} device(s), "
          f"{os.cpu_count()} CPU cores, jax {jax.__version__}")


def write(rows, args, out):
  os.makedirs(out, exist_ok=True)
  lines = [
      "# Train step: LayerNorm vs CBWC+RMSNorm vs RMSNorm", "",
      f"Device: {device_line()}.",
      f"Model: pre-LN GPT, d={args.d}, {args.layers} layers, {args.heads} heads, vocab 256; "
      f"{rows[0]['params']:,} parameters of which {rows[0]['centered']:,} are centered by CBWC "
      f"({rows[0]['folded']} LayerNorms folded). Step: jit(adamw(value_and_grad)), "
      f"{args.tokens} tokens per step.",
      f"Timing: median over {args.reps} repetitions of {args.inner} steps after {args.warmup} "
      "warm-up steps, variants interleaved with rotating order. Ratios are time / LN time "
      "(< 1 is faster than LN); the A/A row (LN vs a separately compiled LN) is the noise floor.",
      "",
      "| seq | batch | s·b | LN ms | CBWC+RMS ms | RMS ms | CBWC/LN | RMS/LN | A/A (LN/LN) | max spread |",
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['seq']} | {r['batch']} | {r['seq'] * r['batch']} | {r['ln_ms']:.2f} | "
                 f"{r['cbwc_ms']:.2f} | {r['rms_ms']:.2f} | {r['cbwc']:.3f} | {r['rms']:.3f} | "
                 f"{r['aa']:.3f} | {100 * r['spread']:.0f}% |")
  lines += ["", "`max spread` is (max − min) / median over the repetitions, worst variant.", ""]
  text = "\n".join(lines)
  with open(os.path.join(out, args.name + ".md"), "w") as f:
    f.write(text)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  seqs = [r["seq"] for r in rows]
  for key, label in (("cbwc", "CBWC+RMSNorm / LN"), ("rms", "RMSNorm / LN"), ("aa", "LN / LN (A/A)")):
    ax.plot(seqs, [r[key] for r in rows], marker="o", label=label)
  ax.axhline(1.0, color="k", lw=0.5)
  ax.set_xscale("log", base=2); ax.set_xlabel("sequence length (tokens per step fixed)")
  ax.set_ylabel("train-step time ratio"); ax.legend(); ax.grid(alpha=0.3)
  ax.set_title(jax.devices()[0].device_kind)
  fig.tight_layout(); fig.savefig(os.path.join(out, args.name + ".png"), dpi=100)
  plt.close(fig)
  print(text)
  return text


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seqs", default="128,256,512,1024,2048")
  p.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch = tokens // seq)")
  p.add_argument("--d", type=int, default=128)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--inner", type=int, default=3)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--out", default="out")
  p.add_argument("--name", default="train_step", help="file name stem of the .md and .png")
  args = p.parse_args(argv)
  if args.reps < 5:
    raise SystemExit("--reps must be >= 5")
  print(device_line())
  rows = [bench_one(args, int(s)) for s in args.seqs.split(",")]
  return write(rows, args, args.out)


if __name__ == "__main__":
  main()
