"""Sends one input Tensor to ``scribble`` over and over, and reports what every call saw.

SPEC (JSON): nbytes, calls, scribble (indices of the calls whose target writes into its input),
keep (the target keeps its inputs), caller_writes (this model adds 7 into every output it got),
async (calls made with async_exec), return_last (the last output goes back as OUTPUT0).
REPORT (JSON): per call the target's CHECK and whether OUTPUT0 held what it should; this stub's
copies, reuses and forwards; its pool's bytes in use before, with the tensor, and after it died.
"""
import asyncio
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def pattern(n, plus=0):
    return ((np.arange(n) + plus) % 256).astype(np.uint8)


def runtime():
    return getattr(pb_utils, "_runtime", None)


def used_bytes():
    return runtime().pool.usage()["used_bytes"]


async def settled_used(limit, seconds=5.0):
    # Releases come back asynchronously (batched): wait a little for the pool to drain. (On
    # the event loop: an async_exec's response is let go once the loop runs on, as Triton's
    # Future is.)
    deadline = time.monotonic() + seconds
    while used_bytes() > limit and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return used_bytes()


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            spec = json.loads(pb_utils.get_input_tensor_by_name(request, "SPEC").as_numpy()[0])
            report, last = await self.run(spec)
            outputs = [pb_utils.Tensor("REPORT", np.array([json.dumps(report)], dtype=np.object_))]
            if last is not None:
                outputs.append(pb_utils.Tensor("OUTPUT0", last))
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses

    async def run(self, spec):
        tr = runtime().transport
        n, calls = int(spec["nbytes"]), int(spec["calls"])
        used0 = await settled_used(0)
        before = (tr.copies, tr.reuses, tr.forwards)
        tensor = pb_utils.Tensor("INPUT0", pattern(n))
        report = {"calls": [], "used_before": used0}
        last = None
        for i in range(calls):
            scribble = i in spec.get("scribble", [])
            request = pb_utils.InferenceRequest(
                model_name="scribble", inputs=[tensor], requested_output_names=["OUTPUT0", "CHECK"],
                parameters={"scribble": scribble, "keep": bool(spec.get("keep"))})
            response = await request.async_exec() if spec.get("async") else request.exec()
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            out = pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy()
            check = json.loads(pb_utils.get_output_tensor_by_name(response, "CHECK").as_numpy()[0])
            check["output_ok"] = bool(np.array_equal(out, pattern(n, 1 if scribble else 0)))
            if spec.get("caller_writes"):
                out += 7
            report["calls"].append(check)
            last = out
            del response, out, request
        report["copies"], report["reuses"], report["forwards"] = (
            tr.copies - before[0], tr.reuses - before[1], tr.forwards - before[2])
        report["used_with_tensor"] = used_bytes()
        if not spec.get("return_last"):
            last = None
        del tensor
        report["used_after"] = await settled_used(used0)
        return report, last
