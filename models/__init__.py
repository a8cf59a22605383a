"""Model zoo for jaxfold tests and benchmarks: a registry of named `ModelSpec`s.

Each family module exposes `CONFIGS: dict[str, ModelSpec]`; this module merges them.
The vision modules (vit, swin, cnn, mlp, vmamba) are optional: if one is missing or fails to
import, its configurations are simply absent (see `import_errors()`).

Example:
    >>> import jax, models
    >>> "gpt2-tiny" in models.names()
    True
    >>> spec = models.get("gpt-j-6b-sized")
    >>> shapes = spec.abstract_init(batch=1, seq=8)   # ShapeDtypeStructs, nothing allocated
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

from models.common import ModelSpec, randomize_norms

_TEXT_MODULES = ("gpt2", "gpt2_nnx", "bert", "opt", "bloom", "phi")
_OPTIONAL_MODULES = ("vit", "swin", "cnn", "mlp", "clip", "whisper", "wav2vec2", "vmamba")

_REGISTRY: dict[str, Any] = {}
_IMPORT_ERRORS: dict[str, str] = {}


def _register(module_name: str, optional: bool) -> None:
  try:
    module = importlib.import_module(f"models.{module_name}")
  except Exception as err:  # a colleague's module may not exist yet, or be mid-edit
    if not optional:
      raise
    _IMPORT_ERRORS[module_name] = f"{type(err).__name__}: {err}"
    return
  for name, spec in getattr(module, "CONFIGS", {}).items():
    if name in _REGISTRY:
      raise ValueError(f"model name {name!r} registered twice (models.{module_name})")
    _REGISTRY[name] = spec


for _m in _TEXT_MODULES:
  _register(_m, optional=False)
for _m in _OPTIONAL_MODULES:
  _register(_m, optional=True)


# Former names still accepted by `get` (not listed by `names`).
ALIASES = {"demo-gpt2-small": "gpt2-256x4"}   # it was never GPT-2 small (d=256, 4 layers)


def get(name: str) -> ModelSpec:
  """The `ModelSpec` registered under `name` or one of its `ALIASES` (KeyError
  listing the known names otherwise)."""
  try:
    return _REGISTRY[ALIASES.get(name, name)]
  except KeyError:
    raise KeyError(f"unknown model {name!r}; known: {', '.join(names())}") from None


def names() -> list[str]:
  """All registered configuration names, sorted."""
  return sorted(_REGISTRY)


def import_errors() -> dict[str, str]:
  """Optional modules that could not be imported, with the error (for diagnostics)."""
  return dict(_IMPORT_ERRORS)


def random_params(spec, batch: int = 1, seq: Optional[int] = None, seed: int = 0):
  """Random weights with non-trivial norms for a ``models`` spec, drawn with
  numpy from its abstract init (no init program to trace or compile):
  kernels/tables N(0, 0.02²); 1-D leaves (norm scales/biases, biases)
  ``base + 0.5·(N(0,1) + c)`` with a per-leaf offset c ∈ [-1, 1], base 1 for
  a leaf named ``scale`` else 0, so γ is non-uniform and β has a non-zero
  mean (like :func:`randomize_norms`)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  shapes = spec.abstract_init(batch, seq) if seq is not None else spec.abstract_init(batch)
  rng = np.random.default_rng(seed)

  def draw(path, sds):
    dtype = jnp.dtype(sds.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
      return jnp.zeros(sds.shape, dtype)
    if len(sds.shape) <= 1:
      last = getattr(path[-1], "key", getattr(path[-1], "name", "")) if path else ""
      base = 1.0 if last == "scale" else 0.0
      x = base + 0.5 * (rng.standard_normal(sds.shape) + rng.uniform(-1, 1))
    else:
      x = 0.02 * rng.standard_normal(sds.shape, dtype=np.float32)
    return jnp.asarray(x, dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def max_positions(spec) -> Optional[int]:
  """The length of a text model's position table (None without one)."""
  c = spec.config
  for k in ("n_positions", "max_position_embeddings"):
    if hasattr(c, k):
      return int(getattr(c, k))
  return None


_CAUSAL_FAMILIES = {"gpt2", "gpt2_nnx", "gpt2-nnx", "opt", "bloom", "phi"}


def serving_meta(spec) -> dict:
  """What ``jaxfold serve`` validates requests against, for a model-zoo spec:
  per-argument names and value ranges (token ids in ``[0, vocab)``), the
  longest sequence (``max_seq``) and whether right-padding is invisible
  (``seq_padding``: ``"causal"`` decoders, ``"mask"`` for BERT's attention mask).

  Example:
      >>> serving_meta(get("gpt2-tiny"))["seq_padding"]
      'causal'
  """
  c = spec.config
  meta: dict = {"model": spec.name, "family": spec.family}
  vocab = getattr(c, "vocab_size", None)
  if spec.family == "bert":
    meta["inputs"] = [
        {"name": "input_ids", "low": 0, "high": int(vocab)},
        {"name": "attention_mask", "low": 0, "high": 2, "role": "attention_mask"},
        {"name": "token_type_ids", "low": 0, "high": int(c.type_vocab_size)},
    ]
    meta["seq_padding"] = "mask"
  elif vocab is not None:
    meta["inputs"] = [{"name": "input_ids", "low": 0, "high": int(vocab)}]
    if spec.family in _CAUSAL_FAMILIES or spec.family.startswith("gpt2"):
      meta["seq_padding"] = "causal"
  else:
    meta["inputs"] = [{"name": "x"}]
  limit = max_positions(spec)
  if limit is not None:
    meta["max_seq"] = limit
  return meta


__all__ = ["ModelSpec", "get", "names", "import_errors", "randomize_norms", "random_params",
           "max_positions", "serving_meta"]
