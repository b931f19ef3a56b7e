"""Stubs SIGKILLed part-way through work that spans several messages (the OOM killer's way):
a decoupled stream with responses already sent, a BLS call waiting on its callee, and a BLS
caller whose callee is still running. Each ends at once with the death's reason; nothing
waits for ever, and the survivors serve on. (``test_supervision.py`` covers a default-mode
execute; these cover the rest.)
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from _models import fp32, infer, io_config, serving, wait_until, write_model

pytestmark = pytest.mark.timeout(60)

# Streams 200 responses, 20 ms apart, writing its pid first.
STREAM_PY = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.pidfile = os.path.join(os.path.dirname(args["model_repository"]), "stream.pid")

    def execute(self, requests):
        open(self.pidfile, "w").write(str(os.getpid()))
        for r in requests:
            sender = r.get_response_sender()
            for i in range(200):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUT", np.full(1, i, np.float32))]))
                time.sleep(0.02)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# Works for up to 5 s (stops early when its request is cancelled), writing its pid first.
CALLEE_PY = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.pidfile = os.path.join(os.path.dirname(args["model_repository"]), "callee.pid")

    def execute(self, requests):
        open(self.pidfile, "w").write(str(os.getpid()))
        x = pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()
        if x[0] > 0:
            end = time.monotonic() + 5
            while time.monotonic() < end and not requests[0].is_cancelled():
                time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(1, np.float32))])
                for _ in requests]
"""

CALLER_PY = """
import os
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.pidfile = os.path.join(os.path.dirname(args["model_repository"]), "caller.pid")

    def execute(self, requests):
        open(self.pidfile, "w").write(str(os.getpid()))
        out = []
        for r in requests:
            resp = pb_utils.InferenceRequest(
                model_name="callee", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(r, "IN")]).exec()
            if resp.has_error():
                raise pb_utils.TritonModelException("callee: " + resp.error().message())
            out.append(pb_utils.InferenceResponse(
                [pb_utils.get_output_tensor_by_name(resp, "OUT")]))
        return out
"""


def _pid(path: Path) -> int:
    return int(wait_until(lambda: path.exists() and path.read_text(), 10, f"{path.name}"))


def test_a_stub_killed_mid_stream_ends_the_stream_with_the_reason(tmp_path: Path,
                                                                  shm_prefix: str) -> None:
    write_model(tmp_path, "stream", STREAM_PY,
                io_config(extra="model_transaction_policy { decoupled: true }\n"))
    with serving(tmp_path, shm_prefix) as srv:
        stream = srv.model("stream").infer({"IN": fp32(1)})
        first = [stream.get(timeout=10) for _ in range(3)]
        assert all(r.error is None for r in first)
        os.kill(_pid(tmp_path / "stream.pid"), signal.SIGKILL)
        t0 = time.monotonic()
        last = None
        for _ in range(200):  # what was sent before the death, then the death's answer
            last = stream.get(timeout=10)
            if last.error is not None or last.final:
                break
        assert time.monotonic() - t0 < 5
        assert last is not None and last.error is not None and last.final, last
        assert "killed by signal SIGKILL" in str(last.error)
        # The replacement streams again, from the start.
        again = wait_until(lambda: srv.model("stream").ready(), 10, "the restart") and \
            srv.model("stream").infer({"IN": fp32(1)})
        assert again.get(timeout=10).outputs["OUT"].to_numpy().tolist() == [0]


def test_a_bls_callee_killed_mid_call_fails_the_call_naming_its_death(tmp_path: Path,
                                                                      shm_prefix: str) -> None:
    write_model(tmp_path, "callee", CALLEE_PY, io_config())
    write_model(tmp_path, "caller", CALLER_PY, io_config())
    with serving(tmp_path, shm_prefix) as srv:
        pending = srv.model("caller").infer({"IN": fp32(1)})
        os.kill(_pid(tmp_path / "callee.pid"), signal.SIGKILL)
        t0 = time.monotonic()
        got = pending.get(timeout=10)
        assert time.monotonic() - t0 < 3
        assert got.error is not None
        assert "callee: Stub process 'callee_0' is not healthy" in str(got.error), got.error
        assert "killed by signal SIGKILL" in str(got.error)
        wait_until(lambda: infer(srv.model("caller"), {"IN": fp32(0)}).error is None, 10,
                   "the callee's restart")


def test_a_bls_caller_killed_mid_call_cancels_what_it_was_waiting_for(tmp_path: Path,
                                                                      shm_prefix: str) -> None:
    write_model(tmp_path, "callee", CALLEE_PY, io_config())
    write_model(tmp_path, "caller", CALLER_PY, io_config())
    with serving(tmp_path, shm_prefix) as srv:
        pending = srv.model("caller").infer({"IN": fp32(1)})
        _pid(tmp_path / "callee.pid")  # the call has reached the callee
        os.kill(_pid(tmp_path / "caller.pid"), signal.SIGKILL)
        got = pending.get(timeout=10)
        assert got.error is not None and "killed by signal SIGKILL" in str(got.error)
        # The callee's request was cancelled with its caller: it stops well before its 5 s,
        # and serves the next request at once.
        t0 = time.monotonic()
        assert infer(srv.model("callee"), {"IN": fp32(0)}, wait=10).error is None
        assert time.monotonic() - t0 < 2.5
        t1 = time.monotonic()
        srv.stop()
        assert time.monotonic() - t1 < 5
