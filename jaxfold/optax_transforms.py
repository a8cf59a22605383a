"""Optax transformations for CBWC training (:func:`jaxfold.cbwc`).

With CBWC the stored parameter is W while the forward pass uses the centered
weight V = P·W (P = I − 11ᵀ/m along the centered axes). The model's function,
and therefore its gradient, depends on W only through V: the component of W
along the all-ones direction (11ᵀW/m) is invisible. Weight decay can then be
applied to W (what ``optax.adamw`` / ``optax.add_decayed_weights`` do, and what
the original LayerNorm model does: identical trajectories) or to V (the paper's
Appendix variant): :func:`decay_centered_weights`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from jaxfold._src import layout

__all__ = ["decay_centered_weights", "centered_weights"]


def _leaf_specs(reparam: Any) -> tuple[dict, Any]:
  """Returns ({leaf index: spec dict}, expected treedef or None)."""
  tree = None
  if hasattr(reparam, "leaf_specs") and hasattr(reparam, "apply_fn"):   # Reparameterized
    tree = getattr(reparam.apply_fn, "params_treedef", None)
    specs = reparam.leaf_specs
  else:                                                                 # ((index, spec), ...)
    specs = reparam
  try:
    out = {int(i): dict(spec) for i, spec in specs}
  except (TypeError, ValueError) as e:
    raise TypeError("reparam must be the result of jaxfold.cbwc (or a sequence of (leaf "
                    "index, spec) pairs like its .leaf_specs), got "
                    f"{type(reparam).__name__}") from e
  return out, tree


def centered_weights(reparam: Any) -> Callable[[Any], Any]:
  """``params -> V``: the weights a CBWC forward pass uses (V = P·W on the
  leaves ``reparam`` centers, W elsewhere).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxfold
    >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm()])
    >>> x = jnp.ones((2, 3)); p = m.init(jax.random.PRNGKey(0), x)
    >>> v = jaxfold.optax_transforms.centered_weights(jaxfold.cbwc(p, m.apply, x))(p)
    >>> bool(jnp.allclose(v['params']['layers_0']['kernel'].sum(-1), 0, atol=1e-6))
    True
  """
  specs, expected_tree = _leaf_specs(reparam)
  if expected_tree is None:      # leaf indices only: the whole parameter tree is expected
    def center(params):
      # optax.masked (and multi_transform) drop masked-out leaves or whole subtrees
      # (an optax.MaskedNode each): the indices would then name other leaves.
      nodes = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda n: isinstance(n, optax.MaskedNode))[0]
      masked = [jax.tree_util.keystr(k) for k, leaf in nodes if isinstance(leaf, optax.MaskedNode)]
      if masked:
        raise ValueError(
            f"params has leaves masked out by optax.masked/multi_transform ({masked[0]}, ...): "
            "with leaf indices (reparam's .leaf_specs) the remaining leaves cannot be "
            "matched to the parameters reparam centers. Pass the result of jaxfold.cbwc itself, "
            "which matches them by path, or use decay_centered_weights(..., mask=...).")
      leaves, tree = jax.tree_util.tree_flatten(params)
      if specs and max(specs) >= len(leaves):
        raise ValueError(f"reparam centers leaf {max(specs)} but params has only "
                         f"{len(leaves)} leaves")
      for i, spec in specs.items():
        shape = tuple(jnp.shape(leaves[i]))
        if any(d >= len(shape) or shape[d] % b for d, b in spec.items()):
          raise ValueError(f"params leaf {i} has shape {shape}, but reparam centers it in blocks "
                           f"{spec} (axis: block size): params does not have the structure reparam "
                           "was made for")
      return jax.tree_util.tree_unflatten(
          tree, [layout.center(x, specs[i]) if i in specs else x for i, x in enumerate(leaves)])
    return center
  # Keyed by path, so a subtree selected by optax.masked is centered correctly too.
  skeleton = jax.tree_util.tree_unflatten(expected_tree, range(expected_tree.num_leaves))
  by_path = {jax.tree_util.keystr(k): specs.get(i)
             for k, i in jax.tree_util.tree_flatten_with_path(skeleton)[0]}

  def center(params):
    def one(path, x):
      key = jax.tree_util.keystr(path)
      if key not in by_path:
        raise ValueError(f"params leaf {key} is not in the parameters reparam was made for "
                         f"({expected_tree})")
      spec = by_path[key]
      return layout.center(x, spec) if spec else x
    return jax.tree_util.tree_map_with_path(one, params)

  return center


def _decays(x: Any) -> bool:
  return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def decay_centered_weights(
    weight_decay: Union[float, jax.Array, Callable[[Any], Any]],
    reparam: Any,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
) -> optax.GradientTransformation:
  r"""Adds ``weight_decay * V`` (V = P·W, the centered weight) to the updates.

  The CBWC counterpart of :func:`optax.add_decayed_weights`: for every leaf
  that ``reparam`` (the result of :func:`jaxfold.cbwc`) centers in its forward
  pass, it adds ``weight_decay * center(W)``; for every other leaf it adds
  ``weight_decay * W`` exactly like ``optax.add_decayed_weights``. ``mask``
  (a pytree of bools with the structure of the params, or a callable that
  returns one) selects which leaves are decayed at all; ``None`` decays all
  float leaves (PRNG keys, integer counters and flags are never decayed).

  **Decay on V versus decay on W.** With CBWC the function depends on W only
  through V = P·W, i.e. not on W's component along the all-ones direction
  of the centered axes (11ᵀW/m). ``add_decayed_weights`` (decay on W) shrinks
  that invisible component too; this transformation (decay on V) leaves it
  alone and is the gradient of the L2 penalty ``weight_decay/2 · ‖V‖²``
  (P is an orthogonal projection, so ∂‖PW‖²/∂W = 2·PW).

  * As a *decoupled* decay (added after the preconditioner and followed only
    by a step size, as in ``optax.adamw``), both choices give the same model
    function at every step — P·(update) is identical — and differ only in the
    invisible component. A transformation after the decay that reads norms
    (``scale_by_trust_ratio`` in LAMB and LARS: ‖W‖ and ‖update‖) sees the two
    differ, so there the functions differ too.
  * As a *coupled* L2 term (added before a per-element preconditioner such as
    ``scale_by_adam``, PyTorch's ``Adam(weight_decay=...)``), the preconditioner
    mixes the ones-component into the visible part, so the two trajectories
    differ. ``chain(decay_centered_weights(wd, r), scale_by_adam(), scale(-lr))``
    is Adam on ``loss + wd/2·‖V‖²``: the variant whose regularizer sees only
    the weight the model actually uses.

  Leaves that ``reparam`` uses both centered and uncentered (an "untied copy"
  of a tied weight) are decayed on W, since W itself is used too.

  The leaves decayed on V are those that ``reparam``'s plan centers: the plan
  at the example ``cbwc`` was given. ``r.apply_fn`` re-plans per call, and a
  training call can center less than the example (dropout between a layer and
  its norm blocks the fold in training mode only), so give ``cbwc`` the
  training call's keyword arguments (``example_kwargs={"train": True, ...}``).

  Args:
    weight_decay: the decay rate: a float, a scalar array, or an optax
      schedule (``step -> rate``, e.g. ``optax.cosine_decay_schedule``).
    reparam: ``jaxfold.cbwc(params, apply_fn, *args)``, or its ``.leaf_specs``.
    mask: as in ``optax.add_decayed_weights`` (applied with ``optax.masked``).

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` requires ``params``:
    ``optax.scale`` (or ``optax.scale_by_schedule``) applied to V, added to
    the updates, wrapped in ``optax.masked`` when ``mask`` is given.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, jaxfold
    >>> from jaxfold.optax_transforms import decay_centered_weights
    >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
    >>> x = jnp.ones((4, 3)); p = m.init(jax.random.PRNGKey(0), x)
    >>> r = jaxfold.cbwc(p, m.apply, x)
    >>> opt = optax.chain(decay_centered_weights(1e-2, r), optax.scale_by_adam(),
    ...                   optax.scale(-1e-3))
    >>> state = opt.init(p)
    >>> g = jax.grad(lambda q: r.apply_fn(q, x).sum())(p)
    >>> updates, state = opt.update(g, state, p)
    >>> p2 = optax.apply_updates(p, updates)
    >>> bool(jnp.allclose(r.apply_fn(p2, x), m.apply(p2, x), atol=1e-5))
    True
    >>> k = p['params']['layers_0']['kernel']   # the ones-component is untouched
    >>> zero = jax.tree_util.tree_map(jnp.zeros_like, p)
    >>> u, _ = decay_centered_weights(0.5, r).update(zero, (), p)
    >>> bool(jnp.allclose(u['params']['layers_0']['kernel'].mean(-1), 0, atol=1e-7))
    True
  """
  center = centered_weights(reparam)
  # By path, the leaves optax.masked keeps are centered after the mask; leaf
  # indices name leaves of the whole tree, so there V is made before the mask.
  by_index = _leaf_specs(reparam)[1] is None
  rate = (optax.scale_by_schedule(weight_decay) if callable(weight_decay)
          else optax.scale(weight_decay))

  def add_decay(updates, state, params):
    v = params if by_index else center(params)
    # Leaves that are not float weights (PRNG keys, counters, flags) are never decayed.
    floats = jax.tree_util.tree_map(_decays, v)
    v = jax.tree_util.tree_map(lambda x, f: x if f else jnp.zeros((), jnp.float32), v, floats)
    decay, state = rate.update(v, state)
    return jax.tree_util.tree_map(lambda u, d, f: (u + d).astype(u.dtype) if f else u,
                                  updates, decay, floats), state

  t = optax.GradientTransformation(rate.init, add_decay)
  t = optax.masked(t, mask) if mask is not None else t

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("decay_centered_weights needs the current params: call "
                       "update(updates, state, params).")
    if jax.tree_util.tree_structure(updates) != jax.tree_util.tree_structure(params):
      raise ValueError(f"updates structure {jax.tree_util.tree_structure(updates)} differs "
                       f"from params structure {jax.tree_util.tree_structure(params)}")
    return t.update(updates, state, center(params) if by_index else params)

  return optax.GradientTransformation(t.init, update_fn)
