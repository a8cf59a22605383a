"""Fold time of a new function object against its `jax.make_jaxpr` time, and a 70B-class abstract fold.

Issue 20, item 5: a fold should cost at most 1.5x a trace. Every call below uses a *new*
function object, so neither jax's tracing cache nor jaxfold's analysis cache is hit. The
variants run interleaved in one process, their order rotated every round (the machine is
shared: only ratios measured this way mean anything); the figure is the ratio of medians,
with a 95% bootstrap interval and an A/A figure (`make_jaxpr` against itself).

- GPT-2 small (`models` gpt2, HF parameter layout) at 1x256 and 4x256, real (random)
  weights: `jaxfold.fold(params, new_fn, ids)` against `jax.make_jaxpr(new_fn)(params, ids)`.
  At batch 1 the fold also proves its plan with the size-1 axis made 2 (one fold serves
  every shape), which traces the function a second time.
- jaxfold's own traces of a flax linen model make each distinct parameter-shape check of
  linen (an abstract evaluation of the parameter's initializer) once, where `make_jaxpr`
  makes one per parameter: the same program, traced for less than `make_jaxpr` costs.
- An OPT-66B-shaped stack (64 layers, d_model 9216, 72 heads, ffn 36864, vocab 50272) from
  `jax.ShapeDtypeStruct` parameters: `jaxfold.fold` accepts abstract parameters and returns
  the report and plan without allocating a weight (`folded.params` holds the structs).

    python benchmarks/fold_vs_trace.py [--rounds 7] [--big 1x2048,4x2048 --big-rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys

import _common as C


def _fresh(fn):
  """A new function object with ``fn``'s behaviour: jax re-traces it, jaxfold re-analyses it."""
  return lambda *a: fn(*a)


def fold_vs_trace(spec, params, args, rounds: int) -> dict:
  import jax

  import jaxfold
  abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  fn = spec.apply_fn()

  def fold(**kw):
    return jaxfold.fold(params, _fresh(fn), *args, **kw).params

  thunks = {"make_jaxpr": lambda: jax.make_jaxpr(_fresh(fn))(abstract, *args),
            "fold": fold,
            "make_jaxpr A/A": lambda: jax.make_jaxpr(_fresh(fn))(abstract, *args)}
  if _has_size_one(args):   # the example's shapes alone: one trace, no second-shape proof
    thunks[EXAMPLE_ONLY] = lambda: fold(generic_shapes=False)
    thunks[BOTH_TRACES] = _both_traces(fn, abstract, args)
  times = C.time_variants(thunks, rounds=rounds, warmup=1, min_seconds=0.0)
  return C.summarize_timings(times, "make_jaxpr", [k for k in thunks if k != "make_jaxpr"])


# The default fold of an example with a size-1 axis proves two shapes (the example's and the
# example with its size-1 axes made 2): its cost set against tracing both.
BOTH_TRACES = "make_jaxpr at both shapes"


def _both_traces(fn, params, args):
  import jax
  probe = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(tuple(2 if n == 1 else n for n in x.shape), x.dtype), args)
  return lambda: (jax.make_jaxpr(_fresh(fn))(params, *args), jax.make_jaxpr(_fresh(fn))(params, *probe))


EXAMPLE_ONLY = "fold, generic_shapes=False"


def _has_size_one(args) -> bool:
  import jax
  return any(1 in x.shape for x in jax.tree_util.tree_leaves(args))


def opt66b_spec():
  from models.common import ModelSpec
  from models.opt import OPTConfig, OPTForCausalLM
  cfg = OPTConfig(vocab_size=50272, hidden_size=9216, num_hidden_layers=64, num_attention_heads=72,
                  ffn_dim=36864, max_position_embeddings=2048)
  return ModelSpec(name="opt-66b-shaped", family="opt", config=cfg, build=OPTForCausalLM)


def abstract_fold(spec, batch: int, seq: int, rounds: int) -> dict:
  """The abstract fold against ``make_jaxpr``, timed like the GPT-2 rows (interleaved, rotated,
  A/A); ``analysis_ms`` is the fold's median minus the trace's, what the fold adds to a trace."""
  import jax

  import jaxfold
  params = spec.abstract_init(batch, seq)
  args = spec.example_inputs(batch, seq, abstract=True)
  n = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
  fn = spec.apply_fn()
  folded = []

  def fold():
    folded[:] = [jaxfold.fold(params, _fresh(fn), *args)]   # the last only: each holds its analysis
    return None

  thunks = {"make_jaxpr": lambda: jax.make_jaxpr(_fresh(fn))(params, *args),
            "fold": fold,
            "make_jaxpr A/A": lambda: jax.make_jaxpr(_fresh(fn))(params, *args)}
  if _has_size_one(args):
    thunks[EXAMPLE_ONLY] = lambda: jaxfold.fold(params, _fresh(fn), *args, generic_shapes=False) and None
    thunks[BOTH_TRACES] = _both_traces(fn, params, args)
  times = C.time_variants(thunks, rounds=rounds, warmup=1, min_seconds=0.0)
  s = C.summarize_timings(times, "make_jaxpr", [k for k in thunks if k != "make_jaxpr"])
  rep = folded[-1].report
  s.update(params=n, folded=f"{rep.num_folded}/{rep.num_sites}", aux=rep.num_auxiliary,
           analysis_ms=s["median_ms"]["fold"] - s["median_ms"]["make_jaxpr"])
  return s


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--sizes", type=C.parse_sizes, default=C.parse_sizes("1x256,4x256"))
  ap.add_argument("--big", default="1x2048,4x2048", type=C.parse_sizes,
                  help="batch x seq of the 70B-class abstract fold")
  ap.add_argument("--big-rounds", type=int, default=3, help="interleaved rounds of the abstract fold")
  ap.add_argument("--out", default=f"{C.RESULTS}/fold_vs_trace.md")
  args = ap.parse_args(argv)

  import jax

  import models
  from models.common import randomize_norms

  rows = []

  def row(model: str, batch: int, seq: int, s: dict) -> None:
    for variant, label in (("fold", model), (EXAMPLE_ONLY, f"{model}, generic_shapes=False")):
      if variant not in s["ratio"]:
        continue
      lo, hi = s["ratio_ci"][variant]
      rows.append({"model": label, "batch x seq": f"{batch}x{seq}",
                   "make_jaxpr ms": f"{s['median_ms']['make_jaxpr']:.0f}",
                   "fold ms": f"{s['median_ms'][variant]:.0f}",
                   "fold / make_jaxpr": f"{s['ratio'][variant]:.2f} [{lo:.2f}, {hi:.2f}]",
                   "A/A": f"{s['ratio']['make_jaxpr A/A']:.2f}",
                   "fold - make_jaxpr ms": f"{s['median_ms'][variant] - s['median_ms']['make_jaxpr']:.0f}",
                   "fold / make_jaxpr at both shapes": (
                       f"{s['median_ms'][variant] / s['median_ms'][BOTH_TRACES]:.2f}"
                       if variant == "fold" and BOTH_TRACES in s["median_ms"] else "")})
      C.log(f"  {rows[-1]}")

  spec = models.get("gpt2")
  for batch, seq in args.sizes:
    C.log(f"gpt2 {batch}x{seq}")
    params = jax.block_until_ready(randomize_norms(spec.init(jax.random.PRNGKey(0), batch, seq),
                                                   jax.random.PRNGKey(1)))
    row("gpt2 (124M, real weights)", batch, seq,
        fold_vs_trace(spec, params, spec.example_inputs(batch, seq), args.rounds))
    del params
    C.log(f"gpt2 {batch}x{seq} (abstract)")
    row("gpt2 (124M, abstract: no centering)", batch, seq, abstract_fold(spec, batch, seq, args.rounds))
  big = opt66b_spec()
  for batch, seq in args.big:
    C.log(f"{big.name} {batch}x{seq} (abstract)")
    s = abstract_fold(big, batch, seq, args.big_rounds)
    row(f"{big.name} ({s['params'] / 1e9:.1f}B, abstract; {s['folded']} folded)", batch, seq, s)

  cols = ["model", "batch x seq", "make_jaxpr ms", "fold ms", "fold / make_jaxpr", "A/A", "fold - make_jaxpr ms",
          "fold / make_jaxpr at both shapes"]
  lines = C.header("fold time against a trace (issue 20, item 5)", sys.argv[1:] if argv is None else argv)
  lines += [f"GPT-2: {args.rounds} interleaved rounds (order rotated), one call per measurement, each of a new "
            "function object; median times, ratio of medians with its 95% bootstrap interval; A/A = "
            "make_jaxpr against itself (the noise). The fold includes centering the real weights; "
            "the abstract GPT-2 rows fold jax.ShapeDtypeStruct parameters (the same program, no "
            "centering), which separates the analysis from the memory-bound centering. "
            f"{big.name}: parameters and inputs are jax.ShapeDtypeStructs (nothing allocated), timed the "
            f"same way with {args.big_rounds} rounds; fold - make_jaxpr is what the fold adds to a trace "
            "(analysis, planning and, at batch 1, the second-shape proof; the generic_shapes=False rows fold "
            "for the example's shapes alone, without it; the last column sets the default fold of an example with a "
            "size-1 axis against make_jaxpr at both shapes it proves, the example's and the example with its "
            "size-1 axes made 2, timed in the same rounds). Target: fold <= 1.5x make_jaxpr, "
            "70B-class fold <= 3 s. The machine is shared; see the load average above.", ""]
  lines += C.markdown_table(rows, cols)
  C.write_markdown(args.out, lines)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
