"""Network frontends of a :class:`tritonpy.Server`: KServe v2 HTTP/REST, gRPC, and metrics.

:class:`Frontends` runs all three on one asyncio loop, either the caller's (``await start()``,
as ``tritonpy serve`` does) or a private loop in a background thread (``start_in_thread()``,
for embedding and tests). Both protocol frontends share one :class:`DataPlane`, so they also
share the registry of client shared-memory regions, as in Triton.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from .._loop import log_stalls, new_event_loop, run_loop
from ..shm.waiting import StallWatch
from ._log_settings import LogSettings
from ._request_parsing import header_pattern
from .dataplane import DEFAULT_MAX_INPUT_SIZE, DataPlane
from ._h2_keepalive import KeepAlive
from .grpc import GRPCFrontend
from .http import HTTPFrontend
from .sharedmem import SharedMemoryRegistry

if TYPE_CHECKING:
    from ..server import Server

__all__ = ["DataPlane", "Frontends", "GRPCFrontend", "HTTPFrontend", "KeepAlive", "LogSettings",
           "SharedMemoryRegistry", "new_event_loop", "run_loop"]

log = logging.getLogger(__name__)

DEFAULT_SHM_PREFIX = "tritonpy_"


class Frontends:
    """HTTP, gRPC and metrics endpoints for one server.

    Args:
        server: the in-process server (already started, or started by the caller later).
        http_port, grpc_port, metrics_port: ports; 0 picks a free one (read the attributes of
            the same names after start).
        allow_http, allow_grpc, allow_metrics: which endpoints to run.
        http_address, grpc_address, metrics_address: addresses to listen on.
        max_input_size: largest HTTP request body, in bytes.
        reserved_shm_prefixes: shm name prefixes clients may not register (the server's own
            pools); by default the server's ``shm-region-prefix-name``.
        log_settings: the dynamic logging settings to expose (a default one otherwise).
        exit_timeout: seconds in-flight requests get to finish on stop.
        cpu_metrics, metrics_interval_ms: Triton's CPU metrics, and how long a CPU utilization
            sample lasts.
        http_restricted, grpc_restricted: API group -> (key, value) a request must carry
            (Triton's ``--http-restricted-api`` / ``--grpc-restricted-protocol``, see
            :func:`._request_parsing.parse_restrictions`).
        http_header_forward, grpc_header_forward: header-forwarding patterns (Triton's
            ``--http-header-forward-pattern`` / ``--grpc-header-forward-pattern``).
        grpc_compression: the gRPC inference responses' compression level.
        grpc_ssl: a server ``ssl.SSLContext``: gRPC is served over TLS.
        reuse_http_port, reuse_grpc_port: bind those ports with SO_REUSEPORT.
        grpc_keepalive: gRPC's keepalive pings, ping policy and connection age
            (:class:`~tritonpy.frontends._h2_keepalive.KeepAlive`; None: Triton's defaults).
    """

    def __init__(
        self,
        server: Server,
        *,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        allow_http: bool = True,
        allow_grpc: bool = True,
        allow_metrics: bool = True,
        http_address: str = "0.0.0.0",
        grpc_address: str = "0.0.0.0",
        metrics_address: str = "0.0.0.0",
        max_input_size: int = DEFAULT_MAX_INPUT_SIZE,
        reserved_shm_prefixes: Iterable[str] | None = None,
        log_settings: LogSettings | None = None,
        exit_timeout: float = 30.0,
        cpu_metrics: bool = True,
        metrics_interval_ms: int = 2000,
        http_restricted: dict[str, tuple[str, str]] | None = None,
        grpc_restricted: dict[str, tuple[str, str]] | None = None,
        http_header_forward: str | None = None,
        grpc_header_forward: str | None = None,
        grpc_compression: str = "none",
        grpc_ssl: Any = None,
        reuse_http_port: bool = False,
        reuse_grpc_port: bool = False,
        grpc_keepalive: KeepAlive | None = None,
    ) -> None:
        from ..metrics import MetricsFrontend

        if reserved_shm_prefixes is None:
            options = getattr(server, "options", None)
            reserved_shm_prefixes = [DEFAULT_SHM_PREFIX,
                                     getattr(options, "shm_region_prefix_name", DEFAULT_SHM_PREFIX)]
        self.server = server
        self.exit_timeout = exit_timeout
        repo = getattr(server, "repo", None)
        gpu_count = repo.gpu_count if repo is not None else (lambda: 0)
        self.plane = DataPlane(server, SharedMemoryRegistry(reserved_shm_prefixes, gpu_count,
                                                            getattr(server, "segments", None)),
                               log_settings)
        self.http = HTTPFrontend(
            self.plane, http_address, http_port, max_input_size, restricted=http_restricted,
            header_forward=header_pattern(http_header_forward),
            reuse_port=reuse_http_port) if allow_http else None
        self.grpc = GRPCFrontend(
            self.plane, grpc_address, grpc_port, restricted=grpc_restricted,
            header_forward=header_pattern(grpc_header_forward), compression=grpc_compression,
            ssl=grpc_ssl, reuse_port=reuse_grpc_port,
            keepalive=grpc_keepalive) if allow_grpc else None
        self.metrics = (MetricsFrontend(server, metrics_address, metrics_port, cpu_metrics,
                                        metrics_interval_ms) if allow_metrics else None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stall: StallWatch | None = None  # the private loop's, while it runs
        self._started: list[Any] = []

    @property
    def http_port(self) -> int | None:
        """The bound HTTP port (None when HTTP is off)."""
        return self.http.port if self.http else None

    @property
    def grpc_port(self) -> int | None:
        """The bound gRPC port (None when gRPC is off)."""
        return self.grpc.port if self.grpc else None

    @property
    def metrics_port(self) -> int | None:
        """The bound metrics port (None when metrics are off)."""
        return self.metrics.port if self.metrics else None

    def endpoints(self) -> Sequence[str]:
        """Human-readable ``protocol host:port`` lines of what is listening."""
        out = []
        for kind, fe in (("HTTP", self.http), ("gRPC", self.grpc), ("metrics", self.metrics)):
            if fe is not None and fe in self._started:
                out.append(f"{kind} {fe.host}:{fe.port}")
        return out

    # -- on the caller's loop ----------------------------------------------------------------

    async def start(self) -> None:
        """Start every enabled endpoint; on failure, stop the ones already started."""
        try:
            # In Triton's order (its log and which busy port it names first): gRPC, HTTP,
            # metrics.
            for fe in (self.grpc, self.http, self.metrics):
                if fe is not None:
                    await fe.start()
                    self._started.append(fe)
        except BaseException:
            await self.stop()
            raise

    def cut_short(self) -> None:
        """End a stop's wait for the requests in flight now (on the frontends' loop): what
        is left is cancelled and every connection closed (a second SIGINT or SIGTERM)."""
        for fe in (self.http, self.grpc):
            if fe is not None:
                fe.cut.set()

    async def stop(self) -> None:
        """Stop accepting, drain in-flight requests (up to ``exit_timeout``, or until
        :meth:`cut_short`), close regions."""
        started, self._started = self._started, []
        results = await asyncio.gather(*(fe.stop(self.exit_timeout) for fe in started),
                                       return_exceptions=True)
        for fe, res in zip(started, results):
            if isinstance(res, BaseException):
                log.warning("stopping %s failed: %s", type(fe).__name__, res)
        self.plane.shm.close()

    # -- on a private loop in a thread -------------------------------------------------------

    def start_in_thread(self) -> Frontends:
        """Run the endpoints on a private event loop in a daemon thread; returns self."""
        if self._thread is not None:
            raise RuntimeError("frontends already started")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._watch_loop(loop)
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name="tritonpy-frontends", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = None
            self._unwatch_loop()
            raise failure[0]
        return self

    def stop_in_thread(self) -> None:
        """Stop what :meth:`start_in_thread` started and join its thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self.stop(), loop)
        try:
            fut.result(self.exit_timeout + 10)
        finally:
            self._unwatch_loop()
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            self._thread = None
            self._loop = None

    def _watch_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the private loop's thread: have the server's maintenance watch it for stalls, as
        it watches its own frame loop (under ``tritonpy serve`` they are one loop)."""
        watch_loop = getattr(self.server, "watch_loop", None)
        options = getattr(self.server, "options", None)
        if watch_loop is None or options is None:
            return
        self._stall = StallWatch(loop, options.loop_stall_seconds,
                                 log_stalls("the event loop of the HTTP and gRPC frontends",
                                            "every HTTP and gRPC request waits"),
                                 threading.get_ident())
        watch_loop(self._stall)

    def _unwatch_loop(self) -> None:
        watch, self._stall = self._stall, None
        if watch is not None:
            self.server.unwatch_loop(watch)

    def __enter__(self) -> Frontends:
        return self.start_in_thread()

    def __exit__(self, *exc: object) -> None:
        self.stop_in_thread()
