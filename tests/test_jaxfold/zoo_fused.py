"""Folded and fused zoo models shared by test_affine and test_rotate (cached per process)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxfold
import models
from models.common import max_rel_err

# Attention scores run in float32 in every zoo model (as in the HF references),
# so float64 models agree to ~1e-7 there at worst, not 1e-15.
ZOO_TOL = 1e-6
ZOO = ("gpt2-tiny", "opt-tiny", "phi-tiny", "vit-tiny")


def shapes(name):
  return [(2, None), (3, None)] if name.startswith("vit") else [(2, 8), (3, 5)]


def inputs(name, batch, seq):
  return models.get(name).example_inputs(batch, seq)


@functools.lru_cache(maxsize=None)
def original(name):
  spec = models.get(name)
  assert jax.config.jax_enable_x64, "use the x64 fixture"
  shapes_ = jax.eval_shape(lambda: spec.init(jax.random.key(0), *shapes(name)[0]))
  return spec.apply_fn(), randomize_np(shapes_)


def randomize_np(shapes_, seed=0):
  """Random float64 parameters: vectors (γ, β, biases) non-uniform with a
  non-zero mean, matrices small (as models.randomize_norms, on the host)."""
  rng = np.random.default_rng(seed)

  def leaf(s):
    if len(s.shape) <= 1:
      return jnp.asarray(1.0 + 0.5 * (rng.normal(size=s.shape) + rng.uniform(-1, 1)))
    return jnp.asarray(0.1 * rng.normal(size=s.shape))
  return jax.tree_util.tree_map(leaf, shapes_)


@functools.lru_cache(maxsize=None)
def fused(name, tied_weights="copy"):
  apply, p = original(name)
  folded = jaxfold.fold(p, apply, *inputs(name, *shapes(name)[0]), tied_weights=tied_weights)
  return folded, jaxfold.fuse_affine(folded)


@functools.lru_cache(maxsize=None)
def _jit(fn):
  return jax.jit(fn)


def errors(name, model, fn=None):
  """Max relative error at both shapes; ``fn`` (default ``model.apply_fn``)
  is jitted once per function, so models sharing a program share compiles."""
  apply, p = original(name)
  ref, new = _jit(apply), _jit(fn or model.apply_fn)
  return [max_rel_err(ref(p, *inputs(name, b, s)), new(model.params, *inputs(name, b, s)))
          for b, s in shapes(name)]

