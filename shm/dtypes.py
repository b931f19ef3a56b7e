"""Triton data types, their numpy equivalents, and the BYTES tensor codec.

BYTES tensors are numpy object arrays of ``bytes`` (or ``str``) on the Python side and travel in
Triton's layout: each element as a little-endian uint32 length followed by its bytes.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ._errors import ProtocolError, TruncatedElementError

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
try:
    # numpy has no bfloat16: ml_dtypes' (which tritonclient also uses for BF16) stands in.
    import ml_dtypes

    BFLOAT16: Any = np.dtype(ml_dtypes.bfloat16)
    TRITON_TO_NUMPY["BF16"] = ml_dtypes.bfloat16
except Exception:  # pragma: no cover - a stub's own environment without it, or with a numpy
    # it was not built for (EXECUTION_ENV_PATH): no BF16 there
    BFLOAT16 = None
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


class TruncatedPrefixError(ProtocolError):
    """A BYTES tensor that ends inside an element's 4-byte length prefix."""

    def __init__(self, available: int) -> None:
        super().__init__(f"truncated BYTES tensor: a length prefix is cut short ({available} of "
                         "its 4 bytes present)")
        self.available = available


class ElementCountError(ProtocolError):
    """A BYTES tensor that holds more or fewer elements than its shape says."""

    def __init__(self, found: int, expected: int) -> None:
        super().__init__(f"BYTES tensor holds {found} elements, expected {expected}")
        self.found = found
        self.expected = expected


_LEN = struct.Struct("<I").pack
#: Elements (de)serialized per numpy call for large BYTES tensors, so that no single call holds
#: the GIL for long (other threads, e.g. the host's event loop, run between chunks).
_CHUNK = 1 << 18
_MAX_ELEMENT = (1 << 32) - 1


def serialize_bytes(arr: np.ndarray) -> bytes:
    """Encode an array of bytes/str in Triton's length-prefixed layout (C order).

    Time and memory stay linear in the payload: equal-length elements (the common case) are
    laid out by numpy in one pass; otherwise many small elements are scattered through a byte
    mask and large ones joined, never through per-byte index arrays.
    """
    flat = np.asarray(arr).ravel(order="C")
    if flat.size == 0:
        return b""
    if flat.size > _CHUNK:
        # The layout is the elements' encodings end to end, so chunks encode independently;
        # each numpy call then holds the GIL for a chunk only, not for millions of elements.
        return b"".join([serialize_bytes(flat[i:i + _CHUNK]) for i in range(0, flat.size, _CHUNK)])
    if flat.dtype.kind == "S":
        items = flat.tolist()
    else:
        items = [_as_bytes(x) for x in flat.tolist()]
    n = len(items)
    lengths = np.fromiter(map(len, items), dtype=np.int64, count=n)
    payload = int(lengths.sum())
    if int(lengths.max()) > _MAX_ELEMENT:
        raise ValueError("a BYTES element is 4 GiB or larger; Triton's layout cannot hold it")
    first = int(lengths[0])
    if first < 1024 and bool(np.all(lengths == first)):
        out = np.empty((n, first + 4), dtype=np.uint8)
        out[:, :4] = np.frombuffer(_LEN(first), dtype=np.uint8)
        if first:
            out[:, 4:] = np.frombuffer(b"".join(items), dtype=np.uint8).reshape(n, first)
        return out.tobytes()
    if payload >= 64 * n:
        parts: list[bytes] = []
        extend = parts.extend
        for x in items:
            extend((_LEN(len(x)), x))
        return b"".join(parts)
    # Many small elements of mixed lengths: write the prefixes by index, the payload by mask.
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1] + 4, out=starts[1:])
    prefix_at = (starts[:, None] + np.arange(4)).ravel()
    flat = np.empty(payload + 4 * n, dtype=np.uint8)
    flat[prefix_at] = lengths.astype("<u4").view(np.uint8)
    is_payload = np.ones(flat.size, dtype=np.bool_)
    is_payload[prefix_at] = False
    flat[is_payload] = np.frombuffer(b"".join(items), dtype=np.uint8)
    return flat.tobytes()


def deserialize_bytes(buf: bytes | bytearray | memoryview | np.ndarray, count: int | None = None) -> np.ndarray:
    """Decode Triton's length-prefixed layout into a 1-D object array of ``bytes``.

    When every element has the same length (the common case) the split is done by numpy in one
    pass; otherwise the length prefixes are walked once.
    """
    mv = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else buf.view(np.uint8).data
    total = len(mv)
    if total == 0:
        if count:
            raise ElementCountError(0, count)
        return np.empty(0, dtype=object)
    if total < 4:
        raise TruncatedPrefixError(total)
    (first,) = struct.unpack_from("<I", mv, 0)
    stride = first + 4
    if total % stride == 0 and (count is None or count == total // stride):
        n = total // stride
        rows = np.frombuffer(mv, dtype=np.uint8).reshape(n, stride)
        if np.all(rows[:, :4].copy().view("<u4") == first):
            out = np.empty(n, dtype=object)
            payload = rows[:, 4:].tobytes()
            for start in range(0, n, _CHUNK):  # chunks: see serialize_bytes
                end = min(n, start + _CHUNK)
                out[start:end] = [payload[i * first:(i + 1) * first] for i in range(start, end)]
            return out
    items: list[bytes] = []
    off = 0
    unpack = struct.unpack_from
    while off < total:
        if off + 4 > total:
            raise TruncatedPrefixError(total - off)
        (n,) = unpack("<I", mv, off)
        off += 4
        if off + n > total:
            if count is not None and len(items) >= count:
                # Past the elements asked for: one more, whatever its length says (as
                # Triton 2.51 counts it, measured), not a length read from their bytes.
                raise ElementCountError(len(items) + 1, count)
            raise TruncatedElementError(n, total - off)
        items.append(bytes(mv[off:off + n]))
        off += n
    if count is not None and len(items) != count:
        raise ElementCountError(len(items), count)
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out
