"""Running folded norms as the Pallas RMSNorm kernel, only where proved equal.

After a fold, a site computes ``y = x * rsqrt(Σx²/n + ε) * γ + β`` spread over
several equations, in whatever formulation the model used. ``prove_epilogue``
does not match a pattern: it computes the exact canonical form of candidate
outputs with the site's mean reductions set to zero and accepts one only if
it *equals* the kernel's formula for some γ, β and the program's own ε
(same ε placement, the same 1/n, no Bessel correction, no extra scale). Any
other value keeps XLA's expression, with the reason in ``why_not``.
"""

from __future__ import annotations

import collections
import dataclasses
from fractions import Fraction
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from jaxfold._src import algebra as A
from jaxfold._src.analysis import Site
from jaxfold._src.program import Lit, Val

IMPLS = ("auto", "xla", "pallas", "interpret")
_MAX_DEPTH = 12


@dataclasses.dataclass(frozen=True, eq=False)
class Epilogue:
  out_path: tuple       # path of the equation that produces y
  x: Any                # value keys of h, γ, β (see program.Val.key)
  gamma: Any
  beta: Any
  eps: float
  hidden: int


def _vector_param(fid: int, hidden: int, top) -> Optional[Val]:
  """The Val behind a factor that is a (hidden,)-vector broadcast over rows."""
  f = A.factor(fid)
  if f.kind != "view":
    return None
  base = A.factor(f.args[0])
  v = f.key
  if base.kind != "atom" or not isinstance(base.key, Val) or base.key.program is not top:
    return None
  if int(np.prod(base.shape)) != hidden or v.offset != 0:
    return None
  if v.strides[-1] != 1 or any(s != 0 for s in v.strides[:-1]):
    return None
  return base.key


def _formula(X: A.Expr, shape: tuple, eps: Fraction, gamma: Optional[A.Expr],
             beta: Optional[A.Expr]) -> A.Expr:
  r = len(shape)
  n = shape[-1]
  ms = A.scale(A.reduce_sum(A.mul(X, X), (r - 1,), shape), Fraction(1, n))
  red = tuple(shape[:-1])
  arg = A.view_op(A.add(ms, A.const(eps)), shape,
                  lambda view: view.broadcast(shape, tuple(range(r - 1))),
                  ("broadcast", tuple(range(r - 1)))) if red else A.add(ms, A.const(eps))
  y = A.mul(X, A.app(("rsqrt",), (arg,), shape))
  if gamma is not None:
    y = A.mul(y, gamma)
  if beta is not None:
    y = A.add(y, beta)
  return y


def _match(C: A.Expr, X: A.Expr, shape: tuple, top) -> Optional[tuple]:
  """(eps, γ factor, β factor, γ Val, β Val) when C is the kernel's formula."""
  (xf,), = X.terms.keys()
  hidden = shape[-1]
  terms = list(C.terms.items())
  if not 1 <= len(terms) <= 2 or any(c != 1 for _, c in terms):
    return None
  main = [m for m, _ in terms if xf in m]
  if len(main) != 1:
    return None
  rest = [f for f in main[0] if f != xf]
  rs = [f for f in rest if A.factor(f).kind == "app" and A.factor(f).key == ("rsqrt",)]
  if len(rs) != 1 or main[0].count(xf) != 1:
    return None
  arg = A.factor(rs[0]).args[0]
  eps = arg.const_value
  if eps <= 0:
    return None
  others = [f for f in rest if f != rs[0]]
  if len(others) > 1:
    return None
  g_val = _vector_param(others[0], hidden, top) if others else None
  if others and g_val is None:
    return None
  b_terms = [m for m, _ in terms if xf not in m]
  b_val = None
  if b_terms:
    if len(b_terms[0]) != 1:
      return None
    b_val = _vector_param(b_terms[0][0], hidden, top)
    if b_val is None:
      return None
  gamma = A.single(others[0]) if others else None
  beta = A.single(b_terms[0][0]) if b_terms else None
  return eps, gamma, beta, g_val, b_val


def _size(v) -> int:
  try:
    return int(np.prod(v.shape))
  except TypeError:
    return 1 << 62


def prove_epilogue(site: Site) -> tuple:
  """(Epilogue or None, reason): the kernel may replace a folded site's
  output only when its canonical form equals the kernel's formula."""
  level = site.level
  top = level.an.top.program
  x = site.input
  shape = tuple(x.shape)
  rank = len(shape)
  if level.program is not top:
    return None, "the norm is inside a loop body"
  if site.axes != (rank - 1,) or not all(isinstance(d, int) for d in shape):
    return None, "the kernel normalizes the last axis of a fixed shape only"
  if np.dtype(x.dtype) not in (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)):
    return None, f"the kernel computes in float32, less precise than this norm's {np.dtype(x.dtype).name}"
  prog = level.program
  zero = {r.outs[0]: A.ZERO for r in site.reduces}
  X = A.atom(("kernel-x", x), shape)
  best = None
  with A.scope(), level.assuming({**zero, x: X}):
    frontier = collections.deque([(x, 0)])
    seen = set()
    while frontier:
      v, d = frontier.popleft()
      if v in seen or d > _MAX_DEPTH:
        continue
      seen.add(v)
      if v is not x and tuple(v.shape) == shape and v.producer is not None:
        try:
          C = level.canon(v)
          m = _match(C, X, shape, top)
          if m is not None:
            eps, gamma, beta, g_val, b_val = m
            if C == _formula(X, shape, eps, gamma, beta):
              best = Epilogue(v.producer.path, x.key, g_val.key if g_val else None,
                              b_val.key if b_val else None, float(eps), shape[-1])
        except A.Unrepresentable:
          pass
      for node, _ in prog.consumers.get(v, ()):
        # Only steps whose other operands are small (γ, β, ε, the reduced
        # statistics): a full-size second operand (a residual) ends the norm.
        if all(a in seen or isinstance(a, Lit) or _size(a) < _size(x) for a in node.ins):
          for o in node.outs:
            frontier.append((o, d + 1))
  if best is None:
    return None, ("no value after the norm equals x·rsqrt(Σx²/n + ε)·γ + β exactly (e.g. a "
                  "Bessel-corrected or rescaled variance); XLA's expression is kept")
  return best, ""


def use_kernel(impl: str, shape, dtype) -> Optional[bool]:
  """None: keep XLA; else the ``interpret`` flag for pallas_kernels.rms_norm.

  ``"pallas"`` means the kernel wherever it lowers: pallas_kernels picks it
  per lowering platform (CUDA) and XLA's expression elsewhere, so a fold
  compiled ahead of time for a GPU from a CPU host carries the kernel.
  ``"auto"`` does so only on a GPU host where the kernel is expected to win.
  """
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
