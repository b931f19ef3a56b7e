"""The state every part of a stub's runtime shares, made once per process: its shared-memory
pool and channel to the host, the locks and tables of its threads and of the requests its model
holds open, and what keeps them sound across a fork of the model's and when /dev/shm runs short.

The runtime is one object, :class:`tritonpy.stub._runtime.StubRuntime`, made of this class and
the mixins built on it, each in its own module, each on the one below:
``_open_requests`` (the requests the model holds, and pacing), ``_readrole`` (who reads the
socket, and the frames handled where they are read), ``_server_calls`` (BLS, model loading,
logging, metrics), ``_execute`` (the execute path, sync and async), ``_lifecycle`` (initialize,
auto-complete, readiness, finalize), ``_runtime`` (the worker threads). They read and write this
state on every request, under the same locks, so they stay methods of one instance (a mixin
costs nothing per call), not collaborator objects that would add an attribute hop to the hot
path.
"""
from __future__ import annotations

import collections
import itertools
import math
import os
import queue
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, cast

from tritonpy.shm.waiting import SpinPolicy, StallWatch
from tritonpy.shm import Channel, ChannelClosedError, Cmd, Pool, TensorTransport
from tritonpy.shm.pool import RECLAIM_EVERY_S

from ._pberrors import TritonModelException
from ._forked import ForkLink
from ._waiters import Pace, Waiter

if TYPE_CHECKING:  # asyncio is imported when a model needs it: a stub starts 20 ms sooner
    import asyncio

    from ._open_requests import _Open
    from ._runtime import StubRuntime


class _StubState:
    """What one model instance's process holds (see the module's doc); the base of
    :class:`._runtime.StubRuntime`, never made on its own."""

    def __init__(self, sock: Any, options: dict[str, Any]) -> None:
        self.options = options
        self.name = options.get("instance_name", "stub")
        self.pool = Pool(
            prefix=options.get("prefix", "tritonpy_"),
            default_size=int(options.get("shm_default_byte_size", 1 << 20)),
            growth_size=int(options.get("shm_growth_byte_size", 1 << 20)),
            cap=int(options.get("shm_cap", 0)),
            directory=options.get("shm_directory") or None,
            label=f"stub:{self.name}",
        )
        self.transport = TensorTransport(self.pool)
        # As Triton's FORCE_CPU_ONLY_INPUT_TENSORS (default "yes"): GPU inputs are copied to
        # the CPU before execute sees them, unless the model's config says "no".
        self.cpu_inputs = True
        self.channel = Channel(sock, self.transport, f"stub:{self.name}",
                               maintenance=self._maintain)
        self.pool.on_exhausted = self._reclaim
        self._reclaim_sent = 0.0
        # (cast: this state is always a StubRuntime's, whose BLS calls the link makes)
        self._fork_link = ForkLink(cast("StubRuntime", self))
        os.register_at_fork(before=self._before_fork, after_in_parent=self._after_fork_in_parent,
                            after_in_child=self._after_fork_in_child)
        self.peer = self.channel.peer
        # A plain lock (not the default RLock), taken a few times per request: ``with
        # self._mu`` (C level) where nobody is woken, the condition only to wait or notify.
        self._mu = threading.Lock()
        self._cv = threading.Condition(self._mu)
        self._reading = False
        self._in_model = 0
        self._model_touch = 0.0  # when a model thread last started a task or got a reply
        self._sync_waiting = 0  # threads inside _await(): they read the socket themselves
        self._stopping = False
        self._pending: collections.deque[list] = collections.deque()
        # Tasks for the main thread only (see _MAIN_THREAD_TASKS), read by the other worker.
        self._main_pending: collections.deque[list] = collections.deque()
        self._exec_busy = False  # a sync execute runs (see _run_executes)
        self._exec_start = 0.0  # ... since then
        self._exec_hold = False  # ... and waits on the server: later EXECUTEs go back
        self._exec_waiters = 0  # threads holding an EXECUTE until it is done
        self._exec_token = 0  # counts the sync executes taken (see _exec_over)
        self._exec_cv = threading.Condition(self._mu)
        self._calls: dict[int, Waiter] = {}
        self._call_ids = itertools.count(1)
        # Host id -> its open request, held weakly: a request the model lets go of while it is
        # still open (no final flag sent, and none can be any more) is ended by _end_dropped.
        self._active: dict[int, _Open] = {}
        # Host id -> the earlier runs of a rescheduled request whose response sender the model
        # took: a thread may still answer through one of them (as Triton's, one request across
        # its runs), so the request stays open while any of them lives. (One that went stays
        # listed until the request ends: it is passed over then.)
        self._earlier: dict[int, list[_Open]] = {}
        self._dropped_ids: queue.SimpleQueue[_Open] = queue.SimpleQueue()
        self._early_cancel: set[int] = set()  # CANCELs that came before their request
        # Paced requests (back-pressure, a body's ``pace``): what their consumers have not
        # taken yet. See send_response.
        self._pace: dict[int, Pace] = {}
        self._async_thread = 0  # the event loop thread of async execute (never made to wait)
        self._peeked = 0.0  # when send_response last looked for frames (see _peek)
        self.model: Any = None
        self.model_config: dict = {}
        self.decoupled = False
        self.reschedulable = False
        self.phase = "starting"  # starting | initialize | ready | finalize
        self._finalized = False  # finalize() returned
        # MetricFamily objects the cyclic garbage collector deleted: sent at the next safe
        # point, never from inside the collection (it may run in the middle of a send).
        self._metric_deletes: list[tuple[str, int]] = []
        self._async_loop: asyncio.AbstractEventLoop | None = None
        self._async_sem: asyncio.Semaphore | None = None
        self._side_loop: asyncio.AbstractEventLoop | None = None  # see _run_returned
        # The loop of ``async def execute`` must not block (every request of this instance
        # waits meanwhile): a stall is logged (loop-stall-seconds), checked by _maintain.
        self._stall_s = float(options.get("loop_stall_s", 0.0))
        self._async_watch: StallWatch | None = None
        self.max_async = 1
        self._forked = False  # True in a process the model forked
        # Sync BLS waits poll before sleeping (see _await), while their recent replies came
        # within twice the window; not on a single CPU, where the peer could not run meanwhile.
        self._bls_spin = SpinPolicy(float(options.get("bls_spin_us", 0.0)) / 1e6, within=2.0,
                                    longest=math.inf)
        # The idle worker polls for the next frame too (see _read_idle).
        self._idle_spin = SpinPolicy(float(options.get("idle_spin_us", 0.0)) / 1e6)

    def _before_fork(self) -> None:
        # SIGTERM is held back across the fork (see _after_fork_in_child).
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM,))
        self._fork_link.before()

    def _after_fork_in_parent(self) -> None:
        self._fork_link.in_parent()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM,))

    def _after_fork_in_child(self) -> None:
        """A process the model forked (e.g. a multiprocessing pool) shares this stub's socket
        but has none of its threads: a call or a response from it on that socket would wait
        for ever or garble the channel. Its BLS calls go through its own link to this stub
        (ForkLink); the other calls that need the server fail at once there. The child dies
        with this stub, as the stub dies with the host."""
        self._forked = True
        self._fork_link.in_child()
        # SIGTERM ends it again, as any process: a multiprocessing pool's terminate() (its
        # ``with`` block's end) ends its workers so. Inherited, the stub's handler dropped it,
        # and the pool waited for ever for a worker blocked on its queue. One sent since the
        # fork was held back (blocked in _before_fork), and now ends it: caught by the stub's
        # handler, or arriving before Python's own after-fork step (which forgets signals
        # caught so far), it would be lost.
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # not the main thread (a fork from another interpreter)
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM,))

        def refuse(*_: Any, **__: Any) -> None:
            self._refuse_forked()
        self.channel.send = refuse  # type: ignore[method-assign]
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def _refuse_forked(self) -> None:
        # Also before any shm allocation: the child's copy of the pool would hand out blocks
        # the stub itself hands out too.
        raise TritonModelException(
            "pb_utils calls that talk to the server other than BLS (the response sender, shm "
            "tensors, logging to the server, metrics, model loading) are not supported in a "
            "process forked by the model; make them in the stub process")

    def _maintain(self) -> None:
        if self._async_watch is not None:
            self._async_watch.check()
        self._give_back_idle(force=False)

    def _give_back_idle(self, force: bool = True) -> None:
        """Unlink this stub's segments idle for their idle time (``force``: every idle one,
        now), and tell the others to unmap them; stop using segments removed behind its back."""
        lost = self.pool.drop_lost()
        if lost:
            self.channel.send(Cmd.LOG, 0, [1, (  # (a WARNING in the host's log)
                f"shared-memory segments of this stub's pool were removed from "
                f"{self.pool.directory or '/dev/shm'} while in use: {', '.join(lost)}; new "
                "tensors go to new segments")])
        self.pool.reap(force)
        dropped = self.pool.take_dropped()
        if dropped:
            self.channel.send(Cmd.DROPPED, 0, dropped)

    def _reclaim(self, need: int) -> bool:
        """The pool's hook when /dev/shm has no room for a new segment of ``need`` bytes: give
        this stub's idle segments back and have the host ask every other process to do the
        same (their idle segments otherwise hold the room until their idle time, 5 s, runs
        out); the pool then waits a moment for it (this thread only)."""
        try:
            self._give_back_idle()
            now = time.monotonic()
            if now - self._reclaim_sent >= RECLAIM_EVERY_S:
                self._reclaim_sent = now
                self.channel.send(Cmd.RECLAIM, 0, need)
        except ChannelClosedError:
            return False
        return True
