"""LN pre-training → CBWC fine-tuning with an orbax checkpoint in the middle →
``jaxfold.fold`` for inference: one consistent path."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jaxfold


class Net(nn.Module):
  """Pre-LN residual MLP: embedding Dense, 2 blocks, final LN, head."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16)(x)
    for _ in range(2):
      h = nn.Dense(32)(nn.LayerNorm()(x))
      x = x + nn.Dense(16)(nn.gelu(h))
    return nn.Dense(4)(nn.LayerNorm()(x))


M = Net()


def _data(n_steps):
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(n_steps, 32, 10)).astype(np.float32)
  ys = rng.integers(0, 4, size=(n_steps, 32))
  return jnp.asarray(xs), jnp.asarray(ys)


def _step_fn(apply_fn, opt):
  def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(apply_fn(p, x), y).mean()

  @jax.jit
  def step(p, s, x, y):
    l, g = jax.value_and_grad(loss)(p, x, y)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, l
  return step


def _run(step, p, s, xs, ys, start, stop):
  for t in range(start, stop):
    p, s, _ = step(p, s, xs[t], ys[t])
  return p, s


def test_checkpoint_resume_is_bit_identical_and_folds(tmp_path):
  xs, ys = _data(30)
  x0 = xs[0]
  p = M.init(jax.random.PRNGKey(0), x0)
  # Random γ, β, biases before "pre-training".
  leaves, tree = jax.tree_util.tree_flatten(p)
  ks = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  p = tree.unflatten([l + (0.5 if l.ndim == 1 else 0.0) * jax.random.normal(k, l.shape)
                      for k, l in zip(ks, leaves)])

  # 1. LN pre-training (original apply_fn), 10 steps.
  opt = optax.adamw(5e-3, weight_decay=0.05)
  p_ln, _ = _run(_step_fn(M.apply, opt), p, opt.init(p), xs, ys, 20, 30)

  # 2. CBWC fine-tuning from the LN checkpoint, with a fresh optimizer.
  r = jaxfold.cbwc(p_ln, M.apply, x0)
  assert r.report.num_folded == r.report.num_sites == 3, str(r.report)
  ft = optax.adamw(2e-3, weight_decay=0.1)
  step = _step_fn(r.apply_fn, ft)
  s0 = ft.init(p_ln)

  # Uninterrupted 20 steps.
  p_full, s_full = _run(step, p_ln, s0, xs, ys, 0, 20)

  # 10 steps, save, restore into a fresh process state, 10 more.
  p_half, s_half = _run(step, p_ln, s0, xs, ys, 0, 10)
  ckpt = ocp.StandardCheckpointer()
  path = tmp_path / "ckpt"
  ckpt.save(path, {"params": p_half, "opt_state": s_half})
  ckpt.wait_until_finished()
  del p_half, s_half
  abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct,
                                    {"params": p_ln, "opt_state": ft.init(p_ln)})
  restored = ckpt.restore(path, abstract)
  ckpt.close()
  p_res, s_res = restored["params"], restored["opt_state"]
  assert jax.tree_util.tree_structure(s_res) == jax.tree_util.tree_structure(s0)
  p_resumed, s_resumed = _run(step, p_res, s_res, xs, ys, 10, 20)

  max_diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                 zip(jax.tree_util.tree_leaves((p_full, s_full)),
                     jax.tree_util.tree_leaves((p_resumed, s_resumed))))
  print(f"resume vs uninterrupted: max abs difference {max_diff:.3g}")
  assert max_diff <= 1e-7

  # The CBWC-trained parameters are ordinary LN-model parameters: the LN
  # model, the CBWC model and the inference fold all compute the same thing.
  x = xs[25]
  ref = M.apply(p_full, x)
  np.testing.assert_allclose(r.apply_fn(p_full, x), ref, rtol=1e-5, atol=1e-5)
  folded = jaxfold.fold(p_full, M.apply, x)
  assert folded.report.num_folded == 3
  np.testing.assert_allclose(folded.apply_fn(folded.params, x), ref, rtol=1e-5, atol=1e-5)
  # The fold's centered weights are the V = P·W the CBWC forward used.
  specs = dict(r.leaf_specs)
  from helpers import center_blocks
  for i, (w, v) in enumerate(zip(jax.tree_util.tree_leaves(p_full),
                                 jax.tree_util.tree_leaves(folded.params.params))):
    expect = center_blocks(w, dict(specs[i])) if i in specs else w
    np.testing.assert_allclose(v, expect, atol=1e-6)
