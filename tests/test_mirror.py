"""Every module under jaxfold/_src has a test module: ``test_<name>.py``
somewhere under tests/, or the one named below (with why it lives there)."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Modules whose tests live under another name.
ELSEWHERE = {
    "jaxfold/_src/rules/contracts.py": ("tests/test_jaxfold/rules/test_control.py",
                                        "static Protocols; the declared facets are checked there"),
    "jaxfold/_src/rules/dims.py": ("tests/test_jaxfold/rules/test_contraction.py",
                                   "a dot_general's dimension numbers"),
    "jaxfold/_src/rules/rotation.py": ("tests/test_jaxfold/test_rotate.py", "the rotate facets"),
    "jaxfold/_src/serve/app.py": ("tests/test_serve.py", "the HTTP server"),
    "jaxfold/_src/serve/batcher.py": ("tests/test_serve_batcher.py", "the request batcher"),
    "jaxfold/_src/serve/model.py": ("tests/test_serve_hardening.py", "the served model's validation"),
    "jaxfold/_src/version.py": ("tests/test_integrity.py", "the version written into manifests"),
    "jaxfold/_src/zero.py": ("tests/test_jaxfold/test_rewrite.py", "a removed mean is a Zero"),
    "jaxfold/_src/deferral.py": ("tests/test_jaxfold/test_defer.py", "deferred norms, end to end"),
    "jaxfold/_src/api.py": ("tests/test_jaxfold/test_fold.py", "the public fold (with fuse/defer)"),
}


def _modules():
  return sorted(p for p in (ROOT / "jaxfold" / "_src").rglob("*.py") if p.name != "__init__.py")


def test_every_src_module_has_a_test_module():
  tests = {p.name: p for p in (ROOT / "tests").rglob("test_*.py")}
  missing = []
  for mod in _modules():
    rel = mod.relative_to(ROOT).as_posix()
    if f"test_{mod.stem}.py" in tests:
      continue
    where = ELSEWHERE.get(rel)
    if where is None or not (ROOT / where[0]).exists():
      missing.append(rel)
  assert not missing, "modules without a test module (add tests/…/test_<name>.py):\n" + "\n".join(missing)


def test_the_exceptions_name_existing_modules():
  stale = [m for m in ELSEWHERE if not (ROOT / m).exists()]
  assert not stale, f"ELSEWHERE names modules that no longer exist: {stale}"
  assert len(_modules()) > 30
