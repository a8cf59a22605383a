"""`jaxfold serve` and examples/serve.py: a folded model behind HTTP answers like the original.

Servers run as subprocesses on 127.0.0.1 with `--port 0`; every client and
request count is bounded, and every wait has a deadline.
"""

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import jax
import numpy as np
import pytest

import jaxfold
from jaxfold.cli import main as cli_main
from models import random_params
from models import serving_meta as model_meta

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
models = pytest.importorskip("models")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, POSITIONS = 96, 32          # gpt2-tiny
DEADLINE = 90.0                    # seconds: no single wait in this file may exceed it


def _post(url, payload, timeout=60, raw=None):
  data = raw if raw is not None else json.dumps(payload).encode()
  req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                               method="POST")
  try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def _get(url, timeout=30):
  with urllib.request.urlopen(url, timeout=timeout) as r:
    return json.loads(r.read())


class Server:
  """A server subprocess; ``url`` from its first stdout line."""

  def __init__(self, argv, preexec_fn=None, scheme="http", cafile=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env, cwd=ROOT, preexec_fn=preexec_fn)
    self.err = []
    threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
    line = self.proc.stdout.readline()   # blocks until the address is printed (or it dies)
    assert line.startswith(f"listening on {scheme}://127.0.0.1:"), (line, self.stderr())
    self.url = line.split()[-1]
    # the socket listens before the first request can be served: wait for /health
    deadline = time.monotonic() + DEADLINE
    while True:
      try:
        if cafile:
          import ssl
          ctx = ssl.create_default_context(cafile=cafile)
          with urllib.request.urlopen(self.url + "/health", timeout=30, context=ctx) as r:
            self.health = json.loads(r.read())
        else:
          self.health = _get(self.url + "/health")
        break
      except (urllib.error.URLError, ConnectionError):
        assert self.proc.poll() is None and time.monotonic() < deadline, self.stderr()
        time.sleep(0.05)

  def stderr(self):
    return "".join(self.err)[-3000:]

  def stop(self):
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait(timeout=10)
    return self.proc.returncode


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
  spec = models.get("gpt2-tiny")
  assert (spec.config.vocab_size, spec.config.n_positions) == (VOCAB, POSITIONS)
  params = random_params(spec, 2, 8, seed=3)
  apply = jax.jit(spec.apply_fn())
  folded = jaxfold.fold(params, spec.apply_fn(), *spec.example_inputs(2, 8))
  art = tmp_path_factory.mktemp("serve") / "gpt2-tiny.jaxexport"
  art.write_bytes(jaxfold.export(folded, *spec.example_inputs(2, 8), meta=model_meta(spec)))
  return art, apply, params


@pytest.fixture(scope="module")
def server(gpt2):
  s = Server([sys.executable, "-m", "jaxfold.cli", "serve", str(gpt2[0]), "--host", "127.0.0.1",
              "--port", "0", "--max-batch", "8", "--max-body", "65536", "--max-wait-ms", "5"])
  try:
    yield s
  finally:
    code = s.stop()
    assert code == 0, s.stderr()


def _reference(apply, params, rows_by_seq):
  """Original-model outputs, one jitted call per sequence length (rows stacked)."""
  return {s: np.asarray(apply(params, np.stack(rows).astype(np.int32)))
          for s, rows in rows_by_seq.items()}


@pytest.mark.slow
def test_64_concurrent_clients_get_correct_answers(server, gpt2):
  _, apply, params = gpt2
  clients, per_client = 64, 2
  rng = np.random.default_rng(0)
  seqs = [3, 8, 13, 16]             # a few lengths: the reference compiles once per length
  reqs = []
  for _ in range(clients * per_client):
    b, s = int(rng.integers(1, 4)), int(rng.choice(seqs))
    reqs.append(rng.integers(0, VOCAB, (b, s)).astype(np.int32))
  u = urllib.parse.urlsplit(server.url)
  start = threading.Barrier(clients)

  def client(k):
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=DEADLINE)
    start.wait(timeout=DEADLINE)      # all 64 connect and send together
    out = []
    try:
      for i in range(k * per_client, (k + 1) * per_client):   # keep-alive: 2 requests each
        conn.request("POST", "/predict", json.dumps({"inputs": reqs[i].tolist()}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        out.append((i, r.status, json.loads(r.read())))
    finally:
      conn.close()
    return out

  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    results = [x for f in [pool.submit(client, k) for k in range(clients)]
               for x in f.result(timeout=DEADLINE)]
  assert len(results) == len(reqs)
  rows_by_seq = {}
  for ids in reqs:
    rows_by_seq.setdefault(ids.shape[1], []).extend(ids)
  want_by_seq = _reference(apply, params, rows_by_seq)
  taken = {s: 0 for s in want_by_seq}
  for i, status, body in sorted(results, key=lambda r: r[0]):
    assert status == 200, body
    ids = reqs[i]
    s = ids.shape[1]
    want = want_by_seq[s][taken[s]:taken[s] + ids.shape[0]]
    taken[s] += ids.shape[0]
    got = np.asarray(body["outputs"], np.float32)
    assert got.shape == want.shape == tuple(body["shape"])
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5, (i, ids.shape)

  m = _get(server.url + "/metrics")
  assert m["requests"]["200"] >= len(reqs)
  assert m["latency_ms"]["p50"] is not None and m["latency_ms"]["p99"] >= m["latency_ms"]["p50"]
  # a bounded set of programs: every compiled shape is a (batch bucket, seq bucket) pair
  b = server.health["buckets"]
  assert b["batch_buckets"] == [1, 2, 4, 8] and b["seq_buckets"] == [8, 16, 32]
  allowed = [[x, y] for x in b["batch_buckets"] for y in b["seq_buckets"]]
  assert m["programs_compiled"] and all(p in allowed for p in m["programs_compiled"])
  assert len(m["programs_compiled"]) <= m["max_programs"] == 12
  assert _get(server.url + "/health")["buckets"]["compiled"] == m["programs_compiled"]


@pytest.mark.parametrize("inputs, status, match", [
    ([[1.7, 2]], 400, "expected integers, got 1.7"),
    ([[-1, 2]], 400, "value -1 .* outside \\[0, 96\\)"),
    ([[2**40]], 400, "outside \\[0, 96\\)"),
    ([[2**70]], 400, "too large"),
    ([[VOCAB]], 400, "outside \\[0, 96\\)"),
    ([list(range(POSITIONS + 1))], 400, "longer than the model's 32 positions"),
    ([1, 2, 3], 400, "rank 2"),
    ([["a", "b"]], 400, "strings"),
    ([[True]], 400, "true/false"),
    ([[]], 400, "empty"),
    ([[1, 2], [3]], 400, "rectangular"),
    ([[1]] * 9, 400, "at most 8 rows"),
])
def test_invalid_inputs_get_4xx(server, inputs, status, match):
  import re
  code, got = _post(server.url + "/predict", {"inputs": inputs})
  assert code == status and re.search(match, got["error"]), got


def test_base64_outputs_match_json_outputs(server):
  import base64
  ids = [[5, 6, 7, 8, 9]]
  code, plain = _post(server.url + "/predict", {"inputs": ids})
  assert code == 200
  code, packed = _post(server.url + "/predict", {"inputs": ids, "encoding": "base64"})
  assert code == 200 and packed["encoding"] == "base64" and packed["dtype"] == "float32"
  got = np.frombuffer(base64.b64decode(packed["outputs"]), "<f4").reshape(packed["shape"])
  np.testing.assert_array_equal(got, np.asarray(plain["outputs"], np.float32))
  code, bad = _post(server.url + "/predict", {"inputs": ids, "encoding": "xml"})
  assert code == 400 and "encoding" in bad["error"]


def test_protocol_errors(server):
  code, got = _post(server.url + "/predict", {"x": 1})
  assert code == 400 and "inputs" in got["error"]
  code, got = _post(server.url + "/predict", None, raw=b"{not json")
  assert code == 400 and "not valid JSON" in got["error"]
  code, got = _post(server.url + "/predict", None, raw=b" " * 70000)     # --max-body 65536
  assert code == 413 and "--max-body" in got["error"]
  code, got = _post(server.url + "/nope", {"inputs": [[1]]})
  assert code == 404
  try:
    urllib.request.urlopen(server.url + "/predict", timeout=30)
    code = 200
  except urllib.error.HTTPError as e:
    code = e.code
  assert code == 405
  m = _get(server.url + "/metrics")
  assert m["requests"]["413"] >= 1 and m["requests"]["400"] >= 2


@pytest.mark.slow
def test_sigterm_finishes_in_flight_requests_and_exits_0(tmp_path, gpt2, capsys):
  """A fold directory served; 6 requests wait in the batcher (--max-wait-ms 3000)
  when SIGTERM arrives: all are answered, then the process exits 0."""
  _, apply, params = gpt2
  fold_dir = tmp_path / "fold"
  assert cli_main(["--quiet", "fold", "--model", "gpt2-tiny", "--out", str(fold_dir)]) == 0
  capsys.readouterr()
  loaded = jaxfold.load_fold(fold_dir, models.get("gpt2-tiny").apply_fn())
  s = Server([sys.executable, "-m", "jaxfold.cli", "serve", str(fold_dir), "--port", "0",
              "--max-wait-ms", "3000"])
  try:
    assert s.health["model"]["model"] == "gpt2-tiny"
    rng = np.random.default_rng(1)
    reqs = [rng.integers(0, VOCAB, (1, 8)).astype(np.int32) for _ in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
      futs = [pool.submit(_post, s.url + "/predict", {"inputs": r.tolist()}, DEADLINE)
              for r in reqs]
      deadline = time.monotonic() + DEADLINE
      while _get(s.url + "/metrics")["in_flight"] < len(reqs):   # all six are waiting
        assert time.monotonic() < deadline and not any(f.done() for f in futs), s.stderr()
        time.sleep(0.02)
      s.proc.send_signal(signal.SIGTERM)
      answers = [f.result(timeout=DEADLINE) for f in futs]
    assert s.proc.wait(timeout=DEADLINE) == 0, s.stderr()
  finally:
    s.stop()
  want = np.asarray(loaded.apply_fn(loaded.params, np.concatenate(reqs)))
  for k, (code, body) in enumerate(answers):
    assert code == 200, body
    np.testing.assert_allclose(np.asarray(body["outputs"], np.float32), want[k:k + 1],
                               rtol=1e-5, atol=1e-5)
  assert "received SIGTERM" in s.stderr()
  with pytest.raises((urllib.error.URLError, ConnectionError)):
    _get(s.url + "/health", timeout=5)


@pytest.mark.slow
def test_example_serve_script(gpt2):
  art, apply, params = gpt2
  s = Server([sys.executable, os.path.join(ROOT, "examples", "serve.py"), str(art), "--host",
              "127.0.0.1", "--port", "0"])
  try:
    assert s.health["inputs"] == [[["batch", "seq"], "int32"]]
    rng = np.random.default_rng(0)
    for b, n in [(1, 4), (3, 5)]:          # a bounded number of requests
      ids = rng.integers(0, VOCAB, (b, n)).astype(np.int32)
      code, got = _post(s.url + "/predict", {"inputs": ids.tolist()})
      assert code == 200, got
      want = np.asarray(apply(params, ids))
      out = np.asarray(got["outputs"], np.float32)
      assert out.shape == want.shape == tuple(got["shape"])
      assert np.max(np.abs(out - want)) / np.max(np.abs(want)) < 1e-5
    code, got = _post(s.url + "/predict", {"inputs": [[VOCAB + 5]]})   # was 200 with NaN
    assert code == 400 and "outside" in got["error"]
  finally:
    assert s.stop() == 0, s.stderr()
