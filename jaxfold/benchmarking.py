"""Measuring a fold: interleaved timing with an A/A noise figure, and errors
that refuse non-finite outputs. What ``jaxfold bench``/``demo`` and the
benchmark scripts use; and :func:`paper_choice`, the paper's unsound "fold every
LayerNorm", as a baseline to measure against.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxfold import benchmarking
    >>> t = benchmarking.time_variants({"a": lambda: jnp.ones(8), "b": lambda: jnp.zeros(8)},
    ...                                rounds=3)
    >>> s = benchmarking.summarize_timings(t, "a", ["b"])
    >>> sorted(s["ratio"]), s["verdict"]["b"] in ("faster", "slower", "not resolved")
    (['b'], True)
    >>> benchmarking.max_rel_err(jnp.ones(3), jnp.ones(3))
    0.0
"""

from jaxfold._src.paper_choice import paper_choice
from jaxfold._src.timing import (
                                 NonFiniteError,
                                 bootstrap_ratio_ci,
                                 check_finite,
                                 compare_forward,
                                 device_string,
                                 max_rel_err,
                                 modelled_gpu,
                                 ratio_of_medians,
                                 summarize_timings,
                                 time_variants,
                                 verdict,
)

__all__ = ["NonFiniteError", "device_string", "time_variants", "summarize_timings", "ratio_of_medians",
           "bootstrap_ratio_ci", "verdict", "compare_forward", "check_finite", "max_rel_err", "paper_choice",
           "modelled_gpu"]
