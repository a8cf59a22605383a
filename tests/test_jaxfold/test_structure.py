"""Structural checks on the source tree (issue 22): they scan the code, not its behaviour.

* Primitive knowledge lives in the rule registry (``jaxfold/_src/rules/``) and
  the JAX version layer (``compat.py``) only: elsewhere in ``jaxfold/`` no
  string literal names a registered rule or primitive, no code reads an
  equation's params (``x.params[...]``, ``x.params.get(...)``), and no code
  dispatches on a control-flow primitive through ``compat`` (``is_scan``,
  ``scan_partition``, ...). Control flow is ``rules/control.py``'s facets.
* No import circles among jaxfold's modules (every ``import`` counts,
  function-level ones too: a lazy import hides a circle, it does not remove it).

* One indentation style (2 spaces per block) in every .py of the repository.
* Public modules (``jaxfold/*.py``, ``jaxfold/cli/``) re-export only names that
  are public in their ``_src`` module, under the same name.
* Every ``jaxfold/_src`` module has a mirroring test module (``mirror_candidates``).

Each test fails listing every offender, so the goal is checked, not claimed.
"""

from __future__ import annotations

import ast
import pathlib

import jaxfold

ROOT = pathlib.Path(jaxfold.__file__).resolve().parent

# The control-flow dispatch helpers of compat: only rules/ may call them.
COMPAT_DISPATCH = frozenset({
    "is_scan", "is_cond", "is_while", "is_call", "is_remat",
    "scan_partition", "scan_length", "while_partition", "control_bodies", "call_kind",
})

# String literals that equal a rule name but mean something else, each with
# the reason; keep this short (a new entry needs the same scrutiny as code).
NOT_PRIMITIVES = {
    ("_src/fold.py", "copy"): "the tied_weights option value 'copy'",
    ("cli/_util.py", "copy"): "the --tied-weights choice 'copy'",
}


def _names() -> frozenset:
  from jaxfold._src import compat
  from jaxfold._src.rules import all_rules, call_rules
  rules = list(all_rules()) + list(call_rules())
  names = {r.name for r in rules}
  names |= {p.name for r in rules for p in r.primitives if p is not None}
  names |= {p.name for p in compat.prims().values()}
  # the call primitives' names across jax versions
  names |= {"pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
            "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
  # checkpoint_name's primitive is called `name`, the word every module uses as a dict key
  # or attribute; its rule's own name, "checkpoint_name", is still checked
  names -= {"name"}
  return frozenset(names)


def _checked_files() -> list:
  """Every module of the package except the registry and compat."""
  out = []
  for f in sorted(ROOT.rglob("*.py")):
    rel = f.relative_to(ROOT).as_posix()
    if rel.startswith("_src/rules/") or rel == "_src/compat.py":
      continue
    out.append(f)
  return out


def primitive_knowledge_offenders() -> list:
  """``file:line: what`` for every piece of primitive knowledge outside the registry."""
  names = _names()
  out = []
  for f in _checked_files():
    rel = f.relative_to(ROOT).as_posix()
    for n in ast.walk(ast.parse(f.read_text(), str(f))):
      what = None
      if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names:
        if (rel, n.value) not in NOT_PRIMITIVES:
          what = f"primitive name {n.value!r}"
      elif isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute) and n.value.attr == "params":
        what = "equation params subscript `.params[...]`"
      elif (isinstance(n, ast.Attribute) and n.attr == "get" and isinstance(n.value, ast.Attribute)
            and n.value.attr == "params"):
        what = "equation params read `.params.get(...)`"
      elif isinstance(n, ast.Attribute) and n.attr in COMPAT_DISPATCH:
        what = f"control-flow dispatch `{n.attr}`"
      if what:
        out.append(f"jaxfold/{rel}:{n.lineno}: {what}")
  return sorted(set(out))


def test_no_primitive_knowledge_outside_rules():
  offenders = primitive_knowledge_offenders()
  assert len(_checked_files()) > 40
  assert not offenders, (f"{len(offenders)} piece(s) of primitive knowledge outside rules/ and compat.py "
                         "(move them into a rule facet):\n" + "\n".join(offenders))


def test_scan_sees_the_registry():
  """The scan above is not vacuous: the names it looks for include the
  control-flow and call primitives, and it finds a planted offender."""
  names = _names()
  assert {"scan", "cond", "while", "reduce_sum", "dot_general", "pjit"} <= names
  tree = ast.parse('x = rule_for(p).name == "reduce_sum"\ny = eqn.params["jaxpr"]\n')
  consts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
  subs = [n for n in ast.walk(tree) if isinstance(n, ast.Subscript) and n.value.attr == "params"]
  assert "reduce_sum" in consts and len(subs) == 1


# ----------------------------------------------------------------------------
# Import circles.


def _module_name(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT.parent).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def import_graph() -> dict:
  """``{module: {imported jaxfold module: first line}}`` over every ``.py`` under jaxfold/."""
  files = {_module_name(f): f for f in sorted(ROOT.rglob("*.py"))}
  graph: dict = {}
  for mod, f in files.items():
    is_pkg = f.name == "__init__.py"
    edges: dict = {}

    def add(target, line, mod=mod, edges=edges):
      while target and target not in files:   # `import a.b.c` of a name: its module
        target = target.rpartition(".")[0]
      if target and target != mod:
        edges.setdefault(target, line)

    for n in _runtime_nodes(ast.parse(f.read_text(), str(f))):
      if isinstance(n, ast.Import):
        for a in n.names:
          if a.name.split(".")[0] == "jaxfold":
            add(a.name, n.lineno)
      elif isinstance(n, ast.ImportFrom):
        if n.level:
          base = mod.split(".") if is_pkg else mod.split(".")[:-1]
          base = base[:len(base) - (n.level - 1)]
          src = ".".join(base + ([n.module] if n.module else []))
        else:
          src = n.module or ""
        if src.split(".")[0] != "jaxfold":
          continue
        for a in n.names:
          sub = f"{src}.{a.name}"
          add(sub if sub in files else src, n.lineno)
    graph[mod] = edges
  return graph


def _runtime_nodes(tree: ast.AST):
  """Every node except those under ``if TYPE_CHECKING:`` (annotations only; never run)."""
  stack = [tree]
  while stack:
    n = stack.pop()
    yield n
    for c in ast.iter_child_nodes(n):
      if isinstance(c, ast.If) and (getattr(c.test, "id", None) == "TYPE_CHECKING"
                                    or getattr(c.test, "attr", None) == "TYPE_CHECKING"):
        stack.extend(c.orelse)
        continue
      stack.append(c)


def import_cycles(graph: dict) -> list:
  """The strongly connected components with more than one module (Tarjan), each
  as one cycle through it, ``a -> b -> ... -> a``."""
  index, low, stack, on, comps = {}, {}, [], set(), []
  counter = [0]

  def strong(v):
    work = [(v, iter(sorted(graph.get(v, ()))))]
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    while work:
      node, it = work[-1]
      for w in it:
        if w not in index:
          index[w] = low[w] = counter[0]
          counter[0] += 1
          stack.append(w)
          on.add(w)
          work.append((w, iter(sorted(graph.get(w, ())))))
          break
        if w in on:
          low[node] = min(low[node], index[w])
      else:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
          comp = []
          while True:
            w = stack.pop()
            on.discard(w)
            comp.append(w)
            if w == node:
              break
          if len(comp) > 1:
            comps.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      strong(v)
  return [_one_cycle(graph, comp) for comp in comps]


def _one_cycle(graph: dict, comp: list) -> str:
  """A shortest cycle through the component's first module, with import lines."""
  members, start = set(comp), comp[0]
  prev = {start: None}
  frontier = [start]
  while frontier:
    nxt = []
    for v in frontier:
      for w in sorted(graph[v]):
        if w == start:
          path = [v]
          while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
          path = path[::-1] + [start]
          hops = [f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:])]
          return " -> ".join(hops + [start]) + f"   [{len(comp)} modules: {', '.join(comp)}]"
        if w in members and w not in prev:
          prev[w] = v
          nxt.append(w)
    frontier = nxt
  return ", ".join(comp)  # pragma: no cover


def test_no_import_cycles():
  cycles = import_cycles(import_graph())
  assert not cycles, "import circles among jaxfold modules:\n" + "\n".join(cycles)


def test_cycle_finder_finds_a_planted_cycle():
  g = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
  (cycle,) = import_cycles(g)
  assert cycle.startswith("a (line 1) -> b (line 2) -> c (line 3) -> a")
  assert import_cycles({"a": {"b": 1}, "b": {}}) == []
  graph = import_graph()
  assert "jaxfold._src.analysis" in graph["jaxfold._src.pipeline"]   # a real edge: the scan sees imports
  assert "jaxfold._src.defer_analysis" in graph["jaxfold._src.rewrite"]


# ----------------------------------------------------------------------------
# Issue 35's house rules for the whole repository: one indentation style,
# public shims that export public names, every _src module mirrored by tests.

REPO = ROOT.parent
SOURCE_DIRS = ("jaxfold", "models", "pallas_kernels", "benchmarks", "examples", "tests")


def _repo_files() -> list:
  return [f for d in SOURCE_DIRS for f in sorted((REPO / d).rglob("*.py"))]


def indentation_offenders(files) -> list:
  """``file:line`` of every block indented other than 2 spaces deeper than its parent (or with a tab).
  Continuation lines inside brackets are free (hanging alignment); only INDENT tokens count."""
  import io
  import tokenize
  out = []
  for f in files:
    stack = [0]
    for t in tokenize.generate_tokens(io.StringIO(pathlib.Path(f).read_text(encoding="utf-8")).readline):
      if t.type == tokenize.INDENT:
        width = len(t.string.expandtabs(8))
        if "\t" in t.string or width - stack[-1] != 2:
          out.append(f"{f}:{t.start[0]}: indented by {width - stack[-1]}{' (tab)' if chr(9) in t.string else ''}")
        stack.append(width)
      elif t.type == tokenize.DEDENT:
        stack.pop()
  return out


def test_two_space_indentation_everywhere():
  bad = indentation_offenders(_repo_files())
  assert not bad, ("blocks not indented by 2 spaces (fix with `python .ci/reindent.py FILE...`):\n"
                   + "\n".join(bad))


def test_indentation_check_finds_four_spaces(tmp_path):
  four = tmp_path / "four.py"
  four.write_text('def f(x):\n    """Doc."""\n    if x:\n        return (1,\n                2)\n    return 0\n')
  two = tmp_path / "two.py"
  two.write_text('def f(x):\n  if x:\n    return (1,\n            2)\n  return 0\n')
  assert indentation_offenders([two]) == []
  assert [b.split(":")[1] for b in indentation_offenders([four])] == ["2", "4"]


def _public_modules() -> list:
  """The modules a user imports: everything under jaxfold/ outside ``_src`` whose name has no underscore."""
  return [f for f in sorted(ROOT.rglob("*.py"))
          if "_src" not in f.relative_to(ROOT).parts
          and (not f.name.startswith("_") or f.name in ("__init__.py", "__main__.py"))
          and not any(p.startswith("_") for p in f.relative_to(ROOT).parts[:-1])]


def private_reexports(files) -> list:
  """``file:line: what`` for every ``from jaxfold._src... import a [as b]`` in a public module where
  ``a`` is private in its defining module, or is re-exported under another name (``b`` != ``a``)."""
  out = []
  for f in files:
    tree = ast.parse(pathlib.Path(f).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
      if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxfold._src")):
        continue
      for a in node.names:
        if a.name.startswith("_") and not a.name.startswith("__"):
          out.append(f"{f}:{node.lineno}: {node.module}.{a.name} is private")
        elif a.asname and a.asname != a.name:
          out.append(f"{f}:{node.lineno}: {node.module}.{a.name} re-exported as {a.asname}")
  return out


def test_public_modules_export_only_public_names():
  bad = private_reexports(_public_modules())
  assert not bad, "public modules re-exporting private or renamed names:\n" + "\n".join(bad)
  import jaxfold.exporting
  import jaxfold.serialization
  for mod in (jaxfold, jaxfold.serialization, jaxfold.exporting, jaxfold.benchmarking):
    for name in mod.__all__:
      obj = getattr(mod, name)
      defined = getattr(obj, "__name__", name)
      assert not defined.startswith("_") or defined.startswith("__"), f"{mod.__name__}.{name} is {defined}"


def test_private_reexport_check_finds_both_kinds(tmp_path):
  shim = tmp_path / "shim.py"
  shim.write_text("from jaxfold._src.saved_fold import save_fold\n"
                  "from jaxfold._src.saved_fold import _helper as helper\n"
                  "from jaxfold._src.integrity import atomic_write_bytes as write_it\n")
  bad = private_reexports([shim])
  assert [b.split(": ", 1)[1] for b in bad] == ["jaxfold._src.saved_fold._helper is private",
                                                "jaxfold._src.integrity.atomic_write_bytes re-exported as write_it"]


# Mirror rule: module ``jaxfold/_src/[pkg/]m.py`` is mirrored by the first of these that exists:
# ``tests/test_jaxfold/[pkg/]test_m.py``, ``tests/test_m.py``, ``tests/test_pkg/test_m.py``,
# ``tests/test_pkg_m.py`` (e.g. rules/dims.py -> tests/test_jaxfold/rules/test_dims.py,
# artifact.py -> tests/test_artifact.py, frameworks/keras.py -> tests/test_frameworks/test_keras.py,
# server/batcher.py -> tests/test_server_batcher.py). Package ``__init__.py`` files need none.
def mirror_candidates(module: pathlib.Path, tests: pathlib.Path) -> list:
  rel = module.relative_to(ROOT / "_src")
  pkg, m = rel.parts[:-1], module.stem
  out = [tests / "test_jaxfold" / pathlib.Path(*pkg) / f"test_{m}.py", tests / f"test_{m}.py"]
  if pkg:
    out += [tests / f"test_{pkg[-1]}" / f"test_{m}.py", tests / f"test_{pkg[-1]}_{m}.py"]
  return out


def unmirrored_modules(tests: pathlib.Path) -> list:
  return [m.relative_to(ROOT).as_posix() for m in sorted((ROOT / "_src").rglob("*.py"))
          if m.name != "__init__.py" and not any(c.exists() for c in mirror_candidates(m, tests))]


def test_every_src_module_has_a_test_module():
  bad = unmirrored_modules(REPO / "tests")
  assert not bad, ("modules with no mirroring test module (see mirror_candidates for the names):\n"
                   + "\n".join(bad))


def test_mirror_check_finds_a_missing_mirror(tmp_path):
  (tmp_path / "test_jaxfold" / "rules").mkdir(parents=True)
  (tmp_path / "test_jaxfold" / "rules" / "test_dims.py").write_text("")
  (tmp_path / "test_serve_batcher.py").write_text("")
  missing = unmirrored_modules(tmp_path)
  assert "_src/rules/dims.py" not in missing and "_src/serve/batcher.py" not in missing
  assert "_src/fold.py" in missing and "_src/rules/control.py" in missing


# Steps keep their state to themselves (issue 35).
#
# A transform's state is read through its public records (``Step.record``,
# ``analysis_for``, ``params_abstract``, ...), never as ``x._private`` from
# another module, and save/load/export never branch on a transform's name:
# adding a step is one new module, not an edit of theirs.

# Names with a leading underscore that are public API of their type.
PUBLIC_UNDERSCORED = frozenset({"_replace", "_fields", "_asdict", "_make", "_field_defaults"})
# Modules whose job is to read other packages' internals (jax's, through compat).
PRIVATE_READS_ALLOWED = frozenset({"_src/compat.py"})
TRANSFORM_NAMES = frozenset({"fold", "cbwc", "fuse_affine", "defer_norms", "rotate"})
# Modules that persist or export any chain: they must not branch on a step's name.
CHAIN_CONSUMERS = ("_src/saved_fold.py", "_src/artifact.py", "_src/defer.py", "serialization.py",
                   "exporting.py", "_src/server/")


def _own_private_names(tree: ast.AST) -> set:
  """The underscored names a module defines itself: functions, classes,
  attributes it assigns (``self._x = ...``, ``obj._x = ...``), class fields,
  parameters."""
  own = set()
  for n in ast.walk(tree):
    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      own.add(n.name)
    elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
      own.add(n.attr)
    elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
      own.add(n.id)
    elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
      own.add(n.target.id)
    elif isinstance(n, ast.arg):
      own.add(n.arg)
  return {x for x in own if x.startswith("_")}


def _foreign_modules(tree: ast.AST) -> set:
  """Names bound to modules outside jaxfold (``import jax``, ``import numpy as np``)."""
  out = set()
  for n in ast.walk(tree):
    if isinstance(n, ast.Import):
      for a in n.names:
        if a.name.split(".")[0] != "jaxfold":
          out.add((a.asname or a.name).split(".")[0])
    elif isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] != "jaxfold":
      out.update(a.asname or a.name for a in n.names)
  return out


def private_read_offenders(sources: dict | None = None) -> list:
  """``file:line: x._name`` for every read of a private attribute that the
  module does not define itself (another module's function, another class's
  state), under ``jaxfold/_src``. ``self``/``cls`` reads of a module's own
  names are fine; third-party internals are compat.py's business."""
  if sources is None:
    sources = {f.relative_to(ROOT).as_posix(): f.read_text() for f in sorted((ROOT / "_src").rglob("*.py"))}
  out = []
  for rel, text in sources.items():
    if rel in PRIVATE_READS_ALLOWED:
      continue
    tree = ast.parse(text, rel)
    own, foreign = _own_private_names(tree), _foreign_modules(tree)
    for n in ast.walk(tree):
      if not (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)):
        continue
      a = n.attr
      if not a.startswith("_") or a.startswith("__") or a in PUBLIC_UNDERSCORED or a in own:
        continue
      base = n.value
      if isinstance(base, ast.Name) and (base.id in foreign or base.id in ("self", "cls")):
        continue
      out.append(f"jaxfold/{rel}:{n.lineno}: {ast.unparse(n)}")
  return sorted(set(out))


def name_branch_offenders(sources: dict | None = None) -> list:
  """``file:line: ...`` for every comparison with a transform's name
  (``== "rotate"``, ``in ("fuse_affine", "rotate")``) in the modules that
  save, load, export or serve a chain."""
  if sources is None:
    sources = {}
    for f in sorted(ROOT.rglob("*.py")):
      rel = f.relative_to(ROOT).as_posix()
      if any(rel == c or (c.endswith("/") and rel.startswith(c)) for c in CHAIN_CONSUMERS):
        sources[rel] = f.read_text()
  out = []
  for rel, text in sources.items():
    for n in ast.walk(ast.parse(text, rel)):
      if isinstance(n, ast.Compare):
        for side in [n.left, *n.comparators]:
          names = [side] + (list(side.elts) if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [])
          if any(isinstance(c, ast.Constant) and c.value in TRANSFORM_NAMES for c in names):
            out.append(f"jaxfold/{rel}:{n.lineno}: {ast.unparse(n)}")
            break
      elif (isinstance(n, ast.Assign) and isinstance(n.value, (ast.Tuple, ast.Set, ast.List))
            and not any(getattr(t, "id", None) == "__all__" for t in n.targets)):
        # a module-level table of names a branch then tests (_CHAIN_STEPS = ("fuse_affine", ...))
        if any(isinstance(c, ast.Constant) and c.value in TRANSFORM_NAMES for c in n.value.elts):
          out.append(f"jaxfold/{rel}:{n.lineno}: {ast.unparse(n)[:80]}")
  return sorted(set(out))


def test_no_private_reads_of_other_modules_objects():
  offenders = private_read_offenders()
  assert not offenders, (f"{len(offenders)} read(s) of another module's private attribute under jaxfold/_src "
                         "(give the owner a public method or record):\n" + "\n".join(offenders))


def test_no_transform_name_branches_in_save_export():
  offenders = name_branch_offenders()
  assert not offenders, (f"{len(offenders)} branch(es) on a transform's name in save/load/export/serve "
                         "(iterate over the steps instead):\n" + "\n".join(offenders))


def test_step_scans_find_planted_offenders():
  """The two scans above are not vacuous."""
  planted = {"_src/x.py": "from jaxfold._src import affine\nimport numpy as np\n"
                          "class A:\n  def f(self, fn):\n    self._mine = 1\n"
                          "    return fn._base, affine._relayout, self._mine, np._core, fn._replace(a=1)\n"}
  got = private_read_offenders(planted)
  assert [g.split(": ")[1] for g in got] == ["affine._relayout", "fn._base"]   # not self's, np's, _replace
  planted = {"_src/saved_fold.py": "if step['name'] == 'rotate':\n  pass\nX = ('fuse_affine', 'rotate')\n"
                                      "ok = kind == 'other'\n"}
  assert len(name_branch_offenders(planted)) == 2
