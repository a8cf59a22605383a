"""Loads that prove what they load: snapshot reads under concurrent overwrites,
killed saves, stale temporaries, disk-full and symlink errors, program
fingerprints and signed folds/artifacts (issue 21)."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfold
from jaxfold._src import integrity
from jaxfold._src.artifact import _LEN, MAGIC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


class Tiny(nn.Module):
  act: bool = False

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(nn.Dense(16)(x))
    return nn.Dense(4)(nn.gelu(h) if self.act else h)


X = jnp.ones((2, 8))


def _folded(seed):
  m = Tiny()
  p = jax.tree_util.tree_map(lambda a: a + 0.1 * seed, m.init(jax.random.PRNGKey(seed), X))
  return jaxfold.fold(p, m.apply, X)


@pytest.fixture(scope="module")
def folds():
  return [_folded(s) for s in range(2)]


def _flat(params):
  return np.concatenate([np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(params)])


def _leftovers(parent, name):
  return [n for n in os.listdir(parent) if n.startswith(f".{name}.tmp-")]


_WRITER = """
import sys, time
sys.path[:0] = [{root!r}, {tests!r}]
import jax
import jaxfold
from test_deploy_safety import _folded
folds = [_folded(0), _folded(1)]
d, seconds = sys.argv[1], float(sys.argv[2])
print("ready", flush=True)
end, i = time.monotonic() + seconds, 0
while time.monotonic() < end:
  jaxfold.save_fold(folds[i % 2], d, meta={{"writer": i % 2}}, overwrite=True)
  i += 1
print("saves", i, flush=True)
"""


def _writer(tmp_path, d, seconds):
  script = tmp_path / "writer.py"
  script.write_text(_WRITER.format(root=ROOT, tests=os.path.join(ROOT, "tests")))
  p = subprocess.Popen([sys.executable, str(script), str(d), str(seconds)], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, env=ENV)
  assert p.stdout.readline().strip() == "ready", p.communicate(timeout=60)
  return p


def _read_while_writing(tmp_path, folds, seconds):
  d = tmp_path / "f"
  jaxfold.save_fold(folds[0], d, meta={"writer": 0})
  want = [_flat(f.params.params) for f in folds]
  p = _writer(tmp_path, d, seconds)
  loads, mixes, seen = 0, 0, set()
  try:
    end = time.monotonic() + seconds
    while time.monotonic() < end and p.poll() is None:
      got = jaxfold.load_fold(d, Tiny().apply)
      flat = _flat(got.params.params)
      hits = [i for i, w in enumerate(want) if np.array_equal(w, flat)]
      if hits != [got.meta.get("writer")]:
        mixes += 1
      seen.add(got.meta.get("writer"))
      np.asarray(got.apply_fn(got.params, X))     # runs (no KeyError from a mixed tree)
      loads += 1
    out, err = p.communicate(timeout=120)
  finally:
    if p.poll() is None:
      p.kill()
  assert p.returncode == 0, err
  print(f"read-while-write: {loads} loads, {mixes} mixes, {out.split()[-1]} saves")
  assert loads > 0 and mixes == 0
  assert _leftovers(tmp_path, "f") == []
  return loads, seen


@pytest.mark.slow
def test_read_while_overwrite_never_mixes(tmp_path, folds):
  _read_while_writing(tmp_path, folds, 4)


@pytest.mark.slow
def test_read_while_overwrite_never_mixes_long(tmp_path, folds):
  loads, seen = _read_while_writing(tmp_path, folds, 20)
  assert seen == {0, 1}


def test_kill_9_during_save_leaves_old_or_new_and_next_save_cleans(tmp_path, folds):
  d = tmp_path / "f"
  jaxfold.save_fold(folds[0], d, meta={"writer": 0})
  p = _writer(tmp_path, d, 30)
  time.sleep(1.5)
  os.kill(p.pid, signal.SIGKILL)
  p.wait(timeout=30)
  got = jaxfold.load_fold(d, Tiny().apply)           # old or new, complete
  assert got.meta["writer"] in (0, 1)
  jaxfold.save_fold(folds[1], d, meta={"writer": 1}, overwrite=True)
  assert _leftovers(tmp_path, "f") == []
  assert jaxfold.load_fold(d, Tiny().apply).meta["writer"] == 1


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path, folds):
  host = integrity.writer_tag().split(".")[0]
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  (tmp_path / f".f.tmp-{host}.{dead.pid}-abc").mkdir()
  (tmp_path / f".f.tmp-{host}.{os.getpid()}-live").mkdir()      # a live writer's: kept
  old = tmp_path / ".f.tmp-1234abcd"                              # unknown writer, old: removed
  old.mkdir()
  os.utime(old, (time.time() - 2 * integrity.STALE_AFTER,) * 2)
  jaxfold.save_fold(folds[0], tmp_path / "f")
  assert _leftovers(tmp_path, "f") == [f".f.tmp-{host}.{os.getpid()}-live"]


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   ValueError("RESOURCE_EXHAUSTED: failed to write chunk")])
def test_disk_full_is_one_clear_error(tmp_path, folds, error):
  d = tmp_path / "f"
  jaxfold.save_fold(folds[0], d, meta={"writer": 0})

  def fill(tmp):
    raise error
  with pytest.raises(jaxfold.IntegrityError, match="no space left.*previous fold there is intact"):
    jaxfold.save_fold(folds[1], d, overwrite=True, extra_files=fill)
  assert jaxfold.load_fold(d, Tiny().apply).meta["writer"] == 0
  assert _leftovers(tmp_path, "f") == []


def test_symlinked_target_is_one_clear_error(tmp_path, folds):
  real = tmp_path / "real"
  jaxfold.save_fold(folds[0], real)
  (tmp_path / "link").symlink_to(real)
  with pytest.raises(jaxfold.IntegrityError, match="symbolic link.*pass the real path"):
    jaxfold.save_fold(folds[1], tmp_path / "link", overwrite=True)
  assert os.path.islink(tmp_path / "link")


@pytest.mark.parametrize("other", ["gelu", "times2"])
def test_load_with_another_program_says_what_differs(tmp_path, folds, other):
  d = jaxfold.save_fold(folds[0], tmp_path / "f")
  fn = Tiny(act=True).apply if other == "gelu" else (lambda p, x: Tiny().apply(p, x) * 2)
  with pytest.raises(jaxfold.FoldError, match="not the program the fold .* was made for: .*operation"):
    jaxfold.load_fold(d, fn)
  jaxfold.load_fold(d, jax.jit(Tiny().apply))        # the same program, jitted: accepted


def test_signed_folds(tmp_path, folds):
  d = jaxfold.save_fold(folds[0], tmp_path / "f", meta={"model": "a"}, key=b"k1")
  jaxfold.load_fold(d, Tiny().apply, key=b"k1")
  with pytest.raises(jaxfold.IntegrityError, match="does not match the manifest under the given key"):
    jaxfold.load_fold(d, Tiny().apply, key=b"k2")
  u = jaxfold.save_fold(folds[0], tmp_path / "u")
  with pytest.raises(jaxfold.IntegrityError, match="not signed"):
    jaxfold.load_fold(u, Tiny().apply, key=b"k1")
  # Forged: meta edited and the manifest re-hashed. The unkeyed hashes cannot tell (accidents,
  # not tampering); the key can.
  (tmp_path / "f" / "meta.json").write_text(json.dumps({"model": "forged"}))
  integrity.write_manifest(str(d), kind="jaxfold-fold", extra={"format_version": 2})
  assert jaxfold.load_fold(d, Tiny().apply).meta == {"model": "forged"}
  with pytest.raises(jaxfold.IntegrityError, match="modified after it was signed"):
    jaxfold.load_fold(d, Tiny().apply, key=b"k1")


def _forge(blob, **meta):
  (n,) = _LEN.unpack_from(blob, len(MAGIC))
  start = len(MAGIC) + _LEN.size
  header = json.loads(blob[start:start + n])
  header["meta"].update(meta)
  raw = json.dumps(header, sort_keys=True).encode()
  import hashlib
  return b"".join([MAGIC, _LEN.pack(len(raw)), raw, hashlib.sha256(raw).digest(),
                   blob[start + n + 32:]])


def test_signed_artifacts(folds):
  blob = jaxfold.export(folds[0], X, symbolic=("batch",), meta={"max_seq": 8}, key="secret")
  assert jaxfold.load_exported(blob, key="secret").meta == {"max_seq": 8}
  forged = _forge(blob, max_seq=10**6)
  assert jaxfold.load_exported(forged).meta["max_seq"] == 10**6     # unkeyed: accepted
  with pytest.raises(jaxfold.IntegrityError, match="modified after it was signed"):
    jaxfold.load_exported(forged, key="secret")
  with pytest.raises(jaxfold.IntegrityError, match="not signed"):
    jaxfold.load_exported(jaxfold.export(folds[0], X, symbolic=("batch",)), key="secret")
