"""CBWC training with parameters sharded over 8 (virtual CPU) devices.

The device count must be fixed before jax initialises, so the check runs in a
subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(r'''
    import json
    import flax.linen as nn
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxfold

    assert len(jax.devices()) == 8, jax.devices()
    D, H, BATCH, STEPS = 16, 64, 16, 5

    class Net(nn.Module):   # pre-LN residual MLP: every LN foldable
      @nn.compact
      def __call__(self, x):
        x = nn.Dense(D)(x)
        for _ in range(2):
          h = nn.LayerNorm()(x)
          h = nn.Dense(H)(h)          # hidden dim sharded over "model"
          h = nn.gelu(h)
          x = x + nn.Dense(D)(h)
        return nn.Dense(5)(nn.LayerNorm()(x))

    m = Net()
    x = jax.random.normal(jax.random.PRNGKey(0), (BATCH, 12))
    y = jax.random.randint(jax.random.PRNGKey(1), (BATCH,), 0, 5)
    p0 = m.init(jax.random.PRNGKey(2), x)
    # Random γ, β and biases.
    leaves, tree = jax.tree_util.tree_flatten(p0)
    ks = jax.random.split(jax.random.PRNGKey(3), len(leaves))
    p0 = tree.unflatten([l + (0.5 if l.ndim == 1 else 0.05) * jax.random.normal(k, l.shape)
                         for k, l in zip(ks, leaves)])

    r = jaxfold.cbwc(p0, m.apply, x)
    assert r.report.num_folded == r.report.num_sites == 3, str(r.report)
    opt = optax.adamw(1e-2, weight_decay=0.1)

    def loss(p, x, y):
      return optax.softmax_cross_entropy_with_integer_labels(r.apply_fn(p, x), y).mean()

    @jax.jit
    def step(p, s, x, y):
      l, g = jax.value_and_grad(loss)(p, x, y)
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s, l

    def run(p, x, y):
      s = opt.init(p)
      losses = []
      for _ in range(STEPS):
        p, s, l = step(p, s, x, y)
        losses.append(float(l))
      return p, s, losses

    # Unsharded reference (one device).
    ref_p, _, ref_l = run(p0, x, y)

    # Sharded: batch over "data", MLP hidden dim over "model".
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    def spec_for(path, leaf):
      names = [getattr(k, "key", "") for k in path]
      blk = names[-2] if len(names) >= 2 else ""
      if blk in ("Dense_1", "Dense_3") and names[-1] == "kernel":   # (D, H)
        return P(None, "model")
      if blk in ("Dense_1", "Dense_3") and names[-1] == "bias":     # (H,)
        return P("model")
      if blk in ("Dense_2", "Dense_4") and names[-1] == "kernel":   # (H, D)
        return P("model", None)
      return P()
    shardings = jax.tree_util.tree_map_with_path(lambda pa, l: NamedSharding(mesh, spec_for(pa, l)), p0)
    ps = jax.device_put(p0, shardings)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ys = jax.device_put(y, NamedSharding(mesh, P("data")))
    n_sharded = sum(not s.is_fully_replicated for s in jax.tree_util.tree_leaves(shardings))
    # cbwc traced with sharded example arguments too.
    r_s = jaxfold.cbwc(ps, m.apply, xs)
    assert r_s.leaf_specs == r.leaf_specs
    sh_p, sh_s, sh_l = run(ps, xs, ys)

    flat_ref = jax.tree_util.tree_leaves(ref_p)
    flat_sh = jax.tree_util.tree_leaves(sh_p)
    max_rel = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / float(np.max(np.abs(np.asarray(a)))))
                  for a, b in zip(flat_ref, flat_sh))
    for a, b in zip(flat_ref, flat_sh):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sh_l, ref_l, rtol=1e-5)
    # Output shardings are the input shardings (params and the optimizer's moments).
    preserved = all(b.sharding.is_equivalent_to(s, b.ndim)
                    for b, s in zip(flat_sh, jax.tree_util.tree_leaves(shardings)))
    mu = sh_s[0].mu
    mu_preserved = all(b.sharding.is_equivalent_to(s, b.ndim)
                       for b, s in zip(jax.tree_util.tree_leaves(mu), jax.tree_util.tree_leaves(shardings)))
    # The centered forward under jit keeps the sharded layout: the jitted
    # forward's output is batch-sharded.
    out = jax.jit(r.apply_fn)(sh_p, xs)
    print(json.dumps({"max_rel": max_rel, "losses": sh_l, "ref_losses": ref_l,
                      "n_sharded_leaves": n_sharded, "params_sharding_preserved": preserved,
                      "mu_sharding_preserved": mu_preserved,
                      "out_sharding": str(out.sharding.spec),
                      "num_devices": len(jax.devices())}))
''')


@pytest.mark.slow
def test_cbwc_sharded_training_matches_unsharded(tmp_path):
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("JAX_ENABLE_X64", None)
  proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                        timeout=300, cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  print(res)
  assert res["num_devices"] == 8
  assert res["n_sharded_leaves"] == 6
  assert res["max_rel"] < 1e-5
  assert res["losses"][-1] < res["losses"][0]
  assert res["params_sharding_preserved"], res
  assert res["mu_sharding_preserved"], res
  assert "data" in res["out_sharding"], res
