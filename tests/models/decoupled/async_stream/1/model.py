"""async def execute in a decoupled model. Each request (parameters 'group', 'n', 'timeout_s')
first waits until n requests of its group are inside execute at once, and sends REPORT (JSON:
reached, peak number inside); then OUT from a blocking exec() on 'double' (2*IN), then OUT
from an await async_exec() on 'double' (2*(IN+1)), then the bare final flag."""
import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def double(values):
    return pb_utils.InferenceRequest(model_name="double", requested_output_names=["OUT"],
                                     inputs=[pb_utils.Tensor("IN", values.astype(np.int32))])


def out(response):
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    arr = pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy().copy()
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", arr)])


class TritonPythonModel:
    def initialize(self, args):
        self.inside = 0
        self.peak = 0
        self.groups = {}

    async def execute(self, requests):
        self.inside += 1
        self.peak = max(self.peak, self.inside)
        try:
            for request in requests:
                params = json.loads(request.parameters())
                group = self.groups.setdefault(params.get("group", ""), [0, asyncio.Event()])
                group[0] += 1
                if group[0] >= int(params.get("n", 1)):
                    group[1].set()
                try:
                    await asyncio.wait_for(group[1].wait(), float(params.get("timeout_s", 10)))
                    reached = True
                except asyncio.TimeoutError:
                    reached = False
                sender = request.get_response_sender()
                sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
                    "REPORT", np.array([json.dumps({"reached": reached, "peak": self.peak})],
                                       dtype=np.object_))]))
                x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
                sender.send(out(double(x).exec()))
                sender.send(out(await double(x + 1).async_exec()))
                sender.send(flags=FINAL)
        finally:
            self.inside -= 1
        return None
