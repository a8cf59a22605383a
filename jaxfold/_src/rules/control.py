"""Control flow: scan, cond (and switch), while (and fori_loop), and calls.

Every equation that carries sub-jaxprs in its params has its rule here, and
the rule's facets are the only place that knows the params' layout (which
body input reads which operand, which are carries, the trip count):

* ``bodies``: the sub-jaxprs, in a fixed order (``program.Program`` makes
  each a sub-program at ``path + (k,)``); ``inline``: a call (``jit``,
  ``checkpoint``, ``custom_jvp``/``custom_vjp``, closed calls), which the
  program flattens at its call site, so no analysis facet ever sees one.
* Obligation 1 (``shift``, ``shift_inside``): the shift through the loop or
  conditional, running the same registry inside its bodies (through
  ``ctx.body(node, k).collect(seeds)``): every branch of a cond (the branch
  index is a traced value, so a shift must be invisible in all of them), a
  fixed point on the carries of a scan or while loop.
* Obligation 2 (``zero_sum`` of an output, ``body_zero_sum`` of a body
  input): ``Need``s on outer operands or, with ``source``/``at``, on values
  inside a body (a branch's output, a carry's update).
* Facts (``body_facts``): what a body input inherits from the operand it reads.
* The rewrite (``rebind``): the equation rebuilt with ``lax.scan``,
  ``lax.switch``, ``lax.while_loop`` or the call's body, each body evaluated
  with the plan by the ``run`` callback ``rewrite.evaluate`` passes.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
from jax import lax

from jaxfold._src import algebra as A
from jaxfold._src import compat
from jaxfold._src.rules.base import Block, Facts, Inline, Need, Rule, freeze, register
from jaxfold._src.rules.elementwise import _prims, ctx_zero

# ----------------------------------------------------------------------------
# Operand layout.


def body_operand(node, k: int, i: int) -> Optional[int]:
  """The outer operand that input ``i`` of body ``k`` of ``node`` reads
  unchanged (a closed-over constant or a branch operand), or None for a
  loop-carried or per-iteration input."""
  if compat.is_cond(node.eqn):
    return i + 1                       # operand 0 is the branch index
  if compat.is_while(node.eqn):
    cn, bn = compat.while_partition(node.params)
    n = cn if k == 0 else bn
    if i < n:
      return i if k == 0 else cn + i
    return None
  if compat.is_scan(node.eqn):
    nc, _ = compat.scan_partition(node.params)
    return i if i < nc else None
  return None


def carries(node, k: int) -> tuple:
  """For a while loop's body ``k``: ``(first carry input, first carry operand)``."""
  cn, bn = compat.while_partition(node.params)
  return (cn if k == 0 else bn), cn + bn


def may_skip(node) -> bool:
  """Whether a loop may run zero times, leaving its carries at their initial
  values (and a scan's stacked outputs empty): a ``while`` whose condition
  may be false at entry (``fori_loop`` with traced bounds), a scan whose
  length is 0 (``fori_loop`` with equal static bounds) or not a concrete int.
  Then every carry rule must hold for the initial carry too, and a centering
  placed in the body ("at every iteration") may never run."""
  if compat.is_scan(node.eqn):
    n = compat.scan_length(node.params)
    return n is None or n <= 0
  return compat.is_while(node.eqn)


# ----------------------------------------------------------------------------
# Facts of body inputs.


def _scan_body_facts(node, k, i, outer, base):
  nc, ncar = compat.scan_partition(node.params)
  f = outer.facts(node.ins[i])
  random = f.random or base.random
  if i < nc:
    return Facts(f.const | base.const, f.value, random)
  if i < nc + ncar:  # a carry changes across iterations: only randomness is known
    return Facts(base.const, None, random)
  return Facts(frozenset(d - 1 for d in f.const if d > 0) | base.const, f.value, random)


def _passed_body_facts(node, k, i, outer, base):
  j = body_operand(node, k, i)
  if j is not None:  # reads an outer operand unchanged (a branch operand, a loop constant)
    f = outer.facts(node.ins[j])
    return Facts(f.const | base.const, f.value, f.random or base.random)
  return Facts(base.const, None, True if any(outer.facts(a).random for a in node.ins) else base.random)


# ----------------------------------------------------------------------------
# Obligation 1: the shift through loops and conditionals.


def _pure_seeds(ins: list, invars: list, where: str, dims_of) -> dict:
  """The body seeds of operands carrying a shift: each must be pure (a linear
  map of the shift), seen in the body with ``dims_of(operand index, dims)``."""
  seeds = {}
  for i, p in enumerate(ins):
    if p is None:
      continue
    if not p.is_pure:
      raise Block(f"a nonlinear function of the shift enters {where}")
    seeds[invars[i]] = A.pure(dims_of(i, p.dims))
  return seeds


def _scan_shift(node, ins: list, ctx, inner: Optional[dict] = None) -> list:
  """Pure shifts through a scan, with a fixed point on the carries.

  ``inner`` maps a body Level to seeds inside it (a centering placed in
  the body, introduced at every iteration)."""
  nc, ncar = compat.scan_partition(node.params)
  body = ctx.body(node, 0)
  extra = (inner or {}).get(body, {})
  binv = body.program.invars
  seeds = _pure_seeds(ins, binv, "a scan", lambda i, dims: dims if i < nc + ncar else dims[1:])
  outs: dict = {}
  for _ in range(2 + 2 * max((len(v.shape) for v in binv), default=0)):
    outs = body.collect({**seeds, **extra})
    changed = False
    for j in range(ncar):
      q = outs.get(j)
      if q is not None:
        changed |= _widen_carry(seeds, binv[nc + j], q, "a scan")
    if not changed:
      break
  else:
    raise Block("the shift on a scan carry has no fixed point")
  result = []
  skip = may_skip(node)
  for k in range(len(node.outs)):
    q = outs.get(k)
    if k < ncar and skip and binv[nc + k] in seeds:
      # Zero trips: the carry leaves as it entered. The widened seed covers
      # both the initial shift and every iteration's.
      result.append(A.pure(seeds[binv[nc + k]].dims))
    elif q is None:
      result.append(None)
    elif not q.is_pure:
      raise Block("a nonlinear function of the shift leaves a scan")
    elif k < ncar:
      result.append(A.pure(q.dims))
    else:
      result.append(A.pure(((None, 1),) + q.dims))
  return result


def _cond_shift(node, ins: list, ctx, inner: Optional[dict] = None) -> list:
  """Shifts through a cond/switch: every branch may run (the index is a
  traced value), so each must keep the shift pure; an output carries the
  shift of any branch (as a fresh pure shift of the merged pattern)."""
  if ins[0] is not None:
    raise Block(f"the branch index of the `{node.prim.name}` depends on the shift")
  for p in ins[1:]:
    if p is not None and not p.is_pure:
      raise Block(f"a nonlinear function of the shift enters the `{node.prim.name}`")
  merged: list = [None] * len(node.outs)
  for k in range(len(node.subs)):
    body = ctx.body(node, k)
    seeds = {body.program.invars[i - 1]: p for i, p in enumerate(ins) if i and p is not None}
    seeds.update((inner or {}).get(body, {}))
    try:
      outs = body.collect(seeds)
    except Block as e:
      raise Block(f"branch {k} of the `{node.prim.name}`: {e}") from e
    for j, q in outs.items():
      if not q.is_pure:
        raise Block(f"branch {k} of the `{node.prim.name}` returns a nonlinear function of "
                    f"the shift (output #{j})")
      merged[j] = q.dims if merged[j] is None else _merge(merged[j], q.dims)
  return [None if d is None else A.pure(d) for d in merged]


def _while_shift(node, ins: list, ctx, inner: Optional[dict] = None) -> list:
  """Pure shifts through a while loop: a fixed point on the carries, and the
  loop condition must not see the shift (it decides the trip count)."""
  cond, body = ctx.body(node, 0), ctx.body(node, 1)
  cc, first = carries(node, 0)
  bc, _ = carries(node, 1)
  for p in ins:
    if p is not None and not p.is_pure:
      raise Block("a nonlinear function of the shift enters a `while` loop")
  carry = {j - first: A.pure(p.dims) for j, p in enumerate(ins) if j >= first and p is not None}

  def seeds_of(level, nconst, base):
    seeds = {level.program.invars[i]: ins[base + i] for i in range(nconst)
             if ins[base + i] is not None}
    for j, p in carry.items():
      seeds[level.program.invars[nconst + j]] = p
    seeds.update((inner or {}).get(level, {}))
    return seeds

  for _ in range(2 + 2 * max((len(v.shape) for v in body.program.invars), default=0)):
    outs = body.collect(seeds_of(body, bc, cc))
    changed = False
    for j, q in outs.items():
      changed |= _widen_carry(carry, j, q, "a `while` loop")
    if not changed:
      break
  else:
    raise Block("the shift on a `while` carry has no fixed point")
  try:
    pred = cond.collect(seeds_of(cond, cc, 0))
  except Block as e:
    raise Block(f"the `while` loop's condition: {e}") from e
  if pred:
    raise Block("the shift reaches the `while` loop's condition (it decides the trip count)")
  return [None if carry.get(j) is None else A.pure(carry[j].dims)
          for j in range(len(node.outs))]


def _widen_carry(carry: dict, key, q, loop: str) -> bool:
  """One step of a loop's carry fixed point: widens ``carry[key]`` to cover the
  body's output shift ``q``; True when it changed."""
  if not q.is_pure:
    raise Block(f"a nonlinear function of the shift is carried by {loop}")
  cur = carry.get(key)
  merged = q.dims if cur is None else _merge(cur.dims, q.dims)
  if cur is not None and _blocks(merged) == _blocks(cur.dims):
    return False
  carry[key] = A.pure(merged)
  return True


def _merge(a: tuple, b: tuple) -> tuple:
  out = []
  for x, y in zip(a, b):
    if x is None and y is None:
      out.append(None)
    elif x is None or y is None:
      out.append((None, (x or y)[1]))
    else:
      out.append((None, math.gcd(x[1], y[1])))
  return tuple(out)


def _blocks(dims: tuple) -> tuple:
  return tuple(None if e is None else e[1] for e in dims)


# ----------------------------------------------------------------------------
# Obligation 2: zero-sum outputs and body inputs.


def _fresh(v, spec, at=None) -> Need:
  """``v`` (in program ``at``; None: the node's level) must be zero-sum over ``spec``."""
  return Need(-1, spec, source=v, at=at)


def _scan_zero_sum(node, k, spec, ctx) -> list:
  nc, ncar = compat.scan_partition(node.params)
  sub = node.subs[0]
  ov = sub.outvars[k]
  if k < ncar:
    # Zero trips: the final carry is the initial one.
    first = [_fresh(node.ins[nc + k], spec)] if may_skip(node) else []
    return first + [_fresh(ov, spec, sub)]
  if any(d == 0 for d, _ in spec):
    raise Block("a scan output normalized over its stacked axis")
  inner = freeze({d - 1: b for d, b in spec})
  return [_fresh(ov, inner, sub)]


def _cond_zero_sum(node, k, spec, ctx) -> list:
  # Whichever branch runs, its output is zero-sum.
  return [_fresh(sub.outvars[k], spec, sub) for sub in node.subs]


def _while_zero_sum(node, k, spec, ctx) -> list:
  return _carry_needs(node, k, spec)


def _carry_needs(node, j, spec) -> list:
  """A while carry is zero-sum when its initial value is and the body keeps
  it so (coinductive: the analysis' seen-set records the assumption)."""
  _, first = carries(node, 1)
  body = node.subs[1]
  return [_fresh(node.ins[first + j], spec), _fresh(body.outvars[j], spec, body)]


def _scan_body_zero_sum(node, k, i, spec, outer) -> list:
  j = body_operand(node, k, i)
  if j is not None:
    # The body reads the outer operand unchanged: a use inside the body is
    # still a use of it (an untied copy can stand in there).
    return [Need(j, spec, transparent=True)]
  nc, ncar = compat.scan_partition(node.params)
  operand = node.ins[i]
  if i < nc + ncar:
    # Zero-sum carry: its initial value is, and the body keeps it so (the
    # assumption for this carry is what the seen-set records).
    return [_fresh(operand, spec), _fresh(node.subs[k].outvars[i - nc], spec, node.subs[k])]
  return [_fresh(operand, freeze({d + 1: b for d, b in spec}))]


def _cond_body_zero_sum(node, k, i, spec, outer) -> list:
  return [Need(body_operand(node, k, i), spec, transparent=True)]


def _while_body_zero_sum(node, k, i, spec, outer) -> list:
  j = body_operand(node, k, i)
  if j is not None:
    return [Need(j, spec, transparent=True)]
  return _carry_needs(node, i - carries(node, k)[0], spec)


# ----------------------------------------------------------------------------
# Bodies, calls and the rewrite.


def _scan_bodies(eqn) -> tuple:
  return (eqn.params["jaxpr"],)


def _cond_bodies(eqn) -> tuple:
  return tuple(eqn.params["branches"])


def _while_bodies(eqn) -> tuple:
  return (eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"])


def _scan_rebind(eqn, invals, run) -> list:
  """Re-traces a scan whose body the plan changes, with lax.scan itself."""
  nc, ncar = compat.scan_partition(eqn.params)
  closed, init, xs = invals[:nc], invals[nc:nc + ncar], invals[nc + ncar:]
  (body_jaxpr,) = _scan_bodies(eqn)

  def body(carry, x):
    outs = run(body_jaxpr, list(closed) + list(carry) + list(x), 0)
    return outs[:ncar], outs[ncar:]

  carry, ys = lax.scan(body, list(init), list(xs), length=eqn.params["length"],
                       reverse=eqn.params["reverse"], unroll=eqn.params.get("unroll", 1))
  return list(carry) + list(ys)


def _cond_rebind(eqn, invals, run) -> list:
  """Re-traces a cond/switch whose branches the plan changes (branch k's
  values are keyed under ``path + (k,)``)."""
  def branch(k, jaxpr):
    return lambda *ops: run(jaxpr, ops, k)
  fns = [branch(k, j) for k, j in enumerate(_cond_bodies(eqn))]
  return lax.switch(invals[0], fns, *invals[1:])


def _while_rebind(eqn, invals, run) -> list:
  """Re-traces a while loop whose condition or body the plan changes."""
  cn, bn = compat.while_partition(eqn.params)
  cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
  cond_jaxpr, body_jaxpr = _while_bodies(eqn)

  def cond_fn(carry):
    return run(cond_jaxpr, list(cconsts) + list(carry), 0)[0]

  def body_fn(carry):
    return run(body_jaxpr, list(bconsts) + list(carry), 1)
  return list(lax.while_loop(cond_fn, body_fn, list(init)))


# ``Inline.kind`` (and ``program.CallSite.kind``) of a remat (``jax.checkpoint``)
# call: the one call with a boundary of its own, which the rewrite keeps.
REMAT = "remat"


def _call_inline(eqn) -> Optional[Inline]:
  body = compat.call_jaxpr_of(eqn)
  if body is None:
    return None
  kind = compat.call_kind(eqn)
  return Inline(body, kind, kind != REMAT)


def _call_bodies(eqn) -> tuple:
  body = compat.call_jaxpr_of(eqn)
  return () if body is None else (body,)


def _call_rebind(eqn, invals, run) -> list:
  """A touched call: its body is interpreted at this call site (a remat
  boundary is kept; values inside it stay inside it)."""
  bodies = _call_bodies(eqn)
  if not bodies:  # a call whose body this jax does not expose: the program kept it as a node
    return compat.bind_eqn(eqn, invals)
  (body,) = bodies
  if compat.is_remat(eqn):
    fn = jax.checkpoint(lambda *a: run(body, a, isolated=True),
                        prevent_cse=eqn.params.get("prevent_cse", True), policy=eqn.params.get("policy"))
    return fn(*invals)
  return run(body, invals)


# ----------------------------------------------------------------------------
# shard_map: the body runs once per shard, on each operand's local block (a
# dim split over n devices is n contiguous chunks of L = size / n elements;
# the body's invars and outvars have the local shapes). Collectives inside
# the body (psum, ...) have no rule: a shift reaching one blocks.


def _sizes(*shapes) -> None:
  for shape in shapes:
    if not all(type(n) is int for n in shape):
      raise Block("a `shard_map` at symbolic shapes")


def _local_dims(dims: tuple, local: tuple) -> tuple:
  """A shift's pattern on one shard's block: a shift piecewise constant on
  aligned blocks of b is so on each chunk (starting at a multiple of L) on
  blocks of gcd(b, L)."""
  out = []
  for e, n in zip(dims, local):
    b = None if e is None else math.gcd(e[1], n)
    out.append(None if b is None or b == n else (None, b))   # one block: constant along it
  return tuple(out)


def _global_dims(dims: tuple, local: tuple, shape: tuple) -> tuple:
  """A shard's output shift seen in the whole output: every shard computed its
  own (the body's shift is arbitrary per shard), so a dim split into chunks
  of L varies at least from chunk to chunk."""
  out = []
  for e, n, g in zip(dims, local, shape):
    if n == g:
      out.append(e)
    else:
      out.append((None, n if e is None else math.gcd(e[1], n)))
  return tuple(out)


def _shard_map_shift(node, ins: list, ctx, inner: Optional[dict] = None) -> list:
  """Pure shifts through a shard_map: each operand's shift, restricted to a
  shard, seeds the body (an arbitrary shift of the local pattern: sound for
  every shard at once); a body output's shift leaves as an arbitrary shift."""
  if not node.subs:
    raise Block("this jax's `shard_map` is opaque to jaxfold")
  body = ctx.body(node, 0)
  binv = body.program.invars

  def local(i, dims):
    _sizes(binv[i].shape, node.ins[i].shape)
    return _local_dims(dims, binv[i].shape)
  seeds = _pure_seeds(ins, binv, "a `shard_map`", local)
  # Every shard sees the same restriction of a shift constant along each dim
  # its mesh axes split: that seed is replicated across them (a psum of it is
  # a known multiple of it, which is what lets a mean over a sharded axis,
  # psum(Σ h) / n, cancel it).
  sizes = compat.shard_map_axis_sizes(node.params)
  for i, p in enumerate(ins):
    if p is not None and binv[i] in seeds:
      split = compat.shard_map_operand_axes(node.params, i, len(p.dims))
      varying = frozenset().union(*[a for a, e in zip(split, p.dims) if e is not None])
      A.replicate(seeds[binv[i]], frozenset(sizes) - varying)
  seeds.update((inner or {}).get(body, {}))
  try:
    outs = body.collect(seeds)
  except Block as e:
    raise Block(f"inside the `shard_map`: {e}") from e
  result = []
  for k, o in enumerate(node.outs):
    q = outs.get(k)
    if q is None:
      result.append(None)
      continue
    if not q.is_pure:
      raise Block(f"a `shard_map` returns a nonlinear function of the shift (output #{k})")
    local = body.program.outvars[k].shape
    _sizes(local, o.shape)
    result.append(A.pure(_global_dims(q.dims, local, o.shape)))
  return result


def _shard_map_zero_sum(node, k, spec, ctx) -> list:
  """Output ``k`` is zero-sum over blocks that no shard boundary splits when
  every shard's output is (a replicated output: the one all shards hold)."""
  if not node.subs:
    raise Block("this jax's `shard_map` is opaque to jaxfold")
  sub = node.subs[0]
  ov = sub.outvars[k]
  _sizes(ov.shape, node.outs[k].shape)
  for d, b in spec:
    if ov.shape[d] % b:
      raise Block(f"a zero-sum block of {b} along dim {d} spans the shards of a `shard_map` "
                  f"({ov.shape[d]} elements each)")
  return [_fresh(ov, spec, sub)]


def _shard_map_body_zero_sum(node, k, i, spec, outer) -> list:
  """A body input is zero-sum over blocks of ``spec`` in every shard when the
  operand is over the same blocks: they tile each shard's chunk (spec's blocks
  divide the local sizes, and chunks start at multiples of them)."""
  return [_fresh(node.ins[i], spec)]


def _shard_map_body_facts(node, k, i, outer, base):
  f = outer.facts(node.ins[i])   # constant along a dim: so is every chunk of it
  return Facts(f.const | base.const, f.value, f.random or base.random)


def _shard_map_bodies(eqn) -> tuple:
  body = compat.shard_map_body(eqn.params)
  return () if body is None else (body,)


def _shard_map_rebind(eqn, invals, run) -> list:
  (body,) = _shard_map_bodies(eqn)
  return compat.shard_map_rebind(eqn.params, lambda *a: run(body, a, 0), invals)


def _psum_shift(node, ins: list, ctx) -> list:
  """``psum(x + k*c) = psum(x) + k*Σ_shards c``: every shard's shift has the
  same pattern (the body is one program), so their sum has it too. Where
  ``c`` is the same in every shard summed over (``A.replicated``), the sum is
  ``n*k*c`` with ``n`` the number of those shards: the same shift, so a mean
  over a sharded axis, ``psum(Σ h) / n``, cancels it. Otherwise it is a new
  arbitrary shift (the shards' shifts need not be equal)."""
  axes, n = _psum_count(node, ctx)
  out = []
  for p in ins[:len(node.outs)]:
    if p is not None and not p.is_pure:
      raise Block(f"a nonlinear function of the shift is summed across shards by `{node.prim.name}`")
    if p is None:
      out.append(None)
    elif n is not None and A.replicated(p, axes):
      out.append(A.poly_map(p, lambda c: A.scale(c, n), p.dims))
    else:
      out.append(A.pure(p.dims))
  return out


def _psum_count(node, ctx) -> tuple:
  """(mesh axes, number of shards) a psum sums over, from the nearest
  enclosing shard_map's mesh; (axes, None) where that is not known."""
  axes = compat.psum_axes(node.params)
  prog = getattr(ctx, "program", None)
  while axes is not None and prog is not None and prog.parent is not None:
    outer, prog = prog.parent
    if outer.prim in compat.shard_map_prims():
      sizes = compat.shard_map_axis_sizes(outer.params)
      if not set(axes) <= set(sizes):
        break
      return axes, math.prod(sizes[a] for a in axes)
  return axes, None


def _psum_facts(node, ins, ctx):
  return [Facts(f.const, None, f.random) for f in ins[:len(node.outs)]]


def _psum_simplify(node, zeros):
  if any(zeros):
    return lambda ins: [ctx_zero(o) if z else x for o, z, x in zip(node.outs, zeros, ins)]
  return None


register(Rule("scan", _prims("scan_p"), shift=_scan_shift, shift_inside=_scan_shift,
              zero_sum=_scan_zero_sum, body_facts=_scan_body_facts, body_zero_sum=_scan_body_zero_sum,
              bodies=_scan_bodies, rebind=_scan_rebind,
              variants=("stacked layers", "carry leak", "zero length")))
register(Rule("cond", _prims("cond_p"), shift=_cond_shift, shift_inside=_cond_shift,
              zero_sum=_cond_zero_sum, body_facts=_passed_body_facts, body_zero_sum=_cond_body_zero_sum,
              bodies=_cond_bodies, rebind=_cond_rebind,
              variants=("two branches", "switch", "index from stream")))
register(Rule("while", _prims("while_p"), shift=_while_shift, shift_inside=_while_shift,
              zero_sum=_while_zero_sum, body_facts=_passed_body_facts, body_zero_sum=_while_body_zero_sum,
              bodies=_while_bodies, rebind=_while_rebind,
              variants=("fixed trip count", "fori traced bounds", "stream predicate", "false at entry")))
register(Rule("call", compat.call_prims(), inline=_call_inline, bodies=_call_bodies, rebind=_call_rebind))
register(Rule("shard_map", compat.shard_map_prims(), shift=_shard_map_shift, shift_inside=_shard_map_shift,
              zero_sum=_shard_map_zero_sum, body_facts=_shard_map_body_facts,
              body_zero_sum=_shard_map_body_zero_sum, bodies=_shard_map_bodies, rebind=_shard_map_rebind,
              shards=lambda node, i: compat.shard_map_operand_axes(node.params, i, len(node.ins[i].shape)),
              variants=("normalized axis local", "normalized axis sharded", "replicated output")))
# a sum of zero-sum values is zero-sum: each shard's operand over the same blocks
register(Rule("psum", compat.psum_prims(), facts=_psum_facts, shift=_psum_shift,
              zero_sum=lambda node, k, spec, ctx: [Need(k, spec)], simplify=_psum_simplify,
              across=lambda node: compat.psum_axes(node.params)))
