"""tokamax's normalization kernels beside ``pallas_kernels``, compiled for H100/A100 (a MODEL).

No GPU is involved: both are compiled ahead of time (``pallas_kernels.aot``, JAX's CUDA
plugin against ``pallas_kernels/targets``) over the kernel sweep of
``bench_rms_norm.py`` (16384 rows x hidden 768/1024/4096/8192, float32 and bfloat16) and
the shapes of ``gpu_model.py``'s norm sites (4096x768, 2048x1024, 8x768 bf16). Per program:

* ``tokamax``: ``tokamax.layer_norm(x, scale, bias, subtract_mean=False,
  implementation="triton")`` (its Pallas Triton kernel; RMSNorm with an offset);
* ``tokamax (donated x)``: the same with ``x`` donated to the jitted function: tokamax's
  forward writes its output over its input, so without donation XLA first copies ``x``;
* ``pallas_kernels``: ``pallas_kernels.rms_norm(x, scale, bias, interpret=False)``;
* ``XLA``: ``pallas_kernels.rms_norm_reference`` (what XLA fuses by itself).

``fwd`` = the forward alone; ``train`` = forward + VJP w.r.t. x, scale and bias. Columns:
launches (XLA's thunk sequence), registers and spilled bytes per kernel (``ptxas -v`` of the
PTX XLA built), modelled bytes (each launch's operands + results once) and modelled time:
``us @ BW`` = bytes / peak bandwidth, ``modelled us`` = per launch bytes / (peak bandwidth x
a modelled utilisation from resident blocks, registers and waves: ``gpu_model.utilisation``).

Deviceless compilation of tokamax needs two things a GPU host provides by itself:
``tokamax.config.cross_compile(True)`` (its device check) and the target's SM count for its
block-size heuristic, which reads ``jax.devices()[0].core_count``: the script answers that
with the compile-only device of the target (132 SMs H100, 108 A100), exactly what it reads on
that GPU. tokamax's autotuning cache holds no 2-D RMSNorm shapes, so a real GPU also takes
the heuristic configuration.

tokamax 0.0.15 is the last release that accepts jax 0.10.2 and needs Python 3.12::

    python3.12 -m venv /work/venvs/tokamax
    /work/venvs/tokamax/bin/pip install "jax==0.10.2" tokamax==0.0.15 jax-cuda12-plugin==0.10.2 \\
        jax-cuda12-pjrt==0.10.2 nvidia-cuda-nvcc-cu12
    /work/venvs/tokamax/bin/pip install --no-deps -e .
    /work/venvs/tokamax/bin/python benchmarks/tokamax_compare.py            # writes results/tokamax_compare.*
    /work/venvs/tokamax/bin/python benchmarks/tokamax_compare.py --quick    # 16384x4096 bf16 and 8x768, h100
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import types
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.dirname(os.path.abspath(__file__))):
  if p not in sys.path:
    sys.path.insert(0, p)

import _common as C  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
EPS = 1e-6
SWEEP = ("16384x768:bfloat16,16384x1024:bfloat16,16384x4096:bfloat16,16384x8192:bfloat16,"
         "16384x768:float32,16384x1024:float32,16384x4096:float32,16384x8192:float32,"
         "4096x768:bfloat16,2048x1024:bfloat16,8x768:bfloat16")
QUICK = "16384x4096:bfloat16,8x768:bfloat16"
IMPLS = ("tokamax", "tokamax (donated x)", "pallas_kernels", "XLA")
PASSES = ("fwd", "train")


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def require_tokamax():
  """tokamax, or exit with how to get it."""
  try:
    import tokamax
  except ImportError as e:
    sys.exit(f"tokamax_compare: tokamax is not installed ({e}). It needs Python 3.12 and, with jax 0.10.2, "
             "tokamax==0.0.15: python3.12 -m venv /work/venvs/tokamax && /work/venvs/tokamax/bin/pip install "
             "'jax==0.10.2' tokamax==0.0.15 jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2 "
             "nvidia-cuda-nvcc-cu12 && /work/venvs/tokamax/bin/pip install --no-deps -e . ; then run this script "
             "with /work/venvs/tokamax/bin/python.")
  return tokamax


class _DevicesOf(types.ModuleType):
  """``jax`` as tokamax's config module sees it, with ``devices()`` = the target's device."""

  def __init__(self, jax_module, device):
    super().__init__("jax")
    self._jax, self._device = jax_module, device

  def devices(self, *args, **kwargs):
    return [self._device]

  def __getattr__(self, name):
    return getattr(self._jax, name)


def for_target(tokamax, target: str) -> None:
  """Point tokamax's block-size heuristic at ``target``'s SM count (see the module docstring)."""
  import jax
  from tokamax._src.ops.normalization import pallas_triton_config as ptc

  from pallas_kernels import aot
  ptc.jax = _DevicesOf(jax, aot.device(target))


def programs(tokamax) -> dict[str, Callable]:
  import pallas_kernels as pk

  return {
      "tokamax": lambda x, s, b: tokamax.layer_norm(x, s, b, epsilon=EPS, subtract_mean=False,
                                                    implementation="triton"),
      "pallas_kernels": lambda x, s, b: pk.rms_norm(x, s, b, eps=EPS, interpret=False),
      "XLA": lambda x, s, b: pk.rms_norm_reference(x, s, b, eps=EPS),
  }


def train_of(f: Callable) -> Callable:
  import jax

  def train(x, s, b, dy):
    y, vjp = jax.vjp(f, x, s, b)
    return y, vjp(dy)

  return train


def compile_one(impl: str, pass_: str, rows: int, hidden: int, dtype: str, target: str, tokamax) -> dict:
  import gpu_model as G
  import jax
  import jax.numpy as jnp

  from pallas_kernels import aot

  base = "tokamax" if impl.startswith("tokamax") else impl
  f = programs(tokamax)[base]
  f = f if pass_ == "fwd" else train_of(f)
  x = jax.ShapeDtypeStruct((rows, hidden), jnp.dtype(dtype))
  p = jax.ShapeDtypeStruct((hidden,), jnp.float32)
  args = (x, p, p) if pass_ == "fwd" else (x, p, p, x)
  jit_kwargs = {"donate_argnums": (0,)} if "donated" in impl else None
  c = aot.compile(f, *args, target=target, jit_kwargs=jit_kwargs)
  t = aot.target(target)
  kernels, seconds, modelled = [], 0.0, 0.0
  for k in c.kernels:
    info = None
    if aot.ptxas_path() and k.name in c.ptx:
      try:
        info = c.ptxas(k.name)
      except (RuntimeError, StopIteration):
        info = None
    at_bw = k.bytes / G.PEAK_BW[target]
    util = None
    if info is not None and k.grid and k.threads:
      util = G.utilisation(t, k.grid[0] * math.prod(k.grid[1:]), math.prod(k.threads), info.registers,
                           k.shared_memory, k.operand_bytes)["util"]
    seconds += at_bw
    modelled += at_bw / util if util else at_bw
    kernels.append({"name": k.name, "kind": k.kind, "grid": list(k.grid), "threads": list(k.threads),
                    "bytes": k.bytes, "registers": info.registers if info else None,
                    "spill_bytes": (info.spill_stores + info.spill_loads) if info else None,
                    "spill_stores": info.spill_stores if info else None, "util": util})
  regs = [k["registers"] for k in kernels if k["registers"] is not None]
  spills = [k["spill_bytes"] for k in kernels if k["spill_bytes"] is not None]
  return {"impl": impl, "pass": pass_, "rows": rows, "hidden": hidden, "dtype": dtype, "target": target,
          "launches": len(kernels), "bytes": c.hbm_bytes, "us_at_bw": seconds * 1e6, "modelled_us": modelled * 1e6,
          "max_registers": max(regs) if regs else None, "spill_bytes": sum(spills) if spills else 0,
          "kernels": kernels}


def _short(dtype: str) -> str:
  return {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}.get(dtype, dtype)


def table(records: list[dict]) -> list[str]:
  cols = ["target", "shape", "pass", "impl", "launches", "registers (per kernel)", "spill B", "MB", "us @ BW",
          "modelled us", "vs pallas_kernels (modelled us)"]
  ours = {(r["target"], r["rows"], r["hidden"], r["dtype"], r["pass"]): r for r in records
          if r["impl"] == "pallas_kernels"}
  rows = []
  for r in records:
    key = (r["target"], r["rows"], r["hidden"], r["dtype"], r["pass"])
    o = ours.get(key)
    regs = "/".join(str(k["registers"]) for k in r["kernels"] if k["registers"] is not None) or "-"
    vs = f"{r['modelled_us'] / o['modelled_us']:.2f}" if o and o["modelled_us"] else ""
    rows.append(dict(zip(cols, [
        r["target"], f"{r['rows']}x{r['hidden']} {_short(r['dtype'])}", r["pass"], r["impl"], r["launches"], regs,
        r["spill_bytes"], f"{r['bytes'] / 1e6:.2f}", f"{r['us_at_bw']:.1f}", f"{r['modelled_us']:.1f}", vs])))
  return C.markdown_table(rows, cols)


def wins(records: list[dict]) -> list[str]:
  """Shapes where a tokamax program beats ours in a metric (fewer launches, bytes or modelled us)."""
  ours = {(r["target"], r["rows"], r["hidden"], r["dtype"], r["pass"]): r for r in records
          if r["impl"] == "pallas_kernels"}
  out = []
  for r in records:
    if not r["impl"].startswith("tokamax"):
      continue
    o = ours.get((r["target"], r["rows"], r["hidden"], r["dtype"], r["pass"]))
    if o is None:
      continue
    better = [f"{m} {r[m]:.4g} vs {o[m]:.4g}" for m in ("launches", "bytes", "modelled_us") if r[m] < o[m] * 0.98]
    if better:
      out.append(f"- {r['target']} {r['rows']}x{r['hidden']} {_short(r['dtype'])} {r['pass']}, {r['impl']}: "
                 + "; ".join(better))
  return out


def versions() -> dict:
  return C.package_versions(("jax", "jaxlib", "tokamax", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                             "nvidia-cuda-nvcc-cu12"))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default=SWEEP, help="rows x hidden:dtype list")
  ap.add_argument("--targets", default="h100,a100")
  ap.add_argument("--impls", default=",".join(IMPLS))
  ap.add_argument("--quick", action="store_true", help=f"{QUICK} on h100 only")
  ap.add_argument("--out", default=os.path.join(RESULTS, "tokamax_compare"), help="path without extension")
  a = ap.parse_args(argv)
  tokamax = require_tokamax()
  from pallas_kernels import aot
  reason = aot.unavailable_reason()
  if reason is not None:
    sys.exit(f"tokamax_compare: deviceless CUDA compilation is unavailable ({reason}); install the gpu-aot "
             "wheels (jax-cuda12-plugin, jax-cuda12-pjrt, nvidia-cuda-nvcc-cu12) of the running jax")
  if a.quick:
    a.shapes, a.targets = QUICK, "h100"
  shapes = []
  for item in a.shapes.split(","):
    size, _, dtype = item.partition(":")
    r, h = (int(v) for v in size.lower().split("x"))
    shapes.append((r, h, dtype or "bfloat16"))
  impls = [i for i in a.impls.split(",") if i]
  t0 = time.time()
  records = []
  with tokamax.config.cross_compile(True):
    for target in [t for t in a.targets.split(",") if t]:
      for_target(tokamax, target)
      for rows, hidden, dtype in shapes:
        for pass_ in PASSES:
          for impl in impls:
            t1 = time.time()
            r = compile_one(impl, pass_, rows, hidden, dtype, target, tokamax)
            records.append(r)
            log(f"{target} {rows}x{hidden} {_short(dtype)} {pass_} {impl}: {r['launches']} launches "
                f"[{', '.join(k['name'] for k in r['kernels'])}], regs {r['max_registers']}, spills "
                f"{r['spill_bytes']} B, {r['bytes'] / 1e6:.1f} MB, {r['modelled_us']:.1f} us "
                f"({time.time() - t1:.0f} s)")
  wall = time.time() - t0
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  cmd = C.command_line(__file__, argv)
  v = versions()
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out + ".json", "w") as f:
    json.dump({"date": now, "command": cmd, "wall_s": round(wall, 1), "versions": v,
               "host": f"CPU only ({os.cpu_count()} cores); no GPU was used", "records": records}, f, indent=1)
  tab, won = table(records), wins(records)
  lines = [*C.model_header("tokamax vs pallas_kernels: RMSNorm kernels compiled for H100/A100 "
                           "(a MODEL, not a measurement)", now, f"wall time {wall:.0f} s", cmd, v),
           "- `tokamax` = `tokamax.layer_norm(x, scale, bias, subtract_mean=False, implementation=\"triton\")`, "
           "`tokamax (donated x)` = the same with x donated (its forward writes over its input; without donation "
           "XLA copies x first: the `kCopy` launch), `pallas_kernels` = `pallas_kernels.rms_norm(..., "
           "interpret=False)`, `XLA` = `pallas_kernels.rms_norm_reference`; f32 scale and bias; `train` = "
           "forward + VJP w.r.t. x, scale, bias",
           "- registers per kernel in launch order (`ptxas -v` on XLA's PTX; `-` for copies and library calls); "
           "spill B = spill stores + loads over the kernels; MB = operands + results of every launch once; "
           "`us @ BW` = MB / peak bandwidth (H100 3.35 TB/s, A100 2.0 TB/s); `modelled us` = per launch "
           "bytes / (peak bandwidth x modelled utilisation: resident blocks by registers/threads/smem, bytes in "
           "flight vs an assumed 600 ns DRAM latency, last-wave efficiency; `benchmarks/gpu_model.py`)",
           "- tokamax's block size comes from its heuristic with the target's SM count (its autotuning cache has "
           "no 2-D RMSNorm entries, so a real GPU takes the same configuration)", "",
           *tab, "", "## Where tokamax is ahead (> 2% in a metric)", "", *(won or ["- nowhere"]), ""]
  with open(a.out + ".md", "w") as f:
    f.write("\n".join(lines))
  log(f"wrote {a.out}.md, {a.out}.json ({wall:.0f} s)")
  print("\n".join(tab))
  print("\n".join(won))
  return 0


if __name__ == "__main__":
  sys.exit(main())
