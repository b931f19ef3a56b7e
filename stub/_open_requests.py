"""The requests a stub's model holds open, and the pacing of their response streams.

A request is open from its EXECUTE until it is answered, fails, or its final flag is sent. The
stub holds it weakly, so that one its model lets go of while still open (no final flag sent,
and none can be any more) is ended with an error saying so, instead of leaving its client
waiting for ever. A paced request (back-pressure from a slow consumer) keeps the sizes of what
its consumer has not taken yet.
"""
from __future__ import annotations

import sys
import traceback
import weakref
from typing import Any, Callable

from tritonpy.shm import ChannelClosedError, Cmd

from . import pb_utils
from ._pberrors import _error_body
from ._stubstate import _StubState


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


class _OpenRequests(_StubState):
    """The open requests of :class:`._runtime.StubRuntime` (a mixin: see ``_stubstate``)."""

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
