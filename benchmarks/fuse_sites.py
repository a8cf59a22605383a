"""Sites ``fuse_affine`` fuses on zoo models as deployed: float32 or bfloat16
parameters, folded with ``norm_impl="xla"`` or ``"pallas"``.

Per model and variant: the sites the fold folded, the affine sites
``fuse_affine`` found and fused, and how many norms the fused program runs as
the RMSNorm kernel (``pallas``: when lowered for CUDA). Random weights with
non-trivial γ, β (``models.random_params``); the counts do not depend on them.

    python benchmarks/fuse_sites.py gpt2-tiny opt-tiny phi-tiny vit-tiny gpt2

Measured 2026-11-25 (CPU host; "fused" = fused/affine sites found, "kernels" =
norms the fused program runs as the RMSNorm kernel), before → after issue 20.3:

    gpt2 (small)  float32  pallas   0/0  → 25/25, 25 kernels
    gpt2 (small)  bfloat16 xla      0/25 → 25/25
    gpt2 (small)  bfloat16 pallas   0/0  → 25/25, 25 kernels
    gpt2/opt-tiny bfloat16 xla      0/5  → 5/5 (pallas: 0/0 → 5/5, 5 kernels)
    phi-tiny      bfloat16 xla      0/3  → 3/3 (pallas: 0/0 → 3/3, 3 kernels)
    vit-tiny      bfloat16 xla      0/5  → 5/5 (pallas: 0/1 → 5/5, 4 kernels: the
                                           final norm's class-token row stays in XLA)
    float32 with norm_impl="xla": unchanged (every folded site fused).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import jaxfold
import models


def _cast(tree, dtype):
  return jax.tree_util.tree_map(
      lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def count(name: str, dtype, norm_impl: str, batch: int = 2, seq: int = 8) -> dict:
  spec = models.get(name)
  s = None if type(spec).__name__ == "ImageModelSpec" else seq   # images: the configured size
  params = _cast(models.random_params(spec, batch, s) if s else models.random_params(spec, batch), dtype)
  args = _cast(spec.example_inputs(batch, s), dtype)
  t = time.perf_counter()
  folded = jaxfold.fold(params, spec.apply_fn(), *args, norm_impl=norm_impl)
  fused = jaxfold.fuse_affine(folded)
  r = fused.report
  return {"folded": folded.report.num_folded, "sites": len(r.sites), "fused": r.num_fused,
          "kernels": getattr(r, "kernels", 0), "seconds": time.perf_counter() - t,
          "first_reason": next((x.reason for x in r.sites if not x.fused), "")}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("names", nargs="+")
  ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  ap.add_argument("--impls", nargs="+", default=["xla", "pallas"])
  a = ap.parse_args()
  print(f"{'model':12} {'dtype':9} {'norm_impl':9} {'folded':>6} {'fused':>9} {'kernels':>7}  reason (first kept site)")
  for name in a.names:
    for dt in a.dtypes:
      for impl in a.impls:
        c = count(name, jnp.dtype(dt), impl)
        print(f"{name:12} {dt:9} {impl:9} {c['folded']:6d} {c['fused']:4d}/{c['sites']:<4d} {c['kernels']:7d}  "
              f"{c['first_reason'][:110]}", flush=True)


if __name__ == "__main__":
  main()
