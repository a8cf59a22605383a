"""Adversarial spellings of LayerNorm / GroupNorm and of the mean (advspell).

Users write a norm many ways; the fold must prove the same facts whatever the
spelling, and refuse the near misses. Each spelling sits in a two-norm pre-LN
residual program (a projection, a GELU MLP branch, a head) and runs
``fold_checks.assert_sound`` in float64 at random γ, β and biases and two batch
sizes (folded == original, CBWC == original at unseen parameters and in its
gradients, every in-place centering invisible), with the number of folded sites
pinned. Norms inside ``shard_map`` run under ``jax.jit`` (NumPy cannot run a
shard_map) on a one-device mesh here and on four virtual CPU devices in a
subprocess.

Findings (each failed before its fix):

* A variance computed twice (Keras' ``h*rsqrt(var(h)) - mean(h)*rsqrt(var(h))``
  with two ``jnp.var`` calls, the same spelled out twice, or a jitted
  ``jnp.var`` called twice) folded nothing: each variance's expansion exceeded
  ``analysis.CANON_TERMS`` and became an atom of its own value, so the two
  ``rsqrt``s were unrelated symbols and the shift ``c*(r1 - r2)`` did not
  cancel. A long expression is now one factor keyed by the expression itself
  (``algebra.boxed``): equal expressions are one symbol.
* ``jnp.average(h, -1, weights=jnp.ones(d))`` (``Σ h·w / Σ w``) was no site:
  site detection did not see the mean of ``h`` through the product with a
  known constant. It now looks through it (detection only; the walk proves
  the product's zero sum).
* ``shard_map`` had no rule: a norm inside one was no site, and a shift
  reaching one blocked every centering upstream. It now has one: the body runs
  per shard on local blocks (shifts restricted to a shard and back, zero-sum
  blocks that no shard boundary splits), a ``psum`` keeps the pattern of the
  shards' shifts, ``pvary`` is the identity, and a touched body is rebuilt with
  ``jax.shard_map``. A norm over an unsharded axis folds as at the top level; a
  norm over a sharded axis without a ``psum`` is a mean per shard, i.e. a
  GroupNorm with one group per shard, and folds as one (``W[1/L]``).
* A mean over a sharded feature axis written ``psum(Σ h) / n`` (a tensor-parallel
  LayerNorm) was no site: the psum made every shift a new one. A shift that
  enters constant along the split dims is now the same in every shard
  (``algebra.replicate``), its psum is ``n·c``, and the mean is a site over the
  whole axis (``MeanSite.across``/``target``): it folds where ``n`` is the global
  size and the psum's mesh axes are exactly those splitting the features, and is
  refused with that reason otherwise (one shard's size, one of two mesh axes,
  the batch's axis, a value computed inside the body).
* Folded parameters were committed to device 0 even where the caller's were
  uncommitted, so ``jax.jit(folded.apply_fn)`` refused a ``shard_map`` over
  several devices ("incompatible devices"). An uncommitted leaf stays so.

Found, not fixed (sound refusals, pinned): a Welford mean or a chunked sum in a
``scan``/``fori_loop`` is not recognised as a mean (no site); a GroupNorm whose
groups are strided (``reshape(..., d // g, g)``, mean over the ``d // g`` axis)
is refused (its centering is not a block spec).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spellings
from fold_checks import assert_sound, make_params, rel_err, x_args
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxfold

D = 8
EPS = 1e-5
SHAPES = dict(w1=(5, D), b1=(D,), g1=(D,), be1=(D,), w2=(D, 2 * D), b2=(2 * D,), w3=(2 * D, D), b3=(D,),
              g2=(D,), be2=(D,), wo=(D, 3))


def mean(h):
  return jnp.mean(h, -1, keepdims=True)


def rs(v):
  return lax.rsqrt(v + EPS)


def ln(h, g, b):
  m = mean(h)
  return (h - m) * rs(mean((h - m) ** 2)) * g + b


def program(norm):
  """A pre-LN block: projection, norm, residual GELU MLP, final norm, head."""
  def apply(p, x):
    h = x @ p["w1"] + p["b1"]
    s = h + jax.nn.gelu(norm(h, p["g1"], p["be1"]) @ p["w2"] + p["b2"]) @ p["w3"] + p["b3"]
    return norm(s, p["g2"], p["be2"]) @ p["wo"]
  return apply


# ----------------------------------------------------------------------------
# Spellings that fold (both sites).


def _var_twice(h, g, b):
  r1, r2 = (rs(jnp.var(h, -1, keepdims=True)) for _ in range(2))
  return (h * r1 - mean(h) * r2) * g + b


def _var_twice_spelled(h, g, b):
  v1, v2 = (mean((h - mean(h)) ** 2) for _ in range(2))
  return (h * rs(v1) - mean(h) * rs(v2)) * g + b


def _var_twice_jit(h, g, b):
  var = jax.jit(lambda h: jnp.var(h, -1, keepdims=True))
  return (h * rs(var(h)) - mean(h) * rs(var(h))) * g + b


def _fast_var_twice(h, g, b):
  # E[h²] - E[h]² with every mean recomputed, inverse written as 1/sqrt
  v = lambda: mean(h * h) - mean(h) ** 2
  return (h / jnp.sqrt(v() + EPS) - mean(h) / jnp.sqrt(v() + EPS)) * g + b


def _group_var_twice(h, g, b):
  # GroupNorm (2 groups of 4), Keras-style, with each group variance computed twice
  r = h.reshape(h.shape[:-1] + (2, D // 2))
  var = lambda: jnp.var(r, -1, keepdims=True)
  return (r * rs(var()) - r.mean(-1, keepdims=True) * rs(var())).reshape(h.shape) * g + b


def _weighted_ones(h, g, b):
  m = jnp.average(h, axis=-1, weights=jnp.ones(D), keepdims=True)
  return (h - m) * rs(mean((h - m) ** 2)) * g + b


def _weighted_uniform(h, g, b):
  m = jnp.average(h, axis=-1, weights=jnp.full((D,), 2.5), keepdims=True)
  c = h - m
  return c * rs(jnp.average(c * c, axis=-1, weights=jnp.full((D,), 0.5), keepdims=True)) * g + b


FOLDS = {
    "variance twice (Keras, two jnp.var)": _var_twice,
    "variance twice, spelled out": _var_twice_spelled,
    "variance twice, a jitted jnp.var": _var_twice_jit,
    "E[h²]-E[h]² twice, 1/sqrt": _fast_var_twice,
    "GroupNorm, variance twice": _group_var_twice,
    "jnp.average, weights of ones": _weighted_ones,
    "jnp.average, uniform weights": _weighted_uniform,
}


@pytest.mark.parametrize("name", list(FOLDS))
def test_spelling_folds(x64, name):
  assert_sound(program(FOLDS[name]), SHAPES, x_args(3), expect_folded=2)


# ----------------------------------------------------------------------------
# Near misses: not a norm of h, so nothing may fold.


def _var_of_other(h, g, b):
  # the second variance is of 1.0001·h: no cancellation
  return (h * rs(jnp.var(h, -1, keepdims=True)) - mean(h) * rs(jnp.var(h * 1.0001, -1, keepdims=True))) * g + b


def _weighted_nonuniform(h, g, b):
  m = jnp.average(h, axis=-1, weights=jnp.arange(1.0, D + 1), keepdims=True)
  c = h - m
  return c * rs(mean(c * c)) * g + b


def _almost_uniform_dot(h, g, b):
  m = (h @ jnp.full((D,), 1.0 / D).at[0].add(1e-3))[..., None]
  c = h - m
  return c * rs(mean(c * c)) * g + b


def _mean_wrong_axis(h, g, b):
  c = h - jnp.mean(h, -2, keepdims=True)   # over the tokens, normalized over the features
  return c * rs(mean(c * c)) * g + b


def _strided_groups(h, g, b):
  r = h.reshape(h.shape[:-1] + (D // 2, 2))     # groups {0, 2, 4, 6} and {1, 3, 5, 7}
  c = r - r.mean(-2, keepdims=True)
  return (c * rs((c * c).mean(-2, keepdims=True))).reshape(h.shape) * g + b


REFUSED = {
    "the second variance of another value": _var_of_other,
    "jnp.average, non-uniform weights": _weighted_nonuniform,
    "a dot with almost uniform weights": _almost_uniform_dot,
    "a mean over the wrong axis": _mean_wrong_axis,
    "a Welford scan (not recognised)": spellings.welford_style,
    "strided groups (not a block spec)": _strided_groups,
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_near_miss_refused(x64, name):
  assert_sound(program(REFUSED[name]), SHAPES, x_args(3), expect_folded=0)


# ----------------------------------------------------------------------------
# shard_map on one device: the rule's plumbing (its local shapes are global).

_MESH1 = Mesh(np.array(jax.devices()[:1]), ("x",))


def _in_shard_map(norm, specs):
  def wrapped(h, g, b):
    return jax.shard_map(norm, mesh=_MESH1, in_specs=specs, out_specs=specs[0])(h, g, b)
  return wrapped


def _jit_check(f, p, args, expect_folded):
  """Folded == original under jax.jit at every argument set; the report."""
  r = jaxfold.fold(p, f, *args[0])
  assert r.report.num_folded == expect_folded, r.report
  run_f, run_r = jax.jit(f), jax.jit(r.apply_fn)
  for a in args:
    assert rel_err(run_f(p, *a), run_r(r.params, *a)) < 1e-9
  return r


@pytest.mark.parametrize("specs", [(P(), P(), P()), (P("x"), P(), P()), (P(None, None, "x"), P("x"), P("x"))],
                         ids=["replicated", "batch sharded", "features sharded"])
def test_shard_map_one_device(x64, specs):
  p = make_params(0, **SHAPES)
  r = _jit_check(program(_in_shard_map(ln, specs)), p, x_args(3), 2)
  assert sorted(c.label() for c in r.report.sites[0].centered) == ["b1[0]", "w1[1]"]


def test_shard_map_whole_model_one_device(x64):
  p = make_params(0, **SHAPES)
  f = program(ln)
  g = lambda p, x: jax.shard_map(f, mesh=_MESH1, in_specs=(P(), P("x")), out_specs=P("x"))(p, x)
  _jit_check(g, p, x_args(3), 2)


# ----------------------------------------------------------------------------
# shard_map on four devices (a subprocess: the device count is fixed before
# jax initialises).

SCRIPT = textwrap.dedent(r'''
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from jax.sharding import Mesh, PartitionSpec as P
    jax.config.update("jax_enable_x64", True)
    sys.path.insert(0, sys.argv[1])
    import jaxfold
    from fold_checks import make_params, rel_err
    from test_adversarial_spellings import D, SHAPES, ln, program, rs

    assert len(jax.devices()) == 4, jax.devices()
    M4 = Mesh(np.array(jax.devices()), ("x",))
    M22 = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))

    def sm(norm, mesh, specs, out):
      return lambda h, g, b: jax.shard_map(norm, mesh=mesh, in_specs=specs, out_specs=out)(h, g, b)

    def psum_mean(h, g, b):       # the normalized axis sharded: mean = psum(Σ h) / n
      m = lax.psum(h.sum(-1, keepdims=True), "x") / D
      c = h - m
      return c * rs(lax.psum((c * c).sum(-1, keepdims=True), "x") / D) * g + b

    def psum_local_size(h, g, b):  # a near miss: the shards' sum divided by one shard's size
      L = h.shape[-1]
      m = lax.psum(h.sum(-1, keepdims=True), "x") / L
      c = h - m
      return c * rs((c * c).mean(-1, keepdims=True)) * g + b

    def psum_mean_2d(h, g, b):    # features split over both axes of a 2x2 mesh, one psum over both
      m = lax.psum(h.sum(-1, keepdims=True), ("a", "b")) / D
      c = h - m
      return c * rs(lax.psum((c * c).sum(-1, keepdims=True), ("a", "b")) / D) * g + b

    def psum_one_of_two(h, g, b):  # a near miss: features split over a and b, the psum over a alone
      m = lax.psum(h.sum(-1, keepdims=True), "a") / (D // 2)
      c = h - m
      return c * rs(lax.psum((c * c).sum(-1, keepdims=True), "a") / (D // 2)) * g + b

    def psum_other_axis(h, g, b):  # a near miss: the batch sharded, the features summed across it
      m = lax.psum(h.sum(-1, keepdims=True), "x") / (4 * D)
      c = h - m
      return c * rs((c * c).mean(-1, keepdims=True)) * g + b

    def local_and_psum_mean(h, g, b):    # one h, a mean per shard (a GroupNorm) and the mean over all shards
      return ln(h, g, b) + psum_mean(h, g, b)

    def local_and_local_size(h, g, b):   # one h, a mean per shard and psum(Σ h) / L
      return ln(h, g, b) + psum_local_size(h, g, b)

    def column_parallel(p, x):    # the projection inside, its columns sharded: the mean is of a value made there
      specs = {k: P() for k in p}
      specs.update(w1=P(None, "x"), b1=P("x"), g1=P("x"), be1=P("x"))
      def f(p, x):
        h = x @ p["w1"] + p["b1"]
        return psum_mean(h, p["g1"], p["be1"])
      return jax.shard_map(f, mesh=M4, in_specs=(specs, P()), out_specs=P(None, None, "x"))(p, x) @ p["wo"]

    def elementwise(h, g, b):     # features sharded in a shard_map that does not normalize, the norm outside
      h = jax.shard_map(lambda h: h * 2.0 + 1.0, mesh=M4, in_specs=P(None, None, "x"), out_specs=P(None, None, "x"))(h)
      return ln(h, g, b)

    def wrong_axis(h, g, b):      # a mean over the sharded tokens, normalized over the features
      c = h - h.mean(-2, keepdims=True)
      return c * rs((c * c).mean(-1, keepdims=True)) * g + b

    def whole(p, x):
      return jax.shard_map(program(ln), mesh=M4, in_specs=(P(), P("x")), out_specs=P("x"))(p, x)

    def row_parallel(p, x):       # Megatron: x's features and w1's rows sharded, psum, norms on full features
      specs = {k: P() for k in p}
      specs["w1"] = P("x", None)
      def f(p, x):
        h = lax.psum(x @ p["w1"], "x") + p["b1"]
        s = h + jax.nn.gelu(ln(h, p["g1"], p["be1"]) @ p["w2"] + p["b2"]) @ p["w3"] + p["b3"]
        return ln(s, p["g2"], p["be2"]) @ p["wo"]
      x = jnp.concatenate([x, x[..., :3] * 0.5], -1)   # 8 input features: 2 per device
      p = dict(p, w1=jnp.concatenate([p["w1"], p["w1"][:3] * -0.7], 0))
      return jax.shard_map(f, mesh=M4, in_specs=(specs, P(None, None, "x")), out_specs=P())(p, x)

    def mlp_parallel(p, x):       # the MLP column/row parallel with a psum, norms outside
      h = x @ p["w1"] + p["b1"]
      mlp = lambda y, w2, b2, w3: lax.psum(jax.nn.gelu(y @ w2 + b2) @ w3, "x")
      s = h + jax.shard_map(mlp, mesh=M4, in_specs=(P(), P(None, "x"), P("x"), P("x", None)), out_specs=P())(
          ln(h, p["g1"], p["be1"]), p["w2"], p["b2"], p["w3"]) + p["b3"]
      return ln(s, p["g2"], p["be2"]) @ p["wo"]

    feat = (P(None, None, "x"), P("x"), P("x"))
    feat2 = (P(None, None, ("a", "b")), P(("a", "b")), P(("a", "b")))
    CASES = {
        "batch sharded": program(sm(ln, M4, (P("x"), P(), P()), P("x"))),
        "2x2 mesh, batch and tokens": program(sm(ln, M22, (P("a", "b"), P(), P()), P("a", "b"))),
        "features sharded, no psum": program(sm(ln, M4, feat, feat[0])),
        "features sharded, psum mean": program(sm(psum_mean, M4, feat, feat[0])),
        "psum mean over one shard's size": program(sm(psum_local_size, M4, feat, feat[0])),
        "psum mean over both axes of a 2x2 mesh": program(sm(psum_mean_2d, M22, feat2, feat2[0])),
        "psum over one of the two mesh axes": program(sm(psum_one_of_two, M22, feat2, feat2[0])),
        "psum across the batch's mesh axis": program(sm(psum_other_axis, M4, (P("x"), P(), P()), P("x"))),
        "psum mean of a column-parallel projection": column_parallel,
        "a mean per shard and a psum mean of one h": program(sm(local_and_psum_mean, M4, feat, feat[0])),
        "a mean per shard and psum over one shard's size": program(sm(local_and_local_size, M4, feat, feat[0])),
        "mean over sharded tokens": program(sm(wrong_axis, M22, (P(None, "a"), P(), P()), P(None, "a"))),
        "elementwise shard_map, norm outside": program(elementwise),
        "whole model": whole,
        "row-parallel projection": row_parallel,
        "parallel MLP": mlp_parallel,
    }
    p = make_params(0, **SHAPES)
    rng = np.random.default_rng(5)
    xs = [jnp.asarray(rng.standard_normal(s)) for s in ((4, 4, 5), (8, 4, 5))]
    out = {}
    for name, f in CASES.items():
      r = jaxfold.fold(p, f, xs[0])
      jf, jr = jax.jit(f), jax.jit(r.apply_fn)
      err = max(rel_err(jf(p, x), jr(r.params, x)) for x in xs)
      cb = jaxfold.cbwc(p, f, xs[0])
      q = make_params(1, **SHAPES)
      loss = lambda fn: lambda q: jnp.sum(jnp.sin(fn(q, xs[1])))
      cerr = rel_err(jax.jit(f)(q, xs[1]), jax.jit(cb.apply_fn)(q, xs[1]))
      gerr = rel_err(jax.jit(jax.grad(loss(f)))(q), jax.jit(jax.grad(loss(cb.apply_fn)))(q))
      out[name] = {"folded": r.report.num_folded, "err": err, "cbwc_err": cerr, "grad_err": gerr,
                   "centered": [sorted(c.label() for c in s.centered) for s in r.report.sites if s.folded],
                   "refused": [s.reason for s in r.report.sites if not s.folded]}
    print(json.dumps(out))
''')

EXPECT = {   # folded sites, and the first folded site's centerings
    "batch sharded": (2, ["b1[0]", "w1[1]"]),
    "2x2 mesh, batch and tokens": (2, ["b1[0]", "w1[1]"]),
    "features sharded, no psum": (2, ["b1[0/2]", "w1[1/2]"]),    # a GroupNorm: one group per shard
    # a mean over the whole (sharded) feature axis, psum(Σ h) / n: a LayerNorm over the global features,
    # folded by centering the producer over all of them
    "features sharded, psum mean": (2, ["b1[0]", "w1[1]"]),
    "psum mean over one shard's size": (0, None),
    "psum mean over both axes of a 2x2 mesh": (2, ["b1[0]", "w1[1]"]),
    "psum over one of the two mesh axes": (0, None),
    "psum across the batch's mesh axis": (0, None),
    "psum mean of a column-parallel projection": (0, None),
    # a per-shard mean wants w1 centered per shard, whose shift differs across shards: the psum mean
    # does not cancel it (refused), and the global centering folds the psum mean (and the final norm)
    "a mean per shard and a psum mean of one h": (2, ["b1[0]", "w1[1]"]),
    "a mean per shard and psum over one shard's size": (0, None),
    "mean over sharded tokens": (0, None),
    # not proved: a zero sum over the whole features spans the shards (a sound refusal, pinned)
    "elementwise shard_map, norm outside": (0, None),
    "whole model": (2, ["b1[0]", "w1[1]"]),
    "row-parallel projection": (2, ["b1[0]", "w1[1]"]),
    "parallel MLP": (2, ["b1[0]", "w1[1]"]),
}


@pytest.fixture(scope="module")
def four_devices():
  env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  env["JAX_PLATFORMS"] = "cpu"
  here = Path(__file__).resolve().parent
  env["PYTHONPATH"] = os.pathsep.join([str(here.parent.parent), str(here.parent), env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, "-c", SCRIPT, str(here)], env=env, capture_output=True, text=True,
                        timeout=600, cwd=str(here))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


# The refused means across shards are reported, each with what its proof lacks.
REFUSED_4 = {
    "psum mean over one shard's size": "the shift reaches the nonlinearity",   # psum(Σ h)/L: no cancellation
    "psum over one of the two mesh axes": "not exactly the mesh axes that split its reduced axes",
    "psum across the batch's mesh axis": "not exactly the mesh axes that split its reduced axes",
    "psum mean of a column-parallel projection": "of a value computed inside the shard_map",
}


@pytest.mark.parametrize("name", list(EXPECT))
def test_shard_map_four_devices(four_devices, name):
  res = four_devices[name]
  folded, centered = EXPECT[name]
  assert res["folded"] == folded, res
  if centered is not None:
    assert res["centered"][0] == centered, res
  if name in REFUSED_4:
    assert res["refused"] and all(REFUSED_4[name] in r for r in res["refused"]), res
  assert res["err"] < 1e-9 and res["cbwc_err"] < 1e-9 and res["grad_err"] < 1e-8, res
