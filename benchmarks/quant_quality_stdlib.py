"""Quantization quality on a GPT-2-style byte model trained on the stdlib (benchmarks/train_stdlib_gpt2.py).

Held-out text: the held-out stdlib files (every 10th, by file). For W8A8, W4A8 (int4 weights in
groups of 128 or the width, int8 activations per token) and W4A4: ``naive`` (the original model
through ``jaxfold.quantize((params, apply_fn), ...)``) and ``fold+fuse_affine+rotate(q)+quantize``
for q in "hadamard", "random" (and "pca" where jaxfold offers it). Metrics: held-out bits per
byte, perplexity per byte, argmax agreement with float. Also the per-channel max |x| of the
residual stream at the norm inputs, before and after a Hadamard rotation (table + png).

    python benchmarks/quant_quality_stdlib.py [--params ~/.cache/jaxfold/trained/stdlib-gpt2-256x4.msgpack]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
  if _p not in sys.path:
    sys.path.insert(0, _p)

import _common as C  # noqa: E402
import train_stdlib_gpt2 as T  # noqa: E402

FORMATS = {"W8A8": dict(weights="int8", activations="int8"),
           "W4A8": dict(weights="int4", activations="int8"),
           "W4A4": dict(weights="int4", activations="int4")}
ROTATIONS = ("hadamard", "random", "pca")


def metrics(logits, targets, ref_logits) -> dict:
  """Bits per byte, perplexity per byte and argmax agreement with `ref_logits` (float64 NumPy)."""
  import numpy as np
  z = np.asarray(logits, np.float64)
  z = z - z.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, np.asarray(targets)[..., None], -1).mean()
  agree = (np.argmax(np.asarray(logits), -1) == np.argmax(np.asarray(ref_logits), -1)).mean()
  r = np.asarray(ref_logits, np.float64)
  r = r - r.max(-1, keepdims=True)
  logr = r - np.log(np.exp(r).sum(-1, keepdims=True))
  kl = (np.exp(logr) * (logr - logp)).sum(-1).mean()   # KL(float || quantized), nats per byte
  return {"bits_per_byte": float(nll / math.log(2)), "ppl": float(math.exp(nll)), "argmax_agree": float(agree),
          "kl": float(kl)}


def residual_channel_max(model, params, seqs):
  """Per-channel max |x| of the residual stream at each block's output (the next norm's input)."""
  import numpy as np
  _, state = model.apply({"params": params}, seqs, capture_intermediates=True, mutable=["intermediates"])
  inter = state["intermediates"]
  names = sorted((k for k in inter if k.startswith("h_")), key=lambda k: int(k[2:]))
  return {k: np.abs(np.asarray(inter[k]["__call__"][0])).max(axis=(0, 1)) for k in names}


def group_for(d: int) -> int:
  return 128 if d % 128 == 0 else d


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--params", default=os.path.join(T.CACHE, "stdlib-gpt2-256x4-4k.msgpack"),
                  help="made by: python benchmarks/train_stdlib_gpt2.py --name stdlib-gpt2-256x4-4k "
                       "--steps 4000 --minutes 50 --lr 2e-3 (the minutes stop it first on 2 CPU cores: the "
                       "steps it took are in the .json beside it); the shorter run: --name "
                       "stdlib-gpt2-256x4-long --steps 1400 --minutes 45 --lr 2e-3")
  ap.add_argument("--windows", type=int, default=32)
  ap.add_argument("--ctx", type=int, default=None, help="default: the model's context")
  ap.add_argument("--out", default=os.path.join(C.RESULTS, "quant_quality_stdlib"))
  args = ap.parse_args(argv)
  import jax
  import numpy as np

  import jaxfold
  from models.gpt2 import GPT2LMHeadModel

  t0 = time.time()
  cfg, params = T.load(args.params)
  with open(os.path.splitext(args.params)[0] + ".json") as fh:
    train_meta = json.load(fh)
  model = GPT2LMHeadModel(cfg)
  fn = lambda p, ids: model.apply({"params": p}, ids)  # noqa: E731
  ctx = args.ctx or cfg.n_positions
  _, held = T.stdlib_bytes()
  starts = np.linspace(0, len(held) - ctx - 2, args.windows + 4).astype(int)
  seqs = np.stack([held[s:s + ctx + 1] for s in starts]).astype(np.int32)
  ids, targets, calib = seqs[:args.windows, :-1], seqs[:args.windows, 1:], seqs[args.windows:, :-1]
  ref = np.asarray(jax.jit(fn)(params, ids))
  rows = [{"format": "float", "model": "original", **metrics(ref, targets, ref)}]
  notes = {}
  fused = jaxfold.fuse_affine(jaxfold.fold(params, fn, ids[:1], tied_weights="copy"))  # rotate needs an untied head
  wide = sorted(fused.report.widened, key=lambda w: -w.ratio)
  if wide:   # fuse_affine's own measure of how γ widened each reader's weight range
    notes["γ widening (fuse report)"] = (
        f"median max|w|/rms(w) per output channel grew in {sum(w.ratio > 1 for w in wide)} of {len(wide)} readers, "
        f"{sum(w.ratio >= 1.5 for w in wide)} by 1.5x or more; largest {wide[0].ratio:.2f}x "
        f"({wide[0].before:.2f} -> {wide[0].after:.2f}, {wide[0].weight})")
  bases = {"naive": (params, fn)}
  for name in ROTATIONS:
    try:
      kw = {"calibration": [(calib,)]} if name == "pca" else {}
      bases[f"fold+fuse+rotate({name})"] = jaxfold.rotate(fused, name, **kw)
    except (TypeError, ValueError, jaxfold.RotateError) as e:   # an older jaxfold without this rotation
      notes[f"rotate({name})"] = f"not available: {str(e).splitlines()[0][:200]}"
  if hasattr(jaxfold, "online_hadamard") and "fold+fuse+rotate(hadamard)" in bases:
    bases["fold+fuse+rotate(hadamard)+online"] = jaxfold.online_hadamard(bases["fold+fuse+rotate(hadamard)"])
  # quantized with smooth=0.5: SmoothQuant's migration instead of a rotation, and with both
  smoothed = {"naive+smooth(0.5)": bases["naive"], "fold+fuse+smooth(0.5)": fused}
  if "fold+fuse+rotate(hadamard)+online" in bases:
    smoothed["fold+fuse+rotate(hadamard)+online+smooth(0.5)"] = bases["fold+fuse+rotate(hadamard)+online"]
  bases.update(smoothed)
  for fmt, kw in FORMATS.items():
    kw = dict(kw, group_size=group_for(cfg.n_embd)) if kw["weights"] == "int4" else kw
    for label, base in bases.items():
      extra = (ids[:1],) if isinstance(base, tuple) else ()
      # Like for like: naive cannot quantize the tied head (wte.attend), so the
      # rotated models keep their untied head copy in float too.
      skip = () if isinstance(base, tuple) else ("wte",)
      smooth = 0.5 if label in smoothed else None
      q = jaxfold.quantize(base, *extra, **kw, calibration=[(calib,)], skip=skip, smooth=smooth)
      rows.append({"format": fmt, "model": label, "quantized": f"{q.report.num_quantized}/{len(q.report.sites)}",
                   **metrics(jax.jit(q.apply_fn)(q.params, ids), targets, ref)})
      C.log(f"{fmt} {label}: bpb {rows[-1]['bits_per_byte']:.4f} agree {rows[-1]['argmax_agree']:.4f}")
  # outliers: residual stream per-channel max |x| before / after the Hadamard rotation
  chmax = residual_channel_max(model, params, ids)
  h = np.asarray(jaxfold.hadamard(cfg.n_embd), np.float64)
  _, st = model.apply({"params": params}, ids, capture_intermediates=True, mutable=["intermediates"])
  rot = {k: np.abs(np.asarray(st["intermediates"][k]["__call__"][0], np.float64) @ h).max(axis=(0, 1)) for k in chmax}
  outliers = [{"site": k, "max": float(v.max()), "median": float(np.median(v)),
               "max/median": float(v.max() / np.median(v)),
               "rot_max": float(rot[k].max()), "rot_max/median": float(rot[k].max() / np.median(rot[k]))}
              for k, v in chmax.items()]
  wall = time.time() - t0
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  cmd = C.command_line(__file__, argv)
  versions = C.package_versions(("jax", "jaxlib", "flax", "qwix"), commit=True)
  targets_txt = target_lines(rows)
  with open(args.out + ".json", "w") as f:
    json.dump({"date": now, "command": cmd, "wall_s": round(wall, 1), "versions": versions, "notes": notes,
               "train": train_meta, "rows": rows, "outliers": outliers, "targets": targets_txt}, f, indent=1)
  table = ["| format | model | quantized | bits/byte | ppl/byte | KL to float | argmax agreement |",
           "|---|---|---|---:|---:|---:|---:|"]
  table += [f"| {r['format']} | {r['model']} | {r.get('quantized', '-')} | {r['bits_per_byte']:.4f} | {r['ppl']:.4f} | "
            f"{r['kl']:.5f} | {r['argmax_agree']:.4f} |" for r in rows]
  otable = ["| residual (block output) | max abs | median channel max | max/median | Hadamard: max | max/median |",
            "|---|---:|---:|---:|---:|---:|"]
  otable += [f"| {o['site']} | {o['max']:.3f} | {o['median']:.3f} | {o['max/median']:.2f} | {o['rot_max']:.3f} | "
             f"{o['rot_max/median']:.2f} |" for o in outliers]
  lines = [f"# Quantization quality on a stdlib-trained byte GPT-2 ({train_meta['name']}, CPU)", "",
           f"- date: {now}; wall time {wall:.0f} s; command: `{cmd}`", f"- versions: {json.dumps(versions)}",
           f"- model: {json.dumps(train_meta['config'])}; trained {train_meta['steps']} steps in "
           f"{train_meta['seconds']} s; final train loss {train_meta['final_train_loss']:.4f}, held-out "
           f"{train_meta['final_held_out_loss']:.4f} nats/byte",
           f"- held-out text: {args.windows} windows of {ctx} bytes of held-out stdlib files; calibration: 4 more",
           "- the LM head stays in float in every model: naive's is the tied table (quantize leaves a tied contraction "
           "in float), and the rotated models' untied copy is skipped (skip=(\"wte\",)), so the comparison is like "
           "for like; KL is KL(float || quantized) in nats per byte, averaged over positions",
           *(f"- {k}: {v}" for k, v in notes.items()), "", *table, "", "## Targets", "", *targets_txt, "",
           "## Outlier channels", "", *otable, ""]
  with open(args.out + ".md", "w") as f:
    f.write("\n".join(lines))
  plot(outliers, chmax, rot, args.out + "_outliers.png")
  plot_quality(rows, args.out + "_kl.png")
  print("\n".join(table + [""] + targets_txt + [""] + otable))
  return 0


def target_lines(rows) -> list[str]:
  """Each target met or NOT met, with the numbers (never adjusted)."""
  by = {(r["format"], r["model"]): r for r in rows}
  f = by[("float", "original")]["ppl"]
  out = []
  for label in [m for (fm, m) in by if fm == "W8A8"]:
    p = by[("W8A8", label)]["ppl"]
    out.append(f"- W8A8 {label} within 0.5% of float perplexity: {'met' if p <= f * 1.005 else 'NOT met'} "
               f"({p:.4f} vs {f:.4f}, {100 * (p / f - 1):+.2f}%)")
  for fmt in ("W4A8", "W4A4"):
    for label in ("fold+fuse+rotate(hadamard)", "fold+fuse+rotate(hadamard)+online"):
      key = (fmt, label)
      if key not in by or (fmt, "naive") not in by:
        continue
      name = label.replace("fold+fuse+rotate(hadamard)", "Hadamard")
      gap, got = by[(fmt, "naive")]["ppl"] - f, by[key]["ppl"] - f
      out.append(f"- {fmt} {name} closes at least half of naive's perplexity gap: "
                 f"{'met' if got <= gap / 2 else 'NOT met'} (naive gap {gap:+.4f}, {name} gap {got:+.4f})")
      kn, kh = by[(fmt, "naive")]["kl"], by[key]["kl"]
      out.append(f"- {fmt} {name} at most half of naive's KL to float: {'met' if kh <= kn / 2 else 'NOT met'} "
                 f"(naive {kn:.5f}, {name} {kh:.5f} nats/byte)")
  return out


def plot(outliers, chmax, rot, path):
  """Per-channel max |x| of the residual stream, before and after the Hadamard rotation."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  fig, axes = plt.subplots(len(chmax), 1, figsize=(9, 2.2 * len(chmax)), squeeze=False)
  for ax, (k, v) in zip(axes[:, 0], chmax.items()):
    ax.plot(v, lw=0.8, label="original")
    ax.plot(rot[k], lw=0.8, label="Hadamard-rotated")
    ax.set_ylabel(f"{k} max|x|")
  axes[0, 0].legend()
  axes[-1, 0].set_xlabel("channel")
  fig.tight_layout()
  fig.savefig(path, dpi=90)


def plot_quality(rows, path):
  """KL to the float model (log scale) per format, one bar per model: which pipeline loses least."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  formats = [f for f in dict.fromkeys(r["format"] for r in rows) if f != "float"]
  labels = list(dict.fromkeys(r["model"] for r in rows if r["format"] != "float"))
  by = {(r["format"], r["model"]): r["kl"] for r in rows}
  fig, ax = plt.subplots(figsize=(10, 4))
  width = 0.8 / len(labels)
  for i, label in enumerate(labels):
    xs = [j + i * width for j in range(len(formats))]
    ax.bar(xs, [by.get((f, label), float("nan")) for f in formats], width, label=label)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(formats))], formats)
  ax.set_yscale("log")
  ax.set_ylabel("KL(float || quantized), nats/byte")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=90)


if __name__ == "__main__":
  sys.exit(main())
