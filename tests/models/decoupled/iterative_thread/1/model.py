"""Request rescheduling with the first execute's response sender used from a thread.

The first execute of a request takes its response sender, releases the request with
RELEASE_RESCHEDULE and hands the sender to a thread. The second execute leaves the request
alone (it returns None and keeps nothing of it), so only the thread's sender can answer:
once the second execute is over, the thread sends COUNT = 1..N and the final flag. With
N = 0 it waits (up to 20 s) for the client to cancel, and then sends the final flag alone.
"""
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.runs = {}  # request id -> (how many executes, the event of the second)

    def execute(self, requests):
        for request in requests:
            key = request.request_id()
            if key not in self.runs:
                n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
                second = threading.Event()
                self.runs[key] = second
                sender = request.get_response_sender()
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                threading.Thread(target=self._answer, args=(sender, n, second),
                                 daemon=True).start()
            else:
                self.runs.pop(key).set()
        return None

    @staticmethod
    def _answer(sender, n, second):
        second.wait(20)
        time.sleep(0.3)  # well after the second execute let go of its request
        if n == 0:
            deadline = time.monotonic() + 20
            while not sender.is_cancelled() and time.monotonic() < deadline:
                time.sleep(0.01)
        for i in range(1, n + 1):
            sender.send(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("COUNT", np.array([i], dtype=np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
