"""Models that make and take GPU tensors, for the tests that run them on ``tests/fake_gpu``'s
stand-in for CuPy (there is no GPU here) and, where marked ``gpu``, on a real one."""
from __future__ import annotations

from pathlib import Path

# Put first on PYTHONPATH for a server's processes to give them the stand-in.
FAKE_GPU = Path(__file__).resolve().parent / "fake_gpu"

# OUT = IN * 2, computed on the "GPU" and returned as a GPU tensor.
GPU_DOUBLE_PY = """
import cupy
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = cupy.asarray(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())
            t = pb_utils.Tensor.from_dlpack("OUT", x * 2)
            assert not t.is_cpu()
            out.append(pb_utils.InferenceResponse([t]))
        return out
"""

# Reports where its input arrived and what the fake device did, returns the input unchanged
# (a GPU input goes back as the very same device memory).
TARGET_PY = """
import json
import cupy
import numpy as np
import triton_python_backend_utils as pb_utils

STATS = getattr(cupy, "_fake_stats", dict)  # the stand-in's counters (none on a real GPU)

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            t = pb_utils.get_input_tensor_by_name(r, "IN")
            seen = {"is_cpu": t.is_cpu(), "stats": STATS()}
            report = pb_utils.Tensor("REPORT", np.array([json.dumps(seen).encode()], np.object_))
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack("OUT", t)
                                                   if not t.is_cpu() else
                                                   pb_utils.Tensor("OUT", t.as_numpy() + 0),
                                                   report]))
        return out
"""

IO = ('backend: "python"\nmax_batch_size: 0\n'
      'input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]\n')
DOUBLE_CONFIG = IO + 'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
TARGET_CONFIG = (IO + 'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] },\n'
                 '         { name: "REPORT", data_type: TYPE_STRING, dims: [ 1 ] } ]\n')
GPU_INPUTS = 'parameters { key: "FORCE_CPU_ONLY_INPUT_TENSORS" value { string_value: "no" } }\n'
