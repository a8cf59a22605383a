"""``jaxfold.rotate``: an orthogonal change of basis of the residual stream, proved exact.

Every parameter that touches the stream is replaced by ``p ×_d Q`` along its
stream dim d: writers (output projections, embeddings, position tables,
biases) and readers (input projections, heads; ``(xQ)·(Qᵀ W) = x·W``). The
program is unchanged. The proof follows the rotation forwards through the
traced program with the rules' ``rotate`` facets (``rules.rotation``): every
value is unchanged, rotated (``Lin``) or a sum of squares of rotated values
(``Quad``, unchanged once summed: the parameter-free RMS norm), and no output
may be anything but unchanged. Which parameters to rotate is proposed by the
zero-sum analysis (what writes each norm's input) and completed where a
facet asks for a rotated operand (``Want``); the forward pass alone decides.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxfold._src import compat, display, kernels, pipeline
from jaxfold._src.analysis import LeafNeed, Level, factor_leaf, leaf_of
from jaxfold._src.errors import RotateError
from jaxfold._src.fold import FoldedApply
from jaxfold._src.hadamard import hadamard, random_orthogonal
from jaxfold._src.hints import rotation_aux_hint
from jaxfold._src.pipeline import Call
from jaxfold._src.program import Val
from jaxfold._src.report import param_label
from jaxfold._src.rules import Block, rule_for
from jaxfold._src.rules.rotation import Lin, Quad, Want
from jaxfold._src.step import RestoreContext, Restored, Result, Step, StepRecord, register


@dataclasses.dataclass(frozen=True)
class RotateReport:
  """What ``rotate`` changed: ``rotated`` is ``((leaf name, dims), ...)``."""
  rotated: tuple
  norms: int            # parameter-free norms whose input is the rotated stream
  size: int

  def __str__(self) -> str:
    lines = [f"rotated the residual stream (d={self.size}) through {self.norms} norm(s); "
             f"{len(self.rotated)} parameters rotated:"]
    lines += [f"  {param_label(name)} along dim {', '.join(map(str, dims))}" for name, dims in self.rotated]
    return "\n".join(lines)


class Rotated(Result):
  """Result of :func:`rotate` (a ``step.Result``): ``apply_fn(params, *args)``
  computes the original; ``params`` has the structure of the model rotated
  (a ``jaxfold.Params``), ``report`` is a :class:`RotateReport`."""
  __slots__ = ()
  __repr__ = display.result_repr

  @property
  def stream_axes(self) -> dict:
    """``{leaf name: dims}``: where each rotated parameter meets the stream. A
    parameter of the user's is named by its path in the user's parameters
    (``"['params']['wte']['embedding']"``); one that fuse_affine made (an untied
    copy, a new bias) by its path in ``params`` (``".extras[...]"``).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, flax.linen as nn, jaxfold
      >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(3)])
      >>> x = jnp.ones((2, 4)); p = m.init(jax.random.PRNGKey(0), x)
      >>> fused = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
      >>> q = np.linalg.qr(np.random.default_rng(0).normal(size=(8, 8)))[0]
      >>> sorted(jaxfold.rotate(fused, q).stream_axes)
      ["['params']['layers_0']['bias']", "['params']['layers_0']['kernel']", "['params']['layers_2']['kernel']"]
    """
    return {_user_path(name): dims for name, dims in self.report.rotated}


def _user_path(name: str) -> str:
  """A leaf's path in the user's parameters (``jaxfold.Params.params``), else unchanged."""
  prefix = ".params"
  if name.startswith(prefix) and name[len(prefix):len(prefix) + 1] in ("[", "."):
    return name[len(prefix):]
  return name


# ----------------------------------------------------------------------------
# The proof.


def _norm_inputs(level: Level, n: int) -> list:
  """``(x, axis)`` for every sum over an axis of size n (a ``reduce_sum`` or a
  contraction with a constant, the fold's mean spellings: the rules' ``sums``)
  of what the rotation facets show to be a sum of squares of ``x`` (the RMS of
  ``x``), where the summing node's own facet shows its output unchanged, and
  for every contraction of ``x`` with itself over such an axis."""
  out = []
  for node in level.program.nodes:
    rule = rule_for(node.prim)
    gram = _self_contraction(node, level, n)
    if gram is not None:
      out.append(gram)
      continue
    try:
      summed = rule.sums(node, level)
    except Block:
      continue
    if summed is None or len(summed[1]) != 1:
      continue
    k, (axis,) = summed
    v = node.ins[k]
    if not isinstance(v, Val) or v.producer is None or v.shape[axis] != n:
      continue
    pn = v.producer
    for x in {a for a in pn.ins if isinstance(a, Val) and a.shape == v.shape}:
      lin = Lin(frozenset({axis}))
      try:
        outs = rule_for(pn.prim).rotate(pn, [lin if a is x else None for a in pn.ins], level)
        if outs[v.index] != Quad(axis):
          continue
        summed_states = rule.rotate(node, [Quad(axis) if j == k else None for j in range(len(node.ins))], level)
      except Block:
        continue
      if all(s is None for s in summed_states):
        out.append((x, axis))
        break
  return out


def _self_contraction(node: Any, level: Level, n: int) -> Optional[tuple]:
  """``(x, axis)`` where ``node`` contracts ``x`` with itself over one axis of
  size n, row by row (a variance as ``einsum('...d,...d->...', x, x)``:
  ``<xQ, xQ> = <x, x>``), as its rotate facet shows; else None."""
  dd = rule_for(node.prim).contraction(node)
  if dd is None or len(node.ins) != 2 or node.ins[0] is not node.ins[1] or not isinstance(node.ins[0], Val):
    return None
  if len(dd.lc) != 1 or tuple(dd.lc) != tuple(dd.rc) or node.ins[0].shape[dd.lc[0]] != n:
    return None
  if tuple(dd.lb) != tuple(dd.rb) or len(dd.lb) + 1 != len(node.ins[0].shape):
    return None   # (row by row only: a Gram matrix x·xᵀ is no norm)
  lin = Lin(frozenset({dd.lc[0]}))
  try:
    outs = rule_for(node.prim).rotate(node, [lin, lin], level)
  except Block:
    return None
  return (node.ins[0], dd.lc[0]) if all(s is None for s in outs) else None


def _leaf_dims(level: Level, a: Any, dims: frozenset) -> Optional[tuple]:
  """(leaf index, leaf dims) when ``a`` is a view of a parameter in which
  each of ``dims`` reads one whole parameter dim, untouched by the others."""
  e = level.canon(a)
  if len(e.terms) != 1:
    return None
  (m, c), = e.terms.items()
  if c != 1 or len(m) != 1:
    return None
  lv = factor_leaf(m[0], level)
  if lv is None:
    return None
  i, view = lv
  src = view.src
  lstrides = [int(np.prod(src[k + 1:])) for k in range(len(src))]
  out = []
  for d in dims:
    match = [k for k in range(len(src)) if src[k] == a.shape[d] and src[k] > 1
             and view.strides[d] == lstrides[k]]
    if len(match) != 1:
      return None
    k = match[0]
    ls, nk = lstrides[k], src[k]
    if (view.offset // ls) % nk:
      return None
    inner = view.offset % ls
    for j, s in enumerate(view.strides):
      if j == d or s == 0 or abs(s) % (ls * nk) == 0:
        continue
      if s < 0:
        return None
      inner += s * (a.shape[j] - 1)
    if inner >= ls:  # the other dims' offsets would carry into dim k
      return None
    out.append(k)
  return i, frozenset(out)


def _writers(level: Level, a: Any, dims: frozenset, depth: int = 12, memo: Optional[dict] = None) -> Optional[dict]:
  """``{leaf index: dims}``: parameters whose rotation would make ``a`` rotated
  along ``dims`` (``Lin(dims)``), found backwards: ``a`` is a parameter seen
  through re-indexing, or a node whose own rotation facet, given one operand
  rotated (and every operand it then asks for, ``Want``), outputs ``a`` so
  rotated (a writer ``o @ Wo + b`` however ``o`` was computed, an embedding
  lookup plus a position table). A proposal only: the forward pass proves."""
  hit = _leaf_dims(level, a, dims)
  if hit is not None:
    return {hit[0]: hit[1]}
  node = getattr(a, "producer", None)
  if node is None or depth == 0 or len(dims) != 1:
    return None
  memo = {} if memo is None else memo   # (a residual chain with T == d would branch at every add)
  if (a, dims) not in memo:
    memo[(a, dims)] = None              # (a cycle through it proposes nothing)
    memo[(a, dims)] = _writers_of(level, node, a, dims, depth, memo)
  return memo[(a, dims)]


def _writers_of(level: Level, node: Any, a: Any, dims: frozenset, depth: int, memo: dict) -> Optional[dict]:
  size = a.shape[next(iter(dims))]
  rule = rule_for(node.prim)
  for k, b in enumerate(node.ins):
    if not isinstance(b, Val) or level.facts(b).value == 0:
      continue
    for d in range(len(b.shape)):
      if b.shape[d] != size:
        continue
      states = [None] * len(node.ins)
      states[k] = Lin(frozenset({d}))
      for _ in range(len(node.ins)):
        try:
          outs = rule.rotate(node, states, level)
        except Want as w:
          if states[w.operand] is not None or not isinstance(node.ins[w.operand], Val):
            break
          states[w.operand] = Lin(w.dims)
          continue
        except Block:
          break
        if outs[a.index] != Lin(dims):
          break
        found: dict = {}   # every rotated operand's writers, agreeing on shared leaves
        for j, st in enumerate(states):
          sub = None if st is None else _writers(level, node.ins[j], st.dims, depth - 1, memo)
          if st is not None and (sub is None or any(found.get(i, q) != q for i, q in sub.items())):
            break
          found.update(sub or {})
        else:
          return found
        break
  return None


def _propagate(level: Level, seeds: dict):
  """Forward states from rotated parameters: None, or (Want, node) / reason."""
  prog = level.program
  states = {prog.invars[i]: Lin(frozenset(d)) for i, d in seeds.items()}
  for v in states:
    if v in prog.output_positions:
      return "a rotated parameter is a program output"
  for node in prog.nodes:
    ins = [states.get(a) if isinstance(a, Val) else None for a in node.ins]
    if all(s is None for s in ins):
      continue
    try:
      outs = rule_for(node.prim).rotate(node, ins, level)
    except Want as w:
      return (w, node)
    except Block as err:
      return f"{err} [at {node.where()}]"
    why = advance(prog, node, outs, states)
    if why is not None:
      return why
  return states


def advance(prog: Any, node: Any, outs: list, states: dict) -> Optional[str]:
  """Records the rotation states of ``node``'s outputs (its rotate facet's
  ``outs``) in ``states``; the reason, when one reaches an output of ``prog``."""
  for o, s in zip(node.outs, outs):
    if s is None:
      continue
    if o in prog.output_positions:
      return f"the rotation reaches program output #{prog.output_positions[o][0]} [from {node.where()}]"
    states[o] = s
  return None


def _solve(fn: Callable, params: Any, args: tuple, n: int):
  """``(leaf dims, norms, names)`` of a proven rotation, or raises RotateError."""
  # The proof reads the XLA expression of every kernel the program would run (the
  # fold's RMSNorm, a deferred reader's RMS-matmul): each computes that expression
  # exactly in real arithmetic, so the rotation is exact for the kernels too; traced
  # as they run, a kernel is an opaque pallas_call that no rotation passes.
  with kernels.xla_level():
    traced = pipeline.trace(fn, params, args)
  names = traced.names
  with pipeline.analyzer(traced) as an:
    level = an.top
    sites = _norm_inputs(level, n)
    if not sites:
      raise RotateError(f"no sum of squares over an axis of size {n} (a parameter-free RMS norm "
                        f"of a stream of width {n}): nothing to rotate; q must match the stream "
                        "width, and the model must be folded and fused (jaxfold.fuse_affine)")
    seeds: dict = {}
    for x, axis in sites:  # proposal: what writes each norm's input
      for need in level.needs(x, ((axis, n),)):
        if isinstance(need, LeafNeed):
          i = leaf_of(need.var, level)
          spec = dict(need.spec)
          if i is not None and len(spec) == 1 and all(
              b == need.var.shape[d] == n for d, b in spec.items()):
            seeds.setdefault(i, set()).update(spec)
    for _ in range(4 * len(names) + 4):
      res = _propagate(level, {i: frozenset(d) for i, d in seeds.items()})
      if isinstance(res, dict):
        break
      if isinstance(res, str):
        raise RotateError(f"the rotation is not provably exact: {res}")
      want, node = res
      a = node.ins[want.operand]
      hits = _writers(level, a, want.dims)
      if not hits:
        src = f"the output of `{a.producer.prim.name}`" if getattr(a, "producer", None) else "it"
        raise RotateError(f"the rotation is not provably exact: {want} and {src} is neither a "
                          f"parameter seen through re-indexing nor written by parameters that a "
                          f"rotation would rotate [at {node.where()}]")
      if all(set(d) <= seeds.get(i, set()) for i, d in hits.items()):
        raise RotateError(f"the rotation is not provably exact: {want} [at {node.where()}]")
      for i, dims in hits.items():
        # A weight that both reads and writes the stream (a square W in
        # h + f(h) @ W ... read along one dim, written along the other) is
        # rotated along both: Qᵀ·W·Q; the forward pass proves the whole.
        seeds.setdefault(i, set()).update(dims)
    else:
      raise RotateError("the rotation did not settle on a set of parameters")
    norms = sum(1 for x, axis in sites if res.get(x) == Lin(frozenset({axis})))
    if not norms:
      raise RotateError("no norm reads the rotated stream")
  return tuple(sorted((i, tuple(sorted(d))) for i, d in seeds.items())), norms, names


def _stream_widths(fn: Callable, params: Any, args: tuple) -> list:
  """Widths n with a parameter-free RMS norm over an axis of size n (the
  streams a rotation could be proved on), widest first."""
  with kernels.xla_level():
    traced = pipeline.trace(fn, params, args)
  sizes = set()
  with pipeline.analyzer(traced) as an:
    level = an.top
    for node in level.program.nodes:
      try:
        summed = rule_for(node.prim).sums(node, level)
      except Block:
        continue
      if summed is not None and len(summed[1]) == 1 and isinstance(node.ins[summed[0]], Val):
        sizes.add(node.ins[summed[0]].shape[summed[1][0]])
      dd = rule_for(node.prim).contraction(node)
      if dd is not None and len(dd.lc) == 1 and isinstance(node.ins[0], Val):
        sizes.add(node.ins[0].shape[dd.lc[0]])
    return sorted((n for n in sizes if n > 1 and _norm_inputs(level, n)), reverse=True)


def _named(name: str, n: int, seed: int, pca: Optional[Callable[[int], np.ndarray]] = None) -> np.ndarray:
  """The orthogonal matrix a name stands for, of order ``n``."""
  if name == "pca":
    return pca(n)
  if name == "hadamard":
    try:
      return hadamard(n)
    except ValueError as e:
      raise RotateError(f"rotate(..., \"hadamard\"): the stream has width {n}, and {e}; rotate by "
                        "\"random\" (or an explicit orthogonal matrix) instead") from None
  return random_orthogonal(n, jax.random.PRNGKey(seed))


NAMED = ("hadamard", "random", "pca")


def _stream_samples(jaxpr: Any, consts: list, args: list, n: int, out: list) -> list:
  """Evaluates ``jaxpr`` and appends to ``out`` every value, flattened to rows
  of width ``n``, that the program squares along a last axis of size ``n``:
  the inputs of the RMS norms, i.e. the residual stream the rotation acts on.
  Sub-programs (``pjit``, ``custom_jvp_call``) are entered so that norms
  inside jitted functions are seen."""
  env = dict(zip(compat.constvars(jaxpr), consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if compat.is_literal(v) else env[v]   # noqa: E731
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    sub = compat.call_jaxpr_of(eqn)
    if sub is not None:
      outs = _stream_samples(*compat.open_jaxpr(sub), ins, n, out)
    else:
      outs = compat.bind_eqn(eqn, ins)
    x = compat.squared_operand(eqn)
    if x is not None and getattr(x.aval, "shape", ()) and x.aval.shape[-1] == n:
      out.append(np.asarray(read(x), np.float64).reshape(-1, n))
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _pca(fn: Callable, params: Any, calibration: Any, kwargs: dict, n: int) -> np.ndarray:
  """Eigenvectors (columns, largest eigenvalue first) of the second-moment
  matrix ``E[x xᵀ]`` of the stream rows ``x`` at every RMS norm's input over
  the calibration inputs: the rotation that makes the stream's leading
  directions its first channels (SliceGPT's PCA)."""
  batches = [calibration] if isinstance(calibration, tuple) else list(calibration)
  rows: list = []
  for args in batches:
    args = args if isinstance(args, tuple) else (args,)
    closed = jax.make_jaxpr(lambda p, *a: fn(p, *a, **kwargs))(params, *args)
    _stream_samples(*compat.open_jaxpr(closed), jax.tree_util.tree_leaves((params, args)), n, rows)
  if not rows:
    raise RotateError(f"rotate(..., \"pca\"): the calibration inputs reach no RMS norm over a stream of width {n}")
  x = np.concatenate(rows)
  w, v = np.linalg.eigh(x.T @ x / len(x))
  return np.ascontiguousarray(v[:, ::-1])


def _hints(model: Any) -> str:
  """What to change when a rotation fails: the usual causes are a fold that
  was not fused (norms still multiply by γ) and auxiliary centerings (a mean
  over the stream, which a rotation does not commute with)."""
  hints = []
  if isinstance(model.apply_fn, FoldedApply):
    hints.append("the model is folded but not fused: call jaxfold.fuse_affine(folded) first, so "
                 "that the norms keep no γ/β")
  fn = model.apply_fn
  while fn is not None and not isinstance(fn, FoldedApply):
    fn = getattr(fn, "__wrapped__", None)
  if fn is not None:
    report = fn.analysis_for(fn.example_args, kwargs=fn.example_kwargs).report
    if report.num_auxiliary:
      hints.append(rotation_aux_hint(report, not fn.options.tie_by_aux()))
    unfolded = [s for s in report.sites if not s.folded and not s.auxiliary]
    if unfolded:   # a LayerNorm the fold kept still subtracts a mean over the stream
      hints.append(f"the fold left {len(unfolded)} of {len(report.sites)} norm site(s) unfolded (they "
                   f"keep a mean over the stream), e.g. {unfolded[0].where}: {unfolded[0].reason}")
  kept = [s for s in getattr(getattr(model, "report", None), "sites", ()) if getattr(s, "fused", True) is False]
  if kept:         # a norm fuse_affine kept still multiplies the stream by γ
    hints.append(f"fuse_affine kept {len(kept)} norm(s) with their γ/β, e.g. {kept[0].where}: "
                 f"{kept[0].reason}")
  return "".join(f"\n  hint: {h}" for h in hints)


def _apply(x, dims: tuple, q: np.ndarray):
  y = np.asarray(x, np.float64)
  for d in dims:
    y = np.moveaxis(np.tensordot(y, q, axes=([d], [0])), -1, d)
  return jnp.asarray(y.astype(x.dtype))


class _RotateRecord(NamedTuple):
  """A saved rotate step, decoded."""
  size: int
  rotated: tuple    # ((leaf, dims), ...), as _solve's key spells them
  has_q: bool


@register
class RotatedApply(Step):
  """The model's apply function, re-proving the rotation per input signature
  (the program is the model's: only its parameters are rotated)."""

  error = RotateError
  kind = "rotate"

  def __init__(self, fn: Callable, params_abstract: Any, key: tuple, n: int, args: tuple,
               kwargs: Optional[dict] = None, q: Optional[np.ndarray] = None):
    super().__init__(fn, params_abstract, args, kwargs)
    self._key, self._n = key, n
    self._q = q   # the rotation, kept so that save_fold records it
    self.seed(self.bind(args, kwargs), key)

  @property
  def q(self) -> Optional[np.ndarray]:
    """The orthogonal matrix the parameters were rotated by (None: not kept)."""
    return self._q

  def record(self) -> StepRecord:
    info = {"name": self.kind, "size": self._n,
            "rotated": [[int(i), [int(d) for d in dims]] for i, dims in self._key],
            "q": self._q is not None}
    return StepRecord(info, {} if self._q is None else {"rotation": np.asarray(self._q, np.float64)})

  @classmethod
  def parse(cls, info: dict, decode: Callable[[Any], Any]) -> _RotateRecord:
    rotated = tuple((int(i), tuple(int(d) for d in dims)) for i, dims in info["rotated"])
    return _RotateRecord(int(info["size"]), rotated, bool(info.get("q")))

  @classmethod
  def restore(cls, inner: Callable, params: Any, parsed: _RotateRecord, ctx: RestoreContext) -> Restored:
    args = tuple(ctx.args)
    call = pipeline.bind(inner, args, ctx.kwargs, ctx.error)
    key, norms, names = _solve(call.fn, params, call.abstract_args(ctx.error), parsed.size)
    if ctx.verify and key != tuple(sorted((ctx.leaf(i), d) for i, d in parsed.rotated)):
      raise ctx.refuse("rotation (other parameters meet the residual stream)")
    q = ctx.array("rotation") if parsed.has_q else None
    report = RotateReport(tuple((names[i], d) for i, d in key), norms, parsed.size)
    return Restored(cls(inner, params, key, parsed.size, args, ctx.kwargs, q=q), report, None)

  def _analyse(self, call: Call) -> tuple:
    key, _, _ = _solve(call.fn, self._params, call.abstract_args(RotateError), self._n)
    if key != self._key:
      raise RotateError("inputs of these shapes rotate different parameters; call rotate again")
    return key

  def __call__(self, params, *args, **kwargs):
    self._cached(self.bind(args, kwargs))
    return self._inner(params, *args, **kwargs)


def _rotate_named(model: Any, name: str, params: Any, fn: Callable, args: tuple, kwargs: dict, given: tuple,
                  seed: int, size: Optional[int], calibration: Any = None) -> Rotated:
  """``rotate`` by a named matrix of the stream's width: ``size``, or the widest
  width whose stream the rotation is proved on."""
  if name not in NAMED:
    raise RotateError(f"rotate: q must be an orthogonal matrix or one of {NAMED}, got {name!r}")
  if name == "pca" and calibration is None:
    raise RotateError("rotate(..., \"pca\") needs calibration= (example args: a tuple, or a list of tuples)")
  pca = lambda n: _pca(fn, params, calibration, kwargs, n)   # noqa: E731
  if size is not None:
    return rotate(model, _named(name, int(size), seed, pca), *given)
  abstract = pipeline.abstract_tree(params, RotateError)
  call = pipeline.bind(fn, tuple(pipeline.abstract_tree(args, RotateError)), kwargs, RotateError)
  widths = _stream_widths(call.fn, abstract, call.abstract_args(RotateError))
  if not widths:
    raise RotateError(f"rotate(..., {name!r}): no parameter-free RMS norm in the program: fold and "
                      f"fuse_affine the model first{_hints(model)}")
  first: Optional[RotateError] = None
  for n in widths:   # the residual stream is the widest normalized width in every model we know
    try:
      return rotate(model, _named(name, n, seed, pca), *given)
    except RotateError as e:
      first = first or e
  raise first


def rotate(model: Any, q: Any, *example_args: Any, seed: int = 0, size: Optional[int] = None,
           calibration: Any = None) -> Rotated:
  """Rotates the residual stream of a fused model by an orthogonal ``q`` (d×d).

  ``q`` is a matrix, or ``"hadamard"`` (the normalized Hadamard matrix of the
  stream's width, also for widths like 384, 768, 1280: ``jaxfold.hadamard``)
  or ``"random"`` (Haar-random, from ``seed``), which spread outlier channels
  over all channels before quantization (QuaRot), or ``"pca"``: the
  eigenvectors, largest first, of ``E[x xᵀ]`` over the rows ``x`` of every
  value the program squares along the stream axis (the inputs of its RMS
  norms) when run on ``calibration`` (example args: a tuple, or a list of
  tuples) — SliceGPT's rotation. Any orthogonal q is exact, so the choice of
  samples affects only quality, never correctness. A named matrix takes the
  width of the widest stream whose rotation is proved (``size`` to choose).

  Every parameter meeting the stream becomes ``p ×_d q`` along its stream dim
  (writers' outputs, readers' inputs, embeddings, position tables, heads);
  the program is unchanged. Exactness is proved on the traced program:
  everything touching the stream must be a contraction, a sum, a
  re-indexing, or a parameter-free RMS norm over the rotated axis — so fold
  and ``fuse_affine`` first. Raises ``RotateError`` with the reason otherwise.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, flax.linen as nn, jaxfold
    >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(3)])
    >>> x = jnp.ones((2, 4)); p = m.init(jax.random.PRNGKey(0), x)
    >>> fused = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, x))
    >>> q = np.linalg.qr(np.random.default_rng(0).normal(size=(8, 8)))[0]
    >>> r = jaxfold.rotate(fused, q)
    >>> bool(jnp.allclose(r.apply_fn(r.params, x), m.apply(p, x), atol=1e-5))
    True
  """
  given = example_args
  kwargs = pipeline.model_kwargs(model, example_args)
  params, fn, example_args = pipeline.model_parts(
      model, example_args, "rotate takes a model with params and apply_fn (jaxfold.Fused)", RotateError)
  if isinstance(q, str):
    return _rotate_named(model, q, params, fn, tuple(example_args), kwargs, given, seed, size, calibration)
  q = np.asarray(q, np.float64)
  if q.ndim != 2 or q.shape[0] != q.shape[1]:
    raise RotateError(f"q must be a square matrix, got shape {q.shape}")
  if not np.allclose(q.T @ q, np.eye(len(q)), atol=1e-6):
    err = np.abs(q.T @ q - np.eye(len(q))).max()
    raise RotateError(f"q is not orthogonal (max |qᵀq - I| = {err:.2e}); an RMS norm commutes "
                      "only with orthogonal maps")
  args = pipeline.abstract_tree(example_args, RotateError)
  abstract = pipeline.abstract_tree(params, RotateError)
  call = pipeline.bind(fn, tuple(args), kwargs, RotateError)
  try:
    key, norms, names = _solve(call.fn, abstract, call.abstract_args(RotateError), len(q))
  except RotateError as e:
    raise RotateError(f"{e}{_hints(model)}") from None
  leaves, tree = jax.tree_util.tree_flatten(params)
  dims = dict(key)
  new = [_apply(x, dims[i], q) if i in dims else x for i, x in enumerate(leaves)]
  report = RotateReport(tuple((names[i], d) for i, d in key), norms, len(q))
  apply = RotatedApply(fn, abstract, key, len(q), args, kwargs, q=q)
  return Rotated(jax.tree_util.tree_unflatten(tree, new), apply, report)
