"""A MODEL, not a measurement: folded vs original models, and one norm site, on H100/A100.

No GPU is involved: every program is compiled ahead of time for the targets in
``pallas_kernels/targets`` (``pallas_kernels.aot``, JAX's CUDA plugin on this CPU-only host).

**Whole models** (``--zoo``): GPT-2 small, OPT-125m and ViT-B/16 in bfloat16, original and
``jaxfold.fold(..., norm_impl="pallas")`` (the Pallas RMSNorm at every folded site, fused
with the residual add where one feeds it), at the paper's batch x sequence settings
(``--zoo-sizes``, ``--image-batches``). Per program: launches and row reductions from XLA's
thunk sequence, modelled HBM bytes (each launch reads its HLO operands and writes its
results once), flops of its GEMMs, and a modelled time = sum over launches of
max(bytes / peak bandwidth, flops / peak math): a per-launch roofline without launch
latency, L2 reuse or achieved-bandwidth losses. Folded/original ratios of each.

**One norm site** (``--models``, ``--sizes``): for every norm site of a pre-LN
transformer (a residual add feeding a
norm: ``h = x + residual; y = norm(h)``, returning ``(y, h)``) at GPT-2 small/medium shapes
in bfloat16, four implementations are compared:

* ``LayerNorm (XLA)``: flax ``nn.LayerNorm`` (what the original model runs);
* ``RMSNorm (XLA)``: :func:`pallas_kernels.rms_norm_reference` (the folded model, XLA path);
* ``RMSNorm (Pallas)``: the add in XLA, then the Pallas kernel ``pallas_kernels.rms_norm``;
* ``add+RMSNorm (Pallas)``: the fused kernel ``pallas_kernels.add_rms_norm`` (one launch).

Two numbers per implementation, forward only and forward + backward (``train``: the VJP
w.r.t. the residual stream, scale and bias):

1. **analytic**: a hand-written list of launches, each reading its inputs and writing its
   outputs exactly once (an ideal XLA implementation for the XLA rows; the Pallas rows
   are exactly what the kernels move, including the backward kernel's float32 partial
   sums of dscale/dbias);
2. **compiled**: the program compiled ahead of time for the target (``pallas_kernels.aot``:
   JAX's CUDA plugin against ``pallas_kernels/targets/*.txtpb``, on this CPU-only host)
   and, for every launch of XLA's thunk sequence, the bytes of its HLO operands + results.
   Launch counts are XLA's, bytes assume each launch touches each operand/result once in
   HBM (no L2 reuse, no re-reads).

Modelled time = bytes / peak HBM bandwidth (3.35 TB/s H100 SXM, 2.0 TB/s A100; the brief's
round numbers), i.e. a lower bound that ignores launch latency (~2-5 us per launch on a
real GPU, which is why launch counts are listed), tails and achieved bandwidth. Per-model
numbers multiply a site by the model's number of norm sites (2 per block + the final norm,
each fed by a residual add; the first by the token + position embedding add).

Usage (from the repository root; needs the ``gpu-aot`` extra for the compiled columns)::

    python benchmarks/gpu_model.py                       # writes results/gpu_model{.md,.png,_zoo.png}
    python benchmarks/gpu_model.py --zoo gpt2 --zoo-sizes 2x1024 --no-sites   # one model, one size
    python benchmarks/gpu_model.py --sizes 8x1024 --no-compile   # analytic one-site rows only

**Kernels** (with the compiled columns): registers, spills and shared memory of the four
Pallas kernels at 16384 x 4096 bf16 from ``ptxas -v``, and a modelled bandwidth utilisation
(resident blocks x tile bytes in flight against bandwidth x an assumed DRAM latency, times
the last wave's efficiency).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import math
import os
import re
import sys
import time
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (ROOT, HERE):  # run as `python benchmarks/gpu_model.py` from a source tree, or loaded by path
  if _p not in sys.path:
    sys.path.insert(0, _p)

import _common as C  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import aot  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODELS = {"gpt2": dict(hidden=768, layers=12), "gpt2-medium": dict(hidden=1024, layers=24)}
PEAK_BW = {"h100": 3.35e12, "a100": 2.0e12}  # bytes/s, modelled peak
EPS = 1e-5
DTYPE = jnp.bfloat16
VARIANTS = ("LayerNorm (XLA)", "RMSNorm (XLA)", "RMSNorm (Pallas)", "add+RMSNorm (Pallas)")
PASSES = ("fwd", "train")


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# The programs (one norm site)
# --------------------------------------------------------------------------
def _layer_norm(h, s, b):
  import flax.linen as nn  # as in the HF Flax GPT-2 (bf16 compute dtype, f32 params)

  return nn.LayerNorm(epsilon=EPS, dtype=DTYPE).apply({"params": {"scale": s, "bias": b}}, h)


SITE: dict[str, Callable] = {
    "LayerNorm (XLA)": lambda x, r, s, b: (_layer_norm(x + r, s, b), x + r),
    "RMSNorm (XLA)": lambda x, r, s, b: (pk.rms_norm_reference(x + r, s, b, eps=EPS), x + r),
    "RMSNorm (Pallas)": lambda x, r, s, b: (pk.rms_norm(x + r, s, b, eps=EPS, interpret=False), x + r),
    "add+RMSNorm (Pallas)": lambda x, r, s, b: pk.add_rms_norm(x, r, s, b, eps=EPS, interpret=False),
}


def program(variant: str, pass_: str) -> Callable:
  site = SITE[variant]
  if pass_ == "fwd":
    return site

  def train(x, r, s, b, dy, dh):
    # d/dx == d/dresidual (the residual stream's gradient), so differentiate w.r.t. x only.
    out, vjp = jax.vjp(lambda x, s, b: site(x, r, s, b), x, s, b)
    return out, vjp((dy, dh))

  return train


def program_args(rows: int, hidden: int, pass_: str):
  a = jax.ShapeDtypeStruct((rows, hidden), DTYPE)
  p = jax.ShapeDtypeStruct((hidden,), jnp.float32)
  return (a, a, p, p) if pass_ == "fwd" else (a, a, p, p, a, a)


# --------------------------------------------------------------------------
# Analytic model (hand-written launch lists)
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Launch:
  name: str
  read: int  # bytes
  written: int  # bytes


def _bwd_programs(rows: int, hidden: int) -> int:
  """Programs of the Pallas backward kernel (its float32 dscale/dbias partial rows)."""
  return sys.modules["pallas_kernels.rms_norm"].bwd_grid(rows, hidden)[2]


def analytic(variant: str, pass_: str, rows: int, hidden: int) -> list[Launch]:
  A = rows * hidden * jnp.dtype(DTYPE).itemsize  # one bf16 activation
  P = hidden * 4  # one f32 parameter vector
  S = rows * 4  # one f32 per-row statistic
  Q = _bwd_programs(rows, hidden) * hidden * 4  # f32 partial sums of one parameter gradient
  add = Launch("add", 2 * A, A)
  if variant in ("LayerNorm (XLA)", "RMSNorm (XLA)"):
    stats = 2 * S if variant.startswith("Layer") else S  # mean + rstd vs rstd
    fwd = [add, Launch("norm", A + 2 * P, A + (stats if pass_ == "train" else 0))]
    if pass_ == "fwd":
      return fwd
    # dx = dh + norm_bwd(dy) in one kernel; dscale/dbias column sums in another.
    return fwd + [Launch("norm_bwd_dx", 3 * A + stats + P, A), Launch("norm_bwd_dparams", 2 * A + stats, 2 * P)]
  if variant == "RMSNorm (Pallas)":
    # The forward kernel writes the per-row rstd only when it is differentiated.
    fwd = [add, Launch("rms_norm_fwd", A + 2 * P, A + (S if pass_ == "train" else 0))]
    if pass_ == "fwd":
      return fwd
    return fwd + [Launch("rms_norm_bwd", 2 * A + S + P, A + 2 * Q), Launch("add (residual grad)", 2 * A, A),
                  Launch("sum dscale partials", Q, P), Launch("sum dbias partials", Q, P)]
  fwd = [Launch("fused_add_rms_norm_fwd", 2 * A + 2 * P, 2 * A + (S if pass_ == "train" else 0))]
  if pass_ == "fwd":
    return fwd
  return fwd + [Launch("fused_add_rms_norm_bwd", 3 * A + S + P, A + 2 * Q),
                Launch("sum dscale partials", Q, P), Launch("sum dbias partials", Q, P)]


# --------------------------------------------------------------------------
# Compiled (AOT) model
# --------------------------------------------------------------------------
@dataclasses.dataclass
class Compiled:
  launches: list[Launch]
  kernels: list  # aot.Kernel


def compiled(variant: str, pass_: str, rows: int, hidden: int, target: str) -> Compiled:
  c = aot.compile(program(variant, pass_), *program_args(rows, hidden, pass_), target=target)
  return Compiled([Launch(k.name, k.operand_bytes, k.result_bytes) for k in c.kernels], c.kernels)


# --------------------------------------------------------------------------
# Whole models: original vs folded (public API only)
# --------------------------------------------------------------------------
ZOO = ("gpt2", "opt-125m", "vit-b/16")
# The paper's batch x sequence settings: batch 2 at 256-16384 tokens (its latency and
# long-context figures), batch 8-128 at 256 tokens (its batch-size scaling); ViT-B/16 at
# 224 px (197 tokens) for the same batches.
ZOO_SIZES = "2x256,2x1024,2x4096,2x16384,8x256,32x256,128x256"
IMAGE_BATCHES = "2,8,32,128"
# Modelled peak math throughput (dense, no sparsity; bytes/s above): H100 SXM and A100 SXM
# datasheet round numbers, by the dtype of a dot's operands.
PEAK_FLOPS = {"h100": {"bf16": 989e12, "f16": 989e12, "f32": 67e12},
              "a100": {"bf16": 312e12, "f16": 312e12, "f32": 19.5e12}}
# XLA's default GEMMs are Triton fusions; its deviceless tiling fails on some of ViT's
# 197-token shapes ("Couldn't find output tile sizes"), and then both programs are
# compiled with cuBLAS GEMMs instead (the table says which).
CUBLAS_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def _bf16(tree):
  import numpy as np

  def cast(a):
    dt = jnp.bfloat16 if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype
    return jax.ShapeDtypeStruct(np.shape(a), dt)

  return jax.tree_util.tree_map(cast, tree)


def zoo_model(name: str, batch: int, seq: Optional[int]):
  """(apply_fn, params, args) of a zoo model in bfloat16, as ShapeDtypeStructs (no weights).

  ``seq`` is the sequence length (text; position tables are extended to it) or
  ``None`` (images: the configured 224 px)."""
  import models

  spec = models.get(name)
  c = spec.config
  if seq is not None:
    for k, extra in (("n_positions", 0), ("max_position_embeddings", 2)):  # OPT offsets by 2
      if hasattr(c, k) and getattr(c, k) < seq + extra:
        c = dataclasses.replace(c, **{k: seq + extra})
    spec = dataclasses.replace(spec, config=c)
  params = _bf16(spec.abstract_init(batch, seq))
  args = _bf16(spec.example_inputs(batch, seq, abstract=True))
  return spec.apply_fn(), params, args


def modelled_seconds(kernels: list, target: str) -> float:
  """Σ over launches of max(bytes / peak bandwidth, flops / peak math): a roofline per launch."""
  peaks = PEAK_FLOPS[target]
  total = 0.0
  for k in kernels:
    flops_s = k.flops / peaks.get(k.flops_dtype, peaks["f32"]) if k.flops else 0.0
    total += max(k.bytes / PEAK_BW[target], flops_s)
  return total


def rms_matmul_work(c) -> None:
  """Adds the work of ``pallas_kernels.rms_matmul`` launches to ``c.kernels``: an opaque
  custom call whose GEMM (2·M·N·K flops, the dtype of its weight) and sum of squares (one
  row reduction) are not in the HLO, so the roofline would see only its bytes. A grouped
  launch (``rms_matmul_group``: the sibling readers of one norm) has one (M, N_i) result per
  weight: N = Σ N_i."""
  from pallas_kernels.rms_matmul import KERNEL

  instrs = None
  for k in c.kernels:
    if not k.name.startswith(KERNEL) or k.flops:
      continue
    if instrs is None:
      instrs = aot.parse_hlo(c.hlo)[0]
    ins = instrs.get(k.instruction)
    if ins is None or len(ins.operands) < 2 or ins.operands[0] not in instrs or ins.operands[1] not in instrs:
      continue
    out, x, w = (aot._arrays(s) for s in (ins.shape, instrs[ins.operands[0]].shape, instrs[ins.operands[1]].shape))
    if out and x and w and all(len(o[1]) == 2 for o in out) and len(x[0][1]) == 2:
      m, n, kk = out[0][1][0], sum(o[1][1] for o in out), x[0][1][1]
      k.flops, k.flops_dtype, k.reductions = 2.0 * m * n * kk, w[0][0], 1


def summarize(c, target: str) -> dict:
  """Launches, norm kernels, reductions, modelled bytes/flops/time of one compilation."""
  rms_matmul_work(c)
  return {"launches": c.launches(), "norm_kernels": c.launches(pk.FWD_KERNELS),
          "fused": c.launches(["fused_add_rms_norm_fwd"]), "reductions": c.reductions(),
          "bytes": c.hbm_bytes, "flops": c.flops, "seconds": modelled_seconds(c.kernels, target),
          "spills": _spills(c)}


def _spills(c) -> Optional[int]:
  """Spilled bytes (stores + loads) over the norm kernels, by ptxas; None without ptxas."""
  if aot.ptxas_path() is None:
    return None
  names = {k.name for k in c.kernels if k.name in pk.FWD_KERNELS + pk.BWD_KERNELS}
  return sum(c.ptxas(n).spill_stores + c.ptxas(n).spill_loads for n in names)


def zoo_compile(name: str, batch: int, seq: Optional[int], target: str) -> dict:
  """Folds ``name`` (``norm_impl="pallas"``) and compiles original and folded for ``target``."""
  import jaxfold

  fn, params, args = zoo_model(name, batch, seq)
  folded = jaxfold.fold(params, fn, *args, norm_impl="pallas")
  gemms = "triton"
  try:
    orig = aot.compile(fn, params, *args, target=target)
    fold = aot.compile(folded.apply_fn, folded.params, *args, target=target)
  except Exception as e:  # noqa: BLE001 - only the known deviceless tiling failure
    if "Couldn't find output tile sizes" not in str(e):
      raise
    gemms = "cublas"
    orig = aot.compile(fn, params, *args, target=target, compiler_options=CUBLAS_OPTIONS)
    fold = aot.compile(folded.apply_fn, folded.params, *args, target=target, compiler_options=CUBLAS_OPTIONS)
  return {"model": name, "batch": batch, "seq": seq, "target": target, "gemms": gemms,
          "sites": folded.report.num_sites,
          "folded": folded.report.num_folded, "orig": summarize(orig, target),
          "fold": summarize(fold, target), "fold_kernels": [k.name for k in fold.kernels]}


# --------------------------------------------------------------------------
# The norm-free bound: how much of the normalization overhead each variant leaves
# --------------------------------------------------------------------------
BOUND_MODELS = ("gpt2", "opt-125m", "phi-1.5", "vit-b/16")
# Prefill: batch x sequence (images: the batch at 224 px, 197 tokens). Decode: one new token
# per sequence against a KV cache of --cache-len positions (models.common.kv_cache); "8x1"
# (eight one-token sequences, no cache) is the decode-like shape of issue 20's first numbers.
BOUND_PREFILL = "2x1024,8x256,32x256"
BOUND_DECODE = "1,8,64"
BOUND_VARIANTS = ("original", "folded", "folded+fused", "folded+fused+deferred", "norm-free")
BOUND_METRICS = (("launches", "launches"), ("bytes", "modelled bytes"), ("seconds", "modelled time"))
_SUFFIX = re.compile(r"(?:[._]+\d+)+$")


def norm_free(fn: Callable) -> Callable:
  """``fn`` with every flax ``LayerNorm``/``RMSNorm``/``GroupNorm`` call replaced by the identity.

  NOT a correct model: the lower bound no normalization implementation can beat (same
  program, no norm work at all). Built with ``flax.linen.intercept_methods``, so neither the
  model code nor jaxfold changes; the norms' parameters stay arguments and are never read."""
  import flax.linen as nn

  norms = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)

  def identity(next_fun, args, kwargs, context):
    if isinstance(context.module, norms) and context.method_name == "__call__":
      return args[0]
    return next_fun(*args, **kwargs)

  def apply(params, *args):
    with nn.intercept_methods(identity):
      return fn(params, *args)

  return apply


def with_kv_cache(fn: Callable) -> Callable:
  """``fn(params, ids)`` -> ``f(params, ids, keys, values)``: one decode step against a KV
  cache (``models.common.kv_cache``; ``keys``/``values`` one (b, L, heads, head_dim) array per
  layer)."""
  from models.common import kv_cache

  def decode(params, ids, keys, values):
    with kv_cache(keys, values):
      return fn(params, ids)

  return decode


def _heads(c) -> tuple[int, int, int]:
  """(layers, heads, head_dim) of a text config."""
  layers = next(getattr(c, k) for k in ("n_layer", "num_hidden_layers") if hasattr(c, k))
  heads = next(getattr(c, k) for k in ("n_head", "num_attention_heads") if hasattr(c, k))
  d = next(getattr(c, k) for k in ("n_embd", "hidden_size") if hasattr(c, k))
  return layers, heads, d // heads


@dataclasses.dataclass(frozen=True)
class Shape:
  kind: str  # "prefill" | "decode" | "image"
  batch: int
  seq: int  # prefill: tokens; decode: new tokens (1); image: unused
  cache: int = 0  # decode: cached positions

  @property
  def label(self) -> str:
    if self.kind == "image":
      return f"{self.batch}x224px"
    if self.kind == "decode":
      return f"decode {self.batch}@{self.cache}" if self.cache else f"{self.batch}x1 (no cache)"
    return f"{self.batch}x{self.seq}"


def bound_programs(name: str, shape: Shape) -> tuple[Callable, Any, tuple]:
  """(apply_fn, params, args) of the original bf16 program (ShapeDtypeStructs)."""
  import models

  if shape.kind == "image":
    return zoo_model(name, shape.batch, None)
  fn, params, args = zoo_model(name, shape.batch, shape.seq)
  if shape.kind == "decode" and shape.cache:
    layers, heads, hd = _heads(models.get(name).config)
    kv = tuple(jax.ShapeDtypeStruct((shape.batch, shape.cache, heads, hd), jnp.bfloat16) for _ in range(layers))
    return with_kv_cache(fn), params, (*args, kv, kv)
  return fn, params, args


def _defer(fused, args):
  """``jaxfold.defer_norms(fused)`` where it exists (None otherwise, with the reason)."""
  import jaxfold

  if not hasattr(jaxfold, "defer_norms"):
    return None, "jaxfold.defer_norms not available in this jaxfold"
  try:
    try:
      return jaxfold.defer_norms(fused), ""
    except TypeError:
      return jaxfold.defer_norms(fused, *args), ""
  except Exception as e:  # noqa: BLE001 - a refusal is a result
    return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def bound_variants(name: str, shape: Shape) -> tuple[dict, dict]:
  """{variant: (apply_fn, params)} and per-variant notes (sites folded/fused/deferred, why absent)."""
  import jaxfold

  fn, params, args = bound_programs(name, shape)
  out = {"original": (fn, params)}
  notes: dict[str, str] = {}
  folded = jaxfold.fold(params, fn, *args, norm_impl="pallas")
  out["folded"] = (folded.apply_fn, folded.params)
  notes["folded"] = f"{folded.report.num_folded}/{folded.report.num_sites} sites folded"
  fused = None
  try:
    fused = jaxfold.fuse_affine(folded, *args)
    out["folded+fused"] = (fused.apply_fn, fused.params)
    notes["folded+fused"] = f"{fused.report.num_fused}/{len(fused.report.sites)} affine sites fused"
  except Exception as e:  # noqa: BLE001 - a refusal is a result
    notes["folded+fused"] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  if fused is not None:
    deferred, why = _defer(fused, args)
    if deferred is not None:
      out["folded+fused+deferred"] = (deferred.apply_fn, deferred.params)
      rep = getattr(deferred, "report", None)
      n = getattr(rep, "num_deferred", None)
      notes["folded+fused+deferred"] = f"{n} sites deferred" if n is not None else "deferred"
    else:
      notes["folded+fused+deferred"] = f"unavailable: {why}"
  out["norm-free"] = (norm_free(fn), params)
  notes["norm-free"] = "every norm = identity (not a correct model: the bound)"
  return {k: (f, p, args) for k, (f, p) in out.items()}, notes


def kernel_kinds(names: list[str]) -> collections.Counter:
  """Launch names without XLA's numeric suffixes (``loop_add_fusion_3`` -> ``loop_add_fusion``)."""
  return collections.Counter(_SUFFIX.sub("", n) for n in names)


def _compile_any(fn, params, args, target: str):
  try:
    return aot.compile(fn, params, *args, target=target), "triton"
  except Exception as e:  # noqa: BLE001 - only the known deviceless tiling failure
    if "Couldn't find output tile sizes" not in str(e):
      raise
    return aot.compile(fn, params, *args, target=target, compiler_options=CUBLAS_OPTIONS), "cublas"


def bound_compile(name: str, shape: Shape, target: str) -> dict:
  """Every variant of ``name`` at ``shape`` compiled for ``target``: metrics, launches, fractions left."""
  programs, notes = bound_variants(name, shape)
  rec: dict = {"model": name, "shape": shape.label, "kind": shape.kind, "batch": shape.batch,
               "seq": shape.seq, "cache": shape.cache, "target": target, "notes": notes, "variants": {}}
  gemms = "triton"
  for v, (fn, params, args) in programs.items():
    t0 = time.time()
    if gemms == "cublas":
      c = aot.compile(fn, params, *args, target=target, compiler_options=CUBLAS_OPTIONS)
    else:
      c, g = _compile_any(fn, params, args, target)
      if g == "cublas" and v != "original":  # keep every variant on the same GEMMs
        return _bound_all_cublas(name, shape, target, programs, rec)
      gemms = g
    rec["variants"][v] = _bound_summary(c, target, time.time() - t0)
  rec["gemms"] = gemms
  return _fractions(rec)


def _bound_all_cublas(name, shape, target, programs, rec) -> dict:
  rec["variants"] = {}
  for v, (fn, params, args) in programs.items():
    t0 = time.time()
    c = aot.compile(fn, params, *args, target=target, compiler_options=CUBLAS_OPTIONS)
    rec["variants"][v] = _bound_summary(c, target, time.time() - t0)
  rec["gemms"] = "cublas"
  return _fractions(rec)


def _bound_summary(c, target: str, secs: float) -> dict:
  rms_matmul_work(c)
  return {"launches": c.launches(), "bytes": c.hbm_bytes, "seconds": modelled_seconds(c.kernels, target),
          "flops": c.flops, "reductions": c.reductions(), "norm_kernels": c.launches(pk.FWD_KERNELS),
          "kernels": [k.name for k in c.kernels], "compile_s": round(secs, 1)}


def _fractions(rec: dict) -> dict:
  """(variant - norm-free) / (original - norm-free) per metric, and the launches left over the bound."""
  vs = rec["variants"]
  o, nf = vs["original"], vs["norm-free"]
  bound = kernel_kinds(nf["kernels"])
  for m in vs.values():
    m["fraction_left"] = {}
    for key, _ in BOUND_METRICS:
      over = o[key] - nf[key]
      # None where the original's overhead over the bound is below 0.1% of it (or negative):
      # a ratio of two differences that small says nothing (decode bytes: weights + cache)
      m["fraction_left"][key] = (m[key] - nf[key]) / over if over > 1e-3 * o[key] else None
    mine = kernel_kinds(m["kernels"])
    extra, instead = mine - bound, bound - mine
    m["extra_over_bound"] = dict(sorted(extra.items(), key=lambda kv: (-kv[1], kv[0])))
    m["bound_only"] = dict(sorted(instead.items(), key=lambda kv: (-kv[1], kv[0])))
  return rec


def _frac(x: Optional[float]) -> str:
  return "n/a" if x is None else f"{x:.2f}"


BOUND_COLUMNS = ["model", "shape", "target", "variant", "launches", "MB", "modelled us",
                 "left: launches", "left: bytes", "left: time", "notes"]


def bound_table(records: list[dict]) -> list[str]:
  rows = []
  for r in records:
    o, nf = r["variants"]["original"], r["variants"]["norm-free"]
    for v in BOUND_VARIANTS:
      m = r["variants"].get(v)
      note = r["notes"].get(v, "")
      if m is None:
        rows.append({"model": r["model"], "shape": r["shape"], "target": r["target"], "variant": v,
                     "notes": note})
        continue
      fl = m["fraction_left"]
      extra = m["launches"] - nf["launches"]
      rows.append({
          "model": r["model"], "shape": r["shape"], "target": r["target"], "variant": v,
          "launches": m["launches"], "MB": _mb(m["bytes"]), "modelled us": f"{m['seconds'] * 1e6:.1f}",
          "left: launches": (f"{_frac(fl['launches'])} ({extra} of {o['launches'] - nf['launches']})"
                             if v not in ("original", "norm-free") else _frac(fl["launches"])),
          "left: bytes": _frac(fl["bytes"]), "left: time": _frac(fl["seconds"]),
          "notes": note,
      })
  return C.markdown_table(rows, BOUND_COLUMNS)


def bound_leftovers(records: list[dict], threshold: float = 0.10,
                    variants: tuple = ("folded", "folded+fused", "folded+fused+deferred")) -> list[str]:
  """Per record and variant leaving > threshold of the launch overhead: the launches over the bound."""
  out = []
  for r in records:
    for v in variants:
      m = r["variants"].get(v)
      f = m and m["fraction_left"]["launches"]
      if f is None or f <= threshold:
        continue
      items = ", ".join(f"{k} x{n}" for k, n in m["extra_over_bound"].items())
      instead = ", ".join(f"{k} x{n}" for k, n in m.get("bound_only", {}).items()) or "nothing"
      out.append(f"- {r['model']} {r['shape']} {r['target']} {v} ({_frac(f)} of the launch overhead "
                 f"left): {items}; the bound has instead: {instead}")
  return out


def plot_bound(path: str, records: list[dict]) -> None:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    log("matplotlib not installed: no PNG written")
    return
  targets = list(dict.fromkeys(r["target"] for r in records))
  fig, axes = plt.subplots(len(BOUND_METRICS), len(targets), figsize=(max(8, 0.55 * len(records) + 3) * len(targets)
                           / max(len(targets), 1), 3.2 * len(BOUND_METRICS)), squeeze=False)
  variants = [v for v in BOUND_VARIANTS[1:-1] if any(v in r["variants"] for r in records)]
  colors = {"folded": "#4c72b0", "folded+fused": "#55a868", "folded+fused+deferred": "#c44e52"}
  for col, t in enumerate(targets):
    rs = [r for r in records if r["target"] == t]
    labels = [f"{r['model']}\n{r['shape']}" for r in rs]
    for row, (key, title) in enumerate(BOUND_METRICS):
      ax = axes[row][col]
      width = 0.8 / max(len(variants), 1)
      for vi, v in enumerate(variants):
        vals = [(r["variants"][v]["fraction_left"][key] if v in r["variants"] else None) for r in rs]
        xs = [i + (vi - (len(variants) - 1) / 2) * width for i in range(len(rs))]
        ax.bar(xs, [0 if x is None else x for x in vals], width, label=v, color=colors.get(v, "k"))
      ax.axhline(0.10, color="k", lw=0.8, ls="--")
      ax.axhline(1.0, color="#8c8c8c", lw=0.8)
      ax.set_xticks(range(len(rs)))
      ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=6)
      ax.set_ylabel("fraction of norm overhead left")
      ax.set_title(f"{t}: {title} (0 = norm-free bound, 1 = original; dashed: 10%)", fontsize=9)
      if row == 0 and col == 0:
        ax.legend(fontsize=7)
  fig.suptitle("MODEL (not measured): (variant - norm-free) / (original - norm-free), bf16, compiled for the "
               "target", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  log(f"wrote {path}")


def _versions() -> dict:
  return C.package_versions(("jax", "jaxlib", "flax", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                             "nvidia-cuda-nvcc-cu12"), commit=True)


def bound_main(args, argv) -> int:
  import json

  import jaxfold
  import models

  reason = aot.unavailable_reason()
  if reason is not None:
    log(f"--bound needs deviceless CUDA compilation (the gpu-aot extra): {reason}")
    return 2
  t_start = time.time()
  names = [m for m in args.bound_models.split(",") if m]
  targets = [t for t in args.targets.split(",") if t]
  prefill = [tuple(int(v) for v in x.lower().split("x")) for x in args.prefill.split(",") if x]
  decode = [int(b) for b in args.decode.split(",") if b]
  deferred = hasattr(jaxfold, "defer_norms")
  if not deferred:
    log("folded+fused+deferred: unavailable (jaxfold.defer_norms does not exist in this jaxfold); "
        "the variant is listed as unavailable and lights up once the API lands")
  records = []
  if args.bound_from:  # re-render from earlier runs' JSON (several runs merged, in order)
    names, walls, runs = [], [], []
    for path in args.bound_from.split(","):
      with open(path) as f:
        d = json.load(f)
      records += [_fractions(r) for r in d["records"]]
      commit = d.get("versions", {}).get("jaxfold_commit")
      walls.append(f"{d['wall_s']:.0f} s ({d['command']}" + (f"; at {commit}" if commit else "") + ")")
      runs.append({k: d.get(k) for k in ("date", "command", "wall_s", "versions")})
    log(f"merged {len(records)} records from {args.bound_from}")
  for name in names:
    image = models.get(name).family in ("vit", "swin", "cnn", "mlp")
    shapes = ([Shape("image", b, 0) for b, _ in prefill] if image else
              [Shape("prefill", b, s) for b, s in prefill] + [Shape("decode", b, 1, args.cache_len) for b in decode]
              + ([Shape("decode", 8, 1)] if name == "gpt2" and args.no_cache_8x1 else []))
    for shape in shapes:
      for t in targets:
        t0 = time.time()
        r = bound_compile(name, shape, t)
        r["wall_s"] = round(time.time() - t0, 1)
        records.append(r)
        vs = r["variants"]
        log(f"bound {name} {shape.label} {t}: launches " + ", ".join(
            f"{v} {m['launches']}" for v, m in vs.items()) + " | left " + ", ".join(
            f"{v} {_frac(m['fraction_left']['launches'])}/{_frac(m['fraction_left']['bytes'])}"
            for v, m in vs.items() if v not in ("original", "norm-free")) + f" ({r['wall_s']:.0f} s)")
  wall = time.time() - t_start
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  cmd = C.command_line(__file__, argv)
  wall_text = f"wall time {wall:.0f} s"
  if args.bound_from:
    wall_text = "merged from runs of " + "; ".join(walls)
  versions = _versions()
  base = args.bound_out
  os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
  with open(base + ".json", "w") as f:
    json.dump({"date": now, "command": cmd, "wall_s": round(wall, 1), "versions": versions,
               "host": f"CPU only ({os.cpu_count()} cores); no GPU was used",
               "deferred_available": deferred, "cache_len": args.cache_len,
               **({"runs": runs} if args.bound_from else {}), "records": records}, f, indent=1)
  log(f"wrote {base}.json")
  png = base + ".png"
  plot_bound(png, records)
  table = bound_table(records)
  leftovers = bound_leftovers(records)
  deferred_diff = bound_leftovers(records, float("-inf"), ("folded+fused+deferred",))
  lines = [
      *C.model_header("GPU model: how much of the normalization overhead is left (a MODEL, not a measurement)",
                      now, wall_text, cmd, versions, cores=os.cpu_count()),
      "- programs: bf16 parameters and activations, compiled ahead of time for "
      "`pallas_kernels/targets/{h100,a100}.txtpb` (`pallas_kernels.aot`); launches from XLA's thunk sequence, "
      "modelled bytes = each launch's HLO operands + results once, modelled time = sum over launches of "
      "max(bytes / peak bandwidth, flops / peak math), no launch latency; a Pallas `rms_matmul_fwd` launch "
      "(deferred readers) is charged its GEMM's 2·M·N·K flops and one row reduction, which its opaque "
      "custom call hides from the HLO",
      "- variants: `original`; `folded` = `jaxfold.fold(..., norm_impl=\"pallas\")`; `folded+fused` = "
      "`jaxfold.fuse_affine(folded)`; `folded+fused+deferred` = `jaxfold.defer_norms(fused)` "
      + ("(available)" if deferred else "(**unavailable**: `jaxfold.defer_norms` does not exist in this jaxfold; "
                                        "the column lights up once it does)")
      + "; `norm-free` = every flax norm replaced by the identity through `flax.linen.intercept_methods` "
      "(**not a correct model**: the lower bound)",
      "- **left** = (variant - norm-free) / (original - norm-free) per metric: 1 = all of the original's "
      "norm overhead, 0 = at the bound, < 0 = below the identity program (XLA fuses the norm-free program "
      "differently, e.g. the residual add into a GEMM epilogue, so it is a bound on launches, not exactly "
      "on bytes); `n/a` = the original's overhead is under 0.1% of it (decode bytes are weights + KV cache); "
      "`(k of n)` = launches over the bound / the original's",
      f"- shapes: prefill `b x s`; `decode b@{args.cache_len}` = one new token per sequence against a KV "
      f"cache of {args.cache_len} positions (`models.common.kv_cache`: q from the new token, K/V = cache "
      "concatenated with the token's own); `8x1 (no cache)` = eight one-token sequences (issue 20's "
      "decode-like shape); ViT-B/16: the batch at 224 px (197 tokens), no decode",
      "",
      *table, "",
      "## Launches over the norm-free bound (variants leaving > 10% of the launch overhead)", "",
      "Kernel names from XLA's thunk sequence with numeric suffixes stripped; the multiset difference "
      "variant - norm-free, then what the norm-free program launches instead (norm-free - variant).", "",
      *(leftovers or ["- none"]), "",
      "## folded+fused+deferred against the bound at every shape", "",
      "The same difference for the deferred variant whatever is left (the RMS-matmul kernels, "
      "`rms_matmul_fwd`, replace the readers' GEMMs).", "",
      *(deferred_diff or ["- none"]), "",
      f"![fraction of norm overhead left]({os.path.basename(png)})", "",
  ]
  with open(base + ".md", "w") as f:
    f.write("\n".join(lines))
  log(f"wrote {base}.md ({wall:.0f} s)")
  print("\n".join(table))
  print("\n".join(leftovers))
  return 0


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------
def _mb(b: float) -> str:
  return f"{b / 1e6:.2f}"


def _us(b: float, target: str) -> float:
  return b / PEAK_BW[target] * 1e6


# Memory latency a streaming kernel must hide (Little's law: bytes in flight per SM >=
# bandwidth x latency / SMs). An assumed round number for both targets, not a measurement.
DRAM_LATENCY_S = 600e-9
MAX_BLOCKS_PER_SM = 32


def utilisation(t, grid: int, threads: int, registers: int, smem: int, read_bytes: int) -> dict:
  """Modelled HBM bandwidth utilisation of a streaming kernel (a model, see the columns).

  Resident blocks per SM are limited by registers, threads and shared memory; each
  resident block is assumed to have its whole input tile in flight; utilisation =
  min(1, in-flight bytes / (bandwidth x latency / SMs)) x wave efficiency (the last
  partial wave of blocks runs the SMs part-empty)."""
  by_regs = t.registers_per_core_limit // max(registers * threads, 1)
  by_smem = t.shared_memory_per_core // smem if smem else MAX_BLOCKS_PER_SM
  blocks = max(0, min(by_regs, t.threads_per_core_limit // threads, by_smem, MAX_BLOCKS_PER_SM))
  if blocks == 0:
    return {"blocks/SM": 0, "waves": float("inf"), "util": 0.0}
  in_flight = blocks * read_bytes / max(grid, 1)
  need = t.memory_bandwidth * DRAM_LATENCY_S / t.core_count
  waves = grid / (blocks * t.core_count)
  wave_eff = waves / math.ceil(waves)
  return {"blocks/SM": blocks, "waves": waves, "util": min(1.0, in_flight / need) * wave_eff}


def kernel_table(targets: list[str], rows: int = 16384, hidden: int = 4096) -> list[dict]:
  """Registers/spills/shared memory and modelled bandwidth utilisation of the Pallas
  kernels at rows x hidden bf16 (forward as differentiated, with its rstd, and backward)."""
  out = []
  for target in targets:
    t = aot.target(target)
    for kind, fn in (("rms_norm", "RMSNorm (Pallas)"), ("fused_add_rms_norm", "add+RMSNorm (Pallas)")):
      c = aot.compile(program(fn, "train"), *program_args(rows, hidden, "train"), target=target)
      for k in c.kernels:
        if k.name not in (f"{kind}_fwd", f"{kind}_bwd"):
          continue
        info = c.ptxas(k.name) if aot.ptxas_path() else None
        threads = math.prod(k.threads)
        row = {
            "target": f"{target} ({t.arch})", "kernel": k.name, "grid": k.grid[0], "threads": threads,
            "dyn. smem B": k.shared_memory,
            "registers": info.registers if info else "n/a",
            "spill st/ld B": f"{info.spill_stores}/{info.spill_loads}" if info else "n/a",
            "MB moved": _mb(k.bytes), "us @ peak BW": f"{_us(k.bytes, target):.1f}",
        }
        if info is not None:
          u = utilisation(t, k.grid[0], threads, info.registers, k.shared_memory, k.operand_bytes)
          row.update({"blocks/SM": u["blocks/SM"], "waves": f"{u['waves']:.2f}",
                      "modelled BW util": f"{100 * u['util']:.0f}%",
                      "modelled us": f"{_us(k.bytes, target) / max(u['util'], 1e-9):.1f}"})
        out.append(row)
  return out


KERNEL_COLUMNS = ["target", "kernel", "grid", "threads", "dyn. smem B", "registers", "spill st/ld B", "blocks/SM",
                  "waves", "MB moved", "us @ peak BW", "modelled BW util", "modelled us"]


def plot(path: str, records: list[dict], size: str, targets: list[str]) -> None:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    log("matplotlib not installed: no PNG written")
    return
  fig, axes = plt.subplots(1, len(PASSES), figsize=(6 * len(PASSES), 4.2), squeeze=False)
  colors = ("#8c8c8c", "#4c72b0", "#55a868", "#c44e52")
  groups = [(m, t) for m in MODELS for t in targets]
  for ax, pass_ in zip(axes[0], PASSES):
    width = 0.8 / len(VARIANTS)
    for vi, variant in enumerate(VARIANTS):
      vals = []
      for m, t in groups:
        r = next((r for r in records if r["model"] == m and r["size"] == size and r["pass"] == pass_
                  and r["variant"] == variant), None)
        vals.append(r[f"step_ms_{t}"] if r else 0.0)
      ax.bar([g + (vi - (len(VARIANTS) - 1) / 2) * width for g in range(len(groups))], vals, width,
             label=variant, color=colors[vi])
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n{t}" for m, t in groups], fontsize=8)
    ax.set_ylabel("modelled ms per step, all norm sites")
    ax.set_title(f"{pass_}: bf16, batch x seq {size}", fontsize=10)
    ax.legend(fontsize=7)
  fig.suptitle("MODEL (not measured): compiled-HLO HBM bytes / peak bandwidth", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  log(f"wrote {path}")


ZOO_COLUMNS = ["model", "b x s", "target", "GEMMs", "sites: folded / kernel / fused", "launches orig -> folded",
               "reductions orig -> folded", "MB orig -> folded", "bytes folded/orig", "modelled ms orig -> folded",
               "time folded/orig"]


def zoo_records(models_: list[str], sizes: list[tuple[int, int]], image_batches: list[int],
                targets: list[str]) -> list[dict]:
  import models

  out = []
  for name in models_:
    image = models.get(name).family in ("vit", "swin", "cnn", "mlp")
    for b, s in ([(b, None) for b in image_batches] if image else sizes):
      for t in targets:
        t0 = time.time()
        r = zoo_compile(name, b, s, t)
        r["size"] = f"{b}x{'image' if s is None else s}"
        out.append(r)
        o, f = r["orig"], r["fold"]
        log(f"zoo {name} {r['size']} {t}: launches {o['launches']} -> {f['launches']}, "
            f"MB {_mb(o['bytes'])} -> {_mb(f['bytes'])} ({time.time() - t0:.0f} s)")
  return out


def zoo_table(records: list[dict]) -> list[str]:
  rows = []
  for r in records:
    o, f = r["orig"], r["fold"]
    rows.append({
        "model": r["model"], "b x s": r["size"], "target": r["target"], "GEMMs": r["gemms"],
        "sites: folded / kernel / fused": f"{r['folded']}/{r['sites']} / {f['norm_kernels']} / {f['fused']}",
        "launches orig -> folded": f"{o['launches']} -> {f['launches']}",
        "reductions orig -> folded": f"{o['reductions']} -> {f['reductions']}",
        "MB orig -> folded": f"{_mb(o['bytes'])} -> {_mb(f['bytes'])}",
        "bytes folded/orig": f"{f['bytes'] / o['bytes']:.4f}",
        "modelled ms orig -> folded": f"{o['seconds'] * 1e3:.3f} -> {f['seconds'] * 1e3:.3f}",
        "time folded/orig": f"{f['seconds'] / o['seconds']:.4f}",
    })
  return C.markdown_table(rows, ZOO_COLUMNS)


def plot_zoo(path: str, records: list[dict]) -> None:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    log("matplotlib not installed: no PNG written")
    return
  names = list(dict.fromkeys(r["model"] for r in records))
  fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
  styles = {"h100": ("#c44e52", "o"), "a100": ("#4c72b0", "s")}
  for ax, name in zip(axes[0], names):
    for t in dict.fromkeys(r["target"] for r in records):
      rs = [r for r in records if r["model"] == name and r["target"] == t]
      color, marker = styles.get(t, ("k", "x"))
      xs = range(len(rs))
      ax.plot(xs, [r["fold"]["seconds"] / r["orig"]["seconds"] for r in rs], marker=marker, color=color,
              label=f"{t}: modelled time")
      ax.plot(xs, [r["fold"]["bytes"] / r["orig"]["bytes"] for r in rs], marker=marker, color=color,
              ls="--", alpha=0.6, label=f"{t}: HBM bytes")
      ax.set_xticks(list(xs))
      ax.set_xticklabels([r["size"] for r in rs], rotation=45, ha="right", fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_title(f"{name} (bf16)", fontsize=10)
    ax.set_ylabel("folded / original")
    ax.legend(fontsize=7)
  fig.suptitle("MODEL (not measured): folded with the Pallas kernels vs original, compiled for H100/A100",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  log(f"wrote {path}")


def main(argv: Optional[list[str]] = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--models", default=",".join(MODELS))
  ap.add_argument("--sizes", default="1x1024,8x1024,32x1024", help="batch x seq list")
  ap.add_argument("--targets", default="h100,a100")
  ap.add_argument("--no-compile", action="store_true", help="analytic columns only")
  ap.add_argument("--plot-size", default="8x1024", help="batch x seq shown in the plot")
  ap.add_argument("--zoo", default=",".join(ZOO), help="whole models compiled original vs folded ('' = none)")
  ap.add_argument("--zoo-sizes", default=ZOO_SIZES, help="batch x seq of the text models")
  ap.add_argument("--image-batches", default=IMAGE_BATCHES, help="batches of the image models (224 px)")
  ap.add_argument("--no-sites", action="store_true", help="skip the one-site comparison")
  ap.add_argument("--out", default=os.path.join(RESULTS, "gpu_model.md"))
  b = ap.add_argument_group("norm-free bound (--bound): variants against every norm replaced by the identity")
  b.add_argument("--bound", action="store_true", help="run only the norm-free bound comparison")
  b.add_argument("--quick", action="store_true", help="with --bound: gpt2 on h100 at 2x1024 and decode 8 only")
  b.add_argument("--bound-models", default=",".join(BOUND_MODELS))
  b.add_argument("--prefill", default=BOUND_PREFILL, help="prefill batch x seq (image models: the batches)")
  b.add_argument("--decode", default=BOUND_DECODE, help="decode batches (one new token against the cache)")
  b.add_argument("--cache-len", type=int, default=1024, help="KV-cache positions of the decode shapes")
  b.add_argument("--no-cache-8x1", action=argparse.BooleanOptionalAction, default=True,
                 help="also gpt2 at 8x1 without a cache (issue 20's decode-like shape)")
  b.add_argument("--bound-from", default="", help="comma-separated JSONs of earlier --bound runs: merge and "
                 "re-render them (no compilation)")
  b.add_argument("--bound-out", default=os.path.join(RESULTS, "gpu_model_bound"),
                 help="path without extension: .json, .md and .png are written")
  args = ap.parse_args(argv)
  if args.bound:
    if args.quick:
      args.bound_models, args.targets, args.prefill, args.decode = "gpt2", "h100", "2x1024", "8"
    return bound_main(args, argv)
  models = [m for m in args.models.split(",") if m]
  targets = [t for t in args.targets.split(",") if t]
  sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes.split(",") if s]
  reason = "--no-compile" if args.no_compile else aot.unavailable_reason()
  t0 = time.time()

  records = []
  for model in ([] if args.no_sites else models):
    hidden, layers = MODELS[model]["hidden"], MODELS[model]["layers"]
    sites = 2 * layers + 1
    for b, s in sizes:
      rows = b * s
      for pass_ in PASSES:
        base = {}
        for variant in VARIANTS:
          an = analytic(variant, pass_, rows, hidden)
          rec = {"model": model, "size": f"{b}x{s}", "pass": pass_, "variant": variant, "sites": sites,
                 "an_launches": len(an), "an_bytes": sum(x.read + x.written for x in an)}
          for t in targets:
            if reason is None:
              c = compiled(variant, pass_, rows, hidden, t)
              rec[f"launches_{t}"] = len(c.launches)
              rec[f"read_{t}"] = sum(x.read for x in c.launches)
              rec[f"written_{t}"] = sum(x.written for x in c.launches)
              rec[f"bytes_{t}"] = rec[f"read_{t}"] + rec[f"written_{t}"]
              rec[f"kernels_{t}"] = [k.name for k in c.kernels]
            else:
              rec[f"bytes_{t}"] = rec["an_bytes"]
            rec[f"site_us_{t}"] = _us(rec[f"bytes_{t}"], t)
            rec[f"step_ms_{t}"] = rec[f"site_us_{t}"] * sites / 1e3
          base = base or rec
          for t in targets:
            rec[f"vs_ln_{t}"] = rec[f"bytes_{t}"] / base[f"bytes_{t}"]
          records.append(rec)
          log(f"{model} {b}x{s} {pass_} {variant}: analytic {len(an)} launches "
              f"{_mb(rec['an_bytes'])} MB" + ("" if reason else
              f"; compiled {rec[f'launches_{targets[0]}']} launches {_mb(rec[f'bytes_{targets[0]}'])} MB"))

  # ---- table -------------------------------------------------------------
  ts = " / ".join(targets)
  src = ["analytic"] + (targets if reason is None else [])
  cols = ["model", "b x s", "pass", "variant", f"launches/site ({' / '.join(src)})",
          f"MB/site ({' / '.join(src)})"]
  cols += [f"us/site {t}" for t in targets] + [f"ms/step {t}" for t in targets] + [f"bytes vs LayerNorm ({ts})"]
  rows_md = []
  for r in records:
    row = {"model": r["model"], "b x s": r["size"], "pass": r["pass"], "variant": r["variant"]}
    row[cols[4]] = " / ".join([str(r["an_launches"])] + [str(r[f"launches_{t}"]) for t in src[1:]])
    row[cols[5]] = " / ".join([_mb(r["an_bytes"])] + [_mb(r[f"bytes_{t}"]) for t in src[1:]])
    for t in targets:
      row[f"us/site {t}"] = f"{r[f'site_us_{t}']:.1f}"
      row[f"ms/step {t}"] = f"{r[f'step_ms_{t}']:.3f}"
    row[cols[-1]] = " / ".join(f"{r[f'vs_ln_{t}']:.3f}" for t in targets)
    rows_md.append(row)
  table = C.markdown_table(rows_md, cols)

  kernels_md: list[str] = []
  if reason is None:
    kernels_md = C.markdown_table(kernel_table(targets), KERNEL_COLUMNS)

  zoo_md: list[str] = []
  zoo = [m for m in args.zoo.split(",") if m]
  if reason is None and zoo:
    sizes = [tuple(int(v) for v in x.lower().split("x")) for x in args.zoo_sizes.split(",") if x]
    zoo_recs = zoo_records(zoo, sizes,
                           [int(b) for b in args.image_batches.split(",") if b], targets)
    zoo_png = os.path.splitext(args.out)[0] + "_zoo.png"
    peaks = ", ".join(f"{t} {PEAK_FLOPS[t]['bf16'] / 1e12:.0f} TFLOP/s" for t in targets)
    plot_zoo(zoo_png, zoo_recs)
    zoo_md = ["## Whole models: original vs folded (`jaxfold.fold(..., norm_impl=\"pallas\")`), bf16", "",
              "Each program compiled for the target; launches and reductions from XLA's thunk sequence; "
              "modelled time = sum over launches of max(bytes / peak bandwidth, flops / peak math) "
              f"(bf16 math: {peaks}); "
              "no launch latency. `sites` = norm sites folded, then forward Pallas kernels in the folded "
              "program (`rms_norm_fwd` + `fused_add_rms_norm_fwd`), then how many of them are fused "
              "with the residual add.", "", *zoo_table(zoo_recs), "",
              f"![folded / original, modelled]({os.path.basename(zoo_png)})", ""]
    print("\n".join(zoo_table(zoo_recs)))

  launches_md: list[str] = []
  if reason is None and records:
    m0, (b0, s0) = models[0], sizes[-1]
    launches_md = [f"## Compiled launches per site ({m0}, {b0}x{s0})", ""]
    for r in records:
      if r["model"] == m0 and r["size"] == f"{b0}x{s0}":
        for t in targets:
          launches_md.append(f"- {t}, {r['pass']}, {r['variant']}: " + ", ".join(r[f"kernels_{t}"]))

  print("\n".join(table))
  if kernels_md:
    print()
    print("\n".join(kernels_md))

  now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
  cmd = C.command_line(__file__, argv)
  lines = [
      "# GPU model: folded vs original models, LayerNorm vs RMSNorm vs fused add+RMSNorm "
      "(a MODEL, not a measurement)", "",
      f"- host: CPU only ({os.cpu_count()} cores), jax {jax.__version__}; no GPU was used",
      f"- date: {now}; {time.time() - t0:.0f} s",
      f"- command: `{cmd}`",
      "- compiled columns: " + ("XLA's launches and HLO operand + result bytes of programs compiled ahead of "
                                "time for `pallas_kernels/targets/{h100,a100}.txtpb` (`pallas_kernels.aot`)"
                                if reason is None else f"not available ({reason}); bytes are analytic"),
      "- modelled time = bytes / peak HBM bandwidth (H100 3.35 TB/s, A100 2.0 TB/s): a lower bound that "
      "ignores launch latency, tails and achieved bandwidth",
      "- one site = a residual add feeding a norm, returning (normed, sum), bf16 activations, f32 scale "
      "and bias; `train` = forward + VJP w.r.t. the residual stream, scale and bias; per step = site x "
      "(2 x layers + 1) norm sites (25 for gpt2, 49 for gpt2-medium); b x s = rows = batch x sequence",
      "- `bytes vs LayerNorm`: a row's bytes (compiled if available) over the LayerNorm (XLA) row's of the "
      "same model, size, pass and target",
      "- analytic launch lists: XLA rows = one kernel per op group (add; norm; norm backward dx incl. the "
      "residual gradient; dscale/dbias column sums) without XLA's cross-op multi-output fusion, so XLA's "
      "compiled training step can move fewer bytes than this naive schedule; Pallas rows = exactly what "
      "the kernels read and write (incl. the backward kernel's f32 dscale/dbias partial rows) plus XLA's adds",
      "",
      *zoo_md,
  ]
  if records:
    lines += ["## One norm site: LayerNorm vs RMSNorm vs fused add+RMSNorm", "", *table, ""]
  if launches_md:
    lines += [*launches_md, ""]
  if kernels_md:
    lines += ["## Pallas kernels at 16384 x 4096 bf16 (fwd + bwd program)", "",
              "Registers and spills from the CUDA wheel's `ptxas -v` on XLA's PTX. `blocks/SM` = resident "
              "blocks per SM allowed by registers, threads and shared memory; `modelled BW util` = "
              "min(1, bytes in flight / (bandwidth x latency / SMs)) x wave efficiency, with each resident "
              f"block's input tile in flight and an assumed {DRAM_LATENCY_S * 1e9:.0f} ns DRAM latency; "
              "`modelled us` = bytes / (peak bandwidth x utilisation). A static model, not an occupancy "
              "or bandwidth measurement.", "", *kernels_md, ""]
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  if records:
    png = os.path.splitext(args.out)[0] + ".png"
    plot(png, records, args.plot_size, targets)
    lines += [f"![modelled ms per step]({os.path.basename(png)})", ""]
  with open(args.out, "w") as f:
    f.write("\n".join(lines))
  log(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
