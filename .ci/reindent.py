"""Re-indents Python files to the house's 2 spaces per block, token by token.

    python .ci/reindent.py FILE...

A statement starts at 2 × its depth; its continuation lines (inside brackets)
and its docstring's lines move with it, so hanging alignment is kept; a
comment line takes the column of the block it sits in (or moves with the
statement before it); every other multi-line string is left as it is. A file
is written only if its AST is unchanged but for docstring indentation
(``inspect.cleandoc`` equal); ``ruff format`` would also reflow code.
Used once for pallas_kernels/ and benchmarks/gpu_model.py (issue 35);
``tests/test_jaxfold/test_structure.py`` keeps the rule.
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import tokenize


def _docstring_starts(tree: ast.AST) -> set:
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        out.add((first.value.lineno, first.value.col_offset))
  return out


def reindent(src: str) -> str:
  """``src`` with every block indented by 2 spaces (see the module docstring)."""
  lines = src.splitlines(keepends=True)
  docs = _docstring_starts(ast.parse(src))
  depth, old_cols = 0, [0]
  shift: dict = {}       # line -> spaces to remove
  kind: dict = {}        # line -> "code" | "comment" | "doc" | "string"
  comment_cols: dict = {}   # comment line -> {old column: new column} known there
  pending: list = []     # comment lines waiting for the next statement's column
  at_start, cur = True, 0
  for t in tokenize.generate_tokens(io.StringIO(src).readline):
    if t.type == tokenize.INDENT:
      depth += 1
      old_cols.append(len(t.string))
      continue
    if t.type == tokenize.DEDENT:
      depth -= 1
      old_cols.pop()
      continue
    if t.type == tokenize.NEWLINE:
      at_start = True
      continue
    if t.type in (tokenize.NL, tokenize.ENDMARKER):
      continue
    ln = t.start[0]
    if t.type == tokenize.COMMENT and at_start and lines[ln - 1].lstrip().startswith("#"):
      kind.setdefault(ln, "comment")
      comment_cols[ln] = {c: 2 * k for k, c in enumerate(old_cols)}
      pending.append(ln)
      continue
    if at_start:
      cur = t.start[1] - 2 * depth
      for c in pending:
        comment_cols[c].setdefault(t.start[1], 2 * depth)
      pending, at_start = [], False
      shift[ln], kind[ln] = cur, "code"
    elif ln not in kind:
      shift[ln], kind[ln] = cur, "code"
    if t.start[0] != t.end[0]:      # a multi-line string
      for k in range(t.start[0] + 1, t.end[0] + 1):
        kind[k] = "doc" if t.start in docs else "string"
        shift[k] = cur
  out, last = [], 0
  for i, line in enumerate(lines, 1):
    k = kind.get(i)
    if k in (None, "string") or not line.strip():
      out.append(line)
      continue
    lead = len(line) - len(line.lstrip(" "))
    if k == "comment":
      d = lead - comment_cols[i][lead] if lead in comment_cols[i] else last
    else:
      d = last = shift[i]
    if k == "doc":
      d = max(0, min(d, lead))
    if not 0 <= d <= lead:
      raise ValueError(f"line {i}: cannot move {line!r} left by {d}")
    out.append(line[d:])
  return "".join(out)


def _normalized_dump(src: str) -> str:
  tree = ast.parse(src)
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        first.value.value = inspect.cleandoc(first.value.value)
  return ast.dump(tree)


def main(paths: list) -> int:
  for path in paths:
    with open(path, encoding="utf-8") as f:
      src = f.read()
    new = reindent(src)
    if _normalized_dump(new) != _normalized_dump(src):
      print(f"{path}: the AST would change; not written", file=sys.stderr)
      return 1
    if new != src:
      with open(path, "w", encoding="utf-8") as f:
        f.write(new)
      print(f"{path}: re-indented")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
