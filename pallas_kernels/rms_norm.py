"""RMSNorm and fused residual-add + RMSNorm as Pallas kernels with custom VJPs.

``y = x * rsqrt(mean(x * x, axis=-1) + eps) * scale + bias``, accumulated in
float32 (float64 for float64 inputs, interpret mode only), returned in ``x.dtype``.

Implementation notes
--------------------
* Forward **and** backward are Pallas kernels (Triton-style ``pl.pallas_call``
  with ``BlockSpec``s). The backward kernel computes ``dx`` per row and writes
  per-program partial sums of ``dscale``/``dbias`` (float32); XLA adds up
  those few partial rows (``num_programs x hidden``), which is negligible
  traffic next to ``x``/``dy``.
* Every input is flattened to ``(rows, hidden)``. A program owns a block of
  ``block_rows x next_pow2(hidden)`` elements (Triton needs power-of-two
  blocks); rows past the end and columns past ``hidden`` are masked, so any
  hidden size and any row count (including 1) work.
* ``backend="mosaic_gpu"`` runs the Mosaic GPU (``plgpu.kernel``) bodies of
  :mod:`pallas_kernels.rms_norm_mosaic` instead (sm_90a; ``hidden`` a
  multiple of 128), same custom VJPs. Opt-in: auto-selection keeps Triton,
  the backend proven on GPUs; the Mosaic kernels are checked in Mosaic GPU's
  interpreter and compiled deviceless for the H100 only.
* The kernel is chosen **per lowering platform**, not by
  ``jax.default_backend()``: the kernel path is a
  ``jax.lax.platform_dependent`` whose ``cuda`` branch is the Pallas kernel
  and whose default branch (CPU, TPU, ROCm) is :func:`rms_norm_reference`.
  Only the branch of the platform being lowered reaches the compiler, so the
  same jitted function compiles to the kernel for an H100 (also ahead of
  time on a CPU-only host, see :mod:`pallas_kernels.aot`) and to the XLA
  expression for the CPU, and ``jax.export`` with several platforms works.

  - ``interpret=True``: the kernel in Pallas interpret mode on every
    platform (CPU tests).
  - ``interpret=False``: the compiled kernel wherever it can lower (CUDA)
    and the shape/dtype is :func:`supports`-ed; the XLA expression on other
    platforms and for unsupported shapes.
  - ``interpret=None`` (default): like ``False``, but only where
    :func:`pallas_kernels.dispatch.choose` says the kernel wins; the XLA
    expression otherwise.

Example:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels import rms_norm
    >>> x = jnp.arange(6.0).reshape(2, 3)
    >>> rms_norm(x, jnp.ones(3), eps=1e-6, interpret=True).shape
    (2, 3)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat, dispatch, rms_norm_mosaic
from pallas_kernels._compat import BACKENDS, pallas_api
from pallas_kernels._tiling import loop_grid

_F32 = jnp.float32
# Elements one program keeps on chip in the forward pass; 4096 fp32 values in
# registers over 4-8 warps is the sweet spot used by Triton's layer norm.
_BLOCK_ELEMS = 4096
# The backward pass holds x, dy (and dres) per element plus the dscale/dbias
# accumulators: half the forward block and ~8 elements per thread. With the
# forward's 4096-element blocks ptxas settles on 64 registers and spills 4-8
# bytes for hidden 768/1000 (sm_80 and sm_90a; tests/test_pallas_kernels/test_aot.py).
_BWD_BLOCK_ELEMS = 2048
_FWD_ELEMS_PER_THREAD = 16
_BWD_ELEMS_PER_THREAD = 8
# Target number of programs for the backward pass: enough to fill an H100
# (132 SMs) several times, few enough that the float32 partial sums of
# dscale/dbias (programs x hidden) stay small.
_BWD_TARGET_PROGRAMS = 1024
# Names of the compiled kernels (the kernel names in XLA's thunk sequence and
# PTX): forward kernels are one launch per normalized site.
FWD_KERNELS = ("rms_norm_fwd", "fused_add_rms_norm_fwd")
BWD_KERNELS = ("rms_norm_bwd", "fused_add_rms_norm_bwd")


# --------------------------------------------------------------------------
# Reference (also the XLA path)
# --------------------------------------------------------------------------
def _acc(dtype):
  """Accumulation dtype: float32, float64 for float64 (interpret mode only;
  the compiled kernels take :data:`SUPPORTED_DTYPES`)."""
  return jnp.promote_types(dtype, _F32)


def rms_norm_reference(
    x: jax.Array, scale: jax.Array, bias: Optional[jax.Array] = None, *, eps: float
) -> jax.Array:
  """Pure-jnp RMSNorm accumulated in float32 (float64 for float64 input); output in ``x.dtype``.

  Example:
      >>> import jax.numpy as jnp
      >>> y = rms_norm_reference(jnp.array([[3.0, 4.0]]), jnp.ones(2), eps=0.0)
      >>> [round(float(v), 4) for v in y[0]]
      [0.8485, 1.1314]
  """
  acc = _acc(x.dtype)
  xf = x.astype(acc)
  ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
  y = xf * lax.rsqrt(ms + eps) * scale.astype(acc)
  if bias is not None:
    y = y + bias.astype(acc)
  return y.astype(x.dtype)


def fused_add_rms_norm_reference(
    x: jax.Array,
    residual: jax.Array,
    scale: jax.Array,
    bias: Optional[jax.Array] = None,
    *,
    eps: float,
) -> tuple[jax.Array, jax.Array]:
  """Reference for :func:`fused_add_rms_norm`: ``h = x + residual``, ``(rms_norm(h), h)``.

  ``h`` has dtype ``result_type(x, residual)``; the normalized output has
  ``x.dtype``. The sum is done in float32 and rounded once.

  Example:
      >>> import jax.numpy as jnp
      >>> y, h = fused_add_rms_norm_reference(jnp.ones((1, 2)), jnp.ones((1, 2)), jnp.ones(2), eps=0.0)
      >>> h.tolist(), y.tolist()
      ([[2.0, 2.0]], [[1.0, 1.0]])
  """
  h_dtype = jnp.result_type(x.dtype, residual.dtype)
  acc = _acc(h_dtype)
  h = (x.astype(acc) + residual.astype(acc)).astype(h_dtype)
  y = rms_norm_reference(h, scale, bias, eps=eps).astype(x.dtype)
  return y, h


# --------------------------------------------------------------------------
# Static configuration
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Static:
  """Hashable, shape-independent settings passed as nondiff args."""

  eps: float
  backend: str  # "triton" (pl.pallas_call) | "mosaic_gpu" (plgpu.kernel, rms_norm_mosaic)
  interpret: bool
  x_dtype: str
  r_dtype: Optional[str]  # residual dtype (fused variant only)
  h_dtype: Optional[str]  # new_residual dtype = result_type(x, residual)


def _tiling(n_rows: int, hidden: int, block_elems: int = _BLOCK_ELEMS) -> tuple[int, int]:
  """(block_rows, block_cols) of a program (one loop step in the backward pass).

  Triton blocks must be powers of two, so the row is padded to
  ``next_pow2(hidden)`` and masked; rows past ``n_rows`` are masked too.
  """
  hp = pl.next_power_of_2(hidden)
  return min(max(1, block_elems // hp), pl.next_power_of_2(n_rows)), hp


def bwd_grid(n_rows: int, hidden: int) -> tuple[int, int, int]:
  """(block_rows, steps, programs) of the backward kernel.

  Each program loops ``steps`` times over ``block_rows`` rows and writes one
  float32 partial row of dscale (and dbias): ``programs x hidden`` each.
  """
  br, _ = _tiling(n_rows, hidden, _BWD_BLOCK_ELEMS)
  return (br, *loop_grid(pl.cdiv(n_rows, br), _BWD_TARGET_PROGRAMS, pow2=True))


def _num_warps(block_elems: int, elems_per_thread: int) -> int:
  # ~elems_per_thread elements per thread, between 1 and 8 warps.
  return int(min(max(block_elems // (32 * elems_per_thread), 1), 8))


def _call(kernel, *, grid, in_specs, out_specs, out_shape, st: _Static, num_warps: int, name: str):
  params = None
  if not st.interpret:
    params = pallas_api(st.backend).compiler_params(num_warps=num_warps, num_stages=None)
  call = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      interpret=st.interpret,
      compiler_params=params,
      name=name,
  )
  # Compiled kernels are only reached through the cuda branch of
  # platform_dependent; cuda_only keeps a multi-platform export from also
  # lowering them for the CPU.
  return call if st.interpret else _compat.cuda_only(call)


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------
def _masks(row0, br: int, hp: int, n_rows: int, n_cols: int):
  """(row_ok (br,), col_ok (hp,), mask (br, hp))."""
  row_ok = (row0 + jnp.arange(br)) < n_rows
  col_ok = jnp.arange(hp) < n_cols
  return row_ok, col_ok, row_ok[:, None] & col_ok[None, :]


def _load(ref, mask):
  return pallas_api("triton").load(ref, mask=mask, other=0)


def _store(ref, value, mask):
  pallas_api("triton").store(ref, value, mask=mask)


def _fwd_kernel(*refs, eps, n_rows, n_cols, has_res, has_bias, has_rstd):
  it = iter(refs)
  x_ref = next(it)
  r_ref = next(it) if has_res else None
  scale_ref = next(it)
  bias_ref = next(it) if has_bias else None
  y_ref = next(it)
  h_ref = next(it) if has_res else None
  rstd_ref = next(it) if has_rstd else None

  br, hp = x_ref.shape
  acc_dt = _acc((h_ref if has_res else x_ref).dtype)
  row_ok, col_ok, mask = _masks(pl.program_id(0) * br, br, hp, n_rows, n_cols)
  x = _load(x_ref, mask).astype(acc_dt)
  if has_res:
    # Round the sum to the residual-stream dtype first so the normalized
    # value matches what the next layer will read back from new_residual.
    h = (x + _load(r_ref, mask).astype(acc_dt)).astype(h_ref.dtype)
    _store(h_ref, h, mask)
    x = h.astype(acc_dt)
  scale = _load(scale_ref, col_ok).astype(acc_dt)
  rstd = lax.rsqrt(jnp.sum(x * x, axis=1) / n_cols + eps)  # padded cols are 0
  y = x * rstd[:, None] * scale[None, :]
  if has_bias:
    y = y + _load(bias_ref, col_ok).astype(acc_dt)[None, :]
  _store(y_ref, y.astype(y_ref.dtype), mask)
  if has_rstd:
    _store(rstd_ref, rstd, row_ok)


def _bwd_kernel(*refs, n_rows, n_cols, steps, has_dres, has_bias):
  it = iter(refs)
  x_ref, scale_ref, rstd_ref, dy_ref = next(it), next(it), next(it), next(it)
  dres_ref = next(it) if has_dres else None
  dx_ref = next(it)
  dscale_ref = next(it)
  dbias_ref = next(it) if has_bias else None

  rows_per_prog, hp = x_ref.shape
  acc_dt = _acc(x_ref.dtype)
  br = rows_per_prog // steps
  _, col_ok, _ = _masks(0, 1, hp, n_rows, n_cols)
  scale = _load(scale_ref, col_ok).astype(acc_dt)
  # Read program_id outside the loop: interpret mode only substitutes it at
  # the top level of the kernel jaxpr, not inside a fori_loop body.
  prog_row0 = pl.program_id(0) * rows_per_prog

  def body(s, acc):
    local = pl.ds(s * br, br)
    row0 = prog_row0 + s * br
    row_ok, _, mask = _masks(row0, br, hp, n_rows, n_cols)
    x = _load(x_ref.at[local, :], mask).astype(acc_dt)
    dy = _load(dy_ref.at[local, :], mask).astype(acc_dt)
    rstd = _load(rstd_ref.at[local], row_ok)  # masked rows -> 0 -> xhat 0
    xhat = x * rstd[:, None]
    g = dy * scale[None, :]
    c = jnp.sum(xhat * g, axis=1) / n_cols
    dx = (g - xhat * c[:, None]) * rstd[:, None]
    if has_dres:
      dx = dx + _load(dres_ref.at[local, :], mask).astype(acc_dt)
    _store(dx_ref.at[local, :], dx.astype(dx_ref.dtype), mask)
    dscale_acc, dbias_acc = acc
    return dscale_acc + jnp.sum(dy * xhat, axis=0), dbias_acc + jnp.sum(dy, axis=0)

  zeros = jnp.zeros((hp,), acc_dt)
  dscale, dbias = lax.fori_loop(0, steps, body, (zeros, zeros))
  col_ok2 = col_ok[None, :]
  _store(dscale_ref, dscale[None, :], col_ok2)
  if has_bias:
    _store(dbias_ref, dbias[None, :], col_ok2)


# --------------------------------------------------------------------------
# pallas_call wrappers on 2-D inputs
# --------------------------------------------------------------------------
def _forward(x, residual, scale, bias, st: _Static, stats: bool = True):
  """Returns (y, h or None, rstd or None) for 2-D ``x``.

  ``stats=False`` (the primal, not differentiated): no per-row rstd is
  written, as nothing reads it.
  """
  if st.backend == "mosaic_gpu":  # recomputes rstd in the backward pass: no stats
    y, h = rms_norm_mosaic.forward(x, residual, scale, bias, eps=st.eps, h_dtype=st.h_dtype,
                                   interpret=st.interpret)
    return y, h, None
  n_rows, hidden = x.shape
  br, hp = _tiling(n_rows, hidden)
  has_res, has_bias = residual is not None, bias is not None
  tile = pl.BlockSpec((br, hp), lambda i: (i, 0))
  vec = pl.BlockSpec((hp,), lambda i: (0,))
  rows = pl.BlockSpec((br,), lambda i: (i,))

  inputs = [x] + ([residual] if has_res else []) + [scale] + ([bias] if has_bias else [])
  in_specs = [tile] + ([tile] if has_res else []) + [vec] + ([vec] if has_bias else [])
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
  out_specs = [tile]
  if has_res:
    out_shape.append(jax.ShapeDtypeStruct(x.shape, jnp.dtype(st.h_dtype)))
    out_specs.append(tile)
  if stats:
    out_shape.append(jax.ShapeDtypeStruct((n_rows,), _acc(st.h_dtype or x.dtype)))
    out_specs.append(rows)

  kernel = functools.partial(
      _fwd_kernel, eps=st.eps, n_rows=n_rows, n_cols=hidden, has_res=has_res, has_bias=has_bias,
      has_rstd=stats,
  )
  outs = _call(
      kernel, grid=(pl.cdiv(n_rows, br),), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, st=st, num_warps=_num_warps(br * hp, _FWD_ELEMS_PER_THREAD),
      name="fused_add_rms_norm_fwd" if has_res else "rms_norm_fwd",
  )(*inputs)
  outs = list(outs) + [None] * (3 - len(outs))
  if has_res:
    return outs[0], outs[1], outs[2]
  return outs[0], None, outs[1]


def _backward(xn, scale, rstd, dy, dres, has_bias: bool, dx_dtype, st: _Static):
  """dx (dtype ``dx_dtype``), dscale (f32), dbias (f32 or None) for 2-D inputs.

  ``xn`` is the tensor that was normalized; ``dres`` (optional) is added to dx.
  """
  if st.backend == "mosaic_gpu":
    return rms_norm_mosaic.backward(xn, scale, dy, dres, has_bias=has_bias, dx_dtype=dx_dtype, eps=st.eps,
                                    interpret=st.interpret)
  n_rows, hidden = xn.shape
  br, steps, n_prog = bwd_grid(n_rows, hidden)
  hp = _tiling(n_rows, hidden)[1]
  rpp = br * steps
  tile = pl.BlockSpec((rpp, hp), lambda i: (i, 0))
  vec = pl.BlockSpec((hp,), lambda i: (0,))
  rows = pl.BlockSpec((rpp,), lambda i: (i,))
  part = pl.BlockSpec((1, hp), lambda i: (i, 0))

  has_dres = dres is not None
  inputs = [xn, scale, rstd, dy] + ([dres] if has_dres else [])
  in_specs = [tile, vec, rows, tile] + ([tile] if has_dres else [])
  out_shape = [jax.ShapeDtypeStruct(xn.shape, dx_dtype), jax.ShapeDtypeStruct((n_prog, hidden), _acc(xn.dtype))]
  out_specs = [tile, part]
  if has_bias:
    out_shape.append(jax.ShapeDtypeStruct((n_prog, hidden), _acc(xn.dtype)))
    out_specs.append(part)
  kernel = functools.partial(
      _bwd_kernel, n_rows=n_rows, n_cols=hidden, steps=steps, has_dres=has_dres, has_bias=has_bias
  )
  outs = _call(
      kernel, grid=(n_prog,), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, st=st, num_warps=_num_warps(br * hp, _BWD_ELEMS_PER_THREAD),
      name="fused_add_rms_norm_bwd" if has_dres else "rms_norm_bwd",
  )(*inputs)
  dscale = outs[1].sum(axis=0)
  dbias = outs[2].sum(axis=0) if has_bias else None
  return outs[0], dscale, dbias


# --------------------------------------------------------------------------
# custom_vjp cores (2-D)
# --------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rms_core(x, scale, bias, st: _Static):
  return _forward(x, None, scale, bias, st, stats=False)[0]


def _rms_core_fwd(x, scale, bias, st):
  y, _, rstd = _forward(x, None, scale, bias, st)
  return y, (x, scale, bias, rstd)


def _rms_core_bwd(st, res, dy):
  x, scale, bias, rstd = res
  dx, dscale, dbias = _backward(x, scale, rstd, dy, None, bias is not None, x.dtype, st)
  return dx, dscale.astype(scale.dtype), None if bias is None else dbias.astype(bias.dtype)


_rms_core.defvjp(_rms_core_fwd, _rms_core_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_core(x, residual, scale, bias, st: _Static):
  y, h, _ = _forward(x, residual, scale, bias, st, stats=False)
  return y, h


def _fused_core_fwd(x, residual, scale, bias, st):
  y, h, rstd = _forward(x, residual, scale, bias, st)
  return (y, h), (h, scale, bias, rstd)


def _fused_core_bwd(st, res, cts):
  h, scale, bias, rstd = res
  dy, dh = cts
  # d(new_residual) flows into both x and residual: dh_total = dh + dnorm.
  dh_total, dscale, dbias = _backward(h, scale, rstd, dy, dh, bias is not None, h.dtype, st)
  dx = dh_total.astype(jnp.dtype(st.x_dtype))
  dr = dh_total.astype(jnp.dtype(st.r_dtype))
  return dx, dr, dscale.astype(scale.dtype), None if bias is None else dbias.astype(bias.dtype)


_fused_core.defvjp(_fused_core_fwd, _fused_core_bwd)


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------
# Auto-selection order: Triton first (the kernels proven on GPUs); Mosaic GPU
# (plgpu.kernel, rms_norm_mosaic) only on request. A pl.pallas_call body cannot
# go through Mosaic GPU: jax 0.10's lowering rejects >256-element TMA blocks and
# axis reductions, and 0.11 has no such lowering.
_COMPILED_KERNEL_BACKENDS = ("triton", "mosaic_gpu")


def _backend_problem(backend: str) -> Optional[str]:
  """Why ``backend`` cannot compile these kernels on this jax, or None."""
  api = pallas_api(backend)
  if not api.available:
    return api.reason
  return None


def available_backends() -> tuple[str, ...]:
  """GPU Pallas backends that can compile these kernels with this jax.

  Example:
      >>> available_backends()[0]
      'triton'
  """
  return tuple(b for b in BACKENDS if _backend_problem(b) is None)


def resolve_backend(backend: Optional[str], interpret: bool) -> str:
  """Validates ``backend`` (None = auto) and returns the concrete name.

  Auto = :func:`pallas_kernels.dispatch.set_backend`'s choice if any, else
  the first of :func:`available_backends`: Triton, the backend checked on
  GPUs; ``"mosaic_gpu"`` is opt-in. In interpret mode the backend picks
  the kernel body (``pl.pallas_call`` or ``plgpu.kernel``); ``"mosaic_gpu"``
  must then be available too (its interpreter ships with ``plgpu``).

  Example:
      >>> resolve_backend(None, interpret=True)
      'triton'
  """
  if backend is not None and backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
  backend = backend or dispatch.get_backend()
  if interpret and backend != "mosaic_gpu":
    return backend or "triton"
  if backend is None:
    avail = available_backends()
    if not avail:
      reasons = "; ".join(f"{b}: {_backend_problem(b)}" for b in BACKENDS)
      raise RuntimeError(f"no Pallas GPU backend available: {reasons}")
    return avail[0]
  problem = _backend_problem(backend)
  if problem is not None:
    raise RuntimeError(f"Pallas backend {backend!r} is unavailable: {problem}")
  return backend


# Input dtypes the kernels are compiled and checked for (float32 accumulation).
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# Widest row the kernels keep on chip without register spills on sm_80/sm_90a:
# at 16384 the backward kernel spills (dscale/dbias accumulators + x + dy per thread)
# (checked by ptxas in tests/test_pallas_kernels/test_aot.py).
MAX_HIDDEN = 8192


def unsupported_reason(shape: Sequence[int], dtype, backend: Optional[str] = None) -> Optional[str]:
  """Why the compiled kernel (of ``backend``; None = auto) cannot handle ``shape``/``dtype``, or None.

  Example:
      >>> unsupported_reason((8, 768), "bfloat16") is None
      True
      >>> unsupported_reason((8, 768), "float64")
      'dtype float64 is not one of float32, bfloat16, float16'
  """
  name = np.dtype(dtype).name
  if name not in SUPPORTED_DTYPES:
    return f"dtype {name} is not one of {', '.join(SUPPORTED_DTYPES)}"
  if len(shape) == 0 or math.prod(int(d) for d in shape) == 0:
    return f"shape {tuple(shape)} is empty or has no hidden axis"
  if int(shape[-1]) > MAX_HIDDEN:
    return f"hidden size {int(shape[-1])} > {MAX_HIDDEN} (a row must fit on chip)"
  if backend == "mosaic_gpu":
    return rms_norm_mosaic.unsupported_reason(int(shape[-1]))
  return None


def supports(shape: Sequence[int], dtype, backend: Optional[str] = None) -> bool:
  """Whether the compiled kernel can handle an input of ``shape``/``dtype`` at all.

  Cheap (no tracing). ``interpret=False`` uses the kernel exactly where this
  holds (on CUDA); :func:`pallas_kernels.choose` additionally says where it
  is expected to be faster than XLA.

  Example:
      >>> supports((4, 128, 768), "bfloat16"), supports((4, 16384), "float32")
      (True, False)
  """
  return unsupported_reason(shape, dtype, backend) is None


def _mode(shape, dtypes, interpret: Optional[bool], backend: Optional[str] = None) -> str:
  """"interpret" | "kernel" (CUDA: kernel, elsewhere: XLA) | "xla".

  ``dtypes``: of every tensor input (the fused kernel's residual too).
  """
  if math.prod(int(d) for d in shape) == 0:
    return "xla"  # no rows (or an empty row): the reference's empty result, no zero-size grid
  why = next(filter(None, (unsupported_reason(shape, d, backend) for d in dtypes)), None)
  if interpret:
    if backend == "mosaic_gpu" and why:
      raise ValueError(f"backend='mosaic_gpu': {why}")
    return "interpret"
  if why:
    return "xla"
  if interpret is None and dispatch.choose(shape, dtypes[0]) != "pallas":
    return "xla"
  return "kernel"


def static_eps(eps, fn: str) -> float:
  """``eps`` as the Python float a kernel is compiled with; a traced one is
  refused by name (``float`` of a tracer raises jax's ConcretizationTypeError,
  which names neither the argument nor what to do)."""
  if isinstance(eps, jax.core.Tracer):
    raise TypeError(
        f"pallas_kernels.{fn}: eps must be a Python number or a concrete array (it is compiled "
        f"into the kernel), got a traced value ({eps.aval.str_short()}). Pass it as a static "
        "argument (functools.partial, or jax.jit(..., static_argnames=...)), or use "
        f"{fn.replace('_group', '')}_reference, which takes a traced eps.")
  try:
    return float(eps)
  except (TypeError, ValueError) as e:
    raise TypeError(f"pallas_kernels.{fn}: eps must be a number, got {eps!r:.60}") from e


def _check(x, scale, bias):
  if x.ndim == 0:
    raise ValueError(f"x must have a hidden axis, got shape {x.shape}")
  hidden = x.shape[-1]
  if scale.shape != (hidden,):
    raise ValueError(f"scale must have shape ({hidden},), got {scale.shape}")
  if bias is not None and bias.shape != (hidden,):
    raise ValueError(f"bias must have shape ({hidden},), got {bias.shape}")


def rms_norm(
    x: jax.Array,
    scale: jax.Array,
    bias: Optional[jax.Array] = None,
    *,
    eps: float,
    interpret: Optional[bool] = None,
    backend: Optional[str] = None,
) -> jax.Array:
  """RMSNorm over the last axis; Pallas kernel (fwd + bwd) or XLA fallback.

  Args:
    x: ``(..., hidden)`` float32/bfloat16/float16 (float64 in interpret mode, accumulated
      in float64). No rows: :func:`rms_norm_reference` in every mode.
    scale, bias: ``(hidden,)``; bias optional.
    eps: added to the mean square.
    interpret: decided per lowering platform (see the module docstring):
      ``True`` = the kernel in Pallas interpret mode everywhere;
      ``False`` = the compiled kernel when lowered for CUDA (if
      :func:`supports` the shape/dtype), the XLA expression
      :func:`rms_norm_reference` for CPU/TPU/ROCm; ``None`` (auto) = like
      ``False`` where :func:`pallas_kernels.choose` picks the kernel, else
      the XLA expression on every platform.
    backend: "triton" | "mosaic_gpu" | None (auto = Triton). "mosaic_gpu"
      needs sm_90a and ``hidden % 128 == 0`` (other shapes take the XLA
      expression when compiled; interpret mode raises ``ValueError``).

  Gradients: the kernel path has a custom VJP (Pallas backward kernel); the
  XLA path is differentiated by JAX. Forward-mode AD (``jax.jvp``) is not
  available on the kernel path (``custom_vjp``).

  Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jax.random.normal(jax.random.key(0), (2, 5, 130))
      >>> y = rms_norm(x, jnp.full(130, 2.0), eps=1e-6, interpret=True)
      >>> bool(jnp.allclose(y, rms_norm_reference(x, jnp.full(130, 2.0), eps=1e-6), atol=1e-5))
      True
  """
  _check(x, scale, bias)
  mode = _mode(x.shape, (x.dtype,), interpret, backend or dispatch.get_backend())
  if mode == "xla":
    return rms_norm_reference(x, scale, bias, eps=eps)
  st = _Static(static_eps(eps, "rms_norm"), resolve_backend(backend, mode == "interpret"),
               mode == "interpret", jnp.dtype(x.dtype).name, None, None)
  shape = x.shape

  def kernel(x, scale, bias):
    return _rms_core(x.reshape(-1, shape[-1]), scale, bias, st).reshape(shape)

  if mode == "interpret":
    return kernel(x, scale, bias)
  return _compat.platform_dependent(
      x, scale, bias, cuda=kernel, default=functools.partial(rms_norm_reference, eps=eps))


def fused_add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    scale: jax.Array,
    bias: Optional[jax.Array] = None,
    *,
    eps: float,
    interpret: Optional[bool] = None,
    backend: Optional[str] = None,
) -> tuple[jax.Array, jax.Array]:
  """Returns ``(rms_norm(x + residual), x + residual)`` in one pass.

  The normalized output has ``x.dtype``; the new residual has
  ``result_type(x, residual)`` (e.g. bf16 x + f32 residual -> f32 stream).
  Dispatch arguments (``interpret``, ``backend``) as in :func:`rms_norm`:
  on CUDA one kernel reads ``x`` and ``residual`` and writes both outputs;
  elsewhere the XLA expression :func:`fused_add_rms_norm_reference`, which
  compiled mode also takes for a residual outside :data:`SUPPORTED_DTYPES`
  (a float64 stream: the kernel would sum it in float32).

  Example:
      >>> import jax.numpy as jnp
      >>> y, h = fused_add_rms_norm(jnp.ones((1, 4)), jnp.ones((1, 4)), jnp.ones(4), eps=0.0, interpret=True)
      >>> h.tolist(), y.tolist()
      ([[2.0, 2.0, 2.0, 2.0]], [[1.0, 1.0, 1.0, 1.0]])
  """
  _check(x, scale, bias)
  if residual.shape != x.shape:
    raise ValueError(f"residual shape {residual.shape} != x shape {x.shape}")
  mode = _mode(x.shape, (x.dtype, residual.dtype), interpret, backend or dispatch.get_backend())
  if mode == "xla":
    return fused_add_rms_norm_reference(x, residual, scale, bias, eps=eps)
  h_dtype = jnp.result_type(x.dtype, residual.dtype)
  st = _Static(
      static_eps(eps, "fused_add_rms_norm"), resolve_backend(backend, mode == "interpret"), mode == "interpret",
      jnp.dtype(x.dtype).name, jnp.dtype(residual.dtype).name, jnp.dtype(h_dtype).name,
  )
  shape = x.shape

  def kernel(x, residual, scale, bias):
    y, h = _fused_core(x.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]), scale, bias, st)
    return y.reshape(shape), h.reshape(shape)

  if mode == "interpret":
    return kernel(x, residual, scale, bias)
  return _compat.platform_dependent(
      x, residual, scale, bias, cuda=kernel, default=functools.partial(fused_add_rms_norm_reference, eps=eps))


# The fused residual add + RMSNorm under its short name (what a pre-LN block's
# "h = x + residual; y = norm(h)" is rewritten to): ``(normed, sum)``.
add_rms_norm = fused_add_rms_norm
