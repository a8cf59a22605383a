"""jaxfold/_src/server/loadgen.py against a tiny stdlib HTTP server: every
payload answered once, in order, over keep-alive connections, with chunked
bodies and server-closed connections handled."""

import http.server
import json
import threading

import pytest

from jaxfold._src.server.loadgen import LoadResult, load_test


class _Echo(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"

  def do_POST(self):  # noqa: N802 - the stdlib's name
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    out = json.dumps({"echo": body}).encode()
    if body.get("fail"):
      self.send_response(422)
    else:
      self.send_response(200)
    self.send_header("Content-Type", "application/json")
    if body.get("chunked"):
      self.send_header("Transfer-Encoding", "chunked")
      self.end_headers()
      half = len(out) // 2
      for part in (out[:half], out[half:]):
        self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
      self.wfile.write(b"0\r\n\r\n")
    else:
      self.send_header("Content-Length", str(len(out)))
      if body.get("close"):
        self.send_header("Connection", "close")
        self.close_connection = True
      self.end_headers()
      self.wfile.write(out)

  def log_message(self, *args):
    pass


@pytest.fixture()
def url():
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{server.server_address[1]}/predict"
  server.shutdown()
  server.server_close()


def test_every_payload_is_answered_in_order(url):
  payloads = [{"i": i, "chunked": i % 3 == 0, "close": i % 5 == 0} for i in range(40)]
  res = load_test(url, payloads, concurrency=4, timeout=60)
  assert isinstance(res, LoadResult) and res.errors == []
  assert res.ok == 40 and [b["echo"]["i"] for b in res.body] == list(range(40))
  assert res.throughput > 0 and 0 < res.percentile(0.5) <= res.percentile(0.99)


def test_statuses_and_bodies_are_kept_per_request(url):
  res = load_test(url, [{"i": 0}, {"i": 1, "fail": True}], concurrency=1, timeout=60,
                  keep_bodies=False)
  assert res.status == [200, 422] and res.ok == 1
  assert res.body[0] is None and res.body[1]["echo"]["fail"] is True


def test_a_refused_connection_is_an_error_not_a_hang():
  res = load_test("http://127.0.0.1:9/predict", [{"i": 0}], concurrency=1, timeout=30)
  assert res.status == [0] and res.ok == 0 and res.errors and res.percentile(0.5) is None
