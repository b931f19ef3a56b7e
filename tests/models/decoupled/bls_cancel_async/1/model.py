"""bls_cancel with async def execute: await async_exec(decoupled=True), async for, cancel()
after AFTER responses with tensors (see bls_cancel)."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def stream_request(rid):
    return pb_utils.InferenceRequest(
        model_name="cancel_poll", requested_output_names=["OUT"], request_id=rid,
        inputs=[pb_utils.Tensor("IN", np.array([0], dtype=np.int32))],
        parameters={"mode": "stream"})


def report(received, last):
    err = last.error() if last is not None else None
    out = {"received": received, "ended": last is not None,
           "error": None if err is None else {
               "cancelled": err.code() == pb_utils.TritonError.CANCELLED,
               "message": err.message()}}
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
        "REPORT", np.array([json.dumps(out)], dtype=np.object_))])


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            after = int(pb_utils.get_input_tensor_by_name(request, "AFTER").as_numpy()[0])
            rid = json.loads(request.parameters())["rid"]
            stream = await stream_request(rid).async_exec(decoupled=True)
            received, last = 0, None
            async for response in stream:
                last = response
                if response.output_tensors():
                    received += 1
                    if received == after:
                        stream.cancel()
            responses.append(report(received, last))
        return responses
