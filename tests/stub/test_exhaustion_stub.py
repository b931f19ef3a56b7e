"""A stub under hostile OS conditions: stopped by a signal, or out of address space.

* A stub stopped (SIGSTOP) for longer than ``stub-timeout-seconds`` is killed and restarted;
  its in-flight request fails with a reason that says it was stopped, not merely silent.
* A stub that cannot map a request's input (``RLIMIT_AS``, a memory cgroup) fails that request
  with an error that names the cause, and serves the next ones.
* So does one that has no file descriptor left to open the segment of a request's input
  (``RLIMIT_NOFILE``): UNAVAILABLE, naming the limit.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from _models import fp32, infer, io_config, serving, stub_processes, wait_until, write_model

pytestmark = pytest.mark.timeout(60)

SLOW_PY = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.3)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)]) for r in requests]
"""

# Leaves itself 48 MiB of address space more than it has after initialize.
TIGHT_PY = """
import os, resource
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", np.full(2, pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().size,
                           np.float32))]) for r in requests]
"""


def test_a_stub_stopped_past_the_stub_timeout_is_killed_saying_it_was_stopped(
        tmp_path, shm_prefix: str) -> None:
    write_model(tmp_path, "slow", SLOW_PY, io_config())
    with serving(tmp_path, shm_prefix, backend_config={"stub-timeout-seconds": "1"}) as srv:
        model = srv.model("slow")
        assert infer(model, {"IN": fp32(1)}).error is None
        stub = stub_processes()[0]
        stream = model.infer({"IN": fp32(2)})
        time.sleep(0.05)
        os.kill(stub.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        got = stream.get(timeout=15)
        assert time.monotonic() - t0 < 5
        assert got.error is not None
        assert "no answer for 1 s, stub-timeout-seconds; it was stopped (SIGSTOP or SIGTSTP)" \
            in str(got.error), got.error
        # Its replacement serves.
        wait_until(lambda: infer(model, {"IN": fp32(3)}).error is None, 10, "the restart")
        assert [p.pid for p in stub_processes()] != [stub.pid]


def test_an_input_the_stub_has_no_address_space_to_map_fails_naming_the_cause(
        tmp_path, shm_prefix: str) -> None:
    write_model(tmp_path, "tight", TIGHT_PY, io_config())
    with serving(tmp_path, shm_prefix) as srv:
        model = srv.model("tight")
        assert infer(model, {"IN": fp32(1)}).error is None
        got = infer(model, {"IN": np.ones(16 << 20, np.float32)})  # 64 MiB
        assert got.error is not None
        # It read "ProtocolError: cannot map shared-memory segment ...: [Errno 12] Cannot
        # allocate memory", as if the host had sent something malformed.
        assert "no memory or address space left for the mapping" in str(got.error), got.error
        assert "RLIMIT_AS" in str(got.error)
        assert infer(model, {"IN": fp32(1, 2)}).outputs["OUT"].to_numpy().tolist() == [2, 2]


# Leaves itself no file descriptor more than it has after initialize.
NO_FDS_PY = TIGHT_PY.replace(
    """        vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))""",
    """        n = len(os.listdir("/proc/self/fd")) - 1  # (less the one listdir held)
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (n, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))""")


def test_an_input_the_stub_has_no_descriptor_to_open_fails_naming_the_limit(
        tmp_path, shm_prefix: str) -> None:
    write_model(tmp_path, "nofds", NO_FDS_PY, io_config())
    with serving(tmp_path, shm_prefix) as srv:
        model = srv.model("nofds")
        assert infer(model, {"IN": fp32(1)}).error is None  # inline: no segment to open
        got = infer(model, {"IN": np.ones(2 << 20, np.float32)})  # 8 MiB: a segment of its own
        assert got.error is not None and got.error.code.name == "UNAVAILABLE", got.error
        # It read "INVALID_ARG cannot decode requests: <a traceback>", as if the host had sent
        # something malformed.
        assert "cannot receive the requests' inputs" in str(got.error), got.error
        assert "RLIMIT_NOFILE" in str(got.error)
        assert infer(model, {"IN": fp32(1, 2)}).outputs["OUT"].to_numpy().tolist() == [2, 2]
