"""The fold and ``jaxfold.cbwc``: trace → analyse → plan → rewrite (``jaxfold.fold`` is
``compose.fold``: this fold, then ``fuse_affine``/``defer_norms`` when asked)."""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import Any, Callable, Literal, NamedTuple, Optional, get_args

import jax
import numpy as np

from jaxfold._src import compiled, display, kernels, layout, notices, pipeline
from jaxfold._src.centering import DEFAULT_POLICY, Centered, Centering, CenteringPolicy, UntiedCopy
from jaxfold._src.counts import fold_counts
from jaxfold._src.errors import FoldError
from jaxfold._src.frameworks import flax_linen
from jaxfold._src.pipeline import (
  Call,
  abstract,
  kwargs_text,
  leaves_signature,
  shapes_text,
  shapes_texts,
)
from jaxfold._src.planner import Outcome, PlanConflict, Planner
from jaxfold._src.report import Report
from jaxfold._src.rewrite import CenterAt, ConstantAt, Plan, UntiedUse
from jaxfold._src.step import Params, Result, Step

# The options' values, as types: a type checker sees a misspelt value, and
# FoldOptions refuses it naming the allowed ones.
TiedWeights = Literal["auto", "copy", "auxiliary"]
NormImpl = Literal["auto", "xla", "pallas", "interpret"]   # == kernels.IMPLS


def _check_choice(name: str, value: Any, choices: Any) -> None:
  allowed = get_args(choices)
  if not isinstance(value, str) or value not in allowed:
    raise FoldError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


@dataclasses.dataclass(frozen=True)
class FoldOptions:
  """The options of one fold (persisted whole with a saved fold)."""
  auxiliary_centering: bool = True
  tied_weights: TiedWeights = "auto"
  through_dropout: bool = False  # CBWC only: fold across dropout masks (inexact)
  norm_impl: NormImpl = "auto"   # how folded norms run
  # fold only: also prove an example's size-1 axes made 2 (load_fold redoes the fold alike)
  generic_shapes: bool = True

  def __post_init__(self):
    # The one validation of options: fold, cbwc, load_fold and the CLI all build these.
    for name in ("auxiliary_centering", "through_dropout", "generic_shapes"):
      if not isinstance(getattr(self, name), bool):
        raise FoldError(f"{name} must be True or False, got {getattr(self, name)!r}")
    _check_choice("tied_weights", self.tied_weights, TiedWeights)
    _check_choice("norm_impl", self.norm_impl, NormImpl)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "FoldOptions":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
      raise FoldError(f"unknown fold options {sorted(unknown)}; known: {sorted(known)}")
    return cls(**d)

  def tie_by_aux(self) -> bool:
    if self.tied_weights == "auto":
      return self.auxiliary_centering
    return self.tied_weights == "auxiliary" and self.auxiliary_centering


# ----------------------------------------------------------------------------
# Tracing and input checks.


def _check_params(params: Any) -> list:
  paths_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  if not paths_leaves:
    raise FoldError("params has no array leaves: pass the model's parameter pytree "
                    "(e.g. the dict returned by module.init, or nnx.state(model)).")
  for path, leaf in paths_leaves:
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      raise FoldError(f"params leaf {jax.tree_util.keystr(path)} is a {type(leaf).__name__} "
                      f"({leaf!r:.60}), not an array: params must be a pytree of arrays or "
                      "jax.ShapeDtypeStruct.")
  return paths_leaves


# ----------------------------------------------------------------------------
# Analysis and planning.


@dataclasses.dataclass(frozen=True)
class Analysis:
  jaxpr: Any
  consts: list
  out_tree: Any
  plan: Plan
  leaf_specs: tuple[Centered, ...]     # parameters centered in place
  untied: tuple[UntiedCopy, ...]       # centered copies of parameters, by name
  report: Report

  @property
  def param_key(self) -> tuple:
    return (self.leaf_specs, tuple((n, i, s) for n, i, s in self.untied))


def analyse(apply_fn: Callable, params: Any, args: tuple, opts: FoldOptions,
            cbwc: bool = False, fixed: Optional[tuple] = None, later: Optional[str] = None) -> Analysis:
  """Traces ``apply_fn`` at abstract params/args and plans the fold; with
  ``fixed`` (another analysis' ``param_key``) the plan keeps exactly those
  centered parameters or raises ``PlanConflict``. ``later``: ``args`` are a
  later call's, described so (``pipeline.trace``'s message names them)."""
  _check_params(params)
  # One collector pause for the trace and the analysis (pipeline.no_gc): the
  # analysis' object graph is garbage before the collector runs again, so
  # the next collection frees it young instead of promoting it alive.
  with pipeline.no_gc():
    traced = pipeline.trace(apply_fn, pipeline.abstract_tree(params), pipeline.abstract_tree(args),
                            error=FoldError, later=later)
    key = (opts, cbwc, traced.names, fixed)
    cached = _ANALYSES.get(traced.closed, key)
    if cached is not None:
      return cached
    with pipeline.analyzer(traced, cbwc=cbwc, through_dropout=opts.through_dropout) as an:
      planner = Planner(an, list(traced.names), opts, fixed=fixed).run()
      outcome = planner.outcome()
      plan, kernel_sites = _plan(outcome, opts)
      report = planner.report(kernel_sites).on_platform(jax.default_backend(), kernels.may_use_kernel(opts.norm_impl))
    result = Analysis(traced.jaxpr, traced.consts, traced.out_tree, plan,
                      tuple(Centered(*x) for x in outcome.leaf_specs),
                      tuple(UntiedCopy(*x) for x in outcome.untied_specs), report)
    del planner, outcome, an
  _ANALYSES.put(traced.closed, key, result)
  return result


class _AnalysisCache:
  """Analyses of the last few programs, keyed by the traced jaxpr's identity.

  jax's tracing cache hands back the *same* ClosedJaxpr object when the same
  function is traced at the same abstract inputs and config, so identity means
  the same program: a later fold of it reuses the (immutable) analysis. The
  entry holds a weak reference to check that identity, and the cache is
  small, so it keeps few programs alive beyond jax's own cache.
  """

  def __init__(self, size: int = 8):
    self.size = size
    self.entries: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()   # another thread's put may evict between get and move_to_end

  def get(self, closed: Any, key: tuple) -> Optional[Analysis]:
    with self._lock:
      entry = self.entries.get((id(closed), key))
      if entry is None or entry[0]() is not closed:
        return None
      self.entries.move_to_end((id(closed), key))
      return entry[1]

  def put(self, closed: Any, key: tuple, analysis: Analysis) -> None:
    with self._lock:
      self.entries[(id(closed), key)] = (weakref.ref(closed), analysis)
      while len(self.entries) > self.size:
        self.entries.popitem(last=False)


_ANALYSES = _AnalysisCache()


def _plan(outcome: Outcome, opts: FoldOptions) -> tuple:
  """The rewrite's instructions, built from the planner's frozen outcome and
  keyed by call-site paths, and the indices of the sites whose epilogue the
  kernel may run."""
  folded = outcome.folded
  zero = frozenset(r.path for e in folded for r in e.site.reduces)
  epilogues, kernel_sites = [], set()
  if kernels.may_use_kernel(opts.norm_impl):
    changed = frozenset(k for k, _ in outcome.aux + outcome.aux_constants)
    for e in folded:
      ep, _ = kernels.prove_epilogue(e.site, changed=changed)
      if ep is not None:
        epilogues.append(ep)
        kernel_sites.add(e.index)
  return Plan(zero=zero, aux=tuple(CenterAt(*a) for a in outcome.aux),
              consts=tuple(CenterAt(*c) for c in outcome.consts),
              untied=tuple(UntiedUse(*u) for u in outcome.untied),
              constants=tuple(ConstantAt(*c) for c in outcome.aux_constants),
              epilogues=tuple(epilogues), norm_impl=opts.norm_impl), frozenset(kernel_sites)


# ----------------------------------------------------------------------------
# One plan for every input shape.
#
# A fold's parameters serve every later call, so which parameters are
# centered must not depend on the example's sizes: a size-1 axis (batch 1,
# one token) makes a broadcast look like a real axis, and a decision proved at
# one length can fail at another. An example with size-1 axes is therefore
# also analysed with them made 2, and the fold keeps parameters both prove.
# Each concrete shape is analysed and proved on its own (the evaluated plan is
# always that shape's), with the fold's parameters fixed
# (``analyse(..., fixed=...)``): the same plan, or a FoldError naming both
# shapes. (A proof at symbolic shapes, ``jax.export.symbolic_shape``, is
# weaker: reshapes that merge symbolic dims cannot be grouped, so it cannot
# refute a concrete plan, and it is not used to choose one.)


def _compatible(an: Analysis, base: Analysis) -> bool:
  """``an`` runs with ``base``'s folded parameters (extra untied copies unused)."""
  return an.leaf_specs == base.leaf_specs and set(an.untied) <= set(base.untied)


def _probe_args(args: tuple) -> Optional[tuple]:
  """``args`` with every size-1 dim made 2 (None: none is size 1)."""
  leaves, tree = jax.tree_util.tree_flatten(args)
  if not any(1 in np.shape(x) for x in leaves):
    return None
  return jax.tree_util.tree_unflatten(tree, [
      jax.ShapeDtypeStruct(tuple(2 if n == 1 else n for n in np.shape(x)), pipeline.dtype_of(x)) for x in leaves])


def _param_diff(a: Analysis, b: Analysis, params: Any, a_name: str, b_name: str) -> str:
  """Which parameters one plan centers and the other does not."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]

  def label(i, spec):
    path, x = leaves[i]
    return f"{jax.tree_util.keystr(path)}{layout.fmt_spec(dict(spec), np.shape(x))}"

  def items(an):
    return ({f"{label(i, s)} in place" for i, s in an.leaf_specs}
            | {f"{label(i, s)} as an untied copy" for _, i, s in an.untied})
  ia, ib = items(a), items(b)
  parts = [f"centered only at {w}: {', '.join(sorted(x))}" for w, x in ((a_name, ia - ib), (b_name, ib - ia)) if x]
  return "; ".join(parts) or "the same parameters"


def _check_fixed(apply_fn: Callable, params: Any, args: tuple, opts: FoldOptions, fixed: tuple) -> None:
  """Raises ``PlanConflict`` unless the centerings ``fixed`` (another
  analysis' ``param_key``) are invisible at ``args``: the proof that
  ``analyse(..., fixed=fixed)`` starts with, without planning the sites."""
  with pipeline.no_gc():   # as in analyse: the check's graph is garbage when the collector resumes
    traced = pipeline.trace(apply_fn, pipeline.abstract_tree(params), pipeline.abstract_tree(args),
                            error=FoldError)
    with pipeline.analyzer(traced, through_dropout=opts.through_dropout) as an:
      Planner(an, list(traced.names), opts, fixed=fixed).check_fixed()
    del an, traced


def _reconcile(call: Call, params: Any, opts: FoldOptions, an: Analysis) -> Analysis:
  """The example's analysis with parameters that its shape with no size-1
  axes proves too (batch 1 and one token are where broadcasts and real axes
  look alike)."""
  gargs = _probe_args(call.args)
  if gargs is None:
    return an
  # The example's plan, proved at the probe shapes: what settles the usual
  # case, and cheaper than the probe's own analysis (no site decisions).
  try:
    _check_fixed(call.fn, params, gargs, opts, an.param_key)
    return an
  except PlanConflict as e:
    first = str(e)
  except Exception:  # noqa: BLE001 - the probe shape is no valid input: nothing to compare
    return an
  try:
    gan = analyse(call.fn, params, gargs, opts)
  except Exception:  # noqa: BLE001 - as above
    return an
  if _compatible(gan, an) and _compatible(an, gan):
    return an
  idle = None
  try:   # else the probe's plan, proved at the example's shapes
    fx = analyse(call.fn, params, call.args, opts, fixed=gan.param_key)
    if fx.report.num_folded or not (fx.leaf_specs or fx.untied):
      return fx
    # It folds nothing at the example, yet its centerings (for the probe's
    # sites alone) can fail at shapes that centering less serves.
    idle, second = fx, "it folds no site there"
  except PlanConflict as e:
    second = str(e)
  # Else the parameters both center alike (each proved invisible at both).
  common = (tuple(x for x in an.leaf_specs if x in gan.leaf_specs),
            tuple(x for x in an.untied if x in gan.untied))
  try:
    analyse(call.fn, params, gargs, opts, fixed=common)
    return analyse(call.fn, params, call.args, opts, fixed=common)
  except PlanConflict:
    pass
  if idle is not None:
    return idle
  ex, ge = f"the example's shapes ({shapes_text(call.args)})", f"shapes ({shapes_text(gargs)})"
  raise FoldError(
      f"no one fold serves every input shape: {ex} and {ge} need different folded parameters "
      f"({_param_diff(an, gan, params, 'the example', 'the other shapes')}). The example's plan "
      f"fails at the other shapes ({first}); theirs fails at the example ({second}). "
      "Fold at the shapes you will call with, or use jaxfold.cbwc, which centers per call.")


# ----------------------------------------------------------------------------
# Public entry points.


class FoldedApply(Step):
  """The folded apply function (the fold step, the root of a chain); re-analyses
  (and caches) per input signature and per value of static keyword arguments
  (``train=True``); array keyword arguments (``rngs={"dropout": key}``) are
  traced like positional ones. With ``center_in_forward`` it is CBWC's: it
  takes the original parameters and centers them per call."""

  error = FoldError
  kind = "fold"
  root = True

  def __init__(self, apply_fn, params_abstract, params_tree, opts, base: Analysis, call: Call,
               center_in_forward: bool, example_args: tuple = (), example_kwargs: Optional[dict] = None,
               example_only: bool = False):
    super().__init__(apply_fn, params_abstract, example_args, example_kwargs)
    self._tree = params_tree
    self._opts = opts
    self._base = base
    self._param_sig = leaves_signature(jax.tree_util.tree_leaves(params_abstract))
    self._center = center_in_forward
    self._example_only = example_only   # fold(generic_shapes=False) at an example with a size-1 axis
    self.seed(call, base)

  @property
  def options(self) -> FoldOptions:
    return self._opts

  @property
  def example_analysis(self) -> Analysis:
    """The analysis made at the example: the plan the parameters were centered for."""
    return self._base

  @property
  def unties(self) -> bool:
    """The fold made untied centered copies of parameters."""
    return bool(self._base.untied)

  def saveable(self) -> bool:
    return not self._center   # CBWC's parameters are the user's: there is no fold to save

  @property
  def params_treedef(self) -> Any:
    """The tree structure of the parameters this function takes."""
    return self._tree

  def analysis_for(self, args: tuple, kwargs: Optional[dict] = None) -> Analysis:
    """The analysis of a call with these arguments (cached per signature)."""
    return self._analysis_with(self.bind(args, kwargs), None, kwargs)

  def _analysis_with(self, call: Call, leaves: Optional[list], kwargs: Optional[dict]) -> Analysis:
    """The cached analysis of ``call`` with parameters of these leaves' avals
    (None: the fold's own), keyed by their signature where it differs."""
    psig = None
    if leaves is not None:
      psig = leaves_signature(leaves)
      if psig == self._param_sig:
        psig = None
    return self._cached(call, psig, lambda: self._analyse_with(call, leaves, psig, kwargs))

  def _analyse_with(self, call: Call, leaves: Optional[list], psig: Any, kwargs: Optional[dict]) -> Analysis:
    """A new analysis of ``call`` with those parameters, proved to keep the fold's centerings."""
    params = self._params
    if psig is not None:
      params = jax.tree_util.tree_unflatten(self._tree, [abstract(x) for x in leaves])
    made = "cbwc" if self._center else "fold"
    here, example = shapes_texts(call.args, self._example)
    at = f"shapes {here}; {made}() was given {example}"
    an = analyse(call.fn, params, call.args, self._opts, cbwc=self._center, later=at)
    # CBWC centers in the forward pass, per analysis; a fold's parameters are fixed.
    if not self._center and not _compatible(an, self._base):
      try:   # the fold's parameters, proved at these shapes
        an = analyse(call.fn, params, call.args, self._opts, fixed=self._base.param_key)
      except PlanConflict as e:
        what = "parameters of these shapes/dtypes" if psig is not None else (
            "inputs of these shapes" + (" and dtypes" if here != shapes_text(call.args) else ""))
        if kwargs:
          what += f" with keyword arguments {kwargs_text(kwargs)}"
        raise FoldError(
            f"{what} ({here}) need different folded parameters than the "
            f"example that fold() was given ({example}): "
            f"{_param_diff(self._base, an, self._params, 'the example', 'these inputs')}; the fold's "
            f"parameters fail here: {e}. (A different set of parameters or axes can be "
            "centered; e.g. in training mode dropout makes centering visible.) Call "
            "jaxfold.fold again with these arguments (example_kwargs= for keyword ones), or "
            "use jaxfold.cbwc, whose apply_fn takes the original parameters, for training."
            + (" This fold was made with generic_shapes=False: with the default (True) it also "
               "proves the example's size-1 axes made 2, choosing parameters that serve both."
               if self._example_only else "")) from None
    return an

  def __call__(self, params, *args, **kwargs):
    extras = {}
    if self._center:
      tree = params
    else:
      if not isinstance(params, Params):
        raise FoldError(
            f"a folded apply_fn takes folded.params (a jaxfold.Params), got "
            f"{type(params).__name__}: the original parameters would compute a different "
            "function here; pass the .params of the fold")
      tree, extras = params.params, params.extras
    leaves, tree_def = jax.tree_util.tree_flatten(tree)
    if tree_def != self._tree:
      raise FoldError(f"params has structure {tree_def}, but the fold was made for {self._tree}")
    call = self.bind(args, kwargs)
    an = self._analysis_with(call, leaves, kwargs)
    if self._center:
      # CBWC: the stored parameters stay W; the forward pass uses P·W.
      specs = dict(an.leaf_specs)
      src = list(leaves)
      leaves = [layout.center(x, dict(specs[i])) if i in specs else x for i, x in enumerate(src)]
      extras = {name: layout.center(src[i], dict(spec)) for name, i, spec in an.untied}
    flat = list(leaves) + jax.tree_util.tree_leaves(call.args)
    outs = compiled.run(an, flat, extras)   # eager: one compiled program per shape, not one per primitive
    return jax.tree_util.tree_unflatten(an.out_tree, outs)


FoldedParams = Params   # deprecated: every result's parameters are a jaxfold.Params


class Folded(Result):
  """Result of :func:`fold` (a ``step.Result``): ``apply_fn(params, *args)``
  computes the original; ``params`` is a :class:`Params` (``extras``: the untied
  centered copies), ``report`` a ``Report``."""
  __slots__ = ()
  __repr__ = display.result_repr


class Reparameterized(NamedTuple):
  """Result of :func:`cbwc`: ``apply_fn`` takes the *original* parameters.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxfold
    >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm()])
    >>> x = jnp.ones((2, 4)); p = m.init(jax.random.PRNGKey(0), x)
    >>> [(i, dict(spec)) for i, spec in jaxfold.cbwc(p, m.apply, x).leaf_specs]
    [(0, {0: 8}), (1, {1: 8})]
  """
  apply_fn: Callable
  report: Report

  @property
  def leaf_specs(self) -> tuple:
    """``((leaf index, ((dim, block), ...)), ...)``: the parameter leaves the
    forward pass centers, and along which dims (what ``optax_transforms`` take)."""
    return self.apply_fn.example_analysis.leaf_specs


def _refuse_traced(params: Any) -> None:
  """fold computes new parameter values on the host: traced params (fold called
  inside jax.jit, grad, vmap, ...) have none."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if isinstance(leaf, jax.core.Tracer):
      raise FoldError(
          f"jaxfold.fold was called under a jax transformation (jit, grad, vmap, ...): params "
          f"leaf {jax.tree_util.keystr(path)} is a tracer ({leaf.aval.str_short()}), not an "
          "array. Call fold outside jit, once, on the concrete parameters, and jit the result "
          "(jax.jit(folded.apply_fn)); inside a traced training step use jaxfold.cbwc, whose "
          "apply_fn takes the original params.")


def fold(params: Any, apply_fn: Callable, *example_args: Any,
         auxiliary_centering: bool = True, tied_weights: TiedWeights = "auto",
         norm_impl: NormImpl = "auto", example_kwargs: Optional[dict] = None,
         generic_shapes: bool = True, centering: CenteringPolicy = DEFAULT_POLICY) -> Folded:
  """The fold alone: ``jaxfold.fold`` without ``fuse_affine``/``defer_norms``
  (``compose.fold`` composes those on this result; the arguments are its own;
  ``centering``: where the centered parameters are computed, see ``centering.py``).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jaxfold._src import fold
    >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm()])
    >>> x = jnp.ones((2, 4)); p = m.init(jax.random.PRNGKey(0), x)
    >>> fold.fold(p, m.apply, x).report.num_folded
    1
  """
  opts = FoldOptions(auxiliary_centering, tied_weights, norm_impl=norm_impl, generic_shapes=generic_shapes)
  if not callable(apply_fn):
    raise FoldError(f"apply_fn must be callable, got {type(apply_fn).__name__}")
  _refuse_traced(params)
  call = pipeline.bind(apply_fn, example_args, example_kwargs)
  leaves, tree = jax.tree_util.tree_flatten(params)
  # The example's plan is almost always the fold's: its parameters center on
  # worker threads while the other shapes are proved.
  engine = Centering(leaves, centering)
  try:
    with pipeline.no_gc(), pipeline.trace_session():   # one collector pause, one trace memo for both shapes
      first = analyse(call.fn, params, call.args, opts)
      engine.start(first.leaf_specs, first.untied)
      an = _reconcile(call, params, opts, first) if opts.generic_shapes else first
  except BaseException:
    engine.cancel()
    raise
  notices.warn_after_fold(first, len(leaves))
  flax_linen.refuse_as_variables(Params)   # model.apply(folded.params): our message, not flax's
  new_leaves, extras = engine.result(an.leaf_specs, an.untied)
  new_params = Params(jax.tree_util.tree_unflatten(tree, new_leaves), extras)
  fn = FoldedApply(apply_fn, pipeline.abstract_tree(params), tree, opts, an, call, False, example_args,
                   example_kwargs, example_only=not opts.generic_shapes and _probe_args(call.args) is not None)
  # report.diff() counts the two programs (traced on first use)
  report = dataclasses.replace(an.report, programs=fold_counts(call, params, fn, new_params, example_args,
                                                               example_kwargs))
  return Folded(new_params, fn, report)


def cbwc(params: Any, apply_fn: Callable, *example_args: Any,
         auxiliary_centering: bool = True, tied_weights: TiedWeights = "auto",
         through_dropout: bool = False, example_kwargs: Optional[dict] = None) -> Reparameterized:
  """Column-centered weights for training (CBWC): same function, cheaper norms.

  ``r.apply_fn(params, *args)`` equals ``apply_fn(params, *args)`` for every
  value of ``params`` with the traced structure: it centers the weights in
  the forward pass (V = P·W) and runs the folded program, so gradients and
  optimizer trajectories are those of the original model.

  Dropout between a linear layer and its norm (in training mode) makes the
  norm's input not zero-mean, so such sites stay LayerNorms by default.
  ``through_dropout=True`` folds them anyway (the paper's practical training
  setting); they are then reported with ``exact=False``.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxfold
    >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm()])
    >>> x = jnp.ones((2, 4)); p = m.init(jax.random.PRNGKey(0), x)
    >>> r = jaxfold.cbwc(p, m.apply, x)
    >>> bool(jnp.allclose(r.apply_fn(p, x), m.apply(p, x), atol=1e-5))
    True
  """
  opts = FoldOptions(auxiliary_centering, tied_weights, through_dropout)
  if not callable(apply_fn):
    raise FoldError(f"apply_fn must be callable, got {type(apply_fn).__name__}")
  call = pipeline.bind(apply_fn, example_args, example_kwargs)
  an = analyse(call.fn, params, call.args, opts, cbwc=True)
  _, tree = jax.tree_util.tree_flatten(params)
  fn = FoldedApply(apply_fn, pipeline.abstract_tree(params), tree, opts, an, call, True, example_args,
                   example_kwargs)
  return Reparameterized(fn, an.report)
