"""VMamba (v2 structure) in Flax linen, channels-last, with the official repository's names.

Structure (``VSSM`` of github.com/MzeroMiko/VMamba, ``classification/models/vmamba.py``, in
its default configuration: ``patchembed v2``, ``forward_type v2`` (gated), ``mlp_ratio 4``,
depths (2, 2, 9, 2); downsampling as in the released v2 models, ``downsample v3``: the default
``v2`` uses a 2x2/2 conv instead, a contraction over the channels all the same):

* ``patch_embed``: conv 3x3/2 -> LayerNorm ``norm1`` -> GELU -> conv 3x3/2 -> LayerNorm ``norm2``.
* ``layers.N.blocks.M`` (VSS blocks): ``x + SS2D(norm(x))`` then ``x + MLP(norm2(x))``.
  SS2D: ``in_proj`` (no bias) splits into ``x`` and a gate ``z``; ``x`` -> depthwise conv 3x3 ->
  SiLU -> 4-direction cross-scan (row-major, column-major, both reversed) -> per direction the
  selective scan S6 (input-dependent Δ, B, C from ``x_proj_weight``/``dt_projs_*``;
  ``A = -exp(A_logs)``; ``D`` skip) -> cross-merge (sum of the 4 directions back in row-major
  order) -> LayerNorm ``out_norm`` -> ``* SiLU(z)`` -> ``out_proj`` (no bias).
* ``layers.N.downsample`` (between stages): conv 3x3/2 -> LayerNorm ``norm`` (``downsample v3``).
* ``classifier``: LayerNorm ``norm`` -> mean over positions -> Dense ``head``.

LayerNorm count: 2 (stem) + 3·sum(depths) (``norm``, ``out_norm``, ``norm2`` per block) +
(stages - 1) (downsampling) + 1 (head). The repository's default depths (2, 2, 9, 2) give
2 + 45 + 3 + 1 = 51, the paper's count; its released VMamba-T v2 checkpoints use (2, 2, 5, 2)
(``s2l5``: 39 LayerNorms) or (2, 2, 8, 2) (``s1l8``: 48), with the ungated ``v05_noz`` SS2D.
The count does not depend on widths.

Which LayerNorms fold exactly, and why the others do not (tests/test_models/test_vmamba.py
checks it; benchmarks/results/vmamba.md has the report's reasons):

* The stem's two LNs and every downsampling LN read a convolution whose only consumer they
  are: centering its output channels shifts each position by a constant along C, which the
  LN ignores. They fold.
* A stage's residual stream starts at an LN output (γ⊙n + β is not zero-mean) and, except in
  the last stage, feeds the next stage's downsampling conv, a contraction over the channels:
  any shift of the stream (centering the blocks' ``out_proj``/``fc2``, or an auxiliary
  centering of the stream) changes that conv's output. So no block LN of stages 0..S-2 folds.
* The last stage's stream reaches only per-position LNs (its blocks' and the head's): with one
  auxiliary centering of the last downsampling LN's output (the paper's practical extension),
  its 2·depth block LNs and the head LN fold.
* ``out_norm`` reads the selective scan's output, a nonlinear function of its input (Δ, B, C
  depend on it): nothing upstream can be centered. It never folds.

Example:
    >>> import jax
    >>> spec = CONFIGS["vmamba-tiny"]
    >>> params = spec.init(jax.random.key(0))
    >>> (x,) = spec.example_inputs(2)
    >>> spec.apply_fn()(params, x).shape
    (2, 10)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.vit import ImageModelSpec

__all__ = ["VMambaConfig", "VMamba", "selective_scan", "cross_scan", "cross_merge", "num_layer_norms",
           "CONFIGS"]

_INIT = nn.initializers.truncated_normal(0.02)
_K = 4  # scan directions


@dataclasses.dataclass(frozen=True)
class VMambaConfig:
  """Hyper-parameters of a VMamba classifier (names follow the official ``VSSM``)."""

  image_size: int = 224
  num_channels: int = 3
  embed_dim: int = 96            # stage widths embed_dim · 2^i
  depths: tuple[int, ...] = (2, 2, 9, 2)
  d_state: int = 16
  ssm_ratio: float = 2.0         # d_inner = ssm_ratio · width
  dt_rank: int | None = None     # None: ceil(width / 16) ("auto")
  d_conv: int = 3
  conv_bias: bool = True
  mlp_ratio: float = 4.0
  num_labels: int = 1000
  layer_norm_eps: float = 1e-5   # torch.nn.LayerNorm's default

  @property
  def dims(self) -> tuple[int, ...]:
    return tuple(self.embed_dim * 2 ** i for i in range(len(self.depths)))


def num_layer_norms(config: VMambaConfig) -> int:
  """LayerNorms in the model: stem 2, three per VSS block, one per downsampling, the head's."""
  return 2 + 3 * sum(config.depths) + (len(config.depths) - 1) + 1


# ---------------------------------------------------------------- selective scan (S6)


def selective_scan(u: jax.Array, delta: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array,
                   D: jax.Array) -> jax.Array:
  """The S6 recurrence along the last axis, with ``lax.scan``.

  ``h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t u_t) B_t`` and ``y_t = C_t · h_t + D u_t``, per batch,
  direction k and channel d, with a state of size n.

  Args:
    u, delta: (b, k, d, l) input and (already softplus-ed) step sizes.
    A: (k, d, n), negative. B, C: (b, k, n, l). D: (k, d).

  Returns:
    y: (b, k, d, l).
  """
  b, k, d, _ = u.shape
  n = A.shape[-1]

  def step(h, inputs):
    u_t, dt_t, b_t, c_t = inputs  # (b,k,d), (b,k,d), (b,k,n), (b,k,n)
    h = jnp.exp(dt_t[..., None] * A) * h + (dt_t * u_t)[..., None] * b_t[:, :, None, :]
    return h, jnp.einsum("bkdn,bkn->bkd", h, c_t)

  time_major = lambda t: jnp.moveaxis(t, -1, 0)
  h0 = jnp.zeros((b, k, d, n), jnp.result_type(u, delta, A, B))
  _, ys = jax.lax.scan(step, h0, (time_major(u), time_major(delta), time_major(B), time_major(C)))
  return jnp.moveaxis(ys, 0, -1) + D[..., None] * u


def cross_scan(x: jax.Array) -> jax.Array:
  """(b, h, w, d) -> (b, 4, d, h·w): row-major, column-major, and both reversed."""
  b, h, w, d = x.shape
  rows = x.reshape(b, h * w, d).transpose(0, 2, 1)
  cols = x.transpose(0, 2, 1, 3).reshape(b, w * h, d).transpose(0, 2, 1)
  return jnp.stack([rows, cols, rows[..., ::-1], cols[..., ::-1]], axis=1)


def cross_merge(ys: jax.Array, h: int, w: int) -> jax.Array:
  """Inverse reading of :func:`cross_scan`, summed: (b, 4, d, h·w) -> (b, h, w, d)."""
  b, _, d, _ = ys.shape
  rows = ys[:, 0] + ys[:, 2, :, ::-1]
  cols = ys[:, 1] + ys[:, 3, :, ::-1]
  cols = cols.reshape(b, d, w, h).transpose(0, 1, 3, 2).reshape(b, d, h * w)
  return (rows + cols).transpose(0, 2, 1).reshape(b, h, w, d)


# ---------------------------------------------------------------- initializers (mamba_init)


def _a_log_init(d_state: int):
  def init(key, shape, dtype=jnp.float32):
    del key
    return jnp.broadcast_to(jnp.log(jnp.arange(1, d_state + 1, dtype=dtype)), shape)
  return init


def _symmetric_uniform(scale: float):
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -scale, scale)
  return init


def _dt_bias_init(dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4):
  """Inverse softplus of dt drawn log-uniformly in [dt_min, dt_max] (as ``mamba_init.dt_init``)."""
  def init(key, shape, dtype=jnp.float32):
    dt = jnp.exp(jax.random.uniform(key, shape, dtype) * (math.log(dt_max) - math.log(dt_min))
                 + math.log(dt_min))
    dt = jnp.maximum(dt, floor)
    return dt + jnp.log(-jnp.expm1(-dt))
  return init


# ---------------------------------------------------------------- modules


def _layer_norm(cfg: VMambaConfig, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(cfg.layer_norm_eps, name=name)


def _conv3x3s2(features: int, name: str) -> nn.Conv:
  return nn.Conv(features, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)), kernel_init=_INIT, name=name)


class SS2D(nn.Module):
  """2-D selective scan on a (b, h, w, width) map (``forward_type v2``: gated, LN ``out_norm``)."""

  config: VMambaConfig
  width: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    d_inner = int(cfg.ssm_ratio * self.width)
    rank = cfg.dt_rank or math.ceil(self.width / 16)
    n = cfg.d_state
    xz = nn.Dense(2 * d_inner, use_bias=False, kernel_init=_INIT, name="in_proj")(x)
    x, z = jnp.split(xz, 2, axis=-1)
    x = nn.Conv(d_inner, (cfg.d_conv, cfg.d_conv), padding="SAME", feature_group_count=d_inner,
                use_bias=cfg.conv_bias, name="conv2d")(x)
    x = nn.silu(x)
    b, h, w, _ = x.shape

    x_proj = self.param("x_proj_weight", _INIT, (_K, rank + 2 * n, d_inner))
    dt_w = self.param("dt_projs_weight", _symmetric_uniform(rank ** -0.5), (_K, d_inner, rank))
    dt_b = self.param("dt_projs_bias", _dt_bias_init(), (_K, d_inner))
    a_logs = self.param("A_logs", _a_log_init(n), (_K * d_inner, n))
    ds = self.param("Ds", lambda _, shape: jnp.ones(shape, jnp.float32), (_K * d_inner,))

    xs = cross_scan(x)                                          # (b, k, d, l)
    x_dbl = jnp.einsum("bkdl,kcd->bkcl", xs, x_proj)
    dts, bs, cs = jnp.split(x_dbl, [rank, rank + n], axis=2)
    dts = jnp.einsum("bkrl,kdr->bkdl", dts, dt_w)
    delta = jax.nn.softplus(dts + dt_b[..., None])
    A = -jnp.exp(a_logs).reshape(_K, d_inner, n)
    ys = selective_scan(xs, delta, A, bs, cs, ds.reshape(_K, d_inner))
    y = _layer_norm(cfg, "out_norm")(cross_merge(ys, h, w))
    y = y * nn.silu(z)
    return nn.Dense(self.width, use_bias=False, kernel_init=_INIT, name="out_proj")(y)


class Mlp(nn.Module):
  hidden: int
  width: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.gelu(nn.Dense(self.hidden, kernel_init=_INIT, name="fc1")(x), approximate=False)
    return nn.Dense(self.width, kernel_init=_INIT, name="fc2")(x)


class VSSBlock(nn.Module):
  """Pre-LN block: ``x + SS2D(norm(x))`` then ``x + MLP(norm2(x))``."""

  config: VMambaConfig
  width: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    x = x + SS2D(cfg, self.width, name="op")(_layer_norm(cfg, "norm")(x))
    if cfg.mlp_ratio > 0:
      y = _layer_norm(cfg, "norm2")(x)
      x = x + Mlp(int(self.width * cfg.mlp_ratio), self.width, name="mlp")(y)
    return x


class _Blocks(nn.Module):
  config: VMambaConfig
  width: int
  depth: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i in range(self.depth):
      x = VSSBlock(self.config, self.width, name=str(i))(x)
    return x


class Downsample(nn.Module):
  """``downsample v3``: conv 3x3, stride 2 (width -> 2·width), then LayerNorm."""

  config: VMambaConfig
  features: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return _layer_norm(self.config, "norm")(_conv3x3s2(self.features, "conv")(x))


class Stage(nn.Module):
  config: VMambaConfig
  index: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg, i = self.config, self.index
    x = _Blocks(cfg, cfg.dims[i], cfg.depths[i], name="blocks")(x)
    if i + 1 < len(cfg.depths):
      x = Downsample(cfg, cfg.dims[i + 1], name="downsample")(x)
    return x


class _Stages(nn.Module):
  config: VMambaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i in range(len(self.config.depths)):
      x = Stage(self.config, i, name=str(i))(x)
    return x


class PatchEmbed(nn.Module):
  """``patchembed v2``: conv 3x3/2 -> LN -> GELU -> conv 3x3/2 -> LN (patch size 4)."""

  config: VMambaConfig

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    cfg = self.config
    x = _layer_norm(cfg, "norm1")(_conv3x3s2(cfg.embed_dim // 2, "conv1")(pixels))
    x = nn.gelu(x, approximate=False)
    return _layer_norm(cfg, "norm2")(_conv3x3s2(cfg.embed_dim, "conv2")(x))


class Classifier(nn.Module):
  config: VMambaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = _layer_norm(self.config, "norm")(x).mean(axis=(1, 2))
    return nn.Dense(self.config.num_labels, kernel_init=_INIT, name="head")(x)


class VMamba(nn.Module):
  """VMamba classifier: NHWC pixels (any side the stem and 3 downsamplings accept) -> logits."""

  config: VMambaConfig

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    x = PatchEmbed(self.config, name="patch_embed")(pixels)
    x = _Stages(self.config, name="layers")(x)
    return Classifier(self.config, name="classifier")(x)


def _spec(name: str, **kw: Any) -> ImageModelSpec:
  return ImageModelSpec(name=name, family="vmamba", config=VMambaConfig(**kw), build=VMamba)


CONFIGS: dict[str, ImageModelSpec] = {
  # The official VSSM's default configuration (51 LayerNorms, the paper's row).
    "vmamba-t": _spec("vmamba-t"),
  # The same depths (so the same 51 LayerNorms and the same fold), tiny widths: 32px -> an 8x8
  # map in stage 0 (scans of 64 steps) down to 1x1 in stage 3.
    "vmamba-tiny": _spec("vmamba-tiny", image_size=32, embed_dim=8, d_state=2, mlp_ratio=2.0, num_labels=10),
  # One block per stage: the same kinds of sites (18 LayerNorms, 8 fold), for the quick tests.
    "vmamba-mini": _spec("vmamba-mini", image_size=32, embed_dim=8, depths=(1, 1, 1, 1), d_state=2,
                         mlp_ratio=2.0, num_labels=10),
}
