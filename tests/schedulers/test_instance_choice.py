"""Which instance takes a request: an idle one before one that is busy, even when the busy one
runs ``async def execute`` and could take more (real stubs). The model blocks its event loop
(``time.sleep``), so requests stacked on one instance would also run one after another."""
from __future__ import annotations

import numpy as np

from _models import serving_models

BLOCKING_ASYNC_PY = '''
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        time.sleep(0.3)  # blocks this instance's event loop
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()],
                                                                           np.int64))])
                for _ in requests]
'''

CONFIG = '''
name: "blocking_async"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_INT64, dims: [ 1 ] } ]
output [ { name: "PID", data_type: TYPE_INT64, dims: [ 1 ] } ]
instance_group [ { count: 3, kind: KIND_CPU } ]
'''


def test_requests_go_to_idle_instances_before_a_busy_async_one(tmp_path) -> None:
    with serving_models(tmp_path, {"blocking_async": (BLOCKING_ASYNC_PY, CONFIG)}) as server:
        pids = {inst.stub.pid for inst in server.runtime("blocking_async").instances}
        assert len(pids) == 3
        model = server.model("blocking_async")
        streams = [model.infer({"X": np.array([i], np.int64)}) for i in range(3)]
        served = []
        for stream in streams:
            resp = stream.get(timeout=30)
            assert resp.error is None, resp.error
            served.append(int(resp.outputs["PID"].to_numpy()[0]))
        assert sorted(served) == sorted(pids), f"served by {served}, instances {pids}"
