"""serve/app.py: the server's configuration and limits (the HTTP behaviour itself
is in test_serve.py and test_serve_hardening.py)."""

import dataclasses
import resource

import pytest

from jaxfold._src.server.app import ServeConfig, connection_limit, is_loopback


def test_connection_limit_follows_the_descriptor_limit():
  soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  default = connection_limit(ServeConfig())
  if soft != resource.RLIM_INFINITY:
    assert default == max(8, soft - 128)          # a reserve of descriptors for the process
  assert connection_limit(ServeConfig(max_connections=100)) == min(default, 100)
  assert connection_limit(ServeConfig(max_connections=3)) == 8   # never fewer than 8


@pytest.mark.parametrize("host, loop", [("127.0.0.1", True), ("::1", True), ("127.0.0.2", True),
                                        ("0.0.0.0", False), ("10.1.2.3", False), ("::", False)])
def test_is_loopback(host, loop):
  assert is_loopback(host) is loop


def test_config_defaults_are_safe_and_frozen():
  c = ServeConfig()
  assert c.api_key is None and not c.insecure and c.max_batch == 16 and c.max_body == 1 << 20
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.max_batch = 1
