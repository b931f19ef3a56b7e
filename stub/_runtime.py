"""The stub process: loads ``model.py`` and runs its ``execute`` for the host.

Threads. No thread owns the socket: whichever needs a frame takes the *read role* (see
``_readrole``) and handles what it reads — an idle worker runs an EXECUTE inline, a model
thread blocked in ``exec()`` consumes its own reply — so the hot paths cost no hand-off between
threads; PING, USAGE and CANCEL are answered by whoever reads them. Two workers run sync
``execute`` and the lifecycle calls. An ``async def execute`` runs on an event loop (uvloop's
where installed) in its own thread, up to ``max_async`` at once per instance.

The runtime's parts are mixins, one per module (see ``_stubstate``); this module puts them
together and runs the worker threads.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import traceback

from tritonpy.shm import ChannelClosedError, Cmd
from tritonpy.shm.messages import PROTOCOL_VERSION

from . import pb_utils
from ._pberrors import _error_body
from ._lifecycle import _Lifecycle
from ._logforward import _LogForwarder, _forward_stdio_handlers
from ._readrole import _on_main_thread


# How long after a sync execute started a request sent behind it still waits for it (longer:
# it goes back to the host's queue, see _run_executes).
_PREFETCH_WAIT_S = 0.02


class StubRuntime(_Lifecycle):
    """One model instance's process."""

    # -- process main: the worker threads (the read role: see _readrole) ------------------------
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

    def _hand_back(self, msg: list) -> None:
        _, call_id, body = msg
        for rb in body.get("requests") or ():
            self.transport.discard(rb.get("inputs"), self.peer)
        self.channel.send(Cmd.EXECUTE_DONE, call_id, {"returned": True})

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
