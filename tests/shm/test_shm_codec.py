"""The BYTES codec and the Triton <-> numpy type map."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from _helpers import NUMERIC_TYPES

from tritonpy.shm import (
    TRITON_TO_NUMPY,
    ProtocolError,
    deserialize_bytes,
    numpy_dtype,
    serialize_bytes,
    triton_dtype_of,
)


def reference(items: list[bytes]) -> bytes:
    """Triton's layout written the obvious way."""
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def obj(items: list) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr


CASES = {
    "empty": [],
    "one-empty": [b""],
    "all-empty": [b""] * 7,
    "equal": [b"abcd", b"efgh", b"\x00\x00\x00\x00"],
    "mixed": [b"", b"a", b"bc\x00", b"\xff" * 300, b""],
    "nul-only": [b"\x00", b"\x00\x00"],
    "long": [b"x" * 100_000, b"y"],
    "many-small": [bytes([i % 256]) * (i % 7) for i in range(5000)],
    "many-equal": [bytes([i % 256]) * 3 for i in range(5000)],
    "equal-long": [b"z" * 5000] * 3,
    # More elements than one chunk (dtypes._CHUNK): encoded and decoded chunk by chunk.
    "chunks-mixed": [bytes([i % 256]) * (i % 5) for i in range(300_000)],
    "chunks-equal": [bytes([i % 256]) * 2 for i in range(300_000)],
}


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_matches_reference_layout(name: str) -> None:
    items = CASES[name]
    data = serialize_bytes(obj(items))
    assert data == reference(items)
    out = deserialize_bytes(data, len(items))
    assert out.dtype == object and out.shape == (len(items),)
    assert out.tolist() == items and all(type(x) is bytes for x in out.tolist())


def test_str_and_other_inputs_are_utf8() -> None:
    items = ["", "héllo", "a\x00b", "日本", "🙂"]
    assert serialize_bytes(obj(items)) == reference([s.encode() for s in items])
    assert serialize_bytes(np.array(items)) == reference([s.encode() for s in items])  # <U
    assert serialize_bytes(np.array([b"ab", b"c"], dtype="S2")) == reference([b"ab", b"c"])
    assert serialize_bytes(obj([bytearray(b"q"), np.bytes_(b"r"), 7])) == reference(
        [b"q", b"r", b"7"])


def test_c_order_of_multidimensional_and_noncontiguous() -> None:
    arr = obj([str(i).encode() * (i % 3) for i in range(12)]).reshape(3, 4)
    assert serialize_bytes(arr) == reference(arr.ravel().tolist())
    assert serialize_bytes(arr.T) == reference(arr.T.ravel().tolist())
    assert serialize_bytes(arr[:, ::2]) == reference(arr[:, ::2].ravel().tolist())


def test_vectorised_and_general_paths_agree() -> None:
    equal = [bytes([i % 256]) * 5 for i in range(1000)]
    data = reference(equal)
    fast = deserialize_bytes(data)  # equal lengths: one numpy pass
    general = deserialize_bytes(data + reference([b"x"]))  # one odd element: the walk
    assert fast.tolist() == equal and general.tolist() == equal + [b"x"]
    # 18 bytes = 3 strides of the first element, but the prefixes differ: the walk decides
    tricky = [b"ab", b"", b"wxyz"]
    assert len(reference(tricky)) == 3 * (4 + 2)
    assert deserialize_bytes(reference(tricky)).tolist() == tricky
    assert deserialize_bytes(reference(tricky), 3).tolist() == tricky


def test_accepts_memoryview_and_uint8_array() -> None:
    data = reference([b"ab", b"cde"])
    assert deserialize_bytes(memoryview(data)).tolist() == [b"ab", b"cde"]
    assert deserialize_bytes(np.frombuffer(data, np.uint8)).tolist() == [b"ab", b"cde"]


@pytest.mark.parametrize("data, count", [
    (b"\x01\x00", None),  # prefix cut short
    (struct.pack("<I", 5) + b"abc", None),  # element runs past the end
    (reference([b"ab"]) + b"\x01", None),  # trailing byte
    (reference([b"ab", b"cd"])[:-1], None),
    (struct.pack("<I", 0xFFFFFFFF) + b"x", None),  # absurd length
    (reference([b"ab", b"cd"]), 3),  # wrong element count
    (reference([b"ab", b"cd"]), 1),
    (reference([b"a", b"bc"]), 3),
    (b"", 2),  # nothing where elements were promised
])
def test_truncated_or_inconsistent_buffers_are_rejected(data: bytes, count: int | None) -> None:
    with pytest.raises(ProtocolError):
        deserialize_bytes(data, count)


def test_type_map() -> None:
    for t in NUMERIC_TYPES:
        dt = numpy_dtype(t)
        assert dt == np.dtype(TRITON_TO_NUMPY[t])
        assert triton_dtype_of(np.zeros(1, dt)) == t
        assert numpy_dtype("TYPE_" + t) == dt
    assert numpy_dtype("BYTES") == np.dtype(object) == numpy_dtype("TYPE_STRING")
    for arr in (obj([b"a"]), np.array([b"a"]), np.array(["a"])):
        assert triton_dtype_of(arr) == "BYTES"
    with pytest.raises(ProtocolError):
        numpy_dtype("FP128")
    with pytest.raises(TypeError):
        triton_dtype_of(np.zeros(1, np.complex64))
