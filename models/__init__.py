"""Model zoo for jaxfold tests and benchmarks: a registry of named `ModelSpec`s.

Each family module exposes `CONFIGS: dict[str, ModelSpec]`; this module merges them.
The vision modules (vit, swin, cnn, mlp) are optional: if one is missing or fails to
import, its configurations are simply absent (see `import_errors()`).

Example:
    >>> import jax, models
    >>> "gpt2-tiny" in models.names()
    True
    >>> spec = models.get("gpt-j-6b-sized")
    >>> shapes = spec.abstract_init(batch=1, seq=8)   # ShapeDtypeStructs, nothing allocated
"""

from __future__ import annotations

import importlib
from typing import Any

from models.common import ModelSpec, randomize_norms

_TEXT_MODULES = ("gpt2", "gpt2_nnx", "bert", "opt", "bloom", "phi")
_OPTIONAL_MODULES = ("vit", "swin", "cnn", "mlp")

_REGISTRY: dict[str, Any] = {}
_IMPORT_ERRORS: dict[str, str] = {}


def _register(module_name: str, optional: bool) -> None:
    try:
        module = importlib.import_module(f"models.{module_name}")
    except Exception as err:  # a colleague's module may not exist yet, or be mid-edit
        if not optional:
            raise
        _IMPORT_ERRORS[module_name] = f"{type(err).__name__}: {err}"
        return
    for name, spec in getattr(module, "CONFIGS", {}).items():
        if name in _REGISTRY:
            raise ValueError(f"model name {name!r} registered twice (models.{module_name})")
        _REGISTRY[name] = spec


for _m in _TEXT_MODULES:
    _register(_m, optional=False)
for _m in _OPTIONAL_MODULES:
    _register(_m, optional=True)


def get(name: str) -> ModelSpec:
    """The `ModelSpec` registered under `name` (KeyError listing the known names otherwise)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(names())}") from None


def names() -> list[str]:
    """All registered configuration names, sorted."""
    return sorted(_REGISTRY)


def import_errors() -> dict[str, str]:
    """Optional modules that could not be imported, with the error (for diagnostics)."""
    return dict(_IMPORT_ERRORS)


__all__ = ["ModelSpec", "get", "names", "import_errors", "randomize_norms"]
