"""The lifecycle of a :class:`~tritonpy.Server`: start and stop, abort, the loads a stop
cancels, the clean-up at the end (stubs killed, segments freed, also at interpreter exit), and
the guards that refuse a call before the start, after the stop or on the frame loop.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, TypeVar

from tritonpy.shm import Pool, SegmentMap, TensorTransport, janitor, sweep_orphans

from ._errors import UnavailableError, load_cancelled
from ._loop import FrameLoop
from ._model import ModelRuntime

if TYPE_CHECKING:
    from ._options import BackendOptions
    from ._repo_manager import RepositoryManager
    from ._timers import Timers
    from ._stubproc import StubProcess
    from ._trace import Tracing

log = logging.getLogger("tritonpy")

# Servers started and not stopped: a program that exits without stop() still leaves no stub
# and no segment behind (a SIGKILLed one relies on PDEATHSIG and its janitor, shm/janitor.py).
_LIVE: weakref.WeakSet[ServerLifecycle] = weakref.WeakSet()


@atexit.register
def _abandon_live_servers() -> None:
    for srv in list(_LIVE):
        try:
            srv._abandon()
        except Exception:  # best effort at interpreter exit
            log.exception("cleanup at exit failed")


_Self = TypeVar("_Self", bound="ServerLifecycle")


class ServerLifecycle:
    """Server's lifecycle, as a mixin of :class:`~tritonpy.Server`'s: its methods read and set
    most of the server's state (the started and stopping flags, the pool and segments, the
    repository, the frame loop and timers), which Server.__init__ sets up, and their callers
    (Model, the repository manager, the model runtimes, the frontends) call them on the server
    itself (``server._require_started()``, ``server.track_start(stub)``): an object of its own
    would reach back into all of that state."""

    # Server's state, set up in Server.__init__ (the pool, segments and frame loop: in _start).
    options: BackendOptions
    repo: RepositoryManager
    timers: Timers
    tracing: Tracing
    exit_timeout: float
    frames: FrameLoop
    pool: Pool
    transport: TensorTransport
    start_error: str | None
    cut_short: list[str]
    aborted: bool
    loads_cancelled: bool
    _loop: asyncio.AbstractEventLoop | None
    _started: bool
    _stopping: bool
    _draining: bool
    _in_start: bool
    _maint: threading.Thread | None
    _starting: set[StubProcess]
    _starting_lock: threading.Lock

    if TYPE_CHECKING:  # ServerStubs' (_server_stubs.py)
        def _maintain(self) -> None: ...

        def _reclaim(self, need: int) -> bool: ...

    def start(self: _Self, wait_until_ready: bool = True) -> _Self:
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

    def _start(self: _Self, wait_until_ready: bool) -> _Self:
        opts = self.options
        directory = opts.shm_fallback_directory or None
        opts.check_shm()
        removed = sweep_orphans(opts.shm_region_prefix_name, directory)
        if removed:
            log.info("removed %d orphaned shm segment(s) of dead processes", len(removed))
        self.segments = SegmentMap(directory)
        self.pool = Pool(prefix=opts.shm_region_prefix_name,
                         default_size=opts.shm_default_byte_size,
                         growth_size=opts.shm_growth_byte_size, cap=opts.shm_total_byte_cap,
                         directory=directory, segments=self.segments, label="host")
        # Should this process die without stop() (SIGKILL), the janitor removes the segments:
        # from the first one on (a large one may take seconds to reserve).
        self._janitor = janitor.start(opts.shm_region_prefix_name, directory)
        # Reserve the first segment now: a too-small /dev/shm fails here, at start, clearly.
        try:
            self.pool.free(*self.pool.allocate(1), 1)
        except BaseException:
            self.pool.close()
            janitor.stop(self._janitor)
            raise
        first = self.pool.usage()["mapped_bytes"]
        # Halved to fit the room left (Triton refuses to start there); not under a smaller cap.
        if first < min(self.pool.default_size, self.pool.cap or self.pool.default_size):
            log.warning("the first shared-memory segment is %d bytes, not shm-default-byte-size "
                        "%d: %s has too little room free", first, self.pool.default_size,
                        directory or "/dev/shm")
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
                log.error("%s: cut off in %s",
                          "stopped at once (abort() or a second signal)" if self.aborted
                          else "exit timeout expired", ", ".join(self.cut_short))
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
            self.aborted = True
            # As a stop cut short by its exit timeout: the versions it leaves unfinished.
            self.mark_cut_off(self.in_flight())
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
            if stub.abandoned:  # (by an earlier call: a stop calls it again)
                continue
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

    def __enter__(self: _Self) -> _Self:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def mark_cut_off(self, versions: list[tuple[str, int, int]]) -> None:
        """Count these model versions (as :meth:`in_flight` lists them) as cut off with
        requests in flight: the stop's log names them and ``tritonpy serve`` exits 1."""
        self.cut_short = list(dict.fromkeys(
            self.cut_short + [f"'{name}' version {version} (requests in flight)"
                              for name, version, _ in versions]))

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
