"""``jaxfold.fuse_affine``: a folded norm's γ and β move into the layers that read it.

Where a value ``y = γ ⊙ K + β`` (γ, β parameters varying along one dim d, K
free of them; a folded norm's output, with K the parameter-free RMS
normalization) is read only by contractions over d, each against a
parameter W, then ``y·W = K·(diag(γ)·W) + β·W``: γ goes into W (in place
when W has no other use, else into an untied copy) and ``β·W`` becomes a bias
added to the contraction's output. γ and β then become constants (1 and 0)
and the norm is parameter-free.

Proof obligations, each checked on the traced folded program:

* ``y``'s canonical form (``Level.canon``, exact) is ``γ_view·K + β_view``
  with no factor of K mentioning γ, β or any value computed from them, and
  every use of γ and β leads to ``y`` only;
* every use of ``y`` reaches a ``dot_general`` contracting exactly d (through
  re-indexing steps whose rotation facet shows d stays one whole axis, so the
  map along d commutes with them), against a parameter.

Anything else is refused with the construct named.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxfold._src import algebra as A
from jaxfold._src import compat, compiled, counts, defer_analysis, display, kernels, pipeline, tl_edits
from jaxfold._src.analysis import Level, factor_leaf, param_operand, single_use, vector_along
from jaxfold._src.errors import FuseError
from jaxfold._src.pipeline import Call
from jaxfold._src.program import Node, Val, upstream
from jaxfold._src.report import param_label
from jaxfold._src.rewrite import BiasAt, Plan, UntiedUse
from jaxfold._src.rules import Block, rule_for
from jaxfold._src.rules.rotation import Lin
from jaxfold._src.step import (
  Params,
  RestoreContext,
  Restored,
  Result,
  Step,
  StepRecord,
  digest,
  register,
  split_extras,
  with_extras,
)

# ----------------------------------------------------------------------------
# Results.


@dataclasses.dataclass(frozen=True)
class AffineSite:
  """One ``γ ⊙ K + β`` and what became of it."""
  where: str
  gamma: str
  beta: Optional[str]
  readers: tuple          # parameter names of the contractions reading it
  fused: bool
  reason: str


@dataclasses.dataclass(frozen=True)
class Widening:
  """How fusing γ into a reader changed its weight's range, per output channel:
  ``before``/``after``: the median over output channels of ``max|w| / rms(w)``
  along the contracted dim (what per-channel quantization's step size sees
  relative to the typical weight); a ratio above 1 makes the reader harder to
  quantize (``fuse_affine``'s report lists those above ``WIDENS``)."""
  weight: str
  gamma: str
  before: float
  after: float

  @property
  def ratio(self) -> float:
    return self.after / self.before if self.before > 0 else 1.0


WIDENS = 1.5   # the ratio from which the report points at the remedy


@dataclasses.dataclass(frozen=True)
class FuseReport:
  """What ``fuse_affine`` did, per affine site; ``widened``: a :class:`Widening`
  per weight γ was fused into (computed on the parameters; empty when abstract)."""
  sites: tuple
  extra_bytes: int = 0    # untied weight copies and new biases
  kernels: int = 0        # norms the RMSNorm kernel computes in the fused program
  norm_impl: str = "xla"  # the fold's, kept for the fused program
  deferred: tuple = ()    # defer_analysis.DeferSite per affine site, with defer_norms
  edits: tuple = ()       # tl_edits.TLSite: center_unembed / fold_value_biases, when asked
  programs: Any = dataclasses.field(default=None, compare=False, repr=False)   # counts.ProgramCounts
  widened: tuple = dataclasses.field(default=(), compare=False)

  def diff(self) -> str:
    """What changed, counted in the original and this program (traced on first use)."""
    return counts.diff_text(self.programs, "deferred" if self.deferred else "fused")

  @property
  def num_fused(self) -> int:
    return sum(s.fused for s in self.sites)

  def __str__(self) -> str:
    lines = []
    for i, s in enumerate(self.sites):
      status = "fused" if s.fused else "kept"
      beta = param_label(s.beta) if s.beta else None
      lines.append(f"{i}  {status:5}  {s.where}  γ={param_label(s.gamma)} β={beta}: {s.reason}")
    lines.append(f"{self.num_fused}/{len(self.sites)} affine sites fused into their readers"
                 + (f"; {self.extra_bytes} extra bytes" if self.extra_bytes else "")
                 + (f"; {self.kernels} norm(s) as the RMSNorm kernel (norm_impl={self.norm_impl!r})"
                    if self.kernels else ""))
    for i, s in enumerate(self.deferred):
      lines.append(f"{i}  {'deferred' if s.deferred else 'normed':8}  {s.where}: {s.reason}")
    lines += [str(tl_edits.TLEdits(sites=self.edits))] if self.edits else []
    wide = sorted((w for w in self.widened if w.ratio >= WIDENS), key=lambda w: -w.ratio)
    if wide:
      lines.append(f"γ widens the weight range of {len(wide)} reader(s) (per output channel, max|w|/rms(w) up to "
                   f"{wide[0].ratio:.1f}x: {param_label(wide[0].weight)}, by {param_label(wide[0].gamma)}); "
                   "to quantize them, rotate first (jaxfold.rotate(fused, \"hadamard\")) or migrate the range "
                   "(jaxfold.quantize(..., smooth=0.5), SmoothQuant)")
    if self.deferred:
      lines.append(f"{self.num_deferred}/{len(self.deferred)} fused norms deferred (readers "
                   "contract the un-normalized input)")
    return "\n".join(lines)

  @property
  def num_deferred(self) -> int:
    return sum(s.deferred for s in self.deferred)


FusedParams = Params   # deprecated: every result's parameters are a jaxfold.Params


class Fused(Result):
  """Result of :func:`fuse_affine` and ``defer_norms`` (a ``step.Result``):
  ``apply_fn(params, *args)`` computes the original; ``params`` is a
  :class:`Params` (γ/β ``None``, weights scaled; ``extras``: the fold's untied
  copies, scaled copies and new biases), ``report`` a :class:`FuseReport`."""
  __slots__ = ()
  __repr__ = display.result_repr


class _FuseRecord(NamedTuple):
  """A saved fuse_affine step, decoded."""
  example_args: Optional[tuple]   # the step's own example (absent in older saves: the fold's)
  defer: bool
  key_sha256: Any
  num_fused: Any
  tl: tuple = (False, False)      # center_unembed, fold_value_biases (absent in older saves: off)


# ----------------------------------------------------------------------------
# The analysis.


@dataclasses.dataclass(frozen=True)
class _Reader:
  node: Any
  w_side: int
  leaf: int            # W's leaf index
  dim: int             # W's dim paired with d
  chain: tuple         # identity nodes from the leaf to the use (leaf first)
  in_place: bool
  y_dim: int           # d at the contraction's operand
  casts: tuple = ()    # float casts between the norm's output and the contraction


@dataclasses.dataclass(frozen=True)
class _Affine:
  y: Val
  dim: int
  gamma: int
  beta: Optional[int]
  quantizer: str = ""   # a quantizing cast on γ's or β's way to y (matched only to be named)


class Removed(NamedTuple):
  """A fused γ or β: leaf ``leaf`` becomes the constant ``fill`` (γ → 1, β → 0)."""
  leaf: int
  fill: int


class Scaled(NamedTuple):
  """W (leaf ``leaf``) scaled in place by γ (leaf ``gamma``) along its dim ``dim``."""
  leaf: int
  gamma: int
  dim: int


class ScaledCopy(NamedTuple):
  """An untied copy ``name`` of W (leaf ``leaf``) scaled by γ (leaf ``gamma``) along ``dim``."""
  name: str
  leaf: int
  gamma: int
  dim: int


class NewBias(NamedTuple):
  """A new parameter ``name`` = β·W, added to a reader's output.

  ``beta``, ``leaf``: β's and W's leaf indices; ``side``: W's operand of the
  contraction; ``numbers``: its dimension numbers; ``y_rank``, ``y_dim``: the
  rank of the norm's output y and its normalized dim; ``dtype``: the
  contraction's output dtype tag; ``chain``: the re-indexing equations from W
  to its use."""
  name: str
  beta: int
  leaf: int
  side: int
  numbers: tuple
  y_rank: int
  y_dim: int
  dtype: str
  chain: tuple


@dataclasses.dataclass(frozen=True)
class FuseAnalysis:
  jaxpr: Any
  consts: list
  out_tree: Any
  plan: Plan
  removed: tuple[Removed, ...]
  scaled: tuple[Scaled, ...]          # in place
  copies: tuple[ScaledCopy, ...]
  biases: tuple[NewBias, ...]
  report: FuseReport
  defer: bool = False  # defer_norms: deferred readers are in plan.deferred
  tl: Any = None       # tl_edits.TLEdits (center_unembed, fold_value_biases), when asked
  tl_options: tuple = (False, False)

  @property
  def key(self) -> tuple:
    # A bias is β contracted with W: its values do not depend on the rank of
    # the norm's output y (only where its size-1 axes sit; see relayout).
    # (Plain tuples: saved folds record a digest of this key's repr.)
    key = (tuple(map(tuple, self.removed)), tuple(map(tuple, self.scaled)), tuple(map(tuple, self.copies)),
           tuple((b.name, b.beta, b.leaf, b.side, b.numbers[0][b.side], b.dtype) for b in self.biases))
    if self.defer:
      # Per site, which readers are deferred: not their paths, which the jaxpr at
      # another shape numbers differently (a batch-1 trace drops a broadcast) for
      # the same deferral. The parameters do not depend on it at all.
      key += (tuple((s.readers, s.deferred) for s in self.report.deferred),)
    return key + ((self.tl.key,) if self.tl is not None else ())

  @property
  def call_key(self) -> tuple:
    """What another call's analysis must share with the example's to run with its
    parameters: ``key`` without the side each bias's W sits on. A bias's values
    are β·W whichever side W is on; the side orders its axes (W's free axes
    before or after the size-1 ones for the norm output's), which ``relayout``
    redoes: ``einsum("dk,...d->...k", W, y)`` puts W on the left at rank 1 and on
    the right at higher ranks. ``key`` itself, which saved folds record a digest
    of, keeps the side (a save re-analyses at its own example)."""
    key = self.key
    return key[:3] + (tuple(b[:3] + b[4:] for b in key[3]),) + key[4:]

  def fuses_like(self, other: "FuseAnalysis") -> bool:
    """This analysis' call runs with ``other``'s fused parameters: the same γ
    and β removed, weights scaled, copies and biases (whichever side W is on)."""
    return self.call_key[:4] == other.call_key[:4]

  def defers_like(self, other: "FuseAnalysis") -> bool:
    """As ``fuses_like``, and the same readers deferred at every site."""
    return self.call_key == other.call_key

  def params_tree(self, folded: Any) -> Any:
    """The tree structure of the fused parameters made from ``folded`` (the
    parameters this analysis was made at): γ/β leaves None, then the extras."""
    leaves, tree = jax.tree_util.tree_flatten(folded)
    removed = dict(self.removed)
    base = jax.tree_util.tree_unflatten(tree, [None if i in removed else x for i, x in enumerate(leaves)])
    extras = {c.name: 0 for c in self.copies}
    extras.update({b.name: 0 for b in self.biases})
    if self.tl is not None:   # center_unembed / fold_value_biases: their copies and new biases
      extras.update({name: 0 for name in self.tl.extra_names})
    return jax.tree_util.tree_structure(with_extras(base, extras, FuseError))


def _mentions(e: A.Expr, banned: set, memo: dict) -> bool:
  return any(_factor_mentions(f, banned, memo) for m in e.terms for f in m)


def _factor_mentions(fid: int, banned: set, memo: dict) -> bool:
  if fid in memo:
    return memo[fid]
  f = A.factor(fid)
  if f.kind == "atom":
    out = isinstance(f.key, Val) and f.key in banned
  elif f.kind == "view":
    out = _factor_mentions(f.args[0], banned, memo)
  else:
    out = any(_mentions(a, banned, memo) for a in f.args)
  memo[fid] = out
  return out


def _reach(level: Level, start: Val, stops: set, limit: int = 256) -> Optional[set]:
  """Values computed from ``start`` up to ``stops``, when every use of
  ``start`` leads to one of ``stops`` (else None)."""
  prog = level.program
  seen, frontier = {start}, [start]
  while frontier:
    v = frontier.pop()
    if v in stops:
      continue
    if v in prog.output_positions:
      return None
    for node, _ in prog.consumers.get(v, ()):
      if node.subs:
        return None
      for o in node.outs:
        if o not in seen:
          seen.add(o)
          frontier.append(o)
          if len(seen) > limit:
            return None
  return seen


# Casts to fewer bits of precision than bfloat16 (float8) quantize: the model
# was calibrated for that rounding of γ ⊙ K + β, and moving γ across it changes
# the function by more than a rounding. Such casts block (also a float8 format
# emulated in a wider dtype by `reduce_precision`: the rules' cast facet
# names the narrowest format a cast passes through).
_MIN_BITS = 7
_MIN_EXPONENT_BITS = 5


def _real_cast(node) -> bool:
  """A float-to-float cast (a Node or a jaxpr equation) to at least bfloat16's
  precision: the identity map in real arithmetic."""
  if isinstance(node, Node):
    prim, ins, outs = node.prim, node.ins, node.outs
  else:
    prim, ins, outs = node.primitive, [a.aval for a in node.invars], [v.aval for v in node.outvars]
  cast = rule_for(prim).cast
  if cast is None or len(ins) != 1:
    return False
  bits = cast(node.params, ins[0].dtype, outs[0].dtype)
  return bits is not None and bits[0] >= _MIN_BITS and bits[1] >= _MIN_EXPONENT_BITS


def _float_cast(node) -> bool:
  """A float-to-float cast (a Node), quantizing or not."""
  cast = rule_for(node.prim).cast
  return (cast is not None and len(node.ins) == 1
          and cast(node.params, node.ins[0].dtype, node.outs[0].dtype) is not None)


def _cast_label(node) -> str:
  """The format a cast node rounds to: its dtype, or the bits a `reduce_precision` keeps."""
  src, dst = np.dtype(node.ins[0].dtype).name, np.dtype(node.outs[0].dtype).name
  bits = rule_for(node.prim).cast(node.params, node.ins[0].dtype, node.outs[0].dtype)
  return dst if dst != src or bits is None else f"{bits[0]} mantissa bits"


def _narrows(node) -> bool:
  """A float cast that rounds (a widening is exact)."""
  bits = rule_for(node.prim).cast(node.params, node.ins[0].dtype, node.outs[0].dtype)
  return bits is not None and bits[0] < jnp.finfo(node.ins[0].dtype).nmant


def _cast_labels(level: Level, leaf: int, stops: set, quantizing: bool = False) -> set:
  """The formats of the rounding casts on the way from parameter ``leaf`` to
  ``stops`` (``quantizing``: only the casts that quantize)."""
  out = set()
  for v in _reach(level, level.program.invars[leaf], stops) or ():
    node = v.producer
    if (node is not None and rule_for(node.prim).cast is not None and _narrows(node)
        and not (quantizing and _real_cast(node))):
      out.add(_cast_label(node))
  return out


def _affine_casts(level: Level, leaves: list, stops: set) -> tuple:
  """The rounding casts on the way from γ and β to the readers' operands: the program
  rounds γ, β (or γ ⊙ K + β) there, the fused program rounds γ ⊙ W and β·W instead."""
  return tuple(sorted(set().union(*[_cast_labels(level, i, stops) for i in leaves])))


def _expr(level: Level, v: Any, depth: int = 4, quant: bool = False) -> A.Expr:
  """``v``'s canonical form in real arithmetic, recomputed through its last
  ``depth`` producers: so that the analysis's size cap on long sums does not
  hide γ and β, and a float cast is the identity even where the analysis
  keeps it opaque (a cast coarser than the program's outputs: the fold's
  tolerance, not this transform's). Casts do not count against ``depth``: a
  γ rounded to bfloat16 and promoted back (``g.astype(bf16)`` in a float32
  program) is two of them. ``quant``: quantizing casts are the identity too
  (only to find the affine they block and name them; never to fuse)."""
  if depth == 0 or not isinstance(v, Val) or v.producer is None or v.producer.subs:
    return level.canon(v)
  node = v.producer
  if _real_cast(node) or (quant and _float_cast(node)):
    return _expr(level, node.ins[0], depth, quant)
  try:
    outs = rule_for(node.prim).canon(node, [_expr(level, a, depth - 1, quant) for a in node.ins], level)
  except Exception:  # noqa: BLE001 - the analysis's own form is always sound
    return level.canon(v)
  return outs[v.index] if outs is not None else level.canon(v)


def _form(level: Level, v: Val, quant: bool = False):
  """``(γ, β, K's factors)`` when ``v = γ ⊙ K + β`` with γ and β parameter
  vectors along one dim (``(leaf, dim)``; β may be None)."""
  vectors, beta, terms = {}, None, []
  for m, c in _expr(level, v, quant=quant).terms.items():
    here = set()
    for f in m:
      lv = factor_leaf(f, level)
      d = vector_along(lv[1], v.shape) if lv is not None else None
      if d is not None:
        vectors[f] = (lv[0], d)
        here.add(f)
    if len(m) == 1 and c == 1 and here:
      if beta is not None:   # a lone parameter vector: β
        return None
      beta = vectors[m[0]]
    else:
      terms.append((m, here))
  # γ: the one parameter vector that is a simple factor of every other term.
  common = set.intersection(*[h for _, h in terms]) if terms else set()
  common = {f for f in common if all(m.count(f) == 1 for m, _ in terms)}
  if len(common) != 1:
    return None
  (gf,) = common
  gamma = vectors[gf]
  rest = [g for m, _ in terms for g in m if g != gf]
  if beta is not None and (beta[1] != gamma[1] or beta[0] == gamma[0]):
    return None
  return gamma, beta, rest


def _free_of(level: Level, leaves: list, stops: set, rests: list) -> bool:
  """Every use of the ``leaves`` leads to ``stops``, and no factor in
  ``rests`` mentions them or anything computed from them."""
  banned = set()
  for i in leaves:
    r = _reach(level, level.program.invars[i], stops)
    if r is None:
      return False
    banned |= r
  banned -= stops
  banned |= {level.program.invars[i] for i in leaves}
  memo: dict = {}
  return not any(_factor_mentions(f, banned, memo) for rest in rests for f in rest)


def _match(level: Level, y: Val, quant: bool = False) -> Optional[_Affine]:
  """``y = γ ⊙ K + β`` with γ, β parameters along one dim and K free of them.
  ``quant``: also through quantizing casts of γ or β, named in ``quantizer``
  (such an affine is reported, never fused)."""
  form = _form(level, y, quant)
  if form is None:
    return None
  gamma, beta, rest = form
  leaves = [gamma[0]] + ([beta[0]] if beta else [])
  if not _free_of(level, leaves, {y}, [rest]):
    return None
  quantizer = ""
  if quant:
    named = []
    for what, i in zip(("γ", "β"), leaves):
      labels = sorted(_cast_labels(level, i, {y}, quantizing=True))
      if labels:
        named.append(f"{what} is cast to {', '.join(labels)}")
    if not named:
      return None
    quantizer = " and ".join(named)
  return _Affine(y, gamma[1], gamma[0], beta[0] if beta else None, quantizer)


def _param_chain(level: Level, a: Any, dim: int):
  """(leaf index, chain nodes leaf-first, leaf dim) when operand ``a`` is a
  parameter seen through re-indexing steps whose rotation facets carry one
  whole leaf dim to ``dim``."""
  found = param_operand(level, a)
  if found is None:
    return None
  i, chain = found
  for e in range(len(level.program.invars[i].shape)):
    state = Lin(frozenset({e}))
    try:
      for node in chain:
        (state,) = rule_for(node.prim).rotate(node, [state], level)
    except Block:
      continue
    if state == Lin(frozenset({dim})):
      return i, chain, e
  return None


def _readers(level: Level, aff: _Affine) -> list:
  """The contractions reading ``y``; raises Block naming any other use."""
  prog = level.program
  out, frontier = [], [(aff.y, aff.dim, ())]
  while frontier:
    v, d, casts = frontier.pop()
    if v in prog.output_positions:
      raise Block("the value is a program output")
    for node, k in prog.consumers.get(v, ()):
      rule = rule_for(node.prim)
      where = f" [at {node.where()}]"
      dd = rule.contraction(node)
      if dd is not None:
        if tuple(dd.contracting(k)) != (d,) or dd.lb:
          raise Block("a contraction that does not contract exactly the normalized dim" + where)
        e = dd.contracting(1 - k)[0]
        src = _param_chain(level, node.ins[1 - k], e)
        if src is None:
          raise Block("a contraction with an operand that is not a parameter" + where)
        leaf, chain, e = src
        if leaf in (aff.gamma, aff.beta) or not jnp.issubdtype(prog.invars[leaf].dtype,
                                                                jnp.inexact):
          raise Block("a contraction with γ, β or a non-float parameter" + where)
        # The kernel's own casts in the program (fake quantization, a bf16 matmul) round
        # γ ⊙ W where the original rounded W: a quantizer blocks, as on the norm's side,
        # and a real cast is reported with the others.
        kcasts = ()
        for c in chain:
          if rule_for(c.prim).cast is None:
            continue
          label = _cast_label(c)
          if not _real_cast(c):
            raise Block(f"the kernel is cast to {label}, which quantizes it: γ would move across "
                        "the quantizer" + where)
          kcasts += (label,) if _narrows(c) else ()
        out.append(_Reader(node, 1 - k, leaf, e, chain, single_use(level, leaf, chain,
                                                                    (node, 1 - k)), d, casts + kcasts))
      else:
        if rule.cast is not None and not _real_cast(node):
          raise Block(f"a cast to {np.dtype(node.outs[0].dtype).name} quantizes it: γ would move "
                      "across the quantizer" + where)
        ins = [None] * len(node.ins)
        ins[k] = Lin(frozenset({d}))
        try:
          outs = rule.rotate(node, ins, level)
        except Block as err:
          raise Block(f"`{node.prim.name}` reads it, which is not a contraction over the "
                      "normalized dim" + where) from err
        # A float cast on the way (a bf16 model's f32 norm output cast for its
        # matmul) is the identity in real arithmetic: the matmul's operand is
        # still γ ⊙ K + β, checked below on its canonical form.
        step = (_cast_label(node),) if _real_cast(node) and _narrows(node) else ()
        for o, st in zip(node.outs, outs):
          if st is not None:
            if not isinstance(st, Lin) or len(st.dims) != 1:
              raise Block(f"`{node.prim.name}` reads it" + where)
            frontier.append((o, next(iter(st.dims)), casts + step))
  if not out:
    raise Block("no contraction reads it")
  # What each contraction reads is still γ ⊙ K' + β along its contracted dim
  # (exact canonical forms), so diag(γ)·W and β·W are what it sees.
  stops = {r.node.ins[1 - r.w_side] for r in out}
  rests = []
  for r in out:
    u = r.node.ins[1 - r.w_side]
    form = _form(level, u)
    if form is None or form[0] != (aff.gamma, r.y_dim) or (
        form[1] is not None) != (aff.beta is not None) or (
        form[1] is not None and form[1] != (aff.beta, r.y_dim)):
      raise Block(f"the operand of the contraction is not γ ⊙ K + β [at {r.node.where()}]")
    rests.append(form[2])
  leaves = [aff.gamma] + ([aff.beta] if aff.beta is not None else [])
  if not _free_of(level, leaves, stops, rests):
    raise Block("γ or β is also used elsewhere")
  return out


def analyse(fn: Callable, params: Any, args: tuple, defer: bool = False,
            tl: tuple = (False, False)) -> FuseAnalysis:
  # A fold's RMSNorm kernel call hides the norm's γ and β: read the folded
  # program's XLA expression, and choose the kernels again once γ and β are
  # fused (the kernel then runs without them).
  # (A new function object: jax caches traces per function, and ``fn``'s own
  # entry must keep its kernels.)
  with kernels.xla_level() as asked:
    traced = pipeline.trace(lambda p, *a: fn(p, *a), params, args)
  norm_impl = next(iter(asked)) if len(asked) == 1 else "xla"
  names = traced.names
  removed, scaled, copies, biases, untied, plan_biases, sites = {}, [], [], [], [], [], []
  made: dict = {}   # name of each new parameter (untied copy, bias) -> what it holds
  extra, ys, changed, epilogues = 0, [], [], ()
  accepted, deferred, dsites = [], (), ()
  with pipeline.analyzer(traced) as an:
    level = an.top
    found = {}
    # (only where the program quantizes anything: a second match per node otherwise finds nothing)
    quantizes = any(_float_cast(n) and not _real_cast(n) for n in level.program.nodes)
    for node in level.program.nodes:
      if rule_for(node.prim).arith not in ("+", "*") or len(node.outs) != 1:
        continue
      y = node.outs[0]
      if not jnp.issubdtype(y.dtype, jnp.inexact):
        continue
      aff = _match(level, y) or (_match(level, y, quant=True) if quantizes else None)
      if aff is not None:
        found[aff.gamma] = aff  # the last match of a γ is the whole affine
    claimed = set()
    for aff in found.values():
      where = aff.y.producer.where()
      gname = names[aff.gamma]
      bname = names[aff.beta] if aff.beta is not None else None
      ys.append(aff.y)
      if aff.quantizer:
        sites.append(AffineSite(where, gname, bname, (), False,
                                f"not fused: {aff.quantizer} on its way to the norm's output, which "
                                "quantizes it: fusing would move it across the quantizer"))
        continue
      try:
        readers = _readers(level, aff)
        for r in readers:
          if r.leaf in claimed or (r.in_place and r.leaf in removed):
            raise Block(f"{param_label(names[r.leaf])} is read after another fusion")
      except Block as err:
        sites.append(AffineSite(where, gname, bname, (), False, f"not fused: {err}"))
        continue
      accepted.append((aff, readers))
      removed[aff.gamma] = 1
      if aff.beta is not None:
        removed[aff.beta] = 0
      for r in readers:
        changed.append(r.node.outs[0])
        wname = names[r.leaf]
        wv = level.program.invars[r.leaf]
        nbytes = int(np.prod(wv.shape)) * np.dtype(wv.dtype).itemsize
        if r.in_place:
          claimed.add(r.leaf)
          scaled.append(Scaled(r.leaf, aff.gamma, r.dim))
        else:
          cname, new = _extra_name(f"{wname}@fused{gname}", (r.leaf, aff.gamma, r.dim), made)
          if new:
            copies.append(ScaledCopy(cname, r.leaf, aff.gamma, r.dim))
            extra += nbytes
          untied.append(UntiedUse(r.node.path, r.w_side, cname, tuple(c.eqn for c in r.chain)))
        if aff.beta is not None:
          z = r.node.outs[0]
          spec = (aff.beta, r.leaf, r.w_side, rule_for(r.node.prim).contraction(r.node).numbers,
                  len(r.node.ins[1 - r.w_side].shape), r.y_dim, _dtype_tag(z.dtype))
          # (a chain of re-indexing steps is its own: equal only when there is none)
          bias, new = _extra_name(f"{wname}@bias{bname}", spec + (tuple(id(c) for c in r.chain),), made)
          if new:
            biases.append(NewBias(bias, *spec, tuple(c.eqn for c in r.chain)))
            extra += int(np.prod(wv.shape)) // wv.shape[r.dim] * np.dtype(z.dtype).itemsize
          plan_biases.append(BiasAt(z.key, bias))
      reason = "γ into " + ", ".join(
          param_label(names[r.leaf]) + ("" if r.in_place else " (untied copy)") for r in readers)
      if aff.beta is not None:
        reason += "; β·W into new biases"
      stops = {r.node.ins[1 - r.w_side] for r in readers}
      leaves = [aff.gamma] + ([aff.beta] if aff.beta is not None else [])
      casts = sorted({c for r in readers for c in r.casts} | set(_affine_casts(level, leaves, stops)))
      if casts:
        reason += (f" (through a cast to {', '.join(casts)}: exact in real arithmetic, rounded at "
                   "another point)")
      sites.append(AffineSite(where, gname, bname, tuple(names[r.leaf] for r in readers), True,
                              reason))
    if defer:
      modified = {r.node.path for _, rs in accepted for r in rs}
      deferred, dsites = defer_analysis.defer_sites(level, accepted, names, modified, sites, norm_impl)
    if kernels.may_use_kernel(norm_impl):
      epilogues = _kernel_epilogues(level, removed, changed)
      # A deferred norm's output is dead: no kernel computes it.
      dead = [aff.y for (aff, _), d in zip(accepted, dsites) if d.deferred]
      epilogues = [(ep, out) for ep, out in epilogues if not any(_reaches(out, y) for y in dead)]
      sites = [_with_kernel(level, site, y, epilogues) for site, y in zip(sites, ys)]
      epilogues = tuple(ep for ep, _ in epilogues)
    edits = tl_edits.prove_edits(level, names, untied, plan_biases, *tl) if any(tl) else None
  plan = Plan(untied=tuple(untied) + (edits.untied if edits else ()),
              biases=tuple(plan_biases) + (edits.plan_biases if edits else ()), epilogues=epilogues,
              norm_impl=norm_impl, deferred=deferred)
  return FuseAnalysis(traced.jaxpr, traced.consts, traced.out_tree, plan,
                      tuple(Removed(*x) for x in sorted(removed.items())), tuple(scaled), tuple(copies),
                      tuple(biases), FuseReport(tuple(sites), extra, len(epilogues), norm_impl, dsites,
                                                edits.sites if edits else ()),
                      defer, edits, tl)


def _reaches(out: Val, y: Val) -> bool:
  """``out`` is ``y`` or a single-operand step (a cast) of it, at most 3 steps up."""
  chain = upstream(out, 3, keep=lambda node, _: len(node.ins) == 1)
  return any(v is y for layer in chain for v in layer)


def _kernel_epilogues(level: Level, removed: dict, changed: list) -> list:
  """``[(Epilogue, output)]``: the norms of the fused program that the RMSNorm
  kernel computes, proved on the folded program with what fusing changes:
  fused γ and β are the constants 1 and 0 the fused program passes, and a
  reader's output (W' and a new bias) is no longer what its equation says."""
  assume = {level.program.invars[i]: A.ONE if fill else A.ZERO for i, fill in removed.items()}
  for z in changed:
    assume[z] = A.atom(("fused-reader", z), tuple(z.shape))
  return kernels.prove_epilogues(level, assume)


def _with_kernel(level: Level, site: AffineSite, y: Val, epilogues: list) -> AffineSite:
  """``site`` with its norm's implementation in the reason: the kernel when
  one replaces ``y`` or a cast of it."""
  for ep, out in epilogues:
    if _reaches(out, y):
      params = "without γ, β" if site.fused else "with its γ, β"
      how = " (fused with its residual add)" if ep.add_path is not None else ""
      return dataclasses.replace(
          site, reason=f"{site.reason}; the norm runs as the RMSNorm kernel {params}{how}")
  return dataclasses.replace(site, reason=f"{site.reason}; XLA computes the norm (no kernel proof)")


# ----------------------------------------------------------------------------
# Parameters and the fused apply function.


def _along(vec: np.ndarray, rank: int, dim: int) -> np.ndarray:
  shape = [1] * rank
  shape[dim] = vec.size
  return vec.reshape(shape)


def _dtype_tag(dtype) -> str:
  # numpy's ``str`` of bfloat16/float8 is an anonymous void ('<V2'): name those.
  dt = np.dtype(dtype)
  return dt.name if dt.kind == "V" else dt.str


def _host(x) -> np.ndarray:
  return np.asarray(x, np.float64) if jnp.issubdtype(x.dtype, jnp.floating) else np.asarray(x)


def _rounded(v: np.ndarray, dtype, what: str):
  """``v`` in ``dtype``; an overflow (γ·W past float16's range, say) would be a
  wrong model, not a rounding: refused."""
  with np.errstate(over="ignore", invalid="ignore"):
    r = v.astype(jnp.dtype(dtype))
  if np.all(np.isfinite(v)) and not np.all(np.isfinite(np.asarray(r, np.float64))):
    raise FuseError(f"{what} overflows {jnp.dtype(dtype).name}: fuse the model in a wider dtype")
  return jnp.asarray(r)


def _reindexed(wx, chain: tuple):
  """``wx`` through the re-indexing steps between a parameter and its use; its
  real casts are skipped (β·W is taken in real arithmetic and rounded once)."""
  for eqn in chain:
    if not _real_cast(eqn):
      wx = compat.bind_eqn(eqn, [wx])[0]
  return wx


def _bias_product(xnp, wx, yb, side: int, dn: tuple):
  """β·W as the reader contracts them (``xnp``: numpy, or jax.numpy for shapes)."""
  (lc, rc), _ = dn
  lhs, rhs = (yb, wx) if side == 1 else (wx, yb)
  return xnp.tensordot(lhs, rhs, axes=(tuple(lc), tuple(rc)))


def _abstract_fused_params(an: FuseAnalysis, leaves: list, tree, bias_dtype=None) -> Params:
  """Shapes and dtypes of the fused parameters of abstract (``ShapeDtypeStruct``)
  folded ones: what a deviceless compile or a size estimate needs."""
  def like(x, shape=None, dtype=None):
    return jax.ShapeDtypeStruct(x.shape if shape is None else shape, dtype or x.dtype,
                                sharding=getattr(x, "sharding", None) if shape is None else None)

  out = list(leaves)
  for w, _, _ in an.scaled:
    out[w] = like(leaves[w])
  extras = {name: like(leaves[w]) for name, w, _, _ in an.copies}
  for name, b, w, side, dn, y_rank, y_dim, dtype, chain in an.biases:
    def bias(wx, vec, chain=chain, side=side, dn=dn, y_rank=y_rank, y_dim=y_dim):
      shape = [1] * y_rank
      shape[y_dim] = vec.size
      return _bias_product(jnp, _reindexed(wx, chain), jnp.reshape(vec, shape), side, dn)
    vec = jax.ShapeDtypeStruct((math.prod(leaves[b].shape),), leaves[b].dtype)
    extras[name] = like(leaves[w], jax.eval_shape(bias, like(leaves[w]), vec).shape,
                        bias_dtype or dtype)
  for i in dict(an.removed):
    out[i] = None
  return with_extras(jax.tree_util.tree_unflatten(tree, out), extras, FuseError)


def _fused_params(an: FuseAnalysis, leaves: list, tree, bias_dtype=None) -> Params:
  """The fused parameters from the folded ones; new biases are rounded once to
  the contraction's dtype (``bias_dtype``: another one, e.g. float64 in tests)."""
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
    if an.tl is not None:
      raise FuseError("center_unembed and fold_value_biases need concrete parameters")
    return _abstract_fused_params(an, leaves, tree, bias_dtype)
  removed = dict(an.removed)
  out = list(leaves)
  for w, g, dim in an.scaled:
    x = leaves[w]
    out[w] = _rounded(_host(x) * _along(_host(leaves[g]).ravel(), x.ndim, dim), x.dtype,
                      f"γ·W (parameter leaf {w})")
  extras = {}
  for name, w, g, dim in an.copies:
    x = leaves[w]
    extras[name] = _rounded(_host(x) * _along(_host(leaves[g]).ravel(), x.ndim, dim), x.dtype,
                            name)
  for name, b, w, side, dn, y_rank, y_dim, dtype, chain in an.biases:
    wx = _host(_reindexed(leaves[w], chain))
    yb = _along(_host(leaves[b]).ravel(), y_rank, y_dim)
    extras[name] = _rounded(_bias_product(np, wx, yb, side, dn), bias_dtype or dtype, name)
  if an.tl is not None:
    tl_edits.apply(an.tl, out, extras)
  for i in removed:
    out[i] = None
  return with_extras(jax.tree_util.tree_unflatten(tree, out), extras, FuseError)


def _extra_name(name: str, spec: tuple, made: dict) -> tuple:
  """``(name, whether it is new)`` for a new parameter holding ``spec``: the
  readers of one norm that read one weight alike share it, and readers that
  read it differently (``y @ W`` and ``y @ W.T``, or ``W`` on either side) get
  one each (one name for both made the second overwrite the first)."""
  base, k = name, 1
  while name in made and made[name] != spec:
    k += 1
    name = f"{base}#{k}"
  new = name not in made
  made[name] = spec
  return name, new


def _defer_diff(base: tuple, other: tuple) -> str:
  """The first deferral site that differs between two analyses, in words."""
  for i, (a, b) in enumerate(zip(base, other)):
    if (a.readers, a.deferred) != (b.readers, b.deferred):
      return f"site {i} ({a.where}) {a.reason} at the example, {b.reason} here"
  return f"{len(base)} norm sites at the example, {len(other)} here"


@register
class FusedApply(Step):
  """The fused apply function (the fuse_affine and defer_norms step);
  re-analyses (and caches) per input signature (and per value of static
  keyword arguments, as the fold's does)."""

  error = FuseError
  kind = "fuse_affine"

  def __init__(self, inner: Callable, params_abstract: Any, base: FuseAnalysis, args: tuple,
               kwargs: Optional[dict] = None):
    super().__init__(inner, params_abstract, args, kwargs)
    self._leaves, self._tree = jax.tree_util.tree_flatten(params_abstract)
    self._base = base
    example = self.bind(args, kwargs)
    self._example_key = example.key
    self.seed(example, base)

  @property
  def example_analysis(self) -> FuseAnalysis:
    """The analysis made at the example: the one the fused parameters were made for."""
    return self._base

  def record(self) -> StepRecord:
    an = self._base
    info = {"name": self.kind, "num_fused": an.report.num_fused, "key_sha256": digest(an.key),
            # The step's own example: its key, and the layout of its new biases (size-1
            # axes for the norm output's free axes), are those of this rank, which may not
            # be the fold's (defer_norms(fused, x) / fuse_affine(folded, x) with x of another
            # rank). Load redoes the step there (absent in older saves: the fold's example).
            "example_args": tuple(self.example_args)}
    if an.defer:  # defer_norms: redone on load (an older jaxfold ignores it: same function)
      info["defer_norms"] = True
    if any(an.tl_options):  # center_unembed / fold_value_biases: redone on load (the key says so)
      info["tl_edits"] = [bool(o) for o in an.tl_options]
    return StepRecord(info, {})

  @classmethod
  def parse(cls, info: dict, decode: Callable[[Any], Any]) -> _FuseRecord:
    args = None
    if "example_args" in info:
      args = decode(info["example_args"])
      if not isinstance(args, tuple):
        raise TypeError(f"a fuse_affine step's example_args is a {type(args).__name__}")
    tl = tuple(bool(o) for o in info.get("tl_edits", (False, False)))
    return _FuseRecord(args, bool(info.get("defer_norms")), info.get("key_sha256"), info.get("num_fused"), tl)

  @classmethod
  def restore(cls, inner: Callable, params: Any, parsed: _FuseRecord, ctx: RestoreContext) -> Restored:
    args = parsed.example_args if parsed.example_args is not None else tuple(ctx.args)
    call = pipeline.bind(inner, args, ctx.kwargs, ctx.error)
    an = analyse(call.fn, params, call.abstract_args(ctx.error), defer=parsed.defer, tl=parsed.tl)
    if ctx.verify and (not ctx.same_key(an.key, parsed.key_sha256)
                       or an.report.num_fused != parsed.num_fused):
      raise ctx.refuse(f"fuse_affine ({an.report.num_fused} sites fused now, {parsed.num_fused} "
                       "when saved)")
    return Restored(cls(inner, params, an, args, ctx.kwargs), an.report, an.params_tree(params))

  def _analyse(self, call: Call) -> FuseAnalysis:
    an = analyse(call.fn, self._params, call.abstract_args(FuseError), self._base.defer, self._base.tl_options)
    if not an.fuses_like(self._base):
      raise FuseError(f"{self._differing(call)} fuse differently from the example fuse_affine was "
                      "given; call fuse_affine again for them")
    if not an.defers_like(self._base):
      raise FuseError(f"{self._differing(call)} defer differently from the example defer_norms was "
                      "given (the report would not hold for them): "
                      + _defer_diff(self._base.report.deferred, an.report.deferred)
                      + "; call defer_norms again for them")
    return an

  def _differing(self, call: Call) -> str:
    """What a refused call differs in, for its message."""
    what = f"inputs of these shapes ({pipeline.shapes_text(call.args)})"
    kw, ex = pipeline.key_kwargs_text(call.key), pipeline.key_kwargs_text(self._example_key)
    if kw != ex:   # another program (train=True, a flag): not the shapes' doing
      what += f" and keyword arguments ({kw or 'none'}; the example's: {ex or 'none'})"
    return what

  def __call__(self, params: Params, *args, **kwargs):
    if not isinstance(params, Params):
      raise FuseError(f"a fused apply_fn takes fused.params (a jaxfold.Params), got "
                      f"{type(params).__name__}")
    call = self.bind(args, kwargs)
    an = self._cached(call)
    removed = dict(an.removed)
    before, extras = split_extras(params, self._params, FuseError)
    given = jax.tree_util.tree_flatten(before, is_leaf=lambda x: x is None)[0]
    if len(given) != len(self._leaves):
      # A model fused before (fuse_affine of a fused or rotated model) has Nones
      # that are empty subtrees of the folded tree, not leaves: flatten up to it.
      try:
        given = self._tree.flatten_up_to(before)
      except (ValueError, TypeError) as err:
        raise FuseError("params does not have the structure of the fused parameters") from err
    flat = []
    for i, (x, ref) in enumerate(zip(given, self._leaves)):
      if i in removed:
        flat.append(jnp.full(ref.shape, removed[i], ref.dtype))
      else:
        flat.append(x)
    flat += jax.tree_util.tree_leaves(call.args)
    outs = compiled.run(an, flat, relayout(extras, self._base, an))
    return jax.tree_util.tree_unflatten(an.out_tree, outs)


def _y_axes(b: NewBias) -> int:
  """How many size-1 axes a new bias has for the free axes of the norm's output."""
  return b.y_rank - len(b.numbers[0][1 - b.side])


def relayout(extras: dict, base: FuseAnalysis, an: FuseAnalysis) -> dict:
  """``extras`` (made at the example) with each new bias's size-1 axes for the
  norm output's free axes as this analysis adds it (inputs of another rank)."""
  made = {b.name: b for b in base.biases}
  out = dict(extras)
  for b in an.biases:
    name, side, was = b.name, b.side, made[b.name].side
    old, new = _y_axes(made[name]), _y_axes(b)
    if (old, was) != (new, side) and name in out:
      # W's free axes, in W's order whichever side W is on: before the size-1
      # axes with W on the left (side 0), after them with W on the right.
      x = out[name]
      w_axes = x.shape[old:] if was == 1 else x.shape[:x.ndim - old]
      out[name] = jnp.reshape(x, (1,) * new + w_axes if side == 1 else w_axes + (1,) * new)
  return out


def fuse_affine(model: Any, *example_args: Any, center_unembed: bool = False,
                fold_value_biases: bool = False) -> Fused:
  """Moves the γ and β of folded norms into the contractions that read them.

  ``model`` is a :class:`jaxfold.Folded` (or anything with ``params`` and
  ``apply_fn``; then pass ``example_args``). Where a norm's output is read only
  by contractions over the normalized axis against parameters (Dense, einsum,
  attention projections, an LM head), ``W' = diag(γ)·W`` (an untied copy when W
  is also used elsewhere, e.g. a tied embedding) and ``β·W`` becomes a bias of
  the contraction's output; the norm keeps no parameters. Other sites are kept
  and reported with the reason (e.g. post-LN, where the residual branch reads
  the norm's output).

  TransformerLens's other two edits, each proved on the program (``jaxfold._src.tl_edits``;
  ``report.edits`` says per site what it preserves or why it was refused):
  ``center_unembed=True`` centers a final contraction's weight (and bias) along its output
  (vocabulary) dim where only a softmax, log_softmax or argmax along it, or a program output,
  sees the shift: probabilities and argmax exact, raw logits shifted per row.
  ``fold_value_biases=True`` moves a value bias ``b_V`` into a new bias ``b_V·W_O`` of the
  output projection where the attention weights are proved rows of a softmax: exact.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxfold
    >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(3)])
    >>> x = jnp.ones((2, 4)); p = m.init(jax.random.PRNGKey(0), x)
    >>> fused = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
    >>> fused.report.num_fused
    1
    >>> bool(jnp.allclose(fused.apply_fn(fused.params, x), m.apply(p, x), atol=1e-5))
    True
  """
  kwargs = pipeline.model_kwargs(model, example_args)
  params, fn, example_args = pipeline.model_parts(
      model, example_args, "fuse_affine takes a jaxfold.Folded (params, apply_fn)", FuseError)
  leaves, tree = jax.tree_util.tree_flatten(params)
  abstract = pipeline.abstract_tree(params, FuseError)
  call = pipeline.bind(fn, tuple(example_args), kwargs, FuseError)
  an = analyse(call.fn, abstract, call.abstract_args(FuseError), tl=(center_unembed, fold_value_biases))
  new = _fused_params(an, leaves, tree)
  apply = FusedApply(fn, abstract, an, example_args, kwargs)
  return Fused(new, apply, dataclasses.replace(an.report, programs=counts.result_counts(new, apply),
                                               widened=_widening(an, params)))


def _crest(w: np.ndarray, dim: int) -> float:
  """Median over the other dims of ``max|w| / rms(w)`` along ``dim``."""
  a = np.moveaxis(np.abs(w), dim, -1).reshape(-1, w.shape[dim])
  rms = np.sqrt((a * a).mean(-1))
  ok = rms > 0
  return float(np.median(a.max(-1)[ok] / rms[ok])) if ok.any() else 0.0


def _widening(an: FuseAnalysis, params: Any) -> tuple:
  """A :class:`Widening` per weight γ was fused into (none for abstract parameters)."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  if any(isinstance(x, jax.ShapeDtypeStruct) for _, x in flat):
    return ()
  names = [jax.tree_util.keystr(k) for k, _ in flat]
  out = []
  for w, g, dim in [(s.leaf, s.gamma, s.dim) for s in an.scaled] + [(c.leaf, c.gamma, c.dim) for c in an.copies]:
    x = np.asarray(_host(flat[w][1]), np.float64)
    scaled = x * _along(np.asarray(_host(flat[g][1]), np.float64).ravel(), x.ndim, dim)
    out.append(Widening(names[w], names[g], _crest(x, dim), _crest(scaled, dim)))
  return tuple(out)
