"""Pallas kernels for jaxfold.

``rms_norm``, ``add_rms_norm`` (= ``fused_add_rms_norm``) and ``rms_matmul``
(a matmul scaled by its left operand's RMS statistic, FlashNorm's reader) pick
the Pallas kernel per lowering platform (CUDA: kernel; CPU/TPU/ROCm: the XLA expression), see
:mod:`pallas_kernels.rms_norm`. :mod:`pallas_kernels.aot` compiles for
H100/A100 target descriptions on a CPU-only host.

Example:
    >>> import jax.numpy as jnp
    >>> import pallas_kernels as pk
    >>> pk.rms_norm(jnp.ones((2, 8)), jnp.ones(8), eps=1e-6, interpret=True).shape
    (2, 8)
"""

from pallas_kernels._compat import export_disabled_checks
from pallas_kernels.dispatch import DEFAULT_RULES, Rule, choose, get_backend, get_rules, set_backend, set_rules
from pallas_kernels.rms_matmul import rms_matmul, rms_matmul_group, rms_matmul_reference
from pallas_kernels.rms_norm import (
    BWD_KERNELS,
    FWD_KERNELS,
    MAX_HIDDEN,
    SUPPORTED_DTYPES,
    add_rms_norm,
    available_backends,
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    resolve_backend,
    rms_norm,
    rms_norm_reference,
    supports,
    unsupported_reason,
)

__all__ = [
    "BWD_KERNELS",
    "DEFAULT_RULES",
    "FWD_KERNELS",
    "MAX_HIDDEN",
    "SUPPORTED_DTYPES",
    "Rule",
    "add_rms_norm",
    "available_backends",
    "choose",
    "export_disabled_checks",
    "fused_add_rms_norm",
    "fused_add_rms_norm_reference",
    "get_backend",
    "get_rules",
    "resolve_backend",
    "rms_matmul",
    "rms_matmul_group",
    "rms_matmul_reference",
    "rms_norm",
    "rms_norm_reference",
    "set_backend",
    "set_rules",
    "supports",
    "unsupported_reason",
]
