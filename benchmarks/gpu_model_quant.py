"""A MODEL, not a measurement: the modelled H100 time of quantized folded LN models.

For GPT-2 small and OPT-125m at prefill 2x1024 and decode 8@1024 (one new token per sequence
against a KV cache of 1024 positions), every program is compiled ahead of time for H100
(``pallas_kernels.aot``, no GPU) and charged, per launch of XLA's thunk sequence,
max(bytes / 3.35 TB/s, flops / peak math of the dot's operand dtype): bf16 989 TFLOP/s,
int8 1979 TOP/s, fp8 1979 TFLOP/s (H100 SXM datasheet, dense). Variants:

* ``bf16 original``; ``bf16 folded+fused+deferred`` (``fold(norm_impl="pallas")`` ->
  ``fuse_affine`` -> ``defer_norms``);
* ``W8A8 int8`` / ``W8A8 int8 static`` (one calibrated activation scale per
  contraction) / ``W8A8 fp8`` / ``W4A8``: ``fold`` -> ``fuse_affine`` ->
  ``rotate("hadamard")`` -> ``quantize(weights=..., activations=...)``, the contractions
  running through qwix's integer / fp8 ``dot_general``;
* the same W8A8 int8 with ``online_hadamard`` before it: the online rotations' own cost is
  the difference, shown separately.

Weights are random bf16 (speed does not depend on their values). Usage::

    python benchmarks/gpu_model_quant.py                 # writes results/gpu_model_quant{.md,.json,.png}
    python benchmarks/gpu_model_quant.py --models gpt2 --shapes prefill
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
  sys.path.insert(0, HERE)

import _common as C  # noqa: E402
import gpu_model as G  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import aot  # noqa: E402

TARGET = "h100"
# Dense peak math by the operand dtype XLA's HLO names (H100 SXM datasheet).
QUANT_PEAKS = {"s8": 1979e12, "u8": 1979e12, "f8e4m3fn": 1979e12, "f8e5m2": 1979e12, "s4": 1979e12}
FORMATS = {  # variant -> quantize(...) keywords
    "W8A8 int8": dict(weights="int8", activations="int8"),
    "W8A8 int8 static": dict(weights="int8", activations="int8", activation_scale="static"),
    "W8A8 fp8": dict(weights="fp8", activations="fp8"),
    "W4A8 int4/int8": dict(weights="int4", activations="int8", group_size=128),
}


def _concrete(tree: Any, seed: int = 0) -> Any:
  """Random bf16 arrays (normal x 0.02; integer leaves zero) of the shapes of ``tree``."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  rng = np.random.default_rng(seed)
  out = [jnp.asarray(rng.standard_normal(a.shape, np.float32) * 0.02, a.dtype)
         if jnp.issubdtype(a.dtype, jnp.floating) else jnp.zeros(a.shape, a.dtype) for a in leaves]
  return jax.tree_util.tree_unflatten(treedef, out)


def _abstract(tree: Any) -> Any:
  return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype)
                                if hasattr(a, "dtype") else a, tree)


def variants(name: str, shape: "G.Shape") -> tuple[dict, dict]:
  """{variant: (apply_fn, params, args)} and {variant: note} (a refusal is a note, not a crash)."""
  import jaxfold

  fn, abstract, args = G.bound_programs(name, shape)
  params = _concrete(abstract)
  cargs = tuple(_concrete(a) if not isinstance(a, tuple) else tuple(_concrete(x) for x in a) for a in args)
  out, notes = {"bf16 original": (fn, params, args)}, {}
  folded = jaxfold.fold(params, fn, *cargs, norm_impl="pallas")
  fused = jaxfold.fuse_affine(folded)
  deferred = jaxfold.defer_norms(fused)
  out["bf16 folded+fused+deferred"] = (deferred.apply_fn, deferred.params, args)
  if not hasattr(jaxfold, "quantize"):
    notes["quantized"] = "jaxfold.quantize does not exist in this jaxfold"
    return out, notes
  try:
    base = jaxfold.rotate(jaxfold.fuse_affine(jaxfold.fold(params, fn, *cargs, tied_weights="copy")), "hadamard")
    notes["rotate"] = f"rotate('hadamard'): {len(base.report.rotated)} parameters rotated"
  except Exception as e:  # noqa: BLE001 - a refusal is a result
    base = jaxfold.fuse_affine(jaxfold.fold(params, fn, *cargs, tied_weights="copy"))
    notes["rotate"] = f"rotate('hadamard') refused ({type(e).__name__}: {str(e).splitlines()[0][:160]}); not rotated"
  for v, kw in FORMATS.items():
    try:
      # (no calibration unless static scales need one: speed needs no error measurement)
      cal = {"calibration": [cargs]} if kw.get("activation_scale") == "static" else {}
      q = jaxfold.quantize(base, **kw, **cal)
      out[v] = (q.apply_fn, q.params, args)
    except Exception as e:  # noqa: BLE001
      notes[v] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  if hasattr(jaxfold, "online_hadamard"):
    try:
      online = jaxfold.online_hadamard(base)
      q = jaxfold.quantize(online, **FORMATS["W8A8 int8"])
      out["W8A8 int8 + online Hadamards"] = (q.apply_fn, q.params, args)
      notes["W8A8 int8 + online Hadamards"] = f"{online.report.num_rotated} contractions rotated online"
    except Exception as e:  # noqa: BLE001
      notes["W8A8 int8 + online Hadamards"] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return out, notes


def measure(fn, params, args) -> dict:
  """Launches, bytes, flops (by dtype) and modelled seconds of one program on H100."""
  c, gemms = G._compile_any(fn, _abstract(params), tuple(_abstract(a) for a in args), TARGET)
  s = G.summarize(c, TARGET)
  by_dtype: dict = {}
  for k in c.kernels:
    if k.flops:
      by_dtype[k.flops_dtype] = by_dtype.get(k.flops_dtype, 0.0) + k.flops
  return {"launches": s["launches"], "bytes": s["bytes"], "flops": s["flops"], "flops_by_dtype": by_dtype,
          "seconds": s["seconds"], "gemms": gemms, "kernels": [k.name for k in c.kernels]}


def table(records: list[dict]) -> list[str]:
  rows = ["| model | shape | variant | launches | MB moved | GFLOP (by dtype) | modelled µs | / bf16 original |",
          "|---|---|---|---:|---:|---|---:|---:|"]
  for r in records:
    ref = r["variants"]["bf16 original"]["seconds"]
    for v, m in r["variants"].items():
      fl = ", ".join(f"{d or '?'} {f / 1e9:.1f}" for d, f in sorted(m["flops_by_dtype"].items()))
      rows.append(f"| {r['model']} | {r['shape']} | {v} | {m['launches']} | {m['bytes'] / 1e6:.1f} | {fl} | "
                  f"{m['seconds'] * 1e6:.1f} | {m['seconds'] / ref:.3f} |")
  return rows


def targets(records: list[dict]) -> list[str]:
  """Issue 36's targets, met or NOT met, with the numbers (never adjusted)."""
  out = ["## Targets (issue 36)", ""]
  for r in records:
    v = r["variants"]
    ref = v["bf16 original"]["seconds"]
    for fmt in ("W8A8 int8", "W8A8 int8 static", "W8A8 fp8"):
      if fmt in v:
        ratio = v[fmt]["seconds"] / ref
        out.append(f"- {r['model']} {r['shape']}: {fmt} / bf16 original = {ratio:.3f} (target <= 0.6): "
                   + ("met" if ratio <= 0.6 else "**NOT met**"))
    if "W8A8 int8 + online Hadamards" in v and "W8A8 int8" in v:
      share = (v["W8A8 int8 + online Hadamards"]["seconds"] - v["W8A8 int8"]["seconds"]) / \
          v["W8A8 int8 + online Hadamards"]["seconds"]
      out.append(f"- {r['model']} {r['shape']}: online Hadamards' share of the quantized program = {share:.1%} "
                 "(target <= 5%): " + ("met" if share <= 0.05 else "**NOT met**"))
  return out


def main(argv: Optional[list[str]] = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--models", default="gpt2,opt-125m")
  ap.add_argument("--shapes", default="prefill,decode", help="prefill (2x1024) and/or decode (8@1024)")
  ap.add_argument("--out", default=os.path.join(C.RESULTS, "gpu_model_quant"))
  args = ap.parse_args(argv)
  reason = aot.unavailable_reason()
  if reason is not None:
    C.log(f"needs deviceless CUDA compilation (the gpu-aot extra): {reason}")
    return 2
  for k, v in QUANT_PEAKS.items():
    G.PEAK_FLOPS[TARGET].setdefault(k, v)
  shapes = {"prefill": G.Shape("prefill", 2, 1024), "decode": G.Shape("decode", 8, 1, 1024)}
  t0 = time.time()
  records = []
  for name in [m for m in args.models.split(",") if m]:
    for key in [s for s in args.shapes.split(",") if s]:
      shape = shapes[key]
      progs, notes = variants(name, shape)
      rec = {"model": name, "shape": shape.label, "notes": notes, "variants": {}}
      for v, (fn, p, a) in progs.items():
        t = time.time()
        rec["variants"][v] = measure(fn, p, a)
        C.log(f"{name} {shape.label} {v}: {rec['variants'][v]['seconds'] * 1e6:.1f} µs modelled "
              f"({time.time() - t:.0f} s)")
      records.append(rec)
  wall = time.time() - t0
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  cmd = C.command_line(__file__, argv)
  versions = G._versions()
  with open(args.out + ".json", "w") as f:
    json.dump({"date": now, "command": cmd, "wall_s": round(wall, 1), "versions": versions,
               "host": f"CPU only ({os.cpu_count()} cores); no GPU was used", "records": records}, f, indent=1)
  lines = [*C.model_header("Quantized folded models on H100 (a MODEL, not a measurement)", now,
                           f"wall time {wall:.0f} s", cmd, versions, cores=os.cpu_count()),
           "", *table(records), ""]
  for r in records:
    lines += [f"- {r['model']} {r['shape']}: " + "; ".join(f"{k}: {v}" for k, v in r["notes"].items())]
  lines += ["", *targets(records)]
  with open(args.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(table(records)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
