"""System shared memory against a ``tritonpy serve`` subprocess: a client that shrinks or
unlinks its shm object after registering it (Triton 2.51 dies of SIGBUS on a shrunk one,
measured) gets an error naming the region, and the server goes on serving; nothing of the
region stays mapped once it is unregistered."""
from __future__ import annotations

import os
import secrets
import signal
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException
from tritonclient.utils import shared_memory as shm_utils

from _models import holds, truncate_shm
from _serve import Serve, serve_repo

CONFIG = """\
name: "add_sub"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
"""
MODEL = """\
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0",
                    pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                    + pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy())])
                for r in requests]
"""

ECHO = """\
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""


@pytest.fixture
def region() -> Iterator[tuple[str, Any]]:
    key = f"tpyc{secrets.token_hex(4)}"
    handle = shm_utils.create_shared_memory_region(key, "/" + key, 65536)
    try:
        yield key, handle
    finally:
        try:
            shm_utils.destroy_shared_memory_region(handle)
        except Exception:  # the test unlinked it itself
            pass



def _inputs(mod: Any, region: str | None, offset: int = 0) -> list[Any]:
    ins = [mod.InferInput("INPUT0", [16], "FP32"), mod.InferInput("INPUT1", [16], "FP32")]
    if region is None:
        ins[0].set_data_from_numpy(np.ones(16, np.float32))
    else:
        ins[0].set_shared_memory(region, 64, offset=offset)
    ins[1].set_data_from_numpy(np.ones(16, np.float32))
    return ins


def _serve_add_sub(serve: Callable[..., Serve], tmp_path: Path) -> tuple[Serve, int, int]:
    (tmp_path / "repo" / "add_sub" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "add_sub" / "config.pbtxt").write_text(CONFIG)
    (tmp_path / "repo" / "add_sub" / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    return serve_repo(serve, tmp_path / "repo")


def test_a_shrunk_or_unlinked_region_is_an_error_not_a_crash(
        serve: Callable[..., Serve], tmp_path: Path, region: tuple[str, Any]) -> None:
    server, http_port, grpc_port = _serve_add_sub(serve, tmp_path)
    key, handle = region
    http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    grpcc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        http.register_system_shared_memory("r", "/" + key, 65536)
        truncate_shm(key, 4096)
        gone = (f"shared memory region 'r' cannot be {{}}: its shm object '/{key}' no longer "
                "holds byte 8192 (it was truncated after the region was registered); "
                "register it again at its new size")
        with pytest.raises(InferenceServerException) as err:  # an input past the new end
            http.infer("add_sub", _inputs(httpclient, "r", offset=8192))
        assert err.value.status() == "400" and err.value.message() == gone.format("read")
        out = grpcclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory("r", 64, offset=8192)
        with pytest.raises(InferenceServerException) as err:  # an output past it
            grpcc.infer("add_sub", _inputs(grpcclient, None), outputs=[out])
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert err.value.message() == gone.format("written")
        assert os.stat(f"/dev/shm/{key}").st_size == 4096  # not grown back either
        # what is still there is served
        shm_utils.set_shared_memory_region(handle, [np.arange(16, dtype=np.float32)])
        got = http.infer("add_sub", _inputs(httpclient, "r")).as_numpy("OUTPUT0")
        assert got.tolist() == (np.arange(16) + 1).tolist()
        # unlinked: the server keeps the object open, as Triton's mapping does (measured)
        truncate_shm(key, 0)
        os.unlink(f"/dev/shm/{key}")
        with pytest.raises(InferenceServerException, match="no longer holds byte 0"):
            http.infer("add_sub", _inputs(httpclient, "r"))
        assert server.proc.poll() is None and http.is_server_ready()
        assert holds(server.proc.pid, key)
        http.unregister_system_shared_memory("r")
        assert not holds(server.proc.pid, key)
        assert http.infer("add_sub", _inputs(httpclient, None)).as_numpy("OUTPUT0").tolist() == [2.0] * 16
    finally:
        http.close()
        grpcc.close()
    server.proc.send_signal(signal.SIGTERM)  # a clean stop removes its pool's segments
    assert server.wait(30) == 0


def test_a_region_shrunk_under_a_kept_grpc_plan_is_the_requests_error_only(
        serve: Callable[..., Serve], tmp_path: Path, region: tuple[str, Any]) -> None:
    """gRPC decodes a request whose header it has seen from a kept plan as its bytes are read;
    an input region shrunk meanwhile is that request's INVALID_ARGUMENT, as in a full decode
    (it was INTERNAL "Failed to parse the request"), and the connection serves on."""
    server, _, grpc_port = _serve_add_sub(serve, tmp_path)
    key, handle = region
    grpcc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        grpcc.register_system_shared_memory("r", "/" + key, 65536)
        shm_utils.set_shared_memory_region(handle, [np.arange(16, dtype=np.float32)])
        inputs = _inputs(grpcclient, "r")
        for _ in range(2):  # the second from the plan the first made
            assert grpcc.infer("add_sub", inputs).as_numpy("OUTPUT0").tolist() == \
                (np.arange(16) + 1).tolist()
        truncate_shm(key, 0)
        for _ in range(3):
            with pytest.raises(InferenceServerException) as err:
                grpcc.infer("add_sub", inputs)
            assert err.value.status() == "StatusCode.INVALID_ARGUMENT", err.value
            assert "no longer holds byte 0" in err.value.message(), err.value
        truncate_shm(key, 65536)
        shm_utils.set_shared_memory_region(handle, [np.ones(16, dtype=np.float32)])
        assert grpcc.infer("add_sub", inputs).as_numpy("OUTPUT0").tolist() == [2.0] * 16
        grpcc.unregister_system_shared_memory()
    finally:
        grpcc.close()
    assert "Fatal error" not in server.log() and "Traceback" not in server.log(), server.log()


def test_an_input_region_that_finds_the_pool_full_is_a_503_without_a_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # (QA) The same 503 as for an input in the body, which logs nothing; this one logged an
    # ERROR with a traceback at each request.
    import logging

    from _models import io_config, serving_frontends, write_model

    caplog.set_level(logging.ERROR)
    write_model(tmp_path, "echo", ECHO, io_config(in_type="TYPE_UINT8", out_type="TYPE_UINT8"))
    MiB = 1 << 20
    key = f"tpyc{secrets.token_hex(4)}"
    handle = shm_utils.create_shared_memory_region(key, "/" + key, 16 * MiB)
    pools = {"shm-total-byte-cap": str(8 * MiB), "shm-default-byte-size": str(4 * MiB),
             "shm-growth-byte-size": str(4 * MiB)}
    try:
        with serving_frontends(tmp_path, backend_config=pools) as (_, fe):
            for mod, port in ((httpclient, fe.http_port), (grpcclient, fe.grpc_port)):
                client = mod.InferenceServerClient(f"127.0.0.1:{port}")
                try:
                    client.register_system_shared_memory("big", "/" + key, 16 * MiB)
                    inp = mod.InferInput("IN", [16 * MiB], "UINT8")
                    inp.set_shared_memory("big", 16 * MiB)
                    with pytest.raises(InferenceServerException,
                                       match="shared memory exhausted") as err:
                        client.infer("echo", [inp])
                    assert err.value.status() in ("503", "StatusCode.UNAVAILABLE")
                    small = mod.InferInput("IN", [4], "UINT8")
                    small.set_data_from_numpy(np.arange(4, dtype=np.uint8))
                    assert client.infer("echo", [small]).as_numpy("OUT").tolist() == [0, 1, 2, 3]
                    client.unregister_system_shared_memory("big")
                finally:
                    client.close()
    finally:
        shm_utils.destroy_shared_memory_region(handle)
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert logged == [], logged
