"""The copier: a child process of the server that makes its large shared-memory copies.

Run as ``python -I -S _shmcopy_child.py FD`` by :mod:`._shmcopy` (standard library only: it
starts in a few milliseconds). FD is its end of a ``SOCK_SEQPACKET`` pair; one message a
command, each a struct (see ``_shmcopy``):

* ``R`` region id, length, with a client's shm object passed as a descriptor: map it;
* ``F`` region id: unmap it (unregistered);
* ``C`` direction, region id, position, length, segment offset, segment path: copy between
  the region and the server's segment at that path (mapped on first use), then answer one
  byte.

A client may shrink its shm object at any time, and a copy through a mapping past the object's
new end is a SIGBUS. Here that kills this process alone (no core file): the server sees the
socket close, answers that request with an error and starts a new copier for the next copy.
The server checks the object's size before every copy, so only a shrink during the copy
itself can do this.

A segment the server unlinks (an idle one given back) is unmapped here too: before each copy
that uses it, and every second for the others, so that a mapping here never keeps freed memory
alive. The process ends when the server closes its end (or dies).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import resource
import socket
import struct
import sys
import time

REGION = struct.Struct("=cQQ")  # b"R", id, length
FORGET = struct.Struct("=cQ")  # b"F", id
COPY = struct.Struct("=c?QQQQ")  # b"C", write, id, position, length, segment offset; path follows
SWEEP_SECONDS = 1.0


class _Mapping:
    """One whole mapping and its address (no buffer export is kept: it can always close)."""

    def __init__(self, fd: int, length: int) -> None:
        self.mm = mmap.mmap(fd, length)
        probe = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(probe)
        del probe
        self.length = length

    def close(self) -> None:
        self.mm.close()


class _Segment(_Mapping):
    """A server segment, with its descriptor kept to see whether it was unlinked."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            super().__init__(self.fd, os.fstat(self.fd).st_size)
        except BaseException:
            os.close(self.fd)
            raise

    def unlinked(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        super().close()
        os.close(self.fd)


def serve(sock: socket.socket) -> None:
    """Answer the server's commands until it closes its end."""
    regions: dict[int, _Mapping] = {}
    segments: dict[str, _Segment] = {}
    swept = time.monotonic()
    sock.settimeout(SWEEP_SECONDS)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 8192, 1)
        except socket.timeout:
            msg, fds = None, []
        except OSError:
            return
        now = time.monotonic()
        if now - swept >= SWEEP_SECONDS:
            swept = now
            for path in [p for p, s in segments.items() if s.unlinked()]:
                segments.pop(path).close()
        if msg is None:
            continue
        if not msg:
            return
        kind = msg[:1]
        if kind == b"R":
            _, rid, length = REGION.unpack(msg)
            try:
                regions[rid] = _Mapping(fds[0], length)
            finally:
                os.close(fds[0])
        elif kind == b"F":
            _, rid = FORGET.unpack(msg)
            mapping = regions.pop(rid, None)
            if mapping is not None:
                mapping.close()
        elif kind == b"C":
            _, write, rid, pos, n, seg_off = COPY.unpack_from(msg)
            path = msg[COPY.size:].decode()
            try:
                seg = segments.get(path)
                if seg is not None and seg.unlinked():
                    segments.pop(path).close()
                    seg = None
                if seg is None:
                    seg = segments[path] = _Segment(path)
                region = regions[rid]
                if pos + n > region.length or seg_off + n > seg.length:
                    raise ValueError("window outside the mapping")
                a, b = region.addr + pos, seg.addr + seg_off
                if write:
                    ctypes.memmove(a, b, n)
                else:
                    ctypes.memmove(b, a, n)
                sock.send(b"\0")
            except (OSError, KeyError, ValueError) as exc:
                sock.send(f"{type(exc).__name__}: {exc}".encode()[:4000] or b"?")


def main() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGBUS leaves no core file behind
    serve(socket.socket(fileno=int(sys.argv[1])))


if __name__ == "__main__":
    main()
