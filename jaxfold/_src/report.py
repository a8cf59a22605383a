"""What the fold found, per normalization site, in a form people can read."""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class Centering:
  """One parameter (or captured constant) centered for a site."""
  param: str            # pytree path, e.g. "['params']['Dense_0']['kernel']"
  axes: str             # the centered dims, e.g. "(1,)" or "(3(groups of 4))"
  mode: str             # "in place" | "untied copy" | "constant"
  extra_bytes: int = 0
  spec: tuple = ()      # ((dim, block), ...): zero-sum over blocks of `block` along `dim`


@dataclasses.dataclass(frozen=True)
class Site:
  """One mean reduction that a LayerNorm/GroupNorm performs."""
  index: int
  where: str            # module path (name stack), or the source line without one
  shape: tuple          # shape of the normalized value
  axes: tuple           # reduced axes, in that value's layout
  folded: bool
  reason: str
  centered: tuple = ()  # tuple[Centering, ...]
  auxiliary: bool = False
  num_reductions: int = 1
  exact: bool = True    # False only for CBWC sites folded across dropout
  source: str = ""      # file:line (function) of the mean reduction

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["centered"] = [dataclasses.asdict(c) for c in self.centered]
    return d


@dataclasses.dataclass(frozen=True)
class Report:
  """Per-site results of :func:`jaxfold.fold` (or :func:`jaxfold.cbwc`)."""
  sites: tuple = ()
  auxiliary: tuple = ()        # descriptions of inserted auxiliary centerings
  untied_bytes: int = 0

  @property
  def num_sites(self) -> int:
    return len(self.sites)

  @property
  def num_folded(self) -> int:
    return sum(s.folded for s in self.sites)

  @property
  def num_auxiliary(self) -> int:
    return len(self.auxiliary)

  def as_dict(self) -> dict:
    return {"num_sites": self.num_sites, "num_folded": self.num_folded,
            "num_auxiliary": self.num_auxiliary, "untied_bytes": self.untied_bytes,
            "auxiliary": list(self.auxiliary),
            "sites": [s.as_dict() for s in self.sites]}

  def to_json(self) -> str:
    return json.dumps(self.as_dict(), indent=2, default=str)

  def __str__(self) -> str:
    rows = [("#", "folded", "where", "shape", "axes", "why / centered")]
    for s in self.sites:
      why = s.reason
      if s.folded and s.centered:
        names = [f"{c.param}{c.axes}" + ("" if c.mode == "in place" else f" [{c.mode}]")
                 for c in s.centered]
        more = f" (+{len(names) - 2} more)" if len(names) > 2 else ""
        why += f"; relies on {len(names)} centered: " + ", ".join(names[-2:]) + more
      if not s.exact:
        why = "[inexact] " + why
      rows.append((str(s.index), "yes" if s.folded else "no", _short(s.where, 48),
                   "x".join(map(str, s.shape)), str(s.axes), why))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = []
    for k, r in enumerate(rows):
      lines.append("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
      if k == 0:
        lines.append("-" * (sum(widths) + 12 + len(r[5])))
    summary = (f"{self.num_folded}/{self.num_sites} normalization sites folded, "
               f"{self.num_auxiliary} auxiliary centering(s)")
    if self.untied_bytes:
      summary += f", {self.untied_bytes / 2**20:.1f} MiB of untied parameter copies"
    lines.append(summary)
    for a in self.auxiliary:
      lines.append(f"  auxiliary centering: {a}")
    return "\n".join(lines)


def _short(s: str, n: int) -> str:
  return s if len(s) <= n else "…" + s[-(n - 1):]
