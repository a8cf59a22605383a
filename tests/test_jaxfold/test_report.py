"""The report: own centerings, readable locations, grouping, diff, JSON."""

import dataclasses
import json
import os
import sys

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


# -- issue 39: the report names every norm, counts the programs, folds constants once ---------

import flax.linen as nn  # noqa: E402
import pytest  # noqa: E402

from jaxfold._src import compat  # noqa: E402


def _randomized(p, seed=0):
  """γ, β and biases random and non-trivial (γ around 1, β and biases off zero)."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(
      lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.5 + (1.0 if a.ndim == 1 else 0.0), jnp.float64), p)


def _assert_exact(m, p, f, *xs):
  for x in xs:
    ref, out = np.asarray(m.apply(p, x)), np.asarray(f.apply_fn(f.params, x))
    assert np.allclose(out, ref, rtol=1e-10, atol=1e-10), np.max(np.abs(out - ref))


class _NeoX(nn.Module):
  """GPT-NeoX's parallel residual: two LayerNorms read the same value."""
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    for i in range(2):
      a = nn.LayerNorm(name=f"layers_{i}_input_layernorm")(h)
      m = nn.LayerNorm(name=f"layers_{i}_post_attention_layernorm")(h)
      h = h + nn.Dense(16, name=f"layers_{i}_attn")(a) + nn.Dense(16, name=f"layers_{i}_mlp")(jax.nn.gelu(m))
    return nn.Dense(4)(nn.LayerNorm(name="final_layer_norm")(h))


def _x(*shape, seed=1):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape))


def test_norms_reading_one_value_are_each_named(x64):
  m = _NeoX()
  p = _randomized(m.init(jax.random.PRNGKey(0), _x(2, 5, 8)))
  f = jaxfold.fold(p, m.apply, _x(2, 5, 8))
  r = f.report
  assert (len(r.sites), r.num_sites, r.num_folded, r.num_shared) == (3, 5, 5, 4)
  assert r.sites[0].norms == ("_NeoX/layers_0_input_layernorm", "_NeoX/layers_0_post_attention_layernorm")
  assert r.sites[2].norms == () and r.sites[2].num_norms == 1
  text, diff = str(r), r.diff()
  for i in range(2):
    for name in ("input_layernorm", "post_attention_layernorm"):
      assert f"layers_{i}_{name}" in text and f"layers_{i}_{name}" in diff
  assert "2 norms read this one value and share its mean" in text
  assert "5/5 normalization sites folded" in text and "3 in all" in text
  assert "2 LayerNorms -> RMSNorms" in diff and "at 5 folded norms sharing 3 mean site(s)" in diff
  d = json.loads(r.to_json())
  assert (d["num_sites"], d["num_mean_sites"]) == (5, 3) and len(d["sites"][1]["norms"]) == 2
  assert R.Report.from_dict(d) == r
  _assert_exact(m, p, f, _x(2, 5, 8), _x(1, 1, 8, seed=2), _x(3, 7, 8, seed=3))


def _sinusoids(length, channels):
  t = jnp.arange(length, dtype=jnp.float32)[:, None]
  inv = jnp.exp(-jnp.log(10000.0) * jnp.arange(channels // 2, dtype=jnp.float32) / (channels // 2 - 1))
  return jnp.concatenate([jnp.sin(t * inv), jnp.cos(t * inv)], axis=-1)


class _WhisperDecoder(nn.Module):
  """levanter Whisper's style: token embedding plus a sinusoid table the program
  computes on every call (from iota): the stream needs an auxiliary centering
  of the table, a value no input reaches."""
  @nn.compact
  def __call__(self, ids):
    h = nn.Embed(50, 16)(ids) + _sinusoids(ids.shape[-1], 16).astype(jnp.float64)
    for _ in range(2):
      h = h + nn.Dense(16)(nn.LayerNorm()(h))
    return nn.Dense(50)(nn.LayerNorm()(h))


def _ids(b, t, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 50, size=(b, t)))


def test_a_centering_of_a_constant_is_computed_once_at_fold_time(x64):
  m = _WhisperDecoder()
  p = _randomized(m.init(jax.random.PRNGKey(0), _ids(2, 5)))
  f = jaxfold.fold(p, m.apply, _ids(2, 5))
  r = f.report
  (a,) = r.auxiliary
  assert a.constant and "centered once at fold time" in a.describe() and r.num_folded == 3
  before = _reductions(m.apply, p, _ids(2, 5))
  after = _reductions(f.apply_fn, f.params, _ids(2, 5))
  assert after == before - 3             # the three means removed; nothing added per call
  ch = r.counted_changes()
  assert (ch.counted_before, ch.counted_after, ch.constant_aux, ch.reductions_added) == (before, after, 1, 0)
  assert f"{before} -> {after}" in r.diff() and "computed at fold time, none per call" in r.diff()
  _assert_exact(m, p, f, _ids(2, 5), _ids(1, 1, seed=1), _ids(3, 9, seed=2))
  # a new shape analysed under the caller's jit computes its constant eagerly too
  out = jax.jit(f.apply_fn)(f.params, _ids(1, 7, seed=3))
  assert np.allclose(out, m.apply(p, _ids(1, 7, seed=3)), rtol=1e-10, atol=1e-10)


class _PerHead(nn.Module):
  heads: int = 4

  @nn.compact
  def __call__(self, q):
    parts = jnp.split(q, self.heads, axis=-2)
    return jnp.concatenate([nn.LayerNorm(name=f"norms_{k}")(x) for k, x in enumerate(parts)], axis=-2)


class _StableLM(nn.Module):
  """StableLM's per-head QK LayerNorms: one LayerNorm per head."""
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    for i in range(2):
      q = nn.Dense(16, name=f"layers_{i}_q_proj")(h).reshape(h.shape[:-1] + (4, 4))
      q = _PerHead(name=f"layers_{i}_q_layernorm")(q)
      h = h + nn.Dense(16, name=f"layers_{i}_o_proj")(q.reshape(h.shape))
    return h


def _balanced(text: str) -> bool:
  depth = {"(": 0, "[": 0, "{": 0}
  close = {")": "(", "]": "[", "}": "{"}
  for c in text:
    if c in depth:
      depth[c] += 1
    elif c in close:
      depth[close[c]] -= 1
      if depth[close[c]] < 0:
        return False
  return not any(depth.values())


def test_per_head_norms_group_with_balanced_labels(x64):
  m = _StableLM()
  p = _randomized(m.init(jax.random.PRNGKey(0), _x(2, 5, 8)))
  f = jaxfold.fold(p, m.apply, _x(2, 5, 8))
  assert f.report.num_folded == 8
  rows = f.report._rows(group=True)
  assert all(_balanced(r[2]) for r in rows), rows
  assert any(r[2] == "_StableLM/layers_0_q_layernorm/norms_1…norms_3  (3)" for r in rows), rows
  _assert_exact(m, p, f, _x(2, 5, 8), _x(1, 1, 8, seed=2))


@pytest.mark.parametrize("names", [
    [f"S/layers_0/q_layernorm/norms_{k} (in pjit `f` called at model.py:12 (g))" for k in range(4)],
    [f"model.py:88 (norm) (use {k} of 4)" for k in (1, 2, 4)],
    [f"S/l_{k}.q[norms_{k}] ← m.py:{k} (f)" for k in range(3)],
    [f"norms_{k}(x)" for k in (0, 1, 2)],
])
def test_group_labels_stay_balanced(names):
  label = R._group_label(names)
  assert _balanced(label) and len(label) < sum(map(len, names)), label


def test_site_names_are_bounded_keeping_the_end():
  long = "/".join(f"module_{i}" for i in range(60)) + "/ln_2"
  assert len(R.bound_name(long)) <= R.NAME_LIMIT and R.bound_name(long).endswith("/module_59/ln_2")
  chain = "enc/ln ← " + " ← ".join(f"layers/f{i}.py:{i} (call_{i})" for i in range(30))
  out = R.bound_name(chain)
  assert len(out) <= R.NAME_LIMIT and out.startswith("enc/ln ← …") and out.endswith("(call_29)")
  assert R.bound_name("h_0/ln_1") == "h_0/ln_1"


_FRAMEWORK = '''
import jax.numpy as jnp

def layer_norm(h, g):
  mu = jnp.mean(h, -1, keepdims=True)
  return (h - mu) / jnp.sqrt(jnp.mean((h - mu) ** 2, -1, keepdims=True) + 1e-5) * g
'''

_USER_MODEL = '''
from fwk39 import layer_norm

def apply(p, x):
  h = x @ p["w"]
  return layer_norm(h, 1.0 + 0 * h[0])   # no parameter of its own to name the norm by
'''


@pytest.fixture
def installed(tmp_path, monkeypatch):
  """A site-packages holding a framework (``fwk39``) and a user's own package
  (``userpkg39``) that calls it."""
  site = tmp_path / "site-packages"
  (site / "userpkg39").mkdir(parents=True)
  (site / "fwk39.py").write_text(_FRAMEWORK)
  (site / "userpkg39" / "__init__.py").write_text("")
  (site / "userpkg39" / "model.py").write_text(_USER_MODEL)
  monkeypatch.syspath_prepend(str(site))
  real = compat._installed_dirs()
  caches = (compat._installed_dirs, compat._is_library_file)

  def with_site(extra=()):
    for c in caches:
      c.cache_clear()
    monkeypatch.setattr(compat, "_installed_dirs", lambda: real + (os.path.join(str(site), ""),) + extra)
  yield site, with_site
  monkeypatch.undo()
  for c in caches:
    c.cache_clear()
  for name in [n for n in sys.modules if n.split(".")[0] in ("fwk39", "userpkg39")]:
    del sys.modules[name]


def _with_installed_norm(p, x):
  import fwk39
  return fwk39.layer_norm(x @ p["w"], 1.0)


def test_site_names_skip_installed_frameworks(installed, x64):
  _, with_site = installed
  with_site()
  p = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(4, 6)))}
  (s,) = jaxfold.fold(p, _with_installed_norm, _x(3, 4)).report.sites
  # the framework's line is never named: the innermost line outside installed code is
  assert s.where == s.source and s.source.endswith("(_with_installed_norm)") and "test_report.py:" in s.source


def test_a_users_installed_package_is_never_named_by_a_library_line(installed, x64):
  """Every frame installed (a user's package in site-packages calling a
  framework): no library's line is named; the site says what it is."""
  _, with_site = installed
  with_site()
  from userpkg39 import model
  p = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(4, 6)))}
  f = jaxfold.fold(p, model.apply, _x(3, 4))
  (s,) = f.report.sites
  assert s.folded and s.source == "" and s.where == "a mean over axes 1 of a 3x6 value (in installed code)", s
  assert "fwk39" not in str(f.report) + f.report.diff()
