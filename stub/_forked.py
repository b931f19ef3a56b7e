"""BLS from a process the model forked: a ``multiprocessing`` pool's worker, or ``os.fork()``
(as Triton's QA ``test_multiprocess``, which Triton 2.51 passes).

Such a child has a copy of the stub's memory and none of its threads. It must not use the
stub's channel (the replies would reach the stub, which reads that socket) nor allocate from
its copy of the pool (it would hand out blocks the stub hands out too). So each fork gets a
private socket pair, made just before it (``os.register_at_fork``). The child sends a BLS
request over it, its tensors copied (pickled); a thread of the stub, started for that child,
makes the call as the forking ``execute`` would (in its context, so that the host tells BLS
cycles apart the same way) and sends the responses back, copied too. Each call waits for its
answer whole: a decoupled call's responses are all collected before ``exec`` returns, and the
calls of one child go one at a time. The thread ends once the child has closed its end (it
exited, or exec'd another program: the socket is close-on-exec).

Only BLS crosses: the rest of pb_utils that talks to the server (the response sender, shm
tensors, logging to the server, metrics, model loading) is refused in the child.
"""
from __future__ import annotations

import contextvars
import socket
import sys
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from tritonpy.shm import cuda

from . import pb_utils
from ._pberrors import TritonError, TritonModelException
from ._pbtensor import Tensor

if TYPE_CHECKING:
    from ._runtime import StubRuntime


class ForkLink:
    """The BLS link of one stub with the processes its model forks (see the module's doc)."""

    def __init__(self, rt: StubRuntime) -> None:
        self.rt = rt
        # The pair of the fork under way, per forking thread (two threads may fork at once).
        self._forking = threading.local()
        self._conn: Connection | None = None  # in a child: its end
        self._lock = threading.Lock()

    # -- at fork (os.register_at_fork) -----------------------------------------------------------
    def before(self) -> None:
        try:
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError:  # no descriptor left: a BLS call in that child says so
            self._forking.pair = None
            return
        self._forking.pair = (a, b, contextvars.copy_context())

    def in_parent(self) -> None:
        pair, self._forking.pair = getattr(self._forking, "pair", None), None
        if pair is None:
            return
        ours, theirs, context = pair
        theirs.close()
        try:
            threading.Thread(target=context.run, args=(self._serve, ours),
                             name="stub-forked-bls", daemon=True).start()
        except RuntimeError:  # no thread to be had: the child's calls find the link closed
            ours.close()

    def in_child(self) -> None:
        pair, self._forking.pair = getattr(self._forking, "pair", None), None
        self._lock = threading.Lock()  # the parent's may have been held by another thread
        if pair is None:
            return
        stubs, ours, _ = pair
        stubs.close()
        self._conn = Connection(ours.detach())

    # -- the child's side ------------------------------------------------------------------------
    def exec(self, req: pb_utils.InferenceRequest, decoupled: bool) -> Any:
        """``req.exec(decoupled)`` in a forked child: made by the stub, answered here."""
        if self._conn is None:
            self.rt._refuse_forked()
        body = {
            "model": req._model_name, "version": req._model_version,
            "request_id": req._request_id, "correlation_id": req._correlation_id,
            "flags": req._flags, "timeout": req._timeout, "parameters": req._parameters,
            "outputs": req._requested_output_names, "decoupled": decoupled,
            "inputs": [(t._name, _on_host(t._arr)) for t in req._inputs],
        }
        with self._lock:
            assert self._conn is not None
            try:
                self._conn.send(body)
                kind, payload = self._conn.recv()
            except (OSError, EOFError):
                raise TritonModelException(
                    "BLS from a process forked by the model: the stub that makes its calls is "
                    "gone") from None
        if kind == "raise":
            error_type, message = payload
            raise (TypeError if error_type == "TypeError" else TritonModelException)(message)
        responses = [_unpack(r) for r in payload]
        if not decoupled:
            return responses[0]
        return _Collected(responses)

    # -- the stub's side -------------------------------------------------------------------------
    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(sock.detach())
        try:
            while True:
                try:
                    body = conn.recv()
                except (OSError, EOFError):
                    return  # the child is gone
                except Exception as exc:  # not ours to read (a child's garbage): drop the link
                    sys.stderr.write(f"tritonpy stub {self.rt.name}: BLS from a forked "
                                     f"process: unreadable call ({exc!r})\n")
                    return
                try:
                    conn.send(self._call(body))
                except (OSError, EOFError):
                    return
        finally:
            conn.close()

    def _call(self, body: dict) -> tuple[str, Any]:
        try:
            req = pb_utils.InferenceRequest(
                request_id=body["request_id"], correlation_id=body["correlation_id"],
                inputs=[Tensor(name, arr) for name, arr in body["inputs"]],
                requested_output_names=body["outputs"], model_name=body["model"],
                model_version=body["version"], flags=body["flags"], timeout=body["timeout"],
                parameters=body["parameters"])
            result = self.rt.bls_exec(req, bool(body["decoupled"]))
            if not body["decoupled"]:
                return "ok", [_pack(result)]
            return "ok", [_pack(r) for r in result]
        except Exception as exc:
            message = exc.message() if isinstance(exc, TritonModelException) else str(exc)
            return "raise", (type(exc).__name__, message)


class _Collected:
    """What ``exec(decoupled=True)`` returns in a forked child: the responses, collected."""

    def __init__(self, responses: list[pb_utils.InferenceResponse]) -> None:
        self._responses = responses

    def __iter__(self) -> Any:
        return iter(self._responses)

    def cancel(self) -> None:
        """The stream is over when this is had: nothing is left to cancel."""


def _on_host(arr: Any) -> np.ndarray:
    return arr if isinstance(arr, np.ndarray) else cuda.to_host(arr)


def _pack(resp: pb_utils.InferenceResponse) -> dict:
    err = resp.error()
    return {"outputs": [(t._name, _on_host(t._arr)) for t in resp.output_tensors()],
            "error": err._to_wire() if err is not None else None,
            "parameters": resp._parameters}


def _unpack(body: dict) -> pb_utils.InferenceResponse:
    err = body["error"]
    error = TritonError._from_wire(err) if err is not None else None
    return pb_utils.InferenceResponse([Tensor(n, a) for n, a in body["outputs"]], error,
                                      body["parameters"] or {})
