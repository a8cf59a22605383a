"""Decides, per normalization site, what to center; typed actions and results.

Three parts: the *site decision* (``decide``: the needs of one site become
actions or blockers, respecting earlier commitments), the *auxiliary choice*
(``choose_auxiliary``: where one inserted centering removes at least two
reductions) and the *explanation* (``explain``: a blocker in the user's
terms). ``Planner.run`` strings them together; ``fold.py`` only orchestrates.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import NamedTuple, Optional, Union

import numpy as np

from jaxfold._src import algebra as A
from jaxfold._src import compat, layout
from jaxfold._src.analysis import (
  DROPOUT_NOTE,
  Analyzer,
  Blocker,
  LeafNeed,
  Level,
  MeanSite,
  factor_leaf,
  find_sites,
  nested_sites,
  scan_levels,
)
from jaxfold._src.program import Val, call_note, read_at
from jaxfold._src.report import Auxiliary, Centering, Changes, Report, bound_name, merged_where, param_label
from jaxfold._src.report import Site as ReportSite
from jaxfold._src.rules import Block, rule_for

# ----------------------------------------------------------------------------
# Typed actions and results.


@dataclasses.dataclass(frozen=True)
class CenterLeaf:
  """Center a parameter leaf (or captured constant) in place over ``spec``."""
  var: Val
  spec: tuple


@dataclasses.dataclass(frozen=True)
class UntieUse:
  """Give one use of a tied parameter its own centered copy."""
  need: LeafNeed


@dataclasses.dataclass(frozen=True)
class AuxCenter:
  """Insert an explicit centering of a value over ``spec``."""
  var: Val
  spec: tuple


Action = Union[CenterLeaf, UntieUse, AuxCenter]


@dataclasses.dataclass(frozen=True)
class Decision:
  """The outcome for one site."""
  folded: bool
  reason: str
  centered: tuple = ()          # report.Centering, what this site itself needed
  auxiliary: bool = False
  exact: bool = True
  aux_vars: tuple = ()          # the auxiliary centerings (Vals) it relies on


class SiteEntry(NamedTuple):
  """One site and the frozen decision the planner made for it."""
  index: int
  site: MeanSite
  decision: Decision


class UntiedUse(NamedTuple):
  """One use that reads an untied centered copy (the rewrite's entry)."""
  path: tuple             # call-site path of the using equation
  operand: int
  name: str               # the copy's name in the fold's Params.extras
  chain: tuple            # the re-indexing equations from the parameter to the use


class Outcome(NamedTuple):
  """What the planner decided, frozen: the plan and the fold's parameters
  are built from this alone (``Planner.outcome()``)."""
  sites: tuple            # SiteEntry per site, in program order
  aux: tuple              # ((value key, spec), ...): auxiliary centerings
  consts: tuple           # ((value key, spec), ...): captured constants centered
  untied: tuple           # UntiedUse, ...
  leaf_specs: tuple       # ((leaf index, spec), ...): parameters centered in place
  untied_specs: tuple     # ((copy name, leaf index, spec), ...)
  aux_constants: tuple = ()   # ((value key, centered array), ...): auxiliary centerings of
                              # values no input reaches, computed once at fold time

  @property
  def folded(self) -> tuple:
    return tuple(e for e in self.sites if e.decision.folded)


class PlanConflict(Exception):
  """A plan fixed by another input shape cannot be proved at this one."""


def _spec_dict(spec: tuple) -> dict:
  return dict(spec)


def _nbytes(v: Val) -> int:
  return int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize


class Planner:
  """Runs the site decisions and keeps the commitments later sites respect."""

  def __init__(self, an: Analyzer, names: list, options, fixed: Optional[tuple] = None):
    self.an = an
    # (leaf specs, untied specs) of the fold's parameters, decided at another
    # input shape: this program must work with exactly those centered leaves.
    self.fixed = fixed
    self.top = an.top
    self.names = names
    self.opts = options
    self.leaf_commit: dict = {}       # Val -> spec
    self.untie_commit: dict = {}      # (use node id, operand) -> LeafNeed
    self.aux_commit: dict = {}        # Val -> spec
    self.decisions: dict = {}         # site index -> Decision
    self._vis: dict = {}
    self._inexact = False
    self._ties_by_copy = False
    self._blocker_counts: collections.Counter = collections.Counter()   # (Val, spec) -> failed sites

  @functools.cached_property
  def sites(self) -> list:
    """The mean reductions, in program order (found on first use: a check of
    fixed centerings needs none)."""
    return [s for lv in scan_levels(self.top) for s in find_sites(lv)]

  # -- invisibility (obligation 1), cached --------------------------------------

  def _visible(self, key, seeds_fn, level: Optional[Level] = None) -> Optional[str]:
    if key not in self._vis:
      before = self.an.random_uses
      try:
        seeds, skip = seeds_fn()
        if level is None or level is self.top:
          reason = self.top.invisible(seeds, skip)
        else:  # inside a loop or branch body: carried out by the control-flow drivers
          reason = level.invisible_inside(seeds) if seeds else None
      except Exception as e:  # noqa: BLE001 - a rule that cannot decide blocks
        reason = f"{type(e).__name__}: {e}"
      self._vis[key] = (reason, self.an.random_uses > before)
    reason, used_random = self._vis[key]
    self._inexact |= used_random and reason is None
    return reason

  def leaf_visible(self, var: Val, spec: tuple) -> Optional[str]:
    return self._visible(("leaf", var, spec), lambda: ({var: seed_poly(var.shape, spec)}, frozenset()))

  def use_visible(self, need: LeafNeed) -> Optional[str]:
    node, k = need.use
    level = self.an.level(node.program)
    if self.an.cbwc and node.custom_calls:
      c = node.custom_calls[-1]
      return f"the use is inside {c.kind} `{c.name}`, whose custom rule CBWC keeps"

    def seeds():
      poly = seed_poly(need.var.shape, need.spec)
      for cnode in reversed(need.chain):
        poly = self.an.level(cnode.program).seed_through(cnode, 0, poly)[0]
        if poly is None:
          return {}, frozenset()
      outs = level.seed_through(node, k, poly)
      return ({v: p for v, p in zip(node.outs, outs) if p is not None}, frozenset({node.index}))
    return self._visible(("use", id(node), k, need.spec), seeds, level)

  def aux_visible(self, var: Val, spec: tuple) -> Optional[str]:
    if self.an.cbwc and var.producer is not None and var.producer.custom_calls:
      return "the value is inside a custom-derivative function, whose rule CBWC keeps"
    return self._visible(("aux", var, spec), lambda: ({var: seed_poly(var.shape, spec)}, frozenset()),
                         self.an.level(var.program))

  # -- names -----------------------------------------------------------------

  def name(self, var: Val) -> str:
    if var.kind == "in" and var.program.is_top and var.index < len(self.names):
      return self.names[var.index]
    src = read_at(var)   # where the constant entered the trace, so the user can tell which it is
    return f"<captured constant {var.shape}{' read at ' + src if src else ''}>"

  def label(self, var: Val, spec: tuple) -> str:
    """``h_0.attn.kernel[1]``: a parameter and the dims centering it would touch."""
    return Centering(self.name(var), layout.fmt_spec(_spec_dict(spec), var.shape), "").label()

  def is_leaf(self, var: Val) -> bool:
    return var.kind == "in" and var.program.is_top and var.index < len(self.names)

  # -- site decision -----------------------------------------------------------

  def decide(self, site: MeanSite, assume_aux: dict, visited: Optional[list] = None) -> tuple:
    """(actions, blockers) for one site given the commitments so far."""
    before = self.an.random_uses
    self._inexact = False
    # A site's reductions are every sum of its input over its axes: the same
    # mean may be computed both outside and inside a custom-derivative call
    # (which one comes first is the program's order), so name the call of the
    # reduction inside one, not the site's first.
    inside = next((r for r in site.reduces if r.custom_calls), None)
    if self.an.cbwc and inside is not None:
      c = inside.custom_calls[-1]
      what = "the norm is" if all(r.custom_calls for r in site.reduces) else "its mean is also computed"
      return [], [Blocker(site.input, (), f"{what} inside {c.kind} `{c.name}` (called at "
                                          f"{c.source}); CBWC keeps its custom rule")]
    try:
      level, value, spec = site.target()
      needs = level.needs(value, spec, assume_aux, visited)
    except Block as e:
      return [], [Blocker(site.input, (), str(e))]
    except Exception as e:  # noqa: BLE001 - fail closed with the cause
      return [], [Blocker(site.input, (), f"{type(e).__name__}: {e}")]
    self._inexact |= self.an.random_uses > before
    actions, blockers = [], []
    for n in needs:
      if isinstance(n, Blocker):
        n = self._aux_point(n)
        if n.spec and assume_aux.get(n.var) == n.spec:
          actions.append(AuxCenter(n.var, n.spec))
        else:
          blockers.append(n)
        continue
      self._decide_leaf(n, assume_aux, actions, blockers)
    return actions, [self._aux_point(b) for b in blockers]

  def _aux_point(self, b: Blocker) -> Blocker:
    """``b`` at the value where an auxiliary centering would be stored exactly.

    A centering stored in a dtype coarser than the program's outputs rounds
    the centered value, so its mean is no longer zero at the outputs'
    precision. The value's exact widening is used instead: the unique
    consumer chain of identity-kind rules (the zero-sum walk came through it,
    so centering its end satisfies the same need). Without one, the blocker
    is returned with no spec (not a candidate for auxiliary centering).
    """
    v, tol = b.var, self.an.tolerance
    if not isinstance(v, Val) or not b.spec or not compat.is_floating(v.dtype):
      return b
    while not Level.at_least_as_precise(v.dtype, tol):
      uses = v.program.consumers.get(v, ())
      node = uses[0][0] if len(uses) == 1 else None
      if (node is None or rule_for(node.prim).kind != "identity" or len(node.outs) != 1
          or node.outs[0].shape != v.shape or v in v.program.output_positions
          or not compat.is_floating(node.outs[0].dtype)):
        return Blocker(b.var, (), f"{b.reason} (an auxiliary centering there would be stored "
                                  f"in {np.dtype(b.var.dtype).name}, coarser than the program's "
                                  f"outputs, {np.dtype(tol).name})")
      v = node.outs[0]
    return b if v is b.var else Blocker(v, b.spec, b.reason)

  def _decide_leaf(self, n: LeafNeed, assume_aux, actions, blockers) -> None:
    var, spec = n.var, n.spec
    if not compat.is_inexact(var.dtype):
      blockers.append(Blocker(n.out_var, n.out_spec, f"{param_label(self.name(var))} is not a float array"))
      return
    if var in self.leaf_commit:
      if self.leaf_commit[var] == spec:
        actions.append(CenterLeaf(var, spec))
      else:
        blockers.append(Blocker(n.out_var, n.out_spec,
                                f"{param_label(self.name(var))} is already centered over other axes for "
                                "another site"))
      return
    if self.fixed is not None and self.is_leaf(var):
      reason = "the fold's parameters, fixed at another input shape, leave it uncentered"
    else:
      reason = self.leaf_visible(var, spec)
    if reason is None:
      actions.append(CenterLeaf(var, spec))
      return
    prior = self.untie_commit.get((id(n.use[0]), n.use[1])) if n.use is not None else None
    if prior is not None and prior.spec != spec:
      # One use reads one copy: another site's copy there is centered over other axes.
      blockers.append(Blocker(n.out_var, n.out_spec,
                              f"this use of {param_label(self.name(var))} already reads a copy centered over "
                              "other axes for another site"))
      return
    if n.use is not None and self.is_leaf(var) and (prior is not None or self.use_visible(n) is None):
      if self.opts.tie_by_aux() and not self._ties_by_copy:
        at = self._aux_point(Blocker(n.out_var, n.out_spec, ""))
        if at.spec and assume_aux.get(at.var) == at.spec:
          actions.append(AuxCenter(at.var, at.spec))
        else:
          blockers.append(Blocker(n.out_var, n.out_spec,
                                  f"{param_label(self.name(var))} is also used where centering it is visible "
                                  f"({reason}); an auxiliary centering or an untied copy would "
                                  "fold it"))
      elif self.fixed is not None and (var.index, spec) not in self._fixed_untied:
        blockers.append(Blocker(n.out_var, n.out_spec,
                                f"{param_label(self.name(var))} has no untied copy centered over these "
                                "axes in the fold's parameters"))
      else:
        actions.append(UntieUse(n))
      return
    blockers.append(Blocker(n.out_var, n.out_spec,
                            f"centering {self.label(var, spec)} would change the output: "
                            f"{reason}"))

  def commit(self, i: int, actions: list) -> None:
    centered = []
    for a in actions:
      if isinstance(a, CenterLeaf):
        self.leaf_commit[a.var] = a.spec
        mode = "in place" if self.is_leaf(a.var) else "constant"
        centered.append(Centering(self.name(a.var),
                                  layout.fmt_spec(_spec_dict(a.spec), a.var.shape), mode,
                                  spec=a.spec))
      elif isinstance(a, UntieUse):
        n = a.need
        self.untie_commit[(id(n.use[0]), n.use[1])] = n
        centered.append(Centering(self.name(n.var),
                                  layout.fmt_spec(_spec_dict(n.spec), n.var.shape),
                                  "untied copy", _nbytes(n.var), spec=n.spec))
      else:
        self.aux_commit[a.var] = a.spec
    aux_vars = tuple(dict.fromkeys(a.var for a in actions if isinstance(a, AuxCenter)))
    aux = bool(aux_vars)
    reason = "input is zero-sum over the normalized axes"
    reason += (" after an auxiliary centering" if aux else " after centering" if centered
               else " as written (it needs nothing centered)")
    if self._inexact:
      reason += DROPOUT_NOTE
    self.decisions[i] = Decision(True, reason, tuple(dict.fromkeys(centered)), aux,
                                 not self._inexact, aux_vars)

  def check_fixed(self) -> None:
    """Proves every fixed leaf centering invisible in this program, or raises
    ``PlanConflict``: all a fixed plan must pass (``run`` starts with it)."""
    self._seed_fixed()

  def _seed_fixed(self) -> None:
    """Commits the fixed leaf centerings, each proved invisible in this program."""
    leaf_specs, untied = self.fixed
    self._fixed_untied = {(i, spec) for _, i, spec in untied}
    for i, spec in leaf_specs:
      var = self.top.program.invars[i]
      reason = self.leaf_visible(var, spec)
      if reason is not None:
        raise PlanConflict(f"centering {self.label(var, spec)} would change the output here: {reason}")
      self.leaf_commit[var] = spec

  def run(self) -> "Planner":
    self.sites   # noqa: B018 - found before the fixed centerings are proved, as always
    if self.fixed is not None:
      self._seed_fixed()
    failed, visits = {}, {}
    for i, site in enumerate(self.sites):
      if site.unrecognised:
        self.decisions[i] = Decision(False, site.unrecognised)
        continue
      visits[i] = []
      actions, blockers = self.decide(site, {}, visits[i])
      if blockers:
        failed[i] = blockers
      else:
        self.commit(i, actions)
        del visits[i]
    if self.opts.auxiliary_centering and failed:
      self.choose_auxiliary(failed)
      self.choose_stream_starts(failed, visits)
    if self.opts.tie_by_aux() and self.opts.tied_weights == "auto":
      # Where an auxiliary centering would not pay for itself, a tied
      # parameter is still worth untying by a centered copy.
      self._ties_by_copy = True
      for i in sorted(failed):
        if i not in self.decisions:
          actions, blockers = self.decide(self.sites[i], dict(self.aux_commit))
          if not blockers:
            self.commit(i, actions)
    for i, blockers in failed.items():
      if i not in self.decisions:
        reason = "input is not zero-sum: " + self.explain(blockers[0]) + self._why_no_aux(blockers[0])
        self.decisions[i] = Decision(False, reason)
    return self

  def _why_no_aux(self, b: Blocker) -> str:
    """Why no auxiliary centering stands in for blocker ``b`` (empty when
    the option is off or ``b`` is not a centerable value)."""
    if not (self.opts.auxiliary_centering and isinstance(b.var, Val) and b.spec):
      return ""
    if self._blocker_counts.get((b.var, b.spec), 0) < 2:
      # (the cost rule alone rules it out: no need to prove anything)
      return ("; an auxiliary centering of that value would remove no more reductions than it "
              "adds (only this site needs it)")
    reason = self.aux_visible(b.var, b.spec)
    if reason is not None:
      return f"; an auxiliary centering of that value would change the result ({reason})"
    return ("; an auxiliary centering of that value would remove fewer reductions than it adds "
            "(it would let fewer than two sites fold)")

  # -- auxiliary choice ----------------------------------------------------------

  def choose_auxiliary(self, failed: dict) -> None:
    """One inserted centering (one reduction) pays off when it lets at least
    two sites drop theirs."""
    counts = self._blocker_counts
    for blockers in failed.values():
      for b in {(b.var, b.spec) for b in blockers}:
        if isinstance(b[0], Val) and b[1]:
          counts[b] += 1
    chosen: dict = {}
    for (var, spec), n in counts.most_common():
      if n < 2 or self.aux_visible(var, spec) is not None:
        continue
      trial = dict(chosen)
      trial[var] = spec
      gain = [i for i, bl in failed.items() if i not in self.decisions and
              all(trial.get(b.var) == b.spec for b in bl)]
      if len(gain) >= 2 or (chosen and gain):
        chosen = trial
    if not chosen:
      return
    for i in sorted(failed):
      if i in self.decisions:
        continue
      actions, blockers = self.decide(self.sites[i], chosen)
      if not blockers:
        self.commit(i, actions)

  STREAM_CANDIDATES = 8

  def choose_stream_starts(self, failed: dict, visits: dict) -> None:
    """Auxiliary centerings at values the failed sites' zero-sum walks pass
    through, not only at their blockers: where a residual stream starts
    (e.g. ``proj(x) + gelu(pos_conv(proj(x)))``) every later norm's walk
    passes, and one centering there can stand in for several blockers none of
    which can be centered alone. Same cost rule: each inserted centering must
    let at least two sites drop their reductions.

    Candidates are tried by how many pending sites pass them, then latest in
    the program first (the join of a stream's parts is nearest the norms).
    """
    pending = [i for i in sorted(failed) if i not in self.decisions]
    if len(pending) < 2:
      return
    counts: dict = collections.Counter()
    for i in pending:
      for key in dict.fromkeys(visits.get(i, ())):
        var = key[0]
        # A centering stored coarser than the outputs would not stay exact.
        if (isinstance(var, Val) and var not in self.aux_commit
            and compat.is_floating(var.dtype)
            and Level.at_least_as_precise(var.dtype, self.an.tolerance)):
          counts[key] += 1
    order = sorted(counts, key=lambda k: (-counts[k], -_position(k[0])))
    tried = checked = 0
    for key in order:
      if (counts[key] < 2 or len(pending) < 2 or tried >= self.STREAM_CANDIDATES
          or checked >= 4 * self.STREAM_CANDIDATES):
        break
      var, spec = key
      checked += 1
      if self.aux_visible(var, spec) is not None:
        continue
      tried += 1
      trial = dict(self.aux_commit)
      trial[var] = spec
      passing = [i for i in pending if key in set(visits.get(i, ()))]
      gains = {}
      for i in passing:
        actions, blockers = self.decide(self.sites[i], trial)
        if not blockers:
          gains[i] = actions
      if len(gains) < 2:
        continue
      for i in sorted(gains):
        # Re-decided in order: earlier commitments (leaf centerings) bind later sites.
        actions, blockers = self.decide(self.sites[i], trial)
        if not blockers:
          self.commit(i, actions)
      pending = [i for i in pending if i not in self.decisions]

  # -- explanation -------------------------------------------------------------

  def explain(self, b: Blocker) -> str:
    """Names the normalization whose output a blocked value comes from."""
    j = self._norm_output_of(b.var)
    if j is None:
      return b.reason
    src = _user_line(self.sites[j].node)
    return (f"it carries the output of normalization #{j} ({self.site_where(j)}"
            f"{', ' + src if src else ''}): γ ⊙ n + β is not zero-mean when γ is non-uniform")

  def _norm_output_of(self, v) -> Optional[int]:
    """The nearest site whose elementwise epilogue produces ``v`` and puts a
    parameter (its γ or β) in it, if any: a value computed from a mean with no
    parameter of its own (``h - mean(h)``, a rescaled mean) is not the γ case,
    and its blocker's own reason is the true one."""
    if not isinstance(v, Val):
      return None
    best, best_d = None, 13
    for j in range(len(self.sites)):
      d = self._epilogue(j).get(v)
      if d is not None and d < best_d and self._params_in(j, v) - self._params_in(j, self.sites[j].input):
        best, best_d = j, d
    return best

  def _params_in(self, j: int, v) -> frozenset:
    """The parameter leaves ``v``'s canonical form (in site ``j``'s level) is written in."""
    cache = self.__dict__.setdefault("_pin", {})
    key = (j, v)
    if key not in cache:
      level = self.sites[j].level
      out, seen = set(), set()
      stack = [f for m in level.canon(v).terms for f in m]
      while stack and len(seen) < 1024:
        fid = stack.pop()
        if fid in seen:
          continue
        seen.add(fid)
        lv = factor_leaf(fid, level)
        if lv is not None:
          out.add(lv[0])
          continue
        f = A.factor(fid)
        if f.kind == "view":
          stack.append(f.args[0])
        elif f.kind == "app":
          stack.extend(g for a in f.args for m in a.terms for g in m)
      cache[key] = frozenset(out)
    return cache[key]

  def _epilogue(self, j: int) -> dict:
    site = self.sites[j]
    return self._epilogue_of(site.reduces, site.level.program)

  def _epilogue_of(self, reduces: tuple, prog) -> dict:
    """Values within 12 elementwise steps of ``reduces``' outputs (their
    norm's epilogue), by distance."""
    cache = self.__dict__.setdefault("_epi", {})
    key = tuple(id(r) for r in reduces)
    if key in cache:
      return cache[key]
    dist, frontier = {}, collections.deque((r.outs[0], 0) for r in reduces)
    while frontier:
      v, d = frontier.popleft()
      if v in dist or d > 12:
        continue
      dist[v] = d
      for node, _ in prog.consumers.get(v, ()):
        rule = rule_for(node.prim)
        if rule.kind or rule.epilogue in ("subtract", "step") or (
            rule.epilogue == "bias" and self._adds_param(node)):
          frontier.append((node.outs[0], d + 1))
    cache[key] = dist
    return dist

  def _adds_param(self, node) -> bool:
    # γ ⊙ n + β: the β add joins a parameter, not another activation.
    for a in node.ins:
      while isinstance(a, Val) and a.producer is not None and len(a.producer.ins) == 1:
        a = a.producer.ins[0]
      if isinstance(a, Val) and self.is_leaf(a):
        return True
    return False

  # -- results ---------------------------------------------------------------

  def report(self, kernel_sites: frozenset = frozenset()) -> Report:
    """The per-site results; ``kernel_sites``: indices of the folded sites
    proved equal to the Pallas kernel's formula."""
    aux_index = {v: k + 1 for k, v in enumerate(self.aux_commit)}
    aux_users: dict = {v: [] for v in self.aux_commit}
    sites, seen = [], set()
    full = _distinct([self.site_where(i) for i in range(len(self.sites))], [s.node for s in self.sites])
    short = [bound_name(w) for w in full]
    # A name the bound made equal to another site's keeps its whole text: sites must read differently.
    clash = {w for w in short if short.count(w) > 1}
    wheres = [f if b in clash else b for f, b in zip(full, short)]
    for i, s in enumerate(self.sites):
      d = self.decisions[i]
      own = tuple(c for c in d.centered if (c.param, c.spec, c.mode) not in seen)
      seen |= {(c.param, c.spec, c.mode) for c in d.centered}
      for v in d.aux_vars:
        aux_users[v].append(len(sites))
      norms = self.norm_names(i)
      sites.append(ReportSite(index=len(sites), where=merged_where(norms) if norms else wheres[i],
                              shape=s.input.shape, norms=norms,
                              axes=s.axes, folded=d.folded, reason=d.reason,
                              centered=own, auxiliary=d.auxiliary,
                              num_reductions=len(s.reduces), exact=d.exact,
                              source=_user_line(s.node), requires=len(d.centered),
                              aux=tuple(aux_index[v] for v in d.aux_vars),
                              kernel=d.folded and i in kernel_sites))
    for loop, s in nested_sites(self.top):
      sites.append(ReportSite(index=len(sites), where=bound_name(_site_where(s.node)), shape=s.input.shape,
                              axes=s.axes, folded=False,
                              reason=f"inside a `{loop.prim.name}` body, which the analysis "
                                     "does not enter yet",
                              num_reductions=len(s.reduces), source=_user_line(s.node)))
    constant = self.constant_aux()
    aux = tuple(Auxiliary(aux_index[v], tuple(v.shape), layout.fmt_spec(_spec_dict(sp), v.shape),
                          _value_text(v), *_value_where(v), tuple(aux_users[v]), v in constant)
                for v, sp in self.aux_commit.items())
    copies = {(n.var, n.spec) for n in self.untie_commit.values()}
    leaves = [v for v in self.leaf_commit if self.is_leaf(v)]
    changes = Changes(
        reductions_before=sum(rule_for(n.prim).sum_axes(n) is not None
                              for p in self.top.program.programs() for n in p.nodes),
        reductions_removed=sum(len(s.reduces) for s in self.folded_sites()),
        reductions_added=len(self.aux_commit) - len(constant), constant_aux=len(constant),
        params_centered=len(leaves), params_centered_bytes=sum(_nbytes(v) for v in leaves),
        norm_impl=self.opts.norm_impl)
    return Report(tuple(sites), aux, sum(_nbytes(v) for v, _ in copies), changes)

  def site_where(self, j: int) -> str:
    """Module path of site ``j``: the name stack (linen), else the path of the
    norm's own γ/β parameters (nnx, plain functions), else the user's line."""
    node = self.sites[j].node
    site = self.sites[j]
    text = node.module() or self._param_module(j) or _user_line(node) or _unnamed(site.axes, site.input.shape)
    if node.calls and not node.module():
      text += " " + call_note(node.calls)
    return text

  def _param_module(self, j: int, reduces: Optional[tuple] = None) -> str:
    """``h_0/ln_1`` from a γ or β leaf (``['h_0']['ln_1']['scale']``) that the
    site's epilogue (or that of ``reduces``, some of its reductions)
    multiplies by or adds."""
    prog = self.sites[j].level.program
    epi = self._epilogue_of(reduces or self.sites[j].reduces, prog)
    for v in sorted(epi, key=epi.__getitem__):
      for node, _ in prog.consumers.get(v, ()):
        if rule_for(node.prim).arith not in ("+", "*"):
          continue
        for a in node.ins:
          while isinstance(a, Val) and a.producer is not None and len(a.producer.ins) == 1:
            a = a.producer.ins[0]
          if isinstance(a, Val) and self.is_leaf(a):
            parts = param_label(self.name(a)).split(".")
            return "/".join(parts[:-1]) if len(parts) > 1 else ""
    return ""

  def norm_names(self, j: int) -> tuple:
    """The normalizations whose mean site ``j`` computes, by name, when more
    than one does: two norms reading one value (GPT-NeoX's parallel
    residual, Falcon-40B's ``ln_mlp``) share one mean site. A reduction is
    named by its module path or its own γ/β's path; one with neither (a
    second reduction of a single norm, e.g. inside ``jnp.var``) is not
    counted as a norm of its own. ``()`` for a site of one norm."""
    site = self.sites[j]
    if len(site.reduces) < 2:
      return ()
    names = [r.module() or self._param_module(j, (r,)) for r in site.reduces]
    names = tuple(dict.fromkeys(n for n in names if n))
    return names if len(names) > 1 else ()

  def untied_name(self, n: LeafNeed) -> str:
    # Named by parameter and axes, not by equation position, so the same
    # folded params serve every input signature (and uses share one copy).
    return f"{self.name(n.var)}@centered{layout.fmt_spec(_spec_dict(n.spec), n.var.shape)}"

  def leaf_specs(self) -> tuple:
    return tuple(sorted((v.index, s) for v, s in self.leaf_commit.items() if self.is_leaf(v)))

  def untied_specs(self) -> tuple:
    return tuple(sorted({(self.untied_name(n), n.var.index, n.spec)
                         for n in self.untie_commit.values()}))

  def folded_sites(self) -> list:
    return [s for i, s in enumerate(self.sites) if self.decisions[i].folded]

  def outcome(self) -> Outcome:
    """The decisions of ``run()``, frozen (what ``fold`` builds the plan from)."""
    constant = self.constant_aux()
    return Outcome(
        sites=tuple(SiteEntry(i, s, self.decisions[i]) for i, s in enumerate(self.sites)),
        aux=tuple((v.key, s) for v, s in self.aux_commit.items() if v not in constant),
        consts=tuple((v.key, s) for v, s in self.leaf_commit.items() if v.kind == "const"),
        untied=tuple(UntiedUse(n.use[0].path, n.use[1], self.untied_name(n),
                               tuple(c.eqn for c in reversed(n.chain)))
                     for n in self.untie_commit.values()),
        leaf_specs=self.leaf_specs(), untied_specs=self.untied_specs(),
        aux_constants=tuple((v.key, x) for v, x in constant.items()))

  def constant_aux(self) -> dict:
    """Val -> its centered value, for each auxiliary centering of a value no
    input (parameter or argument) reaches, e.g. a sinusoidal position table
    the program computes from ``iota``: computed once here and written into
    the folded program as a constant instead of being recomputed and
    re-centered on every call."""
    if "_constant_aux" not in self.__dict__:
      out = {}
      for v, spec in self.aux_commit.items():
        nodes = _input_free_nodes(v)
        if nodes is not None:
          out[v] = layout.center(np.asarray(_evaluate_constant(v, nodes)), _spec_dict(spec))
      self._constant_aux = out
    return self._constant_aux


def _distinct(wheres: list, nodes: list) -> list:
  """Site locations made distinct: where two sites read the same (one helper
  function called from two lines, one module applied twice), the user's
  calling line that tells them apart is added, else the call's ordinal."""
  out = list(wheres)
  groups: dict = collections.defaultdict(list)
  for i, w in enumerate(wheres):
    groups[w].append(i)
  for w, members in groups.items():
    if len(members) < 2:
      continue
    frames = {i: compat.user_frames(nodes[i].eqn) for i in members}
    # (a location that is itself the innermost user line starts past it)
    first = int(all(f and f[0] in w for f in frames.values()))
    depth = max(len(f) for f in frames.values())
    for k in range(first + 1, depth + 1):
      keys = [tuple(frames[i][first:k]) for i in members]
      if len(set(keys)) == len(keys):
        for i in members:
          out[i] = " ← ".join([w] + frames[i][first:k])
        break
    else:
      for n, i in enumerate(members):
        out[i] = f"{w} (use {n + 1} of {len(members)})"
  return out


def _input_free_nodes(v: Val) -> Optional[list]:
  """The equations computing ``v`` in program order when it depends on no
  input of the program (only on literals and captured constants) and none
  has effects; else None. Values inside loop or branch bodies are left to
  run time."""
  nodes, seen, stack = {}, set(), [v]
  while stack:
    u = stack.pop()
    if not isinstance(u, Val) or u in seen:
      continue
    seen.add(u)
    if not u.program.is_top:
      return None
    if u.producer is None:
      if u.kind != "const":
        return None
      continue
    node = u.producer
    if getattr(node.eqn, "effects", None):
      return None
    nodes[id(node)] = node
    stack.extend(node.ins)
  return sorted(nodes.values(), key=lambda n: n.index)


def _evaluate_constant(v: Val, nodes: list):
  """``v``'s value, computed eagerly from ``nodes`` (even under a caller's trace)."""
  import jax
  env: dict = {}

  def read(a):
    if isinstance(a, Val):
      return env[a] if a.producer is not None else a.const
    return a.value
  with jax.ensure_compile_time_eval():
    for node in nodes:
      for o, x in zip(node.outs, compat.bind_eqn(node.eqn, [read(a) for a in node.ins])):
        env[o] = x
    return read(v)


def _user_line(node) -> str:
  """``file.py:line (function)`` of the innermost frame outside installed
  libraries that made ``node``; "" when only installed code did (a library's
  line is never named: see compat's ``_LIBRARIES``)."""
  return compat.user_source(node.eqn)


def _unnamed(axes: tuple, shape: tuple) -> str:
  """A site no module path, parameter or user's line names."""
  return f"a mean over axes {','.join(map(str, axes))} of a {'x'.join(map(str, shape))} value (in installed code)"


def _position(v: Val) -> int:
  return v.producer.index if v.producer is not None else -1


def _site_where(node) -> str:
  text = node.module() or _user_line(node) or "a norm inside installed libraries"
  if node.calls:
    text += " " + call_note(node.calls)
  return text


def _value_text(v: Val) -> str:
  """What an intermediate value is, in the user's terms."""
  node = v.producer
  if node is None:
    return "a program input" if v.kind == "in" else "a captured constant"
  # (module path and line come from _value_where)
  what = f"`{node.prim.name}`"
  if node.calls:
    what += f" in `{node.calls[-1].name}`"
  return what


def _value_where(v: Val) -> tuple:
  """(module path, user's line) of the equation that produces ``v``."""
  node = v.producer
  if node is None:
    return "", ""
  if node.calls:
    c = node.calls[0]   # the outermost call: the user's line, not a jnp internal
    return bound_name(node.module() or c.stack), c.source
  return bound_name(node.module()), _user_line(node)


def seed_poly(shape: tuple, spec: tuple):
  """The shift of centering a value of ``shape`` over the blocks of ``spec``."""
  blocks = dict(spec)
  dims = []
  for d, s in enumerate(shape):
    b = blocks.get(d)
    if s == 1 or b == s:
      dims.append(None)
    else:
      dims.append((None, b or 1))
  return A.pure(tuple(dims))
