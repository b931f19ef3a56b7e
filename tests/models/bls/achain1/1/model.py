"""An async BLS chain link: like chain1, but ``async def execute`` awaits ``async_exec``.
Request parameter 'hops' ("a,b,c") names the models still to call; 'fan' (first hop only)
awaits that many identical calls at once with asyncio.gather; 'delay_ms' sleeps first.
Answers DEPTH = its child's DEPTH + 1 and PATH = the instances on the way (the first child's).
achain2 and achain_b link to this file; achain1 and achain_b run one execute at a time, achain2
two."""
import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]

    async def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            hops = [h for h in params.get("hops", "").split(",") if h]
            await asyncio.sleep(int(params.get("delay_ms", 0)) / 1000)
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            if not hops:
                depth, path = 0, [self.instance]
            else:
                calls = [pb_utils.InferenceRequest(
                    model_name=hops[0], requested_output_names=["DEPTH", "PATH"],
                    inputs=[in0], parameters={"hops": ",".join(hops[1:])}).async_exec()
                    for _ in range(int(params.get("fan", 1)))]
                children = await asyncio.gather(*calls)
                failed = [c for c in children if c.has_error()]
                if failed:
                    responses.append(pb_utils.InferenceResponse(error=failed[0].error()))
                    continue
                child = children[0]
                depth = int(pb_utils.get_output_tensor_by_name(child, "DEPTH").as_numpy()[0]) + 1
                below = pb_utils.get_output_tensor_by_name(child, "PATH").as_numpy().tolist()
                path = [self.instance] + [p.decode() if isinstance(p, bytes) else p for p in below]
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("DEPTH", np.array([depth], dtype=np.int32)),
                pb_utils.Tensor("PATH", np.array(path, dtype=np.object_))]))
        return responses
