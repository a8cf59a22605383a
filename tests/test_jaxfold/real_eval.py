"""A low-precision program evaluated in real arithmetic (approximated by float64).

``run(closed, args)`` evaluates a jaxpr traced in bfloat16/float16/float32 with
every floating-point value held in float64 and every float-to-float cast the
identity: the same equations, the same casts in the same places, no rounding
but float64's. Two programs that are equal in real arithmetic agree to ~1e-12
here, whatever rounding their own dtypes would add; a fusion that is wrong in
real arithmetic (a missing bias, γ on the wrong axis) differs by O(1). This is
how the fuse tests check exactness of bf16/f16 programs, whose casts jax would
elide in a float64 model (``astype`` to the same dtype emits no equation).

Needs ``jax_enable_x64`` (the x64 fixture).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfold._src import compat
from jaxfold._src.rules import rule_for

_DTYPE_PARAMS = ("preferred_element_type", "new_dtype", "dtype", "accumulation_type")
_CASTS = ("convert_element_type", "reduce_precision")


def _wide(x):
  x = jnp.asarray(x)
  return x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _param(k, v):
  try:
    floating = k in _DTYPE_PARAMS and v is not None and jnp.issubdtype(v, jnp.floating)
  except TypeError:
    floating = False
  return jnp.float64 if floating else v


def run(closed, args: list) -> list:
  """Outputs of ``closed`` at ``args`` (floats widened to float64) in real arithmetic."""
  assert jax.config.jax_enable_x64, "use the x64 fixture"
  jaxpr, consts = compat.open_jaxpr(closed)
  # one compilation instead of one per equation
  return jax.jit(lambda c, a: _run(jaxpr, c, a))([_wide(c) for c in consts], [_wide(a) for a in args])


def _run(jaxpr, consts, args) -> list:
  env: dict = {}

  def read(a):
    return _wide(compat.literal_value(a)) if compat.is_literal(a) else env[a]

  for v, c in zip(compat.constvars(jaxpr), consts):
    env[v] = _wide(c)
  for v, a in zip(jaxpr.invars, args, strict=True):
    env[v] = _wide(a)
  for eqn in jaxpr.eqns:
    ins = [read(a) for a in eqn.invars]
    out_float = all(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.outvars)
    if eqn.primitive.name in _CASTS and jnp.issubdtype(ins[0].dtype, jnp.floating) and out_float:
      outs = [ins[0]]                          # a float cast: the identity on the reals
    elif rule_for(eqn.primitive).inline(eqn) is not None:   # a call: its body, inline
      body, body_consts = compat.open_jaxpr(rule_for(eqn.primitive).inline(eqn).body)
      outs = _run(body, body_consts, ins)
    else:
      params = {k: _param(k, v) for k, v in eqn.params.items()}
      outs = compat.bind_eqn(eqn.replace(params=params), ins)
    for v, o in zip(eqn.outvars, outs, strict=True):
      if compat.is_var(v):
        env[v] = o
  return [read(a) for a in jaxpr.outvars]
