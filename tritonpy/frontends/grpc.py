"""KServe v2 gRPC frontend (``inference.GRPCInferenceService``) on our HTTP/2 server
(:mod:`._http2`, HTTP/2 framed on the frontends' event loop, ``hpack`` for headers).

The service definition is the one ``tritonclient[grpc]`` ships, so the real client talks to it
unchanged. Behaviour follows Triton's ``src/grpc``: every output travels in
``raw_output_contents``; errors become the gRPC status the Triton error code maps to; the
bidirectional stream behaves as :mod:`._grpc_stream` says.

This module serves the service (:class:`GRPCFrontend`: each method's handler, parser, API
group and delay, on the HTTP/2 server). The rest of the frontend:

- :mod:`._grpc_service`: ``GRPCInferenceService`` over the data plane, its unary RPCs;
- :mod:`._grpc_stream`: the bidirectional ``ModelStreamInfer`` (order, errors, stop);
- :mod:`._grpc_codec`: messages to and from requests and results, and the hand reading of a
  ``ModelInferRequest``'s wire bytes.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
from typing import Any

from tritonclient.grpc import service_pb2

from .._errors import listen_error
from .._scheduler import debug_count
from ._grpc_service import F, GRPCService
from ._h2_grpc import MAX_MESSAGE_SIZE, Method
from ._h2_keepalive import KeepAlive
from ._http2 import Http2GrpcServer
from .dataplane import DataPlane

log = logging.getLogger(__name__)

#: The standard gRPC health check, served beside ``GRPCInferenceService``.
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def _delayed(handler: F, seconds: int) -> F:
    """``handler`` answering ``seconds`` late, as Triton's test hook
    ``TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC`` delays every gRPC answer but inference
    ones (upstream's non-inference client timeout tests need it). The work is done first."""

    @functools.wraps(handler)
    async def late(request: Any, context: Any) -> Any:
        try:
            response = await handler(request, context)
        except asyncio.CancelledError:
            raise
        except BaseException:
            await asyncio.sleep(seconds)
            raise
        await asyncio.sleep(seconds)
        return response

    return late  # type: ignore[return-value]


def _health_request(data: Any) -> None:
    """A HealthCheckRequest, checked (not kept): a message that is not protobuf is refused
    INTERNAL, as Triton refuses it (measured). An empty message type reads any well-formed
    one, its ``service`` field an unknown field."""
    service_pb2.ServerLiveRequest.FromString(data)


#: The API group of each method, as --grpc-restricted-protocol names them.
_CATEGORIES = {
    "ServerLive": "health", "ServerReady": "health", "ModelReady": "health",
    "ServerMetadata": "metadata", "ModelMetadata": "metadata",
    "ModelInfer": "inference", "ModelStreamInfer": "inference",
    "ModelConfig": "model-config", "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository", "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory", "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory", "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory", "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace", "LogSettings": "logging",
}


class GRPCFrontend:
    """The gRPC endpoint of one :class:`DataPlane`.

    Args:
        plane: the shared data plane.
        host: address to listen on.
        port: port to listen on (0 picks a free one; see :attr:`port` after :meth:`start`).
        max_message_size: largest request message in bytes (Triton's 2^31-1 by default); a
            larger one is answered RESOURCE_EXHAUSTED.
        restricted: API group -> (key, value): a call to the group must carry the metadata
            ``triton-grpc-protocol-<key>: <value>``, else it is refused UNAVAILABLE (Triton's
            ``--grpc-restricted-protocol``).
        header_forward: metadata whose names match it reach the model as request parameters
            (``--grpc-header-forward-pattern``).
        compression: the inference responses' compression level (``none``, ``low``,
            ``medium``, ``high``: Triton's ``--grpc-infer-response-compression-level``).
        ssl: a server ``ssl.SSLContext`` to serve TLS with (``--grpc-use-ssl``).
        reuse_port: bind with SO_REUSEPORT (``--reuse-grpc-port``).
        keepalive: the keepalive pings, ping policy and connection age (Triton's
            ``--grpc-keepalive-*``, ``--grpc-http2-*``, ``--grpc-max-connection-age*``); None:
            their defaults.
    """

    def __init__(self, plane: DataPlane, host: str = "0.0.0.0", port: int = 8001,
                 max_message_size: int = MAX_MESSAGE_SIZE,
                 restricted: dict[str, tuple[str, str]] | None = None,
                 header_forward: re.Pattern[str] | None = None, compression: str = "none",
                 ssl: Any = None, reuse_port: bool = False,
                 keepalive: KeepAlive | None = None) -> None:
        self.plane = plane
        self.host = host
        self.port = port
        self.max_message_size = max_message_size
        self.restricted = restricted or {}
        self.header_forward = header_forward
        self.compression = compression
        self.ssl = ssl
        self.reuse_port = reuse_port
        self.keepalive = keepalive
        self.cut = asyncio.Event()  # set: a stop ends at once (Frontends.cut_short)
        self._server: Http2GrpcServer | None = None
        self._service: GRPCService | None = None

    async def start(self) -> None:
        """Bind and start serving."""
        service = GRPCService(self.plane, self.header_forward)
        described = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        late = debug_count("TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC")
        if late:
            log.info("gRPC answers other than inference ones are delayed %d s "
                     "(TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC)", late)
        methods = {}
        for m in described.methods:
            infer = m.name in ("ModelInfer", "ModelStreamInfer")
            parse = (service.parse_infer if m.name == "ModelInfer"
                     else getattr(service_pb2, m.input_type.name).FromString)
            handler = getattr(service, m.name)
            methods[f"/{described.full_name}/{m.name}"] = Method(
                _delayed(handler, late) if late and not infer else handler, parse,
                m.client_streaming, compressible=infer,
                restricted=self._restriction(_CATEGORIES.get(m.name, "")),
                # A stream reads its own (triton_grpc_error), once per stream.
                metadata=infer and (m.name == "ModelStreamInfer" or self.header_forward is not None
                                    or self.plane.server.tracing.mode == "opentelemetry"))
        methods[HEALTH_CHECK] = Method(
            _delayed(service.HealthCheck, late) if late else service.HealthCheck,
            _health_request, False, restricted=self._restriction("health"))
        server = Http2GrpcServer(methods, self.max_message_size, self.compression, self.ssl,
                                 self.keepalive, cut=self.cut)
        try:
            self.port = await server.start(self.host, self.port, self.reuse_port)
        except OSError as exc:
            address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
            raise listen_error("GRPC", address, exc) from None
        self._service = service
        self._server = server
        log.info("Started GRPCInferenceService at %s:%d", self.host, self.port)

    def _restriction(self, category: str) -> tuple[str, str] | None:
        """The (metadata name, value) a call of the API group ``category`` must carry."""
        need = self.restricted.get(category)
        return None if need is None else (f"triton-grpc-protocol-{need[0]}", need[1])

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting, give in-flight RPCs up to ``timeout`` seconds, then cancel them."""
        if self._server is not None:
            if self._service is not None:
                self._service.begin_stop()
            await self._server.stop(timeout)
            self._server = None
