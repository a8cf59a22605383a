"""``jaxfold.defer_norms``: the front end of deferred normalization (FlashNorm).

The analysis and the rewrite are in ``defer_analysis.py`` (run by fuse's analysis
and by ``rewrite.evaluate``); this module checks what it is given, fuses a
fold first, and re-analyses with ``affine.analyse(..., defer=True)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxfold._src import affine, counts, pipeline, rotate
from jaxfold._src.defer_analysis import Deferred, DeferSite
from jaxfold._src.step import Params

__all__ = ["DeferSite", "Deferred", "defer_norms"]


def defer_norms(model: Any, *example_args: Any) -> Any:
  """Defers the normalization of fused norms into their readers (FlashNorm).

  ``model`` is a :class:`jaxfold.Fused` (or a :class:`jaxfold.Folded`, which is
  fused first). Where a fused RMS norm ``y = x · s`` (``s = 1/rms(x)``, one
  value per row) is read only by contractions over the normalized dim, each
  reader computes ``(x @ W') · s`` and then adds its ``β·W`` bias: the
  normalized tensor is never formed. The parameters are those of the fused
  model; ``report.deferred`` says per site whether it was deferred, or which
  reader prevents it and why.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxfold
    >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(3)])
    >>> x = jnp.ones((2, 4)); p = m.init(jax.random.PRNGKey(0), x)
    >>> d = jaxfold.defer_norms(jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x)))
    >>> d.report.num_deferred
    1
    >>> bool(jnp.allclose(d.apply_fn(d.params, x), m.apply(p, x), atol=1e-5))
    True
  """
  fn = getattr(model, "apply_fn", None)
  if isinstance(fn, rotate.RotatedApply):
    raise affine.FuseError("defer_norms takes the fused model, before rotate: "
                           "jaxfold.rotate(jaxfold.defer_norms(fused), q)")
  if not isinstance(fn, affine.FusedApply):
    if not hasattr(model, "params") or not callable(fn):
      raise affine.FuseError(f"defer_norms takes a jaxfold.Fused or jaxfold.Folded, got "
                             f"{type(model).__name__}")
    model = affine.fuse_affine(model, *example_args)
    fn = model.apply_fn
  args = tuple(example_args) if example_args else fn.example_args
  kwargs = pipeline.model_kwargs(model, example_args)
  call = fn.bind(args, kwargs)
  fused = fn.example_analysis
  an = affine.analyse(call.fn, fn.params_abstract, call.abstract_args(affine.FuseError), defer=True,
                      tl=fused.tl_options)
  if not an.fuses_like(fused):
    raise affine.FuseError("these inputs fuse differently from the example fuse_affine was given; "
                           "pass the same example_args")
  # The new biases were made at fuse_affine's example; the deferred apply takes
  # them as laid out at this one (its base), which may have another rank.
  # (At the same rank nothing moves and the parameters stay the fused model's own.)
  params = model.params
  if isinstance(params, Params):
    extras = affine.relayout(params.extras, fused, an)
    if any(extras[k] is not x for k, x in params.extras.items()):
      params = Params(params.params, extras)
  apply = affine.FusedApply(fn.inner, fn.params_abstract, an, args, kwargs)
  return affine.Fused(params, apply, dataclasses.replace(an.report, programs=counts.result_counts(params, apply)))
