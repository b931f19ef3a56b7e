"""BLS replies nobody reads still give their shared memory back: a decoupled stream left
part-way (a ``break``, or an iterator never read; sync and ``async for``) and an
``async_exec`` whose awaiting task was cancelled. The rest of the stream still arrives, and
each reply's tensors go back to their owner undecoded. Before, every such reply held its block
in the target's pool for as long as the target lived (7 MiB a call here).

Triton's response iterator instead waits in its destructor for the rest of the stream; the
target is not cancelled in either.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from _models import infer, serving_models

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20
RESPONSES = 8  # of 1 MiB each: above the inline limit, so each travels by shm handle

# One instance each; N in, 1 MiB of OUT per response.
BIG_SLOW_CONFIG = '''
backend: "python"
max_batch_size: 0
input [ { name: "N", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
'''
BIG_STREAM_CONFIG = BIG_SLOW_CONFIG + "model_transaction_policy { decoupled: true }\n"

BIG_STREAM_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(n):
                sender.send(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.full(1 << 20, i, np.uint8))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

BIG_SLOW_PY = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.3)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(1 << 20, np.uint8))])
                for _ in requests]
'''

QUITTER_CONFIG = '''
backend: "python"
max_batch_size: 0
input [ { name: "N", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "GOT", data_type: TYPE_INT32, dims: [ 1 ] } ]
parameters { key: "max_concurrent_executes" value: { string_value: "1" } }
'''

# Request parameter "mode": break | unread | async_break | async_cancelled. GOT: the first
# value read (-1: none was).
QUITTER_PY = '''
import asyncio
import gc
import json
import numpy as np
import triton_python_backend_utils as pb_utils


def call(model, n):
    return pb_utils.InferenceRequest(model_name=model, requested_output_names=["OUT"],
                                     inputs=[pb_utils.Tensor("N", np.array([n], np.int32))])


def first(response):
    return int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0])


class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for request in requests:
            mode = json.loads(request.parameters())["mode"]
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            got = -1
            if mode == "break":
                for response in call("big_stream", n).exec(decoupled=True):
                    got = first(response)
                    break
            elif mode == "unread":
                call("big_stream", n).exec(decoupled=True)
            elif mode == "async_break":
                async for response in await call("big_stream", n).async_exec(decoupled=True):
                    got = first(response)
                    break
            elif mode == "async_cancelled":
                try:
                    await asyncio.wait_for(call("big_slow", n).async_exec(), 0.02)
                except asyncio.TimeoutError:
                    pass
            gc.collect()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("GOT", np.array([got], np.int32))]))
        return out
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving_models(tmp_path_factory.mktemp("repo"), {
            "big_stream": (BIG_STREAM_PY, BIG_STREAM_CONFIG),
            "big_slow": (BIG_SLOW_PY, BIG_SLOW_CONFIG),
            "quitter": (QUITTER_PY, QUITTER_CONFIG)}) as srv:
        yield srv


def used_bytes(server, pool: str) -> int:
    (usage,) = [u for u in server.shm_usage() if u["pool"] == pool]
    return int(usage["used_bytes"])


def settled_used_bytes(server, pool: str, wait_s: float = 10.0) -> int:
    """The pool's used bytes once they reach 0, or after ``wait_s`` (releases travel
    asynchronously, and the rest of a stream may still be on its way)."""
    deadline = time.monotonic() + wait_s
    while True:
        used = used_bytes(server, pool)
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.05)


@pytest.mark.parametrize("mode, target, got", [
    ("break", "big_stream", 0),
    ("unread", "big_stream", -1),
    ("async_break", "big_stream", 0),
    ("async_cancelled", "big_slow", -1),
])
def test_replies_nobody_reads_give_their_blocks_back(server, mode, target, got) -> None:
    before = server.statistics(target)["model_stats"][0]["inference_stats"]
    for _ in range(4):
        r = infer(server.model("quitter"), {"N": np.array([RESPONSES], np.int32)},
                  parameters={"mode": mode})
        assert r.error is None, r.error
        assert int(r.outputs["GOT"].to_numpy()[0]) == got
    # The target serves every call in full (it is not cancelled) ...
    deadline = time.monotonic() + 20
    while served(server, target) < before["success"]["count"] + 4 \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = server.statistics(target)["model_stats"][0]["inference_stats"]
    assert stats["success"]["count"] == before["success"]["count"] + 4
    assert stats["fail"]["count"] == before["fail"]["count"]
    # ... and none of its replies' blocks stays taken.
    assert settled_used_bytes(server, f"{target}_0_0") == 0
    assert used_bytes(server, "host") == 0


def served(server, model: str) -> int:
    return int(server.statistics(model)["model_stats"][0]["inference_stats"]["success"]["count"])
