"""Evaluate a jaxpr with NumPy, falling back to JAX (eager) for what it does not know.

Why: the fuzzer runs hundreds of tiny programs, each several times (original,
folded, CBWC, gradients, shifted parameters, two batch sizes). On a small CPU
machine XLA spends ~30-80 ms compiling each new (primitive, shape) kernel in
eager mode and ~0.5 s per jitted program, which makes a few hundred programs
take most of an hour. Tracing each function once (``jax.make_jaxpr``) and
evaluating the jaxpr here costs milliseconds.

Semantics: every primitive handled in NumPy follows XLA's definition (dtype of
the output aval, truncating integer division, C ``fmod`` remainders, clamped
dynamic-slice starts, round-half-even ``round``, ...); anything else —
gathers, scatters, convolutions, special functions, random bits, Pallas calls,
and any primitive or parameter layout not recognised (e.g. other JAX
versions) — is bound eagerly through JAX, which is exactly ``eval_jaxpr``.
Sub-jaxprs of ``jit``, ``checkpoint``, ``custom_jvp_call``, ``custom_vjp_call``,
``scan``, ``while`` and ``cond`` are evaluated recursively.

The checks only compare results of this evaluator with each other, and every
failure they find is re-checked with plain JAX before it is reported.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with NumPy)
import numpy as np
from jax.extend import core as jcore

_FALLBACKS: dict = {}      # primitive name -> count (for diagnostics)


def trace(fn: Callable, *args):
  """(closed jaxpr, output treedef) of ``fn(*args)``."""
  closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
  return closed, jax.tree_util.tree_structure(shapes)


def run(fn: Callable, *args):
  """``fn(*args)`` evaluated with this evaluator (outputs as NumPy arrays)."""
  closed, tree = trace(fn, *args)
  outs = eval_closed(closed, jax.tree_util.tree_leaves(args))
  return jax.tree_util.tree_unflatten(tree, outs)


def eval_closed(closed, args: list) -> list:
  with np.errstate(all="ignore"):
    return eval_jaxpr(closed.jaxpr, list(closed.consts), args)


def _np(x):
  if isinstance(x, np.ndarray):
    return x
  if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.extended):
    return x                    # PRNG keys stay JAX arrays
  return np.asarray(x)


def eval_jaxpr(jaxpr, consts: list, args: list) -> list:
  env: dict = {}

  def read(v):
    if isinstance(v, jcore.Literal):
      return np.asarray(v.val, dtype=v.aval.dtype)
    return env[v]

  def write(v, x):
    if not isinstance(v, jcore.DropVar):
      env[v] = x

  for v, x in zip(jaxpr.constvars, consts):
    write(v, _np(x))
  for v, x in zip(jaxpr.invars, args):
    write(v, _np(x))
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    outs = _apply(eqn, ins)
    for v, x in zip(eqn.outvars, outs):
      write(v, x)
  return [read(v) for v in jaxpr.outvars]


def _fit(x, aval):
  """Cast to the output aval's dtype (NumPy promotes where XLA does not)."""
  x = np.asarray(x)
  dt = np.dtype(aval.dtype)
  if x.dtype != dt:
    x = x.astype(dt)
  if x.shape != tuple(aval.shape):
    x = np.broadcast_to(x, tuple(aval.shape)).copy()
  return x


def _plain(aval) -> bool:
  dt = getattr(aval, "dtype", None)
  return (dt is not None and hasattr(aval, "shape")
          and not jnp.issubdtype(dt, jax.dtypes.extended))


def _apply(eqn, ins: list) -> list:
  name = eqn.primitive.name
  h = _HANDLERS.get(name)
  if h is not None and (name in _RECURSIVE or not any(isinstance(x, jax.Array) for x in ins)):
    try:
      outs = h(eqn, *ins)
    except _Unsupported:
      outs = None
    if outs is not None:
      if not eqn.primitive.multiple_results:
        outs = [outs]
      return [_fit(o, v.aval) if _plain(v.aval) and not isinstance(o, jax.Array) else o
              for o, v in zip(outs, eqn.outvars)]
  return _fallback(eqn, ins)


class _Unsupported(Exception):
  pass


def _fallback(eqn, ins: list) -> list:
  _FALLBACKS[eqn.primitive.name] = _FALLBACKS.get(eqn.primitive.name, 0) + 1
  args = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in ins]
  # (a primitive with a sub-jaxpr, e.g. shard_map, binds it as a function: get_bind_params)
  bp = eqn.primitive.get_bind_params(eqn.params)
  subfuns, params = bp if isinstance(bp, tuple) else ((), bp)
  outs = eqn.primitive.bind(*subfuns, *args, **params)
  if not eqn.primitive.multiple_results:
    outs = [outs]
  return [_np(o) for o in outs]


# ----------------------------------------------------------------------------
# Handlers: (eqn, *inputs) -> output (or list of outputs for multiple_results).

_HANDLERS: dict = {}


def _h(*names):
  def deco(fn):
    for n in names:
      _HANDLERS[n] = fn
    return fn
  return deco


def _unary(name, f):
  _HANDLERS[name] = lambda eqn, x: f(x)


def _is_int(x) -> bool:
  return np.issubdtype(x.dtype, np.integer)


def _is_bool(x) -> bool:
  return x.dtype == np.bool_


for _n, _f in {
    "neg": np.negative, "sin": np.sin, "cos": np.cos, "tan": np.tan, "asin": np.arcsin,
    "acos": np.arccos, "atan": np.arctan, "sinh": np.sinh, "cosh": np.cosh, "tanh": np.tanh,
    "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh, "exp": np.exp, "exp2": np.exp2,
    "expm1": np.expm1, "log": np.log, "log1p": np.log1p, "sqrt": np.sqrt,
    "rsqrt": lambda x: np.reciprocal(np.sqrt(x)), "cbrt": np.cbrt, "abs": np.abs,
    "floor": np.floor, "ceil": np.ceil, "is_finite": np.isfinite, "square": np.square,
    "real": np.real, "imag": np.imag, "conj": np.conj,
    "logistic": lambda x: np.reciprocal(1 + np.exp(-x)),
    "copy": lambda x: x.copy(), "copy_p": lambda x: x.copy(),
}.items():
  _unary(_n, _f)


@_h("sign")
def _sign(eqn, x):
  return np.sign(x)


@_h("not")
def _not(eqn, x):
  return np.logical_not(x) if _is_bool(x) else np.invert(x)


@_h("round")
def _round(eqn, x):
  method = int(eqn.params.get("rounding_method", 0))
  if method == 0:          # away from zero
    return np.sign(x) * np.floor(np.abs(x) + 0.5)
  return np.round(x)       # half to even


@_h("integer_pow")
def _ipow(eqn, x):
  y = int(eqn.params["y"])
  if _is_int(x) and y < 0:
    raise _Unsupported
  if y == 0:
    return np.ones_like(x)
  acc = None
  base = x
  n = abs(y)
  while n:                 # exponentiation by squaring, as XLA
    if n & 1:
      acc = base if acc is None else acc * base
    n >>= 1
    if n:
      base = base * base
  return np.reciprocal(acc) if y < 0 else acc


@_h("population_count")
def _popcnt(eqn, x):
  bits = x.dtype.itemsize * 8
  u = x.astype(np.dtype(f"u{x.dtype.itemsize}")).astype(np.uint64)
  c = np.zeros(x.shape, np.uint64)
  for _ in range(bits):
    c += u & np.uint64(1)
    u >>= np.uint64(1)
  return c.astype(x.dtype)


@_h("clz")
def _clz(eqn, x):
  bits = x.dtype.itemsize * 8
  u = x.astype(np.dtype(f"u{x.dtype.itemsize}")).astype(np.uint64)
  n = np.full(x.shape, bits, np.int64)
  for k in range(bits):
    n = np.where((u >> np.uint64(k)) & np.uint64(1) == 1, bits - 1 - k, n)
  return n.astype(x.dtype)


# --- special functions (SciPy, float64; cast to the output dtype)

def _special():
  try:
    import scipy.special as sp
  except ImportError:  # pragma: no cover - then JAX evaluates them
    return
  for name, f in {"lgamma": sp.gammaln, "digamma": sp.psi, "erf": sp.erf, "erfc": sp.erfc,
                  "erf_inv": sp.erfinv, "bessel_i0e": sp.i0e, "bessel_i1e": sp.i1e}.items():
    _HANDLERS[name] = (lambda f: lambda eqn, x: f(x.astype(np.float64))  # noqa: B023 - bound by the call
                       if np.issubdtype(x.dtype, np.floating) else _unsup())(f)
  for name, f in {"igamma": sp.gammainc, "igammac": sp.gammaincc, "zeta": sp.zeta,
                  "polygamma": lambda n, x: sp.polygamma(n.astype(np.int64), x)}.items():
    _HANDLERS[name] = (lambda f: lambda eqn, a, b: f(a.astype(np.float64), b.astype(np.float64))  # noqa: B023
                       if np.issubdtype(b.dtype, np.floating) and np.all(np.isfinite(a)) else _unsup())(f)


# --- binary arithmetic

_HANDLERS["add"] = lambda eqn, a, b: a + b
_HANDLERS["add_any"] = lambda eqn, a, b: a + b
_HANDLERS["sub"] = lambda eqn, a, b: a - b
_HANDLERS["mul"] = lambda eqn, a, b: np.logical_and(a, b) if _is_bool(a) else a * b
_HANDLERS["max"] = lambda eqn, a, b: np.maximum(a, b)
_HANDLERS["min"] = lambda eqn, a, b: np.minimum(a, b)
_HANDLERS["pow"] = lambda eqn, a, b: np.power(a, b)
_HANDLERS["atan2"] = lambda eqn, a, b: np.arctan2(a, b)
_HANDLERS["nextafter"] = lambda eqn, a, b: np.nextafter(a, b)
_HANDLERS["complex"] = lambda eqn, a, b: a + 1j * b
for _n, _f in (("eq", np.equal), ("ne", np.not_equal), ("lt", np.less), ("le", np.less_equal),
               ("gt", np.greater), ("ge", np.greater_equal)):
  _HANDLERS[_n] = (lambda f: lambda eqn, a, b: f(a, b))(_f)


@_h("div")
def _div(eqn, a, b):
  if _is_int(a):
    if np.any(b == 0):
      raise _Unsupported
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q)
  return np.true_divide(a, b)


@_h("rem")
def _rem(eqn, a, b):
  if _is_int(a) and np.any(b == 0):
    raise _Unsupported
  return np.fmod(a, b)


@_h("and", "or", "xor")
def _bitwise(eqn, a, b):
  n = eqn.primitive.name
  if _is_bool(a):
    return {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}[n](a, b)
  return {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[n](a, b)


@_h("shift_left", "shift_right_logical", "shift_right_arithmetic")
def _shift(eqn, a, b):
  bits = a.dtype.itemsize * 8
  n = eqn.primitive.name
  b64 = b.astype(np.int64)
  big = (b64 < 0) | (b64 >= bits)
  s = np.where(big, 0, b64).astype(np.uint64)
  if not _is_int(a):
    raise _Unsupported
  u = np.dtype(f"u{a.dtype.itemsize}")
  au = a.astype(u).astype(np.uint64)
  if n == "shift_left":
    r = (au << s).astype(u).view(a.dtype)
    return np.where(big, np.zeros_like(r), r)
  if n == "shift_right_logical":
    r = (au >> s).astype(u).view(a.dtype)
    return np.where(big, np.zeros_like(r), r)
  if not np.issubdtype(a.dtype, np.signedinteger):
    raise _Unsupported
  return (a.astype(np.int64) >> np.where(big, bits - 1, b64)).astype(a.dtype)


@_h("mulhi")
def _mulhi(eqn, a, b):
  bits = a.dtype.itemsize * 8
  if bits > 32:
    raise _Unsupported
  wide = np.int64 if np.issubdtype(a.dtype, np.signedinteger) else np.uint64
  p = a.astype(wide) * b.astype(wide)
  return (p >> wide(bits)).astype(a.dtype)


@_h("clamp")
def _clamp(eqn, lo, x, hi):
  return np.minimum(np.maximum(x, lo), hi)


@_h("select_n")
def _select(eqn, pred, *cases):
  if _is_bool(pred):
    return np.where(pred, cases[1], cases[0]) if len(cases) == 2 else cases[0]
  shape = np.broadcast_shapes(pred.shape, *[c.shape for c in cases])
  return np.choose(np.broadcast_to(pred, shape), [np.broadcast_to(c, shape) for c in cases])


@_h("convert_element_type")
def _convert(eqn, x):
  dt = np.dtype(eqn.params["new_dtype"])
  if dt == np.bool_:
    return x != 0
  if np.issubdtype(dt, np.integer) and not _is_int(x) and not _is_bool(x):
    if np.iscomplexobj(x):
      raise _Unsupported
    info = np.iinfo(dt)
    t = np.trunc(x)
    if np.any(~np.isfinite(t)) or np.any(t < info.min) or np.any(t > info.max):
      raise _Unsupported            # XLA's saturation rules: let JAX do it
    return t.astype(dt)
  if np.iscomplexobj(x) and not np.issubdtype(dt, np.complexfloating):
    return np.real(x).astype(dt)
  return x.astype(dt)


@_h("optimization_barrier")
def _barrier(eqn, *xs):
  return list(xs)


@_h("sharding_constraint", "stop_gradient", "name")
def _identity(eqn, x):
  return x


# --- shapes and layouts

@_h("broadcast_in_dim")
def _bcast(eqn, x, *dyn):
  if dyn:
    raise _Unsupported
  shape = tuple(eqn.params["shape"])
  bd = tuple(eqn.params["broadcast_dimensions"])
  expanded = [1] * len(shape)
  for i, d in enumerate(bd):
    expanded[d] = x.shape[i]
  return np.broadcast_to(x.reshape(expanded), shape)


@_h("reshape")
def _reshape(eqn, x, *dyn):
  if dyn or eqn.params.get("dimensions") is not None:
    raise _Unsupported
  return x.reshape(tuple(eqn.params["new_sizes"]))


@_h("squeeze")
def _squeeze(eqn, x):
  return np.squeeze(x, axis=tuple(eqn.params["dimensions"]))


@_h("expand_dims")
def _expand(eqn, x):
  return np.expand_dims(x, tuple(eqn.params["dimensions"]))


@_h("transpose")
def _transpose(eqn, x):
  return np.transpose(x, tuple(eqn.params["permutation"]))


@_h("rev")
def _rev(eqn, x):
  return np.flip(x, tuple(eqn.params["dimensions"])) if eqn.params["dimensions"] else x


@_h("slice")
def _slice(eqn, x):
  starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
  strides = eqn.params["strides"] or (1,) * len(starts)
  return x[tuple(slice(s, l, st) for s, l, st in zip(starts, limits, strides))]


def _clamped_starts(idx, shape, sizes):
  return [int(min(max(int(np.asarray(i)), 0), n - s)) for i, n, s in zip(idx, shape, sizes)]


@_h("dynamic_slice")
def _dslice(eqn, x, *idx):
  sizes = tuple(eqn.params["slice_sizes"])
  if len(idx) != x.ndim:
    raise _Unsupported
  st = _clamped_starts(idx, x.shape, sizes)
  return x[tuple(slice(s, s + n) for s, n in zip(st, sizes))]


@_h("dynamic_update_slice")
def _dus(eqn, x, upd, *idx):
  if len(idx) != x.ndim:
    raise _Unsupported
  st = _clamped_starts(idx, x.shape, upd.shape)
  out = x.copy()
  out[tuple(slice(s, s + n) for s, n in zip(st, upd.shape))] = upd
  return out


@_h("concatenate")
def _concat(eqn, *xs):
  return np.concatenate(xs, axis=eqn.params["dimension"])


@_h("pad")
def _pad(eqn, x, val):
  out = x
  for d, (lo, hi, it) in enumerate(eqn.params["padding_config"]):
    n = out.shape[d]
    if it > 0 and n > 0:
      shape = list(out.shape)
      shape[d] = n + (n - 1) * it
      tmp = np.full(shape, val, out.dtype)
      sl = [slice(None)] * out.ndim
      sl[d] = slice(None, None, it + 1)
      tmp[tuple(sl)] = out
      out = tmp
    if lo < 0:
      sl = [slice(None)] * out.ndim
      sl[d] = slice(-lo, None)
      out = out[tuple(sl)]
    if hi < 0:
      sl = [slice(None)] * out.ndim
      sl[d] = slice(None, out.shape[d] + hi)
      out = out[tuple(sl)]
    if lo > 0 or hi > 0:
      widths = [(0, 0)] * out.ndim
      widths[d] = (max(lo, 0), max(hi, 0))
      out = np.pad(out, widths, constant_values=val)
  return out


@_h("split")
def _split(eqn, x):
  sizes = eqn.params["sizes"]
  return np.split(x, np.cumsum(sizes)[:-1], axis=eqn.params["axis"])


@_h("tile")
def _tile(eqn, x):
  return np.tile(x, tuple(eqn.params["reps"]))


@_h("iota")
def _iota(eqn):
  shape = tuple(eqn.params["shape"])
  d = eqn.params["dimension"]
  r = np.arange(shape[d], dtype=np.dtype(eqn.params["dtype"]))
  view = [1] * len(shape)
  view[d] = shape[d]
  return np.broadcast_to(r.reshape(view), shape)


# --- reductions

def _axes(eqn):
  return tuple(eqn.params["axes"])


_HANDLERS["reduce_sum"] = lambda eqn, x: np.sum(x, axis=_axes(eqn))
_HANDLERS["reduce_max"] = lambda eqn, x: np.max(x, axis=_axes(eqn)) if x.size else _unsup()
_HANDLERS["reduce_min"] = lambda eqn, x: np.min(x, axis=_axes(eqn)) if x.size else _unsup()
_HANDLERS["reduce_prod"] = lambda eqn, x: np.prod(x, axis=_axes(eqn))
_HANDLERS["reduce_and"] = lambda eqn, x: np.all(x, axis=_axes(eqn)) if _is_bool(x) else _unsup()
_HANDLERS["reduce_or"] = lambda eqn, x: np.any(x, axis=_axes(eqn)) if _is_bool(x) else _unsup()


def _unsup():
  raise _Unsupported


@_h("reduce_xor")
def _rxor(eqn, x):
  f = np.logical_xor if _is_bool(x) else np.bitwise_xor
  out = x
  for a in sorted(_axes(eqn), reverse=True):
    out = f.reduce(out, axis=a)
  return out


@_h("sort")
def _sort(eqn, *xs):
  if len(xs) != 1:
    raise _Unsupported
  return [np.sort(xs[0], axis=eqn.params["dimension"], kind="stable")]


@_h("top_k")
def _top_k(eqn, x):
  axis = eqn.params.get("axis", x.ndim - 1)
  if axis != x.ndim - 1 or (np.issubdtype(x.dtype, np.floating) and not np.all(np.isfinite(x))):
    raise _Unsupported
  k = eqn.params["k"]
  idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
  return [np.take_along_axis(x, idx, -1), idx.astype(np.int32)]


@_h("argmax", "argmin")
def _arg(eqn, x):
  axes = _axes(eqn)
  if len(axes) != 1 or (np.issubdtype(x.dtype, np.floating) and not np.all(np.isfinite(x))):
    raise _Unsupported
  f = np.argmax if eqn.primitive.name == "argmax" else np.argmin
  return f(x, axis=axes[0]).astype(np.dtype(eqn.params["index_dtype"]))


@_h("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _cum(eqn, x):
  axis, rev = eqn.params["axis"], eqn.params.get("reverse", False)
  f = {"cumsum": np.add.accumulate, "cumprod": np.multiply.accumulate,
       "cummax": np.maximum.accumulate, "cummin": np.minimum.accumulate,
       "cumlogsumexp": np.logaddexp.accumulate}[eqn.primitive.name]
  if _is_bool(x) or (eqn.primitive.name == "cumlogsumexp" and not np.issubdtype(x.dtype, np.floating)):
    raise _Unsupported
  if rev:
    return np.flip(f(np.flip(x, axis), axis=axis), axis)
  return f(x, axis=axis)


# --- contractions

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@_h("dot_general")
def _dot(eqn, a, b):
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  la = [None] * a.ndim
  ra = [None] * b.ndim
  it = iter(_LETTERS)
  out = []
  for i, j in zip(lb, rb):
    la[i] = ra[j] = next(it)
    out.append(la[i])
  for i, j in zip(lc, rc):
    la[i] = ra[j] = next(it)
  for i in range(a.ndim):
    if la[i] is None:
      la[i] = next(it)
      out.append(la[i])
  for j in range(b.ndim):
    if ra[j] is None:
      ra[j] = next(it)
      out.append(ra[j])
  dt = np.result_type(a, b)
  if _is_bool(a):
    raise _Unsupported
  return np.einsum(f"{''.join(la)},{''.join(ra)}->{''.join(out)}", a.astype(dt), b.astype(dt))


# --- gather / scatter-add / convolution

def _mode(eqn) -> str:
  m = str(eqn.params.get("mode"))
  for k in ("FILL_OR_DROP", "PROMISE_IN_BOUNDS", "CLIP"):
    if k in m:
      return k
  raise _Unsupported


@_h("gather")
def _gather(eqn, x, idx):
  dn = eqn.params["dimension_numbers"]
  if getattr(dn, "operand_batching_dims", ()) or not _is_int(idx):
    raise _Unsupported
  mode = _mode(eqn)
  sizes = tuple(eqn.params["slice_sizes"])
  fill = eqn.params.get("fill_value")
  if mode == "FILL_OR_DROP" and fill is None:
    raise _Unsupported
  batch_shape = idx.shape[:-1]
  k = idx.shape[-1]
  flat = idx.reshape(-1, k)
  offset_shape = tuple(n for d, n in enumerate(sizes) if d not in dn.collapsed_slice_dims)
  limit = np.array([n - s for n, s in zip(x.shape, sizes)])
  out = []
  for row in flat:
    start = np.zeros(x.ndim, np.int64)
    for j, d in enumerate(dn.start_index_map):
      start[d] = int(row[j])
    oob = bool(np.any(start < 0) or np.any(start > limit))
    start = np.clip(start, 0, limit)
    if mode == "FILL_OR_DROP" and oob:
      out.append(np.full(offset_shape, fill, x.dtype))
      continue
    sl = x[tuple(slice(int(a), int(a) + n) for a, n in zip(start, sizes))]
    out.append(sl.reshape(offset_shape))
  res = np.stack(out) if out else np.zeros((0,) + offset_shape, x.dtype)
  res = res.reshape(batch_shape + offset_shape)
  rank = len(batch_shape) + len(offset_shape)
  offset_dims = tuple(dn.offset_dims)
  batch_pos = [d for d in range(rank) if d not in offset_dims]
  perm = [0] * rank
  for i, d in enumerate(batch_pos):
    perm[d] = i
  for i, d in enumerate(offset_dims):
    perm[d] = len(batch_shape) + i
  return np.transpose(res, perm)


@_h("scatter-add", "scatter_add")
def _scatter_add(eqn, x, idx, upd):
  dn = eqn.params["dimension_numbers"]
  if getattr(dn, "operand_batching_dims", ()) or not _is_int(idx):
    raise _Unsupported
  mode = _mode(eqn)
  win_dims = tuple(dn.update_window_dims)
  batch_axes = [d for d in range(upd.ndim) if d not in win_dims]
  u = np.transpose(upd, batch_axes + list(win_dims))
  n_batch = int(np.prod([upd.shape[d] for d in batch_axes], dtype=np.int64))
  win_shape = tuple(upd.shape[d] for d in win_dims)
  u = u.reshape((n_batch,) + win_shape)
  full = list(win_shape)
  for d in sorted(dn.inserted_window_dims):
    full.insert(d, 1)
  if len(full) != x.ndim:
    raise _Unsupported
  k = idx.shape[-1]
  flat = idx.reshape(-1, k)
  limit = np.array([n - s for n, s in zip(x.shape, full)])
  out = x.copy()
  for b in range(n_batch):
    start = np.zeros(x.ndim, np.int64)
    for j, d in enumerate(dn.scatter_dims_to_operand_dims):
      start[d] = int(flat[b, j])
    if mode == "CLIP":
      start = np.clip(start, 0, limit)
    elif np.any(start < 0) or np.any(start > limit):
      continue                          # out-of-bounds windows are dropped
    out[tuple(slice(int(a), int(a) + n) for a, n in zip(start, full))] += u[b].reshape(full)
  return out


@_h("empty2")
def _empty(eqn, *xs):
  aval = eqn.outvars[0].aval
  return np.zeros(aval.shape, aval.dtype)


@_h("conv_general_dilated")
def _conv(eqn, lhs, rhs):
  p = eqn.params
  dn = p["dimension_numbers"]
  if dn is None or not np.issubdtype(lhs.dtype, np.floating):
    raise _Unsupported
  ls, rs, os_ = dn.lhs_spec, dn.rhs_spec, dn.out_spec
  x = np.transpose(lhs, ls)                 # (N, C, *spatial)
  w = np.transpose(rhs, rs)                 # (O, I, *spatial)
  nsp = x.ndim - 2
  strides = tuple(p["window_strides"])
  lhs_dil = tuple(p["lhs_dilation"] or (1,) * nsp)
  rhs_dil = tuple(p["rhs_dilation"] or (1,) * nsp)
  pads = tuple(tuple(pp) for pp in p["padding"])
  fg, bg = int(p["feature_group_count"]), int(p["batch_group_count"])
  # lhs dilation, then padding (possibly negative): as lax.pad with interior.
  cfg = [(0, 0, 0), (0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(pads, lhs_dil)]
  xp = _pad(type("E", (), {"params": {"padding_config": cfg}})(), x, np.zeros((), x.dtype))
  ksp = w.shape[2:]
  eff = [(k - 1) * d + 1 for k, d in zip(ksp, rhs_dil)]
  out_sp = [(n - e) // s + 1 for n, e, s in zip(xp.shape[2:], eff, strides)]
  if any(o <= 0 for o in out_sp):
    raise _Unsupported
  n, c = xp.shape[:2]
  o, i = w.shape[:2]
  if bg > 1:
    nb = n // bg
    parts = []
    ob = o // bg
    for g in range(bg):
      parts.append(_conv_core(xp[g * nb:(g + 1) * nb], w[g * ob:(g + 1) * ob], 1, ksp, rhs_dil, strides, out_sp))
    out = np.concatenate(parts, axis=1)
  else:
    out = _conv_core(xp, w, fg, ksp, rhs_dil, strides, out_sp)
  inv = np.argsort(os_)
  return np.transpose(out, inv)


def _conv_core(xp, w, fg, ksp, rhs_dil, strides, out_sp):
  import itertools
  n = xp.shape[0]
  o, i = w.shape[:2]
  og = o // fg
  out = np.zeros((n, o) + tuple(out_sp), np.result_type(xp, w))
  for g in range(fg):
    xg = xp[:, g * i:(g + 1) * i]
    wg = w[g * og:(g + 1) * og]
    for tap in itertools.product(*[range(k) for k in ksp]):
      sl = tuple(slice(t * d, t * d + (m - 1) * s + 1, s)
                 for t, d, m, s in zip(tap, rhs_dil, out_sp, strides))
      patch = xg[(slice(None), slice(None)) + sl]               # (N, I, *out_sp)
      kern = wg[(slice(None), slice(None)) + tap]               # (Og, I)
      out[:, g * og:(g + 1) * og] += np.einsum("ni...,oi->no...", patch, kern)
  return out


# --- calls and control flow (recursive)

def _closed(j):
  if hasattr(j, "consts") and hasattr(j, "jaxpr"):
    return j.jaxpr, list(j.consts)
  return j, []


def _call(key):
  def handler(eqn, *xs):
    j = eqn.params.get(key)
    if j is None:
      raise _Unsupported
    jaxpr, consts = _closed(j)
    return eval_jaxpr(jaxpr, consts, list(xs))
  return handler


_HANDLERS["jit"] = _call("jaxpr")
_HANDLERS["pjit"] = _call("jaxpr")
_HANDLERS["remat2"] = _call("jaxpr")
_HANDLERS["checkpoint"] = _call("jaxpr")
_HANDLERS["closed_call"] = _call("call_jaxpr")
_HANDLERS["core_call"] = _call("call_jaxpr")
_HANDLERS["custom_jvp_call"] = _call("call_jaxpr")
_HANDLERS["custom_vjp_call"] = _call("call_jaxpr")


@_h("scan")
def _scan(eqn, *xs):
  p = eqn.params
  if not {"jaxpr", "num_consts", "num_carry", "length"} <= set(p):
    raise _Unsupported
  jaxpr, consts0 = _closed(p["jaxpr"])
  nc, nk, n = p["num_consts"], p["num_carry"], p["length"]
  consts, carry, seqs = list(xs[:nc]), list(xs[nc:nc + nk]), list(xs[nc + nk:])
  ys = [None] * n
  order = range(n - 1, -1, -1) if p.get("reverse", False) else range(n)
  for i in order:
    outs = eval_jaxpr(jaxpr, consts0, consts + carry + [s[i] for s in seqs])
    carry = outs[:nk]
    ys[i] = outs[nk:]
  n_ys = len(eqn.outvars) - nk
  stacked = []
  for k in range(n_ys):
    aval = eqn.outvars[nk + k].aval
    if n == 0:
      stacked.append(np.zeros(aval.shape, aval.dtype))
    else:
      stacked.append(np.stack([np.asarray(y[k]) for y in ys]))
  return carry + stacked


@_h("while")
def _while(eqn, *xs):
  p = eqn.params
  if not {"cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"} <= set(p):
    raise _Unsupported
  cj, cc0 = _closed(p["cond_jaxpr"])
  bj, bc0 = _closed(p["body_jaxpr"])
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts, carry = list(xs[:cn]), list(xs[cn:cn + bn]), list(xs[cn + bn:])
  for _ in range(100000):
    if not bool(np.asarray(eval_jaxpr(cj, cc0, cconsts + carry)[0])):
      return carry
    carry = eval_jaxpr(bj, bc0, bconsts + carry)
  raise _Unsupported


@_h("cond")
def _cond(eqn, idx, *xs):
  branches = eqn.params.get("branches")
  if branches is None:
    raise _Unsupported
  i = int(np.clip(int(np.asarray(idx)), 0, len(branches) - 1))
  jaxpr, consts = _closed(branches[i])
  return eval_jaxpr(jaxpr, consts, list(xs))


_special()

# Handlers that recurse: they accept PRNG keys (JAX arrays) among their inputs.
_RECURSIVE = {"jit", "pjit", "remat2", "checkpoint", "closed_call", "core_call", "custom_jvp_call",
              "custom_vjp_call", "scan", "while", "cond"}


def fallbacks() -> dict:
  """Primitive name -> how many equations were evaluated by JAX instead."""
  return dict(_FALLBACKS)
