"""Stub supervision with real stubs: death, hangs, restarts, and a host that goes away.

A stub that dies mid-request (SIGKILL, a segfault, ``os._exit``) fails every request it was
executing with the exit code or signal and its last stderr lines, is restarted with back-off
while the model reports not ready, and serves again; requests queued meanwhile are served by
the new stub. A stub that stops answering and is stuck (stopped, or blocked in C code holding
the GIL) is killed after ``stub-timeout-seconds``; one that is merely busy in ``execute``, even
on a CPU in C code that holds the GIL, is left alone. A host process
that ends in any way leaves no stub behind, and the next start sweeps its segments.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

import tritonpy
from tritonpy.shm import sweep_orphans
from _models import assert_clean, infer, io_config, segments, serving, stub_processes, wait_for
from _models import write_model

pytestmark = pytest.mark.timeout(60)

# Batches of exactly 4 reach execute together: the preferred size is sent as soon as it is
# queued, and a smaller batch waits (here at most 0.2 s) for more requests.
CRASHY_CONFIG = io_config(
    max_batch_size=8,
    extra="dynamic_batching { preferred_batch_size: [ 4 ] "
          "max_queue_delay_microseconds: 200000 }\n"
          "instance_group [ { count: 1, kind: KIND_CPU } ]\n")

CRASHY_PY = '''
import ctypes
import json
import os
import signal
import sys
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]

    def execute(self, requests):
        params = json.loads(requests[0].parameters())
        mode = params["mode"]
        if mode != "ok":
            gate = params.get("gate")
            if gate:
                open(gate + ".in", "w").close()  # the batch is executing
                deadline = time.monotonic() + 20
                while not os.path.exists(gate) and time.monotonic() < deadline:
                    time.sleep(0.01)
            sys.stderr.write(f"crashy {self.instance}: about to {mode}, "
                             f"batch of {len(requests)}\\n")
            sys.stderr.flush()
            time.sleep(0.05)  # let the host read the line before the process goes
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "segfault":
            ctypes.string_at(0)
        elif mode == "sigsegv":
            # Sent to the process, the signal may be taken by another thread while this one
            # runs on: wait for it here, as a request caught mid-way would.
            os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(20)
        elif mode == "exit3":
            os._exit(3)
        elif mode == "hang":
            # Blocks in C while holding the GIL (PyDLL does not release it): no thread of this
            # process can run, so nothing answers the host's pings.
            ctypes.PyDLL(None).sleep(30)
        elif mode == "busy":
            time.sleep(float(params["seconds"]))  # releases the GIL: the stub still answers
        elif mode == "gil_cpu":
            # Busy on a CPU for about that long in one C call that holds the GIL (re does not
            # release it): nothing answers the host's pings meanwhile. Backtracking doubles
            # with each "a": the count is found from a short run.
            import math, re
            t0 = time.perf_counter()
            re.match(r"(a+)+$", "a" * 16 + "b")
            unit = max(time.perf_counter() - t0, 1e-6) / 2 ** 16
            n = max(16, math.ceil(math.log2(float(params["seconds"]) / unit)))
            t0 = time.perf_counter()
            re.match(r"(a+)+$", "a" * n + "b")
            requests[0].held = time.perf_counter() - t0
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", x * 2)],
                parameters={"pid": os.getpid(), "instance": self.instance,
                            "batch": len(requests),
                            "held": str(getattr(requests[0], "held", 0.0))}))
        return out
'''

X = np.arange(4, dtype=np.float32).reshape(1, 4)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    write_model(path, "crashy", CRASHY_PY, CRASHY_CONFIG)
    return path


def ok(model: tritonpy.Model) -> dict:
    resp = infer(model, {"IN": X}, parameters={"mode": "ok"})
    assert resp.error is None, resp.error
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), X * 2)
    return resp.parameters


DEATHS = {
    "sigkill": "killed by signal SIGKILL",
    "segfault": "killed by signal SIGSEGV",
    "sigsegv": "killed by signal SIGSEGV",
    "exit3": "exited with code 3",
}


@pytest.mark.parametrize("how", sorted(DEATHS))
def test_dead_stub_fails_its_batch_and_is_restarted(repo, tmp_path, shm_prefix, how):
    # stub-timeout-seconds is far away: the death must be noticed from the process itself.
    backend = {"stub-timeout-seconds": "120", "restart-backoff-seconds": "0.5"}
    with serving(repo, shm_prefix, backend_config=backend) as srv:
        model = srv.model("crashy")
        first = ok(model)
        gate = tmp_path / "gate"
        doomed = [model.infer({"IN": X + i}, parameters={"mode": how, "gate": str(gate)})
                  for i in range(4)]
        assert wait_for(lambda: Path(str(gate) + ".in").exists(), timeout=15)
        # Queued behind the doomed batch: it must survive the death and be served later.
        queued = model.infer({"IN": X}, parameters={"mode": "ok"})
        gate.touch()
        responses = [s.get(timeout=15) for s in doomed]
        assert not model.ready() and not srv.ready()  # restarting (back-off 0.5 s)
        for resp in responses:
            err = resp.error
            assert isinstance(err, tritonpy.UnavailableError), resp
            assert err.code.value == "UNAVAILABLE"
            msg = err.message
            # Triton's sentence, then how it ended.
            assert f"Stub process 'crashy_0_0' is not healthy: pid {first['pid']} " \
                   f"{DEATHS[how]}" in msg
            assert "last stderr lines:" in msg
            assert f"crashy crashy_0_0: about to {how}, batch of 4" in msg
            if how == "segfault":  # where: the model's line, from the crashing thread's stack
                assert "Fatal Python error: Segmentation fault" in msg
                line = CRASHY_PY.splitlines().index("            ctypes.string_at(0)") + 1
                assert f"crashy/1/model.py\", line {line} in execute" in msg, msg
        assert not psutil.pid_exists(first["pid"]) or \
            psutil.Process(first["pid"]).status() == psutil.STATUS_ZOMBIE
        # Back to ready; the queued request and new ones are served by a new process.
        assert wait_for(model.ready, timeout=20), srv.models()
        later = queued.get(timeout=20)
        assert later.error is None, later.error
        assert later.parameters["pid"] != first["pid"]
        again = ok(model)
        assert again["pid"] == later.parameters["pid"]
        assert again["instance"] == "crashy_0_0"
        assert [p.pid for p in stub_processes()] == [again["pid"]]


SLOW_START_PY = """
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(0.5)

    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)],
            parameters={"pid": os.getpid()}) for r in requests]
"""


def test_a_replacement_killed_while_it_starts_is_restarted_again(tmp_path, shm_prefix):
    # The replacement of a dead stub dies too, before it is ready (here: killed as soon as it
    # exists, so before its HELLO or during initialize). The instance stays RESTARTING and the
    # restart loop tries again after its back-off; it used to end STOPPED, never restarted,
    # with every later request waiting forever.
    write_model(tmp_path / "repo", "slowstart", SLOW_START_PY)
    backend = {"restart-backoff-seconds": "0.2"}
    with serving(tmp_path / "repo", shm_prefix, backend_config=backend) as srv:
        model = srv.model("slowstart")
        (inst,) = srv.runtime("slowstart").instances
        first = inst.stub.pid
        os.kill(first, signal.SIGKILL)
        replacement = wait_for(lambda: inst.stub.pid if inst.stub.pid != first else None,
                               timeout=15, interval=0.001)
        os.kill(replacement, signal.SIGKILL)
        waiting = model.infer({"IN": X[0]})  # queued while no stub can serve it
        assert inst.state == "RESTARTING"
        assert wait_for(model.ready, timeout=20), srv.models()
        third = inst.stub.pid
        assert third not in (first, replacement)
        resp = waiting.get(timeout=20)
        assert resp.error is None, resp.error
        assert resp.parameters["pid"] == third
        np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), X[0] * 2)


# Starts well, then dies 0.3 s later: every replacement does the same.
DIES_SOON_PY = """
import os, threading, time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        threading.Thread(target=lambda: (time.sleep(0.3), os._exit(9)), daemon=True).start()

    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]
"""


def test_a_stub_that_keeps_dying_soon_after_starting_is_restarted_ever_later(tmp_path,
                                                                          shm_prefix):
    # Each replacement started well, so the back-off was reset every time: a restart every
    # ~0.65 s for as long as the server ran (15 in 10 s). Deaths soon after a start now double
    # the back-off: 0.2 s x 2, 4, 8, 16, 32 (10 s at most), so about 5 restarts in 8 s.
    write_model(tmp_path / "repo", "dies_soon", DIES_SOON_PY)
    backend = {"restart-backoff-seconds": "0.2"}
    with serving(tmp_path / "repo", shm_prefix, backend_config=backend) as srv:
        (inst,) = srv.runtime("dies_soon").instances
        pids, deadline = [inst.stub.pid], time.monotonic() + 8
        while time.monotonic() < deadline:
            pid = inst.stub.pid if inst.stub is not None else None
            if pid is not None and pid != pids[-1]:
                pids.append(pid)
            time.sleep(0.005)
    assert 2 <= len(pids) - 1 <= 5, len(pids) - 1


def test_hung_stub_is_killed_after_stub_timeout_and_restarted(repo, shm_prefix):
    backend = {"stub-timeout-seconds": "1", "restart-backoff-seconds": "0.1"}
    with serving(repo, shm_prefix, backend_config=backend) as srv:
        model = srv.model("crashy")
        first = ok(model)
        t0 = time.monotonic()
        resp = infer(model, {"IN": X}, wait=20, parameters={"mode": "hang"})
        waited = time.monotonic() - t0
        err = resp.error
        assert isinstance(err, tritonpy.UnavailableError), resp
        assert f"pid {first['pid']} killed by signal SIGKILL" in err.message
        assert "no answer for 1 s, stub-timeout-seconds" in err.message
        assert "about to hang, batch of 1" in err.message
        assert waited < 25  # the model itself would have slept 30 s
        assert wait_for(model.ready, timeout=20)
        again = ok(model)
        assert again["pid"] != first["pid"]


def test_busy_stub_is_not_killed_by_the_watchdog(repo, shm_prefix):
    # execute sleeps for several stub-timeout-seconds; the stub keeps answering pings.
    backend = {"stub-timeout-seconds": "0.6"}
    with serving(repo, shm_prefix, backend_config=backend) as srv:
        model = srv.model("crashy")
        first = ok(model)
        resp = infer(model, {"IN": X}, wait=20, parameters={"mode": "busy", "seconds": 2.0})
        assert resp.error is None, resp.error
        assert resp.parameters["pid"] == first["pid"]
        assert model.ready()


def test_a_stub_busy_on_a_cpu_in_c_code_holding_the_gil_is_not_killed(repo, shm_prefix, caplog):
    # (QA) As Triton 2.51 lets it be: one C call that holds the GIL for several
    # stub-timeout-seconds (a long regex, json.loads of a huge document) got its stub killed,
    # the request failed and the stub restarted. Only a stub that uses no CPU meanwhile (the
    # hang test above) is stuck.
    backend = {"stub-timeout-seconds": "1"}
    caplog.set_level(logging.WARNING, logger="tritonpy")
    with serving(repo, shm_prefix, backend_config=backend) as srv:
        model = srv.model("crashy")
        first = ok(model)
        resp = infer(model, {"IN": X}, wait=40, parameters={"mode": "gil_cpu", "seconds": 4})
        assert resp.error is None, resp.error
        assert float(resp.parameters["held"]) > 2, resp.parameters  # (the GIL held > 1 s)
        assert resp.parameters["pid"] == first["pid"]
        assert model.ready()
    busy = [r.getMessage() for r in caplog.records if "busy on a CPU" in r.getMessage()]
    assert len(busy) == 1, busy


SLOW_INIT_PY = '''
import ctypes
import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        how = json.loads(args["model_config"])["parameters"]["HOW"]["string_value"]
        if how == "busy":
            time.sleep(3.0)  # e.g. loading weights: releases the GIL, the stub answers pings
        elif how == "gil_cpu":  # 2 s on a CPU in one C call that holds the GIL (see CRASHY_PY)
            import math, re
            t0 = time.perf_counter()
            re.match(r"(a+)+$", "a" * 16 + "b")
            unit = max(time.perf_counter() - t0, 1e-6) / 2 ** 16
            re.match(r"(a+)+$", "a" * max(16, math.ceil(math.log2(2.0 / unit))) + "b")
        else:
            ctypes.PyDLL(None).sleep(30)  # stuck in C holding the GIL: nothing answers

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
'''


@pytest.mark.parametrize("how", ["busy", "gil_cpu", "hang"])
def test_initialize_has_no_deadline_but_a_hung_one_is_killed(tmp_path, shm_prefix, how):
    # Triton waits for initialize as long as the stub is healthy (models load weights for
    # minutes); a stub that stops answering is killed after stub-timeout-seconds.
    repo = tmp_path / "repo"
    write_model(repo, "slowinit", SLOW_INIT_PY, io_config(
        extra=f'parameters {{ key: "HOW" value: {{ string_value: "{how}" }} }}\n'))
    backend = {"stub-timeout-seconds": "0.6", "restart-backoff-seconds": "0.1"}
    with serving(repo, shm_prefix, backend_config=backend) as srv:
        (entry,) = [m for m in srv.models() if m["name"] == "slowinit"]
        if how in ("busy", "gil_cpu"):  # (QA: gil_cpu was killed, as hung)
            assert entry["state"] == "READY", entry
            resp = infer(srv.model("slowinit"), {"IN": np.array([2.0], np.float32)})
            assert resp.error is None and resp.outputs["OUT"].to_numpy().tolist() == [2.0]
        else:
            assert entry["state"] == "UNAVAILABLE", entry
            assert "killed by signal SIGKILL" in entry["reason"]
            assert "no answer for 0.6 s, stub-timeout-seconds" in entry["reason"]


# -- the host goes away -------------------------------------------------------------------------
HOST_PY = textwrap.dedent('''
    import json, os, signal, sys, time
    import numpy as np
    import tritonpy

    repo, prefix, how = sys.argv[1:4]
    srv = tritonpy.Server(repo, backend_config={"shm-region-prefix-name": prefix})
    srv.start()
    # A large tensor each way, so that both the host and the stub have segments mapped.
    x = np.ones((1, 1 << 18), np.float32)
    r = srv.model("crashy").infer({"IN": x}, parameters={"mode": "ok"}).get(timeout=30)
    assert r.error is None, r.error
    print(json.dumps({"stub": r.parameters["pid"]}), flush=True)
    sys.stdin.readline()  # the test has looked at us; now end (or be killed meanwhile)
    if how == "return":
        sys.exit(0)  # no stop(): the interpreter just ends
    if how == "raise":
        raise RuntimeError("the host's own code failed")
    time.sleep(60)
''')


def _owners(prefix: str) -> set[int]:
    """Creator pids of the prefix's segments (names end in ``<pid>x<hex>_<n>``)."""
    return {int(n[len(prefix):].split("x", 1)[0]) for n in segments(prefix)}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("how", ["sigkill", "sigterm", "return", "raise"])
def test_host_that_exits_leaves_no_stub_and_its_segments_are_swept(repo, tmp_path, shm_prefix,
                                                                   how):
    script = tmp_path / "host.py"
    script.write_text(HOST_PY)
    host = subprocess.Popen([sys.executable, str(script), str(repo), shm_prefix, how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    stub = None
    try:
        line = host.stdout.readline()
        assert line, f"host failed: {host.stderr.read()[-2000:]}"
        stub = json.loads(line)["stub"]
        assert not _gone(stub)
        assert stub in _owners(shm_prefix)
        if how == "sigkill":
            host.kill()
        elif how == "sigterm":
            host.send_signal(signal.SIGTERM)
        else:
            host.stdin.write("go\n")
            host.stdin.flush()
        code = host.wait(timeout=20)
        expected = {"sigkill": -signal.SIGKILL, "sigterm": -signal.SIGTERM, "return": 0,
                    "raise": 1}[how]
        assert code == expected, host.stderr.read()[-2000:]
        assert wait_for(lambda: _gone(stub), timeout=10), f"stub {stub} outlived its host"
        if how in ("return", "raise"):
            # An interpreter exit without stop(): the exit hook killed the stub and freed
            # every segment already, before any later start could sweep them.
            assert not segments(shm_prefix)
        # A later start with the same prefix removes whatever the dead processes left.
        with serving(repo, shm_prefix) as srv:
            ok(srv.model("crashy"))
            assert not _owners(shm_prefix) & {host.pid, stub}
        assert not segments(shm_prefix)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(timeout=10)
        if stub is not None and not _gone(stub):
            os.kill(stub, signal.SIGKILL)
        for pipe in (host.stdin, host.stdout, host.stderr):
            try:
                pipe.close()
            except BrokenPipeError:
                pass
        sweep_orphans(shm_prefix)  # on failure too: the fixture then judges only real leaks
    assert_clean(shm_prefix)


def test_stub_dying_while_the_server_stops_does_not_hold_stop(repo, tmp_path, shm_prefix):
    # exit_timeout is long; a request still queued when the last stub dies during the drain
    # can never be served, so it fails at once and stop() returns without waiting it out.
    import threading

    with serving(repo, shm_prefix, exit_timeout=40) as srv:
        model = srv.model("crashy")
        ok(model)
        gate = tmp_path / "gate"
        doomed = [model.infer({"IN": X}, parameters={"mode": "sigkill", "gate": str(gate)})
                  for _ in range(4)]
        assert wait_for(lambda: Path(str(gate) + ".in").exists(), timeout=15)
        queued = model.infer({"IN": X}, parameters={"mode": "ok"})
        stopper = threading.Thread(target=srv.stop, name="test-stop")
        stopper.start()
        try:
            assert wait_for(lambda: not model.ready(), timeout=10)  # draining now
            gate.touch()
            stopper.join(timeout=20)
            assert not stopper.is_alive(), "stop() waited for a request no stub can serve"
        finally:
            gate.touch()
            stopper.join(timeout=30)
        for s in doomed:
            assert "killed by signal SIGKILL" in s.get(timeout=5).error.message
        err = queued.get(timeout=5).error
        assert isinstance(err, tritonpy.UnavailableError)
        assert "unloaded" in err.message


# initialize() reads what to do from a file next to the model: "ok", "raise" or "hang".
FLAKY_INIT_PY = """
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

MODE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mode")


class TritonPythonModel:
    def initialize(self, args):
        mode = open(MODE).read().strip() if os.path.exists(MODE) else "ok"
        if mode == "raise":
            raise RuntimeError("initialize fails on purpose")
        while mode == "hang":
            time.sleep(0.05)
            mode = open(MODE).read().strip()

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)],
            parameters={"pid": os.getpid()}) for r in requests]
"""


@pytest.mark.parametrize("how", ["raise", "hang"])
def test_requests_are_failed_while_a_dead_stub_cannot_restart(tmp_path, shm_prefix, how):
    # The only instance dies and its replacement's initialize raises (or hangs). Requests that
    # queued meanwhile, and new ones, get UNAVAILABLE naming why (after stub-timeout-seconds
    # for a hang) instead of waiting for ever; once initialize works again the model serves.
    mdir = write_model(tmp_path / "repo", "flaky", FLAKY_INIT_PY)
    backend = {"restart-backoff-seconds": "0.2", "stub-timeout-seconds": "2"}
    with serving(tmp_path / "repo", shm_prefix, backend_config=backend) as srv:
        model = srv.model("flaky")
        (inst,) = srv.runtime("flaky").instances
        first = inst.stub.pid
        (mdir / "mode").write_text(how)
        os.kill(first, signal.SIGKILL)
        assert wait_for(lambda: inst.state == "RESTARTING", timeout=10)
        queued = [model.infer({"IN": X[0]}) for _ in range(3)]
        t0 = time.monotonic()
        answers = [q.get(timeout=20) for q in queued]
        waited = time.monotonic() - t0
        why = ("its restart failed: RuntimeError: initialize fails on purpose" if how == "raise"
               else "its replacement has not initialized within 2 s")
        for resp in answers:
            assert isinstance(resp.error, tritonpy.UnavailableError), resp
            assert f"model 'flaky' has no ready instance: instance 'flaky_0' died and " \
                   f"{why}" in resp.error.message, resp.error.message
        assert waited < 10
        # A new request is refused at once while no instance is back.
        t0 = time.monotonic()
        late = model.infer({"IN": X[0]}).get(timeout=5)
        assert isinstance(late.error, tritonpy.UnavailableError) and why in late.error.message
        assert time.monotonic() - t0 < 1
        assert not model.ready()
        # (QA) The index said READY with no reason meanwhile: it now says why, as requests do.
        (entry,) = [m for m in srv.models() if m["name"] == "flaky"]
        assert entry["state"] == "READY" and why in entry["reason"], entry
        (mdir / "mode").write_text("ok")
        assert wait_for(model.ready, timeout=20), srv.models()
        (entry,) = [m for m in srv.models() if m["name"] == "flaky"]
        assert entry["reason"] == "", entry
        resp = model.infer({"IN": X[0]}).get(timeout=20)
        assert resp.error is None, resp.error
        assert resp.parameters["pid"] not in (first,)
        np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), X[0] * 2)


def slow_or_dying_env(mdir: Path) -> Path:
    """An environment whose bin/python3 (a shell script) sleeps 3 s before it runs this
    test's interpreter while the file ``slow`` exists, and exits at once while ``die``
    does: a stub that is slow to spawn, or dies as it starts."""
    bindir = mdir / "env" / "bin"
    bindir.mkdir(parents=True)
    script = bindir / "python3"
    script.write_text(f'#!/bin/sh\n[ -e "{mdir}/slow" ] && sleep 3\n'
                      f'[ -e "{mdir}/die" ] && exit 3\nexec {sys.executable} "$@"\n')
    script.chmod(0o755)
    return mdir


ENV_CONFIG = io_config(extra='parameters { key: "EXECUTION_ENV_PATH" '
                             'value: { string_value: "$$TRITON_MODEL_DIRECTORY/env" } }\n')


def test_a_restart_slow_to_spawn_still_serves_what_waits(tmp_path, shm_prefix):
    # stub-timeout-seconds bounds the replacement's initialize, not the time the machine
    # takes to spawn it: a replacement that takes 3 s to say hello (a loaded machine) with
    # stub-timeout-seconds 2 serves the requests queued meanwhile. They used to fail after
    # 2 s counted from the death ("has not restarted within 2 s").
    mdir = slow_or_dying_env(write_model(tmp_path / "repo", "slowspawn", FLAKY_INIT_PY,
                                         config=ENV_CONFIG))
    backend = {"restart-backoff-seconds": "0.1", "stub-timeout-seconds": "2"}
    with serving(tmp_path / "repo", shm_prefix, backend_config=backend) as srv:
        model = srv.model("slowspawn")
        (inst,) = srv.runtime("slowspawn").instances
        first = inst.stub.pid
        (mdir / "slow").write_text("")
        t0 = time.monotonic()
        os.kill(first, signal.SIGKILL)
        assert wait_for(lambda: inst.state == "RESTARTING", timeout=10)
        queued = [model.infer({"IN": X[0]}) for _ in range(3)]
        for q in queued:
            resp = q.get(timeout=30)
            assert resp.error is None, resp.error
            assert resp.parameters["pid"] != first
            np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), X[0] * 2)
        assert time.monotonic() - t0 > 3.0  # they did wait out the slow spawn


def test_requests_are_failed_once_replacements_keep_dying_as_they_start(tmp_path, shm_prefix):
    # Every replacement dies before its hello: after three tries what waits gets UNAVAILABLE
    # naming the death, new requests are refused at once, and the restart goes on; once a
    # replacement starts the model serves again.
    mdir = slow_or_dying_env(write_model(tmp_path / "repo", "dying", FLAKY_INIT_PY,
                                         config=ENV_CONFIG))
    backend = {"restart-backoff-seconds": "0.1", "stub-timeout-seconds": "2"}
    with serving(tmp_path / "repo", shm_prefix, backend_config=backend) as srv:
        model = srv.model("dying")
        (inst,) = srv.runtime("dying").instances
        (mdir / "die").write_text("")
        os.kill(inst.stub.pid, signal.SIGKILL)
        assert wait_for(lambda: inst.state == "RESTARTING", timeout=10)
        queued = model.infer({"IN": X[0]})
        resp = queued.get(timeout=30)
        assert isinstance(resp.error, tritonpy.UnavailableError), resp
        assert "model 'dying' has no ready instance: instance 'dying_0' died and its restart " \
               "failed: " in resp.error.message and "exited with code 3" in resp.error.message, \
            resp.error.message
        assert inst.restarts >= 3
        late = model.infer({"IN": X[0]}).get(timeout=5)
        assert isinstance(late.error, tritonpy.UnavailableError), late
        (mdir / "die").unlink()
        assert wait_for(model.ready, timeout=30), srv.models()
        resp = model.infer({"IN": X[0]}).get(timeout=20)
        assert resp.error is None, resp.error


@pytest.mark.parametrize("when", ["spawning", "initializing"])
def test_stop_while_a_dead_stub_restarts_leaves_no_stub(tmp_path, shm_prefix, monkeypatch, when):
    # The server stops while the restart of a dead stub is under way: its replacement is
    # being spawned, or runs initialize. stop() returns with no stub of the model left. A
    # replacement spawned after the unload used to live on (its frame loop already closed).
    import threading

    from tritonpy import _model

    mdir = write_model(tmp_path / "repo", "flaky", FLAKY_INIT_PY)
    spawning, release = threading.Event(), threading.Event()
    real = _model.StubProcess

    class SlowSpawn(real):  # type: ignore[misc,valid-type]
        """The real stub, spawned only once the test says so (holds the restart at the
        moment the race needs; the process and everything after are real)."""

        def __init__(self, *args, **kwargs):
            spawning.set()
            release.wait(20)
            super().__init__(*args, **kwargs)

    backend = {"restart-backoff-seconds": "0.05"}
    with serving(tmp_path / "repo", shm_prefix, backend_config=backend) as srv:
        (inst,) = srv.runtime("flaky").instances
        first = inst.stub.pid
        if when == "spawning":
            monkeypatch.setattr(_model, "StubProcess", SlowSpawn)
        else:
            (mdir / "mode").write_text("hang")
        os.kill(first, signal.SIGKILL)
        if when == "spawning":
            assert spawning.wait(15)
        else:
            assert wait_for(lambda: inst.stub.pid != first and inst.stub.alive, timeout=15)
        stopper = threading.Thread(target=srv.stop, name="test-stop")
        stopper.start()
        try:
            assert wait_for(lambda: inst.state == "STOPPED", timeout=10)
            release.set()  # the replacement is spawned after the unload stopped the instance
            stopper.join(timeout=30)
            assert not stopper.is_alive(), "stop() hung"
            assert wait_for(lambda: not stub_processes(), timeout=3), \
                [p.cmdline() for p in stub_processes()]
            time.sleep(0.5)  # nothing is started after stop() returned
            assert not stub_processes()
            assert inst.state == "STOPPED"
        finally:
            release.set()
            stopper.join(timeout=30)


def test_sigusr1_to_a_stub_logs_where_the_models_threads_are(
        repo, shm_prefix, tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    # kill -USR1 <stub pid> while a request runs in execute: every thread's stack reaches the
    # host log, tagged with the instance, down to the model's line; the request completes.
    caplog.set_level(logging.INFO, logger="tritonpy.model.crashy")
    with serving(repo, shm_prefix) as srv:
        model = srv.model("crashy")
        pid = ok(model)["pid"]
        busy = model.infer({"IN": X}, parameters={"mode": "busy", "seconds": 2.0,
                                                  "gate": ""})
        assert wait_for(lambda: "about to busy" in caplog.text, timeout=15)
        os.kill(pid, signal.SIGUSR1)
        assert wait_for(lambda: re.search(r'crashy/1/model\.py", line \d+ in execute',
                                          caplog.text), timeout=15), caplog.text[-3000:]
        assert "[crashy_0_0] Thread 0x" in caplog.text  # every thread, tagged
        answer = busy.get(timeout=30)
        assert answer.error is None and answer.parameters["pid"] == pid
