"""KServe v2 HTTP/REST frontend with Triton's extensions, on :mod:`._http1`.

The server (httptools' C parser under an asyncio Protocol, see ``_http1`` for why not a
framework) runs on the same asyncio loop as the gRPC frontend and hands over whole request
bodies, out of which the binary tensor extension slices the tensors without a copy.

Routing copies Triton's URL grammar (``HTTPAPIServer::Handle``) so that unknown paths, wrong
methods and error bodies (``{"error": "..."}``) look the same to a client.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import math
import re
import socket
from typing import Any, AsyncGenerator, Awaitable, Callable
from urllib.parse import unquote

import numpy as np

from ..shm.dtypes import ITEMSIZE
from .._errors import (
    InvalidArgumentError,
    TritonpyError,
    UnavailableError,
    UnsupportedError,
    input_twice,
    listen_error,
)
from .._repo_manager import NOT_EXPLICIT
from ..validation import request_prefix
from ._http1 import HTTPServer
from ._http1_messages import BodyTooLarge, Request, Response
from .generate import NOT_ONE_RESPONSE, SSE_CONTENT_TYPE, counts, decode_generate, encode_generate, sse_event
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
from ._request_parsing import (
    apply_parameters,
    forward_headers,
    parse_json_object,
    parse_version,
    shm_ref,
)
from ._tensor_decode import array_from_json, array_from_raw, input_from_raw, is_uint
from ._tensor_encode import class_count, json_data
from .dataplane import DEFAULT_MAX_INPUT_SIZE, DataPlane, to_error

log = logging.getLogger(__name__)

_MODEL_RE = re.compile(
    r"/v2/models/([^/]+)(?:/versions/([0-9]+))?"
    r"(?:/(infer|generate|generate_stream|ready|config|stats|trace/setting))?"
)
_HEALTH_RE = re.compile(r"/v2/health/(live|ready)")
_REPO_RE = re.compile(r"/v2/repository(?:/([^/]+))?/(index|models/([^/]+)/(load|unload))")
_SYSSHM_RE = re.compile(r"/v2/systemsharedmemory(?:/region/([^/]+))?/(status|register|unregister)")
_CUDASHM_RE = re.compile(r"/v2/cudasharedmemory(?:/region/([^/]+))?/(status|register|unregister)")
_HEADER_LENGTH = "Inference-Header-Content-Length"
_HEADER_LENGTH_KEY = _HEADER_LENGTH.lower()  # Request.headers has lower-case names
_DECOUPLED = "HTTP end point doesn't support models with decoupled transaction policy"

Handler = Callable[[Request], Awaitable[Response]]

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


_UNROUTED = object()
# NaN and infinities go as Triton writes them (NaN, Infinity, -Infinity: not strict JSON, but
# what tritonclient and Python's json read back).
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _dumps(obj: Any) -> bytes:
    return _ENCODER.encode(obj).encode()


def _as_sent(request: Request) -> Any:
    """The request's ``(name, value)`` headers, each name as the client sent it (as Triton
    forwards them to models) where the server kept them."""
    names = request.names
    if names is None:
        return request.headers.items()
    return ((names.get(k, k), v) for k, v in request.headers.items())


def json_response(obj: Any, status: int = 200) -> Response:
    """A JSON response."""
    return Response(status, _dumps(obj), "application/json")


def error_response(err: BaseException) -> Response:
    """Triton's error body, with the status the error code maps to."""
    e = to_error(err)
    return json_response({"error": e.message}, e.http_status)


# Triton's answers for a path it does not serve and a method a path does not take: a JSON
# body, sent as text/plain for the former and the health, model ready and infer paths, as
# application/json for the others (status line "405 Not Allowed", see _http1).
_NOT_FOUND = b'{"error":"Not Found"}'
_NOT_ALLOWED = b'{"error":"Method Not Allowed"}'
#: The method numbers Triton's verbose log gives ("HTTP request: 2 /v2/models/m/infer"): its
#: HTTP library's (libevhtp's htp_method); 16 for any other.
_EVHTP_METHODS = {"GET": 0, "HEAD": 1, "POST": 2, "PUT": 3, "DELETE": 4, "OPTIONS": 8,
                  "TRACE": 13, "CONNECT": 14, "PATCH": 15}


def _method_not_allowed(content_type: str = "application/json") -> Response:
    return Response(405, _NOT_ALLOWED, content_type)


def _json_body(request: Request, *, required: bool = False) -> dict[str, Any]:
    raw = request.body
    if not raw:
        if required:
            raise InvalidArgumentError("failed to parse the request JSON buffer: the body is empty")
        return {}
    return parse_json_object(raw)


def _dict(value: object, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"Unable to parse '{what}'")
    return value


def _category(path: str) -> str:
    """The API group of a path, as ``--http-restricted-api`` names them ("" for none)."""
    if path == "/v2/models/stats":
        return "statistics"
    m = _MODEL_RE.fullmatch(path)
    if m is not None:
        kind = m.group(3) or ""
        return {"": "metadata", "ready": "health", "config": "model-config",
                "stats": "statistics", "trace/setting": "trace"}.get(kind, "inference")
    if path == "/v2":
        return "metadata"
    for prefix, category in (("/v2/health/", "health"), ("/v2/repository", "model-repository"),
                             ("/v2/systemsharedmemory", "shared-memory"),
                             ("/v2/cudasharedmemory", "shared-memory"),
                             ("/v2/trace/", "trace"), ("/v2/logging", "logging")):
        if path.startswith(prefix):
            return category
    return ""


class HTTPFrontend:
    """The HTTP/REST endpoint of one :class:`DataPlane`.

    Args:
        plane: the shared data plane.
        host: address to listen on.
        port: port to listen on (0 picks a free one; see :attr:`port` after :meth:`start`).
        max_input_size: largest request body accepted, in bytes (``--http-max-input-size``).
        restricted: API group -> (header, value) a request to it must carry (Triton's
            ``--http-restricted-api``); others are refused with 403.
        header_forward: headers whose names match it reach the model as request parameters
            (``--http-header-forward-pattern``; see :func:`.dataplane.header_pattern`).
        reuse_port: bind with SO_REUSEPORT (``--reuse-http-port``): several servers share it.
    """

    def __init__(self, plane: DataPlane, host: str = "0.0.0.0", port: int = 8000,
                 max_input_size: int = DEFAULT_MAX_INPUT_SIZE,
                 restricted: dict[str, tuple[str, str]] | None = None,
                 header_forward: re.Pattern[str] | None = None, reuse_port: bool = False) -> None:
        self.plane = plane
        self.host = host
        self.port = port
        self.max_input_size = max_input_size
        # Header names are lower-case here (HTTP headers are case-insensitive).
        self.restricted = {c: (k.lower(), v) for c, (k, v) in (restricted or {}).items()}
        self.header_forward = header_forward
        self.reuse_port = reuse_port
        self.cut = asyncio.Event()  # set: a stop ends at once (Frontends.cut_short)
        self._server: HTTPServer | None = None
        self._plans: dict[tuple[str, int, bytes], RequestPlan] = {}
        self._headers: dict[tuple, tuple[bytes, dict[str, str] | None]] = {}
        self._routes: dict[str, Handler | None] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and start serving."""
        # Bodies past the limit are read and dropped, then answered with Triton's message.
        server = HTTPServer(self._dispatch, self._refused, self.max_input_size, cut=self.cut)
        server.keep_case = self.header_forward is not None
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise listen_error("HTTP", f"{self.host}:{self.port}", exc) from None
        self.port = sock.getsockname()[1]
        await server.start(sock)
        self._server = server
        log.info("Started HTTPService at %s:%d", self.host, self.port)

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting, give in-flight requests up to ``timeout`` seconds, then cancel them
        (which cancels their inferences) and close every connection."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(timeout)

    def _refused(self, err: BaseException) -> Response:
        """The answer to a request that never reached a handler (see ``HTTPServer``)."""
        if isinstance(err, BodyTooLarge):
            return error_response(self._too_large(err.size))
        return error_response(InvalidArgumentError(str(err)))

    # -- routing -----------------------------------------------------------------------------

    async def _dispatch(self, request: Request) -> Response:
        path = request.path
        if log.isEnabledFor(logging.DEBUG):  # --log-verbose: each request, as Triton's line
            log.debug("HTTP request: %d %s", _EVHTP_METHODS.get(request.method, 16), path)
        if self.restricted:
            need = self.restricted.get(_category(path))
            if need is not None and request.headers.get(need[0]) != need[1]:
                # Triton's answer, content type included.
                return Response(403, _ENCODER.encode(
                    {"error": f"This API is restricted, expecting header '{need[0]}'"}).encode(),
                    "text/plain")
        try:
            # The handler of the path, kept per path (a route depends on the path alone).
            routes = self._routes
            handler = routes.get(path, _UNROUTED)
            if handler is _UNROUTED:
                handler = self._find_route(path)
                keep(routes, path, handler)
            if handler is None:
                log.debug("HTTP error: %s %s - 404", request.method, path)
                return Response(404, _NOT_FOUND, "text/plain")
            return await handler(request)  # type: ignore[operator]
        except Exception as exc:  # a bad request must never take the server down
            if not isinstance(exc, TritonpyError):
                log.exception("HTTP %s %s failed", request.method, path)
            return error_response(exc)

    def _find_route(self, path: str) -> Handler | None:
        """The handler of ``path`` as sent; the names in it are percent-decoded once it is
        split, so that an escaped slash never splits one."""
        m = _MODEL_RE.fullmatch(path)
        if path == "/v2/models/stats":
            return lambda r: self._stats(r, "", "")
        if path == "/v2/logging":
            return self._logging
        if m is not None:
            name, version, kind = unquote(m.group(1)), m.group(2) or "", m.group(3) or ""
            if kind == "trace/setting" and version:
                return None
            if kind == "infer":
                return self._infer_route(name, version)
            return lambda r: self._model(r, name, version, kind)
        if path == "/v2":
            return self._server_metadata
        m = _HEALTH_RE.fullmatch(path)
        if m is not None:
            kind = m.group(1)
            return lambda r: self._health(r, kind)
        m = _SYSSHM_RE.fullmatch(path)
        if m is not None:
            region, action = unquote(m.group(1) or ""), m.group(2)
            return lambda r: self._system_shm(r, region, action)
        m = _CUDASHM_RE.fullmatch(path)
        if m is not None:
            region, action = unquote(m.group(1) or ""), m.group(2)
            return lambda r: self._cuda_shm(r, region, action)
        m = _REPO_RE.fullmatch(path)
        if m is not None:
            repo, kind, action = unquote(m.group(1) or ""), m.group(2), m.group(4)
            model = None if m.group(3) is None else unquote(m.group(3))
            return lambda r: self._repository(r, repo, kind, model, action)
        if path == "/v2/trace/setting":
            return self._trace
        return None

    # -- server ------------------------------------------------------------------------------

    async def _health(self, request: Request, kind: str) -> Response:
        if request.method != "GET":
            return _method_not_allowed("text/plain")
        ok = self.plane.live() if kind == "live" else await self.plane.ready()
        return Response(200 if ok else 400, content_type="text/plain")  # as Triton, empty

    async def _server_metadata(self, request: Request) -> Response:
        if request.method != "GET":
            return _method_not_allowed()
        return json_response(self.plane.server_metadata())

    async def _logging(self, request: Request) -> Response:
        if request.method == "GET":
            return json_response(self.plane.log_settings.get())
        if request.method == "POST":
            body = request.body
            if not body.strip(b" \t\r\n"):
                # As Triton 2.51: a settings update needs a JSON document; an empty body (or one
                # of whitespace only) changes nothing and is refused in its JSON parser's words
                # (Triton answers 500; a bad request body is 400 here, as everywhere).
                raise InvalidArgumentError("failed to parse the request JSON buffer: The "
                                           f"document is empty. at {len(body)}")
            return json_response(self.plane.update_log_settings(_json_body(request)))
        return _method_not_allowed()

    async def _trace(self, request: Request, model: str = "") -> Response:
        if request.method == "GET":
            return json_response(self.plane.trace_settings(None, model))
        if request.method == "POST":
            return json_response(self.plane.trace_settings(_json_body(request), model))
        return _method_not_allowed()

    # -- models ------------------------------------------------------------------------------

    def _infer_route(self, name: str, version_str: str) -> Handler:
        """The handler of a model's ``infer`` path: :meth:`_model`'s, with the version read
        once and an inference going straight to :meth:`_infer` (one coroutine less on the
        stack of every request)."""
        version = parse_version(version_str)  # digits or nothing (the route's pattern)

        def infer(request: Request) -> Awaitable[Response]:
            if request.method != "POST":
                return self._model(request, name, version_str, "infer")
            return self._infer(request, name, version)
        return infer

    async def _model(self, request: Request, name: str, version_str: str, kind: str) -> Response:
        if kind == "infer":
            if request.method != "POST":
                return _method_not_allowed("text/plain")
            return await self._infer(request, name, parse_version(version_str))
        if kind == "trace/setting":
            return await self._trace(request, name)
        if kind in ("generate", "generate_stream"):
            if request.method != "POST":
                return _method_not_allowed()
            return await self._generate(request, name, parse_version(version_str), kind == "generate_stream")
        if kind == "stats":
            return await self._stats(request, name, version_str)
        if request.method != "GET":
            return _method_not_allowed("text/plain" if kind == "ready" else "application/json")
        version = parse_version(version_str)
        if kind == "ready":
            if await self.plane.model_ready(name, version):
                return Response(200, content_type="text/plain")
            return json_response({"error": "Model version not ready"}, 400)
        if kind == "config":
            return json_response(self.plane.model_config(name, version))
        return json_response(self.plane.model_metadata(name, version))

    async def _stats(self, request: Request, name: str, version: str) -> Response:
        if request.method != "GET":
            return _method_not_allowed()
        return json_response(await self.plane.statistics(name, version))

    # -- repository --------------------------------------------------------------------------

    async def _repository(self, request: Request, repo: str, kind: str, name: str | None,
                          action: str | None) -> Response:
        if request.method != "POST":
            return _method_not_allowed()
        if repo and kind != "index":  # Triton 2.51 answers the index whatever the name
            raise UnsupportedError("'repository_name' specification is not supported")
        if action == "unload" and self.plane.server.model_control_mode != "explicit":
            # As Triton 2.51 (measured; QA L0_http): an unload is refused for the mode before
            # its body is read (a load's body is read first).
            raise UnavailableError(NOT_EXPLICIT)
        body = _json_body(request)
        if kind == "index":
            ready = body.get("ready", False)
            if not isinstance(ready, bool):
                raise InvalidArgumentError("Unable to parse 'ready'")
            # As Triton's JSON: a field with nothing to say (a READY model's reason) is left out.
            index = await self.plane.repository_index(ready)
            return json_response([{k: v for k, v in m.items() if v != ""} for m in index])
        assert name is not None
        params = _dict(body.get("parameters"), "parameters")
        if action == "load":
            config: str | None = None
            files: dict[str, bytes] = {}
            for key, value in params.items():
                if not isinstance(value, str):
                    raise InvalidArgumentError(f"Unable to parse parameter '{key}': expected a string")
                if key == "config":
                    config = value
                elif key.startswith("file:"):
                    try:
                        files[key] = base64.b64decode(value, validate=True)
                    except (binascii.Error, ValueError):
                        raise InvalidArgumentError(f"parameter '{key}' is not valid base64") from None
                else:
                    raise InvalidArgumentError(f"unexpected parameter '{key}' in load request")
            await self.plane.load(name, config, files or None)
        else:
            dependents = params.get("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise InvalidArgumentError("Unable to parse 'unload_dependents'")
            await self.plane.unload(name, dependents)
        return Response(200, content_type="application/json")

    # -- shared memory -----------------------------------------------------------------------

    def _shm_method_ok(self, request: Request, action: str) -> bool:
        return request.method == ("GET" if action == "status" else "POST")

    async def _system_shm(self, request: Request, region: str, action: str) -> Response:
        if not self._shm_method_ok(request, action):
            return _method_not_allowed()
        shm = self.plane.shm
        if action == "status":
            return json_response(shm.status(region))
        if action == "register":
            if not region:
                raise InvalidArgumentError(
                    "'region name' is necessary to register system shared memory region"
                )
            body = _json_body(request, required=True)
            if "key" not in body:
                raise InvalidArgumentError("Shared memory register request has no 'key' field")
            if "byte_size" not in body:
                raise InvalidArgumentError("Shared memory register request has no 'byte_size' field")
            key, offset, size = body["key"], body.get("offset", 0), body["byte_size"]
            if not isinstance(key, str):
                raise InvalidArgumentError("Unable to parse 'key'")
            if not is_uint(offset) or not is_uint(size):
                raise InvalidArgumentError("Unable to parse 'offset' or 'byte_size'")
            shm.register(region, key, offset, size)
        else:
            shm.unregister(region)
        return Response(200, content_type="application/json")

    async def _cuda_shm(self, request: Request, region: str, action: str) -> Response:
        # Without GPUs (none counted), as a Triton built without GPU support: status lists
        # nothing, unregister has nothing to do, register is refused.
        if not self._shm_method_ok(request, action):
            return _method_not_allowed()
        shm = self.plane.shm
        if action == "status":
            return json_response(shm.cuda_status(region))
        if action == "register":
            shm.require_gpus(region)
            body = _json_body(request, required=True)
            for field in ("raw_handle", "device_id", "byte_size"):
                if field not in body:
                    raise InvalidArgumentError(
                        f"CUDA shared memory register request has no '{field}' field")
            raw = body["raw_handle"]
            b64 = raw.get("b64") if isinstance(raw, dict) else None
            if not isinstance(b64, str):
                raise InvalidArgumentError("Unable to parse 'raw_handle': expected {\"b64\": ...}")
            try:
                handle = base64.b64decode(b64, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidArgumentError("Unable to parse 'raw_handle': not base64") from None
            device, size = body["device_id"], body["byte_size"]
            if not is_uint(device) or not is_uint(size):
                raise InvalidArgumentError("Unable to parse 'device_id' or 'byte_size'")
            shm.register_cuda(region, handle, device, size)
        else:
            shm.unregister_cuda(region)
        return Response(200, content_type="application/json")

    # -- inference ---------------------------------------------------------------------------

    def _too_large(self, size: int) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"request body of {size} bytes exceeds the maximum allowed value of "
            f"{self.max_input_size} bytes. Use --http-max-input-size to increase the limit."
        )

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

    # -- generate extension ------------------------------------------------------------------

    async def _generate(self, request: Request, model: str, version: int, stream: bool) -> Response:
        """``/generate`` (exactly one response, as JSON) and ``/generate_stream`` (SSE)."""
        req = decode_generate(model, version, request.body, self.plane.model_metadata(model, version))
        if self.header_forward is not None:
            forward_headers(req, _as_sent(request), self.header_forward)
        decoupled = self.plane.model(model, version).decoupled()
        responses = self.plane.stream(req)
        if not stream:
            async with contextlib.aclosing(responses):
                results = [r async for r in responses if counts(r, decoupled)]
            if len(results) != 1:
                raise InvalidArgumentError(NOT_ONE_RESPONSE)
            if results[0].error is not None:
                raise results[0].error
            return Response(200, encode_generate(results[0]), "application/json")
        try:
            # The first response sets the status; an error before it is a plain JSON error.
            first = None
            async for result in responses:
                if counts(result, decoupled):
                    first = result
                    break
        except BaseException:
            await responses.aclose()
            raise

        async def events() -> AsyncGenerator[bytes, None]:
            async with contextlib.aclosing(responses):
                if first is None:
                    return
                yield sse_event(first)
                async for result in responses:
                    if counts(result, decoupled):
                        yield sse_event(result)

        status = 200 if first is None or first.error is None else first.error.http_status
        return Response(status, content_type=SSE_CONTENT_TYPE, stream=events())

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

