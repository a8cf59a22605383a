"""One fold for every input shape (issue 19, item 4).

Every zoo model is folded at batch 1 and at batch 2 and called at four other
shapes (batch, sequence length, image resolution where the model takes
another); the folded function must equal the original in float64. A size-1
axis in the example must not change which parameters are centered, and where
a shape truly needs other parameters the FoldError names both shapes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from dinov2_model import Dinov2Config, Dinov2Model

import jaxfold
import models
from models.vit import ViTConfig, ViTModel

# name -> (example size, four other (batch, size) call shapes). The size is the
# sequence length, the image side or None (the model's only resolution: ViT and
# CLIP learn one position per patch and do not interpolate).
TEXT = (8, [(4, 8), (1, 5), (3, 12), (2, 1)])
MATRIX = {
    "gpt2-tiny": TEXT, "gpt2-nnx-tiny": TEXT, "bert-tiny": TEXT, "opt-tiny": TEXT, "opt-350m-tiny": TEXT,
    "bloom-tiny": TEXT, "phi-tiny": TEXT, "gpt-j-tiny": TEXT,
    "vit-tiny": (None, [(3, None), (4, None), (5, None), (8, None)]),
    "clip-vit-tiny": (None, [(3, None), (4, None), (5, None), (8, None)]),
    "clip-vit-tiny-hidden": (None, [(3, None), (4, None), (5, None), (8, None)]),
    # Swin's relative-position tables fix its window grid: 32 and 64 px images.
    "swin-tiny-test": (32, [(3, 32), (1, 64), (2, 64), (4, 32)]),
    "cnn-gn": (16, [(3, 16), (1, 32), (2, 8), (4, 24)]),
    "cnn-gn-per-position": (16, [(3, 16), (1, 32), (2, 8), (4, 24)]),
    "mlp-small": (None, [(3, None), (4, None), (5, None), (8, None)]),
    "whisper-tiny-test": (16, [(4, 16), (1, 8), (3, 32), (2, 24)]),
    "wav2vec2-tiny-test": (8, [(4, 8), (1, 5), (3, 12), (2, 3)]),
    "wav2vec2-stable-tiny-test": (8, [(4, 8), (1, 5), (3, 12), (2, 3)]),
}
FAST = {("gpt2-nnx-tiny", 1)}   # the default run; the whole matrix is `slow` (~8 min on 2 cores)


def _spec64(name):
  spec = models.get(name)
  if hasattr(spec.config, "param_dtype"):  # nnx modules cast to their param dtype
    spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, param_dtype=jnp.float64))
  return spec


def _to64(tree):
  return jax.tree_util.tree_map(
      lambda x: jnp.asarray(x, jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _inputs(spec, batch, size, seed):
  xs = _to64(spec.example_inputs(batch, size))
  key = jax.random.key(seed)
  return tuple(jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
               if jnp.issubdtype(x.dtype, jnp.floating) else x for i, x in enumerate(xs))


@pytest.mark.parametrize("name,fold_batch", [
    pytest.param(n, b, marks=() if (n, b) in FAST else pytest.mark.slow) for n in MATRIX for b in (1, 2)])
def test_one_fold_serves_every_shape(x64, name, fold_batch):
  spec = _spec64(name)
  size, calls = MATRIX[name]
  params = _to64(models.random_params(spec, 1, size) if size is not None else models.random_params(spec, 1))
  fn = spec.apply_fn()
  folded = jaxfold.fold(params, fn, *_inputs(spec, fold_batch, size, 0))
  # (post-LN OPT-350m, per-sample GroupNorm and base Wav2Vec2 fold nothing, soundly)
  assert folded.report.num_folded >= 1 or name in ("opt-350m-tiny", "cnn-gn", "wav2vec2-tiny-test")
  # (jitted: eager evaluation compiles every operation once per shape)
  original, folded_fn = jax.jit(fn), jax.jit(folded.apply_fn)
  for k, (b, s) in enumerate([(fold_batch, size)] + calls):
    x = _inputs(spec, b, s, k + 1)
    assert rel_err(original(params, *x), folded_fn(folded.params, *x)) < 1e-9, (name, fold_batch, b, s)


def test_batch_one_and_two_center_the_same_parameters(x64):
  """A flax.nnx GPT with a tied head: at batch 1 the position table's shift
  used to look visible (the gather's size-1 batch label was dropped by the
  LN's reshape), so batch 1 and batch 2 centered different parameters and a
  call at another batch raised a TypeError."""
  spec = _spec64("gpt2-nnx-tiny")
  params = _to64(models.random_params(spec, 1, 8))
  fn = spec.apply_fn()
  keys = [jaxfold.fold(params, fn, *_inputs(spec, b, s, 0)).apply_fn._base.param_key
          for b, s in [(1, 8), (2, 8), (1, 1), (3, 5)]]
  assert all(k == keys[0] for k in keys)
  assert any(i for i, _ in keys[0][0])   # the position table is centered in place


def _ln(h, g, b):
  m = h.mean(-1, keepdims=True)
  return (h - m) / jnp.sqrt(((h - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


def _params(rng):
  return {"W": jnp.asarray(rng.normal(size=(4, 8))), "g": jnp.asarray(rng.normal(size=8)),
          "b": jnp.asarray(rng.normal(size=8)), "V": jnp.asarray(rng.normal(size=(8, 3)))}


def test_a_shape_that_needs_other_parameters_names_both_shapes(x64):
  # At batch 3 (only) the program also returns the sum of x @ W: centering W,
  # which the fold at batch 1 does, would change it.
  def f(p, x):
    h = x @ p["W"]
    y = _ln(h, p["g"], p["b"]) @ p["V"]
    return (y, h.sum(-1)) if x.shape[0] == 3 else (y, jnp.zeros(x.shape[0]))

  p = _params(np.random.default_rng(0))
  x1 = jnp.asarray(np.random.default_rng(1).normal(size=(1, 4)))
  folded = jaxfold.fold(p, f, x1)
  assert folded.report.num_folded == 1
  x5 = jnp.ones((5, 4))
  assert rel_err(f(p, x5), folded.apply_fn(folded.params, x5)) < 1e-12
  with pytest.raises(jaxfold.FoldError) as e:
    folded.apply_fn(folded.params, jnp.ones((3, 4)))
  msg = str(e.value)
  assert "(3, 4)" in msg and "(1, 4)" in msg and "['W'](1) in place" in msg


def test_example_plan_is_kept_when_generic_shapes_cannot_center(x64):
  # Generic shapes (here: any batch but 1) see h's sum; the example (batch 1)
  # does not. The fold keeps parameters that both prove: W stays uncentered,
  # and every batch, 1 included, computes the original.
  def f(p, x):
    h = x @ p["W"]
    y = _ln(h, p["g"], p["b"]) @ p["V"]
    return (y, jnp.zeros(1)) if x.shape[0] == 1 else (y, h.sum(-1))

  p = _params(np.random.default_rng(0))
  folded = jaxfold.fold(p, f, jnp.ones((1, 4)))
  assert folded.apply_fn._base.leaf_specs == ()
  for b in (1, 2, 7):
    x = jnp.asarray(np.random.default_rng(b).normal(size=(b, 4)))
    assert rel_err(f(p, x), folded.apply_fn(folded.params, x)) < 1e-12


def _counting(f):
  shapes = []

  def g(p, x):
    shapes.append(x.shape)
    return f(p, x)
  return g, shapes


def test_example_shapes_only_traces_once_and_refuses_clearly_elsewhere(x64):
  # The program above, folded for its example alone: one trace, W centered
  # (right at batch 1), and at batch 2 a FoldError that names the option.
  def f(p, x):
    h = x @ p["W"]
    y = _ln(h, p["g"], p["b"]) @ p["V"]
    return (y, jnp.zeros(1)) if x.shape[0] == 1 else (y, h.sum(-1))

  p = _params(np.random.default_rng(0))
  x1 = jnp.asarray(np.random.default_rng(1).normal(size=(1, 4)))
  g, shapes = _counting(f)
  folded = jaxfold.fold(p, g, x1, generic_shapes=False)
  assert shapes == [(1, 4)]
  assert [i for i, _ in folded.apply_fn._base.leaf_specs] == [1]   # W (leaves: V, W, b, g)
  assert rel_err(f(p, x1), folded.apply_fn(folded.params, x1)) < 1e-12
  with pytest.raises(jaxfold.FoldError, match="generic_shapes=False") as e:
    folded.apply_fn(folded.params, jnp.ones((2, 4)))
  assert "(2, 4)" in str(e.value) and "(1, 4)" in str(e.value)
  # The default traces the example and the probe, and serves both.
  g, shapes = _counting(f)
  folded = jaxfold.fold(p, g, x1)
  assert shapes[:2] == [(1, 4), (2, 4)]
  x2 = jnp.asarray(np.random.default_rng(2).normal(size=(2, 4)))
  assert rel_err(f(p, x2), folded.apply_fn(folded.params, x2)) < 1e-12


def test_example_shapes_only_survives_save_and_load(x64, tmp_path):
  # load_fold redoes the fold: with the default it would choose other
  # parameters for this program and refuse the saved ones as another program.
  def f(p, x):
    h = x @ p["W"]
    return _ln(h, p["g"], p["b"]) @ p["V"], (jnp.zeros(1) if x.shape[0] == 1 else h.sum(-1))

  p = _params(np.random.default_rng(0))
  x1 = jnp.asarray(np.random.default_rng(1).normal(size=(1, 4)))
  folded = jaxfold.fold(p, f, x1, generic_shapes=False)
  jaxfold.save_fold(folded, str(tmp_path / "f"))
  loaded = jaxfold.load_fold(str(tmp_path / "f"), f)
  assert loaded.apply_fn.options.generic_shapes is False
  assert rel_err(f(p, x1), loaded.apply_fn(loaded.params, x1)) < 1e-12
  with pytest.raises(jaxfold.FoldError, match="generic_shapes=False"):
    loaded.apply_fn(loaded.params, jnp.ones((2, 4)))


def test_example_shapes_only_through_defer_save_and_load(x64, tmp_path):
  """fold(generic_shapes=False, defer_norms=True) at batch 1: fused, deferred,
  saved and loaded, exact at the example and at other shapes (each proved)."""
  def f(p, x):
    h = x @ p["W"]
    return _ln(h, p["g"], p["b"]) @ p["V"]

  p = _params(np.random.default_rng(0))
  x1 = jnp.asarray(np.random.default_rng(1).normal(size=(1, 4)))
  de = jaxfold.fold(p, f, x1, generic_shapes=False, defer_norms=True)
  assert all(s.deferred for s in de.report.deferred)
  jaxfold.save_fold(de, str(tmp_path / "d"))
  loaded = jaxfold.load_fold(str(tmp_path / "d"), f)
  for got in (de, loaded):
    for k, shape in enumerate([(1, 4), (5, 4), (2, 3, 4)]):
      x = jnp.asarray(np.random.default_rng(k + 2).normal(size=shape))
      assert rel_err(f(p, x), jax.jit(got.apply_fn)(got.params, x)) < 1e-12, shape


@pytest.mark.parametrize("shape", [(1, 1), pytest.param((1, 8), marks=pytest.mark.slow),
                                   pytest.param((3, 5), marks=pytest.mark.slow)])
def test_example_shapes_only_agrees_with_the_default_on_a_model(x64, shape):
  """A model without size-dependent Python: the example alone proves the same
  parameters, and the fold serves other shapes."""
  spec = _spec64("gpt2-nnx-tiny")
  params = _to64(models.random_params(spec, 1, 8))
  fn = spec.apply_fn()
  x = _inputs(spec, *shape, 0)
  only = jaxfold.fold(params, fn, *x, generic_shapes=False)
  assert only.apply_fn._base.param_key == jaxfold.fold(params, fn, *x).apply_fn._base.param_key
  original, folded_fn = jax.jit(fn), jax.jit(only.apply_fn)
  for k, (b, s) in enumerate([shape, (4, 6), (2, 1)]):
    xs = _inputs(spec, b, s, k + 1)
    assert rel_err(original(params, *xs), folded_fn(only.params, *xs)) < 1e-9


def test_generic_shapes_must_be_a_bool():
  with pytest.raises(jaxfold.FoldError, match="generic_shapes must be True or False"):
    jaxfold.fold(_params(np.random.default_rng(0)), lambda p, x: x, jnp.ones((1, 4)), generic_shapes="yes")


@pytest.mark.parametrize("which", ["reshape", "broadcast"])
def test_rows_of_a_row_varying_shift_are_not_equal(x64, which):
  """Centering W over its columns shifts row r by its own mean c_r: W[0:1]
  and W[1:2] (size-1 rows, reshaped or broadcast alike) differ by c_0 − c_1,
  so W must not be centered in place (was a wrong fold)."""
  def f(p, x):
    y = _ln(x @ p["W"], p["g"], p["b"]) @ p["V"]
    if which == "reshape":
      z = p["W"][0:1].reshape(8) - p["W"][1:2].reshape(8)
    else:
      z = jnp.broadcast_to(p["W"][0:1], (3, 8)) - jnp.broadcast_to(p["W"][1:2], (3, 8))
    return y, z

  p = _params(np.random.default_rng(2))
  x = jnp.asarray(np.random.default_rng(3).normal(size=(5, 4)))
  folded = jaxfold.fold(p, f, x)
  assert rel_err(f(p, x), folded.apply_fn(folded.params, x)) < 1e-12


def _vit_interpolated(p, img, patch=4, d=16):
  """A ViT whose position embeddings are resized to the patch grid (bilinear, as
  HF ViT/DINOv2 do at another resolution), a class token and two pre-LN blocks."""
  def ln(h, g, b):
    m = h.mean(-1, keepdims=True)
    v = ((h - m) ** 2).mean(-1, keepdims=True)
    return (h - m) * jax.lax.rsqrt(v + 1e-6) * g + b

  b = img.shape[0]
  x = jax.lax.conv_general_dilated(img, p["patch"], (patch, patch), "VALID",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["pb"]
  gh, gw = x.shape[1], x.shape[2]
  x = (x + jax.image.resize(p["pos"], (gh, gw, d), "bilinear")).reshape(b, gh * gw, d)
  h = jnp.concatenate([jnp.broadcast_to(p["cls"], (b, 1, d)), x], 1)
  for i in range(2):
    y = ln(h, p[f"g{i}"], p[f"b{i}"])
    att = jax.nn.softmax((y @ p[f"q{i}"]) @ jnp.swapaxes(y @ p[f"k{i}"], 1, 2) / 4.0, -1)
    h = h + att @ (y @ p[f"u{i}"]) @ p[f"o{i}"]
    y = ln(h, p[f"e{i}"], p[f"f{i}"])
    h = h + jax.nn.gelu(y @ p[f"w{i}"] + p[f"c{i}"]) @ p[f"v{i}"] + p[f"d{i}"]
  return ln(h, p["gf"], p["bf"])[:, 0] @ p["head"]


@pytest.mark.slow
def test_vit_at_other_resolutions_with_interpolated_positions(x64):
  """Folded at 16×16 px, batch 1; called at other resolutions (the position table is
  resized to each patch grid) and batches: exact."""
  keys = iter(jax.random.split(jax.random.PRNGKey(3), 64))
  n = lambda *s: jax.random.normal(next(keys), s)
  d = 16
  p = {"patch": n(4, 4, 3, d), "pb": n(d), "pos": n(4, 4, d), "cls": n(1, 1, d), "gf": 1 + n(d),
       "bf": n(d), "head": n(d, 5)}
  for i in range(2):
    p.update({f"g{i}": 1 + n(d), f"b{i}": n(d), f"e{i}": 1 + n(d), f"f{i}": n(d), f"w{i}": n(d, 32),
              f"c{i}": n(32), f"v{i}": n(32, d), f"d{i}": n(d), f"q{i}": n(d, d), f"k{i}": n(d, d),
              f"u{i}": n(d, d), f"o{i}": n(d, d)})
  r = jaxfold.fold(p, _vit_interpolated, n(1, 16, 16, 3))
  assert all(s.folded for s in r.report.sites) and len(r.report.sites) == 5
  for shape in [(1, 16, 16, 3), (3, 24, 24, 3), (2, 32, 16, 3), (4, 8, 8, 3)]:
    x = n(*shape)
    assert rel_err(r.apply_fn(r.params, x), _vit_interpolated(p, x)) < 1e-9, shape


# ----------------------------------------------------------------------------
# Position tables interpolated to the patch grid (issue 38): Dinov2 reads its
# table directly at the pretraining grid and resizes it bicubically at any
# other, so the example's program and a later call's differ. The resize is a
# linear map along the grid: a shift constant along the channels stays one,
# and a table zero-sum along the channels stays so (whatever its rows sum
# to). One fold serves every resolution, each proved at its first call.

def _vision_params(params, seed: int):
  """Float64 parameters with non-uniform γ (scale, layer scale), β and biases
  with non-zero means, kernels and tables N(0, 0.3²)."""
  rng = np.random.default_rng(seed)

  def draw(path, x):
    if x.ndim <= 1:
      base = 1.0 if path[-1].key in ("scale", "lambda1") else 0.0
      return jnp.asarray(base + 0.5 * rng.standard_normal(x.shape) + rng.uniform(-1, 1))
    return jnp.asarray(0.3 * rng.standard_normal(x.shape))
  return jax.tree_util.tree_map_with_path(draw, params)


def _dinov2(**kw):
  m = Dinov2Model(Dinov2Config(**kw))
  return m.apply, lambda x: m.init(jax.random.key(0), x)


def _vit(**kw):
  m = ViTModel(ViTConfig(interpolate_pos_encoding=True, num_labels=3, **kw))
  nhwc = lambda p, x: m.apply(p, jnp.transpose(x, (0, 2, 3, 1)))   # NCHW pixels, as Dinov2's
  return nhwc, lambda x: m.init(jax.random.key(0), jnp.transpose(x, (0, 2, 3, 1)))


VISION = {"dinov2": _dinov2, "vit": _vit}
CONFIG32 = dict(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
CONFIG16 = dict(CONFIG32, image_size=16, patch_size=4)
SIDES = [16, 24, 32, 48, (24, 20)]


def resolution_matrix(model: str, config: dict, fold_batch: int, sides: list, batches=(1, 2),
                      dtype=jnp.float64) -> dict:
  """``{(batch, h, w): relative error}`` of the fold (at ``config``'s image
  size, batch ``fold_batch``) against the original, in ``dtype``; a refusal
  is recorded as its FoldError's text."""
  apply, init = VISION[model](**config)
  s = config["image_size"]
  rng = np.random.default_rng(7)
  pixels = lambda b, h, w: jnp.asarray(rng.normal(size=(b, 3, h, w)), dtype)
  x0 = pixels(fold_batch, s, s)
  params = jax.tree_util.tree_map(lambda a: a.astype(dtype), _vision_params(init(x0), 1))
  folded = jaxfold.fold(params, apply, x0)
  out = {"folded": f"{folded.report.num_folded}/{len(folded.report.sites)}"}
  original, fn = jax.jit(apply), jax.jit(folded.apply_fn)
  for side in sides:
    h, w = side if isinstance(side, tuple) else (side, side)
    for b in batches:
      x = pixels(b, h, w)
      try:
        out[(b, h, w)] = rel_err(original(params, x), fn(folded.params, x))
      except jaxfold.FoldError as e:
        out[(b, h, w)] = str(e)
  return out


def _assert_exact(matrix: dict):
  bad = {k: v for k, v in matrix.items() if k != "folded" and not (isinstance(v, float) and v < 1e-9)}
  assert not bad, bad


@pytest.mark.parametrize("model", ["dinov2", "vit"])
def test_interpolated_positions_one_fold_serves_other_resolutions(x64, model):
  """Folded at 32 px, batch 1: exact at 24 px (resized table), 32 px (the
  table read directly) and 24×20 (a non-square grid), batches 1 and 2."""
  m = resolution_matrix(model, CONFIG32, 1, [24, 32, (24, 20)])
  _assert_exact(m)
  assert m["folded"] == ("1/5" if model == "dinov2" else "5/5")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["dinov2", "vit"])
@pytest.mark.parametrize("fold_batch", [1, 2])
def test_interpolated_positions_resolution_matrix(x64, model, fold_batch):
  """The whole matrix: folded at 32 px (batch 1 or 2), called at 16, 24, 32,
  48 px and 24×20 at batches 1 and 2; and folded at 16 px, called at 24×20."""
  _assert_exact(resolution_matrix(model, CONFIG32, fold_batch, SIDES))
  _assert_exact(resolution_matrix(model, CONFIG16, fold_batch, [(24, 20), 8]))


def test_a_float32_interpolation_in_a_float64_model_is_refused_with_the_cast(x64):
  """HF's Flax Dinov2 interpolates in float32 (``.astype(jnp.float32)``) even
  in a float64 model: the centered table's float32 rounding is not the
  original's rounding shifted (~2e-8 at the outputs, measured), so the
  example's in-place centering fails at another resolution: refused, naming
  the cast. In a float32 model the same program is served."""
  hf = dict(CONFIG32, interpolate_in_float32=True)
  refused = resolution_matrix("dinov2", hf, 1, [24], batches=(1,))[(1, 24, 24)]
  assert isinstance(refused, str) and "need different folded parameters" in refused
  assert "position_embeddings[2]" in refused and "[float64 -> float32]" in refused
  assert "fold the float32 model" in refused
  m = resolution_matrix("dinov2", hf, 1, [24, (24, 20)], dtype=jnp.float32)
  assert all(isinstance(v, float) and v < 1e-5 for k, v in m.items() if k != "folded"), m
