"""``jaxfold.fold``: the fold (``fold.py``), then ``fuse_affine`` and
``defer_norms`` on its result when asked.

The composition lives above the three transforms so that none of them
imports another's front end: fold → fuse → defer is a chain of calls on
results, not a circle of imports.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from jaxfold._src import fold as _fold
from jaxfold._src.affine import fuse_affine as _fuse_affine
from jaxfold._src.defer import defer_norms as _defer_norms
from jaxfold._src.fold import Folded, NormImpl, TiedWeights


def fold(params: Any, apply_fn: Callable, *example_args: Any,
         auxiliary_centering: bool = True, tied_weights: TiedWeights = "auto",
         norm_impl: NormImpl = "auto", example_kwargs: Optional[dict] = None,
         fuse_affine: bool = False, defer_norms: bool = False, generic_shapes: bool = True) -> Folded:
  """Folds every provably foldable LayerNorm/GroupNorm of ``apply_fn`` into an RMSNorm.

  Args:
    params: the parameter pytree (linen variables, ``nnx.State``, plain dict)
      of float arrays or ``jax.ShapeDtypeStruct``; it is never modified.
    apply_fn: ``apply_fn(params, *args)``, any jax-traceable function.
    *example_args: arrays or ``jax.ShapeDtypeStruct`` used for tracing.
    auxiliary_centering: allow inserting an explicit centering where it
      removes at least two mean reductions (the paper's practical extension).
      ``False`` guarantees the folded program has no operation the original
      lacks.
    tied_weights: how a parameter that cannot be centered everywhere (e.g. an
      embedding table reused as the LM head) is handled: ``"copy"`` (a
      centered copy for the use that needs it; reported as extra bytes),
      ``"auxiliary"`` (an auxiliary centering instead), or ``"auto"``
      (auxiliary when ``auxiliary_centering`` else copy).
    norm_impl: how folded norms run: ``"auto"`` (the Pallas RMSNorm kernel on
      GPUs where ``pallas_kernels.choose`` expects it to beat XLA, XLA's
      expression elsewhere), ``"xla"``, ``"pallas"`` (force the kernel) or
      ``"interpret"`` (the kernel in Pallas interpret mode, for CPU tests).
    example_kwargs: keyword arguments of ``apply_fn`` for tracing (e.g.
      ``{"train": False}``). The folded ``apply_fn`` takes the same keyword
      arguments: arrays (``rngs={"dropout": key}``) are traced, other values
      re-analyse once per value.
    fuse_affine: also move the folded norms' γ and β into the layers that
      read them (``jaxfold.fuse_affine`` of the fold; returns its ``Fused``).
    defer_norms: also defer the fused norms into their readers
      (``jaxfold.defer_norms``; implies ``fuse_affine``).
    generic_shapes: when an example has a size-1 axis (batch 1, one token),
      also prove the fold with those axes made 2 and keep parameters that
      serve both (a size-1 axis can make a broadcast and a real axis look
      alike, and a Python branch on a size is invisible in one trace). This
      traces ``apply_fn`` a second time. ``False`` folds for the example's
      shapes alone: other shapes are still proved at call time and raise
      ``FoldError`` where the fold's parameters do not hold.

  Returns:
    ``Folded(params, apply_fn, report)`` (``Fused`` with ``fuse_affine``).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxfold
    >>> class M(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return nn.LayerNorm()(nn.Dense(8)(x))
    >>> m = M(); x = jnp.ones((2, 4))
    >>> p = m.init(jax.random.PRNGKey(0), x)
    >>> f = jaxfold.fold(p, m.apply, x)
    >>> f.report.num_folded
    1
    >>> bool(jnp.allclose(f.apply_fn(f.params, x), m.apply(p, x), atol=1e-5))
    True
  """
  folded = _fold.fold(params, apply_fn, *example_args, auxiliary_centering=auxiliary_centering,
                      tied_weights=tied_weights, norm_impl=norm_impl, example_kwargs=example_kwargs,
                      generic_shapes=generic_shapes)
  if defer_norms:
    return _defer_norms(folded)
  if fuse_affine:
    return _fuse_affine(folded)
  return folded
