"""A stateful accumulator keyed by correlation id: SEQUENCE_START resets the sum, every request
adds INPUT, SEQUENCE_END forgets the sequence. SEEN (JSON) reports what the request carried."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            corr = request.correlation_id()
            flags = request.flags()
            if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                self.sums[corr] = 0
            if corr not in self.sums:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"sequence {corr!r} was never started", pb_utils.TritonError.INVALID_ARG)))
                continue
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()[0])
            self.sums[corr] += value
            acc = self.sums[corr]
            if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                del self.sums[corr]
            seen = {"correlation_id": corr, "correlation_id_type": type(corr).__name__,
                    "flags": flags, "open_sequences": len(self.sums)}
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                # Wrapped to INT32 as a C++ accumulator would (NumPy 2 refuses an int past it).
                pb_utils.Tensor("ACC", np.array([acc], dtype=np.int64).astype(np.int32)),
                pb_utils.Tensor("SEEN", np.array([json.dumps(seen)], dtype=np.object_))]))
        return responses
