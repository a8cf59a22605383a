"""The rewrite's marker for an exactly-zero value (a removed mean reduction).

A leaf module: the rules' ``simplify`` facets return it and the rewrite
creates it, so neither imports the other for it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Zero:
  """A value known to be exactly zero; never materialised unless needed."""
  aval: Any

  def materialize(self):
    return jnp.zeros(self.aval.shape, self.aval.dtype)
