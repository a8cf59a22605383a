"""jaxfold models: the model zoo's names, with family and size."""

from __future__ import annotations

from jaxfold.cli import _util as U


def add_parser(sub) -> None:
  m = sub.add_parser("models", help="list the model zoo (names for --model)")
  m.add_argument("--names", action="store_true", help="names only, one per line")
  m.set_defaults(func=run, model=None)


def run(args) -> int:
  zoo = U.zoo()
  if getattr(args, "names", False) or getattr(args, "model", None) == "?":
    print("\n".join(zoo.names()))
    return 0
  rows = [("name", "family", "config")]
  for name in zoo.names():
    spec = zoo.get(name)
    rows.append((name, spec.family, U.describe(spec)))
  w = [max(len(r[i]) for r in rows) for i in range(2)]
  for r in rows:
    print(f"{r[0].ljust(w[0])}  {r[1].ljust(w[1])}  {r[2]}")
  aliases = getattr(zoo, "ALIASES", {})
  if aliases:
    print("aliases: " + ", ".join(f"{a} = {n}" for a, n in sorted(aliases.items())))
  missing = zoo.import_errors()
  if missing:
    print(f"(not available: {', '.join(sorted(missing))}; see models.import_errors())")
  return 0
