"""Re-traces a jaxpr with a fold plan applied.

The folded program is produced by interpreting the original jaxpr under the
caller's trace (so ``jit``/``make_jaxpr`` rebuild it), with these changes,
all keyed by the call-site paths of ``program.Program``: removed mean
reductions yield a symbolic ``Zero`` that each primitive's rule simplifies
away (``h - 0 = h``, ``0 * y = 0``), auxiliary centerings are inserted after
the values the plan names, captured constants are centered, untied copies
replace a parameter at one use, and proven epilogues run as the RMSNorm
kernel (fused with the residual add that feeds them where that is proved),
operands the plan names are multiplied by a Hadamard matrix before their
equation reads them (``OperandMap``: online_hadamard), and values and program
outputs are multiplied by a rotation of the extras (``RotationAt``: rotate, for
a stream that starts at a value no parameter writes or ends at an output).
A call whose body the plan does not touch is bound unchanged, so its custom
differentiation rules are kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxfold._src import compat, defer_analysis, hadamard, kernels, layout
from jaxfold._src.rules import rule_for
from jaxfold._src.zero import Zero


class CenterAt(NamedTuple):
  """An auxiliary centering of the value (or captured constant) ``key`` by ``spec``."""
  key: tuple
  spec: tuple


class UntiedUse(NamedTuple):
  """Operand ``operand`` of the equation at ``path`` reads the parameter copy
  ``name`` (in the extras), through ``chain``: the casts and re-indexing
  equations between the tied parameter and that use."""
  path: tuple
  operand: int
  name: str
  chain: tuple


class BiasAt(NamedTuple):
  """The extras' parameter ``name`` is added to the value ``key``."""
  key: tuple
  name: str


class OperandMap(NamedTuple):
  """Operand ``operand`` of the equation at ``path`` is multiplied by the
  normalized Hadamard matrix along its ``axis`` (``hadamard_transform``) before
  the equation reads it (online_hadamard: the weight it meets was multiplied by
  the same matrix along the paired dim, so the contraction is unchanged)."""
  path: tuple
  operand: int
  axis: int


class RotationAt(NamedTuple):
  """A rotation by the extras' matrix ``name`` along ``axis``: the value
  ``key`` (every reader's) times ``Q``; with ``key = (path, "operand", k)``,
  operand k of that equation (that use only) times ``Qᵀ``, and with ``key =
  ("output", i)`` program output i times ``Qᵀ`` (a rotated stream leaving)."""
  key: tuple
  axis: int
  name: str


class ConstantAt(NamedTuple):
  """The value ``key`` (one no input reaches) is replaced by ``value``, its
  auxiliary centering computed once at fold time."""
  key: tuple
  value: Any


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything the rewrite needs, keyed by paths (see program.Val.key)."""
  zero: frozenset = frozenset()               # paths of reduce_sum to remove
  aux: tuple[CenterAt, ...] = ()
  consts: tuple[CenterAt, ...] = ()
  untied: tuple[UntiedUse, ...] = ()
  epilogues: tuple = ()                       # kernels.Epilogue of proven sites
  norm_impl: str = "auto"                     # see kernels.IMPLS
  biases: tuple[BiasAt, ...] = ()
  deferred: tuple = ()                        # defer_analysis.Deferred: contractions reading x, scaled by s
  constants: tuple[ConstantAt, ...] = ()      # values replaced by fold-time constants
  hadamards: tuple[OperandMap, ...] = ()      # operands rotated online before their equation
  quantized: tuple = ()                       # quantize.QuantizedAt: contractions run through qwix
  rotations: tuple[RotationAt, ...] = ()      # values and outputs multiplied by a rotation

  @property
  def touched(self) -> frozenset:
    paths = set(self.zero) | {k[0] for k, _ in self.aux} | {k[0] for k, _ in self.consts}
    paths |= {u for u, *_ in self.untied}
    paths |= {k[0] for k, _ in self.biases} | {k[0] for k, _ in self.constants}
    paths |= {m.path for m in self.hadamards} | {q.path for q in self.quantized}
    paths |= {r.key[0] for r in self.rotations if r.key[0] != "output"}   # (value and operand keys)
    paths |= {e.path for e in self.deferred} | {k[0] for e in self.deferred for k in (e.x, e.s)}
    paths |= {e.kernel.add[0] for e in self.deferred if e.kernel is not None and e.kernel.add is not None}
    if self.norm_impl != "xla":
      paths |= {e.out_path for e in self.epilogues}
      paths |= {e.add_path for e in self.epilogues if e.add_path is not None}
    return frozenset(p[:i] for p in paths for i in range(len(p) + 1))


class _Eqn:
  """An equation seen through the interface rule facets use (``node.outs``...)."""
  __slots__ = ("eqn",)

  def __init__(self, eqn):
    self.eqn = eqn

  @property
  def prim(self):
    return self.eqn.primitive

  @property
  def params(self):
    return self.eqn.params

  @property
  def ins(self):
    return [_Aval(a.aval) for a in self.eqn.invars]

  @property
  def outs(self):
    return [_Aval(v.aval) for v in self.eqn.outvars]


class _Aval:
  __slots__ = ("aval",)

  def __init__(self, aval):
    self.aval = aval

  @property
  def shape(self):
    return tuple(self.aval.shape)

  @property
  def dtype(self):
    return self.aval.dtype


def _simplify(eqn, invals) -> list | None:
  """Outputs of ``eqn`` when some inputs are Zero (its rule's facet), or None."""
  zeros = [isinstance(v, Zero) for v in invals]
  fn = rule_for(eqn.primitive).simplify(_Eqn(eqn), zeros)
  return None if fn is None else list(fn(invals))


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], plan: Plan,
             extras: dict, prefix: tuple = (), values: dict | None = None, observe: Any = None) -> list:
  """Evaluates ``jaxpr`` with ``plan`` applied under the current trace.

  ``values`` maps value keys to what they evaluated to, across call levels,
  so a kernel substitution reads the operands its proof names; ``observe``
  (optional) is called as ``observe(path, eqn, invals)`` before each equation
  outside a loop or branch body (quantize measures its contractions' errors so).
  """
  jaxpr, inner_consts = compat.open_jaxpr(jaxpr)
  consts = list(consts) if consts else inner_consts
  if values is None:
    kernels.announce(plan.norm_impl)
  values = {} if values is None else values
  env: dict = {}
  kernels_at = {e.out_path: e for e in plan.epilogues} if plan.norm_impl != "xla" else {}
  fused_at = {e.add_path: e for e in plan.epilogues
              if e.add_path is not None and plan.norm_impl != "xla"}
  aux = dict(plan.aux)
  constants = dict(plan.constants)
  biases = dict(plan.biases)
  centered = dict(plan.consts)
  untied = {(u.path, u.operand): (u.name, u.chain) for u in plan.untied}
  deferred = {e.path: e for e in plan.deferred}
  quantized = {q.path: q for q in plan.quantized}
  rotations = {r.key: r for r in plan.rotations}
  left: dict = {}   # (var, RotationAt) -> the value un-rotated
  online: dict = {}
  for m in plan.hadamards:
    online.setdefault((m.path, m.operand), []).append(m.axis)
  # The add of a kernel reader's own bias: the reader is held (defer_analysis.Pending) until it.
  own_bias = ({e.kernel.add[0]: e for e in plan.deferred if e.kernel is not None and e.kernel.add is not None}
              if plan.norm_impl != "xla" else {})
  touched = plan.touched
  grouped: dict = {}    # outputs of a sibling group's launch, for the readers after its leader

  def read(a):
    return compat.literal_value(a) if compat.is_literal(a) else env[a]

  def write(v, val, key, biased=False):
    if key in constants:
      val = constants[key]
    if key in aux:
      val = _aux(val, aux[key])
    if key in biases and not biased:
      val = _materialize(val) + extras[biases[key]]
    if key in rotations:
      val = _rotate(_materialize(val), rotations[key], extras)
    if compat.is_var(v):
      env[v] = val
    if not isinstance(val, defer_analysis.Pending):   # (a kernel substitution reading it computes it as written)
      values[key] = val

  for i, (v, c) in enumerate(zip(compat.constvars(jaxpr), consts)):
    key = (prefix, "const", i)
    write(v, layout.center(jnp.asarray(c), dict(centered[key])) if key in centered else c, key)
  for i, (v, a) in enumerate(zip(jaxpr.invars, args)):
    write(v, a, (prefix, "in", i))

  def runner(path):
    def run(body, args, sub=None, isolated=False):
      """Evaluates ``body`` with the plan: a loop or branch body (``sub`` = its
      index) at ``path + (sub,)`` with values of its own, a call's body at
      ``path`` itself (program.Program flattens calls), sharing ``values``
      unless ``isolated`` (a remat boundary: values inside stay inside)."""
      inner, inner_consts = compat.open_jaxpr(body)
      if sub is not None:
        return evaluate(inner, inner_consts, list(args), plan, extras, path + (sub,))
      return evaluate(inner, inner_consts, list(args), plan, extras, path,
                      dict(values) if isolated else values, observe)
    return run

  for i, eqn in enumerate(jaxpr.eqns):
    path = prefix + (i,)
    rule = rule_for(eqn.primitive)
    invals = [read(a) for a in eqn.invars]
    if path not in own_bias:
      invals = _unhold(invals)
    for k in range(len(invals)):
      if (path, k) in untied:
        invals[k] = _untied_value(untied[(path, k)], extras)
      for axis in online.get((path, k), ()):
        invals[k] = hadamard.hadamard_transform(_materialize(invals[k]), axis)
      if (path, "operand", k) in rotations:   # (one y @ Qᵀ per value, whichever equations read it)
        at, var = rotations[(path, "operand", k)], eqn.invars[k]
        if (var, at) not in left:
          left[(var, at)] = _rotate(_materialize(invals[k]), at, extras, transpose=True)
        invals[k] = left[(var, at)]
    outs, biased = None, False
    if observe is not None and rule.inline(eqn) is None:
      observe(path, eqn, [_materialize(v) for v in invals])
    if path in quantized:
      outs = quantized[path].contract(eqn, [_materialize(v) for v in invals], extras)
    elif path in own_bias:
      outs = defer_analysis.resolve(own_bias[path], eqn, invals)
      if outs is None:
        invals = _unhold(invals)
    if outs is not None:
      pass
    elif path in kernels_at:
      outs = _kernel(kernels_at[path], eqn, values, plan)
    elif path in fused_at and (path, "out", 0) not in aux and (path, "out", 0) not in biases:
      # (the kernel's sum must be the value every consumer reads, unchanged)
      outs = _fused(fused_at[path], eqn, invals, values, plan)
    if outs is None and path not in grouped and path in deferred and _leads(deferred[path], plan):
      grouped.update(_run_group(deferred, path, untied, extras, biases, aux, values, plan) or {})
    if outs is None and path in grouped:   # (a sibling group's launch ran at its leader)
      out, biased = grouped.pop(path)
      outs = [out]
    if outs is None and path in deferred:
      key = (path, "out", 0)
      bias = extras[biases[key]] if key in biases and key not in aux else None
      outs, biased = defer_analysis.run(deferred[path], eqn, invals, values, plan.norm_impl, bias,
                                  key not in aux)    # hold: a kernel reader with its own bias
    if outs is not None:
      pass
    elif path in plan.zero:
      outs = [Zero(eqn.outvars[0].aval)]
    elif path in touched and rule.rebind is not None:
      outs = list(rule.rebind(eqn, [_materialize(v) for v in invals], runner(path)))
    else:
      if any(isinstance(v, Zero) for v in invals):
        outs = _simplify(eqn, invals)
        if outs is None:
          invals = [v.materialize() if isinstance(v, Zero) else v for v in invals]
      if outs is None:
        outs = compat.bind_eqn(eqn, invals)
        if kernels_at and rule.inline(eqn) is not None:
          # A kernel may read a value the program sees inside this untouched
          # call (program.Program flattens calls): record it under that key.
          for k, key in _call_out_keys(eqn, path):
            if key is not None and key not in values:
              values[key] = outs[k]
    for k, (v, val) in enumerate(zip(eqn.outvars, outs)):
      write(v, val, (path, "out", k), biased)
  outs = [_materialize(v) for v in (read(a) for a in jaxpr.outvars)]
  if not prefix:
    outs = [_rotate(o, rotations[("output", i)], extras, transpose=True) if ("output", i) in rotations else o
            for i, o in enumerate(outs)]
  return outs


def _leads(entry, plan) -> bool:
  k = entry.kernel
  return k is not None and bool(k.group) and k.group[0].path == entry.path and plan.norm_impl != "xla"


def _run_group(deferred, path, untied, extras, biases, aux, values, plan):
  """At a sibling group's leader: every member's output from one launch, or None."""
  members = deferred[path].kernel.group
  entries = {m.path: deferred[m.path] for m in members}
  weights, fused = [], []
  for m in members:
    out = (m.path, "out", 0)
    if out in aux:
      return None
    side = 1 - entries[m.path].operand
    if (m.path, side) in untied:
      w = _untied_value(untied[(m.path, side)], extras)
    else:
      w = values.get(m.w)
      if w is not None and m.convert:   # (mixed precision: the member's own cast, computed here first)
        w = _through(_materialize(w), m.convert)
    weights.append(w)
    fused.append(extras[biases[out]] if out in biases else None)
  return defer_analysis.run_group(entries, weights, fused, values, plan.norm_impl)


def _untied_value(entry: tuple, extras: dict):
  """An untied operand: its copy in ``extras`` through the chain of equations
  (converts, reshapes) between the tied parameter and the reader."""
  name, chain = entry
  return _through(extras[name], chain)


def _through(val, chain: tuple):
  """``val`` through a chain of single-operand equations (casts, re-indexing)."""
  for ceqn in chain:
    val = compat.bind_eqn(ceqn, [val])[0]
  return val


def _unhold(invals: list) -> list:
  """``invals`` with every held kernel reader (``defer_analysis.Pending``) computed."""
  return [v.materialize() if isinstance(v, defer_analysis.Pending) else v for v in invals]


def _materialize(x):
  return x.materialize() if isinstance(x, (Zero, defer_analysis.Pending)) else x


def _call_out_keys(eqn, path) -> list:
  """(k, key) per output of a call equation: the key program.Program gives the
  value it returns (an equation output inside the body, at any depth)."""
  inner, _ = compat.open_jaxpr(rule_for(eqn.primitive).inline(eqn).body)
  made = {}
  for j, e in enumerate(inner.eqns):
    for k, v in enumerate(e.outvars):
      made[v] = (e, path + (j,), k)
  consts = {v: i for i, v in enumerate(compat.constvars(inner))}
  out = []
  for k, v in enumerate(inner.outvars):
    if compat.is_literal(v):
      out.append((k, None))
    elif v in consts:
      out.append((k, (path, "const", consts[v])))
    elif v in made:
      e, p, i = made[v]
      if rule_for(e.primitive).inline(e) is not None:
        out.append((k, dict(_call_out_keys(e, p))[i]))
      else:
        out.append((k, (p, "out", i)))
    else:
      out.append((k, None))  # an input of the call: already recorded outside
  return out


def _rotate(x, at: RotationAt, extras: dict, transpose: bool = False):
  """``x ×_axis Q`` (or ``Qᵀ``) for the extras' ``Q``, in ``x``'s dtype at full precision."""
  q = jnp.asarray(extras[at.name]).astype(x.dtype)
  y = jnp.tensordot(x, q.T if transpose else q, axes=([at.axis], [0]), precision=jax.lax.Precision.HIGHEST)
  return jnp.moveaxis(y, -1, at.axis)


def _aux(x, spec):
  x = x.materialize() if isinstance(x, Zero) else x
  return layout.center(x, dict(spec))


def _fused_key(ep) -> tuple:
  return ("fused-normalized", ep.out_path)


def _fused(ep, eqn, invals, values, plan):
  """The residual add as the fused add+RMSNorm kernel: returns the sum (used
  by every consumer of the add) and keeps the normalized value for the
  norm's output equation; None keeps the add (the norm then runs alone)."""
  from jaxfold._src import kernels
  a, b = invals
  if isinstance(a, Zero) or isinstance(b, Zero):
    return None
  interpret = kernels.use_kernel(plan.norm_impl, a.shape, a.dtype)
  if interpret is None or any(k is not None and k not in values for k in (ep.gamma, ep.beta)):
    return None
  gamma = values[ep.gamma] if ep.gamma is not None else None
  beta = values[ep.beta] if ep.beta is not None else None
  y, h = kernels.run_fused(ep, a, b, gamma, beta, interpret)
  values[_fused_key(ep)] = y
  return [h]


def _kernel(ep, eqn, values, plan):
  from jaxfold._src import kernels
  y = values.pop(_fused_key(ep), None)
  if y is not None:
    return [y.astype(eqn.outvars[0].aval.dtype)]
  x = values.get(ep.x)
  if x is None or isinstance(x, Zero):
    return None
  interpret = kernels.use_kernel(plan.norm_impl, x.shape, x.dtype)
  if interpret is None:
    return None
  if any(k is not None and k not in values for k in (ep.gamma, ep.beta)):
    return None
  gamma = values[ep.gamma] if ep.gamma is not None else None
  beta = values[ep.beta] if ep.beta is not None else None
  return [kernels.run_kernel(ep, x, gamma, beta, eqn.outvars[0].aval, interpret)]
