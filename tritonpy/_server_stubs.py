"""What a :class:`~tritonpy.Server` and its stubs say to each other outside requests: the
calls a stub makes of the host (BLS, log lines, custom metrics, the model loading API), the
host's broadcasts to every stub, and the maintenance thread that gives idle shared memory back
and watches the event loops for stalls.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from tritonpy.shm import Cmd, Pool, SegmentMap
from tritonpy.shm.pool import RECLAIM_EVERY_S
from tritonpy.shm.waiting import StallWatch

from ._errors import InvalidArgumentError, TritonpyError, UnavailableError
from ._model import ModelRuntime
from ._stubproc import StubProcess

if TYPE_CHECKING:
    from ._bls import BlsRouter
    from ._custom_metrics import CustomMetrics
    from ._loop import FrameLoop
    from ._repo_manager import RepositoryManager

log = logging.getLogger("tritonpy")
_LOG_LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}


def _wire_text(value: Any) -> str:
    """A name, version or config of a stub's model loading API call: bytes (its model gave
    bytes that are not UTF-8) are read as pb_utils read them, each byte UTF-8 cannot read a
    lone surrogate (as os.fsdecode reads a folder's name)."""
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


class ServerStubs:
    """Server's side of its talk with the stubs, as a mixin of :class:`~tritonpy.Server`'s: a
    model runtime hands each frame of a stub's own to ``server.on_stub_frame`` on the frame
    loop, and the answers need the server's state throughout (its repository, BLS router,
    custom metrics, pool and segments)."""

    # Server's state, set up in Server.__init__ (the pool, segments and frame loop: in start()).
    repo: RepositoryManager
    bls: BlsRouter
    custom_metrics: CustomMetrics
    model_control_mode: str
    frames: FrameLoop
    pool: Pool
    segments: SegmentMap
    _started: bool
    _stopping: bool
    _reclaim_sent: float
    _loop_watches: list[StallWatch]

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
        stubs viewed no more, and tell the stubs; stop using segments removed behind its back."""
        lost = self.pool.drop_lost()
        if lost:
            log.warning("shared-memory segments of the server's pool were removed from %s while "
                        "in use (rm, or systemd's RemoveIPC=yes at the logout of the server's "
                        "user): %s; new tensors go to new segments",
                        self.pool.directory or "/dev/shm", ", ".join(lost))
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
