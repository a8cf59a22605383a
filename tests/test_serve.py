"""examples/serve.py: an exported folded model behind HTTP answers like the original."""

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

import jaxfold
from jaxfold.cli import random_params
from jaxfold._src.export import export

models = pytest.importorskip("models")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _post(url, payload, timeout=60):
  req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                               headers={"Content-Type": "application/json"}, method="POST")
  try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  spec = models.get("gpt2-tiny")
  params = random_params(spec, 2, 8, seed=3)
  apply = spec.apply_fn()
  folded = jaxfold.fold(params, apply, *spec.example_inputs(2, 8))
  art = tmp_path_factory.mktemp("serve") / "gpt2-tiny.jaxexport"
  art.write_bytes(export(folded, *spec.example_inputs(2, 8)))
  proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", "serve.py"), str(art),
                           "--host", "127.0.0.1", "--port", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  try:
    line = proc.stdout.readline()   # blocks until the server prints its address (or dies)
    assert line.startswith("listening on http://127.0.0.1:"), line
    yield line.split()[-1], jax.jit(apply), params
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait(timeout=10)


def test_predict_matches_original(server):
  base, apply, params = server
  with urllib.request.urlopen(base + "/health", timeout=30) as r:
    health = json.loads(r.read())
  assert health["inputs"] == [[["batch", "seq"], "int32"]]
  rng = np.random.default_rng(0)
  for b, s in [(1, 4), (2, 8), (3, 5)]:          # a bounded number of requests
    ids = rng.integers(0, 96, (b, s)).astype(np.int32)
    code, got = _post(base + "/predict", {"inputs": ids.tolist()})
    assert code == 200, got
    want = np.asarray(apply(params, ids))
    out = np.asarray(got["outputs"], np.float32)
    assert out.shape == want.shape == tuple(got["shape"])
    assert np.max(np.abs(out - want)) / np.max(np.abs(want)) < 1e-5


def test_bad_requests_get_400(server):
  base = server[0]
  code, got = _post(base + "/predict", {"inputs": [1, 2, 3]})
  assert code == 400 and "rank 2" in got["error"]
  code, got = _post(base + "/predict", {"x": 1})
  assert code == 400 and "inputs" in got["error"]
  code, got = _post(base + "/nope", {"inputs": [[1]]})
  assert code == 404
