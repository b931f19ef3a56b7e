"""The system shared-memory extension: regions a client creates and registers with the server.

A client creates a POSIX shm object (``tritonclient.utils.shared_memory``), registers a window
of it (key, offset, byte size) under a region name, and then names that region in an input's or
output's ``shared_memory_region`` parameter instead of sending the bytes. The frontends read
inputs from and write outputs into these windows.

Every size and offset here comes from the network, so each one is checked against the window
before any memory is touched (STYLE §10). Keys under tritonpy's own segment prefix are refused:
they are the server's tensor pools, and a client must not be able to read or scribble on them.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Iterable

import posix_ipc

from .._errors import AlreadyExistsError, InvalidArgumentError, NotFoundError

log = logging.getLogger(__name__)


@dataclass
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    mm: mmap.mmap


class SharedMemoryRegistry:
    """The registered system shared-memory regions of one server (thread-safe).

    Args:
        reserved_prefixes: shm name prefixes (without the leading ``/``) that clients may not
            register, normally the server's ``shm-region-prefix-name``.
    """

    def __init__(self, reserved_prefixes: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, _Region] = {}
        # Mappings unregistered while a request still held a view of them; unmapped as soon as
        # the last view dies (Triton likewise defers the munmap of a region in use).
        self._deferred: list[mmap.mmap] = []
        self._reserved = tuple(p.lstrip("/") for p in reserved_prefixes if p.strip("/"))

    # -- control -----------------------------------------------------------------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``byte_size`` bytes at ``offset`` of the shm object ``key`` as region ``name``."""
        if not name:
            raise InvalidArgumentError(
                "'region name' is necessary to register system shared memory region"
            )
        if not isinstance(key, str) or not key.strip("/") or "/" in key.lstrip("/") or "\0" in key:
            raise InvalidArgumentError(f"failed to register shared memory region '{name}': invalid key {key!r}")
        for value, what in ((offset, "offset"), (byte_size, "byte_size")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(
                    f"failed to register shared memory region '{name}': {what} must be a non-negative integer"
                )
        bare = key.lstrip("/")
        if any(bare.startswith(p) for p in self._reserved):
            raise InvalidArgumentError(
                f"failed to register shared memory region '{name}': key '{key}' is reserved for "
                "the server's own tensor pools"
            )
        with self._lock:
            self._reap()
            if name in self._regions:
                raise AlreadyExistsError(f"shared memory region '{name}' already in manager")
            mm = _map(name, "/" + bare, offset, byte_size)
            self._regions[name] = _Region(name, key, offset, byte_size, mm)
        log.debug("registered system shared memory region %r (key %r, offset %d, %d bytes)",
                  name, key, offset, byte_size)

    def unregister(self, name: str = "") -> None:
        """Unregister region ``name``, or every region when ``name`` is empty.

        An unknown name is not an error, as in Triton.
        """
        with self._lock:
            names = [name] if name else list(self._regions)
            for n in names:
                region = self._regions.pop(n, None)
                if region is not None:
                    self._close(region.mm)
                    log.debug("unregistered system shared memory region %r", n)
            self._reap()

    def status(self, name: str = "") -> list[dict[str, object]]:
        """Triton's status list: ``[{"name", "key", "offset", "byte_size"}]``."""
        with self._lock:
            if name:
                region = self._regions.get(name)
                if region is None:
                    raise NotFoundError(f"Unable to find system shared memory region: '{name}'")
                regions = [region]
            else:
                regions = sorted(self._regions.values(), key=lambda r: r.name)  # as Triton lists them
            return [
                {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for r in regions
            ]

    def close(self) -> None:
        """Unregister everything (server shutdown)."""
        self.unregister("")

    # -- data --------------------------------------------------------------------------------

    def view(self, name: str, offset: int, byte_size: int) -> memoryview:
        """A writable view of ``byte_size`` bytes at ``offset`` inside region ``name``."""
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InvalidArgumentError(f"Invalid offset for shared memory region: '{name}'")
        if isinstance(byte_size, bool) or not isinstance(byte_size, int) or byte_size < 0:
            raise InvalidArgumentError(f"Invalid byte size for shared memory region: '{name}'")
        with self._lock:
            region = self._regions.get(name)
            if region is None:
                raise NotFoundError(f"Unable to find shared memory region: '{name}'")
            if offset >= region.byte_size:
                raise InvalidArgumentError(f"Invalid offset for shared memory region: '{name}'")
            if offset + byte_size > region.byte_size:
                raise InvalidArgumentError(
                    f"Invalid offset + byte size for shared memory region: '{name}'"
                )
            start = region.offset + offset
            return memoryview(region.mm)[start:start + byte_size]

    # -- internals ---------------------------------------------------------------------------

    def _close(self, mm: mmap.mmap) -> None:
        try:
            mm.close()
        except BufferError:
            self._deferred.append(mm)

    def _reap(self) -> None:
        still = []
        for mm in self._deferred:
            try:
                mm.close()
            except BufferError:
                still.append(mm)
        self._deferred = still


def _map(name: str, key: str, offset: int, byte_size: int) -> mmap.mmap:
    """Map the first ``offset + byte_size`` bytes of shm object ``key``.

    mmap offsets must be page aligned, so the mapping starts at 0 and the region's offset is
    applied when slicing.
    """
    try:
        shm = posix_ipc.SharedMemory(key, 0)
    except posix_ipc.ExistentialError:
        raise InvalidArgumentError(f"Unable to open shared memory region: '{key}'") from None
    except (posix_ipc.Error, OSError, ValueError) as exc:
        raise InvalidArgumentError(f"Unable to open shared memory region: '{key}': {exc}") from None
    try:
        size = os.fstat(shm.fd).st_size
        if byte_size == 0 or offset + byte_size > size:
            raise InvalidArgumentError(f"failed to register shared memory region '{name}': invalid args")
        try:
            return mmap.mmap(shm.fd, offset + byte_size, flags=mmap.MAP_SHARED)
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(
                f"failed to register shared memory region '{name}': {exc}"
            ) from None
    finally:
        shm.close_fd()
