"""The decoupled 'repeat' model of Triton's examples, written afresh: for each request a thread
sends one response per element of IN (OUT = IN[i], IDX = i), waiting DELAY[i] ms before each,
then waits WAIT ms and closes the stream with a bare COMPLETE_FINAL flag. execute returns None
at once; finalize waits for the threads still sending."""
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        if not pb_utils.using_decoupled_model_transaction_policy(
                __import__("json").loads(args["model_config"])):
            raise pb_utils.TritonModelException("repeat must be decoupled")
        self.threads = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().copy()
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy().copy()
            wait = int(pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy()[0])
            sender = request.get_response_sender()
            t = threading.Thread(target=self.send_all, args=(sender, values, delays, wait),
                                 daemon=True)
            t.start()
            self.threads.append(t)
        self.threads = [t for t in self.threads if t.is_alive()]
        return None

    @staticmethod
    def send_all(sender, values, delays, wait):
        for i, v in enumerate(values.tolist()):
            time.sleep(int(delays[i]) / 1000 if i < len(delays) else 0)
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUT", np.array([v], dtype=np.int32)),
                pb_utils.Tensor("IDX", np.array([i], dtype=np.uint32))]))
        time.sleep(wait / 1000)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for t in self.threads:
            t.join(timeout=10)
