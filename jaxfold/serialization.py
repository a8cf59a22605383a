"""Saved folds on disk (public names of ``jaxfold._src.saved_fold``).

Example:
    >>> from jaxfold import serialization
    >>> serialization.save_fold(folded, "/tmp/f", meta={"model": "gpt2-tiny"})
    >>> serialization.load_report("/tmp/f").num_folded
    >>> serialization.check_target("/tmp/f", overwrite=False)   # FileExistsError: not empty
"""

from jaxfold._src.integrity import IntegrityError
from jaxfold._src.saved_fold import (
                                        FORMAT_VERSION,
                                        LoadedFold,
                                        check_target,
                                        load_fold,
                                        load_meta,
                                        load_report,
                                        save_fold,
)

__all__ = ["save_fold", "load_fold", "load_report", "load_meta", "LoadedFold", "IntegrityError",
           "FORMAT_VERSION", "check_target"]
