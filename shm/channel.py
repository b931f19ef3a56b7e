"""A message channel between two processes: msgpack frames over a SOCK_SEQPACKET socket pair.

Each ``send`` is one datagram, so threads may send concurrently without a lock and the receiver
never sees a torn frame. A frame larger than ``frame_limit`` is written into a pool block and
only its handle crosses the socket (SPILL). The peer's death closes the socket: ``recv`` returns
None at once, with no timeout involved. Releases owed to the peer ride along on the next frame
that goes to it anyway (an optional fourth element); what no frame took within
``RELEASE_DELAY_S`` a small flusher thread sends in RELEASE batches. Every frame read from the
peer is validated before use.
"""
from __future__ import annotations

import atexit
import collections
import logging
import os
import socket
import threading
import time
from typing import Any, Callable
import queue

import msgpack
import numpy as np

from ._errors import ChannelClosedError, ProtocolError
from .messages import Cmd, frame
from .transport import Peer, TensorTransport

FRAME_LIMIT = 60 * 1024
# Release ids per RELEASE frame: small enough that a batch never spills into shm (the flusher
# must not need pool space to give pool space back).
RELEASE_BATCH = 8192
# How long owed releases wait for a frame to carry them before the flusher sends them: in
# request/response traffic they then cost no frame and no wake-up of the peer of their own. Once
# they add up to URGENT_RELEASE_BYTES of blocks (Peer.owe_release), they go at once. While releases are owed, the
# flusher looks every RELEASE_DELAY_S (it is not woken per release: that wake-up cost more than
# the release itself); after PARK_AFTER_TICKS looks that found nothing owed it sleeps until the
# next release wakes it.
RELEASE_DELAY_S = 0.002
PARK_AFTER_TICKS = 5
MAINTENANCE_EVERY_S = 1.0
CARRY_MAX = 1024  # release ids one frame carries
#: A polling recv asks its ``give_way`` after this many empty polls (~1-2 µs each).
POLL_CHECK_EVERY = 16
logger = logging.getLogger(__name__)
_KNOWN = frozenset(int(c) for c in Cmd)
_packb = msgpack.packb
_unpackb = msgpack.unpackb
#: What ``recv(wait=False)`` returns when no frame is there (compare with ``is``).
EMPTY: list = []
# Plain ints for the per-frame checks in recv(): an IntEnum member lookup costs ~0.3 µs each.
_SPILL, _RELEASE, _DROPPED = int(Cmd.SPILL), int(Cmd.RELEASE), int(Cmd.DROPPED)
# TRITONPY_FRAME_TRACE=<directory>: every process (stubs inherit it) records when each frame is
# sent and received, and appends the records to <directory>/<pid>.tsv every TRACE_CHUNK of them
# and at exit (a stub that ends by os._exit, which skips atexit, calls flush_trace first);
# benchmarks/bls_trace.py reads them. Off by default: one global test per frame.
_TRACE_DIR = os.environ.get("TRITONPY_FRAME_TRACE", "")
TRACE_CHUNK = 4096
_trace: list[tuple[int, str, str, int, int]] = []
_trace_lock = threading.Lock()


def _traced(row: tuple[int, str, str, int, int]) -> None:
    _trace.append(row)
    if len(_trace) >= TRACE_CHUNK:
        _dump_trace()


def flush_trace() -> None:
    """Write out the frame trace now (TRITONPY_FRAME_TRACE), before an ``os._exit``."""
    if _TRACE_DIR:
        _dump_trace()


def _dump_trace() -> None:
    # Under a lock: a thread about to os._exit waits until another one (atexit's) has written.
    with _trace_lock:
        rows = _trace[:]
        del _trace[:len(rows)]
        if rows:
            with open(os.path.join(_TRACE_DIR, f"{os.getpid()}.tsv"), "a") as fh:
                fh.writelines("\t".join(map(str, row)) + "\n" for row in rows)


if _TRACE_DIR:
    atexit.register(_dump_trace)


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """A connected SOCK_SEQPACKET pair (inheritable end second)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.set_inheritable(True)
    return a, b


class Channel:
    """One end of a host <-> stub channel."""

    # Set by use_backlog(), used only once it was called.
    _on_backlog: Callable[[], None]
    _may_wait: Callable[[], bool]

    def __init__(self, sock: socket.socket, transport: TensorTransport, name: str = "channel",
                 frame_limit: int = FRAME_LIMIT,
                 maintenance: Callable[[], None] | None = None) -> None:
        self.sock = sock
        self.transport = transport
        self.peer = Peer(name)
        self.name = name
        self.frame_limit = frame_limit
        self._buf = bytearray(frame_limit + 1024)
        self._view = memoryview(self._buf)
        self.closed = False
        self.frames_sent = 0
        self.frames_received = 0
        # RELEASE frames among those (batched lifetime traffic, not requests): tests subtract
        # them to count the messages of a request.
        self.release_frames_sent = 0
        self.release_frames_received = 0
        self._maintenance = maintenance
        self._local = threading.local()
        self.frames_carrying_releases = 0
        # A socket an event loop watches is non-blocking (the loop must never wait on a peer
        # that does not read): what it does not take waits here, in order, until the owner's
        # loop sees it writable and calls flush_backlog(). See use_backlog().
        self._backlog: collections.deque[bytes] | None = None
        self._backlog_lock = threading.Lock()
        self._backlog_drained = threading.Condition(self._backlog_lock)
        self._flusher = threading.Thread(target=self._flush_releases, name=f"{name}-release",
                                         daemon=True)
        self._flusher.start()

    def use_backlog(self, on_backlog: Callable[[], None], may_wait: Callable[[], bool]) -> None:
        """Make the socket non-blocking: a frame it does not take at once is kept in a backlog
        (and every later frame behind it, so that none overtakes another).

        Args:
            on_backlog: called (from any thread) when the backlog stops being empty; the owner
                calls :meth:`flush_backlog` once the socket is writable, until it returns True.
            may_wait: whether the calling thread may wait for the backlog to drain (a sender
                that is not the owner's event loop waits, as a blocking send did).
        """
        self._on_backlog, self._may_wait = on_backlog, may_wait
        self._backlog = collections.deque()
        self.sock.setblocking(False)

    def flush_backlog(self) -> bool:
        """Send what waits in the backlog; whether it is empty now (or the peer is gone)."""
        with self._backlog_lock:
            return self._flush_locked()

    def _flush_locked(self) -> bool:
        backlog = self._backlog
        assert backlog is not None
        try:
            while backlog:
                self.sock.send(backlog[0])
                backlog.popleft()
        except BlockingIOError:
            return False
        except OSError:
            self.closed = True
            backlog.clear()
        self._backlog_drained.notify_all()
        return True

    def _send_or_keep(self, data: bytes) -> None:
        """Send on a non-blocking socket, or keep the frame in the backlog behind the others."""
        backlog = self._backlog
        assert backlog is not None
        with self._backlog_lock:
            if not backlog:
                try:
                    self.sock.send(data)
                    return
                except BlockingIOError:
                    pass
            backlog.append(data)
            first = len(backlog) == 1
        if first:
            self._on_backlog()
        if self._may_wait():
            with self._backlog_lock:
                while backlog and not self.closed:
                    if not self._backlog_drained.wait(0.05):
                        self._flush_locked()  # progress even if the owner's loop is gone

    # -- sending ------------------------------------------------------------------------------
    def send(self, cmd: Cmd, call_id: int = 0, body: Any = None) -> None:
        """Send one frame; raises ChannelClosedError if the peer is gone."""
        # One reusable Packer per sending thread: msgpack.packb() builds (and sizes) a new
        # Packer on every call, about 1 µs of a ~10 µs send. Packers are not thread-safe.
        try:
            pack = self._local.pack
        except AttributeError:
            pack = self._local.pack = msgpack.Packer(use_bin_type=True).pack
        peer = self.peer
        if (peer.lazy or peer.urgent) and cmd != _RELEASE:
            ids = self._take_releases(CARRY_MAX)
            try:
                data = pack([int(cmd), call_id, body, ids] if ids else [int(cmd), call_id, body])
            except Exception:
                # A body msgpack refuses (a str with a lone surrogate, an int past 64 bits): the
                # releases it was to carry go back in the queue, or their blocks leak.
                for eid in ids:
                    peer.owe_release(eid)
                raise
            if ids:
                self.frames_carrying_releases += 1
        else:
            data = pack([int(cmd), call_id, body])
        if len(data) > self.frame_limit:
            block = self.transport.pool.new_array(np.uint8, (len(data),))
            block[:] = np.frombuffer(data, np.uint8)
            seg, off = self.transport.segments.locate(block)  # type: ignore[misc]
            eid = self.peer.export(block)
            data = _packb(frame(Cmd.SPILL, 0, [seg.name, off, len(data), eid]), use_bin_type=True)
        try:
            if _TRACE_DIR:
                _traced((time.perf_counter_ns(), self.name, "send", int(cmd), call_id))
            if self._backlog is None:
                self.sock.send(data)
            else:
                self._send_or_keep(data)
        except OSError as exc:
            self.closed = True
            raise ChannelClosedError(f"{self.name}: peer is gone ({exc})") from None
        self.frames_sent += 1

    def _take_releases(self, limit: int | None) -> list[int]:
        ids = self.peer.take_owed()
        if limit is not None and len(ids) > limit:
            # Back in the queue, for the next frame or the flusher.
            owe = self.peer.owe_release
            for eid in ids[limit:]:
                owe(eid)
            ids = ids[:limit]
        return ids

    def _flush_releases(self) -> None:
        """The flusher thread: sends the releases no frame took (see RELEASE_DELAY_S), and runs
        the owner's maintenance about every MAINTENANCE_EVERY_S."""
        peer = self.peer
        quiet = 0  # looks in a row that found nothing owed
        next_maintenance = time.monotonic() + MAINTENANCE_EVERY_S
        while True:
            try:
                token = peer.wake.get(
                    timeout=MAINTENANCE_EVERY_S if peer.parked else RELEASE_DELAY_S)
            except queue.Empty:
                token = 0
            if token is None or self.closed:
                return
            now = time.monotonic()
            if now >= next_maintenance and self._maintenance is not None:
                next_maintenance = now + MAINTENANCE_EVERY_S
                try:
                    self._maintenance()
                except ChannelClosedError:
                    return
                except Exception:  # keep flushing releases whatever maintenance does
                    logger.exception("%s: maintenance failed", self.name)
            if peer.urgent or (peer.lazy and now - peer.lazy_since >= RELEASE_DELAY_S):
                quiet = 0
                ids = self._take_releases(None)
                try:
                    for i in range(0, len(ids), RELEASE_BATCH):
                        self.release_frames_sent += 1
                        self.send(Cmd.RELEASE, 0, ids[i:i + RELEASE_BATCH])
                except ChannelClosedError:
                    return
            elif peer.lazy:
                quiet = 0
            elif not peer.parked:
                quiet += 1
                if quiet >= PARK_AFTER_TICKS:
                    quiet = 0
                    peer.parked = True
                    if peer.lazy:  # owed before it could see the flusher parked: not woken
                        peer.parked = False

    # -- receiving ----------------------------------------------------------------------------
    def recv(self, spin_s: float = 0.0, wait: bool = True,
             give_way: Callable[[], bool] | None = None) -> list | None:
        """The next frame ``[cmd, call_id, body]``; None once the peer has closed or died;
        with ``wait=False``, :data:`EMPTY` at once when no frame is there. ``spin_s``: poll
        that long before sleeping (see ``_poll_into`` for ``give_way``).

        RELEASE frames are handled here and never returned.
        """
        resets = 0
        while True:
            try:
                if not wait:
                    n = self.sock.recv_into(self._buf, 0, socket.MSG_DONTWAIT)
                else:
                    n = self._poll_into(spin_s, give_way) if spin_s else -1
                    if n < 0:
                        n = self.sock.recv_into(self._buf)
            except BlockingIOError:
                return EMPTY
            except ConnectionResetError:
                # The peer closed with frames of ours still unread: the kernel reports that once,
                # ahead of the frames it had sent before closing (its last replies). Read those.
                resets += 1
                if resets < 3:
                    continue
                n = 0
            except OSError:
                n = 0
            if n == 0:
                self.closed = True
                return None
            self.frames_received += 1
            if n == len(self._buf):  # SOCK_SEQPACKET cut a datagram longer than any we send
                raise ProtocolError(f"{self.name}: frame of {n}+ bytes exceeds the frame limit")
            if _TRACE_DIR:  # the command byte: a fixarray header, then a positive fixint
                _traced((time.perf_counter_ns(), self.name, "recv", self._buf[1], 0))
            msg = self._parse(self._view[:n])
            if msg[0] == _SPILL:
                msg = self._unspill(msg[2])
            if len(msg) == 4:  # releases carried along
                ids = msg.pop()
                if not (type(ids) is list and all(type(i) is int for i in ids)):
                    raise ProtocolError(f"{self.name}: carried releases must be a list of ids")
                self.peer.release(ids)
            cmd = msg[0]
            if cmd == _RELEASE:
                ids = msg[2]
                if not (isinstance(ids, list) and all(type(i) is int for i in ids)):
                    raise ProtocolError(f"{self.name}: RELEASE body must be a list of ids")
                self.release_frames_received += 1
                self.peer.release(ids)
                continue
            if cmd == _DROPPED and isinstance(msg[2], list):
                for name in msg[2]:
                    if isinstance(name, str):
                        self.transport.segments.forget(name, owned=False)
            return msg

    def _poll_into(self, spin_s: float, give_way: Callable[[], bool] | None = None) -> int:
        """Read a datagram without sleeping, polling for up to ``spin_s``; -1 if none came.

        Between polls the thread yields its CPU to any other runnable thread there (the host,
        the target stub, other callers): with more busy threads than CPUs a poll that did not
        yield took a whole time slice from the work it waits for. ``give_way`` is asked every
        :data:`POLL_CHECK_EVERY` polls; polling stops when it answers True.
        """
        recv_into, buf, sched_yield = self.sock.recv_into, self._buf, os.sched_yield
        deadline = time.perf_counter() + spin_s
        polls = 0
        while True:
            try:
                return recv_into(buf, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() > deadline:
                    return -1
                polls += 1
                if give_way is not None and not polls % POLL_CHECK_EVERY and give_way():
                    return -1
                sched_yield()

    def _parse(self, data: Any) -> list:
        try:
            # unpackb bounds every str/bin/array/map length by the frame's own size.
            # (raw=False is msgpack's default; every keyword parsed costs on this hot path)
            msg = _unpackb(data, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise ProtocolError(f"{self.name}: undecodable frame ({exc})") from None
        if not (type(msg) is list and 3 <= len(msg) <= 4 and type(msg[0]) is int
                and type(msg[1]) is int):
            raise ProtocolError(f"{self.name}: frame is not [cmd, call_id, body(, releases)]")
        if msg[0] not in _KNOWN:
            raise ProtocolError(f"{self.name}: unknown command {msg[0]}")
        return msg

    def _unspill(self, body: Any) -> list:
        if not (isinstance(body, list) and len(body) == 4):
            raise ProtocolError(f"{self.name}: malformed SPILL frame")
        seg_name, off, nbytes, eid = body
        if not all(isinstance(x, int) for x in (off, nbytes, eid)):
            raise ProtocolError(f"{self.name}: malformed SPILL frame")
        try:
            seg = self.transport.segments.get(seg_name)
            if off < 0 or nbytes <= 0 or off + nbytes > seg.size:
                raise ProtocolError(
                    f"{self.name}: SPILL of {nbytes} bytes at {off} exceeds segment {seg_name}"
                )
            msg = self._parse(memoryview(seg.mm)[off:off + nbytes])
        finally:
            self.peer.owe_release(eid)
        if msg[0] == Cmd.SPILL:
            raise ProtocolError(f"{self.name}: nested SPILL frame")
        return msg

    # -- closing ------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the socket and stop the flusher; what the peer held is dropped."""
        self.closed = True
        self.peer.wake.put(None)
        with self._backlog_lock:  # what waits is dropped with the peer; its waiters go on
            if self._backlog is not None:
                self._backlog.clear()
            self._backlog_drained.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.peer.drop_all()
