"""Running folded norms as the Pallas RMSNorm kernel, only where proved equal.

After a fold, a site computes ``y = x * rsqrt(Σx²/n + ε) * γ + β`` spread over
several equations, in whatever formulation the model used. ``prove_epilogue``
does not match a pattern: it computes the exact canonical form of candidate
outputs with the site's mean reductions set to zero and accepts one only if
it *equals* the kernel's formula for some γ, β and the program's own ε
(same ε placement, the same 1/n, no Bessel correction, no extra scale). Any
other value keeps XLA's expression, with the reason in ``why_not``.

The kernel reads the norm's *source*: the value before exact widenings (a
bf16 stream converted to float32, perhaps twice, is read as the bf16 value;
the kernel widens it itself). When that source is a residual add of two
full-size operands (a pre-LN block's ``h = x + f(x)``), ``prove_fused_add``
checks the add's canonical form is exactly ``a + b`` in one dtype, and the
rewrite then runs ``pallas_kernels.add_rms_norm``: one kernel that writes the
sum ``h`` (the same value: rounded once from a float32 sum, as the program's
add) for every downstream use, and the normalized output.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
from fractions import Fraction
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from jaxfold._src import algebra as A
from jaxfold._src.analysis import MeanSite
from jaxfold._src.program import Lit, Val, upstream
from jaxfold._src.rules import rule_for

IMPLS = ("auto", "xla", "pallas", "interpret")
_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
_MAX_DEPTH = 12


@dataclasses.dataclass(frozen=True, eq=False)
class Epilogue:
  out_path: tuple       # path of the equation that produces y
  x: Any                # value keys of h, γ, β (see program.Val.key)
  gamma: Any
  beta: Any
  eps: float
  hidden: int
  add_path: Optional[tuple] = None   # the residual add producing x, when fused


def _precise(a, b) -> bool:
  """dtype ``a`` represents every value of dtype ``b`` (float widening)."""
  a, b = np.dtype(a), np.dtype(b)
  if not (jnp.issubdtype(a, jnp.floating) and jnp.issubdtype(b, jnp.floating)):
    return False
  fa, fb = jnp.finfo(a), jnp.finfo(b)
  return fa.nmant >= fb.nmant and fa.nexp >= fb.nexp


def _same_value(level, node, shape) -> Optional[Val]:
  """The one operand of ``node`` that its output equals exactly (its canonical
  form is the operand's and the output dtype widens it), else None."""
  if node is None or node.subs or len(node.ins) != 1 or len(node.outs) != 1:
    return None
  (u,), (o,) = node.ins, node.outs
  if not isinstance(u, Val) or u.shape != shape or o.shape != shape:
    return None
  if not _precise(o.dtype, u.dtype):
    return None
  U = A.atom(("kernel-source", u), shape)
  with A.scope(), level.assuming({u: U}):
    try:
      return u if level.canon(o) == U else None
    except A.Unrepresentable:
      return None


def _source(level, x: Val) -> tuple:
  """(source, aliases): the value ``x`` exactly widens, and every value of the
  same level that is an exact widening of the source (source included)."""
  shape = tuple(x.shape)
  src = x
  while (u := _same_value(level, src.producer, shape)) is not None:
    src = u
  aliases, todo = [src], [src]
  while todo:
    v = todo.pop()
    for node, _ in level.program.consumers.get(v, ()):
      if _same_value(level, node, shape) is v and node.outs[0] not in aliases:
        aliases.append(node.outs[0])
        todo.append(node.outs[0])
  return src, tuple(aliases)


def _kernel_input(aliases: tuple, out_dtype) -> Optional[Val]:
  """The alias the kernel reads so its output dtype is the program's: the one
  of the output's dtype, else the source when the output is no wider."""
  for a in aliases:
    if np.dtype(a.dtype) == np.dtype(out_dtype):
      return a
  return aliases[0] if _precise(aliases[0].dtype, out_dtype) else None


def _partly_read(level, y: Val) -> bool:
  """Every use of ``y`` (through exact re-layouts) reads a strict part of it:
  its canonical form is a smaller view of ``y`` (a slice, say)."""
  prog = level.program
  n = _size(y)
  Y = A.atom(("kernel-y", y), tuple(y.shape))
  (yf,), = Y.terms.keys()
  todo, seen, partial = [y], {y}, False
  with A.scope(), level.assuming({y: Y}):
    while todo:
      v = todo.pop()
      if v in prog.output_positions:
        return False
      for node, _ in prog.consumers.get(v, ()):
        for o in node.outs:
          try:
            C = level.canon(o)
          except A.Unrepresentable:
            return False
          terms = list(C.terms.items())
          if len(terms) != 1 or terms[0][1] != 1 or len(terms[0][0]) != 1:
            return False
          f = A.factor(terms[0][0][0])
          if not (terms[0][0][0] == yf or (f.kind == "view" and f.args[0] == yf)):
            return False
          if _size(o) < n:
            partial = True
          elif _size(o) == n:
            if o not in seen:
              seen.add(o)
              todo.append(o)
          else:
            return False
  return partial


def prove_fused_add(level, src: Val, out: Val) -> tuple:
  """(add path or None, reason): ``src`` is exactly ``a + b`` of two full-size
  operands of its dtype, computed in the same call nest as the norm's output
  ``out``, whose dtype is no wider than the sum's (the fused kernel writes
  the normalized value in the operands' dtype)."""
  node = src.producer
  shape = tuple(src.shape)
  if node is None or node.subs or len(node.ins) != 2 or len(node.outs) != 1:
    return None, "the norm's input is not produced by a two-operand equation"
  a, b = node.ins
  dt = np.dtype(src.dtype)
  if not all(isinstance(o, Val) and o.shape == shape and np.dtype(o.dtype) == dt for o in (a, b)):
    return None, "the add's operands are not two full-size values of the sum's dtype"
  if any(shape[d] > 1 for o in (a, b) for d in level.constant_dims(o, shape)):
    return None, ("an operand of the add is a broadcast: the kernel would read it materialized, "
                  "so the add stays in XLA")
  if not _precise(dt, out.dtype):
    return None, f"the norm's output ({np.dtype(out.dtype).name}) is wider than the sum ({dt.name})"
  if tuple(c.path for c in node.calls) != tuple(c.path for c in out.producer.calls):
    return None, "the add and the norm's output are in different calls"
  Ea = A.atom(("add-a", a), shape)
  Eb = Ea if b is a else A.atom(("add-b", b), shape)
  with A.scope(), level.assuming({a: Ea, b: Eb}):
    try:
      ok = level.canon(src) == A.add(Ea, Eb)
    except A.Unrepresentable:
      ok = False
  if not ok:
    return None, "the norm's input is not exactly the sum of two values"
  return node.path, ""


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
  y = A.mul(X, A.app(A.RSQRT, (arg,), shape))
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
  rs = [f for f in rest if A.factor(f).kind == "app" and A.factor(f).key == A.RSQRT]
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
  except Exception:  # noqa: BLE001 - a symbolic dim (jax's InconclusiveDimensionOperation is no TypeError)
    return 1 << 62


def _small(a, x: Val, level) -> bool:
  """A side operand the norm's search may step over: smaller than ``x``, or a
  parameter or constant (through single-operand steps such as a broadcast) —
  at one row (decode at batch 1) γ is as large as ``x``. Only a search
  bound: what is proved is the exact formula."""
  for _ in range(4):
    if isinstance(a, Lit) or _size(a) < _size(x):
      return True
    node = a.producer
    if node is None:
      return level.program.is_top and (a.kind == "const" or a.kind == "in" and a.index < level.an.num_leaves)
    ins = [i for i in node.ins if isinstance(i, Val)]
    if node.subs or len(ins) != 1:
      return False
    a = ins[0]
  return False


def prove_epilogue(site: MeanSite, changed: frozenset = frozenset()) -> tuple:
  """(Epilogue or None, reason): the kernel may replace a folded site's
  output only when its canonical form equals the kernel's formula.

  ``changed``: keys of values the rewrite replaces (auxiliary centerings);
  the kernel reads the norm's source only if all its widenings are read
  unchanged (else it reads the norm's input, as the program does)."""
  ep, why, _ = _prove(site, changed, {})
  return ep, why


def _prove(site: MeanSite, changed: frozenset, assume: dict) -> tuple:
  """prove_epilogue with canonical forms under ``assume`` (Val -> Expr), plus
  the output value the kernel replaces."""
  level = site.level
  top = level.an.top.program
  shape = tuple(site.input.shape)
  rank = len(shape)
  if level.program is not top:
    return None, "the norm is inside a loop body", None
  if site.axes != (rank - 1,) or not all(isinstance(d, int) for d in shape):
    return None, "the kernel normalizes the last axis of a fixed shape only", None
  x, aliases = _source(level, site.input)
  if any(a.key in changed for a in aliases[1:]):
    x, aliases = site.input, (site.input,)
  prog = level.program
  zero = {r.outs[0]: A.ZERO for r in site.reduces}
  X = A.atom(("kernel-x", x), shape)
  best, why, best_out = None, "", None
  with A.scope(), level.assuming({**assume, **zero, x: X}):
    frontier = collections.deque([(a, 0) for a in aliases])
    seen = set()
    while frontier:
      v, d = frontier.popleft()
      if v in seen or d > _MAX_DEPTH:
        continue
      seen.add(v)
      if v not in aliases and tuple(v.shape) == shape and v.producer is not None:
        try:
          C = level.canon(v)
          m = _match(C, X, shape, top)
          if m is not None:
            eps, gamma, beta, g_val, b_val = m
            inp = _kernel_input(aliases, v.dtype)
            if inp is None:
              why = (f"the norm's output ({np.dtype(v.dtype).name}) is wider than every value "
                     "the kernel could read")
            elif np.dtype(inp.dtype) not in _KERNEL_DTYPES:
              why = (f"the kernel computes in float32, less precise than this norm's "
                     f"{np.dtype(inp.dtype).name}")
            elif C == _formula(X, shape, eps, gamma, beta):
              best = Epilogue(v.producer.path, inp.key, g_val.key if g_val else None,
                              b_val.key if b_val else None, float(eps), shape[-1])
              best_out = v
        except A.Unrepresentable:
          pass
      for node, _ in prog.consumers.get(v, ()):
        # Only steps whose other operands are small (γ, β, ε, the reduced
        # statistics): a full-size second operand (a residual) ends the norm.
        if all(a in seen or _small(a, x, level) for a in node.ins):
          for o in node.outs:
            frontier.append((o, d + 1))
  if best is None:
    return None, why or ("no value after the norm equals x·rsqrt(Σx²/n + ε)·γ + β exactly (e.g. "
                         "a Bessel-corrected or rescaled variance); XLA's expression is kept"), None
  if _partly_read(level, best_out):
    return None, ("only a part of the norm's output is read (a class token, say): XLA computes "
                  "just those rows, the kernel would write them all"), None
  if best.x == x.key:
    add_path, _ = prove_fused_add(level, x, best_out)
    if add_path is not None:
      best = dataclasses.replace(best, add_path=add_path)
  return best, "", best_out


def prove_rms_read(level, x: Val, u: Val, assume: dict) -> tuple:
  """``(source, ε)`` when ``u`` equals ``x · rsqrt(Σ_last x²/n + ε)`` exactly
  (canonical forms under ``assume``; ``x`` as an atom, read as its source: the
  value it exactly widens), else ``(None, reason)``.

  What the RMS-matmul kernel needs of a deferred norm's output ``u``: a
  contraction of ``u`` over the last axis equals the contraction of the
  source scaled by the per-row statistic the kernel computes itself. No γ, no
  β and no other scale may remain (``assume`` holds the fused γ = 1, β = 0),
  the same 1/n and ε placement as the kernel."""
  top = level.an.top.program
  shape = tuple(x.shape)
  if level.program is not top or tuple(u.shape) != shape or not all(isinstance(d, int) for d in shape):
    return None, "not a fixed-shape value of the top-level program"
  src, _ = _source(level, x)
  # The kernel reads the source only from the same call nest (the rewrite records
  # values there); else x itself.
  if src is not x and (src.producer is None or x.producer is None
                       or tuple(c.path for c in src.producer.calls) != tuple(c.path for c in x.producer.calls)):
    src = x
  X = A.atom(("rms-read", src), shape)
  with A.scope(), level.assuming({**assume, src: X}):
    try:
      C = level.canon(u)
      m = _match(C, X, shape, top)
      if m is None or m[1] is not None or m[2] is not None:
        return None, "its operand is not x · rsqrt(Σx²/n + ε) exactly over the contracted axis"
      if C != _formula(X, shape, m[0], None, None):
        return None, "its operand is not x · rsqrt(Σx²/n + ε) exactly over the contracted axis"
    except A.Unrepresentable:
      return None, "its operand has no exact canonical form"
  return src, float(m[0])


def prove_epilogues(level, assume: dict) -> list:
  """``[(Epilogue, output Val)]``: every norm of ``level`` whose output equals the
  kernel's formula, proved with canonical forms under ``assume``.

  For a program that no longer has its norms' mean reductions (a folded one):
  each sum over the last axis (a sum of squares, say) names candidates for the
  norm's input, and a candidate counts only when ``prove_epilogue``'s exact
  proof holds for it, so a wrong candidate costs time, never soundness."""
  found, paths = [], set()
  for node in level.program.nodes:
    if node.subs:
      continue
    summed = rule_for(node.prim).sums(node, level)
    if summed is None:
      continue
    k, axes = summed
    u = node.ins[k]
    if not isinstance(u, Val) or tuple(axes) != (len(u.shape) - 1,):
      continue
    # The norm's input is among the values of u's shape that u is computed from.
    near = upstream(u, 3, keep=lambda _, a, shape=u.shape: a.shape == shape)
    for x in (a for layer in near for a in layer):
      ep, _, out = _prove(MeanSite((), x, (len(x.shape) - 1,), level), frozenset(), assume)
      if ep is not None:
        if ep.out_path not in paths:
          paths.add(ep.out_path)
          found.append((ep, out))
        break
  return found


def may_use_kernel(impl: str) -> bool:
  """Whether a fold with ``impl`` can run any kernel (else its proofs are moot:
  ``"auto"`` uses the kernel only on a GPU host, see ``use_kernel``)."""
  import jax
  return impl in ("pallas", "interpret") or (impl == "auto" and jax.default_backend() == "gpu")


_XLA_LEVEL: contextvars.ContextVar = contextvars.ContextVar("jaxfold_xla_level", default=None)


@contextlib.contextmanager
def xla_level():
  """Within it no kernel is substituted (``use_kernel`` keeps XLA's expression)
  and the yielded set collects the ``norm_impl`` of every plan that asked for
  one. ``fuse_affine`` traces a folded program under it: the kernel call would
  hide the norm's γ and β, so the analysis reads the XLA expression and the
  kernels are chosen again on the fused program.

  Example:
    >>> with xla_level() as asked:
    ...   use_kernel("interpret", (2, 8), "float32") is None
    True
    >>> sorted(asked)
    ['interpret']
  """
  asked: set = set()
  token = _XLA_LEVEL.set(asked)
  try:
    yield asked
  finally:
    _XLA_LEVEL.reset(token)


def announce(impl: str) -> None:
  """A plan with ``impl`` is evaluated: within ``xla_level`` its ``norm_impl``
  is collected even when none of its norms asks for a kernel (float64 ones),
  so a transform of the result (fuse, defer) inherits it."""
  asked = _XLA_LEVEL.get()
  if asked is not None and impl != "xla":
    asked.add(impl)


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
  asked = _XLA_LEVEL.get()
  if asked is not None:
    asked.add(impl)
    return None
  if impl == "interpret":
    return True
  if impl == "pallas":
    return False
  import pallas_kernels
  if jax.default_backend() != "gpu" or pallas_kernels.choose(shape, dtype) != "pallas":
    return None
  return False


# Rows up to which ``"auto"`` runs the RMS-matmul kernel on a GPU host: decode-like
# shapes, where the GEMM is bound by reading W and the launches it saves dominate; at
# prefill cuBLAS keeps the GEMM until the kernel is measured on a GPU (a guess, as
# pallas_kernels.dispatch's table).
MATMUL_AUTO_ROWS = 64


def use_matmul_kernel(impl: str, rows: int) -> Optional[bool]:
  """None: keep XLA's deferred reader; else the ``interpret`` flag for
  ``pallas_kernels.rms_matmul`` (same ``impl`` rules as ``use_kernel``; ``"auto"``
  only on a GPU host for at most ``MATMUL_AUTO_ROWS`` rows).

  Example:
    >>> use_matmul_kernel("interpret", 8), use_matmul_kernel("xla", 8)
    (True, None)
  """
  import jax
  if impl != "auto":
    return use_kernel(impl, (rows, 1), "float32")
  asked = _XLA_LEVEL.get()
  if asked is not None:
    asked.add(impl)
    return None
  return False if jax.default_backend() == "gpu" and rows <= MATMUL_AUTO_ROWS else None


def run_rms_matmul(x, w, bias, eps: float, w_nk: bool, out_dtype, interpret: bool):
  """``(x @ w) · rsqrt(mean(x², -1) + ε) + bias`` as the Pallas kernel (x: ``(..., K)``,
  bias ``(N,)``, a tuple of ``(N,)`` vectors added in the epilogue, or None)."""
  import pallas_kernels
  return pallas_kernels.rms_matmul(x, w, bias, eps=eps, w_nk=w_nk, out_dtype=out_dtype, interpret=interpret)


def run_rms_matmul_group(x, ws, biases, eps: float, w_nk: bool, out_dtypes, interpret: bool):
  """``run_rms_matmul`` for every weight of ``ws`` in one launch (a tuple of outputs)."""
  import pallas_kernels
  return pallas_kernels.rms_matmul_group(x, ws, biases, eps=eps, w_nk=w_nk, out_dtypes=out_dtypes,
                                         interpret=interpret)


def run_kernel(ep: Epilogue, x, gamma, beta, out_aval, interpret: bool):
  import jax.numpy as jnp

  import pallas_kernels
  hidden = ep.hidden
  scale = jnp.reshape(gamma, (hidden,)) if gamma is not None else jnp.ones((hidden,), x.dtype)
  bias = jnp.reshape(beta, (hidden,)) if beta is not None else None
  y = pallas_kernels.rms_norm(x, scale, bias, eps=ep.eps, interpret=interpret)
  return y.astype(out_aval.dtype)


def run_fused(ep: Epilogue, a, b, gamma, beta, interpret: bool) -> tuple:
  """(normalized, sum) of the fused residual add + RMSNorm kernel."""
  import jax.numpy as jnp

  import pallas_kernels
  hidden = ep.hidden
  scale = jnp.reshape(gamma, (hidden,)) if gamma is not None else jnp.ones((hidden,), a.dtype)
  bias = jnp.reshape(beta, (hidden,)) if beta is not None else None
  return pallas_kernels.add_rms_norm(a, b, scale, bias, eps=ep.eps, interpret=interpret)
