"""Stub start-up time and in-process infer round trip, beside the substrate's floors.

Prints markdown tables:

* start-up (median of N): a bare stub process from spawn to its HELLO on the channel, and
  ``Server.load()`` of the ``identity`` bench model (spawn, import model.py, ``initialize``,
  ready) in explicit mode;
* in-process ``model.infer()`` round trip of the ``identity`` model (UINT8, the output is the
  input tensor handed back) at 16 B, 1 MiB and 64 MiB, beside the floors measured in the same
  run with ``shm_bench.py``'s own functions: the one-byte pipe ping-pong between two
  processes (the cross-process floor), one numpy memcpy of the size (a tensor entering shm is
  copied once), and the substrate's own channel transfer of that size (copy into shm, handle,
  release). The ratio columns divide tritonpy's time by the floor (pipe + memcpy) and by the
  substrate transfer.

Usage: ``python benchmarks/stub_bench.py [--quick]``. The machine is shared: run it once.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import shm_bench  # noqa: E402  (benchmarks/ is not a package)
from _limits import fmt_size, print_table  # noqa: E402

import tritonpy  # noqa: E402
from tritonpy.shm import sweep_orphans  # noqa: E402

REPO = os.path.join(HERE, "bench_models")
SIZES = (16, 1 << 20, 64 << 20)


def _median_s(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def startup(srv: tritonpy.Server, n: int) -> tuple[float, float]:
    """Median seconds: bare stub spawn -> HELLO, and load() of ``identity`` to ready."""
    from tritonpy._stubproc import StubProcess

    def bare() -> float:
        t = time.perf_counter()
        stub = StubProcess("bench_bare", "bench_bare", srv.transport, srv.options,
                           srv.frames, on_frame=lambda s, m: None, on_death=lambda s, r: None)
        try:
            stub.wait_hello(60)
            return time.perf_counter() - t  # stopping it is not part of start-up
        finally:
            stub.stop(finalize=False, timeout=2)

    hello = []
    loads = []
    for _ in range(n):
        hello.append(bare())
        t = time.perf_counter()
        srv.load("identity")
        assert srv.model("identity").ready()
        loads.append(time.perf_counter() - t)
        srv.unload("identity")
    return statistics.median(hello), statistics.median(loads)


def infer_rt(model: tritonpy.Model, size: int, reps: int) -> float:
    """Median seconds of one ``infer`` round trip of ``size`` bytes."""
    x = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)

    def once() -> None:
        r = model.infer({"INPUT0": x}).get(timeout=60)
        assert r.error is None, r.error
        assert r.outputs["OUTPUT0"].to_numpy().nbytes == size

    for _ in range(2):
        once()
    return _median_s(once, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples")
    args = ap.parse_args()
    n_start = 3 if args.quick else 9
    reps = {16: 300 if args.quick else 2000, 1 << 20: 50 if args.quick else 300,
            64 << 20: 5 if args.quick else 20}

    prefix = f"tpbench_stub_{os.getpid()}_"
    srv = tritonpy.Server(REPO, model_control_mode="explicit",
                          backend_config={"shm-region-prefix-name": prefix,
                                          "shm-default-byte-size": str(256 << 20)})
    try:
        srv.start()
        hello_s, load_s = startup(srv, n_start)
        srv.load("identity")
        model = srv.model("identity")
        ours = {size: infer_rt(model, size, reps[size]) for size in SIZES}
    finally:
        srv.stop()
        sweep_orphans(prefix)

    pipe = shm_bench.PipeFloor()
    try:
        pipe_us = shm_bench.round_trips([pipe.once], 2000 if args.quick else 20000)[0]
    finally:
        pipe.close()
    peer = shm_bench.Peer()
    try:
        floors = {}
        for size in SIZES:
            copy_in, _forward, memcpy = shm_bench.transfer(peer, size, max(3, reps[size] // 2))
            floors[size] = (copy_in, memcpy)
    finally:
        peer.close()
        sweep_orphans(shm_bench.PREFIX)

    print_table(f"Stub start-up (median of {n_start})", ["what", "ms"], [
        ["spawn -> HELLO (bare stub)", f"{hello_s * 1e3:.1f}"],
        ["load(): spawn -> initialize -> ready (identity)", f"{load_s * 1e3:.1f}"],
    ])
    rows = []
    for size in SIZES:
        copy_in, memcpy = floors[size]
        floor = pipe_us / 1e6 + memcpy
        rows.append([fmt_size(size), f"{ours[size] * 1e6:.1f}", f"{pipe_us:.1f}",
                     f"{memcpy * 1e6:.1f}", f"{copy_in * 1e6:.1f}",
                     f"{ours[size] / floor:.1f}x", f"{ours[size] / copy_in:.1f}x"])
    print_table("In-process infer round trip, identity model (median µs)",
                ["size", "tritonpy infer", "pipe floor", "memcpy", "substrate transfer",
                 "vs floor (pipe+memcpy)", "vs substrate"], rows)


if __name__ == "__main__":
    main()
