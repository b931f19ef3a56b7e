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
from ._infer_types import InferRequest, InferResult, OutputTensor
from ._request_parsing import parse_json_object
from ._tensor_decode import array_from_json
from ._tensor_encode import json_data

#: Triton's words when /generate gets other than one response.
NOT_ONE_RESPONSE = ("generate expects model to produce exactly 1 response, use generate stream "
                    "for model that generates various number of responses")
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


def _invalid_parameter(key: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'.")


# Triton's words for a JSON value of the wrong kind (clients and Triton's own tests look for them).
_WRONG_KIND = {
    "BYTES": "attempt to access JSON non-string as string",
    "BOOL": "attempt to access JSON non-boolean as boolean",
    "INT": "attempt to access JSON non-signed-integer as signed-integer",
    "UINT": "attempt to access JSON non-unsigned-integer as unsigned-integer",
    "FP": "attempt to access JSON non-number as double",
}


def _check_kinds(name: str, datatype: str, data: list[Any]) -> None:
    """Each element of a flat JSON list is of the kind ``datatype`` reads."""
    if datatype == "BYTES":
        ok = all(isinstance(v, str) for v in data)
        if not ok:
            raise InvalidArgumentError(
                f"Unable to parse JSON bytes array for input '{name}': {_WRONG_KIND['BYTES']}")
        return
    if datatype == "BOOL":
        kind, ok = "BOOL", all(isinstance(v, bool) for v in data)
    elif datatype.startswith("UINT"):
        kind, ok = "UINT", all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in data)
    elif datatype.startswith("INT"):
        kind, ok = "INT", all(isinstance(v, int) and not isinstance(v, bool) for v in data)
    else:
        kind, ok = "FP", all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in data)
    if not ok:
        raise InvalidArgumentError(
            f"Unable to parse 'data' of input '{name}' ({datatype}): {_WRONG_KIND[kind]}")


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
    if not any(isinstance(v, list) for v in data):  # nested lists: array_from_json says why not
        _check_kinds(name, spec["datatype"], data)
    return array_from_json(name, spec["datatype"], shape, data)


class _Object(dict):  # type: ignore[type-arg]
    """A JSON object that keeps its members in order, repeated keys included."""

    pairs: list[tuple[str, Any]]


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    obj.pairs = pairs
    return obj


def _members(obj: dict[str, Any]) -> list[tuple[str, Any]]:
    return getattr(obj, "pairs", None) or list(obj.items())


def decode_generate(model: str, version: int, body: bytes | bytearray,
                    metadata: dict[str, Any]) -> InferRequest:
    """The inference request a generate body stands for, given the model's metadata."""
    doc = parse_json_object(body or b"null", object_pairs_hook=_object)
    inputs = {spec["name"]: spec for spec in metadata.get("inputs", [])}
    if "parameters" in inputs:
        raise InvalidArgumentError("Keyword 'parameters' for nested schema also given as input tensor name")
    req = InferRequest(model, version)

    def take(key: str, value: object) -> None:
        spec = inputs.get(key)
        if spec is not None:
            if key in req.inputs:
                raise InvalidArgumentError(f"input '{key}' already exists in request")
            req.inputs[key] = _tensor(key, spec, value)
        elif isinstance(value, (bool, int, float, str)):
            req.parameters[key] = value
        else:
            raise _invalid_parameter(key)

    for key, value in _members(doc):  # in order: the first repeated input is the one named
        if key != "parameters":
            take(key, value)
            continue
        if not isinstance(value, dict):
            raise InvalidArgumentError("Expected JSON object for keyword: 'parameters': "
                                       "attempt to access JSON non-object as object")
        try:
            for inner, inner_value in _members(value):
                take(inner, inner_value)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"Converting keyword: 'parameters': {exc.message}") from None
    if "id" in doc and "id" not in inputs:
        if not isinstance(doc["id"], str):
            raise InvalidArgumentError("Unable to parse 'id': expected a string")
        req.request_id = doc["id"]
    return req


def counts(result: InferResult, decoupled: bool) -> bool:
    """Whether a result is a response of its own (a decoupled model's flags-only final is not;
    a final response that holds no tensors is, as in Triton)."""
    return not (decoupled and result.final and result.empty)


def _value(out: OutputTensor) -> Any:
    """An output as generate writes it: a scalar for one element, else a flat list."""
    values = json_data(out)
    if values is None:  # what /infer would send as binary
        assert out.array is not None
        if out.datatype == "BYTES":
            raise InternalError(f"output '{out.name}' holds bytes that are not UTF-8 text; "
                                "read it through /infer")
        values = out.array.ravel().astype(np.float64).tolist()  # FP16 / BF16
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
            doc[out.name] = _value(out)
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
