"""The shared-memory extensions: regions a client creates and registers with the server.

A client creates a POSIX shm object (``tritonclient.utils.shared_memory``), registers a window
of it (key, offset, byte size) under a region name, and then names that region in an input's or
output's ``shared_memory_region`` parameter instead of sending the bytes. The frontends read
inputs from and write outputs into these windows.

Every size and offset here comes from the network, so each one is checked against the window
before any memory is touched (STYLE §10). Keys under tritonpy's own segment prefix are refused:
they are the server's tensor pools, and a client must not be able to read or scribble on them.

The client keeps its shm object after registering it, and may shrink it (``ftruncate``) at any
time: a load or store through a mapping past the object's new end is a SIGBUS, which would take
the whole server down (Triton 2.51 dies so, measured). So the host does not map a client's
object at all: it keeps it open, and copies inputs out of it and outputs into it with
``preadv``/``pwritev`` on that descriptor (:func:`_transfer`), where a shrunk object is a short
read (and a write is checked against its size first), which becomes a clear error for that
request. One copy is made either way (an input goes straight into the host's pool); a large
read is split across threads, as one kernel copy is slower than a memcpy (``_SPLIT_BYTES``).
A copy of 1 MiB or more between a region and one of the server's segments is made by a child
process that maps both (:mod:`._shmcopy`): one memcpy, several times faster than the kernel's,
where a shrink during the copy ends that child alone.
Each copy holds its region, so an unregister meanwhile closes it only once the copy is done.
A request in flight holds the regions its outputs go to (:meth:`SharedMemoryRegistry.hold`):
unregistering one is refused until it ends, as in Triton, rather than losing its output.

CUDA shared memory: a client registers the CUDA IPC handle of a device allocation
(``tritonclient.utils.cuda_shared_memory``), its GPU and its size. An input read from such a
region reaches the model's stub by that handle (a :class:`~tritonpy.shm.cuda.DeviceRef`: the
host does not map it), where it is mapped, and copied to the CPU unless the model takes GPU
inputs. An output written into one is copied there by the host: the only place the host uses
CuPy, mapping each region once, on its first output.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import posix_ipc

from ..shm import cuda
from ..shm.cuda import IPC_HANDLE_BYTES, DeviceRef
from ..shm.pool import SegmentMap
from ._shmcopy import MIN_BYTES, Copier, CopierDied, segment_path
from .._errors import (AlreadyExistsError, InternalError, InvalidArgumentError, NotFoundError,
                       UnavailableError)

log = logging.getLogger(__name__)


@dataclass
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int  # the client's shm object, open for the copies
    users: int = 0  # copies in progress; the descriptor closes when the last one ends
    requests: int = 0  # requests in flight that will write an output into it (see hold())
    rid: int = 0  # its number for the copier


@dataclass
class _CudaRegion:
    name: str
    handle: bytes
    device_id: int
    byte_size: int
    mapped: Any = None  # the host's CuPy view of the whole region, made for its first output


class SharedMemoryRegistry:
    """The registered system shared-memory regions of one server (thread-safe).

    Args:
        reserved_prefixes: shm name prefixes (without the leading ``/``) that clients may not
            register, normally the server's ``shm-region-prefix-name``.
        gpu_count: the server's GPUs, for CUDA regions.
        segments: the server's segments: a large copy between one of them and a region is made
            by the copier; without them every copy is made here.
    """

    def __init__(self, reserved_prefixes: Iterable[str] = (),
                 gpu_count: Callable[[], int] = lambda: 0,
                 segments: SegmentMap | None = None) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, _Region] = {}
        self._segments = segments
        self._copier = Copier() if segments is not None else None
        self._rids = itertools.count(1)
        self._cuda: dict[str, _CudaRegion] = {}
        self._gpu_count = gpu_count
        self._reserved = tuple(p.lstrip("/") for p in reserved_prefixes if p.strip("/"))

    # -- control -----------------------------------------------------------------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``byte_size`` bytes at ``offset`` of the shm object ``key`` as region ``name``."""
        if not isinstance(key, str) or not key.strip("/") or "/" in key.lstrip("/") or "\0" in key:
            # Triton's words and status for a key shm_open cannot open (measured)
            raise InternalError(f"Unable to open shared memory region: '{key}'")
        try:  # posix_ipc crashes the process on a key that is not text (JSON's "\ud800")
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError(
                f"failed to register shared memory region '{name}': invalid key {ascii(key)}: "
                "it holds an unpaired surrogate, which is not text") from None
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
            if name in self._regions or name in self._cuda:
                raise AlreadyExistsError(f"shared memory region '{name}' already in manager")
            if any(r.key == key for r in self._regions.values()):
                # Triton 2.51 refuses a key that another region has registered (measured)
                raise InternalError(f"Invalid shared memory region: '{key}'")
            fd = _open(name, key, offset, byte_size)
            self._regions[name] = _Region(name, key, offset, byte_size, fd, rid=next(self._rids))
        log.debug("registered system shared memory region %r (key %r, offset %d, %d bytes)",
                  name, key, offset, byte_size)

    def unregister(self, name: str = "", *, force: bool = False) -> None:
        """Unregister region ``name``, or every region when ``name`` is empty.

        An unknown name is not an error, as in Triton. A region that a request in flight will
        write an output into (:meth:`hold`) is refused, as in Triton, unless ``force``: the
        request would otherwise fail at its end, its output lost. Unregistering all of them
        unregisters the others, then names the refused ones (Triton's words). A region a copy
        is using is closed when that copy ends.
        """
        with self._lock:
            names = [name] if name else list(self._regions)
            busy = []
            for n in names:
                region = self._regions.get(n)
                if region is None:
                    continue
                if region.requests and not force:
                    busy.append(n)
                    continue
                del self._regions[n]
                if region.users == 0:  # else the last copy closes it
                    self._close(region)
                log.debug("unregistered system shared memory region %r", n)
        if busy and name:
            raise InternalError(
                f"Cannot unregister shared memory region '{name}', it is currently in use.")
        if busy:
            raise InternalError("Failed to unregister the following system shared memory "
                                f"regions: {', '.join(busy)} (in use by requests in flight)")

    def hold(self, windows: Iterable[tuple[str, int, int]]) -> list[_Region]:
        """Check that each ``(name, offset, byte_size)`` window is inside its region, and
        keep those regions registered (:meth:`unregister` refuses them) until
        :meth:`release` of what this returns: a request's output windows, from its start to
        its end."""
        with self._lock:
            regions = [_window(self._regions, *w) for w in windows]
            for region in regions:
                region.requests += 1
        return regions

    def release(self, regions: Iterable[_Region]) -> None:
        """End a :meth:`hold`."""
        with self._lock:
            for region in regions:
                region.requests -= 1

    def status(self, name: str = "") -> list[dict[str, object]]:
        """Triton's status list: ``[{"name", "key", "offset", "byte_size"}]``."""
        with self._lock:
            regions = _listed(self._regions, name, "system")
            return [
                {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for r in regions
            ]

    def close(self) -> None:
        """Unregister everything (server shutdown)."""
        self.unregister("", force=True)
        self.unregister_cuda("")
        if self._copier is not None:
            self._copier.close()

    # -- CUDA shared memory ------------------------------------------------------------------

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Register the device allocation that ``raw_handle`` (a ``cudaIpcMemHandle_t``) names,
        on the server's GPU ``device_id``, as region ``name`` of ``byte_size`` bytes."""
        gpus = self.require_gpus(name)
        if not isinstance(raw_handle, bytes) or len(raw_handle) != IPC_HANDLE_BYTES:
            raise InvalidArgumentError(
                f"failed to register CUDA shared memory region '{name}': the raw handle must be "
                f"a CUDA IPC handle of {IPC_HANDLE_BYTES} bytes, got "
                f"{len(raw_handle) if isinstance(raw_handle, bytes) else type(raw_handle).__name__}")
        for value, what in ((device_id, "device_id"), (byte_size, "byte_size")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"failed to register CUDA shared memory region "
                                           f"'{name}': {what} must be a non-negative integer")
        if device_id >= gpus:
            raise InvalidArgumentError(
                f"failed to register CUDA shared memory region '{name}': GPU {device_id} is not "
                f"one of the server's {gpus}")
        if byte_size == 0:
            raise InvalidArgumentError(
                f"failed to register CUDA shared memory region '{name}': byte_size must not be 0")
        with self._lock:
            if name in self._regions or name in self._cuda:
                raise AlreadyExistsError(f"shared memory region '{name}' already in manager")
            self._cuda[name] = _CudaRegion(name, raw_handle, device_id, byte_size)
        log.debug("registered CUDA shared memory region %r (GPU %d, %d bytes)", name, device_id,
                  byte_size)

    def require_gpus(self, name: str) -> int:
        """The server's GPU count; refuses a CUDA registration where there is none (Triton's
        words when built without GPU support), before its body is read."""
        if not name:
            raise InvalidArgumentError(
                "'region name' is necessary to register cuda shared memory region")
        gpus = self._gpu_count()
        if gpus == 0:
            raise InvalidArgumentError(
                f"failed to register CUDA shared memory region: '{name}', GPUs not supported")
        return gpus

    def unregister_cuda(self, name: str = "") -> None:
        """Unregister CUDA region ``name``, or all of them (an unknown name is no error). The
        host's mapping of it closes once no output copy uses it."""
        with self._lock:
            for n in [name] if name else list(self._cuda):
                if self._cuda.pop(n, None) is not None:
                    log.debug("unregistered CUDA shared memory region %r", n)

    def cuda_status(self, name: str = "") -> list[dict[str, object]]:
        """Triton's status list: ``[{"name", "device_id", "byte_size"}]``."""
        with self._lock:
            regions = _listed(self._cuda, name, "cuda")
            return [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size}
                    for r in regions]

    def is_cuda(self, name: str) -> bool:
        return name in self._cuda

    def _cuda_window(self, name: str, offset: int, byte_size: int) -> _CudaRegion:
        return _window(self._cuda, name, offset, byte_size)

    def cuda_check(self, name: str, offset: int, byte_size: int) -> None:
        """Fail, as :meth:`check` does, on a window that is not inside CUDA region ``name``."""
        self._cuda_window(name, offset, byte_size)

    def cuda_input(self, name: str, offset: int, byte_size: int, dtype: np.dtype,
                   shape: tuple[int, ...]) -> DeviceRef:
        """The stand-in for an input in CUDA region ``name``: the stub that runs the request
        maps it (nothing is released: the memory is the client's)."""
        region = self._cuda_window(name, offset, byte_size)
        return DeviceRef(region.handle, offset, byte_size, region.device_id, dtype, shape,
                         reuse=False)

    def cuda_write(self, name: str, offset: int, data: Any) -> None:
        """Copy ``data`` (bytes-like) to ``offset`` of CUDA region ``name``."""
        src = np.frombuffer(data, np.uint8)
        region = self._cuda_window(name, offset, len(src))
        if region.mapped is None:
            if not cuda.available():
                raise UnavailableError(
                    f"output to CUDA shared memory region '{name}' needs CuPy in the server: "
                    "pip install 'tritonpy[gpu]'")
            try:
                region.mapped = cuda.open_array(region.handle, 0, region.byte_size, np.dtype(np.uint8),
                                                (region.byte_size,), lambda: None, reuse=False)
            except Exception as exc:
                raise InvalidArgumentError(
                    f"cannot map CUDA shared memory region '{name}': {exc}") from None
        cuda.copy_into(region.mapped, offset, src)

    # -- data --------------------------------------------------------------------------------

    def read(self, name: str, offset: int, byte_size: int,
             alloc: Callable[[int], np.ndarray] = lambda n: np.empty(n, np.uint8)) -> np.ndarray:
        """A copy of ``byte_size`` bytes at ``offset`` of region ``name``, in the flat uint8
        array ``alloc(byte_size)`` (called once the window is known to be inside it)."""
        region = self._hold(name, offset, byte_size)
        try:
            dst = alloc(byte_size)
            if not self._copied(region, offset, dst, write=False):
                _transfer(region, offset, dst.data.cast("B"), write=False)
            return dst
        finally:
            self._let_go(region)

    def write(self, name: str, offset: int, data: Any) -> None:
        """Copy ``data`` (bytes-like) to ``offset`` of region ``name``."""
        src = memoryview(data).cast("B")
        region = self._hold(name, offset, len(src))
        try:
            if not self._copied(region, offset, src, write=True):
                _transfer(region, offset, src, write=True)
        finally:
            self._let_go(region)

    # -- internals ---------------------------------------------------------------------------

    def _hold(self, name: str, offset: int, byte_size: int) -> _Region:
        """Region ``name``, checked to hold the window, kept open for a copy until
        :meth:`_let_go`."""
        with self._lock:
            region: _Region = _window(self._regions, name, offset, byte_size)
            region.users += 1
        return region

    def _let_go(self, region: _Region) -> None:
        with self._lock:
            region.users -= 1
            if region.users == 0 and self._regions.get(region.name) is not region:
                self._close(region)  # unregistered during the copy

    def _close(self, region: _Region) -> None:
        os.close(region.fd)
        if self._copier is not None:
            self._copier.forget(region.rid)

    def _copied(self, region: _Region, offset: int, buf: Any, write: bool) -> bool:
        """Whether the copier made this copy (a large one, ``buf`` in one of the server's
        segments). The object's size is checked first, so that only a shrink during the copy
        can end the copier; if it does, the request gets the error a kernel copy gives."""
        n = buf.nbytes
        if n < MIN_BYTES or self._copier is None or self._segments is None:
            return False
        where = self._segments.locate(np.frombuffer(buf, np.uint8))
        if where is None:
            return False
        seg, seg_off = where
        start = region.offset + offset
        _check_size(region, start, n, write)
        try:
            return self._copier.copy(region.rid, region.fd, start,
                                     segment_path(seg.name, seg.directory), seg_off, n, write)
        except CopierDied as exc:
            how = exc.how
        # (Out of the except clause: an error raised in it would hold the caught one, whose
        # traceback holds this frame, and so every caller's frame and what they view, until
        # the cyclic collector runs.)
        _check_size(region, start, n, write)
        log.warning("shm copier %s during a copy %s region '%s'; copying it here", how,
                    "into" if write else "out of", region.name)
        return False


def _window(regions: dict[str, Any], name: str, offset: int, byte_size: int) -> Any:
    """Region ``name`` of ``regions``, checked to hold ``byte_size`` bytes at ``offset``."""
    region = regions.get(name)
    if region is None:
        raise NotFoundError(f"Unable to find shared memory region: '{name}'")
    _check_window(name, offset, byte_size, region.byte_size)
    return region


def _listed(regions: dict[str, Any], name: str, kind: str) -> list[Any]:
    """Region ``name`` (NotFoundError in Triton's words), or all of them in name order, as
    Triton lists them."""
    if not name:
        return sorted(regions.values(), key=lambda r: r.name)
    region = regions.get(name)
    if region is None:
        raise NotFoundError(f"Unable to find {kind} shared memory region: '{name}'")
    return [region]


def _check_window(name: str, offset: int, byte_size: int, region_size: int) -> None:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InvalidArgumentError(f"Invalid offset for shared memory region: '{name}'")
    if isinstance(byte_size, bool) or not isinstance(byte_size, int) or byte_size < 0:
        raise InvalidArgumentError(f"Invalid byte size for shared memory region: '{name}'")
    if offset >= region_size:
        raise InvalidArgumentError(f"Invalid offset for shared memory region: '{name}'")
    if offset + byte_size > region_size:
        raise InvalidArgumentError(f"Invalid offset + byte size for shared memory region: '{name}'")


def _open(name: str, key: str, offset: int, byte_size: int) -> int:
    """Open shm object ``key`` (with or without its leading ``/``) and check that it holds
    ``offset + byte_size`` bytes; its descriptor. Errors name the key as the client gave it."""
    try:
        shm = posix_ipc.SharedMemory("/" + key.lstrip("/"), 0)
    except posix_ipc.ExistentialError:  # Triton's status and words (measured)
        raise InternalError(f"Unable to open shared memory region: '{key}'") from None
    except (posix_ipc.Error, OSError, ValueError) as exc:
        raise InternalError(f"Unable to open shared memory region: '{key}': {exc}") from None
    fd = shm.fd
    try:
        size = os.fstat(fd).st_size
        if offset + byte_size > size:
            raise InvalidArgumentError(f"failed to register shared memory region '{name}': invalid args")
        if byte_size == 0:  # Triton's words: its mmap's, and strerror(EINVAL) (measured)
            raise InvalidArgumentError(f"failed to register shared memory region '{name}': "
                                       "unable to process address spaceInvalid argument")
    except BaseException:
        os.close(fd)
        raise
    os.set_inheritable(fd, False)  # not into the stubs this server spawns
    return fd


#: A copy this large is split across threads: one kernel copy runs at about 70 % of a memcpy's
#: speed here (4.4 against 6.3 GB/s), two together at about a memcpy's (6.6-6.8 GB/s).
_SPLIT_BYTES = 8 << 20
_CHUNK_ALIGN = 1 << 20
_PARTS = max(1, min(4, os.cpu_count() or 1))
# The threads of the other parts (the caller copies one itself); started on first use.
_COPIERS = concurrent.futures.ThreadPoolExecutor(max(1, _PARTS - 1),
                                                 thread_name_prefix="tritonpy-shm-copy")


def _transfer(region: _Region, offset: int, buf: memoryview, *, write: bool) -> None:
    """Copy ``buf`` into (``write``) or out of the region at ``offset``, with ``pwritev`` /
    ``preadv`` on its object: a client that shrank it gets an error, not the server a
    SIGBUS. A write past the object's end would grow it: it is refused first (a shrink racing
    the write can only make the object bigger again, never crash anything). A large copy is
    split in parts copied together (see ``_SPLIT_BYTES``)."""
    start = region.offset + offset
    n = len(buf)
    if write:
        _check_size(region, start, n, write)
    # Writes are not split: the kernel serializes writes into one object (its inode lock), and
    # the threads of the other parts only spun waiting for it (measured: 2.16 ms for 16 MiB in
    # one part or two).
    parts = min(_PARTS, n // _SPLIT_BYTES + 1) if n >= _SPLIT_BYTES and not write else 1
    if parts == 1:
        _copy_part(region, start, buf, write)
        return
    step = -(-n // parts // _CHUNK_ALIGN) * _CHUNK_ALIGN
    bounds = [(i, min(i + step, n)) for i in range(0, n, step)]
    others = [_COPIERS.submit(_copy_part, region, start + a, buf[a:b], write)
              for a, b in bounds[1:]]
    try:
        _copy_part(region, start, buf[:bounds[0][1]], write)
    finally:  # the others use ``buf``: wait for them whatever happened here
        concurrent.futures.wait(others)
    for fut in others:
        fut.result()  # the failure of the lowest part, if any


def _check_size(region: _Region, start: int, n: int, write: bool) -> None:
    """Fail unless the region's object still holds the ``n`` bytes at ``start``."""
    try:
        size = os.fstat(region.fd).st_size
    except OSError as exc:
        raise _failed(region, write, exc) from None
    if size < start + n:
        raise _shrunk(region, max(start, size), write)


def _copy_part(region: _Region, at: int, buf: memoryview, write: bool) -> None:
    done, n = 0, len(buf)
    try:
        while done < n:
            k = (os.pwritev if write else os.preadv)(region.fd, [buf[done:]], at + done)
            if k <= 0:
                raise _shrunk(region, at + done, write)
            done += k
    except OSError as exc:
        raise _failed(region, write, exc) from None


def _failed(region: _Region, write: bool, exc: OSError) -> InvalidArgumentError:
    return InvalidArgumentError(f"shared memory region '{region.name}' cannot be "
                                f"{'written' if write else 'read'}: {exc.strerror}")


def _shrunk(region: _Region, end: int, write: bool) -> InvalidArgumentError:
    """The error for a window whose byte ``end`` the region's object no longer holds."""
    return InvalidArgumentError(
        f"shared memory region '{region.name}' cannot be {'written' if write else 'read'}: "
        f"its shm object '{region.key}' no longer holds byte {end} (it was truncated after "
        "the region was registered); register it again at its new size")
