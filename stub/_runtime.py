"""The stub process: loads ``model.py`` and runs its ``execute`` for the host.

Threads. No thread owns the socket: whichever needs a frame takes the *read role* (see
``StubRuntime.run``) and handles what it reads — an idle worker runs an EXECUTE inline, a model
thread blocked in ``exec()`` consumes its own reply — so the hot paths cost no hand-off between
threads; PING, USAGE and CANCEL are answered by whoever reads them. Two workers run sync
``execute`` and the lifecycle calls. An ``async def execute`` runs on an event loop (uvloop's
where installed) in its own thread, up to ``max_async`` at once per instance.
"""
from __future__ import annotations

import collections
import contextvars
import inspect
import itertools
import math
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
import types
import weakref
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:  # asyncio is imported when a model needs it: a stub starts 20 ms sooner
    import asyncio

from tritonpy.shm.waiting import SpinPolicy, StallWatch, cpus_busy
from tritonpy.shm import INLINE_LIMIT, Channel, ChannelClosedError, Cmd, Pool, TensorTransport
from tritonpy.shm import cuda
from tritonpy.shm._errors import FdLimitError, ProtocolError, ShmError, ShmExhaustedError
from tritonpy.shm.channel import EMPTY, flush_trace
from tritonpy.shm.messages import PROTOCOL_VERSION
from tritonpy.shm.pool import RECLAIM_EVERY_S

from . import pb_utils
from ._pberrors import (
    TritonError,
    TritonModelException,
    count_mismatch,
    decoupled_returned,
    exception_text,
    execute_failed,
    not_a_list,
    not_a_response,
    unsendable,
)
from ._loader import import_model, model_search_path
from ._bls import AsyncResponseIterator, ResponseIterator, on_held, place
from ._forked import ForkLink
from ._logforward import _LogForwarder, _forward_stdio_handlers
from ._pbtensor import Tensor
from ._waiters import Pace, Waiter, first_item


_TAKEOVER_S = 0.02
# How long after a sync execute started a request sent behind it still waits for it (longer:
# it goes back to the host's queue, see _run_executes).
_PREFETCH_WAIT_S = 0.02
# The execute a BLS call is made from: the host id of its first request (0 outside execute).
# A context variable, so that it follows an async execute into the tasks it awaits.
_EXECUTE = contextvars.ContextVar("tritonpy_execute", default=0)
_IDLE_POLL_S = 0.05
# Tasks that only the stub's main thread runs (see StubRuntime._queue).
_MAIN_THREAD_TASKS = frozenset((Cmd.INITIALIZE, Cmd.AUTO_COMPLETE, Cmd.FINALIZE))


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


# A model streaming responses looks for frames from the host (ACK, CANCEL, RELEASE) this often
# at most (see StubRuntime._peek).
_PEEK_EVERY_S = 0.001


def _let_go(err: BaseException | None) -> None:
    """Free now what a failed execute's frames still hold: its arrays (GPU memory too) and its
    requests' input tensors (shared memory of the host). The exception's traceback keeps those
    frames and their locals, and the frame that caught it refers back to it: a cycle that only
    the cyclic garbage collector would break, whenever it next runs. The caller then drops its
    own reference (``del``), which ends the cycle.

    Called before the error is sent: the instance's next request may run on the stub's other
    thread as soon as this one has said the execute is over, and on a loaded machine this
    thread can lag; the next request would then find the memory still taken (seen on a GPU:
    all of it). The error's text needs only the frames' code and line numbers, which stay."""
    if err is not None:
        traceback.clear_frames(err.__traceback__)


class _Open(weakref.ref):  # type: ignore[type-arg]
    """An open request of the stub, held weakly (see StubRuntime._dropped)."""

    __slots__ = ("host_id", "request_id")

    def __init__(self, req: pb_utils.InferenceRequest, callback: Callable[[_Open], None]) -> None:
        # (weakref.ref.__new__ took both arguments already)
        self.host_id = req._host_id
        self.request_id = req._request_id


def dropped_unanswered(instance: str, request_id: str) -> str:
    """The error of a request its model let go of before sending the final flag."""
    which = f"request '{request_id}'" if request_id else "the request"
    return (f"model instance '{instance}' let go of {which} and its response sender without "
            "sending the final flag (pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL): no "
            "response can follow, so the request ends here")


class _SharedMemory:
    """``c_python_backend_utils.shared_memory``: this stub's shared memory."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def free_memory(self) -> int:
        """Bytes free in the segments this stub has mapped (as Triton's, in its region)."""
        usage = self._pool.usage()
        return usage["mapped_bytes"] - usage["used_bytes"]


def _c_utils(pool: Pool) -> types.ModuleType:
    """Triton's C++ module ``c_python_backend_utils``, which some models import beside
    pb_utils (Triton's QA restart model: ``c_utils.shared_memory.free_memory()``): pb_utils'
    names, and ``shared_memory``."""
    module = types.ModuleType("c_python_backend_utils")
    for name in pb_utils.__all__:
        setattr(module, name, getattr(pb_utils, name))
    module.shared_memory = _SharedMemory(pool)  # type: ignore[attr-defined]
    return module


async def _awaited(awaitable: Any) -> Any:
    """A coroutine of any awaitable (asyncio.run takes coroutines only)."""
    return await awaitable


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """The loop of ``async def execute``: uvloop's where it is installed (its scheduling costs
    a fraction of the default loop's on every await), else asyncio's own."""
    try:
        import uvloop
    except ImportError:  # e.g. a model's own EXECUTION_ENV_PATH interpreter without it
        import asyncio

        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class StubRuntime:
    """One model instance's process."""

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
        self._fork_link = ForkLink(self)
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

    # -- process main: the read role ------------------------------------------------------------
    # No thread owns the socket. A thread that needs a frame (an idle worker, or a model thread
    # waiting in exec()) takes the *read role* if nobody holds it, reads one frame and handles
    # it itself: an EXECUTE runs inline in the thread that read it, a BLS reply is consumed by
    # the thread that waits for it. So the hot paths cost no thread hand-off (each one costs
    # tens of microseconds in CPython). An idle worker leaves the role to model threads while
    # one of them waits for a reply, or has had one within _TAKEOVER_S (a loop of BLS calls
    # must not have its replies handed over by the worker); past that it takes the role, so
    # pings and cancels are read during long executes, and async calls' replies are read.
    def run(self) -> int:
        pb_utils._set_runtime(self)
        # Python logging in model.py: a record that finds no handler (the model configured
        # none) reaches the host log at its own level instead of stderr's WARNING-only default;
        # so does one that a handler writes to the stub's stderr or stdout (see
        # _forward_stdio_handlers).
        forwarder = _LogForwarder(self)
        logging.lastResort = forwarder
        _forward_stdio_handlers(forwarder)
        self.channel.send(Cmd.HELLO, 0, {"version": PROTOCOL_VERSION, "pid": os.getpid()})
        other = threading.Thread(target=self._worker, name="stub-worker", daemon=True)
        other.start()
        threading.Thread(target=self._end_dropped, name="stub-dropped", daemon=True).start()
        self._worker()
        self.channel.close()
        self.pool.close()
        return 0

    def _worker(self) -> None:
        main = _on_main_thread()
        while True:
            msg = self._next_task(main)
            if msg is None:
                return
            if self._handle_inline(msg):
                continue
            if msg[0] == Cmd.EXECUTE and self._async_loop is None:
                self._run_executes(msg)
            else:
                self._run_task(msg)

    # A sync model runs one execute at a time. The host may send an instance its next request
    # while a short execute runs (execute-prefetch-microseconds): its frame waits in the socket
    # and the thread that ran the execute reads it next, with no round trip to the host in
    # between. A thread that reads it while the execute still runs waits for that execute,
    # for at most _PREFETCH_WAIT_S after it started. A request goes back to the host (which
    # queues it again) if the execute runs longer, or waits on the server (a BLS call, model
    # loading): another instance may take it, and it may be what the execute waits for.
    def _run_executes(self, msg: list) -> None:
        with self._mu:
            if self._exec_busy and not self._exec_hold:
                self._exec_waiters += 1
                try:
                    while self._exec_busy and not self._exec_hold:
                        left = self._exec_start + _PREFETCH_WAIT_S - time.monotonic()
                        if left <= 0:
                            break
                        self._exec_cv.wait(left)
                finally:
                    self._exec_waiters -= 1
            back = self._exec_busy
            if not back:
                self._exec_busy = True
                self._exec_start = time.monotonic()
                self._exec_token += 1
                token = self._exec_token
        if back:
            self._hand_back(msg)
            return
        try:
            self._run_task(msg)
        finally:
            self._exec_over(token)

    def _exec_over(self, token: int) -> None:
        """Sync execute ``token`` is over (its model code returned): the next may run. Said
        before its EXECUTE_DONE goes, so that an EXECUTE the host sends once it has that frame
        (not a prefetched one) always finds the instance free: the thread finishing the last
        one may lag behind its frame (a loaded machine), and an EXECUTE that found it busy
        past _PREFETCH_WAIT_S went back to the host, which may give it to another instance
        (a warmup sample then ran on the instance already serving)."""
        with self._mu:
            if self._exec_busy and self._exec_token == token:
                self._exec_busy = self._exec_hold = False
                if self._exec_waiters:
                    self._exec_cv.notify()

    def _hold_executes(self) -> None:
        """The running execute (or a thread of the model) is about to wait on the server."""
        with self._mu:
            if self._exec_busy:
                self._exec_hold = True
                if self._exec_waiters:
                    self._exec_cv.notify_all()

    def _hand_back(self, msg: list) -> None:
        _, call_id, body = msg
        for rb in body.get("requests") or ():
            self.transport.discard(rb.get("inputs"), self.peer)
        self.channel.send(Cmd.EXECUTE_DONE, call_id, {"returned": True})

    def _next_task(self, main: bool = False) -> list | None:
        # The idle worker polls (a timed wait) rather than being notified after every frame:
        # a notify per frame would wake it, and make it fight for the GIL, on every request.
        cv = self._cv
        with cv:
            while True:
                if self._stopping:
                    return None
                if main and self._main_pending:
                    return self._main_pending.popleft()
                if self._pending:
                    return self._pending.popleft()
                if self._reading:
                    cv.wait(_IDLE_POLL_S)
                elif not self._sync_waiting and (
                        self._in_model == 0
                        or time.monotonic() - self._model_touch > _TAKEOVER_S):
                    self._reading = True
                    break
                else:
                    cv.wait(_TAKEOVER_S)
        msg = self._read_idle()
        return msg if msg is not None else self._next_task(main)

    def _read_idle(self) -> list | None:
        """The idle worker's read of the next frame (an execute, mostly): polled for first,
        as long as :class:`SpinPolicy` finds it worth it (idle-spin-microseconds), until the
        machine gets busy. Polls yield the CPU to any other runnable thread
        (``Channel._poll_into``). Not in a decoupled model, nor one with
        ``async def execute``: their model code runs in other threads of this stub while it
        waits, and the polls would contend with it for the interpreter."""
        policy = self._idle_spin
        if not policy.window or self.decoupled or self._async_loop is not None:
            return self._read_one()
        start = time.perf_counter()
        try:
            return self._read_one(policy.window if policy.worth() else 0.0, cpus_busy)
        finally:
            policy.waited(time.perf_counter() - start)

    def _read_one(self, spin_s: float = 0.0,
                  give_way: Callable[[], bool] | None = None) -> list | None:
        """Read one frame while holding the read role (released on return); ``spin_s``: poll
        the socket that long before sleeping in the kernel (see ``_await``, and
        ``Channel._poll_into`` for ``give_way``). None: the frame was a task for the main
        thread, handed to it (see :meth:`_queue`)."""
        try:
            while True:
                try:
                    msg = self.channel.recv(spin_s, give_way=give_way)
                except FdLimitError as exc:
                    self._frame_lost(exc)
                except Exception as exc:  # a malformed frame: report it, keep reading
                    sys.stderr.write(f"tritonpy stub {self.name}: bad frame from host: {exc}\n")
                    continue
                if msg is None:  # the host is gone; nothing here can be useful any more
                    flush_trace()
                    os._exit(0)
                if msg[0] in _MAIN_THREAD_TASKS and not _on_main_thread():
                    self._queue(msg)  # still holding the role: the main thread is not reading
                    return None
                return msg
        finally:
            self._reading = False  # a plain store: nobody sleeps waiting for exactly this

    def _queue(self, msg: list) -> None:
        """A task read by a thread that does not run it: for any worker, or for the main thread
        (initialize, auto_complete_config and finalize run there, as in Triton's stub, where
        Python lets a model call ``signal.signal()``; the other worker goes on reading the
        host's frames, its pings during a long initialize included). Called while holding the
        read role, so that the main thread, which looks for its tasks before it takes the role,
        is never left reading when one waits for it."""
        with self._cv:
            (self._main_pending if msg[0] in _MAIN_THREAD_TASKS else self._pending).append(msg)
            self._cv.notify_all()

    def _handle_inline(self, msg: list) -> bool:
        """Frames handled by whichever thread read them; False for tasks (execute etc.)."""
        cmd, call_id, body = msg
        if cmd == Cmd.REPLY or cmd == Cmd.BLS_RESPONSE:
            w = self._calls.get(call_id)
            if w is not None and w.deliver(body):
                self._calls.pop(call_id, None)
        elif cmd == Cmd.PING:
            self._reply(call_id, {"ok": True})
        elif cmd == Cmd.USAGE:
            usage = self.pool.usage()
            usage.pop("free_system_bytes", None)
            self._reply(call_id, {"ok": True, **usage})
        elif cmd == Cmd.CANCEL:
            for rid in body if type(body) is list else ():
                if type(rid) is not int:
                    continue
                held = self._active.get(rid)
                for earlier in self._earlier.get(rid, ()):
                    req = earlier()
                    if req is not None:
                        req._cancelled = True
                if held is not None:
                    req = held()
                    if req is not None:
                        req._cancelled = True
                else:
                    # Its EXECUTE may have been read by another thread that has not made the
                    # request yet: _make_requests applies the flag (bounded: stale ids expire).
                    if len(self._early_cancel) > 1024:
                        self._early_cancel.clear()
                    self._early_cancel.add(rid)
                    # A failed final send may open it again meanwhile (see _reopen).
                    held = self._active.get(rid)
                    req = held() if held is not None else None
                    if req is not None:
                        req._cancelled = True
                        self._early_cancel.discard(rid)
                self._unpace(rid)
        elif cmd == Cmd.ACK:
            for item in body if type(body) is list else ():
                if type(item) is list and len(item) == 2:
                    self._taken(*item)
        elif cmd == Cmd.HELD:  # the producer of a decoupled BLS stream waits for our model
            on_held(self, body)
        elif cmd == Cmd.DROPPED:
            pass  # the channel already unmapped them
        elif cmd == Cmd.RECLAIM:
            self._give_back_idle()
        else:
            return False
        return True

    def _dropped(self, held: _Open) -> None:
        """A request was freed: the model holds neither it nor its response sender any more.
        Still open, it is ended by _end_dropped. Called wherever the last reference went,
        maybe under a lock of ours: hands over, and does nothing else."""
        if self._active.get(held.host_id) is held:
            self._dropped_ids.put(held)

    def _end_dropped(self) -> None:
        """End each open request its model let go of, with an error saying so (after what it
        sent). Otherwise its client would wait for ever (as with Triton), and an unload until
        its exit timeout."""
        while True:
            gone = self._dropped_ids.get()
            if not self._still_dropped(gone):
                continue
            self._active.pop(gone.host_id, None)
            if self._pace:
                self._unpace(gone.host_id)
            # No response, only the flag and why: a default-mode request that had its response
            # sent (the host holds it for the flag) gets that response, the error is logged.
            body: dict[str, Any] = {
                "id": gone.host_id, "final": True, "empty": True, "error": _error_body(
                    "INTERNAL", dropped_unanswered(self.name, gone.request_id))}
            try:
                self.channel.send(Cmd.RESPONSE_SEND, 0, body)
            except ChannelClosedError:
                return
            except Exception:  # this request's end could not go: the others' still must
                sys.stderr.write(f"tritonpy stub {self.name}: ending a request let go of: "
                                 f"{traceback.format_exc(limit=2)}\n")

    def _still_dropped(self, gone: _Open) -> bool:
        """Whether the request of ``gone`` (freed) is open with nothing left to answer it. An
        earlier run of it that still lives (its sender held by a thread) takes its place."""
        rid = gone.host_id
        if self._active.get(rid) is not gone:
            return False
        earlier = self._earlier.get(rid)
        while earlier:
            held = earlier.pop()
            self._active[rid] = held  # then alive: its own end comes here; else the next one
            if held() is not None:
                return False
        self._earlier.pop(rid, None)
        return True

    def _close(self, rid: int) -> None:
        """The request is over (answered, failed, or its final flag sent): not open any more."""
        self._active.pop(rid, None)
        if self._earlier:
            self._earlier.pop(rid, None)

    def _unpace(self, rid: Any) -> None:
        """No more pacing for this request (cancelled, or its final response went)."""
        with self._mu:  # (against a sender about to wait: see _wait_for_consumer)
            p = self._pace.pop(rid, None)
            w = p.waiter if p is not None else None
        if w is not None:
            w.deliver({"final": True})

    def _taken(self, rid: Any, taken: Any) -> None:
        """The consumer of a paced request has taken ``taken`` of its responses so far."""
        if type(rid) is not int or type(taken) is not int:
            return
        p = self._pace.get(rid)
        if p is None:
            return
        if taken < 0:  # the host paces it no more
            self._unpace(rid)
            return
        with self._mu:
            sizes = p.sizes
            for _ in range(min(taken - p.acked, len(sizes))):
                p.unread -= sizes.popleft()
            p.acked = max(p.acked, taken)
            w = p.waiter
            if w is None or len(sizes) > p.max_count // 2 or p.unread > p.max_bytes // 2:
                return
            p.waiter = None
        w.deliver({"final": True})

    def _run_task(self, msg: list) -> None:
        cmd, call_id, body = msg
        cv = self._cv
        with self._mu:
            self._in_model += 1
            self._model_touch = time.monotonic()
        try:
            if cmd == Cmd.EXECUTE:
                self._on_execute(call_id, body)
            elif cmd == Cmd.INITIALIZE:
                self._reply(call_id, self._initialize(body))
            elif cmd == Cmd.AUTO_COMPLETE:
                self._reply(call_id, self._auto_complete(body))
            elif cmd == Cmd.IS_READY:
                self._reply(call_id, self._is_ready())
            elif cmd == Cmd.FINALIZE:
                self._reply(call_id, self._finalize())
                with cv:  # only after the reply is out: the main thread exits on this
                    self._stopping = True
                    cv.notify_all()
        except ChannelClosedError:
            pass  # the host is gone (the server stops): nobody is left to answer
        except BaseException:  # a bug here, or sys.exit(), must not kill the worker silently
            try:
                self._reply(call_id, {"ok": False, "error": _error_body(
                    "INTERNAL", f"stub {self.name}: {traceback.format_exc()}")})
            except ChannelClosedError:
                pass
        finally:
            with self._mu:
                self._in_model -= 1

    def _await(self, waiter: Waiter, spin: bool = False, take: bool = True) -> Any:
        """Wait for the next reply of a sync call, reading the socket ourselves if we can;
        ``spin``: poll first (see below); ``take``: False leaves it there (several threads may
        wait for the same waiter: see send_response) and returns None."""
        cv = self._cv
        with self._mu:
            self._sync_waiting += 1
        # Spinning: a thread that sleeps in recv() until the reply comes costs a wake-up of its
        # CPU, tens of microseconds on a virtual machine, on top of the peer's own. A sync BLS
        # call, one request and its reply, polls the socket for up to bls-spin-microseconds
        # first, as long as recent replies came within about twice that (the mean of the last
        # few waits): a slow target costs no spinning. Polls yield the CPU to other runnable
        # threads (Channel._poll_into), and stop while threads wait for a CPU (cpus_busy), as
        # idle polling does. Not the responses of a decoupled stream: its producer and the
        # host keep both CPUs busy, and polling there was measured slower.
        policy = self._bls_spin
        timed = spin and policy.window > 0
        spin_s = policy.window if timed and policy.worth() else 0.0
        start = time.perf_counter() if timed else 0.0
        try:
            while not waiter.items:
                with self._mu:
                    if waiter.items:
                        break
                    mine = not self._reading
                    if mine:
                        self._reading = True
                if not mine:
                    waiter.sig.acquire(timeout=0.05)  # the reader delivers; re-check the role
                    continue
                msg = self._read_one(spin_s, cpus_busy)
                if msg is not None and not self._handle_inline(msg):
                    self._queue(msg)
        finally:
            if timed:
                policy.waited(time.perf_counter() - start)
            with cv:
                self._sync_waiting -= 1
                self._model_touch = time.monotonic()
                if not self._sync_waiting and self._calls:
                    cv.notify()  # other calls still wait for replies: the worker reads now
        return waiter.items.popleft() if take else None

    def _maintain(self) -> None:
        if self._async_watch is not None:
            self._async_watch.check()
        self._give_back_idle(force=False)

    def _async_stalled(self, seconds: float, where: str | None) -> None:
        if where is None:
            self.log(1, f"the event loop of async def execute runs again, after {seconds:.1f} s")
        else:
            self.log(1, f"the event loop of async def execute has run nothing for {seconds:.0f} s: "
                        "something on it blocks instead of awaiting (a time.sleep, a blocking "
                        "call, a long computation: run those with asyncio.to_thread), and every "
                        f"request of this instance waits. Its thread is in:\n{where}")

    def _give_back_idle(self, force: bool = True) -> None:
        """Unlink this stub's segments idle for their idle time (``force``: every idle one,
        now), and tell the others to unmap them."""
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

    def _reply(self, call_id: int, body: dict) -> None:
        self.channel.send(Cmd.REPLY, call_id, body)

    # -- lifecycle --------------------------------------------------------------------------------
    def _load_module(self, body: dict) -> Any:
        """Import the model of an INITIALIZE or AUTO_COMPLETE frame (see
        ``tritonpy.repository.model_source``)."""
        sys.modules["triton_python_backend_utils"] = pb_utils
        sys.modules.setdefault("c_python_backend_utils", _c_utils(self.pool))
        model_file, version_dir = body["model_file"], body["version_dir"]
        self.version_dir = version_dir
        backend = body.get("backend_dir")
        if backend is not None:
            # A Python-based backend, as Triton 2.51 imports it (measured): its folder is
            # searched last, the model's folders not at all, and its model.py is the
            # top-level module "model".
            if backend not in sys.path:
                sys.path.append(backend)
            return import_model(model_file, None)
        # As Triton: the version directory's files and then the model directory's (beside
        # config.pbtxt, shared by the versions) import as plain modules, searched after the
        # standard library and site-packages (as Triton 2.51 appends them, measured: a csv.py
        # of the model's does not shadow the csv a library of it imports), and model.py is
        # the module "<version>.model" (its relative imports work).
        for folder in model_search_path(version_dir):
            if folder not in sys.path:
                sys.path.append(folder)
        module = import_model(model_file, os.path.basename(os.path.normpath(version_dir)))
        # ``import model`` (e.g. Triton's QA models' unittest.main("model")) finds this one.
        sys.modules.setdefault(module.__name__.rpartition(".")[2], module)
        return module

    def _initialize(self, body: dict) -> dict:
        self.phase = "initialize"
        try:
            import json

            module = self._load_module(body)
            self.model = module.TritonPythonModel()
            args = body["args"]
            self.model_config = json.loads(args["model_config"])
            self.decoupled = bool(body.get("decoupled"))
            # Only an iterative sequence batcher takes a request back for another execute.
            self.reschedulable = bool((self.model_config.get("sequence_batching") or {})
                                      .get("iterative_sequence"))
            force = ((self.model_config.get("parameters") or {})
                     .get("FORCE_CPU_ONLY_INPUT_TENSORS") or {}).get("string_value", "yes")
            self.cpu_inputs = str(force).strip().lower() not in ("no", "false", "off", "0")
            self.max_async = max(1, int(body.get("max_async", 1)))
            if hasattr(self.model, "initialize"):
                result = self.model.initialize(args)
                if inspect.isawaitable(result):
                    import asyncio

                    asyncio.run(_awaited(result))  # an async initialize is allowed by Triton
            is_async = inspect.iscoroutinefunction(getattr(self.model, "execute", None))
            if not hasattr(self.model, "execute"):
                raise AttributeError("TritonPythonModel has no execute() method")
            if is_async:
                self._start_async_loop()
        # As Triton writes it: "Type: message", then the model's frames; sys.exit() too.
        except BaseException as exc:  # noqa: B036
            return {"ok": False, "error": _error_body("INTERNAL", exception_text(exc))}
        finally:
            self.phase = "ready"
        return {"ok": True, "async": is_async, "has_is_ready": hasattr(self.model, "is_ready")}

    def _auto_complete(self, body: dict) -> dict:
        self.phase = "initialize"
        try:
            module = self._load_module(body)
            cls = module.TritonPythonModel
            cfg = pb_utils.ModelConfig(body["config"])
            fn = getattr(cls, "auto_complete_config", None)
            if fn is not None:
                cfg = fn(cfg)
            if not isinstance(cfg, pb_utils.ModelConfig):  # a forgotten ``return``: Triton's words
                return {"ok": False, "error": _error_body("INTERNAL", (
                    f"auto_complete_config function in model '{body['config'].get('name', '')}' "
                    "must return a valid pb.ModelConfig object."))}
            return {"ok": True, "config": cfg.as_dict()}
        except BaseException as exc:  # noqa: B036 (sys.exit() too, as in initialize)
            return {"ok": False, "error": _error_body("INTERNAL", exception_text(exc))}

    def _is_ready(self) -> dict:
        fn = getattr(self.model, "is_ready", None)
        if fn is None:
            return {"ok": True, "ready": True}
        try:
            return {"ok": True, "ready": bool(fn())}
        except Exception:
            return {"ok": True, "ready": False, "reason": traceback.format_exc(limit=3)}

    def _finalize(self) -> dict:
        self.phase = "finalize"
        try:
            fn = getattr(self.model, "finalize", None)
            if fn is not None:
                result = fn()
                if inspect.isawaitable(result):
                    import asyncio

                    asyncio.run(_awaited(result))
        except BaseException:  # noqa: B036 (sys.exit() too: the stub must still end at once)
            return {"ok": False, "error": _error_body("INTERNAL", traceback.format_exc())}
        finally:
            self.flush_metric_deletes()
            self._finalized = True
            if self._async_loop is not None:
                self._async_loop.call_soon_threadsafe(self._async_loop.stop)
        return {"ok": True}

    # -- execute ----------------------------------------------------------------------------------
    def _make_requests(self, body: dict) -> list[pb_utils.InferenceRequest]:
        out = []
        decode = self.transport.decode
        peer = self.peer
        wrap = Tensor._wrap
        received = pb_utils.InferenceRequest._received
        cpu_inputs = self.cpu_inputs
        try:
            for rb in body["requests"]:
                inputs = [wrap(*decode(w, peer)) for w in rb["inputs"]]
                if cpu_inputs:
                    for t in inputs:
                        if type(t._arr) is not np.ndarray and not t.is_cpu():
                            t._arr = cuda.to_host(t._arr)
                req = received(rb.get("model", ""), inputs, rb, self.decoupled)
                out.append(req)
                self._active[req._host_id] = _Open(req, self._dropped)
                pace = rb.get("pace")
                if type(pace) is list and len(pace) == 2 and all(type(n) is int for n in pace):
                    self._pace[req._host_id] = Pace(*pace)
                if self._early_cancel and req._host_id in self._early_cancel:
                    self._early_cancel.discard(req._host_id)
                    req._cancelled = True
        except BaseException:
            # The batch fails as a whole (the host answers each request with the error): the
            # requests made before the one that failed are not open any more.
            for req in out:
                self._active.pop(req._host_id, None)
                self._pace.pop(req._host_id, None)
            raise
        return out

    def _frame_lost(self, exc: BaseException) -> None:
        """A frame spilled into a segment this process has no descriptor left to map is lost,
        and whatever waits for it would wait for ever: the stub ends, saying why (the host
        then fails its requests with this line, and restarts it)."""
        sys.stderr.write(f"tritonpy stub {self.name}: a frame from the host could not be "
                         f"read: {exc}\n")
        sys.stderr.flush()
        os._exit(1)

    def _on_execute(self, call_id: int, body: dict) -> None:
        try:
            requests = self._make_requests(body)
        except ProtocolError:
            self.channel.send(Cmd.EXECUTE_DONE, call_id, {"error": _error_body(
                "INVALID_ARG", f"cannot decode requests: {traceback.format_exc(limit=2)}")})
            return
        except ShmError as exc:  # this process's limits (descriptors, address space)
            self.channel.send(Cmd.EXECUTE_DONE, call_id, {"error": _error_body(
                "UNAVAILABLE", f"cannot receive the requests' inputs: {exc}")})
            return
        except Exception:
            self.channel.send(Cmd.EXECUTE_DONE, call_id, {"error": _error_body(
                "INVALID_ARG", f"cannot decode requests: {traceback.format_exc(limit=2)}")})
            return
        if self._async_loop is not None:
            import asyncio

            asyncio.run_coroutine_threadsafe(self._execute_async(call_id, requests),
                                             self._async_loop)
            return
        token = _EXECUTE.set(requests[0]._host_id if requests else 0)
        try:
            result = self.model.execute(requests)
            if type(result) is not list and inspect.isawaitable(result):
                result = self._run_returned(result)
            err = None
        except BaseException as exc:  # sys.exit() too: the requests get it as their error
            result, err = None, exc
        finally:
            _EXECUTE.reset(token)
        _let_go(err)  # before _complete frees the instance for the next request (_exec_over)
        try:
            self._complete(call_id, requests, result, err)
        finally:
            del err  # the last reference: it goes now, not at the next cyclic collection

    def _run_returned(self, awaitable: Any) -> Any:
        """A coroutine that a plain ``def execute`` returned: run, as Triton does, on an event
        loop of its own thread (BLS ``async_exec`` needs one running). In default mode execute
        ends when it does, with what it returns; in decoupled mode it runs in the background
        (its responses go through the senders) and execute ends now."""
        with self._mu:  # executes of a decoupled model may run at once: one loop for them all
            if self._side_loop is None:
                loop = _new_event_loop()
                threading.Thread(target=loop.run_forever, name="stub-coroutines",
                                 daemon=True).start()
                self._side_loop = loop
        tag = _EXECUTE.get()

        async def run() -> Any:
            _EXECUTE.set(tag)  # this task's own context: BLS cycles are told by it
            return await awaitable

        import asyncio

        fut = asyncio.run_coroutine_threadsafe(run(), self._side_loop)
        if not self.decoupled:
            exc = fut.exception()  # waits; not fut.result(), whose frames would show
            if exc is not None:
                raise exc
            return fut.result()

        def done(f: Any) -> None:
            exc = f.exception()
            if exc is not None:
                sys.stderr.write(f"tritonpy stub {self.name}: the coroutine that execute "
                                 f"returned failed: {exception_text(exc)}\n")
            elif f.result() is not None:
                sys.stderr.write(f"tritonpy stub {self.name}: "
                                 f"{decoupled_returned(self.name)}\n")
        fut.add_done_callback(done)
        return None

    async def _execute_async(self, call_id: int, requests: list) -> None:
        assert self._async_sem is not None
        async with self._async_sem:
            _EXECUTE.set(requests[0]._host_id if requests else 0)  # this task's own context
            try:
                result = await self.model.execute(requests)
                err = None
            except BaseException as exc:  # also SystemExit, which would stop the stub's loop
                result, err = None, exc
        _let_go(err)
        try:
            self._complete(call_id, requests, result, err)
        finally:
            del err  # the last reference: it goes now, not at the next cyclic collection

    def _complete(self, call_id: int, requests: list, result: Any,
                  err: BaseException | None) -> None:
        """Send EXECUTE_DONE: one frame carrying every response of the batch (default mode)."""
        try:
            body = self._done_body(requests, result, err)
        except ShmExhaustedError as exc:
            # No room in /dev/shm for an output: UNAVAILABLE, as for an input that finds none
            # (a condition of the machine, not a fault of the model: no traceback).
            body = {"error": _error_body("UNAVAILABLE", execute_failed(self.name, str(exc)))}
        except Exception as exc:  # e.g. a response this stub cannot send
            sys.stderr.write(traceback.format_exc())
            body = self._failed(exception_text(exc))
        reschedule = [r._host_id for r in requests
                      if r._release_flags == pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE]
        refused: list[int] = []
        if reschedule and not self.reschedulable:
            # As Triton refuses the flag, in its words (it then leaves the client waiting for
            # ever; upstream's L0_iterative_sequence expects the error): the request ends.
            refused, reschedule = reschedule, []
            if "error" not in body:
                refusal = _error_body("INVALID_ARG", RESCHEDULE_REFUSED)
                body.setdefault("responses", []).extend(
                    {"id": rid, "final": True, "error": refusal} for rid in refused)
        if reschedule and "error" not in body:
            body["reschedule"] = reschedule
        elif reschedule:
            reschedule = []  # the execute failed: its requests get the error, not another run
        keep = "error" not in body
        decoupled = self.decoupled
        for r in requests:
            # A request answered through its sender stays cancellable (is_cancelled() sees
            # CANCEL) until the sender sends the final flag, which may happen in a thread after
            # execute returned (a decoupled request always may).
            rid = r._host_id
            if refused and rid in refused:
                r._answered = True  # its sender, if the model kept it, can send no more
            elif keep and rid not in reschedule and (
                    (r._taken or decoupled) and not r._answered):
                continue
            if rid in reschedule:
                held = self._active.pop(rid, None)
                if held is not None and r._taken and not r._answered:
                    self._earlier.setdefault(rid, []).append(held)
            else:
                self._close(rid)
            if self._pace:
                self._unpace(rid)
        if self._metric_deletes:
            self.flush_metric_deletes()
        self._exec_over(self._exec_token)  # a sync execute's: the one this thread runs
        unsent = self._send_responses(Cmd.EXECUTE_DONE, call_id, body)
        if unsent is not None:
            # Every request of the batch gets the reason instead of waiting for ever.
            sys.stderr.write(f"tritonpy stub {self.name}: {unsendable(unsent)}\n")
            for r in requests:
                self._close(r._host_id)
                if self._pace:
                    self._unpace(r._host_id)
            self.channel.send(Cmd.EXECUTE_DONE, call_id, self._failed(unsendable(unsent)))

    def _send_responses(self, cmd: Cmd, call_id: int, body: dict) -> Exception | None:
        """Send a frame of responses; None, or the error that kept it from being sent at all.

        A body msgpack refuses (a str with a lone surrogate in a name, message or parameter)
        or a spilled frame with no shared memory left for it is never sent: the handles made
        for its outputs are given back (their blocks would leak) and the error returned."""
        try:
            self.channel.send(cmd, call_id, body)
        except ChannelClosedError:
            raise
        except Exception as exc:
            self.peer.release(_own_handles(body))
            # Without its traceback: its frames lead back (f_back) to the caller's, which keeps
            # this error: a cycle that would hold the caller's requests until the cyclic
            # collector runs (a request let go of would not end).
            return exc.with_traceback(None)
        return None

    def _done_body(self, requests: list, result: Any, err: BaseException | None) -> dict:
        if err is not None:
            return self._failed(exception_text(err))
        if self.decoupled:
            if result is not None:
                return {**self._failed(decoupled_returned(self.name)), "unfinished_only": True}
            return {}
        returned_none = result is None
        if returned_none:
            # Each request answered (or will answer, from a thread) through its response sender.
            result = [None] * len(requests)
        elif not isinstance(result, (list, tuple)):
            return self._failed(not_a_list(result))
        if len(result) != len(requests):
            return self._failed(count_mismatch(len(requests), len(result)))
        resched = pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
        # A None entry (or a None return) is fine for a request that took its response sender:
        # as with Triton, its response may come from the sender before or after execute returns.
        missing = 0
        for req, resp in zip(requests, result):
            if req._release_flags == resched:
                if resp is not None:
                    # As Triton: a rescheduled request gets no response now (answering it and
                    # running it again would loop for ever). Triton's words, its spelling
                    # included: clients' tests look for them.
                    return self._failed(
                        "Expected a None object in the execute function return list for "
                        f"reschduled request, found type '{type(resp)}'.")
            elif resp is None and not req._taken:
                missing += 1
        responses = []
        for req, resp in zip(requests, result):
            taken = req._taken
            if req._release_flags == resched:
                continue
            if resp is None:
                if not taken:
                    what = ("returned None, but no response was sent" if returned_none else
                            "returned None in its list, and no response was sent,")
                    responses.append({"id": req._host_id, "error": _error_body(
                        "INTERNAL", f"execute() {what} for {missing} of {len(requests)} "
                        f"request(s) of model '{self.name}'; return a list of "
                        "InferenceResponse or use the response sender")})
                continue
            if taken and req._answered:
                # Answered through the sender already: as with Triton, the returned response
                # has nobody to go to.
                sys.stderr.write(f"tritonpy stub {self.name}: execute returned a response for a "
                                 "request already answered through its response sender; "
                                 "dropped\n")
                continue
            if taken and req._sent:
                req._answered = True  # the host answers with the response the sender sent
                responses.append({"id": req._host_id, "error": _error_body(
                    "INTERNAL", "a response was already sent for this request through its "
                    "response sender; execute() must return None for it")})
                continue
            if not isinstance(resp, pb_utils.InferenceResponse):
                # Only this request fails (Triton fails the whole batch).
                responses.append({"id": req._host_id, "error": _error_body(
                    "INTERNAL", execute_failed(self.name, not_a_response(resp)))})
                continue
            if taken:
                req._answered = True  # its one response is this one
            responses.append(self._response_body(req, resp, True))
        return {"responses": responses}

    def _failed(self, message: str) -> dict:
        """The body of an execute that failed as a whole."""
        return {"error": _error_body("INTERNAL", execute_failed(self.name, message))}

    def _response_body(self, req: pb_utils.InferenceRequest,
                       resp: pb_utils.InferenceResponse | None, final: bool) -> dict:
        body: dict[str, Any] = {"id": req._host_id, "final": final}
        if resp is None:
            body["empty"] = True
            return body
        if resp._err is not None:
            # As Triton: a response that carries an error carries no tensors (its parameters
            # still go).
            body["error"] = resp._err._to_wire()
            body["outputs"] = []
        else:
            wanted = req._requested_output_names
            gpu_ok = req._gpu_ok
            body["outputs"] = self.transport.encode_many(
                [(t._name, t._arr if gpu_ok or type(t._arr) is np.ndarray or t.is_cpu()
                  else self._host_copy(t._arr))
                 for t in resp._output_tensors if not wanted or t._name in wanted], self.peer)
        if resp._parameters:
            body["parameters"] = resp._parameters
        return body

    def _host_copy(self, arr: Any) -> np.ndarray:
        """A GPU output copied to the CPU for a reader there: straight into shared memory
        when it will travel by handle."""
        if arr.nbytes <= INLINE_LIMIT:
            return cuda.to_host(arr)
        return cuda.to_host(arr, self.pool.new_array(arr.dtype, tuple(arr.shape)))

    def send_response(self, req: pb_utils.InferenceRequest,
                      resp: pb_utils.InferenceResponse | None, final: bool) -> None:
        if self._forked:
            self._refuse_forked()
        now = time.monotonic()
        if now - self._peeked > _PEEK_EVERY_S:
            self._peeked = now
            self._peek()
        p = self._pace.get(req._host_id) if self._pace else None
        if p is not None:
            # Back-pressure: once the consumer (a client reading its stream slowly) has not
            # taken max_bytes or max_count of the responses sent, the send waits until it took
            # half of them. Not on the event loop of async execute, where every other request
            # of the instance would wait too: those streams keep the host's bound only (see
            # AsyncResponseStream).
            if threading.get_ident() != self._async_thread:
                self._wait_for_consumer(req, p)
            nbytes = 0
            for t in resp._output_tensors if resp is not None else ():
                nbytes += t._arr.nbytes
            with self._mu:
                p.sizes.append(nbytes)
                p.unread += nbytes
        try:
            exc = self._send_responses(Cmd.RESPONSE_SEND, 0,
                                       self._response_body(req, resp, final))
        except ChannelClosedError:
            raise
        except BaseException:  # its body could not be built (a BYTES element, no shm left)
            if final:
                self._reopen(req)
            raise
        if exc is not None:  # nothing went: the model may send another response instead
            if final:
                self._reopen(req)
            raise TritonModelException(f"Unable to send response. {unsendable(exc)}") from None
        if final:
            self._close(req._host_id)
            self._unpace(req._host_id)

    def _reopen(self, req: pb_utils.InferenceRequest) -> None:
        """A final send that failed: nothing went, and the request is still open. An execute
        that returned meanwhile took it for ended (its sender looked closed), and a CANCEL
        that came since found no request: open it again, with that CANCEL."""
        rid = req._host_id
        if rid in self._active:
            return
        self._active[rid] = _Open(req, self._dropped)
        # After the line above: the CANCEL handler adds to _early_cancel, then looks in
        # _active, so one of the two sees the other.
        if rid in self._early_cancel:
            self._early_cancel.discard(rid)
            req._cancelled = True

    def _wait_for_consumer(self, req: pb_utils.InferenceRequest, p: Pace) -> None:
        while True:
            with self._mu:
                if req._cancelled or self._pace.get(req._host_id) is not p or (
                        len(p.sizes) < p.max_count and p.unread < p.max_bytes):
                    return
                w = p.waiter
                first = w is None
                if first:
                    w = p.waiter = Waiter()
            assert w is not None
            if first:  # the host acknowledges what is taken from now on, in eighths
                self.channel.send(Cmd.HELD, 0, [req._host_id])
            self._hold_executes()
            self._await(w, take=False)

    def _peek(self) -> None:
        """Handle what the host sent meanwhile, without waiting, if no thread reads the
        socket. A model that streams from its execute reads nothing, and the idle worker takes
        the read role only _TAKEOVER_S later: an ACK (or CANCEL, or a release, which frees the
        block for the next response) would come that late. Not while a thread waits in
        _await: that one reads, and would find the role taken and sleep a while."""
        with self._mu:
            if self._reading or self._sync_waiting:
                return
            self._reading = True
        try:
            while True:
                try:
                    msg = self.channel.recv(wait=False)
                except FdLimitError as exc:
                    self._frame_lost(exc)
                except Exception as exc:  # a malformed frame: report it, keep reading
                    sys.stderr.write(f"tritonpy stub {self.name}: bad frame from host: {exc}\n")
                    continue
                if msg is None or msg is EMPTY:
                    return
                if not self._handle_inline(msg):
                    self._queue(msg)
        finally:
            with self._cv:  # an idle worker that found the role taken polls; it reads now
                self._reading = False
                self._cv.notify()

    def new_shm_array(self, dtype: Any, shape: tuple[int, ...]) -> Any:
        if self._forked:
            self._refuse_forked()
        return self.pool.new_array(dtype, shape)

    def _start_async_loop(self) -> None:
        loop = _new_event_loop()
        started = threading.Event()

        def run() -> None:
            self._async_thread = threading.get_ident()
            import asyncio

            asyncio.set_event_loop(loop)
            self._async_sem = asyncio.Semaphore(self.max_async)
            started.set()
            loop.run_forever()

        threading.Thread(target=run, name="stub-async", daemon=True).start()
        started.wait()
        self._async_watch = StallWatch(loop, self._stall_s, self._async_stalled,
                                       self._async_thread)
        self._async_loop = loop

    # -- calls to the host: BLS, model loading, metrics ---------------------------------------
    def _bls_body(self, req: pb_utils.InferenceRequest, decoupled: bool) -> dict:
        if self._forked:
            self._refuse_forked()
        if self.phase != "ready":
            raise TritonModelException(
                "BLS is only supported during the 'execute' function. "
                f"(this call came from {self.phase}())"
            )
        if not req._model_name:
            raise TritonModelException("BLS InferenceRequest needs a model_name")
        inputs = self.transport.encode_many([(t._name, t._arr, t) for t in req._inputs], self.peer)
        body: dict[str, Any] = {
            "request": {
                "model": req._model_name,
                "version": req._model_version,
                "request_id": req._request_id,
                "correlation_id": req._correlation_id,
                "flags": req._flags,
                "timeout": req._timeout,
                "parameters": req._parameters,
                "inputs": inputs,
                "outputs": req._requested_output_names,
            },
            "decoupled": decoupled,
            "exec": _EXECUTE.get(),
        }
        memory = req._preferred_memory
        if memory is not None:
            body["request"]["preferred_memory"] = [memory.preferred_memory_type,
                                                   memory.preferred_device_id]
        trace = req._trace.triton_trace
        if trace:  # InferenceRequest(..., trace=request.trace()) of a traced request
            body["request"]["trace"] = trace
        return body

    def _call(self, cmd: Cmd, body: Any, waiter: Waiter) -> int:
        if self._exec_busy and cmd in _WAITS_ON_SERVER:
            self._hold_executes()
        call_id = next(self._call_ids)
        self._calls[call_id] = waiter
        try:
            self.channel.send(cmd, call_id, body)
        except Exception as exc:
            self._calls.pop(call_id, None)
            if isinstance(exc, ChannelClosedError):
                raise
            # Never sent (e.g. a request id with a lone surrogate): the handles made for its
            # inputs are given back, and the model told why.
            request = body.get("request") if type(body) is dict else None
            if type(request) is dict:
                self.peer.release(_own_handles(request, "inputs"))
            raise TritonModelException(unsendable(exc, "request")) from None
        if waiter.loop is not None and not self._reading:
            with self._cv:  # an async caller cannot read: make sure an idle worker does
                self._cv.notify()
        return call_id

    def bls_exec(self, req: pb_utils.InferenceRequest, decoupled: bool) -> Any:
        if self._forked:  # made by the stub for this child (see ForkLink)
            return self._fork_link.exec(req, decoupled)
        body = self._bls_body(req, decoupled)
        if decoupled:
            waiter = Waiter()
            call_id = self._call(Cmd.BLS_INFER, body, waiter)
            return ResponseIterator(self, call_id, waiter, req._preferred_memory)
        waiter = Waiter()
        self._call(Cmd.BLS_INFER, body, waiter)
        reply = self._await(waiter, spin=True)
        return self._to_response(reply, req._preferred_memory)

    async def bls_async_exec(self, req: pb_utils.InferenceRequest, decoupled: bool) -> Any:
        import asyncio

        loop = asyncio.get_running_loop()
        if self._forked:
            return await loop.run_in_executor(None, self._fork_link.exec, req, decoupled)
        body = self._bls_body(req, decoupled)
        waiter = Waiter(stream=decoupled, loop=loop)
        if not decoupled:
            waiter.drop = self.drop_reply
        call_id = self._call(Cmd.BLS_INFER, body, waiter)
        if decoupled:
            # As Triton: resolved once the first response is in, so that the documented plain
            # ``for`` over the result does not block the event loop waiting for it.
            try:
                await first_item(waiter)
            except BaseException:  # cancelled: nobody will read this stream
                waiter.abandon(self.drop_reply)
                raise
            return AsyncResponseIterator(self, call_id, waiter, req._preferred_memory)
        fut = waiter.future
        assert fut is not None
        try:
            body = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # the reply came just before the cancel
                self.drop_reply(fut.result())
            raise
        return self._to_response(body, req._preferred_memory)

    def drop_reply(self, body: Any) -> None:
        """A BLS reply nobody will read: its tensors' blocks go back undecoded."""
        if isinstance(body, dict):
            self.transport.discard(body.get("outputs"), self.peer)

    def _to_response(self, body: dict,
                     memory: pb_utils.PreferredMemory | None = None) -> pb_utils.InferenceResponse:
        err = body.get("error")
        decode, peer, wrap = self.transport.decode, self.peer, Tensor._wrap
        outputs = [wrap(*decode(w, peer)) for w in body.get("outputs") or ()]
        if memory is not None:
            place(outputs, memory)
        return pb_utils.InferenceResponse(
            outputs, TritonError._from_wire(err) if err else None, body.get("parameters") or {})

    def cancel_call(self, call_id: int) -> None:
        self.channel.send(Cmd.BLS_CANCEL, call_id, None)

    def model_call(self, what: str, name: str, **kw: Any) -> Any:
        cmd = {"load": Cmd.LOAD_MODEL, "unload": Cmd.UNLOAD_MODEL, "ready": Cmd.MODEL_READY}[what]
        if self.phase == "finalize":
            raise TritonModelException("the model loading API cannot be used in finalize()")
        body = {"name": name, **kw}
        for key, value in body.items():
            if type(value) is str and not value.isascii():
                body[key] = _wire_text(value)
        return self._call_ok(cmd, body).get("ready", True)

    def _call_ok(self, cmd: Cmd, body: Any) -> dict:
        """A call to the host and its reply; TritonModelException with the host's message
        when the reply is not ok."""
        waiter = Waiter()
        self._call(cmd, body, waiter)
        reply = self._await(waiter)
        if not reply.get("ok"):
            raise TritonModelException(str((reply.get("error") or {}).get("message", reply)))
        return reply

    def log(self, level: int, message: str, where: tuple[str, int] | None = None) -> None:
        """A line for the host's log; ``where``: the model's file and line that logged it."""
        self.channel.send(Cmd.LOG, 0, [level, message, *where] if where else [level, message])

    def metric_family(self, name: str, description: str, kind: int, family_id: int) -> None:
        # A call, not a notice: a family of that name but another kind is refused (as Triton).
        if self._metric_deletes:  # a deletion of the same name goes first
            self.flush_metric_deletes()
        self._call_ok(Cmd.METRIC_FAMILY, {"name": name, "description": description, "kind": kind,
                                          "id": family_id})

    def metric_family_delete(self, name: str, family_id: int, collecting: bool) -> None:
        """The model deleted a MetricFamily object (from its ``__del__``). Not once
        ``finalize`` returned: what the interpreter's exit collects was not deleted by the
        model, and its series stay, as they do on Triton. One the cyclic collector deleted
        (``collecting``) waits for the next safe point: the collection may have started at
        any allocation, a send of this very thread included."""
        if self._finalized:
            return
        self._metric_deletes.append((name, family_id))
        if not collecting:
            self.flush_metric_deletes()

    def flush_metric_deletes(self) -> None:
        """Send the deletions that wait (before anything else about metrics, and before an
        execute's responses: a client that reads the metrics after them sees them gone)."""
        deletes = self._metric_deletes
        while deletes:
            try:
                name, family_id = deletes.pop(0)
            except IndexError:  # another thread took the last one
                return
            self.channel.send(Cmd.METRIC_FAMILY_DELETE, 0, [name, family_id])

    def metric_op(self, family: str, labels: dict, op: str, value: float,
                  buckets: list | None, family_id: int = 0) -> None:
        if self._metric_deletes:
            self.flush_metric_deletes()
        self.channel.send(Cmd.METRIC_OP, 0, [family, labels, op, value, buckets, family_id])

    def metric_value(self, family: str, labels: dict) -> float:
        if self._metric_deletes:
            self.flush_metric_deletes()
        waiter = Waiter()
        self._call(Cmd.METRIC_VALUE, [family, labels], waiter)
        return float(self._await(waiter).get("value", 0.0))


# Calls whose answer may need another execute of this model to run first.
_WAITS_ON_SERVER = frozenset((Cmd.BLS_INFER, Cmd.LOAD_MODEL, Cmd.UNLOAD_MODEL))


def _wire_text(text: str) -> str | bytes:
    """A name, version or config of the model loading API as its frame carries it: one that
    pb_utils read from bytes that are not UTF-8 (a lone surrogate for each byte it could not
    read) as those bytes, which the host reads back the same; msgpack carries no lone
    surrogate. Another lone surrogate stays: the call then says why it cannot be sent."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            pass
    return text


def _own_handles(body: dict, key: str = "outputs") -> list[int]:
    """The export ids of the shm (or GPU) handles among a body's tensors (a response's
    outputs, every response's of an EXECUTE_DONE, or a BLS request's inputs)."""
    ids = []
    for resp in body.get("responses", (body,)):
        for w in resp.get(key) or ():
            data = w[3]
            if type(data) is list and len(data) >= 4:
                ids.append(data[3])
    return ids


#: Triton's words for a request released with RESCHEDULE by a model whose scheduler is not an
#: iterative sequence batcher.
RESCHEDULE_REFUSED = ("Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE while "
                      "the model is not configured to handle such a flag.")


def _error_body(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}
