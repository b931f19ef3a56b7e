"""A BLS chain link: request parameter 'hops' ("a,b,c") names the models still to call. This
model calls the first hop (sync exec) with the rest, and answers DEPTH = its DEPTH + 1 and PATH
= the instances on the way; a failed hop's error is returned with its code unchanged. Parameter
'delay_ms' (first hop only) sleeps before calling, so that two callers can be busy at once. The
chain2 and chain_b link to this file; chain1 and chain_b have one instance, chain2 two."""
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            hops = [h for h in params.get("hops", "").split(",") if h]
            time.sleep(int(params.get("delay_ms", 0)) / 1000)
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            if not hops:
                depth, path = 0, [self.instance]
            else:
                child = pb_utils.InferenceRequest(
                    model_name=hops[0], requested_output_names=["DEPTH", "PATH"],
                    inputs=[in0], parameters={"hops": ",".join(hops[1:])}).exec()
                if child.has_error():
                    responses.append(pb_utils.InferenceResponse(error=child.error()))
                    continue
                depth = int(pb_utils.get_output_tensor_by_name(child, "DEPTH").as_numpy()[0]) + 1
                below = pb_utils.get_output_tensor_by_name(child, "PATH").as_numpy().tolist()
                path = [self.instance] + [p.decode() if isinstance(p, bytes) else p for p in below]
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("DEPTH", np.array([depth], dtype=np.int32)),
                pb_utils.Tensor("PATH", np.array(path, dtype=np.object_))]))
        return responses
