"""The paper's VMamba row: how many LayerNorms jaxfold folds exactly, why not the others, and
what the paper's count does numerically.

The paper counts 51 LayerNorms in VMamba, 36 foldable with its practical extension. This
script folds ``vmamba-t`` (the official VSSM's default configuration, 51 LNs) without weights
for the count and the report's reasons, then measures on ``vmamba-tiny`` (the same depths and
so the same 51 sites, tiny widths) with random γ, β and biases, in float64 and float32, the max
relative error of the logits against the original for:

* jaxfold's exact fold (with auxiliary centering);
* the paper's choice on every LN (``jaxfold.benchmarking.paper_choice``: every mean removed,
  every parameter feeding a norm's input additively centered, no soundness checks);
* the paper's choice on its own 36 (every LN but the 15 SS2D ``out_norm``s, whose input is the
  selective scan's output: the only 15 LNs no linear layer produces).

    python benchmarks/vmamba_fold.py --out benchmarks/results/vmamba.md
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxfold  # noqa: E402
import models  # noqa: E402
from jaxfold.benchmarking import max_rel_err, paper_choice  # noqa: E402

_WHY = """Why (tests/test_models/test_vmamba.py checks each step):

* Folded: the stem's 2 LNs and the 3 downsampling LNs read a convolution that nothing else reads
  (its output channels are centered); with one auxiliary centering of the last downsampling LN's
  output, the last stage's 4 block LNs and the head LN (that stream reaches only per-position LNs).
* Not folded, 26 block LNs of stages 0-2: a stage's stream starts at an LN output (γ ⊙ n + β is not
  zero-mean) and feeds the next stage's downsampling conv, a contraction over the channels. Any shift
  of the stream (an auxiliary centering, or centering the blocks' `out_proj`/`fc2`) becomes a shift
  that varies along the conv's output channels, which the downsampling LN does not ignore. The paper
  counts these as foldable (its practical extension); numerically that is the error above.
* Not folded, the 15 SS2D `out_norm`s: their input is the selective scan's output (C_t · h_t with
  input-dependent C_t and exp(Δ_t A)), which no linear producer feeds; the paper does not count them
  either (51 − 36 = 15).

The paper's count, 36, is then 10 exact + 26 block LNs whose fold changes the function."""


def _template(text: str) -> str:
  """A reason without its details (parenthesized or bracketed: which norm, sizes, lines) and
  with numbers replaced by N, so that sites refused for the same reason compare equal."""
  prev = None
  while prev != text:
    prev, text = text, re.sub(r"\([^()]*\)|\[[^\[\]]*\]", "", text)
  return re.sub(r"\d+", "N", text)


def group_reasons(report) -> list[tuple[list[str], list[int], str]]:
  """Not-folded sites grouped by their reason up to details:
  ``[(module path templates, site indices, one site's full reason)]``."""
  groups: dict = {}
  for s in report.sites:
    if not s.folded:
      wheres, idx, _ = groups.setdefault(_template(s.reason), ([], [], s.reason))
      where = re.sub(r"/\d+/", "/N/", s.where)
      if where not in wheres:
        wheres.append(where)
      idx.append(s.index)
  return list(groups.values())


def count_rows(spec) -> tuple[list[str], object]:
  """Fold the abstract model with and without auxiliary centering; rows of the count table."""
  params = spec.abstract_init(1)
  xs = spec.example_inputs(1, abstract=True)
  rows, reports = [], {}
  for aux in (False, True):
    t = time.perf_counter()
    r = jaxfold.fold(params, spec.apply_fn(), *xs, auxiliary_centering=aux).report
    reports[aux] = r
    rows.append(f"| jaxfold, exact ({'with' if aux else 'no'} auxiliary centering) | {r.num_sites} | "
                f"{r.num_folded} | {r.num_auxiliary} | {time.perf_counter() - t:.1f} s |")
  return rows, reports[True]


def errors(spec, dtype, batch: int, seed: int = 0) -> dict:
  """Max relative error of the logits vs the original, for the exact fold and the paper's choices."""
  params = jax.tree_util.tree_map(lambda a: a.astype(dtype), models.random_params(spec, seed=seed))
  (x,) = spec.example_inputs(batch)
  x = x.astype(dtype)
  fn = spec.apply_fn()
  ref = jax.jit(fn)(params, x)
  folded = jaxfold.fold(params, fn, x, auxiliary_centering=True)
  out = {"exact fold": max_rel_err(ref, jax.jit(folded.apply_fn)(folded.params, x))}
  paper_all, n_all = paper_choice(params, fn, x)
  keep = [s.index for s in folded.report.sites if not s.where.endswith("/op/out_norm")]
  paper_36, n_36 = paper_choice(params, fn, x, sites=keep)
  out[f"paper's choice, every LN ({n_all})"] = max_rel_err(ref, paper_all)
  out[f"paper's choice, its count ({n_36}: all but out_norm)"] = max_rel_err(ref, paper_36)
  out["_folded"] = folded.report.num_folded
  return out


def main(argv=None) -> str:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None)
  ap.add_argument("--count-model", default="vmamba-t")
  ap.add_argument("--error-model", default="vmamba-tiny")
  ap.add_argument("--batch", type=int, default=2)
  args = ap.parse_args(argv)
  spec, small = models.get(args.count_model), models.get(args.error_model)
  rows, report = count_rows(spec)
  md = [f"Measured {time.strftime('%Y-%m-%d')}. VMamba, `{spec.name}` ({spec.config.depths} depths, "
        f"{spec.config.image_size} px, analysed without weights); jax {jax.__version__}, "
        f"{jax.devices()[0].device_kind}.\n",
        "| who | LayerNorms | folded | auxiliary centerings | fold time |", "|---|---:|---:|---:|---:|",
        "| paper (appendix F table: 0 foldable, 36 with its practical extension) | 51 | 36 | – | – |", *rows, "",
        "Not folded, grouped (with auxiliary centering; N: the numbers that vary within a group):\n",
        "| sites | # | where | the report's reason (one of them) |", "|---|---:|---|---|"]
  for wheres, idx, reason in group_reasons(report):
    md.append(f"| {', '.join(map(str, idx))} | {len(idx)} | {', '.join(f'`{w}`' for w in wheres)} | {reason} |")
  md += ["", f"Numeric error on `{small.name}` ({small.config.depths} depths, embed_dim "
         f"{small.config.embed_dim}, {small.config.image_size} px, batch {args.batch}), random γ, β and "
         "biases (`models.random_params`): max |y − y_orig| / max |y_orig| of the logits.\n",
         "| fold | float64 | float32 |", "|---|---:|---:|"]
  jax.config.update("jax_enable_x64", True)
  e64 = errors(small, jnp.float64, args.batch)
  jax.config.update("jax_enable_x64", False)
  e32 = errors(small, jnp.float32, args.batch)
  for k in e64:
    if not k.startswith("_"):
      md.append(f"| {k}{' (' + str(e64['_folded']) + ' LNs)' if k == 'exact fold' else ''} | "
                f"{e64[k]:.1e} | {e32[k]:.1e} |")
  md += ["", _WHY, "", "Commands:\n", "```",
         f"python benchmarks/vmamba_fold.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip(),
         "python -m pytest -n 0 tests/test_models/test_vmamba.py            # count, reasons, exactness, baseline",
         "python -m pytest -n 0 -m slow tests/test_models/test_vmamba.py    # vmamba-tiny (51 LNs) exact at 2 shapes",
         "```", "", "Full report (`str(report)`, with auxiliary centering):\n", "```", str(report), "```", ""]
  text = "\n".join(md)
  print(text)
  if args.out:
    with open(args.out, "w") as fh:
      fh.write(text)
  return text


if __name__ == "__main__":
  main()
