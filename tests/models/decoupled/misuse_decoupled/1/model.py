"""A decoupled model that misuses its response sender on purpose (request parameter 'mode'):
send_after_final (the exception is kept and reported later), final_twice, return_list (execute
returns responses), send_then_return (the stream is complete, then execute returns responses),
bad_calls (unsupported flags, no response without the final flag), raise, send_then_raise
(one response, then execute raises); 'report' answers
with what the last misuse raised (REPORT, JSON)."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def out(v):
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor("OUT", np.array([v], dtype=np.int32))])


class TritonPythonModel:
    def initialize(self, args):
        self.last = None

    def execute(self, requests):
        for request in requests:
            mode = json.loads(request.parameters()).get("mode", "")
            sender = request.get_response_sender()
            if mode == "send_after_final":
                sender.send(out(1))
                sender.send(flags=FINAL)
                try:
                    sender.send(out(2))
                    self.last = {"raised": None}
                except pb_utils.TritonModelException as exc:
                    self.last = {"raised": "TritonModelException", "message": exc.message()}
            elif mode == "final_twice":
                sender.send(out(1), flags=FINAL)
                try:
                    sender.send(flags=FINAL)
                    self.last = {"raised": None}
                except pb_utils.TritonModelException as exc:
                    self.last = {"raised": "TritonModelException", "message": exc.message()}
            elif mode == "bad_calls":
                # Each refused as Triton refuses it; the stream then completes normally.
                raised = []
                for args in ((out(1), 3), (None, 0), (out(1), 2)):
                    try:
                        sender.send(*args)
                        raised.append(None)
                    except pb_utils.TritonModelException as exc:
                        raised.append(exc.message())
                sender.send(out(9), flags=FINAL)
                self.last = {"messages": raised}
            elif mode == "return_list":
                return [out(1) for _ in requests]
            elif mode == "send_then_return":
                sender.send(out(1), flags=FINAL)
                return [out(2) for _ in requests]
            elif mode == "raise":
                raise RuntimeError("misuse_decoupled raised on purpose")
            elif mode == "send_then_raise":
                sender.send(out(1))
                raise pb_utils.TritonModelException("misuse_decoupled raised after a response")
            elif mode == "report":
                sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
                    "REPORT", np.array([json.dumps(self.last)], dtype=np.object_))]), flags=FINAL)
        return None
