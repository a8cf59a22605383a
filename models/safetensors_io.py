"""Read and write Hugging Face safetensors checkpoints as the Flax pytrees of `models/`.

The mapping rule (the same for every family, plus a small per-family `Layout` table):

1. Drop a known wrapper prefix (`transformer.`, `bert.`, `model.decoder.`, `model.`, ...)
   and skip buffers/heads the Flax model does not have (`embeddings.position_ids`,
   GPT-2's `attn.bias` mask, `pooler.*`, a tied `lm_head.weight`).
2. Split the key on `.`; a numeric segment is fused with the one before it
   (`h.0` -> `h_0`, Flax's naming of submodules built in a loop).
3. The last segment becomes the Flax leaf name:
   `bias` -> `bias`; `gamma`/`beta` (old BERT) -> `scale`/`bias`;
   `weight` -> `embedding` for the family's embedding tables, `scale` for 1-D tensors
   (LayerNorm), `kernel` otherwise.  A torch `nn.Linear` weight is (out, in) and is
   transposed to Flax's (in, out); GPT-2's `Conv1D` weights are already (in, out).

Saving applies the inverse, so folded parameters can be written back in HF naming.  Dtypes
are kept (bf16 included).  Tied heads are one array in the pytree: a tied `lm_head.weight`
in a file is checked against the embedding and not duplicated.

Example:
    >>> params = load_safetensors("model.safetensors", "bert")
    >>> params["embeddings"]["LayerNorm"]["scale"].shape
    (384,)
    >>> save_safetensors(params, "/tmp/out.safetensors", "bert")
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.flax import save_file

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Layout:
  """Per-family facts the generic rule needs.

  strip_prefixes: wrapper prefixes removed on load (first match wins).
  save_prefix: prefix written on save for base-model keys.
  top_level: first path components that live outside the wrapper (e.g. Phi's `lm_head`).
  embeddings: module names whose `weight` is an embedding table.
  conv1d: True when 2-D weights are stored (in, out) (GPT-2's Conv1D): no transpose.
  tied_head: key of a head tied to an embedding (dropped on load, never saved).
  layer_lists: module names whose numbered children are fused on load (`h.0` -> `h_0`) and
      split again on save; needed because a Flax name like GPT-2's `ln_1` must stay whole.
  ignore: regexes of keys (after prefix stripping) that the Flax model has no use for.
  """

  strip_prefixes: tuple[str, ...]
  save_prefix: str
  layer_lists: frozenset[str]
  embeddings: frozenset[str]
  top_level: frozenset[str] = frozenset()
  conv1d: bool = False
  tied_head: tuple[str, str] | None = None  # (head key, embedding module name)
  ignore: tuple[str, ...] = ()


LAYOUTS: dict[str, Layout] = {
    "gpt2": Layout(
        strip_prefixes=("transformer.",), save_prefix="", layer_lists=frozenset({"h"}),
        embeddings=frozenset({"wte", "wpe"}), conv1d=True,
        tied_head=("lm_head.weight", "wte"),
        ignore=(r"(^|\.)attn\.(masked_)?bias$",),  # causal-mask buffers of old checkpoints
    ),
    "bert": Layout(
        strip_prefixes=("bert.",), save_prefix="", layer_lists=frozenset({"layer"}),
        embeddings=frozenset({"word_embeddings", "position_embeddings", "token_type_embeddings"}),
        ignore=(r"^embeddings\.position_ids$", r"^pooler\.", r"^cls\."),
    ),
    "opt": Layout(
        strip_prefixes=("model.decoder.", "decoder."), save_prefix="model.decoder.",
        layer_lists=frozenset({"layers"}),
        embeddings=frozenset({"embed_tokens", "embed_positions"}),
        tied_head=("lm_head.weight", "embed_tokens"),
    ),
    "bloom": Layout(
        strip_prefixes=("transformer.",), save_prefix="", layer_lists=frozenset({"h"}),
        embeddings=frozenset({"word_embeddings"}),
        tied_head=("lm_head.weight", "word_embeddings"),
    ),
    "phi": Layout(
        strip_prefixes=("model.",), save_prefix="model.", layer_lists=frozenset({"layers"}),
        embeddings=frozenset({"embed_tokens"}), top_level=frozenset({"lm_head"}),
        ignore=(r"rotary_emb\.inv_freq$",),
    ),
}


def layout(family: str) -> Layout:
  """The `Layout` of a family ('gpt2', 'bert', 'opt', 'bloom', 'phi')."""
  try:
    return LAYOUTS[family]
  except KeyError:
    raise ValueError(f"unknown family {family!r}; known: {sorted(LAYOUTS)}") from None


# --------------------------------------------------------------------------------------
# Key mapping
# --------------------------------------------------------------------------------------


def _strip(key: str, lay: Layout) -> str:
  for prefix in lay.strip_prefixes:
    if key.startswith(prefix):
      return key[len(prefix):]
  return key


def hf_key_to_path(key: str, ndim: int, family: str) -> tuple[tuple[str, ...], bool] | None:
  """(Flax path, transpose?) for an HF key, or None when the key is skipped.

  Example:
      >>> hf_key_to_path("bert.encoder.layer.0.attention.self.query.weight", 2, "bert")
      (('encoder', 'layer_0', 'attention', 'self', 'query', 'kernel'), True)
  """
  lay = layout(family)
  key = _strip(key, lay)
  if any(re.search(p, key) for p in lay.ignore):
    return None
  parts: list[str] = []
  for seg in key.split("."):
    if seg.isdigit() and parts:
      parts[-1] = f"{parts[-1]}_{seg}"
    else:
      parts.append(seg)
  *modules, leaf = parts
  transpose = False
  if leaf in ("bias", "beta"):
    leaf = "bias"
  elif leaf == "gamma" or (leaf == "weight" and ndim == 1):
    leaf = "scale"
  elif leaf == "weight" and modules and modules[-1] in lay.embeddings:
    leaf = "embedding"
  elif leaf == "weight":
    leaf, transpose = "kernel", (ndim == 2 and not lay.conv1d)
  return tuple(modules) + (leaf,), transpose


def _split_numbered(name: str, lay: Layout) -> str:
  """`h_0` -> `h.0` for the family's layer lists; any other name (`ln_1`) is kept."""
  m = re.fullmatch(r"(.*)_(\d+)", name)
  return f"{m.group(1)}.{m.group(2)}" if m and m.group(1) in lay.layer_lists else name


def path_to_hf_key(path: tuple[str, ...], ndim: int, family: str) -> tuple[str, bool]:
  """(HF key, transpose?) for a Flax path; the inverse of `hf_key_to_path`.

  Example:
      >>> path_to_hf_key(("h_0", "ln_1", "scale"), 1, "gpt2")
      ('h.0.ln_1.weight', False)
  """
  lay = layout(family)
  *modules, leaf = path
  segs = [_split_numbered(m, lay) for m in modules]
  transpose = False
  if leaf in ("scale", "embedding"):
    leaf = "weight"
  elif leaf == "kernel":
    leaf, transpose = "weight", (ndim == 2 and not lay.conv1d)
  key = ".".join(segs + [leaf])
  prefix = "" if modules and modules[0] in lay.top_level else lay.save_prefix
  return prefix + key, transpose


# --------------------------------------------------------------------------------------
# Tensor dicts <-> pytrees (torch-free, file-free)
# --------------------------------------------------------------------------------------


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  if path[-1] in tree:
    raise ValueError(f"two checkpoint keys map to {'/'.join(path)}")
  tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]) -> Any:
  for p in path:
    tree = tree[p]
  return tree


def from_hf_tensors(tensors: Mapping[str, Any], family: str) -> dict:
  """HF-named tensors -> nested Flax params dict (arrays as jnp, dtypes kept)."""
  lay = layout(family)
  params: dict = {}
  head = None
  for key, value in tensors.items():
    if lay.tied_head and _strip(key, lay) == lay.tied_head[0]:
      head = value
      continue
    mapped = hf_key_to_path(key, np.ndim(value), family)
    if mapped is None:
      continue
    path, transpose = mapped
    arr = jnp.asarray(value)
    _set(params, path, arr.T if transpose else arr)
  if head is not None:
    _check_tied(params, head, lay)
  return params


def _check_tied(params: dict, head: Any, lay: Layout) -> None:
  """A tied head must equal its embedding: the Flax model cannot represent an untied one."""
  table = params.get(lay.tied_head[1], {}).get("embedding")
  if table is None or table.shape != np.shape(head) or not np.array_equal(
          np.asarray(table), np.asarray(head)):
    raise ValueError(f"{lay.tied_head[0]} is not tied to {lay.tied_head[1]}: this model "
                     "family's Flax module uses the embedding as its head")


def to_hf_tensors(params: PyTree, family: str) -> dict[str, jax.Array]:
  """Nested Flax params -> HF-named tensors (inverse of `from_hf_tensors`)."""
  out: dict[str, jax.Array] = {}
  for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    path = tuple(_key_name(k) for k in kp)
    arr = jnp.asarray(leaf)
    key, transpose = path_to_hf_key(path, arr.ndim, family)
    if key in out:
      raise ValueError(f"two parameters map to HF key {key}")
    out[key] = arr.T if transpose else arr
  return out


def _key_name(k: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------


def load_safetensors(path: str | os.PathLike, family: str) -> dict:
  """Load an HF safetensors file as the Flax params pytree of `family`.

  Example:
      >>> params = load_safetensors("gpt2/model.safetensors", "gpt2")
      >>> params["h_0"]["attn"]["c_attn"]["kernel"].shape     # Conv1D: kept (in, out)
      (768, 2304)
  """
  with safe_open(os.fspath(path), framework="flax") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  return from_hf_tensors(tensors, family)


class NotRepresentable(ValueError):
  """The parameters need more than the original model's tensors to compute the right function."""


def representable(params: Any) -> PyTree:
  """The plain parameter pytree of ``params`` (a pytree, a ``jaxfold.fold`` result or its
  ``jaxfold.Params``), or raises `NotRepresentable` with the reason when the original model
  would compute something else with it: γ/β fused into other layers (``fuse_affine``: a
  ``Params`` with ``None`` where they were, or scaled copies and new biases in its extras),
  untied centered copies, auxiliary centerings in the folded program, or a rotated residual
  stream (``rotate``). A bare ``Params`` does not say which steps made it: pass the result."""
  import jaxfold  # noqa: PLC0415 - models does not otherwise depend on jaxfold at import

  why = ("a safetensors file holds only the original model's tensors, which the original "
         "architecture then computes with")
  # For a fold, folded.params.params alone is still right for the original LayerNorm model
  # (in-place centerings are invisible there), just not for an RMSNorm one.
  plain = ("; pass folded.params.params explicitly to write the centered tensors for the original "
           "LayerNorm architecture (where they compute the same function)")
  if isinstance(params, (jaxfold.Fused, jaxfold.Rotated)) or (
      getattr(getattr(params, "apply_fn", None), "root", True) is False):   # a step after the fold
    kind = "rotate" if isinstance(params, jaxfold.Rotated) or isinstance(
        getattr(params, "report", None), jaxfold.RotateReport) else "fuse_affine"
    raise NotRepresentable(f"this is a {kind} result: its γ/β live in other layers and new biases"
                           + (", and its residual stream is rotated" if kind == "rotate" else "")
                           + f"; {why}. Save it with jaxfold.save_fold or jaxfold.export instead")
  report = getattr(params, "report", None)
  if hasattr(params, "apply_fn") and hasattr(params, "params"):   # a fold result
    if getattr(report, "num_auxiliary", 0):
      raise NotRepresentable(f"the fold has {report.num_auxiliary} auxiliary centering(s) in its "
                             f"program, which the original model lacks; {why}. Fold with "
                             "tied_weights=\"copy\" (or auxiliary_centering=False), or save with "
                             "jaxfold.save_fold" + plain)
    params = params.params
  if isinstance(params, jaxfold.Params):
    fused = [k for k in params.extras if "@fused" in k or "@bias" in k]   # fuse_affine's names
    if fused or _has_none(params.params):
      raise NotRepresentable(f"these are fuse_affine parameters (γ/β moved into other layers, "
                             f"{len(params.extras)} extra tensors); {why}. Save the result with "
                             "jaxfold.save_fold or jaxfold.export instead")
    if params.extras:
      raise NotRepresentable(f"the fold has {len(params.extras)} untied centered copies "
                             f"({', '.join(sorted(params.extras))}) used in place of tied "
                             f"weights; {why}. Write them separately (as `jaxfold fold` does) or "
                             "use jaxfold.save_fold")
    params = params.params
  missing = [jax.tree_util.keystr(p) for p, x in
             jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: x is None)[0] if x is None]
  if missing:
    raise NotRepresentable(f"{len(missing)} parameters are None (e.g. {missing[0]}): γ/β fused "
                           f"away by fuse_affine, whose extra tensors this pytree lacks; {why}. "
                           "Save the fused result with jaxfold.save_fold or jaxfold.export")
  return params


def _has_none(tree: Any) -> bool:
  return any(x is None for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None))


def save_safetensors(params: PyTree, path: str | os.PathLike, family: str,
                     metadata: dict[str, str] | None = None) -> None:
  """Write a Flax params pytree in HF naming (inverse of `load_safetensors`).

  ``params`` may also be a ``jaxfold.fold`` result or its ``jaxfold.Params``; anything the
  original model would compute wrongly with is refused by `representable` (nothing written).

  Example:
      >>> save_safetensors(folded.params.params, "folded.safetensors", "gpt2")
  """
  params = representable(params)
  tensors = {k: jnp.asarray(v) for k, v in to_hf_tensors(params, family).items()}
  save_file(tensors, os.fspath(path), metadata={"format": "pt", **(metadata or {})})
  os.chmod(path, default_file_mode())   # safetensors creates files 0600


def default_file_mode() -> int:
  """``0o666`` less the process umask: what ``open(path, "w")`` gives a new file."""
  mask = os.umask(0o022)
  os.umask(mask)
  return 0o666 & ~mask
