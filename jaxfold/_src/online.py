"""``jaxfold.online_hadamard``: QuaRot's online Hadamards, proved exact on the program.

QuaRot makes the inputs of the down-projection (reading the MLP's activation)
and of attention's output projection (reading the heads) easy to quantize by
rotating them: ``y = (x H)(Hᵀ W)``. ``x H`` runs in the program (a fast
Walsh–Hadamard transform, ``hadamard.hadamard_transform``, inserted before the
contraction by the rewrite's ``OperandMap``); ``Hᵀ W`` is folded into the
weight once (the weight is multiplied by ``H`` along its contracted dim).

The proof is local to the contraction and needs nothing of ``x``: the weight is
a parameter (seen through re-indexing) and every one of its uses must be
unchanged once the weight is rotated and the chosen operands are rotated
online. It runs the rules' ``rotate`` facets (``rules.rotation``) forwards from
the rotated weight, with the online operands' states set at their contractions
(``Lin``: the value times ``H_n`` along a dim of size ``n``): a weight that
another contraction also reads (a tied matrix) makes the proof fail, and the
site is skipped with that reason.

Which contractions are candidates is decided from the program, never from
parameter names: ``"mlp"`` is a contraction with a parameter whose other
operand is, through re-indexing and casts, an elementwise function of a value
made by an activation (a rule with the ``activation`` facet: GELU's erf or tanh,
SiLU's logistic, ReLU's max); ``"attention"`` one whose other operand is,
through re-indexing, a contraction of two non-parameters (probabilities × V,
its heads merged). Programs that merge the heads with a reshape get the online
Hadamard over the full width (QuaRot's per-head offline part needs heads and
head dims as separate axes of the output projection; they are then rotated
online along each axis).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxfold._src import compiled, display, pipeline
from jaxfold._src.analysis import Level, param_operand
from jaxfold._src.errors import RotateError
from jaxfold._src.hadamard import hadamard, hadamard_factorization
from jaxfold._src.pipeline import Call
from jaxfold._src.program import Val
from jaxfold._src.report import param_label
from jaxfold._src.rewrite import OperandMap, Plan
from jaxfold._src.rotate import advance
from jaxfold._src.rules import Block, rule_for
from jaxfold._src.rules.rotation import Lin
from jaxfold._src.step import RestoreContext, Restored, Result, Step, StepRecord, digest, register

__all__ = ["Online", "OnlineApply", "OnlineReport", "OnlineSite", "online_hadamard"]

WHERE = ("mlp", "attention")
_DEPTH = 6   # elementwise steps searched back from an MLP's activation for its nonlinearity
_PLAIN = "online over the contracted width"


@dataclasses.dataclass(frozen=True)
class OnlineSite:
  """One contraction ``online_hadamard`` considered.

  ``weight``: the weight's parameter path; ``kind``: ``"mlp"`` or
  ``"attention"``; ``width``: the contracted width rotated online (the product
  over the rotated axes); ``order``: the Hadamard's construction
  (``"H_12⊗H_64"``; per axis, joined by ``×``); ``rotated``: whether it was;
  ``reason``: why not, or what was done; ``where``: the contraction's source."""
  weight: str
  kind: str
  width: int
  order: str
  rotated: bool
  reason: str
  where: str


@dataclasses.dataclass(frozen=True)
class OnlineReport:
  """What ``online_hadamard`` did: one :class:`OnlineSite` per candidate contraction;
  ``weights``: ``((parameter path, dims), ...)``, every parameter multiplied by a
  Hadamard matrix along those dims (the rotated weights, and V's for the per-head part)."""
  sites: tuple
  weights: tuple = ()

  @property
  def num_rotated(self) -> int:
    return sum(s.rotated for s in self.sites)

  def summary(self) -> str:
    return f"{self.num_rotated} of {len(self.sites)} contraction(s) rotated online"

  def __str__(self) -> str:
    lines = [f"online Hadamards: {self.summary()}"]
    if not self.sites:
      lines.append("  no contraction with a parameter reads an MLP activation or attention's heads (contractions "
                   "inside loop bodies, e.g. a scan over layers, are not candidates)")
    else:
      w = max(len(param_label(s.weight)) for s in self.sites)
      lines.append(f"  {'kind':9}  {'width':>6}  {'hadamard':13}  {'weight':{w}}  result")
      for s in self.sites:
        what = ("rotated" + ("" if s.reason == _PLAIN else f": {s.reason}")) if s.rotated else f"skipped: {s.reason}"
        lines.append(f"  {s.kind:9}  {s.width:>6}  {s.order or '-':13}  {param_label(s.weight):{w}}  {what}")
    return "\n".join(lines)


class Online(Result):
  """Result of :func:`online_hadamard` (a ``step.Result``): ``apply_fn(params,
  *args)`` computes the original; ``params`` has the structure of the model's
  (its rotated weights multiplied by H), ``report`` is an :class:`OnlineReport`."""
  __slots__ = ()
  __repr__ = display.result_repr


# ----------------------------------------------------------------------------
# Candidates.


class _Site(NamedTuple):
  """A contraction reading a parameter whose other operand may be rotated online."""
  node: Any          # the contraction (program.Node)
  act: int           # the operand rotated online
  leaf: int          # the weight's parameter leaf
  chain: tuple       # the re-indexing nodes from the leaf to the weight operand, leaf first
  kind: str          # "mlp" | "attention"


def _back(a: Any) -> tuple:
  """``(v, chain)``: ``a`` back through re-indexing and casts of one array
  operand, with the nodes passed, ``v``'s first."""
  chain = []
  while isinstance(a, Val) and a.producer is not None:
    node = a.producer
    vals = [b for b in node.ins if isinstance(b, Val)]
    if not rule_for(node.prim).reindex or len(vals) != 1:
      break
    chain.append(node)
    a = vals[0]
  return a, tuple(reversed(chain))


def _activated(v: Any, depth: int) -> bool:
  """``v`` is an elementwise function (sums, products, casts of same-shaped
  values) of the output of an activation rule: a GELU, SiLU or ReLU output.
  A norm's output is not: its nonlinearity (rsqrt) reaches it broadcast."""
  node = getattr(v, "producer", None)
  if node is None or depth == 0:
    return False
  rule = rule_for(node.prim)
  if rule.activation:
    return True
  if not (rule.arith or rule.reindex == "convert" or rule.kind == "identity"):
    return False
  return any(_activated(b, depth - 1) for b in node.ins if isinstance(b, Val) and b.shape == v.shape)


def _kind(level: Level, a: Any) -> Optional[str]:
  """``"attention"``, ``"mlp"`` or None for the activation operand ``a``."""
  v, _ = _back(a)
  node = getattr(v, "producer", None)
  if node is None:
    return None
  if rule_for(node.prim).contraction(node) is not None and all(
      param_operand(level, b) is None for b in node.ins):
    return "attention"
  return "mlp" if _activated(v, _DEPTH) else None


def _sites(level: Level, where: tuple) -> list:
  out = []
  for node in level.program.nodes:
    if len(node.ins) != 2 or rule_for(node.prim).contraction(node) is None:
      continue
    for w in (0, 1):
      hit = param_operand(level, node.ins[w])
      if hit is None or param_operand(level, node.ins[1 - w]) is not None:
        continue
      kind = _kind(level, node.ins[1 - w])
      if kind in where:
        out.append(_Site(node, 1 - w, hit[0], hit[1], kind))
      break
  return out


# ----------------------------------------------------------------------------
# The proof.


def _order(n: int) -> str:
  m, p2 = hadamard_factorization(n)
  return f"H_{p2}" if m == 1 else f"H_{m}⊗H_{p2}"


def _through(chain: tuple, state: Any, level: Level) -> Any:
  """The state after ``chain`` (single-operand steps) of a value with ``state`` (None: blocked)."""
  for node in chain:   # (each node's one array operand is the value before it)
    try:
      state = rule_for(node.prim).rotate(node, [state if isinstance(b, Val) else None for b in node.ins],
                                         level)[0]
    except Block:
      return None
  return state


def _leaf_dims(site: _Site, axes: tuple, level: Level) -> Optional[tuple]:
  """The leaf dims whose rotation rotates the weight operand along the dims
  paired with ``axes`` (the activation's contracted axes), or None."""
  node = site.node
  dd = rule_for(node.prim).contraction(node)
  mine, other = dd.contracting(site.act), dd.contracting(1 - site.act)
  want = frozenset(other[mine.index(a)] for a in axes)
  leaf = level.program.invars[site.leaf]
  dims = frozenset(_dim_before(leaf, site.chain, c, level) for c in want)
  if None in dims or len(dims) != len(want):
    return None
  return tuple(sorted(dims)) if _through(site.chain, Lin(dims), level) == Lin(want) else None


def _prove(level: Level, seeds: dict, online: dict) -> Optional[str]:
  """None when rotating leaf ``i`` along ``seeds[i]`` and operand ``k`` of the
  equation at ``path`` along ``online[(path, k)]`` leaves every program output
  unchanged (the rules' rotate facets); else the reason."""
  prog = level.program
  states = {prog.invars[i]: Lin(frozenset(d)) for i, d in seeds.items()}
  if any(v in prog.output_positions for v in states):
    return "the weight is a program output"
  for node in prog.nodes:
    ins = [states.get(a) if isinstance(a, Val) else None for a in node.ins]
    for k in range(len(ins)):
      axes = online.get((node.path, k))
      if axes is not None:
        # (rotations along different axes commute: an operand rotated offline along
        # the head dim, per head, is rotated online across the heads)
        done = ins[k].dims if isinstance(ins[k], Lin) else frozenset()
        if ins[k] is not None and (not isinstance(ins[k], Lin) or done & set(axes)):
          return f"the operand rotated online is already rotated along that dim [at {node.where()}]"
        ins[k] = Lin(done | frozenset(axes))
    if all(s is None for s in ins):
      continue
    try:
      outs = rule_for(node.prim).rotate(node, ins, level)
    except Block as err:   # (a Want too: a use of the weight that is not rotated online)
      return f"another use of the weight is not rotated the same way: {err} [at {node.where()}]"
    why = advance(prog, node, outs, states)
    if why is not None:
      return why
  return None


class _Option(NamedTuple):
  """One way to rotate a site: the parameters' leaf dims and the axes rotated online."""
  seeds: tuple       # ((leaf, dims), ...): the weight's, and for attention's per-head part V's
  axes: tuple        # the activation's axes rotated online
  entry: OnlineSite  # its report entry once proved


class _Planned(NamedTuple):
  """One site's proposal: its options, best first (none: ``entry`` says why)."""
  site: _Site
  options: tuple
  entry: OnlineSite


def _dim_before(v: Any, chain: tuple, dim: int, level: Level) -> Optional[int]:
  """The one dim of ``v`` that ``chain`` carries whole to ``dim``, or None."""
  out_size = v.shape[dim] if not chain else chain[-1].outs[0].shape[dim]
  found = [e for e in range(len(v.shape)) if v.shape[e] == out_size
           and _through(chain, Lin(frozenset({e})), level) == Lin(frozenset({dim}))]
  return found[0] if len(found) == 1 else None


def _writers(level: Level, a: Any, dim: int, depth: int = 4) -> Optional[dict]:
  """``{leaf: dims}``: the parameters whose rotation rotates ``a`` along
  ``dim``: a contraction with a parameter (V's projection), plus a parameter
  bias. A proposal only: ``_prove`` checks it."""
  v, chain = _back(a)
  g = _dim_before(v, chain, dim, level)
  node = getattr(v, "producer", None)
  if g is None or node is None or depth == 0:
    return None
  rule = rule_for(node.prim)
  dd = rule.contraction(node)
  if dd is not None:
    side, k = dd.owner.get(g, (None, None))
    hit = None if side is None else param_operand(level, node.ins[side])
    if hit is None:
      return None
    d = _dim_before(level.program.invars[hit[0]], hit[1], k, level)
    return None if d is None else {hit[0]: (d,)}
  if rule.arith != "+":
    return None
  out: dict = {}
  for b in node.ins:
    if not isinstance(b, Val):
      continue
    hit = param_operand(level, b)
    if hit is not None:
      d = _dim_before(level.program.invars[hit[0]], hit[1], g, level)
      sub = None if d is None else {hit[0]: (d,)}
    else:
      sub = _writers(level, b, g, depth - 1)
    if sub is None:
      return None
    out.update(sub)
  return out


def _per_head(site: _Site, axes: tuple, dims: tuple, level: Level, names: tuple,
              entry: OnlineSite) -> Optional[_Option]:
  """QuaRot's attention split, where the output projection contracts heads and
  head dims as separate axes: V's projection (and bias) rotated per head along
  the head dim offline (attention probabilities mix tokens, not features), the
  heads rotated online (the weight is rotated along both, ``dims``)."""
  if site.kind != "attention" or len(axes) < 2:
    return None
  act = site.node.ins[site.act]
  v, chain = _back(act)
  pv = getattr(v, "producer", None)
  pdd = None if pv is None else rule_for(pv.prim).contraction(pv)
  if pdd is None:
    return None
  for a in axes:
    e = _dim_before(v, chain, a, level)
    side, f = pdd.owner.get(e, (None, None)) if e is not None else (None, None)
    writers = None if side is None else _writers(level, pv.ins[side], f)
    if not writers or site.leaf in writers:
      continue
    rest = tuple(x for x in axes if x != a)
    labels = ", ".join(param_label(names[i]) for i in sorted(writers))
    return _Option(((site.leaf, dims),) + tuple(sorted(writers.items())), rest, dataclasses.replace(
        entry, width=int(np.prod([act.shape[x] for x in rest])), order=" × ".join(_order(act.shape[x]) for x in rest),
        reason=f"online across heads; per head offline: {labels} and the weight by {_order(act.shape[a])} "
               "along the head dim"))
  return None


def _propose(site: _Site, level: Level, names: tuple) -> _Planned:
  node = site.node
  dd = rule_for(node.prim).contraction(node)
  a = node.ins[site.act]
  axes, orders, skipped = [], [], []
  for ax in dd.contracting(site.act):
    n = a.shape[ax]
    if n < 2:
      continue
    try:
      orders.append(_order(n))
      axes.append(ax)
    except ValueError as err:
      skipped.append(f"width {n}: {str(err).split(':', 2)[-1].strip()}")
  width = int(np.prod([a.shape[x] for x in (axes or dd.contracting(site.act))]))
  entry = OnlineSite(names[site.leaf], site.kind, width, " × ".join(orders), False, "", node.where())
  if not axes:
    return _Planned(site, (), dataclasses.replace(
        entry, reason="no Hadamard construction for the contracted width (" + "; ".join(skipped) + ")"))
  dims = _leaf_dims(site, tuple(axes), level)
  if dims is None:
    return _Planned(site, (), dataclasses.replace(
        entry, reason="the contracted dim of the weight is not one whole dim of the parameter"))
  how = _PLAIN + ("; not along " + "; ".join(skipped) if skipped else "")
  if site.kind == "attention":   # (said where QuaRot's per-head offline part was not proved)
    how += ("; no per-head offline part: the projection reads the heads merged into one axis" if len(axes) < 2
            else "; no per-head offline part: V's projection is not provably rotated per head")
  online = _Option(((site.leaf, dims),), tuple(axes), dataclasses.replace(entry, reason=how))
  head = _per_head(site, tuple(axes), dims, level, names, entry)
  return _Planned(site, (head, online) if head is not None else (online,), entry)


def _merge(seeds: dict, options: list) -> Optional[dict]:
  """``seeds`` with every option's, or None where two rotate a leaf along different dims."""
  out = dict(seeds)
  for o in options:
    for i, d in o.seeds:
      if out.setdefault(i, d) != d:
        return None
  return out


class OnlineAnalysis(NamedTuple):
  """One signature analysed: the program, the plan and what it rotates."""
  jaxpr: Any
  consts: list
  out_tree: Any
  plan: Plan
  key: tuple       # ((leaf, dims), ...): the weights rotated, sorted
  report: OnlineReport


def analyse(fn: Callable, params: Any, args: tuple, where: tuple) -> OnlineAnalysis:
  """The online Hadamards of ``fn(params, *args)`` at ``where``, each proved
  exact with the weights it rotates; the sites refused say why."""
  traced = pipeline.trace(fn, params, args, RotateError)
  with pipeline.analyzer(traced) as an:
    level = an.top
    planned = [_propose(s, level, traced.names) for s in _sites(level, where)]
    by_leaf: dict = {}   # sites sharing a weight are rotated together or not at all
    for p in planned:
      if p.options:
        by_leaf.setdefault(p.site.leaf, []).append(p)
    seeds: dict = {}
    online: dict = {}
    chosen: dict = {}    # id(planned) -> the option proved, or the reason none was
    for group in by_leaf.values():
      why = ""
      for choice in range(max(len(p.options) for p in group)):
        picks = [p.options[min(choice, len(p.options) - 1)] for p in group]
        trial_seeds = _merge(seeds, picks)
        if trial_seeds is None:
          why = "two contractions read the weight along different dims"
          continue
        trial = dict(online)
        trial.update({(p.site.node.path, p.site.act): o.axes for p, o in zip(group, picks)})
        why = _prove(level, trial_seeds, trial)
        if why is None:
          seeds, online = trial_seeds, trial
          chosen.update({id(p): o for p, o in zip(group, picks)})
          break
      else:
        chosen.update({id(p): why for p in group})
  entries = []
  for p in planned:
    got = chosen.get(id(p))
    if isinstance(got, _Option):
      entries.append(dataclasses.replace(got.entry, rotated=True))
    else:
      entries.append(p.entry if got is None else dataclasses.replace(p.entry, reason=got))
  plan = Plan(hadamards=tuple(OperandMap(path, k, ax) for (path, k), axes in sorted(online.items())
                              for ax in axes))
  key = tuple(sorted((i, tuple(d)) for i, d in seeds.items()))
  report = OnlineReport(tuple(entries), tuple((traced.names[i], d) for i, d in key))
  return OnlineAnalysis(traced.jaxpr, traced.consts, traced.out_tree, plan, key, report)


# ----------------------------------------------------------------------------
# The weights and the apply function.


def _times_hadamard(x: Any, dims: tuple) -> jax.Array:
  """``x`` multiplied by the normalized Hadamard matrix along each of ``dims``
  (in float64, then cast back)."""
  y = np.asarray(x, np.float64)
  for d in dims:
    y = np.moveaxis(np.tensordot(y, hadamard(y.shape[d]), axes=([d], [0])), -1, d)
  return jnp.asarray(y.astype(x.dtype))


class _OnlineRecord(NamedTuple):
  """A saved online_hadamard step, decoded."""
  where: tuple
  key_sha256: str
  num_rotated: int


def _where(where: Any) -> tuple:
  where = (where,) if isinstance(where, str) else tuple(where)
  bad = [w for w in where if w not in WHERE]
  if bad or not where:
    raise RotateError(f"online_hadamard: where must name some of {WHERE}, got {where!r}")
  return where


@register
class OnlineApply(Step):
  """The apply function with online Hadamards: re-traces the model per input
  signature, proves the same weights rotated, and runs the rewritten program."""

  error = RotateError
  kind = "online_hadamard"

  def __init__(self, inner: Callable, params_abstract: Any, base: OnlineAnalysis, where: tuple,
               args: tuple, kwargs: Optional[dict] = None):
    super().__init__(inner, params_abstract, args, kwargs)
    self._base, self._where = base, where
    self._tree = jax.tree_util.tree_structure(params_abstract)
    self.seed(self.bind(args, kwargs), base)

  @property
  def where(self) -> tuple:
    """The kinds of contraction this step rotates (``"mlp"``, ``"attention"``)."""
    return self._where

  def record(self) -> StepRecord:
    info = {"name": self.kind, "where": list(self._where), "key_sha256": digest(self._base.key),
            "num_rotated": self._base.report.num_rotated}
    return StepRecord(info, {})

  @classmethod
  def parse(cls, info: dict, decode: Callable[[Any], Any]) -> _OnlineRecord:
    return _OnlineRecord(_where(info["where"]), str(info["key_sha256"]), int(info["num_rotated"]))

  @classmethod
  def restore(cls, inner: Callable, params: Any, parsed: _OnlineRecord, ctx: RestoreContext) -> Restored:
    args = tuple(ctx.args)
    call = pipeline.bind(inner, args, ctx.kwargs, ctx.error)
    an = analyse(call.fn, params, call.abstract_args(ctx.error), parsed.where)
    if ctx.verify and (digest(an.key) != parsed.key_sha256 or an.report.num_rotated != parsed.num_rotated):
      raise ctx.refuse(f"online_hadamard ({an.report.num_rotated} contractions rotated now, "
                       f"{parsed.num_rotated} when saved)")
    return Restored(cls(inner, params, an, parsed.where, args, ctx.kwargs), an.report, None)

  def _analyse(self, call: Call) -> OnlineAnalysis:
    an = analyse(call.fn, self._params, call.abstract_args(RotateError), self._where)
    if an.key != self._base.key:
      raise RotateError(f"inputs of these shapes ({pipeline.shapes_text(call.args)}) rotate other weights "
                        "online than the example's; call online_hadamard again for them")
    return an

  def __call__(self, params, *args, **kwargs):
    call = self.bind(args, kwargs)
    return compiled.run_on(self._cached(call), self._tree, params, call.args, {}, RotateError,
                           "params do not have the structure of the online_hadamard result's params")


def online_hadamard(model: Any, *example_args: Any, where: Any = WHERE) -> Online:
  """QuaRot's online Hadamards before the MLP's down-projection and attention's output projection.

  ``model`` is a result of ``fold``, ``fuse_affine``, ``defer_norms`` or
  ``rotate`` (anything with ``params`` and ``apply_fn``; pass ``example_args``
  when its apply function does not record them). At each contraction ``where``
  selects (``"mlp"``: the weight reads an activation such as GELU, SiLU or ReLU;
  ``"attention"``: it reads the heads, probabilities × V), the program computes
  ``x H`` (a fast Walsh–Hadamard transform along the contracted dim) and the
  weight becomes ``Hᵀ W``: ``(x H)(Hᵀ W) = x W``, proved on the program for
  every use of the weight. Sites whose width has no Hadamard construction, or
  whose weight has another use, are skipped; ``report`` lists every site.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxfold
    >>> class MLP(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return nn.Dense(4)(nn.gelu(nn.Dense(16)(nn.LayerNorm()(x))))
    >>> m = MLP(); x = jnp.ones((2, 4)); p = m.init(jax.random.PRNGKey(0), x)
    >>> r = jaxfold.online_hadamard(jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x)))
    >>> r.report.num_rotated
    1
    >>> bool(jnp.allclose(r.apply_fn(r.params, x), m.apply(p, x), atol=1e-5))
    True
  """
  where = _where(where)
  kwargs = pipeline.model_kwargs(model, example_args)
  params, fn, example_args = pipeline.model_parts(
      model, example_args, "online_hadamard takes a model with params and apply_fn (jaxfold.Fused)", RotateError)
  abstract = pipeline.abstract_tree(params, RotateError)
  call = pipeline.bind(fn, tuple(example_args), kwargs, RotateError)
  an = analyse(call.fn, abstract, call.abstract_args(RotateError), where)
  leaves, tree = jax.tree_util.tree_flatten(params)
  dims = dict(an.key)
  new = [_times_hadamard(x, dims[i]) if i in dims else x for i, x in enumerate(leaves)]
  apply = OnlineApply(fn, abstract, an, where, example_args, kwargs)
  return Online(jax.tree_util.tree_unflatten(tree, new), apply, an.report)
