"""A stand-in for CuPy where there is no GPU (tests only): host memory plays device memory.

There is no GPU on the machines the tests run on, so this is the one mock the suite allows: it
stands in for CuPy and for the CUDA driver. Each "device allocation" is a memfd mapped in the
process that made it; its "device pointer" is that mapping's address. Its pool hands a freed
allocation of the same size out again, as CuPy's does. A CUDA IPC handle names
the allocation by (pid, fd), and ``ipcOpenMemHandle`` in another process maps
``/proc/<pid>/fd/<fd>``: the memory is really shared across processes, as with CUDA IPC, so a
test sees whether tritonpy passes GPU tensors by handle, keeps them alive until released, and
closes what it opened. As CUDA does, it refuses to open a process's own handle.

It has what tritonpy, the tests' models and ``bls_bench.py --gpu`` call: ``ndarray`` (with
``__cuda_array_interface__``, ``data.ptr``, ``device``, ``get``, DLPack), ``empty``, ``ones``,
``arange``, ``asarray``, ``asnumpy``,
``ascontiguousarray``, ``from_dlpack``, ``+ * **``, ``cuda.runtime``'s IPC calls,
``cuda.UnownedMemory`` / ``MemoryPointer`` / ``Device`` / ``get_current_stream``, the default
memory pool's ``used_bytes()`` and ``cuda.memory.OutOfMemoryError``; and it puts its own
``address_range`` in ``tritonpy.shm.cuda`` (the driver call ``cuMemGetAddressRange``).
``_fake_stats()`` counts copies between host and "device" and IPC opens and closes.

The "device" holds ``FAKE_CUPY_CAPACITY`` bytes (default 1 GiB); an allocation's bytes count as
used until no array refers to it, as with CuPy's pool, so a test sees whether tritonpy keeps
the arrays of a failed execute alive.
"""
from __future__ import annotations

import mmap
import os
import struct
import threading
import types
import weakref
from typing import Any

import numpy

uint8 = numpy.uint8
int32 = numpy.int32
int64 = numpy.int64
float32 = numpy.float32
_CAPACITY = int(os.environ.get("FAKE_CUPY_CAPACITY", str(1 << 30)))
_used = [0]
_lock = threading.Lock()
_stats = {"d2h": 0, "h2d": 0, "ipc_open": 0, "ipc_close": 0}


class CUDARuntimeError(RuntimeError):
    pass


class OutOfMemoryError(MemoryError):
    def __init__(self, size: int, total: int) -> None:
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")


class _Mapping:
    """One stretch of fake device memory mapped in this process (made here, or opened)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.mm = mmap.mmap(fd, max(size, 1))
        self.bytes = numpy.frombuffer(self.mm, numpy.uint8)
        self.base = int(self.bytes.ctypes.data)


class _Block:
    """One allocation handed out by the pool; back to the pool when no array refers to it."""

    __slots__ = ("mapping", "__weakref__")


# base address -> mapping: allocations made here (kept by the pool, as CuPy's, until
# free_all_blocks) and handles opened here (until ipcCloseMemHandle).
_made: dict[int, _Mapping] = {}
_opened: dict[int, _Mapping] = {}
_free_blocks: dict[int, list[_Mapping]] = {}  # by size, as CuPy's pool reuses them


def _malloc(nbytes: int) -> _Block:
    if _used[0] + nbytes > _CAPACITY:
        raise OutOfMemoryError(nbytes, _used[0])
    free = _free_blocks.get(nbytes)
    if free:
        m = free.pop()
    else:
        fd = os.memfd_create("fake-cupy", os.MFD_CLOEXEC)
        os.ftruncate(fd, max(nbytes, 1))
        m = _Mapping(fd, nbytes)
        _made[m.base] = m
    _used[0] += nbytes
    block = _Block()
    block.mapping = m
    weakref.finalize(block, _recycle, m)
    return block


def _recycle(m: _Mapping) -> None:
    _used[0] -= m.size
    _free_blocks.setdefault(m.size, []).append(m)


def _find(ptr: int) -> _Mapping:
    for table in (_made, _opened):
        for base, m in list(table.items()):
            if base <= ptr < base + max(m.size, 1):
                return m
    raise CUDARuntimeError(f"cudaErrorInvalidValue: {ptr:#x} is not device memory")


def _address_range(ptr: int) -> tuple[int, int]:
    m = _find(ptr)
    return m.base, m.size


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner: Any, device_id: int | None = None) -> None:
        self.ptr = ptr
        self.size = size
        self.owner = owner
        self._mapping = _find(ptr)


class MemoryPointer:
    def __init__(self, mem: Any, offset: int) -> None:
        self.mem = mem
        self.ptr = mem.ptr + offset


class _Device:
    def __init__(self, device: int | None = None) -> None:
        self.id = 0 if device is None else int(device)

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def use(self) -> None:
        pass


class _Stream:
    def synchronize(self) -> None:
        pass


class ndarray:
    def __init__(self, shape: Any, dtype: Any = float, memptr: MemoryPointer | None = None) -> None:
        dt = numpy.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(numpy.prod(shape, dtype=numpy.int64)) * dt.itemsize
        if nbytes == 0 and memptr is None:  # as CuPy: no memory at all, a null pointer
            self.data = MemoryPointer(types.SimpleNamespace(ptr=0), 0)
            self._host = numpy.empty(shape, dt)
            return
        if memptr is None:
            block = _malloc(nbytes)
            mem_map = block.mapping
            memptr = MemoryPointer(types.SimpleNamespace(ptr=mem_map.base, block=block), 0)
        else:
            mem_map = _find(memptr.ptr)
        start = memptr.ptr - mem_map.base
        self.data = memptr
        self._mapping = mem_map
        self._host = mem_map.bytes[start:start + nbytes].view(dt).reshape(shape)

    # what tritonpy reads
    @property
    def shape(self) -> tuple[int, ...]:
        return self._host.shape

    @property
    def dtype(self) -> numpy.dtype:
        return self._host.dtype

    @property
    def nbytes(self) -> int:
        return self._host.nbytes

    @property
    def size(self) -> int:
        return self._host.size

    @property
    def ndim(self) -> int:
        return self._host.ndim

    @property
    def flags(self) -> Any:
        return self._host.flags

    @property
    def device(self) -> _Device:
        return _Device(0)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (int(self._host.ctypes.data), False), "strides": None}

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    def __dlpack__(self, stream: Any = None, **kw: Any) -> Any:
        return self._host.__dlpack__()  # (a host capsule: there is no device here)

    def get(self, stream: Any = None, order: str = "C", out: numpy.ndarray | None = None) -> numpy.ndarray:
        _stats["d2h"] += 1
        if out is None:
            return self._host.copy()
        out[...] = self._host
        return out

    def copy(self) -> ndarray:
        return _from_host(self._host)

    def __getitem__(self, key: Any) -> ndarray:
        part = self._host[key]
        if isinstance(part, numpy.ndarray) and numpy.shares_memory(part, self._host):
            view = ndarray.__new__(ndarray)  # a view, as CuPy's basic indexing gives
            # sharing the memory object, which keeps an opened handle's owner alive
            view.data = MemoryPointer(self.data.mem, int(part.ctypes.data) - self.data.mem.ptr)
            view._mapping = self._mapping
            view._host = part
            return view
        return _from_host(numpy.asarray(part))

    def set(self, arr: numpy.ndarray, stream: Any = None) -> None:
        _stats["h2d"] += 1
        self._host[...] = arr

    def __setitem__(self, key: Any, value: Any) -> None:
        self._host[key] = value._host if isinstance(value, ndarray) else value

    def __pow__(self, k: Any) -> ndarray:
        return _from_host(self._host ** _operand(k))

    def __mul__(self, k: Any) -> ndarray:
        return _from_host(self._host * _operand(k))

    def __add__(self, k: Any) -> ndarray:
        return _from_host(self._host + _operand(k))

    def __repr__(self) -> str:
        return f"fake_cupy.ndarray({self._host!r})"


def _operand(x: Any) -> Any:
    return x._host if isinstance(x, ndarray) else x


def _from_host(host: numpy.ndarray) -> ndarray:
    out = ndarray(host.shape, host.dtype)
    out._host[...] = host
    return out


def empty(shape: Any, dtype: Any = float) -> ndarray:
    return ndarray(shape, dtype)  # untouched pages: no host memory is used


def ones(shape: Any, dtype: Any = float) -> ndarray:
    return _from_host(numpy.ones(shape, dtype))


def arange(n: int, dtype: Any = None) -> ndarray:
    return _from_host(numpy.arange(n, dtype=dtype))


def asarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray) and dtype is None:
        return a
    _stats["h2d"] += 1
    return _from_host(numpy.asarray(a, dtype=dtype))


def ascontiguousarray(a: ndarray) -> ndarray:
    return a if a.flags.c_contiguous else _from_host(numpy.ascontiguousarray(a._host))


def asnumpy(a: Any) -> numpy.ndarray:
    if not isinstance(a, ndarray):
        return numpy.asarray(a)
    _stats["d2h"] += 1
    return a._host.copy()


def from_dlpack(obj: Any) -> ndarray:
    if isinstance(obj, ndarray):
        return obj
    raise TypeError("the fake CuPy takes only its own arrays through DLPack")


# -- CUDA IPC -----------------------------------------------------------------------------------
def _ipc_get(ptr: int) -> bytes:
    m = _made.get(ptr)
    if m is None:
        raise CUDARuntimeError(f"cudaErrorInvalidValue: {ptr:#x} is not the base of an allocation "
                               "made in this process")
    return struct.pack("<qqq", os.getpid(), m.fd, m.size).ljust(64, b"\0")


def _ipc_open(handle: bytes, flags: int = 0) -> int:
    pid, fd, size = struct.unpack("<qqq", bytes(handle)[:24])
    if pid == os.getpid():
        raise CUDARuntimeError("cudaErrorInvalidContext: a process cannot open its own IPC handle")
    local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    with _lock:
        m = _Mapping(local, size)
        os.close(local)
        _opened[m.base] = m
        _stats["ipc_open"] += 1
    return m.base


def _ipc_close(ptr: int) -> None:
    with _lock:
        if _opened.pop(ptr, None) is None:
            raise CUDARuntimeError(f"cudaErrorInvalidValue: {ptr:#x} was not opened")
        _stats["ipc_close"] += 1


def _fake_stats() -> dict:
    """Copies between host and "device", IPC handles opened and closed, handles open now."""
    return {**_stats, "open_now": len(_opened)}


class _Pool:
    def used_bytes(self) -> int:
        return _used[0]

    def free_all_blocks(self) -> None:
        for blocks in _free_blocks.values():
            for m in blocks:
                _made.pop(m.base, None)
                os.close(m.fd)
        _free_blocks.clear()


_POOL = _Pool()


def get_default_memory_pool() -> _Pool:
    return _POOL


runtime = types.SimpleNamespace(
    ipcGetMemHandle=_ipc_get, ipcOpenMemHandle=_ipc_open, ipcCloseMemHandle=_ipc_close,
    cudaIpcMemLazyEnablePeerAccess=1,
    getDeviceCount=lambda: int(os.environ.get("FAKE_CUPY_DEVICES", "1")), getDevice=lambda: 0,
    CUDARuntimeError=CUDARuntimeError)
cuda = types.SimpleNamespace(
    memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError), runtime=runtime,
    UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer, Device=_Device,
    get_current_stream=lambda: _Stream())

try:  # the driver call tritonpy makes itself (through ctypes, with a real GPU)
    import tritonpy.shm.cuda as _tritonpy_cuda

    _tritonpy_cuda.address_range = _address_range
except ImportError:
    pass
