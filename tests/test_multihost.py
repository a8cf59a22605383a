"""Folding beyond one device and one process.

1. Two simulated CPU devices in one process
   (``XLA_FLAGS=--xla_force_host_platform_device_count=2``): a fold of
   parameters sharded across both keeps every leaf's sharding, computes the
   same function, and a saved fold restores with those shardings.
2. ``jax.distributed`` with two processes on 127.0.0.1 (CPU, gloo collectives),
   one device each: parameters sharded across the processes (no process holds
   all of them), ``jaxfold.fold`` and CBWC training equal the single-process
   run computed here, and ``save_fold``/``load_fold`` write and restore the
   sharded folded parameters with orbax's multi-process checkpointing.

Both run in subprocesses (the device count and the distributed runtime are
fixed when jax initialises), with time limits.  Parameters are drawn with numpy
here and passed in a file, so the subprocesses compile little.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jaxfold

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
D, H, STEPS, LR = 8, 32, 3, 0.05


class Net(nn.Module):
  """Pre-LN residual MLP: every LayerNorm foldable; the hidden dim H is what gets sharded."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(D)(x)
    h = nn.Dense(H)(nn.LayerNorm()(x))
    x = x + nn.Dense(D)(nn.gelu(h))
    return nn.Dense(5)(nn.LayerNorm()(x))


def shard_spec(path) -> tuple:
  """PartitionSpec entries of a leaf: H over the mesh axis "p", the rest replicated."""
  names = [getattr(k, "key", "") for k in path]
  if names[-2:] == ["Dense_1", "kernel"]:
    return (None, "p")
  if names[-2:] == ["Dense_1", "bias"]:
    return ("p",)
  if names[-2:] == ["Dense_2", "kernel"]:
    return ("p", None)
  return ()


def problem():
  """Numpy params (random γ/β/biases), inputs and labels."""
  m = Net()
  x = np.random.default_rng(0).standard_normal((4, 12)).astype(np.float32)
  shapes = jax.eval_shape(m.init, jax.random.PRNGKey(0), x)
  rng = np.random.default_rng(1)
  params = jax.tree_util.tree_map(
      lambda s: (0.3 * rng.standard_normal(s.shape) + (1.0 if len(s.shape) == 1 else 0.0))
      .astype(np.float32), shapes)
  y = np.array([0, 1, 2, 3], np.int32)
  return m, params, x, y


def train(apply_fn, params, x, y):
  """STEPS of SGD on the CBWC apply function; returns (losses, final params)."""
  def loss(p):
    return optax.softmax_cross_entropy_with_integer_labels(apply_fn(p, x), y).mean()

  @jax.jit
  def step(p):
    l, g = jax.value_and_grad(loss)(p)
    return jax.tree_util.tree_map(lambda a, b: a - LR * b, p, g), l

  losses = []
  for _ in range(STEPS):
    params, l = step(params)
    losses.append(float(l))
  return losses, params


def _leaves(tree):
  return [np.asarray(a) for a in jax.tree_util.tree_leaves(tree)]


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_ENABLE_X64")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + TESTS, **extra)
  return env


def _last_json(out: str) -> dict:
  return json.loads([l for l in out.splitlines() if l.startswith("{")][-1])


# ---------------------------------------------------------------------------- 2 devices

TWO_DEVICES = textwrap.dedent("""
  import json, sys
  import jax, numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jaxfold
  from test_multihost import problem, shard_spec
  assert len(jax.devices()) == 2, jax.devices()
  m, params, x, _ = problem()
  ref = jaxfold.fold(params, m.apply, x)
  mesh = Mesh(np.array(jax.devices()), ("p",))
  shardings = jax.tree_util.tree_map_with_path(
      lambda path, _: NamedSharding(mesh, P(*shard_spec(path))), params)
  ps = jax.device_put(params, shardings)
  f = jaxfold.fold(ps, m.apply, x)
  flat_s = jax.tree_util.tree_leaves(shardings)
  kept = [a.sharding.is_equivalent_to(s, a.ndim)
          for a, s in zip(jax.tree_util.tree_leaves(f.params.params), flat_s)]
  out = np.asarray(jax.jit(f.apply_fn)(f.params, x))
  # parameters kept on the second device (not the default one): centered on the host, put back there
  on1 = jaxfold.fold(jax.device_put(params, jax.devices()[1]), m.apply, x)
  d = jaxfold.save_fold(f, sys.argv[1])
  target = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), f.params)
  back = jaxfold.load_fold(d, m.apply, target=target)
  print(json.dumps({
      "n_sharded": sum(not s.is_fully_replicated for s in flat_s),
      "sharding_kept": kept,
      "second_device_kept": [a.devices() == {jax.devices()[1]} for a in jax.tree_util.tree_leaves(on1.params)],
      "num_folded": [f.report.num_folded, f.report.num_sites],
      "out_vs_original": float(np.max(np.abs(out - np.asarray(m.apply(params, x))))),
      "out_vs_unsharded_fold": float(np.max(np.abs(out - np.asarray(ref.apply_fn(ref.params, x))))),
      "params_vs_unsharded_fold": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
          for a, b in zip(jax.tree_util.tree_leaves(f.params), jax.tree_util.tree_leaves(ref.params))),
      "restored_sharding_kept": all(a.sharding.is_equivalent_to(b.sharding, a.ndim)
          for a, b in zip(jax.tree_util.tree_leaves(back.params), jax.tree_util.tree_leaves(f.params))),
      "restored_equal": all(np.array_equal(np.asarray(a), np.asarray(b))
          for a, b in zip(jax.tree_util.tree_leaves(back.params), jax.tree_util.tree_leaves(f.params))),
  }))
""")


def test_fold_of_params_sharded_over_two_devices(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-c", TWO_DEVICES, str(tmp_path / "fold")], capture_output=True, text=True,
      timeout=180, cwd=str(tmp_path),
      env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=2"))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  r = _last_json(proc.stdout)
  assert r["n_sharded"] == 3 and r["num_folded"] == [2, 2]
  assert all(r["sharding_kept"]) and all(r["second_device_kept"]), r
  assert r["out_vs_original"] < 1e-5 and r["out_vs_unsharded_fold"] < 1e-5, r
  assert r["params_vs_unsharded_fold"] < 1e-6, r        # the same centering, up to rounding
  assert r["restored_sharding_kept"] and r["restored_equal"], r


# ---------------------------------------------------------------------------- 2 processes

WORKER = textwrap.dedent("""
  import json, sys
  pid, port, data, fold_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=pid, initialization_timeout=60)
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jaxfold
  from test_multihost import problem, shard_spec, train
  assert jax.process_count() == 2 and len(jax.devices()) == 2 and len(jax.local_devices()) == 1
  m, params, x, y = problem()
  ref = np.load(data)
  mesh = Mesh(np.array(jax.devices()), ("p",))
  # each process provides only its own shard of each parameter
  ps = jax.tree_util.tree_map_with_path(
      lambda path, a: jax.make_array_from_callback(
          a.shape, NamedSharding(mesh, P(*shard_spec(path))), lambda idx: a[idx]), params)
  def n_split(tree):   # leaves of which each process holds only a part
      return sum(not a.is_fully_addressable and not a.sharding.is_fully_replicated
                 for a in jax.tree_util.tree_leaves(tree))
  split = n_split(ps)

  def gather(tree):
      return [np.asarray(multihost_utils.process_allgather(a, tiled=True))
              for a in jax.tree_util.tree_leaves(tree)]

  def worst(got, want):
      return max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))

  f = jaxfold.fold(ps, m.apply, x)
  out = gather(jax.jit(f.apply_fn)(f.params, x))
  folded = gather(f.params)
  kept = all(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in
             zip(jax.tree_util.tree_leaves(f.params.params), jax.tree_util.tree_leaves(ps)))
  r = jaxfold.cbwc(ps, m.apply, x)
  losses, trained = train(r.apply_fn, ps, x, y)
  trained = gather(trained)
  d = jaxfold.save_fold(f, fold_dir, meta={"processes": 2})
  target = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), f.params)
  back = jaxfold.load_fold(d, m.apply, target=target)
  print(json.dumps({
      "pid": pid, "params_split_across_processes": split,
      "fold_sharding_kept": kept,
      "restored_split": n_split(back.params),
      "out_err": worst(out, [ref["out"]]),
      "folded_params_err": worst(folded, [ref[f"folded{i}"] for i in range(len(folded))]),
      "losses": losses, "ref_losses": ref["losses"].tolist(),
      "trained_err": worst(trained, [ref[f"trained{i}"] for i in range(len(trained))]),
      "restored_err": worst(gather(back.params), folded),
      "meta": back.meta,
  }), flush=True)
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_jax_distributed_fold_cbwc_and_checkpoint(tmp_path):
  m, params, x, y = problem()
  ref = jaxfold.fold(params, m.apply, x)         # the single-process run
  losses, trained = train(jaxfold.cbwc(params, m.apply, x).apply_fn, params, x, y)
  folded = _leaves(ref.params)
  data = tmp_path / "ref.npz"
  np.savez(data, out=np.asarray(ref.apply_fn(ref.params, x)), losses=np.array(losses),
           **{f"folded{i}": a for i, a in enumerate(folded)},
           **{f"trained{i}": a for i, a in enumerate(_leaves(trained))})
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(port), str(data),
                             str(tmp_path / "fold")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(tmp_path), env=_env())
           for i in range(2)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=150))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=10)
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, out[-2000:] + err[-4000:]
  results = [_last_json(out) for out, _ in outs]
  assert sorted(r["pid"] for r in results) == [0, 1]
  for r in results:
    assert r["params_split_across_processes"] == 3, r     # no process holds those leaves
    assert r["fold_sharding_kept"], r
    assert r["out_err"] < 1e-5 and r["folded_params_err"] < 1e-6, r
    np.testing.assert_allclose(r["losses"], losses, rtol=1e-5)
    assert r["losses"][-1] < r["losses"][0]
    assert r["trained_err"] < 1e-5, r
    assert r["restored_split"] == 3 and r["restored_err"] == 0.0, r
    assert r["meta"] == {"processes": 2}
  # one complete fold on disk, verified by its manifest, loadable by a single process
  single = jaxfold.load_fold(tmp_path / "fold", m.apply)
  for a, b in zip(_leaves(single.params), folded):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert [n for n in os.listdir(tmp_path) if n.startswith(".fold.")] == []
