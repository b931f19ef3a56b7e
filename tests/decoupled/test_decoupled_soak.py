"""Soak: 100,000 decoupled responses through the in-process API, and the host's and the stub's
RSS and the shm segment count stay flat (nothing is kept per response or per request).

The responses are counted and checked as they arrive, never stored. A warm-up run first lets
pools, caches and allocator arenas reach their steady size; the soak then must not grow them.
"""
from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import numpy as np
import pytest

import tritonpy
from _bls_models import DECOUPLED_REPO, MiB, new_prefix, rss, segments, serve

TOTAL = 100_000
PER_REQUEST = 10_000
WAIT_S = 30.0
# Growth allowed over the whole soak. A leak of even 100 bytes per response is ~10 MiB.
RSS_SLACK = 8 * MiB

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def soak() -> Iterator[tuple[tritonpy.Server, str]]:
    prefix = new_prefix()
    with serve(DECOUPLED_REPO, prefix, model_control_mode="explicit",
               load_models=["stream_n"]) as srv:
        yield srv, prefix


def drain(server: tritonpy.Server, n: int) -> int:
    """Run one stream_n request of ``n`` responses; check each as it arrives; count them."""
    stream = server.model("stream_n").infer({"N": np.array([n], np.int32)})
    deadline = time.monotonic() + WAIT_S
    expect = 0
    while True:
        try:
            resp = stream.get(timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Empty:
            raise AssertionError(f"stream stalled after {expect} of {n} responses") from None
        assert resp.error is None, resp.error
        if resp.final:
            assert not resp.outputs
            return expect
        assert int(resp.outputs["OUT"].to_numpy()[0]) == expect
        expect += 1


def test_100k_decoupled_responses_keep_memory_and_segments_flat(soak):
    server, prefix = soak
    (inst,) = server.runtime("stream_n").instances
    assert inst.stub is not None
    stub_pid = inst.stub.pid
    for _ in range(3):  # warm-up
        assert drain(server, PER_REQUEST) == PER_REQUEST
    host0, stub0, segs0 = rss(), rss(stub_pid), segments(prefix)

    t0 = time.perf_counter()
    got = sum(drain(server, PER_REQUEST) for _ in range(TOTAL // PER_REQUEST))
    elapsed = time.perf_counter() - t0
    host1, stub1, segs1 = rss(), rss(stub_pid), segments(prefix)

    assert got == TOTAL
    print(f"\n{TOTAL} decoupled responses in {elapsed:.2f} s ({TOTAL / elapsed:,.0f}/s); "
          f"host RSS {host0 / MiB:.1f} -> {host1 / MiB:.1f} MiB, stub RSS {stub0 / MiB:.1f} "
          f"-> {stub1 / MiB:.1f} MiB, segments {len(segs0)} -> {len(segs1)}")
    assert inst.stub.pid == stub_pid  # the same stub throughout
    assert host1 - host0 < RSS_SLACK, (host0, host1)
    assert stub1 - stub0 < RSS_SLACK, (stub0, stub1)
    assert len(segs1) <= len(segs0), (segs0, segs1)
    # Nothing left in flight on the host: the execute's own completion frame follows the
    # final response, so allow it a moment to arrive.
    deadline = time.monotonic() + 10
    while (inst.active or inst.inflight) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not inst.active and not inst.inflight
