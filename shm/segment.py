"""Named shared-memory segments: POSIX shm through posix_ipc, or files in a fallback directory.

A segment is created by exactly one process (its owner), which reserves its pages with
``posix_fallocate`` so that a full ``/dev/shm`` raises :class:`ShmExhaustedError` here instead
of a SIGBUS on first touch. Peers attach by name. Names are ``<prefix><pid>x<rand>_<n>``: the
creating pid lets a later sweep tell orphans from live segments.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import resource
import secrets
import time

import posix_ipc

from ._errors import (
    NO_SPACE,
    FdLimitError,
    ProtocolError,
    SegmentGoneError,
    ShmError,
    ShmExhaustedError,
)

PAGE = mmap.PAGESIZE
SHM_DIR = "/dev/shm"
# No '/', and no leading '.': a peer must not make us open ".", ".." or a path.
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def round_up(n: int, to: int = PAGE) -> int:
    """Round ``n`` up to a multiple of ``to``."""
    return (n + to - 1) // to * to


def process_token() -> str:
    """A per-process token, ``<pid>x<random>``; the pid is what the orphan sweep checks."""
    return f"{os.getpid()}x{secrets.token_hex(3)}"


def _blocks(directory: str | None, field: str) -> int:
    try:
        st = os.statvfs(directory or SHM_DIR)
    except OSError:
        return 0
    return int(getattr(st, field)) * st.f_frsize


def free_bytes(directory: str | None) -> int:
    """Bytes still free on the filesystem that backs ``directory`` (``/dev/shm`` for None)."""
    return _blocks(directory, "f_bavail")


def total_bytes(directory: str | None) -> int:
    """The size of the filesystem that backs ``directory`` (``/dev/shm`` for None)."""
    return _blocks(directory, "f_blocks")


def could_fit(directory: str | None, nbytes: int) -> bool:
    """Whether ``directory``'s filesystem is that large at all (were it empty)."""
    return nbytes <= total_bytes(directory)


def wait_for_room(directory: str | None, nbytes: int, timeout: float) -> bool:
    """Whether ``nbytes`` are free on ``directory``'s filesystem within ``timeout`` seconds
    (False at once when it could never fit)."""
    if not could_fit(directory, nbytes):
        return False
    deadline = time.monotonic() + timeout
    while free_bytes(directory) < nbytes:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _fd_limit(exc: BaseException, what: str) -> FdLimitError | None:
    """The error to raise for ``exc`` when it says that no file descriptor was left (EMFILE
    or ENFILE), else None. posix_ipc raises a plain OSError without errno for them, known
    by its text only."""
    code = getattr(exc, "errno", None)
    text = str(exc)
    if code == errno.EMFILE or code is None and "maximum number of files open" in text:
        return FdLimitError(what)
    if code == errno.ENFILE or code is None and "total number of open files" in text:
        return FdLimitError(what, system=True)
    return None


def _file_size_limit() -> int | None:
    """This process's RLIMIT_FSIZE soft limit in bytes (None: unlimited)."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _no_memory(exc: OSError, what: str) -> ShmError | None:
    """The error to raise for a mapping refused for want of memory (ENOMEM), else None."""
    if exc.errno != errno.ENOMEM:
        return None
    return ShmError(f"{what}: no memory or address space left for the mapping (the process's "
                    "RLIMIT_AS, its memory cgroup, or vm.max_map_count)")


def check_name(name: str) -> None:
    """Reject a segment name from a peer unless it is a plain name (no path tricks)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ProtocolError(f"invalid shared-memory segment name {name!r}")


class Segment:
    """One mapped segment; ``owner`` is True in the process that created (and will unlink) it."""

    __slots__ = ("name", "size", "mm", "owner", "directory", "base", "gone", "ino")

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool, directory: str | None):
        self.name = name
        self.size = size
        self.mm = mm
        self.owner = owner
        self.directory = directory
        # Its name is not this process's any more: unlinked by it, or removed behind its back
        # (Pool.drop_lost). Still mapped where it was, but no peer can open it, so nothing is
        # sent by handle into it.
        self.gone = False
        self.ino = 0  # its file's inode, once known (see lost)
        # The address of the mapping, used to recognise arrays that already live in it.
        probe = ctypes.c_char.from_buffer(mm)
        self.base = ctypes.addressof(probe)
        del probe

    @classmethod
    def create(cls, name: str, size: int, directory: str | None = None) -> Segment:
        """Create and reserve a segment of ``size`` bytes; raises ShmExhaustedError when full."""
        check_name(name)
        size = round_up(max(size, 1))
        try:
            fd = _open(name, directory, create=True)
        except (posix_ipc.Error, OSError) as exc:
            raise (_fd_limit(exc, f"cannot create shared-memory segment {name} ({size} bytes)")
                   or ShmError(f"cannot create shared-memory segment {name}: {exc}")) from None
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                _unlink(name, directory)
                limit = _file_size_limit() if exc.errno == errno.EFBIG else None
                if limit is not None and size > limit:
                    # Not /dev/shm: this process may not make a file that large (Python
                    # ignores the SIGXFSZ that comes with it).
                    raise ShmExhaustedError(
                        size, free_bytes(directory), directory or SHM_DIR,
                        f"larger than this process's file size limit, RLIMIT_FSIZE {limit} "
                        "bytes: ulimit -f") from None
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EDQUOT):
                    raise ShmExhaustedError(
                        size, free_bytes(directory), directory or SHM_DIR, NO_SPACE
                    ) from None
                raise ShmError(f"cannot reserve {size} bytes for segment {name}: {exc}") from exc
            try:
                # (mmap keeps a duplicate of the descriptor: EMFILE can come from here too.)
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
            except OSError as exc:
                _unlink(name, directory)
                what = f"cannot map shared-memory segment {name} ({size} bytes)"
                raise (_fd_limit(exc, what) or _no_memory(exc, what)
                       or ShmError(f"{what}: {exc}")) from None
            ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        seg = cls(name, size, mm, True, directory)
        seg.ino = ino
        return seg

    @classmethod
    def attach(cls, name: str, directory: str | None = None) -> Segment:
        """Map an existing segment created by a peer."""
        check_name(name)
        try:
            fd = _open(name, directory, create=False)
        except (posix_ipc.ExistentialError, FileNotFoundError):
            raise SegmentGoneError(name) from None
        except (posix_ipc.Error, OSError, ValueError) as exc:
            # A name from a peer that we may not open (permissions, a directory ...), unless
            # this process is out of descriptors: not the peer's fault.
            raise (_fd_limit(exc, f"cannot open shared-memory segment {name}")
                   or ProtocolError(f"cannot open shared-memory segment {name}: {exc}")) from None
        try:
            size = os.fstat(fd).st_size
            if size <= 0:
                raise ProtocolError(f"shared-memory segment {name} is empty")
            try:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
            except OSError as exc:
                what = f"cannot map shared-memory segment {name} ({size} bytes)"
                raise (_fd_limit(exc, what) or _no_memory(exc, what)
                       or ProtocolError(f"{what}: {exc}")) from None
        finally:
            os.close(fd)
        return cls(name, size, mm, False, directory)

    def map_private(self, offset: int, nbytes: int) -> tuple[mmap.mmap, int, int]:
        """A copy-on-write mapping of ``nbytes`` at ``offset``: reads see the segment, writes
        stay in this process. Returns (mapping, where the bytes start in it, its address).

        The pages are mapped lazily (a reader pays page faults only for what it touches)."""
        start = offset // PAGE * PAGE
        length = round_up(offset + nbytes) - start
        try:
            fd = _open(self.name, self.directory, create=False)
        except (posix_ipc.ExistentialError, FileNotFoundError):
            raise SegmentGoneError(self.name) from None
        except (posix_ipc.Error, OSError) as exc:
            raise (_fd_limit(exc, f"cannot reopen shared-memory segment {self.name}")
                   or ProtocolError(f"cannot reopen shared-memory segment {self.name}: {exc}")) from None
        try:
            mm = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, offset=start)
        except OSError as exc:
            what = f"cannot map shared-memory segment {self.name} ({length} bytes)"
            raise (_fd_limit(exc, what) or _no_memory(exc, what)
                   or ProtocolError(f"{what}: {exc}")) from None
        finally:
            os.close(fd)
        probe = ctypes.c_char.from_buffer(mm)
        address = ctypes.addressof(probe)
        del probe
        return mm, offset - start, address

    def close(self) -> bool:
        """Unmap; returns False (and stays mapped) while views of it are still alive."""
        try:
            self.mm.close()
        except BufferError:
            return False
        return True

    def lost(self) -> bool:
        """Whether this process's segment has lost its name: its file was removed from its
        directory, or replaced by another of the same name, behind its owner's back (peers
        that open it by name can no longer reach it). One ``stat``."""
        if not self.owner or self.gone or not self.ino:
            return False
        try:
            return os.stat(os.path.join(self.directory or SHM_DIR, self.name)).st_ino != self.ino
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def unlink(self) -> None:
        """Remove the name (owner only); the memory lives on until every mapping is closed."""
        if self.owner and not self.gone:
            self.gone = True
            _unlink(self.name, self.directory)


def _open(name: str, directory: str | None, create: bool) -> int:
    if directory is None:
        flags = posix_ipc.O_CREX if create else 0
        shm = posix_ipc.SharedMemory("/" + name, flags, mode=0o600, size=0)
        return shm.fd
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    return os.open(os.path.join(directory, name), flags, 0o600)


def _unlink(name: str, directory: str | None) -> None:
    try:
        if directory is None:
            posix_ipc.unlink_shared_memory("/" + name)
        else:
            os.unlink(os.path.join(directory, name))
    except (posix_ipc.ExistentialError, FileNotFoundError):
        pass

