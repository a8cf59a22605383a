"""What a newcomer sees first: short reprs, a self-explaining Params, the
report in a notebook, what the diff says about kernels, one parameter naming
across fold/fuse/rotate, and rotate's hints."""

import copy
import dataclasses
import pickle

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfold
from jaxfold._src import display
from jaxfold._src import report as R

models = pytest.importorskip("models")


class M(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.LayerNorm()(nn.Dense(8)(x)))


X = jnp.ones((2, 4))


@pytest.fixture(scope="module")
def tiny():
  m = M()
  p = m.init(jax.random.PRNGKey(0), X)
  return m, p, jaxfold.fold(p, m.apply, X)


@pytest.fixture(scope="module")
def gpt2():
  spec = models.get("gpt2-tiny")
  p = models.random_params(spec, 1, 8, 0)
  return spec, p, spec.example_inputs(1, 8)


def test_reprs_summarise_shapes_not_values(tiny):
  _, _, f = tiny
  text = repr(f)
  assert "Array(" not in text and len(text) < 300, text
  assert text.startswith("Folded(params=Params(params=<6 leaves, ")
  assert "report=<1/1 normalization sites folded" in text
  fused = jaxfold.fuse_affine(f)
  assert "Array(" not in repr(fused) and repr(fused).startswith("Fused(params=Params(params=<")
  assert repr(f.report) == "<jaxfold.Report: 1/1 normalization sites folded, 0 auxiliary centering(s)>"


def test_folded_params_in_the_original_model_says_what_to_pass(tiny):
  m, p, f = tiny
  with pytest.raises(AttributeError, match=r"folded\.params\.params"):
    m.apply(f.params, X)
  # copy and pickle look optional dunders up through __getattr__: they must still work
  again = pickle.loads(pickle.dumps(copy.deepcopy(f.params)))
  assert isinstance(again, jaxfold.Params) and again.extras == {}


@pytest.mark.parametrize("kw", [{}, {"tied_weights": "copy"}])
def test_centered_tree_computes_the_original_function_in_the_original_model(gpt2, kw):
  spec, p, ids = gpt2
  fn = spec.apply_fn()
  f = jaxfold.fold(p, fn, *ids, **kw)
  # the case the claim is about: an auxiliary centering, or an untied copy
  assert f.report.num_auxiliary if not kw else f.params.extras
  changed = [not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(p),
                                                       jax.tree_util.tree_leaves(f.params.params))]
  assert any(changed)
  run = jax.jit(fn)   # one compile for both: eager gpt2 costs seconds
  ref, out = np.asarray(run(p, *ids)), np.asarray(run(f.params.params, *ids))
  assert np.max(np.abs(ref - out)) / np.max(np.abs(ref)) < 1e-5


def test_report_html_is_a_table_and_escaped(tiny):
  _, _, f = tiny
  site = dataclasses.replace(f.report.sites[0], where="<script>x</script>")
  r = dataclasses.replace(f.report, sites=(site,))
  out = r._repr_html_()
  assert out.startswith("<div><table>") and "<th" in out and out.count("<tr") == 2
  assert "<script>" not in out and "&lt;script&gt;x&lt;/script&gt;" in out
  assert "<div>1/1 normalization sites folded, 0 auxiliary centering(s)</div>" in out


def test_diff_says_no_kernel_proof_ran_on_cpu(tiny):
  m, p, _ = tiny
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU the kernel's proof runs")
  auto = jaxfold.fold(p, m.apply, X).report
  line = next(x for x in auto.diff().splitlines() if "kernels substituted" in x)
  assert "no kernel proof attempted" in line and "cpu" in line and "proved" not in line
  pallas = jaxfold.fold(p, m.apply, X, norm_impl="pallas").report
  line = next(x for x in pallas.diff().splitlines() if "kernels substituted" in x)
  assert "1 site(s) proved" in line and "XLA's RMSNorm expression runs" in line
  assert "only when compiled for CUDA" in line
  # saved and loaded, the report still knows where it was made
  again = R.Report.from_dict(pallas.as_dict())
  assert again == pallas and again.diff() == pallas.diff()
  old = R.Report.from_dict({**auto.as_dict(), "changes": {
      k: v for k, v in auto.as_dict()["changes"].items() if k not in ("platform", "kernel_proof")}})
  assert "kernels substituted: none" in old.diff()


def test_param_labels_are_one_naming():
  assert R.param_label("['params']['h_0']['attn']['kernel']") == "h_0.attn.kernel"
  assert R.param_label(".params['params']['h_0']['attn']['kernel']") == "h_0.attn.kernel"
  assert R.param_label(".base.params['h_0']['mlp']['c_fc']['kernel']") == "h_0.mlp.c_fc.kernel"
  assert R.param_label(".base.untied[\"['wte']['embedding']@centered(1)\"]") == "wte.embedding[1] (copy)"
  assert R.param_label(".extras[\".params['wte']['embedding']@bias.params['ln_f']['bias']\"]") == (
      "wte.embedding (new bias from ln_f.bias)")
  assert R.param_label("['h_0']['attn'].value") == "h_0.attn"


def test_fold_fuse_rotate_reports_name_parameters_alike(gpt2):
  spec, p, ids = gpt2
  f = jaxfold.fold(p, spec.apply_fn(), *ids, tied_weights="copy")
  fused = jaxfold.fuse_affine(f)
  q = np.linalg.qr(np.random.default_rng(0).normal(size=(32, 32)))[0]
  rotated = jaxfold.rotate(fused, q)
  texts = [str(f.report), f.report.diff(), str(fused.report), str(rotated.report)]
  for t in texts:
    assert "['" not in t and ".params" not in t and ".base" not in t, t
  assert "wte.embedding[1] (copy)" in texts[1] and "wte.embedding[1] (copy) along dim 1" in texts[3]
  assert "γ into h_0.attn.c_attn.kernel" in texts[2]


def test_rotate_says_fuse_first_and_tied_weights_copy(gpt2):
  spec, p, ids = gpt2
  q = np.eye(32)
  copy = jaxfold.fold(p, spec.apply_fn(), *ids, tied_weights="copy")
  with pytest.raises(jaxfold.FuseError, match=r"call jaxfold\.fuse_affine\(folded\) first") as e:
    jaxfold.rotate(copy, q)
  assert "tied_weights" not in str(e.value)
  aux = jaxfold.fold(p, spec.apply_fn(), *ids)
  assert aux.report.num_auxiliary == 1
  with pytest.raises(jaxfold.FuseError, match=r'tied_weights="copy"') as e:
    jaxfold.rotate(jaxfold.fuse_affine(aux), q, insert=False)
  assert "fuse_affine(folded) first" not in str(e.value)
  # (by default the program computes x @ Q on the aux-centered embedding instead)
  assert len(jaxfold.rotate(jaxfold.fuse_affine(aux), q).report.inserted) == 1


def test_tree_summary():
  tree = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float16)}
  assert display.tree_summary(tree) == "<2 leaves, 30 B, float16/float32>"
