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
  rewrite cannot see values across one).

Anything else keeps the site as fused (normalized) and the report names the
reader and the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp
from jax import lax

from jaxfold._src import algebra as A
from jaxfold._src import compat
from jaxfold._src.analysis import factor_leaf, vector_along
from jaxfold._src.program import Val
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


# Single-operand steps that only move or convert elements (the rules'
# ``reindex`` role): they commute with an elementwise product, so
# chain(x ⊙ s) = chain(x) ⊙ chain(s).
_REINDEX = ("move", "convert")
_CONE_DEPTH = 8


def _leaf_vector(level, fid: int, leaf: int, dim: int, shape: tuple) -> bool:
  lv = factor_leaf(fid, level)
  return lv is not None and lv[0] == leaf and vector_along(lv[1], shape) == dim


def _cone(level, y) -> tuple:
  """Values within ``_CONE_DEPTH`` producers of ``y`` (BFS order) and the
  values just beyond them."""
  order, seen, frontier = [y], {y}, [y]
  for _ in range(_CONE_DEPTH):
    nxt = []
    for v in frontier:
      node = v.producer
      if node is None or node.subs:
        continue
      for a in node.ins:
        if isinstance(a, Val) and a not in seen:
          seen.add(a)
          order.append(a)
          nxt.append(a)
    frontier = nxt
  return order, frontier


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
  order, boundary = _cone(level, y)
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


def analyse(level, accepted: list, names: list, modified: set, fuse_sites: list) -> tuple:
  """``(entries, sites)`` for fused sites ``accepted`` (``(affine, readers)``
  pairs); ``modified``: paths of the nodes the fused plan changes;
  ``fuse_sites``: every affine site (those not fused are not deferred either)."""
  entries, sites = [], []
  for aff, readers in accepted:
    where = aff.y.producer.where()
    labels = tuple(names[r.leaf] for r in readers)
    mine = []
    try:
      x, s, invert = _statistic(level, aff)
      region = _region(level, aff.y, {x, s})
      if region is None or any(n.path in modified for n in region):
        raise Block("the fused plan changes an operation between its input and its output")
      for r in readers:
        tag = f"reader {param_label(names[r.leaf])} [at {r.node.where()}]: "
        try:
          chain = _chain(level, r, aff.y, s, aff.dim)
          for v in (x, s):
            if not _remats(v.producer) <= _remats(r.node):
              raise Block("a remat boundary separates it from the norm's input")
        except Block as err:
          raise Block(tag + str(err)) from err
        mine.append(Deferred(r.node.path, 1 - r.w_side, x.key, s.key, aff.y.shape, chain,
                             r.y_dim, invert))
    except Block as err:
      sites.append(DeferSite(where, labels, False, f"not deferred: {err}"))
      continue
    entries += mine
    sites.append(DeferSite(where, labels, True,
                           f"deferred: {', '.join(map(param_label, labels))} read the "
                           "un-normalized input, outputs scaled by the per-row statistic"))
  # One row per affine site, in fuse's order.
  mine, out = iter(sites), []
  for f in fuse_sites:
    out.append(next(mine) if f.fused else DeferSite(f.where, (), False, "not deferred: " + f.reason))
  return tuple(entries), tuple(out)


# ----------------------------------------------------------------------------
# The rewrite.


def run(entry: Deferred, eqn: Any, invals: list, values: dict) -> Optional[list]:
  """The contraction on ``x`` scaled by ``s``; None (compute it as written)
  when ``x`` or ``s`` was not recorded."""
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
