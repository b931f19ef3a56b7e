"""The copies and messages of BLS round trips, counted on the real substrate.

* Messages: one request frame and one response frame per hop (client -> bls_driver, and
  bls_driver -> identity through the host), whatever the tensor size. RELEASE frames (batched
  lifetime traffic) are counted apart and left out.
* Copies: a tensor that already lives in shared memory crosses every hop by handle — the
  identity model's output is its input, and what comes back to the client is the very memory
  the client sent (``np.shares_memory``), with zero bytes copied by the host or the caller's stub.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator

import numpy as np
import pytest

import tritonpy
from _bls_models import BLS_REPO, MiB, bytes_tensor, collect, new_prefix, serve, text


@pytest.fixture(scope="module")
def server() -> Iterator[tritonpy.Server]:
    # No watchdog pings: they would add frames to the counts.
    with serve(BLS_REPO, new_prefix(), model_control_mode="explicit",
               load_models=["bls_driver", "identity"],
               backend_config={"stub-timeout-seconds": "0"}) as srv:
        yield srv


def _channel(server, model: str):
    (inst,) = server.runtime(model).instances
    return inst.stub.channel


def _frames(server) -> dict[str, int]:
    """Non-RELEASE frames on the host's channels to the two stubs, by direction."""
    drv, idt = _channel(server, "bls_driver"), _channel(server, "identity")
    return {
        "to_driver": drv.frames_sent - drv.release_frames_sent,
        "from_driver": drv.frames_received - drv.release_frames_received,
        "to_identity": idt.frames_sent - idt.release_frames_sent,
        "from_identity": idt.frames_received - idt.release_frames_received,
    }


def _settled_frames(server) -> dict[str, int]:
    prev = _frames(server)
    for _ in range(40):
        time.sleep(0.05)
        cur = _frames(server)
        if cur == prev:
            return cur
        prev = cur
    raise AssertionError(f"frame counters never settled: {prev}")


def _run(server, spec: dict, data: np.ndarray | None) -> tuple[dict, dict]:
    inputs = {"SPEC": bytes_tensor(json.dumps(spec))}
    if data is not None:
        inputs["DATA"] = data
    (resp,) = collect(server.model("bls_driver").infer(inputs), timeout=30)
    report = text(resp, "REPORT")
    assert report["exception"] is None, report["exception"]
    return report, resp


@pytest.mark.parametrize("calls", [1, 25])
@pytest.mark.parametrize("nbytes", [16, 4 * MiB], ids=["16B", "4MiB"])
def test_one_request_and_one_response_message_per_hop(server, nbytes: int, calls: int) -> None:
    data = np.arange(nbytes // 4, dtype=np.float32)
    spec = {"model": "identity", "outputs": ["OUTPUT0"], "data_as": "INPUT0", "repeat": calls}
    before = _settled_frames(server)
    report, _ = _run(server, spec, data)
    after = _settled_frames(server)
    delta = {k: after[k] - before[k] for k in after}
    assert report["calls"] == calls and report["errors"] == 0
    assert delta == {
        "to_driver": 1 + calls,      # EXECUTE + one BLS_RESPONSE per call
        "from_driver": calls + 1,    # one BLS_INFER per call + EXECUTE_DONE
        "to_identity": calls,        # one EXECUTE per call
        "from_identity": calls,      # one EXECUTE_DONE per call
    }, delta


def test_shm_tensor_round_trip_copies_nothing(server) -> None:
    n = 1 * MiB // 4
    data = server.pool.new_array(np.float32, (n,))  # the client's tensor is in shm already
    data[:] = np.arange(n, dtype=np.float32)
    tr = server.transport
    copies0, forwards0 = tr.copies, tr.forwards
    spec = {"model": "identity", "outputs": ["OUTPUT0"], "data_as": "INPUT0",
            "return_output": "OUTPUT0"}
    report, resp = _run(server, spec, data)
    out = resp.outputs["OUTPUT0"].to_numpy()
    # the same memory went client -> driver -> identity -> driver -> client
    assert np.shares_memory(out, data)
    np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32))
    assert tr.copies - copies0 == 0
    # host forwards: DATA to the driver, INPUT0 to identity, OUTPUT0 back to the driver
    assert tr.forwards - forwards0 == 3
    assert report["stub_copies"] == 0 and report["stub_forwards"] == 1
    (bls,) = report["responses"]
    assert bls["error"] is None
    params = bls["parameters"]  # identity saw a view of shm, not a private copy
    assert params == {"owndata": False, "mmap_view": True, "in_shm": True, "nbytes": n * 4}
    got = bls["outputs"]["OUTPUT0"]
    assert got["in_shm"] is True and got["owndata"] is False
    del out, resp


def test_plain_numpy_input_is_copied_once_at_the_edge(server) -> None:
    n = 2 * MiB // 4
    data = np.full(n, 3.0, np.float32)
    tr = server.transport
    copies0 = tr.copies
    spec = {"model": "identity", "outputs": ["OUTPUT0"], "data_as": "INPUT0",
            "return_output": "OUTPUT0", "repeat": 3}
    report, resp = _run(server, spec, data)
    out = resp.outputs["OUTPUT0"].to_numpy()
    np.testing.assert_array_equal(out, data)
    # the client's array enters shm once; three BLS round trips add no copy anywhere
    assert tr.copies - copies0 == data.nbytes
    assert report["stub_copies"] == 0 and report["stub_forwards"] == 3
    del out, resp


@pytest.mark.parametrize("timeout_us", [0, 60_000_000])
def test_bls_outputs_are_freed_once_released(server, timeout_us: int) -> None:
    # (with a long BLS timeout too: a finished request must not be kept until its deadline)
    def used() -> int:
        return server.pool.usage()["used_bytes"]

    def settle(limit: int) -> int:
        deadline = time.monotonic() + 5
        while used() > limit and time.monotonic() < deadline:
            time.sleep(0.02)
        return used()

    # releases of earlier tests travel asynchronously; idle, this server's pool is empty
    base = settle(0)
    assert base == 0, f"{base} bytes held before the test"
    n = 8 * MiB // 4
    data = server.pool.new_array(np.float32, (n,))
    data[:] = 1.0
    spec = {"model": "identity", "outputs": ["OUTPUT0"], "data_as": "INPUT0",
            "return_output": "OUTPUT0", "repeat": 5, "timeout": timeout_us}
    _, resp = _run(server, spec, data)
    assert used() >= base + data.nbytes
    del resp, data
    left = settle(0)
    assert left == 0, f"{left} bytes still held after every view was dropped"
