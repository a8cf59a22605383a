"""The paper's (unsound) choice of folding every normalization, as a
measurement baseline for ``benchmarks/paper_choice_error.py``."""

from __future__ import annotations

from typing import Collection, Optional

import jax

from jaxfold._src import layout, pipeline
from jaxfold._src.analysis import LeafNeed
from jaxfold._src.fold import FoldOptions
from jaxfold._src.planner import Planner
from jaxfold._src.rewrite import Plan, evaluate
from jaxfold._src.rules.base import freeze


def paper_choice(params, apply_fn, *args, sites: Optional[Collection[int]] = None):
  """The paper's choice, for measuring it: *every* normalization's mean
  reduction removed and every parameter that feeds a norm's input additively
  centered, **without** jaxfold's soundness checks. Returns
  ``(outputs, number of sites)``; not a fold (it is generally wrong on trained
  post-LN models, which is what it measures).

  ``sites``: only these sites (indices as in :func:`jaxfold.fold`'s report),
  for a paper whose count leaves some norms alone (VMamba's 36 of 51); the
  number returned is then the number of sites chosen.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jaxfold.benchmarking import paper_choice
    >>> m = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(8), nn.LayerNorm()])
    >>> x = jnp.ones((2, 4)); p = m.init(jax.random.PRNGKey(0), x)
    >>> out, n = paper_choice(p, m.apply, x)     # compare with m.apply(p, x)
    >>> n
    2
  """
  # Walk each site and center every parameter it needs, visible or not.
  traced = pipeline.trace(apply_fn, params, args)
  n = len(traced.names)
  specs: dict = {}
  zero = set()
  with pipeline.analyzer(traced) as an:
    planner = Planner(an, [str(i) for i in range(n)], FoldOptions())
    chosen = range(len(planner.sites)) if sites is None else sorted(set(sites))
    for i in chosen:
      site = planner.sites[i]
      if site.unrecognised:   # no mean reduction to remove
        continue
      zero |= {r.path for r in site.reduces}
      spec = freeze(layout.full_spec(site.input.shape, site.axes))
      for need in site.level.needs(site.input, spec):
        if isinstance(need, LeafNeed) and planner.is_leaf(need.var):
          specs.setdefault(need.var.index, need.spec)
    num_sites = len(chosen)
  leaves, tree = jax.tree_util.tree_flatten(params)
  leaves = [layout.center(x, dict(specs[i])) if i in specs else x for i, x in enumerate(leaves)]
  flat = leaves + jax.tree_util.tree_leaves(args)
  out = evaluate(traced.jaxpr, traced.consts, flat, Plan(zero=frozenset(zero)), {})
  return jax.tree_util.tree_unflatten(traced.out_tree, out), num_sites
