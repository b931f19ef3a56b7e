"""Two processes exchange tensors of every Triton type over a real Channel, both directions."""
from __future__ import annotations

import numpy as np
import pytest
from _helpers import ALL_TYPES, MiB, bytes_equal, digest, make_array, wait_for

from tritonpy.shm import INLINE_LIMIT, numpy_dtype


def _sizes(triton_type: str) -> list[int]:
    item = 1 if triton_type == "BYTES" else numpy_dtype(triton_type).itemsize
    # empty, one element, the inline limit exactly, just past it (a handle), a few MiB
    return [0, item, INLINE_LIMIT, INLINE_LIMIT + item, 3 * MiB + 5 * item]


@pytest.mark.parametrize("triton_type", ALL_TYPES)
def test_every_dtype_both_directions(shm_child, triton_type: str) -> None:
    child = shm_child()
    sent = {}
    for i, nbytes in enumerate(_sizes(triton_type)):
        arr = make_array(triton_type, nbytes, seed=i)
        sent[f"flat{i}"] = arr
        if arr.size and arr.size % 6 == 0:
            sent[f"shaped{i}"] = arr.reshape(2, 3, -1)
    sent["empty2d"] = make_array(triton_type, 0).reshape(0, 4)
    sent["noncontig"] = make_array(triton_type, 4096, seed=99)[::3]

    reply = child.send_tensors("echo", sent)

    # parent -> child: the child saw exactly what was sent
    assert reply["digests"] == {n: digest(a) for n, a in sent.items()}
    # child -> parent: what comes back (a copy made in the child's own pool) is identical
    back = child.decode(reply["outputs"])
    assert set(back) == set(sent)
    for name, arr in sent.items():
        assert bytes_equal(arr, back[name]), name
        if triton_type != "BYTES":
            assert back[name].dtype == numpy_dtype(triton_type)
    # large ones crossed as handles into the other process's segments, both ways
    big = [n for n, a in sent.items() if a.nbytes > INLINE_LIMIT and triton_type != "BYTES"]
    for name in big:
        assert child.transport.segments.locate(back[name]) is not None, name
    del back
    # every block is given back on both sides once the views are gone
    assert wait_for(lambda: child.used() == 0)
    assert wait_for(lambda: child.call("stats")["usage"]["used_bytes"] == 0)


def test_bytes_kinds_survive_the_trip(shm_child) -> None:
    """str, empty strings, non-ASCII and embedded NULs; bytes come back as bytes."""
    child = shm_child()
    items = ["", "héllo", "a\x00b\x00", "\x00\x00", "日本", b"\xff\x00\xfe", b""]
    obj = np.array(items, dtype=object)
    fixed = np.array([b"ab", b"a\x00c", b""], dtype="S3")
    uni = np.array(["ünï", "", "x"], dtype="U3")
    big = np.array([("é\x00" * 50_000)] * 3, dtype=object)  # > inline limit: through shm
    reply = child.send_tensors("echo", {"obj": obj, "fixed": fixed, "uni": uni, "big": big})
    back = child.decode(reply["outputs"])
    assert back["obj"].tolist() == [x.encode() if isinstance(x, str) else x for x in items]
    assert back["fixed"].tolist() == fixed.tolist()
    assert back["uni"].tolist() == [x.encode() for x in uni.tolist()]
    assert back["big"].tolist() == [x.encode() for x in big.tolist()]
    assert all(type(x) is bytes for x in back["obj"].tolist())


@pytest.mark.slow
def test_256_mib_both_directions(shm_child) -> None:
    child = shm_child()
    arr = np.empty(256 * MiB // 4, dtype=np.float32)
    arr[:] = np.arange(arr.size, dtype=np.float32)  # cheap to make, every page distinct
    reply = child.send_tensors("echo", {"huge": arr})
    assert reply["digests"]["huge"] == digest(arr)
    back = child.decode(reply["outputs"])["huge"]
    assert back.shape == arr.shape and back.dtype == arr.dtype
    assert np.array_equal(back, arr)
    assert child.transport.copies == arr.nbytes  # exactly one copy into shm on our side
