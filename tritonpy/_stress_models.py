"""The model repository that ``tritonpy stress`` drives: written to a temporary directory.

Plain Triton Python models (``config.pbtxt`` + ``1/model.py``), as a user would write them:

* ``stress_io``: ``OUT`` is ``DATA`` back (``OUT_BYTES`` < 0) or ``OUT_BYTES`` new bytes of 7;
* ``stress_slow``: sleeps ``SLEEP_MS`` in ``execute`` (one instance), answers ``PID``;
* ``stress_stream``: decoupled, sends ``COUNT`` responses of ``BYTES`` bytes (all ``INDEX``
  modulo 251), each with its ``INDEX``, then the final flag; sleeps a minute before response
  ``STALL_AFTER`` (optional);
* ``stress_bls_reader``: starts a decoupled BLS call to ``stress_stream``, sleeps ``PAUSE_MS``
  before it reads (the responses pile up on its socket meanwhile), then reads them all and
  answers how many came and the first out of order (-1: none);
* ``stress_bls_io``: a BLS call to ``stress_io`` with ``BYTES`` bytes of 9; answers how many
  came back (-1: not the same), or the call's error;
* ``stress_fanout``: an ``async def execute`` that awaits ``CALLS`` BLS calls to ``stress_io``
  at once (``asyncio.gather``), 4 KiB each, and answers how many came back right (or the
  first error);
* ``stress_gpu``: one ``KIND_GPU`` instance; ``MODE`` 0 allocates CuPy blocks of ``BLOCK_MB``
  until CUDA runs out of memory and lets the error out of ``execute``, as a naive model would;
  ``MODE`` 1 answers the bytes its CuPy pool still holds for live arrays and a small array
  computed on the GPU.
"""
from __future__ import annotations

from pathlib import Path

_IO_CONFIG = """
backend: "python"
max_batch_size: 0
input [
  { name: "DATA" data_type: TYPE_UINT8 dims: [ -1 ] },
  { name: "OUT_BYTES" data_type: TYPE_INT64 dims: [ 1 ] }
]
output [ { name: "OUT" data_type: TYPE_UINT8 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

_IO_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "DATA").as_numpy()
            size = int(pb_utils.get_input_tensor_by_name(request, "OUT_BYTES").as_numpy()[0])
            out = data if size < 0 else np.full(size, 7, np.uint8)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
'''

_SLOW_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "SLEEP_MS" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

_SLOW_PY = '''
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            ms = int(pb_utils.get_input_tensor_by_name(request, "SLEEP_MS").as_numpy()[0])
            time.sleep(ms / 1000)
            pid = np.array([os.getpid()], np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PID", pid)]))
        return responses
'''

_STREAM_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "COUNT" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "BYTES" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "STALL_AFTER" data_type: TYPE_INT64 dims: [ 1 ] optional: true }
]
output [
  { name: "INDEX" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "OUT" data_type: TYPE_UINT8 dims: [ -1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

_STREAM_PY = '''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            size = int(pb_utils.get_input_tensor_by_name(request, "BYTES").as_numpy()[0])
            stall = pb_utils.get_input_tensor_by_name(request, "STALL_AFTER")
            stall = -1 if stall is None else int(stall.as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(count):
                if sender.is_cancelled():
                    break
                if i == stall:
                    time.sleep(60)  # to be killed here, its responses so far unread
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("INDEX", np.array([i], np.int64)),
                    pb_utils.Tensor("OUT", np.full(size, i % 251, np.uint8))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

_BLS_READER_CONFIG = """
backend: "python"
max_batch_size: 0
input [
  { name: "COUNT" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "PAUSE_MS" data_type: TYPE_INT64 dims: [ 1 ] }
]
output [
  { name: "RECEIVED" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "FIRST_OUT_OF_ORDER" data_type: TYPE_INT64 dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

_BLS_READER_PY = '''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            count = pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()
            pause = int(pb_utils.get_input_tensor_by_name(request, "PAUSE_MS").as_numpy()[0])
            call = pb_utils.InferenceRequest(
                model_name="stress_stream", requested_output_names=["INDEX"],
                inputs=[pb_utils.Tensor("COUNT", count),
                        pb_utils.Tensor("BYTES", np.array([16], np.int64))])
            stream = call.exec(decoupled=True)
            time.sleep(pause / 1000)  # the responses pile up on this stub's socket meanwhile
            received, first_bad, error = 0, -1, None
            for response in stream:
                if response.has_error():
                    error = response.error()
                    break
                index = pb_utils.get_output_tensor_by_name(response, "INDEX")
                if index is None:  # the final flag, with no tensors
                    continue
                if int(index.as_numpy()[0]) != received and first_bad < 0:
                    first_bad = received
                received += 1
            if error is not None:
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("RECEIVED", np.array([received], np.int64)),
                pb_utils.Tensor("FIRST_OUT_OF_ORDER", np.array([first_bad], np.int64))]))
        return responses
'''

_BLS_IO_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "BYTES" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "RETURNED" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

_BLS_IO_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            size = int(pb_utils.get_input_tensor_by_name(request, "BYTES").as_numpy()[0])
            call = pb_utils.InferenceRequest(
                model_name="stress_io", requested_output_names=["OUT"],
                inputs=[pb_utils.Tensor("DATA", np.full(size, 9, np.uint8)),
                        pb_utils.Tensor("OUT_BYTES", np.array([-1], np.int64))])
            response = call.exec()
            if response.has_error():
                responses.append(pb_utils.InferenceResponse(error=response.error()))
                continue
            out = pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
            returned = out.size if (out == 9).all() else -1
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("RETURNED", np.array([returned], np.int64))]))
        return responses
'''

_FANOUT_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "CALLS" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [
  { name: "ANSWERED" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "WRONG" data_type: TYPE_INT64 dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

_FANOUT_PY = '''
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


async def _one(i):
    data = np.full(4096, i % 251, np.uint8)
    call = pb_utils.InferenceRequest(
        model_name="stress_io", requested_output_names=["OUT"],
        inputs=[pb_utils.Tensor("DATA", data),
                pb_utils.Tensor("OUT_BYTES", np.array([-1], np.int64))])
    response = await call.async_exec()
    if response.has_error():
        return response.error().message()
    out = pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
    return None if np.array_equal(out, data) else f"call {i} came back different"


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            calls = int(pb_utils.get_input_tensor_by_name(request, "CALLS").as_numpy()[0])
            results = await asyncio.gather(*[_one(i) for i in range(calls)])
            wrong = [r for r in results if r is not None]
            if wrong:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"{len(wrong)} of {calls} calls failed, the first: {wrong[0]}")))
                continue
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("ANSWERED", np.array([len(results)], np.int64)),
                pb_utils.Tensor("WRONG", np.array([len(wrong)], np.int64))]))
        return responses
'''

_GPU_CONFIG = """
backend: "python"
max_batch_size: 0
input [
  { name: "MODE" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "BLOCK_MB" data_type: TYPE_INT64 dims: [ 1 ] }
]
output [
  { name: "USED_BYTES" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "SQUARES" data_type: TYPE_INT64 dims: [ 4 ] }
]
instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]
"""

_GPU_PY = '''
import cupy
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            mode = int(pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0])
            block = int(pb_utils.get_input_tensor_by_name(request, "BLOCK_MB").as_numpy()[0])
            if mode == 0:
                held = []
                while True:  # until CUDA says no: the error leaves execute with held alive
                    held.append(cupy.empty(block << 20, dtype=cupy.uint8))
            used = cupy.get_default_memory_pool().used_bytes()
            squares = cupy.asnumpy(cupy.arange(4, dtype=cupy.int64) ** 2)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("USED_BYTES", np.array([used], np.int64)),
                pb_utils.Tensor("SQUARES", squares)]))
        return responses
'''

MODELS: dict[str, tuple[str, str]] = {
    "stress_io": (_IO_CONFIG, _IO_PY),
    "stress_slow": (_SLOW_CONFIG, _SLOW_PY),
    "stress_stream": (_STREAM_CONFIG, _STREAM_PY),
    "stress_bls_reader": (_BLS_READER_CONFIG, _BLS_READER_PY),
    "stress_bls_io": (_BLS_IO_CONFIG, _BLS_IO_PY),
    "stress_fanout": (_FANOUT_CONFIG, _FANOUT_PY),
    "stress_gpu": (_GPU_CONFIG, _GPU_PY),
}


def write_repository(root: Path) -> Path:
    """Write every stress model under ``root`` (created); returns ``root``."""
    for name, (config, source) in MODELS.items():
        version = root / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n{config.lstrip()}')
        (version / "model.py").write_text(source.lstrip())
    return root
