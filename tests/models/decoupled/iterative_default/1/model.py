"""Request rescheduling, default mode: a rescheduled request gets None in the returned list
(as Triton's docs say); on its N-th execute it gets its one response, COUNT = N. N < 0: the
model's bug, a response returned for a request it reschedules."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.counts = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            key = request.request_id()
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            if n < 0:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("COUNT", np.array([n], dtype=np.int32))]))
                continue
            count = self.counts.get(key, 0) + 1
            self.counts[key] = count
            if count < n:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
            else:
                del self.counts[key]
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("COUNT", np.array([count], dtype=np.int32))]))
        return responses
