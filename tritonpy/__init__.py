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
from ._otel import OtelSettings
from ._request import AsyncResponseStream, InferenceResponse, ResponseStream, Tensor
from ._stats import MetricsConfig
from ._trace import Tracing
from .server import Model, Server, __version__

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
