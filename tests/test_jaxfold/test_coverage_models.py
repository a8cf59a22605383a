"""Own Flax-linen models whose embeddings use the structural primitives of
issue 10 (tile, concatenate, ...), folded exactly in float64.

* a CLIP-vision-like encoder: ``concat(tile(class_embedding), patch_conv(x)) +
  positions`` starts the residual stream, then ``pre_layrnorm``, pre-LN blocks
  and ``post_layernorm`` on the pooled class token. Centering the class
  embedding, the patch kernel's output columns and the position table folds
  ``pre_layrnorm``; the later norms fold (one auxiliary centering of
  ``pre_layrnorm``'s output) only when the un-normalized stream is not itself
  returned.

Checked with ``fold_checks.assert_sound`` (folded == original at two input
shapes, CBWC == original at unseen parameters and in its gradients, every
in-place centering invisible) with randomized γ/β/biases.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from fold_checks import assert_sound
from test_control_models import F64, D, PreLNLayer, _args, _random_like, _sound

PATCH = 2
CHANNELS = 3


class CLIPVisionLikeEncoder(nn.Module):
  layers: int = 2
  max_positions: int = 17

  @nn.compact
  def __call__(self, x):                      # x: (batch, height, width, channels)
    b = x.shape[0]
    patches = nn.Conv(D, (PATCH, PATCH), strides=(PATCH, PATCH), use_bias=False,
                      param_dtype=F64, name="patch_embedding")(x)
    patches = patches.reshape(b, -1, D)
    cls = self.param("class_embedding", nn.initializers.normal(1.0), (D,), F64)
    h = jnp.concatenate([jnp.tile(cls, (b, 1, 1)), patches], axis=1)
    pos = nn.Embed(self.max_positions, D, param_dtype=F64, name="position_embedding")
    h = h + pos(jnp.arange(h.shape[1]))[None]
    ln = functools.partial(nn.LayerNorm, epsilon=1e-5, param_dtype=F64)
    h = ln(name="pre_layrnorm")(h)
    for i in range(self.layers):
      h = PreLNLayer(name=f"layers_{i}")(h)
    return h, ln(name="post_layernorm")(h[:, 0])


ARGS = [(2, 4, 4, CHANNELS), (3, 8, 8, CHANNELS)]


def test_clip_vision_like_embeddings(x64):
  # tile(class_embedding) ++ patch_conv + positions: centering the three
  # parameters makes pre_layrnorm's input zero-mean, so it folds. The residual
  # stream then starts at pre_layrnorm's output γ ⊙ n + β, which is not
  # zero-mean for non-uniform γ. Like HF's FlaxCLIPVisionTransformer, the
  # model returns that un-normalized stream (last_hidden_state): any centering
  # of it, auxiliary or of a layer's output projection, changes output #0, so
  # no later norm may fold.
  res = _sound(CLIPVisionLikeEncoder(), _args(ARGS), expect_folded=1)
  sites = res.fold_report.sites
  assert sites[0].folded, res.fold_report
  for s in sites[1:]:
    assert "auxiliary centering of that value would change the result" in s.reason, s.reason
    assert "program output #0" in s.reason, s.reason


def _pooled(model):
  # (the image features CLIP's projection reads: only the pooled class token)
  return lambda params, x: model.apply(params, x)[1]


def test_clip_vision_like_encoder_all_norms(x64):
  # Returning only the pooled output, one auxiliary centering of
  # pre_layrnorm's output makes the stream zero-mean: pre_layrnorm, 2 layers x
  # 2 norms and post_layernorm all fold (5 reductions removed for 1 added).
  model = CLIPVisionLikeEncoder()
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), *_args(ARGS)[0])
  res = assert_sound(_pooled(model), lambda seed: _random_like(shapes, seed), _args(ARGS),
                     expect_folded=6)
  assert len(res.fold_report.auxiliary) == 1, res.fold_report


