"""The single place where jax-version differences of the Pallas API are handled.

Everything version dependent (import paths, class names of compiler params,
how masked loads/stores are spelled, whether ``pl.pallas_call`` can still
lower through Mosaic GPU) is resolved in :func:`pallas_api`. Kernel code only
talks to the :class:`PallasAPI` it returns.

Known differences (checked against jax 0.10.2 and 0.11.2):

* ``jax.experimental.pallas.triton.CompilerParams(num_warps, num_stages)``
  exists in both; older jax spelled it
  ``jax.experimental.pallas.gpu.TritonCompilerParams``.
* ``jax.experimental.pallas.mosaic_gpu.CompilerParams`` exists in both
  (older: ``GPUCompilerParams``), but only jax 0.10 still lowers a
  ``pl.pallas_call`` through Mosaic GPU (deprecated there; default when no
  compiler params are given, ``jax_pallas_use_mosaic_gpu=True``). jax 0.11
  registers no ``pl.pallas_call`` lowering for Mosaic GPU params (kernels
  must use ``plgpu.kernel``), so that backend is reported unavailable there.
* Masked loads/stores: ``jax.experimental.pallas.triton.load/store`` (0.10,
  0.11); older jax had ``pl.load(ref, idx, mask=...)``.

Example:
    >>> from pallas_kernels._compat import pallas_api
    >>> api = pallas_api("triton")
    >>> api.available, callable(api.load)
    (True, True)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax

BACKENDS = ("triton", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class PallasAPI:
    """Version-resolved Pallas entry points for one GPU backend."""

    backend: str
    available: bool
    reason: str  # why it is unavailable ("" when available)
    # compiler_params(num_warps=..., num_stages=...) -> params object or None
    compiler_params: Callable[..., Any]
    # load(ref, mask=None, other=None) / store(ref, value, mask=None)
    load: Callable[..., Any]
    store: Callable[..., Any]


def _unavailable(backend: str, reason: str) -> PallasAPI:
    def _raise(*_a, **_k):
        raise RuntimeError(f"Pallas backend {backend!r} unavailable: {reason}")

    return PallasAPI(backend, False, reason, _raise, _raise, _raise)


@functools.cache
def pallas_api(backend: str) -> PallasAPI:
    """Resolves compiler params and masked load/store for ``backend``.

    ``backend`` is ``"triton"`` or ``"mosaic_gpu"``. Never raises for an
    unavailable backend; check ``.available``/``.reason`` instead (the
    functions of an unavailable API raise ``RuntimeError`` when called).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown Pallas backend {backend!r}; expected one of {BACKENDS}")
    from jax.experimental import pallas as pl

    # --- masked load / store (the Triton-style spelling) -------------------
    try:
        from jax.experimental.pallas import triton as plt

        def load(ref, mask=None, other=None):
            if mask is None:
                return ref[...]
            return plt.load(ref, mask=mask, other=other)

        def store(ref, value, mask=None):
            if mask is None:
                ref[...] = value
            else:
                plt.store(ref, value, mask=mask)

    except (ImportError, AttributeError):  # older jax: pl.load/pl.store
        def load(ref, mask=None, other=None):
            idx = tuple(slice(None) for _ in ref.shape)
            return pl.load(ref, idx, mask=mask, other=other)

        def store(ref, value, mask=None):
            idx = tuple(slice(None) for _ in ref.shape)
            pl.store(ref, idx, value, mask=mask)

    # --- compiler params ----------------------------------------------------
    if backend == "triton":
        try:
            from jax.experimental.pallas import triton as plt_mod

            cls = plt_mod.CompilerParams
        except (ImportError, AttributeError):
            try:
                from jax.experimental.pallas import gpu as old_gpu

                cls = old_gpu.TritonCompilerParams
            except (ImportError, AttributeError) as e:
                return _unavailable(backend, f"no Triton CompilerParams in jax {jax.__version__}: {e}")

        def compiler_params(num_warps=None, num_stages=None):
            return cls(num_warps=num_warps, num_stages=num_stages)

        return PallasAPI(backend, True, "", compiler_params, load, store)

    # backend == "mosaic_gpu"
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        cls = getattr(plgpu, "CompilerParams", None) or plgpu.GPUCompilerParams
    except (ImportError, AttributeError) as e:
        return _unavailable(backend, f"jax.experimental.pallas.mosaic_gpu not importable: {e}")
    # jax <= 0.10 dispatches pl.pallas_call to Mosaic GPU by params type (the
    # config flag below exists exactly in those versions); jax >= 0.11 only
    # dispatches through a registry that Mosaic GPU does not register in.
    if not hasattr(jax.config, "jax_pallas_use_mosaic_gpu"):
        try:
            from jax._src.pallas import core as pallas_core  # private, guarded
            from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401

            registered = pallas_core.get_lowering_rule(cls, "gpu") is not None
        except Exception:  # noqa: BLE001 - any failure means "not supported"
            registered = False
        if not registered:
            return _unavailable(
                backend,
                f"jax {jax.__version__} cannot lower pl.pallas_call with Mosaic GPU "
                "(it requires plgpu.kernel); use backend='triton'",
            )

    def mgpu_params(num_warps=None, num_stages=None):
        del num_warps  # Mosaic GPU schedules warpgroups itself.
        return cls(max_concurrent_steps=num_stages or 1)

    return PallasAPI(backend, True, "", mgpu_params, load, store)


def default_platform() -> str:
    """``"gpu"``, ``"cpu"`` or ``"tpu"``: the platform jit would run on."""
    return jax.default_backend()
