"""Shared pieces of the training examples: norms, a small GPT, the loop that
trains the three variants (LN, plain RMSNorm, CBWC+RMSNorm), plots and tables.

The three variants:

* ``ln``   — the model with LayerNorm, trained as is;
* ``rms``  — the same model with every LayerNorm swapped for an RMSNorm (with
  γ and β, same ε): a *different* model, cheaper, and usually a bit worse;
* ``cbwc`` — ``jaxfold.cbwc`` of the LN model: the stored parameters are the LN
  model's, the forward pass centers the upstream weights and runs RMSNorms.
  It is the LN model's function exactly (same initial loss, same trajectory
  up to rounding) at the cost of RMSNorm plus a per-parameter centering.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import jaxfold  # noqa: E402

VARIANTS = ("ln", "rms", "cbwc")
LABELS = {"ln": "LayerNorm", "rms": "RMSNorm (swapped)", "cbwc": "CBWC + RMSNorm (jaxfold)",
          "ln_b": "LayerNorm (A/A copy)"}


class RMSNorm(nn.Module):
  """RMSNorm with the LayerNorm's parameters (scale γ and bias β) and ε."""
  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (d,))
    bias = self.param("bias", nn.initializers.zeros, (d,))
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.epsilon)
    return (y * scale + bias).astype(x.dtype)


def make_norm(kind: str) -> nn.Module:
  if kind == "ln":
    return nn.LayerNorm(epsilon=1e-6)
  if kind == "rms":
    return RMSNorm(epsilon=1e-6)
  raise ValueError(f"norm kind must be 'ln' or 'rms', got {kind!r}")


# ----------------------------------------------------------------------------
# A small pre-LN GPT (also used by benchmarks/bench_train_step.py).


class CausalSelfAttention(nn.Module):
  d: int
  heads: int

  @nn.compact
  def __call__(self, x):
    *lead, t, _ = x.shape
    hd = self.d // self.heads
    qkv = nn.Dense(3 * self.d, name="qkv")(x).reshape(*lead, t, 3, self.heads, hd)
    q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
    logits = jnp.einsum("...qhc,...khc->...hqk", q, k) / np.sqrt(hd).astype(np.float32)
    causal = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    att = jax.nn.softmax(logits, axis=-1)
    y = jnp.einsum("...hqk,...khc->...qhc", att, v).reshape(*lead, t, self.d)
    return nn.Dense(self.d, name="out")(y)


class GPT(nn.Module):
  vocab: int = 256
  d: int = 64
  heads: int = 4
  layers: int = 2
  max_len: int = 128
  norm: str = "ln"

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d)(tokens)
    pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.d))
    x = x + pos[: tokens.shape[-1]]
    for _ in range(self.layers):
      x = x + CausalSelfAttention(self.d, self.heads)(make_norm(self.norm)(x))
      h = nn.Dense(4 * self.d)(make_norm(self.norm)(x))
      x = x + nn.Dense(self.d)(nn.gelu(h))
    return nn.Dense(self.vocab)(make_norm(self.norm)(x))


# ----------------------------------------------------------------------------
# Training loop.


@dataclasses.dataclass
class History:
  name: str
  steps: list = dataclasses.field(default_factory=list)        # 1-based step of each loss
  losses: list = dataclasses.field(default_factory=list)       # training loss *before* the update
  eval_steps: list = dataclasses.field(default_factory=list)
  evals: list = dataclasses.field(default_factory=list)        # dict of metrics
  step_seconds: list = dataclasses.field(default_factory=list)  # wall time per step (after compile)
  compile_seconds: float = 0.0
  note: str = ""

  @property
  def ms_per_step(self) -> float:
    s = self.step_seconds[1:] if len(self.step_seconds) > 1 else self.step_seconds
    return 1e3 * float(np.median(s)) if s else float("nan")


def add_common_args(p: argparse.ArgumentParser, steps: int, seconds: float) -> None:
  p.add_argument("--out", default="out", help="directory for the PNG, markdown and JSON")
  p.add_argument("--steps", type=int, default=steps, help="max steps per variant")
  p.add_argument("--seconds", type=float, default=seconds,
                 help="max training seconds per variant (after compilation)")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--weight-decay", type=float, default=0.01)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--eval-every", type=int, default=50)
  p.add_argument("--variants", default=",".join(VARIANTS),
                 help="comma-separated subset of " + ",".join(VARIANTS))
  p.add_argument("--smoke", action="store_true", help="a few steps of a tiny model (seconds)")


def train(name: str, apply_fn: Callable, params: Any, loss_fn: Callable,
          batches: Callable[[int], Any], evaluate: Callable[[Callable, Any], dict],
          opt: optax.GradientTransformation, steps: int, seconds: float,
          eval_every: int, log: Callable[[str], None] = print) -> tuple[History, Any]:
  """Trains one variant; ``batches(t)`` gives step t's batch (same for all variants).

  ``loss_fn(apply_fn, params, batch)`` is the training loss and
  ``evaluate(apply_fn, params)`` a dict of scalar metrics (both are jitted).
  """
  hist = History(name)

  @jax.jit
  def step(p, s, batch):
    l, g = jax.value_and_grad(lambda q: loss_fn(apply_fn, q, batch))(p)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, l

  eval_jit = jax.jit(lambda p: evaluate(apply_fn, p))
  state = opt.init(params)
  t0 = time.perf_counter()
  compiled = step.lower(params, state, batches(0)).compile()
  hist.compile_seconds = time.perf_counter() - t0
  train_time = 0.0
  for t in range(steps):
    batch = batches(t)
    t1 = time.perf_counter()
    params, state, l = compiled(params, state, batch)
    l = float(l)   # blocks
    dt = time.perf_counter() - t1
    train_time += dt
    hist.step_seconds.append(dt)
    hist.steps.append(t + 1)
    hist.losses.append(l)
    last = t + 1 == steps or train_time >= seconds
    if (t + 1) % eval_every == 0 or last or t == 0:
      ev = {k: float(v) for k, v in eval_jit(params).items()}
      hist.eval_steps.append(t + 1)
      hist.evals.append(ev)
      log(f"[{name:>4}] step {t + 1:5d}  loss {l:.4f}  " +
          "  ".join(f"{k} {v:.4f}" for k, v in ev.items()) + f"  ({1e3 * dt:.1f} ms/step)")
    if last:
      break
  return hist, params


def run_variants(args, make_model: Callable[[str], nn.Module], example: Any,
                 loss_fn: Callable, batches: Callable[[int], Any], evaluate: Callable,
                 title: str, log: Callable[[str], None] = print) -> dict:
  """Trains each requested variant from the same initial parameters (the RMS
  model from the same seed) and writes curves.png, results.md, results.json."""
  require_plotting()
  names = [v.strip() for v in args.variants.split(",") if v.strip()]
  for n in names:
    if n not in VARIANTS:
      raise SystemExit(f"unknown variant {n!r}; choose from {VARIANTS}")
  key = jax.random.PRNGKey(args.seed)
  ln_model, rms_model = make_model("ln"), make_model("rms")
  ln_params = ln_model.init(key, example)
  histories, notes = {}, {}
  for n in names:
    opt = optax.adamw(args.lr, weight_decay=args.weight_decay)
    if n == "ln":
      apply_fn, params = ln_model.apply, ln_params
    elif n == "rms":
      apply_fn, params = rms_model.apply, rms_model.init(key, example)
    else:
      r = jaxfold.cbwc(ln_params, ln_model.apply, example)
      notes[n] = f"{r.report.num_folded}/{r.report.num_sites} LayerNorms folded"
      log(f"[cbwc] {notes[n]}; {len(r.leaf_specs)} parameter leaves centered in the forward")
      apply_fn, params = r.apply_fn, ln_params
    hist, _ = train(n, apply_fn, params, loss_fn, batches, evaluate, opt, args.steps,
                    args.seconds, args.eval_every, log)
    hist.note = notes.get(n, "")
    histories[n] = hist
  os.makedirs(args.out, exist_ok=True)
  write_results(histories, args.out, title, args)
  return histories


# ----------------------------------------------------------------------------
# Outputs.


def _device() -> str:
  d = jax.devices()[0]
  return f"{d.platform} ({d.device_kind}), {os.cpu_count()} CPUs, jax {jax.__version__}"


def require_plotting() -> None:
  """Fails *before* training when the plot could not be written at the end."""
  import importlib.util
  if importlib.util.find_spec("matplotlib") is None:
    raise SystemExit("this example plots its curves with matplotlib, which is not installed: "
                     "pip install -e \".[examples]\" (matplotlib, scikit-learn)")


def write_results(histories: dict, out: str, title: str, args) -> None:
  require_plotting()
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  metrics = sorted({k for h in histories.values() for e in h.evals for k in e})
  fig, axes = plt.subplots(1, 1 + len(metrics), figsize=(5 * (1 + len(metrics)), 4))
  axes = np.atleast_1d(axes)
  for n, h in histories.items():
    axes[0].plot(h.steps, h.losses, label=LABELS.get(n, n), lw=1,
                 ls="--" if n == "cbwc" else "-")
    for ax, k in zip(axes[1:], metrics):
      ax.plot(h.eval_steps, [e[k] for e in h.evals], marker=".", label=LABELS.get(n, n),
              ls="--" if n == "cbwc" else "-")
  axes[0].set_title("training loss"); axes[0].set_xlabel("step"); axes[0].set_yscale("log")
  for ax, k in zip(axes[1:], metrics):
    ax.set_title(k); ax.set_xlabel("step")
  for ax in axes:
    ax.legend(); ax.grid(alpha=0.3)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "curves.png"), dpi=100)
  plt.close(fig)

  lines = [f"# {title}", "", f"Device: {_device()}. Optimizer: adamw(lr={args.lr}, "
           f"weight_decay={args.weight_decay}); budget {args.steps} steps / {args.seconds:g} s "
           f"per variant{' (smoke run)' if args.smoke else ''}.", "",
           "| variant | steps | loss @ step 1 | final train loss | " +
           " | ".join(f"final {k}" for k in metrics) + " | ms/step (median) | compile s | note |",
           "|---|---:|---:|---:|" + "---:|" * len(metrics) + "---:|---:|---|"]
  for n, h in histories.items():
    final = h.evals[-1] if h.evals else {}
    lines.append(f"| {LABELS.get(n, n)} | {h.steps[-1]} | {h.losses[0]:.6f} | {h.losses[-1]:.4f} | " +
                 " | ".join(f"{final.get(k, float('nan')):.4f}" for k in metrics) +
                 f" | {h.ms_per_step:.2f} | {h.compile_seconds:.1f} | {h.note} |")
  if "ln" in histories and "cbwc" in histories:
    a, b = histories["ln"].losses, histories["cbwc"].losses
    k = min(len(a), len(b))
    diff = max(abs(x - y) for x, y in zip(a[:k], b[:k]))
    lines += ["", f"LN vs CBWC: |loss difference| at step 1 = {abs(a[0] - b[0]):.2e}, "
              f"max over the first {k} steps = {diff:.2e} (same function; only rounding differs)."]
  text = "\n".join(lines) + "\n"
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump({n: dataclasses.asdict(h) for n, h in histories.items()}, f)
  print(text)
