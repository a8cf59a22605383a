"""Deferred normalization (FlashNorm, Graef et al. 2024) on a fused program:
the analysis (run inside ``affine.analyse(..., defer=True)``) and the rewrite
(``run``, called by ``rewrite.evaluate``); the front end ``defer_norms`` is in
``defer.py``.

After ``fuse_affine`` a folded norm's output is ``y = γ ⊙ x ⊙ s + β`` with
``s`` a per-row statistic (``rsqrt(mean(x²) + ε)``), γ and β constants (1 and
0) at run time, and every use of ``y`` a contraction over the normalized dim
d against a weight that already holds γ (``W' = diag(γ)·W``, a bias ``β·W``
added to its output). Since ``s`` is constant along d,

    Σ_d (x_d · s) · W'_d  =  s · Σ_d x_d · W'_d

row by row: each reader contracts ``x`` itself and scales its output by ``s``
*before* the bias ``β·W`` is added (the bias must not be scaled). The
normalized tensor is then dead code.

Proof obligations, each checked on the traced folded program (the one
``fuse_affine`` analysed), per reader:

* ``y``'s exact canonical form, with ``x`` and ``s`` as opaque atoms, is
  ``γ_d · x · s + β_d`` (or ``γ_d · x · s⁻¹ + β_d``: ``x / sqrt(var + ε)``;
  γ, β this site's parameter vectors along d), and no operation between
  ``{x, s, γ, β}`` and ``y`` is changed by the fused plan (so the identity
  still holds at run time, where γ = 1 and β = 0);
* ``s`` is constant along d (the analysis's facts, not its shape);
* the reader's operand is ``y`` seen through single-operand re-indexing steps
  (reshape, transpose, broadcast, squeeze, slice, rev, copy, dtype converts),
  which commute with the elementwise product, and ``s`` pushed through the
  same steps is constant along the contracted dim (the rules' facts facets);
* ``x``, ``s`` and the reader are not separated by a remat boundary (the
  rewrite cannot see values across one);
* every float dtype the deferred reader computes in (``x``'s casts, its
  operand, its output) has at least float32's exponent range, and ``x``'s
  (``_check_range``): ``x @ W`` is ``rms(x)`` times the normalized product and
  overflows a float16 where the original does not.

Anything else keeps the site as fused (normalized) and the report names the
reader and the reason.

The RMS-matmul kernel. Where the fold's ``norm_impl`` may run kernels, a
deferred reader also runs as ``pallas_kernels.rms_matmul`` (one launch: the
GEMM accumulates Σx² of its own rows and scales its output tile, so neither
the statistic's reduction nor the normalized tensor is computed) when,
besides the above:

* it reads ``y`` through dtype converts only, as the left operand of a
  matmul contracting its last axis (the normalized dim) with a 2-D weight
  (``(K, N)`` or ``(N, K)``), no batch dims, operands of one float dtype;
* ``y``'s exact canonical form, with the fused γ = 1 and β = 0 and every
  fused reader's output opaque, is ``x · rsqrt(Σ_d x²/n + ε)`` over exactly
  that axis (``kernels.prove_rms_read``: the same 1/n, ε placement and no
  other scale), which gives the kernel its ε; ``x`` is read as its source
  (the value it exactly widens, a bf16 stream) and cast to the weight's
  dtype for the dot, as the XLA form contracts ``chain(x)``.

Otherwise the reader keeps the XLA form ``(chain(x) @ W') · s``.

The reader's own bias. A linear layer adds its bias right after the
contraction (``t = z + b``, GPT-2's ``c_attn``): as a separate equation, which
XLA fuses into its own GEMM's epilogue but cannot fuse into the opaque kernel
(on the A100 it became one more launch per layer, the bias add fused with the
slice of q). The kernel adds it in its epilogue, next to the fused ``β·W``
(``t = s · (x @ W') + β·W + b``, the same value in real arithmetic, rounded
once), when, besides the kernel's own proof:

* ``t`` is an ``add`` of the reader's output ``z`` (either operand) and an
  operand ``o`` of ``t``'s rank, last dim and dtype, and ``z`` has no other
  use (no other equation and no program output reads it), ``t`` has ``z``'s
  shape (``z`` is not broadcast), and the add is in the reader's level of the
  program (the rewrite holds ``z`` until the add);
* ``o`` (broadcast to ``t``) is constant along every dim but the last (the
  analysis's facts, not a random value's): one value per output column, so
  ``o[0, ..., 0, :]`` is the vector the kernel adds;
* no operation between the program's inputs and ``o`` is changed by the
  fused plan (the facts hold at run time).

Otherwise the add stays an equation of its own.

Sibling readers. A norm read by several matmuls (separate q, k, v; Phi's
parallel attention and MLP inputs) runs them as ONE launch of
``pallas_kernels.rms_matmul_group`` (the column grid is the weights' tiles one
after another; each program computes its own weight's tile exactly as the
single kernel does, and no weight is copied or concatenated), when every
reader is proved for the kernel on its own (above), their weights are read in
one layout (none transposed) and have one dtype, they are at one level of the
program, and every weight is an input or a captured constant of the program
(or fuse's untied copy of one), or dtype conversions and re-indexing steps
of one that the fused plan does not change (mixed precision: float32
parameters, bfloat16 matmuls): the first reader (the leader) runs the launch,
so each weight must be known there (it applies those steps itself). Their own biases stay adds. Otherwise each
keeps XLA's deferred form, whose GEMMs XLA merges into one launch, which one
kernel call per reader could not join.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfold._src import algebra as A
from jaxfold._src import compat, kernels
from jaxfold._src.analysis import factor_leaf, vector_along
from jaxfold._src.program import Val, upstream
from jaxfold._src.report import param_label
from jaxfold._src.rules import Block, rule_for
from jaxfold._src.rules.base import Facts
from jaxfold._src.rules.control import REMAT
from jaxfold._src.zero import Zero


@dataclasses.dataclass(frozen=True)
class DeferSite:
  """One fused norm site and whether its readers read the un-normalized input."""
  where: str
  readers: tuple          # parameter names of the contractions reading it
  deferred: bool
  reason: str


class GroupMember(NamedTuple):
  """One reader of a sibling group's launch: the reader's path, the key of the
  value its weight is made from (an input or captured constant of the
  program), the reader's output dtype, and the dtype conversions (equations)
  from that value to the weight the reader reads (mixed precision: the
  parameters in float32, the matmul in bfloat16) or re-indexing steps."""
  path: tuple
  w: tuple
  dtype: str
  convert: tuple = ()


@dataclasses.dataclass(frozen=True)
class RmsRead:
  """A deferred reader the RMS-matmul kernel may compute: it reads ``x`` (a
  value key: the norm's input or the value it exactly widens) and ``eps``."""
  x: tuple
  eps: float
  w_nk: bool               # the weight is (N, K): contracted on its dim 1
  w_t: bool = False        # the weight is a transpose: the kernel reads it untransposed
  add: Optional[tuple] = None   # (path of the add of the reader's own bias, its operand index)
  group: tuple = ()        # sibling readers in one launch: GroupMember, ..., leader first


@dataclasses.dataclass(frozen=True)
class Deferred:
  """A rewrite entry: the contraction at ``path`` reads ``x`` (operand
  ``operand``) through ``chain`` and its output is scaled by ``s``."""
  path: tuple              # the dot_general's path
  operand: int             # which operand reads the normalized value
  x: tuple                 # key of x
  s: tuple                 # key of the statistic
  shape: tuple             # y's shape (s broadcasts to it)
  chain: tuple             # re-indexing equations from y to the operand, y first
  dim: int                 # the contracted dim at the operand
  invert: bool = False     # the norm divides by s (x / s)
  kernel: Optional[RmsRead] = None   # proved for pallas_kernels.rms_matmul


# Single-operand steps that only move or convert elements (the rules'
# ``reindex`` role): they commute with an elementwise product, so
# chain(x ⊙ s) = chain(x) ⊙ chain(s).
_REINDEX = ("move", "convert")
_CONE_DEPTH = 8


def _leaf_vector(level, fid: int, leaf: int, dim: int, shape: tuple) -> bool:
  lv = factor_leaf(fid, level)
  return lv is not None and lv[0] == leaf and vector_along(lv[1], shape) == dim


def _is_form(level, y, aff, x, s, invert: bool) -> bool:
  """canon(y) == γ_d · x · s + β_d (``1/s`` with ``invert``) exactly, x and s opaque."""
  e = level.canon(y)
  rest = dict(e.terms)
  if aff.beta is not None:
    betas = [m for m, c in rest.items()
             if len(m) == 1 and c == 1 and _leaf_vector(level, m[0], aff.beta, aff.dim, y.shape)]
    if len(betas) != 1:
      return False
    del rest[betas[0]]
  if len(rest) != 1:
    return False
  ((m, c),) = rest.items()
  gammas = [f for f in m if _leaf_vector(level, f, aff.gamma, aff.dim, y.shape)]
  if c != 1 or len(gammas) != 1 or m.count(gammas[0]) != 1:
    return False
  sv = A.inv(level.atom(s), s.shape) if invert else level.atom(s)
  want = A.mul(A.mul(A.single(gammas[0]), level.atom(x)), sv)
  return want.terms == {m: c}


def _statistic(level, aff) -> tuple:
  """``(x, s, invert)`` with ``y = γ ⊙ x ⊙ s + β`` (``x / s`` with ``invert``)
  and ``s`` constant along d; raises Block."""
  y, d = aff.y, aff.dim
  # The cone: values within _CONE_DEPTH producers of y; its last layer bounds it.
  layers = upstream(y, _CONE_DEPTH)
  order, boundary = [v for layer in layers for v in layer], layers[-1]
  # Only factors of a product or quotient can be x and s (a search, not a
  # proof: the canonical check below decides).
  ops: dict = {}
  for v in order:
    node = v.producer
    arith = rule_for(node.prim).arith if node is not None and not node.subs else ""
    if arith in ("*", "/"):
      for k, a in enumerate(node.ins):
        if isinstance(a, Val) and jnp.issubdtype(a.dtype, jnp.inexact):
          ops.setdefault(a, set()).add(arith == "/" and k == 1)
  full = [v for v in ops if v.shape == y.shape]
  stats = [(v, inv) for v in ops for inv in sorted(ops[v]) if len(v.shape) == len(y.shape)
           and all(a in (1, b) for a, b in zip(v.shape, y.shape))
           and level.facts(v).value is None and level.constant_along(v, (d,), y.shape)]
  # Atoms beyond the cone keep every canonical form local to it.
  base = {b: level.atom(b) for b in boundary}
  for x in full:
    for s, invert in stats:
      if s is x:
        continue
      with level.assuming({**base, x: level.atom(x), s: level.atom(s)}):
        try:
          ok = _is_form(level, y, aff, x, s, invert)
        except A.Unrepresentable:
          ok = False
      if ok:
        return x, s, invert
  raise Block("its output is not γ ⊙ x ⊙ s + β with a statistic s constant along the "
              "normalized dim")


def _region(level, y, stops: set) -> Optional[list]:
  """Nodes between ``stops`` (and parameters) and ``y``; None past 256 values."""
  nodes, seen, frontier = [], set(), [y]
  while frontier:
    v = frontier.pop()
    if v in stops or v in seen or v.producer is None:
      continue
    seen.add(v)
    node = v.producer
    if node.subs or len(seen) > 256:
      return None
    nodes.append(node)
    frontier.extend(a for a in node.ins if isinstance(a, Val))
  return nodes


def _remats(node) -> set:
  return {c.path for c in node.calls if c.kind == REMAT} if node is not None else set()


def _chain(level, reader, y, s, dim_y: int) -> tuple:
  """The re-indexing equations from ``y`` to the reader's operand (``y``
  first), after checking ``s`` through them stays constant along the
  contracted dim; raises Block."""
  u = reader.node.ins[1 - reader.w_side]
  nodes = []
  while u is not y:
    node = getattr(u, "producer", None)
    if node is None or node.subs or len(node.ins) != 1 or rule_for(node.prim).reindex not in _REINDEX:
      name = node.prim.name if node is not None else "an input"
      raise Block(f"it reads the normalized value through `{name}`")
    nodes.append(node)
    u = node.ins[0]
  nodes.reverse()
  f = Facts(level.constant_dims(s, y.shape))
  for node in nodes:
    (f,) = rule_for(node.prim).facts(node, [f], level)
  if reader.y_dim not in f.const:
    raise Block("the statistic is not constant along the contracted dim after re-indexing")
  return tuple(n.eqn for n in nodes)


# Exponent bits of float32 (and bfloat16): below them (float16, float8) the
# un-normalized values overflow at magnitudes a normalized activation never has.
_RANGE_BITS = 8


def _check_range(x, chain: tuple, reader) -> None:
  """Raises Block when a float dtype the deferred reader computes in (``x``'s
  re-indexing and casts, its operand, its output) has a narrower exponent range
  than ``max(x's dtype, float32)``. The original rounds the *normalized* value
  to it (|y| ~ γ, β); the deferred form casts ``x`` and forms ``x @ W`` in it,
  ``rms(x)`` times larger: a float16 residual stream of a few thousand, or a
  float64 one past 3e38 cast to float32, overflows to inf where the original
  is finite."""
  dts = [x.dtype] + [e.outvars[0].aval.dtype for e in chain]
  dts += [reader.node.ins[1 - reader.w_side].dtype, reader.node.outs[0].dtype]
  dts = [np.dtype(d) for d in dts if jnp.issubdtype(d, jnp.floating)]
  if not dts:
    return
  need = max(_RANGE_BITS, jnp.finfo(dts[0]).nexp) if jnp.issubdtype(x.dtype, jnp.floating) else _RANGE_BITS
  narrow = [d for d in dts if jnp.finfo(d).nexp < need]
  if narrow:
    raise Block(f"it would contract the un-normalized input in {narrow[0].name}, whose range is narrower "
                f"than {np.dtype(x.dtype).name if need > _RANGE_BITS else 'float32'}'s: x @ W can overflow "
                "where the normalized product does not")


def _fused_values(accepted: list, level) -> dict:
  """Canonical forms of what fusing changes, for the kernel proofs: fused γ and
  β are the constants 1 and 0 at run time, a reader's output (W' and a new
  bias) is no longer what its equation says."""
  invars, assume = level.program.invars, {}
  for aff, readers in accepted:
    assume[invars[aff.gamma]] = A.ONE
    if aff.beta is not None:
      assume[invars[aff.beta]] = A.ZERO
    for r in readers:
      z = r.node.outs[0]
      assume[z] = A.atom(("fused-reader", z), tuple(z.shape))
  return assume


def _rms_read(level, r, aff, x, chain: tuple, assume: dict) -> tuple:
  """``(RmsRead, "")`` when the kernel computes reader ``r`` exactly, else
  ``(None, why not)``."""
  if any(rule_for(e.primitive).reindex != "convert" for e in chain):
    return None, "it reads the normalized value re-indexed"
  dd = rule_for(r.node.prim).contraction(r.node)
  u, w = r.node.ins[0], r.node.ins[1]
  last = len(u.shape) - 1
  if r.w_side != 1 or dd is None or dd.lb or tuple(dd.lc) != (last,) or aff.dim != last:
    return None, "it is not a matmul of the normalized value over its last axis"
  if len(w.shape) != 2 or tuple(dd.rc) not in ((0,), (1,)):
    return None, "its weight is not a matrix"
  if np.dtype(u.dtype) != np.dtype(w.dtype) or not jnp.issubdtype(u.dtype, jnp.floating):
    return None, "its operands have different dtypes"
  # Proved on y itself: the chain's converts are the deferral's own rounding points
  # (it contracts chain(x) too), whatever the program's tolerance makes of them.
  src, eps = kernels.prove_rms_read(level, x, aff.y, assume)
  if src is None:
    return None, eps
  return RmsRead(src.key, eps, tuple(dd.rc) == (1,), _transposed(level, w)), ""


def _group(level, sib: list, modified: set) -> tuple:
  """``(members, "")``: the readers of one norm as one grouped kernel launch
  (``pallas_kernels.rms_matmul_group``), each proved for the kernel on its own,
  or ``((), why not)``. Members in program order, the first (the leader) runs
  the launch, so every other weight must be a value of the program known then:
  an input or a captured constant (or fuse's untied copy of one), at the
  leader's level of the program, or casts and re-indexing steps of one
  (which the leader then applies)."""
  for _reader, kern, why in sib:
    if kern is None:
      return (), why
  sib = sorted(sib, key=lambda t: t[0].node.index)
  (r0, k0, _) = sib[0]
  ws = [r.node.ins[r.w_side] for r, _, _ in sib]
  if any(k.w_t or k.w_nk != k0.w_nk or k.x != k0.x or k.eps != k0.eps for _, k, _ in sib):
    return (), "their weights are read in different layouts"
  if len({np.dtype(w.dtype) for w in ws}) != 1:
    return (), "their weights have different dtypes"
  if any(r.node.path[:-1] != r0.node.path[:-1] or r.node.program is not r0.node.program for r, _, _ in sib):
    return (), "they are in different parts of the program"
  members = []
  for (r, _, _), w in zip(sib, ws):
    src = _weight_source(w, modified)
    if src is None:
      return (), "a weight is computed in the program (not by casts and re-indexing of an input)"
    members.append(GroupMember(r.node.path, src[0].key, np.dtype(r.node.outs[0].dtype).name, src[1]))
  return tuple(members), ""


def _weight_source(w, modified: set) -> Optional[tuple]:
  """``(w0, steps)``: ``w`` is an input or captured constant ``w0`` of its part
  of the program (known at the group's leader) seen through dtype conversions
  and re-indexing steps only (equations, ``w0``'s first, which the leader
  applies to get exactly the reader's weight), none of which the fused plan
  changes; or None."""
  chain = []
  while isinstance(w, Val) and w.producer is not None:
    node = w.producer
    if (node.subs or len(node.ins) != 1 or rule_for(node.prim).reindex not in ("convert", "move")
        or node.path in modified):
      return None
    chain.append(node.eqn)
    w = node.ins[0]
  if not isinstance(w, Val):
    return None
  return w, tuple(reversed(chain))


def _bias_add(level, r, modified: set) -> Optional[tuple]:
  """``(path, operand)`` of the add of the reader's own bias, a vector along the
  output's last dim that the kernel may add in its epilogue (see the module
  docstring), or None."""
  z = r.node.outs[0]
  prog = z.program
  uses = prog.consumers.get(z, [])
  if len(uses) != 1 or z in prog.output_positions:
    return None
  node, k = uses[0]
  if (node.subs or rule_for(node.prim).arith != "+" or len(node.ins) != 2 or node.path[:-1] != r.node.path[:-1]
      or node.path in modified):
    return None
  o, t = node.ins[1 - k], node.outs[0]
  nd = len(t.shape)
  if (not isinstance(o, Val) or o is z or tuple(t.shape) != tuple(z.shape) or nd == 0
      or len(o.shape) != nd or o.shape[-1] != t.shape[-1] or np.dtype(o.dtype) != np.dtype(t.dtype)
      or np.dtype(t.dtype) != np.dtype(z.dtype)):
    return None
  if level.facts(o).random or not level.constant_along(o, tuple(range(nd - 1)), t.shape):
    return None
  region = _region(level, o, set())
  if region is None or any(n.path in modified for n in region):
    return None
  return node.path, 1 - k


def _transposed(level, w) -> bool:
  """``w`` is a transpose of a matrix (a tied embedding read as the head): the
  kernel then reads ``wᵀ`` in the other layout, which XLA folds into the
  transpose (no copy of W). Only a layout choice: the result is the same
  either way."""
  node = w.producer
  if node is None or node.subs or len(node.ins) != 1 or rule_for(node.prim).reindex != "move":
    return False
  (w0,) = node.ins
  if not isinstance(w0, Val) or tuple(w0.shape) != tuple(w.shape)[::-1]:
    return False
  W0 = A.atom(("w-untransposed", w0), tuple(w0.shape))
  want = A.view_op(W0, tuple(w.shape), lambda v: v.transpose((1, 0)), ("swap dims", (1, 0)))
  with level.assuming({w0: W0}):
    try:
      return level.canon(w) == want
    except A.Unrepresentable:
      return False


def defer_sites(level, accepted: list, names: list, modified: set, fuse_sites: list,
                norm_impl: str = "xla") -> tuple:
  """``(entries, sites)`` for fused sites ``accepted`` (``(affine, readers)``
  pairs); ``modified``: paths of the nodes the fused plan changes;
  ``fuse_sites``: every affine site (those not fused are not deferred either);
  ``norm_impl``: the fold's, whether readers may run as the RMS-matmul kernel."""
  entries, sites = [], []
  assume = _fused_values(accepted, level) if kernels.may_use_kernel(norm_impl) else None
  for aff, readers in accepted:
    where = aff.y.producer.where()
    labels = tuple(names[r.leaf] for r in readers)
    mine, fast, slow, sib = [], [], [], []
    try:
      x, s, invert = _statistic(level, aff)
      region = _region(level, aff.y, {x, s})
      if region is None or any(n.path in modified for n in region):
        raise Block("the fused plan changes an operation between its input and its output")
      for r in readers:
        tag = f"reader {param_label(names[r.leaf])} [at {r.node.where()}]: "
        try:
          chain = _chain(level, r, aff.y, s, aff.dim)
          _check_range(x, chain, r)
          for v in (x, s):
            if not _remats(v.producer) <= _remats(r.node):
              raise Block("a remat boundary separates it from the norm's input")
        except Block as err:
          raise Block(tag + str(err)) from err
        kern = None
        if assume is not None and len(readers) > 1:
          # Sibling readers (q, k, v; Phi's parallel block): XLA merges their GEMMs into
          # one launch, which one opaque RMS-matmul call per reader cannot join (the
          # deviceless model: OPT, Phi, ViT launch more than the folded program); one
          # grouped launch for all of them can (decided below, once every reader is seen).
          sib.append((r, *_rms_read(level, r, aff, x, chain, assume)))
        elif assume is not None:
          kern, why = _rms_read(level, r, aff, x, chain, assume)
          add = _bias_add(level, r, modified) if kern is not None else None
          if add is not None:
            kern = dataclasses.replace(kern, add=add)
          label = param_label(names[r.leaf])
          if kern is not None:
            fast.append(label + (" with its bias" if kern.add is not None else ""))
          else:
            slow.append(f"{label} ({why})")
        mine.append(Deferred(r.node.path, 1 - r.w_side, x.key, s.key, aff.y.shape, chain,
                             r.y_dim, invert, kern))
      if sib:
        group, why = _group(level, sib, modified)
        for i, (_reader, kern, _) in enumerate(sib):
          if group:
            mine[i] = dataclasses.replace(mine[i], kernel=dataclasses.replace(kern, group=group))
        if group:
          fast.append(f"{', '.join(param_label(names[r.leaf]) for r, _, _ in sib)} in one launch")
        else:
          slow.append(f"{', '.join(param_label(names[r.leaf]) for r, _, _ in sib)} ({len(readers)} readers "
                      f"share the norm, XLA merges their GEMMs; one kernel launch cannot: {why})")
    except Block as err:
      sites.append(DeferSite(where, labels, False, f"not deferred: {err}"))
      continue
    entries += mine
    how = ""
    if fast:
      how += (f"; the RMS-matmul kernel computes {', '.join(fast)}" if norm_impl != "auto" else
              f"; the RMS-matmul kernel computes {', '.join(fast)} at up to "
              f"{kernels.MATMUL_AUTO_ROWS} rows (norm_impl='auto')")
    if slow:
      how += f"; XLA computes {', '.join(slow)}"
    sites.append(DeferSite(where, labels, True,
                           f"deferred: {', '.join(map(param_label, labels))} read the "
                           "un-normalized input, outputs scaled by the per-row statistic" + how))
  # One row per affine site, in fuse's order.
  mine, out = iter(sites), []
  for f in fuse_sites:
    out.append(next(mine) if f.fused else DeferSite(f.where, (), False, "not deferred: " + f.reason))
  return tuple(entries), tuple(out)


# ----------------------------------------------------------------------------
# The rewrite.


def _kernel(entry: Deferred, eqn: Any, invals: list, values: dict, norm_impl: str, bias,
            own=None) -> Optional[tuple]:
  """``(outputs, whether the bias is in them)``: the reader as the RMS-matmul
  kernel, or None (``norm_impl`` or the values say no). ``own``: the operand
  of the add of the reader's own bias (``entry.kernel.add``), constant along
  every dim but the last: its ``[0, ..., 0, :]`` joins the epilogue too."""
  k = entry.kernel
  x, w = values.get(k.x), invals[1 - entry.operand]
  if x is None or isinstance(x, Zero) or isinstance(w, Zero):
    return None
  interpret = kernels.use_matmul_kernel(norm_impl, int(np.prod(x.shape[:-1])))
  if interpret is None:
    return None
  w_nk = k.w_nk
  if k.w_t:
    w, w_nk = jnp.swapaxes(w, 0, 1), not w_nk   # transpose(transpose(W)) = W: no copy
  n = w.shape[0] if w_nk else w.shape[1]
  dt = eqn.outvars[0].aval.dtype
  fused = _epilogue_bias(bias, n, dt, len(eqn.outvars[0].aval.shape))
  take = fused is not None
  vecs = (fused,) if take else ()
  if own is not None and not isinstance(own, Zero):
    vecs += (jnp.reshape(own[(0,) * (own.ndim - 1)], (n,)),)
  vec = None if not vecs else vecs[0] if len(vecs) == 1 else vecs
  out = kernels.run_rms_matmul(x, w, vec, k.eps, w_nk, dt, interpret)
  return [out], take


def _epilogue_bias(bias, n: int, out_dtype, ndim: int):
  """The fused bias (β·W, added to a reader's rank-``ndim`` output) as the kernel's
  ``(n,)`` epilogue vector, or None. Only one value per output column ((..., 1, N)
  broadcast over the rows) that does not widen the output (the rewrite's add would
  promote it)."""
  if (bias is None or isinstance(bias, Zero) or bias.ndim > ndim or bias.shape[-1:] != (n,) or bias.size != n
      or jnp.result_type(out_dtype, bias.dtype) != np.dtype(out_dtype)):
    return None
  return jnp.reshape(bias, (n,))


class Pending:
  """A kernel reader's output held until the add of its own bias
  (``entry.kernel.add``), which runs the kernel with that bias in its epilogue
  (``resolve``). Anything else that reads it gets ``materialize()``: the reader
  as ``run`` computes it, with the fused bias the rewrite adds."""
  __slots__ = ("args", "_value")

  def __init__(self, entry, eqn, invals, values, norm_impl, bias):
    self.args = (entry, eqn, list(invals), values, norm_impl, bias)
    self._value = None

  def materialize(self):
    if self._value is None:
      entry, eqn, invals, values, norm_impl, bias = self.args
      outs, biased = run(entry, eqn, invals, values, norm_impl, bias)
      out = outs[0] if outs is not None else compat.bind_eqn(
          eqn, [v.materialize() if isinstance(v, Zero) else v for v in invals])[0]
      if bias is not None and not biased:
        out = (out.materialize() if isinstance(out, Zero) else out) + bias
      self._value = out
    return self._value


def resolve(entry: Deferred, eqn: Any, invals: list) -> Optional[list]:
  """The add ``eqn`` of a kernel reader's own bias (``entry.kernel.add``): the
  kernel with both biases in its epilogue, or None (its reader was not held:
  bind the add as written)."""
  k = entry.kernel.add[1]
  held, own = invals[1 - k], invals[k]
  if not isinstance(held, Pending):
    return None
  e, reqn, rinvals, values, norm_impl, bias = held.args
  got = _kernel(e, reqn, rinvals, values, norm_impl, bias, own)
  if got is None:   # no kernel after all: the reader as written, then this add
    ins = list(invals)
    ins[1 - k] = held.materialize()
    return None if isinstance(own, Zero) else compat.bind_eqn(eqn, ins)   # (Zero: the rewrite's own rule)
  (out,), took = got
  if bias is not None and not isinstance(bias, Zero) and not took:
    out = out + bias
  return [out.astype(eqn.outvars[0].aval.dtype)]


def run(entry: Deferred, eqn: Any, invals: list, values: dict, norm_impl: str = "xla",
        bias=None, hold: bool = False) -> tuple:
  """``(outputs or None, whether they include bias)``: the contraction on ``x``
  scaled by ``s`` (the RMS-matmul kernel, which may also add ``bias``, the
  value the rewrite adds to this output, where proved and ``norm_impl``
  allows it); None (compute it as written) when ``x`` or ``s`` was not
  recorded. ``hold``: a reader whose own bias the kernel may add returns a
  ``Pending`` (with ``bias``) for ``resolve``."""
  if hold and entry.kernel is not None and entry.kernel.add is not None and norm_impl != "xla":
    return [Pending(entry, eqn, invals, values, norm_impl, bias)], True
  if entry.kernel is not None and not entry.kernel.group and norm_impl != "xla":
    out = _kernel(entry, eqn, invals, values, norm_impl, bias)
    if out is not None:
      return out
  return _xla(entry, eqn, invals, values), False


def run_group(entries: dict, weights: list, biases: list, values: dict, norm_impl: str) -> Optional[dict]:
  """The sibling readers of one norm (``entries[path]``, each ``.kernel.group``,
  in the group's order; ``weights`` and the fused ``biases`` (or None) likewise)
  in one launch of ``pallas_kernels.rms_matmul_group``: ``{path: (output,
  whether its bias is in it)}``, or None (``norm_impl`` or the values say no:
  each reader then keeps XLA's deferred form)."""
  members = next(iter(entries.values())).kernel.group
  k = entries[members[0].path].kernel
  x = values.get(k.x)
  if x is None or isinstance(x, Zero) or any(w is None or isinstance(w, Zero) for w in weights):
    return None
  interpret = kernels.use_matmul_kernel(norm_impl, int(np.prod(x.shape[:-1])))
  if interpret is None:
    return None
  vecs = [_epilogue_bias(bias, w.shape[0] if k.w_nk else w.shape[1], dt, len(x.shape))
          for m, w, bias in zip(members, weights, biases) for dt in (m.dtype,)]
  took = [v is not None for v in vecs]
  outs = kernels.run_rms_matmul_group(x, list(weights), vecs, k.eps, k.w_nk, [m.dtype for m in members],
                                      interpret)
  return {m.path: (out, t) for m, out, t in zip(members, outs, took)}


def _xla(entry: Deferred, eqn: Any, invals: list, values: dict) -> Optional[list]:
  x, s = values.get(entry.x), values.get(entry.s)
  if x is None or s is None or isinstance(x, Zero) or isinstance(s, Zero):
    return None
  s = jnp.broadcast_to(s, entry.shape)
  for ceqn in entry.chain:
    x = compat.bind_eqn(ceqn, [x])[0]
    if rule_for(ceqn.primitive).reindex != "convert":
      s = compat.bind_eqn(ceqn, [s])[0]    # s keeps its precision
  operand = eqn.invars[entry.operand].aval
  ins = list(invals)
  ins[entry.operand] = x.astype(operand.dtype)
  (out,) = compat.bind_eqn(eqn, ins)
  r = lax.index_in_dim(s, 0, entry.dim, keepdims=False)
  other = out.ndim - r.ndim
  r = r.reshape(r.shape + (1,) * other if entry.operand == 0 else (1,) * other + r.shape)
  wide = jnp.promote_types(out.dtype, r.dtype)
  r = 1 / r.astype(wide) if entry.invert else r.astype(wide)
  return [(out.astype(wide) * r).astype(out.dtype)]
