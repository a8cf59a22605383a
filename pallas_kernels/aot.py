"""Compile for NVIDIA GPUs ahead of time, on a CPU-only host, and read what XLA built.

JAX's CUDA PJRT plugin compiles against a *topology description* made from a
``GpuTargetConfigProto`` (``targets/*.txtpb``: H100, A100); no GPU, driver or
CUDA runtime is needed, only ``pip install -e ".[gpu-aot]"`` (the
``jax-cuda12-plugin``/``jax-cuda12-pjrt`` wheels of the running jax and
``nvidia-cuda-nvcc-cu12`` for ``ptxas``/libdevice). :func:`compile` lowers
and compiles a function for a target with XLA's dump enabled and returns a
:class:`Compilation`: the optimized HLO, the launched kernels in order (from
the thunk sequence: grid, threads, dynamic shared memory, operand + result
bytes, flops of dots/convolutions) and each kernel's PTX, which :func:`ptxas_info`
turns into registers and spills.

Everything here describes a *compilation*; bytes and times derived from it are
a model, not a measurement.

Example:
    >>> import jax.numpy as jnp, pallas_kernels as pk
    >>> from pallas_kernels import aot
    >>> if aot.unavailable_reason() is None:  # the gpu-aot extra is installed
    ...     c = aot.compile(lambda x, s: pk.rms_norm(x, s, eps=1e-6, interpret=False),
    ...                     jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16),
    ...                     jax.ShapeDtypeStruct((1024,), jnp.float32), target="h100")
    ...     assert [k.name for k in c.kernels] == ["rms_norm_fwd"]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import itertools
import math
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from pallas_kernels import _compat
from pallas_kernels.rms_norm import FWD_KERNELS

TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
TARGETS = ("h100", "a100")


# --------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
  """A GPU target description (the fields the models below use)."""

  name: str
  config: str  # GpuTargetConfigProto text
  description: str
  compute_capability: tuple[int, int]
  core_count: int
  fpus_per_core: int
  clock_rate_ghz: float
  memory_bandwidth: float  # bytes/s
  l2_cache_size: int
  shared_memory_per_block_optin: int  # bytes
  registers_per_block_limit: int
  threads_per_core_limit: int
  registers_per_core_limit: int
  shared_memory_per_core: int  # bytes

  @property
  def arch(self) -> str:
    """ptxas architecture XLA compiles for (``a`` features from sm_90 on)."""
    major, minor = self.compute_capability
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def _field(text: str, name: str, default: Optional[str] = None) -> str:
  m = re.search(rf"^\s*{name}:\s*\"?([^\"\n]+)\"?", text, re.M)
  if m is None:
    if default is None:
      raise ValueError(f"target config has no {name}")
    return default
  return m.group(1).strip()


@functools.cache
def target(name: str) -> Target:
  """The checked-in target ``name`` (``"h100"`` or ``"a100"``).

  Example:
      >>> target("a100").arch, target("h100").core_count
      ('sm_80', 132)
  """
  if name not in TARGETS:
    raise ValueError(f"unknown target {name!r}; expected one of {TARGETS}")
  with open(os.path.join(TARGETS_DIR, f"{name}.txtpb")) as f:
    text = f.read()
  cc = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text)
  cc_text = cc.group(1) if cc else ""
  major = int(_field(cc_text, "major", "0"))
  minor = int(_field(cc_text, "minor", "0"))
  return Target(
      name=name,
      config=text,
      description=_field(text, "device_description_str"),
      compute_capability=(major, minor),
      core_count=int(_field(text, "core_count")),
      fpus_per_core=int(_field(text, "fpus_per_core")),
      clock_rate_ghz=float(_field(text, "clock_rate_ghz")),
      memory_bandwidth=float(_field(text, "memory_bandwidth")),
      l2_cache_size=int(_field(text, "l2_cache_size")),
      shared_memory_per_block_optin=int(_field(text, "shared_memory_per_block_optin")),
      registers_per_block_limit=int(_field(text, "registers_per_block_limit")),
      threads_per_core_limit=int(_field(text, "threads_per_core_limit")),
      registers_per_core_limit=int(_field(text, "registers_per_core_limit")),
      shared_memory_per_core=int(_field(text, "shared_memory_per_core")),
  )


_lookup = target  # compile() has a parameter named `target`


@functools.cache
def _topology(name: str):
  return _compat.cuda_topology(target(name).config)


def unavailable_reason() -> Optional[str]:
  """Why CUDA cannot be compiled for here (plugin wheels missing...), or None.

  Example:
      >>> isinstance(unavailable_reason(), (str, type(None)))
      True
  """
  try:
    _topology("h100")
  except RuntimeError as e:
    return str(e)
  return None


def device(name: str = "h100") -> jax.Device:
  """The compile-only device of target ``name`` (raises RuntimeError if unavailable)."""
  return _topology(name).devices[0]


def on_target(tree: Any, name: str = "h100") -> Any:
  """Arrays/ShapeDtypeStructs -> ShapeDtypeStructs placed on the target's device.

  Example:
      >>> import jax.numpy as jnp
      >>> if unavailable_reason() is None:
      ...     s = on_target(jnp.ones((2, 3)), "a100")
      ...     assert s.shape == (2, 3) and s.sharding.device_set == {device("a100")}
  """
  sharding = jax.sharding.SingleDeviceSharding(device(name))
  return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


# --------------------------------------------------------------------------
# Optimized HLO
# --------------------------------------------------------------------------
_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)
          if dt in _DTYPE_BYTES]


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (tuples summed; token/opaque are 0).

  Example:
      >>> shape_bytes("(bf16[2,3]{1,0}, f32[4]{0})")
      28
  """
  return int(sum(_DTYPE_BYTES[dt] * math.prod(d) for dt, d in _arrays(shape)))


def _element_bytes(shape: str, element: Optional[int]) -> int:
  """Bytes of ``shape``, or of its tuple element ``element``."""
  if element is None:
    return shape_bytes(shape)
  arrays = _arrays(shape)
  if element >= len(arrays):
    return shape_bytes(shape)
  dt, dims = arrays[element]
  return int(_DTYPE_BYTES[dt] * math.prod(dims))


def _matching(s: str, i: int) -> int:
  """Index of the bracket closing the one at ``s[i]``."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack = [pairs[s[i]]]
  j = i + 1
  in_str = False
  while j < len(s):
    c = s[j]
    if in_str:
      if c == "\\":
        j += 1
      elif c == '"':
        in_str = False
    elif c == '"':
      in_str = True
    elif c in pairs:
      stack.append(pairs[c])
    elif c == stack[-1]:
      stack.pop()
      if not stack:
        return j
    j += 1
  return len(s) - 1


@dataclasses.dataclass
class Instr:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  attrs: str
  computation: str
  # Tuple element each operand reads (jax 0.11's HLO text writes "%t#1" for
  # get-tuple-element(%t), index=1); None = the whole value.
  elements: list = dataclasses.field(default_factory=list)
  args: str = ""  # the text between the opcode's parentheses (a parameter's number)


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")


def parse_hlo(text: str) -> tuple[dict[str, Instr], dict[str, list[str]], str]:
  """(instructions by name, instruction names per computation, entry name)."""
  instrs: dict[str, Instr] = {}
  comps: dict[str, list[str]] = {}
  entry, comp = "", None
  for line in text.splitlines():
    if comp is None:
      if line.endswith("{") and not line.startswith(" ") and not line.startswith("HloModule"):
        m = _COMP.match(line)
        if m:
          comp = m.group(1)
          comps[comp] = []
          if line.startswith("ENTRY"):
            entry = comp
      continue
    if line.startswith("}"):
      comp = None
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, rest = m.group(1), line[m.end():]
    if rest.startswith("("):
      end = _matching(rest, 0)
      shape, rest = rest[: end + 1], rest[end + 1:].lstrip()
    else:
      shape, _, rest = rest.partition(" ")
    op_m = re.match(r"([\w\-]+)\(", rest)
    if not op_m:
      continue
    opcode = op_m.group(1)
    close = _matching(rest, op_m.end() - 1)
    refs = re.findall(r"%([\w.\-]+)(?:#(\d+))?", rest[op_m.end(): close])
    operands = [r for r, _ in refs]
    instrs[name] = Instr(name, shape, opcode, operands, rest[close + 1:], comp,
                         [int(e) if e else None for _, e in refs], rest[op_m.end(): close])
    comps[comp].append(name)
  return instrs, comps, entry


def _called(ins: Instr) -> list[str]:
  out = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", ins.attrs)
  for group in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}", ins.attrs):
    out += re.findall(r"%([\w.\-]+)", group)
  return out


_PARTIAL_READS = ("gather", "dynamic-slice", "slice")  # ops that read part of their first operand


def _operand_read_bytes(ins: Instr, instrs: dict[str, Instr], comps: dict[str, list[str]]) -> int:
  """Bytes a launch reads from its operands: each operand once, except that an operand
  read only by gathers/slices/dynamic slices (an embedding table, the first rows of a
  position table) is charged for the elements they read (their results), not for the
  whole array."""
  elements = ins.elements or [None] * len(ins.operands)

  def full(o: str, i: Optional[int] = None) -> int:
    e = elements[i] if i is not None and i < len(elements) else None
    return _element_bytes(instrs[o].shape, e) if o in instrs else 0

  def partial_reads(users: list[Instr], param: str) -> Optional[int]:
    if users and all(u.opcode in _PARTIAL_READS and u.operands[:1] == [param] for u in users):
      return sum(shape_bytes(u.shape) for u in users)
    return None

  if ins.opcode in _PARTIAL_READS:
    got = partial_reads([ins], ins.operands[0]) if ins.operands else None
    return (min(got, full(ins.operands[0], 0)) if got is not None else full(ins.operands[0], 0)) + sum(
        full(o, i) for i, o in enumerate(ins.operands) if i)
  called = _called(ins) if ins.opcode == "fusion" else []
  body = comps.get(called[0], []) if called else []
  params = {instrs[n].args.strip(): n for n in body if instrs[n].opcode == "parameter"}
  total = 0
  for i, o in enumerate(ins.operands):
    p = params.get(str(i))
    got = None
    if p is not None:
      got = partial_reads([instrs[n] for n in body if p in instrs[n].operands], p)
    total += full(o, i) if got is None else min(got, full(o, i))
  return total


def _dims_attr(attrs: str, key: str) -> list[int]:
  m = re.search(rf"{key}=\{{([0-9,]*)\}}", attrs)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def _json_dims(attrs: str, key: str) -> list[int]:
  m = re.search(rf'"{key}":\[([^\]]*)\]', attrs)
  return [int(d) for d in re.findall(r"\d+", m.group(1))] if m else []


def _flops(ins: Instr, instrs: dict[str, Instr]) -> tuple[float, str]:
  """(flops, dtype of the lhs) of a dot/convolution/GEMM custom call, else (0, "")."""
  def lhs():
    a = _arrays(instrs[ins.operands[0]].shape) if ins.operands and ins.operands[0] in instrs else []
    return a[0] if a else ("", ())

  out = _arrays(ins.shape)
  if not out:
    return 0.0, ""
  out_elems = math.prod(out[0][1])
  if ins.opcode == "dot":
    dt, dims = lhs()
    k = math.prod(dims[i] for i in _dims_attr(ins.attrs, "lhs_contracting_dims"))
    return 2.0 * out_elems * k, dt
  if ins.opcode == "custom-call" and re.search(r'custom_call_target="__cublas\$(lt\$matmul|gemm)', ins.attrs):
    dt, dims = lhs()
    k = math.prod(dims[i] for i in _json_dims(ins.attrs, "lhs_contracting_dimensions"))
    return 2.0 * out_elems * k, dt
  if ins.opcode == "convolution" or (
          ins.opcode == "custom-call" and "__cudnn$conv" in ins.attrs):
    dt, _ = lhs()
    rhs = _arrays(instrs[ins.operands[1]].shape)[0][1] if len(ins.operands) > 1 else ()
    labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
    if not rhs or not labels or "o" not in labels.group(1):
      return 0.0, dt
    o = rhs[labels.group(1).index("o")]
    return 2.0 * out_elems * math.prod(rhs) / o, dt
  return 0.0, ""


# --------------------------------------------------------------------------
# Kernels of a compilation
# --------------------------------------------------------------------------
@dataclasses.dataclass
class Kernel:
  """One launch in XLA's thunk sequence."""

  name: str  # kernel name (PTX entry), e.g. "rms_norm_fwd", "loop_add_fusion"
  kind: str  # thunk kind, e.g. "kKernel", "kCustomKernel", "kGemm"
  instruction: str  # HLO instruction it runs
  grid: tuple[int, ...]
  threads: tuple[int, ...]
  shared_memory: int  # dynamic shared memory, bytes
  operand_bytes: int
  result_bytes: int
  flops: float
  flops_dtype: str  # lhs dtype of the dot/conv ("" if none)
  reductions: int  # reduce ops in its HLO (1 for a forward RMSNorm kernel)
  custom_call_target: str = ""  # e.g. "__gpu$xla.gpu.triton" for a Pallas Triton kernel

  @property
  def bytes(self) -> int:
    """Modelled HBM traffic: every operand read once (an operand read only by
    gathers/slices: the elements they read), every result written once (a
    cuBLAS/cuDNN workspace is not counted)."""
    return self.operand_bytes + self.result_bytes


# Thunks that launch nothing themselves (containers, synchronization, host work).
_NON_LAUNCH = ("kSequential", "kWhile", "kConditional", "kWaitForStreams", "kCommand", "kHostSend",
               "kHostRecv", "kCopyDone", "kSendDone", "kRecvDone", "kInfeed", "kOutfeed")
_THUNK = re.compile(r"^\s*(\d+):\s+(k\w+)\s+\[[^\]]*\]\s*(.*)$")


def _parse_thunks(seq: str, meta: str) -> list[tuple[int, str, str, str]]:
  """(id, kind, rest of line, profile annotation = HLO instruction) per thunk."""
  annot = {int(i): a for a, i in re.findall(r'profile_annotation:\s*"([^"]*)"\s*thunk_id:\s*(\d+)', meta)}
  out = []
  for line in seq.splitlines():
    m = _THUNK.match(line)
    if m:
      tid = int(m.group(1))
      out.append((tid, m.group(2), m.group(3), annot.get(tid, "")))
  return out


def _ints(text: str, key: str) -> tuple[int, ...]:
  m = re.search(rf"{key}:\s*\[([0-9,\s]*)\]", text)
  return tuple(int(d) for d in m.group(1).split(",") if d.strip()) if m else ()


def _scratch_bytes(shape: str, cc_target: str) -> int:
  """Bytes of a library call's scratch result (cuBLAS/cuDNN return their
  workspace as a trailing ``s8[n]`` tuple element): memory the call may use,
  not data it moves, so the traffic model leaves it out."""
  arrays = _arrays(shape)
  if not cc_target.startswith(("__cublas", "__cudnn")) or len(arrays) < 2:
    return 0
  dt, dims = arrays[-1]
  return int(math.prod(dims)) if dt in ("s8", "u8") and len(dims) == 1 else 0


@dataclasses.dataclass
class Compilation:
  """What XLA built for one target: optimized HLO, launches, PTX."""

  target: Target
  hlo: str
  kernels: list[Kernel]
  ptx: dict[str, str]  # kernel name -> PTX text
  dump_dir: str
  compiled: Any = dataclasses.field(repr=False, default=None)
  # ptxas -v that the Mosaic GPU compiler ran on its own PTX (kernel name -> info): its
  # PTX ISA can be newer than the nvcc wheel's ptxas accepts.
  mosaic_ptxas: dict = dataclasses.field(default_factory=dict)

  def launches(self, names: Optional[Sequence[str]] = None) -> int:
    """Number of launches (of kernels named in ``names``, if given)."""
    return sum(1 for k in self.kernels if names is None or k.name in names)

  @property
  def hbm_bytes(self) -> int:
    return sum(k.bytes for k in self.kernels)

  @property
  def flops(self) -> float:
    return sum(k.flops for k in self.kernels)

  def reductions(self) -> int:
    """Row reductions executed: ``reduce`` ops inside the launched kernels,
    plus one per forward RMSNorm kernel (its sum of squares is inside the
    opaque Triton kernel)."""
    return sum(k.reductions for k in self.kernels)

  def ptxas(self, kernel: str) -> "PtxasInfo":
    """ptxas -v of ``kernel``'s PTX for this target (raises if ptxas is missing)."""
    if kernel in self.mosaic_ptxas:
      return self.mosaic_ptxas[kernel]
    infos = ptxas_info(self.ptx[kernel], self.target.arch)
    # A Mosaic GPU kernel's PTX entry is "<name>_mosaic_gpu_kernel".
    return next(i for i in infos if i.name in (kernel, kernel + MOSAIC_ENTRY_SUFFIX))


def compile(fn: Callable[..., Any], *args: Any, target: str = "h100",  # noqa: A001 - mirrors jax's .compile
            dump_dir: Optional[str] = None, keep_dump: bool = False,
            compiler_options: Optional[dict[str, Any]] = None,
            jit_kwargs: Optional[dict[str, Any]] = None) -> Compilation:
  """``jax.jit(fn).lower(*args).compile()`` for ``target``, with XLA's dump read back.

  ``args`` are arrays or ShapeDtypeStructs (pytrees); they are re-placed on
  the target's compile-only device. ``dump_dir`` (default: a temporary
  directory, removed unless ``keep_dump``) receives XLA's dump;
  ``compiler_options`` are extra XLA debug options; ``jit_kwargs`` go to
  ``jax.jit`` (e.g. ``donate_argnums``).
  """
  t = _lookup(target)
  placed = on_target(args, target)
  tmp = dump_dir or tempfile.mkdtemp(prefix=f"aot_{target}_")
  try:
    with _mosaic_dump(os.path.join(tmp, "mosaic")):
      # The kernels' Triton lowering targets this GPU too (jax 0.11 reads it
      # from the abstract mesh; the compile-only device is not the default one).
      with _compat.gpu_target(t.description):
        lowered = jax.jit(fn, **(jit_kwargs or {})).lower(*placed)
      compiled = lowered.compile(
          compiler_options={**_compat.dump_options(), **(compiler_options or {}), "xla_dump_to": tmp})
    return _read_dump(t, tmp, compiled)
  finally:
    if dump_dir is None and not keep_dump:
      shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------
# Mosaic GPU kernels
# --------------------------------------------------------------------------
# A Mosaic GPU kernel is an XLA custom call holding an MLIR module; the CUDA
# plugin turns it into PTX and a cubin while XLA compiles (deviceless too: the
# module's arch is fixed at lowering, sm_90a when no GPU is attached) and
# writes PTX, ptxas -v and its MLIR passes to MOSAIC_GPU_DUMP_TO. The launch
# (grid, 128-thread warpgroups, dynamic SMEM) is the host-side gpu.launch there.
MOSAIC_CUSTOM_CALL_TARGET = "mosaic_gpu_v2"
MOSAIC_ENTRY_SUFFIX = "_mosaic_gpu_kernel"
_MOSAIC_SEEN: dict = {}  # kernel_hash (as printed in HLO) -> (PTX, gpu.launch line, ptxas info)
_MOSAIC_ENV = ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_MLIR_PASSES")


@contextlib.contextmanager
def _mosaic_dump(d: str):
  os.makedirs(d, exist_ok=True)
  prev = {k: os.environ.get(k) for k in _MOSAIC_ENV}
  os.environ.update({"MOSAIC_GPU_DUMP_TO": d, "MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1",
                     "MOSAIC_GPU_DUMP_MLIR_PASSES": "1"})
  try:
    yield
  finally:
    for k, v in prev.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


_LAUNCH = re.compile(r"gpu\.launch .*?blocks\(.*?\) in \(%\w+ = %c(\d+)\w*, %\w+ = %c(\d+)\w*, %\w+ = %c(\d+)\w*\)"
                     r" threads\(.*?\) in \(%\w+ = %c(\d+)\w*, %\w+ = %c(\d+)\w*, %\w+ = %c(\d+)\w*\)"
                     r"(?: dynamic_shared_memory_size %c(\d+)_i32)?")


def _mosaic_dumps(d: str, arch: str) -> dict[str, list[tuple[str, str, Optional["PtxasInfo"]]]]:
  """kernel name -> [(PTX, first gpu.launch line, ptxas info)] in compilation order."""
  out: dict[str, list[tuple]] = {}
  for path in glob.glob(os.path.join(d, "mosaic", "*.ptx")):
    base = os.path.basename(path)[: -len(".ptx")]
    name, _, n = base.rpartition("_")
    with open(path) as f:
      ptx = f.read()
    info = None
    if os.path.exists(path + "as"):
      with open(path + "as") as f:
        infos = _parse_ptxas(f.read(), arch)
      info = next((i for i in infos if i.name == name + MOSAIC_ENTRY_SUFFIX), None)
    launch = ""
    log = os.path.join(d, "mosaic", base + ".mlir-passes.log")
    if os.path.exists(log):
      with open(log) as f:
        for line in f:
          if "gpu.launch " in line and _LAUNCH.search(line):
            launch = line
            break
    out.setdefault(name, []).append((int(n) if n.isdigit() else 0, ptx, launch, info))
  return {k: [e[1:] for e in sorted(v, key=lambda e: e[0])] for k, v in out.items()}


def _read_dump(t: Target, d: str, compiled: Any) -> Compilation:
  def newest(pattern: str) -> str:
    files = sorted(glob.glob(os.path.join(d, pattern)), key=os.path.getmtime)
    if not files:
      raise RuntimeError(f"XLA dump in {d} has no {pattern}")
    with open(files[-1]) as f:
      return f.read()

  hlo = newest("*gpu_after_optimizations.txt")
  seq = newest("*thunk_sequence.txt")
  meta = newest("*thunk_metadata.txt")
  instrs, comps, _ = parse_hlo(hlo)

  def flops_of(name: str, seen: set) -> tuple[float, str, int]:
    """(flops, dot dtype, reduce ops) of an instruction and what it calls."""
    ins = instrs.get(name)
    if ins is None:
      return 0.0, "", 0
    total, dtype = _flops(ins, instrs)
    reduces = int(ins.opcode == "reduce")
    for comp in _called(ins):
      if comp in seen or ins.opcode == "reduce":  # a reduce's to_apply is its combiner
        continue
      seen.add(comp)
      for sub in comps.get(comp, []):
        f, dt, r = flops_of(sub, seen)
        total, dtype, reduces = total + f, dtype or dt, reduces + r
    return total, dtype, reduces

  mosaic = _mosaic_dumps(d, t.arch)
  kernels, ptx, mosaic_ptxas = [], {}, {}
  for _, kind, rest, annot in _parse_thunks(seq, meta):
    if kind in _NON_LAUNCH:
      continue
    ins = instrs.get(annot)
    name = rest.split()[0] if rest.split() and not rest.startswith(("grid", "{")) else annot
    operand_bytes = result_bytes = reduces = 0
    flops, fdt, cc_target = 0.0, "", ""
    if ins is not None:
      if ins.opcode == "custom-call":
        m = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
        cc_target = m.group(1) if m else ""
      operand_bytes = _operand_read_bytes(ins, instrs, comps)
      result_bytes = shape_bytes(ins.shape) - _scratch_bytes(ins.shape, cc_target)
      flops, fdt, reduces = flops_of(annot, set())
    if name in FWD_KERNELS:
      reduces = 1
    sm = re.search(r"shared_memory:\s*(\d+)", rest)
    grid, threads, smem = _ints(rest, "grid"), _ints(rest, "threads"), int(sm.group(1)) if sm else 0
    if cc_target == MOSAIC_CUSTOM_CALL_TARGET:
      # plgpu.kernel's name is the scope just above its mpmd_map/pallas_call.
      m = re.search(r'op_name="[^"]*?([\w.\-]+)/(?:mpmd_map|pallas_call)[^/"]*"', ins.attrs)
      name = m.group(1) if m else name
      # The plugin compiles a module once per process (keyed by its hash) and
      # dumps only then; later compilations reuse what the first one read.
      hm = re.search(r'kernel_hash\s*=\s*"((?:[^"\\]|\\.)*)"', ins.attrs)
      key = hm.group(1) if hm else None
      if mosaic.get(name):
        _MOSAIC_SEEN[key] = mosaic[name].pop(0)
      if key in _MOSAIC_SEEN:
        text, launch, info = _MOSAIC_SEEN[key]
        ptx[name] = text
        if info is not None:
          mosaic_ptxas[name] = info
        lm = _LAUNCH.search(launch)
        if lm:
          grid = tuple(int(v) for v in lm.groups()[:3])
          threads = tuple(int(v) for v in lm.groups()[3:6])
          smem = int(lm.group(7) or 0)
      if name in FWD_KERNELS:
        reduces = 1
    kernels.append(Kernel(name, kind, annot, grid, threads, smem, operand_bytes, result_bytes, flops, fdt,
                          reduces, cc_target))
  for path in glob.glob(os.path.join(d, "*.ptx")):
    with open(path) as f:
      text = f.read()
    for entry in re.findall(r"\.entry\s+([\w$.]+)\s*\(", text):
      ptx[entry] = text
  return Compilation(t, hlo, kernels, ptx, d, compiled, mosaic_ptxas)


# --------------------------------------------------------------------------
# ptxas
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PtxasInfo:
  name: str
  arch: str
  registers: int
  spill_stores: int  # bytes
  spill_loads: int  # bytes
  stack_frame: int  # bytes
  shared_memory: int  # static smem, bytes


def ptxas_path() -> Optional[str]:
  """The ptxas of the ``nvidia-cuda-nvcc-cu12`` wheel (else on PATH), or None."""
  try:
    import nvidia.cuda_nvcc as nvcc  # the wheel's namespace package

    for root in list(getattr(nvcc, "__path__", [])):
      p = os.path.join(root, "bin", "ptxas")
      if os.access(p, os.X_OK):
        return p
  except ImportError:
    pass
  return shutil.which("ptxas")


def ptxas_info(ptx: str, arch: str) -> list[PtxasInfo]:
  """Registers/spills per entry of ``ptx`` from ``ptxas -arch=<arch> -v``."""
  exe = ptxas_path()
  if exe is None:
    raise RuntimeError("ptxas not found: pip install nvidia-cuda-nvcc-cu12 (the gpu-aot extra)")
  with tempfile.TemporaryDirectory() as d:
    src = os.path.join(d, "k.ptx")
    with open(src, "w") as f:
      f.write(ptx)
    r = subprocess.run([exe, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                       capture_output=True, text=True, timeout=300)
  if r.returncode != 0:
    raise RuntimeError(f"ptxas failed ({r.returncode}): {r.stderr[-2000:]}")
  return _parse_ptxas(r.stderr, arch)


def _parse_ptxas(text: str, arch: str) -> list[PtxasInfo]:
  out, cur = [], None
  for line in text.splitlines():
    m = re.search(r"Compiling entry function '([^']+)'", line)
    if m:
      cur = dict(name=m.group(1), registers=0, spill_stores=0, spill_loads=0, stack_frame=0, shared_memory=0)
      out.append(cur)
      continue
    if cur is None:
      continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m:
      cur.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
    m = re.search(r"Used (\d+) registers", line)
    if m:
      cur["registers"] = int(m.group(1))
    m = re.search(r"(\d+) bytes smem", line)
    if m:
      cur["shared_memory"] = int(m.group(1))
  return [PtxasInfo(arch=arch, **c) for c in out]


def abstract(tree: Any) -> Any:
  """Arrays -> ShapeDtypeStructs (no sharding); ShapeDtypeStructs pass through."""
  return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


# --------------------------------------------------------------------------
# Triton vs Mosaic GPU
# --------------------------------------------------------------------------
COMPARE_SHAPES = ((4096, 768), (16384, 4096), (8, 768))


def _norm_program(variant: str, grad: bool, backend: str):
  import pallas_kernels as pk

  def norm(x, r, s, b):
    if variant == "rms_norm":
      return pk.rms_norm(x, s, b, eps=1e-6, interpret=False, backend=backend)
    return pk.fused_add_rms_norm(x, r, s, b, eps=1e-6, interpret=False, backend=backend)

  def f(x, r, s, b, dy, dh):
    if not grad:
      return norm(x, r, s, b)
    out, vjp = jax.vjp(norm, x, r, s, b)
    return out, vjp(dy if variant == "rms_norm" else (dy, dh))

  return f


def compare_backends(shapes: Sequence[tuple[int, int]] = COMPARE_SHAPES, dtype: str = "bfloat16",
                     target: str = "h100", backends: Sequence[str] = ("triton", "mosaic_gpu")) -> list[dict]:
  """Per shape x variant x pass x backend: launches, the norm kernels' launch/registers/
  shared memory/spills and the compilation's modelled bytes and time at peak bandwidth.

  ``pass`` "fwd" is the primal alone; "fwd+bwd" is the forward as differentiated plus
  the backward (and XLA's reductions of the partial dscale/dbias rows, and any copies).
  """
  t = _lookup(target)
  rows = []
  for (n, h), variant, grad, backend in itertools.product(
          shapes, ("rms_norm", "fused_add_rms_norm"), (False, True), backends):
    a = jax.ShapeDtypeStruct((n, h), np.dtype(jnp_dtype(dtype)))
    v = jax.ShapeDtypeStruct((h,), np.float32)
    row = {"shape": f"{n}x{h}", "dtype": dtype, "variant": variant, "pass": "fwd+bwd" if grad else "fwd",
           "backend": backend}
    try:
      c = compile(_norm_program(variant, grad, backend), a, a, v, v, a, a, target=target)
    except Exception as e:  # noqa: BLE001 - reported in the table (e.g. Triton on jax 0.11 without a GPU)
      rows.append({**row, "launches": "-", "norm kernels": f"compile failed: {type(e).__name__}: "
                   f"{str(e).splitlines()[0][:160]}", "MB": "-", "us @ peak BW": "-"})
      continue
    names = [k for k in c.kernels if k.name.startswith(variant + "_")]
    kinfo = []
    for k in names:
      info = c.ptxas(k.name) if (k.name in c.mosaic_ptxas or ptxas_path()) else None
      regs = f"{info.registers}" if info else "n/a"
      spill = f"{info.spill_stores}/{info.spill_loads}" if info else "n/a"
      kinfo.append(f"{k.name.rsplit('_', 1)[1]}: {k.grid[0] if k.grid else '?'}x"
                   f"{math.prod(k.threads) if k.threads else '?'} thr, {regs} regs, "
                   f"{k.shared_memory} B smem, spill {spill}")
    rows.append({**row, "launches": c.launches(),
                 "norm kernels": "; ".join(kinfo), "MB": f"{c.hbm_bytes / 1e6:.2f}",
                 "us @ peak BW": f"{c.hbm_bytes / t.memory_bandwidth * 1e6:.1f}"})
  return rows


def jnp_dtype(name: str):
  import jax.numpy as jnp

  return jnp.dtype(name)


def markdown(rows: list[dict]) -> str:
  cols = list(rows[0]) if rows else []
  out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
  out += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
  return "\n".join(out)


__all__ = ["TARGETS", "Target", "target", "unavailable_reason", "device", "on_target", "compile",
           "Compilation", "Kernel", "PtxasInfo", "ptxas_path", "ptxas_info", "parse_hlo", "shape_bytes",
           "abstract", "compare_backends", "markdown", "COMPARE_SHAPES", "MOSAIC_CUSTOM_CALL_TARGET"]


if __name__ == "__main__":  # python -m pallas_kernels.aot [ROWSxHIDDEN ...]: Triton vs Mosaic GPU table
  import sys

  shapes = [tuple(int(v) for v in a.split("x")) for a in sys.argv[1:]] or COMPARE_SHAPES
  print(markdown(compare_backends(shapes)))
