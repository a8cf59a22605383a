"""Short reprs of jaxfold's result types: shapes and dtypes, never values.

``repr(folded)`` in a REPL or notebook should fit on a screen whatever the
model's size, so parameters are summarised (leaf count, bytes, dtypes) and the
report by its summary line.
"""

from __future__ import annotations

from typing import Any

from jaxfold._src.report import _bytes, param_label


def _leaf_text(x: Any) -> str:
  shape = getattr(x, "shape", None)
  dtype = getattr(x, "dtype", None)
  if shape is None or dtype is None:
    return type(x).__name__
  return f"{dtype}[{','.join(map(str, shape))}]"


def tree_summary(tree: Any) -> str:
  """``<12 leaves, 44.5 KiB, float32>``: a pytree by size, not by value.

  Example:
    >>> import numpy as np
    >>> tree_summary({"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)})
    '<2 leaves, 36 B, float32>'
  """
  import jax
  leaves = jax.tree_util.tree_leaves(tree)
  nbytes = sum(int(getattr(x, "size", 0)) * getattr(getattr(x, "dtype", None), "itemsize", 0)
               for x in leaves)
  dtypes = sorted({str(x.dtype) for x in leaves if hasattr(x, "dtype")})
  return f"<{len(leaves)} leaves, {_bytes(nbytes)}, {'/'.join(dtypes) or 'no arrays'}>"


def _named(d: dict) -> str:
  return "{" + ", ".join(f"{param_label(str(k))!r}: {_leaf_text(v)}" for k, v in d.items()) + "}"


def params_repr(self) -> str:
  return f"Params(params={tree_summary(self.params)}, extras={_named(self.extras)})"


def quant_params_repr(self) -> str:
  return f"QuantParams(base={_params(self.base)}, weights={tree_summary(self.weights)})"


def result_repr(self) -> str:
  """``Folded(params=..., apply_fn=<folded apply_fn of f>, report=<...>)`` for
  Folded/Fused/Rotated, whose fields are (params, apply_fn, report)."""
  return (f"{type(self).__name__}(params={_params(self.params)}, apply_fn=<{_fn_name(self.apply_fn)}>, "
          f"report=<{_summary(self.report)}>)")


def _params(p: Any) -> str:
  return repr(p) if hasattr(p, "_fields") else tree_summary(p)


def _fn_name(fn: Any) -> str:
  return f"{type(fn).__name__} of {getattr(fn, '__name__', '?')}"


def _summary(report: Any) -> str:
  if hasattr(report, "summary"):
    return report.summary()
  lines = str(report).splitlines() or [type(report).__name__]
  # FuseReport ends with its count line, RotateReport starts with it.
  return lines[0] if type(report).__name__ == "RotateReport" else lines[-1]


# Fields of the parameter types that jaxfold.Params replaced, and where they went.
_RENAMED = {"untied": "a fold's untied copies are in .extras", "base": "a fused model's parameters are .params "
            "(the user's tree) and .extras (untied copies, scaled copies, new biases)"}


def not_a_variable_dict(self, name: str):
  """``Params.__getattr__``: flax's ``model.apply`` (and anything else
  expecting a dict) asks for ``.items``/``.keys``; say what to pass instead."""
  if name.startswith("__"):
    raise AttributeError(name)
  if name in _RENAMED:
    raise AttributeError(f"'Params' object has no attribute {name!r}: {_RENAMED[name]}")
  raise AttributeError(
      f"'Params' object has no attribute {name!r}: folded.params is not a variable dict "
      "but (params, extras), the input of folded.apply_fn — call folded.apply_fn(folded.params, "
      "...). For the original model (e.g. model.apply) pass folded.params.params: the same "
      "function (every in-place centering is invisible there), without the speedup")
