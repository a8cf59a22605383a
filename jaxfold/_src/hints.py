"""Hints chosen from what the program and the options actually are.

A hint names an option or a framework setting only where it applies: the
option not already in use, the framework the program was written in.
"""

from __future__ import annotations

from typing import Any


def rotation_aux_hint(report: Any, ties_copied: bool) -> str:
  """Why a fold's auxiliary centerings stop a rotation, and what (if
  anything) to change. ``ties_copied``: the fold untied tied parameters by
  centered copies (``tied_weights="copy"``), so no auxiliary centering
  stands for a tied parameter: each centers a stream that starts at a value
  no parameter rotation reaches (an activation, e.g. GELU output plus
  positions), and no fold option changes that; ``rotate`` (unless
  ``insert=False``) computes ``x @ Q`` there instead."""
  aux = report.auxiliary
  n = len(aux)
  first = f"; {aux[0].describe()}" if aux else ""
  if ties_copied:
    return (f"the fold has {n} auxiliary centering(s) (a mean over the stream) although it already "
            "used tied_weights=\"copy\": the stream starts at a value no parameter rotation reaches "
            "(an activation, e.g. a GELU output plus positions), so its mean is not a parameter's "
            "and no parameter rotation reaches it; rotate without insert=False computes x @ Q "
            f"there in the program{first}")
  return (f"the fold has {n} auxiliary centering(s) (a mean over the stream): where one stands for a "
          "tied parameter (e.g. an embedding reused as the LM head), fold with tied_weights=\"copy\"; "
          "where the stream starts at an activation no parameter rotation reaches, rotate without "
          f"insert=False computes x @ Q there in the program{first}")


def cast_hint(made_by: str, src: str, dst: str) -> str:
  """What to do when the program computes a norm in ``dst`` on ``src``
  values; ``made_by``: the framework whose code made the cast ("" if the
  user's own)."""
  fix = {"keras": f" (Keras: keras.config.set_floatx('{src}'))",
         "flax": f" (flax: the module's dtype argument, e.g. dtype=jnp.{src})"}.get(made_by, "")
  return (f"the program computes this norm in {dst} on {src} values; compute in {src} "
          f"throughout{fix} or fold the {dst} model")
