"""Adversarial checks of CBWC training (``jaxfold.cbwc`` and ``jaxfold.optax_transforms``).

The promise: ``r.apply_fn`` is the original function of the *same* parameters, so
every optax optimizer (whatever it does with gradients and parameters: factored
second moments, trust ratios, sign updates, gradient accumulation, per-label
transforms) follows the original's trajectory to float64 rounding, and the trained
parameters then fold exactly. Float64 throughout, random γ, β and biases, short
trajectories compared under one ``jax.jit``; the long optimizer sweep is slow.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import center_blocks, randomize, rel_err

import jaxfold
from jaxfold.optax_transforms import centered_weights, decay_centered_weights


class Net(nn.Module):
  """Pre-LN residual MLP: both LNs fold (the stream's writers are centered)."""

  @nn.compact
  def __call__(self, x):
    s = nn.Dense(8)(x)
    s = s + nn.Dense(8)(nn.gelu(nn.Dense(16)(nn.LayerNorm()(s))))
    return nn.Dense(3)(nn.LayerNorm()(s))


def _setup(seed=1):
  x = jnp.asarray(np.random.default_rng(seed).normal(size=(6, 5)))
  p = randomize(Net().init(jax.random.PRNGKey(0), x), seed)
  return x, jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), p)


def _both_trajectories(apply_a, apply_b, p0, opt, x, steps=3, **kw):
  """The trajectories of ``opt`` on the two apply functions, under one jit."""
  def run(fn, p):
    def loss(q):
      out = fn(q, x, **kw)
      return jnp.mean((out - jnp.linspace(-1.0, 1.0, out.shape[-1])) ** 2)

    def body(c, _):
      p, s = c
      u, s = opt.update(jax.grad(loss)(p), s, p)
      return (optax.apply_updates(p, u), s), loss(p)
    (p, _), ls = jax.lax.scan(body, (p, opt.init(p)), None, length=steps)
    return p, ls

  return jax.jit(lambda p: (run(apply_a, p), run(apply_b, p)))(p0)


def _check_trajectory_then_fold(opt, tol=1e-11):
  x, p0 = _setup()
  r = jaxfold.cbwc(p0, Net().apply, x)
  assert r.report.num_folded == r.report.num_sites == 2, str(r.report)
  (pa, la), (pb, lb) = _both_trajectories(Net().apply, r.apply_fn, p0, opt(r), x)
  assert rel_err(p0, pa) > 1e-6          # it trained (prodigy starts with steps of ~1e-6)
  assert rel_err(la, lb) < tol and rel_err(pa, pb) < tol, (rel_err(la, lb), rel_err(pa, pb))
  # The CBWC-trained parameters fold exactly, at the traced and at another batch size.
  f = jaxfold.fold(pb, Net().apply, x)
  assert f.report.num_folded == 2
  x2 = jnp.asarray(np.random.default_rng(7).normal(size=(2, 3, 5)))
  orig, folded = jax.jit(Net().apply), jax.jit(f.apply_fn)
  for z in (x, x2):
    assert rel_err(orig(pb, z), folded(f.params, z)) < 1e-12


def _kernels(p):
  return jax.tree_util.tree_map(lambda a: a.ndim >= 2, p)


# Optimizers whose update is not a function of the gradient alone, or not
# elementwise: factored second moments (min_dim_size_to_factor lowered so that the
# 5x8, 8x16, ... kernels are factored), trust ratios on parameter norms, sign updates,
# gradient accumulation, per-label transforms, the weight decay on V behind optax.masked.
FAST = {
    "adafactor_factored": lambda r: optax.adafactor(1e-2, min_dim_size_to_factor=2),
    "lion": lambda r: optax.lion(1e-3, weight_decay=0.1),
    "lamb_decay_on_v": lambda r: optax.chain(decay_centered_weights(0.1, r), optax.lamb(1e-2)),
    "multi_transform_masked_decay": lambda r: optax.multi_transform(
        {"k": optax.chain(decay_centered_weights(0.05, r, mask=_kernels), optax.adam(1e-2)),
         "o": optax.sgd(0.1, momentum=0.9, nesterov=True)},
        lambda p: jax.tree_util.tree_map(lambda a: "k" if a.ndim >= 2 else "o", p)),
    "multisteps_clip": lambda r: optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2, weight_decay=0.1, mask=_kernels)), 2),
}


@pytest.mark.parametrize("name", sorted(FAST))
def test_trajectory_then_fold(x64, name):
  _check_trajectory_then_fold(FAST[name])


def _contrib(name, *args, **kw):
  fn = getattr(getattr(optax, "contrib", None), name, None)
  return None if fn is None else fn(*args, **kw)


SLOW = {
    "sgd": lambda r: optax.sgd(0.1), "momentum": lambda r: optax.sgd(0.1, 0.9),
    "adam": lambda r: optax.adam(1e-2), "adamw_mask": lambda r: optax.adamw(1e-2, weight_decay=0.1, mask=_kernels),
    "lars": lambda r: optax.lars(1e-1), "adafactor": lambda r: optax.adafactor(1e-2),
    "adagrad": lambda r: optax.adagrad(1e-2), "rmsprop": lambda r: optax.rmsprop(1e-2),
    "sm3": lambda r: optax.sm3(1e-2), "novograd": lambda r: optax.novograd(1e-2),
    "fromage": lambda r: optax.fromage(1e-2), "adan": lambda r: optax.adan(1e-2),
    "clip_sgd": lambda r: optax.chain(optax.clip(0.01), optax.sgd(0.1)),
    "noise": lambda r: optax.chain(optax.add_noise(0.01, 0.55, 0), optax.sgd(0.1)),
    "inject": lambda r: optax.inject_hyperparams(optax.adam)(learning_rate=optax.linear_schedule(1e-2, 1e-3, 3)),
    "inject_decay_on_v": lambda r: optax.chain(
        optax.inject_hyperparams(decay_centered_weights, static_args=("reparam",))(weight_decay=0.1, reparam=r),
        optax.adam(1e-2)),
    "apply_if_finite": lambda r: optax.apply_if_finite(optax.adam(1e-2), 3),
    "zero_nans": lambda r: optax.chain(optax.zero_nans(), optax.adam(1e-2)),
    "trust_ratio": lambda r: optax.chain(optax.scale_by_adam(), optax.scale_by_trust_ratio(), optax.scale(-1e-2)),
    "decay_on_v_index_mask": lambda r: optax.chain(
        decay_centered_weights(0.1, r.leaf_specs, mask=_kernels), optax.adam(1e-2)),
    "schedule_free": lambda r: _contrib("schedule_free_adamw", 1e-2),
    "muon": lambda r: _contrib("muon", 1e-2),
    "prodigy": lambda r: _contrib("prodigy", 1.0),
    "ademamix": lambda r: _contrib("ademamix", 1e-2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_trajectory_then_fold_sweep(x64, name):
  x, p0 = _setup()
  if SLOW[name](jaxfold.cbwc(p0, Net().apply, x)) is None:
    pytest.skip(f"optax has no {name}")
  _check_trajectory_then_fold(SLOW[name], tol=1e-10)


# ----------------------------------------------------------------------------
# The weight decay on V when the params reach it masked.


def _named_setup():
  """A hand-written x@w0+b0 -> LN(g, b) -> @w1 with dict keys sorted b, b0, g, w0, w1:
  the centered leaves are b0 (index 1) and w0 (index 3); g and w1 have the shapes
  that index 1 and 3 of a tree with `b` masked out would give them."""
  rng = np.random.default_rng(3)
  p = {"b": jnp.asarray(rng.normal(size=8) + 0.3), "b0": jnp.asarray(rng.normal(size=8) + 0.3),
       "g": jnp.asarray(1 + 0.5 * rng.normal(size=8)), "w0": jnp.asarray(rng.normal(size=(8, 8))),
       "w1": jnp.asarray(rng.normal(size=(8, 8)))}

  def apply(p, x):
    h = x @ p["w0"] + p["b0"]
    m = h.mean(-1, keepdims=True)
    v = ((h - m) ** 2).mean(-1, keepdims=True)
    return ((h - m) / jnp.sqrt(v + 1e-5) * p["g"] + p["b"]) @ p["w1"]

  x = jnp.asarray(rng.normal(size=(4, 8)))
  r = jaxfold.cbwc(p, apply, x)
  assert r.report.num_folded == 1
  names = sorted(p)
  assert {names[i] for i, _ in r.leaf_specs} == {"b0", "w0"}
  return p, r


def _expected_decay(p, r, wd, decayed):
  specs = {sorted(p)[i]: dict(s) for i, s in r.leaf_specs}
  return {k: (wd * center_blocks(a, specs[k]) if k in specs else wd * np.asarray(a)) if k in decayed
          else np.zeros(a.shape) for k, a in p.items()}


@pytest.mark.parametrize("form", ["cbwc", "leaf_specs"])
def test_decay_on_v_mask_with_every_reparam_form(x64, form):
  """decay_centered_weights(wd, r.leaf_specs, mask=...) centered the masked tree by leaf
  index: with `b` masked out, index 1 named g and index 3 named w1, so it decayed P·g
  and P·w1 and decayed b0 and w0 on W (silently; other masks crashed in a reshape)."""
  p, r = _named_setup()
  reparam = {"cbwc": r, "leaf_specs": r.leaf_specs}[form]
  mask = {k: k != "b" for k in p}
  zero = jax.tree_util.tree_map(jnp.zeros_like, p)
  for m in (mask, lambda u: {k: k != "b" for k in u}):
    t = decay_centered_weights(0.1, reparam, mask=m)
    u, state = t.update(zero, t.init(p), p)
    assert isinstance(state, optax.MaskedState)   # the state optax.masked makes, as before
    want = _expected_decay(p, r, 0.1, {"b0", "g", "w0", "w1"})
    for k in p:
      np.testing.assert_allclose(u[k], want[k], rtol=1e-12, atol=1e-14, err_msg=k)


def test_index_form_refuses_a_tree_masked_by_optax(x64):
  """Inside the user's own optax.masked/multi_transform the leaf-index form cannot tell
  which leaves are gone: it refuses and names the form that can (cbwc's result)."""
  p, r = _named_setup()
  zero = jax.tree_util.tree_map(jnp.zeros_like, p)
  labels = {k: "d" if k != "b" else "n" for k in p}
  t = optax.multi_transform({"d": decay_centered_weights(0.1, r.leaf_specs), "n": optax.identity()}, labels)
  with pytest.raises(ValueError, match=r"masked out.*\['b'\].*result of jaxfold.cbwc"):
    t.update(zero, t.init(p), p)
  # By path, the same composition is right.
  t = optax.multi_transform({"d": decay_centered_weights(0.1, r), "n": optax.identity()}, labels)
  u, _ = t.update(zero, t.init(p), p)
  want = _expected_decay(p, r, 0.1, {"b0", "g", "w0", "w1"})
  for k in p:
    np.testing.assert_allclose(u[k], want[k], rtol=1e-12, atol=1e-14, err_msg=k)


def test_path_form_ignores_masked_out_leaves_it_was_not_made_for(x64):
  """By path, a leaf that the mask removes need not be one of reparam's (a counter
  beside the parameters): the mask applies first, as with optax.masked alone."""
  p, r = _named_setup()
  q = {**p, "step": jnp.zeros(3)}
  zero = jax.tree_util.tree_map(jnp.zeros_like, q)
  t = decay_centered_weights(0.1, r, mask={k: k != "step" for k in q})
  u, _ = t.update(zero, t.init(q), q)
  want = _expected_decay(p, r, 0.1, set(p))
  for k in p:
    np.testing.assert_allclose(u[k], want[k], rtol=1e-12, atol=1e-14, err_msg=k)
  with pytest.raises(ValueError, match=r"\['step'\] is not in the parameters reparam was made for"):
    decay_centered_weights(0.1, r).update(zero, (), q)


def test_index_form_refuses_params_of_another_structure(x64):
  """Leaf indices applied to another tree: leaf 3 (w0's index, centered over axis 1)
  is 1-D here, and centering it over an axis it lacks returned zeros (V = 0: no
  decay at all), silently; a block that does not divide the axis crashed in a reshape."""
  _, r = _named_setup()
  center = centered_weights(r.leaf_specs)
  with pytest.raises(ValueError, match=r"leaf 3 has shape \(8,\).*structure reparam was made for"):
    center({k: jnp.ones(5 if k in "ace" else 8) for k in "abcde"})
  with pytest.raises(ValueError, match=r"leaf 1 has shape \(5,\)"):
    center({k: jnp.ones(5) for k in "abcde"})


# ----------------------------------------------------------------------------
# Models: tied embedding, layers under nn.scan + nn.remat, dropout in training mode.


class TiedScan(nn.Module):
  @nn.compact
  def __call__(self, tok, train: bool = False):
    emb = nn.Embed(11, 8)
    s = emb(tok)

    class Layer(nn.Module):
      @nn.compact
      def __call__(self, s, _):
        h = nn.Dropout(0.25, deterministic=not train)(nn.gelu(nn.Dense(16)(nn.LayerNorm()(s))))
        return s + nn.Dense(8)(h), None

    s, _ = nn.scan(nn.remat(Layer), variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                   length=2)()(s, None)
    return emb.attend(nn.LayerNorm()(s))


def test_tied_scan_remat_dropout_trajectory_then_fold(x64):
  tok = jnp.asarray(np.random.default_rng(0).integers(0, 11, (3, 5)))
  m = TiedScan()
  p0 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), randomize(m.init(jax.random.PRNGKey(0), tok), 2))
  key = jax.random.PRNGKey(5)
  kw = {"train": True, "rngs": {"dropout": key}}
  r = jaxfold.cbwc(p0, m.apply, tok, example_kwargs=kw)
  # The scanned layer's LN is one site; the tied table's lookup is centered by an
  # auxiliary centering (the head reads the table uncentered); the dropout is after the LN.
  assert r.report.num_folded == r.report.num_sites == 2 and r.report.num_auxiliary == 1, str(r.report)
  opt = optax.chain(decay_centered_weights(0.1, r), optax.adafactor(1e-2, min_dim_size_to_factor=2))
  (pa, la), (pb, lb) = _both_trajectories(m.apply, r.apply_fn, p0, opt, tok, **kw)
  assert rel_err(p0, pa) > 1e-4
  assert rel_err(la, lb) < 1e-11 and rel_err(pa, pb) < 1e-11, (rel_err(la, lb), rel_err(pa, pb))
  f = jaxfold.fold(pb, m.apply, tok)          # for inference (train=False)
  assert f.report.num_folded == 2
  tok2 = jnp.asarray(np.random.default_rng(1).integers(0, 11, (2, 7)))
  orig, folded = jax.jit(m.apply), jax.jit(f.apply_fn)
  for z in (tok, tok2):
    assert rel_err(orig(pb, z), folded(f.params, z)) < 1e-12
