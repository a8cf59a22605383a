"""Running folded norms as the Pallas RMSNorm kernel.

After a fold, a site computes ``y = h * rsqrt(E[h²] + ε) * γ + β`` spread over
several equations. ``match_epilogue`` recognises that shape in the common
formulations (flax linen/nnx LayerNorm, hand-written ``x * rsqrt(...)``),
over the last axis only, and the rewrite then computes ``y`` with one kernel
call. Anything it does not recognise keeps the XLA expression, which is
always correct: this is a speed substitution, not a soundness decision.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jax import lax

from jaxfold._src import compat
from jaxfold._src.analysis import _LAYOUT, _UNARY_SAME, _scalar_literal, shape_of
from jaxfold._src.graph import Graph

IMPLS = ("auto", "xla", "pallas", "interpret")


@dataclasses.dataclass(frozen=True, eq=False)
class Epilogue:
  out_path: tuple       # path of the equation that produces y
  x: Any                # h, γ, β as graph values (resolved across calls)
  gamma: Any
  beta: Any
  eps: float
  hidden: int


def _chain_back(g: Graph, v: Any, ops) -> Any:
  """Follows single-input layout/convert equations backwards."""
  while compat.is_var(v) and v in g.producer:
    node, _ = g.producer[v]
    if node.prim in ops and len([a for a in node.invars if compat.is_var(a)]) <= 1:
      v = node.invars[0]
    else:
      break
  return v


def _producer(g: Graph, v: Any):
  return g.producer.get(v, (None, None))[0] if compat.is_var(v) else None


def _is_square_of(g: Graph, v: Any, x: Any) -> bool:
  node = _producer(g, v)
  if node is None:
    return False
  strip = lambda a: _chain_back(g, a, _UNARY_SAME)
  if node.prim is lax.square_p or (node.prim is lax.integer_pow_p and node.params["y"] == 2):
    return strip(node.invars[0]) is x
  if node.prim is lax.mul_p:
    return strip(node.invars[0]) is x and strip(node.invars[1]) is x
  return False


def match_epilogue(g: Graph, site, leaf_or_const) -> Optional[Epilogue]:
  """The RMSNorm computation left at a folded site, if it has a known shape."""
  x = site.input
  rank = len(shape_of(x))
  if site.axes != (rank - 1,):
    return None
  zeroed = {r.outvars[0] for r in site.reduces}
  # 1. The second moment: reduce_sum(x²) → scaled → [max(0, · - 0)] → + ε → rsqrt.
  inv, eps = None, None
  for node in g.nodes:
    if (node.prim is lax.reduce_sum_p and tuple(node.params["axes"]) == site.axes
        and _is_square_of(g, node.invars[0], x)):
      v = node.outvars[0]
      while True:
        users = g.consumers.get(v, [])
        if len(users) != 1:
          break
        u, _ = users[0]
        other = [a for a in u.invars if a is not v]
        if u.prim in _LAYOUT or u.prim in _UNARY_SAME:
          v = u.outvars[0]
        elif u.prim in (lax.div_p, lax.mul_p) and other and _scalar_literal(other[0]) is not None:
          v = u.outvars[0]
        elif u.prim is lax.max_p and other and _scalar_literal(other[0]) == 0.0:
          v = u.outvars[0]
        elif u.prim is lax.sub_p and u.invars[0] is v and _from_zeroed(g, u.invars[1], zeroed):
          v = u.outvars[0]
        elif u.prim is lax.add_p and other and _scalar_literal(other[0]) is not None and eps is None:
          eps = _scalar_literal(other[0])
          v = u.outvars[0]
        elif u.prim is lax.rsqrt_p and eps is not None:
          inv = u.outvars[0]
          break
        else:
          break
      if inv is not None:
        break
  if inv is None:
    return None
  # 2. The centered value n = x - mean (mean is the zeroed reduction).
  n = None
  for u, _ in g.consumers.get(x, []):
    if u.prim is lax.sub_p and u.invars[0] is x and _from_zeroed(g, u.invars[1], zeroed):
      n = u.outvars[0]
  if n is None:
    return None
  inv_like = lambda a: _chain_back(g, a, _LAYOUT | _UNARY_SAME) is inv
  param = lambda a: leaf_or_const(_chain_back(g, a, _LAYOUT | _UNARY_SAME))
  # 3. y = n * inv * γ (+ β), with the products in either order.
  users = g.consumers.get(n, [])
  if len(users) != 1 or users[0][0].prim is not lax.mul_p:
    return None
  m1 = users[0][0]
  other = m1.invars[1] if m1.invars[0] is n else m1.invars[0]
  gamma = None
  if inv_like(other):
    prod = m1.outvars[0]
    nxt = g.consumers.get(prod, [])
    if len(nxt) == 1 and nxt[0][0].prim is lax.mul_p:
      m2 = nxt[0][0]
      o = m2.invars[1] if m2.invars[0] is prod else m2.invars[0]
      if param(o) is not None:
        gamma, prod = param(o), m2.outvars[0]
  else:  # n * (inv * γ)
    node = _producer(g, other)
    if node is None or node.prim is not lax.mul_p:
      return None
    a, b = node.invars
    if inv_like(a) and param(b) is not None:
      gamma = param(b)
    elif inv_like(b) and param(a) is not None:
      gamma = param(a)
    else:
      return None
    prod = m1.outvars[0]
  beta, out = None, prod
  nxt = g.consumers.get(prod, [])
  if len(nxt) == 1 and nxt[0][0].prim is lax.add_p:
    o = nxt[0][0].invars[1] if nxt[0][0].invars[0] is prod else nxt[0][0].invars[0]
    if param(o) is not None:
      beta, out = param(o), nxt[0][0].outvars[0]
  if shape_of(out) != shape_of(x):
    return None
  hidden = shape_of(x)[-1]
  for p in (gamma, beta):
    if p is not None and shape_of(p) not in ((hidden,), (1,) * (rank - 1) + (hidden,)):
      return None
  return Epilogue(g.producer[out][0].path, x, gamma, beta, float(eps), hidden)


def _from_zeroed(g: Graph, v: Any, zeroed: set) -> bool:
  """v is a removed mean, possibly rescaled, broadcast or converted."""
  while compat.is_var(v):
    if v in zeroed:
      return True
    node = _producer(g, v)
    if node is None:
      return False
    if node.prim in _LAYOUT or node.prim in _UNARY_SAME:
      v = node.invars[0]
    elif node.prim in (lax.div_p, lax.mul_p, lax.square_p):
      v = node.invars[0]
    else:
      return False
  return False


def use_kernel(impl: str, shape, dtype) -> Optional[bool]:
  """None: keep XLA; else the ``interpret`` flag for pallas_kernels.rms_norm."""
  import jax
  if impl == "xla":
    return None
  if impl == "interpret":
    return True
  if impl == "pallas":
    return False
  import pallas_kernels
  if jax.default_backend() != "gpu" or pallas_kernels.choose(shape, dtype) != "pallas":
    return None
  return False


def run_kernel(ep: Epilogue, x, gamma, beta, out_aval, interpret: bool):
  import jax.numpy as jnp
  import pallas_kernels
  hidden = ep.hidden
  scale = jnp.reshape(gamma, (hidden,)) if gamma is not None else jnp.ones((hidden,), x.dtype)
  bias = jnp.reshape(beta, (hidden,)) if beta is not None else None
  y = pallas_kernels.rms_norm(x, scale, bias, eps=ep.eps, interpret=interpret)
  return y.astype(out_aval.dtype)
