"""Exported artifacts (public names of ``jaxfold._src.artifact``).

An artifact is a ``jax.export`` program in a small content-hashed container
(header with the program's SHA-256, the writer's versions and caller metadata);
:func:`load_exported` verifies it before ``jax.export`` parses a byte.

Example:
    >>> from jaxfold import exporting
    >>> blob = exporting.export(folded, ids, meta={"model": "gpt2-tiny"})
    >>> exporting.write_artifact("model.jaxexport", blob)     # atomic
    >>> fn = exporting.load_exported("model.jaxexport")
    >>> exporting.exported_signature(fn)
    [(('batch', 'seq'), 'int32')]
"""

from jaxfold._src.artifact import (
                                 ARTIFACT_VERSION,
                                 MAGIC,
                                 ExportWarning,
                                 export,
                                 exported_signature,
                                 load_exported,
                                 read_artifact,
                                 write_artifact,
)
from jaxfold._src.integrity import IntegrityError

__all__ = ["export", "load_exported", "ExportWarning", "exported_signature", "read_artifact",
           "write_artifact", "IntegrityError", "ARTIFACT_VERSION", "MAGIC"]
