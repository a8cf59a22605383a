"""A structural fingerprint of the program a fold was made for.

``save_fold`` traces the *original* ``apply_fn`` at the fold's abstract
parameters and example arguments and stores one line per primitive
application (primitive, parameters, input/output shapes and which values flow
where; jit/custom-derivative wrappers inlined, names and addresses dropped),
with their SHA-256, in ``program.json``.  ``load_fold`` traces the apply_fn it
is given the same way: another architecture (more heads, another width), or
the same model with an extra operation (``apply(p, x) * 2``), gives other
lines, and the error names the first one that differs.

Example:
    >>> fp = fingerprint(apply_fn, params, (ids,), {})
    >>> fp["sha256"], fp["equations"]
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Callable, Optional

import jax

from jaxfold._src import compat
from jaxfold._src.rules import rule_for

__all__ = ["fingerprint", "difference"]

_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")
# Parameters that name or wrap things without changing what is computed.
_SKIP = {"name", "debug_info", "donated_invars", "inline", "keep_unused", "in_shardings",
         "out_shardings", "in_layouts", "out_layouts", "ctx_mesh", "compiler_options_kvs",
         "resource_env", "jvp_jaxpr_fun", "jvp_jaxpr_thunk", "fwd_jaxpr_thunk", "bwd", "out_trees",
         "symbolic_zeros", "num_consts", "prevent_cse", "differentiated", "policy"}


def _is_array(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _aval(v: Any) -> str:
  a = compat.aval(v)
  return f"{compat.dtype_name(a.dtype)}{list(a.shape)}" if hasattr(a, "shape") else str(a)


class _Walker:
  def __init__(self):
    self.lines: list = []
    self.ids: dict = {}
    self.n = 0

  def fresh(self, v: Any) -> int:
    if id(v) not in self.ids:
      self.ids[id(v)] = self.n
      self.n += 1
    return self.ids[id(v)]

  def name(self, v: Any) -> str:
    if compat.is_literal(v):
      val = compat.literal_value(v)
      return f"lit({_ADDR.sub('', repr(getattr(val, 'tolist', lambda: val)()))[:60]})"
    return f"%{self.fresh(v)}"

  def param(self, k: str, v: Any, depth: int) -> Optional[str]:
    if k in _SKIP or callable(v) and not hasattr(v, "eqns"):
      return None
    inner = getattr(v, "jaxpr", v)
    if hasattr(inner, "eqns"):
      self.sub(v, depth + 1)
      return f"{k}=<jaxpr>"
    if isinstance(v, (tuple, list)) and v and all(hasattr(getattr(x, "jaxpr", x), "eqns") for x in v):
      for x in v:
        self.sub(x, depth + 1)
      return f"{k}=<{len(v)} jaxprs>"
    return f"{k}={_ADDR.sub('', repr(v))[:200]}"

  def sub(self, closed: Any, depth: int, bind: Optional[list] = None) -> list:
    jaxpr, _ = compat.open_jaxpr(closed)
    for i, v in enumerate(list(compat.constvars(jaxpr)) + list(jaxpr.invars)):
      if bind is not None and i >= len(compat.constvars(jaxpr)):
        outer = bind[i - len(compat.constvars(jaxpr))]
        if not compat.is_literal(outer):
          self.ids[id(v)] = self.fresh(outer)
          continue
      self.name(v)
    for eqn in jaxpr.eqns:
      call = rule_for(eqn.primitive).inline(eqn)
      if call is not None and call.wrapper:
        # Wrappers are inlined: jax.jit(apply) and apply are the same program.
        outs = self.sub(call.body, depth, bind=list(eqn.invars))
        for o, v in zip(outs, eqn.outvars):
          if not compat.is_literal(o):
            self.ids[id(v)] = self.fresh(o)
        continue
      params = [p for k, v in sorted(eqn.params.items()) if (p := self.param(k, v, depth)) is not None]
      ins = ", ".join(f"{self.name(v)}:{_aval(v)}" for v in eqn.invars)
      outs = ", ".join(f"{self.name(v)}:{_aval(v)}" for v in eqn.outvars)
      self.lines.append(f"{'  ' * depth}{eqn.primitive.name}({ins}) -> ({outs}) {' '.join(params)}")
    return list(jaxpr.outvars)


def fingerprint(apply_fn: Callable, params: Any, args: tuple, kwargs: dict) -> dict:
  """``{"sha256", "equations", "lines", "outputs"}`` of ``apply_fn(params, *args, **kwargs)``
  traced on abstract values (array keyword arguments traced, the others static).

  Example:
      >>> fingerprint(lambda p, x: x * p, 2.0, (jnp.ones(3),), {})["equations"]
      1
  """
  leaves, tree = jax.tree_util.tree_flatten(kwargs)
  dyn = [_is_array(x) for x in leaves]

  def call(p, a, kw):
    it = iter(kw)
    full = [next(it) if d else x for x, d in zip(leaves, dyn)]
    return apply_fn(p, *a, **jax.tree_util.tree_unflatten(tree, full))

  def abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if _is_array(x) else x

  closed, shape = jax.make_jaxpr(call, return_shape=True)(
      jax.tree_util.tree_map(abstract, params), jax.tree_util.tree_map(abstract, tuple(args)),
      [abstract(x) for x, d in zip(leaves, dyn) if d])
  w = _Walker()
  w.sub(closed, 0)
  outputs = [f"{compat.dtype_name(s.dtype)}{list(s.shape)}" for s in jax.tree_util.tree_leaves(shape)]
  text = "\n".join(w.lines + ["outputs " + " ".join(outputs)])
  return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "equations": len(w.lines),
          "outputs": outputs, "lines": w.lines}


def difference(saved: dict, now: dict) -> Optional[str]:
  """What differs between two fingerprints (None when they match)."""
  if saved.get("sha256") == now["sha256"]:
    return None
  parts = []
  if saved.get("outputs") != now["outputs"]:
    parts.append(f"outputs {saved.get('outputs')} when saved, {now['outputs']} now")
  if saved.get("equations") != now["equations"]:
    parts.append(f"{saved.get('equations')} operations when saved, {now['equations']} now")
  old, new = list(saved.get("lines") or []), now["lines"]
  for i, (a, b) in enumerate(zip(old, new)):
    if a != b:
      parts.append(f"first difference at operation {i}: saved `{a.strip()[:160]}`, now "
                   f"`{b.strip()[:160]}`")
      break
  else:
    if len(old) != len(new):
      extra = (new if len(new) > len(old) else old)[min(len(old), len(new))]
      parts.append(f"operation {min(len(old), len(new))} `{extra.strip()[:160]}` is "
                   f"{'new' if len(new) > len(old) else 'gone'}")
  return "; ".join(parts) or "the traced programs differ"
