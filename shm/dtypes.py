"""Triton data types, their numpy equivalents, and the BYTES tensor codec.

BYTES tensors are numpy object arrays of ``bytes`` (or ``str``) on the Python side and travel in
Triton's layout: each element as a little-endian uint32 length followed by its bytes.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ._errors import ProtocolError

TRITON_TO_NUMPY: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}
_NUMPY_TO_TRITON = {np.dtype(v): k for k, v in TRITON_TO_NUMPY.items() if k != "BYTES"}
ITEMSIZE = {k: (np.dtype(v).itemsize if k != "BYTES" else 0) for k, v in TRITON_TO_NUMPY.items()}
ALL_TYPES = frozenset(TRITON_TO_NUMPY) | {"BF16"}


def triton_dtype_of(arr: np.ndarray) -> str:
    """The Triton type name of a numpy array (object, bytes and str arrays are BYTES)."""
    dt = arr.dtype
    t = _NUMPY_TO_TRITON.get(dt)
    if t is not None:
        return t
    if dt.kind in ("O", "S", "U"):
        return "BYTES"
    raise TypeError(f"numpy dtype {dt} has no Triton equivalent")


def numpy_dtype(triton_dtype: str) -> np.dtype:
    """The numpy dtype for a Triton type name (``TYPE_`` prefix accepted)."""
    name = triton_dtype[5:] if triton_dtype.startswith("TYPE_") else triton_dtype
    if name == "STRING":
        name = "BYTES"
    try:
        return np.dtype(TRITON_TO_NUMPY[name])
    except KeyError:
        raise ProtocolError(f"unknown or unsupported Triton data type {triton_dtype!r}") from None


def _as_bytes(x: Any) -> bytes:
    if isinstance(x, bytes):
        return x
    if isinstance(x, str):
        return x.encode("utf-8")
    if isinstance(x, (bytearray, memoryview, np.bytes_)):
        return bytes(x)
    return str(x).encode("utf-8")


def serialize_bytes(arr: np.ndarray) -> bytes:
    """Encode an array of bytes/str in Triton's length-prefixed layout (C order)."""
    flat = np.asarray(arr).ravel(order="C")
    if flat.size == 0:
        return b""
    if flat.dtype.kind == "S":
        items = flat.tolist()
    else:
        items = [_as_bytes(x) for x in flat.tolist()]
    lengths = np.fromiter(map(len, items), dtype=np.int64, count=len(items))
    data = np.frombuffer(b"".join(items), dtype=np.uint8)
    n = len(items)
    starts = np.zeros(n, dtype=np.int64)
    if n > 1:
        np.cumsum(lengths[:-1] + 4, out=starts[1:])
    out = np.empty(int(lengths.sum()) + 4 * n, dtype=np.uint8)
    le = lengths.astype("<u4").view(np.uint8).reshape(n, 4)
    for k in range(4):
        out[starts + k] = le[:, k]
    if data.size:
        # Destination of every payload byte: its element's start + 4 + its index inside it.
        elem_of_byte = np.repeat(np.arange(n), lengths)
        within = np.arange(data.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[starts[elem_of_byte] + 4 + within] = data
    return out.tobytes()


def deserialize_bytes(buf: bytes | memoryview | np.ndarray, count: int | None = None) -> np.ndarray:
    """Decode Triton's length-prefixed layout into a 1-D object array of ``bytes``.

    When every element has the same length (the common case) the split is done by numpy in one
    pass; otherwise the length prefixes are walked once.
    """
    mv = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else memoryview(buf.view(np.uint8))
    total = len(mv)
    if total == 0:
        return np.empty(0, dtype=object)
    (first,) = struct.unpack_from("<I", mv, 0)
    stride = first + 4
    if total % stride == 0 and (count is None or count == total // stride):
        n = total // stride
        rows = np.frombuffer(mv, dtype=np.uint8).reshape(n, stride)
        if np.all(rows[:, :4].copy().view("<u4") == first):
            out = np.empty(n, dtype=object)
            payload = rows[:, 4:].tobytes()
            out[:] = [payload[i * first:(i + 1) * first] for i in range(n)]
            return out
    items = []
    off = 0
    unpack = struct.unpack_from
    while off < total:
        if off + 4 > total:
            raise ProtocolError("truncated BYTES tensor: a length prefix is cut short")
        (n,) = unpack("<I", mv, off)
        off += 4
        if off + n > total:
            raise ProtocolError(f"truncated BYTES tensor: element of {n} bytes runs past the end")
        items.append(bytes(mv[off:off + n]))
        off += n
    if count is not None and len(items) != count:
        raise ProtocolError(f"BYTES tensor holds {len(items)} elements, expected {count}")
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out
