"""Triton's generate extension: ``POST /v2/models/<m>[/versions/<v>]/generate`` and
``/generate_stream`` take one flat JSON object and answer one flat JSON object per response
(``/generate_stream`` as Server-Sent Events). Behaviour checked side by side with Triton 2.51.

Request: each top-level key that names a model input becomes that input, typed by the model
(a scalar is one element, a list its elements; the input's last variable dimension takes the
count, any other variable dimension is 1). Every other key, and every member of the optional
``"parameters"`` object, is a request parameter (string, number or bool); a member of
``"parameters"`` that names an input is that input. ``"id"`` also sets the request id.

Response: ``id`` (when set), ``model_name``, ``model_version``, the response's parameters and
its outputs by name, keys in alphabetical order as Triton writes them; a one-element output is
a scalar, any other a flat list; BYTES are strings.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from .._errors import InternalError, InvalidArgumentError
from .dataplane import InferRequest, InferResult, array_from_json

#: Triton's words when /generate gets other than one response.
NOT_ONE_RESPONSE = ("generate expects model to produce exactly 1 response, use generate stream "
                    "for model that generates various number of responses")
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


def _invalid_parameter(key: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'.")


def _tensor(name: str, spec: dict[str, Any], value: object) -> np.ndarray:
    """An input from a JSON scalar or list, shaped by the model's dims."""
    data = value if isinstance(value, list) else [value]
    count = len(data)
    dims = [int(d) for d in spec["shape"]]
    fixed = math.prod(d for d in dims if d >= 0)
    variable = [i for i, d in enumerate(dims) if d < 0]
    fits = count == fixed if not variable else (count % fixed == 0 if fixed else count == 0)
    if not fits:
        raise InvalidArgumentError(f"The schema can not convert input '{name}' to tensor with proper shape")
    shape = [d if d >= 0 else 1 for d in dims]
    if variable:
        shape[variable[-1]] = count // fixed if fixed else 0
    return array_from_json(name, spec["datatype"], shape, data)


def decode_generate(model: str, version: int, body: bytes | bytearray,
                    metadata: dict[str, Any]) -> InferRequest:
    """The inference request a generate body stands for, given the model's metadata."""
    try:
        doc = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgumentError("failed to parse the request JSON buffer: expected a JSON object")
    inputs = {spec["name"]: spec for spec in metadata.get("inputs", [])}
    if "parameters" in inputs:
        raise InvalidArgumentError("Keyword 'parameters' for nested schema also given as input tensor name")
    req = InferRequest(model, version)

    def take(key: str, value: object) -> None:
        spec = inputs.get(key)
        if spec is not None:
            if key in req.inputs:
                raise InvalidArgumentError(f"input '{key}' appears more than once in the request")
            req.inputs[key] = _tensor(key, spec, value)
        elif isinstance(value, (bool, int, float, str)):
            req.parameters[key] = value
        else:
            raise _invalid_parameter(key)

    for key, value in doc.items():
        if key != "parameters":
            take(key, value)
            continue
        if not isinstance(value, dict):
            raise InvalidArgumentError("Expected JSON object for keyword: 'parameters'")
        for inner, inner_value in value.items():
            take(inner, inner_value)
    if "id" in doc and "id" not in inputs:
        if not isinstance(doc["id"], str):
            raise InvalidArgumentError("Unable to parse 'id': expected a string")
        req.request_id = doc["id"]
    return req


def counts(result: InferResult, decoupled: bool) -> bool:
    """Whether a result is a response of its own (a decoupled model's flags-only final is not)."""
    return not (decoupled and result.final and result.error is None and not result.outputs
                and not result.parameters)


def _value(name: str, datatype: str, array: np.ndarray) -> Any:
    flat = array.ravel()
    if datatype == "BYTES":
        try:
            values: list[Any] = [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in flat]
        except UnicodeDecodeError:
            raise InternalError(f"output '{name}' holds bytes that are not UTF-8 text; "
                                "read it through /infer") from None
    else:
        if flat.dtype.kind == "f" and flat.size and not np.isfinite(flat.astype(np.float64)).all():
            raise InternalError(f"output '{name}' holds NaN or infinity, which JSON cannot carry; "
                                "read it through /infer")
        values = flat.astype(np.float64).tolist() if datatype in ("FP16", "BF16") else flat.tolist()
    return values[0] if len(values) == 1 else values


def encode_generate(result: InferResult) -> bytes:
    """One response as generate's JSON object (the caller handles ``result.error``)."""
    doc: dict[str, Any] = {}
    if result.request_id:
        doc["id"] = result.request_id
    doc["model_name"] = result.model
    doc["model_version"] = str(result.version)
    for key, value in result.parameters.items():
        doc.setdefault(key, value)
    for out in result.outputs:
        if out.name not in doc:
            assert out.array is not None
            doc[out.name] = _value(out.name, out.datatype, out.array)
    return json.dumps(dict(sorted(doc.items())), separators=(",", ":")).encode()


def sse_event(result: InferResult) -> bytes:
    """One Server-Sent Event: the response, or ``{"error": ...}``."""
    if result.error is None:
        try:
            data = encode_generate(result)
        except InternalError as exc:
            data = json.dumps({"error": exc.message}, separators=(",", ":")).encode()
    else:
        data = json.dumps({"error": result.error.message}, separators=(",", ":")).encode()
    return b"data: " + data + b"\n\n"
