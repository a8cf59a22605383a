"""Fault injection into jaxfold's analysis: does the test suite notice?

A tool, not a test (pytest does not collect it): each mutant below is one
hand-written textual replacement in ``jaxfold/_src`` that introduces a plausible
*soundness* fault (a facet claiming more than is true, a check or Blocker
dropped, a precision policy weakened, a loop path skipped, ...). For each, the
patch is applied to a scratch copy of the tree (never this checkout), a fixed
selection of fast tests runs with ``-x`` and a timeout, and the result is
recorded: killed (some test failed, named), survived, timeout, or no-apply (the
old text is not found exactly once: the mutant is stale).

  python tests/mutation_study.py                 # every mutant, writes the report
  python tests/mutation_study.py --only E3,P4    # some mutants (merged into the saved results)
  python tests/mutation_study.py --check         # only checks that every patch applies

Results: ``benchmarks/results/mutation_study.json`` (per mutant, merged across
runs) and ``benchmarks/results/mutation_study.md`` (the table). A survivor is
either equivalent (``equivalent=`` says why the change is no fault) or a test
gap, closed by a test in ``tests/test_jaxfold/test_mutants.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

# The fixed selections: fast soundness tests, the cheapest and most targeted first (with -x a
# killed mutant stops at its first failure). Mutants of the analysis (rules, drivers, planner,
# fold) run TESTS; mutants of fuse_affine/defer_norms (affine.py, deferral.py) run TESTS_FUSE.
TESTS = (
    "tests/test_jaxfold/test_mutants.py",
    "tests/test_jaxfold/rules/",
    "tests/test_jaxfold/test_adversarial_core.py",
    "tests/test_jaxfold/test_adversarial_general.py",
    "tests/test_jaxfold/test_fuzz.py",
    "tests/test_jaxfold/test_shapes.py",
    "tests/test_jaxfold/test_adversarial.py",
    "tests/test_jaxfold/test_adversarial_defer.py",
    "tests/test_jaxfold/test_adversarial_spellings.py::test_shard_map_four_devices",
)
TESTS_FUSE = (
    "tests/test_jaxfold/test_mutants.py",
    "tests/test_jaxfold/test_adversarial_defer.py",
    "tests/test_jaxfold/test_affine.py",
    "tests/test_jaxfold/test_defer.py",
)
FUSE_FILES = ("affine.py", "deferral.py")
PYTEST = ("-q", "-x", "-p", "no:cacheprovider", "-n", "1", "-rfE", "--no-header")


class Mutant(NamedTuple):
  id: str
  file: str            # under jaxfold/_src
  old: str             # exact text, found exactly once
  new: str
  what: str            # the fault, in one line
  # After a survival: "gap: ..." (the test that now kills it), "masked: ..." (why no fold goes
  # wrong) or "equivalent: ..." (why the change is no fault; not counted in the kill rate).
  verdict: str = ""


M = Mutant
EL, RED, CON, STR, CTL = ("rules/elementwise.py", "rules/reduction.py", "rules/contraction.py",
                          "rules/structural.py", "rules/control.py")

MUTANTS = [
  # -- elementwise: zero-sum facets ---------------------------------------------------------------
  M("E1", EL, "    if ctx.is_zero(a):\n      continue\n    s = operand_spec(a, spec, out_shape)",
    "    if ctx.is_zero(a) or len(a.shape) != len(out_shape):\n      continue\n"
    "    s = operand_spec(a, spec, out_shape)",
    "add: a scalar (rank-0) operand, e.g. `h + 3.0`, is skipped as if zero-sum"),
  M("E3", EL, "    if ctx.constant_along(y, dims, out_shape):\n      s = operand_spec(x, spec, out_shape)",
    "    if True:\n      s = operand_spec(x, spec, out_shape)",
    "mul: zero-sum through a product whatever the other factor (varying factor ignored)"),
  M("E4", EL, "  dims = [d for d, _ in spec]\n  for i, (x, y)", "  dims = [d for d, _ in spec][:1]\n  for i, (x, y)",
    "mul: the factor checked constant along the first normalized dim only (axes compared loosely)"),
  M("E5", EL, "  if _is_float(node.outs[0].dtype) and ctx.constant_along(b, [d for d, _ in spec], out_shape):",
    "  if _is_float(node.outs[0].dtype):",
    "div: zero-sum through a division by a value varying along the normalized axes"),
  M("E6", EL, "    raise Block(\"the shift reaches a divisor\")", "    return [None]",
    "div: a shift in the divisor treated as cancelled"),
  M("E7", EL, "  if n < 0:\n    raise Block(f\"the shift reaches a negative power",
    "  if n < -9:\n    raise Block(f\"the shift reaches a negative power",
    "integer_pow: a negative power carries the shift like a linear map"),
  M("E8", EL, "  if _pow_n(node) == 1:\n    return [Need(0, spec)]",
    "  if _pow_n(node) % 2 == 1:\n    return [Need(0, spec)]",
    "integer_pow: an odd power (x³) claimed zero-sum when x is"),
  M("E9", EL, "  for i in range(n - 1):\n    acc_p = A.poly_mul", "  for i in range(n - 2):\n    acc_p = A.poly_mul",
    "integer_pow: the top degree dropped (x² carries a shift linearly: a nonlinear op treated as linear)"),
  M("E10", EL, "  if not ctx.constant_along(pred, [d for d, _ in spec], shape):",
    "  if False and not ctx.constant_along(pred, [d for d, _ in spec], shape):",
    "select_n: the predicate may vary along the normalized axes"),
  M("E11", EL, "  if ctx.at_least_as_precise(dst, ctx.tolerance):\n    return \"rounding\"",
    "  if True:\n    return \"rounding\"",
    "convert: any float narrowing counted as rounding within tolerance (cast precision ignored)"),
  M("E14", EL, "    if not differentiable and ctx.cbwc:", "    if False:",
    "stop_gradient: CBWC lets a shift through a non-differentiable identity"),
  M("E15", EL, "      if ins[i] is not None and ins[1 - i] is None and ctx.facts(other).value == identity:",
    "      if ins[i] is not None and ins[1 - i] is None and ctx.facts(other).value is not None:",
    "max/min: any constant bound is transparent (ReLU max(x, 0) treated as linear)"),
  M("E16", EL, "    if a.is_const and a.const_value <= 0 and A.nonneg(b):",
    "    if a.is_const and a.const_value <= 0:",
    "max canon: max(0, v) = v without proving v non-negative"),
  M("E17", EL,
    "        if A.is_proportional(pa, A.lift(ca, out_shape)) and A.is_proportional(pb, A.lift(cb, out_shape)):",
    "        if A.is_proportional(pa, A.lift(ca, out_shape)):",
    "div (softmax): only the numerator checked proportional (exp(x+c) / (Σexp(x+c) + 1) passes)"),
  M("E18", EL, "  if _float_node(node) and A.exp_values(p) and A.is_proportional(p, _in_exp_atoms(ctx, p, node.ins)"
               "[0]):",
    "  if _float_node(node) and A.exp_values(p):",
    "log: any function of an exp's shift treated as log-sum-exp"),
  M("E21", EL, "    return A.derived(p, factor, ctx.constant_dims(other, out_shape), out_shape)",
    "    return A.derived(p, factor, frozenset(range(len(out_shape))), out_shape)",
    "mul: the other factor's variation ignored (shift times a varying factor stays constant)"),
  # -- reductions ----------------------------------------------------------------------------------
  M("R1", RED, "  if all(p.dims[a] is None for a in axes):\n    # Σ a_k c^k",
    "  if any(p.dims[a] is None for a in axes):\n    # Σ a_k c^k",
    "reduce_sum: a shift constant along ANY summed axis is summed as constant (axes compared loosely)"),
  M("R2", RED, "  return [Need(0, freeze({kept[d]: b for d, b in spec}))]",
    "  return [Need(0, freeze({d: b for d, b in spec}))]",
    "reduce_sum zero-sum: output dims not mapped back to input dims"),
  M("R4", RED, "  if any(d == node.params[\"axis\"] for d, _ in spec):", "  if False:",
    "cumsum: zero-sum claimed along the accumulated (normalized) axis"),
  M("R5", RED, "    dims[axis] = (None, 1) if shape[axis] != 1 else None", "    dims[axis] = p.dims[axis]",
    "cumsum: cumsum of a constant shift still constant along the axis (it is (i+1)·c)"),
  # -- contractions --------------------------------------------------------------------------------
  M("C1", CON, "      dims.append(_block(p, d_side, const_p[d_side] and d_other in other_const))",
    "      dims.append(_block(p, d_side, const_p[d_side]))",
    "dot_general: a batch dim's constancy ignores the other operand"),
  M("C2", CON, "        dims.append(None if d in other_const else (None, 1))", "        dims.append(None)",
    "dot_general: the other operand's free dims treated as constant (shift through W unmixed)"),
  M("C3", CON, "  return [p.dims[d] is None and ctx.expr_constant_along(coef, d) for d in range(rank)]",
    "  return [p.dims[d] is None for d in range(rank)]",
    "contraction: a linear shift's coefficient variation ignored"),
  M("C4", CON, "  if summed is not None and summed[0] == side and all(p.dims[d] is None for d in "
               "dd.contracting(side)):",
    "  if summed is not None and summed[0] == side:",
    "dot with ones (a mean): a shift varying along the contracted dims summed as constant"),
  M("C5", CON, "  dims = [(None, 1)] * len(out_shape)\n  if ins[1] is not None:",
    "  dims = [None] * len(out_shape)\n  if ins[1] is not None:",
    "conv: spatial/batch dims of a kernel shift treated as constant (GroupNorm over H, W fooled)"),
  M("C7", CON, "        dims[cd.out_channel] = None if cd.groups == 1 else (None, per_group)",
    "        dims[cd.out_channel] = None",
    "grouped conv: a per-group kernel shift treated as constant over all output channels"),
  # -- structural ----------------------------------------------------------------------------------
  M("S1", STR, "    if d not in bd or not D._same(in_shape[bd.index(d)], out_shape[d]):",
    "    if d not in bd:",
    "broadcast_in_dim zero-sum: a size-1 expansion along a normalized dim accepted"),
  M("S3", STR, "  return r if r is None else A.Poly(next(A._syms), r.dims, r.coeffs)", "  return r",
    "slice/broadcast: one block of a varying shift keeps the original symbol (rows 0 and 1 cancel)"),
  M("S4", STR, "  return [Need(0, freeze({perm[d]: b for d, b in spec}), transparent=True)]",
    "  return [Need(0, freeze({d: b for d, b in spec}), transparent=True)]",
    "transpose zero-sum: the permutation ignored"),
  M("S5", STR, "        steps[d] != 1 or not isinstance(b, int) or starts[d] % b):",
    "        steps[d] != 1 or not isinstance(b, int)):",
    "slice zero-sum: a slice not starting on a block boundary accepted"),
  M("S6", STR, "    elif starts[d] % e[1] == 0 and steps[d] == 1 and out_shape[d] <= e[1]:",
    "    elif steps[d] == 1 and out_shape[d] <= e[1]:",
    "slice shift: a slice straddling two blocks counted as inside one"),
  M("S7", STR, "  if len(live) == len(ins) and _all_same(live) and live[0].dims[dim] is None:",
    "  if _all_same(live) and live[0].dims[dim] is None:",
    "concatenate: shifted and unshifted pieces treated as one uniformly shifted value"),
  M("S8", STR, "  if block is not None and not all(a.shape[dim] % block == 0 for a in node.ins):",
    "  if False:",
    "concatenate zero-sum: pieces that split a normalized group accepted"),
  M("S9", STR, "  if any_padding and not ctx.is_zero(node.ins[1]):", "  if False:",
    "pad zero-sum: a non-zero padding value accepted"),
  M("S11", STR, "    if not g.full(od):\n      raise Block(\"a gather that slices part",
    "    if False:\n      raise Block(\"a gather that slices part",
    "gather zero-sum: a window over part of the normalized axis accepted"),
  M("S19", "rules/dims.py", "    if not full:\n      return None\n    block *= b", "    block *= b",
    "reshape zero-sum: non-contiguous per-dim blocks merged into one flat block"),
  # -- control flow --------------------------------------------------------------------------------
  M("K1", CTL, "    return n is None or n <= 0", "    return n is None or n < 0",
    "scan: a zero-length scan assumed to run (initial carry not checked)"),
  M("K2", CTL, "  return compat.is_while(node.eqn)\n", "  return False\n",
    "while: a loop that may run zero times assumed to run"),
  M("K3", CTL, "  for k in range(len(node.subs)):\n    body = ctx.body(node, k)",
    "  for k in range(1):\n    body = ctx.body(node, k)",
    "cond shift: only branch 0 checked"),
  M("K4", CTL, "  return [_fresh(sub.outvars[k], spec, sub) for sub in node.subs]",
    "  return [_fresh(sub.outvars[k], spec, sub) for sub in node.subs[:1]]",
    "cond zero-sum: only branch 0 checked"),
  M("K5", CTL, "        changed |= _widen_carry(seeds, binv[nc + j], q, \"a scan\")",
    "        _widen_carry(seeds, binv[nc + j], q, \"a scan\")",
    "scan shift: no fixed point (one pass over the body)"),
  M("K6", CTL, "  if pred:\n    raise Block(", "  if False:\n    raise Block(",
    "while: the shift may reach the loop condition"),
  M("K7", CTL, "    return [_fresh(operand, spec), _fresh(node.subs[k].outvars[i - nc], spec, node.subs[k])]",
    "    return [_fresh(operand, spec)]",
    "scan zero-sum: a carry's update in the body not checked (only its initial value)"),
  M("K8", CTL, "  return [_fresh(node.ins[first + j], spec), _fresh(body.outvars[j], spec, body)]",
    "  return [_fresh(node.ins[first + j], spec)]",
    "while zero-sum: a carry's update in the body not checked"),
  M("K10", CTL, "  if i < nc + ncar:  # a carry changes across iterations: only randomness is known\n"
                "    return Facts(base.const, None, random)",
    "  if i < nc + ncar:  # a carry changes across iterations: only randomness is known\n"
    "    return Facts(f.const | base.const, f.value, random)",
    "scan facts: a carry inherits its initial value's facts (a zero initial carry stays 'zero')"),
  M("K11", CTL, "    out.append(None if p is None else A.pure(p.dims))", "    out.append(p)",
    "psum: the sum of the shards' shifts taken as one shard's shift (a mean over one shard's size cancels)"),
  # -- analysis drivers ----------------------------------------------------------------------------
  M("A1", "analysis.py", "    if best is None or jnp.finfo(dt).nmant > jnp.finfo(best).nmant:",
    "    if best is None or jnp.finfo(dt).nmant < jnp.finfo(best).nmant:",
    "tolerance: the narrowest output dtype instead of the widest (output-tolerance policy weakened)"),
  M("A3", "analysis.py", "      out.append(Blocker(v, spec, \"a program input (not a parameter)\"))\n      return",
    "      return",
    "zero-sum walk: a program input (not a parameter) assumed zero-sum"),
  M("A6", "analysis.py", "    if self.an.through_dropout and self.facts(a).random:", "    if self.facts(a).random:",
    "dropout masks treated as constant without through_dropout"),
  M("A7", "analysis.py",
    "    if self.an.cbwc and node.custom_calls:\n      c = node.custom_calls[-1]\n      raise Block(",
    "    if False:\n      c = node.custom_calls[-1]\n      raise Block(",
    "CBWC: a shift enters a custom_vjp/custom_jvp function"),
  # -- planner -------------------------------------------------------------------------------------
  M("P1", "planner.py", "      if self.leaf_commit[var] == spec:\n        actions.append(CenterLeaf(var, spec))",
    "      if True:\n        actions.append(CenterLeaf(var, spec))",
    "planner: a leaf already centered over other axes reused for another spec"),
  M("P3", "planner.py",
    "    if n.use is not None and self.is_leaf(var) and (prior is not None or self.use_visible(n) is None):",
    "    if n.use is not None and self.is_leaf(var):",
    "tied weights: an untied copy taken without proving the use's own shift invisible"),
  M("P4", "planner.py", "        if n.spec and assume_aux.get(n.var) == n.spec:",
    "        if n.spec and n.var in assume_aux:",
    "planner: an auxiliary centering over other axes stands in for a blocker"),
  M("P5", "planner.py", "      if n < 2 or self.aux_visible(var, spec) is not None:", "      if n < 2:",
    "auxiliary centering chosen without proving it invisible"),
  M("P7", "planner.py", "    while not Level.at_least_as_precise(v.dtype, tol):", "    while False:",
    "auxiliary centering stored in a dtype coarser than the outputs"),
  M("P8", "planner.py", "      if reason is not None:\n        raise PlanConflict(",
    "      if False:\n        raise PlanConflict(",
    "fixed plan: centerings fixed at another shape not proved at this one"),
  M("P9", "planner.py", "      dims.append((None, b or 1))", "      dims.append((None, b) if b else None)",
    "seed: a centering's shift assumed constant along the dims it does not center (tokens, batch)"),
  # -- fold: shapes --------------------------------------------------------------------------------
  M("F1", "fold.py", "  gargs = _probe_args(call.args)", "  gargs = None",
    "fold: the generic-shapes probe (_reconcile) skipped"),
  M("F2", "fold.py", "    if not self._center and not _compatible(an, self._base):", "    if False:",
    "folded apply: another shape's plan used with the fold's parameters, unproved"),
  # -- defer_norms and fuse_affine -------------------------------------------------------------------
  M("D1", "deferral.py", "  if reader.y_dim not in f.const:\n    raise Block(", "  if False:\n    raise Block(",
    "defer: the statistic need not be constant along the contracted dim after re-indexing"),
  M("D2", "deferral.py", "           and level.facts(v).value is None and level.constant_along(v, (d,), y.shape)]",
    "           and level.facts(v).value is None]",
    "defer: a statistic varying along the normalized dim accepted"),
  M("D3", "deferral.py", "  if narrow:\n    raise Block(", "  if False:\n    raise Block(",
    "defer: contracting un-normalized values in a narrow-range dtype (overflow) accepted"),
  M("U1", "affine.py", "        if tuple(dd.contracting(k)) != (d,) or dd.lb:", "        if dd.lb:",
    "fuse: a contraction over other dims than the normalized one fused"),
  M("U2", "affine.py", "        if rule.cast is not None and not _real_cast(node):\n          raise Block(",
    "        if False:\n          raise Block(",
    "fuse: γ moved across a quantizing cast"),
  M("U3", "affine.py",
    "  if not _free_of(level, leaves, stops, rests):\n    raise Block(\"γ or β is also used elsewhere\")",
    "  pass",
    "fuse: γ or β also used elsewhere"),
]


T = "test_mutants.py::"
MASKED = ("masked: a wrong zero-sum claim, but the same change moves the centering's shift off the constants "
          "(it varies along the normalized axes), so obligation 1 refuses every centering that would rely on it; "
          "now killed by " + T)
# Verdicts on the mutants that survived the suite before this study's tests (see the report).
VERDICTS = {
  "E3": MASKED + "test_the_walk_refuses_products_quotients_and_odd_powers_that_break_a_zero_sum",
  "E4": MASKED + "test_the_walk_refuses_products_quotients_and_odd_powers_that_break_a_zero_sum",
  "E5": MASKED + "test_the_walk_refuses_products_quotients_and_odd_powers_that_break_a_zero_sum",
  "E7": "gap: " + T + "test_a_negative_power_is_not_a_shift",
  "E8": MASKED + "test_the_walk_refuses_products_quotients_and_odd_powers_that_break_a_zero_sum",
  "E9": "gap: " + T + "test_square_minus_value_sees_the_shift",
  "E10": "gap: " + T + "test_a_selection_that_mixes_features_is_not_zero_sum (cases with one shift, mixed "
         "per feature: invisible centering, wrong zero sum)",
  "E15": "gap: " + T + "test_relu_is_not_a_shift",
  "E16": "gap: " + T + "test_relu_is_not_the_identity_in_a_product",
  "E17": "gap: " + T + "test_softmax_with_an_extra_one_is_not_shift_invariant",
  "E18": "gap: " + T + "test_log_of_a_sum_of_exps_plus_one_is_not_shift_invariant",
  "R1": "equivalent: the summed shift keeps its symbol but loses the varying axis from its dims, and a shift "
        "is identified by (symbol, dims): it cancels neither the unsummed shift (whose dims vary there) nor "
        "anything else (a slice or one block of it gets a fresh symbol), so it stays visible wherever the true "
        "one is; tried: a norm over (t, d) after a centering over d, a ones-contraction mean (not a proof)",
  "R4": MASKED + "test_the_walk_refuses_rearrangements_that_break_a_zero_sum",
  "R5": "gap: " + T + "test_a_cumulative_sum_along_d_of_a_shift_varies",
  "C1": "gap: " + T + "test_batched_contraction_over_the_normalized_dim",
  "C3": "gap: " + T + "test_attention_over_exp_values_sees_the_shift",
  "C7": "gap: " + T + "test_a_grouped_convolution_splits_a_kernel_shift_by_group",
  "S5": MASKED + "test_the_walk_refuses_rearrangements_that_break_a_zero_sum",
  "S7": "gap: " + T + "test_a_concatenation_of_shifted_and_unshifted_pieces",
  "S8": MASKED + "test_the_walk_refuses_rearrangements_that_break_a_zero_sum",
  "S11": MASKED + "test_the_walk_refuses_rearrangements_that_break_a_zero_sum",
  "K6": "equivalent: a while condition returns a boolean, and every producer of a boolean from a shifted "
        "value blocks the shift first (comparisons, casts to bool, logical ops), so the condition's outputs never "
        "carry a shift and the dropped check never fires",
  "S19": MASKED + "test_the_walk_refuses_rearrangements_that_break_a_zero_sum",
  "K2": "equivalent: may_skip is asked only by the scan facets (_scan_shift, _scan_zero_sum), so its while "
        "branch is dead code today; a while loop's zero-trip case is covered because its carries' needs always "
        "include the initial value (_carry_needs) and its shift fixed point starts from it",
  "K5": "gap: " + T + "test_a_scan_carry_shift_is_a_fixed_point",
  "K10": "gap: " + T + "test_a_scan_carry_that_starts_at_zero_is_not_zero",
  "A7": "gap, and a bug of the unmutated code (fixed in program.py): " + T
        + "test_cbwc_keeps_a_custom_derivative_out_of_the_shift",
  "P4": "gap: " + T + "test_an_auxiliary_centering_over_d_does_not_serve_a_norm_over_halves",
  "P5": "gap: " + T + "test_an_auxiliary_centering_of_a_program_output",
  "D1": "equivalent (argued): fuse_affine accepts a reader only if the rules' rotate facets keep the normalized "
        "dim a single dim up to the contraction, and the statistic is checked constant along it at y; reindexing "
        "steps that keep one dim whole keep that constancy, the ones that mix it with others are refused before "
        "_chain runs (tried: a reader through a reshape merging tokens and features)",
  "U3": "equivalent (argued): _match already requires every use of γ and β to lead to y, and each reader's "
        "operand must be exactly γ ⊙ K + β with K free of them, which is what the dropped re-check in _readers "
        "asks (tried: γ also scaling a second output: no affine site is matched)",
  "C4": "equivalent: as R1, the wrongly summed shift keeps its symbol with dims constant along the contracted "
        "axes, so it never cancels the true (varying) shift; a per-token mean of any shift is constant along d "
        "anyway; tried: a ones-contraction LayerNorm after a per-half centering (still refused)",
}
MUTANTS = [m._replace(verdict=VERDICTS.get(m.id, "")) for m in MUTANTS]

# ----------------------------------------------------------------------------
# Running.


def _copy_tree(dst: str) -> None:
  ignore = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", "results", ".pytest_cache", "*.egg-info")
  for name in os.listdir(ROOT):
    src = os.path.join(ROOT, name)
    if name in (".git",):
      continue
    if os.path.isdir(src):
      shutil.copytree(src, os.path.join(dst, name), ignore=ignore)
    else:
      shutil.copy2(src, os.path.join(dst, name))


def _apply(tree: str, m: Mutant) -> Optional[tuple]:
  """(path, original text) after writing the mutant, or None when it does not apply."""
  path = os.path.join(tree, "jaxfold", "_src", m.file)
  with open(path) as f:
    text = f.read()
  if text.count(m.old) != 1:
    return None
  with open(path, "w") as f:
    f.write(text.replace(m.old, m.new))
  return path, text


def _killer(out: str) -> str:
  for line in out.splitlines():
    mm = re.match(r"(FAILED|ERROR) (\S+)", line)
    if mm:
      return mm.group(2)
  if out.strip() and "error" in out.lower().splitlines()[-1]:
    return "(collection error)"
  return "(unnamed)"


def run_one(tree: str, m: Mutant, tests: tuple, timeout: float) -> dict:
  t0 = time.time()
  applied = _apply(tree, m)
  if applied is None:
    return {"result": "no-apply", "killer": "", "seconds": 0.0}
  path, text = applied
  try:
    proc = subprocess.run([sys.executable, "-m", "pytest", *PYTEST, *tests], cwd=tree, timeout=timeout,
                          capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
      res = {"result": "survived", "killer": ""}
    elif proc.returncode in (1, 2):   # a failure, or an error collecting the tests (an import)
      res = {"result": "killed", "killer": _killer(out)}
    else:   # usage error, no tests collected, internal error: the study's fault, not a kill
      res = {"result": "error", "killer": f"pytest exit {proc.returncode}: " + out.strip()[-300:]}
  except subprocess.TimeoutExpired:
    res = {"result": "timeout", "killer": ""}
  finally:
    with open(path, "w") as f:
      f.write(text)
  res["seconds"] = round(time.time() - t0, 1)
  return res


def _load() -> dict:
  path = os.path.join(RESULTS, "mutation_study.json")
  data = {"runs": [], "before": {}, "after": {}}
  if os.path.exists(path):
    with open(path) as f:
      data.update(json.load(f))
  if "mutants" in data:   # (a run of the first version of this script: the before phase)
    data["before"].update(data.pop("mutants"))
  return data


def _commit() -> str:
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "jaxfold", "tests"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return head + (" (+ uncommitted changes)" if dirty else "")
  except OSError:
    return "?"


def _rate(rows: dict) -> tuple:
  """(killed, counted, text): kill rate over the mutants that apply and are not equivalent."""
  known = [m for m in MUTANTS if m.id in rows]
  counted = [m for m in known if rows[m.id]["result"] != "no-apply" and not m.verdict.startswith("equivalent")]
  killed = sum(rows[m.id]["result"] == "killed" for m in counted)
  counts: dict = {}
  for m in known:
    counts[rows[m.id]["result"]] = counts.get(rows[m.id]["result"], 0) + 1
  text = (f"{killed}/{len(counted)} = {killed / max(len(counted), 1):.0%} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))} of {len(known)})")
  return killed, len(counted), text


def write_report(data: dict) -> str:
  before = data["before"]
  # A mutant killed before is killed after (tests were only added): carried over unless rerun.
  after = {**{k: dict(v, carried=True) for k, v in before.items() if v["result"] == "killed"}, **data["after"]}
  equiv = [m.id for m in MUTANTS if m.verdict.startswith("equivalent")]
  lines = ["# Mutation study of jaxfold's soundness tests", "",
           "Generated by `tests/mutation_study.py`: each mutant is one hand-written soundness fault injected "
           "into a scratch copy of `jaxfold/_src`; a fixed selection of tests runs with `-x` until the first "
           "failure (the killing test). *Before*: the suite without `tests/test_jaxfold/test_mutants.py` "
           "(`--before`); *after*: with it.", ""]
  lines += [f"- {r['date']}, commit {r['commit']}: `{r['command']}` ({r['mutants']} mutants, {r['seconds']} s)"
            for r in data["runs"]]
  lines += [f"  - {h}" for h in data.get("history", [])]
  lines += ["", f"Tests: `python -m pytest {' '.join(PYTEST)} SELECTION` (timeout {data.get('timeout', '?')} s per "
            f"mutant), SELECTION = `{' '.join(TESTS)}`; for mutants of {' and '.join(FUSE_FILES)}: "
            f"`{' '.join(TESTS_FUSE)}`.", "",
            f"Kill rate, over the mutants that apply and are not equivalent ({len(equiv)} equivalent: "
            f"{', '.join(equiv) or 'none'}):", "",
            f"- before: {_rate(before)[2] if before else 'not run'}",
            f"- after: {_rate(after)[2] if data['after'] else 'not run'} (mutants killed before carried over; "
            "the equivalent ones not rerun)", "",
            "Verdicts on the mutants that survived the suite before: *gap* (a program on which the mutant "
            "folds wrongly, now a test), *masked* (the facet's claim is wrong, but obligation 1 refuses the "
            "centering in every program, so no fold is wrong: now checked on the facet itself), *equivalent* "
            "(no fault).", "",
            "| mutant | file | fault | before | after | killing test (after) | verdict |",
            "|---|---|---|---|---|---|---|"]
  for m in MUTANTS:
    b, a = before.get(m.id), after.get(m.id)
    if b is None and a is None:
      continue
    cell = lambda r: "-" if r is None else r["result"] + (" (carried)" if r.get("carried") else "")   # noqa: E731
    killer = a["killer"] if a is not None and a["result"] == "killed" else ""
    lines.append(f"| {m.id} | {m.file} | {m.what.replace('|', '/')} | {cell(b)} | {cell(a)} | "
                 f"{killer.replace('|', '/')} | {m.verdict.replace('|', '/')} |")
  text = "\n".join(lines) + "\n"
  with open(os.path.join(RESULTS, "mutation_study.md"), "w") as f:
    f.write(text)
  return text


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--only", default="", help="comma-separated mutant ids")
  ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
  ap.add_argument("--check", action="store_true", help="only check that every mutant applies")
  ap.add_argument("--report", action="store_true", help="only rewrite the markdown from the saved results")
  ap.add_argument("--tests", default="", help="comma-separated test paths instead of the fixed selection")
  ap.add_argument("--note", default="", help="a line added to the report's history")
  ap.add_argument("--no-save", action="store_true", help="print the results only (trying a new test)")
  ap.add_argument("--before", action="store_true",
                  help="without tests/test_jaxfold/test_mutants.py (the suite before this study's tests)")
  args = ap.parse_args(argv)
  ids = [m.id for m in MUTANTS]
  assert len(set(ids)) == len(ids), "duplicate mutant ids"
  chosen = [m for m in MUTANTS if not args.only or m.id in args.only.split(",")]
  if args.report:
    print(write_report(_load()))
    return 0
  def selection(m: Mutant) -> tuple:
    if args.tests:
      return tuple(args.tests.split(","))
    # (the scratch tree is this checkout as it was at the start: a test file added since is not run)
    return tuple(t for t in (TESTS_FUSE if m.file in FUSE_FILES else TESTS) if os.path.exists(os.path.join(tree, t)))
  with tempfile.TemporaryDirectory(prefix="jaxfold-mutants-") as tree:
    _copy_tree(tree)
    if args.before:
      os.remove(os.path.join(tree, "tests", "test_jaxfold", "test_mutants.py"))
    if args.check:
      bad = []
      for m in chosen:
        applied = _apply(tree, m)
        if applied is None:
          bad.append(m.id)
        else:
          with open(applied[0], "w") as f:
            f.write(applied[1])
      print(f"{len(chosen) - len(bad)} of {len(chosen)} apply" + (f"; not: {', '.join(bad)}" if bad else ""))
      return 1 if bad else 0
    data = _load()
    phase = data["before" if args.before else "after"]
    t0 = time.time()
    for m in chosen:
      res = run_one(tree, m, selection(m), args.timeout)
      phase[m.id] = res
      print(f"{m.id:4} {res['result']:9} {res['seconds']:7.1f}s  {res['killer']}", flush=True)
      if args.no_save:
        continue
      os.makedirs(RESULTS, exist_ok=True)
      with open(os.path.join(RESULTS, "mutation_study.json"), "w") as f:
        json.dump(data, f, indent=1)
  if args.no_save:
    return 0
  data["timeout"] = args.timeout
  data["runs"].append({"date": datetime.date.today().isoformat(), "commit": _commit(),
                       "command": "python tests/mutation_study.py" + (" --before" if args.before else "")
                       + (f" --only {args.only}" if args.only else ""),
                       "mutants": len(chosen), "seconds": round(time.time() - t0)})
  if args.note:
    data.setdefault("history", []).append(args.note)
  with open(os.path.join(RESULTS, "mutation_study.json"), "w") as f:
    json.dump(data, f, indent=1)
  write_report(data)
  return 0


if __name__ == "__main__":
  sys.exit(main())
