"""Pallas kernels for jaxfold.

Example:
    >>> import jax.numpy as jnp
    >>> import pallas_kernels as pk
    >>> pk.rms_norm(jnp.ones((2, 8)), jnp.ones(8), eps=1e-6, interpret=True).shape
    (2, 8)
"""

from pallas_kernels.dispatch import DEFAULT_RULES, Rule, choose, get_rules, set_rules
from pallas_kernels.rms_norm import (
    available_backends,
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    resolve_backend,
    rms_norm,
    rms_norm_reference,
)

__all__ = [
    "DEFAULT_RULES",
    "Rule",
    "available_backends",
    "choose",
    "fused_add_rms_norm",
    "fused_add_rms_norm_reference",
    "get_rules",
    "resolve_backend",
    "rms_norm",
    "rms_norm_reference",
    "set_rules",
]
