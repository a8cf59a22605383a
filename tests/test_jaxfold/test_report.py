"""The report: own centerings, readable locations, grouping, diff, JSON."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jaxfold
import models
from jaxfold._src import report as R
from jaxfold._src.program import Program
from jaxfold._src.rules import rule_for


def _fold_zoo(name, **kw):
  spec = models.get(name)
  if kw:
    spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, **kw))
  args = spec.example_inputs(1, abstract=True)
  return spec, args, jaxfold.fold(spec.abstract_init(1), spec.apply_fn(), *args)


def _reductions(fn, *args) -> int:
  prog = Program(jax.make_jaxpr(fn)(*args))
  return sum(rule_for(n.prim).name == "reduce_sum" for p in prog.programs() for n in p.nodes)


def test_changes_match_the_folded_program():
  spec, args, f = _fold_zoo("gpt2-tiny")
  ch = f.report.changes
  assert ch.reductions_before == _reductions(spec.apply_fn(), spec.abstract_init(1), *args)
  assert ch.reductions_after == _reductions(f.apply_fn, f.params, *args)
  assert ch.reductions_removed == f.report.num_folded and ch.reductions_added == 1
  d = f.report.diff()
  assert f"{ch.reductions_before} -> {ch.reductions_after}" in d and "A1" in d


def test_each_centering_is_listed_once_by_the_site_that_needs_it_first():
  _, _, f = _fold_zoo("gpt2-tiny", n_layer=3)
  own = [(c.param, c.spec) for s in f.report.sites for c in s.centered]
  assert len(own) == len(set(own)) == f.report.changes.params_centered
  need = 0
  for s in f.report.sites:
    need += len(s.centered)
    assert s.requires == need        # a residual stream: every site relies on all before it
  text = str(f.report)
  assert "h_0…h_2/ln_2  (3)" in text and "h_*.attn.c_proj.kernel[1]" in text
  assert "(+" not in text and R.LEGEND in text


def test_locations_are_module_paths_or_user_lines():
  _, _, bert = _fold_zoo("bert-tiny")
  for s in bert.report.sites:
    for text in (s.where, s.reason, s.source):
      assert "flax" not in text and "site-packages" not in text, text
    assert "models/bert.py:" in s.source.replace(os.sep, "/")
  _, _, nnx = _fold_zoo("gpt2-nnx-tiny")
  wheres = [s.where for s in nnx.report.sites]
  assert wheres == ["h_0/ln_1", "h_0/ln_2", "h_1/ln_1", "h_1/ln_2", "ln_f"]


def _pure_jax(p, x):
  h = x @ p["w"] + p["b"]
  mu = jnp.mean(h, -1, keepdims=True)
  var = jnp.mean((h - mu) ** 2, -1, keepdims=True)
  return (h - mu) / jnp.sqrt(var + 1e-5) * p["g"]


def test_pure_jax_site_is_located_at_the_users_line(x64):
  rng = np.random.default_rng(0)
  p = {"w": rng.standard_normal((4, 6)), "b": rng.standard_normal(6), "g": rng.standard_normal(6)}
  x = rng.standard_normal((3, 4))
  r = jaxfold.fold(p, _pure_jax, x).report
  (s,) = r.sites
  assert s.folded and s.where == s.source
  assert s.source.startswith("test_report.py:") or "test_jaxfold/test_report.py:" in s.source
  assert s.source.endswith("(_pure_jax)")
  assert {c.label() for c in s.centered} == {"w[1]", "b[0]"}


def test_json_round_trip_and_old_reports():
  _, _, f = _fold_zoo("gpt2-tiny")
  d = json.loads(f.report.to_json())
  assert R.Report.from_dict(d) == f.report
  assert d["changes"]["reductions_after"] == f.report.changes.reductions_after
  old = {**d, "auxiliary": ["(1, 8, 32) over (2) at somewhere"]}
  old.pop("changes")
  for s in old["sites"]:
    for k in ("requires", "aux", "kernel"):
      s.pop(k)
  r = R.Report.from_dict(old)
  assert r.auxiliary[0].value.startswith("(1, 8, 32)") and "what changed" in r.diff()
  assert str(r)


def test_group_labels():
  assert R._group_label(["h_0/ln_1", "h_1/ln_1", "h_2/ln_1"]) == "h_0…h_2/ln_1"
  assert R._group_label(["h_0/ln_1", "h_2/ln_1"]) == "{h_0,h_2}/ln_1"
  assert R._group_label(["a", "a"]) == "a x2"
  assert R._merge_texts(["h_0.k[1]", "h_5.k[1]"]) == "h_*.k[1]"
  assert R.param_label("['params']['Dense_0']['kernel']") == "Dense_0.kernel"
  assert R.param_label("['h'][0]['ln_1']['scale'].value") == "h.0.ln_1.scale"
