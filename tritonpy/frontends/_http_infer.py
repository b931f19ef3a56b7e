"""Inference over HTTP: a request decoded from its JSON header and the binary tensors that
follow it (Triton's binary tensor extension; a plan kept per header decodes the next one alike),
Triton's raw binary request, and a result encoded as a JSON header and the binary outputs after
it, unjoined."""
from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from ..shm.dtypes import ITEMSIZE
from .._errors import InvalidArgumentError, input_twice
from ..validation import request_prefix
from ._http1_messages import Request, Response
from ._http_json import _dict, _dumps, error_response
from ._infer_types import (
    InferRequest,
    InferResult,
    InputSpec,
    RequestPlan,
    ShmReader,
    ShmRef,
    RequestedOutput,
    keep,
)
from ._request_parsing import apply_parameters, forward_headers, parse_json_object, shm_ref
from ._tensor_decode import array_from_json, array_from_raw, input_from_raw, is_uint
from ._tensor_encode import class_count, json_data
from .dataplane import DataPlane

_HEADER_LENGTH = "Inference-Header-Content-Length"
_HEADER_LENGTH_KEY = _HEADER_LENGTH.lower()  # Request.headers has lower-case names
_DECOUPLED = "HTTP end point doesn't support models with decoupled transaction policy"

#: A longer request header is decoded each time (it carries data, or values that change).
PLAN_MAX_HEADER = 4096


def _plan_request(plan: RequestPlan, body: bytes | bytearray, offset: int,
                  from_shm: ShmReader) -> InferRequest:
    """``plan``'s request from an HTTP body whose JSON header ends at ``offset``: the errors
    of a body too short or too long are the full decode's."""
    total = len(body)
    view = memoryview(body)
    buffers = []
    for spec in plan.inputs:
        name, size = spec[0], spec[1]
        if size < 0:  # in shared memory
            continue
        end = offset + size
        if end > total:
            raise InvalidArgumentError(
                f"unexpected size for input '{name}', expecting {end - total} additional "
                f"bytes for model '{plan.model}'")
        buffers.append(view[offset:end])
        offset = end
    if offset != total:
        raise InvalidArgumentError(f"unexpected additional input data for model '{plan.model}'")
    req = plan.request(buffers, from_shm)
    assert req is not None  # each size is the header's own, checked when the plan was made
    return req


def _as_sent(request: Request) -> Any:
    """The request's ``(name, value)`` headers, each name as the client sent it (as Triton
    forwards them to models) where the server kept them."""
    names = request.names
    if names is None:
        return request.headers.items()
    return ((names.get(k, k), v) for k, v in request.headers.items())


class _Inference:
    """The inference path of :class:`.http.HTTPFrontend` (a mixin: these methods share the
    frontend's plane, its header forwarding and the plans and response heads it keeps, on
    every request, and a mixin adds no attribute hop or call layer to that path)."""

    # (set by HTTPFrontend.__init__)
    plane: DataPlane
    header_forward: re.Pattern[str] | None
    _plans: dict[tuple[str, int, bytes], RequestPlan]
    _headers: dict[tuple, tuple[bytes, dict[str, str] | None]]

    async def _infer(self, request: Request, model: str, version: int) -> Response:
        req = self._parse_infer(model, version, request.body, request.headers.get(_HEADER_LENGTH_KEY))
        if self.header_forward is not None:
            forward_headers(req, _as_sent(request), self.header_forward)
        if self.plane.server.tracing.active:  # nothing built per request while tracing is off
            req.received = (("HTTP_RECV_START", request.received[0]),
                            ("HTTP_RECV_END", request.received[1]))
            req.traceparent = request.headers.get("traceparent", "")
        try:
            result = await self.plane.infer(req, decoupled_error=_DECOUPLED)
        except Exception as exc:
            if req.trace is None:
                raise
            response = error_response(exc)  # as Triton: a failed request's trace has its send
        else:
            try:
                response = self._encode_result(result)
            except BaseException:
                if req.trace is not None:
                    req.trace.finish()
                raise
            response.compress = True  # when the client's Accept-Encoding asks for it
        trace = req.trace
        if trace is not None:
            def sent(start: int, end: int) -> None:
                trace.stamps((("HTTP_SEND_START", start), ("HTTP_SEND_END", end)))
                trace.finish()
            response.on_sent = sent
        return response

    def _parse_infer(self, model: str, version: int, body: bytes | bytearray,
                     header_length: str | None) -> InferRequest:
        total = len(body)
        if header_length is None:
            hlen = total
        else:
            try:
                hlen = int(header_length)
            except ValueError:
                raise InvalidArgumentError(
                    f"Unable to parse {_HEADER_LENGTH}, got: {header_length}"
                ) from None
            if hlen < 0 or hlen > total:
                raise InvalidArgumentError(
                    f"inference header size should be in range (0, {total}), got: {header_length}"
                )
        if hlen == 0:
            return self._raw_request(model, version, body)
        head = body[:hlen]
        key = (model, version, bytes(head)) if hlen <= PLAN_MAX_HEADER else None
        if key is not None:
            plan = self._plans.get(key)
            if plan is not None:
                return _plan_request(plan, body, hlen, self.plane.input_from_shm)
        header = parse_json_object(head)
        specs: list[InputSpec] | None = []
        shm_inputs: dict[str, tuple[str, list, ShmRef]] = {}
        req = InferRequest(model, version)
        rid = header.get("id", "")
        if not isinstance(rid, str):
            raise InvalidArgumentError("Unable to parse 'id'")
        req.request_id = rid
        apply_parameters(req, _dict(header.get("parameters"), "parameters"), http=True)
        inputs = header.get("inputs")
        if not isinstance(inputs, list):
            raise InvalidArgumentError("Unable to parse 'inputs'")
        view = memoryview(body)
        offset = hlen
        for inp in inputs:
            if not isinstance(inp, dict):
                raise InvalidArgumentError("Unable to parse 'inputs'")
            name, datatype, shape = inp.get("name"), inp.get("datatype"), inp.get("shape")
            if not isinstance(name, str):
                raise InvalidArgumentError("Unable to parse 'name'")
            if not isinstance(datatype, str):
                raise InvalidArgumentError("Unable to parse 'datatype'")
            if not isinstance(shape, list):
                raise InvalidArgumentError("Unable to parse 'shape'")
            params = _dict(inp.get("parameters"), "parameters")
            has = [k for k, present in (("'data'", "data" in inp),
                                        ("'binary_data_size'", "binary_data_size" in params),
                                        ("'shared_memory_region'", "shared_memory_region" in params))
                   if present]
            if len(has) != 1:
                raise InvalidArgumentError(
                    "Input must set only one of the following fields: 'data', 'binary_data_size' "
                    "in 'parameters', 'shared_memory_region' in 'parameters'. But "
                    + ("no field is set" if not has else "set " + " ".join(has))
                )
            if name in req.inputs:
                raise input_twice(name, request_prefix(req.request_id))
            if "binary_data_size" in params:
                size = params["binary_data_size"]
                if not is_uint(size):
                    raise InvalidArgumentError("Unable to parse 'binary_data_size'")
                if offset + size > total:
                    raise InvalidArgumentError(
                        f"unexpected size for input '{name}', expecting {offset + size - total} "
                        f"additional bytes for model '{model}'"
                    )
                value = input_from_raw(name, datatype, shape, view[offset:offset + size],
                                       model=model, request_id=req.request_id)
                req.inputs[name] = value
                if specs is not None:
                    specs.append(RequestPlan.spec(name, value, size))
                offset += size
            elif "data" in inp:
                specs = None
                req.inputs[name] = array_from_json(name, datatype, shape, inp["data"])
            else:
                ref = shm_ref(name, params)
                assert ref is not None
                req.inputs[name] = self.plane.input_from_shm(name, datatype, shape, ref, model=model,
                                                             request_id=req.request_id)
                if specs is not None:  # read again from its window by the next such request
                    specs.append(RequestPlan.shm_spec(name))
                    shm_inputs[name] = (datatype, list(shape), ref)
        if offset != total:
            raise InvalidArgumentError(f"unexpected additional input data for model '{model}'")
        if "outputs" in header:
            req.outputs = self._parse_outputs(header["outputs"])
        if key is not None and specs is not None:
            keep(self._plans, key, RequestPlan(req, specs, shm_inputs))
        return req

    def _parse_outputs(self, outputs: object) -> list[RequestedOutput]:
        if not isinstance(outputs, list):
            raise InvalidArgumentError("Unable to parse 'outputs'")
        result: list[RequestedOutput] = []
        for out in outputs:
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise InvalidArgumentError("Unable to parse 'name'")
            params = _dict(out.get("parameters"), "parameters")
            binary = params.get("binary_data")
            if binary is not None and not isinstance(binary, bool):
                raise InvalidArgumentError("Unable to parse 'binary_data'")
            ref = shm_ref(out["name"], params)
            if ref is not None and binary:
                raise InvalidArgumentError("Output can't set both 'shared_memory_region' and 'binary_data'")
            result.append(RequestedOutput(out["name"], binary, ref,
                                          class_count(out["name"], params.get("classification"))))
        return result

    def _raw_request(self, model: str, version: int, body: bytes | bytearray) -> InferRequest:
        """Triton's raw binary request (header length 0): the whole body is the only input, of
        batch 1 for a batching model; its one variable dimension is deduced from the size."""
        handle = self.plane.model(model, version)
        inputs = handle.metadata().get("inputs", [])
        if len(inputs) != 1:
            raise InvalidArgumentError(  # Triton's core words, with its request id prefix
                f"{request_prefix('')}Raw request must only have 1 input (found 1) to be deduced "
                f"but got {len(inputs)} inputs in '{model}' model configuration")
        spec = inputs[0]
        name, datatype = spec["name"], spec["datatype"]
        batching = handle.max_batch_size > 0
        dims = [int(d) for d in spec["shape"]][1 if batching else 0:]
        if datatype == "BYTES":
            if dims != [1]:
                raise InvalidArgumentError(f"{request_prefix('')}For BYTE datatype raw input "
                                           f"'{name}', the model must have input shape [1]")
            arr = np.empty(1, dtype=object)
            arr[0] = bytes(body)  # the body is the one element, without a length prefix
        else:
            variable = [i for i, d in enumerate(dims) if d < 0]
            if len(variable) > 1:
                raise InvalidArgumentError(
                    f"{request_prefix('')}The shape of the raw input '{name}' can not be deduced "
                    "because there are more than one variable-sized dimension")
            if variable:
                fixed = math.prod(d for d in dims if d >= 0) * ITEMSIZE.get(datatype, 1)
                dims[variable[0]] = len(body) // fixed if fixed else 0
            arr = array_from_raw(name, datatype, dims, body, model=model)
        req = InferRequest(model, version, binary_output_default=True)
        req.inputs[name] = arr.reshape([1, *dims] if batching else dims)
        return req

    # -- responses ---------------------------------------------------------------------------

    def _encode_result(self, result: InferResult) -> Response:
        # When every output goes binary in the body or into shared memory and the response has
        # no parameters, the header depends on the outputs' names, types, shapes and sizes
        # only: the same for each request of one shape, so it is kept.
        parts: list[Any] | None = None
        if result.outputs and not result.parameters:
            parts = []
            shape: list[Any] = [result.request_id, result.model, result.version]
            for out in result.outputs:
                if out.shm is not None:  # (named in the header only)
                    shape.append((out.name, out.datatype, out.shape, -1))
                    continue
                if not out.binary:
                    parts = None
                    break
                raw = out.raw()
                parts.append(raw)
                shape.append((out.name, out.datatype, out.shape, len(raw)))
        if parts is not None:
            key = tuple(shape)
            kept = self._headers.get(key)
            if kept is None:
                header = self._encode_header(result)[0]
                kept = header, {_HEADER_LENGTH: str(len(header))} if parts else None
                keep(self._headers, key, kept)
            header, headers = kept  # (the headers are only read, by the server that writes them)
            if headers is None:  # every output in shared memory: the header is the body
                return Response(200, header, "application/json")
        else:
            header, parts = self._encode_header(result)
            if not parts:
                return Response(200, header, "application/json")
            headers = {_HEADER_LENGTH: str(len(header))}
        # The tensors follow the header as they are (views of the response's arrays), not joined.
        return Response(200, header, "application/octet-stream", headers, parts=parts)

    def _encode_header(self, result: InferResult) -> tuple[bytes, list[Any]]:
        """A response's JSON header, and the bytes of its binary outputs (to follow it)."""
        doc: dict[str, Any] = {}
        if result.request_id:
            doc["id"] = result.request_id
        doc["model_name"] = result.model
        doc["model_version"] = str(result.version)
        if result.parameters:
            doc["parameters"] = result.parameters
        outputs = []
        chunks: list[Any] = []
        for out in result.outputs:
            entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.shape)}
            if out.shm is None:  # one in shared memory is named with no parameters, as Triton's
                data = None if out.binary else json_data(out)
                if data is None:
                    # Binary when asked, and also when JSON cannot carry the values exactly
                    # (FP16, bytes that are not UTF-8): the client decodes either form.
                    raw = out.raw()
                    entry["parameters"] = {"binary_data_size": len(raw)}
                    chunks.append(raw)
                else:
                    entry["data"] = data
            outputs.append(entry)
        doc["outputs"] = outputs
        return _dumps(doc), chunks

