"""Adapters that present other frameworks' models as ``(params, apply_fn)``."""
