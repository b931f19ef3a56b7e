"""BLS from a thread that outlives execute(). Request parameter 'action': 'start' starts a
thread that waits until execute has returned, then calls add_sub (INPUT0 + INPUT0) with
exec() (or exec(decoupled=True) on 'square' with 'decoupled': true) and records the outcome;
'report' returns that record as REPORT (JSON): done, output or exception, seconds taken."""
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.record = {"done": False}
        self.returned = threading.Event()

    def work(self, in0, decoupled):
        self.returned.wait(10)
        time.sleep(0.05)  # well after execute() has returned
        t0 = time.monotonic()
        rec = {"done": True, "exception": None, "output": None}
        try:
            if decoupled:
                request = pb_utils.InferenceRequest(
                    model_name="square", requested_output_names=["OUT"],
                    inputs=[pb_utils.Tensor("IN", np.array([2], np.int32))])
                rec["output"] = [r.as_numpy().tolist() for resp in request.exec(decoupled=True)
                                 for r in resp.output_tensors()]
            else:
                request = pb_utils.InferenceRequest(
                    model_name="add_sub", requested_output_names=["OUTPUT0"],
                    inputs=[pb_utils.Tensor("INPUT0", in0), pb_utils.Tensor("INPUT1", in0)])
                resp = request.exec()
                if resp.has_error():
                    rec["exception"] = f"error response: {resp.error().message()}"
                else:
                    rec["output"] = pb_utils.get_output_tensor_by_name(
                        resp, "OUTPUT0").as_numpy().tolist()
        except Exception as exc:
            rec["exception"] = f"{type(exc).__name__}: {exc}"
        rec["seconds"] = time.monotonic() - t0
        self.record = rec

    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            if params.get("action") == "start":
                self.record = {"done": False}
                self.returned.clear()
                in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy().copy()
                threading.Thread(target=self.work, args=(in0, bool(params.get("decoupled"))),
                                 daemon=True).start()
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
                "REPORT", np.array([json.dumps(self.record)], dtype=np.object_))]))
        self.returned.set()
        return responses
