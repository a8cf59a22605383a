"""jaxfold/_src/planner.py: the frozen decisions a fold is built from —
which sites fold, what each needs centered, what is refused and why, and the
auxiliary centerings and untied copies the planner chooses."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

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
