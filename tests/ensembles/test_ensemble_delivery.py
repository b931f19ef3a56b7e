"""An ensemble delivers its responses outside its request's lock, in the order it made them.

A consumer that calls back into the ensemble request from the delivery itself (here: a sink
that cancels the request when its first response arrives, on the thread that reads the stubs)
once waited for ever on the lock that its own delivery held, and the server with it. The
request is driven through the runtime with a sink of the test's own (the public streams defer
such calls), as a frontend or an outer ensemble does.
"""
from __future__ import annotations

import threading
from typing import Any, Iterator

import numpy as np
import pytest

import tritonpy
from _models import new_prefix, serving, write_model
from tritonpy._request import HostRequest

pytestmark = pytest.mark.timeout(60)

PRODUCER = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])
            for i in range(n):
                if r.is_cancelled():
                    break
                sender.send(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.array([i], dtype=np.float32))]))
                time.sleep(0.01)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

FP32_IO = """
backend: "python"
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""

ENSEMBLE = """
platform: "ensemble"
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
ensemble_scheduling { step [ { model_name: "producer" model_version: -1
  input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "OUT" } } ] }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tritonpy.Server]:
    repo = tmp_path_factory.mktemp("delivery_repo")
    write_model(repo, "producer", PRODUCER,
                FP32_IO + "model_transaction_policy { decoupled: true }\n")
    write_model(repo, "stream", "", ENSEMBLE)
    (repo / "stream" / "1" / "model.py").unlink()
    with serving(repo, new_prefix()) as srv:
        yield srv


class _Recorder:
    """A sink that keeps what it is given, and may call back into the request."""

    def __init__(self, on_first: Any = None) -> None:
        self.got: list[tuple[Any, Any, bool, str]] = []
        self.ended = threading.Event()
        self.on_first = on_first

    def __call__(self, req: HostRequest, outputs: Any, error: Any, parameters: Any,
                 final: bool) -> None:
        value = float(dict(outputs)["OUT"][0]) if outputs else None
        self.got.append((value, error, final, threading.current_thread().name))
        if len(self.got) == 1 and self.on_first is not None:
            self.on_first(req)
        if final:
            self.ended.set()


def _submit(server: tritonpy.Server, n: int, sink: _Recorder) -> HostRequest:
    rt = server.runtime("stream")
    req = HostRequest(rt, [("IN", np.array([n], np.float32))], None, sink)
    server.validate(rt, req)
    rt.submit(req)
    return req


def test_a_sink_that_cancels_from_its_delivery_does_not_hang_the_server(
        server: tritonpy.Server) -> None:
    sink = _Recorder(on_first=lambda req: req.cancel("enough"))
    _submit(server, 1000, sink)
    assert sink.ended.wait(20), f"the request never ended: {sink.got[:5]}"
    assert sink.got[0][0] == 0.0 and sink.got[0][1] is None
    last = sink.got[-1]
    assert last[2] and last[1] is not None and last[1].code.value == "CANCELLED", last
    assert len(sink.got) < 1000
    # The server goes on serving.
    more = _Recorder()
    _submit(server, 3, more)
    assert more.ended.wait(20)
    assert [g[0] for g in more.got] == [0.0, 1.0, 2.0, None]
    assert not server.runtime("stream")._busy()


def test_responses_arrive_in_the_order_they_were_made_with_the_final_last(
        server: tritonpy.Server) -> None:
    sinks = [_Recorder() for _ in range(4)]
    for sink in sinks:
        _submit(server, 50, sink)
    for sink in sinks:
        assert sink.ended.wait(30)
        assert [g[0] for g in sink.got] == [float(i) for i in range(50)] + [None]
        assert [g[2] for g in sink.got] == [False] * 50 + [True]
