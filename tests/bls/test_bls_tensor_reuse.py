"""An input Tensor sent by BLS again and again keeps its shared-memory copy.

Like the real Triton (which keeps the copy made at a Tensor's first send), a big tensor is
copied into shm at most twice (its first and second sends) and every later send reuses that
block without a copy. Whoever receives such a block may still write into its arrays, as with
Triton (whose receivers get copies): the writes stay private to the writer, so they never reach
the next call, the sender's kept copy, or another array of the same block. These tests drive
``reuse_caller`` -> ``scribble`` over real stubs and shared memory and check every call's data.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest

import tritonpy
from _bls_models import BLS_REPO, bytes_tensor, infer_one, new_prefix, serve, text
from tritonpy.shm.transport import KEEP_MIN_BYTES

BIG = KEEP_MIN_BYTES + 4096 + 5  # kept; not a whole number of pages


def pattern(n: int, plus: int = 0) -> np.ndarray:
    return ((np.arange(n) + plus) % 256).astype(np.uint8)


@pytest.fixture(scope="module")
def server() -> Iterator[tritonpy.Server]:
    with serve(BLS_REPO, new_prefix(), model_control_mode="explicit",
               load_models=["reuse_caller", "scribble"]) as srv:
        yield srv


def run(server: tritonpy.Server, **spec) -> tuple[dict, object]:
    resp = infer_one(server, "reuse_caller", {"SPEC": bytes_tensor(json.dumps(spec))}, timeout=60)
    return text(resp, "REPORT"), resp


def all_ok(report: dict, scribbled: tuple[int, ...] = ()) -> None:
    for i, call in enumerate(report["calls"]):
        assert call["input_ok"], f"call {i}: the target's input was not what the caller sent"
        assert call["output_ok"], f"call {i}: the output was not the target's (scribbled {scribbled})"
        assert call["writeable"], f"call {i}: the target's input is not writable"
        assert all(call["kept_ok"]), f"call {i}: a kept input changed: {call['kept_ok']}"


@pytest.mark.parametrize("use_async", [False, True], ids=["exec", "async_exec"])
def test_a_tensor_sent_again_is_copied_twice_then_reused(server, use_async: bool) -> None:
    host_copies = server.transport.copies
    report, _ = run(server, nbytes=BIG, calls=6, **{"async": use_async})
    all_ok(report)
    assert report["copies"] == 2 * BIG and report["reuses"] == 4
    assert server.transport.copies == host_copies  # the host forwards every handle
    # the kept block lives with the Tensor and is freed with it
    assert report["used_with_tensor"] >= report["used_before"] + BIG
    assert report["used_after"] == report["used_before"]


def test_a_small_tensor_is_copied_each_time(server) -> None:
    n = KEEP_MIN_BYTES - 4096
    report, _ = run(server, nbytes=n, calls=4)
    all_ok(report)
    assert report["copies"] == 4 * n and report["reuses"] == 0


def test_a_target_writing_into_its_input_changes_only_its_own_view(server) -> None:
    # calls 2 and 4 get the kept block and write into it; 3 and 5 must still see the original
    report, _ = run(server, nbytes=BIG, calls=6, scribble=[2, 4])
    all_ok(report, (2, 4))
    # the scribbled outputs were copied (their pages were written), the others forwarded
    assert report["reuses"] == 4 and report["copies"] == 2 * BIG


def test_the_caller_writing_into_an_output_does_not_reach_its_kept_copy(server) -> None:
    # identity outputs come back as views of the caller's own kept block
    report, _ = run(server, nbytes=BIG, calls=5, caller_writes=True)
    all_ok(report)
    assert report["reuses"] == 3


def test_arrays_kept_by_the_target_never_alias_each_other(server) -> None:
    # the target holds every input; later inputs are the same block, one of them written into
    report, _ = run(server, nbytes=BIG, calls=5, keep=True, scribble=[3])
    all_ok(report, (3,))
    assert report["calls"][-1]["kept_ok"] == [True] * 5
    server.unload("scribble")  # drops what it kept
    server.load("scribble")


def test_a_kept_block_returned_to_the_client_is_a_private_copy(server) -> None:
    report, resp = run(server, nbytes=BIG, calls=4, return_last=True)
    all_ok(report)
    out = resp.outputs["OUTPUT0"].to_numpy()
    np.testing.assert_array_equal(out, pattern(BIG))
    out[:] = 0  # the client's array is its own
    report, _ = run(server, nbytes=BIG, calls=3)
    all_ok(report)
    del out, resp
