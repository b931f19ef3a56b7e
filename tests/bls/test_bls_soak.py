"""Soak: 10,000 BLS calls — sync by shm handle (256 KiB tensors through identity), sync inline
(add_sub), async gathered (bls_async) and decoupled streams (bls_decoupled_async on square) —
and afterwards the host's and the stubs' RSS and the /dev/shm segment count are flat, the
host pool holds no bytes, no export is outstanding and no BLS call is left in the books.

A warm-up round first lets pools, caches and allocator arenas reach their steady size.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

import tritonpy
from _bls_models import (
    BLS_REPO,
    DECOUPLED_REPO,
    MiB,
    drive,
    fp32,
    infer_one,
    new_prefix,
    rss,
    segments,
    serve,
)

# Growth allowed over the whole soak: a leak of 1 KiB per call is ~10 MiB.
RSS_SLACK = 8 * MiB
MODELS = ["bls_driver", "identity", "add_sub", "bls_async", "bls_decoupled_async", "square"]
BIG = np.arange(64 * 1024, dtype=np.float32)  # 256 KiB: crosses by shm handle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def soak() -> Iterator[tuple[tritonpy.Server, str]]:
    prefix = new_prefix()
    with serve([BLS_REPO, DECOUPLED_REPO], prefix, model_control_mode="explicit",
               load_models=MODELS, backend_config={"shm-default-byte-size": str(4 * MiB),
                                                   "shm-growth-byte-size": str(4 * MiB)}) as srv:
        yield srv, prefix


def one_round(server: tritonpy.Server, scale: int) -> int:
    """BLS calls of every kind; returns how many BLS calls were made (each one checked)."""
    calls = 0
    for _ in range(scale):
        report, resp = drive(server, {"model": "identity", "outputs": ["OUTPUT0"],
                                      "data_as": "INPUT0", "repeat": 600,
                                      "return_output": "OUTPUT0"}, BIG)
        assert report["errors"] == 0 and report["exception"] is None, report
        assert np.array_equal(resp.outputs["OUTPUT0"].to_numpy(), BIG)
        calls += report["calls"]
        del resp
        report, _ = drive(server, {"model": "add_sub", "outputs": ["OUTPUT0"], "repeat": 300,
                                   "inputs": {"INPUT0": fp32(1, 2), "INPUT1": fp32(3, 4)}})
        assert report["errors"] == 0 and report["exception"] is None, report
        assert report["responses"][0]["outputs"]["OUTPUT0"]["values"] == [4.0, 6.0]
        calls += report["calls"]
    for _ in range(10 * scale):
        resp = infer_one(server, "bls_async", {"INPUT0": np.ones(4, np.float32),
                                               "INPUT1": np.ones(4, np.float32)},
                         parameters={"calls": 8})
        assert resp.error is None, resp.error
        assert resp.outputs["SUMS"].to_numpy()[7].tolist() == [9.0] * 4
        calls += 8
    for _ in range(10 * scale):
        resp = infer_one(server, "bls_decoupled_async", {"IN": np.array([1], np.int32)})
        assert resp.error is None, resp.error
        assert resp.outputs["OUT"].to_numpy().tolist() == [1, 2, 2]
        calls += 2
    return calls


def test_10k_bls_calls_keep_memory_and_segments_flat(soak) -> None:
    server, prefix = soak
    pids = {m: server.runtime(m).instances[0].stub.pid for m in MODELS}
    assert one_round(server, 1) == 1000  # warm-up
    rss0 = {m: rss(p) for m, p in pids.items()} | {"host": rss()}
    segs0 = segments(prefix)

    t0 = time.perf_counter()
    calls = one_round(server, 10)
    elapsed = time.perf_counter() - t0
    assert calls == 10_000

    rss1 = {m: rss(p) for m, p in pids.items()} | {"host": rss()}
    segs1 = segments(prefix)
    print(f"\n{calls} BLS calls in {elapsed:.2f} s; RSS MiB "
          + ", ".join(f"{k} {rss0[k] / MiB:.1f}->{rss1[k] / MiB:.1f}" for k in rss0)
          + f"; segments {len(segs0)} -> {len(segs1)}")
    assert {m: server.runtime(m).instances[0].stub.pid for m in MODELS} == pids  # no restart
    grown = {k: rss1[k] - rss0[k] for k in rss0 if rss1[k] - rss0[k] >= RSS_SLACK}
    assert not grown, f"RSS grew by (bytes): {grown}"
    assert len(segs1) <= len(segs0), (segs0, segs1)

    # Nothing held once the releases (batched, asynchronous) have gone round.
    def held() -> dict:
        out = {"host_pool_bytes": server.pool.usage()["used_bytes"]}
        for m in MODELS:
            (inst,) = server.runtime(m).instances
            out[m] = (inst.stub.channel.peer.outstanding, len(inst.bls_calls),
                      len(inst.waiting_on), len(inst.active))
        return out

    idle = {"host_pool_bytes": 0} | {m: (0, 0, 0, 0) for m in MODELS}
    deadline = time.monotonic() + 10
    while held() != idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held() == idle
