"""``tritonpy serve``'s exit code when its exit timeout cuts requests off.

As Triton exits 1 after "Exit timeout expired", tritonpy does when requests are still in
flight once ``--exit-timeout-secs`` has passed. A stream that never ends (its model streams
until cancelled) is such a request: the frontends cancel its call as they stop, and whether
the model had ended by the time its unload judged it used to decide the exit code (0 or 1,
about half and half; QA of the ensemble pacing). The drain's own timeout decides it now.
"""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from _models import segments, wait_until, write_model
from _serve import Serve, serve_repo

pytestmark = pytest.mark.timeout(120)

ENDLESS_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""
# Streams small responses until its request is cancelled.
ENDLESS_PY = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            i = 0
            while not request.is_cancelled():
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT", np.array([i], np.int32))]))
                i += 1
                time.sleep(0.01)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_a_stream_cut_off_by_the_exit_timeout_exits_1(
        serve: Callable[..., Serve], tmp_path: Path, shm_prefix: str) -> None:
    """Three stops of a server with an endless gRPC stream, its client reading: each exits 1
    after about the 1 s exit timeout, and says which model was cut off."""
    write_model(tmp_path / "repo", "endless", ENDLESS_PY, ENDLESS_CONFIG)
    for _ in range(3):
        server, _, grpc_port = serve_repo(serve, tmp_path / "repo", "--exit-timeout-secs", "1")
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        got: list = []
        lock = threading.Lock()

        def callback(result, error) -> None:
            with lock:
                got.append(error if error is not None else result)

        try:
            client.start_stream(callback=callback)
            inp = grpcclient.InferInput("IN", [1], "INT32")
            inp.set_data_from_numpy(np.array([0], np.int32))
            client.async_stream_infer("endless", [inp])
            wait_until(lambda: len(got) >= 3 or None, 30, "the stream to flow")
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGINT)
            code = server.wait(30)
            took = time.monotonic() - t0
        finally:
            client.close()
        assert code == 1, server.log()
        assert took < 10, took
        assert "exit timeout expired: cut off in 'endless' version 1 (requests in flight)" \
            in server.log()
    assert segments(shm_prefix) == []
