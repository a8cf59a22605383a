"""Fault injection into jaxfold: does the test suite notice?

A tool, not a test (pytest does not collect it): each mutant below is one
hand-written textual replacement in ``jaxfold/_src`` that introduces a plausible
*soundness* fault (a facet claiming more than is true, a check or Blocker
dropped, a precision policy weakened, a loop path skipped, ...). For each, the
patch is applied to a scratch copy of the tree (never this checkout), a fixed
selection of fast tests runs with ``-x`` and a timeout, and the result is
recorded: killed (some test failed, named), survived, timeout, or no-apply (the
old text is not found exactly once: the mutant is stale).

The analysis' mutants (rules, drivers, planner, fold, affine, deferral) run
TESTS or TESTS_FUSE. The rest of the library (LIB_MUTANTS: layout/host
centering, rotate and its facets, the kernel epilogue proofs, defer_norms,
export, saved-fold and artifact checks, fingerprints, serve's request
validation, CBWC and its optax transforms, the Pallas kernels in interpret
mode; files outside ``jaxfold/_src`` by their repository path) names its
selection with ``sel=``, a key of SELECTIONS: a few fast test files or test
ids of the module concerned (a ``file::test`` the scratch tree's file does
not define is skipped).

  python tests/mutation_study.py                 # every mutant, writes the report
  python tests/mutation_study.py --only E3,P4    # some mutants (merged into the saved results)
  python tests/mutation_study.py --check         # only checks that every patch applies

Results: ``benchmarks/results/mutation_study.json`` (per mutant, merged across
runs) and ``benchmarks/results/mutation_study.md`` (the table). A survivor is
either equivalent (``equivalent=`` says why the change is no fault) or a test
gap, closed by a test in ``tests/test_jaxfold/test_mutants.py`` (the analysis)
or in the test file of the module concerned (the rest of the library; such a
rerun may name the new test with ``--tests``).
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
# fold) run TESTS; mutants of fuse_affine/defer_norms (affine.py, defer_analysis.py) run TESTS_FUSE.
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
FUSE_FILES = ("affine.py", "defer_analysis.py")
# Mutants of the rest of the library (sel=...): the tests of the module each concerns, fast.
SELECTIONS = {
  "layout": ("tests/test_jaxfold/test_layout.py", "tests/test_jaxfold/test_centering.py",
             "tests/test_multihost.py::test_fold_of_params_sharded_over_two_devices"),
  "rotate": ("tests/test_jaxfold/test_rotate.py", "tests/test_jaxfold/test_adversarial_rotate.py"),
  "kernels": (*(f"tests/test_jaxfold/test_adversarial.py::test_fold_exact[rc9_kernel_{n}]" for n in (
                  "near_cancel_mean", "bessel_var", "rsqrt_4var", "eps_outside_sqrt", "beta_before_gamma",
                  "large_eps", "inv_std_output")),
              "tests/test_jaxfold/test_kernels.py"),
  "defer": ("tests/test_jaxfold/test_defer.py",),
  "export": ("tests/test_deploy_safety.py::test_signed_artifacts",
             *(f"tests/test_integrity.py::{t}" for t in (
                 "test_damaged_artifacts", "test_newer_artifact_format_is_refused",
                 "test_raw_serialization_needs_verify_false_and_junk_still_fails")),
             "tests/test_jaxfold/test_adversarial_export.py", "tests/test_artifact.py"),
  "save": ("tests/test_deploy_safety.py::test_load_with_another_program_says_what_differs",
           "tests/test_saved_fold.py::test_refuses_non_empty_dir_and_wrong_model",
           *(f"tests/test_jaxfold/test_transform_results.py::{t}" for t in (
               "test_load_refuses_another_program", "test_load_refuses_a_chain_the_analysis_does_not_reproduce")),
           "tests/test_integrity.py::test_newer_format_is_refused"),
  "integrity": ("tests/test_deploy_safety.py::test_signed_folds", "tests/test_integrity.py"),
  "fingerprint": ("tests/test_jaxfold/test_fingerprint.py",
                  "tests/test_deploy_safety.py::test_load_with_another_program_says_what_differs"),
  "serve": ("tests/test_serve.py", "tests/test_serve_hardening.py"),
  "cbwc": ("tests/test_cbwc.py",),
  "pallas": ("tests/test_pallas_kernels/test_rms_norm.py", "tests/test_pallas_kernels/test_rms_matmul.py"),
}
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
  sel: str = ""        # the test selection (a key of SELECTIONS); "" for the analysis' own (TESTS/TESTS_FUSE)


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
  M("S1", STR, "    if d not in bd or not D.same(in_shape[bd.index(d)], out_shape[d]):",
    "    if d not in bd:",
    "broadcast_in_dim zero-sum: a size-1 expansion along a normalized dim accepted"),
  M("S3", STR, "  return r if r is None else A.Poly(A.fresh_symbol(), r.dims, r.coeffs)", "  return r",
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
  M("K11", CTL, "    else:\n      out.append(A.pure(p.dims))\n  return out",
    "    else:\n      out.append(p)\n  return out",
    "psum: the sum of the shards' shifts taken as one shard's shift (a mean over one shard's size cancels)"),
  M("K12", CTL, "    elif n is not None and A.replicated(p, axes):", "    elif n is not None:",
    "psum: a shift that differs across shards taken as n times one shard's (a psum mean cancels it)"),
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
  M("D1", "defer_analysis.py", "  if reader.y_dim not in f.const:\n    raise Block(", "  if False:\n    raise Block(",
    "defer: the statistic need not be constant along the contracted dim after re-indexing"),
  M("D2", "defer_analysis.py",
    "           and level.facts(v).value is None and level.constant_along(v, (d,), y.shape)]",
    "           and level.facts(v).value is None]",
    "defer: a statistic varying along the normalized dim accepted"),
  M("D3", "defer_analysis.py", "  if narrow:\n    raise Block(", "  if False:\n    raise Block(",
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


# -- the library outside the analysis: centering, rotate, kernels, export, saving, serving, CBWC, Pallas ---
# (run with the selection named by sel=, see SELECTIONS)
LAY, ROT, KER, EXP, SER, INT, FP = ("layout.py", "rotate.py", "kernels.py", "artifact.py", "saved_fold.py",
                                    "integrity.py", "fingerprint.py")
RRO, SRV, OPT = "rules/rotation.py", "server/model.py", "jaxfold/optax_transforms.py"
PRN, PRM = "pallas_kernels/rms_norm.py", "pallas_kernels/rms_matmul.py"
LIB_MUTANTS = [
  # -- layout.center and the fold's host centering ------------------------------------------------------
  M("L1", LAY, "      split.append(n // b)\n    split.append(n if b is None else b)",
    "      split.append(b)\n    split.append(n if b is None else n // b)",
    "center: a block of b consecutive elements read as b strided ones (groups interleaved)", sel="layout"),
  M("L2", LAY, "      axes.append(len(split) - 1)", "      axes.append(len(split) - 2)",
    "center: the mean taken over the block index instead of within each block", sel="layout"),
  M("L3", LAY, "    m = z.mean(axis=axes, dtype=np.float32 if fast else np.float64",
    "    m = z.mean(axis=axes, dtype=np.float32 if pairwise else np.float64",
    "host center: any table (float64, several axes) takes the float32 mean when pairwise", sel="layout"),
  M("L4", LAY, "      y = (z.astype(np.float32) - m.astype(np.float32)).astype(dtype)",
    "      y = z - m.astype(dtype)",
    "host center: bfloat16/float16 subtracts a rounded mean (rounds twice)", sel="layout"),
  M("L5", LAY, "        dest[...] = y\n", "",
    "host center: a low-precision row block is not written into the shared output", sel="layout"),
  M("L6", LAY, "  acc = jnp.promote_types(dtype, jnp.float32)", "  acc = dtype",
    "jax center (CBWC, sharded leaves): bfloat16 mean accumulated in bfloat16", sel="layout"),
  M("L7", LAY, "  z = z - z.mean(axis=axes, keepdims=True)", "  z = z - z.mean(axis=axes[:1], keepdims=True)",
    "jax center: a spec over several dims centered along the first only", sel="layout"),
  M("L8", "centering.py", "or workers < 2 or 0 in spec or x.ndim < 2", "or workers < 2 or x.ndim < 2",
    "fold: row blocks split along a centered dim 0 (each block centered by its own mean)", sel="layout"),
  M("L9", "centering.py", "                        for a, b in zip(cuts[:-1], cuts[1:])])",
    "                        for a, b in zip(cuts[:-2], cuts[1:-1])])",
    "fold: the last row block of a large leaf is never centered (left uninitialised)", sel="layout"),
  M("L10", "centering.py", "  return jax.device_put(y, sharding)\n",
    "  return jnp.asarray(y)\n", "fold: a centered leaf loses its sharding (placed on the default device)",
    sel="layout"),
  M("L11", "centering.py", "  return _center_jit_cached(tuple(sorted(spec.items())))",
    "  return _center_jit_cached(tuple(sorted(spec.items()))[:1])",
    "fold: a device-resident leaf centered along its first spec dim only", sel="layout"),
  # -- rotate and the rotation facets --------------------------------------------------------------------
  M("T1", ROT, "      if o in prog.output_positions:\n        return f\"the rotation reaches program output",
    "      if False:\n        return f\"the rotation reaches program output",
    "rotate: a rotated value may be a program output", sel="rotate"),
  M("T2", ROT, "    if key != self._key:\n      raise RotateError(", "    if False:\n      raise RotateError(",
    "rotate: inputs of another shape that rotate other parameters run with these parameters", sel="rotate"),
  M("T3", ROT, "        seeds.setdefault(i, set()).update(dims)", "        seeds[i] = set(dims)",
    "rotate: a parameter asked to rotate along a second dim (a square W reading and writing the stream) "
    "keeps the last only", sel="rotate"),
  M("T4", ROT, "    if (view.offset // ls) % nk:\n      return None", "    if False:\n      return None",
    "rotate: a parameter view starting inside the rotated dim treated as the whole dim", sel="rotate"),
  M("T5", RRO, "  if not ctx.constant_along(other, _dims_of(s), out_shape):\n    raise Block(\"a rotated value is "
    "multiplied", "  if False:\n    raise Block(\"a rotated value is multiplied",
    "rotation mul: a factor varying along the rotated dim (an unfused γ) passes", sel="rotate"),
  M("T6", RRO, "  if s.dims & axes:\n    raise Block(", "  if False:\n    raise Block(",
    "rotation reduce_sum: a sum over the rotated dim of a rotated value passes", sel="rotate"),
  M("T7", RRO, "    if s is None and not _zero(ctx, node.ins[k]):\n      if isinstance(state, Lin)",
    "    if False:\n      if isinstance(state, Lin)",
    "rotation add: an unrotated value added to the rotated stream", sel="rotate"),
  M("T8", RRO, "  if isinstance(s, Lin) and len(s.dims) == 1 and y == 2:",
    "  if isinstance(s, Lin) and len(s.dims) == 1 and y % 2 == 0:",
    "rotation integer_pow: x⁴ treated as a sum of squares", sel="rotate"),
  M("T9", RRO, "  if any(node.ins[0].shape[d] != node.outs[0].shape[d] for d in dims):\n    raise Block(\"a slice",
    "  if False:\n    raise Block(\"a slice", "rotation slice: a slice of the rotated dim keeps the rotation",
    sel="rotate"),
  # -- kernels: the epilogue proofs ----------------------------------------------------------------------
  M("N1", KER, "            elif C == _formula(X, shape, eps, gamma, beta):", "            else:",
    "epilogue: a matched shape accepted without the exact formula (1/n, ε placement, extra scale)",
    sel="kernels"),
  M("N2", KER, "  if any(a.key in changed for a in aliases[1:]):", "  if False:",
    "epilogue: the kernel reads the source although a widening of it is changed (auxiliary centering)",
    sel="kernels"),
  M("N3", KER, "  return aliases[0] if _precise(aliases[0].dtype, out_dtype) else None", "  return aliases[0]",
    "epilogue: a norm whose output is wider than the source computed from the narrow source", sel="kernels"),
  M("N4", KER, "            elif np.dtype(inp.dtype) not in _KERNEL_DTYPES:", "            elif False:",
    "epilogue: a float64 norm run by the float32 kernel", sel="kernels"),
  M("N5", KER, "  if v.strides[-1] != 1 or any(", "  if abs(v.strides[-1]) != 1 or any(",
    "epilogue: a reversed γ/β view (stride -1) passed to the kernel as stored", sel="kernels"),
  M("N6", KER, "      ok = level.canon(src) == A.add(Ea, Eb)", "      ok = True",
    "fused add: any two-operand equation (a - b, a * b) fused as a residual add", sel="kernels"),
  M("N7", KER, "      if C != _formula(X, shape, m[0], None, None):\n        return None",
    "      if False:\n        return None",
    "rms_read (deferred matmul kernel): the exact formula check dropped", sel="defer"),
  M("N8", "defer.py", "  if not an.fuses_like(fused):", "  if False:",
    "defer_norms: example inputs that fuse differently from the fused model accepted", sel="defer"),
  # -- export ----------------------------------------------------------------------------------------------
  M("X1", EXP, "names[i] is None or s[i] != ref[i] else names[i]", "names[i] is None else names[i]",
    "export: every leading axis named symbolic whatever its size (a position table, a raw key)",
    sel="export"),
  M("X2", EXP, "    if attempt and undecided:", "    if False and undecided:",
    "export: a Python comparison of symbolic sizes (decided once for all sizes) accepted", sel="export"),
  M("X3", EXP, "  for size in (lambda n: n, lambda n: 1, lambda n: n + 1):", "  for size in (lambda n: n,):",
    "export check: the symbolic program is not run at other sizes (size 1, one larger)", sel="export"),
  M("X4", EXP, "    if not (np.array_equal(fg, fw) and", "    if not (True or",
    "export check: NaN/inf where the program is finite counts as no difference", sel="export"),
  M("X5", EXP, "  if hashlib.sha256(program).hexdigest() != header.get(\"payload_sha256\"):",
    "  if False:", "load_exported: the program's SHA-256 is not checked", sel="export"),
  M("X6", EXP, "  mac = header.get(\"hmac_sha256\")\n  if mac is None:\n    raise",
    "  mac = header.get(\"hmac_sha256\")\n  if mac is None:\n    return\n    raise",
    "load_exported(key=...): an unsigned artifact accepted", sel="export"),
  M("X7", EXP, "    if hashlib.sha256(chunk).hexdigest() != t[\"sha256\"]:", "    if False:",
    "load_exported: a bundled parameter tensor's SHA-256 is not checked", sel="export"),
  # -- saved folds: integrity, format and analysis-key checks, fingerprints -----------------------------------
  M("V1", "affine.py", "    if ctx.verify and (not ctx.same_key(an.key, parsed.key_sha256)\n                       or ",
    "    if ctx.verify and (", "load_fold: a fuse_affine step's analysis key not compared", sel="save"),
  M("V2", ROT, "    if ctx.verify and key != tuple(sorted((ctx.leaf(i), d) for i, d in parsed.rotated)):",
    "    if False:",
    "load_fold: a rotation that rotates other parameters now accepted", sel="save"),
  M("V3", SER, "    if got != want or bool(refold.params.extras)", "    if bool(refold.params.extras)",
    "load_fold: the re-analysed fold's sites not compared with the saved ones", sel="save"),
  M("V4", SER, "  if saved.get(\"jax_version\") != jax.__version__:", "  if True:",
    "load_fold: another program only warned about (as if saved by another jax)", sel="save"),
  M("V5", SER, "  if not isinstance(version, int) or version > FORMAT_VERSION:",
    "  if not isinstance(version, int) or version > FORMAT_VERSION + 1:",
    "load_fold: a format newer than this jaxfold reads accepted", sel="save"),
  M("V6", INT, "  if h.hexdigest() != want.get(\"sha256\"):", "  if False:",
    "integrity: a copied file's SHA-256 not checked (only its size)", sel="integrity"),
  M("V7", INT, "  if not hmac_matches(key, raw_manifest, mac):", "  if mac is None:",
    "integrity: a signature present is accepted whatever it is", sel="integrity"),
  M("V8", FP, "    return f\"{k}={_ADDR.sub('', repr(v))[:200]}\"", "    return f\"{k}=\"",
    "fingerprint: primitive parameters dropped (x**2 and x**3, other axes look alike)", sel="fingerprint"),
  M("V9", FP, "      return f\"lit({_ADDR.sub('', repr(getattr(val, 'tolist', lambda: val)()))[:60]})\"",
    "      return \"lit\"", "fingerprint: literal values dropped (apply(p, x) * 2 and * 3 look alike)",
    sel="fingerprint"),
  M("V10", FP, "      ins = \", \".join(f\"{self.name(v)}:{_aval(v)}\" for v in eqn.invars)",
    "      ins = \", \".join(f\"{_aval(v)}\" for v in eqn.invars)",
    "fingerprint: which values flow where dropped (x - y and y - x look alike)", sel="fingerprint"),
  # -- serve: request validation -------------------------------------------------------------------------
  M("W1", SRV, "        if lo < low or hi >= high:", "        if lo < low or hi > high:",
    "serve: an id equal to the vocabulary size accepted (gather clamps it: a wrong answer)", sel="serve"),
  M("W2", SRV, "    if seq is not None and self.max_seq and seq > self.max_seq:",
    "    if seq is not None and self.max_seq and seq > self.max_seq + 1:",
    "serve: a sequence one longer than the position table accepted", sel="serve"),
  M("W3", SRV, "        elif sizes.setdefault(d, arr.shape[k]) != arr.shape[k]:", "        elif False:",
    "serve: inputs that disagree on a shared symbolic dim accepted", sel="serve"),
  # -- CBWC and its optax transforms ----------------------------------------------------------------------
  M("B1", "fold.py", "      leaves = [layout.center(x, dict(specs[i])) if i in specs else x",
    "      leaves = [x - jax.lax.stop_gradient(x - layout.center(x, dict(specs[i]))) if i in specs else x",
    "cbwc: the centering's gradient not projected (straight-through: the forward is P·W, the gradient is not)",
    sel="cbwc"),
  M("B2", OPT, "  if expected_tree is None:      # leaf indices only", "  if True:      # leaf indices only",
    "optax: leaves matched by index even for a masked subtree (the wrong leaves centered)", sel="cbwc"),
  M("B3", OPT, "    v = params if by_index else center(params)", "    v = params",
    "decay_centered_weights: decays W instead of V = P·W", sel="cbwc"),
  # -- Pallas kernels (interpret mode) ----------------------------------------------------------------------
  M("Q1", PRN, "  return jnp.promote_types(dtype, _F32)", "  return jnp.dtype(dtype)",
    "rms_norm: accumulation in the input dtype (bfloat16), reference and kernel alike", sel="pallas"),
  M("Q2", PRN, "  rstd = lax.rsqrt(jnp.sum(x * x, axis=1) / n_cols + eps)",
    "  rstd = lax.rsqrt((jnp.sum(x * x, axis=1) + eps) / n_cols)",
    "rms_norm kernel: ε added before the division by n (ε/n)", sel="pallas"),
  M("Q3", PRN, "  rstd = lax.rsqrt(jnp.sum(x * x, axis=1) / n_cols + eps)",
    "  rstd = lax.rsqrt(jnp.sum(x * x, axis=1) / hp + eps)",
    "rms_norm kernel: the mean square over the padded width (ragged hidden)", sel="pallas"),
  M("Q4", PRN, "  col_ok = jnp.arange(hp) < n_cols", "  col_ok = jnp.arange(hp) <= n_cols",
    "rms_norm kernel: one column past a ragged hidden read and written", sel="pallas"),
  M("Q5", PRN, "    dx = (g - xhat * c[:, None]) * rstd[:, None]", "    dx = g * rstd[:, None]",
    "rms_norm backward: the rstd term of dx dropped", sel="pallas"),
  M("Q6", PRN, "    _store(h_ref, h, mask)\n    x = h.astype(acc_dt)",
    "    _store(h_ref, h, mask)\n    x = x + _load(r_ref, mask).astype(acc_dt)",
    "add_rms_norm kernel: normalizes the unrounded sum, not the h it writes", sel="pallas"),
  M("Q7", PRM, "    k_ok = t * bk + jnp.arange(bk) < k", "    k_ok = t * bk + jnp.arange(bk) <= k",
    "rms_matmul: one element past a ragged K read", sel="pallas"),
  M("Q8", PRM, "  out = out * lax.rsqrt(ss / k + st.eps)[:, None]",
    "  out = out * lax.rsqrt(ss / (pl.cdiv(k, bk) * bk) + st.eps)[:, None]",
    "rms_matmul: the mean square over the padded K", sel="pallas"),
]
MUTANTS += LIB_MUTANTS


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
  "K11": "gap: tests/test_jaxfold/test_adversarial_spellings.py::test_shard_map_four_devices[a mean per shard and "
         "psum over one shard's size] (the psum rules' replicated branch came before: only a shift that differs "
         "across shards, a per-shard centering, reaches the dropped line)",
  "K12": "gap: tests/test_jaxfold/test_adversarial_spellings.py::test_shard_map_four_devices[a mean per shard and "
         "a psum mean of one h]",
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
# The library outside the analysis: each gap closed by a test in the test file of the module concerned.
TJ = "tests/test_jaxfold/"
VERDICTS.update({
  "L4": "gap: " + TJ + "test_layout.py::test_half_precision_center_subtracts_in_float32_and_rounds_once (the "
        "old test allowed 8 ulp: bit for bit now)",
  "L6": "gap: " + TJ + "test_layout.py::test_half_precision_center_subtracts_in_float32_and_rounds_once (the "
        "jax path, which CBWC's forward pass and device leaves take, was only checked for its dtype)",
  "L10": "gap: tests/test_multihost.py::test_fold_of_params_sharded_over_two_devices (parameters on the second "
         "of two devices: every sharded case went through jit, which keeps the sharding anyway)",
  "L11": "gap: " + TJ + "test_centering.py::test_centered_leaves_equal_host_centering_and_keep_dtype_and_sharding "
         "(a spec over two dims under jax)",
  "T1": "gap: " + TJ + "test_rotate.py::test_rotated_stream_as_an_output_refused (the stream, or a slice of it, "
        "returned beside the logits would come back rotated)",
  "T2": "gap: " + TJ + "test_rotate.py::test_inputs_that_rotate_other_parameters_are_refused (a shape branch "
        "that adds an unrotated bias to the rotated stream)",
  "T3": "gap: " + TJ + "test_adversarial_rotate.py (square_reads_and_writes rotates along both dims); "
        "no wrong result: _propagate proves every output from the final seeds, a parameter whose seeds "
        "flip-flop ends in 'did not settle'",
  "X3": "gap: " + TJ + "test_adversarial_export.py::"
        "test_a_size_decided_without_a_comparison_is_caught_by_the_size_probes "
        "(a size looked up in a dict makes no symbolic `==`, so only the size probes see the branch)",
  "X4": "gap: " + TJ + "test_adversarial_export.py::test_max_rel_diff_counts_a_non_finite_mismatch_as_a_difference",
  "T4": "equivalent: _leaf_dims only proposes which dims of a parameter a Want rotates; a rotation is accepted "
        "only once _propagate, from the parameters themselves through every equation's rotate facet, proves "
        "every output unchanged, so a wrong proposal (a view starting inside the dim) ends in a refusal "
        "(a reshape/slice facet blocks), never in a wrong result",
  "T8": "gap: " + TJ + "test_rotate.py::test_rotation_refused_where_it_does_not_commute[fourth-power statistic]",
  "T9": "gap: " + TJ + "test_rotate.py::test_rotation_refused_where_it_does_not_commute[statistic of half of d]",
  "N1": "gap: " + TJ + "test_kernels.py::test_kernel_epilogue_near_misses_in_float32 (the rc9 adversarial "
        "kernel programs run in float64, where no kernel runs: they could not notice a wrong epilogue proof)",
  "N2": "gap: " + TJ + "test_kernels.py::test_a_centered_widening_of_the_source_is_what_the_kernel_reads "
        "(a bf16 input widened to float32 and centered there by an auxiliary centering: the kernel read the "
        "uncentered bf16 source, 0.54 off)",
  "N3": "gap: " + TJ + "test_kernels.py::test_a_norm_wider_than_its_source_keeps_xla (a float32 stream "
        "normalized in float64 after its centering: the kernel read the float32 source, 8e-8 off XLA)",
  "N4": "equivalent: a float64 norm given to the kernel computes in float64 in interpret mode (_acc promotes "
        "to float64), and compiled (interpret=False) pallas_kernels' dispatch sends float64 to the XLA "
        "reference (unsupported_reason): the same formula either way",
  "N5": "equivalent: a reversed (hidden,) view of a vector starts at offset hidden-1, which _vector_param's "
        "offset check refuses anyway (a stride -1 view at offset 0 has size 1); "
        + TJ + "test_kernels.py::test_a_reversed_gamma_or_beta_keeps_xla pins the exact fold",
  "Q2": "gap: tests/test_pallas_kernels/test_rms_norm.py::test_a_large_eps_is_added_to_the_mean_square (every "
        "test used ε ≤ 1e-5, where ε/n and ε agree to the tolerance)",
  "Q6": "gap: tests/test_pallas_kernels/test_rms_norm.py::test_fused_add_normalizes_the_rounded_sum_it_writes "
        "(bf16/f16: y against the float64 formula of the rounded h where β cancels it: 778 ulps off)",
  "V8": "gap: " + TJ + "test_fingerprint.py::test_same_operations_other_parameters_constants_or_wiring_differ",
  "V9": "gap: " + TJ + "test_fingerprint.py::test_same_operations_other_parameters_constants_or_wiring_differ",
  "V10": "gap: " + TJ + "test_fingerprint.py::test_same_operations_other_parameters_constants_or_wiring_differ",
  "V1": "gap: " + TJ + "test_transform_results.py::test_load_refuses_a_chain_the_analysis_does_not_reproduce"
        "[fused]",
  "V2": "gap: " + TJ + "test_transform_results.py::test_load_refuses_a_chain_the_analysis_does_not_reproduce"
        "[rotated]",
  "V3": "gap: tests/test_saved_fold.py::test_refuses_non_empty_dir_and_wrong_model (without program.json "
        "the per-site comparison is what refuses another model; it was never reached)",
})
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


def _present(tree: str, test: str) -> bool:
  """A selected file, or ``file::test`` whose test function the file defines (a test added since is not run)."""
  path, _, name = test.partition("::")
  path = os.path.join(tree, path)
  if not os.path.exists(path):
    return False
  if os.path.isdir(path):   # a directory of test files (tests/test_jaxfold/rules/)
    return True
  with open(path) as f:
    return not name or f"def {name.split('[')[0]}(" in f.read()


def _file_path(file: str) -> tuple:
  """A mutant's file under the tree: ``jaxfold/...`` and ``pallas_kernels/...`` as written, else under jaxfold/_src."""
  return tuple(file.split("/")) if file.split("/")[0] in ("jaxfold", "pallas_kernels") else (
      "jaxfold", "_src", *file.split("/"))


def _apply(tree: str, m: Mutant) -> Optional[tuple]:
  """(path, original text) after writing the mutant, or None when it does not apply."""
  path = os.path.join(tree, *_file_path(m.file))
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
           "into a scratch copy of `jaxfold/_src` (or `pallas_kernels/`, `jaxfold/optax_transforms.py`); a fixed "
           "selection of tests runs with `-x` until the first "
           "failure (the killing test). *Before*: the suite without `tests/test_jaxfold/test_mutants.py` "
           "(`--before`) and the tests added for this study's survivors; *after*: with them (a library "
           "mutant's rerun may run only its new test: see the command).", ""]
  lines += [f"- {r['date']}, commit {r['commit']}: `{r['command']}` ({r['mutants']} mutants, {r['seconds']} s)"
            for r in data["runs"]]
  lines += [f"  - {h}" for h in data.get("history", [])]
  lines += ["", f"Tests: `python -m pytest {' '.join(PYTEST)} SELECTION` (timeout {data.get('timeout', '?')} s per "
            f"mutant), SELECTION = `{' '.join(TESTS)}`; for mutants of {' and '.join(FUSE_FILES)}: "
            f"`{' '.join(TESTS_FUSE)}`; for the mutants of the rest of the library, by their group (sel): "
            + "; ".join(f"{k}: `{' '.join(v)}`" for k, v in SELECTIONS.items()) + ".", "",
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
    tests = SELECTIONS[m.sel] if m.sel else TESTS_FUSE if m.file in FUSE_FILES else TESTS
    return tuple(t for t in tests if _present(tree, t))
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
                       + (f" --only {args.only}" if args.only else "")
                       + (f" --tests {args.tests}" if args.tests else ""),
                       "mutants": len(chosen), "seconds": round(time.time() - t0)})
  if args.note:
    data.setdefault("history", []).append(args.note)
  with open(os.path.join(RESULTS, "mutation_study.json"), "w") as f:
    json.dump(data, f, indent=1)
  write_report(data)
  return 0


if __name__ == "__main__":
  sys.exit(main())
