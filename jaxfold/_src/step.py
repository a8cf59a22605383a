"""A transform as a step of a chain: one result type, one apply wrapper, one registry.

Every transform (``fold``, ``cbwc``, ``fuse_affine``, ``defer_norms``,
``rotate``) returns a :class:`Result` ``(params, apply_fn, report)`` whose
``apply_fn`` is a :class:`Step`: a ``pipeline.PipelineApply`` (argument
binding, the per-signature analysis cache) whose ``inner`` is the function it
transformed. A chain is read by following ``inner`` from the outermost step
to the root (the fold): :func:`chain_of`.

Saving and loading a chain never looks inside a step: each step says what it
needs as a :class:`StepRecord` (``record``) and rebuilds itself from it
(``parse``, then ``restore``), and is found by its ``kind`` in the registry
(:func:`register`). A new transform is one module: a ``Step`` subclass with
those three methods, registered; ``save_fold``/``load_fold``/``export`` need
no change (see docs/contributing.md, "Adding a transform step").
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, ClassVar, NamedTuple, Optional

import numpy as np

from jaxfold._src import display
from jaxfold._src.pipeline import PipelineApply


class StepRecord(NamedTuple):
  """What a step saves: ``info`` (JSON values; its ``"name"`` is the step's
  kind) and ``arrays`` (NumPy arrays saved beside it, by name)."""
  info: dict
  arrays: dict


class RestoreContext(NamedTuple):
  """What ``Step.restore`` is given besides the step before it.

  ``args``/``kwargs``: the fold's abstract example arguments; ``verify``: check
  the step makes the saved decisions; ``refuse(what)``: the error to raise
  when it does not; ``error``: the error class of the load; ``array(name)``:
  the step's saved array of that name (None if absent); ``same_key(key,
  sha256)``: whether a saved digest is that of ``key`` (an older format spelt
  parameter names otherwise); ``leaf(i)``: the index now of the parameter
  leaf a record saved as ``i`` (an older format ordered leaves otherwise)."""
  args: tuple
  kwargs: dict
  verify: bool
  refuse: Callable[[str], Exception]
  error: type
  array: Callable[[str], Optional[np.ndarray]]
  same_key: Callable[[Any, Any], bool] = lambda key, sha256: digest(key) == sha256
  leaf: Callable[[int], int] = lambda i: i


class Restored(NamedTuple):
  """A step rebuilt on load: its apply function, its report, and the tree
  structure of the parameters that apply function takes (None: the same as
  the step before it)."""
  apply_fn: Any
  report: Any
  params_tree: Any


class Step(PipelineApply):
  """The apply function of one transform step.

  ``kind`` names the step in saves (``"fold"``, ``"fuse_affine"``, ...);
  ``root``: a chain may start at this step (its parameters come from the
  user's, as a fold's). Subclasses that can be saved after the root implement
  ``record``, ``parse`` and ``restore``.
  """

  kind: ClassVar[str] = ""
  root: ClassVar[bool] = False

  @property
  def transform(self) -> str:   # the kind under its older name
    return self.kind

  def saveable(self) -> bool:
    """``save_fold`` can record and redo this step (a CBWC apply function cannot)."""
    return type(self).kind in STEPS or self.root

  def record(self) -> StepRecord:
    """What ``restore`` needs to rebuild this step on load."""
    raise NotImplementedError(f"{type(self).__name__} cannot be saved")

  @classmethod
  def parse(cls, info: dict, decode: Callable[[Any], Any]) -> Any:
    """The saved ``info`` checked and decoded (``decode``: JSON to abstract
    arguments); raises KeyError/TypeError/ValueError when it is malformed."""
    return info

  @classmethod
  def restore(cls, inner: Callable, params: Any, parsed: Any, ctx: RestoreContext) -> Restored:
    """The step redone on ``inner`` at abstract ``params`` (the parameters
    ``inner`` takes), checked against ``parsed`` when ``ctx.verify``."""
    raise NotImplementedError


STEPS: dict = {}   # kind -> Step subclass that save_fold/load_fold can redo


def register(cls: type) -> type:
  """Class decorator: ``cls`` (a ``Step`` with a ``kind``) can be saved and loaded."""
  if not (isinstance(cls, type) and issubclass(cls, Step) and cls.kind):
    raise TypeError(f"register takes a Step subclass with a kind, got {cls!r}")
  if STEPS.get(cls.kind, cls) is not cls:
    raise ValueError(f"a step of kind {cls.kind!r} is registered already ({STEPS[cls.kind].__name__})")
  STEPS[cls.kind] = cls
  return cls


def register_params(cls: type, serialized_name: str) -> type:
  """Registers a step's parameter type (a NamedTuple) with ``jax.export``, so
  that an artifact taking the parameters as an argument serializes their tree;
  ``serialized_name`` is stable across versions (artifacts record it)."""
  from jax import export as jax_export
  jax_export.register_namedtuple_serialization(cls, serialized_name=serialized_name)
  return cls


def restorer(kind: Any) -> Optional[type]:
  """The registered step class of ``kind`` (None: unknown to this jaxfold)."""
  return STEPS.get(kind) if isinstance(kind, str) else None


def chain_of(apply_fn: Any) -> Optional[list]:
  """The steps of a result's ``apply_fn`` from the root outwards, when every
  one can be saved and the innermost is a root; None otherwise."""
  steps = []
  fn = apply_fn
  while isinstance(fn, Step):
    if not fn.saveable():
      return None
    steps.append(fn)
    if fn.root:
      return steps[::-1]
    fn = fn.inner
  return None


def digest(key: Any) -> str:
  """The SHA-256 of ``repr(key)``: what a save records of an analysis' decisions."""
  return hashlib.sha256(repr(key).encode()).hexdigest()


class Params(NamedTuple):
  """The parameters every result's ``apply_fn`` takes (``jaxfold.Params``).

  ``params``: the user's pytree, in its own structure, as the steps left it
  (centered by a fold; a γ or β that ``fuse_affine`` moved away is ``None``;
  weights scaled or rotated in place); ``extras``: ``{name: array}`` of the
  tensors steps added (a fold's untied centered copies ``P@centered(d)``,
  ``fuse_affine``'s scaled copies ``W@fusedγ`` and new biases ``W@biasβ``).
  A type of its own, so that passing the user's parameters to a transformed
  ``apply_fn`` is refused instead of computing something else; it is not a flax
  variable dict (the original model takes a fold's ``.params``).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxfold
    >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm()])
    >>> x = jnp.ones((2, 4)); p = m.init(jax.random.PRNGKey(0), x)
    >>> folded = jaxfold.fold(p, m.apply, x)
    >>> isinstance(folded.params, jaxfold.Params), folded.params.extras
    (True, {})
  """
  params: Any
  extras: dict
  __repr__ = display.params_repr
  __getattr__ = display.not_a_variable_dict


def with_extras(base: Any, extras: dict, error: type) -> Params:
  """``base`` (a ``Params``, or a plain pytree) with the ``extras`` a step
  adds: one ``Params`` whatever the chain's length. A name already present is
  refused (one tensor would silently replace another).

  Example:
    >>> p = with_extras(Params({"w": 1}, {"a": 2}), {"b": 3}, ValueError)
    >>> p.params, sorted(p.extras)
    ({'w': 1}, ['a', 'b'])
  """
  if not isinstance(base, Params):
    return Params(base, dict(extras))
  clash = sorted(set(base.extras) & set(extras))
  if clash:
    raise error(f"a step would add parameters named like existing ones: {', '.join(clash[:3])}")
  return Params(base.params, {**base.extras, **extras})


def split_extras(params: Params, inner: Any, error: type) -> tuple:
  """``(the parameters of the step before, this step's extras)`` of ``params``:
  ``inner`` is the (abstract) parameters the step before takes (a ``Params``
  whose extras names are its own, or a plain pytree).

  Example:
    >>> split_extras(Params({"w": 1}, {"a": 2, "b": 3}), Params({"w": 0}, {"a": 0}), ValueError)
    (Params(params=<1 leaves, 0 B, no arrays>, extras={'a': int}), {'b': 3})
  """
  if not isinstance(inner, Params):
    return params.params, dict(params.extras)
  missing = sorted(set(inner.extras) - set(params.extras))
  if missing:
    raise error(f"params lacks the extra tensors {', '.join(missing[:3])}: pass the result's .params")
  before = {k: params.extras[k] for k in inner.extras}
  return Params(params.params, before), {k: x for k, x in params.extras.items() if k not in inner.extras}


register_params(Params, "jaxfold.Params")


class Result(NamedTuple):
  """What every transform returns: ``apply_fn(params, *args)`` computes the original.

  ``params``: the :class:`Params` ``apply_fn`` takes; ``report``: what the
  last step did; ``steps``: the chain of steps that made it, from the fold
  outwards.
  """
  params: Any
  apply_fn: Callable
  report: Any

  @property
  def steps(self) -> tuple:
    """The ``Step`` apply functions of the chain, from the root (the fold) outwards."""
    out, fn = [], self.apply_fn
    while isinstance(fn, Step):
      out.append(fn)
      fn = fn.inner
    return tuple(out[::-1])


__all__ = ["Params", "Restored", "RestoreContext", "Result", "Step", "StepRecord", "STEPS", "chain_of", "digest",
           "register", "register_params", "restorer", "split_extras", "with_extras"]
