"""Property tests: random small programs, folded == original, nothing visible.

Hypothesis draws programs from a small grammar (dense/conv producers, residual
sums, LayerNorm/GroupNorm in several formulations, nonlinearities, concats,
tied weights, extra outputs). For each program we check, in float64:

* the folded program equals the original at the traced parameters and at
  inputs of another shape;
* CBWC (which centers inside the forward pass) equals the original at
  *other* random parameters;
* every centering the plan chose is invisible: adding an arbitrary shift that
  is constant over the centered axes to that parameter leaves every output
  unchanged. A wrong fold cannot pass this.
"""

import jax
import jax.numpy as jnp
import pytest
from conftest import rel_err, x64_context
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxfold

F64 = jnp.float64
D = 8


def layer_norm(h, g, b, style, axes=(-1,)):
  if style == "fast":
    mu = h.mean(axes, keepdims=True)
    var = jnp.maximum(0.0, (h * h).mean(axes, keepdims=True) - mu * mu)
    return (h - mu) * jax.lax.rsqrt(var + 1e-5) * g + b
  if style == "two_pass":
    c = h - h.mean(axes, keepdims=True)
    return c / jnp.sqrt((c ** 2).mean(axes, keepdims=True) + 1e-6) * g + b
  if style == "jnp_var":
    return (h - jnp.mean(h, axes, keepdims=True)) * jax.lax.rsqrt(jnp.var(h, axes, keepdims=True) + 1e-5) * g + b
  raise ValueError(style)


OPS = ["preln_mlp", "postln", "dense_on_stream", "gelu_on_stream", "concat_seq",
       "groupnorm_per_pos", "groupnorm_spatial", "token_scale", "ln_formula"]


@st.composite
def programs(draw):
  ops = draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=4))
  styles = draw(st.lists(st.sampled_from(["fast", "two_pass", "jnp_var"]), min_size=len(ops) + 2,
                         max_size=len(ops) + 2))
  start = draw(st.sampled_from(["embed", "dense", "embed_ln", "conv"]))
  tied = draw(st.booleans()) and start in ("embed", "embed_ln")
  extra_output = draw(st.booleans())
  final_ln = draw(st.booleans())
  return dict(ops=ops, styles=styles, start=start, tied=tied, extra=extra_output, final=final_ln)


def build(prog):
  """Returns (init(key) -> params, apply(params, x))."""
  shapes = {"emb": (20, D), "pos": (6, D), "w_in": (3, D), "b_in": (D,), "conv": (2, 3, D)}
  for i in range(len(prog["ops"])):
    shapes[f"w1_{i}"] = (D, 2 * D)
    shapes[f"b1_{i}"] = (2 * D,)
    shapes[f"w2_{i}"] = (2 * D, D)
    shapes[f"b2_{i}"] = (D,)
    shapes[f"g_{i}"] = (D,)
    shapes[f"be_{i}"] = (D,)
    shapes[f"ws_{i}"] = (D, 1)
  for k in ("g_e", "be_e", "g_f", "be_f"):
    shapes[k] = (D,)
  shapes["head"] = (D, 5)

  def init(key):
    keys = jax.random.split(key, len(shapes))
    return {k: jax.random.normal(kk, s, F64) for kk, (k, s) in zip(keys, sorted(shapes.items()))}

  def apply(p, x):
    ids, feats = x
    st_ = prog["styles"]
    if prog["start"] in ("embed", "embed_ln"):
      h = p["emb"][ids] + p["pos"][: ids.shape[1]]
      if prog["start"] == "embed_ln":
        h = layer_norm(h, p["g_e"], p["be_e"], st_[-1])
    elif prog["start"] == "dense":
      h = feats @ p["w_in"] + p["b_in"]
    else:  # a 1-D conv over the sequence
      h = jax.lax.conv_general_dilated(feats, p["conv"], (1,), "SAME",
                                       dimension_numbers=("NWC", "WIO", "NWC")) + p["b_in"]
    outs = []
    for i, op in enumerate(prog["ops"]):
      g, b = p[f"g_{i}"], p[f"be_{i}"]
      mlp = lambda z, i=i: jax.nn.gelu(z @ p[f"w1_{i}"] + p[f"b1_{i}"]) @ p[f"w2_{i}"] + p[f"b2_{i}"]
      if op == "preln_mlp":
        h = h + mlp(layer_norm(h, g, b, st_[i]))
      elif op == "postln":
        h = layer_norm(h + mlp(h), g, b, st_[i])
      elif op == "dense_on_stream":
        h = h @ p[f"w2_{i}"][:D] + p[f"b2_{i}"]
      elif op == "gelu_on_stream":
        h = jax.nn.gelu(h)
      elif op == "concat_seq":
        h = jnp.concatenate([h[:, :1], h[:, 1:] + mlp(layer_norm(h[:, 1:], g, b, st_[i]))], axis=1)
      elif op == "groupnorm_per_pos":
        hh = h.reshape(h.shape[:-1] + (2, D // 2))
        n = layer_norm(hh, 1.0, 0.0, st_[i]).reshape(h.shape) * g + b
        h = h + mlp(n)
      elif op == "groupnorm_spatial":  # statistics over (sequence, channels in group)
        hh = h.reshape(h.shape[:-1] + (2, D // 2))
        n = layer_norm(hh, 1.0, 0.0, st_[i], axes=(1, 3)).reshape(h.shape) * g + b
        h = h + mlp(n)
      elif op == "token_scale":
        h = h * jax.nn.sigmoid(h.mean(-1, keepdims=True) * 0 + feats[..., :1] @ jnp.ones((1, 1)))
      elif op == "ln_formula":
        outs.append(layer_norm(h, g, b, st_[i]))
    stream = h
    if prog["final"]:
      h = layer_norm(h, p["g_f"], p["be_f"], st_[-2])
    out = h @ (p["emb"].T if prog["tied"] else p["head"])
    res = [out] + outs
    if prog["extra"]:  # exposes the residual stream itself
      res.append(stream)
    return res

  return init, apply


def inputs(seed, b, t):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return (jax.random.randint(k1, (b, t), 0, 20), jax.random.normal(k2, (b, t, 3), F64))


def shift_along(key, shape, spec):
  """A random tensor constant over each joint block of ``spec``."""
  spec = dict(spec)
  small = []
  for d, s in enumerate(shape):
    small.append(s // spec[d] if d in spec else s)
  r = jax.random.normal(key, small, F64)
  for d, b in spec.items():
    r = jnp.repeat(r, b, axis=d)
  return r


def check_program(prog, aux):
  with x64_context():
    init, apply = build(prog)
    p = init(jax.random.PRNGKey(0))
    x = inputs(1, 2, 5)
    f = jaxfold.fold(p, apply, *[x], auxiliary_centering=aux)
    ref = jax.jit(apply)
    assert rel_err(ref(p, x), f.apply_fn(f.params, x)) < 1e-9
    y = inputs(2, 3, 4)
    assert rel_err(ref(p, y), f.apply_fn(f.params, y)) < 1e-9
    # CBWC at parameters the analysis never saw.
    r = jaxfold.cbwc(p, apply, x, auxiliary_centering=aux)
    q = init(jax.random.PRNGKey(7))
    assert rel_err(ref(q, x), r.apply_fn(q, x)) < 1e-9
    # Every centering is invisible: any shift constant over its axes.
    leaves, tree = jax.tree_util.tree_flatten(p)
    for i, spec in r.leaf_specs:
      shifted = list(leaves)
      shifted[i] = leaves[i] + shift_along(jax.random.PRNGKey(i), leaves[i].shape, spec)
      assert rel_err(ref(p, x), ref(jax.tree_util.tree_unflatten(tree, shifted), x)) < 1e-9, (
          f"centering leaf {i} over {spec} is visible")
    # Sites the math rules out are never folded.
    if "groupnorm_spatial" in prog["ops"] and not prog["extra"]:
      spatial = [s for s in f.report.sites if s.axes == (1, 3)]
      assert spatial and not any(s.folded for s in spatial)


_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=12, **_SETTINGS)
@given(prog=programs(), aux=st.booleans())
@pytest.mark.slow
def test_random_programs(prog, aux):
  check_program(prog, aux)


@pytest.mark.slow
@settings(max_examples=200, **_SETTINGS)
@given(prog=programs(), aux=st.booleans())
def test_random_programs_many(prog, aux):
  check_program(prog, aux)


def test_generator_covers_foldable_and_unfoldable_cases():
  """Guards against a grammar that only ever produces trivial programs."""
  with x64_context():
    prog = dict(ops=["preln_mlp", "preln_mlp"], styles=["fast", "two_pass", "jnp_var", "fast"],
                start="embed", tied=False, extra=False, final=True)
    init, apply = build(prog)
    p, x = init(jax.random.PRNGKey(0)), inputs(1, 2, 5)
    f = jaxfold.fold(p, apply, x)
    assert (f.report.num_sites, f.report.num_folded) == (3, 3)
    prog["extra"] = True
    init, apply = build(prog)
    f = jaxfold.fold(init(jax.random.PRNGKey(0)), apply, x)
    assert f.report.num_folded < f.report.num_sites
