"""Grid arithmetic shared by the Triton (``rms_norm``) and Mosaic GPU
(``rms_norm_mosaic``) RMSNorm kernels."""

from __future__ import annotations

from jax.experimental import pallas as pl


def loop_grid(n_blocks: int, target: int, pow2: bool = False) -> tuple[int, int]:
  """``(steps, programs)`` of a backward kernel whose programs each loop over
  ``steps`` row blocks: at most ``target`` programs (fewer float32 partial
  dscale/dbias rows for XLA to add), as few steps as that allows. ``pow2``
  rounds steps up to a power of two (Triton: ``block_rows x steps`` is a block
  shape)."""
  steps = max(1, pl.cdiv(n_blocks, target))
  if pow2:
    steps = pl.next_power_of_2(steps)
  return steps, pl.cdiv(n_blocks, steps)
