"""An embedder passes CuPy arrays to ``Model.infer``: the model's stub maps them by their CUDA
IPC handle, and the host keeps each one alive until the stub lets go of it.

There is no GPU here: the embedder runs as a script on ``tests/fake_gpu``'s stand-in for CuPy
and the CUDA driver (the only mock the suite allows; its device memory is memfd memory that the
stubs really map through its IPC handles). A script, because the stand-in must not be imported
into the test process itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _gpu_models import FAKE_GPU, GPU_INPUTS, TARGET_CONFIG, TARGET_PY
from _models import new_prefix, segments, write_model

EMBEDDER = r"""
import gc, json, sys, time
import numpy as np
import cupy
import tritonpy

repo, prefix = sys.argv[1:3]
srv = tritonpy.Server(repo, backend_config={"shm-region-prefix-name": prefix})
srv.start()
report = {}
try:
    x = np.arange(8, dtype=np.float32)
    d = cupy.asarray(x)
    for model in ("gpu_target", "cpu_target"):
        (resp,) = list(srv.model(model).infer({"IN": d}))
        assert resp.error is None, resp.error.message
        report[model] = {"seen": json.loads(resp.outputs["REPORT"].to_numpy()[0]),
                         "out": resp.outputs["OUT"].to_numpy().tolist()}
        del resp
    (empty,) = list(srv.model("cpu_target").infer({"IN": cupy.asarray(x[:0])}))
    report["empty"] = empty.outputs["OUT"].to_numpy().tolist()
    del d, empty
    deadline = time.monotonic() + 10
    while cupy.get_default_memory_pool().used_bytes() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    report["used_after"] = cupy.get_default_memory_pool().used_bytes()
finally:
    srv.stop()
print(json.dumps(report))
"""


def test_cupy_inputs_from_an_embedder(tmp_path: Path) -> None:
    write_model(tmp_path, "gpu_target", TARGET_PY, TARGET_CONFIG + GPU_INPUTS)
    write_model(tmp_path, "cpu_target", TARGET_PY, TARGET_CONFIG)
    prefix = new_prefix()
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(FAKE_GPU), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run([sys.executable, "-c", EMBEDDER, str(tmp_path), prefix], env=env,
                              capture_output=True, text=True, timeout=120)
    finally:
        leftovers = segments(prefix)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    x = [float(i) for i in range(8)]
    # A model that takes GPU inputs maps the embedder's memory: no copy in its stub.
    gpu = report["gpu_target"]
    assert gpu["seen"]["is_cpu"] is False and gpu["seen"]["stats"]["d2h"] == 0
    assert gpu["seen"]["stats"]["open_now"] == 1 and gpu["out"] == x
    # Others get it on the CPU (FORCE_CPU_ONLY_INPUT_TENSORS defaults to "yes").
    cpu = report["cpu_target"]
    assert cpu["seen"]["is_cpu"] is True and cpu["out"] == x
    assert report["empty"] == []
    # Once the stubs let go, the host keeps nothing: the embedder's memory is all free.
    assert report["used_after"] == 0
    assert leftovers == []
