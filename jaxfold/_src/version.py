"""jaxfold's version: a leaf module, so code that records it (integrity's
``versions()``) does not import the package's ``__init__`` (an import circle)."""

__version__ = "0.1.0"
