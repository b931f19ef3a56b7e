"""idle-spin-microseconds: a stub with nothing to run polls its socket for its next request
before it sleeps, while its recent requests came within that time and no thread waits for a
CPU (``tritonpy.shm.waiting.cpus_busy``). What a user sees of it is the stub's CPU time, measured
here with psutil on a real stub fed one request at a time, a few milliseconds apart."""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import tritonpy
from _models import fp32, infer, new_prefix, pinned_beside_busy, serving, write_model


def _serve(tmp_path: Path, spin_us: str) -> Iterator[tritonpy.Server]:
    write_model(tmp_path, "double")
    with serving(tmp_path, new_prefix(), backend_config={"idle-spin-microseconds": spin_us}) as srv:
        yield srv


@pytest.fixture
def spinning(tmp_path: Path) -> Iterator[tritonpy.Server]:
    yield from _serve(tmp_path, "20000")


def stub_cpu_seconds(server: tritonpy.Server, gap_s: float, requests: int) -> float:
    """CPU seconds the stub of ``double`` spends on ``requests`` requests sent one at a time,
    ``gap_s`` apart (the client sleeps in between)."""
    (inst,) = server.runtime("double").instances
    proc = psutil.Process(inst.stub.pid)
    model = server.model("double")
    for _ in range(3):  # warm, and the stub's recent waits are these gaps
        infer(model, {"IN": fp32(1)})
        time.sleep(gap_s)
    before = sum(proc.cpu_times()[:2])
    for i in range(requests):
        assert infer(model, {"IN": fp32(i)}).outputs["OUT"].to_numpy().tolist() == [2 * i]
        time.sleep(gap_s)
    return sum(proc.cpu_times()[:2]) - before


def test_an_idle_stub_polls_for_its_next_request(spinning: tritonpy.Server) -> None:
    # 5 ms gaps, 20 ms of polling allowed: the stub polls through each whole gap, ~200 ms of
    # CPU for 40 requests on an idle machine (a stub that sleeps uses ~15 ms). With other tests
    # busy beside it, it polls less or not at all (it stops while threads wait for a CPU):
    # rounds go on for up to 20 s, and the best is asked to reach 60 ms.
    best, deadline = 0.0, time.monotonic() + 20
    while best < 0.06 and time.monotonic() < deadline:
        best = max(best, stub_cpu_seconds(spinning, gap_s=0.005, requests=40))
    assert best >= 0.06


def test_requests_further_apart_than_the_window_are_not_polled_for(
        spinning: tritonpy.Server) -> None:
    # 100 ms gaps: after at most two waits the moving mean of the waits is past 20 ms and the
    # stub sleeps at once; polling every gap would cost 10 x 20 ms = 200 ms of CPU.
    assert stub_cpu_seconds(spinning, gap_s=0.1, requests=10) < 0.1


def test_a_busy_machine_is_not_polled_on(spinning: tritonpy.Server) -> None:
    # Threads waiting for a CPU (more busy processes than one CPU can run): polling would take
    # a share of a CPU from them, so the stub sleeps. The busy processes run on one CPU and the
    # stub on another, so that the stub could poll through every gap undisturbed (~200 ms of
    # CPU, as above) if it did.
    (inst,) = spinning.runtime("double").instances
    with pinned_beside_busy(inst.stub.pid, hogs=len(os.sched_getaffinity(0)) + 1,
                            same_cpu=False):
        time.sleep(0.1)
        used = stub_cpu_seconds(spinning, gap_s=0.005, requests=40)
    assert used < 0.05, used


def test_zero_turns_polling_off(tmp_path: Path) -> None:
    for srv in _serve(tmp_path, "0"):
        assert stub_cpu_seconds(srv, gap_s=0.005, requests=40) < 0.05


@pytest.mark.parametrize("value, words", [
    ("-1", "idle-spin-microseconds must be between 0 and 1000000, got -1"),
    ("lots", "backend option 'idle-spin-microseconds' expects a number, got 'lots'"),
])
def test_a_bad_value_is_refused_naming_the_option(tmp_path: Path, value: str, words: str) -> None:
    with pytest.raises(tritonpy.InvalidArgumentError, match=words):
        tritonpy.Server(os.fspath(tmp_path), backend_config={"idle-spin-microseconds": value})
