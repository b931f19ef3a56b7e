"""The in-process API: ``tritonpy.Server`` and ``Model`` — what a host server embeds.

Shaped after Triton's own in-process Python API (the ``tritonserver`` package): a server over
one or more model repositories, model handles with ``infer``/``async_infer`` returning
iterables of responses, and the repository, statistics and metrics views the frontends serve.
"""
from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import operator
import os
import threading
import time
import weakref
from typing import Any, Mapping, Sequence

import numpy as np
from prometheus_client import CollectorRegistry

from tritonpy.shm import Cmd, Pool, SegmentMap, TensorTransport, janitor, sweep_orphans
from tritonpy.shm import cuda
from tritonpy.shm.cuda import DeviceRef
from tritonpy.shm.dtypes import TRITON_TO_NUMPY, triton_dtype_of
from tritonpy.shm.pool import RECLAIM_EVERY_S
from tritonpy.shm.waiting import StallWatch

from . import _repo_manager
from ._bls import BlsRouter
from ._cache import ResponseCache
from ._custom_metrics import CustomMetrics
from . import _arguments as arg
from ._errors import (
    InvalidArgumentError,
    TritonpyError,
    UnavailableError,
    input_twice,
    load_cancelled,
)
from ._loop import FrameLoop
from ._model import ModelRuntime
from ._options import BackendOptions
from ._ratelimit import RateLimiter, parse_resource
from ._request import AsyncResponseStream, HostRequest, ResponseStream, Timers
from ._runtime_base import READY
from ._stats import CounterCarry, MetricsConfig
from ._stubproc import StubProcess
from ._trace import Trace, Tracing
from .repository import DEFAULT_BACKEND_DIRECTORY, repository_problem

log = logging.getLogger("tritonpy")
__version__ = "0.1.0"
_LOG_LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}
_USAGE_TIMEOUT_S = 0.5  # a stub's answer to USAGE (a metrics scrape waits for it)


def load_models_problem(model_control_mode: str, load_models: Sequence[str]) -> str:
    """What is wrong with models to load at start (empty: nothing), in Triton's words: it
    refuses to start then, rather than load every model or some of them."""
    if load_models and model_control_mode != "explicit":
        return ("Use of '--load-model' requires setting '--model-control-mode=explicit' as "
                "well.")
    if "*" in load_models and len(load_models) > 1:
        return "Wildcard model name '*' must be the ONLY startup model if specified at all."
    return ""


def _wire_text(value: Any) -> str:
    """A name, version or config of a stub's model loading API call: bytes (its model gave
    bytes that are not UTF-8) are read as pb_utils read them, each byte UTF-8 cannot read a
    lone surrogate (as os.fsdecode reads a folder's name)."""
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


# Servers started and not stopped: a program that exits without stop() still leaves no stub
# and no segment behind (a SIGKILLed one relies on PDEATHSIG and its janitor, shm/janitor.py).
_LIVE: weakref.WeakSet[Server] = weakref.WeakSet()


@atexit.register
def _abandon_live_servers() -> None:
    for srv in list(_LIVE):
        try:
            srv._abandon()
        except Exception:  # best effort at interpreter exit
            log.exception("cleanup at exit failed")


EXTENSIONS = ["classification", "sequence", "model_repository", "model_repository(unload_dependents)",
              "schedule_policy", "model_configuration", "system_shared_memory", "binary_tensor_data",
              "parameters", "statistics", "trace", "logging"]


class Server:
    """A tritonpy server: model repositories, stubs, scheduling, BLS routing.

    Args:
        model_repository: one or more repository directories (str, bytes or
            ``os.PathLike``).
        model_control_mode: ``"none"`` (load everything at start), ``"explicit"`` (load what
            ``load_models``/``load()`` ask for) or ``"poll"`` (rescan and reload on changes).
        load_models: models to load at start in explicit mode (``"*"`` for all; None: none).
        backend_config: Triton's python backend options, e.g.
            ``{"shm-default-byte-size": "16777216", "shm-region-prefix-name": "myapp_"}``.
        exit_timeout: seconds ``stop()`` waits for in-flight requests.
        poll_interval: seconds between repository scans in poll mode (0: the repository is
            read at start only, as Triton's ``--repository-poll-secs 0``).
        strict_readiness: not ready while a model failed to load or is loading (Triton's
            default).
        auto_complete: call a model's ``auto_complete_config`` (and allow a missing
            config.pbtxt); False is Triton's ``--disable-auto-complete-config``.
        tracing: the trace settings (Triton's ``--trace-config``); tracing is off without.
        model_config_name: Triton's ``--model-config-name``: a model whose directory has
            ``configs/<name>.pbtxt`` is configured by it instead of its ``config.pbtxt``.
        response_cache_size: bytes of Triton's local response cache (``--cache-config
            local,size=N``) for the models whose config enables ``response_cache``; 0: none
            (those models run every request, as in Triton).
        model_load_retry_count: how many times a model that fails to load is tried again
            (Triton's ``--model-load-retry-count``); an invalid configuration is not.
        metrics_config: Triton's ``--metrics-config`` (duration counters on or off, duration
            summaries and their quantiles); None: Triton's defaults (counters, no summaries).
        backend_directory: Triton's ``--backend-directory``, where a model whose config names
            another backend than ``python`` finds it as a Python-based backend
            (``<backend_directory>/<backend>/model.py``); None: Triton's default,
            ``/opt/tritonserver/backends``.
        rate_limit: Triton's ``--rate-limit``: ``"execution_count"`` turns the rate limiter
            on (an instance whose group lists ``rate_limiter`` resources runs an execute only
            while they are free, across models); ``"off"`` (the default) ignores them.
        rate_limit_resources: Triton's ``--rate-limit-resource``, each
            ``"<name>:<count>[:<device>]"``: the copies of a resource (on every device, and for
            a global one, without a device); others have as many as the largest count an
            instance lists.
        model_namespacing: Triton's ``--model-namespacing``: a model name that two
            repositories hold is two models, each ensemble running the steps of its own
            repository first; a request, a load or an unload naming it stands for both (a
            request is refused for its ambiguity), and the metrics carry a ``namespace`` label
            (the repository). False: such a name is served by neither (as Triton).
        loop: a running event loop on which to read the stubs' frames, typically the one the
            caller serves its clients on (``tritonpy serve`` passes the HTTP/gRPC loop): a
            response then reaches an ``async_infer`` caller there with no hand-off between
            threads. It must run until :meth:`stop` returns. None: a thread of the server's own.
    """

    def __init__(self, model_repository: arg.PathArg | Sequence[arg.PathArg] | None = None, *,
                 model_control_mode: str = "none", load_models: Sequence[str] | None = (),
                 backend_config: Mapping[str, str] | None = None, log_verbose: int = 0,
                 exit_timeout: float = 30.0, poll_interval: float = 1.0,
                 strict_readiness: bool = True, auto_complete: bool = True,
                 server_id: str = "triton", tracing: Tracing | None = None,
                 loop: asyncio.AbstractEventLoop | None = None,
                 model_config_name: str = "", response_cache_size: int = 0,
                 model_load_retry_count: int = 0,
                 metrics_config: MetricsConfig | None = None,
                 backend_directory: arg.PathArg | None = None,
                 rate_limit: str = "off",
                 rate_limit_resources: Sequence[str] = (),
                 model_namespacing: bool = False) -> None:
        repos = [] if model_repository is None else arg.paths(model_repository)
        if model_control_mode not in ("none", "explicit", "poll"):
            raise InvalidArgumentError(
                f"model_control_mode must be none, explicit or poll, not {model_control_mode!r}")
        load_models = arg.names("load_models", load_models)
        if backend_config is not None and not isinstance(backend_config, Mapping):
            raise InvalidArgumentError(f"backend_config must be a mapping of keys to values, "
                                       f"not {type(backend_config).__name__}")
        log_verbose = arg.count("log_verbose", log_verbose)
        exit_timeout = arg.seconds("exit_timeout", exit_timeout)
        poll_interval = arg.seconds("poll_interval", poll_interval)
        model_load_retry_count = arg.count("model_load_retry_count", model_load_retry_count)
        response_cache_size = arg.count("response_cache_size", response_cache_size)
        for what, text in (("server_id", server_id), ("model_config_name", model_config_name),
                           ("rate_limit", rate_limit)):
            if not isinstance(text, str):
                raise InvalidArgumentError(f"{what} must be a str, not {type(text).__name__}")
        rate_limit_resources = arg.names("rate_limit_resources", rate_limit_resources, "resources")
        strict_readiness = arg.flag("strict_readiness", strict_readiness)
        auto_complete = arg.flag("auto_complete", auto_complete)
        model_namespacing = arg.flag("model_namespacing", model_namespacing)
        arg.instance("tracing", tracing, Tracing, "a tritonpy.Tracing")
        arg.instance("loop", loop, asyncio.AbstractEventLoop, "an asyncio event loop")
        arg.instance("metrics_config", metrics_config, MetricsConfig, "a tritonpy.MetricsConfig")
        problem = load_models_problem(model_control_mode, load_models)
        if problem:
            raise InvalidArgumentError(problem)
        for r in repos:
            wrong = repository_problem(r)
            if wrong:
                raise InvalidArgumentError(wrong)
        self.repositories = [os.path.abspath(r) for r in repos]
        # Triton's --model-namespacing: see RepositoryManager.
        self.model_namespacing = model_namespacing
        self.model_control_mode = model_control_mode
        self.load_models = list(load_models)
        self.options = BackendOptions.from_mapping(backend_config)
        self.log_verbose = log_verbose
        self.exit_timeout = exit_timeout
        self.poll_interval = poll_interval
        self.strict_readiness = strict_readiness
        # False: a model's auto_complete_config is never called and config.pbtxt is required
        # (Triton's --disable-auto-complete-config).
        self.auto_complete = auto_complete
        self.model_config_name = model_config_name
        if rate_limit.lower() not in ("off", "execution_count"):
            raise InvalidArgumentError(
                f"rate_limit must be off or execution_count, not {rate_limit!r}")
        # Triton's rate limiter, with --rate-limit execution_count (see _ratelimit).
        self.limiter = (RateLimiter(parse_resource(r) for r in rate_limit_resources)
                        if rate_limit.lower() == "execution_count" else None)
        self.backend_directory = os.path.abspath(
            DEFAULT_BACKEND_DIRECTORY if backend_directory is None
            else arg.path("backend_directory", backend_directory))
        self.model_load_retry_count = model_load_retry_count
        # Triton's --metrics-config: duration counters and summaries on the metrics page.
        self.metrics_config = metrics_config if metrics_config is not None else MetricsConfig()
        # Triton's local response cache (--cache-config local,size=N); None: no cache.
        self.response_cache = ResponseCache(response_cache_size) if response_cache_size > 0 \
            else None
        # The name in the server metadata: Triton's default, which clients written for Triton
        # check (Triton's --id).
        self.server_id = server_id
        # Triton's trace extension: requests from the HTTP and gRPC frontends are traced
        # by these settings (off unless given a level and a file).
        self.tracing = tracing if tracing is not None else Tracing()
        self.metrics_registry = CollectorRegistry(auto_describe=True)
        # The per-model Prometheus counters across reloads and unloads (Triton's lifetimes).
        self.counter_carry = CounterCarry()
        # A dead stub's MetricFamily objects keep no series (its death is no deletion).
        self.custom_metrics = CustomMetrics(is_live=lambda stub: bool(stub.alive))
        self.metrics_registry.register(self.custom_metrics)
        self.timers = Timers()
        self._loop = loop
        self.frames: FrameLoop = None  # type: ignore[assignment]  # from start()
        self.bls = BlsRouter(self)
        self.transport: TensorTransport = None  # type: ignore[assignment]
        self.pool: Pool = None  # type: ignore[assignment]
        self.repo = _repo_manager.RepositoryManager(self)
        self._started = False
        self._stopping = False
        self._draining = False  # a stop is draining its requests (see stop())
        self._in_start = False  # start() runs (see abort())
        # Why start() failed, if it did: ``tritonpy serve --exit-on-error=false`` goes on serving
        # such a server, as Triton does, neither live nor ready and "Server not ready" to calls.
        self.start_error: str | None = None
        self.refusing = False  # see refuse_new_requests()
        self._maint: threading.Thread | None = None
        # The stubs of instances being started (spawned, initializing or warming up), which a
        # stop does not wait for: cancel_loads() kills them and refuses to start more.
        self._starting: set[StubProcess] = set()
        self._starting_lock = threading.Lock()
        self.loads_cancelled = False
        # Other event loops whose stalls the maintenance watches too (watch_loop).
        self._loop_watches: list[StallWatch] = []
        # After stop(): the model versions whose in-flight requests outlasted exit_timeout.
        self.cut_short: list[str] = []

    def tell_reserved(self, instances: Sequence[Any]) -> None:
        """The rate limiter reserved resources for ``instances``: their models dispatch
        (on the timer thread: the caller may hold a model's lock)."""
        for inst in instances:
            self.timers.at(0.0, functools.partial(inst.model.kick_reserved, inst))

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, wait_until_ready: bool = True) -> Server:
        """Create the shm pool, sweep orphans of our prefix, load models per the control mode.

        A second call does nothing. A server that was stopped (or whose start failed) cannot
        start again: make a new one. A start that fails (say a model of ``load_models`` is
        not in the repository) stops what it had started before it raises, so that
        ``with Server(...)`` leaves no stub or segment behind either."""
        if self._started and not self._stopping:
            return self
        if self._stopping:
            raise UnavailableError("this Server was stopped (or its start failed): it cannot "
                                   "be started again; create a new Server")
        self._not_on_frame_loop("start()")
        loop = self._loop
        if loop is not None and (loop.is_closed() or not loop.is_running()):
            raise RuntimeError(
                "Server(loop=...) was given an event loop that is "
                f"{'closed' if loop.is_closed() else 'not running'}: the stubs' answers are "
                "read on it, so it must run from start() until stop() returns (or give no "
                "loop: the server then reads them on a thread of its own)")
        self._in_start = True  # an abort() from now on stops this start (see abort())
        try:
            return self._start(wait_until_ready)
        finally:
            self._in_start = False

    def _start(self, wait_until_ready: bool) -> Server:
        opts = self.options
        directory = opts.shm_fallback_directory or None
        removed = sweep_orphans(opts.shm_region_prefix_name, directory)
        if removed:
            log.info("removed %d orphaned shm segment(s) of dead processes", len(removed))
        self.segments = SegmentMap(directory)
        self.pool = Pool(prefix=opts.shm_region_prefix_name,
                         default_size=opts.shm_default_byte_size,
                         growth_size=opts.shm_growth_byte_size, cap=opts.shm_total_byte_cap,
                         directory=directory, segments=self.segments, label="host")
        # Reserve the first segment now: a too-small /dev/shm fails here, at start, clearly.
        self.pool.free(*self.pool.allocate(1), 1)
        # Should this process die without stop() (SIGKILL), the janitor removes the segments.
        self._janitor = janitor.start(opts.shm_region_prefix_name, directory)
        # The host only reads the tensors it routes: small ones stay views of their frames.
        self.transport = TensorTransport(self.pool, self.segments, writable_inline=False,
                                         private_views=False, device_refs=True)
        self.frames = FrameLoop(self._loop, self.options.loop_stall_seconds,
                                self.options.idle_spin_microseconds / 1e6)
        self.pool.on_exhausted = self._reclaim
        self._reclaim_sent = 0.0
        self._started = True
        self._maint = threading.Thread(target=self._maintain, name="tritonpy-maint", daemon=True)
        self._maint.start()
        _LIVE.add(self)
        try:
            self.repo.start_up(wait_until_ready)
        except BaseException as exc:
            self.start_error = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            # Nothing half-started stays behind (with: __exit__ is not called). A Ctrl-C
            # (KeyboardInterrupt) is not kept waiting for the models' finalize either.
            if isinstance(exc, Exception):
                self.stop()
            else:
                self._stop_now()
            raise
        if self._stopping:  # abort() while it started: it ends here, nothing left behind
            self._stop_now()
            raise UnavailableError("the server was aborted while it started")
        return self

    def stop(self) -> None:
        """Drain in-flight requests, finalize models; no stub process or segment is left.

        A stop interrupted in its drain (Ctrl-C: KeyboardInterrupt) kills the stubs left,
        without their finalize, frees the segments and raises; one interrupted even then is
        finished by the next call, or at exit."""
        if not self._started:
            return
        if self._stopping:
            if self._draining:  # another thread's stop is under way
                return
            self._stop_now()  # an interrupted stop: finish it, without a drain
            return
        self._not_on_frame_loop("stop()")
        self._stopping = True
        self._draining = True
        drained = False
        try:
            self.cancel_loads()  # an instance still initializing has no request to drain
            self._unpace_streams()
            cut = self.repo.shut_down(self.exit_timeout)
            # (one line for versions alike; an abort() meanwhile may have named some)
            self.cut_short = list(dict.fromkeys(self.cut_short + cut))
            if self.cut_short:
                log.error("exit timeout expired: cut off in %s", ", ".join(self.cut_short))
            drained = True
        finally:
            self._draining = False
            if not drained:
                log.warning("stop interrupted: the instances left are killed, without finalize")
            self._close(kill=not drained)

    def abort(self) -> None:
        """Kill every stub now, without its finalize, from any thread: the requests in flight
        fail, a :meth:`stop` draining in another thread ends at once (what ``tritonpy serve``
        does at a second SIGINT or SIGTERM), no stub is started again, the requests queued
        fail too, and the next :meth:`stop` has nothing to drain: it frees the segments. A
        :meth:`start` under way in another thread stops loading and raises."""
        if self._started or self._in_start:
            self._stopping = True
            # As a stop cut short by its exit timeout: the versions it leaves unfinished.
            self.cut_short = list(dict.fromkeys(
                self.cut_short + [f"'{name}' version {version} (requests in flight)"
                                  for name, version, _ in self.in_flight()]))
            # The queues first: once the stubs are dead, a drain under way would fail what is
            # queued in its own words.
            error = UnavailableError("the server stopped at once (abort() or a second signal): "
                                     "the request was not run")
            for rt in self.repo.runtimes() + self.repo.retiring():
                rt.fail_queue(error)
            self.cancel_loads()
            self._kill_stubs()

    def _stop_now(self) -> None:
        """Stop without a drain or finalize: the stubs (those starting too) are killed, the
        segments freed."""
        self._stopping = True
        self.cancel_loads()
        self._close(kill=True)

    def _close(self, kill: bool) -> None:
        """The end of every stop: the stubs left killed (``kill``), the timers, frame loop and
        trace file closed, the folders of loads with files removed, the segments freed."""
        if kill:
            self._kill_stubs()
        self.timers.stop()
        self.frames.close()
        self.tracing.close()
        self.repo.remove_files_folders()
        self._release_shm()

    def _unpace_streams(self) -> None:
        """Lift the back-pressure of every stream (see ``_request.HOLD_BYTES``) for the drain:
        a stream that its caller holds but reads no more would otherwise keep its model
        waiting to send, and the drain waiting for it, until the exit timeout. Its model
        finishes instead, as in Triton, whose streams have no back-pressure; what it sends
        waits in the stream."""
        self.timers.draining = True  # (streams held from now on: see _Pacing.held)
        for rt in self.repo.runtimes():
            for inst in getattr(rt, "instances", ()):
                for req in list(inst.active.values()):
                    pacer = req.pacer
                    if pacer is not None:
                        pacer.unpace()

    def cancel_loads(self) -> None:
        """Stop the instances being started now, in whatever their model's ``initialize`` or
        warmup is doing, and refuse to start any more: their loads fail at once with "the
        server is stopping". :meth:`stop` begins with it; a SIGINT while models load at start
        calls it too, so neither waits for a slow ``initialize`` (Triton 2.51 waits for the
        whole load, past its exit timeout, then exits 1)."""
        with self._starting_lock:
            self.loads_cancelled = True
            starting = list(self._starting)
        for stub in starting:
            log.warning("stopping: instance '%s' of model '%s' was still starting; it is stopped",
                        stub.name, stub.model)
            stub.abandon()

    def track_start(self, stub: StubProcess) -> None:
        """Count ``stub`` among the instances being started; once :meth:`cancel_loads` ran,
        kill it and raise."""
        with self._starting_lock:
            if not self.loads_cancelled:
                self._starting.add(stub)
                return
        stub.abandon()
        raise load_cancelled()

    def untrack_start(self, stub: StubProcess) -> None:
        with self._starting_lock:
            self._starting.discard(stub)

    def _abandon(self) -> None:
        """At interpreter exit without stop(), or after an interrupted stop: kill the stubs (no
        finalize), free the segments."""
        if not self._started:
            return
        self._stopping = True
        self._kill_stubs()
        self.repo.remove_files_folders()
        self._release_shm()

    def _kill_stubs(self) -> None:
        with self._starting_lock:  # a restart (after the kills below) starts no stub now
            self.loads_cancelled = True
        for rt in self.repo.runtimes() + self.repo.retiring():  # those being drained too
            for inst in getattr(rt, "instances", ()):
                stub = inst.stub
                if stub is not None and stub.proc.poll() is None:
                    # On purpose: its death is no error to log.
                    stub.abandon("the server stopped it at once, without finalize")
                    stub.proc.wait()

    def _release_shm(self) -> None:
        """Unlink the host pool, unmap the stubs' segments, sweep what dead stubs left. The
        server counts as started (for a next stop() or the exit's clean-up) until this ends."""
        self.pool.close()
        self.segments.close()
        sweep_orphans(self.options.shm_region_prefix_name,
                      self.options.shm_fallback_directory or None)
        janitor.stop(self._janitor)
        self._started = False
        _LIVE.discard(self)

    def _require_started(self) -> None:
        """UnavailableError, naming why, unless the server is started (maybe stopping)."""
        if not self._started:
            if self.start_error is not None:  # Triton's words for a server whose start failed
                raise UnavailableError("Server not ready")
            raise UnavailableError(
                "the server was stopped: create a new Server" if self._stopping else
                "the server is not started: call start() first (or use 'with Server(...)')")

    def _require_frame_loop(self) -> None:
        """UnavailableError when the loop given as ``Server(loop=...)`` no longer runs: no
        answer of a stub could be read, and a request would wait for ever."""
        loop = self._loop
        if loop is not None and not loop.is_running():
            raise UnavailableError(
                "the event loop given as Server(loop=...) is not running, so no answer of a "
                "stub can be read: it must run until stop() returns")

    def _not_on_frame_loop(self, what: str) -> None:
        """Refuse a call that waits for stubs on the loop given to read their answers."""
        if self._loop is not None and asyncio._get_running_loop() is self._loop:
            raise RuntimeError(
                f"Server.{what} waits for the stubs, whose answers are read on this event loop "
                "(Server(loop=...)): call it from another thread, e.g. "
                "await loop.run_in_executor(None, ...)")

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _maintain(self) -> None:
        """Every second: watch the frame loop for a stall, give idle host segments back and
        tell every stub to unmap them."""
        while self._started and not self._stopping:
            time.sleep(1.0)
            if self._stopping:
                return
            try:
                self.frames.stall.check()
                for watch in list(self._loop_watches):
                    watch.check()
                self._give_back_idle(force=False)
            except Exception:  # logged, and the next second tries again: never a silent end
                log.exception("server maintenance failed")

    def watch_loop(self, watch: StallWatch) -> None:
        """Have the maintenance thread check ``watch`` every second too (e.g. the loop of
        :meth:`Frontends.start_in_thread <tritonpy.frontends.Frontends.start_in_thread>`)."""
        self._loop_watches.append(watch)

    def unwatch_loop(self, watch: StallWatch) -> None:
        """Stop checking ``watch`` (its loop is about to stop)."""
        if watch in self._loop_watches:
            self._loop_watches.remove(watch)

    def _give_back_idle(self, force: bool) -> None:
        """Unlink the host's idle segments (``force``: all of them, now), and those of ended
        stubs viewed no more, and tell the stubs."""
        self.pool.reap(force)
        dropped = self.pool.take_dropped() + self.segments.reap_kept()
        if dropped:
            self.broadcast(Cmd.DROPPED, dropped)

    def _reclaim(self, need: int) -> bool:
        """The host pool's hook when /dev/shm has no room for a new segment of ``need``
        bytes: give the host's idle segments back and ask every stub to do the same; the pool
        may then wait for the room, but not on the frame loop, which reads the stubs' answers
        (there the request is queued again a moment later: ModelRuntime._retry_later)."""
        self._give_back_idle(force=True)
        now = time.monotonic()
        if now - self._reclaim_sent >= RECLAIM_EVERY_S:
            self._reclaim_sent = now
            self.broadcast(Cmd.RECLAIM, need)
        return not self.frames.on_loop()

    def broadcast(self, cmd: Cmd, body: Any, exclude: StubProcess | None = None) -> None:
        for rt in self.repo.runtimes():
            for inst in rt.instances:
                stub = inst.stub
                if stub is not None and stub is not exclude and stub.alive:
                    try:
                        stub.send(cmd, 0, body)
                    except Exception:
                        pass

    # -- health and metadata ---------------------------------------------------------------------
    def live(self) -> bool:
        return self._started and not self._stopping and not self.refusing

    def refuse_new_requests(self) -> None:
        """The start of ``tritonpy serve``'s stop, as Triton's: the server is neither live nor
        ready from now on, and its frontends refuse clients' new inference requests (Triton's
        UNAVAILABLE "Server is stopping, ..."), while the requests in flight finish and the
        BLS calls they make go on."""
        self.refusing = True

    def in_flight(self) -> list[tuple[str, int, int]]:
        """``(model, version, requests)`` for each model version with requests not answered
        yet (queued or running); ensembles count in the models they run."""
        out = []
        # (versions unloaded or replaced that still finish theirs count too)
        for rt in dict.fromkeys([*self.repo.runtimes(), *self.repo.retiring()]):
            n = rt.in_flight() if isinstance(rt, ModelRuntime) else 0
            if n:
                out.append((rt.name, rt.version, n))
        return out

    def ready(self) -> bool:
        """Live, every loaded model ready and, with ``strict_readiness`` (Triton's default), no
        model that failed to load or is still loading; models unloaded on purpose do not
        count."""
        if not (self.live() and self.repo.all_ready()):
            return False
        return not (self.strict_readiness and self.repo.not_available())

    def metadata(self) -> dict:
        extensions = list(EXTENSIONS)
        if self.repo.gpu_count():  # as a Triton built with GPU support
            extensions.insert(extensions.index("system_shared_memory") + 1, "cuda_shared_memory")
        return {"name": self.server_id, "version": __version__, "extensions": extensions}

    def models(self) -> list[dict]:
        """Repository index: ``{"name", "version", "state", "reason"}`` for every model, as
        Triton's: a model never loaded has only its name (the rest ""), an unloaded one its
        last versions, each ``UNAVAILABLE`` with reason ``"unloaded"``."""
        self._require_started()
        return self.repo.index()

    def model(self, name: str, version: int = -1) -> Model:
        """A handle on a model; NotFoundError if the repository has no such model,
        UnavailableError before :meth:`start` or after :meth:`stop`."""
        if not self._started:  # (the check, before the call: every request comes here)
            self._require_started()
        if type(name) is not str:  # (a plain str goes the short way: every request comes here)
            name = arg.model_name(name)
        self.repo.require_known(name)
        if type(version) is not int:
            try:
                version = operator.index(version)
            except TypeError:
                raise InvalidArgumentError(f"model version must be an int (-1: the latest), "
                                           f"not {type(version).__name__}") from None
        return Model(self, name, version)

    def load(self, name: str, config: str | bytes | Mapping[str, Any] | None = None,
             files: Mapping[str, bytes] | None = None) -> None:
        """Load or reload a model (explicit mode): raises with the reason on failure.
        ``config``: a config override, Triton's model configuration as JSON text (str or
        UTF-8 bytes), or as a dict, written as JSON (numpy numbers and arrays as the numbers
        and lists they hold); ``files``: ``{"file:1/model.py": b"..."}``, with a config."""
        self._not_on_frame_loop("load()")
        self._require_started()
        if type(name) is not str:
            name = arg.model_name(name)
        text = arg.config_text(config)
        if files is not None and not isinstance(files, Mapping):
            raise InvalidArgumentError(f"files must be a mapping of paths to bytes, not "
                                       f"{type(files).__name__}")
        try:
            self.repo.load(name, config=text, files=files, api=True)
        except TritonpyError as exc:  # as Triton's, the server's log says so too
            self.log_failed_load(name, exc.message)
            raise

    def log_failed_load(self, name: str, why: str) -> None:
        """Log a failed load: as an error, unless a stop cut it short (no fault of the
        model's: :meth:`cancel_loads`)."""
        log.log(logging.INFO if self.loads_cancelled else logging.ERROR,
                "failed to load '%s': %s", name, why)

    def unload(self, name: str, unload_dependents: bool = False, wait: bool = True) -> None:
        """Unload a model (explicit mode); with ``unload_dependents`` an ensemble's step
        models go too, unless another loaded ensemble still runs them. The model takes no new
        request at once; those in flight or queued finish first, however long they take (as
        in Triton), and ``wait`` says whether to return only then (False: at once, as Triton's
        HTTP, gRPC and ``pb_utils.unload_model`` do; the model shows UNLOADING meanwhile)."""
        from ._ensemble_load import step_models_to_unload

        self._not_on_frame_loop("unload()")
        self._require_started()
        if type(name) is not str:
            name = arg.model_name(name)
        for what, flag in (("unload_dependents", unload_dependents), ("wait", wait)):
            if not isinstance(flag, (bool, int, np.bool_)):
                raise InvalidArgumentError(f"{what} must be a bool, not {type(flag).__name__}")
        steps = [step for key in self.repo.keys_of(name)
                 for step in step_models_to_unload(self.repo, key)] if unload_dependents else []
        self.repo.unload(name, api=True, wait=wait)
        for step in steps:
            self.repo.unload(step, api=True, wait=wait)

    def runtime(self, name: str, version: int = -1) -> ModelRuntime:
        """The loaded runtime of a model version (-1: the newest loaded)."""
        return self.repo.runtime(name, version)

    def statistics(self, name: str = "", version: str = "") -> dict:
        """Triton's ModelStatisticsResponse as JSON, for the versions loaded now: as in
        Triton, an unloaded version's statistics go with it (its next load starts at 0)."""
        self._require_started()
        runtimes = [rt for rt in self.repo.runtimes() if not name or rt.name == name]
        if name and self.model_namespacing:
            self.repo.find(name)  # two or more of that name: refused, in Triton's words
        # Triton's words and code (INVALID_ARG: HTTP 400), for the model, then the version.
        if name and not runtimes:
            raise InvalidArgumentError(f"requested model '{name}' is not available")
        if version:
            runtimes = [rt for rt in runtimes if str(rt.version) == str(version)]
            if name and not runtimes:
                raise InvalidArgumentError(
                    f"requested model version is not available for model '{name}'")
        return {"model_stats": [rt.stats.as_dict() for rt in runtimes]}

    def counters(self) -> list[dict]:
        """Per loaded model version, its Prometheus counters: the cumulative fields of its
        statistics (``inference_count``, ``execution_count``, ``inference_stats``) summed over
        the runtimes that served it since it was loaded. As in Triton, a reload that replaces
        the runtime restarts :meth:`statistics`, not these (see ``CounterCarry``)."""
        out = []
        for rt in self.repo.runtimes():
            counters = self.counter_carry.counters(rt.namespace, rt.name, rt.version)
            if counters is not None:  # None: unloaded since runtimes() was read
                out.append({"name": rt.name, "version": str(rt.version), **counters,
                            **self._namespace_of(rt.namespace)})
        return out

    def _namespace_of(self, namespace: str) -> dict[str, str]:
        """A model's namespace, with --model-namespacing (Triton's metrics then carry one)."""
        return {"namespace": namespace} if self.model_namespacing else {}

    def failures(self) -> list[dict]:
        """Per model version that was ever loaded, its failed requests by Triton's reason
        (``REJECTED``, ``CANCELED``, ``BACKEND``, ``OTHER``), summed over all its runtimes: as
        Triton's ``nv_inference_request_failure``, they outlive an unload and go on from their
        values at the next load."""
        return [{"name": name, "version": str(version), "reasons": reasons,
                 **self._namespace_of(namespace)}
                for namespace, name, version, reasons in self.counter_carry.failures()]

    def pending_requests(self) -> list[dict]:
        """Per loaded model version, the requests awaiting execution (Triton's
        ``nv_inference_pending_request_count``): queued, or sent behind a running execute."""
        out = []
        for rt in self.repo.runtimes():
            out.append({"name": rt.name, "version": str(rt.version), "count": rt.pending(),
                        **self._namespace_of(rt.namespace)})
        return out

    def shm_usage(self) -> list[dict]:
        """Usage of the host pool and of each stub's pool (named after its instance).

        Each stub reports its own (segments, mapped, used and peak bytes); one that does not
        answer within a moment (busy in C code holding its GIL, or dying) is described by its
        segments' sizes in the shm directory, with no ``used_bytes``.
        """
        out = [{"pool": "host", **self.pool.usage()}] if self.pool is not None else []
        if self.pool is None:
            return out
        reported: dict[str, dict] = {}
        for rt in self.repo.runtimes():
            for inst in rt.instances:
                stub = inst.stub
                if stub is None or not stub.alive:
                    continue
                try:
                    reply = stub.call(Cmd.USAGE, None, _USAGE_TIMEOUT_S)
                except TritonpyError:
                    continue
                reported[inst.name] = {k: int(reply[k]) for k in (
                    "segments", "mapped_bytes", "used_bytes", "peak_bytes") if k in reply}
        # Stub segments are named "<prefix><stub pid>x<token>_<n>" (shm.process_token).
        owners: dict[str, str] = {}
        for rt in self.repo.runtimes():
            for inst in rt.instances:
                stub = getattr(inst, "stub", None)
                if stub is not None:
                    owners[f"{self.options.shm_region_prefix_name}{stub.pid}x"] = inst.name
        directory = self.options.shm_fallback_directory or "/dev/shm"
        try:
            names = os.listdir(directory)
        except OSError:
            names = []
        pools = {inst: {"segments": 0, "mapped_bytes": 0} for inst in owners.values()}
        for name in names:
            owner = next((inst for start, inst in owners.items() if name.startswith(start)), None)
            if owner is None:
                continue
            try:
                size = os.stat(os.path.join(directory, name)).st_size
            except OSError:  # unlinked meanwhile
                continue
            pool = pools[owner]
            pool["segments"] += 1
            pool["mapped_bytes"] += size
        pools.update(reported)
        out.extend({"pool": inst, **usage} for inst, usage in sorted(pools.items()))
        return out

    def execution_env(self, rt: ModelRuntime) -> list[str] | None:
        return self.repo.execution_env(rt)

    # -- requests --------------------------------------------------------------------------------
    def validate(self, rt: ModelRuntime, req: HostRequest) -> None:
        self.check_signature(rt, req.inputs, req.requested, req.request_id)
        if rt.max_batch_size > 0 and req.inputs:
            req.batch_size = int(req.inputs[0][1].shape[0]) if req.inputs[0][1].ndim else 1

    @staticmethod
    def check_signature(rt: ModelRuntime, inputs: Sequence[tuple[str, Any]],
                        requested: Sequence[str], request_id: str) -> None:
        """Check each input's name, datatype and shape against the model (``inputs``: pairs of
        a name and anything with a numpy ``dtype`` and a ``shape``, data not needed)."""
        validator = rt.validator
        key = (tuple([(n, a.dtype, a.shape) for n, a in inputs]), tuple(requested))
        good = validator.known_good
        if key not in good:
            shapes = {}
            for n, a in inputs:
                if n in shapes:
                    raise input_twice(n)
                shapes[n] = (triton_dtype_of(a), tuple(a.shape))
            validator.validate(shapes, requested or None, request_id)
            if len(good) < 4096:
                good[key] = True

    def on_stub_frame(self, rt: ModelRuntime, inst: Any, stub: StubProcess, msg: list) -> None:
        cmd, call_id, body = msg
        if cmd == Cmd.BLS_INFER:
            self.bls.infer(rt, inst, stub, call_id, body)
        elif cmd == Cmd.BLS_CANCEL:
            self.bls.cancel(inst, call_id)
        elif cmd == Cmd.ACK:  # what a caller's model took of its decoupled BLS streams
            self.bls.taken(inst, body)
        elif cmd == Cmd.LOG:
            self._model_log(rt, inst, body)
        elif cmd == Cmd.METRIC_FAMILY:
            problem = self.custom_metrics.family(str(body["name"]), str(body["description"]),
                                                 int(body["kind"]), stub, int(body["id"]))
            stub.send(Cmd.REPLY, call_id, {"ok": True} if problem is None else {
                "ok": False, "error": InvalidArgumentError(problem).to_wire()})
        elif cmd == Cmd.METRIC_OP:
            fam, labels, op, value, buckets, family_id = body
            self.custom_metrics.op(fam, labels, op, value, buckets, stub, int(family_id))
        elif cmd == Cmd.METRIC_FAMILY_DELETE:
            self.custom_metrics.delete_family(stub, int(body[1]))
        elif cmd == Cmd.METRIC_VALUE:
            stub.send(Cmd.REPLY, call_id, {"ok": True,
                                           "value": self.custom_metrics.value(body[0], body[1])})
        elif cmd in (Cmd.LOAD_MODEL, Cmd.UNLOAD_MODEL, Cmd.MODEL_READY):
            threading.Thread(target=self._model_api, args=(stub, cmd, call_id, body),
                             daemon=True, name="tritonpy-model-api").start()
        elif cmd == Cmd.DROPPED:
            self.broadcast(Cmd.DROPPED, body, exclude=stub)
        elif cmd == Cmd.RECLAIM:  # a stub found /dev/shm full: everybody gives idle room back
            self._give_back_idle(force=True)
            self.broadcast(Cmd.RECLAIM, body, exclude=stub)

    def _model_api(self, stub: StubProcess, cmd: int, call_id: int, body: dict) -> None:
        try:
            name = _wire_text(body["name"])
            if cmd == Cmd.MODEL_READY:
                v = _wire_text(body.get("version") or "")
                try:
                    version = int(v) if v else -1
                except ValueError:
                    raise InvalidArgumentError(
                        f"is_model_ready: model_version must be a version number, got "
                        f"{v!r}") from None
                ready = self.repo.is_ready(name, version)
                reply: dict = {"ok": True, "ready": ready}
            else:
                if self.model_control_mode != "explicit":
                    raise UnavailableError(
                        "the model loading API needs explicit model control mode "
                        "(--model-control-mode=explicit)")
                if cmd == Cmd.LOAD_MODEL:
                    files = body.get("files") or None
                    if isinstance(files, dict):  # as Triton's: a key without file: is no file
                        files = {k: v for k, v in files.items()
                                 if isinstance(k, str) and k.startswith("file:")} or None
                    config = body.get("config") or None
                    self.repo.load(name, config=None if config is None else _wire_text(config),
                                   files=files, api=True)
                else:  # as Triton's: returns at once (a model may unload itself)
                    self.repo.unload(name, api=True, wait=False)
                reply = {"ok": True}
        except TritonpyError as exc:
            reply = {"ok": False, "error": exc.to_wire()}
        except Exception as exc:
            reply = {"ok": False, "error": {"code": "INTERNAL", "message": str(exc)}}
        if not reply["ok"]:  # a name read from bytes that are not UTF-8 may be in it
            error = reply["error"]
            error["message"] = error["message"].encode("utf-8", "backslashreplace").decode()
        try:
            stub.send(Cmd.REPLY, call_id, reply)
        except Exception:
            pass

    @staticmethod
    def _model_log(rt: ModelRuntime, inst: Any, body: list) -> None:
        """A model's log line (pb_utils.Logger, Python logging), tagged with its instance and,
        where the stub says, written as logged from the model's own file and line (as
        Triton's, ``model.py:12]``)."""
        level = _LOG_LEVELS.get(body[0], logging.INFO)
        logger = logging.getLogger(f"tritonpy.model.{rt.name}")
        if not logger.isEnabledFor(level):
            return
        if len(body) == 4 and type(body[2]) is str and type(body[3]) is int:
            logger.handle(logger.makeRecord(logger.name, level, body[2], body[3], "[%s] %s",
                                            (inst.name, body[1]), None))
        else:
            logger.log(level, "[%s] %s", inst.name, body[1])

    def on_instance_died(self, rt: ModelRuntime, inst: Any) -> None:
        if self._stopping:  # killed by the stop (or at exit): no restart to speak of
            return
        log.warning("model '%s' instance '%s' died; restarting", rt.name, inst.name)


#: The numpy dtypes that name a Triton type other than BYTES: an array of one of them is an
#: input as it is (what every frontend request sends).
_PLAIN_DTYPES = frozenset(dt for dt in map(np.dtype, TRITON_TO_NUMPY.values())
                          if dt.kind not in "OSU")


def _as_input(name: str, value: Any) -> np.ndarray:
    if type(value) is DeviceRef:  # in a client's CUDA shared memory: the stub maps it
        return value  # type: ignore[return-value]
    if not isinstance(value, np.ndarray) and hasattr(value, "__cuda_array_interface__"):
        # An embedder's CuPy array: the stub maps it by its CUDA IPC handle (a GPU model that
        # takes GPU inputs gets this very memory); kept alive until the stub lets go of it.
        if not value.nbytes:
            return np.empty(value.shape, np.dtype(value.dtype))
        try:
            return cuda.ref_of(value)  # type: ignore[return-value]
        except Exception as exc:
            raise InvalidArgumentError(f"input '{name}': cannot share its GPU memory: {exc}") \
                from None
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if hasattr(value, "to_numpy") and not isinstance(value, np.ndarray):
        arr = value.to_numpy()
    if arr.dtype.kind == "U":
        arr = arr.astype(object)
    try:
        triton_dtype_of(arr)
    except TypeError:
        raise InvalidArgumentError(
            f"input '{name}' has numpy dtype {arr.dtype}, which has no Triton data type") from None
    return arr


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_UINT64_MAX = (1 << 64) - 1
_SEQUENCE_FLAGS = 3  # START (1) | END (2): the only request flags Triton knows


def _uint64(what: str, value: Any, bounded: bool = True) -> int:
    """``value`` as an int in Triton's uint64 range (``bounded`` False: any int from 0),
    else InvalidArgumentError naming it."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgumentError(f"{what} must be an int, not {type(value).__name__}")
    number = value.__index__()
    if number < 0 or bounded and number > _UINT64_MAX:
        raise InvalidArgumentError(f"{what} must be in 0..2**64-1 (Triton's uint64), got {number}")
    return number


def _check_settings(request_id: Any, correlation_id: Any, flags: Any, timeout: Any,
                    priority: Any) -> tuple[int | str, int, int, int]:
    """A request's settings checked as Triton types them (the ID a str, the others uint64;
    a correlation ID a uint64 or a str), so that a model never sees a value Triton cannot
    send it; raises InvalidArgumentError naming the first that is wrong."""
    if not isinstance(request_id, str):
        raise InvalidArgumentError(f"request_id must be a str, not {type(request_id).__name__}")
    if not isinstance(correlation_id, str):
        correlation_id = _uint64("correlation_id (a str or an int)", correlation_id)
    flags = _uint64("flags", flags)
    if flags & ~_SEQUENCE_FLAGS:
        raise InvalidArgumentError(
            f"flags must combine SEQUENCE_START (1) and SEQUENCE_END (2) only, got {flags}")
    # A timeout past 64 bits is left to the channel, whose "cannot be encoded" answers it
    # (tests/host/test_huge_timeout.py).
    return (correlation_id, flags, _uint64("timeout (microseconds)", timeout, bounded=False),
            _uint64("priority", priority))


class Model:
    """A handle on one model (version -1: the newest loaded)."""

    def __init__(self, server: Server, name: str, version: int = -1) -> None:
        self.server = server
        self.name = name
        self.version = version

    def _rt(self) -> ModelRuntime:
        return self.server.repo.runtime(self.name, self.version)  # (Server.runtime's)

    def ready(self) -> bool:
        return self.server.repo.is_ready(self.name, self.version)

    def check(self, inputs: Mapping[str, Any], requested: Sequence[str] | None,
              request_id: str = "") -> None:
        """Validate a request from its inputs' datatypes and shapes alone (each value needs a
        numpy ``dtype`` and a ``shape``), before their data is decoded."""
        self.server.check_signature(self._rt(), list(inputs.items()), list(requested or ()),
                                    request_id)

    def config(self) -> dict:
        import json

        return json.loads(self._rt().config_json)

    def output_labels(self, output: str) -> list[str] | None:
        """The class labels of ``output`` (its ``label_filename``, a label per line: line i
        names class i), as read when the model loaded; None when it names no file."""
        return self._rt().output_labels.get(output)

    @property
    def max_batch_size(self) -> int:
        """The config's ``max_batch_size`` (0: the model does not batch)."""
        return self._rt().max_batch_size

    def metadata(self) -> dict:
        from .validation import model_metadata

        rt = self._rt()
        # As Triton: the metadata of a version names that version; of the model, every one.
        versions = [rt.version] if self.version >= 0 else self.server.repo.loaded_versions(rt.name)
        return model_metadata(rt.config, rt.name, versions)

    def decoupled(self) -> bool:
        return self._rt().decoupled

    def _request(self, stream: ResponseStream | AsyncResponseStream, inputs: Mapping[str, Any],
                 requested_output_names: Sequence[str] | None, request_id: str,
                 parameters: Mapping[str, Any] | None, correlation_id: int | str, flags: int,
                 timeout: int, priority: int, trace: Trace | None = None) -> HostRequest:
        server = self.server
        if not server._started:
            server._require_started()
        loop = server._loop
        if loop is not None and not loop.is_running():
            server._require_frame_loop()
        if type(inputs) is not dict and not isinstance(inputs, Mapping):
            raise InvalidArgumentError(
                f"inputs must be a mapping of input names to arrays, not {type(inputs).__name__}")
        # The usual values pass with a few type checks (every frontend request comes here).
        if not (type(request_id) is str and type(flags) is int and not flags & ~_SEQUENCE_FLAGS
                and type(timeout) is int and timeout >= 0
                and type(priority) is int and 0 <= priority <= _UINT64_MAX
                and (type(correlation_id) is str
                     or type(correlation_id) is int and 0 <= correlation_id <= _UINT64_MAX)):
            correlation_id, flags, timeout, priority = _check_settings(
                request_id, correlation_id, flags, timeout, priority)
        rt = self._rt()
        if rt.state != READY and rt.successor is None:  # reloaded: submit() forwards it
            raise UnavailableError(f"model '{self.name}' is not ready")
        if parameters and type(parameters) is not dict and not isinstance(parameters, Mapping):
            raise InvalidArgumentError("parameters must be a mapping of names to values, not "
                                       f"{type(parameters).__name__}")
        for k, v in parameters.items() if parameters else ():
            if not isinstance(k, str):
                raise InvalidArgumentError(f"parameter name {k!r} is not a str")
            if not isinstance(v, (bool, int, float, str)):
                raise InvalidArgumentError(
                    f"parameter '{k}' has type {type(v).__name__}; bool, int, float or str only")
            if type(v) is int and not _INT64_MIN <= v <= _INT64_MAX:
                raise InvalidArgumentError(f"parameter '{k}': {v} is out of the int64 range")
        if isinstance(requested_output_names, str):
            requested_output_names = [requested_output_names]
        arrays = []
        for n, v in inputs.items():  # (a plain array as it is, without a call: the usual input)
            arrays.append((n, v if type(v) is np.ndarray and v.dtype in _PLAIN_DTYPES
                           else _as_input(n, v)))
        req = HostRequest(rt, arrays, requested_output_names, stream._feed.sink,
                          request_id=request_id, correlation_id=correlation_id, flags=flags,
                          timeout_us=timeout, priority=priority, parameters=parameters)
        req.trace = trace
        self.server.validate(rt, req)
        # A decoupled model's stream is paced by its consumer, and cancelled once dropped.
        stream._start(req, self.server.timers if rt.decoupled else None)
        return req

    def infer(self, inputs: Mapping[str, Any],
              requested_output_names: Sequence[str] | None = None, *, request_id: str = "",
              parameters: Mapping[str, Any] | None = None, correlation_id: int | str = 0,
              flags: int = 0, timeout: int = 0, priority: int = 0) -> ResponseStream:
        """Run a request; iterate the result for its responses (one in default mode).

        A decoupled model's request is cancelled once the result is dropped before its end
        (the model sees ``is_cancelled()``), as :meth:`ResponseStream.cancel` would.

        Raises InvalidArgumentError / NotFoundError / UnavailableError for a request that
        cannot be queued; errors during execution come back as ``response.error``. On the
        event loop given as ``Server(loop=...)``, where its responses are read, it raises
        RuntimeError: use :meth:`async_infer` there.
        """
        self.server._not_on_frame_loop("model(...).infer() (use async_infer here)")
        stream = ResponseStream()
        req = self._request(stream, inputs, requested_output_names, request_id,
                            parameters, correlation_id, flags, timeout, priority)
        req.model.submit(req)
        return stream

    def async_infer(self, inputs: Mapping[str, Any],
                    requested_output_names: Sequence[str] | None = None, *,
                    request_id: str = "", parameters: Mapping[str, Any] | None = None,
                    correlation_id: int | str = 0, flags: int = 0, timeout: int = 0,
                    priority: int = 0, trace: Trace | None = None,
                    loop: asyncio.AbstractEventLoop | None = None) -> AsyncResponseStream:
        """Like :meth:`infer`, for asyncio: ``async for response in model.async_infer(...)``.
        ``trace``: record the request's timestamps in it (the frontends' tracing). ``loop``:
        the loop that will iterate the stream, when called from another thread. As with
        :meth:`infer`, dropping the result before its end cancels a decoupled model's request."""
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise RuntimeError(
                    "async_infer() needs the event loop that will iterate its responses: call "
                    "it on that loop, or pass loop=... from another thread (or use infer())"
                ) from None
        elif not isinstance(loop, asyncio.AbstractEventLoop):
            raise InvalidArgumentError(f"loop must be an asyncio event loop, not "
                                       f"{type(loop).__name__}")
        stream = AsyncResponseStream(loop)
        req = self._request(stream, inputs, requested_output_names, request_id,
                            parameters, correlation_id, flags, timeout, priority, trace)
        req.model.submit(req)
        return stream
