"""Saved folds and exported artifacts are content-hashed: damage is one clear error.

Every fault here (flipped bits, truncation, junk, stale or missing files, a
foreign file or directory) must raise exactly one jaxfold.FoldError naming the
file, before orbax/tensorstore or jax.export parse a byte (no raw
struct.error, no tensorstore tracebacks on stderr).
"""

import glob
import json
import os
import shutil

import jax
import numpy as np
import pytest

import jaxfold
from jaxfold import exporting as jexport
from jaxfold import serialization
from jaxfold._src import integrity  # this file mirrors jaxfold/_src/integrity.py
from models import random_params

models = pytest.importorskip("models")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A fold with an untied copy (so params/ holds several tensors) and its artifact."""
  spec = models.get("gpt2-tiny")
  params = random_params(spec, 2, 8, seed=0)
  apply = spec.apply_fn()
  folded = jaxfold.fold(params, apply, *spec.example_inputs(2, 8), auxiliary_centering=False,
                        tied_weights="copy")
  assert folded.params.extras
  root = tmp_path_factory.mktemp("integrity")
  d = jaxfold.save_fold(folded, root / "good", meta={"model": spec.name})
  blob = jaxfold.export(folded, *spec.example_inputs(2, 8), meta={"model": spec.name})
  return spec, apply, folded, d, blob


def _copy(src, tmp_path, name="f"):
  dst = tmp_path / name
  shutil.copytree(src, dst)
  return str(dst)


def _largest_tensor_file(d):
  files = [p for p in glob.glob(os.path.join(d, "params", "**", "*"), recursive=True)
           if os.path.isfile(p)]
  return max(files, key=os.path.getsize)


def _refused(capfd, fn, match, exc=jaxfold.FoldError):
  """Exactly one clear error: the expected type, a message, nothing printed."""
  capfd.readouterr()
  with pytest.raises(exc, match=match) as info:
    fn()
  out, err = capfd.readouterr()
  assert "Traceback" not in err and "Event loop is closed" not in err, err[-2000:]
  assert isinstance(info.value, jaxfold.FoldError)
  return str(info.value)


# ---------------------------------------------------------------------------- saved folds


def test_manifest_records_hashes_and_versions(saved):
  _, apply, folded, d, _ = saved
  m = json.load(open(os.path.join(d, "manifest.json")))
  # A plain fold keeps the older format (older readers load it); fuse/rotate chains write the newest.
  assert m["kind"] == "jaxfold-fold" and m["format_version"] == 2 < serialization.FORMAT_VERSION
  assert m["written_by"]["jaxfold"] == jaxfold.__version__
  assert {"jax", "jaxlib", "orbax-checkpoint", "python"} <= set(m["written_by"])
  on_disk = {os.path.relpath(p, d).replace(os.sep, "/")
             for p in glob.glob(os.path.join(d, "**", "*"), recursive=True) if os.path.isfile(p)}
  assert set(m["files"]) == on_disk - {"manifest.json"}
  for rel, entry in m["files"].items():
    assert entry["sha256"] == integrity.sha256_file(os.path.join(d, rel))
    assert entry["bytes"] == os.path.getsize(os.path.join(d, rel))
  loaded = jaxfold.load_fold(d, apply)          # the intact fold loads and verifies
  np.testing.assert_array_equal(np.asarray(loaded.params.params["wte"]["embedding"]),
                                np.asarray(folded.params.params["wte"]["embedding"]))


def test_flipped_bit_in_a_tensor_is_refused(saved, tmp_path, capfd):
  _, apply, _, d, _ = saved
  d = _copy(d, tmp_path)
  path = _largest_tensor_file(d)
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 0x10
  open(path, "wb").write(bytes(data))
  msg = _refused(capfd, lambda: jaxfold.load_fold(d, apply), "SHA-256")
  assert path in msg and "re-create" in msg


def test_truncated_tensor_file_is_refused(saved, tmp_path, capfd):
  _, apply, _, d, _ = saved
  d = _copy(d, tmp_path)
  path = _largest_tensor_file(d)
  data = open(path, "rb").read()
  open(path, "wb").write(data[: len(data) // 3])
  msg = _refused(capfd, lambda: jaxfold.load_fold(d, apply), "truncated")
  assert path in msg


@pytest.mark.parametrize("fault", ["junk-everywhere", "junk-manifest", "missing-file",
                                   "stale-shard", "no-manifest", "report-edited"])
def test_damaged_fold_directories(saved, tmp_path, capfd, fault):
  _, apply, _, d, _ = saved
  d = _copy(d, tmp_path)
  rng = np.random.default_rng(0)
  if fault == "junk-everywhere":
    for p in glob.glob(os.path.join(d, "**", "*"), recursive=True):
      if os.path.isfile(p):
        open(p, "wb").write(rng.bytes(64))
    match = "manifest.json is damaged"
  elif fault == "junk-manifest":
    open(os.path.join(d, "manifest.json"), "w").write('{"files": 3}')
    match = "manifest.json is damaged"
  elif fault == "missing-file":
    os.remove(_largest_tensor_file(d))
    match = "is missing"
  elif fault == "stale-shard":     # e.g. left over by a non-atomic overwrite
    open(os.path.join(d, "params", "untied.old"), "wb").write(b"x")
    match = "not listed"
  elif fault == "no-manifest":
    os.remove(os.path.join(d, "manifest.json"))
    match = "no manifest.json"
  else:
    path = os.path.join(d, "report.json")
    text = open(path, "rb").read()
    assert b'"folded": true' in text
    open(path, "wb").write(text.replace(b'"folded": true', b'"folded": 1111', 1))   # same size
    match = "report.json does not match"
    _refused(capfd, lambda: serialization.load_report(d), match)
  _refused(capfd, lambda: jaxfold.load_fold(d, apply), match)


def test_no_manifest_loads_only_when_asked(saved, tmp_path):
  _, apply, folded, d, _ = saved
  d = _copy(d, tmp_path)
  os.remove(os.path.join(d, "manifest.json"))
  loaded = jaxfold.load_fold(d, apply, integrity=False)
  assert loaded.report.as_dict() == folded.report.as_dict()


def test_foreign_paths(saved, tmp_path, capfd):
  _, apply, _, d, _ = saved
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "notes.txt").write_text("hello")
  msg = _refused(capfd, lambda: jaxfold.load_fold(tmp_path / "other", apply), "not a saved fold",
                 FileNotFoundError)
  assert str(tmp_path / "other") in msg
  _refused(capfd, lambda: jaxfold.load_fold(tmp_path / "other" / "notes.txt", apply),
           "is a file", NotADirectoryError)
  _refused(capfd, lambda: jaxfold.load_fold(tmp_path / "absent", apply), "does not exist",
           FileNotFoundError)
  _refused(capfd, lambda: jaxfold.load_exported(d), "is a directory", IsADirectoryError)


def test_newer_format_is_refused(saved, tmp_path, capfd):
  _, apply, _, d, _ = saved
  d = _copy(d, tmp_path)
  path = os.path.join(d, "manifest.json")
  m = json.load(open(path))
  m["format_version"] = serialization.FORMAT_VERSION + 1
  json.dump(m, open(path, "w"))
  _refused(capfd, lambda: jaxfold.load_fold(d, apply), "upgrade jaxfold")


# ---------------------------------------------------------------------------- artifacts


def test_artifact_header_records_hash_versions_and_meta(saved):
  spec, _, folded, _, blob = saved
  header, program = jexport.read_artifact(blob)
  assert blob.startswith(jexport.MAGIC)
  assert header["payload_sha256"] == integrity.sha256_bytes(program)
  assert header["written_by"]["jax"] and header["written_by"]["jaxfold"] == jaxfold.__version__
  assert len(program) < header["weights"]["bytes"] / 2   # weights beside it, not baked in
  tensors = header["weights"]["tensors"]    # one hashed entry per parameter tensor
  assert len(tensors) == len(jax.tree_util.tree_leaves(folded.params))
  assert all(len(t["sha256"]) == 64 and t["name"] for t in tensors)
  fn = jaxfold.load_exported(blob)
  assert fn.meta == {"model": spec.name}
  args = spec.example_inputs(3, 5)
  np.testing.assert_allclose(np.asarray(fn(*args)),
                             np.asarray(folded.apply_fn(folded.params, *args)),
                             rtol=1e-5, atol=1e-5)


def _faults(blob):
  n = len(blob)
  header, program = jexport.read_artifact(blob)
  weights = header["weights"]["bytes"]
  flip_program = bytearray(blob)
  flip_program[n - weights - len(program) // 2] ^= 0x01
  flip_weight = bytearray(blob)
  flip_weight[n - weights // 2] ^= 0x01
  flip_header = bytearray(blob)
  flip_header[len(jexport.MAGIC) + 8 + 5] ^= 0x20
  return {
      "flip-program": (bytes(flip_program), "the program does not match its SHA-256"),
      "flip-weight": (bytes(flip_weight), "parameter tensor .*\\['.*'\\].* does not match its SHA-256"),
      "flip-header": (bytes(flip_header), "SHA-256|JSON"),
      "truncated-half": (blob[: n // 2], "truncated"),
      "truncated-one-byte": (blob[:-1], "truncated"),
      "truncated-in-magic": (blob[:5], "truncated"),
      "trailing-bytes": (blob + b"\0", "trailing"),
      "empty": (b"", "empty"),
      "junk": (np.random.default_rng(1).bytes(4096), "not a jaxfold artifact"),
      "foreign-json": (b'{"sites": []}\n', "not a jaxfold artifact"),
      "raw-jax-export": (jexport.read_artifact(blob)[1], "not a jaxfold artifact"),
  }


FAULTS = ["flip-program", "flip-weight", "flip-header", "truncated-half", "truncated-one-byte",
          "truncated-in-magic", "trailing-bytes", "empty", "junk", "foreign-json", "raw-jax-export"]


@pytest.mark.parametrize("fault", FAULTS)
def test_damaged_artifacts(saved, tmp_path, capfd, fault):
  blob = saved[4]
  data, match = _faults(blob)[fault]
  path = tmp_path / "m.jaxexport"
  path.write_bytes(data)
  msg = _refused(capfd, lambda: jaxfold.load_exported(path), match)
  assert str(path) in msg
  _refused(capfd, lambda: jaxfold.load_exported(data), match)   # bytes: named <bytes>


def test_raw_serialization_needs_verify_false_and_junk_still_fails(saved, capfd):
  spec, _, folded, _, _ = saved
  blob = jaxfold.export(folded, *spec.example_inputs(2, 8), bundle_params=False, check=False)
  raw = jexport.read_artifact(blob)[1]      # parameters baked in: a plain jax.export program
  fn = jaxfold.load_exported(raw, verify=False)
  assert fn(*spec.example_inputs(1, 4)).shape == (1, 4, spec.config.vocab_size)
  _refused(capfd, lambda: jaxfold.load_exported(b"\x00" * 64, verify=False),
           "cannot read the program")


def test_newer_artifact_format_is_refused(saved, capfd):
  blob = saved[4]
  header, program = jexport.read_artifact(blob)
  header["format_version"] = jexport.ARTIFACT_VERSION + 1
  raw = json.dumps(header, sort_keys=True).encode()
  import hashlib
  newer = (jexport.MAGIC + len(raw).to_bytes(8, "little") + raw + hashlib.sha256(raw).digest()
           + program)
  _refused(capfd, lambda: jaxfold.load_exported(newer), "upgrade jaxfold")
