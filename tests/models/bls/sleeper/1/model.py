"""Sleeps MS milliseconds in 5 ms steps, stopping early once the request is cancelled (which a
timeout does). LOG (JSON) lists every request served before: request id, ms slept, cancelled."""
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = []

    def execute(self, requests):
        responses = []
        for request in requests:
            ms = int(pb_utils.get_input_tensor_by_name(request, "MS").as_numpy()[0])
            t0 = time.monotonic()
            while (time.monotonic() - t0) * 1000 < ms and not request.is_cancelled():
                time.sleep(0.005)
            slept = int((time.monotonic() - t0) * 1000)
            history = json.dumps(self.log)
            self.log.append({"request_id": request.request_id(), "slept_ms": slept,
                             "cancelled": request.is_cancelled()})
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("SLEPT", np.array([slept], dtype=np.int32)),
                pb_utils.Tensor("LOG", np.array([history], dtype=np.object_))]))
        return responses
