"""Every difference between the JAX versions we support lives here.

jax 0.10 (CI, Python 3.11) and jax 0.11 (GPU machines, Python 3.12) differ in
how closed jaxprs are represented (0.11 merged ``Jaxpr`` and ``ClosedJaxpr``),
in the scan parameters (``num_consts``/``num_carry`` became ``ft_in``) and in
where ``Var``/``Literal`` live. Primitives are discovered by tracing tiny
programs (or looked up where each version defines them, ``lax_prims``), so
we compare them by identity and never by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import sysconfig
import threading
from typing import Any, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

try:  # jax >= 0.4.30
  from jax.extend import core as _jcore
except ImportError:  # pragma: no cover
  from jax import core as _jcore  # type: ignore

Var = _jcore.Var
Literal = _jcore.Literal


def open_jaxpr(j: Any) -> tuple[Any, list[Any]]:
  """Returns ``(jaxpr, consts)`` for a Jaxpr, ClosedJaxpr or merged 0.11 Jaxpr."""
  inner = getattr(j, "jaxpr", j)
  consts = list(getattr(j, "consts", ()) or ())
  if inner is j:  # 0.11 merged form: consts live on the jaxpr itself.
    return j, consts
  return inner, consts


def constvars(jaxpr: Any) -> list[Any]:
  return list(getattr(jaxpr, "constvars", ()) or ())


def is_var(a: Any) -> bool:
  return isinstance(a, Var) and not isinstance(a, Literal)


def is_literal(a: Any) -> bool:
  return isinstance(a, Literal)


def literal_value(a: Any) -> Any:
  return a.val


def per_dtype(fn):
  """``fn(dtype)`` remembered per dtype: the analysis asks such questions of every
  operand of every equation, and jax's dtype tests are slow. An unhashable
  dtype-like is asked every time."""
  memo: dict = {}

  @functools.wraps(fn)
  def call(dtype):
    try:
      return memo[dtype]
    except KeyError:
      r = memo[dtype] = fn(dtype)
      return r
    except TypeError:
      return fn(dtype)
  return call


@per_dtype
def is_inexact(dtype: Any) -> bool:
  """``jnp.issubdtype(dtype, jnp.inexact)``, remembered (asked at every step)."""
  return bool(jnp.issubdtype(dtype, jnp.inexact))


@per_dtype
def is_floating(dtype: Any) -> bool:
  """``jnp.issubdtype(dtype, jnp.floating)``, remembered."""
  return bool(jnp.issubdtype(dtype, jnp.floating))


@per_dtype
def precision(dtype: Any) -> tuple:
  """``(finfo.nmant, finfo.nexp)`` of a float dtype, remembered."""
  info = jnp.finfo(dtype)
  return int(info.nmant), int(info.nexp)


def x64_enabled() -> bool:
  """Whether jax computes in float64 here (the flag, or an ``enable_x64`` context)."""
  return jax.dtypes.canonicalize_dtype(np.float64) == np.float64


@per_dtype
def is_prng_key(dtype: Any) -> bool:
  """Whether ``dtype`` is a typed PRNG key's."""
  try:
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
  except Exception:  # pragma: no cover
    return False


def key_impl_name(x: Any) -> str:
  """The PRNG implementation name (``"threefry2x32"``, ``"rbg"``, ...) of a typed
  key array, ``ShapeDtypeStruct`` or key dtype."""
  if isinstance(x, jax.Array):
    return str(jax.random.key_impl(x))   # a str on 0.10, a PRNGSpec (str() = name) before
  dtype = getattr(x, "dtype", x)
  impl = getattr(dtype, "_impl", None)   # abstract keys: no public accessor on 0.10/0.11
  name = getattr(impl, "name", None)
  if name is not None:
    return str(name)
  for name in ("threefry2x32", "rbg", "unsafe_rbg"):
    if key_dtype(name) == dtype:
      return name
  raise TypeError(f"cannot name the PRNG implementation of {dtype}")


@functools.lru_cache(maxsize=None)
def key_dtype(impl: str) -> Any:
  """The typed key dtype of the PRNG implementation named ``impl``."""
  return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


_KEY_PREFIX = "prng_key:"


def dtype_name(dtype: Any) -> str:
  """A JSON-able name of ``dtype``; typed PRNG keys (no numpy name) as ``prng_key:IMPL``."""
  if is_prng_key(dtype):
    return _KEY_PREFIX + key_impl_name(dtype)
  return jnp.dtype(dtype).name


def dtype_from_name(name: str) -> Any:
  """Inverse of :func:`dtype_name`."""
  if name.startswith(_KEY_PREFIX):
    return key_dtype(name[len(_KEY_PREFIX):])
  return jnp.dtype(name)


def aval(a: Any) -> Any:
  return a.aval


def source_summary(eqn: Any) -> str:
  try:
    from jax._src import source_info_util as siu
    return siu.summarize(eqn.source_info)
  except Exception:  # pragma: no cover - best effort only
    return "<unknown>"


# Library code, never "the user's line": any file installed in site-packages,
# dist-packages, the standard library or the scripts directory (flax, haliax,
# keras, EasyDeL, transformers, ... wherever pip put them; ``_installed_dirs``),
# and these packages wherever they are (jaxfold itself; editable installs of
# the frameworks jaxfold knows). A user's own package installed into
# site-packages (not ``pip install -e``) is installed code too: jaxfold cannot
# tell it from a framework by location (nor by the traceback, which starts at
# the traced function), and naming a framework's line is the error to avoid,
# so its sites are named by module or parameter path, else by what they are
# (the report's ``Site.source`` is then empty). An editable install stays the
# user's code.
_LIBRARIES = ("flax", "optax", "chex", "numpy", "jaxfold", "pallas_kernels", "transformers",
              "orbax", "einops", "equinox", "haiku")


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple:
  import importlib.util
  dirs = []
  for name in _LIBRARIES:
    try:
      spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
      continue
    for d in (spec.submodule_search_locations or []) if spec else []:
      dirs.append(os.path.join(os.path.realpath(d), ""))
  return tuple(dirs)


def made_in_package(eqn: Any, package: str) -> bool:
  """Whether a frame of the code that made ``eqn`` lies in the installed
  ``package`` (e.g. "keras"): a hint names a framework's setting only then."""
  try:
    import importlib.util
    spec = importlib.util.find_spec(package)
    dirs = tuple(os.path.join(os.path.realpath(d), "") for d in (spec.submodule_search_locations or []))
    if not dirs:
      return False
    return any(os.path.realpath(f.file_name).startswith(dirs) for f in eqn.source_info.traceback.frames)
  except Exception:  # noqa: BLE001 - best effort only: no hint
    return False


@functools.lru_cache(maxsize=1)
def _installed_dirs() -> tuple:
  """Where installed code lives: site-packages and dist-packages (also of
  virtual environments on ``sys.path``), the standard library, the scripts
  directory (console-script wrappers)."""
  import site
  import sys
  import sysconfig
  dirs = set()
  try:
    dirs.update(site.getsitepackages())
    dirs.add(site.getusersitepackages())
  except Exception:  # noqa: BLE001 - some embedded interpreters lack them
    pass
  paths = sysconfig.get_paths()
  dirs.update(paths.get(k) for k in ("purelib", "platlib", "stdlib", "platstdlib", "scripts"))
  dirs.update(p for p in sys.path if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages"))
  return tuple(sorted({os.path.join(os.path.realpath(d), "") for d in dirs if d}, key=len, reverse=True))


@functools.lru_cache(maxsize=4096)
def _is_library_file(path: str) -> bool:
  real = os.path.realpath(path)
  return real.startswith(_library_dirs()) or real.startswith(_installed_dirs())


def _short_path(path: str) -> str:
  try:
    rel = os.path.relpath(path)
  except ValueError:  # another drive (Windows)
    rel = path
  if not rel.startswith(".."):
    return rel
  parts = path.replace(os.sep, "/").split("/")
  return "/".join(parts[-2:])


def user_frames(eqn: Any) -> list[str]:
  """``file.py:line (function)`` of every frame outside jax and the libraries
  above (so never a line of flax's LayerNorm), innermost first."""
  try:
    return [_frame_text(f) for f in _user_frames(eqn)]
  except Exception:  # pragma: no cover - best effort only
    return []


def _user_frames(eqn: Any):
  from jax._src import source_info_util as siu
  return (f for f in siu.user_frames(eqn.source_info.traceback) if not _is_library_file(f.file_name))


def _frame_text(f: Any) -> str:
  return f"{_short_path(f.file_name)}:{f.start_line} ({f.function_name})"


def user_source(eqn: Any) -> str:
  """The innermost of ``user_frames``; "" without one (the others' paths,
  costly to shorten, are not computed: every inlined call asks)."""
  try:
    f = next(_user_frames(eqn), None)
    return _frame_text(f) if f is not None else ""
  except Exception:  # pragma: no cover - best effort only
    return ""


def name_stack(eqn: Any) -> str:
  try:
    return str(eqn.source_info.name_stack)
  except Exception:  # pragma: no cover
    return ""


def bind_eqn(eqn: Any, invals: Sequence[Any]) -> list[Any]:
  """Evaluates one equation as ``jax.core.eval_jaxpr`` does."""
  bp = eqn.primitive.get_bind_params(eqn.params)
  subfuns, params = bp if isinstance(bp, tuple) else ((), bp)  # jax < 0.10 returned a pair
  try:
    from jax._src import source_info_util as siu
    ctx = siu.user_context(eqn.source_info.traceback,
                           name_stack=siu.current_name_stack() + eqn.source_info.name_stack)
  except Exception:  # pragma: no cover
    import contextlib
    ctx = contextlib.nullcontext()
  with ctx, eqn.ctx.manager:
    out = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def scan_partition(params: dict) -> tuple[int, int]:
  """``(num_consts, num_carry)`` of a scan equation, on either JAX version."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  ft_in = params["ft_in"]  # jax 0.11: a FlatTree of (consts, carry, xs)
  if hasattr(ft_in, "unpack"):
    consts, carry = ft_in.unpack()[:2]
    return len(consts), len(carry)
  count = lambda t: len(jax.tree_util.tree_leaves(t, is_leaf=lambda v: v is None))
  return count(ft_in[0]), count(ft_in[1])


def scan_length(params: dict) -> Optional[int]:
  """A scan's static trip count, or None where it is not a concrete int
  (a symbolic dimension under shape polymorphism)."""
  n = params.get("length")
  try:
    return int(n) if n is not None and n == int(n) else None
  except Exception:  # noqa: BLE001 - a symbolic dimension has no int value
    return None


def while_partition(params: dict) -> tuple[int, int]:
  """``(cond_nconsts, body_nconsts)`` of a while equation (unchanged in 0.11)."""
  return params["cond_nconsts"], params["body_nconsts"]


def _private_modules() -> tuple:
  mods = []
  try:  # add_any (the sum AD produces) is not exported under one public name
    from jax._src import ad_util
    mods.append(ad_util)
  except ImportError:  # pragma: no cover
    pass
  try:  # the loop primitives live in lax's private control-flow module
    from jax._src.lax import control_flow
    mods.append(control_flow)
  except ImportError:  # pragma: no cover
    pass
  return tuple(mods)


def lax_prims(*names: str) -> tuple:
  """The primitives named ``names`` (e.g. ``"add_p"``) that this jax defines,
  from ``jax.lax`` or, failing that, the private modules that hold the rest."""
  out = []
  for n in names:
    p = getattr(lax, n, None)
    for mod in _private_modules():
      if p is None:
        p = getattr(mod, n, None)
    if p is not None and p not in out:
      out.append(p)
  return tuple(out)


def _discover() -> dict[str, Any]:
  """Finds the primitive objects of higher-order constructs by tracing them."""
  x = jax.ShapeDtypeStruct((2,), jnp.float32)  # abstract: discovery compiles nothing

  def first_prim(fn, *args):
    # The construct is the one equation that carries a sub-jaxpr.
    eqns = jax.make_jaxpr(fn)(*args).eqns
    for e in eqns:
      if any(k in e.params for k in ("jaxpr", "call_jaxpr", "fun_jaxpr", "branches",
                                     "body_jaxpr")):
        return e.primitive
    return eqns[0].primitive

  @jax.custom_jvp
  def cj(y):
    return y
  cj.defjvp(lambda p, t: (p[0], t[0]))

  @jax.custom_vjp
  def cv(y):
    return y
  cv.defvjp(lambda y: (y, None), lambda _, g: (g,))

  prims = {
      "jit": first_prim(jax.jit(lambda y: y + 1), x),
      "remat": first_prim(jax.checkpoint(lambda y: y + 1), x),
      "custom_jvp": first_prim(cj, x),
      "custom_vjp": first_prim(cv, x),
      "scan": first_prim(lambda y: lax.scan(lambda c, _: (c, None), y, None, length=2)[0], x),
      "cond": first_prim(lambda y: lax.cond(y[0] > 0, lambda z: z, lambda z: -z, y), x),
      "while": first_prim(lambda y: lax.while_loop(lambda c: c[0] < 0, lambda c: c, y), x),
  }
  return prims


@functools.cache
def prims() -> dict[str, Any]:
  return _discover()


def call_jaxpr_of(eqn: Any) -> Any | None:
  """The body of a call-like equation (jit, remat, custom_jvp/vjp), or None."""
  p = prims()
  prim = eqn.primitive
  if prim is p["jit"] or prim is p["remat"]:
    return eqn.params["jaxpr"]
  if prim is p["custom_jvp"]:
    return eqn.params["call_jaxpr"]
  if prim is p["custom_vjp"]:
    return eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
  name = prim.name
  if name in ("closed_call", "core_call"):
    return eqn.params.get("call_jaxpr")
  return None


def squared_operand(eqn: Any) -> Any | None:
  """The operand an equation squares (``x**2``, ``square(x)``, ``x*x``), or None:
  how the RMS norms the fold leaves spell their sum of squares (rotate's PCA)."""
  name, ins = eqn.primitive.name, eqn.invars
  if name == "square" or (name == "integer_pow" and eqn.params.get("y") == 2):
    return ins[0]
  if name == "mul" and ins[0] is ins[1]:
    return ins[0]
  return None


def call_prims() -> tuple:
  """The primitives ``call_jaxpr_of`` recognises: jit, remat, custom_jvp/vjp
  and, where this jax defines them, ``closed_call``/``core_call``."""
  p = prims()
  out = [p["jit"], p["remat"], p["custom_jvp"], p["custom_vjp"]]
  try:
    from jax._src import core as _core
  except ImportError:  # pragma: no cover
    _core = None
  for name in ("closed_call_p", "core_call_p"):
    q = getattr(_core, name, None)
    if q is not None and q not in out:
      out.append(q)
  return tuple(out)


def call_kind(eqn: Any) -> str:
  """``"jit" | "remat" | "custom_jvp" | "custom_vjp" | "call"`` of a call-like equation."""
  p = prims()
  for kind in ("jit", "remat", "custom_jvp", "custom_vjp"):
    if eqn.primitive is p[kind]:
      return kind
  return "call"


def call_name(eqn: Any) -> str:
  """The called function's name, best effort (jit records it; custom rules their fun)."""
  params = eqn.params
  name = params.get("name")
  if name:
    return str(name)
  for k in ("call_jaxpr", "fun_jaxpr", "jaxpr"):
    j = params.get(k)
    dbg = getattr(getattr(j, "jaxpr", j), "debug_info", None)
    fn = getattr(dbg, "func_name", None) or getattr(dbg, "func_src_info", None)
    if fn:
      return str(fn).split(" ")[0]
  return eqn.primitive.name


def is_remat(eqn: Any) -> bool:
  return eqn.primitive is prims()["remat"]


def is_scan(eqn: Any) -> bool:
  return eqn.primitive is prims()["scan"]


def is_cond(eqn: Any) -> bool:
  return eqn.primitive is prims()["cond"]


def is_while(eqn: Any) -> bool:
  return eqn.primitive is prims()["while"]


# ----------------------------------------------------------------------------
# shard_map: the primitive lives in jax._src.shard_map (jax >= 0.6; before, in
# jax.experimental.shard_map, with ``in_names``/``check_rep`` params, which we
# do not model: there the equation stays opaque).


def _prims_in(modules: tuple, names: tuple) -> tuple:
  """The distinct primitives called ``names`` in those of ``modules`` that this
  jax has, in that order (modules and primitives move between versions)."""
  import importlib
  out = []
  for mod in modules:
    try:
      m = importlib.import_module(mod)
    except ImportError:  # pragma: no cover - another layout
      continue
    for name in names:
      p = getattr(m, name, None)
      if p is not None and p not in out:
        out.append(p)
  return tuple(out)


@functools.lru_cache(maxsize=1)
def shard_map_prims() -> tuple:
  """The shard_map primitive where this jax defines one."""
  return _prims_in(("jax._src.shard_map", "jax.experimental.shard_map"), ("shard_map_p",))[:1]


def vary_prims() -> tuple:
  """``pvary`` (and ``pcast`` where defined): inside a shard_map with the
  replication check, marks a value as varying across mesh axes; the identity
  on values (jax._src.core in jax 0.10)."""
  return _prims_in(("jax._src.core", "jax._src.lax.parallel"), ("pvary_p", "pcast_p"))


def checkpoint_name_prims() -> tuple:
  """``name`` (``jax.ad_checkpoint.checkpoint_name``): tags a value for a remat policy
  (``save_only_these_names``, MaxText's ``checkpoint_name(x, "mlpwo")``); the identity on
  values and derivatives (jax._src.ad_checkpoint in jax 0.10)."""
  return _prims_in(("jax._src.ad_checkpoint",), ("name_p",))


def psum_prims() -> tuple:
  """The cross-shard sums: ``psum`` and, under shard_map's replication check
  (jax 0.10), ``psum_invariant``."""
  return _prims_in(("jax._src.lax.parallel",), ("psum_p", "psum_invariant_p"))


def shard_map_body(params: dict) -> Any:
  """The per-shard body of a shard_map equation, or None where its params
  are not the ones :func:`shard_map_rebind` rebuilds (then it stays opaque)."""
  if not {"jaxpr", "mesh", "in_specs", "out_specs"} <= set(params) or not hasattr(jax, "shard_map"):
    return None
  return params["jaxpr"]


def shard_map_axis_sizes(params: dict) -> dict:
  """``{mesh axis name: size}`` of a shard_map equation's manual axes (the ones
  its body's collectives name)."""
  mesh = params["mesh"]
  manual = params.get("newly_manual_axes")
  names = tuple(mesh.axis_names) if manual is None else tuple(n for n in mesh.axis_names if n in manual)
  return {n: int(mesh.shape[n]) for n in names}


def shard_map_operand_axes(params: dict, i: int, ndim: int) -> tuple:
  """Per dim of a shard_map's operand ``i``: the frozenset of mesh axes that
  split it (its ``in_specs`` entry; an axis named nowhere leaves it whole)."""
  spec = tuple(params["in_specs"][i])
  out = []
  for d in range(ndim):
    e = spec[d] if d < len(spec) else None
    if e is None:
      out.append(frozenset())
    elif isinstance(e, (tuple, list)):
      out.append(frozenset(e))
    else:
      out.append(frozenset((e,)))
  return tuple(out)


def psum_axes(params: dict) -> Optional[tuple]:
  """The named mesh axes a ``psum`` sums over, or None where it sums over
  groups of devices or positional axes (not modelled)."""
  if params.get("axis_index_groups") is not None:
    return None
  axes = params.get("axes")
  axes = axes if isinstance(axes, (tuple, list)) else (axes,)
  return tuple(axes) if axes and all(isinstance(a, str) for a in axes) else None


def shard_map_rebind(params: dict, body: Any, invals: Sequence[Any]) -> list[Any]:
  """``jax.shard_map(body, ...)(*invals)`` with the equation's mesh, specs,
  manual axes and replication check; ``body(*local values) -> list``."""
  mesh = params["mesh"]
  kw = dict(mesh=mesh, in_specs=tuple(params["in_specs"]), out_specs=tuple(params["out_specs"]))
  if "check_vma" in params:
    kw["check_vma"] = params["check_vma"]
  manual = params.get("newly_manual_axes")
  if manual is not None and set(manual) != set(mesh.axis_names):
    kw["axis_names"] = set(manual)
  return list(jax.shard_map(lambda *a: tuple(body(*a)), **kw)(*invals))


def reduce_precision_p() -> Any:
  return getattr(lax, "reduce_precision_p", None)


P = lax  # primitives such as lax.add_p are public in every supported version.


# ----------------------------------------------------------------------------
# Python comparisons of jax.export symbolic sizes.
#
# ``b == 5`` on a symbolic dim is False unless jax can prove it true (its
# ``_DimExpr.__eq__`` says so itself: "really unsound"), so a program that
# branches on it is traced as one branch for every size. jax's own code only
# asks such questions where False is safe; user code may not.

_EQ_STATE: dict = {"depth": 0, "orig": None}
_EQ_LOCK = threading.Lock()
_EQ_LOCAL = threading.local()


def _dim_expr_class() -> Any:
  try:
    from jax._src.export import shape_poly
  except ImportError:  # pragma: no cover - another layout: no recording
    return None
  cls = getattr(shape_poly, "_DimExpr", None)
  return cls if isinstance(getattr(cls, "__eq__", None), type(lambda: 0)) else None


@functools.lru_cache(maxsize=1)
def _trusted_dirs() -> tuple:
  """jax's and jaxfold's own code (which treat an unproved ``==`` as unknown)."""
  import importlib.util
  dirs = []
  for name in ("jax", "jaxlib", "jaxfold"):
    spec = importlib.util.find_spec(name)
    for d in (spec.submodule_search_locations or []) if spec else []:
      dirs.append(os.path.join(os.path.realpath(d), ""))
  return tuple(dirs)


@functools.lru_cache(maxsize=1)
def _pass_through_dirs() -> tuple:
  """Code that only relays a comparison (the standard library: functools,
  dataclasses, operator, ...): the caller above it decides."""
  return tuple(os.path.join(os.path.realpath(sysconfig.get_paths()[k]), "") for k in ("stdlib", "platstdlib"))


@functools.lru_cache(maxsize=4096)
def _frame_kind(path: str, name: str) -> str:
  if path.startswith("<"):   # generated code: a dataclass' __eq__ relays, anything else is the user's
    return "pass" if name in ("__eq__", "__ne__") else "user"
  real = os.path.realpath(path)
  if real.startswith(_trusted_dirs()):
    return "trusted"
  return "pass" if real.startswith(_pass_through_dirs()) else "user"


def _provably_unequal(a: Any, b: Any) -> bool:
  """``a != b`` for every value of the symbols (or not a size comparison)."""
  if isinstance(b, type(a)) and getattr(b, "scope", None) is not getattr(a, "scope", None):
    return True
  try:
    d = a - b
  except Exception:  # noqa: BLE001 - not a size (None, a string, a tracer): plainly unequal
    return True
  for decide in (lambda: d >= 1, lambda: d <= -1):
    try:
      if decide():
        return True
    except Exception:  # noqa: BLE001 - jax's InconclusiveDimensionOperation
      pass
  return False


def _recording_eq(self, other):
  out = _EQ_STATE["orig"](self, other)
  log = getattr(_EQ_LOCAL, "log", None)
  if out or log is None or getattr(_EQ_LOCAL, "busy", False):
    return out
  _EQ_LOCAL.busy = True   # (deciding compares sizes too)
  try:
    if not _provably_unequal(self, other):
      f = sys._getframe(1)   # the comparing frame: past jax's own __ne__ and relays
      while f is not None and (f.f_code.co_filename == _EQ_STATE["file"]
                               or _frame_kind(f.f_code.co_filename, f.f_code.co_name) == "pass"):
        f = f.f_back
      if f is not None and _frame_kind(f.f_code.co_filename, f.f_code.co_name) == "user":
        log.append(f"`{self} == {other}` at {_short_path(f.f_code.co_filename)}:{f.f_lineno}")
  finally:
    _EQ_LOCAL.busy = False
  return out


@contextlib.contextmanager
def undecided_size_comparisons() -> Iterator[list]:
  """Yields a list that collects, while the block runs on this thread, each
  ``==``/``!=`` of a symbolic size (``jax.export.symbolic_shape``) that code
  outside jax and jaxfold made and jax decided as unequal without proof
  (``b == 5``, ``b % 4 == 0``, ``b == t``): ``"`b == 5` at file.py:12"``.
  Where this jax keeps its sizes elsewhere, the list stays empty."""
  cls = _dim_expr_class()
  if cls is None or getattr(_EQ_LOCAL, "log", None) is not None:
    yield []
    return
  with _EQ_LOCK:
    if _EQ_STATE["depth"] == 0:
      _EQ_STATE["orig"], _EQ_STATE["file"] = cls.__eq__, cls.__eq__.__code__.co_filename
      cls.__eq__ = _recording_eq
    _EQ_STATE["depth"] += 1
  log: list = []
  _EQ_LOCAL.log = log
  try:
    yield log
  finally:
    _EQ_LOCAL.log = None
    with _EQ_LOCK:
      _EQ_STATE["depth"] -= 1
      if _EQ_STATE["depth"] == 0:
        cls.__eq__ = _EQ_STATE["orig"]


# ---------------------------------------------------------------- StableHLO facts
# What ``jaxfold serve`` reads from an exported program (``jax.export``'s
# StableHLO): which operation gathers rows of a table, which only moves its
# operand's elements, and the attributes those questions need. The dataflow
# over them is server/tables.py's; the operation names and bindings are here.

_HLO_MOVES = frozenset({
    "stablehlo.convert", "stablehlo.reshape", "stablehlo.dynamic_reshape", "stablehlo.broadcast_in_dim",
    "stablehlo.dynamic_broadcast_in_dim", "stablehlo.transpose"})
_HLO_KINDS = {
    "func.call": "calls", "func.return": "returns", "stablehlo.gather": "gathers",
    "stablehlo.dynamic_gather": "gathers", "stablehlo.iota": "arange", "stablehlo.dynamic_iota": "arange",
    "stablehlo.compare": "compares", "stablehlo.select": "selects", "stablehlo.add": "adds",
    "stablehlo.multiply": "scales", "stablehlo.get_dimension_size": "dimsize",
    "stablehlo.constant": "constant", "stablehlo.dot_general": "contracts",
    "stablehlo.dynamic_slice": "indexes", "stablehlo.scatter": "indexes", "stablehlo.dynamic_update_slice": "indexes",
    "stablehlo.custom_call": "opaque", "stablehlo.while": "opaque", "stablehlo.case": "opaque",
    "stablehlo.if": "opaque",
}


@dataclasses.dataclass(frozen=True)
class HloOp:
  """One StableHLO operation as the serve analysis sees it: ``kind`` ("moves",
  "gathers", "arange", "calls", ... or "other") and the facts of that kind."""
  op: Any
  kind: str
  callee: Optional[str] = None          # call: the function called
  axes: tuple = ()                      # gather: operand axes the indices select (start_index_map);
  #                                       iota: (iota dimension,); dot: (lhs contracting, rhs contracting)
  direction: Optional[str] = None       # compare: "EQ", "LT", ...
  splat: Optional[int] = None           # constant: its value where every element is the same integer


@contextlib.contextmanager
def hlo_functions(exported: Any) -> Iterator[dict]:
  """``{name: (arguments, [HloOp, ...])}`` for every function of ``exported``'s
  module, valid inside the ``with`` (the MLIR context lives as long)."""
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir
  with mlir.make_ir_context():
    module = ir.Module.parse(exported.mlir_module())
    out = {}
    for f in module.body.operations:
      body = f.regions[0].blocks[0]
      name = ir.StringAttr(f.attributes["sym_name"]).value
      out[name] = (list(body.arguments), [hlo_op(op) for op in body.operations])
    yield out


def hlo_op(op: Any) -> HloOp:
  """The :class:`HloOp` of one operation (inside :func:`hlo_functions`)."""
  from jax._src.lib.mlir import ir
  from jaxlib.mlir.dialects import stablehlo as shlo
  op = getattr(op, "operation", op)
  name, attrs = op.name, op.attributes
  if name in _HLO_MOVES:
    return HloOp(op, "moves")
  kind = _HLO_KINDS.get(name, "opaque" if len(op.regions) and name != "stablehlo.reduce" else "other")
  if kind == "calls":
    return HloOp(op, kind, callee=ir.FlatSymbolRefAttr(attrs["callee"]).value)
  if kind == "gathers" and "dimension_numbers" in attrs:
    return HloOp(op, kind, axes=tuple(shlo.GatherDimensionNumbers(attrs["dimension_numbers"]).start_index_map))
  if kind == "arange":
    return HloOp(op, kind, axes=(ir.IntegerAttr(attrs["iota_dimension"]).value,))
  if kind == "compares":
    return HloOp(op, kind, direction=str(shlo.ComparisonDirectionAttr(attrs["comparison_direction"]).value))
  if kind == "contracts":
    dn = shlo.DotDimensionNumbers(attrs["dot_dimension_numbers"])
    return HloOp(op, kind, axes=(tuple(dn.lhs_contracting_dimensions), tuple(dn.rhs_contracting_dimensions)))
  if kind == "constant":
    v = attrs["value"]
    dense = v if isinstance(v, ir.DenseIntElementsAttr) else None
    splat = int(dense.get_splat_value().value) if dense is not None and dense.is_splat else None
    return HloOp(op, kind, splat=splat)
  return HloOp(op, kind)


def hlo_integer(value: Any) -> bool:
  """Whether a value holds integers or booleans (what can index)."""
  from jax._src.lib.mlir import ir
  try:
    return isinstance(ir.ShapedType(value.type).element_type, ir.IntegerType)
  except (ValueError, TypeError):
    return False


def hlo_shape(value: Any) -> tuple:
  """A value's shape, ``None`` for a dynamic (symbolic) dimension; ``()`` for a non-tensor."""
  from jax._src.lib.mlir import ir
  try:
    t = ir.RankedTensorType(value.type)
  except (ValueError, TypeError):
    return ()
  return tuple(None if t.is_dynamic_dim(i) else int(d) for i, d in enumerate(t.shape))
