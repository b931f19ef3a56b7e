"""bls_relay with async def execute: await async_exec(decoupled=True) on 'stream_n', iterated
with async for, each response forwarded as it arrives (see bls_relay)."""
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
    async def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            failed = False
            async for response in await target(request).async_exec(decoupled=True):
                if forward(sender, response):
                    failed = True
                    break
            if not failed:
                sender.send(flags=FINAL)
        return None
