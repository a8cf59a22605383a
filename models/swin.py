"""Swin Transformer in Flax linen, with Hugging Face ``SwinModel`` parameter names.

Parameter paths mirror ``SwinForImageClassification``: ``swin.embeddings.patch_embeddings.
projection``, ``swin.embeddings.norm``, ``swin.encoder.layers.N.blocks.M.{layernorm_before,
attention.self.{query,key,value,relative_position_bias_table}, attention.output.dense,
layernorm_after, intermediate.dense, output.dense}``, ``swin.encoder.layers.N.downsample.
{norm, reduction}``, ``swin.layernorm`` and ``classifier``.

Which LayerNorms fold (see tests/models/test_swin.py for the full argument):

* ``embeddings.norm`` reads the patch conv only: foldable.
* The stream of stage k starts at an LN output (k = 0, ``embeddings.norm``) or at the bias-free
  ``reduction`` Linear (k > 0, centerable). Blocks add centerable dense outputs.
* A stream that feeds a patch merging is NOT centerable: merging concatenates 4 neighbouring
  positions along channels, so a per-position shift (constant along C only) becomes
  piecewise-constant along 4C, which the merging LN does not ignore. Hence every stage but the
  last keeps its LayerNorms, with or without auxiliary centering.
* The last stage's stream (from ``reduction``) reaches only per-position LNs: foldable.

Example:
    >>> import jax
    >>> spec = CONFIGS["swin-tiny-test"]
    >>> params = spec.init(jax.random.key(0))
    >>> (x,) = spec.example_inputs(2)
    >>> spec.apply_fn()(params, x).shape
    (2, 10)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.vit import ImageModelSpec

__all__ = ["SwinConfig", "SwinForImageClassification", "CONFIGS"]

_INIT = nn.initializers.truncated_normal(0.02)


@dataclasses.dataclass(frozen=True)
class SwinConfig:
  """Hyper-parameters of a Swin classifier (names follow HF ``SwinConfig``)."""

  image_size: int = 224
  patch_size: int = 4
  num_channels: int = 3
  embed_dim: int = 96
  depths: tuple[int, ...] = (2, 2, 6, 2)
  num_heads: tuple[int, ...] = (3, 6, 12, 24)
  window_size: int = 7
  mlp_ratio: float = 4.0
  num_labels: int = 1000
  layer_norm_eps: float = 1e-5

  @property
  def num_features(self) -> int:
    return self.embed_dim * 2 ** (len(self.depths) - 1)


# ---------------------------------------------------------------- window helpers (static)


def window_partition(x: jax.Array | np.ndarray, w: int) -> jax.Array | np.ndarray:
  """(B, H, W, C) -> (B * H/w * W/w, w*w, C); works on numpy and jax arrays alike."""
  b, h, wd, c = x.shape
  x = x.reshape(b, h // w, w, wd // w, w, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(-1, w * w, c)


def window_reverse(windows: jax.Array, w: int, h: int, wd: int) -> jax.Array:
  """Inverse of :func:`window_partition`."""
  c = windows.shape[-1]
  x = windows.reshape(-1, h // w, wd // w, w, w, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(-1, h, wd, c)


def relative_position_index(w: int) -> np.ndarray:
  """(w*w, w*w) index into the ((2w-1)^2, heads) bias table, as in HF/Microsoft Swin."""
  coords = np.stack(np.meshgrid(np.arange(w), np.arange(w), indexing="ij")).reshape(2, -1)
  rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + (w - 1)
  return rel[..., 0] * (2 * w - 1) + rel[..., 1]


def shifted_window_mask(h: int, wd: int, w: int, shift: int) -> np.ndarray | None:
  """(num_windows, w*w, w*w) additive mask (0 / -100) hiding pixels rolled in from afar."""
  if shift == 0:
    return None
  img = np.zeros((1, h, wd, 1), np.float32)
  spans = (slice(0, -w), slice(-w, -shift), slice(-shift, None))
  for region, (hs, ws) in enumerate((hs, ws) for hs in spans for ws in spans):
    img[:, hs, ws, :] = region
  win = window_partition(img, w)[..., 0]  # numpy in, numpy out: stays static under jit
  return np.where(win[:, :, None] != win[:, None, :], -100.0, 0.0).astype(np.float32)


def effective_window(resolution: int, window: int, shift: int) -> tuple[int, int]:
  """HF rule: a window as large as the feature map covers it whole and is not shifted."""
  return (resolution, 0) if resolution <= window else (window, shift)


# ---------------------------------------------------------------- modules


class SwinPatchEmbeddings(nn.Module):
  config: SwinConfig

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    p = self.config.patch_size
    return nn.Conv(self.config.embed_dim, (p, p), strides=(p, p), padding="VALID",
                   kernel_init=_INIT, name="projection")(pixels)


class SwinEmbeddings(nn.Module):
  """Patch conv then LayerNorm; returns (B, H', W', C)."""

  config: SwinConfig

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    x = SwinPatchEmbeddings(self.config, name="patch_embeddings")(pixels)
    return nn.LayerNorm(self.config.layer_norm_eps, name="norm")(x)


class SwinSelfAttention(nn.Module):
  """Window attention with a learned relative position bias; input (windows, w*w, C)."""

  dim: int
  heads: int
  window: int

  @nn.compact
  def __call__(self, x: jax.Array, mask: np.ndarray | None) -> jax.Array:
    hd = self.dim // self.heads
    table = self.param("relative_position_bias_table", _INIT,
                       ((2 * self.window - 1) ** 2, self.heads))
    split = lambda t: t.reshape(t.shape[:-1] + (self.heads, hd))
    q, k, v = (split(nn.Dense(self.dim, kernel_init=_INIT, name=n)(x)) for n in ("query", "key", "value"))
    logits = jnp.einsum("nqhd,nkhd->nhqk", q, k) / jnp.sqrt(hd).astype(x.dtype)
    bias = table[relative_position_index(self.window)].transpose(2, 0, 1)  # (heads, w², w²)
    logits = logits + bias[None]
    if mask is not None:
      nw = mask.shape[0]
      logits = logits.reshape(-1, nw, *logits.shape[1:]) + jnp.asarray(mask)[None, :, None]
      logits = logits.reshape(-1, *logits.shape[2:])
    out = jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(logits, axis=-1), v)
    return out.reshape(out.shape[:-2] + (self.dim,))


class _Dense(nn.Module):
  """A module holding a single Dense named ``dense`` (HF's ``*.output.dense`` nesting)."""

  features: int
  gelu: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y = nn.Dense(self.features, kernel_init=_INIT, name="dense")(x)
    return nn.gelu(y, approximate=False) if self.gelu else y


class SwinAttention(nn.Module):
  dim: int
  heads: int
  window: int

  @nn.compact
  def __call__(self, x: jax.Array, mask: np.ndarray | None) -> jax.Array:
    y = SwinSelfAttention(self.dim, self.heads, self.window, name="self")(x, mask)
    return _Dense(self.dim, name="output")(y)


class SwinLayer(nn.Module):
  """Pre-LN (shifted-)window block on a (B, H, W, C) map."""

  config: SwinConfig
  dim: int
  heads: int
  shift: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    b, h, wd, c = x.shape
    w, shift = effective_window(min(h, wd), cfg.window_size, self.shift)
    y = nn.LayerNorm(cfg.layer_norm_eps, name="layernorm_before")(x)
    if shift:
      y = jnp.roll(y, (-shift, -shift), axis=(1, 2))
    y = SwinAttention(self.dim, self.heads, w, name="attention")(
        window_partition(y, w), shifted_window_mask(h, wd, w, shift))
    y = window_reverse(y, w, h, wd)
    if shift:
      y = jnp.roll(y, (shift, shift), axis=(1, 2))
    x = x + y
    y = nn.LayerNorm(cfg.layer_norm_eps, name="layernorm_after")(x)
    y = _Dense(int(self.dim * cfg.mlp_ratio), gelu=True, name="intermediate")(y)
    return x + _Dense(self.dim, name="output")(y)


class SwinPatchMerging(nn.Module):
  """Concatenate each 2x2 neighbourhood along channels (4C), LayerNorm, bias-free 4C -> 2C."""

  config: SwinConfig
  dim: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    # HF order: (0,0), (1,0), (0,1), (1,1) in (row, col) offsets.
    parts = [x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]]
    x = nn.LayerNorm(self.config.layer_norm_eps, name="norm")(jnp.concatenate(parts, axis=-1))
    return nn.Dense(2 * self.dim, use_bias=False, kernel_init=_INIT, name="reduction")(x)


class _Blocks(nn.Module):
  config: SwinConfig
  dim: int
  depth: int
  heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i in range(self.depth):
      shift = 0 if i % 2 == 0 else self.config.window_size // 2
      x = SwinLayer(self.config, self.dim, self.heads, shift, name=str(i))(x)
    return x


class SwinStage(nn.Module):
  config: SwinConfig
  index: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg, i = self.config, self.index
    dim = cfg.embed_dim * 2 ** i
    x = _Blocks(cfg, dim, cfg.depths[i], cfg.num_heads[i], name="blocks")(x)
    if i + 1 < len(cfg.depths):
      x = SwinPatchMerging(cfg, dim, name="downsample")(x)
    return x


class _Stages(nn.Module):
  config: SwinConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i in range(len(self.config.depths)):
      x = SwinStage(self.config, i, name=str(i))(x)
    return x


class SwinEncoder(nn.Module):
  config: SwinConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return _Stages(self.config, name="layers")(x)


class SwinModel(nn.Module):
  """Backbone: returns the final-LayerNorm feature map flattened to (B, H*W, C_last)."""

  config: SwinConfig

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    x = SwinEncoder(self.config, name="encoder")(SwinEmbeddings(self.config, name="embeddings")(pixels))
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    return nn.LayerNorm(self.config.layer_norm_eps, name="layernorm")(x)


class SwinForImageClassification(nn.Module):
  """Swin backbone, average pool over positions, linear classifier. NHWC in, logits out."""

  config: SwinConfig

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    seq = SwinModel(self.config, name="swin")(pixels)
    return nn.Dense(self.config.num_labels, kernel_init=_INIT, name="classifier")(seq.mean(axis=1))


def _spec(name: str, **kw: Any) -> ImageModelSpec:
  return ImageModelSpec(name=name, family="swin", config=SwinConfig(**kw), build=SwinForImageClassification)


CONFIGS: dict[str, ImageModelSpec] = {
    "swin-t": _spec("swin-t"),
  # 32px / patch 4 -> 8x8 map, window 4: stage 0 exercises shifted windows + mask,
  # stage 1 (4x4, one block) the "window covers the map" rule; one patch merging between.
    "swin-tiny-test": _spec("swin-tiny-test", image_size=32, embed_dim=16, depths=(2, 1),
                            num_heads=(2, 4), window_size=4, num_labels=10),
}
