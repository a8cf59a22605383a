"""Use a folded GPT-2 checkpoint in an RMSNorm model written without jaxfold.

`jaxfold fold --model gpt2 --checkpoint model.safetensors --out DIR` writes
`DIR/model.safetensors` in the Hugging Face layout with the centered weights. This
script does the same for the zoo's gpt2-tiny (random weights, non-trivial γ/β) and
then runs the folded file through a small NumPy GPT-2 in which

* every folded LayerNorm is an RMSNorm with the *same* γ, β and ε:
  ``y = x / sqrt(mean(x²) + ε) · γ + β`` (β stays: only the mean subtraction goes);
* the report's auxiliary centering A1 (the output of the `wte` embedding lookup)
  is one explicit ``e - e.mean(-1)`` after the token lookup (the tied LM head keeps
  the uncentered `wte`, which is why jaxfold did not center it in place);
* nothing else changes: same attention, MLP and LM head.

It prints the max relative error against the original LayerNorm model.

    python examples/rmsnorm_from_folded.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)


def rms_norm(x, gamma, beta, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * gamma + beta


def gelu_new(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def softmax(s):
  s = s - s.max(-1, keepdims=True)
  e = np.exp(s)
  return e / e.sum(-1, keepdims=True)


def gpt2_rms(w: dict, ids: np.ndarray, *, n_layer: int, n_head: int, eps: float,
             aux_center_tokens: bool) -> np.ndarray:
  """GPT-2 with RMSNorm, reading Hugging Face names (``h.0.ln_1.weight``, ...)."""
  b, t = ids.shape
  tok = w["wte.weight"][ids]
  if aux_center_tokens:                       # the report's auxiliary centering A1
    tok = tok - tok.mean(-1, keepdims=True)
  x = tok + w["wpe.weight"][np.arange(t)][None]
  causal = np.where(np.tril(np.ones((t, t), bool)), 0.0, -1e30)
  for i in range(n_layer):
    p = lambda k, i=i: w[f"h.{i}.{k}"]
    h = rms_norm(x, p("ln_1.weight"), p("ln_1.bias"), eps)
    q, k, v = np.split(h @ p("attn.c_attn.weight") + p("attn.c_attn.bias"), 3, -1)
    q, k, v = (a.reshape(b, t, n_head, -1) for a in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]) + causal
    a = np.einsum("bhqk,bkhd->bqhd", softmax(s), v).reshape(b, t, -1)
    x = x + a @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
    h = rms_norm(x, p("ln_2.weight"), p("ln_2.bias"), eps)
    x = x + gelu_new(h @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias")) @ p("mlp.c_proj.weight") \
        + p("mlp.c_proj.bias")
  x = rms_norm(x, w["ln_f.weight"], w["ln_f.bias"], eps)
  return x @ w["wte.weight"].T                 # tied head: the stored, uncentered wte


def main(argv=None) -> float:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", help="directory for the folded model.safetensors (default: temporary)")
  args = ap.parse_args(argv)

  import jax
  from safetensors.numpy import load_file

  import jaxfold
  import models
  from models.safetensors_io import save_safetensors

  jax.config.update("jax_enable_x64", True)     # compare in float64: the fold is exact
  spec = models.get("gpt2-tiny")
  cfg = spec.config
  params = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64),
                                  models.random_params(spec, 2, 16, seed=1))
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
  folded = jaxfold.fold(params, spec.apply_fn(), ids)
  print(folded.report)
  print(folded.report.diff())
  aux = folded.report.auxiliary
  # This hand-written model knows where GPT-2's one auxiliary centering goes; check it.
  assert all(s.folded for s in folded.report.sites), "this sketch assumes every LN folded"
  assert len(aux) <= 1 and all("wte" in a.where for a in aux), aux
  assert not folded.params.extras, "untied copies would be in untied.safetensors"

  out = args.out or tempfile.mkdtemp(prefix="jaxfold-rms-")
  path = os.path.join(out, "model.safetensors")
  save_safetensors(folded.params.params, path, "gpt2")
  weights = {k: v.astype(np.float64) for k, v in load_file(path).items()}
  logits = gpt2_rms(weights, ids, n_layer=cfg.n_layer, n_head=cfg.n_head,
                    eps=cfg.layer_norm_epsilon, aux_center_tokens=bool(aux))
  ref = np.asarray(spec.apply_fn()(params, ids))
  err = float(np.max(np.abs(logits - ref)) / np.max(np.abs(ref)))
  print(f"wrote {path}; NumPy RMSNorm GPT-2 on the folded weights vs the original "
        f"LayerNorm model: max relative error {err:.1e} (the zoo's attention scores are float32)")
  if aux:
    bad = gpt2_rms(weights, ids, n_layer=cfg.n_layer, n_head=cfg.n_head,
                   eps=cfg.layer_norm_epsilon, aux_center_tokens=False)
    print(f"without the auxiliary centering A1: {np.max(np.abs(bad - ref)) / np.max(np.abs(ref)):.1e} "
          "(it is part of the folded model)")
  return err


if __name__ == "__main__":
  main()
