"""jaxfold: LayerNorm with the cost of RMSNorm, exactly.

Public API:
  fold(params, apply_fn, *example_args) -> Folded(params, apply_fn, report)
  Params(params, extras): every result's params (the user's tree as the steps left it; tensors steps added)
  cbwc(params, apply_fn, *example_args) -> Reparameterized(apply_fn, report)   (.leaf_specs: what it centers)
  Report: str(report) (per site), report.diff() (what changed), report.to_json() (for tools)
  export(folded, *example_args, meta=...) -> bytes; load_exported(bytes | path) -> callable
  save_fold(folded, directory); load_fold(directory, apply_fn)   (atomic; content-hashed)
  IntegrityError: a saved fold or an artifact is damaged, truncated or foreign
  JaxfoldError (a ValueError): every refusal; FoldError, FuseError and RotateError (a FuseError)
  fuse_affine(folded) -> Fused(params, apply_fn, report)   (γ/β into the readers; or fold(..., fuse_affine=True))
  defer_norms(fused) -> Fused   (readers contract the un-normalized input, scaled per row;
                                 or fold(..., defer_norms=True))
  rotate(fused, q) -> Rotated(params, apply_fn, report)     (orthogonal q on the residual stream;
                             q = "hadamard" | "random" | "pca" (calibration=) of the stream width)
  online_hadamard(result) -> Online(params, apply_fn, report)  (QuaRot's online Hadamards before
                             the MLP's down-projection and attention's output projection)
  quantize(result | (params, apply_fn), *args, weights=, activations=, group_size=) -> Quantized
                             (contractions reading a parameter as int8/int4/fp8 GEMMs, qwix; the `quantize` extra)
  keras_params(model) -> (params, apply_fn)   (a Keras 3 model, JAX backend; keras imported lazily)
  keras_assign(model, folded_or_params)      (writes parameters back into the Keras model's variables)
Submodules (imported with jaxfold): optax_transforms (CBWC weight decay), exporting,
serialization, benchmarking (timing, errors); jaxfold.serving (HTTP; needs the `serve` extra)
is imported on demand.
"""

from jaxfold import benchmarking, exporting, optax_transforms, serialization  # noqa: E402, I001
from jaxfold._src.artifact import export, load_exported
from jaxfold._src.fold import Folded, FoldedParams, FoldError, FoldOptions, Reparameterized, cbwc
from jaxfold._src.integrity import IntegrityError
from jaxfold._src.report import Auxiliary, Centering, Changes, Report, Site
from jaxfold._src.affine import Fused, FusedParams, FuseReport, fuse_affine
from jaxfold._src.errors import FuseError, JaxfoldError, RotateError
from jaxfold._src.defer import DeferSite, defer_norms
from jaxfold._src.compose import fold
from jaxfold._src.rotate import Rotated, RotateReport, rotate
from jaxfold._src.hadamard import hadamard
from jaxfold._src.online import Online, OnlineReport, OnlineSite, online_hadamard
from jaxfold._src.quantize import QuantizeError, Quantized, QuantParams, QuantReport, QuantSite, QWeight, quantize
from jaxfold._src.step import Params
from jaxfold._src.frameworks.keras import KerasParams, keras_assign, keras_params
from jaxfold._src.saved_fold import load_fold, save_fold
from jaxfold._src.version import __version__ as __version__

__all__ = ["fold", "cbwc", "Folded", "Params", "FoldedParams", "FoldOptions", "Reparameterized", "FoldError",
           "Report", "Site", "Centering", "Auxiliary", "Changes", "export", "load_exported",
           "save_fold", "load_fold", "IntegrityError", "optax_transforms", "exporting",
           "serialization", "benchmarking"]
__all__ += ["defer_norms", "DeferSite"]
__all__ += ["fuse_affine", "Fused", "FusedParams", "FuseError", "FuseReport", "rotate", "Rotated",
            "RotateReport", "RotateError", "JaxfoldError", "keras_params", "keras_assign", "KerasParams"]
__all__ += ["online_hadamard", "Online", "OnlineReport", "OnlineSite"]
__all__ += ["hadamard"]
__all__ += ["quantize", "Quantized", "QuantParams", "QuantReport", "QuantSite", "QWeight", "QuantizeError"]
