"""``jaxfold.fold`` and ``jaxfold.cbwc``: trace → analyse → plan → rewrite."""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfold._src import compat
from jaxfold._src import kernels
from jaxfold._src import layout
from jaxfold._src.analysis import Constancy, Propagator, seed_poly, shape_of
from jaxfold._src.graph import Graph
from jaxfold._src.planner import Blocker, LeafNeed, Walker, find_sites, nested_sites
from jaxfold._src.report import Centering, Report, Site
from jaxfold._src.rewrite import Plan, evaluate
from jaxfold._src.symbolic import Unsupported


class FoldError(ValueError):
  """Bad input to fold/cbwc; the message names the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class FoldOptions:
  """The options of one fold (persisted whole with a saved fold)."""
  auxiliary_centering: bool = True
  tied_weights: str = "auto"     # "auto" | "copy" | "auxiliary"
  through_dropout: bool = False  # CBWC only: fold across dropout masks (inexact)
  norm_impl: str = "auto"        # folded norms: "auto" | "xla" | "pallas" | "interpret"

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


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise FoldError(f"expected an array or jax.ShapeDtypeStruct, got {type(x).__name__}: {x!r:.80}")
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)
                              if isinstance(x, jax.Array) else None)


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


def _trace(apply_fn: Callable, params: Any, args: tuple):
  try:
    return jax.make_jaxpr(apply_fn, return_shape=True)(params, *args)
  except FoldError:
    raise
  except Exception as e:  # noqa: BLE001 - re-raised with context below
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise FoldError(
        f"could not trace apply_fn(params, *example_args): {type(e).__name__}: {first}\n"
        "jaxfold analyses the function's jaxpr, so apply_fn must be traceable by jax "
        "(no Python control flow on array values, no numpy conversion of inputs) and "
        "params/example_args must be what apply_fn expects (same pytree structure and shapes)."
    ) from e


# ----------------------------------------------------------------------------
# Analysis and planning.


@dataclasses.dataclass(frozen=True)
class Analysis:
  jaxpr: Any
  consts: list
  out_tree: Any
  plan: Plan
  leaf_specs: tuple      # ((leaf index, spec tuple), ...)
  untied: tuple          # ((name, leaf index, spec tuple), ...)
  report: Report

  @property
  def param_key(self) -> tuple:
    return (self.leaf_specs, tuple((n, i, s) for n, i, s in self.untied))


def analyse(apply_fn: Callable, params: Any, args: tuple, opts: FoldOptions) -> Analysis:
  paths_leaves = _check_params(params)
  abstract_params = jax.tree_util.tree_map(_abstract, params)
  abstract_args = jax.tree_util.tree_map(_abstract, args)
  closed, out_shape = _trace(apply_fn, abstract_params, abstract_args)
  jaxpr, consts = compat.open_jaxpr(closed)
  graph = Graph(closed, consts)
  names = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
  leaf_index = {graph.invars[i]: i for i in range(len(paths_leaves))}
  planner = _Planner(graph, leaf_index, names, opts)
  planner.run()
  return Analysis(jaxpr, consts, jax.tree_util.tree_structure(out_shape), planner.plan(),
                  planner.leaf_specs(), planner.untied_specs(), planner.report())


class _Planner:
  """Decides per site; keeps the commitments that later sites must respect."""

  def __init__(self, graph: Graph, leaf_index: dict, names: list, opts: FoldOptions):
    self.g = graph
    self.leaf_index = leaf_index
    self.names = names
    self.opts = opts
    self._constancies: dict = {}
    self.constancy = self.constancy_of(graph)
    self.prop = Propagator(graph, self.constancy, self.constancy_of)
    self.walker = Walker(graph, self.constancy_of, set(leaf_index))
    self.sites = [s for g in self.walker.graphs() for s in find_sites(g)]
    self.leaf_commit: dict = {}       # var -> spec (in place / constants)
    self.untie_commit: dict = {}      # (use node index, operand) -> LeafNeed
    self.aux_commit: dict = {}        # var -> spec
    self.results: dict = {}           # site index -> (folded, reason, centered, aux)
    self._vis: dict = {}
    self._inexact = False
    self._ties_by_copy = False

  def constancy_of(self, g: Graph) -> Constancy:
    if g not in self._constancies:
      self._constancies[g] = Constancy(g, random_is_constant=self.opts.through_dropout)
    return self._constancies[g]

  @property
  def random_uses(self) -> int:
    return sum(c.random_uses for c in self._constancies.values())

  def _top(self, var) -> bool:
    return var in self.g.producer or var in self.g.invars or var in self.g.const_values

  # -- invisibility checks, cached -------------------------------------------

  def _visible(self, key, seeds_fn):
    if key not in self._vis:
      before = self.random_uses
      seeds, skip = seeds_fn()
      reason = self.prop.invisible(seeds, skip)
      self._vis[key] = (reason, self.random_uses > before)
    reason, used_random = self._vis[key]
    self._inexact |= used_random and reason is None
    return reason

  def leaf_visible(self, var, spec):
    return self._visible(("leaf", var, spec),
                         lambda: ({var: seed_poly(shape_of(var), dict(spec))}, frozenset()))

  def use_visible(self, need: LeafNeed):
    node, k = need.use
    if not self._top(node.outvars[0]):
      return "an untied copy would be needed inside a loop body"

    def seeds():
      poly = seed_poly(shape_of(need.var), dict(need.spec))
      for cnode in reversed(need.chain):
        poly = self.prop.seed_through(cnode, 0, poly)[0]
        if poly is None:
          return {}, frozenset()
      outs = self.prop.seed_through(node, k, poly)
      return ({v: p for v, p in zip(node.outvars, outs) if p is not None},
              frozenset({node.index}))
    try:
      return self._visible(("use", node.index, k, need.spec), seeds)
    except Unsupported as e:  # the use itself does not carry the shift
      return str(e)

  def aux_visible(self, var, spec):
    if not self._top(var):
      return "auxiliary centerings are only inserted outside loop bodies"
    return self._visible(("aux", var, spec),
                         lambda: ({var: seed_poly(shape_of(var), dict(spec))}, frozenset()))

  # -- per site ---------------------------------------------------------------

  def _name(self, var) -> str:
    if var in self.leaf_index:
      return self.names[self.leaf_index[var]]
    return f"<captured constant {shape_of(var)}>"

  def evaluate(self, site, assume_aux: dict):
    shape = shape_of(site.input)
    before = self.random_uses
    self._inexact = False
    needs = self.walker.needs(site.input, layout.full_spec(shape, site.axes), site.graph)
    self._inexact |= self.random_uses > before
    actions, blockers = [], []
    for n in needs:
      if isinstance(n, Blocker):
        if assume_aux.get(n.var) == n.spec:
          actions.append(("aux", n.var, n.spec))
        else:
          blockers.append(n)
        continue
      var, spec = n.var, n.spec
      if not jnp.issubdtype(compat.aval(var).dtype, jnp.inexact):
        blockers.append(Blocker(n.out_var, n.out_spec, f"{self._name(var)} is not a float array"))
        continue
      if var in self.leaf_commit:
        if self.leaf_commit[var] == spec:
          actions.append(("leaf", var, spec))
        else:
          blockers.append(Blocker(n.out_var, n.out_spec,
                                  f"{self._name(var)} is already centered over other axes for another site"))
        continue
      reason = self.leaf_visible(var, spec)
      if reason is None:
        actions.append(("leaf", var, spec))
        continue
      use_key = (n.use[0].index, n.use[1]) if n.use else None
      if n.use is not None and var in self.leaf_index and (
          use_key in self.untie_commit or self.use_visible(n) is None):
        if self.opts.tie_by_aux() and not self._ties_by_copy:
          if assume_aux.get(n.out_var) == n.out_spec:
            actions.append(("aux", n.out_var, n.out_spec))
          else:
            blockers.append(Blocker(n.out_var, n.out_spec,
                                    f"{self._name(var)} is also used where centering it is visible "
                                    f"({reason}); an auxiliary centering or an untied copy would fold it"))
        else:
          actions.append(("untie", n))
        continue
      blockers.append(Blocker(n.out_var, n.out_spec,
                              f"centering {self._name(var)} over {layout.fmt_spec(dict(spec), shape_of(var))} "
                              f"would change the output: {reason}"))
    return actions, blockers

  def commit(self, site_idx, site, actions, aux_new=()):
    centered = []
    for a in actions:
      if a[0] == "leaf":
        _, var, spec = a
        self.leaf_commit[var] = spec
        mode = "in place" if var in self.leaf_index else "constant"
        centered.append(Centering(self._name(var), layout.fmt_spec(dict(spec), shape_of(var)), mode,
                                  spec=tuple(sorted(dict(spec).items()))))
      elif a[0] == "untie":
        n = a[1]
        self.untie_commit[(n.use[0].index, n.use[1])] = n
        nbytes = int(np.prod(shape_of(n.var))) * compat.aval(n.var).dtype.itemsize
        centered.append(Centering(self._name(n.var), layout.fmt_spec(dict(n.spec), shape_of(n.var)),
                                  "untied copy", nbytes, spec=tuple(sorted(dict(n.spec).items()))))
      elif a[0] == "aux":
        self.aux_commit[a[1]] = a[2]
    aux = any(a[0] == "aux" for a in actions)
    reason = "input is zero-sum over the normalized axes"
    reason += " after an auxiliary centering" if aux else (" after centering" if centered else "")
    if self._inexact:
      reason += " (INEXACT: a dropout mask was treated as constant, as through_dropout=True asks)"
    self.results[site_idx] = (True, reason, tuple(dict.fromkeys(centered)), aux, not self._inexact)

  def run(self):
    failed = {}
    for i, site in enumerate(self.sites):
      actions, blockers = self.evaluate(site, {})
      if blockers:
        failed[i] = blockers
      else:
        self.commit(i, site, actions)
    if self.opts.auxiliary_centering and failed:
      self._auxiliary(failed)
    if self.opts.tie_by_aux() and self.opts.tied_weights == "auto":
      # Where an auxiliary centering would not pay for itself, a tied
      # parameter is still worth untying by a centered copy.
      self._ties_by_copy = True
      for i in sorted(failed):
        if i not in self.results:
          actions, blockers = self.evaluate(self.sites[i], dict(self.aux_commit))
          if not blockers:
            self.commit(i, self.sites[i], actions)
    for i, blockers in failed.items():
      if i not in self.results:
        self.results[i] = (False, "input is not zero-sum: " + self._explain(blockers[0]), (), False, True)

  def _auxiliary(self, failed):
    # A centering inserted at value v (one reduction) pays off when it lets
    # at least two sites drop theirs.
    counts = collections.Counter()
    for blockers in failed.values():
      for b in {(b.var, b.spec) for b in blockers}:
        if compat.is_var(b[0]):
          counts[b] += 1
    chosen: dict = {}
    for (var, spec), n in counts.most_common():
      if n < 2 or self.aux_visible(var, spec) is not None:
        continue
      trial = dict(chosen)
      trial[var] = spec
      gain = [i for i, bl in failed.items() if i not in self.results and
              all(trial.get(b.var) == b.spec for b in bl)]
      if len(gain) >= 2 or (chosen and gain):
        chosen = trial
    if not chosen:
      return
    for i in sorted(failed):
      if i in self.results:
        continue
      actions, blockers = self.evaluate(self.sites[i], chosen)
      if not blockers:
        self.commit(i, self.sites[i], actions)

  # -- outputs -----------------------------------------------------------------

  def plan(self) -> Plan:
    zero = frozenset(r.path for i, s in enumerate(self.sites) if self.results[i][0] for r in s.reduces)
    used_aux = self.aux_commit
    aux = tuple((self.g.var_key(v), tuple(sorted(dict(s).items()))) for v, s in used_aux.items())
    consts = tuple((self.g.const_keys[v], s) for v, s in self.leaf_commit.items()
                   if v in self.g.const_keys)
    untied = tuple((n.use[0].path, n.use[1], self._untied_name(n),
                    tuple(c.eqn for c in reversed(n.chain))) for n in self.untie_commit.values())
    epilogues = []
    leaf_or_const = lambda v: v if (v in self.leaf_index or v in self.g.const_values) else None
    for i, site in enumerate(self.sites):
      if self.results[i][0] and site.graph is self.g:
        ep = kernels.match_epilogue(self.g, site, leaf_or_const)
        if ep is not None:
          epilogues.append(ep)
    return Plan(zero=zero, aux=aux, consts=consts, untied=untied, epilogues=tuple(epilogues),
                norm_impl=self.opts.norm_impl)

  def _untied_name(self, n: LeafNeed) -> str:
    # Named by parameter and axes, not by equation position, so the same
    # folded params serve every input signature (and uses share one copy).
    return f"{self._name(n.var)}@centered{layout.fmt_spec(dict(n.spec), shape_of(n.var))}"

  def leaf_specs(self) -> tuple:
    return tuple(sorted((self.leaf_index[v], s) for v, s in self.leaf_commit.items()
                        if v in self.leaf_index))

  def untied_specs(self) -> tuple:
    return tuple(sorted({(self._untied_name(n), self.leaf_index[n.var], n.spec)
                         for n in self.untie_commit.values()}))

  def report(self) -> Report:
    sites = []
    for i, s in enumerate(self.sites):
      folded, reason, centered, aux, exact = self.results[i]
      sites.append(Site(index=len(sites), where=s.node.module() or s.node.source(),
                        shape=shape_of(s.input), axes=s.axes, folded=folded, reason=reason,
                        centered=centered, auxiliary=aux, num_reductions=len(s.reduces),
                        exact=exact, source=s.node.source()))
    for loop, s in nested_sites(self.g):
      sites.append(Site(index=len(sites), where=s.node.module() or s.node.source(),
                        shape=shape_of(s.input), axes=s.axes, folded=False,
                        reason=f"inside a `{loop.prim.name}` body, which the analysis does not enter yet",
                        num_reductions=len(s.reduces), source=s.node.source()))
    aux = tuple(f"{shape_of(v)} over {layout.fmt_spec(dict(s), shape_of(v))} at "
                f"{self._where(v)}" for v, s in self.aux_commit.items())
    copies = {(n.var, n.spec) for n in self.untie_commit.values()}
    untied = sum(int(np.prod(shape_of(v))) * compat.aval(v).dtype.itemsize for v, _ in copies)
    return Report(tuple(sites), aux, untied)

  def _explain(self, b: Blocker) -> str:
    """Names the normalization whose output a blocked value comes from."""
    j = self._norm_output_of(b.var)
    if j is None:
      return b.reason
    return (f"the value comes from the output of normalization #{j} "
            f"(γ ⊙ n + β is not zero-mean when γ is non-uniform) [at "
            f"{self.sites[j].node.where()}]")

  def _norm_output_of(self, v):
    """The nearest site whose elementwise epilogue produces ``v``, if any."""
    best, best_d = None, 13
    for j, site in enumerate(self.sites):
      d = self._epilogue(j).get(v)
      if d is not None and d < best_d:
        best, best_d = j, d
    return best

  @functools.lru_cache(maxsize=None)
  def _epilogue(self, j) -> dict:
    """Values reached from site j's mean by elementwise/layout steps, with depth."""
    from jaxfold._src.analysis import elementwise_or_layout
    site = self.sites[j]
    dist, frontier = {}, [(r.outvars[0], 0) for r in site.reduces]
    while frontier:
      v, d = frontier.pop(0)
      if v in dist or d > 12:
        continue
      dist[v] = d
      for node, _ in self.g.consumers.get(v, []):
        if elementwise_or_layout(node.prim) and node.prim not in (lax.add_p,) or (
            node.prim is lax.add_p and d < 12 and self._adds_param(node)):
          frontier.append((node.outvars[0], d + 1))
    return dist

  def _adds_param(self, node) -> bool:
    # γ ⊙ n + β: the β add joins a parameter, not another activation.
    return any(compat.is_var(a) and (a in self.leaf_index or self._is_param_derived(a))
               for a in node.invars)

  def _is_param_derived(self, v) -> bool:
    while compat.is_var(v) and v in self.g.producer:
      node, _ = self.g.producer[v]
      if len(node.invars) != 1:
        return False
      v = node.invars[0]
    return v in self.leaf_index

  def _where(self, v) -> str:
    if v in self.g.producer:
      node = self.g.producer[v][0]
      return node.where() or f"the output of `{node.prim.name}`"
    return "a program input"


# ----------------------------------------------------------------------------
# Public entry points.


def _signature(args: tuple) -> tuple:
  leaves, tree = jax.tree_util.tree_flatten(args)
  return (tree, tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves))


class FoldedApply:
  """The folded apply function; re-analyses (and caches) per input signature."""

  def __init__(self, apply_fn, params_abstract, params_tree, opts, base: Analysis, sig,
               center_in_forward: bool):
    self._apply_fn = apply_fn
    self._params = params_abstract
    self._tree = params_tree
    self._opts = opts
    self._base = base
    self._cache = {sig: base}
    self._center = center_in_forward
    self._example_sig = sig
    functools.update_wrapper(self, apply_fn, updated=())

  @property
  def options(self) -> FoldOptions:
    return self._opts

  @property
  def original_fn(self) -> Callable:
    return self._apply_fn

  @property
  def example_args(self) -> Any:
    """The abstract example arguments the fold was traced with."""
    tree, leaves = self._example_sig
    return jax.tree_util.tree_unflatten(
        tree, [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape, dtype in leaves])

  def analysis_for(self, args: tuple) -> Analysis:
    sig = _signature(args)
    if sig not in self._cache:
      an = analyse(self._apply_fn, self._params, args, self._opts)
      if an.param_key != self._base.param_key:
        raise FoldError(
            f"inputs with shapes {[s for s in sig[1]]} need different folded parameters than "
            "the example arguments that fold() was given (a different set of parameters or "
            "axes can be centered). Call jaxfold.fold again with example arguments of this shape.")
      self._cache[sig] = an
    return self._cache[sig]

  def __call__(self, params, *args):
    an = self.analysis_for(args)
    extras = {}
    if self._center:
      tree = params
    else:
      if not isinstance(params, FoldedParams):
        raise FoldError(
            f"a folded apply_fn takes folded.params (a jaxfold.FoldedParams), got "
            f"{type(params).__name__}: the original parameters would compute a different "
            "function here; pass the .params of the fold")
      tree, extras = params.params, params.untied
    leaves, tree_def = jax.tree_util.tree_flatten(tree)
    if tree_def != self._tree:
      raise FoldError(f"params has structure {tree_def}, but the fold was made for {self._tree}")
    if self._center:
      # CBWC: the stored parameters stay W; the forward pass uses P·W.
      specs = dict(an.leaf_specs)
      src = list(leaves)
      leaves = [layout.center(x, dict(specs[i])) if i in specs else x for i, x in enumerate(src)]
      extras = {name: layout.center(src[i], dict(spec)) for name, i, spec in an.untied}
    flat = list(leaves) + jax.tree_util.tree_leaves(args)
    outs = evaluate(an.jaxpr, an.consts, flat, an.plan, extras)
    return jax.tree_util.tree_unflatten(an.out_tree, outs)


class FoldedParams(NamedTuple):
  """The parameters of a fold: the centered pytree and untied centered copies.

  A distinct type, so that passing the original parameters to a folded
  ``apply_fn`` is caught instead of silently computing something else.
  """
  params: Any
  untied: dict


class Folded(NamedTuple):
  """Result of :func:`fold`: ``apply_fn(params, *args)`` computes the original."""
  params: FoldedParams
  apply_fn: Callable
  report: Report


class Reparameterized(NamedTuple):
  """Result of :func:`cbwc`: ``apply_fn`` takes the *original* parameters."""
  apply_fn: Callable
  report: Report
  analysis: Analysis


def _center_leaf(x, spec):
  """Centers one parameter, keeping its dtype, device and sharding."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
  on_host = sharding is None or all(d.platform == "cpu" for d in sharding.device_set)
  if on_host and len(getattr(sharding, "device_set", ())) <= 1:
    # NumPy on the host: no per-shape compilation, which dominates a cold fold.
    y = layout.center(np.asarray(x), dict(spec))
  else:
    y = _center_jit(dict(spec))(x)
  return jax.device_put(y, sharding) if sharding is not None else jnp.asarray(y)


@functools.lru_cache(maxsize=None)
def _center_jit_cached(spec_items: tuple):
  return jax.jit(lambda x: layout.center(x, dict(spec_items)))


def _center_jit(spec: dict):
  return _center_jit_cached(tuple(sorted(spec.items())))


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
         auxiliary_centering: bool = True, tied_weights: str = "auto",
         norm_impl: str = "auto") -> Folded:
  """Folds every provably foldable LayerNorm/GroupNorm of ``apply_fn`` into an RMSNorm.

  Args:
    params: the parameter pytree (linen variables, ``nnx.State``, plain dict)
      of float arrays or ``jax.ShapeDtypeStruct``; it is never modified.
    apply_fn: ``apply_fn(params, *args)``, any jax-traceable function.
    *example_args: arrays or ``jax.ShapeDtypeStruct`` used for tracing.
    auxiliary_centering: allow inserting an explicit centering where it
      removes at least two mean reductions (the paper's practical extension).
      ``False`` guarantees the folded program has no operation the original
      lacks.
    tied_weights: how a parameter that cannot be centered everywhere (e.g. an
      embedding table reused as the LM head) is handled: ``"copy"`` (a
      centered copy for the use that needs it; reported as extra bytes),
      ``"auxiliary"`` (an auxiliary centering instead), or ``"auto"``
      (auxiliary when ``auxiliary_centering`` else copy).
    norm_impl: how folded norms run: ``"auto"`` (the Pallas RMSNorm kernel on
      GPUs where ``pallas_kernels.choose`` expects it to beat XLA, XLA's
      expression elsewhere), ``"xla"``, ``"pallas"`` (force the kernel) or
      ``"interpret"`` (the kernel in Pallas interpret mode, for CPU tests).

  Returns:
    ``Folded(params, apply_fn, report)``.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxfold
    >>> class M(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return nn.LayerNorm()(nn.Dense(8)(x))
    >>> m = M(); x = jnp.ones((2, 4))
    >>> p = m.init(jax.random.PRNGKey(0), x)
    >>> f = jaxfold.fold(p, m.apply, x)
    >>> f.report.num_folded
    1
    >>> bool(jnp.allclose(f.apply_fn(f.params, x), m.apply(p, x), atol=1e-5))
    True
  """
  if tied_weights not in ("auto", "copy", "auxiliary"):
    raise FoldError(f"tied_weights must be 'auto', 'copy' or 'auxiliary', got {tied_weights!r}")
  if not callable(apply_fn):
    raise FoldError(f"apply_fn must be callable, got {type(apply_fn).__name__}")
  if norm_impl not in kernels.IMPLS:
    raise FoldError(f"norm_impl must be one of {kernels.IMPLS}, got {norm_impl!r}")
  _refuse_traced(params)
  opts = FoldOptions(auxiliary_centering, tied_weights, norm_impl=norm_impl)
  an = analyse(apply_fn, params, example_args, opts)
  leaves, tree = jax.tree_util.tree_flatten(params)
  specs = dict(an.leaf_specs)
  new_leaves = [_center_leaf(x, specs[i]) if i in specs else x for i, x in enumerate(leaves)]
  new_params = jax.tree_util.tree_unflatten(tree, new_leaves)
  extras = {name: _center_leaf(leaves[i], spec) for name, i, spec in an.untied}
  new_params = FoldedParams(new_params, extras)
  abstract = jax.tree_util.tree_map(_abstract, params)
  fn = FoldedApply(apply_fn, abstract, tree, opts, an, _signature(example_args), False)
  return Folded(new_params, fn, an.report)


def cbwc(params: Any, apply_fn: Callable, *example_args: Any,
         auxiliary_centering: bool = True, tied_weights: str = "auto",
         through_dropout: bool = False) -> Reparameterized:
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
  an = analyse(apply_fn, params, example_args, opts)
  _, tree = jax.tree_util.tree_flatten(params)
  abstract = jax.tree_util.tree_map(_abstract, params)
  fn = FoldedApply(apply_fn, abstract, tree, opts, an, _signature(example_args), True)
  return Reparameterized(fn, an.report, an)
