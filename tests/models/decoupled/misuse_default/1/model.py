"""A default-mode (not decoupled) model and the response sender (request parameter 'mode'):
sender_ok (one response with COMPLETE_FINAL), sender_split (one response, then a bare final
flag), two_responses (the second send raises; kept for 'report'), second_after_final (the
same after a response sent with the final flag), final_only (a bare
final flag first: raises; kept for 'report'), return_none (returns None
without sending anything), after_return / after_return_list (the sender answers from a thread
after execute returned None / a list with None for that request), raise_after_send (one
response sent, then execute raises), return_after_send (one response sent with the final flag,
and another returned), and 'report'."""
import json
import threading
import time

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
        responses = []
        for request in requests:
            mode = json.loads(request.parameters()).get("mode", "")
            value = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            if mode == "sender_ok":
                request.get_response_sender().send(out(value), flags=FINAL)
            elif mode == "sender_split":
                sender = request.get_response_sender()
                sender.send(out(value))
                sender.send(flags=FINAL)
            elif mode == "two_responses":
                sender = request.get_response_sender()
                sender.send(out(value))
                try:
                    sender.send(out(value + 1))
                    self.last = {"raised": None}
                except pb_utils.TritonModelException as exc:
                    self.last = {"raised": "TritonModelException", "message": exc.message()}
                sender.send(flags=FINAL)
            elif mode == "second_after_final":
                sender = request.get_response_sender()
                sender.send(out(value), flags=FINAL)
                try:
                    sender.send(out(value + 1))
                    self.last = {"raised": None}
                except pb_utils.TritonModelException as exc:
                    self.last = {"raised": "TritonModelException", "message": exc.message()}
            elif mode == "final_only":
                # A bare final flag before any response: refused in default mode; the model
                # then answers the usual way.
                try:
                    request.get_response_sender().send(flags=FINAL)
                    self.last = {"raised": None}
                except pb_utils.TritonModelException as exc:
                    self.last = {"raised": "TritonModelException", "message": exc.message()}
                responses.append(out(value))
            elif mode == "return_none":
                return None
            elif mode in ("after_return", "after_return_list"):
                sender = request.get_response_sender()

                def later(sender=sender, value=value):
                    time.sleep(0.2)  # well after execute returned
                    sender.send(out(value))
                    sender.send(flags=FINAL)
                threading.Thread(target=later, daemon=True).start()
                if mode == "after_return":
                    return None
                responses.append(None)
            elif mode == "raise_after_send":
                request.get_response_sender().send(out(value))
                raise pb_utils.TritonModelException("raised after its response went out")
            elif mode == "return_after_send":
                request.get_response_sender().send(out(value), flags=FINAL)
                responses.append(out(value + 1))
            elif mode == "report":
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
                    "REPORT", np.array([json.dumps(self.last)], dtype=np.object_))]))
                continue
            else:
                responses.append(out(value))
                continue
        return responses if responses else None
