"""keras-hub backbones at tiny configs, with the number of LayerNorm sites a sound fold
can remove (worked out from each architecture, not from a fold):

* pre-LN (GPT-2, OPT, GPT-NeoX, Falcon, ESM-2, ViT, DeiT): every LN; the residual
  stream is a sum of linear outputs, so centering its producers makes each LN input
  zero-mean. GPT-NeoX's parallel residual has a block's two LNs read the same tensor:
  jaxfold counts them as one site (both lose their mean reductions).
* post-LN (BERT, RoBERTa, DistilBERT, ELECTRA, ALBERT): only the embedding LN; every
  later LN reads the previous LN's output, γ ⊙ n + β, not zero-mean for a non-uniform γ.
  BART: its encoder's and decoder's embedding LNs (one shared token table).
* a stream that starts at an LN output (Bloom's and ESM's embedding LN, CLIP-vision's
  pre-LN) or at a nonlinearity (Whisper's GELU conv stem): every LN, with one auxiliary
  centering of that output.

``build(name, dtype)`` returns ``(model, inputs(batch, seq))``; keras must be imported
with the JAX backend first (the test module does that).
"""

import keras_hub
import numpy as np
from keras_util import random_init

L, H, D, F, V, S = 2, 2, 8, 16, 37, 16   # layers, heads, width, MLP width, vocabulary, max length
IMG, PATCH = 8, 4


def _text(batch, seq, segments=False, seed=0):
  r = np.random.default_rng(seed)
  x = {"token_ids": r.integers(1, V, (batch, seq)).astype("int32"),
       "padding_mask": np.ones((batch, seq), "int32")}
  x["padding_mask"][0, -1] = 0     # one padded position: the mask path is traced too
  if segments:
    x["segment_ids"] = r.integers(0, 2, (batch, seq)).astype("int32")
  return x


def _ids(batch, seq, seed=0):
  return {"token_ids": _text(batch, seq, seed=seed)["token_ids"]}


def _image(batch, seed=0):
  return np.random.default_rng(seed).normal(size=(batch, IMG, IMG, 3)).astype("float32")


def _audio(batch, seq, seed=0):
  r = np.random.default_rng(seed)
  return {"encoder_features": r.normal(size=(batch, 2 * seq, 4)).astype("float32"),
          "decoder_token_ids": r.integers(1, V, (batch, seq)).astype("int32"),
          "decoder_padding_mask": np.ones((batch, seq), "int32")}


def _seq2seq(batch, seq, seed=0):
  r = np.random.default_rng(seed)
  return {"encoder_token_ids": r.integers(1, V, (batch, seq)).astype("int32"),
          "encoder_padding_mask": np.ones((batch, seq), "int32"),
          "decoder_token_ids": r.integers(1, V, (batch, seq)).astype("int32"),
          "decoder_padding_mask": np.ones((batch, seq), "int32")}


def _clip_inputs(batch, seq, seed=0):
  r = np.random.default_rng(seed)
  return {"images": _image(batch, seed), "token_ids": r.integers(1, V, (batch, seq)).astype("int32")}


def _clip(dtype):
  vis = keras_hub.models.CLIPVisionEncoder(patch_size=PATCH, hidden_dim=D, num_layers=L, num_heads=H,
                                           intermediate_dim=F, image_shape=(IMG, IMG, 3), dtype=dtype)
  txt = keras_hub.models.CLIPTextEncoder(vocabulary_size=V, embedding_dim=D, hidden_dim=D, num_layers=L,
                                         num_heads=H, intermediate_dim=F, max_sequence_length=S, dtype=dtype)
  return keras_hub.models.CLIPBackbone(vis, txt, projection_dim=D, dtype=dtype)


_lm = dict(vocabulary_size=V, num_layers=L, num_heads=H, hidden_dim=D, intermediate_dim=F)
_vit = dict(image_shape=(IMG, IMG, 3), patch_size=PATCH, num_layers=L, num_heads=H, hidden_dim=D)

# name: (constructor(dtype), inputs(batch, seq), LN sites, sound count, auxiliary centerings, reason)
BACKBONES = {
  "gpt2": (lambda dt: keras_hub.models.GPT2Backbone(**_lm, max_sequence_length=S, dtype=dt), _text,
           2 * L + 1, 2 * L + 1, 0, "pre-LN"),
  "opt": (lambda dt: keras_hub.models.OPTBackbone(**_lm, max_sequence_length=S, dtype=dt), _text,
          2 * L + 1, 2 * L + 1, 0, "pre-LN"),
  "gpt_neox": (lambda dt: keras_hub.models.GPTNeoXBackbone(**_lm, rotary_percentage=0.5,
                                                                            max_sequence_length=S, dtype=dt), _text,
               L + 1, L + 1, 0, "pre-LN, parallel residual: a block's two LNs normalize the same tensor (one site)"),
  "falcon": (lambda dt: keras_hub.models.FalconBackbone(vocabulary_size=V, num_layers=L, num_attention_heads=H,
                                                       hidden_dim=D, intermediate_dim=F, dtype=dt), _text,
             2 * L + 1, 2 * L + 1, 0, "pre-LN"),
  "bloom": (lambda dt: keras_hub.models.BloomBackbone(**_lm, dtype=dt), _text,
            2 * L + 2, 2 * L + 2, 1, "stream starts at the embedding LN's output"),
  "bert": (lambda dt: keras_hub.models.BertBackbone(**_lm, max_sequence_length=S, dtype=dt),
           lambda b, s: _text(b, s, segments=True), 2 * L + 1, 1, 0, "post-LN"),
  "roberta": (lambda dt: keras_hub.models.RobertaBackbone(**_lm, max_sequence_length=S, dtype=dt), _text,
              2 * L + 1, 1, 0, "post-LN"),
  "distil_bert": (lambda dt: keras_hub.models.DistilBertBackbone(**_lm, max_sequence_length=S, dtype=dt),
                  _text, 2 * L + 1, 1, 0, "post-LN"),
  "electra": (lambda dt: keras_hub.models.ElectraBackbone(vocab_size=V, num_layers=L, num_heads=H, hidden_dim=D,
                                                         embedding_dim=D // 2, intermediate_dim=F,
                                                         max_sequence_length=S, dtype=dt),
              lambda b, s: _text(b, s, segments=True), 2 * L + 1, 1, 0, "post-LN"),
  "albert": (lambda dt: keras_hub.models.AlbertBackbone(vocabulary_size=V, num_layers=L, num_heads=H,
                                                       embedding_dim=D // 2, hidden_dim=D, intermediate_dim=F,
                                                       max_sequence_length=S, dtype=dt),
             lambda b, s: _text(b, s, segments=True), 2 * L + 1, 1, 0, "post-LN"),
  "esm": (lambda dt: keras_hub.models.ESMBackbone(**_lm, max_sequence_length=S, dtype=dt), _ids,
          2 * L + 1, 2 * L + 1, 0, "pre-LN blocks (ESM-2)"),
  "esm_emb_ln": (lambda dt: keras_hub.models.ESMBackbone(**_lm, max_sequence_length=S, use_pre_layer_norm=True,
                                                         dtype=dt), _ids,
                 2 * L + 2, 2 * L + 2, 1, "pre-LN; the stream starts at the embedding LN's output"),
  "bart": (lambda dt: keras_hub.models.BartBackbone(**_lm, max_sequence_length=S, dtype=dt), _seq2seq,
           2 + 2 * L + 3 * L, 2, 0, "post-LN encoder and decoder: their embedding LNs"),
  "vit": (lambda dt: keras_hub.models.ViTBackbone(**_vit, mlp_dim=F, dtype=dt), lambda b, s: _image(b),
          2 * L + 1, 2 * L + 1, 0, "pre-LN"),
  "deit": (lambda dt: keras_hub.models.DeiTBackbone(**_vit, intermediate_dim=F, dtype=dt),
           lambda b, s: _image(b), 2 * L + 1, 2 * L + 1, 0, "pre-LN"),
  "whisper": (lambda dt: keras_hub.models.WhisperBackbone(**_lm, num_mels=4, max_encoder_sequence_length=2 * S,
                                                          max_decoder_sequence_length=S, dtype=dt), _audio,
              (2 * L + 1) + (3 * L + 1), (2 * L + 1) + (3 * L + 1), 1,
              "pre-LN; the encoder stream starts at a GELU output (conv stem)"),
  "clip": (_clip, _clip_inputs, (2 * L + 2) + (2 * L + 1), (2 * L + 2) + (2 * L + 1), 1,
           "pre-LN; the vision stream starts at its pre-LN's output"),
}


def build(name, dtype="float32", seed=0):
  """``(model, inputs)``: the backbone with random variables, ``inputs(batch, seq)`` its inputs."""
  make, inputs = BACKBONES[name][:2]
  with random_init(seed):
    return make(dtype), inputs

