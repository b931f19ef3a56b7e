"""Models for the scheduler tests, and a gate that holds an ``execute`` until the test opens it.

A gate is a file path: a model that is handed one (request parameter ``gate``, or a gate path
baked into its source) waits in ``execute``/``initialize`` until the file exists (at most 30 s),
so a test can queue requests behind a busy instance and then let them go, and observe the
batches that formed by what the model saw — by order and content, never by timing.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tritonpy
from _models import io_config

# Each request's response says which execute call it was in (exec), how many requests that call
# had (batch), how many rows they had together (rows), where it was in the list (pos), and the
# instance. OUT = IN. A request with parameter "gate" holds its execute until the file exists.
BATCH_PY = """
import json, os, time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]
        self.execs = 0

    def execute(self, requests):
        self.execs += 1
        rows = 0
        for r in requests:
            rows += pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().shape[0]
        for r in requests:
            gate = json.loads(r.parameters()).get("gate")
            if gate:
                deadline = time.monotonic() + 60
                while not os.path.exists(gate) and time.monotonic() < deadline:
                    time.sleep(0.005)
        out = []
        for pos, r in enumerate(requests):
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)], parameters={
                "exec": self.execs, "batch": len(requests), "rows": int(rows), "pos": pos,
                "instance": self.instance}))
        return out
"""

# A stateful model: per correlation ID it adds IN to a running sum (reset at START) and returns
# the sum; the parameters report every control input it received, its value and dtype.
SEQ_PY = """
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

CONTROLS = ("START", "END", "READY", "CORRID")

class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]
        self.state = {}
        self.execs = 0

    def execute(self, requests):
        self.execs += 1
        for r in requests:
            gate = json.loads(r.parameters()).get("gate")
            if gate:
                deadline = time.monotonic() + 60
                while not os.path.exists(gate) and time.monotonic() < deadline:
                    time.sleep(0.005)
        out = []
        readies = []  # READY of each request of the batch, in order (None: no READY input)
        for r in requests:
            t = pb_utils.get_input_tensor_by_name(r, "READY")
            readies.append(None if t is None else bool(t.as_numpy().reshape(-1)[0]))
        for pos, r in enumerate(requests):
            cid = r.correlation_id()
            x = float(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().reshape(-1)[0])
            seen = {}
            for name in CONTROLS:
                t = pb_utils.get_input_tensor_by_name(r, name)
                if t is not None:
                    a = t.as_numpy()
                    v = a.reshape(-1)[0]
                    v = v.decode() if isinstance(v, bytes) else v.item()
                    seen[name] = [v, str(a.dtype), list(a.shape)]
            if r.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                self.state[cid] = 0.0
            self.state[cid] = self.state.get(cid, 0.0) + x
            shape = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().shape
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.full(shape, self.state[cid], np.float32))],
                parameters={"instance": self.instance, "exec": self.execs,
                            "batch": len(requests), "pos": pos, "flags": r.flags(),
                            "cid": json.dumps(cid), "controls": json.dumps(seen),
                            "readies": json.dumps(readies)}))
        return out
"""

# Drives SEQ_PY through BLS: IN holds the values of one sequence; the correlation ID comes from
# the request parameter "cid" (a JSON int or string). OUT is the last running sum.
SEQ_BLS_PY = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            params = json.loads(r.parameters())
            cid = params["cid"]
            target = params["target"]
            values = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            sums = []
            for i, v in enumerate(values):
                flags = 0
                if i == 0:
                    flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
                if i == len(values) - 1:
                    flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
                resp = pb_utils.InferenceRequest(
                    model_name=target, requested_output_names=["OUT"],
                    inputs=[pb_utils.Tensor("IN", np.array([v], np.float32))],
                    correlation_id=cid, flags=flags).exec()
                if resp.has_error():
                    raise pb_utils.TritonModelException(resp.error().message())
                sums.append(float(pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy()[0]))
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array(sums, np.float32))]))
        return out
"""


def seq_config(strategy: str = "direct { }", controls: str = "", max_batch_size: int = 0,
               instances: int = 1, idle_us: int = 0, extra: str = "", dims: str = "[ 1 ]") -> str:
    """A SEQ_PY configuration: FP32 IN/OUT (of one element unless ``dims`` says), the given
    strategy and controls."""
    idle = f"max_sequence_idle_microseconds: {idle_us}\n" if idle_us else ""
    return io_config(max_batch_size, dims=dims, extra=(
        f"sequence_batching {{\n{idle}{strategy}\n{controls}\n}}\n"
        f"instance_group [ {{ count: {instances}, kind: KIND_CPU }} ]\n{extra}"))


ALL_CONTROLS = """
control_input [
  { name: "START", control [ { kind: CONTROL_SEQUENCE_START, int32_false_true: [ 0, 1 ] } ] },
  { name: "END", control [ { kind: CONTROL_SEQUENCE_END, fp32_false_true: [ 0, 1 ] } ] },
  { name: "READY", control [ { kind: CONTROL_SEQUENCE_READY, bool_false_true: [ false, true ] } ] },
  { name: "CORRID", control [ { kind: CONTROL_SEQUENCE_CORRID, data_type: CORRID_TYPE } ] }
]
"""


class Gate:
    """A file path a model waits on; ``open()`` creates the file."""

    def __init__(self, directory: Path, name: str = "gate") -> None:
        self.path = str(directory / name)

    def open(self) -> None:
        Path(self.path).touch()

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.open()  # never leave a model waiting, whatever the test did


def params(resp: tritonpy.InferenceResponse) -> dict:
    assert resp.error is None, resp.error
    return dict(resp.parameters)


def controls(resp: tritonpy.InferenceResponse) -> dict:
    return json.loads(params(resp)["controls"])
