"""version.py: the one place jaxfold's version is written in Python."""

import pathlib
import re

import jaxfold
from jaxfold._src import integrity, version

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_package_and_pyproject_agree():
  text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
  declared = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)
  assert version.__version__ == declared == jaxfold.__version__


def test_is_a_pep440_release():
  assert re.fullmatch(r"\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?", version.__version__)


def test_manifests_record_it():
  assert integrity.versions()["jaxfold"] == version.__version__
