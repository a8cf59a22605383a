"""Warnings for folds that succeed but whose success misleads.

A fold can "succeed" while doing nothing the user meant: a model without any
normalization folds 0/0 sites, and an ``apply_fn`` that closes over its
weights and ignores its ``params`` argument folds its captured constants while
``folded.params`` go unused. Both are correct results, silently surprising;
these checks say so as a :class:`UserWarning` (the report carries the first as
a line of its own, ``report.NO_SITES``).

Example:
    >>> import warnings, jax.numpy as jnp, jaxfold
    >>> with warnings.catch_warnings(record=True) as w:
    ...   warnings.simplefilter("always")
    ...   _ = jaxfold.fold({"w": jnp.ones(3)}, lambda p, x: x * p["w"], jnp.ones(3))
    >>> "no normalization" in str(w[0].message)
    True
"""

from __future__ import annotations

import warnings
from typing import Any

from jaxfold._src import compat
from jaxfold._src.report import NO_SITES

__all__ = ["warn_after_fold", "unread_params"]


def unread_params(jaxpr: Any, num_leaves: int) -> bool:
  """Whether none of the program's first ``num_leaves`` inputs (the parameter
  leaves) is read by an equation or returned: ``apply_fn`` ignores ``params``."""
  if num_leaves == 0:
    return False
  params = {id(v) for v in jaxpr.invars[:num_leaves]}
  read = (a for e in jaxpr.eqns for a in e.invars)
  return not any(compat.is_var(a) and id(a) in params for a in (*read, *jaxpr.outvars))


def warn_after_fold(analysis: Any, num_leaves: int, stacklevel: int = 4) -> None:
  """The fold-time warnings for ``fold``'s analysis of the example (see module docstring)."""
  if not analysis.report.sites:
    warnings.warn(f"jaxfold.fold: {NO_SITES}", UserWarning, stacklevel=stacklevel)
  if unread_params(analysis.jaxpr, num_leaves):
    warnings.warn(
        f"jaxfold.fold: apply_fn does not read its params argument: none of the {num_leaves} parameter "
        "leaves reaches the program, so folded.params are unused and whatever the fold centers are "
        "constants captured from the enclosing scope (the report names them by the line that reads "
        "them). Pass the weights as apply_fn's first argument (apply_fn(params, *args)) rather than "
        "closing over them.", UserWarning, stacklevel=stacklevel)
