"""The copier: a child process of the server that makes its large shared-memory copies.

Run as ``python -I -S _shmcopy_child.py FD`` by :mod:`._shmcopy` (standard library only: it
starts in a few milliseconds). FD is its end of a ``SOCK_SEQPACKET`` pair; one message a
command, each a struct (see ``_shmcopy``):

* ``R`` region id, with a client's shm object passed as a descriptor: keep it (it is
  mapped by the first copy that uses it, and again, larger, by one that needs more of it);
* ``F`` region id: unmap and close it (unregistered);
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
import signal
import socket
import struct
import sys
import time

REGION = struct.Struct("=cQ")  # b"R", id
FORGET = struct.Struct("=cQ")  # b"F", id
COPY = struct.Struct("=c?QQQQ")  # b"C", write, id, position, length, segment offset; path follows
SWEEP_SECONDS = 1.0


class _Mapping:
    """A file kept open and mapped whole, as large as it is when mapped, with the mapping's
    address (no buffer export is kept: it can always close)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.mm: mmap.mmap | None = None
        self.addr = self.length = 0

    def cover(self, end: int) -> None:
        """Map the file again if this mapping ends before byte ``end`` (ValueError when the
        file itself does: a client shrank it)."""
        if end <= self.length:
            return
        self.unmap()
        size = os.fstat(self.fd).st_size
        if size < end:
            raise ValueError(f"the object holds {size} bytes, the copy needs {end}")
        self.mm = mmap.mmap(self.fd, size)
        probe = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(probe)
        del probe
        self.length = size

    def unmap(self) -> None:
        if self.mm is not None:
            self.mm.close()
        self.mm, self.addr, self.length = None, 0, 0

    def close(self) -> None:
        self.unmap()
        os.close(self.fd)


class _Segment(_Mapping):
    """A server segment, its descriptor kept to see whether it was unlinked."""

    def __init__(self, path: str) -> None:
        super().__init__(os.open(path, os.O_RDWR | os.O_CLOEXEC))

    def unlinked(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0


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
            _, rid = REGION.unpack(msg)
            old = regions.pop(rid, None)
            if old is not None:
                old.close()
            regions[rid] = _Mapping(fds[0])
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
                region.cover(pos + n)
                seg.cover(seg_off + n)
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
    # Ctrl-C in a terminal goes to the server's whole process group: the server stops, and
    # this process with it once the server closes its end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(socket.socket(fileno=int(sys.argv[1])))


if __name__ == "__main__":
    main()
