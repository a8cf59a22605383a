"""jaxfold/_src/planner.py: the frozen decisions a fold is built from —
which sites fold, what each needs centered, what is refused and why, and the
auxiliary centerings and untied copies the planner chooses."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfold
from jaxfold._src import pipeline
from jaxfold._src.fold import FoldOptions
from jaxfold._src.planner import Decision, Outcome, Planner

D = 8


def _outcome(module, x, **opts):
  p = module.init(jax.random.PRNGKey(0), x)
  traced = pipeline.trace(module.apply, p, (x,))
  with pipeline.analyzer(traced) as an:
    planner = Planner(an, list(traced.names), FoldOptions(**opts)).run()
    return planner.outcome(), traced.names


class PreLN(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D, name="inp")(x)
    h = h + nn.Dense(D, name="mlp")(nn.LayerNorm(name="ln1")(h))
    return nn.Dense(3, name="head")(nn.LayerNorm(name="ln2")(h))


class PostLN(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="ln1")(nn.Dense(D, name="inp")(x))
    h = nn.LayerNorm(name="ln2")(h + nn.Dense(D, name="mlp")(h))
    return nn.Dense(3, name="head")(h)


class FromInput(nn.Module):
  """A residual stream that starts at the input: nothing upstream to center,
  so one explicit centering of the input serves both norms."""
  @nn.compact
  def __call__(self, x):
    h = x + nn.Dense(D)(nn.LayerNorm()(x))
    return nn.Dense(3)(nn.LayerNorm()(h))


X = jnp.ones((2, 5, 4))


def test_pre_ln_folds_every_site_and_centers_the_producers():
  out, names = _outcome(PreLN(), X)
  assert isinstance(out, Outcome) and len(out.sites) == 2 == len(out.folded)
  centered = {names[i] for i, _ in out.leaf_specs}
  # The stream is the sum of inp's and mlp's outputs: both kernels and biases.
  assert {"['params']['inp']['kernel']", "['params']['inp']['bias']",
          "['params']['mlp']['kernel']", "['params']['mlp']['bias']"} <= centered
  assert not any("head" in n or "ln" in n for n in centered)
  assert out.aux == () and out.untied == ()
  for e in out.sites:
    assert e.decision.folded and e.decision.exact and e.decision.centered


def test_post_ln_refuses_with_a_reason_and_centers_nothing_for_it():
  out, _ = _outcome(PostLN(), X)
  (first, second) = out.sites
  assert first.decision.folded
  assert not second.decision.folded and second.decision.reason
  # The refused site's producers (the residual reads ln1's output) are not centered for it.
  assert second.decision.centered == ()


def test_a_stream_from_the_input_needs_an_auxiliary_centering():
  x = jnp.ones((2, 5, D))
  out, _ = _outcome(FromInput(), x)
  assert len(out.folded) == 2 and len(out.aux) == 1
  assert all(e.decision.auxiliary and e.decision.aux_vars for e in out.sites)
  out, _ = _outcome(FromInput(), x, auxiliary_centering=False)
  assert out.folded == () and out.aux == ()
  assert all("not zero-sum" in e.decision.reason for e in out.sites)


def test_decisions_are_frozen():
  out, _ = _outcome(PreLN(), X)
  d = out.sites[0].decision
  assert isinstance(d, Decision)
  with pytest.raises(dataclasses.FrozenInstanceError):
    d.folded = False
  with pytest.raises(AttributeError):
    out.sites = ()


def test_the_plan_does_not_depend_on_the_batch_shape():
  a, _ = _outcome(PreLN(), X)
  b, _ = _outcome(PreLN(), jnp.ones((3, 7, 4)))
  assert a.leaf_specs == b.leaf_specs
  assert [e.decision.folded for e in a.sites] == [e.decision.folded for e in b.sites]


def _ln(h, g, b):
  m = h.mean(-1, keepdims=True)
  return (h - m) * jax.lax.rsqrt(((h - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


def _custom_block(kind: str):
  """``LN(h) @ w`` behind a custom derivative (the true one)."""
  body = lambda h, lp: _ln(h, lp["g"], lp["b"]) @ lp["w"]
  if kind == "custom_jvp":
    f = jax.custom_jvp(body)
    f.defjvp(lambda primals, tangents: jax.jvp(body, primals, tangents))
  else:
    f = jax.custom_vjp(body)
    f.defvjp(lambda h, lp: jax.vjp(body, h, lp), lambda vjp, ct: vjp(ct))
  return f


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
@pytest.mark.parametrize("outside_first", [True, False])
def test_cbwc_a_mean_computed_outside_and_inside_a_custom_call(x64, kind, outside_first):
  """The class of the CBWC crash (IndexError in Planner.decide): one site
  whose sums of the same value over the same axes lie both outside and inside
  a custom-derivative call (the caller normalizes the block's input too, here
  a side output). CBWC keeps the custom rule, so the site stays a LayerNorm,
  named with its call; the fold removes both sums. Exact either way."""
  block = _custom_block(kind)

  def f(p, x):
    h = x @ p["win"] + p["bin"]
    side = lambda: _ln(h, p["g0"], p["b0"]) @ p["head"]
    inner = lambda: block(h, p["blk"])
    if outside_first:
      a = side()
      return a, inner()
    b = inner()
    return side(), b

  rng = np.random.default_rng(0)
  draw = lambda seed: {k: jnp.asarray(np.random.default_rng([seed, i]).normal(size=s) + (1.0 if k[0] == "g" else 0.3))
                       for i, (k, s) in enumerate(dict(win=(4, D), bin=(D,), g0=(D,), b0=(D,), head=(D, 3)).items())}
  p = draw(1)
  p["blk"] = {"g": jnp.asarray(1 + 0.5 * rng.normal(size=D)), "b": jnp.asarray(0.3 + rng.normal(size=D)),
              "w": jnp.asarray(rng.normal(size=(D, D)))}
  q = dict(draw(2), blk=jax.tree_util.tree_map(lambda a: a + 0.1 * jnp.asarray(rng.normal(size=a.shape)), p["blk"]))
  xs = [jnp.asarray(rng.normal(size=s)) for s in ((2, 5, 4), (1, 3, 4))]

  r = jaxfold.cbwc(p, f, xs[0])
  (site,) = r.report.sites
  assert not site.folded and f"inside {kind} `" in site.reason and "CBWC keeps its custom rule" in site.reason
  loss = lambda fn: lambda u: sum(jnp.sum(jnp.sin(o)) for o in fn(u, xs[0]))
  for a, b in zip(r.apply_fn(q, xs[0]), f(q, xs[0])):
    assert jnp.max(jnp.abs(a - b)) < 1e-12
  ga, gb = jax.grad(loss(r.apply_fn))(q), jax.grad(loss(f))(q)
  leaves = jax.tree_util.tree_leaves
  assert all(jnp.max(jnp.abs(u - v)) < 1e-12 for u, v in zip(leaves(ga), leaves(gb)))

  folded = jaxfold.fold(p, f, xs[0])
  assert folded.report.num_folded == 1
  for x in xs:
    for a, b in zip(folded.apply_fn(folded.params, x), f(p, x)):
      assert jnp.max(jnp.abs(a - b)) < 1e-12 * (1 + jnp.max(jnp.abs(b)))
