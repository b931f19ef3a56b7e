"""async def execute in a default-mode model, with a barrier: each request (parameters 'group',
'n', 'timeout_s') waits until n requests of its group are inside execute at the same moment.
Reaching it proves n executes overlap; REPORT (JSON) also gives the peak number inside."""
import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.inside = 0
        self.peak = 0
        self.groups = {}

    async def execute(self, requests):
        self.inside += 1
        self.peak = max(self.peak, self.inside)
        try:
            responses = []
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
                report = {"reached": reached, "inside_now": self.inside, "peak": self.peak}
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
                    "REPORT", np.array([json.dumps(report)], dtype=np.object_))]))
            return responses
        finally:
            self.inside -= 1
