"""Sends N responses (OUT = 0 .. N-1) from execute. Request parameters: 'final_with_last'
(the last response carries COMPLETE_FINAL; otherwise a bare flag follows), 'gate' (a file path:
after the first response, wait for that file to exist before sending the rest)."""
import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            params = json.loads(request.parameters())
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            with_last = bool(params.get("final_with_last", False))
            gate = params.get("gate", "")
            sender = request.get_response_sender()
            for i in range(n):
                if i == 1 and gate:
                    deadline = time.monotonic() + 20
                    while not os.path.exists(gate) and time.monotonic() < deadline:
                        time.sleep(0.002)
                flags = FINAL if (with_last and i == n - 1) else 0
                sender.send(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUT", np.array([i], dtype=np.int32))]),
                    flags=flags)
            if not (with_last and n > 0):
                sender.send(flags=FINAL)
        return None
