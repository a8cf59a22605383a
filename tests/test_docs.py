"""The guide's Python snippets run, in order, as one program (blocks that need a
downloaded checkpoint, marked by a ``path/to`` placeholder, are skipped)."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_guide_snippets_run(tmp_path, monkeypatch):
  text = open(os.path.join(ROOT, "docs", "guide.md"), encoding="utf-8").read()
  blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "path/to" not in b]
  assert len(blocks) >= 5
  monkeypatch.chdir(tmp_path)            # the save/load snippet writes ./gpt2-fold
  env: dict = {}
  exec(compile("\n".join(blocks), "docs/guide.md", "exec"), env)   # noqa: S102 - our own docs
  assert env["deployed"].report.num_folded == 1
  assert env["again"].report == env["folded"].report
