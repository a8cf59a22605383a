"""The soundness analysis: which mean reductions can go, and what to center.

Two obligations (DESIGN-BRIEF §2), each checked by its own pass:

* ``zero_sum_sources`` walks backwards from a normalization's input and lists
  what must be centered for that input to sum to zero over the normalized
  axes (obligation 2: then the mean reduction is exactly zero).
* ``Propagator`` follows the shift that centering one value introduces
  forwards, as a polynomial in a shift symbol, and proves that no output of
  the program sees it (obligation 1). Normalizations annihilate the shift by
  algebraic cancellation, not by matching a pattern.

Anything either pass does not understand blocks the fold, with a reason.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np
from jax import lax

from jaxfold._src import compat
from jaxfold._src import layout
from jaxfold._src import symbolic as sy
from jaxfold._src.graph import Graph, Node

Unsupported = sy.Unsupported

_UNARY_SAME = {lax.convert_element_type_p, lax.copy_p}
for _name in ("reduce_precision_p", "copy_p", "optimization_barrier_p"):
  if hasattr(lax, _name):
    _UNARY_SAME.add(getattr(lax, _name))
_SHARDING = {getattr(lax, n) for n in ("sharding_constraint_p",) if hasattr(lax, n)}
_LAYOUT = {lax.reshape_p, lax.broadcast_in_dim_p, lax.transpose_p, lax.squeeze_p}
_ADD = {lax.add_p, lax.sub_p}
for _name in ("add_any_p",):
  if hasattr(lax, _name):
    _ADD.add(getattr(lax, _name))
try:
  from jax._src.ad_util import add_jaxvals_p as _add_any
  _ADD.add(_add_any)
except Exception:  # pragma: no cover
  pass
_CUMULATIVE = {p for p in (getattr(lax, "cumsum_p", None),) if p is not None}


def shape_of(a: Any) -> tuple:
  return tuple(compat.aval(a).shape)


def _scalar_literal(a: Any) -> Optional[float]:
  if compat.is_literal(a):
    v = np.asarray(compat.literal_value(a))
    if v.size == 1:
      return float(v.reshape(()))
  return None


# ----------------------------------------------------------------------------
# Structural constancy of values that no shift touches.


class Constancy:
  """Dimensions along which a value is constant, from the program's structure."""

  def __init__(self, graph: Graph, random_is_constant: bool = False):
    self.graph = graph
    # CBWC's opt-in inexact mode: treat dropout masks (values derived from a
    # PRNG key) as if they were constant; every use is counted so the sites
    # that relied on it are reported as inexact.
    self.random_is_constant = random_is_constant
    self.random_uses = 0

  @functools.cache
  def from_key(self, v: Any) -> bool:
    """Whether ``v`` is computed from a PRNG key (e.g. a dropout mask)."""
    stack, seen = [v], set()
    while stack:
      a = stack.pop()
      if not compat.is_var(a) or a in seen:
        continue
      seen.add(a)
      if compat.is_prng_key(compat.aval(a).dtype):
        return True
      prod = self.graph.producer.get(a)
      if prod is not None:
        stack.extend(prod[0].invars)
    return False

  def dims(self, v: Any) -> frozenset:
    shape = shape_of(v)
    if self.random_is_constant and compat.is_var(v) and self.from_key(v):
      self.random_uses += 1
      return frozenset(range(len(shape)))
    return self._dims(v)

  @functools.cache
  def _dims(self, v: Any) -> frozenset:
    shape = shape_of(v)
    ones = frozenset(d for d, s in enumerate(shape) if s == 1)
    if compat.is_literal(v) or not shape:
      return frozenset(range(len(shape)))
    prod = self.graph.producer.get(v)
    if prod is None:
      return ones
    node, _ = prod
    p = node.prim
    if p is lax.broadcast_in_dim_p:
      bd = node.params["broadcast_dimensions"]
      src = node.invars[0]
      inner = self.dims(src) if compat.is_var(src) else frozenset(range(len(shape_of(src))))
      kept = {bd[i] for i in inner}
      return ones | frozenset(d for d in range(len(shape)) if d not in bd) | kept
    if p in _UNARY_SAME or p is lax.neg_p or p in _SHARDING:
      return ones | self._of(node.invars[0], shape)
    if p in (lax.mul_p, lax.div_p, lax.add_p, lax.sub_p, lax.max_p, lax.min_p,
             lax.rsqrt_p, lax.sqrt_p, lax.exp_p, lax.integer_pow_p, lax.square_p):
      res = None
      for a in node.invars:
        d = self._of(a, shape)
        res = d if res is None else res & d
      return ones | (res or frozenset())
    return ones

  def _of(self, a: Any, out_shape: tuple) -> frozenset:
    s = shape_of(a)
    if not s or compat.is_literal(a):
      return frozenset(range(len(out_shape)))
    bcast = frozenset(d for d, n in enumerate(s) if n == 1)
    return bcast | self.dims(a)


# ----------------------------------------------------------------------------
# Forward: the shift a centering introduces, as a polynomial.


class Propagator:
  """Proves that a shift injected at some value reaches no program output."""

  def __init__(self, graph: Graph, constancy: Constancy, constancy_of=None):
    self.g = graph
    self.const = constancy
    self.constancy_of = constancy_of or (lambda g: Constancy(g))
    self._bodies: dict = {}

  def _body(self, g: Graph) -> "Propagator":
    if g not in self._bodies:
      self._bodies[g] = Propagator(g, self.constancy_of(g), self.constancy_of)
    return self._bodies[g]

  def collect(self, seeds: dict) -> dict:
    """Propagates inside a body; returns {output position: poly}."""
    outputs: dict = {}
    self.canon = {}
    for v, p in seeds.items():
      for k in self.g.output_positions.get(v, []):
        outputs[k] = p
    starts = [n.index for v in seeds for n, _ in self.g.consumers.get(v, [])]
    if starts:
      reason = self._run(dict(seeds), min(starts), frozenset(), outputs)
      if reason is not None:
        raise Unsupported(reason)
    return outputs

  # -- public ---------------------------------------------------------------

  def invisible(self, seeds: dict[Any, sy.Poly], skip: frozenset = frozenset(),
                canon: Optional[dict] = None) -> Optional[str]:
    """None when every output is provably unchanged; else the reason."""
    polys = dict(seeds)
    self.canon = dict(canon or {})
    for v in seeds:
      if v in self.g.output_positions:
        return f"the shift reaches program output #{self.g.output_positions[v][0]}"
    starts = [n.index for v in seeds for n, _ in self.g.consumers.get(v, [])]
    if not starts:
      return None
    return self._run(polys, min(starts), skip)

  @functools.cached_property
  def _last_use(self) -> dict:
    last = {}
    for n in self.g.nodes:
      for v in n.invars:
        if compat.is_var(v):
          last[v] = n.index
    for v in self.g.output_positions:
      last[v] = len(self.g.nodes)
    return last

  def _run(self, polys: dict, start: int, skip: frozenset,
           outputs: Optional[dict] = None) -> Optional[str]:
    # Once a single pure shift is all that is left alive, the rest of the
    # walk depends only on (value, constancy pattern): memoised, so the
    # producers feeding one residual stream share the walk down the stream.
    memo = self.__dict__.setdefault("_memo", {})
    trail = []
    result = None
    for node in self.g.nodes[start:]:
      if len(polys) == 1 and not skip and outputs is None:
        (v, p), = polys.items()
        if p.is_pure and sy.is_const(p.coeffs[0]):
          key = (v, tuple(None if e is None else e[1] for e in p.emb), node.index)
          if key in memo:
            result = memo[key]
            break
          trail.append(key)
      if node.index in skip:
        continue
      ins = [polys.get(v) if compat.is_var(v) else None for v in node.invars]
      if not any(p is not None for p in ins):
        continue
      try:
        outs = self.transfer(node, ins)
      except Unsupported as e:
        result = f"{e} [at {node.where()}]"
        break
      for v, p in zip(node.outvars, outs):
        if p is not None:
          if v in self.g.output_positions:
            if outputs is None:
              result = (f"the shift reaches program output #{self.g.output_positions[v][0]}"
                        f" [from {node.where()}]")
              break
            for k in self.g.output_positions[v]:
              outputs[k] = p
          polys[v] = p
      if result is not None:
        break
      last = self._last_use
      for v in [v for v in polys if last.get(v, -1) <= node.index]:
        del polys[v]
      if not polys:
        break
    for key in trail:
      memo[key] = result
    return result

  def seed_through(self, node: Node, operand: int, poly: sy.Poly) -> list:
    """Output polys of ``node`` when only ``operand`` carries ``poly``."""
    ins = [None] * len(node.invars)
    ins[operand] = poly
    self.canon = {}
    return self.transfer(node, ins)

  # -- helpers --------------------------------------------------------------

  def _canon(self, a: Any) -> sy.Coef:
    k = _scalar_literal(a)
    if k is not None:
      return sy.const(k)
    if compat.is_var(a) and a in self.canon:
      return self.canon[a]
    return sy.atom(id(a))

  def _fit(self, p: Optional[sy.Poly], a: Any, out_shape: tuple) -> Optional[sy.Poly]:
    if p is None:
      return None
    s = shape_of(a)
    if len(s) != len(out_shape):
      return sy.Poly(p.sym, (None,) * len(out_shape), p.coeffs)
    return p

  def _remint(self, emb: tuple, out_shape: tuple) -> sy.Poly:
    return sy.pure(tuple(None if (e is None or out_shape[d] == 1) else (d, e[1] if e else 1)
                         for d, e in enumerate(emb)))

  @staticmethod
  def _varying(d: int) -> tuple:
    return (("fresh", d), 1)

  # -- transfer functions ---------------------------------------------------

  def transfer(self, node: Node, ins: list) -> list:
    p = node.prim
    out_shape = shape_of(node.outvars[0]) if node.outvars else ()
    name = p.name
    if compat.is_scan(node.eqn):
      return self._scan(node, ins)
    if node.subgraphs:
      raise Unsupported(f"the shift enters a `{name}` (conditionals and while loops are not analysed)")
    if p in _UNARY_SAME or p in _SHARDING:
      self._set_canon(node, self._canon(node.invars[0]))
      return [ins[0]] + [None] * (len(node.outvars) - 1)
    if p is lax.neg_p:
      self._set_canon(node, sy.scale(self._canon(node.invars[0]), -1.0))
      return [sy.make(ins[0].sym, ins[0].emb, [sy.scale(a, -1.0) for a in ins[0].coeffs])]
    if p in _ADD:
      return [self._add(node, ins, out_shape, -1.0 if p is lax.sub_p else 1.0)]
    if p is lax.mul_p:
      return [self._mul(node, ins, out_shape)]
    if p is lax.div_p:
      if ins[1] is not None:
        raise Unsupported("the shift reaches a divisor")
      inv = sy.inverse(self._canon(node.invars[1]))
      return [self._scale_by(node, ins[0], node.invars[0], node.invars[1], inv, out_shape)]
    if p is lax.square_p or (p is lax.integer_pow_p and node.params["y"] == 2):
      x = node.invars[0]
      c = self._canon(x)
      self._set_canon(node, sy.mul(c, c))
      return [sy.poly_mul(ins[0], c, ins[0], c)]
    if p is lax.integer_pow_p and node.params["y"] == 1:
      self._set_canon(node, self._canon(node.invars[0]))
      return [ins[0]]
    if p is lax.reduce_sum_p:
      return [self._reduce(node, ins[0])]
    if p in _LAYOUT or (hasattr(lax, "expand_dims_p") and p is getattr(lax, "expand_dims_p")):
      return [self._layout(node, ins[0])]
    if p is lax.dot_general_p:
      return [self._dot(node, ins)]
    if p is lax.conv_general_dilated_p:
      return [self._conv(node, ins)]
    if p in (lax.slice_p, lax.dynamic_slice_p):
      if any(q is not None for q in ins[1:]):
        raise Unsupported("the shift reaches slice indices")
      return [self._slice(node, ins[0])]
    if p is lax.gather_p:
      if ins[1] is not None:
        raise Unsupported("the shift reaches gather indices")
      return [self._gather(node, ins[0])]
    if p in (lax.concatenate_p, lax.pad_p, lax.select_n_p,
             lax.dynamic_update_slice_p) or p in _CUMULATIVE:
      return [self._piecewise(node, ins, out_shape)]
    raise Unsupported(f"the shift reaches `{name}`, which does not ignore it")

  def _scan(self, node: Node, ins: list) -> list:
    """A pure shift through a scan, with a fixed point on the carries."""
    nc, ncar = compat.scan_partition(node.params)
    body = node.subgraphs[0]
    bp = self._body(body)
    seeds = {}
    for i, p in enumerate(ins):
      if p is None:
        continue
      if not p.is_pure:
        raise Unsupported("a nonlinear function of the shift enters a scan")
      emb = p.emb if i < nc + ncar else p.emb[1:]
      seeds[body.invars[i]] = sy.pure(_pattern(emb))
    for _ in range(2 + 2 * max((len(shape_of(v)) for v in body.invars), default=0)):
      outs = bp.collect(seeds)
      changed = False
      for j in range(ncar):
        q = outs.get(j)
        if q is None:
          continue
        if not q.is_pure:
          raise Unsupported("a nonlinear function of the shift is carried by a scan")
        var = body.invars[nc + j]
        cur = seeds.get(var)
        merged = _pattern(q.emb) if cur is None else _merge(cur.emb, q.emb)
        if cur is None or merged != cur.emb:
          seeds[var] = sy.pure(merged)
          changed = True
      if not changed:
        break
    else:
      raise Unsupported("the shift on a scan carry has no fixed point")
    result = []
    self.canon = getattr(self, "canon", {})
    for k, v in enumerate(node.outvars):
      q = outs.get(k)
      if q is None:
        result.append(None)
      elif not q.is_pure:
        raise Unsupported("a nonlinear function of the shift leaves a scan")
      elif k < ncar:
        result.append(sy.pure(_pattern(q.emb)))
      else:
        result.append(sy.pure(((("stack", 0), 1),) + _pattern(q.emb)))
    return result

  def _set_canon(self, node: Node, c: sy.Coef) -> None:
    self.canon[node.outvars[0]] = c

  def _add(self, node, ins, out_shape, sign):
    a, b = node.invars[:2]
    pa, pb = self._fit(ins[0], a, out_shape), self._fit(ins[1], b, out_shape)
    # A sum is its own atom: matching only ever needs the structure of
    # reductions and scalings of one value, and expanding residual sums
    # would grow quadratically along a residual stream.
    self._set_canon(node, sy.atom(id(node.outvars[0])))
    if pa is None:
      return sy.make(pb.sym, pb.emb, [sy.scale(c, sign) for c in pb.coeffs])
    if pb is None:
      return pa
    if pa.same_symbol(pb):
      return sy.poly_add(pa, pb, sign)
    if pa.is_pure and pb.is_pure:
      emb = tuple(None if (x is None and y is None) else self._varying(d)
                  for d, (x, y) in enumerate(zip(pa.emb, pb.emb)))
      self._set_canon(node, sy.atom(id(node.outvars[0])))
      return self._remint(emb, out_shape)
    raise Unsupported("two different shifts meet in a sum")

  def _mul(self, node, ins, out_shape):
    a, b = node.invars
    pa, pb = self._fit(ins[0], a, out_shape), self._fit(ins[1], b, out_shape)
    ca, cb = self._canon(a), self._canon(b)
    self._set_canon(node, sy.mul(ca, cb))
    if pa is not None and pb is not None:
      if not pa.same_symbol(pb):
        raise Unsupported("two different shifts are multiplied")
      return sy.poly_mul(pa, ca, pb, cb)
    if pa is None:
      return self._scale_by(node, pb, b, a, ca, out_shape)
    return self._scale_by(node, pa, a, b, cb, out_shape)

  def _scale_by(self, node, p, x, other, factor, out_shape):
    """``x * other`` where only x carries the shift; factor is canon(other)."""
    p = self._fit(p, x, out_shape)
    if node.outvars[0] not in self.canon:
      self._set_canon(node, sy.mul(self._canon(x), factor))
    if sy.is_const(factor):
      return sy.poly_scale(p, factor)
    if p.is_pure:
      # k·c·y is a new pure shift, varying wherever c or y does.
      const = self.const._of(other, out_shape)
      emb = tuple(e if (d in const or e is not None) else self._varying(d)
                  for d, e in enumerate(p.emb))
      self._set_canon(node, sy.atom(id(node.outvars[0])))
      return self._remint(emb, out_shape)
    return sy.poly_scale(p, factor)

  def _reduce(self, node, p):
    x = node.invars[0]
    axes = tuple(node.params["axes"])
    shape = shape_of(x)
    n = int(np.prod([shape[a] for a in axes])) if axes else 1
    tag = ("reduce_sum", axes, shape)
    emb = tuple(e for d, e in enumerate(p.emb) if d not in axes)
    if all(p.emb[a] is None for a in axes):
      self._set_canon(node, sy.wrap(self._canon(x), tag, lambda k: k * n))
      return sy.make(p.sym, emb, [sy.wrap(c, tag, lambda k: k * n) for c in p.coeffs])
    if p.is_pure:
      self._set_canon(node, sy.atom(id(node.outvars[0])))
      return self._remint(emb, shape_of(node.outvars[0]))
    raise Unsupported(f"a reduction over axes {axes} along which the shift varies")

  def _layout(self, node, p):
    x = node.invars[0]
    prim = node.prim
    in_shape, out_shape = shape_of(x), shape_of(node.outvars[0])
    if prim is lax.transpose_p:
      perm = node.params["permutation"]
      emb = tuple(p.emb[i] for i in perm)
    elif prim is lax.broadcast_in_dim_p:
      bd = node.params["broadcast_dimensions"]
      emb = [None] * len(out_shape)
      for i, d in enumerate(bd):
        emb[d] = p.emb[i] if out_shape[d] == in_shape[i] else None
      emb = tuple(emb)
    else:
      emb = layout.reshape_emb(p.emb, in_shape, out_shape)
      if emb is None:
        raise Unsupported(f"a reshape {in_shape}->{out_shape} that mixes the shift's axes")
    tag = (prim.name, repr(sorted((k, repr(v)) for k, v in node.params.items())), out_shape)
    self._set_canon(node, sy.wrap(self._canon(x), tag))
    return sy.make(p.sym, emb, [sy.wrap(c, tag) for c in p.coeffs])

  def _dot(self, node, ins):
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    if ins[0] is not None and ins[1] is not None:
      raise Unsupported("the shift reaches both operands of a contraction")
    side = 0 if ins[0] is not None else 1
    p = ins[side]
    if not p.is_pure:
      raise Unsupported("a nonlinear function of the shift reaches a contraction")
    ls, rs = shape_of(node.invars[0]), shape_of(node.invars[1])
    lfree = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rs)) if d not in rc and d not in rb]
    # Output dims: batch, then lhs free, then rhs free. The shift stays
    # constant along the perturbed operand's free dims where it was; the
    # other operand's free dims and the batch dims mix it.
    out = [self._varying(i) for i in range(len(lb))]
    for d in lfree:
      out.append(p.emb[d] if side == 0 else self._varying(len(out)))
    for d in rfree:
      out.append(p.emb[d] if side == 1 else self._varying(len(out)))
    self._set_canon(node, sy.atom(id(node.outvars[0])))
    return self._remint(tuple(out), shape_of(node.outvars[0]))

  def _conv(self, node, ins):
    if ins[0] is not None and ins[1] is not None:
      raise Unsupported("the shift reaches both operands of a convolution")
    p = ins[0] if ins[0] is not None else ins[1]
    if not p.is_pure:
      raise Unsupported("a nonlinear function of the shift reaches a convolution")
    dn = node.params["dimension_numbers"]
    out_shape = shape_of(node.outvars[0])
    emb = [self._varying(d) for d in range(len(out_shape))]
    if ins[1] is not None and node.params.get("batch_group_count", 1) == 1:
      # A kernel shift constant along its output-feature dim stays constant
      # along the output channels within one feature group.
      o_k, o_out = dn.rhs_spec[0], dn.out_spec[1]
      fg = node.params["feature_group_count"]
      e = p.emb[o_k]
      per_group = out_shape[o_out] // fg
      if e is None:
        emb[o_out] = None if fg == 1 else (("grp", o_out), per_group)
      elif per_group % e[1] == 0:
        emb[o_out] = e
    self._set_canon(node, sy.atom(id(node.outvars[0])))
    return self._remint(tuple(emb), out_shape)

  def _slice(self, node, p):
    x = node.invars[0]
    in_shape, out_shape = shape_of(x), shape_of(node.outvars[0])
    cut = [d for d in range(len(in_shape)) if in_shape[d] != out_shape[d]]
    if all(p.emb[d] is None for d in cut):
      tag = (node.prim.name, repr(sorted((k, repr(v)) for k, v in node.params.items()
                                         if k != "slice_sizes")), out_shape)
      self._set_canon(node, sy.atom(id(node.outvars[0])))
      return sy.make(p.sym, p.emb, [sy.wrap(c, tag) for c in p.coeffs])
    if p.is_pure:
      self._set_canon(node, sy.atom(id(node.outvars[0])))
      return self._remint(p.emb, out_shape)
    raise Unsupported("a slice along an axis where the shift varies")

  def _gather(self, node, p):
    if not p.is_pure:
      raise Unsupported("a nonlinear function of the shift is gathered")
    dn = node.params["dimension_numbers"]
    slice_sizes = node.params["slice_sizes"]
    x = node.invars[0]
    in_shape, out_shape = shape_of(x), shape_of(node.outvars[0])
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    kept = [d for d in range(len(in_shape))
            if d not in dn.collapsed_slice_dims and d not in batching]
    emb = [self._varying(d) for d in range(len(out_shape))]
    indexed_const = all(p.emb[d] is None for d in range(len(in_shape))
                        if d not in kept or slice_sizes[d] != in_shape[d])
    for od, d in zip(dn.offset_dims, kept):
      if slice_sizes[d] == in_shape[d]:
        emb[od] = p.emb[d]
    if indexed_const:
      for d in range(len(out_shape)):
        if d not in dn.offset_dims:
          emb[d] = None
    self._set_canon(node, sy.atom(id(node.outvars[0])))
    return self._remint(tuple(emb), out_shape)

  def _piecewise(self, node, ins, out_shape):
    """concatenate / pad / select / update-slice / cumsum: pure shifts only."""
    prim = node.prim
    data = list(range(len(node.invars)))
    if prim is lax.select_n_p:
      if ins[0] is not None:
        raise Unsupported("the shift reaches a selection predicate")
      data = data[1:]
    elif prim is lax.pad_p:
      if ins[1] is not None:
        raise Unsupported("the shift reaches a padding value")
      data = [0]
    elif prim is lax.dynamic_update_slice_p:
      if any(q is not None for q in ins[2:]):
        raise Unsupported("the shift reaches update indices")
      data = [0, 1]
    polys = [self._fit(ins[i], node.invars[i], out_shape) for i in data]
    live = [q for q in polys if q is not None]
    if not all(q.is_pure for q in live):
      raise Unsupported(f"a nonlinear function of the shift reaches `{prim.name}`")
    # Which output dims can the selection pattern vary along?
    if prim is lax.concatenate_p:
      moving = {node.params["dimension"]}
    elif prim is lax.pad_p:
      moving = {d for d, (lo, hi, it) in enumerate(node.params["padding_config"])
                if lo or hi or it}
    elif prim is lax.select_n_p:
      moving = set(range(len(out_shape))) - set(self.const._of(node.invars[0], out_shape))
    elif prim in _CUMULATIVE:
      moving = {node.params["axis"]}
    else:  # dynamic_update_slice: only axes the update covers partially
      upd = shape_of(node.invars[1])
      moving = {d for d in range(len(out_shape)) if upd[d] != out_shape[d]}
    same = (len(live) == len(polys) and all(q.same_symbol(live[0]) and q.coeffs == live[0].coeffs
                                            for q in live))
    emb = []
    for d in range(len(out_shape)):
      es = [q.emb[d] for q in live]
      if all(e is None for e in es) and (same or d not in moving):
        emb.append(None)
      else:
        emb.append(self._varying(d))
    self._set_canon(node, sy.atom(id(node.outvars[0])))
    return self._remint(tuple(emb), out_shape)


_ELEMENTWISE = {lax.add_p, lax.sub_p, lax.mul_p, lax.div_p, lax.neg_p, lax.max_p, lax.min_p,
                lax.rsqrt_p, lax.sqrt_p, lax.square_p, lax.integer_pow_p}


def elementwise_or_layout(p: Any) -> bool:
  return p in _ELEMENTWISE or p in _LAYOUT or p in _UNARY_SAME


def _pattern(emb: tuple) -> tuple:
  return tuple(None if e is None else (("p", d), e[1]) for d, e in enumerate(emb))


def _merge(a: tuple, b: tuple) -> tuple:
  out = []
  for d, (x, y) in enumerate(zip(a, b)):
    if x is None and y is None:
      out.append(None)
    elif x is None or y is None or x[1] == y[1]:
      out.append((("p", d), (x or y)[1]))
    else:
      out.append((("p", d), 1))
  return tuple(out)


def seed_poly(shape: tuple, spec: layout.Spec) -> sy.Poly:
  """The shift of centering a value of ``shape`` over the blocks of ``spec``."""
  emb = []
  for d, s in enumerate(shape):
    b = spec.get(d)
    if s == 1 or b == s:
      emb.append(None)
    else:
      emb.append((("seed", d), b or 1))
  return sy.pure(tuple(emb))
