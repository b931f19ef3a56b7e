"""tritonpy: run Triton Python-backend model repositories, unmodified, in pure Python.

The public API is the in-process server (what a host server embeds)::

    import tritonpy
    with tritonpy.Server(model_repository="examples") as server:
        response = next(iter(server.model("add_sub").infer({"INPUT0": a, "INPUT1": b})))
        print(response.outputs["OUTPUT0"].to_numpy())
"""
from __future__ import annotations

from ._errors import (
    AlreadyExistsError,
    CancelledError,
    ConfigError,
    ErrorCode,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    TritonpyError,
    UnavailableError,
    UnknownError,
    UnsupportedError,
)
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._otel import OtelSettings
    from ._request import AsyncResponseStream, InferenceResponse, ResponseStream, Tensor
    from ._stats import MetricsConfig
    from ._trace import Tracing
    from ._model_handle import Model
    from .server import Server, __version__

# The server and what goes with it are imported on first use (PEP 562): a stub process, which
# imports ``tritonpy.stub`` and ``tritonpy.shm`` and so runs this file, then loads none of the
# host side (about 150 ms and the memory of it, in every stub). The errors are light, and here.
_LAZY = {
    "OtelSettings": "._otel", "AsyncResponseStream": "._request",
    "InferenceResponse": "._request", "ResponseStream": "._request", "Tensor": "._request",
    "MetricsConfig": "._stats", "Tracing": "._trace", "Model": "._model_handle",
    "Server": ".server", "__version__": ".server",
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'tritonpy' has no attribute '{name}'")
    import importlib

    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AlreadyExistsError",
    "AsyncResponseStream",
    "CancelledError",
    "ConfigError",
    "ErrorCode",
    "InferenceResponse",
    "InternalError",
    "InvalidArgumentError",
    "MetricsConfig",
    "Model",
    "NotFoundError",
    "OtelSettings",
    "ResponseStream",
    "Server",
    "Tensor",
    "Tracing",
    "TritonpyError",
    "UnavailableError",
    "UnknownError",
    "UnsupportedError",
    "__version__",
]
