"""Model code that misbehaves, compared with Triton 2.51 (the same model.py on both).

Each case runs through real HTTP and gRPC frontends with tritonclient; after it, the model
and its neighbour still serve.
"""
from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from _models import io_config, serving_frontends, write_model

pytestmark = pytest.mark.timeout(60)

# A plain ``def execute`` that returns a coroutine: Triton runs it to its end (on an event
# loop, so BLS ``async_exec`` works in it) and answers with what it returns. Decoupled, it
# runs in the background and its responses go through the senders.
CORO_PY = '''
import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(
            json.loads(args["model_config"]))

    async def _run(self, requests):
        await asyncio.sleep(0.01)
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if json.loads(r.parameters()).get("mode") == "raise":
                raise ValueError("raised in the coroutine")
            if json.loads(r.parameters()).get("mode") == "bls":
                got = await pb_utils.InferenceRequest(
                    model_name="double", inputs=[pb_utils.Tensor("IN", x)],
                    requested_output_names=["OUT"]).async_exec()
                x = pb_utils.get_output_tensor_by_name(got, "OUT").as_numpy()
            resp = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + 1)])
            if self.decoupled:
                sender = r.get_response_sender()
                sender.send(resp)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + 2)]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                out.append(resp)
        return None if self.decoupled else out

    def execute(self, requests):
        return self._run(requests)
'''


@pytest.fixture(scope="module")
def frontends(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "double")
    write_model(repo, "coro", CORO_PY)
    write_model(repo, "coro_dc", CORO_PY,
                io_config(extra="model_transaction_policy { decoupled: true }\n"))
    with serving_frontends(repo) as (server, fe):
        yield server, fe


def http_infer(fe, model: str, mode: str = "ok") -> np.ndarray:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
    inp = httpclient.InferInput("IN", [2], "FP32")
    inp.set_data_from_numpy(np.float32([1, 2]))
    try:
        return client.infer(model, [inp], parameters={"mode": mode}).as_numpy("OUT")
    finally:
        client.close()


@pytest.mark.parametrize("mode, expected", [("ok", [2, 3]), ("bls", [3, 5])])
def test_a_coroutine_returned_by_a_plain_execute_is_run(frontends, mode, expected):
    _, fe = frontends
    np.testing.assert_array_equal(http_infer(fe, "coro", mode), np.float32(expected))
    np.testing.assert_array_equal(http_infer(fe, "double"), np.float32([2, 4]))


def test_an_exception_in_the_returned_coroutine_fails_the_request(frontends):
    _, fe = frontends
    with pytest.raises(httpclient.InferenceServerException) as info:
        http_infer(fe, "coro", "raise")
    assert ("Failed to process the request(s) for model 'coro_0', message: "
            "ValueError: raised in the coroutine\n\nAt:\n") in info.value.message()
    assert "model.py" in info.value.message() and "_base.py" not in info.value.message()
    np.testing.assert_array_equal(http_infer(fe, "coro"), np.float32([2, 3]))


def test_a_decoupled_coroutine_sends_through_its_senders(frontends):
    _, fe = frontends
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{fe.grpc_port}")
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        inp = grpcclient.InferInput("IN", [2], "FP32")
        inp.set_data_from_numpy(np.float32([1, 2]))
        client.async_stream_infer("coro_dc", [inp])
        values = []
        for _ in range(2):
            result, error = got.get(timeout=20)
            assert error is None, error
            values.append(result.as_numpy("OUT").tolist())
        assert values == [[2, 3], [3, 4]]
    finally:
        client.stop_stream()
        client.close()


SIGNALS_PY = """
import os
import signal
import threading
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # raises ValueError off the main thread
        return config

    def initialize(self, args):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.where = threading.current_thread() is threading.main_thread()
        self.done = os.path.join(args["model_repository"], "finalized")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())],
            parameters={"initialized_on_main_thread": self.where}) for r in requests]

    def finalize(self):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with open(self.done, "w") as f:
            f.write(str(threading.current_thread() is threading.main_thread()))
"""


def test_initialize_auto_complete_and_finalize_run_on_the_main_thread(tmp_path):
    # As in Triton's stub: a model may set signal handlers there. It used to fail its load with
    # "signal only works in main thread of the main interpreter" whenever the stub's other
    # worker thread took the task.
    from _models import infer, new_prefix, serving

    for i in range(4):  # either thread may read the task: load it a few times
        write_model(tmp_path, f"signals{i}", SIGNALS_PY, io_config())
    with serving(tmp_path, new_prefix(), model_control_mode="explicit") as server:
        for i in range(4):
            server.load(f"signals{i}")
            resp = infer(server.model(f"signals{i}"), {"IN": np.ones(2, np.float32)})
            assert resp.error is None, resp.error
            assert resp.parameters["initialized_on_main_thread"] is True
            server.unload(f"signals{i}")
            assert (tmp_path / f"signals{i}" / "finalized").read_text() == "True"


# finalize raising what is not an Exception (sys.exit(), a KeyboardInterrupt, GeneratorExit).
FINALIZE_RAISES_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]

    def finalize(self):
        raise %s
"""


@pytest.mark.parametrize("raised", ["SystemExit('boom in finalize')", "KeyboardInterrupt",
                                    "GeneratorExit"])
def test_a_finalize_raising_a_base_exception_ends_its_stub_at_once(tmp_path, caplog, raised):
    # QA round 14: the error was logged at once, then the stub lived on until the host killed
    # it 10 s later, so every unload and stop of such a model took 10 s more.
    import logging
    import time

    from _models import new_prefix, serving

    write_model(tmp_path, "fin", FINALIZE_RAISES_PY % raised, io_config())
    with serving(tmp_path, new_prefix(), model_control_mode="explicit",
                 load_models=["fin"]) as server:
        stub = server.runtime("fin").instances[0].stub.proc
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            server.unload("fin")
        assert time.monotonic() - t0 < 3.0
        assert stub.poll() is not None
        assert "finalize failed" in caplog.text and raised.split("(")[0] in caplog.text
