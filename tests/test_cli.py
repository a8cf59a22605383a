"""The `jaxfold` command line (run in-process through jaxfold.cli.main)."""

import json
import os
import re
import subprocess
import sys

import pytest

from jaxfold.cli import main

models = pytest.importorskip("models")


def run(capsys, *argv):
  code = main(["--quiet", *argv])
  out, err = capsys.readouterr()
  return code, out, err


def test_unknown_model_lists_valid_names(capsys):
  code, out, err = run(capsys, "report", "--model", "gpt3-tiny")
  assert code == 2
  assert "--model: unknown model 'gpt3-tiny'" in err and "gpt2-tiny" in err
  assert "Traceback" not in err


def test_argument_errors_exit_2_without_traceback(capsys, tmp_path):
  code, _, err = run(capsys, "fold", "--model", "gpt2-tiny", "--checkpoint",
                     str(tmp_path / "nope.safetensors"), "--out", str(tmp_path / "o"))
  assert code == 2 and "--checkpoint" in err and "does not exist" in err
  code, _, err = run(capsys, "report")
  assert code == 2 and "--model NAME" in err
  code, _, err = run(capsys, "report", str(tmp_path))
  assert code == 2 and "not a saved fold" in err
  code, _, err = run(capsys, "export", "--out", str(tmp_path / "x"))
  assert code == 2 and "exactly one of --model" in err
  with pytest.raises(SystemExit) as e:   # argparse's own checks
    main(["bench", "--model", "gpt2-tiny", "--batch", "0"])
  assert e.value.code == 2
  assert "--batch must be a positive integer" in capsys.readouterr().err
  (tmp_path / "busy").mkdir()
  (tmp_path / "busy" / "f").write_text("x")
  code, _, err = run(capsys, "fold", "--model", "gpt2-tiny", "--out", str(tmp_path / "busy"))
  assert code == 2 and "pass --force to replace" in err and "overwrite=True" not in err   # a flag, not Python
  code, _, err = run(capsys, "fold", "--model", "gpt2-tiny", "--out", str(tmp_path / "busy"), "--force")
  assert code == 2 and "even with --force" in err and "overwrite=True" not in err   # not a fold: kept


def test_report_for_model_uses_abstract_init(capsys):
  code, out, _ = run(capsys, "report", "--model", "gpt2-tiny", "--seq", "8")
  assert code == 0
  assert "5/5 normalization sites folded" in out
  code, out, _ = run(capsys, "report", "--model", "bert-tiny", "--json", "--no-auxiliary")
  assert code == 0
  d = json.loads(out)
  assert d["num_sites"] == 5 and d["num_auxiliary"] == 0
  assert d["changes"]["reductions_removed"] == d["num_folded"]
  code, out, _ = run(capsys, "report", "--model", "gpt2-tiny", "--diff")
  assert code == 0 and "h_0…h_1/ln_2" in out and "what changed" in out and "A1" in out
  code, out, _ = run(capsys, "report", "--model", "gpt2-tiny", "--all")
  assert code == 0 and "h_1/ln_2" in out and "…" not in out


def test_models_lists_the_zoo(capsys):
  code, out, _ = run(capsys, "models")
  assert code == 0 and "gpt2-tiny" in out and "bert-base" in out and "family" in out
  assert "aliases: demo-gpt2-small = gpt2-256x4" in out   # the demo's former name is listed too
  code, out, _ = run(capsys, "models", "--names")
  assert code == 0 and out.split() == models.names() and "gpt2-256x4" in out   # the demo's model
  assert models.get("demo-gpt2-small") is models.get("gpt2-256x4")   # its former name, an alias
  code, out, _ = run(capsys, "report", "--model", "?")   # the old spelling still works
  assert code == 0 and out.split() == models.names()


def test_fold_report_export_roundtrip(capsys, tmp_path):
  out_dir = tmp_path / "folded"
  code, out, err = run(capsys, "fold", "--model", "gpt2-tiny", "--out", str(out_dir),
                       "--batch", "2", "--seq", "8")
  assert code == 0, err
  names = set(os.listdir(out_dir))
  assert {"params", "report.json", "meta.json", "fold.json", "model.safetensors"} <= names
  meta = json.loads((out_dir / "meta.json").read_text())
  assert meta["model"] == "gpt2-tiny" and meta["config"]["n_embd"] == 32
  assert meta["options"] == {"auxiliary_centering": True, "tied_weights": "auto", "batch": 2, "seq": 8}
  assert "jax_version" in meta
  # the HF-named file loads back with the zoo's reader
  from models.safetensors_io import load_safetensors
  p = load_safetensors(out_dir / "model.safetensors", "gpt2")
  assert p["h_0"]["ln_1"]["scale"].shape == (32,)

  code, out, _ = run(capsys, "report", str(out_dir), "--diff")
  assert code == 0 and "saved fold of gpt2-tiny" in out and "5/5" in out and "what changed" in out

  art = tmp_path / "m.jaxexport"
  code, out, err = run(capsys, "export", "--from", str(out_dir), "--out", str(art),
                       "--batch", "2", "--seq", "8")
  assert code == 0, err
  assert art.stat().st_size > 1000 and "int32[batch,seq]" in out

  # a checkpoint written by `fold` is a valid --checkpoint (HF naming)
  code, out, err = run(capsys, "fold", "--model", "gpt2-tiny", "--checkpoint",
                       str(out_dir / "model.safetensors"), "--out", str(tmp_path / "again"),
                       "--tied-weights", "copy", "--no-auxiliary")
  assert code == 0, err
  assert "untied.safetensors" in os.listdir(tmp_path / "again")
  code, _, err = run(capsys, "fold", "--model", "bert-tiny", "--checkpoint",
                     str(out_dir / "model.safetensors"), "--out", str(tmp_path / "bad"))
  assert code == 2 and "does not match --model bert-tiny" in err


def test_bench_and_demo(capsys):
  # no --seq: bench's default (64) is longer than gpt2-tiny's 32 positions and is capped
  code, out, err = run(capsys, "bench", "--model", "gpt2-tiny", "--batch", "1",
                       "--rounds", "3", "--warmup", "1")
  assert code == 0, err
  assert "gpt2-tiny has 32 positions, using --seq 32" in err and "batch 1 x seq 32" in out
  # the ratio printed is the ratio of the medians printed beside it, with its interval
  m = re.search(r"folded/original = ([\d.]+) / ([\d.]+) = ([\d.]+) \(95% bootstrap CI ([\d.]+)-([\d.]+)\)", out)
  assert m, out
  folded, original, ratio, lo, hi = map(float, m.groups())
  assert abs(ratio / (folded / original) - 1) < 3e-3 and lo <= ratio <= hi   # 4 significant digits
  assert ("not resolved" in out) == (lo <= 1 <= hi)
  # beside the measured ratio: what a CPU run cannot show, and the modelled GPU figure, labelled as such
  assert "a GPU effect that a CPU run cannot show" in out
  assert "A MODEL, not a measurement: benchmarks/results/gpu_model.md" in out
  code, out, err = run(capsys, "demo", "--tiny", "--batch", "2", "--seq", "8", "--rounds", "3")
  assert code == 0, err
  assert "5/5 normalization sites folded" in out and "modelled GPU folded/original time" in out
  errs = [float(l.rsplit(":", 1)[1]) for l in out.splitlines() if l.startswith("max relative error")]
  assert len(errs) == 2 and max(errs) < 1e-5


def test_console_entry_point():
  r = subprocess.run([sys.executable, "-m", "jaxfold.cli", "--help"], capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 0 and "demo" in r.stdout and "fold" in r.stdout
  r = subprocess.run([sys.executable, "-m", "jaxfold.cli"], capture_output=True, text=True,
                     timeout=60)
  assert r.returncode == 2


def test_non_finite_outputs_are_refused(capsys, tmp_path):
  # beyond the position table: refused before any work
  code, out, err = run(capsys, "bench", "--model", "gpt2-tiny", "--batch", "1", "--seq", "100")
  assert code == 2 and "32 positions" in err and "--seq 32" in err
  assert "max relative error" not in out
  # NaN weights: outputs are non-finite, no error or timing is printed for them
  import numpy as np

  from models import random_params
  from models.safetensors_io import save_safetensors
  spec = models.get("gpt2-tiny")
  params = random_params(spec, 1, 8, seed=0)
  attn = params["h_0"]["attn"]["c_attn"]
  attn["kernel"] = np.asarray(attn["kernel"]).copy()
  attn["kernel"][0, 0] = np.nan
  ckpt = tmp_path / "nan.safetensors"
  save_safetensors(params, ckpt, "gpt2")
  code, out, err = run(capsys, "bench", "--model", "gpt2-tiny", "--batch", "1", "--seq", "8",
                       "--checkpoint", str(ckpt), "--rounds", "2")
  assert code == 2 and "non-finite" in err, (out, err)
  assert "max relative error" not in out and "Traceback" not in err


def test_max_rel_err_refuses_nan():
  import numpy as np

  from jaxfold.benchmarking import NonFiniteError, max_rel_err
  assert max_rel_err(np.ones(3), np.ones(3)) == 0.0
  with pytest.raises(NonFiniteError, match="non-finite"):
    max_rel_err(np.array([1.0, np.nan]), np.array([1.0, np.nan]))
  with pytest.raises(NonFiniteError, match="folded model"):
    max_rel_err(np.ones(2), np.array([1.0, np.inf]))


def test_serve_refuses_damaged_or_missing_sources(capsys, tmp_path):
  pytest.importorskip("uvicorn")
  junk = tmp_path / "junk.jaxexport"
  junk.write_bytes(b"\x00garbage" * 100)
  code, out, err = run(capsys, "serve", str(junk), "--port", "0")
  assert code == 2 and "not a jaxfold artifact" in err and str(junk) in err
  assert "Traceback" not in err and "listening" not in out
  code, out, err = run(capsys, "serve", str(tmp_path / "absent"), "--port", "0")
  assert code == 2 and "does not exist" in err
  (tmp_path / "d").mkdir()
  code, out, err = run(capsys, "serve", str(tmp_path / "d"), "--port", "0")
  assert code == 2 and "not a saved fold" in err


def test_help_shows_defaults(capsys):
  for argv, want in ((["serve", "--help"], ["(default: 8000)", "(default: 127.0.0.1)", "(default: 16)"]),
                     (["bench", "--help"], ["(default: 9)", "(default: 64, or the model's position count"])):
    with pytest.raises(SystemExit) as e:
      main(argv)
    out = " ".join(capsys.readouterr().out.split())   # argparse wraps lines
    assert e.value.code == 0 and all(w in out for w in want), out


def test_sign_key_on_fold_and_export(capsys, tmp_path):
  import jaxfold
  key_file = tmp_path / "key"
  key_file.write_bytes(b"s3cret\n")
  out_dir = tmp_path / "signed"
  code, out, err = run(capsys, "fold", "--model", "gpt2-tiny", "--out", str(out_dir),
                       "--batch", "2", "--seq", "8", "--sign-key", str(key_file))
  assert code == 0, err
  assert (out_dir / "signature.json").exists() and "(signed)" in out
  apply_fn = models.get("gpt2-tiny").apply_fn()
  jaxfold.load_fold(out_dir, apply_fn, key=b"s3cret")
  with pytest.raises(jaxfold.IntegrityError):
    jaxfold.load_fold(out_dir, apply_fn, key=b"other")
  art = tmp_path / "m.jaxexport"
  code, out, err = run(capsys, "export", "--from", str(out_dir), "--out", str(art),
                       "--batch", "2", "--seq", "8", "--sign-key", str(key_file))
  assert code == 0, err
  jaxfold.load_exported(art, key=b"s3cret")
  with pytest.raises(jaxfold.IntegrityError, match="signature does not match"):
    jaxfold.load_exported(art, key=b"other")
  # Unsigned: refused under a key, as the messages (which name --sign-key) say.
  code, _, err = run(capsys, "export", "--from", str(out_dir), "--out", str(tmp_path / "u.jaxexport"),
                     "--batch", "2", "--seq", "8")
  assert code == 0, err
  with pytest.raises(jaxfold.IntegrityError, match="--sign-key"):
    jaxfold.load_exported(tmp_path / "u.jaxexport", key=b"s3cret")
  empty = tmp_path / "empty"
  empty.write_bytes(b"")
  code, _, err = run(capsys, "export", "--from", str(out_dir), "--out", str(art), "--sign-key", str(empty))
  assert code == 2 and "is empty" in err


def test_a_models_module_of_ones_own_is_named(tmp_path):
  # a user's models.py in the working directory shadows the zoo under `python -m`: say so, with its path
  (tmp_path / "models.py").write_text("class MyNet:\n  pass\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
  r = subprocess.run([sys.executable, "-m", "jaxfold.cli", "models"], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 2, r.stderr
  assert f"`import models` found {tmp_path / 'models.py'}, which is not jaxfold's model zoo" in r.stderr
  assert "internal error" not in r.stderr and "Traceback" not in r.stderr
