"""execute-prefetch-microseconds: an instance of a sync model whose executes are short gets its
next request while its execute runs (real stubs). It still runs one execute at a time, and a
request sent behind an execute that turns out long goes back to the queue, so another instance
serves it instead of it waiting behind that execute; and one sent behind an execute whose stub
dies is served by the restarted stub, as a request that had waited in the host's queue."""
from __future__ import annotations

import queue

import numpy as np
import pytest

import tritonpy
from tritonpy.metrics import metrics_text
from _models import serving_models, wait_for

MODEL_PY = '''
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

_lock = threading.Lock()
_inside = 0
_peak = 0


class TritonPythonModel:
    def execute(self, requests):
        global _inside, _peak
        with _lock:
            _inside += 1
            _peak = max(_peak, _inside)
        try:
            out = []
            for request in requests:
                mode = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])
                if mode == -1:  # the stub dies 10 ms into the execute
                    time.sleep(0.01)
                    os.kill(os.getpid(), 9)
                if mode == 1:  # held until the file named by the "gate" parameter exists
                    import json
                    gate = json.loads(request.parameters())["gate"]
                    while not os.path.exists(gate):
                        time.sleep(0.005)
                elif mode >= 2:  # busy for mode milliseconds
                    time.sleep(mode / 1000)
                out.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("PID", np.array([os.getpid()], np.int64)),
                    pb_utils.Tensor("PEAK", np.array([_peak], np.int64))]))
            return out
        finally:
            with _lock:
                _inside -= 1
'''

CONFIG = '''
name: "m"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_INT64, dims: [ 1 ] } ]
output [ { name: "PID", data_type: TYPE_INT64, dims: [ 1 ] },
         { name: "PEAK", data_type: TYPE_INT64, dims: [ 1 ] } ]
instance_group [ { count: COUNT, kind: KIND_CPU } ]
'''


def _serve(tmp_path, count: int, prefetch_us: str = "1000"):
    return serving_models(tmp_path, {"m": (MODEL_PY, CONFIG.replace("COUNT", str(count)))},
                          backend_config={"execute-prefetch-microseconds": prefetch_us})


def _x(mode: int) -> dict:
    return {"X": np.array([mode], np.int64)}


def _answer(stream, timeout: float = 30.0) -> tuple[int, int]:
    resp = stream.get(timeout=timeout)
    assert resp.error is None, resp.error
    return int(resp.outputs["PID"].to_numpy()[0]), int(resp.outputs["PEAK"].to_numpy()[0])


def test_a_sync_model_still_runs_one_execute_at_a_time(tmp_path) -> None:
    # Executes of 5-35 ms with prefetching allowed up to 1 s: requests are sent behind running
    # executes, and the stub's idle thread reads some of them while the execute runs (it takes
    # over reading after 20 ms). None may run beside the execute.
    with _serve(tmp_path, 1, prefetch_us="1000000") as server:
        model = server.model("m")
        streams = [model.infer(_x(5 + (i * 7) % 31)) for i in range(24)]
        peaks = [_answer(s)[1] for s in streams]
        assert max(peaks) == 1, f"executes overlapped: peaks {peaks}"


def test_a_request_sent_behind_a_long_execute_goes_to_another_instance(tmp_path) -> None:
    gate = tmp_path / "gate"
    with _serve(tmp_path, 2) as server:
        model = server.model("m")
        first, second = (i.stub.pid for i in server.runtime("m").instances)
        for _ in range(5):  # short executes: both instances prefetch
            _answer(model.infer(_x(0)))
        held = model.infer(_x(1), parameters={"gate": str(gate)})  # the first instance
        assert wait_for(lambda: server.runtime("m").instances[0].running == 1, timeout=10)
        busy = model.infer(_x(300))  # the second instance, for 0.3 s
        assert wait_for(lambda: server.runtime("m").instances[1].running == 1, timeout=10)
        behind = model.infer(_x(0))  # sent behind one of them while both run
        try:
            # Back in the queue 20 ms after its execute started, it runs once the second
            # instance is free, while the first is still held.
            assert _answer(behind, timeout=10) == (second, 1)
            assert _answer(busy)[0] == second
            with pytest.raises(queue.Empty):
                held.get(timeout=0.05)
        finally:
            gate.touch()
        assert _answer(held)[0] == first


def test_a_request_sent_behind_an_execute_whose_stub_dies_is_served_after_the_restart(
        tmp_path) -> None:
    with _serve(tmp_path, 1) as server:
        model = server.model("m")
        dying = model.infer(_x(-1))
        behind = model.infer(_x(0))  # sent at once, behind the execute that will crash
        resp = dying.get(timeout=30)
        assert resp.error is not None and "killed by signal SIGKILL" in resp.error.message
        pid, _ = _answer(behind)  # it never started: the restarted stub serves it
        assert pid == server.runtime("m").instances[0].stub.pid


def test_pending_requests_count_those_queued_and_those_sent_behind_an_execute(tmp_path) -> None:
    gate = tmp_path / "gate"
    with _serve(tmp_path, 1) as server:
        model = server.model("m")
        held = model.infer(_x(1), parameters={"gate": str(gate)})
        inst = server.runtime("m").instances[0]
        assert wait_for(lambda: inst.running == 1, timeout=10)
        waiting = [model.infer(_x(0)) for _ in range(2)]  # one may go behind the held execute
        try:
            line = 'nv_inference_pending_request_count{model="m",version="1"} 2'
            assert line in metrics_text(server).splitlines()
            assert server.pending_requests() == [{"name": "m", "version": "1", "count": 2}]
        finally:
            gate.touch()
        for stream in [held, *waiting]:
            _answer(stream)
        assert server.pending_requests() == [{"name": "m", "version": "1", "count": 0}]


def test_prefetch_can_be_turned_off(tmp_path) -> None:
    with _serve(tmp_path, 1, prefetch_us="0") as server:
        inst = server.runtime("m").instances[0]
        assert inst.prefetch_ns == 0
        model = server.model("m")
        streams = [model.infer(_x(2)) for _ in range(4)]
        assert wait_for(lambda: inst.running == 1, timeout=10)
        assert not inst.free()  # nothing is sent behind its execute
        assert [_answer(s)[1] for s in streams] == [1] * 4


@pytest.mark.parametrize("value, message", [
    ("-1", "execute-prefetch-microseconds must be between 0 and 1000000000, got -1"),
    ("soon", "backend option 'execute-prefetch-microseconds' expects a number, got 'soon'"),
])
def test_a_bad_prefetch_option_is_refused(tmp_path, value, message) -> None:
    with pytest.raises(tritonpy.InvalidArgumentError, match=message):
        tritonpy.Server(str(tmp_path), backend_config={"execute-prefetch-microseconds": value})


SEQ_PY = '''
import itertools, json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

_order = itertools.count()


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            gate = json.loads(request.parameters()).get("gate")
            while gate and not os.path.exists(gate):
                time.sleep(0.005)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SEQ", np.array([next(_order)], np.int64))]))
        return out
'''

SEQ_CONFIG = '''
name: "seq"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_INT64, dims: [ 1 ] } ]
output [ { name: "SEQ", data_type: TYPE_INT64, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
'''


def test_requests_reach_the_stub_in_the_order_they_were_taken(tmp_path) -> None:
    """A request taken by one thread (A: behind a running execute) and one taken after it by
    another (B: the frame loop, as that execute ends) reach the stub in that order, even
    when the first thread is slow to send (a sleep injected into its send; in the server, a
    cancel or a submit from a client's thread takes requests too). B used to overtake A:
    a stream of an ensemble got two responses swapped (found by QA)."""
    import threading

    gate = tmp_path / "gate"
    with serving_models(tmp_path, {"seq": (SEQ_PY, SEQ_CONFIG)},
                        backend_config={"execute-prefetch-microseconds": "1000000"}) as server:
        model, rt = server.model("seq"), server.runtime("seq")
        for _ in range(3):
            model.infer(_x(0)).get(timeout=30)
        held = model.infer(_x(0), parameters={"gate": str(gate)})
        inst = rt.instances[0]
        assert wait_for(lambda: inst.running == 1, timeout=10)
        real_send = rt._send
        b_answered = threading.Event()
        a_in_send = threading.Event()

        def slow_send(inst_: object, batch: list) -> None:
            if threading.current_thread().name == "A":
                a_in_send.set()
                b_answered.wait(1.0)  # B overtook A by then, if it can
            real_send(inst_, batch)

        rt._send = slow_send  # (an instance attribute: the runtime's own method is shadowed)
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("a", model.infer(_x(0))), name="A")
        t.start()
        assert a_in_send.wait(10)  # A is taken (sent behind the held execute), not yet sent
        b = model.infer(_x(0))  # queued: the instance has its two
        gate.touch()  # the held execute ends: the frame loop takes B
        held.get(timeout=30)
        seq_b = int(b.get(timeout=30).outputs["SEQ"].to_numpy()[0])
        b_answered.set()
        t.join(10)
        seq_a = int(box["a"].get(timeout=30).outputs["SEQ"].to_numpy()[0])
        del rt._send
        assert seq_a < seq_b, (seq_a, seq_b)
