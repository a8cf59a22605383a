"""jaxfold's refusals: one base class, one subclass per transform.

``JaxfoldError`` is a ``ValueError``, so code written before the hierarchy
(``except ValueError``) still catches every refusal; each transform raises its
own subclass so a caller can tell them apart:

* ``FoldError``: ``fold``/``cbwc``/``load_fold`` (and ``IntegrityError``, a damaged
  or foreign saved fold, is a ``FoldError``);
* ``FuseError``: ``fuse_affine``;
* ``RotateError``: ``rotate``. It subclasses ``FuseError`` because ``rotate`` raised
  ``FuseError`` before it had its own class: ``except FuseError`` still catches
  what it caught, and ``except RotateError`` now tells a rotation apart.

This module imports nothing of jaxfold, so every other module can import it.
"""

from __future__ import annotations


class JaxfoldError(ValueError):
  """A refusal by jaxfold; the message names the problem and the fix."""


class FoldError(JaxfoldError):
  """Bad input to fold/cbwc; the message names the problem and the fix."""


class FuseError(JaxfoldError):
  """Bad input to ``fuse_affine``; the message says what to pass."""


class RotateError(FuseError):
  """Bad input to ``rotate``, or a rotation that is not provably exact.

  A ``FuseError`` for compatibility: ``rotate`` raised ``FuseError`` before."""


__all__ = ["JaxfoldError", "FoldError", "FuseError", "RotateError"]
