"""The decoupled 'square' model of Triton's examples, written afresh: IN = n sends n responses
(each OUT = n) from a thread, then a bare COMPLETE_FINAL flag; IN = 0 sends only the flag."""
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            t = threading.Thread(target=self.respond, args=(request.get_response_sender(), n),
                                 daemon=True)
            t.start()
            self.threads.append(t)
        self.threads = [t for t in self.threads if t.is_alive()]
        return None

    @staticmethod
    def respond(sender, n):
        for _ in range(n):
            sender.send(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUT", np.array([n], dtype=np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for t in self.threads:
            t.join(timeout=10)
