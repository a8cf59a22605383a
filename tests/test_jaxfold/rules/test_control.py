"""Calls and control flow: jit / checkpoint / custom_jvp / custom_vjp blocks
reused with different parameters, scan over stacked layers, cond, while, vmap.

For the control-flow rule module to come (scan/cond/while); see
``test_elementwise.py`` for what every test checks. Site counts inside loop
bodies depend on how sites are counted, so loops pin a lower bound only.
"""

import fuzz_programs as fp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fold_checks import DIN, assert_sound, x_args
from jax import lax

F64 = jnp.float64
D = 8
FF = 16


def block_shapes():
  return {"g": (D,), "be": (D,), "w1": (D, FF), "b1": (FF,), "w2": (FF, D), "b2": (D,)}


def preln_block(h, p, ln=fp.ln_fast):
  return h + jax.nn.gelu(ln(h, p["g"], p["be"]) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def stack_shapes(n):
  return {"w_in": (DIN, D), "b_in": (D,), "layers": [block_shapes()] * n, "g_f": (D,), "be_f": (D,),
          "head": (D, 3)}


def nested_params(seed, spec):
  rng = np.random.default_rng(seed)

  def make(name, s):
    if isinstance(s, dict):
      return {k: make(k, v) for k, v in sorted(s.items())}
    if isinstance(s, list):
      return [make(name, v) for v in s]
    n = rng.standard_normal(s)
    if name.startswith("g"):
      return jnp.asarray(1 + 0.5 * n, F64)
    if name.startswith("b"):
      return jnp.asarray(0.3 + 0.5 * n, F64)
    if name.startswith(("w", "head")):
      return jnp.asarray(n / np.sqrt(max(1, int(np.prod(s[:-1])))), F64)
    return jnp.asarray(0.7 * n, F64)
  return make("", spec)


def sound(apply, spec, args=None, **kw):
  """assert_sound for nested parameter trees."""
  return assert_sound(apply, lambda seed: nested_params(seed, spec), args or x_args(), **kw)


def stack_apply(block):
  def apply(p, x):
    h = x @ p["w_in"] + p["b_in"]
    for lp in p["layers"]:
      h = block(h, lp)
    return fp.ln_two_pass(h, p["g_f"], p["be_f"]) @ p["head"]
  return apply


@pytest.mark.parametrize("wrap", ["checkpoint", "jit"])
def test_reused_block_preln_stack(x64, wrap):
  block = {"checkpoint": jax.checkpoint, "jit": jax.jit}[wrap](preln_block)
  # Pre-LN stack: with W_in, b_in and every block's w2, b2 centered, all 3 block
  # LayerNorms and the final one are foldable.
  sound(stack_apply(block), stack_shapes(3), expect_folded=4)


def test_reused_jit_block_second_call_after_tanh(x64):
  block = jax.jit(lambda h, g, be, w, b: fp.ln_two_pass(h, g, be) @ w + b)

  def apply(p, x):
    h = x @ p["w_in"] + p["b_in"]
    y = block(h, p["g1"], p["be1"], p["w1"], p["b1"])
    return block(jnp.tanh(y), p["g2"], p["be2"], p["w2"], p["b2"])
  spec = {"w_in": (DIN, D), "b_in": (D,), "g1": (D,), "be1": (D,), "w1": (D, D), "b1": (D,),
          "g2": (D,), "be2": (D,), "w2": (D, D), "b2": (D,)}
  sound(apply, spec, expect_folded=1)


def _custom_vjp_dense_ln(kind):
  def dense_ln(x, w, b, g, be):
    return fp.ln_fast(x @ w + b, g, be)

  @jax.custom_vjp
  def f(x, w, b, g, be):
    return dense_ln(x, w, b, g, be)

  def fwd(*args):
    return dense_ln(*args), args

  def bwd(res, ct):
    _, vjp = jax.vjp(dense_ln, *res)
    if kind == "scaled":
      return vjp(0.5 * ct)
    c = vjp(ct)
    if kind == "clipped":
      return (c[0], jnp.clip(c[1], -0.05, 0.05), jnp.clip(c[2], -0.05, 0.05), c[3], c[4])
    return c
  f.defvjp(fwd, bwd)
  return f


@pytest.mark.parametrize("kind", ["true", "scaled", "clipped"])
def test_custom_vjp_gradients(x64, kind):
  # CBWC must give the custom gradients (check (d)), whatever the bwd does.
  f = _custom_vjp_dense_ln(kind)

  def apply(p, x):
    return f(x, p["w"], p["b"], p["g"], p["be"]) @ p["head"]
  sound(apply, {"w": (DIN, D), "b": (D,), "g": (D,), "be": (D,), "head": (D, 3)})


@pytest.mark.parametrize("straight_through", [False, True])
def test_custom_jvp_layernorm(x64, straight_through):
  @jax.custom_jvp
  def ln(h, g, be):
    return fp.ln_two_pass(h, g, be)

  @ln.defjvp
  def ln_jvp(primals, tangents):
    if straight_through:
      h, g, be = primals
      return ln(h, g, be), tangents[0] * g + tangents[2]
    return jax.jvp(fp.ln_two_pass, primals, tangents)

  def apply(p, x):
    z = jnp.tanh(ln(x @ p["w"] + p["b"], p["g1"], p["be1"]) @ p["w2"] + p["b2"])
    return ln(z, p["g2"], p["be2"]) @ p["head"]
  sound(apply, {"w": (DIN, D), "b": (D,), "g1": (D,), "be1": (D,), "w2": (D, D), "b2": (D,),
                "g2": (D,), "be2": (D,), "head": (D, 3)})


def _stacked(n):
  return {"w_in": (DIN, D), "b_in": (D,), "g_f": (D,), "be_f": (D,), "head": (D, 3),
          **{f"layers_{k}": (n,) + s for k, s in block_shapes().items()}}


def _layers(p):
  return {k[len("layers_"):]: v for k, v in p.items() if k.startswith("layers_")}


@pytest.mark.parametrize("leak", [False, True])
def test_scan_over_stacked_layers(x64, leak):
  def apply(p, x):
    h = x @ p["w_in"] + p["b_in"]

    def body(c, lp):
      y = preln_block(c, lp)
      if leak:     # 0.1 * LN output (not zero-mean) joins the carry: no fixed point
        y = y + 0.1 * fp.ln_fast(c, lp["g"], lp["be"])
      return y, None
    h, _ = lax.scan(body, h, _layers(p))
    return fp.ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]
  sound(apply, _stacked(3), min_folded=None if leak else 1)


@pytest.mark.parametrize("tanh_branch", [False, True])
def test_cond_between_blocks(x64, tanh_branch):
  def apply(p, x, flag):
    h = x @ p["w_in"] + p["b_in"]
    other = jnp.tanh if tanh_branch else (lambda v: preln_block(v, p["lb"], fp.ln_jnp_var))
    h = lax.cond(flag, lambda v: preln_block(v, p["la"]), other, h)
    return fp.ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]
  spec = {"w_in": (DIN, D), "b_in": (D,), "la": block_shapes(), "lb": block_shapes(), "g_f": (D,),
          "be_f": (D,), "head": (D, 3)}
  args = x_args(extra=lambda rng, b: (jnp.asarray(b == 2),))
  # Both blocks' norms (centered W_in, b_in, w2, b2) and the final norm; with a tanh
  # branch, nothing (the shift of W_in reaches tanh in one branch).
  sound(apply, spec, args, expect_folded=0 if tanh_branch else 3)


def test_while_loop_block(x64):
  def apply(p, x):
    h = x @ p["w_in"] + p["b_in"]
    _, h = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, preln_block(c[1], p["l"])),
                          (jnp.int32(0), h))
    return fp.ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]
  spec = {"w_in": (DIN, D), "b_in": (D,), "l": block_shapes(), "g_f": (D,), "be_f": (D,), "head": (D, 3)}
  sound(apply, spec, grads=False, expect_folded=2)


def test_vmap_block(x64):
  def apply(p, x):
    h = x @ p["w_in"] + p["b_in"]
    h = jax.vmap(preln_block, in_axes=(0, None))(h, p["l"])
    return fp.ln_two_pass(h, p["g_f"], p["be_f"]) @ p["head"]
  spec = {"w_in": (DIN, D), "b_in": (D,), "l": block_shapes(), "g_f": (D,), "be_f": (D,), "head": (D, 3)}
  sound(apply, spec, expect_folded=2)


# ----------------------------------------------------------------------------
# cond / switch / while: one rule each, the shift must be invisible on every
# path the traced index or trip count can take.

_LOOP_SPEC = {"w_in": (DIN, D), "b_in": (D,), "l": block_shapes(), "g_f": (D,), "be_f": (D,),
              "head": (D, 3), "v": (D,)}


def _index_args(n):
  return x_args(extra=lambda rng, b: (jnp.asarray(b % n, jnp.int32),))


@pytest.mark.parametrize("third", ["scale", "feature_scale"])
def test_switch_every_branch(x64, third):
  # Branch 2 multiplies the stream by a scalar (the shift stays constant along
  # D) or by a per-feature vector (the shift varies along D: visible).
  def apply(p, x, i):
    h = x @ p["w_in"] + p["b_in"]
    f = {"scale": lambda v: 0.5 * v, "feature_scale": lambda v: v * p["v"]}[third]
    h = lax.switch(i, [lambda v: preln_block(v, p["l"]), lambda v: v, f], h)
    return fp.ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]
  # scale: the block's norm and the final one. feature_scale: the final norm
  # sees v ⊙ h from branch 2 and the shift of W_in would reach it through
  # v ⊙ (h + c): nothing folds (one site alone never pays for an auxiliary
  # centering).
  sound(apply, _LOOP_SPEC, _index_args(3), expect_folded=2 if third == "scale" else 0)


def test_norm_only_inside_branch(x64):
  # A norm inside one branch folds on its own (input centered upstream); the
  # other branch returns a tanh, so nothing after the cond folds.
  def apply(p, x, flag):
    h = x @ p["w_in"] + p["b_in"]
    h = lax.cond(flag, lambda v: jnp.tanh(v), lambda v: fp.ln_two_pass(v, p["g_f"], p["be_f"]), h)
    return h @ p["head"]
  sound(apply, _LOOP_SPEC, x_args(extra=lambda rng, b: (jnp.asarray(b == 2),)), expect_folded=0)

  def apply2(p, x, flag):
    # The branch norm folds; the norm after the cond sees that norm's output
    # (γ ⊙ n + β, not zero-mean) from branch 1: it does not.
    h = x @ p["w_in"] + p["b_in"]
    y = lax.cond(flag, lambda v: fp.ln_two_pass(v, p["g_f"], p["be_f"]), lambda v: 2.0 * v, h)
    return fp.ln_fast(y, p["l"]["g"], p["l"]["be"]) @ p["head"]
  res = sound(apply2, _LOOP_SPEC, x_args(extra=lambda rng, b: (jnp.asarray(b == 2),)),
              expect_folded=1)
  assert res.fold_report.sites[1].folded and not res.fold_report.sites[0].folded, res.fold_report


@pytest.mark.parametrize("init", ["dense", "tanh"])
def test_while_carry_initial_value(x64, init):
  # The carry is zero-sum only if its initial value is (and the body keeps it).
  def apply(p, x):
    h = x @ p["w_in"] + p["b_in"]
    if init == "tanh":
      h = jnp.tanh(h)
    _, h = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, preln_block(c[1], p["l"])),
                          (jnp.int32(0), h))
    return fp.ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]
  # tanh: the block norm and the final norm both see tanh(h) + centerable
  # terms; one auxiliary centering of tanh(h) folds both.
  res = sound(apply, _LOOP_SPEC, grads=False, expect_folded=2)
  assert len(res.fold_report.auxiliary) == (init == "tanh"), res.fold_report


def test_while_threshold_parameter(x64):
  # The trip count compares a loop counter with a parameter-derived bound: no
  # shift reaches it; and a bound read from the stream makes W_in visible.
  def apply(p, x):
    h = x @ p["w_in"] + p["b_in"]
    bound = 2.0 + jnp.tanh(p["v"][0])
    _, h = lax.while_loop(lambda c: c[0] < bound, lambda c: (c[0] + 1.0, preln_block(c[1], p["l"])),
                          (jnp.float64(0), h))
    return fp.ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]
  sound(apply, _LOOP_SPEC, grads=False, expect_folded=2)


def test_cond_inside_while(x64):
  def apply(p, x, flag):
    h = x @ p["w_in"] + p["b_in"]
    body = lambda c: (c[0] + 1, lax.cond(flag, lambda v: preln_block(v, p["l"]), lambda v: -v, c[1]))
    _, h = lax.while_loop(lambda c: c[0] < 3, body, (jnp.int32(0), h))
    return fp.ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]
  sound(apply, _LOOP_SPEC, x_args(extra=lambda rng, b: (jnp.asarray(b == 2),)), grads=False,
        expect_folded=2)


def test_auxiliary_centering_inside_scan_body(x64):
  # Each step starts its own stream at gelu(x_t W + b) (no parameter centering
  # makes it zero-mean) and runs two pre-LN blocks and a final norm on it: one
  # auxiliary centering inside the body, at every step, folds all three norms.
  def apply(p, x):
    def step(c, xt):
      s = jax.nn.gelu(xt @ p["w_in"] + p["b_in"])
      s = preln_block(preln_block(s, p["la"]), p["lb"])
      return c + 1.0, fp.ln_fast(s, p["g_f"], p["be_f"]) @ p["head"]
    _, ys = lax.scan(step, jnp.zeros((), x.dtype), jnp.swapaxes(x, 0, 1))
    return ys
  spec = {"w_in": (DIN, D), "b_in": (D,), "la": block_shapes(), "lb": block_shapes(), "g_f": (D,),
          "be_f": (D,), "head": (D, 3)}
  res = sound(apply, spec, expect_folded=3)
  assert len(res.fold_report.auxiliary) == 1, res.fold_report
  sound(apply, spec, expect_folded=0, auxiliary_centering=False)


@pytest.mark.parametrize("length", [0, 2])
def test_centering_inside_scan_body_at_zero_trips(x64, length):
  # The body overwrites the carry with a stream that starts at gelu(x W + b)
  # (an auxiliary centering in the body, at every step, makes it zero-sum); two
  # pre-LN blocks and a norm read the final carry after the loop. With zero
  # steps the final carry is the initial tanh(...): the body's centering never
  # runs, so the norms after the loop cannot rely on it.
  def apply(p, x):
    def step(c, _):
      s = jax.nn.gelu(x @ p["w_in"] + p["b_in"])
      return preln_block(s, p["la"]), None
    h, _ = lax.scan(step, jnp.tanh(x @ p["w_0"]), None, length=length)
    h = preln_block(preln_block(h, p["lb"]), p["lc"])
    return fp.ln_fast(h, p["g_f"], p["be_f"]) @ p["head"]
  spec = {"w_in": (DIN, D), "b_in": (D,), "w_0": (DIN, D), "la": block_shapes(), "lb": block_shapes(),
          "lc": block_shapes(), "g_f": (D,), "be_f": (D,), "head": (D, 3)}
  sound(apply, spec, min_folded=1)


@pytest.mark.parametrize("loop", ["scan0", "fori_static", "fori_traced", "while_false"])
def test_zero_trip_loop_keeps_initial_shift(x64, loop):
  # A Dense output enters a loop that runs zero times and whose body drops the
  # carry: the loop returns it unchanged, so centering the Dense (for the LN
  # that also reads it) would change that output.
  def apply(p, x, n):
    h = x @ p["w_in"] + p["b_in"]
    f = lambda c: jnp.zeros_like(c)
    if loop == "scan0":
      c = lax.scan(lambda c, _: (f(c), None), h, None, length=0)[0]
    elif loop == "fori_static":
      c = lax.fori_loop(1, 1, lambda i, c: f(c), h)
    elif loop == "fori_traced":
      c = lax.fori_loop(n, n, lambda i, c: f(c), h)
    else:
      c = lax.while_loop(lambda k: k[0] < n - 5, lambda k: (k[0] + 1, f(k[1])), (0, h))[1]
    return fp.ln_fast(h, p["g_f"], p["be_f"]), c
  spec = {"w_in": (DIN, D), "b_in": (D,), "g_f": (D,), "be_f": (D,)}
  sound(apply, spec, x_args(extra=lambda rng, b: (jnp.asarray(b, jnp.int32),)), expect_folded=0,
        grads=loop in ("scan0", "fori_static"))


def test_control_facets_are_declared():
  """Loops, conditionals and calls are rules: their facets (not the drivers)
  name the bodies, and calls are flattened rather than analysed."""
  from jaxfold._src import compat
  from jaxfold._src.program import Program
  from jaxfold._src.rules import all_rules, call_rules, rule_for
  prims = compat.prims()
  for kind in ("scan", "cond", "while"):
    r = rule_for(prims[kind])
    assert r.name == kind and r.rebind is not None and r in all_rules()
  calls = call_rules()
  assert calls and not set(map(id, calls)) & set(map(id, all_rules()))
  for kind in ("jit", "remat", "custom_jvp", "custom_vjp"):
    assert rule_for(prims[kind]) in calls

  def f(x):
    y = jax.checkpoint(lambda z: jnp.sin(z) * 2)(x)
    y = lax.cond(y[0] > 0, lambda z: z + 1, lambda z: z - 1, y)
    return lax.scan(lambda c, _: (c * 2, None), y, None, length=3)[0]
  closed = jax.make_jaxpr(f)(jnp.ones(3))
  prog = Program(closed)
  names = [n.prim.name for n in prog.nodes]
  assert prims["remat"].name not in names and "sin" in names        # the call is flattened
  subs = {n.prim.name: len(n.subs) for n in prog.nodes if n.subs}
  assert subs == {prims["cond"].name: 2, prims["scan"].name: 1}
  for n in prog.nodes:
    assert len(rule_for(n.prim).bodies(n.eqn)) == len(n.subs)
