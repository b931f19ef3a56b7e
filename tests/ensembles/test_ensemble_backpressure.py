"""An ensemble's ``max_inflight_requests`` (a newer Triton's back-pressure between steps;
upstream's ``L0_simple_ensemble/ensemble_backpressure_test.py``): at most that many requests
run at each step at once, across all of the ensemble's requests, and a decoupled step that
streams faster than the step after it consumes waits to send, so that neither step requests
nor their tensors pile up in the server.

The models are real stubs: a decoupled producer streams N responses as fast as it may,
recording after each send how many it has sent; a slow consumer with 8 instances records, as
it starts each request, how many producer responses were sent by then and how many of its
instances are running (marker files), and answers them with its input.
"""
from __future__ import annotations

import os
import queue
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import tritonpy

from _models import new_prefix, serving, wait_for, write_model

pytestmark = pytest.mark.timeout(120)

PRODUCER = """
import json, os
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            p = json.loads(r.parameters())
            sender = r.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])
            for i in range(n):
                if r.is_cancelled():
                    break
                sender.send(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.array([i], dtype=np.float32))]))
                tmp = p["sent"] + ".tmp"
                with open(tmp, "w") as f:
                    f.write(str(i + 1))
                os.replace(tmp, p["sent"])
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            open(p["sent"] + ".done", "w").close()
        return None
"""

# OUT = [its input, producer responses sent when it started, its instances running then].
CONSUMER = """
import json, os, time, uuid
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            p = json.loads(r.parameters())
            marker = os.path.join(p["runs"], uuid.uuid4().hex)
            open(marker, "w").close()
            running = len(os.listdir(p["runs"]))
            try:
                with open(p["sent"]) as f:
                    sent = int(f.read() or 0)
            except FileNotFoundError:
                sent = 0
            time.sleep(float(p.get("hold", 0.05)))
            os.unlink(marker)
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", np.array([x[0], sent, running], dtype=np.float32))]))
        return out
"""

FP32_IO = """
backend: "python"
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""


def ensemble(limit: int) -> str:
    setting = f"max_inflight_requests: {limit}\n" if limit else ""
    return f"""
platform: "ensemble"
max_batch_size: 0
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] }} ]
ensemble_scheduling {{
  {setting}step [
    {{ model_name: "producer" model_version: -1
       input_map {{ key: "IN" value: "IN" }} output_map {{ key: "OUT" value: "mid" }} }},
    {{ model_name: "consumer" model_version: -1
       input_map {{ key: "IN" value: "mid" }} output_map {{ key: "OUT" value: "OUT" }} }}
  ]
}}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tritonpy.Server]:
    repo = tmp_path_factory.mktemp("backpressure_repo")
    write_model(repo, "producer", PRODUCER,
                FP32_IO + "model_transaction_policy { decoupled: true }\n")
    write_model(repo, "consumer", CONSUMER,
                FP32_IO + "instance_group [ { count: 8, kind: KIND_CPU } ]\n")
    for name, limit in (("limit_4", 4), ("limit_1", 1), ("unlimited", 0)):
        write_model(repo, name, "", ensemble(limit))
        (repo / name / "1" / "model.py").unlink()
    with serving(repo, new_prefix()) as srv:
        yield srv


def _dirs(tmp: Path, name: str) -> dict[str, str]:
    (tmp / f"{name}_runs").mkdir()
    return {"sent": str(tmp / f"{name}_sent"), "runs": str(tmp / f"{name}_runs")}


def _collect(stream: tritonpy.ResponseStream) -> list[np.ndarray]:
    rows = []
    while True:
        resp = stream.get(timeout=60)
        assert resp.error is None, resp.error
        if resp.outputs:
            rows.append(resp.outputs["OUT"].to_numpy())
        if resp.final:
            return rows


def _run(server: tritonpy.Server, model: str, n: int, params: dict[str, str]) -> np.ndarray:
    stream = server.model(model).infer({"IN": np.array([n], np.float32)}, parameters=params)
    rows = np.array(_collect(stream))
    assert sorted(rows[:, 0].tolist()) == list(range(n))  # every response, each once
    return rows


def test_the_limit_bounds_the_step_and_paces_the_producer(server: tritonpy.Server,
                                                           tmp_path: Path) -> None:
    rows = _run(server, "limit_4", 32, _dirs(tmp_path, "a"))
    # Eight consumer instances, but never more than 4 of them at once.
    assert rows[:, 2].max() <= 4
    assert rows[:, 2].max() >= 2  # (the limit lets several run: it is not one at a time)
    # The producer was never far ahead of the response being consumed: 4 running, 4 let
    # through its stub's pacing and waiting at the gate, one more to the sends it counted.
    ahead = rows[:, 1] - rows[:, 0]
    assert ahead.max() <= 9, ahead


def test_without_a_limit_the_producer_runs_ahead(server: tritonpy.Server,
                                                 tmp_path: Path) -> None:
    # What the test above rules out happens here: the measure is not blind. The consumer
    # holds each request longer here, so that a producer slowed by a loaded machine still
    # runs well ahead of it.
    params = _dirs(tmp_path, "b")
    params["hold"] = "0.4"
    rows = _run(server, "unlimited", 32, params)
    assert rows[:, 2].max() > 4
    assert (rows[:, 1] - rows[:, 0]).max() > 9


def test_a_limit_of_one_runs_one_at_a_time(server: tritonpy.Server, tmp_path: Path) -> None:
    rows = _run(server, "limit_1", 8, _dirs(tmp_path, "c"))
    assert rows[:, 2].max() == 1
    assert (rows[:, 1] - rows[:, 0]).max() <= 3


def test_the_limit_is_shared_by_concurrent_requests(server: tritonpy.Server,
                                                    tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    streams = [server.model("limit_4").infer(
        {"IN": np.array([8], np.float32)},
        parameters={"sent": str(tmp_path / f"sent{i}"), "runs": str(runs)}) for i in range(8)]
    rows = [np.array(_collect(s)) for s in streams]
    for r in rows:
        assert sorted(r[:, 0].tolist()) == list(range(8))
    assert max(r[:, 2].max() for r in rows) <= 4


def test_cancelling_frees_a_waiting_producer_and_the_steps(server: tritonpy.Server,
                                                           tmp_path: Path) -> None:
    params = _dirs(tmp_path, "d")
    stream = server.model("limit_4").infer({"IN": np.array([1000], np.float32)},
                                           parameters=params)
    first = stream.get(timeout=60)
    assert first.error is None and first.outputs
    stream.cancel()
    while True:  # responses that were on their way, then the cancel
        resp = stream.get(timeout=60)
        if resp.error is not None:
            assert resp.error.code.value == "CANCELLED", resp.error
            break
        assert not resp.final, "the request ran to its end"
    # The producer, which waited to send, sees the cancel and ends its execute.
    assert wait_for(lambda: os.path.exists(params["sent"] + ".done"), timeout=30)
    sent = int(Path(params["sent"]).read_text())
    assert sent < 100, sent
    # Nothing of it holds the step's gate: requests still go through, 4 at a time.
    time.sleep(0.2)
    rows = _run(server, "limit_4", 8, _dirs(tmp_path, "e"))
    assert rows[:, 2].max() <= 4


def test_the_setting_is_in_the_served_config(server: tritonpy.Server) -> None:
    assert server.model("limit_4").config()["ensemble_scheduling"][
        "max_inflight_requests"] == 4
    assert "max_inflight_requests" not in server.model("unlimited").config()[
        "ensemble_scheduling"]


def test_over_grpc_as_upstreams_test(server: tritonpy.Server, tmp_path: Path) -> None:
    # Upstream's cases with the real tritonclient over a gRPC stream: a whole stream, then
    # one cancelled by the client after its first response (stop_stream(cancel_requests=True)).
    import tritonclient.grpc as grpcclient
    from tritonpy.frontends import Frontends

    fe = Frontends(server, http_port=0, grpc_port=0, allow_metrics=False,
                   http_address="127.0.0.1", grpc_address="127.0.0.1")
    fe.start_in_thread()
    try:
        def stream(n: int, params: dict[str, str]) -> tuple[Any, queue.Queue]:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{fe.grpc_port}")
            got: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: got.put((result, error)))
            inp = grpcclient.InferInput("IN", [1], "FP32")
            inp.set_data_from_numpy(np.array([n], np.float32))
            client.async_stream_infer("limit_4", [inp], parameters=params,
                                      enable_empty_final_response=True)
            return client, got

        client, got = stream(32, _dirs(tmp_path, "g"))
        values = []
        while True:
            result, error = got.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                values.append(int(result.as_numpy("OUT")[0]))
            if response.parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
        client.close()
        assert sorted(values) == list(range(32))

        params = _dirs(tmp_path, "h")
        client, got = stream(1000, params)
        result, error = got.get(timeout=60)
        assert error is None and result.get_response().outputs
        client.stop_stream(cancel_requests=True)
        client.close()
        while True:
            result, error = got.get(timeout=30)
            if error is not None:
                assert error.status() == "StatusCode.CANCELLED", error
                break
        assert wait_for(lambda: os.path.exists(params["sent"] + ".done"), timeout=30)
        assert int(Path(params["sent"]).read_text()) < 100
    finally:
        fe.stop_in_thread()
    rows = _run(server, "limit_4", 8, _dirs(tmp_path, "i"))
    assert rows[:, 2].max() <= 4


def test_stopping_the_server_mid_stream_does_not_hang(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "producer", PRODUCER,
                FP32_IO + "model_transaction_policy { decoupled: true }\n")
    write_model(repo, "consumer", CONSUMER,
                FP32_IO + "instance_group [ { count: 2, kind: KIND_CPU } ]\n")
    write_model(repo, "limit_1", "", ensemble(1))
    (repo / "limit_1" / "1" / "model.py").unlink()
    params = _dirs(tmp_path, "s")
    started = time.monotonic()
    with serving(repo, new_prefix()) as srv:
        stream = srv.model("limit_1").infer({"IN": np.array([60], np.float32)},
                                            parameters=params)
        assert stream.get(timeout=60).error is None
    # The stop let the producer run out (its pacing lifted) and the steps drain.
    assert os.path.exists(params["sent"] + ".done")
    assert time.monotonic() - started < 30
