"""Serving folded models over HTTP: what ``jaxfold serve`` runs, for use from Python.

Needs the ``serve`` extra (``pip install "jaxfold[serve]"``: uvicorn + starlette).

Example:
    >>> from jaxfold import serving
    >>> model = serving.load_model("gpt2-tiny.jaxexport", max_batch=16)
    >>> model.self_check()
    >>> serving.serve(model, "127.0.0.1", 0)     # blocks; prints "listening on http://..."

    >>> res = serving.load_test("http://127.0.0.1:8000/predict", payloads, concurrency=64)
    >>> res.throughput, res.percentile(0.5), res.percentile(0.99)
"""

from jaxfold._src.server.app import ServeConfig, connection_limit, create_app, is_loopback, serve
from jaxfold._src.server.loadgen import LoadResult, load_test, run_load
from jaxfold._src.server.model import (
                                     InputError,
                                     OutsideBuckets,
                                     ServedModel,
                                     ServeError,
                                     load_model,
                                     pow2_buckets,
                                     program_bounds,
)

__all__ = ["ServeConfig", "create_app", "serve", "load_model", "ServedModel", "ServeError",
           "InputError", "load_test", "run_load", "LoadResult", "pow2_buckets", "OutsideBuckets",
           "program_bounds", "is_loopback", "connection_limit"]
