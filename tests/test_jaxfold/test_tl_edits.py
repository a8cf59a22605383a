"""fuse_affine(center_unembed=True, fold_value_biases=True) against TransformerLens's formulas.

TL's weight processing written in numpy on the model's own weights (fold_ln, center_writing_weights,
center_unembed, fold_value_biases) is compared with jaxfold's processed parameters (to 1e-12), and
the outputs: probabilities equal to 1e-12 in float64, raw logits shifted by a per-row constant.
Two GPT-2 styles (models/gpt2.py: fused c_attn, tied head, float32 attention casts, compared in
real arithmetic; a TransformerLens-style einsum GPT-2 in float64), two shapes, batch 1 included.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import real_eval

import jaxfold
import models

SHAPES = [(2, 8), (1, 5)]


def _f64(tree):
  return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), tree)


def _row_spread(a, b):
  """max over rows of (max - min) of a - b along the last axis: 0 for a per-row shift."""
  d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  return float(np.max(d.max(-1) - d.min(-1)))


def _softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _center(w, axis):
  return w - w.mean(axis=axis, keepdims=True)


# ----------------------------------------------------------------------------
# models/gpt2.py


def _tl_gpt2(p, n_layer, d):
  """TL's processed weights of models/gpt2.py's parameters (numpy, float64)."""
  out = {}
  for i in range(n_layer):
    h = p[f"h_{i}"]
    g, b = h["ln_1"]["scale"], h["ln_1"]["bias"]
    w, bq = h["attn"]["c_attn"]["kernel"], h["attn"]["c_attn"]["bias"]
    bqkv = bq + b @ w                                        # fold_ln: b += β·W
    b_v = bqkv[2 * d:]
    w_o = _center(h["attn"]["c_proj"]["kernel"], -1)          # center_writing_weights
    b_o = _center(h["attn"]["c_proj"]["bias"], -1)
    out[i] = {"b_O": b_o + b_v @ w_o, "W_qkv": g[:, None] * w}   # fold_value_biases
  g, b = p["ln_f"]["scale"], p["ln_f"]["bias"]
  w_u = g[:, None] * p["wte"]["embedding"].T                  # fold_ln into W_U, b_U = β·W_U
  out["W_U"], out["b_U"] = _center(w_u, -1), _center(b @ p["wte"]["embedding"].T, -1)   # center_unembed
  return out


def test_gpt2_matches_transformer_lens_formulas(x64):
  spec = models.get("gpt2-tiny")
  cfg = spec.config
  p = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), models.random_params(spec, 2, 8))
  ids = spec.example_inputs(2, 8)
  folded = jaxfold.fold(p, spec.apply_fn(), *ids, tied_weights="copy")
  fu = jaxfold.fuse_affine(folded, center_unembed=True, fold_value_biases=True)
  edits = fu.report.edits
  assert sum(s.done for s in edits if s.edit == "fold_value_biases") == cfg.n_layer, str(fu.report)
  assert [s.done for s in edits if s.edit == "center_unembed"] == [True], str(fu.report)
  assert "per row" in str(fu.report) and "Σ_k = 1" in str(fu.report)
  pp = p.get("params", p)
  tl = _tl_gpt2(_f64(pp), cfg.n_layer, cfg.n_embd)
  base = fu.params.params
  base = base.get("params", base)
  extras = {k: np.asarray(v, np.float64) for k, v in fu.params.extras.items()}
  d = cfg.n_embd
  for i in range(cfg.n_layer):
    h = base[f"h_{i}"]["attn"]
    vb = [v for k, v in extras.items() if k.startswith(f"h_{i}.attn.c_proj.kernel@vbias")]
    assert len(vb) == 1
    np.testing.assert_allclose(np.asarray(h["c_proj"]["bias"]) + vb[0].reshape(-1), tl[i]["b_O"], atol=1e-12)
    np.testing.assert_allclose(np.asarray(h["c_attn"]["kernel"]), tl[i]["W_qkv"], atol=1e-12)   # fold_ln
    assert np.all(np.asarray(h["c_attn"]["bias"])[2 * d:] == 0)          # b_V' = 0
    fb = [v for k, v in extras.items() if f"h_{i}']['attn']['c_attn']['kernel']@bias" in k]
    assert np.all(fb[0].reshape(-1)[2 * d:] == 0)                         # and its fold_ln part
  # (the fold untied the lookup's copy: the head scales and centers wte in place)
  b_u = [v for k, v in extras.items() if k.startswith(".params['wte']['embedding']@bias")]
  np.testing.assert_allclose(np.asarray(base["wte"]["embedding"], np.float64).T, tl["W_U"], atol=1e-12)
  np.testing.assert_allclose(b_u[0].reshape(-1), tl["b_U"], atol=1e-12)
  # Outputs, in real arithmetic (the model's attention computes in float32): probabilities to
  # 1e-12, logits shifted per row; without the edits' new biases the probabilities are wrong.
  for b, t in SHAPES:
    x = spec.example_inputs(b, t)
    ref = real_eval.run(jax.make_jaxpr(spec.apply_fn())(p, *x), jax.tree_util.tree_leaves((p, x)))[0]
    got = real_eval.run(jax.make_jaxpr(fu.apply_fn)(fu.params, *x), jax.tree_util.tree_leaves((fu.params, x)))[0]
    assert np.max(np.abs(_softmax(got) - _softmax(ref))) < 1e-12
    assert _row_spread(got, ref) < 1e-12
    assert np.max(np.abs(np.asarray(got) - np.asarray(ref))) > 1e-6   # (the shift is real)
    broken = fu.params._replace(extras={k: (0 * v if "vbias" in k else v) for k, v in fu.params.extras.items()})
    bad = real_eval.run(jax.make_jaxpr(fu.apply_fn)(broken, *x), jax.tree_util.tree_leaves((broken, x)))[0]
    assert np.max(np.abs(_softmax(bad) - _softmax(ref))) > 1e-6


# ----------------------------------------------------------------------------
# A TransformerLens-style GPT-2: einsum attention with per-head W_Q/W_K/W_V/W_O, untied W_U, b_U.

D, H, DH, V, L = 16, 4, 4, 24, 2


def _ln(x, g, b, eps=1e-5):
  m = x.mean(-1, keepdims=True)
  v = ((x - m) ** 2).mean(-1, keepdims=True)
  return (x - m) / jnp.sqrt(v + eps) * g + b


class TLGPT(nn.Module):
  """Hand-written parameters in TL's shapes; ``dropout``: probabilities times a given mask."""
  dropout: bool = False
  softcap: bool = False

  @nn.compact
  def __call__(self, ids, keep=None):
    n = lambda name, shape, s=0.3: self.param(name, nn.initializers.normal(s), shape, jnp.float64)
    t = ids.shape[1]
    x = n("W_E", (V, D))[ids] + n("W_pos", (16, D))[:t]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for i in range(L):
      p = lambda name, shape, s=0.3, i=i: n(f"{i}.{name}", shape, s)
      y = _ln(x, p("ln1.w", (D,)), p("ln1.b", (D,)))
      q = jnp.einsum("bpd,hdk->bphk", y, p("W_Q", (H, D, DH))) + p("b_Q", (H, DH))
      k = jnp.einsum("bpd,hdk->bphk", y, p("W_K", (H, D, DH))) + p("b_K", (H, DH))
      v = jnp.einsum("bpd,hdk->bphk", y, p("W_V", (H, D, DH))) + p("b_V", (H, DH))
      s = jnp.einsum("bqhk,bphk->bhqp", q, k) / np.sqrt(DH)
      a = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
      if self.dropout:
        a = a * keep / 0.9
      z = jnp.einsum("bhqp,bphk->bqhk", a, v)
      x = x + jnp.einsum("bqhk,hkd->bqd", z, p("W_O", (H, DH, D))) + p("b_O", (D,))
      y = _ln(x, p("ln2.w", (D,)), p("ln2.b", (D,)))
      m = jax.nn.gelu(y @ p("W_in", (D, 4 * D)) + p("b_in", (4 * D,)))
      x = x + m @ p("W_out", (4 * D, D)) + p("b_out", (D,))
    y = _ln(x, n("lnf.w", (D,)), n("lnf.b", (D,)))
    logits = y @ n("W_U", (D, V)) + n("b_U", (V,))
    return jnp.tanh(logits) if self.softcap else logits


def _tl_process(p):
  """TransformerLens's process_weights_ on TLGPT's parameters, in numpy."""
  p = {k: np.asarray(v, np.float64) for k, v in p.items()}
  out = {}
  for i in range(L):
    g, b = p[f"{i}.ln1.w"], p[f"{i}.ln1.b"]
    b_v = p[f"{i}.b_V"] + np.einsum("d,hdk->hk", b, p[f"{i}.W_V"])   # fold_ln
    w_o, b_o = _center(p[f"{i}.W_O"], -1), _center(p[f"{i}.b_O"], -1)    # center_writing_weights
    out[f"{i}.W_V"] = g[None, :, None] * p[f"{i}.W_V"]
    out[f"{i}.b_O"] = b_o + np.einsum("hk,hkd->d", b_v, w_o)             # fold_value_biases
  g, b = p["lnf.w"], p["lnf.b"]
  out["W_U"] = _center(g[:, None] * p["W_U"], -1)                         # fold_ln + center_unembed
  out["b_U"] = _center(p["b_U"] + b @ p["W_U"], -1)
  return out


def _tlgpt(seed=0, **kw):
  m = TLGPT(**kw)
  ids = jnp.asarray(np.random.default_rng(seed).integers(0, V, (2, 8)))
  p = m.init(jax.random.PRNGKey(seed), ids, jnp.ones((2, H, 8, 8)) if kw.get("dropout") else None)
  return m, p, ids


def test_einsum_gpt_matches_transformer_lens_formulas(x64):
  m, p, ids = _tlgpt()
  folded = jaxfold.fold(p, m.apply, ids)
  fu = jaxfold.fuse_affine(folded, center_unembed=True, fold_value_biases=True)
  assert sum(s.done for s in fu.report.edits) == L + 1, str(fu.report)
  tl = _tl_process(p["params"])
  base = {k: np.asarray(v, np.float64) for k, v in fu.params.params["params"].items() if v is not None}
  extras = {k: np.asarray(v, np.float64) for k, v in fu.params.extras.items()}
  for i in range(L):
    np.testing.assert_allclose(base[f"{i}.W_V"], tl[f"{i}.W_V"], atol=1e-12)
    vb = [v for k, v in extras.items() if k.startswith(f"{i}.W_O@vbias")]
    np.testing.assert_allclose(base[f"{i}.b_O"] + vb[0].reshape(-1), tl[f"{i}.b_O"], atol=1e-12)
    assert np.all(base[f"{i}.b_V"] == 0)
    fb = [v for k, v in extras.items() if f"'{i}.W_V']@bias" in k]
    assert np.all(fb[0] == 0)
  np.testing.assert_allclose(base["W_U"], tl["W_U"], atol=1e-12)
  bu = [v for k, v in extras.items() if "['W_U']@bias" in k]
  np.testing.assert_allclose(base["b_U"] + bu[0].reshape(-1), tl["b_U"], atol=1e-12)
  for b, t in SHAPES:
    x = jnp.asarray(np.random.default_rng(b + t).integers(0, V, (b, t)))
    ref, got = jax.jit(m.apply)(p, x), jax.jit(fu.apply_fn)(fu.params, x)
    assert np.max(np.abs(_softmax(got) - _softmax(ref))) < 1e-12
    assert _row_spread(got, ref) < 1e-12
    assert bool(jnp.all(jnp.argmax(got, -1) == jnp.argmax(ref, -1)))


def test_refused_with_the_reason(x64):
  # Dropout on the probabilities: the weights' rows no longer sum to one.
  m, p, ids = _tlgpt(dropout=True)
  keep = jnp.asarray(np.random.default_rng(1).integers(0, 2, (2, H, 8, 8)), jnp.float64)
  fu = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, ids, keep), fold_value_biases=True)
  vb = [s for s in fu.report.edits if s.edit == "fold_value_biases"]
  assert len(vb) == L and not any(s.done for s in vb)
  assert all("not proved to be rows of a softmax" in s.reason for s in vb), str(fu.report)
  np.testing.assert_allclose(jax.jit(fu.apply_fn)(fu.params, ids, keep), m.apply(p, ids, keep), atol=1e-12)
  # Logits through a nonlinearity: centering them would change the output.
  m, p, ids = _tlgpt(softcap=True)
  fu = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, ids), center_unembed=True)
  cu = [s for s in fu.report.edits if s.edit == "center_unembed"]
  assert len(cu) == 1 and not cu[0].done and "not centered" in cu[0].reason, str(fu.report)
  np.testing.assert_allclose(jax.jit(fu.apply_fn)(fu.params, ids), m.apply(p, ids), atol=1e-12)


def test_off_by_default(x64):
  m, p, ids = _tlgpt()
  fu = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, ids))
  assert fu.report.edits == ()
  np.testing.assert_allclose(jax.jit(fu.apply_fn)(fu.params, ids), m.apply(p, ids), atol=1e-12)


def test_save_load_and_defer_keep_the_edits(x64, tmp_path):
  """The edits are part of the fused program: a saved result redoes them on load, and
  defer_norms of an edited result keeps them (else the new biases would be missing)."""
  m, p, ids = _tlgpt()
  fu = jaxfold.fuse_affine(jaxfold.fold(p, m.apply, ids), center_unembed=True, fold_value_biases=True)
  x = jnp.asarray(np.random.default_rng(3).integers(0, V, (1, 5)))
  want = jax.jit(fu.apply_fn)(fu.params, x)
  jaxfold.save_fold(fu, tmp_path / "tl")
  back = jaxfold.load_fold(tmp_path / "tl", m.apply)
  assert back.report.edits == fu.report.edits
  np.testing.assert_allclose(jax.jit(back.apply_fn)(back.params, x), want, atol=1e-12)
  deferred = jaxfold.defer_norms(fu)
  assert deferred.report.edits == fu.report.edits and deferred.report.num_deferred > 0
  np.testing.assert_allclose(jax.jit(deferred.apply_fn)(deferred.params, x), want, atol=1e-12)
