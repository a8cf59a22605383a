"""The single place where jax-version differences of the Pallas API are handled.

Everything version dependent (import paths, class names of compiler params,
how masked loads/stores are spelled, whether ``pl.pallas_call`` can still
lower through Mosaic GPU) is resolved in :func:`pallas_api`. Kernel code only
talks to the :class:`PallasAPI` it returns.

Known differences (checked against jax 0.10.2 and 0.11.2):

* ``jax.experimental.pallas.triton.CompilerParams(num_warps, num_stages)``
  exists in both; older jax spelled it
  ``jax.experimental.pallas.gpu.TritonCompilerParams``.
* Mosaic GPU: only jax 0.10 still lowers a ``pl.pallas_call`` through it;
  jax 0.11 requires ``plgpu.kernel``. The Mosaic kernels
  (:mod:`pallas_kernels.rms_norm_mosaic`) are ``plgpu.kernel`` bodies, which
  both versions lower (:func:`mosaic_gpu_kernel`). Its interpreter params are
  ``plgpu.InterpretGPUParams`` in 0.11 and private
  (``jax._src.pallas.mosaic_gpu.interpret.params``) in 0.10.
* Kernel choice per lowering platform (:func:`platform_dependent`),
  ``jax.experimental.topologies.get_topology_desc(platform="cuda",
  target_config=...)`` and the Triton custom-call target are the same in
  0.10.2 and 0.11; ``pallas.triton.CUSTOM_CALL_TARGET_NAME`` is exported
  from 0.11 on.
* Masked loads/stores: ``jax.experimental.pallas.triton.load/store`` (0.10,
  0.11); older jax had ``pl.load(ref, idx, mask=...)``.
* ``plgpu.load(ref, idx, layout=...)`` (0.10, 0.11) lost its index argument in
  0.12 (:func:`mosaic_gpu_load`).

Example:
    >>> from pallas_kernels._compat import pallas_api
    >>> api = pallas_api("triton")
    >>> api.available, callable(api.load)
    (True, True)
"""

from __future__ import annotations

import contextlib
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

  # backend == "mosaic_gpu": the kernels are plgpu.kernel bodies (rms_norm_mosaic),
  # which both 0.10 and 0.11 lower; pl.pallas_call via Mosaic GPU is not used.
  problem = mosaic_gpu_problem()
  if problem is not None:
    return _unavailable(backend, problem)

  def mgpu_params(num_warps=None, num_stages=None):
    del num_warps, num_stages  # plgpu.kernel bodies schedule their own copies.
    return None

  return PallasAPI(backend, True, "", mgpu_params, load, store)


# --------------------------------------------------------------------------
# Mosaic GPU (plgpu.kernel)
# --------------------------------------------------------------------------
@functools.cache
def mosaic_gpu_problem() -> str | None:
  """Why ``plgpu.kernel`` bodies cannot be built with this jax, or None.

  Needs ``plgpu.kernel`` with ``kernel_name``/``interpret`` (0.10.2, 0.11.2)
  and the GPU interpreter's params class (public as
  ``plgpu.InterpretGPUParams`` from 0.11 on, private in 0.10).
  """
  try:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for name in ("kernel", "copy_gmem_to_smem", "copy_smem_to_gmem", "Barrier", "SMEM"):
      getattr(plgpu, name)
    fields = getattr(plgpu.Mesh, "__dataclass_fields__", {})
    if "kernel_name" not in fields:
      return f"jax {jax.__version__}: plgpu.Mesh has no kernel_name"
    _interpret_params_cls()
  except Exception as e:  # noqa: BLE001 - any failure means "not supported"
    return f"jax {jax.__version__} has no usable Mosaic GPU kernel API: {type(e).__name__}: {e}"
  return None


def _interpret_params_cls():
  from jax.experimental.pallas import mosaic_gpu as plgpu

  cls = getattr(plgpu, "InterpretGPUParams", None)  # jax >= 0.11
  if cls is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls  # 0.10, private
  return cls


def mosaic_gpu_load(ref, layout):
  """``plgpu.load`` of a whole (sliced) ref in ``layout``: jax 0.10/0.11 take an index
  argument (``()``), jax 0.12 dropped it (``plgpu.load(ref, layout=...)``)."""
  import inspect

  from jax.experimental.pallas import mosaic_gpu as plgpu

  if "idx" in inspect.signature(plgpu.load).parameters:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def mosaic_gpu_kernel(body, *, out_type, scratch_types, grid: int, name: str, interpret: bool):
  """``plgpu.kernel`` over a 1-D grid named ``"i"``.

  ``interpret=True`` runs the body in Mosaic GPU's interpreter (simulated
  SMEM, TMA and barriers on the CPU); the generic ``interpret=True`` of
  Pallas cannot discharge TMA copies (``copy_gmem_to_smem``).
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu

  call = plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch_types, grid=(grid,), grid_names=("i",),
      kernel_name=name, interpret=_interpret_params_cls()() if interpret else False)
  if interpret:
    return call
  return cuda_only(lambda *a: call(*a))


# --------------------------------------------------------------------------
# Kernel choice by lowering platform
# --------------------------------------------------------------------------
def platform_dependent(*args: Any, cuda: Callable[..., Any], default: Callable[..., Any]) -> Any:
  """``cuda(*args)`` when lowered for CUDA, ``default(*args)`` elsewhere.

  ``jax.lax.platform_dependent`` (jax 0.10 and 0.11) stages both branches
  into a ``cond`` whose lowering keeps only the branch of the platform being
  lowered (``branches_platforms``), so a Pallas GPU kernel in the ``cuda``
  branch never reaches the CPU compiler. ROCm takes ``default``: the
  kernels have not been compiled or checked for it.
  """
  return jax.lax.platform_dependent(*args, cuda=cuda, default=default)


def triton_custom_call_target() -> str:
  """The custom-call target of compiled Pallas Triton kernels in HLO."""
  try:
    from jax.experimental.pallas import triton as plt

    return plt.CUSTOM_CALL_TARGET_NAME  # jax >= 0.11
  except (ImportError, AttributeError):
    return "__gpu$xla.gpu.triton"  # jax 0.10 (same string)


def export_disabled_checks() -> list:
  """``jax.export`` safety checks to disable for artifacts holding the kernels.

  ``jax.export`` refuses custom calls without a stability guarantee, and
  Triton IR has none: an exported CUDA artifact with the kernel is only
  valid for the jax/jaxlib that wrote it.
  """
  from jax import export

  return [export.DisabledSafetyCheck.custom_call(triton_custom_call_target())]


# --------------------------------------------------------------------------
# Deviceless CUDA compilation (pallas_kernels.aot)
# --------------------------------------------------------------------------
def cuda_topology(target_config: str):
  """A one-device CUDA ``TopologyDescription`` built from a target config.

  Needs the ``jax-cuda12-plugin``/``jax-cuda12-pjrt`` wheels of the running
  jax (``pip install -e ".[gpu-aot]"``); no GPU, driver or CUDA runtime.
  Raises ``RuntimeError`` with the reason when compiling for CUDA is not
  possible here.

  Why the re-registration below: on a host without a CUDA runtime the
  plugin's ``initialize()`` fails its runtime-version check -- unless
  ``JAX_PLATFORMS`` excludes CUDA, or ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` is
  set -- and then registers no CUDA topology factory. Compile-only use never
  touches the runtime, so we rerun ``initialize()`` with the check skipped
  (only when no CUDA backend exists, so a real GPU setup is left alone).
  """
  from jax._src import xla_bridge as xb  # private, guarded: registry of topology factories
  from jax.experimental import topologies

  try:
    xb._discover_and_register_pjrt_plugins()
    if "cuda" not in xb._topology_factories and "cuda" not in xb._backends:
      import os

      try:
        from jax_plugins import xla_cuda12 as plugin  # the jax-cuda12-plugin wheel
      except ImportError as e:
        raise RuntimeError(
            "the CUDA PJRT plugin is not installed: pip install -e \".[gpu-aot]\" "
            f"(jax-cuda12-plugin=={jax.__version__}, jax-cuda12-pjrt, nvidia-cuda-nvcc-cu12): {e}"
        ) from None
      prev = os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
      os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
      try:
        plugin.initialize()
      finally:
        if prev is None:
          del os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"]
        else:
          os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = prev
  except RuntimeError:
    raise
  except Exception as e:  # noqa: BLE001 - any failure means "cannot compile for CUDA here"
    raise RuntimeError(f"cannot register the CUDA PJRT plugin: {type(e).__name__}: {e}") from e
  try:
    return topologies.get_topology_desc(platform="cuda", target_config=target_config, topology="1x1x1")
  except Exception as e:  # noqa: BLE001
    raise RuntimeError(f"cannot build a CUDA topology: {type(e).__name__}: {e}") from e


def dump_options() -> dict:
  """XLA options that make ``xla_dump_to`` also write each kernel's LLVM IR and PTX.

  jax 0.10's XLA dumps them with ``xla_dump_to`` alone; jax 0.11's writes
  only the HLO and thunk files unless ``xla_dump_emitter_re`` selects the
  emitters (checked: no ``*.ptx`` without it on 0.11.2). The pattern selects
  the PTX dump only: ``".*"`` also dumps every MLIR pass of every Triton
  kernel (2.7 MB for one RMSNorm), which made a deviceless compile 10-15x
  slower (3.0 s against 0.2 s for a 4096x768 RMSNorm on the H100).
  """
  if _triton_gpu_info() is None:  # jax 0.10 (the same switch as gpu_target)
    return {}
  return {"xla_dump_emitter_re": ".*ptx.*"}


# --------------------------------------------------------------------------
# Which GPU a Triton kernel is lowered for
# --------------------------------------------------------------------------
# jax 0.10's Triton lowering reads the compute capability of the first local GPU
# and, without one, assumes 9.0. jax 0.11 reads it from
# jax._src.pallas.triton.gpu_info: the local GPU or the abstract device of the
# current abstract mesh, and raises "No supported GPU devices found, please
# specify an abstract GPU device using AbstractDevice" on a CPU-only host -- in
# jax.export(platforms=("cpu", "cuda")) and in deviceless compilation alike.
DEFAULT_GPU_KIND = "NVIDIA H100"  # compute capability 9.0: jax 0.10's fallback, so both versions agree


def _triton_gpu_info():
  """jax 0.11's ``gpu_info`` module, or None where the lowering does not use one (jax 0.10)."""
  try:
    from jax._src.pallas.triton import gpu_info  # private, guarded
  except ImportError:
    return None
  return gpu_info if hasattr(gpu_info, "get_gpu_info") else None


def gpu_target(device_kind: str | None = None):
  """Context in which Pallas Triton kernels lower for the GPU ``device_kind``.

  ``device_kind`` is a CUDA device kind (``"NVIDIA A100-SXM4-80GB"``; what
  matters is the model name, which fixes the compute capability). ``None``:
  a local GPU or an abstract GPU the caller set
  (``jax.sharding.use_abstract_mesh``) wins, else :data:`DEFAULT_GPU_KIND`.
  A no-op on jax 0.10, whose lowering assumes compute capability 9.0 without
  a GPU. The current abstract mesh keeps its axes; only its abstract device
  is set, so this also works inside a sharded program.

  Example:
      >>> with gpu_target("NVIDIA A100"):
      ...     pass
  """
  info = _triton_gpu_info()
  if info is None:
    return contextlib.nullcontext()
  if device_kind is None:
    try:
      info.get_gpu_info()
      return contextlib.nullcontext()  # a real or caller-chosen abstract GPU
    except ValueError:
      device_kind = DEFAULT_GPU_KIND
  if info.gpu_version_from_device_kind(device_kind) is None:
    raise ValueError(f"{device_kind!r} is not a GPU that jax {jax.__version__}'s Triton lowering knows")
  from jax._src import mesh as mesh_lib  # private, guarded by the jax version check above

  dev = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
  return jax.sharding.use_abstract_mesh(mesh_lib.get_abstract_mesh().update(abstract_device=dev))


# --------------------------------------------------------------------------
# Lowering a kernel for CUDA only, also inside multi-platform lowerings
# --------------------------------------------------------------------------
# In a multi-platform lowering (jax.export(..., platforms=("cpu", "cuda"))) the
# kept branches of a platform_dependent are lowered in a context that still
# lists *all* platforms, so pl.pallas_call lowers its CPU rule too and raises
# ("Only interpret mode is supported on CPU backend"; jax 0.10.2 and 0.11).
# `cuda_only(f)` stages f as one primitive whose lowering narrows the module
# context to CUDA. It is only ever lowered inside the cuda branch of
# platform_dependent, so the narrowing is exact. No AD rules: it is used inside
# custom_vjp forward/backward rules only.
_cuda_only_p = None


def _cuda_only_primitive():
  global _cuda_only_p
  if _cuda_only_p is not None:
    return _cuda_only_p
  from jax._src import core  # private, guarded by the tests of every supported jax
  from jax._src.interpreters import batching, mlir

  p = core.Primitive("pallas_kernels_cuda_only")
  p.multiple_results = True
  p.def_impl(lambda *args, jaxpr: jax.jit(core.jaxpr_as_fun(jaxpr))(*args))
  p.def_abstract_eval(lambda *args, jaxpr: jaxpr.out_avals)

  def lowering(ctx, *args, jaxpr):
    narrowed = ctx.replace(module_context=ctx.module_context.replace(platforms=("cuda",)))
    return mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)(narrowed, *args)

  def batcher(args, dims, *, jaxpr):
    fn = jax.vmap(core.jaxpr_as_fun(jaxpr), in_axes=tuple(dims))
    outs = cuda_only(fn)(*args)
    return outs, [0] * len(outs)

  mlir.register_lowering(p, lowering)
  batching.primitive_batchers[p] = batcher
  _cuda_only_p = p
  return p


def cuda_only(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` (flat array args -> list of arrays), lowered with CUDA as the only platform."""
  def wrapped(*args):
    p = _cuda_only_primitive()
    # Traced under the GPU target: each equation records the abstract mesh
    # it was traced in and lowering restores it, so setting it only at
    # lowering time would not reach the kernel's lowering rule.
    with gpu_target():
      closed = jax.make_jaxpr(lambda *a: list(fn(*a)))(*args)
    return p.bind(*args, jaxpr=closed)

  return wrapped
