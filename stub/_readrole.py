"""Who reads the stub's socket, and the frames handled by whichever thread reads them.

No thread owns the socket. A thread that needs a frame (an idle worker, or a model thread
waiting in exec()) takes the *read role* if nobody holds it, reads one frame and handles
it itself: an EXECUTE runs inline in the thread that read it, a BLS reply is consumed by
the thread that waits for it. So the hot paths cost no thread hand-off (each one costs
tens of microseconds in CPython). An idle worker leaves the role to model threads while
one of them waits for a reply, or has had one within _TAKEOVER_S (a loop of BLS calls
must not have its replies handed over by the worker); past that it takes the role, so
pings and cancels are read during long executes, and async calls' replies are read.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable

from tritonpy.shm.waiting import cpus_busy
from tritonpy.shm import Cmd
from tritonpy.shm._errors import FdLimitError
from tritonpy.shm.channel import EMPTY, flush_trace

from ._bls import on_held
from ._open_requests import _OpenRequests
from ._waiters import Waiter


_TAKEOVER_S = 0.02
_IDLE_POLL_S = 0.05
# Tasks that only the stub's main thread runs (see StubRuntime._queue).
_MAIN_THREAD_TASKS = frozenset((Cmd.INITIALIZE, Cmd.AUTO_COMPLETE, Cmd.FINALIZE))


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _ReadRole(_OpenRequests):
    """The read role of :class:`._runtime.StubRuntime` (a mixin: see ``_stubstate``), and the
    gate of its sync executes (``_exec_over``, ``_hold_executes``: see
    ``StubRuntime._run_executes``), which the execute path and the calls that wait on the
    server use."""

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
        as long as :class:`~tritonpy.shm.waiting.SpinPolicy` finds it worth it
        (idle-spin-microseconds), until the machine gets busy. Polls yield the CPU to any
        other runnable thread (``Channel._poll_into``). Not in a decoupled model, nor one with
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

    def _frame_lost(self, exc: BaseException) -> None:
        """A frame spilled into a segment this process has no descriptor left to map is lost,
        and whatever waits for it would wait for ever: the stub ends, saying why (the host
        then fails its requests with this line, and restarts it)."""
        sys.stderr.write(f"tritonpy stub {self.name}: a frame from the host could not be "
                         f"read: {exc}\n")
        sys.stderr.flush()
        os._exit(1)

    def _reply(self, call_id: int, body: dict) -> None:
        self.channel.send(Cmd.REPLY, call_id, body)
