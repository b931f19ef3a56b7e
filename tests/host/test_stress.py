"""``tritonpy stress``: every scenario against real servers, real stubs and real shared memory.

The command runs as a real subprocess in its own session (killed, group and all, whatever
happens) and its table is read as a user reads it. Where this machine cannot mount a private
``/dev/shm`` (not root, no ``unshare``), the shm scenario runs against a pool cap and says why
the rest of it was skipped; the test expects exactly that. The GPU scenario runs for real only
on a machine with a GPU and CuPy (``gpu`` mark); elsewhere a stand-in for CuPy plays the device
(``tests/fake_gpu``: host memory with a capacity, which is all that can be mocked here), so the
tool's logic and the stub's release of a failed execute's memory are still checked.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _models import communicate_in_session

from tritonpy import stress
from tritonpy._stress_models import write_repository
from tritonpy.stress import Answer, Row

pytestmark = pytest.mark.timeout(240)

FAKE_GPU = Path(__file__).resolve().parents[1] / "fake_gpu"


def run_stress(*args: str, env: dict[str, str] | None = None,
               timeout: float = 200) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tritonpy", "stress", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    out, err = communicate_in_session(proc, timeout)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.pid = proc.pid  # type: ignore[attr-defined]
    return done


def run_leftovers(pid: int) -> list[str]:
    """Segments that the ``tritonpy stress`` run of process ``pid`` left."""
    return stress.list_segments(f"{stress.PREFIX}{pid}x")


def rows_of(table: str) -> list[tuple[str, str, str, str]]:
    """(scenario, check, verdict, outcome) of each row, read back from the printed table."""
    lines = table.splitlines()
    header = lines[0]
    starts = [header.index(c) for c in ("scenario", "check", "seconds", "verdict", "outcome")]
    out = []
    for line in lines[2:]:
        if not line.strip():
            break
        cut = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [len(line)])]
        out.append((cut[0], cut[1], cut[3], cut[4]))
    return out


def test_every_scenario_passes_and_the_table_says_what_happened() -> None:
    no_private = stress.private_shm_unavailable(stress.DOCKER_SHM)
    proc = run_stress("--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = rows_of(proc.stdout)
    verdicts = [v for _, _, v, _ in rows]
    assert "FAILED" not in verdicts, proc.stdout
    assert [s for s, *_ in rows if s not in ("GPU memory full",)] == \
        ["shm full"] * (13 if no_private is None else 9) + ["message queue full"] * 5 \
        + ["stub killed"] * 6 + ["stub hung"] * 3 + ["host killed"]
    outcome = {(s, check): o for s, check, _, o in rows}
    verdict = {(s, check): v for s, check, v, _ in rows}

    shm = "shm full"
    if no_private is None:
        assert "asked for 134217728 bytes in /dev/shm" in \
            outcome[(shm, "client input of 128 MiB, /dev/shm of 64 MiB")]
        assert "shared memory exhausted" in outcome[(shm, "model output of 128 MiB")]
        assert outcome[(shm, "the other process gone: input of 32 MiB")] == "served"
        assert outcome[(shm, "shm-fallback-directory (on disk): input of 128 MiB")] == "served"
        assert "ShmExhaustedError: shared memory exhausted" in \
            outcome[(shm, "BLS call with an input of 128 MiB")]
        assert outcome[(shm, "BLS call with an input of 128 MiB")].endswith(
            "the next request is served")
        streamed = outcome[(shm, "stream of 16 responses of 8 MiB to a consumer 1 s late")]
        assert streamed == "all 16 came, in order" or "shared memory exhausted" in streamed
        assert verdict[(shm, "idle segments given back (every pool)")] == "ok"
        assert outcome[(shm, "a server started while /dev/shm is full")].startswith(
            "refused: shared memory exhausted (no space left): asked for 4096 bytes")
    else:
        assert "(pool cap): asked for 134217728 bytes" in \
            outcome[(shm, "client input of 128 MiB, a host pool capped at 64 MiB")]
        assert verdict[(shm, "model output larger than /dev/shm")] == "skipped"
        assert "needs a private /dev/shm" in outcome[(shm, "model output larger than /dev/shm")]
    if stress.visible_gpu_count() == 0:  # (the suite's servers count none: conftest.py)
        assert [(c, v, o) for s, c, v, o in rows if s == "GPU memory full"] == \
            [("CuPy allocations until CUDA runs out", "skipped", "no GPU: TRITONPY_GPU_COUNT=0")]

    mq = "message queue full"
    assert outcome[(mq, "stream of 20,000 responses to a consumer 1 s late")] == \
        "all 20,000 came, in order"
    assert outcome[(mq, "BLS stream of 5,000 into a stub not reading for 1 s")] == \
        "all 5,000 came, in order"
    assert outcome[(mq, "an async model awaits 1,000 BLS calls at once")].startswith(
        "all 1,000 answered right")
    assert outcome[(mq, "500 requests at once to one instance")].startswith(
        "500/500 answered right")
    assert "killed by signal SIGKILL" in \
        outcome[("stub killed", "SIGKILL to the stub in execute: that request")]
    assert "no answer for 2 s, stub-timeout-seconds" in \
        outcome[("stub hung", "SIGSTOP to the stub in execute: that request")]
    assert outcome[("stub killed", "SIGKILL mid-stream, 5 responses of 1 MiB unread")] == \
        "the 5 came whole, then the error naming SIGKILL"
    assert outcome[("stub killed", "the dead stub's segments, once its responses are read")] \
        == "gone"
    for s in ("stub killed", "stub hung"):
        assert outcome[(s, "the 3 requests queued behind it")].startswith(
            "served by the restarted stub")
    killed = [(c, o) for s, c, _, o in rows if s == "host killed"]
    assert killed[0][0].startswith("SIGKILL to the server, ") and "held by 2 processes" in \
        killed[0][0]
    assert killed[0][1] == "its stubs died with it; every segment gone"
    stops = [v for _, c, v, _ in rows if c == "stop: nothing left behind"]
    assert stops == ["ok"] * (6 if no_private is None else 5)
    assert proc.stdout.rstrip().endswith(
        f"{verdicts.count('ok')} ok, 0 failed, {verdicts.count('skipped')} skipped")
    assert run_leftovers(proc.pid) == []  # type: ignore[attr-defined]


def test_without_a_private_dev_shm_a_pool_cap_stands_in(tmp_path) -> None:
    # In process, as `tritonpy stress` runs where no tmpfs can be mounted (the reason given).
    ctx = stress.Context(write_repository(tmp_path), no_private_shm="not root here")
    rows = stress.shm_full(ctx)
    assert [(r.check, r.verdict) for r in rows] == [
        ("client input of 128 MiB, a host pool capped at 64 MiB", "ok"),
        ("model output larger than /dev/shm", "skipped"),
        ("/dev/shm filled by another process", "skipped"),
        ("a model loaded while /dev/shm is full", "skipped"),
        ("BLS input larger than /dev/shm", "skipped"),
        ("a stream of big responses to a late consumer", "skipped"),
        ("the file-backed fallback", "skipped"),
        ("a server started while /dev/shm is full", "skipped"),
        ("stop: nothing left behind", "ok")]
    assert "shared memory exhausted (pool cap): asked for 134217728 bytes" in rows[0].outcome
    assert rows[0].outcome.endswith("the next request is served")
    assert rows[1].outcome == "needs a private /dev/shm (not root here)"


def test_gpu_memory_full_with_a_stand_in_for_cupy() -> None:
    # No GPU here: tests/fake_gpu's cupy holds 1 GiB of "device" memory in host memory.
    env = {"PYTHONPATH": os.pathsep.join([str(FAKE_GPU), os.environ.get("PYTHONPATH", "")]),
           "TRITONPY_GPU_COUNT": "1", "FAKE_CUPY_CAPACITY": str(1 << 30)}
    proc = run_stress("--scenario", "gpu-memory-full", "--json", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [Row(**r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]
    assert [(r.check, r.verdict) for r in rows] == [
        ("execute allocates 256 MiB blocks until CUDA refuses", "ok"),
        ("the next request: memory given back, GPU computes", "ok"),
        ("stop: nothing left behind", "ok")]
    assert "OutOfMemoryError: Out of memory allocating 268,435,456 bytes" in rows[0].outcome
    assert rows[1].outcome == "served"


@pytest.mark.gpu
def test_gpu_memory_full_on_a_real_gpu() -> None:
    proc = run_stress("--scenario", "gpu-memory-full", "--json", timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [Row(**r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]
    assert [r.verdict for r in rows] == ["ok", "ok", "ok"], rows
    assert "out of memory" in rows[0].outcome.lower()


def test_a_shm_size_under_dockers_default_is_refused() -> None:
    proc = run_stress("--shm-size", str(8 << 20))
    assert proc.returncode == 2
    assert "--shm-size must be at least 67108864 bytes" in proc.stderr
    assert proc.stdout == ""


# -- the verdicts themselves (pure functions: no server needed) -----------------------------

def test_an_expected_error_that_does_not_come_fails_the_check() -> None:
    served = Answer({"OUT": None}, None, 0.1)  # type: ignore[dict-item]
    row = stress.expect_error("s", "c", served, "shared memory exhausted")
    assert row.verdict == "FAILED" and row.outcome == "served, where an error was expected"
    other = stress.expect_error("s", "c", Answer(None, "model not found", 0.1), "exhausted")
    assert other.verdict == "FAILED" and other.outcome == "error: model not found"
    then = stress.expect_error("s", "c", Answer(None, "shm exhausted", 0.1), "exhausted",
                               after=lambda: "a 4 KiB request failed: boom")
    assert then.verdict == "FAILED" and then.outcome.endswith("then a 4 KiB request failed: boom")
    good = stress.expect_error("s", "c", Answer(None, "SHM EXHAUSTED", 0.1), "exhausted",
                               after=lambda: None)
    assert good.verdict == "ok" and good.outcome.endswith("the next request is served")


def test_a_failed_check_makes_the_exit_status_1(monkeypatch, capsys) -> None:
    # The scenarios are replaced here: what is under test is the report and the exit status.
    monkeypatch.setattr(stress, "SCENARIOS", {
        "a": lambda ctx: [Row("a", "first", "fine", 0.5)],
        "b": lambda ctx: [Row("b", "second", "went wrong", None, "FAILED")],
        "c": lambda ctx: 1 / 0})
    args = argparse.Namespace(scenario=["a", "b", "c"], shm_size=stress.DOCKER_SHM,
                                     quick=True, json=False, inside_private_shm=False)
    assert stress.main(args) == 1
    table = capsys.readouterr().out
    assert rows_of(table) == [("a", "first", "ok", "fine"), ("b", "second", "FAILED", "went wrong"),
                              ("c", "the scenario itself", "FAILED",
                               "ZeroDivisionError: division by zero")]
    assert table.rstrip().endswith("1 ok, 2 failed, 0 skipped")
    monkeypatch.setattr(stress, "SCENARIOS", {"a": lambda ctx: [Row("a", "first", "fine")]})
    args.scenario = ["a"]
    assert stress.main(args) == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_stops_its_servers_and_removes_its_files(tmp_path,
                                                                    sig: signal.Signals) -> None:
    # (QA) SIGINT was ignored when inherited so (a shell's background job), and SIGTERM left
    # the run's model repository in the temp folder.
    def as_a_background_job() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, "-m", "tritonpy", "stress", "--scenario",
                             "message-queue-full", "--quick"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)},
                            preexec_fn=as_a_background_job)
    try:
        deadline = time.monotonic() + 60
        while not any(stress.janitor.stubs_of(proc.pid)):  # a server of the run serves
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.1)
        assert list(tmp_path.glob("tritonpy-stress-*"))
        os.kill(proc.pid, sig)
        out, err = communicate_in_session(proc, 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 128 + sig, (proc.returncode, err[-2000:])
    assert f"tritonpy stress: interrupted ({sig.name})" in err
    assert "Traceback" not in err
    assert out == ""  # no table of a run cut short
    assert list(tmp_path.glob("tritonpy-stress-*")) == []
    assert run_leftovers(proc.pid) == []
