"""What the fold found and what it changed, per normalization site, in a form
people (``str(report)``, ``report.diff()``) and tools (``report.to_json()``) read.

A report is plain data: it is saved with a fold (``report.json``) and loaded
without any JAX work, so everything here works from the fields alone.
"""

from __future__ import annotations

import dataclasses
import html
import json
import re
from typing import Any, Optional

LEGEND = (
    "legend: p[d]: parameter p made zero-mean along its dim d (0-based; p[d, e]: jointly; "
    "p[d/g]: in blocks of g);\n"
    "        (copy): a centered copy for this use of a tied parameter; A1, A2: auxiliary "
    "centerings;\n"
    "        own centerings: what this site needed first (it also relies on earlier sites'); "
    "axes: normalized axes")

# The report's line (and fold's warning) when the program has no site at all.
NO_SITES = ("no normalization found: the program subtracts no mean before a normalization (no LayerNorm, "
            "GroupNorm, ...; an RMSNorm has no mean to remove), so there is nothing to fold and the folded "
            "model computes exactly what the original does, at the same cost")

_HEAD = ("#", "folded", "site", "shape", "axes", "own centerings (folded) / reason (not folded)")


@dataclasses.dataclass(frozen=True)
class Centering:
  """One parameter (or captured constant) centered for a site."""
  param: str            # pytree path, e.g. "['params']['Dense_0']['kernel']"
  axes: str             # the centered dims, e.g. "(1)" or "(3(groups of 4))"
  mode: str             # "in place" | "untied copy" | "constant"
  extra_bytes: int = 0
  spec: tuple = ()      # ((dim, block), ...): zero-sum over blocks of `block` along `dim`

  def label(self) -> str:
    """Compact form, e.g. ``h_0.attn.c_proj.kernel[1]`` (see :data:`LEGEND`)."""
    tag = {"in place": "", "untied copy": " (copy)", "constant": " (constant)"}.get(self.mode, "")
    return f"{param_label(self.param)}[{_dims(self.axes)}]{tag}"


@dataclasses.dataclass(frozen=True)
class Auxiliary:
  """An inserted centering of an intermediate value (one mean reduction)."""
  index: int            # 1-based: "A1", "A2", ...
  shape: tuple = ()
  axes: str = ""        # centered dims, as Centering.axes
  value: str = ""       # the operation producing the value, e.g. "`gather` in `_take`"
  where: str = ""       # module path, may be empty
  source: str = ""      # the user's line, file.py:line (function)
  sites: tuple = ()     # indices of the sites that rely on it
  constant: bool = False  # the value depends on no input: centered once at fold time, a constant

  @property
  def name(self) -> str:
    return f"A{self.index}"

  def describe(self) -> str:
    dims = _dims(self.axes)
    if not self.shape:        # a report written before auxiliary centerings were structured
      return f"{self.name}: {self.value}"
    if self.where:
      what = f"the output of {self.where} ({self.value})"
    else:
      what = self.value if self.value.startswith("a ") else f"the output of {self.value}"
    at = f" at {self.source}" if self.source else ""
    used = f"; lets {len(self.sites)} site(s) fold" if self.sites else ""
    shape = "x".join(map(str, self.shape))
    once = ("; the value depends on no input: centered once at fold time, a constant of the folded "
            "program (no reduction per call)") if self.constant else ""
    return f"{self.name}: centers {what}{at} over [{dims}] of {shape}{used}{once}"


@dataclasses.dataclass(frozen=True)
class Site:
  """One mean reduction that a LayerNorm/GroupNorm performs."""
  index: int
  where: str            # module path (name stack or the norm's parameters), else the user's line
  shape: tuple          # shape of the normalized value
  axes: tuple           # reduced axes, in that value's layout
  folded: bool
  reason: str
  centered: tuple = ()  # tuple[Centering, ...]: the centerings this site needed first
  auxiliary: bool = False
  num_reductions: int = 1
  exact: bool = True    # False only for CBWC sites folded across dropout
  source: str = ""      # file.py:line (function) of the mean reduction in the user's code
  requires: int = 0     # all centerings its proof relies on (own + earlier sites')
  aux: tuple = ()       # indices of the Auxiliary centerings it relies on
  kernel: bool = False  # proved equal to the Pallas RMSNorm kernel's formula
  norms: tuple = ()     # names of the norms sharing this mean (they read one value); () for one norm

  @property
  def num_norms(self) -> int:
    """The normalizations this site is the mean of (2 where two norms read one value)."""
    return max(1, len(self.norms))

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["centered"] = [dataclasses.asdict(c) for c in self.centered]
    return d


@dataclasses.dataclass(frozen=True)
class Changes:
  """Before/after counts of the program (see :meth:`Report.diff`)."""
  reductions_before: int = 0    # reduce_sum equations, per call site
  reductions_removed: int = 0   # at folded sites
  reductions_added: int = 0     # by auxiliary centerings
  params_centered: int = 0      # leaves centered in place (same shapes, new values)
  params_centered_bytes: int = 0
  norm_impl: str = "auto"
  kernel_proof: Optional[bool] = None  # whether the kernel's proof ran (None: a report from before this field)
  platform: str = ""                   # jax.default_backend() where the fold was made
  counted_before: int = -1      # reduce_sum equations counted in the original program (-1: not counted)
  counted_after: int = -1       # ... in the folded program
  primitives: tuple = ()        # ((primitive, before, after), ...): every count that changed
  constant_aux: int = 0         # auxiliary centerings computed at fold time (no reduction per call)

  @property
  def counted(self) -> bool:
    """Whether the counts were taken from the two programs (not the plan's)."""
    return self.counted_after >= 0

  @property
  def planned_after(self) -> int:
    return self.reductions_before - self.reductions_removed + self.reductions_added

  @property
  def reductions_after(self) -> int:
    return self.counted_after if self.counted else self.planned_after


@dataclasses.dataclass(frozen=True, eq=False)
class Report:
  """Per-site results of :func:`jaxfold.fold` (or :func:`jaxfold.cbwc`).

  ``str(report)`` groups identical rows, ``report.table(group=False)`` lists
  every site, ``report.diff()`` says what changed, ``report.to_json()`` is for
  tools.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxfold
    >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm()])
    >>> x = jnp.ones((2, 4)); p = m.init(jax.random.PRNGKey(0), x)
    >>> r = jaxfold.fold(p, m.apply, x).report
    >>> r.num_folded, r.sites[0].centered[0].label()
    (1, 'layers_0.kernel[1]')
    >>> print(r.diff().splitlines()[1])
      reductions (reduce_sum, all): 2 -> 1 (-1 mean reduction(s) at 1 folded site(s))
  """
  sites: tuple = ()
  auxiliary: tuple = ()        # tuple[Auxiliary, ...]
  untied_bytes: int = 0
  changes: Optional[Changes] = None
  # counts.ProgramCounts of the fold's two programs, traced on first use (not data: never
  # compared, saved or pickled; what it counts is saved in ``changes``)
  programs: Any = dataclasses.field(default=None, compare=False, repr=False)

  def __reduce__(self):
    return (_report, (self.sites, self.auxiliary, self.untied_bytes, self.counted_changes()))

  def __eq__(self, other) -> bool:
    # (a report equals its saved form: the programs' counts, taken or not yet, are its data)
    if not isinstance(other, Report):
      return NotImplemented
    return ((self.sites, self.auxiliary, self.untied_bytes, self.counted_changes())
            == (other.sites, other.auxiliary, other.untied_bytes, other.counted_changes()))

  def __hash__(self) -> int:
    return hash((self.sites, self.auxiliary, self.untied_bytes))

  def counted_changes(self) -> Optional[Changes]:
    """``changes`` with the reductions and primitive counts of the two
    programs (traced now, once, where this report knows them)."""
    if self.programs is None or self.changes is None or self.changes.counted:
      return self.changes
    before, after, prims = self.programs()
    return dataclasses.replace(self.changes, counted_before=before, counted_after=after, primitives=prims)

  @property
  def num_sites(self) -> int:
    """Normalizations: a mean site that norms reading one value share counts each."""
    return sum(s.num_norms for s in self.sites)

  @property
  def num_folded(self) -> int:
    return sum(s.num_norms for s in self.sites if s.folded)

  @property
  def num_shared(self) -> int:
    """Normalizations that share their mean site with another norm reading the same value."""
    return sum(s.num_norms for s in self.sites if s.num_norms > 1)

  @property
  def num_auxiliary(self) -> int:
    return len(self.auxiliary)

  # -- data ------------------------------------------------------------------

  def as_dict(self) -> dict:
    d = {"num_sites": self.num_sites, "num_folded": self.num_folded, "num_mean_sites": len(self.sites),
         "num_auxiliary": self.num_auxiliary, "untied_bytes": self.untied_bytes,
         "auxiliary": [dataclasses.asdict(a) for a in self.auxiliary],
         "sites": [s.as_dict() for s in self.sites]}
    ch = self.counted_changes()
    if ch is not None:
      d["changes"] = {**dataclasses.asdict(ch), "reductions_after": ch.reductions_after}
    return d

  def to_json(self) -> str:
    return json.dumps(self.as_dict(), indent=2, default=str)

  @classmethod
  def from_dict(cls, d: dict) -> "Report":
    """Inverse of :meth:`as_dict` (also reads reports saved by earlier versions)."""
    sites = []
    for s in d.get("sites", []):
      s = dict(s)
      s["centered"] = tuple(Centering(**{**c, "spec": tuple(tuple(x) for x in c.get("spec", ()))})
                            for c in s.get("centered", ()))
      for k in ("shape", "axes", "aux", "norms"):
        s[k] = tuple(s.get(k, ()))
      sites.append(Site(**s))
    aux = []
    for i, a in enumerate(d.get("auxiliary", ())):
      if isinstance(a, str):   # written before auxiliary centerings were structured
        aux.append(Auxiliary(i + 1, value=a))
      else:
        aux.append(Auxiliary(**{**a, "shape": tuple(a.get("shape", ())),
                                "sites": tuple(a.get("sites", ()))}))
    ch = d.get("changes")
    changes = None
    if ch:
      changes = Changes(**{k: (tuple(tuple(x) for x in v) if k == "primitives" else v)
                           for k, v in ch.items() if k != "reductions_after"})
    return cls(tuple(sites), tuple(aux), int(d.get("untied_bytes", 0)), changes)

  def on_platform(self, platform: str, kernel_proof: bool) -> "Report":
    """This report, recording where the fold was made and whether the kernel's
    proof ran (:meth:`diff` says what runs there)."""
    if self.changes is None:
      return self
    return dataclasses.replace(self, changes=dataclasses.replace(
        self.changes, platform=platform, kernel_proof=kernel_proof))

  # -- text ------------------------------------------------------------------

  def summary(self) -> str:
    s = (f"{self.num_folded}/{self.num_sites} normalization sites folded, "
         f"{self.num_auxiliary} auxiliary centering(s)")
    if self.num_shared:
      s += (f" ({self.num_shared} of them read a value another norm reads: they share "
            f"{sum(x.num_norms > 1 for x in self.sites)} mean site(s), {len(self.sites)} in all)")
    if self.untied_bytes:
      s += f", {_bytes(self.untied_bytes)} of untied parameter copies"
    return s

  def table(self, group: bool = True) -> str:
    """The per-site table; ``group=True`` merges sites that differ only in a
    layer number (``h_0…h_11/ln_1  (12)``)."""
    return _render([_HEAD] + self._rows(group))

  def _rows(self, group: bool) -> list:
    rows = []
    for members in (_groups(self.sites) if group else [[s] for s in self.sites]):
      s = members[0]
      label = _group_label([m.where for m in members])
      if len(members) > 1:
        label += f"  ({len(members)})"
      if s.folded:
        own = [_merge_texts([m.centered[k].label() for m in members])
               for k in range(len(s.centered))]
        what = ", ".join(own) if own else "nothing new" if s.requires or s.aux else "nothing (zero-sum as written)"
        if s.aux:
          what += "; after " + ", ".join(f"A{a}" for a in s.aux)
        if not s.exact:
          what = "[inexact] " + what
      else:
        what = _merge_texts([m.reason for m in members])
      if s.num_norms > 1:
        what = f"{_shared_text(s)}: " + what
      idx = _indices([m.index for m in members])
      rows.append((idx, "yes" if s.folded else "no", label, "x".join(map(str, s.shape)),
                   ",".join(map(str, s.axes)), what))
    return rows

  def __repr__(self) -> str:
    return f"<jaxfold.Report: {self.summary()}>"

  def _repr_html_(self) -> str:
    """The grouped table as HTML, for notebooks (every text escaped)."""
    e = html.escape
    cells = "".join(f"<th style='text-align:left'>{e(h)}</th>" for h in _HEAD)
    rows = [f"<tr>{cells}</tr>"]
    for r in self._rows(group=True):
      color = "" if r[1] == "yes" else " style='color:#a33'"
      rows.append(f"<tr{color}>" + "".join(f"<td style='text-align:left'>{e(c)}</td>" for c in r)
                  + "</tr>")
    notes = [self.summary()] + ["auxiliary centering " + a.describe() for a in self.auxiliary]
    foot = "".join(f"<div>{e(n)}</div>" for n in notes)
    return f"<div><table>{''.join(rows)}</table>{foot}<pre>{e(LEGEND)}</pre></div>"

  def __str__(self) -> str:
    lines = [self.table(group=True), self.summary()] + ([NO_SITES] if not self.sites else [])
    for a in self.auxiliary:
      lines.append("  auxiliary centering " + a.describe())
    lines.append(LEGEND)
    return "\n".join(lines)

  def diff(self) -> str:
    """What the fold changed: mean reductions per site, auxiliary centerings
    inserted, kernels substituted, parameters centered and untied copies."""
    ch = self.counted_changes() or Changes()
    folded = [s for s in self.sites if s.folded]
    lines = ["what changed (original -> folded program):"]
    if self.changes is not None:
      lines.append(_reductions_text(ch, len(folded), sum(x.num_norms for x in folded)))
      if ch.primitives:
        lines.append("  equations per primitive (counted in the two programs): "
                     + ", ".join(f"{k} {a} -> {b}" for k, a, b in ch.primitives))
    for members in _groups(folded):
      label = _group_label([m.where for m in members])
      n = sum(m.num_reductions for m in members)
      each = f" ({members[0].num_reductions} each)" if len(members) > 1 else ""
      norms = "LayerNorm -> RMSNorm"
      if members[0].num_norms > 1:
        norms = f"{members[0].num_norms} LayerNorms -> RMSNorms ({_shared_text(members[0])})"
      lines.append(f"    {label}: -{n} reduction(s){each}, {norms}")
    for a in self.auxiliary:
      lines.append(f"  + auxiliary centering {a.describe()}")
    lines.append("  kernels substituted: " + _kernels_text(ch, sum(s.kernel for s in folded)))
    if self.changes is not None:
      lines.append(f"  parameters centered in place: {ch.params_centered} leaves "
                   f"({_bytes(ch.params_centered_bytes)}; same shapes and dtypes, new values)")
    copies = {(c.param, c.axes): c.extra_bytes for s in self.sites for c in s.centered
              if c.mode == "untied copy"}
    if copies:
      lines.append(f"  untied centered copies: {len(copies)} ({_bytes(self.untied_bytes)} extra)")
      for (p, ax), b in copies.items():
        lines.append(f"    {Centering(p, ax, 'untied copy').label()}: {_bytes(b)}")
    else:
      lines.append("  untied centered copies: none (0 B extra)")
    not_folded = self.num_sites - self.num_folded
    if not_folded:
      lines.append(f"  unchanged: {not_folded} site(s) keep their LayerNorm (see str(report))")
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Formatting helpers.


def _report(sites, auxiliary, untied_bytes, changes) -> "Report":
  return Report(sites, auxiliary, untied_bytes, changes)


def _reductions_text(ch: Changes, folded: int, norms: int) -> str:
  """The reductions line of ``diff``: the programs' counts where they were
  taken, with the plan's account of the difference. ``folded``: the folded
  mean sites; ``norms``: the norms they cover (more when norms share one)."""
  added = f", +{ch.reductions_added} for auxiliary centering(s)" if ch.reductions_added else ""
  if ch.constant_aux:
    added += f"; {ch.constant_aux} auxiliary centering(s) of constants computed at fold time, none per call"
  before = ch.counted_before if ch.counted_before >= 0 else ch.reductions_before
  where = (f"{folded} folded site(s)" if norms == folded
           else f"{norms} folded norms sharing {folded} mean site(s)")
  text = (f"  reductions (reduce_sum, all): {before} -> {ch.reductions_after} "
          f"(-{ch.reductions_removed} mean reduction(s) at {where}{added})")
  if not ch.counted:
    return text + " [planned: the programs were not counted]"
  if (before, ch.counted_after) != (ch.reductions_before, ch.planned_after):
    text += (f" [counted in the two programs; the plan expected {ch.reductions_before} -> "
             f"{ch.planned_after}]")
  return text


def _shared_text(s: Site) -> str:
  return f"{s.num_norms} norms read this one value and share its mean"


NAME_LIMIT = 100


def bound_name(text: str, limit: int = NAME_LIMIT) -> str:
  """``text`` in at most ``limit`` characters, keeping its informative end.

  A module path keeps its end (the norm's own name: ``…/h_11/ln_2``). A chain
  ``site ← caller ← caller`` (sites told apart by their callers) keeps the
  site's name and the outermost callers it needs, the middle written ``…``.

  Example:
    >>> bound_name("a/" * 60 + "ln_2", 20)
    '…a/a/a/a/a/a/a/ln_2'
  """
  if len(text) <= limit:
    return text
  parts = text.split(" ← ")
  if len(parts) == 1:
    return _tail(text, limit)
  head = _tail(parts[0], max(limit // 2, limit - 3 - len(" ← ".join(parts[1:]))))
  tail = [parts[-1]]
  for p in reversed(parts[1:-1]):
    if len(head) + sum(len(t) + 3 for t in tail) + len(p) + 7 > limit:
      break
    tail.insert(0, p)
  more = " ← …" if len(tail) < len(parts) - 1 else ""
  rest = _tail(" ← ".join(tail), limit - len(head) - 3 - len(more))
  return f"{head}{more} ← {rest}"


def _tail(text: str, n: int) -> str:
  """The end of ``text`` in ``n`` characters, from a separator where one is near."""
  if len(text) <= n:
    return text
  cut = text[len(text) - (n - 1):]
  seps = [i for i in (cut.find("/"), cut.find(" ")) if 0 <= i < len(cut) // 2]
  if seps:
    cut = cut[min(seps) + 1:]
  return "…" + cut


def merged_where(norms: tuple) -> str:
  """One row's name for norms sharing a mean: every norm's, ``a + b``, bounded."""
  return bound_name(" + ".join(norms), max(NAME_LIMIT, 40 * len(norms)))


def _kernels_text(ch: Changes, kern: int) -> str:
  """What runs at the folded sites, on the platform the fold was made on."""
  impl, where = ch.norm_impl, ch.platform or "this platform"
  if impl == "xla":
    return "none (norm_impl='xla': XLA's RMSNorm expression everywhere; no kernel proof attempted)"
  if ch.kernel_proof is False:
    return (f"none: no kernel proof attempted (norm_impl={impl!r} considers the Pallas kernel only "
            f"on a GPU; this fold was made on {where}, where XLA's RMSNorm expression runs)")
  if not kern:
    return (f"none (norm_impl={impl!r}: no folded site proved equal to the Pallas RMSNorm formula; "
            "XLA's RMSNorm expression runs)")
  proved = f"{kern} site(s) proved equal to the Pallas RMSNorm formula"
  if impl == "interpret":
    return f"{proved}; they run the kernel in Pallas interpret mode (an emulation, for tests)"
  if impl == "auto":
    return (f"{proved}; norm_impl='auto' runs the kernel where pallas_kernels.choose expects it "
            f"to win on this GPU ({where}), XLA's expression elsewhere")
  if ch.platform in ("", "gpu", "cuda"):
    return f"{proved}; they run the Pallas RMSNorm kernel (norm_impl={impl!r}) when compiled for CUDA"
  return (f"{proved}; norm_impl={impl!r} runs the kernel only when compiled for CUDA: on {where} "
          "(where this fold was made) XLA's RMSNorm expression runs; an export or AOT compile for "
          "a GPU carries the kernel")


_KEY = re.compile(r"\['([^']*)'\]|\[(\d+)\]|\.([A-Za-z_]\w*)")
# Leaves of jaxfold's own parameter type (Params; older: FoldedParams, FusedParams) are named
# through their fields; labels drop those so fold, fuse and rotate name a
# parameter alike.
_FIELD = re.compile(r"^\.(?:params|base)(?=[.\[])")
_MADE = re.compile(r"""^\.(?:untied|extras)\[(?:"(.*)"|'(.*)')\]$""")


def _dims(axes: str) -> str:
  """``"(1)"`` -> ``"1"``, ``"(3(groups of 4))"`` -> ``"3/4"``."""
  return axes.strip("()").replace("(groups of ", "/").replace(")", "")


def param_label(path: str) -> str:
  """``"['params']['h_0']['attn']['kernel']"`` -> ``"h_0.attn.kernel"``.

  Paths into a fold's or a fuse's parameters name the same leaf the same way;
  leaves jaxfold made are named by the parameter they come from.

  Example:
    >>> param_label(".base.params['params']['h_0']['attn']['kernel']")
    'h_0.attn.kernel'
    >>> param_label(".base.untied[\"['wte']['embedding']@centered(1)\"]")
    'wte.embedding[1] (copy)'
  """
  if path.startswith("<"):   # a description, not a path: <captured constant (100, 64) read at f.py:3 (g)>
    return path
  while (m := _FIELD.match(path)) is not None:
    path = path[m.end():]
  made = _MADE.match(path)
  if made is not None:
    return _made_label(made.group(1) if made.group(1) is not None else made.group(2))
  if "@" in path:
    return _made_label(path)
  parts = [a or b or c for a, b, c in _KEY.findall(path)]
  if not parts:
    return path
  if parts[0] == "params" and len(parts) > 1:
    parts = parts[1:]
  if parts[-1] == "value" and len(parts) > 1:   # nnx.Variable leaves
    parts = parts[:-1]
  return ".".join(parts)


def _made_label(name: str) -> str:
  """Names jaxfold gives the leaves it adds: ``P@centered(d)`` (fold's untied
  copy), ``W@fusedγ`` (fuse's γ-scaled copy), ``W@biasβ`` (fuse's new bias)."""
  head, _, tail = name.partition("@")
  if tail.startswith("centered"):
    return f"{param_label(head)}[{_dims(tail[len('centered'):])}] (copy)"
  if tail.startswith("fused"):
    return f"{param_label(head)} (copy scaled by {param_label(tail[len('fused'):])})"
  if tail.startswith("bias"):
    return f"{param_label(head)} (new bias from {param_label(tail[len('bias'):])})"
  return param_label(head) + (f"@{tail}" if tail else "")


def _bytes(n: int) -> str:
  if n >= 2**20:
    return f"{n / 2**20:.1f} MiB"
  if n >= 2**10:
    return f"{n / 2**10:.1f} KiB"
  return f"{n} B"


_NUM = re.compile(r"\d+")


def _template(text: str) -> str:
  return _NUM.sub("#", text)


def _site_key(s: Site) -> tuple:
  return (_template(s.where), s.folded, _template(s.reason), s.shape, s.axes,
          tuple(_template(c.label()) for c in s.centered), s.aux, s.exact, s.requires > len(s.centered),
          s.num_reductions)


def _groups(sites) -> list:
  """Sites whose rows differ only in one number (a layer index) form a group,
  in order of first appearance; anything else stays alone."""
  by_key: dict = {}
  for s in sites:
    by_key.setdefault(_site_key(s), []).append(s)
  out = []
  for members in by_key.values():
    if len(members) == 1 or _varying(m.where for m in members) is not None:
      out.append(members)
    else:
      out.extend(_split_by_one_number(members))
  out.sort(key=lambda g: g[0].index)
  return out


def _split_by_one_number(members: list) -> list:
  """Rows whose names differ in several numbers (layer and head:
  ``l_0/norms_1``), grouped along the one number that leaves fewest groups."""
  nums = [_NUM.findall(m.where) for m in members]
  if len({len(n) for n in nums}) != 1 or not nums[0]:
    return [[m] for m in members]
  best = None
  for k in range(len(nums[0])):
    parts: dict = {}
    for m, n in zip(members, nums):
      parts.setdefault(tuple(n[:k] + n[k + 1:]), []).append(m)
    if best is None or len(parts) < len(best):
      best = list(parts.values())
  return best


def _varying(texts) -> Optional[int]:
  """The position of the one number that differs between ``texts`` (-1 if none
  differs); None when several do."""
  nums = [_NUM.findall(t) for t in texts]
  if not nums or len({len(n) for n in nums}) != 1:
    return None
  diff = [k for k in range(len(nums[0])) if len({n[k] for n in nums}) > 1]
  if not diff:
    return -1
  return diff[0] if len(diff) == 1 else None


def _group_label(texts: list) -> str:
  """``["h_0/ln_1", "h_1/ln_1", "h_2/ln_1"]`` -> ``"h_0…h_2/ln_1"``."""
  if len(texts) == 1:
    return texts[0]
  k = _varying(texts)
  if k is None or k < 0:
    return f"{texts[0]} x{len(texts)}"
  values = [int(_NUM.findall(t)[k]) for t in texts]
  spans = list(_NUM.finditer(texts[0]))
  m = spans[k]
  # the token the number belongs to (e.g. "h_0" in "h_0/ln_1"): its run of word
  # characters, repeated at both ends (never past a bracket, so labels stay balanced)
  start = _WORD_START.search(texts[0][:m.start()]).start()
  end = m.end() + _WORD_END.match(texts[0], m.end()).end() - m.end()
  token_pre, token_post = texts[0][start:m.start()], texts[0][m.end():end]
  lo, hi = min(values), max(values)
  if sorted(values) == list(range(lo, hi + 1)):
    rng = f"{token_pre}{lo}{token_post}…{token_pre}{hi}{token_post}"
  else:
    rng = "{" + ",".join(f"{token_pre}{v}{token_post}" for v in values) + "}"
  return texts[0][:start] + rng + texts[0][end:]


_WORD_START = re.compile(r"[A-Za-z0-9_-]*$")
_WORD_END = re.compile(r"[A-Za-z0-9_-]*")


def _indices(ix: list) -> str:
  if len(ix) <= 3:
    return ",".join(map(str, ix))
  return f"{ix[0]},{ix[1]},…,{ix[-1]}"


def _merge_texts(texts: list) -> str:
  """One text for grouped rows: every number that differs between them is
  written ``*`` (``h_*.attn.c_proj.kernel[1]``)."""
  nums = [_NUM.findall(t) for t in texts]
  if len({len(n) for n in nums}) != 1 or len({_template(t) for t in texts}) != 1:
    return texts[0]
  vary = {k for k in range(len(nums[0])) if len({n[k] for n in nums}) > 1}
  out, last = [], 0
  for k, m in enumerate(_NUM.finditer(texts[0])):
    out.append(texts[0][last:m.start()] + ("*" if k in vary else m.group()))
    last = m.end()
  return "".join(out) + texts[0][last:]


def _render(rows: list) -> str:
  widths = [max(len(r[i]) for r in rows) for i in range(5)]
  lines = []
  for k, r in enumerate(rows):
    lines.append("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
    if k == 0:
      lines.append("-" * min(len(lines[0]), 120))
  return "\n".join(lines)
