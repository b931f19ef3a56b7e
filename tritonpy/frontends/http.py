"""KServe v2 HTTP/REST frontend with Triton's extensions, on :mod:`._http1`.

The server (httptools' C parser under an asyncio Protocol, see ``_http1`` for why not a
framework) runs on the same asyncio loop as the gRPC frontend and hands over whole request
bodies, out of which the binary tensor extension slices the tensors without a copy.

Routing copies Triton's URL grammar (``HTTPAPIServer::Handle``) so that unknown paths, wrong
methods and error bodies (``{"error": "..."}``) look the same to a client.

Its modules: this one (the frontend: lifecycle, routing, the generate extension),
``_http_infer`` (the inference path: the binary tensor extension both ways),
``_http_endpoints`` (health, metadata, settings, statistics, repository, shared memory) and
``_http_json`` (the JSON answers and error bodies).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from typing import AsyncGenerator, Awaitable, Callable
from urllib.parse import unquote

from .._errors import InvalidArgumentError, listen_error
from ._http1 import HTTPServer
from ._http1_messages import BodyTooLarge, Request, Response
from ._http_endpoints import _Endpoints
from ._http_infer import _Inference, _as_sent
from ._http_json import _ENCODER, _NOT_FOUND, _method_not_allowed, error_response, json_response
from ._infer_types import RequestPlan, keep
from ._request_parsing import forward_headers, parse_version
from .dataplane import DEFAULT_MAX_INPUT_SIZE, DataPlane, needs_traceback
from .generate import (NOT_ONE_RESPONSE, SSE_CONTENT_TYPE, counts, decode_generate,
                       encode_generate, sse_event)

log = logging.getLogger(__name__)

_MODEL_RE = re.compile(
    r"/v2/models/([^/]+)(?:/versions/([0-9]+))?"
    r"(?:/(infer|generate|generate_stream|ready|config|stats|trace/setting))?"
)
_HEALTH_RE = re.compile(r"/v2/health/(live|ready)")
_REPO_RE = re.compile(r"/v2/repository(?:/([^/]+))?/(index|models/([^/]+)/(load|unload))")
_SYSSHM_RE = re.compile(r"/v2/systemsharedmemory(?:/region/([^/]+))?/(status|register|unregister)")
_CUDASHM_RE = re.compile(r"/v2/cudasharedmemory(?:/region/([^/]+))?/(status|register|unregister)")

Handler = Callable[[Request], Awaitable[Response]]

_UNROUTED = object()
#: The method numbers Triton's verbose log gives ("HTTP request: 2 /v2/models/m/infer"): its
#: HTTP library's (libevhtp's htp_method); 16 for any other.
_EVHTP_METHODS = {"GET": 0, "HEAD": 1, "POST": 2, "PUT": 3, "DELETE": 4, "OPTIONS": 8,
                  "TRACE": 13, "CONNECT": 14, "PATCH": 15}


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


class HTTPFrontend(_Endpoints, _Inference):
    """The HTTP/REST endpoint of one :class:`DataPlane`.

    Args:
        plane: the shared data plane.
        host: address to listen on.
        port: port to listen on (0 picks a free one; see :attr:`port` after :meth:`start`).
        max_input_size: largest request body accepted, in bytes (``--http-max-input-size``).
        restricted: API group -> (header, value) a request to it must carry (Triton's
            ``--http-restricted-api``); others are refused with 403.
        header_forward: headers whose names match it reach the model as request parameters
            (``--http-header-forward-pattern``; see :func:`._request_parsing.header_pattern`).
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

    def _too_large(self, size: int) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"request body of {size} bytes exceeds the maximum allowed value of "
            f"{self.max_input_size} bytes. Use --http-max-input-size to increase the limit."
        )

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
            if needs_traceback(exc):
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
