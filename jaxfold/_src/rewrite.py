"""Re-traces a jaxpr with a fold plan applied.

The folded program is produced by interpreting the original jaxpr under the
caller's trace (so ``jit``/``make_jaxpr`` rebuild it), with three changes:
removed mean reductions yield a symbolic ``Zero`` that simplifies away
(``h - 0 = h``, ``0 * y = 0``), auxiliary centerings are inserted after the
values the plan names, and untied parameter copies replace a leaf at one use.
Equations the plan does not touch are bound unchanged, sub-jaxprs included.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxfold._src import compat
from jaxfold._src import layout


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything the rewrite needs, keyed by equation paths (see graph.Node)."""
  zero: frozenset = frozenset()               # paths of reduce_sum to remove
  aux: tuple = ()                             # ((var_key, spec), ...)
  consts: tuple = ()                          # ((const_key, spec), ...)
  untied: tuple = ()                          # ((use_path, operand, name, chain eqns), ...)
  epilogues: tuple = ()                       # kernels.Epilogue of folded sites
  norm_impl: str = "auto"                     # see kernels.IMPLS

  @property
  def touched(self) -> frozenset:
    paths = set(self.zero) | {k[0] for k, _ in self.aux} | {k[0] for k, _ in self.consts}
    paths |= {u for u, *_ in self.untied}
    paths |= {e.out_path for e in self.epilogues} if self.norm_impl != "xla" else set()
    return frozenset(p[:i] for p in paths for i in range(len(p) + 1))


@dataclasses.dataclass(frozen=True)
class Zero:
  """A value known to be exactly zero; never materialised unless needed."""
  aval: Any

  def materialize(self):
    return jnp.zeros(self.aval.shape, self.aval.dtype)


def _fit(x, aval):
  x = jnp.asarray(x)
  if x.dtype != aval.dtype:
    x = x.astype(aval.dtype)
  if x.shape != tuple(aval.shape):
    x = jnp.broadcast_to(x, aval.shape)
  return x


_ZERO_PRESERVING = {lax.neg_p, lax.convert_element_type_p, lax.reshape_p, lax.broadcast_in_dim_p,
                    lax.transpose_p, lax.squeeze_p, lax.reduce_sum_p, lax.copy_p,
                    lax.slice_p, lax.dynamic_slice_p}


def _simplify(eqn, invals) -> list | None:
  """Outputs of ``eqn`` when some inputs are Zero, or None to materialise."""
  p = eqn.primitive
  zeros = [isinstance(v, Zero) for v in invals]
  out_aval = eqn.outvars[0].aval
  if p in _ZERO_PRESERVING and zeros[0]:
    return [Zero(out_aval)]
  if p is lax.mul_p or p is lax.dot_general_p:
    return [Zero(out_aval)]
  if p is lax.div_p and zeros[0]:
    return [Zero(out_aval)]
  if p in (lax.square_p,) or (p is lax.integer_pow_p and eqn.params["y"] > 0):
    return [Zero(out_aval)]
  if p is lax.add_p:
    if all(zeros):
      return [Zero(out_aval)]
    live = invals[0] if zeros[1] else invals[1]
    return [_fit(live, out_aval)]
  if p is lax.sub_p:
    if all(zeros):
      return [Zero(out_aval)]
    return [_fit(invals[0], out_aval)] if zeros[1] else [_fit(-invals[1], out_aval)]
  return None


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], plan: Plan,
             extras: dict, prefix: tuple = (), env: dict | None = None) -> list:
  """Evaluates ``jaxpr`` with ``plan`` applied under the current trace.

  ``env`` is shared with the enclosing levels, so a kernel substitution can
  read values the analysis resolved across call boundaries.
  """
  jaxpr, inner_consts = compat.open_jaxpr(jaxpr)
  consts = list(consts) if consts else inner_consts
  env = {} if env is None else env
  kernels_at = {e.out_path: e for e in plan.epilogues} if plan.norm_impl != "xla" else {}
  aux = dict(plan.aux)
  centered = dict(plan.consts)
  untied = {(u, k): (name, chain) for u, k, name, chain in plan.untied}
  touched = plan.touched

  def read(a):
    return compat.literal_value(a) if compat.is_literal(a) else env[a]

  def write(v, val):
    if compat.is_var(v):
      env[v] = val

  for i, (v, c) in enumerate(zip(compat.constvars(jaxpr), consts)):
    key = (prefix, "const", i)
    write(v, layout.center(jnp.asarray(c), dict(centered[key])) if key in centered else c)
  for i, (v, a) in enumerate(zip(jaxpr.invars, args)):
    key = (prefix, "in", i)
    write(v, _aux(a, aux[key]) if key in aux else a)

  for i, eqn in enumerate(jaxpr.eqns):
    path = prefix + (i,)
    invals = [read(a) for a in eqn.invars]
    for k in range(len(invals)):
      if (path, k) in untied:
        name, chain = untied[(path, k)]
        val = extras[name]
        for ceqn in chain:
          val = compat.bind_eqn(ceqn, [val] + [read(a) for a in ceqn.invars[1:]])[0]
        invals[k] = val
    if path in kernels_at and (outs := _kernel(kernels_at[path], eqn, env, plan)) is not None:
      pass
    elif path in plan.zero:
      outs = [Zero(eqn.outvars[0].aval)]
    elif path in touched and compat.is_call(eqn):
      outs = _call(eqn, invals, plan, extras, path, env if not compat.is_remat(eqn) else dict(env))
    elif path in touched and compat.is_scan(eqn):
      outs = _scan(eqn, invals, plan, extras, path)
    else:
      outs = None
      if any(isinstance(v, Zero) for v in invals):
        outs = _simplify(eqn, invals)
        if outs is None:
          invals = [v.materialize() if isinstance(v, Zero) else v for v in invals]
      if outs is None:
        outs = compat.bind_eqn(eqn, invals)
    for k, (v, val) in enumerate(zip(eqn.outvars, outs)):
      key = (path, "out", k)
      write(v, _aux(val, aux[key]) if key in aux else val)
  return [v.materialize() if isinstance(v, Zero) else v
          for v in (read(a) for a in jaxpr.outvars)]


def _aux(x, spec):
  x = x.materialize() if isinstance(x, Zero) else x
  return layout.center(x, dict(spec))


def _kernel(ep, eqn, env, plan):
  from jaxfold._src import kernels
  x = env.get(ep.x)
  if x is None or isinstance(x, Zero):
    return None
  interpret = kernels.use_kernel(plan.norm_impl, x.shape, x.dtype)
  if interpret is None:
    return None
  if any(v is not None and v not in env for v in (ep.gamma, ep.beta)):
    return None
  gamma = env[ep.gamma] if ep.gamma is not None else None
  beta = env[ep.beta] if ep.beta is not None else None
  return [kernels.run_kernel(ep, x, gamma, beta, eqn.outvars[0].aval, interpret)]


def _scan(eqn, invals, plan, extras, path):
  """Re-traces a scan whose body the plan changes, with lax.scan itself."""
  nc, ncar = compat.scan_partition(eqn.params)
  inner, consts = compat.open_jaxpr(eqn.params["jaxpr"])
  invals = [v.materialize() if isinstance(v, Zero) else v for v in invals]
  closed, init, xs = invals[:nc], invals[nc:nc + ncar], invals[nc + ncar:]

  def body(carry, x):
    outs = evaluate(inner, consts, list(closed) + list(carry) + list(x), plan, extras, path + (0,))
    return outs[:ncar], outs[ncar:]

  carry, ys = lax.scan(body, list(init), list(xs), length=eqn.params["length"],
                       reverse=eqn.params["reverse"], unroll=eqn.params.get("unroll", 1))
  return list(carry) + list(ys)


def _call(eqn, invals, plan, extras, path, env):
  body = compat.call_jaxpr_of(eqn)
  inner, consts = compat.open_jaxpr(body)
  invals = [v.materialize() if isinstance(v, Zero) else v for v in invals]
  run = lambda *a: evaluate(inner, consts, a, plan, extras, path, env)
  if compat.is_remat(eqn):
    run = jax.checkpoint(run, prevent_cse=eqn.params.get("prevent_cse", True),
                         policy=eqn.params.get("policy"))
  return run(*invals)
