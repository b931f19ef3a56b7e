"""The gRPC frontend's messages (:mod:`.grpc`): a ``ModelInferRequest`` into an
:class:`InferRequest` (raw, typed or shared-memory contents, parameters), an
:class:`InferResult` into a ``ModelInferResponse``, and the hand reading of a request's wire
bytes (:func:`split_infer`) that lets a request of a shape seen before skip protobuf.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from .._errors import InvalidArgumentError, input_twice
from ..validation import request_prefix
from ._infer_types import InferRequest, InferResult, RequestedOutput
from ._request_parsing import SPECIAL_PARAMETERS, apply_parameters, parse_version, shm_ref
from ._tensor_decode import element_count, input_from_raw, string_count_error
from ._tensor_encode import class_count
from .dataplane import DataPlane

# Which typed ``contents`` field carries each datatype.
_CONTENTS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
_FIELD_TYPE = {"bool_contents": "BOOL", "int_contents": "INT32", "int64_contents": "INT64",
               "uint_contents": "UINT32", "uint64_contents": "UINT64", "fp32_contents": "FP32",
               "fp64_contents": "FP64", "bytes_contents": "BYTES"}

def _param_value(p: Any) -> Any:
    """The Python value of an InferParameter / ModelRepositoryParameter / SettingValue."""
    kind = p.WhichOneof("parameter_choice")
    return None if kind is None else getattr(p, kind)


def _set_param(target: Any, key: str, value: Any) -> None:
    p = target[key]
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


def _request_parameters(params: Any) -> dict[str, Any]:
    """A request's parameters as Python values; Triton takes an ordinary one only as int64,
    bool, string or double (a ``uint64_param`` is refused, as an unset value)."""
    out = {}
    for key, p in params.items():
        kind = p.WhichOneof("parameter_choice")
        if kind in (None, "uint64_param") and not (
                key in SPECIAL_PARAMETERS or key.startswith("triton_")):
            raise InvalidArgumentError(
                f"invalid value type for '{key}' parameter, expected int64_param, bool_param, "
                "or string_param.")
        out[key] = None if kind is None else getattr(p, kind)
    return out


def decode_request(plane: DataPlane, request: Any) -> InferRequest:
    """A :class:`InferRequest` from a ``ModelInferRequest`` message."""
    model = request.model_name
    req = InferRequest(model, parse_version(request.model_version), request_id=request.id)
    apply_parameters(req, _request_parameters(request.parameters), http=False)
    raw = request.raw_input_contents
    index = 0
    for inp in request.inputs:
        name, datatype, shape = inp.name, inp.datatype, list(inp.shape)
        params = {k: _param_value(v) for k, v in inp.parameters.items()}
        ref = shm_ref(name, params)
        has_contents = inp.HasField("contents")
        if name in req.inputs:
            raise input_twice(name, request_prefix(req.request_id))
        if ref is not None:
            if has_contents:
                raise InvalidArgumentError(
                    f"unexpected 'content' provided when using shared memory for input tensor "
                    f"'{name}' for model '{model}'"
                )
            req.inputs[name] = plane.input_from_shm(name, datatype, shape, ref, model=model,
                                                    request_id=req.request_id)
        elif has_contents and len(raw):
            raise InvalidArgumentError(
                f"contents field must not be specified when using raw_input_contents for "
                f"'{name}' for model '{model}'"
            )
        elif has_contents:
            req.inputs[name] = _from_contents(model, name, datatype, shape, inp.contents,
                                              req.request_id)
        elif index < len(raw):
            req.inputs[name] = input_from_raw(name, datatype, shape, raw[index], model=model,
                                              request_id=req.request_id)
            index += 1
        else:
            raise InvalidArgumentError(
                f"unable to find data for input tensor '{name}' for model '{model}' in request."
            )
    if index != len(raw):
        raise InvalidArgumentError(
            f"unexpected number of raw_input_contents for model '{model}': "
            f"{len(raw)} given, {index} inputs use them"
        )
    if len(request.outputs):
        req.outputs = []
        for out in request.outputs:
            params = {k: _param_value(v) for k, v in out.parameters.items()}
            req.outputs.append(RequestedOutput(out.name, None, shm_ref(out.name, params),
                                               class_count(out.name, params.get("classification"))))
    return req


def _from_contents(model: str, name: str, datatype: str, shape: list[int], contents: Any,
                   request_id: str = "") -> np.ndarray:
    fields = [f.name for f, _ in contents.ListFields()]
    expected = _CONTENTS.get(datatype)
    if expected is None:
        raise InvalidArgumentError(
            f"input '{name}' for model '{model}': datatype '{datatype}' cannot be sent in typed "
            "contents, use raw_input_contents"
        )
    for f in fields:
        if f != expected:
            raise InvalidArgumentError(
                f"unexpected explicit tensor data for input tensor '{name}' for model '{model}' "
                f"of type '{_FIELD_TYPE[f]}', expected datatype '{datatype}'"
            )
    count = element_count(name, shape)
    values = getattr(contents, expected)
    if len(values) != count:
        if datatype == "BYTES":  # Triton's words, as for raw BYTES data
            raise InvalidArgumentError(request_prefix(request_id) + string_count_error(
                name, len(values), count, f" for model '{model}'"))
        raise InvalidArgumentError(
            f"unexpected number of elements {len(values)} for input '{name}', expecting {count}"
        )
    if datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        arr[:] = list(values)
    else:
        from ..shm.dtypes import numpy_dtype

        try:
            arr = np.array(values, dtype=numpy_dtype(datatype)) if count else np.empty(
                0, numpy_dtype(datatype))
        except OverflowError:  # int_contents carry INT8/INT16, uint_contents UINT8/UINT16
            raise InvalidArgumentError(
                f"unexpected explicit tensor data for input tensor '{name}' for model "
                f"'{model}': value out of range for {datatype}") from None
    return arr.reshape(shape)


def encode_result(result: InferResult) -> Any:
    """A ``ModelInferResponse`` from a successful :class:`InferResult`."""
    resp = service_pb2.ModelInferResponse(
        model_name=result.model, model_version=str(result.version), id=result.request_id
    )
    for key, value in result.parameters.items():
        _set_param(resp.parameters, key, value)
    for out in result.outputs:
        resp.outputs.add(name=out.name, datatype=out.datatype, shape=out.shape)
        if out.shm is not None:  # named with no parameters and empty contents, as Triton's
            resp.raw_output_contents.append(b"")
        else:
            resp.raw_output_contents.append(bytes(out.raw()))
    return resp


#: The tag of ``raw_input_contents`` (field 7) and of ``raw_output_contents`` (field 6), both
#: length-delimited, on the wire.
_RAW_IN_TAG = 7 << 3 | 2
_RAW_OUT_TAG = bytes([6 << 3 | 2])


def split_infer(data: Any) -> tuple[bytes, list[tuple[int, int]]] | None:
    """A ``ModelInferRequest``'s wire bytes in two parts: every field but its raw input
    contents (as bytes, in order: what decodes the same way every time) and where each raw
    input content lies (start, end), in order. None when they are not the plain
    length-delimited fields this message is made of: a full parse then decides."""
    n = len(data)
    i = 0
    head = []
    raws = []
    while i < n:
        tag = data[i]
        if tag & 0x80 or tag & 7 != 2:  # a field past 15, or not length-delimited
            return None
        j = i + 1
        size = shift = 0
        while True:
            if j >= n or shift > 35:
                return None
            b = data[j]
            j += 1
            size |= (b & 0x7F) << shift
            if b < 0x80:
                break
            shift += 7
        end = j + size
        if end > n:
            return None
        if tag == _RAW_IN_TAG:
            raws.append((j, end))
        else:
            head.append(data[i:end])
        i = end
    return b"".join(head), raws



def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
