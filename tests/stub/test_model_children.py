"""Processes a model starts (a subprocess, a shell with a background job, a forked child) end
with its stub: at unload, when the stub dies and is restarted, and when the server itself is
SIGKILLed. Each stub runs in a process group of its own, which the host (or, when the host is
gone, its janitor) kills once the stub has ended. Triton leaves such processes running.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import psutil
import pytest

from tritonpy.shm import sweep_orphans
from _models import assert_clean, infer, io_config, serving, wait_for, wait_until, write_model

pytestmark = pytest.mark.timeout(60)

# initialize starts a plain subprocess, a shell whose background job is a grandchild, and a
# forked child; execute answers with the stub's pid.
SPAWNER_PY = """
import os
import subprocess
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.procs = [subprocess.Popen(["sleep", "600"]),
                      subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600"])]
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)

    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())],
            parameters={"pid": os.getpid()}) for r in requests]
"""


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "repo"
    write_model(path, "spawner", SPAWNER_PY, io_config())
    return path


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _stub_and_children(model) -> tuple[int, list[int]]:
    """The stub's pid and its model's processes (5: sleep, sh and its two sleeps, the fork)."""
    r = infer(model, {"IN": np.ones(2, np.float32)}, wait=20)
    assert r.error is None, r.error
    stub = int(r.parameters["pid"])
    kids = wait_until(lambda: [p.pid for p in psutil.Process(stub).children(recursive=True)]
                      if len(psutil.Process(stub).children(recursive=True)) == 5 else None,
                      10, "the model's 5 processes")
    return stub, kids


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def test_a_stub_has_a_process_group_of_its_own_in_the_servers_session(repo, shm_prefix):
    # A session of its own made the stub an equal of its host where the kernel shares CPU time
    # among sessions (autogroup): 4 HTTP clients got 3,378 infer/s against 3,977 in its host's
    # session. Python 3.10 has no process_group: a session of its own gives the group there.
    kids: list[int] = []
    try:
        with serving(repo, shm_prefix, model_control_mode="explicit",
                     load_models=["spawner"]) as srv:
            stub, kids = _stub_and_children(srv.model("spawner"))
            assert os.getpgid(stub) == stub
            assert all(os.getpgid(k) == stub for k in kids if not _gone(k))
            if sys.version_info >= (3, 11):
                assert os.getsid(stub) == os.getsid(0)
    finally:
        _kill_all(kids)


def test_unload_ends_the_processes_the_model_started(repo, shm_prefix, caplog):
    kids: list[int] = []
    try:
        with serving(repo, shm_prefix, model_control_mode="explicit",
                     load_models=["spawner"]) as srv:
            stub, kids = _stub_and_children(srv.model("spawner"))
            assert not any(_gone(k) for k in kids)
            with caplog.at_level(logging.WARNING, logger="tritonpy"):
                srv.unload("spawner")
                assert wait_for(lambda: all(_gone(k) for k in kids), timeout=10), \
                    [psutil.Process(k).cmdline() for k in kids if not _gone(k)]
            assert any("killed the processes its model left running" in rec.getMessage()
                       and "spawner" in rec.getMessage() for rec in caplog.records)
    finally:
        _kill_all(kids)


def test_a_restarted_stub_leaves_no_process_of_the_dead_one(repo, shm_prefix):
    kids: list[int] = []
    try:
        with serving(repo, shm_prefix) as srv:
            model = srv.model("spawner")
            stub, kids = _stub_and_children(model)
            os.kill(stub, signal.SIGKILL)
            assert wait_for(lambda: all(_gone(k) for k in kids), timeout=10)
            # (its processes end before the death is told to the model, which is still ready
            # for a moment: wait for the new stub, not for readiness alone)
            (inst,) = srv.runtime("spawner").instances
            wait_until(lambda: inst.stub is not None and inst.stub.pid != stub and model.ready(),
                       30, "the restarted stub")
            new_stub, new_kids = _stub_and_children(model)  # the new stub starts its own
            kids += new_kids
            assert new_stub != stub
    finally:
        _kill_all(kids)


HOST_PY = textwrap.dedent('''
    import json, sys, time
    import numpy as np
    import tritonpy
    repo, prefix = sys.argv[1:3]
    srv = tritonpy.Server(repo, backend_config={"shm-region-prefix-name": prefix}).start()
    r = srv.model("spawner").infer({"IN": np.ones(2, np.float32)}).get(timeout=30)
    print(json.dumps({"stub": int(r.parameters["pid"])}), flush=True)
    time.sleep(60)
''')


def test_a_sigkilled_server_leaves_no_process_its_models_started(repo, tmp_path, shm_prefix):
    script = tmp_path / "host.py"
    script.write_text(HOST_PY)
    host = subprocess.Popen([sys.executable, str(script), str(repo), shm_prefix],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    kids: list[int] = []
    try:
        line = host.stdout.readline()
        assert line, f"host failed: {host.stderr.read()[-2000:]}"
        stub = json.loads(line)["stub"]
        kids = wait_until(lambda: [p.pid for p in psutil.Process(stub).children(recursive=True)]
                          if len(psutil.Process(stub).children(recursive=True)) == 5 else None,
                          10, "the model's 5 processes")
        host.kill()
        host.wait(timeout=10)
        # The stub dies of PR_SET_PDEATHSIG; the janitor ends its process group.
        assert wait_for(lambda: all(_gone(k) for k in [stub, *kids]), timeout=15), \
            [psutil.Process(k).cmdline() for k in kids if not _gone(k)]
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(timeout=10)
        _kill_all(kids)
        for pipe in (host.stdout, host.stderr):
            pipe.close()
        wait_for(lambda: False, timeout=0.5)  # let the janitor finish its sweep first
        sweep_orphans(shm_prefix)
    assert_clean(shm_prefix)


# A model that ends what it started with SIGTERM: a program (Popen.terminate()) and a fork
# pool's workers (the end of its ``with`` block terminates them).
TERMINATOR_PY = """
import multiprocessing
import subprocess

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        proc = subprocess.Popen(["sleep", "600"])
        proc.terminate()
        try:
            program = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            program = "still running after terminate()"
        for _ in range(20):  # a worker blocked on the pool's queue at its end took SIGTERM
            with multiprocessing.get_context("fork").Pool(2) as pool:
                pool.map(abs, range(8))
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())],
            parameters={"program": program}) for r in requests]
"""


def test_the_model_ends_what_it_started_with_sigterm(tmp_path, shm_prefix):
    # The stub drops SIGINT and SIGTERM (they are for the host). It ignored them, and an
    # ignored signal stays ignored across exec: the model's Popen.terminate() did nothing.
    # And a forked pool worker kept the stub's disposition: the pool's terminate() at the end
    # of its ``with`` block waited for ever for a worker blocked on its queue.
    write_model(tmp_path, "terminator", TERMINATOR_PY, io_config())
    with serving(tmp_path, shm_prefix) as srv:
        r = infer(srv.model("terminator"), {"IN": np.array([1.0], np.float32)}, wait=40)
        assert r.error is None, r.error
        assert r.parameters["program"] == -signal.SIGTERM
