"""TransformerLens's two remaining weight edits, proved on the program (``fuse_affine`` options).

* ``center_unembed``: a contraction ``logits = x·W_U (+ b_U)`` whose output shift along W_U's
  free (vocabulary) dim reaches nothing but a softmax / log_softmax / argmax along that dim or a
  program output: W_U (and b_U, and the β·W_U bias ``fuse_affine`` made there) are centered along
  it. Proved with the fold's shift analysis (``Level.collect``): every output the shift reaches
  changes by a value constant along the dims the report names (a per-row constant on the
  logits), so softmax probabilities and the argmax along them are exact; raw logits are not.
* ``fold_value_biases``: an attention-weighted sum ``z = Σ_k A[.., k] V[.., k, ..]`` whose
  weights are proved to be rows of a softmax (``A = N / D`` with ``Σ_k N = D``: exact canonical
  forms, masked softmax included) and whose ``V = R + view(b_V)`` with ``b_V`` a parameter
  constant along the key dim: then ``z = A·R + b_V`` (rows sum to one), and where ``z`` reaches
  only a contraction against a parameter ``W_O`` over ``b_V``'s dims (through re-indexing steps),
  ``b_V`` goes into a new bias ``b_V·W_O`` of that contraction's output and its entries of the
  parameter become 0. Exact for every output in real arithmetic. Refused with the reason
  otherwise (dropout on the probabilities, weights that are not a quotient by their own sum,
  ``b_V``'s entries read elsewhere, ``z`` read by anything but such a contraction).

Both are computed on the folded program ``fuse_affine`` analyses, after its own fusions, and
applied to the fused parameters (``apply``).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from jaxfold._src import algebra as A
from jaxfold._src import compat
from jaxfold._src.analysis import Level, factor_leaf, param_operand, single_use
from jaxfold._src.program import Val
from jaxfold._src.report import param_label
from jaxfold._src.rules import Block, rule_for
from jaxfold._src.rules.rotation import Lin


@dataclasses.dataclass(frozen=True)
class TLSite:
  """One TransformerLens edit considered: where, on which parameters, done or why not."""
  edit: str            # "center_unembed" | "fold_value_biases"
  where: str
  params: tuple        # parameter names involved
  done: bool
  reason: str          # what the edit preserves, or why it was refused


@dataclasses.dataclass(frozen=True)
class TLEdits:
  """The parameter edits of the proved sites (all keyed by leaf index or extras name)."""
  center: tuple = ()     # ((("leaf", i) | ("extra", name), dim), ...): subtract the mean along dim
  copies: tuple = ()     # ((name, leaf index), ...): new untied copies (then centered)
  untied: tuple = ()     # Plan.untied entries for the copies
  zeroed: tuple = ()     # ((leaf index, flat indices), ...): b_V entries set to 0
  vbiases: tuple = ()    # ((name, out key, spec), ...): new biases b_V·W_O (spec: see _vbias_value)
  sites: tuple = ()

  @property
  def key(self) -> tuple:
    # (no equation paths: a trace at another shape numbers equations differently)
    return (self.center, self.copies, self.zeroed,
            tuple((n, s[0], s[6], s[7], s[11], s[12] and (s[12][0], s[12][4])) for n, _, s in self.vbiases))

  @property
  def extra_names(self) -> tuple:
    """The names of the new parameters (untied copies, new biases) the edits add."""
    return tuple(n for n, _ in self.copies) + tuple(n for n, _, _ in self.vbiases)

  @property
  def plan_biases(self) -> tuple:
    return tuple((key, name) for name, key, _ in self.vbiases)

  def __str__(self) -> str:
    return "\n".join(f"{s.edit:17} {'done' if s.done else 'kept':4}  {s.where}: {s.reason}" for s in self.sites)


# ----------------------------------------------------------------------------
# Shared helpers.


def _through(level: Level, chain: tuple, dims: frozenset) -> Optional[frozenset]:
  """Where the dims ``dims`` of a chain's input end up at its output (rotation facets)."""
  state = Lin(frozenset(dims))
  try:
    for node in chain:
      (state,) = rule_for(node.prim).rotate(node, [state], level)
  except Block:
    return None
  return state.dims if isinstance(state, Lin) else None


def _seed(shape: tuple, const_dims: frozenset):
  """A shift constant along ``const_dims`` and arbitrary along the others."""
  return A.pure(tuple(None if (d in const_dims or n == 1) else (None, 1) for d, n in enumerate(shape)))


def _outputs_shift(level: Level, seeds: dict) -> dict:
  """``{output position: constant dims}`` of the shift ``seeds`` at the outputs it reaches;
  raises Block where anything else sees it (a nonlinearity, a contraction over it...)."""
  out = {}
  for k, p in level.collect(seeds).items():
    if p is None:
      continue
    if not p.is_pure:
      raise Block(f"program output #{k} sees the shift through a product (not a shift of the output)")
    out[k] = frozenset(d for d, e in enumerate(p.dims) if e is None)
  return out


# ----------------------------------------------------------------------------
# center_unembed.


def _unembed_sites(level: Level, names: tuple, fused: dict) -> tuple:
  """(TLEdits fields, sites) for center_unembed. ``fused`` describes fuse_affine's result:
  ``untied`` {(use path, operand): copy name}, ``scaled`` {leaf}, ``biases`` {out key: name}."""
  prog = level.program
  outs_shapes = [getattr(v, "shape", ()) for v in prog.outvars]
  center, copies, untied, sites = [], [], [], []
  seen_leaves: dict = {}
  for node in prog.nodes:
    dd = rule_for(node.prim).contraction(node)
    if dd is None or dd.lb:
      continue
    for side in (0, 1):
      src = param_operand(level, node.ins[side])
      if src is None:
        continue
      leaf, chain = src
      free = dd.free[side]
      if len(free) != 1:
        continue
      (o,) = [od for od, (s, d) in dd.owner.items() if s == side]
      z = node.outs[0]
      # An unembedding: a contraction against a parameter that no later one reads.
      if z.shape[o] == 1 or not _final(level, z):
        continue
      wname = names[leaf]
      where = node.where()
      try:
        reached = _outputs_shift(level, {z: _seed(z.shape, frozenset({o}))})
      except Exception as err:  # noqa: BLE001 - a rule that cannot decide blocks
        sites.append(TLSite("center_unembed", where, (wname,), False, f"not centered: {err}"))
        continue
      bad = [k for k, c in reached.items() if not (c - {d for d, n in enumerate(outs_shapes[k]) if n == 1})]
      if bad:
        sites.append(TLSite("center_unembed", where, (wname,), False,
                            f"not centered: program output #{bad[0]} would change by a value that "
                            "varies along every dim"))
        continue
      # W's dim that becomes output dim o, through the chain.
      e = dd.free[side][0]
      wdims = [d for d in range(len(prog.invars[leaf].shape))
               if _through(level, chain, frozenset({d})) == frozenset({e})]
      if len(wdims) != 1:
        sites.append(TLSite("center_unembed", where, (wname,), False,
                            "not centered: the vocabulary dim is not one dim of the parameter"))
        continue
      wd = wdims[0]
      if leaf in seen_leaves:
        continue
      seen_leaves[leaf] = True
      copy = fused["untied"].get((node.path, side))
      if copy is not None:
        if fused["copy_uses"].get(copy, 0) != 1:
          sites.append(TLSite("center_unembed", where, (wname,), False,
                              "not centered: its fused copy is shared with another reader"))
          continue
        target = ("extra", copy)
      elif single_use(level, leaf, chain, (node, side)):
        target = ("leaf", leaf)
      else:
        cname = f"{wname}@unembed"
        copies.append((cname, leaf))
        untied.append((node.path, side, cname, tuple(c.eqn for c in chain)))
        target = ("extra", cname)
      center.append((target, wd))
      what = [param_label(wname)]
      # fuse_affine's β·W bias at this output: the same shift, centered alike.
      bname = fused["biases"].get(z.key)
      if bname is not None:
        center.append((("extra", bname), o))
        what.append(bname)
      # b_U: a parameter vector along o added to z (seeded at the leaf: all its uses).
      kept = ""
      for b in _added_vectors(level, z, o):
        try:
          breach = _outputs_shift(level, {prog.invars[b]: _seed(prog.invars[b].shape, frozenset(
              range(len(prog.invars[b].shape))))})
        except Exception as err:  # noqa: BLE001 - a rule that cannot decide blocks
          kept = f"; {param_label(names[b])} kept: {err}"
          continue
        center.append((("leaf", b), _vec_dim(prog.invars[b].shape)))
        what.append(param_label(names[b]))
        for k, c in breach.items():
          reached[k] = reached.get(k, c) & c
      outs = "; ".join(f"output #{k} changes by a value constant along its dim(s) {sorted(c)}"
                       for k, c in sorted(reached.items())) or "no output sees the shift (exact)"
      sites.append(TLSite(
          "center_unembed", where, tuple(what), True,
          f"centered {', '.join(what)} along the vocabulary dim (output dim {o}): {outs} — softmax "
          f"probabilities and argmax along it are exact, raw logits are shifted per row{kept}"))
  return tuple(center), tuple(copies), tuple(untied), sites


def _final(level: Level, z: Val, limit: int = 20000) -> bool:
  """No contraction against a parameter reads anything computed from ``z``."""
  reached = _downstream(level, z, limit)
  if reached is None:
    return False
  return not any(rule_for(node.prim).contraction(node) is not None
                 and any(param_operand(level, a) is not None for a in node.ins)
                 for v in reached for node, _ in level.program.consumers.get(v, ()))


def _vec_dim(shape: tuple) -> int:
  big = [d for d, n in enumerate(shape) if n != 1]
  return big[0] if big else len(shape) - 1


def _added_vectors(level: Level, z: Val, o: int) -> list:
  """Parameter leaves added to ``z`` (an add reading it) as vectors along ``o`` only."""
  out = []
  for node, k in level.program.consumers.get(z, ()):
    if rule_for(node.prim).arith != "+" or len(node.ins) != 2:
      continue
    other = node.ins[1 - k]
    for m, c in level.canon(other).terms.items():
      if len(m) != 1 or c != 1:
        continue
      lv = factor_leaf(m[0], level)
      if lv is None:
        continue
      view = lv[1]
      varying = [d for d, s in enumerate(view.strides) if s != 0]
      if varying == [o] and len(level.canon(other).terms) == 1:
        out.append(lv[0])
  return out


# ----------------------------------------------------------------------------
# fold_value_biases.


def rows_sum_to_one(level: Level, a: Any, k: int) -> Optional[str]:
  """None when ``Σ_k a = 1`` is proved: ``a`` (through real casts) is a quotient ``N / D`` (the
  rules' "/" facet) with ``D`` constant along ``k`` and ``Σ_k N`` equal to ``D`` as exact canonical
  forms (a softmax, masked or not); else what was found instead."""
  while isinstance(a, Val) and a.producer is not None and _real_cast(a.producer):
    a = a.producer.ins[0]
  if not isinstance(a, Val) or a.producer is None:
    return "the weights are not computed in the program"
  node = a.producer
  if rule_for(node.prim).arith != "/":
    return f"the weights are `{node.prim.name}` of something, not a quotient by their own sum"
  n, d = node.ins
  if not isinstance(n, Val) or not isinstance(d, Val) or len(d.shape) != len(n.shape):
    return "the weights' divisor is not a per-row sum"
  try:
    sn = A.reduce_sum(level.canon(n), (k,), n.shape)
    sd = A.reduce_sum(level.canon(d), (k,), d.shape)
    if d.shape[k] != 1:
      if not level.constant_along(d, (k,), d.shape):
        return "the weights' divisor varies along the summed dim"
      sd = A.scale(sd, Fraction(1, d.shape[k]))
  except A.Unrepresentable as err:
    return f"the weights' row sums are too large to compare ({err})"
  if sn != sd:
    return "the weights' divisor is not their numerator's sum along the key dim"
  return None


def _real_cast(node) -> bool:
  """A float cast to at least bfloat16's precision (the identity in real arithmetic)."""
  cast = rule_for(node.prim).cast
  if cast is None or len(node.ins) != 1 or tuple(node.ins[0].shape) != tuple(node.outs[0].shape):
    return False
  bits = cast(node.params, node.ins[0].dtype, node.outs[0].dtype)
  return bits is not None and bits[0] >= 7 and bits[1] >= 5


def _view_indices(view: A.View, shape: tuple) -> np.ndarray:
  """The flat source index each element of a view reads."""
  idx = np.full(tuple(int(n) for n in shape), view.offset, np.int64)
  for d, s in enumerate(view.strides):
    if s:
      r = [1] * len(shape)
      r[d] = int(shape[d])
      idx = idx + s * np.arange(int(shape[d])).reshape(r)
  return idx


def _src_view(fid: int, src: Val) -> Optional[A.View]:
  """The view through which factor ``fid`` reads value ``src`` directly (else None)."""
  f = A.factor(fid)
  if f.kind == "atom" and f.key is src:
    return A.View.identity(f.shape)
  if f.kind == "view" and A.factor(f.args[0]).kind == "atom" and A.factor(f.args[0]).key is src:
    return f.key
  return None


_NONE = np.zeros(0, np.int64)


def _reads(e: A.Expr, src: Val, banned: set, memo: dict) -> Optional[np.ndarray]:
  """Flat indices of ``src`` (a parameter or a value) that ``e`` reads, sorted and unique
  (None: read opaquely, through a value computed from it)."""
  parts = []
  for m in e.terms:
    for f in m:
      r = _factor_reads(f, src, banned, memo)
      if r is None:
        return None
      parts.append(r)
  return np.unique(np.concatenate(parts)) if parts else _NONE


def _factor_reads(fid: int, src: Val, banned: set, memo: dict) -> Optional[np.ndarray]:
  if fid in memo:
    return memo[fid]
  f = A.factor(fid)
  view = _src_view(fid, src)
  if view is not None:
    out = np.unique(_view_indices(view, f.shape))
  elif f.kind == "atom":
    out = None if (isinstance(f.key, Val) and f.key in banned) else _NONE
  elif f.kind == "view":
    out = _factor_reads(f.args[0], src, banned, memo)
  else:
    parts = []
    for a in f.args:
      r = _reads(a, src, banned, memo) if isinstance(a, A.Expr) else _NONE
      if r is None:
        parts = None
        break
      parts.append(r)
    out = None if parts is None else (np.unique(np.concatenate(parts)) if parts else _NONE)
  memo[fid] = out
  return out


def _meets(r: np.ndarray, s: np.ndarray) -> bool:
  """Two sorted unique index arrays share an index."""
  return bool(r.size and s.size and np.intersect1d(r, s, assume_unique=True).size)


def _downstream(level: Level, src: Val, limit: int = 1 << 22) -> Optional[set]:
  """Every value computed from ``src`` (itself included); None past ``limit`` values."""
  prog = level.program
  seen, frontier = {src}, [src]
  while frontier:
    v = frontier.pop()
    for node, _ in prog.consumers.get(v, ()):
      for o in node.outs:
        if o not in seen:
          seen.add(o)
          frontier.append(o)
          if len(seen) > limit:
            return None
  return seen


def _only_into(level: Level, src: Val, s: np.ndarray, v: Val) -> Optional[str]:
  """None when setting ``src``'s entries ``s`` to zero changes no value but ``v`` (walking
  forwards from ``src``, a value whose exact canonical form reads none of ``s`` stops the
  walk), and ``v`` only through one view: else why not."""
  prog = level.program
  banned = _downstream(level, src)
  if banned is None:
    return "the bias reaches too much of the program to follow"
  memo: dict = {}
  frontier, seen = [src], set()
  while frontier:
    u = frontier.pop()
    for node, _ in prog.consumers.get(u, ()):
      if node.subs:
        return f"the bias enters `{node.prim.name}` [at {node.where()}]"
      for o in node.outs:
        if o in seen or o is v:
          continue
        seen.add(o)
        r = _reads(level.canon(o), src, banned, memo)
        if r is not None and not _meets(r, s):
          continue
        if o in prog.output_positions:
          return f"the value bias also reaches program output #{prog.output_positions[o][0]}"
        frontier.append(o)
  return None


def _bias_source(level: Level, v: Val, term: tuple, src: Val, s: Optional[np.ndarray] = None) -> Optional[str]:
  """None when ``v``'s canonical form reads ``src`` only through its term ``term`` (a view of
  ``src``, coefficient 1) and setting the entries ``s`` of ``src`` (default: what that term
  reads) to zero changes no other value."""
  e = level.canon(v)
  view = _src_view(term[0], src)
  if s is None:
    s = np.unique(_view_indices(view, v.shape))
  banned = _downstream(level, src)
  if banned is None:
    return "the bias reaches too much of the program to follow"
  rest = A.sub(e, A.Expr({term: e.terms[term]}, e.shape))
  rr = _reads(rest, src, banned, {})
  if rr is None or _meets(rr, s):
    return "the rest of the value reads the same bias entries"
  return _only_into(level, src, s, v)


def _value_bias_sites(level: Level, names: tuple, fused: dict, base_plan_biases: set) -> tuple:
  """(zeroed, vbiases, sites) for fold_value_biases."""
  prog = level.program
  zeroed, vbiases, sites = [], [], []
  taken: set = set()
  for node in prog.nodes:
    dd = rule_for(node.prim).contraction(node)
    if dd is None:
      continue
    for vs in (0, 1):
      kv = dd.contracting(vs)
      ka = dd.contracting(1 - vs)
      if len(kv) != 1:
        continue
      v0 = node.ins[vs]
      if not isinstance(v0, Val) or v0.shape[kv[0]] == 1:
        continue
      v = _uncast(level, v0)   # (a real cast of V, e.g. to float32 for the attention sum)
      found = _bias_term(level, v, kv[0])
      if found is None:
        continue
      b, view, term = found
      if b in taken:
        continue
      bname = names[b]
      where = node.where()
      why = rows_sum_to_one(level, node.ins[1 - vs], ka[0])
      if why is not None:
        sites.append(TLSite("fold_value_biases", where, (bname,), False,
                            f"not folded: the attention weights are not proved to be rows of a softmax: {why}"))
        continue
      s = np.unique(_view_indices(view, v.shape))
      why = None
      if any(len(prog.consumers.get(u, ())) != 1 or u in prog.output_positions for u in _cast_chain(v, v0)):
        why = "the value is also read elsewhere (not only by the attention sum)"
      else:
        why = _bias_source(level, v, term, prog.invars[b])
      # fuse_affine's β·W bias added where V's projection is computed (TransformerLens folds
      # it into b_V first): folded alike, its entries that V reads moved out.
      fb = _fused_bias_term(level, v, fused["biases"]) if why is None else None
      fz = None
      if fb is not None:
        fz = _fused_zero_set(fb, v, kv[0])
        why = "a fused β·W bias reaches the value varying along the key dim" if fz is None else \
            _bias_source(level, v, fb[0], fb[1], fz[1])
      if why is not None:
        sites.append(TLSite("fold_value_biases", where, (bname,), False, f"not folded: {why}"))
        continue
      # The dims of z = node.outs[0] along which b_V varies (it is constant along kv).
      vary_v = {d for d, st in enumerate(view.strides) if st}
      vmap = {dd.batch[i][vs]: i for i in dd.batch}
      vmap.update({d: od for od, (side, d) in dd.owner.items() if side == vs})
      vary_z = frozenset(vmap[d] for d in vary_v)
      try:
        reader = _reader(level, node.outs[0], vary_z)
      except Block as err:
        sites.append(TLSite("fold_value_biases", where, (bname,), False, f"not folded: {err}"))
        continue
      wnode, wside, wleaf, chain, wchain = reader
      key = wnode.outs[0].key
      if key in base_plan_biases:
        sites.append(TLSite("fold_value_biases", where, (bname,), False,
                            "not folded: the output projection already receives a fused bias"))
        continue
      wname = names[wleaf]
      name = f"{param_label(wname)}@vbias.{param_label(bname)}"
      wsrc = ("extra", fused["untied"][(wnode.path, wside)]) if (wnode.path, wside) in fused["untied"] \
          else ("leaf", wleaf)
      wdd = rule_for(wnode.prim).contraction(wnode)
      fused_part = (fb[3], fb[2], tuple(fb[1].shape), fb[4], fz[0]) if fb is not None else None
      spec = (b, view, node.eqn, vs, ka[0], chain, wleaf, wside, wsrc, wchain, wdd.numbers,
              tuple(sorted(od for od, (sd, _) in wdd.owner.items() if sd == wside)), fused_part,
              wnode.outs[0].dtype, dd.numbers)
      taken.add(b)
      zeroed.append((b, tuple(s.tolist())))
      vbiases.append((name, key, spec))
      sites.append(TLSite(
          "fold_value_biases", where, (bname, param_label(wname)), True,
          f"b_V ({len(s)} entries of {param_label(bname)}"
          + (f" and {len(fz[0])} of the fused bias {fb[3]}" if fb is not None else "")
          + f") folded into a new bias {name} of "
          f"{param_label(wname)}'s output: exact for every output (the attention weights at "
          f"{node.where()} are proved rows of a softmax, Σ_k = 1)"))
  return tuple(zeroed), tuple(vbiases), sites


def _uncast(level: Level, v: Any) -> Any:
  """``v`` before the real casts that produce it."""
  while isinstance(v, Val) and v.producer is not None and _real_cast(v.producer):
    v = v.producer.ins[0]
  return v


def _cast_chain(v: Val, v0: Val) -> list:
  """The values from ``v`` to its cast ``v0`` (``v`` included)."""
  out = [v0]
  while out[-1] is not v:
    out.append(out[-1].producer.ins[0])
  return out


def _bias_term(level: Level, v: Val, kv: int):
  """``(leaf, view, rest)`` when ``v``'s canonical form is ``rest + view(leaf)`` with the view
  constant along ``kv`` (one such term)."""
  e = level.canon(v)
  hits = []
  for m, c in e.terms.items():
    if len(m) == 1 and c == 1:
      lv = factor_leaf(m[0], level)
      if lv is not None and lv[1].strides[kv] == 0 and any(lv[1].strides):
        hits.append((m, lv))
  if len(hits) != 1:
    return None
  m, (leaf, view) = hits[0]
  return leaf, view, m


def _fused_bias_term(level: Level, v: Val, biases: dict):
  """``(term, d, view, bias name, E's shape)`` when ``v``'s canonical form has a term that is a
  view of a value ``d`` to which fuse_affine adds a bias ``E`` (varying only along its
  parameter's free dims)."""
  for m, c in level.canon(v).terms.items():
    if len(m) != 1 or c != 1:
      continue
    f = A.factor(m[0])
    base = A.factor(f.args[0]) if f.kind == "view" else f
    d = base.key if base.kind == "atom" else None
    if not isinstance(d, Val) or d.key not in biases or d.producer is None:
      continue
    dd = rule_for(d.producer.prim).contraction(d.producer)
    sides = [k for k in (0, 1) if param_operand(level, d.producer.ins[k]) is not None]
    if dd is None or len(sides) != 1:
      return None
    wfree = {od for od, (sd, _) in dd.owner.items() if sd == sides[0]}
    eshape = tuple(n if i in wfree else 1 for i, n in enumerate(d.shape))
    return m, d, _src_view(m[0], d), biases[d.key], eshape
  return None


def _fused_zero_set(fb: tuple, v: Val, kv: int) -> Optional[tuple]:
  """``(E's entries V reads, d's entries holding them)``, when what V reads of E is constant
  along the key dim ``kv``."""
  _, d, view, _, eshape = fb
  eidx = np.broadcast_to(np.arange(int(np.prod(eshape))).reshape(eshape), d.shape).ravel()
  read = eidx[_view_indices(view, v.shape)]
  if not np.all(read == np.take(read, [0], axis=kv)):
    return None
  entries = np.unique(read)
  return tuple(entries.tolist()), np.flatnonzero(np.isin(eidx, entries))


def _reader(level: Level, z: Val, dims: frozenset):
  """``(node, W side, W leaf, chain from z, W's chain)``: the one contraction that reads ``z``
  (through re-indexing steps) contracting exactly ``dims`` against a parameter."""
  prog = level.program
  # Followed: the dims b_V is constant along (batch, queries), which must stay whole dims
  # and not be contracted; the contraction then contracts exactly the others.
  v, chain, state = z, [], Lin(frozenset(range(len(z.shape))) - dims)
  while True:
    if v in prog.output_positions:
      raise Block("the attention output is a program output")
    uses = prog.consumers.get(v, ())
    if len(uses) != 1:
      raise Block("the attention output has more than one reader")
    node, k = uses[0]
    rule = rule_for(node.prim)
    dd = rule.contraction(node)
    if dd is not None:
      rest = frozenset(range(len(node.ins[k].shape))) - state.dims
      if frozenset(dd.contracting(k)) != rest or dd.lb:
        raise Block(f"a contraction that does not contract exactly b_V's dims [at {node.where()}]")
      src = param_operand(level, node.ins[1 - k])
      if src is None:
        raise Block(f"a contraction with an operand that is not a parameter [at {node.where()}]")
      return node, 1 - k, src[0], tuple(c.eqn for c in chain), tuple(c.eqn for c in src[1])
    if len(node.ins) != 1 or not (rule.kind in ("identity", "layout") or _real_cast(node)):
      raise Block(f"`{node.prim.name}` reads the attention output [at {node.where()}]")
    try:
      (state,) = rule.rotate(node, [state], level)
    except Block as err:
      raise Block(f"`{node.prim.name}` reads the attention output [at {node.where()}]") from err
    if not isinstance(state, Lin):
      raise Block(f"`{node.prim.name}` reads the attention output [at {node.where()}]")
    chain.append(node)
    v = node.outs[0]


# ----------------------------------------------------------------------------
# Entry points.


def prove_edits(level: Level, names: tuple, untied: list, plan_biases: list, center_unembed: bool,
                fold_value_biases: bool) -> TLEdits:
  """The proved edits of both kinds (each only when asked), on the folded program's ``level``
  after fuse_affine's own: its untied copies ``(use path, operand, name, chain)`` and new biases
  ``(output key, name)``."""
  fused = {"untied": {(u, k): n for u, k, n, _ in untied}, "biases": dict(plan_biases), "copy_uses": {}}
  for _, _, n, _ in untied:
    fused["copy_uses"][n] = fused["copy_uses"].get(n, 0) + 1
  base_plan_biases = set(fused["biases"])
  center = copies = untied = zeroed = vbiases = ()
  sites: list = []
  # (an analysis that fails unexpectedly leaves the model as fuse_affine made it, and says so)
  if fold_value_biases:
    try:
      zeroed, vbiases, s = _value_bias_sites(level, names, fused, base_plan_biases)
    except Exception as err:  # noqa: BLE001 - refused with the reason, never a wrong edit
      s = [TLSite("fold_value_biases", "(program)", (), False, f"not folded: {type(err).__name__}: {err}")]
    sites += s
  if center_unembed:
    try:
      center, copies, untied, s = _unembed_sites(level, names, fused)
    except Exception as err:  # noqa: BLE001
      s = [TLSite("center_unembed", "(program)", (), False, f"not centered: {type(err).__name__}: {err}")]
    sites += s
  return TLEdits(center, copies, untied, zeroed, vbiases, tuple(sites))


def _host(x) -> np.ndarray:
  return np.asarray(x, np.float64)


def _vbias_value(spec: tuple, flat: list, extras: dict) -> np.ndarray:
  """``b_V·W_O`` at the output projection, with size 1 where it is constant, in float64: the
  attention sum with one-hot weights (picks b_V, constant along the key dim), carried through
  the re-indexing steps (as an index map: exact in any dtype), contracted with the fused W_O."""
  b, view, eqn, vs, ka, chain, wleaf, wside, wsrc, wchain, dn, wdims, fused_part, _, adn = spec
  vshape = eqn.invars[vs].aval.shape
  bv = _host(flat[b]).ravel()[_view_indices(view, vshape)]
  if fused_part is not None:   # fuse_affine's β·W bias, the part V reads
    name, fview, dshape, eshape, _ = fused_part
    e = _host(extras[name])
    if e.shape != eshape:
      raise ValueError(f"the fused bias {name} has shape {e.shape}, the analysis expected {eshape}")
    bv = bv + np.broadcast_to(e, dshape).ravel()[_view_indices(fview, vshape)]
  a_shape = eqn.invars[1 - vs].aval.shape
  onehot = np.zeros(a_shape, np.float64)
  sl = [slice(None)] * len(a_shape)
  sl[ka] = 0
  onehot[tuple(sl)] = 1
  ops = [None, None]
  ops[vs], ops[1 - vs] = bv, onehot
  z = _np_dot_general(ops[0], ops[1], adn)
  z = z.ravel()[_index_map(z.shape, chain)]
  wx = _host(extras[wsrc[1]] if wsrc[0] == "extra" else flat[wleaf])
  wx = wx.ravel()[_index_map(wx.shape, wchain)]
  ops[wside], ops[1 - wside] = wx, z
  t = _np_dot_general(ops[0], ops[1], dn)
  # Constant along every dim but W_O's free ones: keep index 0 there.
  return t[tuple(slice(None) if d in wdims else slice(0, 1) for d in range(t.ndim))]


def _index_map(shape: tuple, chain: tuple) -> np.ndarray:
  """Where each element of a re-indexing chain's output comes from in its input (flat);
  real casts are skipped (the values are taken in real arithmetic and rounded once)."""
  idx = jnp.arange(int(np.prod(shape)), dtype=jnp.int32).reshape(shape)
  for e in chain:
    if rule_for(e.primitive).cast is None:
      idx = compat.bind_eqn(e, [idx])[0]
  return np.asarray(idx)


def _np_dot_general(lhs: np.ndarray, rhs: np.ndarray, numbers) -> np.ndarray:
  """``lax.dot_general`` in numpy (float64): batch dims, then lhs free, then rhs free."""
  (lc, rc), (lb, rb) = numbers
  lc, rc, lb, rb = map(list, (lc, rc, lb, rb))
  lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
  rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
  bs = tuple(lhs.shape[d] for d in lb)
  k = int(np.prod([lhs.shape[d] for d in lc]))
  lm = lhs.transpose(lb + lf + lc).reshape(bs + (-1, k))
  rm = rhs.transpose(rb + rc + rf).reshape(bs + (k, -1))
  return (lm @ rm).reshape(bs + tuple(lhs.shape[d] for d in lf) + tuple(rhs.shape[d] for d in rf))


def apply(edits: TLEdits, flat: list, extras: dict) -> None:
  """Applies ``edits`` to the fused parameters in place: ``flat`` (the fused leaves, None for
  removed ones) and ``extras``; values are computed in float64 and rounded once."""
  for name, leaf in edits.copies:
    extras[name] = flat[leaf]
  for name, _, spec in edits.vbiases:
    extras[name] = jnp.asarray(_vbias_value(spec, flat, extras).astype(np.dtype(spec[13])))
  for _, _, spec in edits.vbiases:
    if spec[12] is not None:
      name, _, _, _, entries = spec[12]
      x = np.array(extras[name]).ravel()
      x[np.asarray(entries, np.int64)] = 0
      extras[name] = jnp.asarray(x.reshape(np.shape(extras[name])))
  for b, idx in edits.zeroed:
    x = np.array(flat[b]).ravel()
    x[np.asarray(idx, np.int64)] = 0
    flat[b] = jnp.asarray(x.reshape(np.shape(flat[b])))
  for (kind, ref), dim in edits.center:
    x = flat[ref] if kind == "leaf" else extras[ref]
    h = _host(x)
    c = jnp.asarray((h - h.mean(axis=dim, keepdims=True)).astype(np.dtype(x.dtype)))
    if kind == "leaf":
      flat[ref] = c
    else:
      extras[ref] = c
