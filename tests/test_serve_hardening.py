"""A server that hostile clients cannot stall (issue 21): idle connections at a
lowered descriptor limit, header timeouts, shapes outside the compiled bucket
set, requests validated against the program (not only its metadata), bearer
key and TLS, and SIGTERM past the drain timeout.  Servers run on 127.0.0.1."""

import collections
import concurrent.futures
import json
import os
import resource
import signal
import socket
import ssl
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

import jaxfold
from jaxfold import serving

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
models = pytest.importorskip("models")
from test_serve import Server, _get, _post  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Fold = collections.namedtuple("Fold", "params apply_fn")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
  spec = models.get("gpt2-tiny")
  params = models.random_params(spec, 2, 8, seed=3)
  folded = jaxfold.fold(params, spec.apply_fn(), *spec.example_inputs(2, 8))
  d = tmp_path_factory.mktemp("hard")
  ids = spec.example_inputs(2, 8)
  arts = {
      "meta": jaxfold.export(folded, *ids, meta=models.serving_meta(spec), key="k"),
      "none": jaxfold.export(folded, *ids),
      "forged": jaxfold.export(folded, *ids, meta={"inputs": [{"name": "ids", "low": -5, "high": 10**6}],
                                                   "max_seq": 10**6, "seq_padding": "causal"}),
      "baked": jaxfold.export(folded, *ids, bundle_params=False),
  }
  paths = {}
  for k, blob in arts.items():
    paths[k] = d / f"{k}.jaxexport"
    paths[k].write_bytes(blob)
  return paths


@pytest.mark.parametrize("which", ["none", "forged"])
def test_ids_are_checked_against_the_program(gpt2, which):
  m = serving.load_model(str(gpt2[which]), max_batch=2)
  assert (m.inputs[0].low, m.inputs[0].high, m.max_seq) == (0, 96, 32)
  for bad, match in [([[-1, 2]], "value -1"), ([[1, 96]], "value 96"), ([[1, True]], "true/false"),
                     ([[1, 2.5]], "expected integers"), ([[1.0, 2.0]], "floats"),
                     ([list(range(33))], "longer than")]:
    with pytest.raises(serving.InputError, match=match):
      m.validate({"inputs": bad})
  m.validate({"inputs": [[0, 95]]})
  if which == "forged":
    assert any("position table" in n for n in m.notes) and any("tables only 96" in n for n in m.notes)


def test_baked_parameters_are_tables_too(gpt2):
  # bundle_params=False bakes the tables into the program as constants: the
  # program still gathers from them (serve/tables.py), so no --vocab is needed
  m = serving.load_model(str(gpt2["baked"]), max_seq=16)
  assert (m.inputs[0].high, m.max_seq) == (96, 16)
  m = serving.load_model(str(gpt2["baked"]), max_seq=16, vocab=50)
  with pytest.raises(serving.InputError, match=r"outside \[0, 50\)"):
    m.validate({"inputs": [[50]]})


def test_signed_artifact_and_verify_key(gpt2):
  serving.load_model(str(gpt2["meta"]), key="k")
  with pytest.raises(jaxfold.IntegrityError, match="not signed"):
    serving.load_model(str(gpt2["none"]), key="k")


def test_shapes_outside_the_bucket_set_get_503(gpt2):
  m = serving.load_model(str(gpt2["meta"]), max_batch=2, seq_padding=None)   # exact lengths
  m.warmup(4)
  m.seal(0)
  assert m.served_seqs() == [1, 2]
  m.check_served(m.validate({"inputs": [[1, 2]]}))
  with pytest.raises(serving.OutsideBuckets, match="--compile-budget"):
    m.check_served(m.validate({"inputs": [[1, 2, 3]]}))
  req = m.validate({"inputs": [[1, 2, 3]]})
  with pytest.raises(serving.OutsideBuckets):
    m.run([req], m.bucket_key(req))
  assert len(m.compiled) == 4


def _limit_fds():
  resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


@pytest.mark.slow
def test_idle_connections_at_1024_descriptors_do_not_stall_health(gpt2):
  s = Server([sys.executable, "-m", "jaxfold.cli", "serve", str(gpt2["meta"]), "--port", "0",
              "--max-batch", "2", "--compile-budget", "2", "--header-timeout", "4"],
             preexec_fn=_limit_fds)
  held = []
  try:
    host, port = s.url.split("//")[1].split(":")
    t0 = time.monotonic()
    for i in range(1100):
      c = socket.create_connection((host, int(port)), timeout=5)
      if i % 2:
        c.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\n")      # half-sent headers
      held.append(c)
    t_open = time.monotonic() - t0
    t0 = time.monotonic()
    assert _get(s.url + "/health", timeout=10)["status"] == "ok"
    t_health = time.monotonic() - t0
    print(f"idle connections: opened 1100 in {t_open:.2f}s; /health answered in {t_health:.3f}s")
    assert t_health < 3.0
    # Shapes outside the compiled set (budget 2: self-check shapes only) get 503, with a body.
    code, body = _post(s.url + "/predict", {"inputs": [[1] * 20]}, timeout=30)
    assert code == 503 and "compile" in body["error"], body
    code, body = _post(s.url + "/predict", {"inputs": [[1, 2, 3]]}, timeout=30)
    assert code == 200, body
    # A connection that sends nothing is closed after --header-timeout.
    c = socket.create_connection((host, int(port)), timeout=15)
    t0 = time.monotonic()
    assert c.recv(1) == b""
    assert time.monotonic() - t0 < 10
    c.close()
  finally:
    for c in held:
      c.close()
    code = s.stop()
  assert code == 0, s.stderr()


def _slow_artifact(tmp_path):
  w = jax.random.normal(jax.random.PRNGKey(0), (256, 256)) / 16

  def apply(p, x):
    return jax.lax.fori_loop(0, 200000, lambda i, h: jnp.tanh(h @ p["w"]), x)
  x = jnp.ones((1, 256))
  blob = jaxfold.export(Fold({"w": w}, apply), x, symbolic=("batch",), check=False,
                        meta={"inputs": [{"name": "x"}]})
  path = tmp_path / "slow.jaxexport"
  path.write_bytes(blob)
  return path


@pytest.mark.slow
def test_sigterm_past_drain_timeout_answers_503_and_exits_nonzero(tmp_path):
  art = _slow_artifact(tmp_path)
  s = Server([sys.executable, "-m", "jaxfold.cli", "serve", str(art), "--port", "0", "--max-batch", "1",
              "--max-wait-ms", "0", "--drain-timeout", "0.5"])
  try:
    t0 = time.monotonic()
    assert _post(s.url + "/predict", {"inputs": [[0.1] * 256]}, timeout=60)[0] == 200
    one = time.monotonic() - t0
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
      futs = [pool.submit(_post, s.url + "/predict", {"inputs": [[0.1] * 256]}, 60) for _ in range(6)]
      time.sleep(0.3)
      s.proc.send_signal(signal.SIGTERM)
      got = [f.result(timeout=60) for f in futs]
    code = s.proc.wait(timeout=60)
  finally:
    s.stop()
  codes = sorted(c for c, _ in got)
  print(f"drain: one call {one:.2f}s; answers {codes}; exit {code}")
  assert set(codes) <= {200, 503} and 503 in codes
  assert all("drain-timeout" in b["error"] for c, b in got if c == 503)
  assert code == 1
  err = s.stderr()
  assert f"{codes.count(503)} requests were not answered within --drain-timeout" in err, err
  assert "CancelledError" not in err


def _cert(tmp_path):
  x509 = pytest.importorskip("cryptography.x509")
  import datetime
  import ipaddress

  from cryptography.hazmat.primitives import hashes, serialization
  from cryptography.hazmat.primitives.asymmetric import ec
  from cryptography.x509.oid import NameOID
  key = ec.generate_private_key(ec.SECP256R1())
  name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
  now = datetime.datetime.now(datetime.timezone.utc)
  cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                         critical=False)
          .sign(key, hashes.SHA256()))
  (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
  (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                       serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
  return tmp_path / "cert.pem", tmp_path / "key.pem"


@pytest.mark.slow
def test_api_key_tls_and_non_loopback_needs_a_key(tmp_path, gpt2):
  import urllib.error
  import urllib.request
  r = subprocess.run([sys.executable, "-m", "jaxfold.cli", "serve", str(gpt2["meta"]), "--host", "0.0.0.0",
                      "--port", "0"], capture_output=True, text=True, timeout=120,
                     env={**os.environ, "JAX_PLATFORMS": "cpu", "JAXFOLD_API_KEY": ""})
  assert r.returncode != 0 and "--api-key" in r.stderr and "--insecure" in r.stderr
  cert, key = _cert(tmp_path)
  (tmp_path / "vk").write_text("k\n")
  s = Server([sys.executable, "-m", "jaxfold.cli", "serve", str(gpt2["meta"]), "--port", "0", "--max-batch", "2",
              "--api-key", "s3cret", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
              "--verify-key", str(tmp_path / "vk")], scheme="https", cafile=str(cert))
  try:
    ctx = ssl.create_default_context(cafile=str(cert))

    def post(headers):
      req = urllib.request.Request(s.url + "/predict", data=json.dumps({"inputs": [[1, 2]]}).encode(),
                                   headers={"Content-Type": "application/json", **headers}, method="POST")
      try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as resp:
          return resp.status, json.loads(resp.read())
      except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    assert post({})[0] == 401
    assert post({"Authorization": "Bearer wrong"})[0] == 401
    code, body = post({"Authorization": "Bearer s3cret"})
    assert code == 200 and body["shape"] == [1, 2, 96]
  finally:
    assert s.stop() == 0, s.stderr()
