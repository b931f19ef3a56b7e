"""Large copies between clients' system shared-memory regions and the server's segments, made
by a child process that maps both (:mod:`._shmcopy_child`).

The host never maps a client's shm object (a client may shrink it, and a load past its new end
is a SIGBUS that would end the server, see :mod:`.sharedmem`); it copies with ``preadv`` /
``pwritev`` on the object's descriptor. Those go through the kernel page by page: a 16 MiB
``pwritev`` took 2.0 ms here where one memcpy takes 0.5-0.9 ms (writes into one object are
serialized by its inode lock, so splitting one across threads does not help), a ``preadv``
2.1 ms (1.1 ms split in two). The copier maps the client's object and the server's segment
and copies with one memmove: 0.6 ms for 16 MiB, answer included. Should the object shrink
during that copy, the SIGBUS ends the copier only: that request gets the error it would have
had, and the next large copy starts a new copier.

One copy at a time goes through the copier; a copy that finds it busy (another thread's), or
that cannot use it, is made here as before (:meth:`Copier.copy` returns False).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from ..shm.segment import SHM_DIR
from ._shmcopy_child import COPY, FORGET, REGION

log = logging.getLogger(__name__)

#: Copies at least this large go through the copier: its answer costs a cross-process round
#: trip (tens of microseconds here), and it saves about 0.1 ms a MiB on a write.
MIN_BYTES = 1 << 20
#: A copier that has not answered a copy in this long, a quarter second plus 5 ms a MiB
#: (200 MB/s), is taken for stuck (stopped, say): it is killed and the copy made here. Its
#: copy runs on the thread that decodes the request (the event loop's, for HTTP and gRPC), so
#: every client waits as long as it does: a stopped copier held them all 10 s. A memmove runs
#: at several GB/s here, so this leaves it 20 to 50 times its time.
ANSWER_BASE_S = 0.25
ANSWER_BYTES_PER_S = 200e6


def answer_s(nbytes: int) -> float:
    """How long the copier may take to answer a copy of ``nbytes``."""
    return ANSWER_BASE_S + nbytes / ANSWER_BYTES_PER_S
_CHILD = str(Path(__file__).with_name("_shmcopy_child.py"))


class CopierDied(Exception):
    """The copier ended during a copy: a SIGBUS (the object shrank) or anything else."""

    def __init__(self, how: str) -> None:
        super().__init__(how)
        self.how = how


class Copier:
    """The host's end: starts the child on first use and again after it died."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._mapped: set[int] = set()  # regions the current child has mapped
        self._closed = False

    def copy(self, rid: int, fd: int, pos: int, seg_path: str, seg_off: int, n: int,
             write: bool) -> bool:
        """Copy ``n`` bytes between byte ``pos`` of region ``rid`` (the client's object, open as
        ``fd``) and byte ``seg_off`` of the server's segment at
        ``seg_path``: into the region when ``write``. False when the copier is busy or cannot be
        used (the caller copies); raises :class:`CopierDied` when it ended during the copy."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            sock = self._started()
            if sock is None:
                return False
            try:
                if rid not in self._mapped:
                    socket.send_fds(sock, [REGION.pack(b"R", rid)], [fd])
                    self._mapped.add(rid)
                sock.settimeout(answer_s(n))
                sock.send(COPY.pack(b"C", write, rid, pos, n, seg_off) + seg_path.encode())
                answer = sock.recv(4096)
            except TimeoutError:
                assert self._proc is not None
                self._proc.kill()
                self._reap()
                raise CopierDied(f"did not answer in {answer_s(n):.2f} s (killed)") from None
            except OSError:
                answer = b""
            if not answer:
                raise CopierDied(self._reap())
            if answer != b"\0":  # it could not (a shrunk object, say): copied here
                log.debug("shm copier: %s", answer.decode(errors="replace"))
                return False
            return True
        finally:
            self._lock.release()

    def forget(self, rid: int) -> None:
        """Region ``rid`` was unregistered: the copier unmaps it."""
        with self._lock:
            if rid in self._mapped and self._sock is not None:
                self._mapped.discard(rid)
                try:
                    self._sock.send(FORGET.pack(b"F", rid))
                except OSError:
                    pass

    def close(self) -> None:
        """End the child (server stop); no copy goes through it afterwards."""
        with self._lock:
            self._closed = True
            if self._proc is not None:
                self._reap(timeout=5.0)

    # -- internals ---------------------------------------------------------------------------

    def _started(self) -> socket.socket | None:
        if self._sock is not None or self._closed:
            return self._sock
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _CHILD, str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        except OSError as exc:  # no process to spare: copy in the host
            log.warning("shm copier: cannot start: %s", exc)
            mine.close()
            self._closed = True
            return None
        finally:
            theirs.close()
        mine.settimeout(answer_s(0))
        self._sock = mine
        return mine

    def _reap(self, timeout: float = 5.0) -> str:
        """Close our end, wait for the child; how it ended."""
        assert self._proc is not None and self._sock is not None
        self._sock.close()
        self._sock = None
        self._mapped.clear()
        proc, self._proc = self._proc, None
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"


def segment_path(name: str, directory: str | None) -> str:
    """Where the server's segment ``name`` lives (``/dev/shm`` or the fallback directory)."""
    return os.path.join(directory or SHM_DIR, name)
