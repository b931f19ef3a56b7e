"""GPU tensors across processes: CUDA IPC handles, through CuPy (the ``gpu`` extra).

A GPU tensor crosses the channel as a handle like a shm one, with the device memory's CUDA IPC
handle in place of a segment name::

    [ipc_handle: bytes, offset, nbytes, export_id, GPU, device]      (or one more element, 0,
                                                                     for a client's memory)

``ipc_handle`` names the whole device allocation the tensor lies in (``cudaIpcGetMemHandle`` of
its base, found with the driver's ``cuMemGetAddressRange``) and ``offset`` is where the tensor
starts in it, so a tensor CuPy's memory pool carved out of a bigger block still travels as is.
The release protocol is the shm one: the sender keeps the array in its export table until the
receiver's last view dies.

The host does not map GPU tensors: it holds a :class:`DeviceRef` in place of the array and
passes the handle on (a BLS input to its target, a target's output back to its caller). A stub
maps a handle once per allocation (``cudaIpcOpenMemHandle``, counted) and keeps the last few it
is done with open for the next tensor in the same allocation (CuPy's pool hands allocations
out again); a handle of its own memory that comes back to it (an identity model's output) is its own array,
since CUDA refuses to open a process's own handle.

CuPy is imported on first use only, so that a process that never sees a GPU tensor never
creates a CUDA context.
"""
from __future__ import annotations

import collections
import ctypes
import threading
import weakref
from typing import Any, Callable

import numpy as np

from ._errors import ProtocolError

GPU = 2  # a handle's fifth element for a GPU tensor (1 is IMMUTABLE, for shm)
IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
KDL_CUDA = 2  # DLPack device type of CUDA memory

_cupy: Any = None
_no_cupy = ""  # why CuPy could not be imported: tried once per process, not per tensor
_lock = threading.RLock()  # re-entrant: a finalizer may unmap from inside a map
# Allocations of this process that it gave handles for: handle -> base pointer.
_exported: dict[bytes, int] = {}
# Allocations of other processes mapped here: handle -> [base pointer, views alive].
_opened: dict[bytes, list[int]] = {}
# The same, by base pointer (an opened array sent on forwards the original handle).
_opened_ranges: dict[int, tuple[bytes, int]] = {}
# Mappings whose last view is gone, kept open (oldest first) because the sender's CuPy pool
# hands the same allocations out again: the next tensor in one of them costs no
# cudaIpcOpenMemHandle. A freed allocation's handle is never handed out again (CUDA makes a
# new one for new memory), so a kept mapping is only ever reused for the memory it maps.
IDLE_MAPPINGS = 16
_idle: collections.OrderedDict[bytes, int] = collections.OrderedDict()


def cupy() -> Any:
    """The ``cupy`` module; ProtocolError naming the ``gpu`` extra where it is missing."""
    global _cupy, _no_cupy
    if _cupy is None:
        if not _no_cupy:
            try:
                import cupy as cp
            except ImportError as exc:
                _no_cupy = str(exc)
            else:
                _cupy = cp
                return cp
        raise ProtocolError("a GPU tensor needs CuPy in this process: pip install "
                            f"'tritonpy[gpu]' ({_no_cupy})")
    return _cupy


def available() -> bool:
    """Whether CuPy can be imported here (imports it)."""
    try:
        cupy()
    except ProtocolError:
        return False
    return True


def is_device_array(obj: Any) -> bool:
    """True for a CuPy array (anything with ``__cuda_array_interface__``) or a DeviceRef."""
    return hasattr(obj, "__cuda_array_interface__") or type(obj) is DeviceRef


class DeviceRef:
    """The host's stand-in for a GPU tensor that it passes on without touching it.

    It has what routing and validation read of an array (``dtype``, ``shape``, ``ndim``,
    ``nbytes``); dropping the last reference owes the release to the process that sent it.
    """

    __slots__ = ("handle", "offset", "nbytes", "device", "dtype", "shape", "owner", "reuse",
                 "__weakref__")

    def __init__(self, handle: bytes, offset: int, nbytes: int, device: int, dtype: np.dtype,
                 shape: tuple[int, ...], owner: Any = None, reuse: bool = True) -> None:
        self.owner = owner  # what keeps the memory alive here (an embedder's CuPy array)
        # False for a client's CUDA shared memory: a stub must not keep it mapped for reuse
        # (the client may free it once it is unregistered).
        self.reuse = reuse
        self.handle = handle
        self.offset = offset
        self.nbytes = nbytes
        self.device = device
        self.dtype = dtype
        self.shape = shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def __repr__(self) -> str:
        return f"DeviceRef(GPU {self.device}, shape={list(self.shape)}, dtype={self.dtype})"


# -- the driver call CuPy does not wrap ---------------------------------------------------------
_libcuda: Any = None


def address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation that ``ptr`` lies in (``cuMemGetAddressRange``).

    The CUDA context must be current on this thread (``export`` makes it so).
    """
    global _libcuda
    if _libcuda is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise ProtocolError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from None
        fn = lib.cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                       ctypes.c_uint64]
        fn.restype = ctypes.c_int
        _libcuda = fn
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    status = _libcuda(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if status != 0:
        raise ProtocolError(f"cuMemGetAddressRange failed for device pointer {ptr:#x} "
                            f"(CUresult {status})")
    return int(base.value), int(size.value)


# -- sending ------------------------------------------------------------------------------------
def export(arr: Any) -> tuple[bytes, int, int]:
    """(ipc_handle, offset, device) for a C-contiguous CuPy array, once the work queued on the
    current stream is done (the receiver reads it on a stream of its own)."""
    cp = cupy()
    device = int(arr.device.id)
    ptr = int(arr.data.ptr)
    with _lock:
        for base, (handle, size) in _opened_ranges.items():
            if base <= ptr < base + size:  # mapped from elsewhere: pass the original on
                return handle, ptr - base, device
    with cp.cuda.Device(device):
        cp.cuda.get_current_stream().synchronize()
        base, _size = address_range(ptr)
        handle = bytes(cp.cuda.runtime.ipcGetMemHandle(base))
    with _lock:
        _exported[handle] = base
    return handle, ptr - base, device


def ref_of(arr: Any) -> DeviceRef:
    """A DeviceRef for a CuPy array of this process, which it keeps alive."""
    arr = contiguous(arr)
    handle, offset, device = export(arr)
    return DeviceRef(handle, offset, int(arr.nbytes), device, np.dtype(arr.dtype),
                     tuple(arr.shape), arr)


def contiguous(arr: Any) -> Any:
    """``arr`` itself when C-contiguous, else a C-contiguous copy on its device."""
    if arr.flags.c_contiguous:
        return arr
    return cupy().ascontiguousarray(arr)


# -- receiving ----------------------------------------------------------------------------------
class _Mapped:
    """Owner of one view's device memory: its death lets go of the mapping (with the last view
    of that allocation: kept open for reuse, or closed) and owes the release to the sender."""

    __slots__ = ("__weakref__",)


def _unmap(handle: bytes, release: Callable[[], None], reuse: bool) -> None:
    try:
        with _lock:
            entry = _opened.get(handle)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _opened[handle]
            _opened_ranges.pop(entry[0], None)
            if not reuse:
                _close(entry[0])
                return
            _idle[handle] = entry[0]
            while len(_idle) > IDLE_MAPPINGS:
                _close(_idle.popitem(last=False)[1])
    finally:
        release()


def _close(base: int) -> None:
    try:
        cupy().cuda.runtime.ipcCloseMemHandle(base)
    except Exception:
        pass  # the context is gone (interpreter exit): nothing left to close


def open_array(handle: bytes, offset: int, nbytes: int, dtype: np.dtype,
               shape: tuple[int, ...], release: Callable[[], None], reuse: bool = True) -> Any:
    """A CuPy array over another process's device memory; ``release`` runs once no view of
    it is left. ``reuse``: keep the mapping open then, for the next tensor in it (False: a
    client's region, whose owner may free it once unregistered)."""
    cp = cupy()
    own = _exported.get(handle)
    keep = _Mapped()
    if own is not None:  # our own memory came back: it is still alive (we hold the export)
        base = own
        weakref.finalize(keep, release)
    else:
        with _lock:  # held while mapping: the driver maps a handle once per process
            entry = _opened.get(handle)
            if entry is None:
                mapped = _idle.pop(handle, None)
                if mapped is None:
                    mapped = int(cp.cuda.runtime.ipcOpenMemHandle(
                        handle, cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess))
                entry = _opened[handle] = [mapped, 0]
            entry[1] += 1
            base = entry[0]
            seen = _opened_ranges.get(base)
            if seen is None or seen[1] < offset + nbytes:
                _opened_ranges[base] = (handle, offset + nbytes)
        weakref.finalize(keep, _unmap, handle, release, reuse)
    mem = cp.cuda.UnownedMemory(base + offset, nbytes, keep)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))


def copy_into(dst: Any, offset: int, src: np.ndarray) -> None:
    """Copy the bytes of host array ``src`` into 1-D uint8 CuPy array ``dst`` at ``offset``."""
    dst[offset:offset + src.nbytes].set(src.reshape(-1).view(np.uint8))


def to_host(arr: Any, out: np.ndarray | None = None) -> np.ndarray:
    """A copy of a CuPy array in host memory (into ``out`` when given)."""
    if out is None:
        return cupy().asnumpy(arr)
    contiguous(arr).get(out=out)
    return out


def to_device(arr: np.ndarray, device: int = 0) -> Any:
    """A copy of a numpy array on GPU ``device`` (of this process)."""
    cp = cupy()
    if not 0 <= device < cp.cuda.runtime.getDeviceCount():
        device = cp.cuda.runtime.getDevice()  # a GPU instance's stub sees its own device only
    with cp.cuda.Device(device):
        return cp.asarray(arr)
