"""The documentation runs as written.

* The README starts with the project's two commands, stays a page, and its first Python block
  prints exactly the output the README shows under it.
* Every section of docs/guide.md runs alone: its Python blocks, in order, in a fresh
  interpreter (a new process, in an empty directory), never the blocks of earlier sections.
  A section that imports an optional package names its install line and is skipped, with
  that line as the reason, where the package is missing.
* The guide's served example (export, serve, curl) is answered by the server it starts.
* Every relative link and anchor in README.md and docs/*.md resolves.
"""

import ast
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
GUIDE = os.path.join(ROOT, "docs", "guide.md")
PAGES = [README] + sorted(os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                          if f.endswith(".md"))

# The two set-up commands (CI runs the second's test command, .ci/run).
COMMANDS = ['pip install -e . && jaxfold demo', 'pip install -e ".[test]" && python -m pytest -q']
README_MAX_BYTES = 15_000
# Modules a guide section may import without naming an install line: the standard library,
# jaxfold's own packages and its dependencies (pyproject.toml).
BASE = {"jaxfold", "models", "pallas_kernels", "jax", "flax", "optax", "chex", "orbax", "numpy", "safetensors"}
# Optional modules and the line a section that imports one must show.
OPTIONAL = {"keras": 'pip install -e ".[keras]"', "keras_hub": "pip install --no-deps keras-hub",
            "uvicorn": 'pip install -e ".[serve]"', "starlette": 'pip install -e ".[serve]"'}
# Sections run in the slow tier (`pytest -m slow`): each costs a process (8-18 s on a busy
# 2-core machine) that compiles a zoo model, an export or imports keras; the default tier keeps
# the core paths (fold and report, nnx, keyword arguments, CBWC, save/load) and the README's example.
SLOW_SECTIONS = {"fold-a-hugging-face-checkpoint", "fold-a-keras-3-model", "fold-a-keras-hub-backbone",
                 "export-and-serve", "fuse-γβ-into-the-next-layers-rotate-the-residual-stream",
                 "defer-the-normalization-into-its-readers-flashnorm",
                 "online-hadamards-before-the-down--and-output-projections-quarot",
                 "rotate-for-quantization-then-quantize-quarot-style-with-qwix"}


def _read(path):
  with open(path, encoding="utf-8") as f:
    return f.read()


def slug(title: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
  return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def sections(text: str) -> list:
  """``[(anchor, body)]`` for every ``## `` section of a page."""
  parts = re.split(r"^## (.+)$", text, flags=re.M)
  return [(slug(parts[i]), parts[i + 1]) for i in range(1, len(parts), 2)]


def blocks(text: str, lang: str) -> list:
  return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def run_python(code: str, cwd, timeout: int = 900) -> subprocess.CompletedProcess:
  """``code`` in a fresh interpreter that sees this checkout; KERAS_BACKEND is unset (the
  conftest sets it for the suite; a reader's shell does not), so a section sets it itself."""
  env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
  env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=timeout)


def imported_modules(code: str) -> set:
  mods = set()
  for node in ast.walk(ast.parse(code)):
    if isinstance(node, ast.Import):
      mods |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      mods.add(node.module.split(".")[0])
  return mods


def _guide_cases():
  cases = []
  for anchor, body in sections(_read(GUIDE)):
    if blocks(body, "python"):
      marks = (pytest.mark.slow,) if anchor in SLOW_SECTIONS else ()
      cases.append(pytest.param(anchor, body, id=anchor, marks=marks))
  return cases


# ------------------------------------------------------------------------- README


def test_readme_layout():
  text = _read(README)
  first = blocks(text, "bash")[0].splitlines()
  assert first[:2] == COMMANDS, first
  assert text.index("```bash") < text.index("\n## "), "the two commands come before any section"
  size = len(text.encode("utf-8"))
  assert size <= README_MAX_BYTES, f"README.md is {size} bytes: move detail to docs/"
  for target in ("docs/guide.md", "docs/benchmarks.md", "docs/contributing.md"):
    assert f"]({target}" in text, target
  assert "pytest -m quick" in text and "python -m pytest -q" in text
  assert "git clone" in text


def test_readme_example_prints_what_the_readme_shows(tmp_path):
  """The first Python block, run as written, prints the block that follows it."""
  text = _read(README)
  m = re.search(r"^```python\n(.*?)^```\n+(?:[^`\n][^\n]*\n+)*?```(?:text)?\n(.*?)^```", text, flags=re.S | re.M)
  assert m, "the README's first python block is followed by its printed output"
  code, shown = m.group(1), m.group(2)
  assert code == blocks(text, "python")[0]
  done = run_python(code, tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  strip = lambda s: [line.rstrip() for line in s.strip("\n").splitlines()]
  assert strip(done.stdout) == strip(shown), done.stdout


# -------------------------------------------------------------------------- guide


def test_guide_sections_are_found():
  anchors = [c.id for c in _guide_cases()]
  assert {"fold-a-flax-model-and-read-the-report", "fold-an-nnx-model", "train-with-cbwc-then-fold-for-deployment",
          "save-and-load", "keyword-arguments-dropout-and-training-mode"} <= set(anchors), anchors
  assert SLOW_SECTIONS <= set(anchors), SLOW_SECTIONS - set(anchors)


@pytest.mark.parametrize("anchor,body", _guide_cases())
def test_guide_section_runs_alone(anchor, body, tmp_path):
  code = "\n".join(blocks(body, "python"))
  stdlib = set(sys.stdlib_module_names)
  for mod in sorted(imported_modules(code) - BASE - stdlib):
    assert mod in OPTIONAL, f"#{anchor} imports {mod}: add it to OPTIONAL with its install line"
    assert OPTIONAL[mod] in body, f"#{anchor} imports {mod} but does not say `{OPTIONAL[mod]}`"
    if importlib.util.find_spec(mod) is None:
      pytest.skip(f"#{anchor} needs {mod}: {OPTIONAL[mod]}")
  done = run_python(code, tmp_path)
  assert done.returncode == 0, f"#{anchor} failed on its own:\n{done.stderr[-4000:]}"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _command(line: str, port: int) -> list:
  """A guide shell line as argv: the comment dropped, `jaxfold` as this checkout's CLI."""
  words = shlex.split(line, comments=True)
  words = [w.replace("8000", str(port)) for w in words if w != "&"]
  return [sys.executable, "-m", "jaxfold.cli", *words[1:]] if words[0] == "jaxfold" else words


@pytest.mark.slow
def test_guide_served_example_is_answered(tmp_path):
  """#export-and-serve's shell block: the export, the server and the curl request, whose ids
  must be within the served model's vocabulary."""
  for mod in ("uvicorn", "starlette"):
    if importlib.util.find_spec(mod) is None:
      pytest.skip(f"needs {mod}: {OPTIONAL[mod]}")
  body = dict(sections(_read(GUIDE)))["export-and-serve"]
  lines = [line for line in blocks(body, "bash")[0].splitlines() if line.strip()]
  export, serve, curl = lines
  port = _free_port()
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
  done = subprocess.run(_command(export, port), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert serve.rstrip().split("#")[0].rstrip().endswith("&")
  server = subprocess.Popen(_command(serve, port), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
  try:
    words = shlex.split(curl, comments=True)
    url, body_json = "http://" + words[words.index("-s") + 1].replace("8000", str(port)), words[words.index("-d") + 1]
    deadline = time.monotonic() + 600
    while True:
      assert server.poll() is None, server.stdout.read()[-3000:]
      try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        break
      except (urllib.error.URLError, ConnectionError):
        assert time.monotonic() < deadline, "the server did not answer /health within 600 s"
        time.sleep(1)
    request = urllib.request.Request(url, data=body_json.encode(), method="POST")
    try:
      reply = urllib.request.urlopen(request, timeout=120)
    except urllib.error.HTTPError as e:
      pytest.fail(f"the guide's request is refused: HTTP {e.code}: {e.read().decode()}")
    outputs = json.loads(reply.read())["outputs"]
    assert len(outputs) == len(json.loads(body_json)["inputs"])
  finally:
    server.send_signal(signal.SIGTERM)
    try:
      server.wait(timeout=60)
    except subprocess.TimeoutExpired:
      server.kill()
      server.wait()


# -------------------------------------------------------------------------- links


def _anchors(path) -> set:
  text = re.sub(r"^```.*?^```", "", _read(path), flags=re.S | re.M)
  return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_and_anchors_resolve(page):
  text = re.sub(r"^```.*?^```", "", _read(page), flags=re.S | re.M)
  broken = []
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if re.match(r"[a-z]+:", target):
      continue
    path, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    if not os.path.exists(full):
      broken.append(target)
    elif anchor and full.endswith(".md") and anchor not in _anchors(full):
      broken.append(target)
  assert not broken, f"{os.path.relpath(page, ROOT)}: {broken}"
