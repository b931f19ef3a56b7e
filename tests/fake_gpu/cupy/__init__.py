"""A stand-in for CuPy where there is no GPU (tests only): host memory plays device memory.

It has just what ``tritonpy stress``'s GPU model calls: ``empty``, ``arange``, ``**``,
``asnumpy``, the default memory pool's ``used_bytes()`` and ``cuda.memory.OutOfMemoryError``.
The "device" holds ``FAKE_CUPY_CAPACITY`` bytes (default 1 GiB); an array's bytes count as used
until the array object is garbage, as with CuPy's pool, so a test sees whether tritonpy keeps
the arrays of a failed execute alive.
"""
from __future__ import annotations

import os
import types
import weakref

import numpy

uint8 = numpy.uint8
int64 = numpy.int64
_CAPACITY = int(os.environ.get("FAKE_CUPY_CAPACITY", str(1 << 30)))
_used = [0]


class OutOfMemoryError(MemoryError):
    def __init__(self, size: int, total: int) -> None:
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")


def _release(nbytes: int) -> None:
    _used[0] -= nbytes


class ndarray:
    def __init__(self, host: numpy.ndarray) -> None:
        if _used[0] + host.nbytes > _CAPACITY:
            raise OutOfMemoryError(host.nbytes, _used[0])
        self._host = host
        _used[0] += host.nbytes
        weakref.finalize(self, _release, host.nbytes)

    def __pow__(self, k: int) -> ndarray:
        return ndarray(self._host ** k)


def empty(shape: int, dtype: object = float) -> ndarray:
    return ndarray(numpy.empty(shape, dtype))  # untouched pages: no host memory is used


def arange(n: int, dtype: object = None) -> ndarray:
    return ndarray(numpy.arange(n, dtype=dtype))


def asnumpy(a: ndarray) -> numpy.ndarray:
    return a._host.copy()


class _Pool:
    def used_bytes(self) -> int:
        return _used[0]

    def free_all_blocks(self) -> None:
        pass


_POOL = _Pool()


def get_default_memory_pool() -> _Pool:
    return _POOL


cuda = types.SimpleNamespace(memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError))
