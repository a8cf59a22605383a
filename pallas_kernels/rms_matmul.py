"""A matmul that applies the RMS statistic of its left operand: FlashNorm's reader kernel.

``rms_matmul(x, w, eps=ε) = (x @ w) * rsqrt(mean(x², -1) + ε)[..., None]``

Every program of a tiled matmul already loads the whole contracted row of
``x`` for its rows, so it accumulates ``Σx²`` next to the dot and scales its
own output tile: one launch computes what a deferred RMSNorm's reader needs
(Graef et al. 2024, "FlashNorm"), where XLA otherwise launches a reduction
(and an rsqrt fusion) besides the GEMM.

Implementation notes
--------------------
* Pallas Triton (``pl.pallas_call``), a 2-D grid over (row, column) tiles;
  each program loops over ``K`` in ``block_k`` steps, accumulating the dot
  and the sum of squares in ``acc = promote(x, w, float32)`` (float64 in
  interpret mode for float64 inputs). Rows, columns and ``K`` past the ends
  are masked (loads read 0), so any shape works, ``M = 1`` included.
* ``x`` may be wider than the dot's operand dtype (a float32 view of a bf16
  stream): the statistic is computed from ``x`` itself, the dot from
  ``x.astype(w.dtype)``, exactly what a program that normalizes in float32 and
  casts the normalized value to the weights' dtype computes, up to rounding.
* Tiles: at decode (``M ≤ 64``) a row tile of 16..64 and column tiles as
  narrow as 16, so that a weight-bound GEMM still has about two programs per
  H100 SM; at prefill 128 x 128 x 32 (4 warps, 3 stages).
* Chosen per lowering platform like :func:`pallas_kernels.rms_norm`: the
  kernel in the ``cuda`` branch of ``platform_dependent``, the XLA expression
  :func:`rms_matmul_reference` elsewhere; ``interpret=True`` runs the kernel
  in Pallas interpret mode everywhere (CPU numerics).
* Forward only: the wrapper is a ``jax.custom_vjp`` whose backward is the VJP
  of :func:`rms_matmul_reference`, so differentiating through it is right
  (XLA computes the gradient).

Example:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels import rms_matmul
    >>> rms_matmul(jnp.ones((3, 8)), jnp.ones((8, 5)), eps=0.0, interpret=True).tolist()[0]
    [8.0, 8.0, 8.0, 8.0, 8.0]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels._compat import pallas_api
from pallas_kernels.rms_norm import static_eps

# Name of the compiled kernel (its PTX entry and thunk name): one launch per reader.
KERNEL = "rms_matmul_fwd"
# Dtypes the compiled kernel takes for x and w (float64 only in interpret mode).
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
_F32 = jnp.float32
# Programs to aim for at decode: about two per SM of an H100 (132 SMs).
_TARGET_PROGRAMS = 264
_DECODE_ROWS = 64


# --------------------------------------------------------------------------
# Reference (also the XLA path)
# --------------------------------------------------------------------------
def _acc(x_dtype, w_dtype):
  return jnp.promote_types(jnp.promote_types(x_dtype, w_dtype), _F32)


def _dims(x_ndim: int, w_nk: bool):
  return (((x_ndim - 1,), (1 if w_nk else 0,)), ((), ()))


def rms_matmul_reference(x: jax.Array, w: jax.Array, bias: Optional[jax.Array] = None, *, eps: float,
                         out_dtype=None, w_nk: bool = False) -> jax.Array:
  """``(x.astype(w.dtype) @ w) * rsqrt(mean(x², -1) + eps) + bias`` accumulated in
  ``promote(x, w, float32)``, returned in ``out_dtype`` (default ``w.dtype``).

  ``w`` is ``(K, N)``, or ``(N, K)`` with ``w_nk``; ``bias`` ``(N,)``, a tuple of
  ``(N,)`` vectors (each added in the accumulator, in order) or None.

  Example:
      >>> import jax.numpy as jnp
      >>> rms_matmul_reference(jnp.array([[3.0, 4.0]]), jnp.eye(2), eps=0.0).tolist()
      [[0.8485281467437744, 1.1313709020614624]]
  """
  acc = _acc(x.dtype, w.dtype)
  xf = x.astype(acc)
  s = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  out = lax.dot_general(x.astype(w.dtype), w, _dims(x.ndim, w_nk), preferred_element_type=acc) * s
  for b in _biases(bias):
    out = out + b.astype(acc)
  return out.astype(out_dtype or w.dtype)


def _biases(bias) -> tuple:
  """``bias`` as a tuple of vectors (None: none; one array: one)."""
  if bias is None:
    return ()
  return tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Static:
  eps: float
  out_dtype: str
  w_nk: bool
  interpret: bool


def tiles(m: int, n: int, k: int, itemsize: int = 2) -> tuple[int, int, int, int, int]:
  """(block_m, block_n, block_k, num_warps, num_stages) for an (m, k) @ (k, n) product
  of ``itemsize``-byte operands.

  float32 operands take the exact (FMA, not TF32) dot, which holds more in registers:
  shorter K steps at decode and 8 warps at prefill (no spills on sm_90a; ptxas in
  tests/test_pallas_kernels/test_rms_matmul.py).

  Example:
      >>> tiles(8, 2304, 768)[:3], tiles(2048, 2304, 768)[:3]
      ((16, 16, 128), (128, 128, 32))
  """
  wide = itemsize >= 4
  if m <= _DECODE_ROWS:
    bm = max(16, pl.next_power_of_2(m))
    rows = pl.cdiv(m, bm)
    bn = next((b for b in (128, 64, 32) if rows * pl.cdiv(n, b) >= _TARGET_PROGRAMS), 16)
    bk = max(16, min(32 if wide else 128, pl.next_power_of_2(k)))
    return bm, bn, bk, 4, 3
  bk = max(16, min(32, pl.next_power_of_2(k)))
  return 128, 128, bk, 8 if wide else 4, 3


def _kernel(*refs, st: _Static, m: int, n: int, k: int, bk: int, acc, dot_dtype, n_bias: int):
  x_ref, w_ref, b_refs, o_ref = refs[0], refs[1], refs[2:2 + n_bias], refs[-1]
  bm, bn = o_ref.shape
  # program_id at the top level: interpret mode does not substitute it inside a loop body.
  row_ok = pl.program_id(0) * bm + jnp.arange(bm) < m
  col_ok = pl.program_id(1) * bn + jnp.arange(bn) < n
  _tile(x_ref, w_ref, b_refs, o_ref, row_ok, col_ok, st=st, k=k, bk=bk, acc=acc, dot_dtype=dot_dtype)


def _group_kernel(*refs, st: _Static, m: int, ns: tuple, starts: tuple, nb: tuple, k: int, bk: int, acc,
                  dot_dtype):
  """Segment ``s`` of the column grid (tiles ``starts[s]``...) computes reader ``s``:
  its weight, its biases, its output; one launch for every reader of one norm."""
  g = len(ns)
  x_ref, w_refs, rest = refs[0], refs[1:1 + g], refs[1 + g:]
  b_refs = []
  for c in nb:
    b_refs.append(rest[:c])
    rest = rest[c:]
  o_refs = rest
  bm, bn = o_refs[0].shape
  i, j = pl.program_id(0), pl.program_id(1)
  row_ok = i * bm + jnp.arange(bm) < m
  for s in range(g):
    t = pl.cdiv(ns[s], bn)

    @pl.when((j >= starts[s]) & (j < starts[s] + t))
    def _(s=s):
      col_ok = (j - starts[s]) * bn + jnp.arange(bn) < ns[s]
      _tile(x_ref, w_refs[s], b_refs[s], o_refs[s], row_ok, col_ok, st=st, k=k, bk=bk, acc=acc,
            dot_dtype=dot_dtype)


def _tile(x_ref, w_ref, b_refs, o_ref, row_ok, col_ok, *, st: _Static, k: int, bk: int, acc, dot_dtype):
  """One (row, column) output tile: the dot and Σx² over K, the scale, the biases."""
  api = pallas_api("triton")
  bm, bn = o_ref.shape
  prec = lax.Precision.HIGHEST if np.dtype(dot_dtype) == np.float32 else None

  def body(t, carry):
    out, ss = carry
    k_ok = t * bk + jnp.arange(bk) < k
    xb = api.load(x_ref.at[:, pl.ds(t * bk, bk)], mask=row_ok[:, None] & k_ok[None, :], other=0)
    if st.w_nk:
      wb = api.load(w_ref.at[:, pl.ds(t * bk, bk)], mask=col_ok[:, None] & k_ok[None, :], other=0)
    else:
      wb = api.load(w_ref.at[pl.ds(t * bk, bk), :], mask=k_ok[:, None] & col_ok[None, :], other=0)
    xf = xb.astype(acc)
    ss = ss + jnp.sum(xf * xf, axis=1)
    out = out + lax.dot_general(xb.astype(dot_dtype), wb, _dims(2, st.w_nk), precision=prec,
                                preferred_element_type=acc)
    return out, ss

  init = (jnp.zeros((bm, bn), acc), jnp.zeros((bm,), acc))
  out, ss = lax.fori_loop(0, pl.cdiv(k, bk), body, init)
  out = out * lax.rsqrt(ss / k + st.eps)[:, None]   # masked rows: rsqrt(ε), never stored
  for b_ref in b_refs:   # each bias vector in the accumulator, in order
    out = out + api.load(b_ref, mask=col_ok, other=0).astype(acc)[None, :]
  api.store(o_ref, out.astype(o_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


def _forward(x, w, b, st: _Static):
  m, k = x.shape
  n = w.shape[0] if st.w_nk else w.shape[1]
  bm, bn, bk, warps, stages = tiles(m, n, k, max(x.dtype.itemsize, w.dtype.itemsize))
  kp = pl.cdiv(k, bk) * bk
  x_spec = pl.BlockSpec((bm, kp), lambda i, j: (i, 0))
  w_spec = pl.BlockSpec((bn, kp), lambda i, j: (j, 0)) if st.w_nk else pl.BlockSpec((kp, bn), lambda i, j: (0, j))
  kernel = functools.partial(_kernel, st=st, m=m, n=n, k=k, bk=bk, acc=_acc(x.dtype, w.dtype), dot_dtype=w.dtype,
                             n_bias=len(_biases(b)))
  specs, args = [x_spec, w_spec], [x, w]
  for v in _biases(b):
    specs.append(pl.BlockSpec((bn,), lambda i, j: (j,)))
    args.append(v)
  params = None if st.interpret else pallas_api("triton").compiler_params(num_warps=warps, num_stages=stages)
  call = pl.pallas_call(
      kernel, grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)), in_specs=specs,
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((m, n), jnp.dtype(st.out_dtype)),
      interpret=st.interpret, compiler_params=params, name=KERNEL)
  # cuda_only: a multi-platform export must not lower the compiled kernel for the CPU.
  return call(*args) if st.interpret else _compat.cuda_only(lambda *a: [call(*a)])(*args)[0]


def _group_forward(x, ws, bs, st: _Static, out_dtypes: tuple):
  m, k = x.shape
  ns = tuple(w.shape[0] if st.w_nk else w.shape[1] for w in ws)
  bm, bn, bk, warps, stages = tiles(m, sum(ns), k, max([x.dtype.itemsize] + [w.dtype.itemsize for w in ws]))
  kp = pl.cdiv(k, bk) * bk
  ts = [pl.cdiv(n, bn) for n in ns]
  starts = tuple(sum(ts[:s]) for s in range(len(ws)))

  def cols(a, t):   # this segment's column tile; programs of other segments keep it in range
    return lambda j: jnp.clip(j - a, 0, t - 1)

  specs, args, out_specs, nb = [pl.BlockSpec((bm, kp), lambda i, j: (i, 0))], [x], [], []
  for s, w in enumerate(ws):
    c = cols(starts[s], ts[s])
    specs.append(pl.BlockSpec((bn, kp), lambda i, j, c=c: (c(j), 0)) if st.w_nk else
                 pl.BlockSpec((kp, bn), lambda i, j, c=c: (0, c(j))))
    args.append(w)
    out_specs.append(pl.BlockSpec((bm, bn), lambda i, j, c=c: (i, c(j))))
  for s, b in enumerate(bs):
    vs = _biases(b)
    nb.append(len(vs))
    c = cols(starts[s], ts[s])
    for v in vs:
      specs.append(pl.BlockSpec((bn,), lambda i, j, c=c: (c(j),)))
      args.append(v)
  acc = functools.reduce(_acc, [w.dtype for w in ws], x.dtype)
  kernel = functools.partial(_group_kernel, st=st, m=m, ns=ns, starts=starts, nb=tuple(nb), k=k, bk=bk,
                             acc=acc, dot_dtype=ws[0].dtype)
  params = None if st.interpret else pallas_api("triton").compiler_params(num_warps=warps, num_stages=stages)
  call = pl.pallas_call(
      kernel, grid=(pl.cdiv(m, bm), sum(ts)), in_specs=specs, out_specs=out_specs,
      out_shape=[jax.ShapeDtypeStruct((m, n), jnp.dtype(d)) for n, d in zip(ns, out_dtypes)],
      interpret=st.interpret, compiler_params=params, name=KERNEL)
  if st.interpret:
    return tuple(call(*args))
  return tuple(_compat.cuda_only(lambda *a: list(call(*a)))(*args))


def _group_ref(x, ws, bs, st: _Static, out_dtypes: tuple):
  return tuple(rms_matmul_reference(x, w, b, eps=st.eps, out_dtype=jnp.dtype(d), w_nk=st.w_nk)
               for w, b, d in zip(ws, bs, out_dtypes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _group_core(x, ws, bs, st: _Static, out_dtypes: tuple):
  return _group_forward(x, ws, bs, st, out_dtypes)


def _group_core_fwd(x, ws, bs, st, out_dtypes):
  return _group_forward(x, ws, bs, st, out_dtypes), (x, ws, bs)


def _group_core_bwd(st, out_dtypes, res, ct):
  x, ws, bs = res
  _, vjp = jax.vjp(lambda x, ws, bs: _group_ref(x, ws, bs, st, out_dtypes), x, ws, bs)
  return vjp(ct)


_group_core.defvjp(_group_core_fwd, _group_core_bwd)


def _ref2(x, w, b, st: _Static):
  return rms_matmul_reference(x, w, b, eps=st.eps, out_dtype=jnp.dtype(st.out_dtype), w_nk=st.w_nk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _core(x, w, b, st: _Static):
  return _forward(x, w, b, st)


def _core_fwd(x, w, b, st):
  return _forward(x, w, b, st), (x, w, b)


def _core_bwd(st, res, ct):
  # The gradient of the same function, computed by XLA (the kernel is forward only).
  x, w, b = res
  _, vjp = jax.vjp(lambda x, w, b: _ref2(x, w, b, st), x, w, b)
  return vjp(ct)


_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------
def _empty(x, ws) -> bool:
  """No rows, columns or K: the reference computes it (a kernel would have a zero-size grid)."""
  return any(math.prod(a.shape) == 0 for a in (x, *ws))


def unsupported_reason(x_shape, x_dtype, w_shape, w_dtype) -> Optional[str]:
  """Why the compiled kernel cannot take these operands, or None.

  Example:
      >>> unsupported_reason((8, 768), "bfloat16", (768, 2304), "bfloat16") is None
      True
      >>> unsupported_reason((8, 768), "float64", (768, 2304), "float64")
      'dtype float64 is not one of float32, bfloat16, float16'
  """
  for dt in (x_dtype, w_dtype):
    if np.dtype(dt).name not in SUPPORTED_DTYPES:
      return f"dtype {np.dtype(dt).name} is not one of {', '.join(SUPPORTED_DTYPES)}"
  if len(x_shape) == 0 or math.prod(int(d) for d in x_shape) == 0 or math.prod(int(d) for d in w_shape) == 0:
    return f"empty operands {tuple(x_shape)} @ {tuple(w_shape)}"
  return None


def rms_matmul(x: jax.Array, w: jax.Array, bias: Optional[jax.Array] = None, *, eps: float, out_dtype=None,
               w_nk: bool = False, interpret: Optional[bool] = None) -> jax.Array:
  """``(x @ w) * rsqrt(mean(x², -1) + eps) + bias`` in one kernel (see the module docstring).

  Args:
    x: ``(..., K)``; the statistic is computed from it in ``promote(x, w,
      float32)``, the dot from ``x.astype(w.dtype)``. Empty operands (no rows) take the
      reference in every mode.
    w: ``(K, N)``, or ``(N, K)`` with ``w_nk`` (a tied embedding read as a head).
    bias: ``(N,)``, a tuple of ``(N,)`` vectors or None, added after the scale
      (not scaled), each in the accumulator dtype, before the one rounding to
      ``out_dtype`` (a deferred reader's fused ``β·W`` and its own bias: one
      launch, no separate sum of the two).
    eps: added to the mean square.
    out_dtype: the result dtype (default ``w.dtype``); the scale is applied to
      the accumulator, before this one rounding.
    interpret: ``True`` = the kernel in Pallas interpret mode everywhere;
      ``False``/``None`` = the compiled kernel when lowered for CUDA (dtypes
      float32/bfloat16/float16), :func:`rms_matmul_reference` elsewhere.

  Returns ``(..., N)``. Differentiable (custom VJP: the reference's gradient).

  Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jax.random.normal(jax.random.key(0), (2, 3, 40))
      >>> w = jax.random.normal(jax.random.key(1), (40, 24))
      >>> y = rms_matmul(x, w, eps=1e-6, interpret=True)
      >>> bool(jnp.allclose(y, rms_matmul_reference(x, w, eps=1e-6), atol=1e-4)), y.shape
      (True, (2, 3, 24))
  """
  k = x.shape[-1]
  if w.ndim != 2 or (w.shape[1] if w_nk else w.shape[0]) != k:
    raise ValueError(f"w must be {'(N, K)' if w_nk else '(K, N)'} with K = {k}, got {w.shape}")
  n = w.shape[0] if w_nk else w.shape[1]
  if isinstance(bias, list):
    bias = tuple(bias)
  for b in _biases(bias):
    if b.shape != (n,):
      raise ValueError(f"bias must have shape ({n},), got {b.shape}")
  if isinstance(bias, tuple) and not bias:
    bias = None
  out_dtype = jnp.dtype(out_dtype or w.dtype)
  st = _Static(static_eps(eps, "rms_matmul"), out_dtype.name, bool(w_nk), bool(interpret))
  lead = x.shape[:-1]

  def kernel(x, w, b):
    return _core(x.reshape(-1, k), w, b, st).reshape(*lead, n)

  ref = functools.partial(rms_matmul_reference, eps=eps, out_dtype=out_dtype, w_nk=w_nk)
  if interpret and not _empty(x, (w,)):
    return kernel(x, w, bias)
  if unsupported_reason(x.shape, x.dtype, w.shape, w.dtype) is not None or (
      any(np.dtype(b.dtype).name not in SUPPORTED_DTYPES for b in _biases(bias))):
    return ref(x, w, bias)
  return _compat.platform_dependent(x, w, bias, cuda=kernel, default=ref)


def rms_matmul_group(x: jax.Array, ws, biases=None, *, eps: float, out_dtypes=None, w_nk: bool = False,
                     interpret: Optional[bool] = None) -> tuple:
  """``rms_matmul(x, w_i, b_i)`` for every weight ``w_i`` of ``ws`` in ONE launch.

  The readers of one norm (separate q, k, v projections; Phi's parallel attention
  and MLP inputs): the column grid is the weights' tiles one after another, and a
  program computes its own weight's tile exactly as :func:`rms_matmul` does (its
  own Σx² over the row it loads, the scale, its biases). No weight is copied or
  concatenated. ``ws``: ``(K, N_i)`` each (``(N_i, K)`` with ``w_nk``), one dtype;
  ``biases``: None or one entry per weight (None, ``(N_i,)`` or a tuple of them);
  ``out_dtypes``: one per weight (default each weight's dtype).

  Returns a tuple of ``(..., N_i)``. Differentiable (the reference's VJP).

  Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jax.random.normal(jax.random.key(0), (3, 40))
      >>> ws = [jax.random.normal(jax.random.key(i), (40, n)) for i, n in ((1, 24), (2, 7))]
      >>> ys = rms_matmul_group(x, ws, eps=1e-6, interpret=True)
      >>> [bool(jnp.allclose(y, rms_matmul_reference(x, w, eps=1e-6), atol=1e-4)) for y, w in zip(ys, ws)]
      [True, True]
  """
  ws = tuple(ws)
  k = x.shape[-1]
  if not ws or any(w.ndim != 2 or (w.shape[1] if w_nk else w.shape[0]) != k for w in ws):
    raise ValueError(f"every weight must be {'(N, K)' if w_nk else '(K, N)'} with K = {k}")
  if len({np.dtype(w.dtype) for w in ws}) != 1:
    raise ValueError("the weights must have one dtype")
  ns = [w.shape[0] if w_nk else w.shape[1] for w in ws]
  bs = tuple(biases) if biases is not None else (None,) * len(ws)
  if len(bs) != len(ws):
    raise ValueError(f"{len(bs)} biases for {len(ws)} weights")
  bs = tuple(None if not _biases(b) else tuple(_biases(b)) for b in bs)
  for b, n in zip(bs, ns):
    for v in _biases(b):
      if v.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {v.shape}")
  out_dtypes = tuple(np.dtype(d).name for d in (out_dtypes or [w.dtype for w in ws]))
  st = _Static(static_eps(eps, "rms_matmul_group"), out_dtypes[0], bool(w_nk), bool(interpret))
  lead = x.shape[:-1]

  def kernel(x, ws, bs):
    outs = _group_core(x.reshape(-1, k), ws, bs, st, out_dtypes)
    return tuple(o.reshape(*lead, n) for o, n in zip(outs, ns))

  def ref(x, ws, bs):
    return _group_ref(x, ws, bs, st, out_dtypes)

  if interpret and not _empty(x, ws):
    return kernel(x, ws, bs)
  if any(unsupported_reason(x.shape, x.dtype, w.shape, w.dtype) is not None for w in ws) or any(
      np.dtype(v.dtype).name not in SUPPORTED_DTYPES for b in bs for v in _biases(b)):
    return ref(x, ws, bs)
  return tuple(_compat.platform_dependent(x, ws, bs, cuda=kernel, default=ref))
