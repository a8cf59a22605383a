"""Adversarial programs against ``rotate`` (and ``fuse_affine``/``defer_norms``
across input ranks) (advrot).

Not covered by test_rotate.py / test_adversarial_fuse.py: norms whose mean is a
contraction with ones (the fold folds them, so rotate must accept them), writers
of the stream that no norm's zero-sum question proposes (found backwards), a
weight that both reads and writes the stream, readers whose W flips sides with
the input's rank (``einsum("dk,...d->...k", W, y)``), ``defer_norms`` at another
rank than ``fuse_affine``, and a campaign of model shapes (heads split and merged
by reshape or einsum, causal masks by ``where``/``-inf``, tied embeddings,
parallel attention+MLP, post-LN before pre-LN, RMSNorm models, keyword
arguments, GroupNorm convnets, bf16 parameters). Each case is either exact
(float64, random non-uniform γ, β and biases, two input shapes, compared with the
*original* program) or refused with a reason that names what blocks.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spellings as S
from conftest import rel_err
from helpers import named_params
from jax import lax

import jaxfold
from jaxfold._src import affine

D, H, V = 8, 2, 11
SHAPES = [(2, 5, 4), (3, 7, 4)]

P = dict(w1=(4, D), b1=(D,), g=(D,), beta=(D,), g2=(D,), beta2=(D,), g3=(D,), beta3=(D,),
         wa=(D, 16), ba=(16,), wb=(16, D), bb=(D,), w2=(D, 3), b2=(3,), wsq=(D, D), v=(D,), ls=(D,),
         emb=(V, D), pos=(9, D), wq=(D, H, D // H), wk=(D, H, D // H), wv=(D, H, D // H),
         wo=(H, D // H, D), wo2=(D, D), bo=(D,), wr=(H, D // H, 5))


def _x(*shape, seed=1):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float64)


def _orth(n=D, seed=0):
  q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
  return q * np.sign(np.diag(r))


def _same(fn, p, model, shapes=SHAPES, tol=1e-9, **kw):
  for k, shape in enumerate(shapes):
    x = _x(*shape, seed=10 + k)
    err = rel_err(fn(p, x, **kw), model.apply_fn(model.params, x, **kw))
    assert err < tol, (shape, err)


def _ln(h, g, b, eps=1e-5):
  m = h.mean(-1, keepdims=True)
  return (h - m) * lax.rsqrt(((h - m) ** 2).mean(-1, keepdims=True) + eps) * g + b


def _rms(h, g, eps=1e-6):
  return h * lax.rsqrt((h * h).mean(-1, keepdims=True) + eps) * g


def _stem(p, x):
  return x @ p["w1"] + p["b1"]


def _mlp(p, y):
  return jax.nn.gelu(y @ p["wa"] + p["ba"]) @ p["wb"] + p["bb"]


# ----------------------------------------------------------------------------
# A LayerNorm whose mean (and variance) is a contraction with a vector of ones:
# the fold folds it (the rules' `sums` facet), so rotate must find its sum of
# squares there too (bug: "no sum of squares over an axis of size 8 ... nothing
# to rotate", or, with one such norm last, the writer before it not proposed:
# "`add` adds an unrotated value to the rotated stream and the output of
# `dot_general` is not a parameter" — the fuzzer's stream programs 3, 4, 5, 7).


@pytest.mark.parametrize("spelling", [("dot_ones", "two_pass"), ("einsum_ones", "fast")],
                         ids=lambda s: "-".join(s))
def test_rotate_mean_as_contraction_with_ones(x64, spelling):
  sp = S.Spelling(*spelling, "rsqrt", "centered")

  def fn(p, x):
    h = _stem(p, x)
    h = h + _mlp(p, S.layer_norm(sp, h, p["g"], p["beta"]))
    return S.layer_norm(sp, h, p["g2"], p["beta2"]) @ p["w2"] + p["b2"]

  p = named_params(**P)
  fu = jaxfold.fuse_affine(jaxfold.fold(p, fn, _x(*SHAPES[0])))
  assert fu.report.num_fused == 2, fu.report
  for m in (fu, jaxfold.defer_norms(fu)):
    r = jaxfold.rotate(m, _orth())
    assert r.report.norms == 2, r.report
    assert {"wb", "bb", "w1", "b1", "wa", "w2"} <= {n.split("'")[1] for n, _ in r.report.rotated}, r.report
    _same(fn, p, r)


def _ln_var_einsum(h, g, b, eps=1e-5):   # the variance as a contraction of h - m with itself
  c = h - h.mean(-1, keepdims=True)
  return c * lax.rsqrt(jnp.einsum("...d,...d->...", c, c)[..., None] / h.shape[-1] + eps) * g + b


def test_rotate_variance_as_self_contraction(x64):
  def fn(p, x):
    h = _stem(p, x)
    h = h + _mlp(p, _ln_var_einsum(h, p["g"], p["beta"]))
    return _ln_var_einsum(h, p["g2"], p["beta2"]) @ p["w2"] + p["b2"]

  p = named_params(**P)
  fu = jaxfold.fuse_affine(jaxfold.fold(p, fn, _x(*SHAPES[0])))
  assert fu.report.num_fused == 2, fu.report
  r = jaxfold.rotate(fu, _orth())    # (was: "no sum of squares over an axis of size 8")
  assert r.report.norms == 2, r.report
  _same(fn, p, r)


def _side(read):
  """A pre-LN block whose stream is also read by ``read`` (centered first, so
  that the fold folds both norms and read sees the folded stream)."""
  def fn(p, x):
    h = _stem(p, x)
    h = h + _mlp(p, _ln(h, p["g"], p["beta"]))
    return _ln(h, p["g2"], p["beta2"]) @ p["w2"] + p["b2"], read(p, h - h.mean(-1, keepdims=True))
  fn.__name__ = read.__name__
  return fn


def squares_dot_ones(p, h):       # ||h||² as a contraction with ones: rotation-invariant
  return (h * h) @ jnp.ones((D,))


def squares_einsum_const(p, h):   # ... with a constant vector, as einsum
  return jnp.einsum("btd,d->bt", jnp.square(h), jnp.full((D,), 0.5))


def gram_rows(p, h):              # a Gram matrix over d: invariant, but no norm
  return jnp.einsum("btd,bsd->bts", h, h)


def squares_dot_weights(p, h):    # Σ_d v_d h_d²: not invariant
  return (h * h) @ p["v"]


def squares_masked_ones(p, h):   # Σ_{d<4} h_d²: a constant vector that is not constant along d
  return (h * h) @ jnp.where(jnp.arange(D) < 4, 1.0, 0.0)


def squares_keep_dim(p, h):       # h² contracted over tokens, keeping d: not invariant
  return jnp.einsum("btd,t->bd", h * h, jnp.ones((h.shape[1],)))


@pytest.mark.parametrize("read, refusal", [
    (squares_dot_ones, None), (squares_einsum_const, None), (gram_rows, None),
    (squares_dot_weights, "weights that vary along it"), (squares_masked_ones, "weights that vary along it"),
    (squares_keep_dim, "keeps its dim")], ids=lambda r: getattr(r, "__name__", ""))
def test_rotate_sum_of_squares_contracted(x64, read, refusal):
  p = named_params(**P)
  fn = _side(read)
  fu = jaxfold.fuse_affine(jaxfold.fold(p, fn, _x(*SHAPES[0])))
  assert fu.report.num_fused == 2, fu.report
  if refusal:
    with pytest.raises(jaxfold.RotateError, match=f"not provably exact: .*{refusal}"):
      jaxfold.rotate(fu, _orth())
    return
  r = jaxfold.rotate(fu, _orth())
  assert r.report.norms == 2 + (read is not gram_rows), r.report   # (the side read: ||h||² is one)
  _same(fn, p, r)


# ----------------------------------------------------------------------------
# Writers of the stream that no norm's zero-sum question proposes: the block's
# output is read by a Gram head (no norm after it), so nothing asks what writes
# it; the rotation finds them backwards from the `add` that joins the rotated
# stream (bug: "... the output of `dot_general` is not a parameter seen through
# re-indexing"). A per-channel scale (LayerScale) on the branch has no rotated
# form and stays refused; a weight that both reads and writes the stream is
# rotated along both dims (was: "would have to be rotated along dims [1] and [0]").


def _gram(h):   # (centered, so that the fold folds: a Gram matrix reads the stream twice)
  h = h - h.mean(-1, keepdims=True)
  return jnp.einsum("btd,bsd->bts", h, h)


def gram_head(p, x):
  h = _stem(p, x)
  return _gram(h + _mlp(p, _ln(h, p["g"], p["beta"])))


def gram_head_layer_scale(p, x):
  h = _stem(p, x)
  return _gram(h + _mlp(p, _ln(h, p["g"], p["beta"])) * p["ls"])


def gram_head_scalar_scale(p, x):
  h = _stem(p, x)
  return _gram(h + _mlp(p, _ln(h, p["g"], p["beta"])) * p["ls"][0])


def square_reads_and_writes(p, x):
  h = _stem(p, x)
  h = h + jnp.einsum("dk,...d->...k", p["wsq"], _ln(h, p["g"], p["beta"]))   # wsq: reader and writer
  return _ln(h, p["g2"], p["beta2"]) @ p["w2"]


@pytest.mark.parametrize("fn, refusal", [
    (gram_head, None), (gram_head_scalar_scale, None), (square_reads_and_writes, None),
    (gram_head_layer_scale, "output of `mul` is neither a parameter")], ids=lambda f: getattr(f, "__name__", ""))
def test_rotate_writers_found_backwards(x64, fn, refusal):
  p = named_params(**P)
  fu = jaxfold.fuse_affine(jaxfold.fold(p, fn, _x(*SHAPES[0])))
  if refusal:
    with pytest.raises(jaxfold.RotateError, match=refusal):
      jaxfold.rotate(fu, _orth(), insert=False)
    # The layer-scaled MLP output (ls varies along the stream) gets x @ Q where it is
    # made; the Gram head's centering reads the stream un-rotated.
    r = jaxfold.rotate(fu, _orth())
    assert [t[:6] for t in r.report.inserted] == ["x @ Q ", "y @ Qᵀ"], r.report
    _same(fn, p, r)
    return
  r = jaxfold.rotate(fu, _orth())
  rotated = {n.split("'")[1]: d for n, d in r.stream_axes.items() if n.startswith("[")}   # the user's
  if fn is square_reads_and_writes:
    assert rotated["wsq"] == (0, 1), r.report
  else:
    assert rotated["wb"] == (1,) and rotated["bb"] == (0,), r.report
  _same(fn, p, r)
  _same(fn, p, jaxfold.rotate(jaxfold.defer_norms(fu), _orth(seed=2)))


# ----------------------------------------------------------------------------
# fuse_affine across ranks. jnp.einsum("dk,...d->...k", W, y) contracts with W
# on the left at rank 1 (y of shape (d,)) and on the right at higher ranks: the
# new bias β·W has the same values, its axes another order (bug: a model fused at
# one rank refused the other, "inputs of these shapes ((4,)) fuse differently").
# defer_norms(fused, x) at another rank than fuse_affine's example kept the
# biases laid out for the old rank (bug: outputs of shape (1, 2, 3, 3) for
# (2, 3, 3), or "cannot reshape array of shape (1, 3) into shape (1,)").


def w_left_reader(p, x):
  h = _stem(p, x)
  h = h + jnp.einsum("dk,...d->...k", p["wb"].T, _ln(h, p["g"], p["beta"])) @ p["wb"]
  return jnp.einsum("dk,...d->...k", p["w2"], _ln(h, p["g2"], p["beta2"])) + p["b2"]


def plain_reader(p, x):
  return _ln(_stem(p, x), p["g"], p["beta"]) @ p["w2"]


RANKS = [(4,), (3, 4), (2, 3, 4)]


@pytest.mark.parametrize("fn", [w_left_reader, plain_reader], ids=lambda f: f.__name__)
@pytest.mark.parametrize("at", [0, 1], ids=["fused_at_rank1", "fused_at_rank2"])
def test_fuse_and_defer_across_ranks(x64, fn, at):
  p = named_params(**P)
  fu = jaxfold.fuse_affine(jaxfold.fold(p, fn, _x(*RANKS[at])))
  assert fu.report.num_fused == (2 if fn is w_left_reader else 1), fu.report
  models = [fu, jaxfold.defer_norms(fu)] + [jaxfold.defer_norms(fu, _x(*s)) for s in RANKS if s != RANKS[at]]
  for m in models:
    for k, shape in enumerate(RANKS):
      x = _x(*shape, seed=20 + k)
      out = m.apply_fn(m.params, x)
      assert out.shape == fn(p, x).shape and rel_err(fn(p, x), out) < 1e-9, (shape, rel_err(fn(p, x), out))


def test_fused_across_ranks_saves_and_loads(x64, tmp_path):
  p = named_params(**P)
  fu = jaxfold.fuse_affine(jaxfold.fold(p, w_left_reader, _x(*RANKS[1])))
  # save_fold records a digest of FuseAnalysis.key, which keeps each bias's W
  # side (name, β, W, side, W's contracting dims, dtype): folds saved before
  # call_key existed load only while it does.
  an = fu.apply_fn.analysis_for((_x(*RANKS[1]),))
  assert [len(b) for b in an.key[3]] == [6] * len(an.biases) and an.key[3][0][3] == 1, an.key
  jaxfold.save_fold(fu, tmp_path / "f")
  back = jaxfold.load_fold(tmp_path / "f", w_left_reader)
  _same(w_left_reader, p, back, shapes=RANKS)
  r = jaxfold.rotate(back, _orth())
  _same(w_left_reader, p, r, shapes=RANKS)
  # A step made at another rank than the fold (defer_norms(fused, x), fuse_affine(folded, x)):
  # its biases are laid out for that rank, so load redoes it there (bug: load re-analysed at
  # the fold's example and gave outputs of the wrong shape, a reshape TypeError, or refused:
  # "re-analysing apply_fn does not reproduce the saved fuse_affine").
  folded = jaxfold.fold(p, w_left_reader, _x(*RANKS[2]))
  for k, m in enumerate([jaxfold.defer_norms(jaxfold.fuse_affine(folded), _x(*RANKS[0])),
                         jaxfold.rotate(jaxfold.defer_norms(jaxfold.fuse_affine(folded), _x(*RANKS[1])), _orth()),
                         jaxfold.fuse_affine(folded, _x(*RANKS[0]))]):
    jaxfold.save_fold(m, tmp_path / f"m{k}")
    _same(w_left_reader, p, jaxfold.load_fold(tmp_path / f"m{k}", w_left_reader), shapes=RANKS)


def test_call_key_differs_from_key_only_in_the_side():
  # (name, β, W, W side, dimension numbers, y rank, y dim, dtype, chain): W (d, k) on the
  # left of y (d,), then on the right of y (b, d); W's contracting dims are (0,) in both.
  left = affine.NewBias("w2", 1, 2, 0, (((0,), (0,)), ((), ())), 1, 0, "float64", ())
  right = affine.NewBias("w2", 1, 2, 1, (((1,), (0,)), ((), ())), 2, 1, "float64", ())
  a, b = (affine.FuseAnalysis(None, [], None, None, (), (), (), (e,), None) for e in (left, right))
  assert a.key != b.key and a.call_key == b.call_key and a.fuses_like(b) and a.defers_like(b)
  other_w = right._replace(leaf=3)
  other = affine.FuseAnalysis(None, [], None, None, (), (), (), (other_w,), None)
  assert other.call_key != b.call_key and not other.fuses_like(b)


# ----------------------------------------------------------------------------
# A campaign of model shapes through fold → fuse_affine → defer_norms → rotate.


def _attention(p, y, mask, merge):
  B, T, _ = y.shape
  q, k, v = (jnp.einsum("btd,dhe->bthe", y, p[w]) for w in ("wq", "wk", "wv"))
  s = jnp.einsum("bthe,bshe->bhts", q, k) / np.sqrt(D // H)
  causal = jnp.tril(jnp.ones((T, T), bool))
  if mask == "where":
    s = jnp.where(causal, s, -jnp.inf)
  elif mask == "add":
    s = s + jnp.where(causal, 0.0, -jnp.inf)
  o = jnp.einsum("bhts,bshe->bthe", jax.nn.softmax(s, -1), v)
  if merge == "einsum":
    return jnp.einsum("bthe,hed->btd", o, p["wo"]) + p["bo"]
  return o.reshape(B, T, D) @ p["wo2"] + p["bo"]


def heads_einsum_where_mask(p, x):
  h = _stem(p, x)
  h = h + _attention(p, _ln(h, p["g"], p["beta"]), "where", "einsum")
  h = h + _mlp(p, _ln(h, p["g3"], p["beta3"]))
  return _ln(h, p["g2"], p["beta2"]) @ p["w2"] + p["b2"]


def heads_reshape_add_mask(p, x):
  h = _stem(p, x)
  h = h + _attention(p, _ln(h, p["g"], p["beta"]), "add", "reshape")
  return _ln(h, p["g2"], p["beta2"]) @ p["w2"] + p["b2"]


def parallel_block(p, x):           # GPT-J / Phi: one norm feeds attention and MLP
  h = _stem(p, x)
  y = _ln(h, p["g"], p["beta"])
  h = h + _attention(p, y, "where", "einsum") + _mlp(p, y)
  return _ln(h, p["g2"], p["beta2"]) @ p["w2"] + p["b2"]


def _ids(x):
  return (jnp.abs(x[..., 0]) * 7).astype(jnp.int32) % V


def tied_lm(p, x):                  # the token table is also the LM head
  ids = _ids(x)
  h = p["emb"][ids] + p["pos"][:ids.shape[1]]
  h = h + _attention(p, _ln(h, p["g"], p["beta"]), "where", "einsum")
  return _ln(h, p["g2"], p["beta2"]) @ p["emb"].T


def rms_model(p, x):                # already RMSNorm: nothing to fold, all to fuse and rotate
  h = _stem(p, x)
  h = h + _attention(p, _rms(h, p["g"]), "add", "einsum")
  h = h + _mlp(p, _rms(h, p["g3"]))
  return _rms(h, p["g2"]) @ p["w2"]


def reader_transposed(p, x):        # the final norm read as (B, D, T) with W on the left
  h = _stem(p, x)
  h = h + _mlp(p, _ln(h, p["g"], p["beta"]))
  return jnp.einsum("dk,bdt->bkt", p["w2"], jnp.swapaxes(_ln(h, p["g2"], p["beta2"]), 1, 2))


def keyword_model(p, x, *, mask=None, train=False, scale=1.0):
  h = _stem(p, x) * scale
  h = h + _attention(p, _ln(h, p["g"], p["beta"]), "where", "einsum")
  if mask is not None:
    h = h * mask[..., None]
  if train:
    h = h + _mlp(p, _ln(h, p["g3"], p["beta3"]))
  return _ln(h, p["g2"], p["beta2"]) @ p["w2"] + p["b2"]


def post_ln_then_pre_ln(p, x):      # a post-LN block's output starts the pre-LN stream
  h = _ln(_stem(p, x) + _mlp(p, _stem(p, x)), p["g"], p["beta"])
  h = h + _attention(p, _ln(h, p["g3"], p["beta3"]), "where", "einsum")
  return _ln(h, p["g2"], p["beta2"]) @ p["w2"] + p["b2"]


def rms_then_ln(p, x):              # the LayerNorm's input reaches an RMSNorm's rsqrt first
  h = _stem(p, x)
  h = h + _mlp(p, _rms(h, p["g"]))
  return _ln(h, p["g2"], p["beta2"]) @ p["w2"] + p["b2"]


def reader_splits_heads(p, x):      # a reader contracts the normalized axis split into heads
  h = _stem(p, x)
  y = _ln(h, p["g"], p["beta"])
  h = h + _mlp(p, _ln(h, p["g3"], p["beta3"]))
  return (jnp.einsum("bthe,hek->btk", y.reshape(*y.shape[:2], H, D // H), p["wr"]),
          _ln(h, p["g2"], p["beta2"]) @ p["w2"])


KW = {"example_kwargs": {"train": True, "scale": 2.0}}
# (program, fold kwargs, call kwargs, refusal of a parameters-only rotation (insert=False) or None,
#  what rotate computes in the program instead: (x @ Q lines, y @ Qᵀ lines, norms not on the stream))
CAMPAIGN = [
    (heads_einsum_where_mask, {}, {}, None, (0, 0, 0)),
    (heads_reshape_add_mask, {}, {}, None, (0, 0, 0)),
    (parallel_block, {}, {}, None, (0, 0, 0)),
    (tied_lm, {"tied_weights": "copy"}, {}, None, (0, 0, 0)),
    # the tied table's aux-centered embedding starts the stream
    (tied_lm, {}, {}, "hint: the fold has 1 auxiliary centering", (1, 0, 0)),
    (rms_model, {}, {}, None, (0, 0, 0)),
    (reader_transposed, {}, {}, None, (0, 0, 0)),
    (keyword_model, KW, KW["example_kwargs"], None, (0, 0, 0)),
    # the stream starts at the post-LN block's output (its norm keeps γ: not on the stream)
    (post_ln_then_pre_ln, {}, {}, "hint: the fold has 1 auxiliary centering", (1, 0, 1)),
    # the unfolded LayerNorm reads the stream un-rotated (its mean does not commute with Q)
    (rms_then_ln, {}, {}, r"hint: the fold left 1 of 1 norm site\(s\) unfolded .*nonlinearity `rsqrt`", (0, 1, 1)),
    # the reader splitting heads reads the norm's output un-rotated
    (reader_splits_heads, {}, {}, r"hint: fuse_affine kept 1 norm\(s\) .*`reshape` reads it", (0, 1, 0)),
]


@pytest.mark.parametrize("fn, fold_kw, call_kw, refusal, inserted", CAMPAIGN,
                         ids=[f"{c[0].__name__}{'-' + '-'.join(c[1]) if c[1] else ''}" for c in CAMPAIGN])
def test_campaign(x64, tmp_path, fn, fold_kw, call_kw, refusal, inserted):
  p = named_params(**P)
  f = jaxfold.fold(p, fn, _x(*SHAPES[0]), **fold_kw)
  fu = jaxfold.fuse_affine(f)
  d = jaxfold.defer_norms(fu)
  for m in (f, fu, d):
    _same(fn, p, m, **call_kw)
  if refusal:
    with pytest.raises(jaxfold.RotateError, match=refusal):
      jaxfold.rotate(d, _orth(), insert=False)
  r = jaxfold.rotate(d, _orth())
  starts, ends, off = inserted
  lines = r.report.inserted
  assert sum(t.startswith("x @ Q") for t in lines) == starts, r.report
  assert sum(t.startswith("y @ Qᵀ") for t in lines) == ends, r.report
  assert r.report.norms == len(fu.report.sites) - off, (r.report, fu.report)
  _same(fn, p, r, **call_kw)
  if lines:   # (the program computes them: the same under jit, and after a save and load)
    _same(fn, p, types.SimpleNamespace(params=r.params, apply_fn=jax.jit(r.apply_fn)), **call_kw)
    jaxfold.save_fold(r, tmp_path / "r")
    back = jaxfold.load_fold(tmp_path / "r", fn)
    assert back.report.inserted == lines
    _same(fn, p, back, **call_kw)


@pytest.mark.slow      # (~20 s: flax init and eager applies)
def test_campaign_groupnorm_convnet_and_bf16(x64):
  import flax.linen as nn
  from helpers import randomize

  class ConvGN(nn.Module):     # GroupNorm over (H, W, C/G): not foldable, nothing to rotate
    @nn.compact
    def __call__(self, x):
      h = nn.GroupNorm(num_groups=2, param_dtype=jnp.float64)(nn.Conv(8, (3, 3), param_dtype=jnp.float64)(x))
      return nn.Conv(5, (1, 1), param_dtype=jnp.float64)(h)

  class Bf16(nn.Module):       # bf16 parameters, f32 compute: exact up to the bf16 roundings
    @nn.compact
    def __call__(self, x):
      kw = dict(param_dtype=jnp.bfloat16, dtype=jnp.float32)
      h = nn.Dense(16, **kw)(x)
      h = h + nn.Dense(16, **kw)(nn.gelu(nn.Dense(16, **kw)(nn.LayerNorm(**kw)(h))))
      return nn.Dense(3, **kw)(nn.LayerNorm(**kw)(h))

  for m, shapes, tol, refusal in [
      (ConvGN(), [(2, 6, 6, 3), (1, 5, 7, 3)], 1e-9, "(?s)no sum of squares .*hint: the fold left 1 of 1"),
      (Bf16(), [(2, 5, 4), (3, 7, 4)], 3e-2, None)]:
    p = randomize(m.init(jax.random.PRNGKey(0), _x(*shapes[0])), seed=3)
    f = jaxfold.fold(p, m.apply, _x(*shapes[0]))
    fu = jaxfold.fuse_affine(f)
    d = jaxfold.defer_norms(fu)
    models = [f, fu, d]
    if refusal:
      with pytest.raises(jaxfold.RotateError, match=refusal):
        jaxfold.rotate(d, _orth())
    else:
      assert fu.report.num_fused == 2, fu.report
      models.append(jaxfold.rotate(d, _orth(16)))
    ref = jax.jit(m.apply)
    for model in models:
      _same(ref, p, model, shapes=shapes, tol=tol)
