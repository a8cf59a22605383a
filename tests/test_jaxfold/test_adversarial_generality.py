"""Adversarial generality: one fold used at many shapes and through JAX
transformations (advgen).

A user folds once (often at batch 1 × one token) and then calls the folded
function at other batch sizes, lengths and ranks, with size-0 and prime-sized
axes, under ``jit``, ``vmap`` (an extra leading axis, or one over the
parameters), ``grad``/``jacfwd``/``hessian``/``linearize``, ``scan``,
``fori_loop``, ``checkpoint`` and ``cond``, with shardings on one CPU device,
and with static keyword arguments of several types. The programs take shapes
from their inputs: a causal mask ``tril(ones((t, t)))``, positions
``wpe[:t]``, padding to a multiple, a Python branch on ``x.shape``, a KV cache
written at a traced position, a mean divided by a size read off another axis;
they spell the norm in more ways (Keras' ``x*inv - mean*inv``, ``sum / n``,
a norm over the last two axes or written with ``axis=h.ndim-1``, a mean as a
product with ``ones((n, 1))``); they take dicts, ``None`` positionals, int
token ids of several dtypes, one-hot floats, stacked layer parameters with a
size-1 layer axis. Keras 3 layers and keras-hub backbones are folded at batch
1 × one token and called at other shapes.

Every program is pinned: the number of folded sites and which later calls
refuse (a ``FoldError`` naming both shapes), and the folded function equals
the original in float64 (≤ 1e-9 relative) at every other call, at random γ, β
and biases.

Findings (each failed before its fix):

* A folded (or fused, deferred, CBWC) apply_fn cached its analyses by static
  keyword values compared with ``==``: ``k=True`` reused the analysis traced
  at ``k=1`` (``1 == 1.0 == True`` hash alike), so a program branching on the
  value's type (``isinstance(k, bool)``, ``jnp.arange(n)``) computed the other
  branch: rel. error 0.5, or outputs of another shape (``jax.jit`` itself
  keeps them apart). The cache key now holds each static value's type.
* A width set by the length (``w[:, :min(t, D)]``) folded at one token: the
  example's plan (one feature) failed at the size-2 probe, and the probe's
  (blocks of 2) was kept although it folded nothing at the example; its
  centering then refused (3, 7) and (2, 3), which the original parameters
  serve. A probe plan that folds nothing at the example now yields to the
  parameters both plans center (here none).
* A call at the example's shapes in float32 (the program rounds h to the
  input's dtype) was refused as "inputs of these shapes ((2, 3, 4)) need
  different folded parameters than the example ... ((2, 3, 4))"; the
  message now names the dtypes where they differ.
* The analysis' factor tables (``algebra``) are module globals with no lock:
  two threads interning at once (a folded apply_fn called at new shapes from
  a thread pool, folds run in parallel) got one id for two keys, so a symbol
  could name another value and a cancellation be decided on the wrong terms.
  An ``algebra.scope`` is now one thread's at a time.

* A variance computed twice (two ``jnp.var`` calls, or one spelled out twice,
  under ``h*rsqrt(var) - mean*rsqrt(var)``) was two unrelated symbols once its
  expansion exceeded ``analysis.CANON_TERMS``, so the shift did not cancel and
  nothing folded. A long expression is now boxed by its expression
  (``algebra.boxed``), not by the value: equal expressions are one symbol.

Found, not fixed (coverage, sound refusals pinned below): a Welford mean in a
``scan`` is not recognised.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import np_eval
import numpy as np
import pytest
import spellings
from fold_checks import make_params, rel_err
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

import jaxfold

D = 6
V = 11
T = 16
F64 = jnp.float64


def ln(h, g, b, axes=(-1,), eps=1e-5):
  m = h.mean(axes, keepdims=True)
  v = ((h - m) ** 2).mean(axes, keepdims=True)
  return (h - m) / jnp.sqrt(v + eps) * g + b


def xs(*shape, seed=0):
  return jnp.asarray(np.random.default_rng([seed, *shape]).standard_normal(shape), F64)


def ids(b, t, seed=1, dtype=jnp.int32):
  return jnp.asarray(np.random.default_rng([seed, b, t]).integers(0, V, (b, t)), dtype)


def dense(p, x):
  return x @ p["w"] + p["b"]


BASE = dict(w=(4, D), b=(D,), g=(D,), be=(D,), v=(D, 3))
GPT = dict(wte=(V, D), wpe=(T, D), g=(D,), be=(D,), g2=(D,), be2=(D,), q=(D, D), k=(D, D), vv=(D, D), o=(D, D),
           head=(D, V))


# ----------------------------------------------------------------------------
# Programs that take shapes from their inputs.


def _attn(p, h):
  t = h.shape[1]
  s = jnp.einsum("btd,bsd->bts", h @ p["q"], h @ p["k"]) / np.sqrt(D)
  s = jnp.where(jnp.tril(jnp.ones((t, t))) > 0, s, -1e9)
  return jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), h @ p["vv"]) @ p["o"]


def _embed(p, x, t=None):
  t = x.shape[1] if t is None else t
  return p["wte"][x] + p["wpe"][:t]


def _gpt(p, x):
  h = _embed(p, x)
  h = h + _attn(p, ln(h, p["g"], p["be"]))
  return ln(h, p["g2"], p["be2"]) @ p["head"]


def _gpt_tied(p, x):
  h = _embed(p, x)
  h = h + _attn(p, ln(h, p["g"], p["be"]))
  return ln(h, p["g2"], p["be2"]) @ p["wte"].T


def _tied_when_long(p, x):
  h = ln(p["wte"][x], p["g"], p["be"])
  return h @ p["wte"].T if x.shape[1] > 4 else h @ p["head"]   # the table is the head at t > 4 only


def _gpt_padded(p, x):
  t = x.shape[1]
  tp = -(-t // 4) * 4                     # padded to a multiple of 4
  h = _embed(p, jnp.pad(x, ((0, 0), (0, tp - t))))
  h = h + _attn(p, ln(h, p["g"], p["be"]))
  return (ln(h, p["g2"], p["be2"]) @ p["head"])[:, :t]


def _gpt_branch(p, x):
  h = _embed(p, x)
  if x.shape[1] > 4:                     # attention at long sequences only
    h = h + _attn(p, ln(h, p["g"], p["be"]))
  else:
    h = h + ln(h, p["g"], p["be"]) @ p["o"]
  return ln(h, p["g2"], p["be2"]) @ p["head"]


def _h_out_when_long(p, x):
  h = dense(p, x)
  y = ln(h, p["g"], p["be"]) @ p["v"]
  return (y, h) if x.shape[1] > 4 else y        # h itself an output: its centering shows


def _axes_by_batch(p, x):
  axes = (0, -1) if x.shape[0] > 2 else (-1,)     # a norm over the batch too: a per-row shift shows
  return ln(dense(p, x), p["g"], p["be"], axes) @ p["v"]


def _sum_over_tokens_count(p, x):
  """A "mean" dividing by the token count: a LayerNorm only where t == D."""
  h = dense(p, x)
  n = h.shape[1]
  m = h.sum(-1, keepdims=True) / n
  return (h - m) * lax.rsqrt(((h - m) ** 2).sum(-1, keepdims=True) / n + 1e-5) * p["g"] + p["be"]


def _sliced_width(p, x):
  """The first min(t, D) features (a width set by the length)."""
  k = min(x.shape[1], D)
  return ln(x @ p["w"][:, :k] + p["b"][:k], p["g"][:k], p["be"][:k]) @ p["v"][:k]


def _rolled(p, x):
  return ln(jnp.roll(dense(p, x), x.shape[1], axis=-1), p["g"], p["be"]) @ p["v"]


def _tiled(p, x):
  t = x.shape[1]
  return ln(jnp.tile(dense(p, x), (1, 1, t)), jnp.tile(p["g"], t), jnp.tile(p["be"], t)) @ jnp.tile(p["v"], (t, 1))


def _w_or_wt(p, x):
  w = p["w"] if x.shape[0] == 1 else p["w"].T    # (D, D): the output axis moves with the batch
  return ln(x @ w + p["b"], p["g"], p["be"]) @ p["v"]


def _w_and_wt(p, x):
  y = ln(x @ p["w"] + p["b"], p["g"], p["be"]) @ p["v"]
  return y + (x @ p["w"].T)[..., :3] if x.shape[0] > 1 else y


def _decode_step(p, tok, pos, kc, vc):
  """One step with a KV cache written at a traced position: prefill, then decode."""
  t = tok.shape[1]
  h = p["wte"][tok] + lax.dynamic_slice_in_dim(p["wpe"], pos, t)
  a = ln(h, p["g"], p["be"])
  kc = lax.dynamic_update_slice_in_dim(kc, a @ p["k"], pos, 1)
  vc = lax.dynamic_update_slice_in_dim(vc, a @ p["vv"], pos, 1)
  s = jnp.einsum("btd,bsd->bts", a @ p["q"], kc) / np.sqrt(D)
  s = jnp.where(jnp.arange(kc.shape[1])[None, :] <= (pos + jnp.arange(t))[:, None], s, -1e9)
  h = h + jnp.einsum("bts,bsd->btd", jax.nn.softmax(s), vc) @ p["o"]
  return ln(h, p["g2"], p["be2"]) @ p["head"], kc, vc


def _scan_layers(p, x):
  """Stacked layer parameters (a size-1 layer axis when L == 1) under scan."""
  h = x @ p["wi"] + p["bi"]

  def body(h, q):
    w1, b1, w2, b2, g, be = q
    return h + jax.nn.gelu(ln(h, g, be) @ w1 + b1) @ w2 + b2, None
  h, _ = lax.scan(body, h, (p["w1"], p["b1"], p["w2"], p["b2"], p["gl"], p["bel"]))
  return ln(h, p["g"], p["be"]) @ p["v"]


def _stacked(n):
  return dict(wi=(4, D), bi=(D,), w1=(n, D, 9), b1=(n, 9), w2=(n, 9, D), b2=(n, D), gl=(n, D), bel=(n, D),
              g=(D,), be=(D,), v=(D, 3))


def _dict_input(p, inp):
  h = inp["x"] @ p["w"] + p["b"]
  if inp.get("extra") is not None:
    h = h + inp["extra"] @ p["w2"]
  return {"y": (ln(h, p["g"], p["be"]) @ p["v"]) * inp["scale"], "n": inp["x"].shape[0]}


def _din(b, t, extra=True, seed=2):
  d = {"x": xs(b, t, 4, seed=seed), "scale": jnp.asarray(2.0)}
  if extra:
    d["extra"] = xs(b, t, 5, seed=seed + 1)
  return d


def _optional_mask(p, x, mask):
  h = dense(p, x)
  if mask is not None:
    h = h * mask[..., None]
  return ln(h, p["g"], p["be"]) @ p["v"]


def _onehot_or_ids(p, x):
  oh = jax.nn.one_hot(x, V) if jnp.issubdtype(x.dtype, jnp.integer) else x
  return ln(oh @ p["wte"], p["g"], p["be"]) @ p["v"]


def _rounded_to_input_dtype(p, x):
  return ln(dense(p, x).astype(x.dtype), p["g"], p["be"]) @ p["v"]


_MESH = Mesh(np.array(jax.devices()[:1]), ("d",))


def _sharding_constraint(p, x):
  h = lax.with_sharding_constraint(dense(p, x), NamedSharding(_MESH, PS("d")))
  return ln(h, p["g"], p["be"]) @ p["v"]


def _shard_map_side_output(p, x):
  h = dense(p, x)
  side = jax.shard_map(lambda h: h.sum(-1, keepdims=True), mesh=_MESH, in_specs=PS("d"), out_specs=PS("d"))(h)
  return ln(h, p["g"], p["be"]) @ p["v"], side


def _axis_one(p, x):
  return ln(dense(p, x), p["g"], p["be"], axes=(1,)) @ p["v"]   # the tokens at rank 3, the features at rank 2


def _pure_callback_side_output(p, x):
  h = dense(p, x)
  s = jax.pure_callback(lambda h: np.asarray(h).sum(-1), jax.ShapeDtypeStruct(h.shape[:-1], h.dtype), h)
  return ln(h, p["g"], p["be"]) @ p["v"], s


def _last_two_axes(h, g, b):
  r = h.reshape(h.shape[:-1] + (2, D // 2))
  n = (r - r.mean((-2, -1), keepdims=True)) * lax.rsqrt(jnp.var(r, (-2, -1), keepdims=True) + 1e-5)
  return n.reshape(h.shape) * g + b


def _swapped(h, g, b):
  ht = jnp.swapaxes(h, -1, -2)                      # normalized along axis -2
  m = ht.mean(-2, keepdims=True)
  n = (ht - m) / jnp.sqrt(((ht - m) ** 2).mean(-2, keepdims=True) + 1e-5)
  return jnp.swapaxes(n, -1, -2) * g + b


def _ones_mean(h, g, b):
  ones = jnp.ones((h.shape[-1], 1))
  c = h - (h @ ones) / h.shape[-1]
  return c * lax.rsqrt((c * c) @ ones / h.shape[-1] + 1e-5) * g + b


def _keras(h, g, b):
  m = jnp.mean(h, -1, keepdims=True)
  inv = lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) - jnp.square(m) + 1e-5) * g
  return h * inv + (-m * inv + b)


def _distributed(h, g, b):
  r = lax.rsqrt(jnp.var(h, -1, keepdims=True) + 1e-5)
  return (h * r - h.mean(-1, keepdims=True) * r) * g + b


def _var_twice(h, g, b):
  r1, r2 = (lax.rsqrt(jnp.var(h, -1, keepdims=True) + 1e-5) for _ in range(2))
  return (h * r1 - h.mean(-1, keepdims=True) * r2) * g + b


def _sum_div_shape(h, g, b):
  m = h.sum(-1, keepdims=True) / h.shape[-1]
  return (h - m) / jnp.sqrt(((h - m) ** 2).sum(-1, keepdims=True) / h.shape[-1] + 1e-5) * g + b


SPELLINGS = {
    "keras": _keras, "distributed, one var": _distributed, "last two axes": _last_two_axes,
    "axis -2 after swapaxes": _swapped, "mean as a product with ones((n, 1))": _ones_mean,
    "sum / h.shape[-1]": _sum_div_shape,
    "axis=h.ndim-1": lambda h, g, b: ln(h, g, b, axes=(h.ndim - 1,)),
    "eps from a size": lambda h, g, b: ln(h, g, b, eps=1e-5 * h.shape[0]),
}


def _spelled(norm):
  return lambda p, x: norm(dense(p, x), p["g"], p["be"]) @ p["v"]


def _tok(*shapes, seed=1):
  return [(xs(*s, seed=seed),) for s in shapes]


def _ids(*shapes, dtype=jnp.int32):
  return [(ids(*s, dtype=dtype),) for s in shapes]


TOK_CALLS = ((3, 7, 4), (2, 1, 4), (5, 4), (0, 3, 4), (2, 0, 4))


def _kv(b):
  return xs(b, T, D, seed=3)


# name: (fn, param shapes, example args, later calls' args, folded, indices of the later calls that refuse)
CASES = {
    "gpt: wte[x] + wpe[:t], tril mask, at (1, 1)": (
        _gpt, GPT, lambda: (ids(1, 1),), lambda: _ids((4, 7), (1, 5), (3, 1), (2, T), (0, 3), (2, 0)), 2, ()),
    "gpt at (2, 5)": (_gpt, GPT, lambda: (ids(2, 5),), lambda: _ids((4, 7), (1, 1), (3, 1)), 2, ()),
    "gpt, tied head": (_gpt_tied, GPT, lambda: (ids(1, 1),), lambda: _ids((4, 7), (1, 5)), 2, ()),
    # the example never reads the table as a head: it is centered in place, and t > 4 refuses
    "tied head at t > 4 only, example t = 2": (_tied_when_long, GPT, lambda: (ids(1, 2),),
                                               lambda: _ids((3, 7), (2, 3)), 1, (0,)),
    "tied head at t > 4 only, example t = 7": (_tied_when_long, GPT, lambda: (ids(1, 7),),
                                               lambda: _ids((3, 2), (2, 9)), 1, ()),
    "gpt, padded to a multiple of 4": (_gpt_padded, GPT, lambda: (ids(1, 1),),
                                       lambda: _ids((4, 7), (1, 5), (2, 8), (1, 4)), 2, ()),
    "gpt, attention only at t > 4, example t = 2": (_gpt_branch, GPT, lambda: (ids(2, 2),),
                                                    lambda: _ids((4, 7), (1, 5), (2, 1)), 2, ()),
    "gpt, attention only at t > 4, example t = 7": (_gpt_branch, GPT, lambda: (ids(2, 7),),
                                                    lambda: _ids((4, 3), (1, 5), (2, 1)), 2, ()),
    "gpt, int64 and uint8 ids": (_gpt, GPT, lambda: (ids(1, 1),),
                                 lambda: _ids((3, 7), dtype=jnp.int64) + _ids((2, 3), dtype=jnp.uint8), 2, ()),
    "prefill then decode with a KV cache": (
        _decode_step, GPT, lambda: (ids(1, 5), jnp.asarray(0), _kv(1), _kv(1)),
        lambda: [(ids(1, 1), jnp.asarray(5), _kv(1), _kv(1)), (ids(3, 1), jnp.asarray(9), _kv(3), _kv(3))], 2, ()),
    "h an output at t > 4 only, example t = 2": (_h_out_when_long, BASE, lambda: (xs(2, 2, 4),),
                                                 lambda: _tok((3, 7, 4), (1, 3, 4)), 1, (0,)),
    "h an output at t > 4 only, example t = 7": (_h_out_when_long, BASE, lambda: (xs(2, 7, 4),),
                                                 lambda: _tok((3, 3, 4), (1, 5, 4)), 0, ()),
    "norm over the batch too at batch > 2": (_axes_by_batch, BASE, lambda: (xs(1, 3, 4),),
                                             lambda: _tok((4, 3, 4), (2, 3, 4)), 1, (0,)),
    "mean = sum / t, t == D at the example": (_sum_over_tokens_count, BASE, lambda: (xs(1, D, 4),),
                                              lambda: _tok((3, 7, 4), (2, 1, 4), (2, D, 4)), 1, (0, 1)),
    # one feature at the example, two at its probe: the probe's centering in
    # blocks of 2 folded nothing at the example and refused (3, 7) and (2, 3)
    "width sliced by the length, example (1, 1)": (_sliced_width, BASE, lambda: (xs(1, 1, 4),),
                                                   lambda: _tok((3, 7, 4), (2, 3, 4), (2, 2, 4)), 0, ()),
    # centering all D columns is a constant shift on any prefix of them
    "width sliced by the length, example (2, D)": (_sliced_width, BASE, lambda: (xs(2, D, 4),),
                                                   lambda: _tok((3, 7, 4), (2, 3, 4), (1, 1, 4)), 1, ()),
    "features rolled by the length": (_rolled, BASE, lambda: (xs(2, 1, 4),), lambda: _tok((3, 7, 4), (1, 6, 4)),
                                      1, ()),
    "features tiled by the length": (_tiled, BASE, lambda: (xs(1, 1, 4),), lambda: _tok((3, 7, 4), (2, 2, 4)),
                                     1, ()),
    "W at batch 1, W.T above": (_w_or_wt, dict(BASE, w=(D, D)), lambda: (xs(2, 3, D),),
                                lambda: _tok((1, 5, D), (3, 7, D)), 1, (0,)),
    "W at batch 1, W.T above, example batch 1": (_w_or_wt, dict(BASE, w=(D, D)), lambda: (xs(1, 3, D),),
                                                 lambda: _tok((2, 5, D), (3, 7, D)), 0, ()),
    "W and, above batch 1, W.T": (_w_and_wt, dict(BASE, w=(D, D)), lambda: (xs(1, 3, D),),
                                  lambda: _tok((2, 5, D), (3, 7, D), (1, 1, D)), 1, ()),
    "stacked layers under scan, L = 1": (_scan_layers, _stacked(1), lambda: (xs(1, 1, 4),),
                                         lambda: _tok((3, 7, 4), (2, 1, 4), (0, 4)), 2, ()),
    "stacked layers under scan, L = 3": (_scan_layers, _stacked(3), lambda: (xs(1, 1, 4),),
                                         lambda: _tok((3, 7, 4), (2, 1, 4)), 2, ()),
    "parameters with size-1 axes": (
        lambda p, x: ln(x @ p["w"] + p["b"], p["g"], p["be"]) @ p["v"],
        dict(w=(1, 4, D), b=(1, 1, D), g=(1, D), be=(D,), v=(D, 3)), lambda: (xs(1, 1, 4),),
        lambda: _tok((3, 7, 4), (2, 1, 4)), 1, ()),
    "a dict input, optional entry present": (_dict_input, dict(BASE, w2=(5, D)), lambda: (_din(1, 1),),
                                             lambda: [(_din(3, 7),), (_din(2, 1, False),)], 1, ()),
    "a dict input, optional entry absent": (_dict_input, dict(BASE, w2=(5, D)), lambda: (_din(1, 1, False),),
                                            lambda: [(_din(3, 7),), (_din(2, 1, False),)], 1, ()),
    "a None positional, then a mask": (_optional_mask, BASE, lambda: (xs(1, 2, 4), None),
                                       lambda: [(xs(3, 7, 4), jnp.full((3, 7), 0.5)), (xs(2, 1, 4), None)], 1, ()),
    "one-hot floats or int ids": (_onehot_or_ids, dict(wte=(V, D), g=(D,), be=(D,), v=(D, 3)),
                                  lambda: (ids(1, 1),), lambda: [(ids(3, 7),), (jax.nn.one_hot(ids(2, 3), V) * 1.5,)],
                                  1, ()),
    "h rounded to the input's dtype, called in float32": (
        _rounded_to_input_dtype, BASE, lambda: (xs(2, 3, 4),),
        lambda: [(xs(3, 5, 4).astype(jnp.float32),), (xs(1, 1, 4),)], 1, (0,)),
    "with_sharding_constraint": (_sharding_constraint, BASE, lambda: (xs(1, 1, 4),), lambda: _tok((3, 7, 4)), 1, ()),
    "norm axis 1 hard-coded, example of rank 2": (_axis_one, BASE, lambda: (xs(1, 4),),
                                                  lambda: _tok((3, 4), (3, 7, 4), (2, 1, 4)), 1, (1,)),
    "a side output through pure_callback": (_pure_callback_side_output, BASE, lambda: (xs(1, 1, 4),),
                                            lambda: _tok((3, 7, 4)), 0, ()),
    # the side output inside the shard_map sums the features: it sees the shift, so nothing folds
    "a side output through shard_map": (_shard_map_side_output, BASE, lambda: (xs(1, 1, 4),),
                                        lambda: _tok((3, 7, 4)), 0, ()),
    # not recognised (the variance is a scan's carry): nothing folds
    "a Welford scan": (_spelled(spellings.welford_style), BASE, lambda: (xs(1, 1, 4),), lambda: _tok((3, 7, 4)), 0, ()),
    # two computations of one variance are one symbol (see the docstring)
    "the variance computed twice": (_spelled(_var_twice), BASE, lambda: (xs(2, 3, 4),),
                                    lambda: _tok((3, 7, 4)), 1, ()),
    **{f"spelling: {k}": (_spelled(f), BASE, lambda: (xs(1, 1, 4),), lambda: _tok(*TOK_CALLS), 1, ())
       for k, f in SPELLINGS.items()},
}


EAGER = {"a side output through shard_map"}   # np_eval cannot bind shard_map


def _outcome(name):
  """(folded, refused calls); asserts the folded function equals the original
  at the example and at every later call that does not refuse."""
  fn, shapes, example, calls, _, _ = CASES[name]
  p = make_params(0, **shapes)
  ex = example()
  fo = jaxfold.fold(p, fn, *ex)
  run = (lambda f, *a: f(*a)) if name in EAGER else np_eval.run
  refused = []
  for k, a in enumerate([ex] + calls()):
    want = run(fn, p, *a)
    try:
      got = run(fo.apply_fn, fo.params, *a)
    except jaxfold.FoldError as e:
      assert k and "need different folded parameters" in str(e), str(e)
      assert str(tuple(np.shape(jax.tree_util.tree_leaves(a)[0]))) in str(e), str(e)
      refused.append(k - 1)
      continue
    assert rel_err(want, got) < 1e-9, (name, k)
  return fo.report.num_folded, tuple(refused)


@pytest.mark.parametrize("name", list(CASES))
def test_program_at_other_shapes(x64, name):
  assert _outcome(name) == CASES[name][4:]


def test_a_refusal_at_the_examples_shapes_in_another_dtype_names_the_dtypes(x64):
  """It said "inputs of these shapes ((2, 3, 4)) need different folded
  parameters than the example that fold() was given ((2, 3, 4))"."""
  p = make_params(0, **BASE)
  fo = jaxfold.fold(p, _rounded_to_input_dtype, xs(2, 3, 4))
  with pytest.raises(jaxfold.FoldError, match=r"shapes and dtypes \(\(2, 3, 4\) float32\) need different folded "
                     r"parameters than the example that fold\(\) was given \(\(2, 3, 4\) float64\)"):
    fo.apply_fn(fo.params, xs(2, 3, 4).astype(jnp.float32))


# ----------------------------------------------------------------------------
# One fold through JAX transformations, at every shape.

SM = dict(wi=(4, D), bi=(D,), g1=(D,), be1=(D,), w1=(D, 9), b1=(9,), w2=(9, D), b2=(D,), g2=(D,), be2=(D,),
          wo=(D, 3), bo=(3,))


def _model(p, x, *, k=1):
  h = x @ p["wi"] + p["bi"]
  h = h + jax.nn.gelu(ln(h, p["g1"], p["be1"]) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
  y = ln(h, p["g2"], p["be2"]) @ p["wo"] + p["bo"]
  return y * 2.0 if isinstance(k, bool) else y    # a branch on the static value's type


def _stack(x):
  return jnp.stack([x, -2 * x])


TRANSFORMS = {
    "jit": lambda f, p, x, kw: jax.jit(lambda p, x: f(p, x, **kw))(p, x),
    "vmap": lambda f, p, x, kw: jax.vmap(lambda x: f(p, x, **kw))(_stack(x)),
    "vmap over axis 1": lambda f, p, x, kw: jax.vmap(lambda x: f(p, x, **kw), 1, 1)(_stack(x)),
    "vmap over scaled params": lambda f, p, x, kw: jax.vmap(
        lambda s: f(jax.tree_util.tree_map(lambda q: q * s, p), x, **kw))(jnp.array([1.0, -0.5])),
    "grad x": lambda f, p, x, kw: jax.grad(lambda x: jnp.sum(jnp.sin(f(p, x, **kw))))(x),
    "jacfwd": lambda f, p, x, kw: jax.jacfwd(lambda x: f(p, x, **kw))(x),
    "hessian": lambda f, p, x, kw: jax.hessian(lambda x: jnp.sum(jnp.sin(f(p, x, **kw))))(x),
    "linearize": lambda f, p, x, kw: jax.linearize(lambda x: f(p, x, **kw), x)[1](jnp.cos(x)),
    "scan": lambda f, p, x, kw: lax.scan(lambda c, x: (c + f(p, x, **kw).sum(), f(p, x, **kw)), 0.0, _stack(x)),
    "fori_loop": lambda f, p, x, kw: lax.fori_loop(0, 3, lambda i, c: c + f(p, x * i, **kw),
                                                   jnp.zeros(x.shape[:-1] + (3,))),
    "checkpoint": lambda f, p, x, kw: jax.checkpoint(lambda x: f(p, x, **kw))(x),
    "cond": lambda f, p, x, kw: lax.cond(x.size > 0, lambda x: f(p, x, **kw), lambda x: -f(p, x, **kw), x),
    "eval_shape": lambda f, p, x, kw: jnp.zeros(jax.eval_shape(lambda x: f(p, x, **kw), x).shape),
    "jit, sharded": lambda f, p, x, kw: jax.jit(
        lambda p, x: f(p, x, **kw), in_shardings=(NamedSharding(_MESH, PS()), NamedSharding(_MESH, PS("d"))),
        out_shardings=NamedSharding(_MESH, PS("d")))(p, x),
}
SMALL = [(1, 1, 4), (3, 7, 4), (2, 1, 4)]
SHAPES = SMALL + [(0, 4), (2, 0, 4), (5, 4), (4,)]
# the derivatives' outputs grow with the input's size; vmapping axis 1 needs rank 2
_SHAPES = {"jacfwd": SMALL, "hessian": SMALL[:2], "vmap over axis 1": SHAPES[:-1]}


def _run(transform, f, p, x):
  """The transformed call, traced once and run by np_eval (no XLA compile per op)."""
  return np_eval.run(lambda p, x: TRANSFORMS[transform](f, p, x, {}), p, x)


def _transformed(p, how):
  """``(params, apply_fn)`` of one transform of _model, folded at batch 1 × one token."""
  if how == "cbwc":
    return p, jaxfold.cbwc(p, _model, xs(1, 1, 4), example_kwargs={"k": 1}).apply_fn
  fo = jaxfold.fold(p, _model, xs(1, 1, 4), example_kwargs={"k": 1})
  assert fo.report.num_folded == 2
  q = np.linalg.qr(np.random.default_rng(0).normal(size=(D, D)))[0]
  r = {"fold": lambda: fo, "fuse": lambda: jaxfold.fuse_affine(fo), "defer": lambda: jaxfold.defer_norms(fo),
       "rotate": lambda: jaxfold.rotate(jaxfold.defer_norms(fo), q)}[how]()
  return r.params, r.apply_fn


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_one_fold_through_transformations(x64, transform):
  """Folded at (1, 1, 4); called at other shapes and ranks under each transformation."""
  p = make_params(1, **SM)
  fp, f = _transformed(p, "fold")
  for shape in _SHAPES.get(transform, SHAPES):
    x = xs(*shape, seed=8)
    assert rel_err(_run(transform, _model, p, x), _run(transform, f, fp, x)) < 1e-9, shape


@pytest.mark.parametrize("how", ["fuse", "defer", "rotate", "cbwc"])
def test_every_transform_through_transformations(x64, how):
  p = make_params(1, **SM)
  fp, f = _transformed(p, how)
  for name in ("jit", "vmap", "grad x", "scan"):
    for shape in SHAPES:
      x = xs(*shape, seed=8)
      assert rel_err(_run(name, _model, p, x), _run(name, f, fp, x)) < 1e-9, (name, shape)


@pytest.mark.parametrize("how", ["fold", "fuse", "defer", "cbwc"])
def test_static_keyword_values_of_equal_hash_are_not_one_analysis(x64, how):
  """k=1 and k=True (and 1.0) are equal and hash alike; a program branching on
  the type computed k=1's branch for k=True (rel. error 0.5): the cache key
  compared the static values with == alone."""
  p = make_params(1, **SM)
  fp, f = _transformed(p, how)
  for k in (1, True, 1.0, False, 0):
    for shape in [(1, 1, 4), (3, 7, 4)]:
      x = xs(*shape, seed=9)
      assert rel_err(_model(p, x, k=k), np_eval.run(lambda q, x, k=k: f(q, x, k=k), fp, x)) < 1e-9, (k, shape)


def _take_first(p, x, *, n=2):
  y = ln(dense(p, x), p["g"], p["be"]) @ p["v"]
  return y[..., : n] if isinstance(n, int) else y / n


def test_a_static_float_is_not_the_int_it_equals(x64):
  """n=2.0 reused n=2's analysis: outputs of the wrong shape (slice, not divide)."""
  p = make_params(0, **BASE)
  fo = jaxfold.fold(p, _take_first, xs(2, 4), example_kwargs={"n": 2})
  for n in (2, 2.0, True, 2):
    x = xs(3, 4, seed=n is True)
    got = fo.apply_fn(fo.params, x, n=n)
    assert rel_err(_take_first(p, x, n=n), got) < 1e-9, n


# ----------------------------------------------------------------------------
# Keras 3 and keras-hub, folded at batch 1 × one token.


def _keras(request):
  os.environ.setdefault("KERAS_BACKEND", "jax")
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip("keras runs on another backend")
  request.getfixturevalue("keras_float64")
  sys.path.insert(0, str(Path(__file__).parents[1] / "test_frameworks"))   # keras_util, keras_models
  return keras


def _keras_gpt(keras):
  from keras_util import random_init
  L, dt = keras.layers, "float64"

  class Positions(L.Layer):
    def build(self, shape):
      self.table = self.add_weight(shape=(T, 8), dtype=dt)

    def call(self, h):
      return h + self.table[: keras.ops.shape(h)[1]]

    def compute_output_shape(self, shape):
      return shape

  with random_init(3):
    x = keras.Input((None,), dtype="int32")
    h = Positions(dtype=dt)(L.Embedding(13, 8, dtype=dt)(x))
    a = L.LayerNormalization(dtype=dt)(h)
    h = h + L.MultiHeadAttention(2, 4, dtype=dt)(a, a, use_causal_mask=True)
    return keras.Model(x, L.Dense(5, dtype=dt)(L.LayerNormalization(center=False, dtype=dt)(h)))


@pytest.mark.slow
def test_keras_causal_model_folded_at_one_token(request):
  """Embedding + positions sliced by length + causal MHA, folded at (1, 1)."""
  keras = _keras(request)
  params, f = jaxfold.keras_params(_keras_gpt(keras))
  tok = lambda b, t: np.random.default_rng(b * 10 + t).integers(0, 13, (b, t)).astype("int32")
  fo = jaxfold.fold(params, f, tok(1, 1))
  assert (fo.report.num_sites, fo.report.num_folded) == (2, 2)
  for b, t in [(1, 1), (3, 7), (2, 1), (1, T)]:
    assert rel_err(f(params, tok(b, t)), fo.apply_fn(fo.params, tok(b, t))) < 1e-9, (b, t)
  x = tok(3, 7)
  assert rel_err(jax.vmap(lambda r: f(params, r))(x[:, None]),
                 jax.vmap(lambda r: fo.apply_fn(fo.params, r))(x[:, None])) < 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "whisper"])
def test_keras_hub_backbone_folded_at_one_token(request, name):
  _keras(request)
  pytest.importorskip("keras_hub")
  import keras_models as km
  from keras_checks import cast_inputs
  model, inputs = km.build(name, "float64", seed=len(name))
  params, f = jaxfold.keras_params(model)
  fo = jaxfold.fold(params, f, cast_inputs(inputs(1, 1), "float64"))
  assert (fo.report.num_folded, fo.report.num_auxiliary) == km.BACKBONES[name][3:5]
  for b, s in ((1, 1), (3, 7), (2, 1), (1, 4)):
    x = cast_inputs(inputs(b, s), "float64")
    assert rel_err(f(params, x), fo.apply_fn(fo.params, x)) < 1e-9, (b, s)


# ----------------------------------------------------------------------------
# Threads: a folded apply_fn called at new shapes from a thread pool.


def test_factor_tables_are_not_shared_by_concurrent_analyses():
  """Two threads interning factors at once got the same id for different keys
  (``len(_FACTORS)`` read before the other's append): one value's symbol named
  another's, so a cancellation could be decided on the wrong terms. A scope
  is now one thread's at a time."""
  from jaxfold._src import algebra as A
  switch = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)
  wrong = []

  def intern(tid):
    with A.scope():
      for i in range(5000):
        (m,), = A.atom((tid, i), (3,)).terms
        if A.factor(m).key != (tid, i):
          wrong.append((tid, i))
          return
  try:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      list(pool.map(intern, range(4)))
  finally:
    sys.setswitchinterval(switch)
  assert not wrong


def test_folded_apply_fn_at_new_shapes_from_threads(x64):
  p = make_params(1, **SM)
  fo = jaxfold.fold(p, _model, xs(1, 1, 4))
  shapes = [(2, 5, 4), (3, 2, 4), (5, 4), (0, 4)]

  def call(shape):
    x = xs(*shape, seed=4)
    return rel_err(np_eval.run(_model, p, x), np_eval.run(fo.apply_fn, fo.params, x))
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    assert max(pool.map(call, shapes)) < 1e-9
