"""jaxfold: LayerNorm with the cost of RMSNorm, exactly.

Public API:
  fold(params, apply_fn, *example_args) -> Folded(params, apply_fn, report)
  cbwc(params, apply_fn, *example_args) -> Reparameterized(apply_fn, report, analysis)
"""

from jaxfold._src.fold import FoldError, Folded, Reparameterized, cbwc, fold
from jaxfold._src.report import Centering, Report, Site

__all__ = ["fold", "cbwc", "Folded", "Reparameterized", "FoldError", "Report", "Site",
           "Centering"]
__version__ = "0.1.0"
