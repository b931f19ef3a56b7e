"""GPU tensor handles as the host sees them: checked before use, passed on as they came, and
released to their sender once the host's stand-in (DeviceRef) is gone. No CUDA is touched here:
the host never maps device memory (the stub side runs in tests/bls/test_gpu_tensors.py)."""
from __future__ import annotations

import gc
import importlib.util
from collections.abc import Iterator

import numpy as np
import pytest
from _helpers import MiB

from tritonpy.shm import Peer, Pool, ProtocolError, TensorTransport
from tritonpy.shm.cuda import GPU, DeviceRef

HANDLE = bytes(range(64))


@pytest.fixture
def host(shm_prefix: str) -> Iterator[TensorTransport]:
    pool = Pool(prefix=shm_prefix, default_size=MiB)
    transport = TensorTransport(pool, writable_inline=False, private_views=False,
                                device_refs=True)
    try:
        yield transport
    finally:
        pool.close()
        transport.segments.close()


def test_a_gpu_handle_is_passed_on_as_it_came_and_released_when_dropped(host) -> None:
    sender, receiver = Peer("caller"), Peer("target")
    name, ref = host.decode(["IN", "FP32", [2, 8], [HANDLE, 256, 64, 7, GPU, 0]], sender)
    assert name == "IN" and type(ref) is DeviceRef
    assert (ref.dtype, ref.shape, ref.ndim, ref.nbytes) == (np.dtype(np.float32), (2, 8), 2, 64)
    wire = host.encode("IN", ref, receiver)
    assert wire[:3] == ["IN", "FP32", [2, 8]]
    handle, offset, nbytes, eid, kind, device = wire[3]
    assert (handle, offset, nbytes, kind, device) == (HANDLE, 256, 64, GPU, 0)
    assert receiver.outstanding == 1  # the host holds the stand-in for the receiver
    del ref
    gc.collect()
    assert sender.take_owed() == []  # the receiver has not let go yet
    receiver.release([eid])
    gc.collect()
    assert sender.take_owed() == [7]
    assert host.copies == 0


@pytest.mark.parametrize("data", [
    [HANDLE[:63], 0, 64, 11, GPU, 0],  # not a CUDA IPC handle
    [HANDLE, -1, 64, 11, GPU, 0],  # negative offset
    [HANDLE, 0, 65, 11, GPU, 0],  # size does not fit the shape
])
def test_a_bad_gpu_handle_is_refused_and_still_released(host, data: list) -> None:
    peer = Peer("caller")
    with pytest.raises(ProtocolError, match="GPU handle for tensor 'IN'"):
        host.decode(["IN", "FP32", [16], data], peer)
    assert peer.take_owed() == [11]


def test_a_gpu_handle_of_malformed_fields_is_refused(host) -> None:
    with pytest.raises(ProtocolError, match="malformed GPU handle"):
        host.decode(["IN", "FP32", [16], ["not bytes", 0, 64, 11, GPU, 0]], Peer())
    with pytest.raises(ProtocolError, match="GPU handle"):
        host.decode(["IN", "BYTES", [16], [HANDLE, 0, 64, 11, GPU, 0]], Peer())


def test_an_undecoded_gpu_handle_is_given_back(host) -> None:
    peer = Peer("caller")
    host.discard([["OUT", "FP32", [16], [HANDLE, 0, 64, 5, GPU, 0]]], peer)
    assert peer.take_owed() == [5]


def test_a_stub_without_cupy_refuses_a_gpu_tensor_naming_the_extra(shm_prefix: str) -> None:
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here: this is about a stub without it")
    pool = Pool(prefix=shm_prefix, default_size=MiB)
    stub_side = TensorTransport(pool)  # a stub's transport maps GPU handles with CuPy
    peer = Peer("host")
    try:
        with pytest.raises(ProtocolError, match=r"pip install 'tritonpy\[gpu\]'"):
            stub_side.decode(["IN", "FP32", [16], [HANDLE, 0, 64, 9, GPU, 0]], peer)
        assert peer.take_owed() == [9]
    finally:
        pool.close()
        stub_side.segments.close()


def test_a_clients_memory_stays_marked_not_to_be_kept_mapped(host) -> None:
    # A client's CUDA shared memory (7th element 0) is passed on with the mark, so that the
    # stub maps it for this request only.
    _, ref = host.decode(["IN", "FP32", [16], [HANDLE, 0, 64, 3, GPU, 0, 0]], Peer("host"))
    assert ref.reuse is False
    assert host.encode("IN", ref, Peer("stub"))[3][4:] == [GPU, 0, 0]
    _, ref = host.decode(["IN", "FP32", [16], [HANDLE, 0, 64, 4, GPU, 0]], Peer("host"))
    assert ref.reuse is True and len(host.encode("IN", ref, Peer("stub"))[3]) == 6
