"""save_fold is atomic: the previous fold survives failures, overwrite replaces the
whole directory, and concurrent writers (threads, processes) end with exactly
one complete fold."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfold
from jaxfold._src import integrity  # unit tests of jaxfold/_src/integrity.py (atomic commits)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Tiny(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.LayerNorm()(nn.Dense(16)(x)))


X = jnp.ones((2, 8))


def _folded(seed):
  m = Tiny()
  p = m.init(jax.random.PRNGKey(seed), X)
  p = jax.tree_util.tree_map(lambda a: a + 0.1 * seed, p)   # distinct LayerNorm γ/β too
  return jaxfold.fold(p, m.apply, X)


@pytest.fixture(scope="module")
def folds():
  return [_folded(s) for s in range(4)]


def _kernel(params):
  leaves = jax.tree_util.tree_leaves(params)
  return np.concatenate([np.asarray(x).ravel() for x in leaves])


def _which(d, folds):
  """Index of the fold stored in ``d`` (after verifying it), by its parameters and meta."""
  loaded = jaxfold.load_fold(d, Tiny().apply)        # verifies every file's hash
  got = _kernel(loaded.params.params)
  hits = [i for i, f in enumerate(folds) if np.array_equal(_kernel(f.params.params), got)]
  assert len(hits) == 1, "the directory does not hold exactly one of the written folds"
  assert loaded.meta.get("writer", hits[0]) == hits[0], "params of one writer, meta of another"
  return hits[0]


def _leftovers(parent, name):
  return [n for n in os.listdir(parent) if n.startswith(f".{name}.tmp-") or
          n.startswith(f".{name}.old-")]


def test_wrong_object_leaves_previous_fold(tmp_path, folds):
  d = jaxfold.save_fold(folds[0], tmp_path / "f")
  with pytest.raises(TypeError, match="nothing was written"):
    jaxfold.save_fold(object(), d, overwrite=True)
  with pytest.raises(TypeError, match="jaxfold.Params"):
    jaxfold.save_fold(folds[0]._replace(params=folds[0].params.params), d, overwrite=True)
  assert _which(d, folds) == 0
  assert _leftovers(tmp_path, "f") == []


def test_failure_midway_keeps_previous_fold(tmp_path, folds):
  d = jaxfold.save_fold(folds[0], tmp_path / "f")

  def fail(tmp):
    assert os.path.isdir(os.path.join(tmp, "params"))   # the new fold is half written
    raise RuntimeError("disk full")
  with pytest.raises(RuntimeError, match="disk full"):
    jaxfold.save_fold(folds[1], d, overwrite=True, extra_files=fail)
  assert _which(d, folds) == 0
  assert _leftovers(tmp_path, "f") == []


def test_overwrite_replaces_the_whole_directory(tmp_path, folds):
  def extra(tmp):
    open(os.path.join(tmp, "untied.safetensors"), "wb").write(b"old untied copy")
  d = jaxfold.save_fold(folds[0], tmp_path / "f", extra_files=extra)
  assert os.path.exists(os.path.join(d, "untied.safetensors"))
  jaxfold.save_fold(folds[1], d, overwrite=True)
  assert not os.path.exists(os.path.join(d, "untied.safetensors"))
  assert _which(d, folds) == 1
  with pytest.raises(FileExistsError, match="overwrite=True"):
    jaxfold.save_fold(folds[2], d)
  assert _which(d, folds) == 1


def test_never_replaces_a_directory_that_is_not_a_fold(tmp_path, folds):
  d = tmp_path / "mine"
  d.mkdir()
  (d / "thesis.tex").write_text("precious")
  with pytest.raises(FileExistsError, match="not a saved fold"):
    jaxfold.save_fold(folds[0], d, overwrite=True)
  assert os.listdir(d) == ["thesis.tex"]
  assert _leftovers(tmp_path, "mine") == []


def test_cli_force_leaves_no_stale_untied_copy(tmp_path):
  from jaxfold.cli import main
  out = tmp_path / "gpt"
  args = ["--quiet", "fold", "--model", "gpt2-tiny", "--batch", "1", "--seq", "8", "--out",
          str(out)]
  assert main(args + ["--tied-weights", "copy", "--no-auxiliary"]) == 0
  assert "untied.safetensors" in os.listdir(out)
  assert main(args + ["--force"]) == 0
  assert "untied.safetensors" not in os.listdir(out)
  integrity.verify_manifest(str(out))
  assert _leftovers(tmp_path, "gpt") == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "lock+rename"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_concurrent_threads_end_with_one_complete_fold(tmp_path, folds, monkeypatch, exchange,
                                                       overwrite):
  monkeypatch.setattr(integrity, "_USE_EXCHANGE", exchange)
  d = str(tmp_path / "f")
  if overwrite:
    jaxfold.save_fold(folds[0], d, meta={"writer": 0})
  start = threading.Barrier(len(folds))
  results = [None] * len(folds)

  def write(i):
    start.wait()
    try:
      jaxfold.save_fold(folds[i], d, meta={"writer": i}, overwrite=overwrite)
      results[i] = "ok"
    except FileExistsError as e:
      results[i] = e
  threads = [threading.Thread(target=write, args=(i,)) for i in range(len(folds))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert not any(t.is_alive() for t in threads)
  winner = _which(d, folds)
  if overwrite:
    assert results == ["ok"] * len(folds)
  else:
    assert [i for i, r in enumerate(results) if r == "ok"] == [winner]
    assert all(isinstance(r, FileExistsError) for i, r in enumerate(results) if i != winner)
  assert _leftovers(tmp_path, "f") == []


_WRITER = textwrap.dedent("""
  import os, sys, time
  sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
  import jaxfold
  from test_atomic_save import _folded
  i, base = int(sys.argv[1]), sys.argv[2]
  folded = _folded(i)
  for rnd, overwrite in (("fresh", False), ("overwrite", True)):
    open(os.path.join(base, f"ready-{{rnd}}-{{i}}"), "w").close()
    while not os.path.exists(os.path.join(base, f"go-{{rnd}}")):
      time.sleep(0.001)
    try:
      jaxfold.save_fold(folded, os.path.join(base, rnd), meta={{"writer": i}}, overwrite=overwrite)
      print(rnd, "ok", flush=True)
    except FileExistsError as e:
      print(rnd, "lost", flush=True)
""")


@pytest.mark.slow
def test_two_processes_end_with_one_complete_fold(tmp_path, folds):
  """Two processes released together write to one directory, first a fresh one
  (exactly one wins, the other is told), then over an existing fold (both
  succeed, one after the other); each time one complete fold remains."""
  script = tmp_path / "writer.py"
  script.write_text(_WRITER.format(root=ROOT, tests=os.path.join(ROOT, "tests")))
  jaxfold.save_fold(folds[0], tmp_path / "overwrite", meta={"writer": 0})
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen([sys.executable, str(script), str(i), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
           for i in (1, 2)]
  try:
    deadline = time.monotonic() + 120
    for rnd in ("fresh", "overwrite"):
      for i, p in zip((1, 2), procs):     # both are ready: release them together
        while not (tmp_path / f"ready-{rnd}-{i}").exists():
          assert p.poll() is None, p.communicate()
          assert time.monotonic() < deadline, "the writers did not get ready in time"
          time.sleep(0.005)
      (tmp_path / f"go-{rnd}").touch()
    outs = [p.communicate(timeout=120) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
  lines = [dict(l.split() for l in o.splitlines() if l.split()[0] in ("fresh", "overwrite"))
           for o, _ in outs]
  winner = _which(str(tmp_path / "fresh"), folds)
  assert winner in (1, 2)
  assert [l["fresh"] for l in lines] == ["ok" if i == winner else "lost" for i in (1, 2)]
  assert [l["overwrite"] for l in lines] == ["ok", "ok"]
  assert _which(str(tmp_path / "overwrite"), folds) in (1, 2)
  for name in ("fresh", "overwrite"):
    assert _leftovers(tmp_path, name) == []


def test_files_get_the_umask_mode_not_mkstemp_0600(tmp_path):
  old = os.umask(0o022)
  try:
    integrity.atomic_write_bytes(str(tmp_path / "a.bin"), b"x")
    from models.safetensors_io import save_safetensors
    spec_params = {"wte": {"embedding": np.zeros((4, 2), np.float32)}}
    save_safetensors(spec_params, tmp_path / "model.safetensors", "gpt2")
  finally:
    os.umask(old)
  for name in ("a.bin", "model.safetensors"):
    assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name
