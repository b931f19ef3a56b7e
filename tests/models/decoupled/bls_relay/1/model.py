"""A decoupled BLS caller: exec(decoupled=True) on 'stream_n' (N, and the request parameter
'gate' passed on) and each response forwarded to this request's sender the moment the BLS
iterator yields it; the bare final flag closes this stream too. With a gate, stream_n waits
after its first response until the test creates the gate file, so the test only gets past
the first response if BLS responses stream to the caller as they arrive."""
import json

import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def target(request):
    params = json.loads(request.parameters())
    return pb_utils.InferenceRequest(
        model_name="stream_n", requested_output_names=["OUT"],
        inputs=[pb_utils.get_input_tensor_by_name(request, "N")],
        parameters={"gate": params.get("gate", "")})


def forward(sender, response):
    if response.has_error():
        sender.send(pb_utils.InferenceResponse(error=response.error()), flags=FINAL)
        return True
    if response.output_tensors():
        sender.send(pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUT", pb_utils.get_output_tensor_by_name(response, "OUT")
                            .as_numpy().copy())]))
    return False


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            for response in target(request).exec(decoupled=True):
                if forward(sender, response):
                    break
            else:
                sender.send(flags=FINAL)
        return None
