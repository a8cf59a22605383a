"""jaxfold's traces of flax linen models check each distinct parameter initializer once
(``frameworks.flax_linen``): the same program, the same errors, fewer abstract evaluations."""

import threading

import flax.core.scope
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfold
from jaxfold._src import pipeline
from jaxfold._src.frameworks import flax_linen as FL


class _Stack(nn.Module):
  width: int = 16
  depth: int = 4

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width, kernel_init=nn.initializers.normal(0.02))(x)
    for _ in range(self.depth):
      h = nn.LayerNorm()(x)
      x = x + nn.Dense(self.width, kernel_init=nn.initializers.normal(0.02))(nn.gelu(h))
    return nn.Dense(3)(nn.LayerNorm()(x))


def _count_eval_shape(monkeypatch):
  calls = []
  real = jax.eval_shape
  monkeypatch.setattr(jax, "eval_shape", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
  return calls


def test_same_program_fewer_checks(monkeypatch):
  m = _Stack()
  x = jnp.ones((2, 5, 8))
  p = m.init(jax.random.PRNGKey(0), x)
  calls = _count_eval_shape(monkeypatch)
  ours = pipeline.trace(m.apply, p, (x,)).closed
  n_ours = len(calls)
  theirs = jax.make_jaxpr(m.apply)(p, x)
  n_params = len(jax.tree_util.tree_leaves(p))
  assert str(ours) == str(theirs)
  assert len(calls) - n_ours == n_params        # flax checks every parameter...
  assert n_ours < n_params // 2                 # ...jaxfold's trace each distinct one once
  assert flax.core.scope.jax is jax             # nothing left behind


def test_a_wrong_shape_still_raises_flax_error():
  # The first Dense's check, (8, 16) with normal(0.02), is in the memo; a later
  # layer's kernel of that shape (it expects (16, 16)) must still be refused by
  # flax, not answered by the first layer's check.
  m = _Stack()
  x = jnp.ones((2, 8))
  p = m.init(jax.random.PRNGKey(0), x)
  bad = jax.tree_util.tree_map(lambda a: a, p)
  bad["params"]["Dense_2"]["kernel"] = jnp.ones((8, 16))
  with pytest.raises(jaxfold.FoldError, match="ScopeParamShapeError"):
    jaxfold.fold(bad, m.apply, x)
  assert flax.core.scope.jax is jax


def test_fold_equals_original_with_memoized_checks(x64):
  m = _Stack()
  x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8)))
  p = m.init(jax.random.PRNGKey(0), x)
  rng = np.random.default_rng(1)
  p = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(size=a.shape)), p)   # random γ, β, biases
  folded = jaxfold.fold(p, m.apply, x)
  assert folded.report.num_folded >= 4
  for b in (3, 1, 6):
    xb = jnp.asarray(np.random.default_rng(b).normal(size=(b, 8)))
    np.testing.assert_allclose(folded.apply_fn(folded.params, xb), m.apply(p, xb), rtol=1e-10, atol=1e-10)


def test_keys_separate_what_an_initializer_can_tell_apart():
  k = FL._value_key
  normal = nn.initializers.normal
  assert k(normal(0.02)) == k(normal(0.02))     # a new closure per module, same values
  assert k(normal(0.02)) != k(normal(0.03))
  assert k((1,)) != k([1]) and k(1) != k(1.0) and k(1) != k(True)
  assert k((jnp.float32, (3, 4))) == k((jnp.float32, (3, 4)))
  assert k(jnp.float32) != k(jnp.bfloat16)
  with pytest.raises(TypeError):
    k(np.ones(3))                                # arrays: no key, the check runs
  f = lambda key, shape, dtype: jnp.zeros(shape, dtype)   # noqa: E731
  g = lambda key, shape, dtype: jnp.ones(shape, dtype)    # noqa: E731
  assert k(f) != k(g)


def test_traces_in_threads_share_the_proxy_safely():
  m = _Stack(depth=2)
  x = jnp.ones((2, 8))
  p = m.init(jax.random.PRNGKey(0), x)
  want = str(jax.make_jaxpr(m.apply)(p, x))
  got, errors = [], []

  def work():
    try:
      for _ in range(3):
        got.append(str(pipeline.trace(m.apply, p, (x,)).closed))
    except Exception as e:  # noqa: BLE001 - reported below
      errors.append(e)

  threads = [threading.Thread(target=work) for _ in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors and got == [want] * 9
  assert flax.core.scope.jax is jax


@pytest.mark.parametrize("wrapped", [False, True], ids=["variables", "{'params': ...}"])
def test_model_apply_given_folded_params_says_what_to_pass(wrapped):
  # the folded params are (params, untied), not a variable dict: flax's own check would
  # raise its generic ApplyScopeInvalidVariablesTypeError for {'params': folded.params}
  m = _Stack(depth=1)
  x = jnp.ones((2, 16))
  variables = m.init(jax.random.PRNGKey(0), x)
  if wrapped:
    folded = jaxfold.fold(variables["params"], lambda p, x: m.apply({"params": p}, x), x)
    given = {"params": folded.params}
  else:
    folded = jaxfold.fold(variables, m.apply, x)
    given = folded.params
  with pytest.raises(AttributeError, match=r"pass folded\.params\.params"):
    m.apply(given, x)
  right = {"params": folded.params.params} if wrapped else folded.params.params
  np.testing.assert_allclose(m.apply(right, x), m.apply(variables, x), rtol=1e-5, atol=1e-5)
  assert not isinstance(folded.params, dict)   # a virtual FrozenDict for flax's check only
