"""Request rescheduling, decoupled: every execute of a request sends COUNT = how many times
this request has been executed; until COUNT reaches N the request is released with
RELEASE_RESCHEDULE (it comes back), then the stream is closed. Each response's parameters
say the request's correlation ID and flags as this execute saw them."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.counts = {}

    def execute(self, requests):
        for request in requests:
            key = request.request_id()
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            count = self.counts.get(key, 0) + 1
            self.counts[key] = count
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("COUNT", np.array([count], dtype=np.int32))],
                parameters={"cid": str(request.correlation_id()), "flags": request.flags()}))
            if count < n:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            else:
                del self.counts[key]
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
