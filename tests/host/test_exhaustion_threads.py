"""A host that cannot start a thread (its cgroup's ``pids.max``, or ``RLIMIT_NPROC``, reached:
threads count as tasks) when a stub dies still fails the dead stub's requests and restarts it,
as soon as a thread can be had again; it used to lose the death (the thread that handles it
never started): the request waited for ever, the model never came back, and ``stop()`` waited
its whole exit timeout.

The server runs in a child process moved into a pids cgroup of its own (cgroup v1, as root);
skipped where there is none to create.
"""
from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path

import pytest
from _models import assert_clean, io_config, run_driver, write_model

pytestmark = pytest.mark.timeout(60)

PIDS = Path("/sys/fs/cgroup/pids")

# ``python -c DRIVER REPO PREFIX CGROUP SCENARIO``: prints one JSON object, then stops the
# server.
DRIVER = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    import numpy as np
    import tritonpy
    from tritonpy.shm import janitor

    repo, prefix, cg, scenario = sys.argv[1:5]
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    server = tritonpy.Server(repo, exit_timeout=10.0, model_control_mode="explicit",
                             load_models=["m"], backend_config={"shm-region-prefix-name": prefix})
    server.start()
    out = {}

    def ask(wait, model="m"):
        try:
            r = server.model(model).infer({"IN": np.ones(4, np.float32)}).get(timeout=wait)
        except Exception as exc:
            return f"raised {type(exc).__name__}: {exc}"
        return f"error: {r.error}" if r.error else "ok"

    def limit(tasks):
        with open(os.path.join(cg, "pids.max"), "w") as f:
            f.write(str(tasks))

    def current():
        with open(os.path.join(cg, "pids.current")) as f:
            return int(f.read())

    try:
        ask(10)
        if scenario == "load":
            limit(current())  # no thread, no process more
            try:
                server.load("two")
                out["load"] = "loaded"
            except Exception as exc:
                out["load"] = f"{type(exc).__name__}: {exc}"
            limit("max")
            out["state"] = {m["name"]: m.get("state") for m in server.models()}
            out["stubs"] = len(janitor.stubs_of(os.getpid()))
            server.load("two")
            out["after"] = ask(8, "two")
        else:
            stub = janitor.stubs_of(os.getpid())[0]
            # Lifts the limit 1.5 s from now; started before it is lowered (forks nothing).
            lifter = subprocess.Popen([sys.executable, "-c", "import sys, time; "
                                       "time.sleep(1.5); open(sys.argv[1], 'w').write('max')",
                                       os.path.join(cg, "pids.max")])
            time.sleep(0.3)
            # What the dead stub gives back, less a few: no thread left for the host to start.
            limit(current() - stub.num_threads() - 3)
            t0 = time.monotonic()
            os.kill(stub.pid, signal.SIGKILL)
            out["during"] = ask(8)
            out["during_s"] = time.monotonic() - t0
            lifter.wait()
            deadline = time.monotonic() + 8
            while (got := ask(8)) != "ok" and time.monotonic() < deadline:
                time.sleep(0.1)
            out["after"] = got
    finally:
        limit("max")
        t0 = time.monotonic()
        server.stop()
        out["stop_s"] = time.monotonic() - t0
    print("RESULT " + json.dumps(out))
""")


def _pids_cgroup(name: str) -> Path:
    cg = PIDS / name
    try:
        cg.mkdir()
    except OSError as exc:
        pytest.skip(f"no pids cgroup to create here ({exc})")
    return cg


def _run(tmp_path: Path, prefix: str, scenario: str) -> tuple[dict, str]:
    """The child's JSON result and its stderr."""
    cg = _pids_cgroup(f"{prefix}{scenario}")
    try:
        result, err = run_driver(DRIVER, str(tmp_path), prefix, str(cg), scenario)
    finally:
        (cg / "pids.max").write_text("max")
        for pid in (cg / "cgroup.procs").read_text().split():  # what is left of the child's
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while (cg / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        cg.rmdir()
    assert_clean(prefix)
    return json.loads(result), err


def test_a_stub_death_seen_when_no_thread_can_start_is_handled_once_one_can(
        tmp_path: Path, shm_prefix: str) -> None:
    write_model(tmp_path, "m")
    got, err = _run(tmp_path, shm_prefix, "death")
    # The death is answered once the limit is lifted (1.5 s), with what killed the stub.
    assert "killed by signal SIGKILL" in got["during"], got
    assert got["during_s"] < 6, got
    assert got["after"] == "ok", got
    assert got["stop_s"] < 5, got
    assert "cannot start a thread for the end of stub 'm_0'" in err, err[-2000:]


def test_a_load_that_can_start_no_thread_fails_cleanly_and_can_be_tried_again(
        tmp_path: Path, shm_prefix: str) -> None:
    write_model(tmp_path, "m")
    write_model(tmp_path, "two", config=io_config(
        extra="instance_group [ { count: 2, kind: KIND_CPU } ]\n"))
    got, _ = _run(tmp_path, shm_prefix, "load")
    # It used to raise "RuntimeError: can't start new thread" out of load() and leave the
    # model LOADING for ever.
    assert got["load"].startswith(("InvalidArgumentError", "UnavailableError")), got
    assert "cannot start stub process 'two_" in got["load"], got
    assert "pids.max" in got["load"], got
    assert got["state"]["two"] == "UNAVAILABLE", got
    assert got["stubs"] == 1, got  # m's alone: none of two's half-started
    assert got["after"] == "ok", got
    assert got["stop_s"] < 5, got
