"""A BLS target that may write into its input: the test of what an input Tensor sent again and
again (kept in shared memory by its sender) lets a receiver do.

Request parameters (bool): ``scribble`` adds 1 to INPUT0 in place before returning it as
OUTPUT0; ``keep`` keeps INPUT0's array for later calls. CHECK (JSON) says whether this input
and every kept one still hold the pattern the caller sent (arange mod 256, plus 1 for a kept
array this model scribbled on).
"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def pattern(n, plus=0):
    return ((np.arange(n) + plus) % 256).astype(np.uint8)


class TritonPythonModel:
    def initialize(self, args):
        self.kept = []  # [array, what was added to it]

    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters() or "{}")
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            check = {"input_ok": bool(np.array_equal(x, pattern(x.size))),
                     "writeable": bool(x.flags.writeable)}
            if params.get("scribble"):
                x += 1
            if params.get("keep"):
                self.kept.append([x, 1 if params.get("scribble") else 0])
            check["kept_ok"] = [bool(np.array_equal(a, pattern(a.size, plus))) for a, plus in self.kept]
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", x),
                pb_utils.Tensor("CHECK", np.array([json.dumps(check)], dtype=np.object_)),
            ]))
        return responses
