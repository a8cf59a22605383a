"""jaxfold._src.timing: the ratio printed is the ratio of the times printed, with a
bootstrap interval, and "not resolved" when that interval contains 1."""

import os

import pytest

from jaxfold import benchmarking as B


def test_ratio_is_the_ratio_of_the_printed_medians():
  # per-round ratios 1, 1, 0.5, 1, 1.6 have median 1.0, while the medians printed
  # (folded 1.0, original 1.25) say 0.8: the summary must say 0.8
  times = {"original": [1.0, 1.0, 2.0, 2.0, 1.25], "folded": [1.0, 1.0, 1.0, 2.0, 2.0], "_number": 1}
  s = B.summarize_timings(times, "original", ["folded"])
  med = s["median_ms"]
  assert (med["folded"], med["original"]) == (1e3, 1.25e3)
  assert s["ratio"]["folded"] == pytest.approx(0.8)
  lo, hi = s["ratio_ci"]["folded"]
  assert lo <= 0.8 <= hi and s["verdict"]["folded"] in ("faster", "not resolved")


def test_verdict_needs_an_interval_that_excludes_one():
  base = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0, 1.03, 0.97, 1.0]
  slower = [2 * b for b in base]
  ci = B.bootstrap_ratio_ci(slower, base)
  assert 1.9 < ci[0] <= ci[1] < 2.1 and B.verdict(2.0, ci) == "slower"
  noisy = [0.7, 1.3, 0.9, 1.2, 0.8, 1.1, 1.0, 1.25, 0.75]
  ci = B.bootstrap_ratio_ci(noisy, base)
  assert ci[0] < 1 < ci[1] and B.verdict(B.ratio_of_medians(noisy, base), ci) == "not resolved"
  assert B.bootstrap_ratio_ci(noisy, base) == ci   # seeded: the same numbers every run
  with pytest.raises(ValueError, match="paired"):
    B.bootstrap_ratio_ci([1.0], [1.0, 2.0])


def test_py_typed_is_shipped():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  assert os.path.isfile(os.path.join(root, "jaxfold", "py.typed"))
  assert 'jaxfold = ["py.typed"]' in open(os.path.join(root, "pyproject.toml")).read()


def test_modelled_gpu_figures_are_the_committed_ones():
  # `jaxfold demo`/`bench` print these beside a CPU timing: they must be the gpt2 rows of the
  # results file they cite (the model's "time folded/orig" column), all of them
  import pathlib

  from jaxfold import benchmarking
  m = benchmarking.modelled_gpu()
  path = pathlib.Path(__file__).resolve().parents[1] / m.source
  if not path.exists():
    pytest.skip(f"{m.source} is not in this checkout")
  whole = path.read_text().split("## Whole models")[1].split("\n## ")[0]   # the whole-model table
  rows = [[c.strip() for c in line.split("|")[1:-1]] for line in whole.splitlines() if line.startswith("| gpt2 |")]
  committed = {(r[2].upper(), r[1], float(r[-1])) for r in rows}
  assert committed and set(m.ratios) == committed
  assert m.date in path.read_text().split("\n## ")[0]    # the file's own date line
