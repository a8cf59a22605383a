"""The soundness checks shared by the fuzzer and the per-rule tests.

``check_fold(...)`` runs, in float64, everything a sound fold must satisfy and
returns the list of failures (empty when sound):

  (a) ``jaxfold.fold`` and ``jaxfold.cbwc`` do not raise (refusing to fold a
      site is fine; an exception is not);
  (b) the folded program equals the original at the example arguments and at
      every further argument set (another batch size and, where the program
      accepts one, another sequence length); at a further argument set a
      FoldError saying those shapes need other folded parameters is allowed;
  (c) CBWC's apply, at parameters the analysis never saw, equals the original;
  (d) CBWC's gradients (of a fixed random projection of the outputs) equal the
      original's, leaf by leaf;
  (e) every in-place centering that fold or CBWC chose is invisible: adding to
      that parameter a random tensor constant over each block of its
      ``Centering.spec`` leaves the ORIGINAL program's outputs unchanged.

Every function is traced once (``jax.make_jaxpr``) and evaluated by
``np_eval`` (NumPy, no XLA compilation: compiling each program's kernels costs
seconds per program on a small CPU machine); every failure found that way is
re-checked with plain JAX before it is reported.
"""

from __future__ import annotations

import dataclasses
import re
import traceback
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import np_eval
import numpy as np

import jaxfold

F64 = jnp.float64


def rel_err(a, b) -> float:
  """Max over leaves of max|a − b| / max|a| (ints compared as floats); a leaf's
  denominator is at least 1e-6 of the largest output, so that an output that
  is zero in exact arithmetic (rounding noise) does not count."""
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  if len(la) != len(lb):
    return float("inf")
  xs = [np.asarray(x, np.float64) for x in la]
  ys = [np.asarray(y, np.float64) for y in lb]
  scale = max([_max_abs(x) for x in xs] + [0.0])
  errs = [0.0]
  for x, y in zip(xs, ys):
    if x.shape != y.shape or not _same_nonfinite(x, y):
      return float("inf")
    if x.size == 0:
      continue
    denom = max(_max_abs(x), 1e-6 * scale, 1e-30)
    errs.append(_max_abs(x - y) / denom)
  return max(errs)


def _same_nonfinite(x: np.ndarray, y: np.ndarray) -> bool:
  """Non-finite entries (a singular point of the original, e.g. the gradient of
  a norm of an identically zero input) must be the same in both."""
  fx, fy = np.isfinite(x), np.isfinite(y)
  return bool(np.array_equal(fx, fy) and np.array_equal(x[~fx], y[~fy], equal_nan=True))


def _max_abs(x: np.ndarray) -> float:
  """max |x| over the finite entries (``x − y`` is NaN where both are ±inf)."""
  x = x[np.isfinite(x)]
  return float(np.max(np.abs(x))) if x.size else 0.0


def float_leaves(tree) -> list:
  return [x for x in jax.tree_util.tree_leaves(tree)
          if jnp.issubdtype(jnp.result_type(x), jnp.floating)]


def projection_loss(example_out, seed: int = 1234) -> Callable:
  """Sum of squares of a fixed random projection of every float output."""
  mats = []
  for i, o in enumerate(float_leaves(example_out)):
    rng = np.random.default_rng(seed + i)
    mats.append(jnp.asarray(rng.standard_normal((int(np.size(o)), 3)), F64))

  def loss(out):
    total = jnp.zeros((), F64)
    for o, m in zip(float_leaves(out), mats):
      total = total + jnp.sum((jnp.reshape(o, (-1,)).astype(F64) @ m) ** 2)
    return total
  return loss


def grad_errors(g_ref, g_other) -> list:
  """[(leaf path, error)]: max|a − b| / max(max|a|, 1e-3 · the largest gradient),
  so that leaves whose gradient is zero in exact arithmetic (rounding noise)
  do not count."""
  paths = jax.tree_util.tree_flatten_with_path(g_ref)[0]
  ref_leaves = [np.asarray(x, np.float64) for _, x in paths]
  other = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(g_other)]
  if len(other) != len(ref_leaves):
    return [("<structure>", float("inf"))]
  scale = max([_max_abs(x) for x in ref_leaves] + [0.0])
  out = []
  for (path, _), x, y in zip(paths, ref_leaves, other):
    if not x.size:
      continue
    denom = max(_max_abs(x), 1e-3 * scale, 1e-30)
    ok = x.shape == y.shape and _same_nonfinite(x, y)
    out.append((jax.tree_util.keystr(path), _max_abs(x - y) / denom if ok else float("inf")))
  return out


def shift_along(key: int, shape, spec) -> np.ndarray:
  """A random tensor constant over each joint block of ``spec`` ((dim, block) pairs)."""
  spec = dict(spec)
  small = [s // spec[d] if d in spec else s for d, s in enumerate(shape)]
  if any(s * spec[d] != shape[d] for d, s in enumerate(small) if d in spec):
    raise ValueError(f"blocks {spec} do not tile shape {tuple(shape)}")
  r = np.random.default_rng(key).standard_normal(small)
  for d, b in spec.items():
    r = np.repeat(r, b, axis=d)
  return r


def in_place_centerings(*reports) -> list:
  seen = []
  for rep in reports:
    for site in rep.sites:
      for c in site.centered:
        if c.mode == "in place" and (c.param, tuple(c.spec)) not in seen:
          seen.append((c.param, tuple(c.spec)))
  return seen


# fuse_affine moves γ/β through float casts by design ("exact in real
# arithmetic, rounded at another point"): outputs then match to the precision
# of the narrowest such cast. A label this table does not know gets no
# allowance (a default of 1.0 once switched a fuzzer's output check off).
_CAST_TOLS = {"float64": 1e-9, "float32": 1e-5, "float16": 3e-2, "bfloat16": 3e-2}


def _one_cast_tol(label: str) -> float:
  if label in _CAST_TOLS:
    return _CAST_TOLS[label]
  m = re.fullmatch(r"(\d+) mantissa bits", label)   # lax.reduce_precision
  return 2.0 ** (5 - int(m.group(1))) if m else 0.0


def cast_tol(report, floor: float = 0.0) -> float:
  """The tolerance a fused result's report allows for the casts it names."""
  casts = [r.split(":")[0] for site in report.sites for r in site.reason.split("through a cast to ")[1:]]
  return max([_one_cast_tol(c.strip()) for cast in casts for c in cast.split(",")] + [floor])


def _exc(e: BaseException) -> str:
  tb = traceback.format_exception(type(e), e, e.__traceback__, limit=-4)
  return "".join(tb).rstrip()


def _needs_other_plan(e: Exception) -> bool:
  """The FoldError a folded apply_fn raises where another input shape needs
  other folded parameters (a refusal that names the shapes, not a crash)."""
  return "need different folded parameters" in str(e)


@dataclasses.dataclass
class Result:
  failures: list
  fold_report: Any = None
  cbwc_report: Any = None
  other_plan: list = dataclasses.field(default_factory=list)   # argument sets refused by FoldError

  def describe(self) -> str:
    out = []
    if self.fold_report is not None:
      out += ["fold report:", str(self.fold_report)]
    if self.cbwc_report is not None:
      out += ["cbwc report:", str(self.cbwc_report)]
    return "\n".join(out)


class _Traced:
  """A function traced once at fixed argument shapes and evaluated by
  ``np_eval`` for any argument values of those shapes."""

  def __init__(self, fn: Callable, *args):
    self.closed, self.tree = np_eval.trace(fn, *args)

  def __call__(self, *args):
    outs = np_eval.eval_closed(self.closed, jax.tree_util.tree_leaves(args))
    return jax.tree_util.tree_unflatten(self.tree, outs)


def _confirm(label: str, err_np: float, tol: float, jax_err: Optional[Callable]) -> str:
  """A failure found with the NumPy evaluator, re-checked with plain JAX
  (``jax_err`` None: not re-checked, to save time)."""
  if jax_err is None:
    return f"{label}: rel err {err_np:.3g}"
  try:
    err_j = jax_err()
  except Exception as e:  # noqa: BLE001
    return f"{label}: rel err {err_np:.3g} (re-check with JAX raised {type(e).__name__}: {e})"
  if err_j < tol:
    return (f"{label}: rel err {err_np:.3g} with the NumPy evaluator but {err_j:.3g} with JAX: "
            "a bug in tests/test_jaxfold/np_eval.py, not (necessarily) in jaxfold")
  return f"{label}: rel err {err_j:.3g} (confirmed with JAX)"


_CBWC_OPTIONS = ("auxiliary_centering", "tied_weights", "through_dropout")


def check_fold(apply: Callable, params: Any, args: list, other_params: Any = None, *,
               fold_kwargs: Optional[dict] = None, tol: float = 1e-9, grad_tol: float = 1e-8,
               grads: bool = True, cbwc: bool = True) -> Result:
  """Runs checks (a)-(e); ``args`` is a list of argument tuples, the first the
  example arguments. Must be called with x64 enabled.

  Every function is traced once and evaluated with ``np_eval`` (no XLA
  compilation); each failure is re-checked with plain JAX before it is
  reported."""
  fails: list = []
  res = Result(fails)
  fold_kwargs = dict(fold_kwargs or {})
  q = params if other_params is None else other_params
  a0 = args[0]
  orig = [_Traced(apply, params, *a) for a in args]
  refs = [orig[v](params, *a) for v, a in enumerate(args)]

  # (a) + (b): fold.
  try:
    f = jaxfold.fold(params, apply, *a0, **fold_kwargs)
    res.fold_report = f.report
  except Exception as e:  # noqa: BLE001 - any exception is a failure here
    fails.append(f"(a) jaxfold.fold raised {type(e).__name__}: {e}\n{_exc(e)}")
    f = None
  if f is not None:
    for v, (a, ref) in enumerate(zip(args, refs)):
      try:
        out = np_eval.run(f.apply_fn, f.params, *a)
      except jaxfold.FoldError as e:
        if v and _needs_other_plan(e):   # a clear refusal at another shape is allowed
          res.other_plan.append(v)
          continue
        fails.append(f"(b) folded apply_fn raised at argument set {v}: FoldError: {e}\n{_exc(e)}")
        continue
      except Exception as e:  # noqa: BLE001
        fails.append(f"(b) folded apply_fn raised at argument set {v}: {type(e).__name__}: {e}\n{_exc(e)}")
        continue
      err = rel_err(ref, out)
      if not err < tol:
        fails.append(_confirm(
            f"(b) folded != original at argument set {v} (shape {np.shape(jax.tree_util.tree_leaves(a)[0])})",
            err, tol, lambda a=a: rel_err(jax.jit(apply)(params, *a), jax.jit(f.apply_fn)(f.params, *a))))

  # (c) + (d): CBWC at other parameters.
  r = None
  if cbwc:
    try:
      # the options both take (norm_impl and generic_shapes are the fold's alone)
      r = jaxfold.cbwc(params, apply, *a0, **{k: v for k, v in fold_kwargs.items() if k in _CBWC_OPTIONS})
      res.cbwc_report = r.report
    except Exception as e:  # noqa: BLE001
      fails.append(f"(a) jaxfold.cbwc raised {type(e).__name__}: {e}\n{_exc(e)}")
  if r is not None:
    ref_q = orig[0](q, *a0)
    try:
      out_q = np_eval.run(r.apply_fn, q, *a0)
      err = rel_err(ref_q, out_q)
      if not err < tol:
        fails.append(_confirm("(c) CBWC != original at parameters the analysis never saw", err, tol,
                              lambda: rel_err(jax.jit(apply)(q, *a0), jax.jit(r.apply_fn)(q, *a0))))
    except Exception as e:  # noqa: BLE001
      fails.append(f"(c) CBWC apply_fn raised {type(e).__name__}: {e}\n{_exc(e)}")
    centered = bool(in_place_centerings(r.report)) or r.report.num_folded or r.report.untied_bytes
    if grads and centered:      # nothing centered: the CBWC program is the original one
      loss = projection_loss(ref_q)

      def grad_of(fn):
        return lambda t: jax.grad(lambda u: loss(fn(u, *a0)))(t)
      g_ref = g_cb = None
      try:
        g_ref = np_eval.run(grad_of(apply), q)
      except Exception as e:  # noqa: BLE001
        fails.append(f"harness: the original program is not differentiable "
                     f"({type(e).__name__}: {e}); mark it so in the test\n{_exc(e)}")
      if g_ref is not None:
        try:
          g_cb = np_eval.run(grad_of(r.apply_fn), q)
        except Exception as e:  # noqa: BLE001
          fails.append(f"(d) the gradient of CBWC's apply_fn raised {type(e).__name__}: {e} "
                       f"(the original's gradient exists)\n{_exc(e)}")
      if g_cb is not None:
        errs = grad_errors(g_ref, g_cb)
        bad = sorted([(e, path) for path, e in errs if not e < grad_tol], reverse=True)
        if bad:
          worst, path = bad[0]
          fails.append(_confirm(
              f"(d) CBWC gradients differ for {len(bad)} of {len(errs)} leaves "
              f"({', '.join(p for _, p in bad[:4])}{', ...' if len(bad) > 4 else ''}); worst {path}",
              worst, grad_tol,
              lambda path=path: dict(grad_errors(jax.jit(grad_of(apply))(q),
                                                 jax.jit(grad_of(r.apply_fn))(q)))[path]))

  # (e): every in-place centering is invisible in the original program.
  reports = [x for x in (res.fold_report, res.cbwc_report) if x is not None]
  if reports:
    paths_leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    index = {jax.tree_util.keystr(path): i for i, (path, _) in enumerate(paths_leaves)}
    leaves = [x for _, x in paths_leaves]
    for k, (param, spec) in enumerate(in_place_centerings(*reports)):
      if param not in index:
        fails.append(f"(e) a centering names an unknown parameter {param}")
        continue
      i = index[param]
      try:
        bump = 3.0 * shift_along(100 + k, np.shape(leaves[i]), spec)
      except Exception as e:  # noqa: BLE001
        fails.append(f"(e) centering {param} has a spec {spec} that does not tile its shape "
                     f"{np.shape(leaves[i])}: {e}")
        continue
      shifted = list(leaves)
      shifted[i] = leaves[i] + jnp.asarray(bump, jnp.result_type(leaves[i]))
      pt = jax.tree_util.tree_unflatten(tree, shifted)
      err = rel_err(refs[0], orig[0](pt, *a0))
      if not err < tol:
        first = not any(x.startswith("(e)") for x in fails)     # re-check the first one only
        fails.append(_confirm(f"(e) centering {param} over blocks {spec} is visible at the outputs",
                              err, tol, (lambda pt=pt: rel_err(jax.jit(apply)(params, *a0),
                                                               jax.jit(apply)(pt, *a0))) if first else None))
  return res


# ----------------------------------------------------------------------------
# Helpers for small hand-written programs (the per-rule tests).

DIN = 5
BATCHES = (2, 3)


def make_params(seed: int, **shapes) -> dict:
  """Random float64 parameters by name: ``g*`` are γ (1 + 0.5 N), ``be*``/``b*``
  are β and biases (0.3 + 0.5 N), ``w*`` kernels (N / sqrt(fan-in)), anything
  else 0.7 N. Needs x64."""
  rng = np.random.default_rng(seed)
  out = {}
  for name in sorted(shapes):
    shape = tuple(shapes[name])
    n = rng.standard_normal(shape)
    if name.startswith("g"):
      v = 1.0 + 0.5 * n
    elif name.startswith("b"):
      v = 0.3 + 0.5 * n
    elif name.startswith("w"):
      v = n / np.sqrt(max(1, int(np.prod(shape[:-1]))))
    else:
      v = 0.7 * n
    out[name] = jnp.asarray(v, F64)
  return out


def x_args(seed: int = 0, tokens: int = 4, din: int = DIN, extra: Optional[Callable] = None) -> list:
  """Argument sets at batch 2 and batch 3: (x,) or (x, *extra(rng, batch))."""
  out = []
  for b in BATCHES:
    rng = np.random.default_rng([seed, b])
    a = (jnp.asarray(rng.standard_normal((b, tokens, din)), F64),)
    if extra is not None:
      a = a + tuple(extra(rng, b))
    out.append(a)
  return out


def assert_sound(apply: Callable, shapes: Any, args: list, *, expect_folded: Optional[int] = None,
                 seed: int = 0, grads: bool = True, tol: float = 1e-9, grad_tol: float = 1e-8,
                 min_folded: Optional[int] = None, convert: Optional[Callable] = None,
                 **fold_kwargs) -> Result:
  """Checks (a)-(e) at random parameters of ``shapes`` (a dict of shapes for
  ``make_params``, or a function seed -> params; mapped by ``convert``, e.g. to
  other dtypes) and, when ``expect_folded`` / ``min_folded`` is given, that fold
  folded exactly / at least that many sites."""
  convert = convert or (lambda p: p)
  init = shapes if callable(shapes) else (lambda s: make_params(s, **shapes))
  params = convert(init(seed))
  other = convert(init(seed + 1))
  res = check_fold(apply, params, args, other, fold_kwargs=fold_kwargs, tol=tol, grad_tol=grad_tol,
                   grads=grads)
  msgs = list(res.failures)
  if expect_folded is not None and res.fold_report is not None:
    if res.fold_report.num_folded != expect_folded:
      msgs.append(f"fold folded {res.fold_report.num_folded} site(s); the mathematics says "
                  f"{expect_folded}")
  if min_folded is not None and res.fold_report is not None:
    if res.fold_report.num_folded < min_folded:
      msgs.append(f"fold folded {res.fold_report.num_folded} site(s); the mathematics says at "
                  f"least {min_folded}")
  assert not msgs, "\n".join(msgs) + "\n" + res.describe()
  return res
