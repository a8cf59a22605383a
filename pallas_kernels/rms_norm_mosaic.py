"""Mosaic GPU (``plgpu.kernel``) bodies of the RMSNorm kernels, for sm_90a.

Used by :mod:`pallas_kernels.rms_norm` for ``backend="mosaic_gpu"``; the
custom VJPs, dispatch and fallbacks live there. Design:

* A row of ``hidden`` elements is viewed as ``(hidden // 128, 128)``: TMA
  boxes are at most 256 elements per dimension, and a 128-wide minor
  dimension gives one warpgroup (128 threads) whole vectors. So ``hidden``
  must be a multiple of 128 (:func:`unsupported_reason`).
* A CTA (one warpgroup) copies a block of ``block_rows`` rows GMEM -> SMEM
  with TMA, normalizes row by row (each row's sum of squares is a full
  reduction of a ``(k, 128)`` array, the layout Mosaic reduces over all
  axes) and copies the results back with TMA.
* Ragged row counts: the last block starts at ``rows - block_rows`` and
  overlaps its predecessor, so every copy is in bounds; the overlapped rows
  are recomputed and rewritten with identical values. The backward pass
  weights their ``dscale``/``dbias`` contributions with 0.
* Backward: rstd is recomputed from the normalized input (one extra
  reduction on data already in SMEM instead of a per-row stats array); a
  CTA loops over several row blocks and accumulates float32 partial
  ``dscale``/``dbias`` rows in SMEM; XLA sums the few partial rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat
from pallas_kernels._tiling import loop_grid

_F32 = jnp.float32
LANES = 128  # minor dimension of the (hidden // 128, 128) row view; one warpgroup
# SMEM a forward/backward CTA may use for its row blocks: 96 KiB lets two CTAs
# share an H100 SM (228 KiB), so one CTA's copies overlap another's math.
_SMEM_BUDGET = 96 * 1024
# Enough CTAs to cover an H100's 132 SMs twice before rows per CTA grow.
_TARGET_CTAS = 264
_MAX_BLOCK_ROWS = 32
# Backward CTAs: bounds the float32 partial dscale/dbias rows (CTAs x hidden).
_BWD_TARGET_CTAS = 528


def unsupported_reason(hidden: int) -> str | None:
  if hidden % LANES:
    return f"hidden {hidden} is not a multiple of {LANES} (the Mosaic kernels' row view)"
  return None


def block_rows(n_rows: int, row_bytes: int, vec_bytes: int = 0) -> int:
  """Rows per CTA block: fill the SMEM budget (after the per-CTA vectors of
  ``vec_bytes``), but keep >= _TARGET_CTAS blocks."""
  # Not rms_norm._tiling's numbers: these blocks are TMA copies into SMEM (a
  # byte budget, any row count: the last block overlaps), Triton's are
  # power-of-two register tiles sized in elements.
  fit = max(1, (_SMEM_BUDGET - vec_bytes) // row_bytes)
  want = max(1, n_rows // _TARGET_CTAS)
  return int(min(n_rows, fit, want, _MAX_BLOCK_ROWS))


def bwd_grid(n_rows: int, row_bytes: int, vec_bytes: int = 0) -> tuple[int, int, int]:
  """(block_rows, steps, ctas) of the backward kernel."""
  br = block_rows(n_rows, row_bytes, vec_bytes)
  return (br, *loop_grid(pl.cdiv(n_rows, br), _BWD_TARGET_CTAS))


def _view(a, k):
  return a.reshape(a.shape[0], k, LANES) if a.ndim == 2 else a.reshape(k, LANES)


def _nbytes(dtype) -> int:
  return jnp.dtype(dtype).itemsize


# Row elements a thread holds per array at once (16 x 128 = 2048 per chunk): at
# hidden 8192 whole rows in registers made the backward kernel spill.
_CHUNK = 16


def _chunk(k: int) -> int:
  return max(d for d in range(1, min(k, _CHUNK) + 1) if k % d == 0)


def _chunks(k: int) -> list:
  kc = _chunk(k)
  return [pl.ds(i * kc, kc) for i in range(k // kc)]


def _vector_loader(chunks, ld):
  """chunk -> float32 values of a (k, 128) vector; loaded once when one chunk is the row."""
  def make(ref):
    if len(chunks) == 1:
      whole = ld(ref.at[chunks[0]]).astype(_F32)
      return lambda cs: whole
    return lambda cs: ld(ref.at[cs]).astype(_F32)
  return make


def _loader(k: int, interpret: bool):
  """Loads a (k, 128) SMEM chunk in one strided layout whatever the dtype.

  Mosaic's default layout vectorizes by element size (8 bytes: 4 x bf16 but
  2 x f32), and arrays of different layouts cannot be combined; so bf16 x
  times float32 scale needs the layout spelled out. Up to 4 elements a thread.
  The interpreter has no layouts (and no plgpu.load of a sliced ref: jax
  0.10.2 and 0.11.2 fail its abstract eval), so it loads plainly.
  """
  if interpret:
    return lambda ref: ref[...]
  vec = next(v for v in (4, 2, 1) if k % v == 0)
  layout = plgpu.Layout.WG_STRIDED((k, LANES), vec_size=vec)
  return lambda ref: _compat.mosaic_gpu_load(ref, layout)


# --------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------
def forward(x, residual, scale, bias, *, eps: float, h_dtype, interpret: bool):
  """(y, h or None) for 2-D ``x``; ``h = x + residual`` in ``h_dtype``."""
  n_rows, hidden = x.shape
  k = hidden // LANES
  has_res, has_bias = residual is not None, bias is not None
  row_bytes = hidden * (2 * _nbytes(x.dtype) + (_nbytes(residual.dtype) + _nbytes(h_dtype) if has_res else 0))
  vec_bytes = hidden * (_nbytes(scale.dtype) + (_nbytes(bias.dtype) if has_bias else 0))
  br = block_rows(n_rows, row_bytes, vec_bytes)

  def body(*refs):
    it = iter(refs)
    x_g = next(it)
    r_g = next(it) if has_res else None
    s_g = next(it)
    b_g = next(it) if has_bias else None
    y_g = next(it)
    h_g = next(it) if has_res else None
    x_s = next(it)
    r_s = next(it) if has_res else None
    s_s = next(it)
    b_s = next(it) if has_bias else None
    y_s = next(it)
    h_s = next(it) if has_res else None
    bar = next(it)

    # The last block overlaps the previous one instead of reading out of bounds.
    start = jnp.minimum(lax.axis_index("i") * br, n_rows - br)
    rows = pl.ds(start, br)
    plgpu.copy_gmem_to_smem(x_g.at[rows], x_s, bar)
    if has_res:
      plgpu.copy_gmem_to_smem(r_g.at[rows], r_s, bar)
    plgpu.copy_gmem_to_smem(s_g, s_s, bar)
    if has_bias:
      plgpu.copy_gmem_to_smem(b_g, b_s, bar)
    plgpu.barrier_wait(bar)
    chunks, ld = _chunks(k), _loader(_chunk(k), interpret)
    vec = _vector_loader(chunks, ld)
    s, b = vec(s_s), (vec(b_s) if has_bias else None)

    @pl.loop(0, br)
    def _(r):
      ss = 0.0
      for cs in chunks:
        xc = ld(x_s.at[r, cs]).astype(_F32)
        if has_res:
          # Round to the residual dtype first: the norm must see what the next
          # layer reads back from h.
          hc = (xc + ld(r_s.at[r, cs]).astype(_F32)).astype(h_s.dtype)
          h_s.at[r, cs][...] = hc
          xc = hc.astype(_F32)
        ss = ss + jnp.sum(xc * xc)
      rstd = lax.rsqrt(ss / hidden + eps)
      src = h_s if has_res else x_s
      for cs in chunks:
        # Second pass from SMEM (each thread rereads its own elements).
        y = ld(src.at[r, cs]).astype(_F32) * rstd * s(cs)
        if has_bias:
          y = y + b(cs)
        y_s.at[r, cs][...] = y.astype(y_s.dtype)

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(y_s, y_g.at[rows])
    if has_res:
      plgpu.copy_smem_to_gmem(h_s, h_g.at[rows])
    plgpu.wait_smem_to_gmem(0)

  inputs = [_view(x, k)] + ([_view(residual, k)] if has_res else []) + [_view(scale, k)]
  inputs += [_view(bias, k)] if has_bias else []
  tile = lambda dt: plgpu.SMEM((br, k, LANES), dt)
  out_type = [jax.ShapeDtypeStruct((n_rows, k, LANES), x.dtype)]
  out_type += [jax.ShapeDtypeStruct((n_rows, k, LANES), h_dtype)] if has_res else []
  scratch = [tile(x.dtype)] + ([tile(residual.dtype)] if has_res else []) + [plgpu.SMEM((k, LANES), scale.dtype)]
  scratch += [plgpu.SMEM((k, LANES), bias.dtype)] if has_bias else []
  scratch += [tile(x.dtype)] + ([tile(h_dtype)] if has_res else [])
  scratch.append(plgpu.Barrier(num_arrivals=len(inputs)))
  outs = _compat.mosaic_gpu_kernel(
    body, out_type=out_type, scratch_types=scratch, grid=pl.cdiv(n_rows, br),
    name="fused_add_rms_norm_fwd" if has_res else "rms_norm_fwd", interpret=interpret)(*inputs)
  y = outs[0].reshape(n_rows, hidden)
  return y, (outs[1].reshape(n_rows, hidden) if has_res else None)


# --------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------
def backward(xn, scale, dy, dres, *, has_bias: bool, dx_dtype, eps: float, interpret: bool):
  """(dx, dscale f32, dbias f32 or None) for 2-D ``xn`` (the normalized input).

  ``dres`` (optional) is added to dx (the fused variant's residual gradient).
  """
  n_rows, hidden = xn.shape
  k = hidden // LANES
  has_dres = dres is not None
  row_bytes = hidden * (_nbytes(xn.dtype) + _nbytes(dy.dtype) + _nbytes(dx_dtype)
                        + (_nbytes(dres.dtype) if has_dres else 0))
  # scale + float32 dscale (and dbias) accumulators
  vec_bytes = hidden * (_nbytes(scale.dtype) + 4 * (2 if has_bias else 1))
  br, steps, n_cta = bwd_grid(n_rows, row_bytes, vec_bytes)
  n_blocks = pl.cdiv(n_rows, br)

  def body(*refs):
    it = iter(refs)
    x_g, s_g, dy_g = next(it), next(it), next(it)
    dres_g = next(it) if has_dres else None
    dx_g, ds_g = next(it), next(it)
    db_g = next(it) if has_bias else None
    x_s, s_s, dy_s = next(it), next(it), next(it)
    dres_s = next(it) if has_dres else None
    dx_s, ds_s = next(it), next(it)
    db_s = next(it) if has_bias else None
    bar, s_bar = next(it), next(it)

    plgpu.copy_gmem_to_smem(s_g, s_s, s_bar)
    ds_s[...] = jnp.zeros((k, LANES), _F32)
    if has_bias:
      db_s[...] = jnp.zeros((k, LANES), _F32)
    plgpu.barrier_wait(s_bar)
    chunks, ld = _chunks(k), _loader(_chunk(k), interpret)
    s = _vector_loader(chunks, ld)(s_s)
    # Read the CTA index outside the loops: the interpreter substitutes it at
    # the top level of the body only.
    block0 = lax.axis_index("i") * steps

    @pl.loop(0, steps)
    def _(j):
      blk = block0 + j

      @pl.when(blk < n_blocks)
      def _():
        start = jnp.minimum(blk * br, n_rows - br)
        rows = pl.ds(start, br)
        plgpu.copy_gmem_to_smem(x_g.at[rows], x_s, bar)
        plgpu.copy_gmem_to_smem(dy_g.at[rows], dy_s, bar)
        if has_dres:
          plgpu.copy_gmem_to_smem(dres_g.at[rows], dres_s, bar)
        plgpu.barrier_wait(bar)

        @pl.loop(0, br)
        def _(r):
          sxx = sxg = 0.0
          for cs in chunks:
            x = ld(x_s.at[r, cs]).astype(_F32)
            sxx = sxx + jnp.sum(x * x)
            sxg = sxg + jnp.sum(x * (ld(dy_s.at[r, cs]).astype(_F32) * s(cs)))
          rstd = lax.rsqrt(sxx / hidden + eps)
          c = rstd * sxg / hidden  # mean(xhat * g)
          # Rows the overlapping last block shares with its predecessor were
          # already accumulated there.
          w = jnp.where(start + r >= blk * br, 1.0, 0.0).astype(_F32)
          for cs in chunks:
            xhat = ld(x_s.at[r, cs]).astype(_F32) * rstd
            g_dy = ld(dy_s.at[r, cs]).astype(_F32)
            dx = (g_dy * s(cs) - xhat * c) * rstd
            if has_dres:
              dx = dx + ld(dres_s.at[r, cs]).astype(_F32)
            dx_s.at[r, cs][...] = dx.astype(dx_s.dtype)
            ds_s.at[cs][...] = ld(ds_s.at[cs]) + (g_dy * w) * xhat
            if has_bias:
              db_s.at[cs][...] = ld(db_s.at[cs]) + g_dy * w

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dx_s, dx_g.at[rows])
        # x_s/dy_s/dx_s are reused by the next block.
        plgpu.wait_smem_to_gmem(0)

    plgpu.commit_smem()
    cta = lax.axis_index("i")
    plgpu.copy_smem_to_gmem(ds_s, ds_g.at[cta])
    if has_bias:
      plgpu.copy_smem_to_gmem(db_s, db_g.at[cta])
    plgpu.wait_smem_to_gmem(0)

  inputs = [_view(xn, k), _view(scale, k), _view(dy, k)] + ([_view(dres, k)] if has_dres else [])
  part = jax.ShapeDtypeStruct((n_cta, k, LANES), _F32)
  out_type = [jax.ShapeDtypeStruct((n_rows, k, LANES), dx_dtype), part] + ([part] if has_bias else [])
  tile = lambda dt: plgpu.SMEM((br, k, LANES), dt)
  vec = lambda dt: plgpu.SMEM((k, LANES), dt)
  scratch = [tile(xn.dtype), vec(scale.dtype), tile(dy.dtype)] + ([tile(dres.dtype)] if has_dres else [])
  scratch += [tile(dx_dtype), vec(_F32)] + ([vec(_F32)] if has_bias else [])
  scratch += [plgpu.Barrier(num_arrivals=3 if has_dres else 2), plgpu.Barrier(num_arrivals=1)]
  outs = _compat.mosaic_gpu_kernel(
    body, out_type=out_type, scratch_types=scratch, grid=n_cta,
    name="fused_add_rms_norm_bwd" if has_dres else "rms_norm_bwd", interpret=interpret)(*inputs)
  dx = outs[0].reshape(n_rows, hidden)
  dscale = outs[1].sum(axis=0).reshape(hidden)
  dbias = outs[2].sum(axis=0).reshape(hidden) if has_bias else None
  return dx, dscale, dbias


__all__ = ["LANES", "backward", "block_rows", "bwd_grid", "forward", "unsupported_reason"]
