"""Triton's CUDA shared-memory extension over HTTP and gRPC, with the real tritonclient.

There is no GPU here. The server (``tritonpy serve``) and the client each run in a process of
their own on ``tests/fake_gpu``'s stand-in for CuPy and the CUDA driver (the only mock the suite
allows): the client's "device memory" is memfd memory that the server's processes map through
the IPC handle the client registers, as with CUDA IPC. So registration, handles, offsets and
the copies made are real; only the CUDA calls are imitated. The client runs as a script
(``CLIENT``) because the stand-in must not be imported into the test process itself.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from _gpu_models import (
    DOUBLE_CONFIG,
    FAKE_GPU,
    GPU_DOUBLE_PY,
    GPU_INPUTS,
    TARGET_CONFIG,
    TARGET_PY,
)
from _models import write_model
from _serve import Serve, serve_repo

CLIENT = r"""
import base64, json, sys
import numpy as np
import cupy
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

http_port, grpc_port = sys.argv[1:3]
x = np.arange(16, dtype=np.float32)
d_in = cupy.asarray(x)                     # the input, in "device memory"
d_out = cupy.empty(128, dtype=np.uint8)    # room for two FP32 [16] outputs


def handle(a):
    return base64.b64encode(cupy.cuda.runtime.ipcGetMemHandle(a.data.ptr))


def error(fn):
    try:
        fn()
    except InferenceServerException as exc:
        return exc.message()
    return None


report = {}
for kind, mod, url in (("http", httpclient, f"127.0.0.1:{http_port}"),
                       ("grpc", grpcclient, f"127.0.0.1:{grpc_port}")):
    c = mod.InferenceServerClient(url)
    r = report[kind] = {}
    c.register_cuda_shared_memory("in", handle(d_in), 0, x.nbytes)
    c.register_cuda_shared_memory("out", handle(d_out), 0, d_out.nbytes)
    status = c.get_cuda_shared_memory_status(**({"as_json": True} if kind == "grpc" else {}))
    r["status"] = (sorted((s["name"], int(s.get("device_id", 0)), int(s["byte_size"]))
                          for s in status) if kind == "http" else
                   sorted((n, int(s.get("device_id", 0)), int(s["byte_size"]))
                          for n, s in status["regions"].items()))

    def infer(model, out_offset, outputs=("OUT",)):
        inp = mod.InferInput("IN", [16], "FP32")
        inp.set_shared_memory("in", x.nbytes)
        outs = []
        for name in outputs:
            o = mod.InferRequestedOutput(name)
            if name == "OUT":
                o.set_shared_memory("out", 64, offset=out_offset)
            outs.append(o)
        return c.infer(model, [inp], outputs=outs)

    d_out.set(np.zeros(128, np.uint8))
    res = infer("gpu_double", 64)
    r["double"] = d_out[64:].get().view(np.float32).tolist()
    r["double_untouched"] = d_out[:64].get().tolist() == [0] * 64
    res = infer("gpu_target", 0, ("OUT", "REPORT"))
    r["target"] = json.loads(res.as_numpy("REPORT")[0])
    r["identity"] = d_out[:64].get().view(np.float32).tolist()
    inp = mod.InferInput("IN", [16], "FP32")
    inp.set_shared_memory("in", x.nbytes)
    small = mod.InferRequestedOutput("OUT")
    small.set_shared_memory("out", 8)
    r["too_small"] = error(lambda: c.infer("gpu_double", [inp], outputs=[small]))
    inp = mod.InferInput("IN", [16], "FP32")
    inp.set_shared_memory("in", x.nbytes, offset=32)
    r["outside"] = error(lambda: c.infer("gpu_double", [inp]))
    r["bad_device"] = error(lambda: c.register_cuda_shared_memory("gpu3", handle(d_in), 3, 64))
    r["twice"] = error(lambda: c.register_cuda_shared_memory("in", handle(d_in), 0, 64))
    c.unregister_cuda_shared_memory("in")
    r["gone"] = error(lambda: infer("gpu_double", 0))
    c.unregister_cuda_shared_memory()
    status = c.get_cuda_shared_memory_status(**({"as_json": True} if kind == "grpc" else {}))
    r["after"] = len(status if kind == "http" else status.get("regions", {}))
print(json.dumps(report))
"""


@pytest.fixture
def fake_gpu_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {"PYTHONPATH": os.pathsep.join([str(FAKE_GPU), os.environ.get("PYTHONPATH", "")]),
           "TRITONPY_GPU_COUNT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # the server's processes inherit it
    return env


def test_cuda_shared_memory_inputs_and_outputs(serve: Callable[..., Serve],
                                               tmp_path: Path, fake_gpu_env: dict) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "gpu_double", GPU_DOUBLE_PY, DOUBLE_CONFIG)
    write_model(repo, "gpu_target", TARGET_PY, TARGET_CONFIG + GPU_INPUTS)
    server, http_port, grpc_port = serve_repo(serve, repo)
    proc = subprocess.run([sys.executable, "-c", CLIENT, str(http_port), str(grpc_port)],
                          capture_output=True, text=True, timeout=120)
    stop(server)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    x = [float(i) for i in range(16)]
    for kind in ("http", "grpc"):
        r = report[kind]
        assert r["status"] == [["in", 0, 64], ["out", 0, 128]], kind
        # Read from the client's device memory, written into it at the offset asked for.
        assert r["double"] == [2 * v for v in x] and r["double_untouched"], kind
        # A model that takes GPU inputs gets the client's memory itself: mapped, not copied.
        assert r["target"]["is_cpu"] is False, kind
        # (its one copy to the host before the gRPC round was the HTTP round's output)
        assert r["target"]["stats"]["d2h"] == {"http": 0, "grpc": 1}[kind], kind
        assert r["target"]["stats"]["open_now"] == 1, kind
        # ... and lets go of it afterwards, not kept for reuse as a stub's memory would be
        # (the client may free it once unregistered): the gRPC round maps it anew.
        assert r["target"]["stats"]["ipc_open"] == {"http": 1, "grpc": 2}[kind], kind
        assert r["identity"] == x, kind
        assert "output 'OUT' (8 bytes) should be at least 64 bytes" in r["too_small"], kind
        assert "Invalid offset + byte size for shared memory region: 'in'" in r["outside"], kind
        assert "GPU 3 is not one of the server's 1" in r["bad_device"], kind
        assert "shared memory region 'in' already in manager" in r["twice"], kind
        assert "Unable to find shared memory region: 'in'" in r["gone"], kind
        assert r["after"] == 0, kind


def test_bad_cuda_registrations_are_refused(serve: Callable[..., Serve],
                                            tmp_path: Path, fake_gpu_env: dict) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    repo = tmp_path / "repo"
    write_model(repo, "gpu_double", GPU_DOUBLE_PY, DOUBLE_CONFIG)
    server, http_port, grpc_port = serve_repo(serve, repo)
    http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    grpcc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    # A server that counts GPUs lists the extension, as a Triton built with GPU support.
    assert "cuda_shared_memory" in http.get_server_metadata()["extensions"]
    import base64
    short = base64.b64encode(b"\1" * 10)
    for c in (http, grpcc):
        with pytest.raises(InferenceServerException, match="CUDA IPC handle of 64 bytes, got 10"):
            c.register_cuda_shared_memory("r", short, 0, 64)
        with pytest.raises(InferenceServerException, match="byte_size must not be 0"):
            c.register_cuda_shared_memory("r", base64.b64encode(b"\1" * 64), 0, 0)
        with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory"):
            c.get_cuda_shared_memory_status("nope")
    status, body = _post(http_port, "/v2/cudasharedmemory/region/r/register",
                         {"raw_handle": {"b64": "%%%"}, "device_id": 0, "byte_size": 64})
    assert status == 400 and "not base64" in body["error"]
    status, body = _post(http_port, "/v2/cudasharedmemory/region/r/register",
                         {"raw_handle": "AAAA", "device_id": 0, "byte_size": 64})
    assert status == 400 and "raw_handle" in body["error"]
    status, body = _post(http_port, "/v2/cudasharedmemory/region/r/register", {"device_id": 0})
    assert status == 400 and "no 'raw_handle' field" in body["error"]
    assert http.get_cuda_shared_memory_status() == []
    http.close()
    grpcc.close()
    stop(server)


def stop(server: Serve) -> None:
    """Ctrl-C, as a person stops it: it must end cleanly (its segments and stubs gone)."""
    os.kill(server.proc.pid, signal.SIGINT)
    assert server.wait(60) == 0, server.log()[-3000:]


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def test_the_registry_checks_windows_and_names_what_the_server_lacks() -> None:
    import importlib.util

    import numpy as np

    from tritonpy._errors import InvalidArgumentError, UnavailableError
    from tritonpy.frontends.sharedmem import SharedMemoryRegistry

    reg = SharedMemoryRegistry(gpu_count=lambda: 1)
    reg.register_cuda("r", b"\1" * 64, 0, 256)
    ref = reg.cuda_input("r", 64, 128, np.dtype(np.float32), (32,))
    assert (ref.handle, ref.offset, ref.nbytes, ref.shape, ref.reuse) == (
        b"\1" * 64, 64, 128, (32,), False)
    with pytest.raises(InvalidArgumentError, match="Invalid offset \\+ byte size"):
        reg.cuda_input("r", 200, 128, np.dtype(np.float32), (32,))
    with pytest.raises(InvalidArgumentError, match="Invalid offset for shared memory region"):
        reg.cuda_check("r", -1, 4)
    if importlib.util.find_spec("cupy") is None:
        # An output into a CUDA region is copied there by the server: it needs CuPy.
        with pytest.raises(UnavailableError, match=r"needs CuPy in the server: .*tritonpy\[gpu\]"):
            reg.cuda_write("r", 0, b"\0" * 8)
    reg.close()
    assert reg.cuda_status() == []


@pytest.mark.gpu
def test_cuda_shared_memory_on_a_real_gpu(serve: Callable[..., Serve], tmp_path: Path) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    cudashm = pytest.importorskip("tritonclient.utils.cuda_shared_memory",
                                  reason="tritonclient's CUDA shared memory needs cuda-python")
    repo = tmp_path / "repo"
    write_model(repo, "gpu_double", GPU_DOUBLE_PY, DOUBLE_CONFIG)
    server, http_port, grpc_port = serve_repo(serve, repo)
    x = np.arange(16, dtype=np.float32)
    h_in = cudashm.create_shared_memory_region("in", x.nbytes, 0)
    h_out = cudashm.create_shared_memory_region("out", x.nbytes, 0)
    try:
        cudashm.set_shared_memory_region(h_in, [x])
        for mod, url in ((httpclient, f"127.0.0.1:{http_port}"),
                         (grpcclient, f"127.0.0.1:{grpc_port}")):
            c = mod.InferenceServerClient(url)  # type: ignore[attr-defined]
            c.register_cuda_shared_memory("in", cudashm.get_raw_handle(h_in), 0, x.nbytes)
            c.register_cuda_shared_memory("out", cudashm.get_raw_handle(h_out), 0, x.nbytes)
            inp = mod.InferInput("IN", [16], "FP32")
            inp.set_shared_memory("in", x.nbytes)
            out = mod.InferRequestedOutput("OUT")
            out.set_shared_memory("out", x.nbytes)
            c.infer("gpu_double", [inp], outputs=[out])
            got = cudashm.get_contents_as_numpy(h_out, np.float32, [16])
            np.testing.assert_array_equal(got, x * 2)
            c.unregister_cuda_shared_memory()
            c.close()
    finally:
        cudashm.destroy_shared_memory_region(h_in)
        cudashm.destroy_shared_memory_region(h_out)
    stop(server)
