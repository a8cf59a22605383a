"""``jaxfold.quantize``: the contractions that read a parameter run as quantized GEMMs (qwix).

Every ``dot_general`` (``einsum``, ``@`` and ``Dense`` lower to it) one of whose
operands is a parameter leaf, seen through casts and re-indexing only and read by
nothing else, becomes ``qwix.dot_general(x̂, Ŵ)``: ``Ŵ`` is the weight quantized
once, here, per output channel (optionally per group of ``group_size`` along the
contracted dim), stored in the result's parameters in its quantized form (int8;
int4 packed two per byte; fp8 as its bits) with its scales; ``x̂`` is the other
operand quantized in the program per token (``activations=``: absmax over the
contracted dims of each row, so each token gets its own scale) or left in float.
With both operands integer the program holds an ``int8 × int8 -> int32``
``dot_general`` (fp8: ``e4m3 × e4m3``), the GEMM an accelerator runs natively.

This is an approximation by design: unlike the other steps it changes what the
model computes. The report says, for every contraction, what it was quantized to
and its measured relative error on the example (or ``calibration``) inputs, and
for every contraction left in float, why (two activations, a weight read
elsewhere such as a tied embedding, ``skip``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxfold._src import compat, compiled, display, pipeline
from jaxfold._src.analysis import param_operand, single_use
from jaxfold._src.errors import JaxfoldError
from jaxfold._src.pipeline import Call
from jaxfold._src.report import param_label
from jaxfold._src.rewrite import Plan
from jaxfold._src.rules import rule_for
from jaxfold._src.step import RestoreContext, Restored, Result, Step, StepRecord, digest, register, register_params


class QuantizeError(JaxfoldError):
  """``jaxfold.quantize`` cannot do what was asked (bad option, qwix missing, ...)."""


WEIGHTS = ("int8", "int4", "fp8")
ACTIVATIONS = (None, "int8", "int4", "fp8")
_QTYPE = {"int8": "int8", "int4": "int4", "fp8": "float8_e4m3fn"}


def _qwix():
  try:
    import qwix
  except ImportError:
    raise QuantizeError('jaxfold.quantize needs qwix: pip install "jaxfold[quantize]" (or pip install qwix)') from None
  return qwix


# ----------------------------------------------------------------------------
# Data: the stored weights, the plan entries, the report.


class QWeight(NamedTuple):
  """A weight as stored: ``data`` (int8; int4 packed two per byte as uint8; fp8
  as its uint8 bits) and ``scale`` (one per output channel or group; float32,
  float64 for a float64 weight)."""
  data: Any
  scale: Any


class QuantParams(NamedTuple):
  """Parameters of a quantized result: ``base``, the parameters of the step
  before it with every quantized leaf replaced by a scalar zero (its values
  live in ``weights``), and ``weights``, ``{name: QWeight}``."""
  base: Any
  weights: dict

  __repr__ = display.quant_params_repr


register_params(QWeight, "jaxfold.QWeight")
register_params(QuantParams, "jaxfold.QuantParams")


class QuantizedAt(NamedTuple):
  """The ``dot_general`` at ``path`` runs through qwix: operand ``operand`` is the
  stored weight ``name`` (shape ``shape``, quantized to ``wtype`` with scales
  along ``channel`` dims, groups of ``group`` along ``tiled``); the other
  operand is quantized per row to ``atype`` (None: kept in float); ``dtype``
  is the float weight's."""
  path: tuple
  operand: int
  name: str
  shape: tuple
  dtype: Any        # the weight operand's dtype
  wtype: str
  channel: tuple
  tiled: Optional[int]
  group: Optional[int]
  atype: Optional[str]
  numbers: tuple    # the dot_general's dimension numbers
  smooth: Optional[str] = None   # the stored per-channel scale s: x/s meets the weight quantized as s·W
  static: Optional[str] = None   # the stored calibrated scale of x (one per contraction); None: per token

  @property
  def x_contracted(self) -> tuple:
    """The other operand's contracted dims."""
    (lc, rc), _ = self.numbers
    return tuple(lc if self.operand == 1 else rc)

  @property
  def w_contracted(self) -> tuple:
    """The weight's contracted dims."""
    (lc, rc), _ = self.numbers
    return tuple(rc if self.operand == 1 else lc)

  def contract(self, eqn: Any, invals: list, extras: dict) -> list:
    """The equation's output computed from the stored weight (rewrite.evaluate calls this)."""
    qwix = _qwix()
    w = _unpacked(self, extras[self.name])
    x = invals[1 - self.operand]
    if self.smooth is not None:   # (x / s)·(s W) = x W: SmoothQuant's migration, before x is quantized
      x = x / _along_dim(extras[self.smooth], x.ndim, self.x_contracted[0]).astype(x.dtype)
    if self.atype is not None and self.static is not None:
      x = _static_quantized(x, extras[self.static], self.atype)
    elif self.atype is not None:
      rows = tuple(d for d in range(x.ndim) if d not in self.x_contracted)
      x = qwix.quantize(x, _QTYPE[self.atype], channelwise_axes=rows)
    ops = (x, w) if self.operand == 1 else (w, x)
    out = qwix.dot_general(*ops, self.numbers)
    return [out.astype(eqn.outvars[0].aval.dtype)]


@dataclasses.dataclass(frozen=True)
class QuantSite:
  """One contraction that reads a parameter: ``weight`` its path, ``formats``
  (``"W int8 / A int8 per token"``) or ``""`` when kept in float, ``error`` the
  relative error of its output on the measured inputs (-1: not measured),
  ``reason`` why it was kept in float."""
  weight: str
  shape: tuple
  formats: str
  error: float = -1.0
  reason: str = ""

  @property
  def quantized(self) -> bool:
    return bool(self.formats)


@dataclasses.dataclass(frozen=True)
class QuantReport:
  """What ``quantize`` did, contraction by contraction."""
  sites: tuple
  weights: str
  activations: Optional[str]
  group_size: Optional[int]
  bytes_before: int
  bytes_after: int
  smooth: Optional[float] = None   # SmoothQuant's α, when the activations' range was migrated into the weights
  activation_scale: str = "dynamic"   # or "static": one calibrated scale per contraction

  @property
  def num_quantized(self) -> int:
    return sum(s.quantized for s in self.sites)

  def __str__(self) -> str:
    w = max([len(param_label(s.weight)) for s in self.sites] + [6])
    fw = max([len(s.formats) for s in self.sites] + [36])
    lines = [f"quantized {self.num_quantized}/{len(self.sites)} contractions reading a parameter "
             f"(weights {self.weights}{f' g{self.group_size}' if self.group_size else ''}, activations "
             f"{self.activations or 'float'}{' static' if self.activation_scale == 'static' else ''}"
             f"{f'; SmoothQuant α={self.smooth:g}' if self.smooth is not None else ''}); their weights "
             f"{_size(self.bytes_before)} -> {_size(self.bytes_after)}",
             f"  {'weight':{w}}  {'shape':>12}  {'formats':{fw}}  rel. error of the output / kept in float because"]
    for s in self.sites:
      shape = "x".join(map(str, s.shape))
      if s.quantized:
        tail = f"{s.error:.2e}" if s.error >= 0 else "not measured (pass calibration=[example args, ...])"
      else:
        tail = s.reason
      lines.append(f"  {param_label(s.weight):{w}}  {shape:>12}  {s.formats or 'float':{fw}}  {tail}")
    return "\n".join(lines)

  def summary(self) -> str:
    return str(self).splitlines()[0]

  def to_json(self) -> str:
    import json
    return json.dumps(dataclasses.asdict(self), indent=1, default=list)


# Largest magnitude of each format: a scale of absmax / _QMAX maps the calibrated range onto it
# (qwix's own convention for int: absmax / 127.5 and 7.5, the rounding boundary of the extreme value).
_QMAX = {"int8": 127.5, "int4": 7.5, "fp8": 448.0}
_QRANGE = {"int8": (-128, 127), "int4": (-8, 7)}


def _static_quantized(x: Any, scale: Any, atype: str) -> Any:
  """``x`` quantized with one calibrated scale (a qwix ``QArray``): values beyond the
  calibrated range saturate, the cost of a static scale (no per-token reduction)."""
  qwix = _qwix()
  s = jnp.asarray(scale, jnp.float32)
  y = x.astype(jnp.float32) / s
  if atype == "fp8":
    q = jnp.clip(y, -_QMAX["fp8"], _QMAX["fp8"]).astype(jnp.float8_e4m3fn)
  else:
    lo, hi = _QRANGE[atype]
    q = jnp.clip(jnp.round(y), lo, hi).astype(_QTYPE[atype])
  return qwix.QArray(qvalue=q, scale=jnp.reshape(s, (1,) * x.ndim), zero_point=None, qtype=_QTYPE[atype])


def _along_dim(v: Any, rank: int, dim: int) -> Any:
  shape = [1] * rank
  shape[dim] = -1
  return jnp.reshape(v, shape)


def _size(n: int) -> str:
  return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


class Quantized(Result):
  """Result of :func:`quantize` (a ``step.Result``): ``apply_fn(params, *args)``
  computes the model with its contractions quantized; ``params`` is a
  :class:`QuantParams`; ``report`` a :class:`QuantReport`."""
  __slots__ = ()
  __repr__ = display.result_repr


# ----------------------------------------------------------------------------
# The analysis: which contractions, proved to read their weight only there.


class _Config(NamedTuple):
  weights: str
  activations: Optional[str]
  group_size: Optional[int]
  skip: tuple
  smooth: Optional[float] = None   # SmoothQuant's α (None: no migration)
  static: bool = False             # activation scales calibrated once (else per token, in the program)


class QuantAnalysis(NamedTuple):
  """One signature analysed: the program, the plan, the sites."""
  jaxpr: Any
  consts: list
  out_tree: Any
  plan: Plan
  key: tuple            # ((leaf, path, operand), ...) quantized
  chains: dict          # leaf -> the re-indexing equations from the leaf to the weight operand
  sites: tuple          # QuantSite (error unmeasured)


def _skipped(name: str, skip: tuple) -> bool:
  label = param_label(name)
  return any((s(label) if callable(s) else (s in name or s in label)) for s in skip)


def analyse(fn: Callable, params: Any, args: tuple, cfg: _Config) -> QuantAnalysis:
  """The contractions of ``fn(params, *args)`` that read a parameter, and
  which of them can be quantized (the weight read there and nowhere else)."""
  traced = pipeline.trace(fn, params, args, QuantizeError)
  entries, sites, key, chains = [], [], [], {}
  with pipeline.analyzer(traced) as an:
    level = an.top
    for node in level.program.nodes:
      dd = rule_for(node.prim).contraction(node)
      if dd is None or len(node.ins) != 2:   # (the contraction facet: dot_general's dims)
        continue
      found = [(k, param_operand(level, a)) for k, a in enumerate(node.ins)]
      found = [(k, p) for k, p in found if p is not None]
      if not found:
        continue
      k, (leaf, chain) = found[0]
      name = traced.names[leaf]
      w_aval = node.ins[k]
      shape = tuple(w_aval.shape)
      contracted = tuple(dd.rc if k == 1 else dd.lc)
      why = ""
      if len(found) == 2:
        why = "both operands are parameters"
      elif not single_use(level, leaf, chain, (node, k)):
        why = "the parameter is read elsewhere too (e.g. a tied embedding): quantizing it here would change that use"
      elif not jnp.issubdtype(w_aval.dtype, jnp.floating):
        why = f"the weight is {w_aval.dtype}, not floating point"
      elif _skipped(name, cfg.skip):
        why = "skipped (skip=)"
      elif len(contracted) != 1 and cfg.group_size:
        why = "a contraction over several dims cannot be grouped: pass group_size=None"
      if why:
        sites.append(QuantSite(name, shape, "", reason=why))
        continue
      channel = tuple(d for d in range(len(shape)) if d not in contracted)
      tiled, group = (contracted[0], cfg.group_size) if cfg.group_size else (None, None)
      if group and shape[tiled] % group:
        sites.append(QuantSite(name, shape, "", reason=f"the contracted dim ({shape[tiled]}) is not a "
                               f"multiple of group_size={group}"))
        continue
      qname = f"w{leaf:05d}"
      smooth = f"{qname}.s" if cfg.smooth is not None and len(contracted) == 1 else None
      entries.append(QuantizedAt(node.path, k, qname, shape, w_aval.dtype, cfg.weights, channel, tiled, group,
                                 cfg.activations, dd.numbers, smooth, f"{qname}.a" if cfg.static else None))
      chains[leaf] = tuple(n.eqn for n in chain)
      key.append((leaf, node.path, k))
      fmt = f"W {cfg.weights}" + (f" g{group}" if group else " per channel")
      fmt += (f" / A {cfg.activations} {'static' if cfg.static else 'per token'}" if cfg.activations
              else " / A float")
      if cfg.smooth is not None:
        fmt += f", smoothed α={cfg.smooth:g}" if smooth else ", not smoothed (several contracted dims)"
      sites.append(QuantSite(name, shape, fmt))
  return QuantAnalysis(traced.jaxpr, traced.consts, traced.out_tree, Plan(quantized=tuple(entries)),
                       tuple(key), chains, tuple(sites))


# ----------------------------------------------------------------------------
# Storing weights.


def _quantize_weight(w: Any, e: QuantizedAt, s: Any = None) -> QWeight:
  """``w`` (times the smoothing scale ``s`` along its contracted dim) quantized and stored."""
  qwix = _qwix()
  tiled = {e.tiled: e.group} if e.group else None
  w = jnp.asarray(w)
  wide = w.astype(jnp.promote_types(w.dtype, jnp.float32))   # (scales of a bf16 weight in float32)
  if s is not None:
    wide = wide * _along_dim(jnp.asarray(s, wide.dtype), wide.ndim, e.w_contracted[0])
  q = qwix.quantize(wide, _QTYPE[e.wtype], channelwise_axes=e.channel, tiled_axes=tiled)
  data = q.qvalue
  if e.wtype == "int4":
    data = _pack_int4(data)
  elif e.wtype == "fp8":
    data = jax.lax.bitcast_convert_type(data, jnp.uint8)
  return QWeight(data, q.scale.astype(wide.dtype))


def _smoothing(e: QuantizedAt, w: Any, amax: Any, alpha: float) -> np.ndarray:
  """SmoothQuant's per-channel scale ``s = max|x|^α / max|W|^(1-α)`` over the
  contracted channel (1 where either is zero; in the weight's float type)."""
  d = e.w_contracted[0]
  w = np.abs(np.asarray(w, np.float64))
  wmax = w.max(axis=tuple(i for i in range(w.ndim) if i != d))
  amax = np.asarray(amax, np.float64)
  ok = (wmax > 0) & (amax > 0)
  s = np.where(ok, np.power(np.where(ok, amax, 1.0), alpha) / np.power(np.where(ok, wmax, 1.0), 1 - alpha), 1.0)
  return np.clip(s, 1e-5, 1e5).astype(_scale_dtype(e))


def _scale_dtype(e: QuantizedAt) -> Any:
  return jnp.promote_types(e.dtype, jnp.float32)


def _activation_ranges(runs: list, leaves: list) -> dict:
  """``{path: per-channel max |x|}`` of the activation operand of every planned
  contraction over ``runs`` (the float program: no plan applied)."""
  from jaxfold._src import rewrite

  amax: dict = {}
  for an, flat in runs:
    at = {e.path: e for e in an.plan.quantized if e.smooth is not None or e.static is not None}

    def hook(path, eqn, invals, at=at):
      e = at.get(path)
      if e is not None:   # (per channel along the one contracted dim when smoothing; else one value)
        c = e.x_contracted[0] if e.smooth is not None else None
        x = np.abs(np.asarray(invals[1 - e.operand], np.float64))
        m = x.max(axis=tuple(i for i in range(x.ndim) if i != c)) if c is not None else x.max(keepdims=False)
        amax[path] = m if path not in amax else np.maximum(amax[path], m)

    rewrite.evaluate(an.jaxpr, an.consts, list(leaves) + list(flat), Plan(), {}, observe=hook)
  return amax


def _pack_int4(q: Any) -> jax.Array:
  """int4 values (flattened) two per uint8: low nibble first (an odd count padded)."""
  v = jnp.ravel(q).astype(jnp.int8)
  if v.size % 2:
    v = jnp.concatenate([v, jnp.zeros((1,), jnp.int8)])
  u = jnp.bitwise_and(v.astype(jnp.uint8), jnp.uint8(0xF)).reshape(-1, 2)
  return u[:, 0] | (u[:, 1] << 4)


def _unpack_int4(p: Any, shape: tuple) -> jax.Array:
  lo = jnp.bitwise_and(p, jnp.uint8(0xF)).astype(jnp.int8)
  hi = jnp.right_shift(p, jnp.uint8(4)).astype(jnp.int8)
  v = jnp.stack([lo, hi], axis=-1).reshape(-1)[:int(np.prod(shape))]
  v = jnp.where(v >= 8, v - 16, v)   # sign-extend the nibble
  return v.reshape(shape).astype(jnp.int4)


def _unpacked(e: QuantizedAt, w: QWeight):
  """The qwix ``QArray`` of a stored weight."""
  qwix = _qwix()
  data = w.data
  if e.wtype == "int4":
    data = _unpack_int4(data, e.shape)
  elif e.wtype == "fp8":
    data = jax.lax.bitcast_convert_type(data, jnp.float8_e4m3fn)
  return qwix.QArray(qvalue=data, scale=w.scale, zero_point=None, qtype=_QTYPE[e.wtype])


def _weight_operand(leaf: Any, chain: tuple) -> Any:
  """The leaf through its chain of casts and re-indexing: the operand the contraction reads."""
  v = leaf
  for eqn in chain:
    v = compat.bind_eqn(eqn, [v])[0]
  return v


def _abstract_weights(an: QuantAnalysis) -> dict:
  out = {}
  for e in an.plan.quantized:
    w = jax.ShapeDtypeStruct(e.shape, e.dtype)
    out[e.name] = jax.eval_shape(functools.partial(_quantize_weight, e=e), w)
    if e.smooth is not None:
      out[e.smooth] = jax.ShapeDtypeStruct((e.shape[e.w_contracted[0]],), _scale_dtype(e))
    if e.static is not None:
      out[e.static] = jax.ShapeDtypeStruct((), np.float32)
  return out


# ----------------------------------------------------------------------------
# The apply function.


class _QuantRecord(NamedTuple):
  cfg: _Config
  key_sha256: str


def _config(weights: Any, activations: Any, group_size: Any, skip: Any, smooth: Any = None,
            activation_scale: str = "dynamic") -> _Config:
  if weights not in WEIGHTS:
    raise QuantizeError(f"quantize: weights must be one of {WEIGHTS}, got {weights!r}")
  if activations not in ACTIVATIONS:
    raise QuantizeError(f"quantize: activations must be one of {ACTIVATIONS}, got {activations!r}")
  if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
    raise QuantizeError(f"quantize: group_size must be a positive int or None, got {group_size!r}")
  if activations is not None and (weights == "fp8") != (activations == "fp8"):
    raise QuantizeError(f"quantize: weights {weights} with activations {activations}: qwix contracts "
                        "integers with integers and fp8 with fp8; pick matching formats (or activations=None)")
  skip = (skip,) if isinstance(skip, str) or callable(skip) else tuple(skip or ())
  if smooth is not None and (isinstance(smooth, bool) or not isinstance(smooth, (int, float)) or not 0 <= smooth <= 1):
    raise QuantizeError(f"quantize: smooth must be SmoothQuant's α, a number in [0, 1] (0.5 is usual), or None; "
                        f"got {smooth!r}")
  if activation_scale not in ("dynamic", "static"):
    raise QuantizeError(f"quantize: activation_scale must be \"dynamic\" (per token, in the program) or "
                        f"\"static\" (calibrated once), got {activation_scale!r}")
  if activation_scale == "static" and activations is None:
    raise QuantizeError("quantize: activation_scale=\"static\" calibrates the scales of quantized activations: "
                        "pass activations=\"int8\" (or \"int4\", \"fp8\") too")
  return _Config(weights, activations, group_size, skip, None if smooth is None else float(smooth),
                 activation_scale == "static")


@register
class QuantizedApply(Step):
  """The apply function with quantized contractions: re-traces the model per
  input signature, checks the same contractions are quantized, and runs the
  program with them through qwix."""

  error = QuantizeError
  kind = "quantize"

  def __init__(self, inner: Callable, params_abstract: Any, base: QuantAnalysis, cfg: _Config,
               args: tuple, kwargs: Optional[dict] = None):
    super().__init__(inner, params_abstract, args, kwargs)
    self._base, self._cfg = base, cfg
    self._tree = jax.tree_util.tree_structure(params_abstract)
    self._shapes = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in jax.tree_util.tree_leaves(params_abstract)]
    self.seed(self.bind(args, kwargs), base)

  def record(self) -> StepRecord:
    c = self._cfg
    if any(callable(s) for s in c.skip):
      raise QuantizeError("a quantized result with a callable skip= cannot be saved: pass parameter names")
    info = {"name": self.kind, "weights": c.weights, "activations": c.activations, "group_size": c.group_size,
            "skip": list(c.skip), "smooth": c.smooth, "activation_scale": "static" if c.static else "dynamic",
            "key_sha256": digest(self._base.key)}
    return StepRecord(info, {})

  @classmethod
  def parse(cls, info: dict, decode: Callable[[Any], Any]) -> _QuantRecord:
    cfg = _config(info["weights"], info["activations"], info["group_size"], tuple(info["skip"]), info.get("smooth"),
                  info.get("activation_scale", "dynamic"))
    return _QuantRecord(cfg, str(info["key_sha256"]))

  @classmethod
  def restore(cls, inner: Callable, params: Any, parsed: _QuantRecord, ctx: RestoreContext) -> Restored:
    args = tuple(ctx.args)
    call = pipeline.bind(inner, args, ctx.kwargs, ctx.error)
    an = analyse(call.fn, params, call.abstract_args(ctx.error), parsed.cfg)
    if ctx.verify and digest(an.key) != parsed.key_sha256:
      raise ctx.refuse("quantize (other contractions would be quantized now than when saved)")
    report = QuantReport(an.sites, parsed.cfg.weights, parsed.cfg.activations, parsed.cfg.group_size, 0, 0,
                         parsed.cfg.smooth, "static" if parsed.cfg.static else "dynamic")
    tree = jax.tree_util.tree_structure(QuantParams(_placeholders(params, an), _abstract_weights(an)))
    return Restored(cls(inner, params, an, parsed.cfg, args, ctx.kwargs), report, tree)

  def _analyse(self, call: Call) -> QuantAnalysis:
    an = analyse(call.fn, self._params, call.abstract_args(QuantizeError), self._cfg)
    if an.key != self._base.key:
      raise QuantizeError(f"inputs of these shapes ({pipeline.shapes_text(call.args)}) quantize other "
                          "contractions than the example's; call quantize again for them")
    return an

  def __call__(self, params, *args, **kwargs):
    if not isinstance(params, QuantParams):
      raise QuantizeError(f"a quantized apply_fn takes the result's params (a jaxfold QuantParams), got "
                          f"{type(params).__name__}")
    call = self.bind(args, kwargs)
    an = self._cached(call)
    quantized = {leaf for leaf, _, _ in an.key}

    def fill(leaves):   # (a quantized leaf's float values are gone; the program's only read of it is replaced)
      return [jnp.zeros(s.shape, s.dtype) if i in quantized else x
              for i, (x, s) in enumerate(zip(leaves, self._shapes))]
    return compiled.run_on(an, self._tree, params.base, call.args, dict(params.weights), QuantizeError,
                           "params.base does not have the structure of the quantized result's", fill)


def _placeholders(params: Any, an: QuantAnalysis) -> Any:
  leaves, tree = jax.tree_util.tree_flatten(params)
  quantized = {leaf for leaf, _, _ in an.key}
  return jax.tree_util.tree_unflatten(
      tree, [np.zeros((), x.dtype) if i in quantized else x for i, x in enumerate(leaves)])


def _rel_err(a: Any, b: Any) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _site_errors(runs: list, leaves: list, weights: dict) -> dict:
  """{name: mean relative error of the contraction's output} over ``runs``
  (``(analysis, flat arguments)``, one per calibration input): the quantized
  contraction against the float one on the operand it gets in the quantized program."""
  from jaxfold._src import rewrite

  errs: dict = {}
  for an, flat in runs:
    at = {e.path: e for e in an.plan.quantized}

    def hook(path, eqn, invals, at=at):
      e = at.get(path)
      if e is not None:
        ref = compat.bind_eqn(eqn, invals)[0]
        got = e.contract(eqn, invals, weights)[0]
        errs.setdefault(e.name, []).append(_rel_err(got, ref))

    rewrite.evaluate(an.jaxpr, an.consts, list(leaves) + list(flat), an.plan, weights, observe=hook)
  return {k: float(np.mean(v)) for k, v in errs.items()}


def quantize(model: Any, *example_args: Any, weights: str = "int8", activations: Optional[str] = None,
             group_size: Optional[int] = None, calibration: Optional[list] = None, skip: Any = (),
             smooth: Optional[float] = None, activation_scale: str = "dynamic") -> Quantized:
  """Runs every contraction that reads a parameter as a quantized GEMM (qwix).

  ``model`` is any jaxfold result (``fold``, ``fuse_affine``, ``rotate``,
  ``defer_norms``, ``online_hadamard``) or the original model as a
  ``(params, apply_fn)`` pair (then pass ``example_args``). ``weights``:
  ``"int8"``, ``"int4"`` or ``"fp8"``, per output channel, or per group of
  ``group_size`` along the contracted dim; ``activations``: ``None`` (float),
  ``"int8"``, ``"int4"`` or ``"fp8"``, per token, quantized in the program. A contraction
  whose weight is read elsewhere (a tied embedding), of two activations, or
  named in ``skip`` (substrings of parameter paths, or a predicate) stays in
  float. ``report`` gives every contraction's formats and its relative error
  on ``calibration`` (a list of example-argument tuples; default: the example).
  ``smooth=α`` migrates each contraction's activation range into its weight
  (SmoothQuant): per contracted channel ``s = max|x|^α / max|W|^(1-α)`` over
  the calibration inputs, the weight is quantized as ``s·W`` and the program
  divides ``x`` by ``s`` before quantizing it — ``(x/s)·(s·W) = x·W`` exactly
  before quantization; the remedy where fusing γ into the readers widened
  their weights' range, or where a channel of ``x`` is an outlier.
  ``activation_scale="static"`` quantizes each contraction's activations with one
  scale calibrated on ``calibration`` (its largest magnitude there) instead of
  per token: no reduction over each row in the program, and values beyond the
  calibrated range saturate.
  Needs qwix (``pip install "jaxfold[quantize]"``).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxfold
    >>> m = nn.Sequential([nn.Dense(32), nn.LayerNorm(), nn.Dense(8)])
    >>> x = jax.random.normal(jax.random.PRNGKey(1), (4, 16)); p = m.init(jax.random.PRNGKey(0), x)
    >>> q = jaxfold.quantize(jaxfold.fold(p, m.apply, x), weights="int8", activations="int8")
    >>> q.report.num_quantized
    2
    >>> bool(jnp.allclose(q.apply_fn(q.params, x), m.apply(p, x), atol=0.1))
    True
  """
  cfg = _config(weights, activations, group_size, skip, smooth, activation_scale)
  _qwix()
  if isinstance(model, tuple) and len(model) == 2 and callable(model[1]) and not isinstance(model, Result):
    params, fn = model
    kwargs: dict = {}
    if not example_args:
      raise QuantizeError("quantize((params, apply_fn), *example_args): pass example arguments")
  else:
    kwargs = pipeline.model_kwargs(model, example_args)
    params, fn, example_args = pipeline.model_parts(
        model, example_args, "quantize takes a jaxfold result or a (params, apply_fn) pair", QuantizeError)
  abstract = pipeline.abstract_tree(params, QuantizeError)
  call = pipeline.bind(fn, tuple(example_args), kwargs, QuantizeError)
  an = analyse(call.fn, abstract, call.abstract_args(QuantizeError), cfg)
  leaves = jax.tree_util.tree_leaves(params)
  runs = []
  for a in (calibration or [example_args]):
    c = pipeline.bind(fn, tuple(a), kwargs, QuantizeError)
    flat = jax.tree_util.tree_leaves(c.args)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in flat):
      runs = []   # (a result's recorded example arguments are abstract: errors need values, calibration=)
      break
    # (an input of the example's signature has the example's analysis: not traced again)
    other = an if c.key == call.key else analyse(c.fn, abstract, c.abstract_args(QuantizeError), cfg)
    if other.key != an.key:
      raise QuantizeError(f"calibration inputs of shapes {pipeline.shapes_text(c.args)} quantize other "
                          "contractions than the example's; calibrate at shapes like the example's")
    runs.append((other, flat))
  if (cfg.smooth is not None or cfg.static) and not runs:
    what = "smooth=α" if cfg.smooth is not None else "activation_scale=\"static\""
    raise QuantizeError(f"quantize(..., {what}) measures the activations' ranges: pass calibration=[example "
                        "args, ...] with values")
  amax = _activation_ranges(runs, leaves) if cfg.smooth is not None or cfg.static else {}
  stored = {}
  before = after = 0
  for e, (leaf, _, _) in zip(an.plan.quantized, an.key):
    w = _weight_operand(leaves[leaf], an.chains[leaf])
    s = None
    if e.smooth is not None:
      s = stored[e.smooth] = jnp.asarray(_smoothing(e, w, amax[e.path], cfg.smooth))
    if e.static is not None:   # (the range x has where it is quantized: after smoothing)
      top = float(np.max(amax[e.path] / np.asarray(s, np.float64))) if s is not None else float(np.max(amax[e.path]))
      stored[e.static] = jnp.asarray(max(top, 1e-30) / _QMAX[e.atype], jnp.float32)
    stored[e.name] = _quantize_weight(w, e, s)
    before += leaves[leaf].size * leaves[leaf].dtype.itemsize
    after += sum(a.size * a.dtype.itemsize for a in stored[e.name])
  errors = _site_errors(runs, leaves, stored) if runs else {}
  measured = iter([errors.get(e.name, -1.0) for e in an.plan.quantized])   # (quantized sites, in plan order)
  sites = tuple(dataclasses.replace(s, error=next(measured)) if s.quantized else s for s in an.sites)
  report = QuantReport(sites, cfg.weights, cfg.activations, cfg.group_size, before, after, cfg.smooth,
                       "static" if cfg.static else "dynamic")
  apply = QuantizedApply(fn, abstract, an, cfg, example_args, kwargs)
  return Quantized(QuantParams(_placeholders(params, an), stored), apply, report)
