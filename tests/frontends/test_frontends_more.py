"""More of the frontends with the real ``tritonclient`` over loopback, on a server in explicit
model-control mode: repository load (config override, files) and unload over HTTP and gRPC, BLS
models over the wire, clients that go away cancel their request inside the model, the error
codes Triton gives for what ``test_frontends_serving`` does not cover, and the metrics values
(Triton's per-model counters, a model's custom metrics).
"""
from __future__ import annotations

import asyncio
import http.client as http_client
import json
import os
import queue
import secrets
import socket
import tempfile
import textwrap
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import tritonpy
from _models import wait_for, wait_until
from tritonpy.frontends import Frontends

IDENT = ("""
    backend: "python"
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    """, """
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
                for r in requests]
    """)

PAIR = ("""
    backend: "python"
    input [ { name: "A", data_type: TYPE_FP32, dims: [ 4 ] },
            { name: "B", data_type: TYPE_INT32, dims: [ 4 ] } ]
    output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
    """, """
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", pb_utils.get_input_tensor_by_name(r, "A").as_numpy())]) for r in requests]
    """)

# Calls another model (the request parameter "target", default "ident") and doubles its output.
BLS_SYNC = ("""
    backend: "python"
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    """, """
    import json
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                target = json.loads(r.parameters()).get("target", "ident")
                x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                resp = pb_utils.InferenceRequest(
                    model_name=target, requested_output_names=["OUTPUT0"],
                    inputs=[pb_utils.Tensor("INPUT0", x)]).exec()
                if resp.has_error():
                    raise pb_utils.TritonModelException("BLS call failed: " + resp.error().message())
                y = pb_utils.get_output_tensor_by_name(resp, "OUTPUT0").as_numpy()
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y * 2)]))
            return out
    """)

# async execute: two concurrent BLS calls (ident and bls_sync) summed.
BLS_ASYNC = ("""
    backend: "python"
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    """, """
    import asyncio
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        async def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                calls = [pb_utils.InferenceRequest(model_name=m, requested_output_names=["OUTPUT0"],
                                                   inputs=[pb_utils.Tensor("INPUT0", x)]).async_exec()
                         for m in ("ident", "bls_sync")]
                got = await asyncio.gather(*calls)
                total = sum(pb_utils.get_output_tensor_by_name(g, "OUTPUT0").as_numpy() for g in got)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", total)]))
            return out
    """)

# Polls request.is_cancelled() for up to 20 s; leaves started-<id> and, when cancelled,
# cancelled-<id> in the directory of its "DIR" parameter.
CANCEL_WATCH = ("""
    backend: "python"
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    instance_group [ { kind: KIND_CPU, count: 3 } ]
    parameters { key: "DIR" value: { string_value: "%(dir)s" } }
    """, """
    import json, os, time
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.dir = json.loads(args["model_config"])["parameters"]["DIR"]["string_value"]

        def execute(self, requests):
            out = []
            for r in requests:
                rid = r.request_id()
                open(os.path.join(self.dir, "started-" + rid), "w").close()
                deadline = time.monotonic() + 20
                resp = None
                while time.monotonic() < deadline:
                    if r.is_cancelled():
                        open(os.path.join(self.dir, "cancelled-" + rid), "w").close()
                        resp = pb_utils.InferenceResponse(error=pb_utils.TritonError(
                            "request cancelled", pb_utils.TritonError.CANCELLED))
                        break
                    time.sleep(0.02)
                if resp is None:
                    x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                    resp = pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)])
                out.append(resp)
            return out
    """)

# Custom metrics: a counter of elements seen and a gauge of the last request's size; a
# negative first element makes execute raise (a failed request).
METRIC_MODEL = ("""
    backend: "python"
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    """, """
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.items_family = pb_utils.MetricFamily(
                name="tpy_test_items", description="elements seen",
                kind=pb_utils.MetricFamily.COUNTER)
            self.size_family = pb_utils.MetricFamily(
                name="tpy_test_last_size", description="last size",
                kind=pb_utils.MetricFamily.GAUGE)
            self.items = self.items_family.Metric(
                labels={"model": "metric_model", "kind": "items"})
            self.size = self.size_family.Metric(labels={"model": "metric_model"})

        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                if x.size and x[0] < 0:
                    raise pb_utils.TritonModelException("negative input")
                self.items.increment(x.size)
                self.size.set(x.size)
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
            return out
    """)

# Not loaded at start: answers with its config parameter WHO (to see which config it got).
LAZY = ("""
    backend: "python"
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "WHO", data_type: TYPE_STRING, dims: [ 1 ] } ]
    parameters { key: "WHO" value: { string_value: "disk" } }
    """, """
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            cfg = json.loads(args["model_config"])
            self.who = cfg["parameters"]["WHO"]["string_value"]

        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "WHO", np.array([self.who.encode()], dtype=object))]) for r in requests]
    """)

# Answers an error with the code named by the request's parameter "code".
ERROR_CODE = ("""
    backend: "python"
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
    """, """
    import json
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            codes = [json.loads(r.parameters())["code"] for r in requests]
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "told " + c, getattr(pb_utils.TritonError, c))) for c in codes]
    """)

# Makes its outputs in the order B, C, A.
THREE_OUT = ("""
    backend: "python"
    input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 1 ] } ]
    output [ { name: "A", data_type: TYPE_FP32, dims: [ 1 ] },
             { name: "B", data_type: TYPE_FP32, dims: [ 1 ] },
             { name: "C", data_type: TYPE_FP32, dims: [ 1 ] } ]
    """, """
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([
                pb_utils.Tensor(n, np.array([v], np.float32))
                for n, v in (("B", 2.0), ("C", 3.0), ("A", 1.0))]) for r in requests]
    """)

LOADED = ["ident", "pair", "bls_sync", "bls_async", "cancel_watch", "metric_model",
          "error_code", "three_out"]


def lazy_config(who: str) -> str:
    return json.dumps({
        "backend": "python",
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "WHO", "data_type": "TYPE_STRING", "dims": [1]}],
        "parameters": {"WHO": {"string_value": who}},
    })


@dataclass
class Served:
    server: tritonpy.Server
    http: str
    grpc: str
    metrics: str
    marks: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("more")
    repo, marks = root / "repo", root / "marks"
    marks.mkdir()
    models = {"ident": IDENT, "pair": PAIR, "bls_sync": BLS_SYNC, "bls_async": BLS_ASYNC,
              "cancel_watch": CANCEL_WATCH, "metric_model": METRIC_MODEL, "lazy": LAZY,
              "error_code": ERROR_CODE, "three_out": THREE_OUT,
              "never": LAZY}  # "never": no test loads it
    for name, (config, code) in models.items():
        (repo / name / "1").mkdir(parents=True)
        text = textwrap.dedent(config)
        if "%(dir)s" in text:
            text = text % {"dir": marks}
        (repo / name / "config.pbtxt").write_text(f'name: "{name}"\n' + text)
        (repo / name / "1" / "model.py").write_text(textwrap.dedent(code))
    prefix = f"tpyt{secrets.token_hex(4)}_"
    server = tritonpy.Server(str(repo), model_control_mode="explicit", load_models=LOADED,
                             backend_config={"shm-region-prefix-name": prefix}, exit_timeout=5.0)
    server.start()
    fe = Frontends(server, http_port=0, grpc_port=0, metrics_port=0, http_address="127.0.0.1",
                   grpc_address="127.0.0.1", metrics_address="127.0.0.1", exit_timeout=5.0)
    try:
        fe.start_in_thread()
        yield Served(server, f"127.0.0.1:{fe.http_port}", f"127.0.0.1:{fe.grpc_port}",
                     f"http://127.0.0.1:{fe.metrics_port}/metrics", marks)
    finally:
        fe.stop_in_thread()
        server.stop()
    assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []


@pytest.fixture
def http(served: Served) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(served.http, network_timeout=60)
    yield client
    client.close()


@pytest.fixture
def grpcc(served: Served) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(served.grpc)
    yield client
    client.close()


def fp32_input(mod: Any, values: list[float], name: str = "INPUT0") -> Any:
    inp = mod.InferInput(name, [len(values)], "FP32")
    inp.set_data_from_numpy(np.array(values, np.float32))
    return inp



def who(client: Any, mod: Any) -> str:
    got = client.infer("lazy", [fp32_input(mod, [1.0])]).as_numpy("WHO")[0]
    return got.decode() if isinstance(got, bytes) else str(got)


# == repository: index, load (config override, files), unload ====================================

# Each code of a model's TritonError as Triton 2.51's frontends answer it (checked side by side).
@pytest.mark.parametrize("code, status, grpc_code", [
    ("UNKNOWN", "400", "UNKNOWN"), ("INTERNAL", "500", "INTERNAL"),
    ("NOT_FOUND", "404", "NOT_FOUND"), ("INVALID_ARG", "400", "INVALID_ARGUMENT"),
    ("UNAVAILABLE", "503", "UNAVAILABLE"), ("UNSUPPORTED", "501", "UNIMPLEMENTED"),
    ("ALREADY_EXISTS", "400", "ALREADY_EXISTS"), ("CANCELLED", "400", "CANCELLED"),
])
def test_model_error_codes_map_to_tritons_statuses(
        http: httpclient.InferenceServerClient, grpcc: grpcclient.InferenceServerClient,
        code: str, status: str, grpc_code: str) -> None:
    with pytest.raises(InferenceServerException) as e:
        http.infer("error_code", [fp32_input(httpclient, [1.0])], parameters={"code": code})
    assert (e.value.status(), e.value.message()) == (status, "told " + code)
    with pytest.raises(InferenceServerException) as e:
        grpcc.infer("error_code", [fp32_input(grpcclient, [1.0])], parameters={"code": code})
    assert (e.value.status(), e.value.message()) == ("StatusCode." + grpc_code, "told " + code)


def test_outputs_come_in_the_order_the_model_made_them(
        http: httpclient.InferenceServerClient, grpcc: grpcclient.InferenceServerClient) -> None:
    # As Triton 2.51 (measured): the model's order (B, C, A), of those the request asks for,
    # whatever the order it lists them in.
    for client, mod in ((http, httpclient), (grpcc, grpcclient)):
        for asked, want in ((None, ["B", "C", "A"]), (["A", "B", "C"], ["B", "C", "A"]),
                            (["A", "C"], ["C", "A"])):
            outputs = None if asked is None else [mod.InferRequestedOutput(n) for n in asked]
            result = client.infer("three_out", [fp32_input(mod, [0.0])], outputs=outputs)
            response = result.get_response()
            got = ([o["name"] for o in response["outputs"]] if mod is httpclient
                   else [o.name for o in response.outputs])
            assert got == want, (mod.__name__, asked, got)


def test_a_model_never_loaded_is_not_found(http: httpclient.InferenceServerClient,
                                           grpcc: grpcclient.InferenceServerClient) -> None:
    # As Triton 2.51: a model not yet loaded is unknown to its core ("has no available
    # versions" is for one whose load failed, or that was unloaded).
    message = "Request for unknown model: 'never' is not found"
    for call in (lambda: http.infer("never", [fp32_input(httpclient, [1.0])]),
                 lambda: http.get_model_metadata("never"), lambda: http.get_model_config("never")):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert (e.value.status(), e.value.message()) == ("404", message)
    for call in (lambda: grpcc.infer("never", [fp32_input(grpcclient, [1.0])]),
                 lambda: grpcc.get_model_metadata("never"), lambda: grpcc.get_model_config("never")):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert (e.value.status(), e.value.message()) == ("StatusCode.NOT_FOUND", message)


def test_repository_load_unload_over_http(served: Served, http: httpclient.InferenceServerClient) -> None:
    index = {m["name"]: m for m in http.get_model_repository_index()}
    assert index["ident"] == {"name": "ident", "version": "1", "state": "READY"}  # no empty reason
    assert index["lazy"].get("state") != "READY"
    assert not http.is_model_ready("lazy")
    try:
        http.load_model("lazy")
        assert http.is_model_ready("lazy") and who(http, httpclient) == "disk"
        # A config override replaces the config on disk for this load.
        http.load_model("lazy", config=lazy_config("override"))
        assert who(http, httpclient) == "override"
        assert http.get_model_config("lazy")["parameters"]["WHO"]["string_value"] == "override"
        # As Triton 2.51 (measured): a load without one keeps it, until an unload.
        http.load_model("lazy")
        assert who(http, httpclient) == "override"
        http.unload_model("lazy")
        http.load_model("lazy")
        assert who(http, httpclient) == "disk"
        http.unload_model("lazy")
        assert not http.is_model_ready("lazy")

        def entry() -> dict:
            return {m["name"]: m for m in http.get_model_repository_index()}["lazy"]

        # As Triton's, the unload returns at once: UNLOADING until its requests are done.
        assert entry()["state"] in ("UNLOADING", "UNAVAILABLE")
        assert wait_for(lambda: entry()["state"] == "UNAVAILABLE", timeout=30)
        assert entry()["reason"] == "unloaded"
        with pytest.raises(InferenceServerException) as e:
            who(http, httpclient)
        assert e.value.status() == "404"
        assert e.value.message() == "Request for unknown model: 'lazy' has no available versions"
        # As Triton 2.51 (measured): a model not loaded has no trace settings to read or set.
        for call in (lambda: http.get_trace_settings(model_name="lazy"),
                     lambda: http.update_trace_settings(model_name="lazy",
                                                        settings={"trace_rate": "3"})):
            with pytest.raises(InferenceServerException) as e:
                call()
            assert (e.value.status(), e.value.message()) == (
                "400", "Request for unknown model : lazy")
    finally:
        http.unload_model("lazy")


def test_an_unloaded_models_statistics_go_with_it(http: httpclient.InferenceServerClient,
                                                  grpcc: grpcclient.InferenceServerClient) -> None:
    # Triton 2.51 (measured): once unloaded, a model has no statistics, by name, by version or
    # in the list of all: 400 / INVALID_ARGUMENT "requested model '<name>' is not available",
    # as for a model whose load failed. Its next load starts at 0.
    message = "requested model 'lazy' is not available"
    try:
        http.load_model("lazy")
        who(http, httpclient)
        assert http.get_inference_statistics("lazy")["model_stats"][0]["inference_count"] == 1
        http.unload_model("lazy")
        for version in ("", "1"):
            with pytest.raises(InferenceServerException) as e:
                http.get_inference_statistics("lazy", version)
            assert (e.value.status(), e.value.message()) == ("400", message)
            with pytest.raises(InferenceServerException) as e:
                grpcc.get_inference_statistics("lazy", version)
            assert (e.value.status(), e.value.message()) == ("StatusCode.INVALID_ARGUMENT", message)
        names = {s["name"] for s in http.get_inference_statistics()["model_stats"]}
        assert "lazy" not in names and "ident" in names
        assert "lazy" not in {s.name for s in grpcc.get_inference_statistics().model_stats}
        http.load_model("lazy")
        assert http.get_inference_statistics("lazy")["model_stats"][0]["inference_count"] == 0
    finally:
        http.unload_model("lazy")


def test_repository_load_with_files_over_http_and_grpc(http: httpclient.InferenceServerClient,
                                                       grpcc: grpcclient.InferenceServerClient,
                                                       served: Served) -> None:
    """Triton's files override: ``file:<path>`` parameters hold the model directory's files
    (base64 in HTTP JSON, bytes in gRPC); a config override must come with them."""
    code = textwrap.dedent(LAZY[1]).replace("self.who = ", "self.who = 'files:' + ")
    try:
        http.load_model("from_files", config=lazy_config("http"),
                        files={"file:1/model.py": code.encode()})
        assert http.is_model_ready("from_files")
        got = http.infer("from_files", [fp32_input(httpclient, [1.0])]).as_numpy("WHO")[0]
        assert got == b"files:http"
        # As Triton 2.51 (measured): the index lists the repositories' models only.
        assert "from_files" not in {m["name"] for m in http.get_model_repository_index()}
        grpcc.load_model("from_files", config=lazy_config("grpc"),
                         files={"file:1/model.py": code.encode()})
        got = grpcc.infer("from_files", [fp32_input(grpcclient, [1.0])]).as_numpy("WHO")[0]
        assert got == b"files:grpc"
        with pytest.raises(InferenceServerException, match="config"):
            http.load_model("from_files", files={"file:1/model.py": code.encode()})
        # A path no file can have is refused with its reason, not an internal error, and
        # what the refused load had written so far is gone (it used to stay in the temp
        # folder: a client could fill the server's disk with refused loads).
        temp_dirs = set(Path(tempfile.gettempdir()).glob("tritonpy-files-*/from_files-*"))
        for bad, why in [("file:1/mo\0del.py", "holds a NUL character"),
                         ("file:1/" + "x" * 300 + ".py", "cannot be written: File name too long")]:
            with pytest.raises(InferenceServerException) as e:
                grpcc.load_model("from_files", config=lazy_config("grpc"),
                                 files={"file:1/model.py": code.encode(), bad: b"x"})
            assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and why in e.value.message()
        assert set(Path(tempfile.gettempdir()).glob("tritonpy-files-*/from_files-*")) <= temp_dirs
        # A refused load of a name never seen leaves no entry in the repository index (it
        # left one with no version, state or reason). Triton's sentence comes first (QA
        # L0_lifecycle's test_file_override_security looks for "failed to load").
        with pytest.raises(InferenceServerException) as e:
            grpcc.load_model("never_seen", config=lazy_config("grpc"),
                             files={"file:1/model.py": code.encode(), "file:../evil": b"x"})
        assert e.value.message().startswith(
            "failed to load 'never_seen', failed to poll from model repository: file path "
            "'../evil' escapes the model directory"), e.value.message()
        assert "never_seen" not in {m.name for m in grpcc.get_model_repository_index().models}
        # JSON's "\ud800" (which no client library will encode): no text, hence no path.
        body = ('{"parameters": {"config": %s, "file:1/\\ud800.py": "eA=="}}'
                % json.dumps(lazy_config("raw")))
        conn = http_client.HTTPConnection(served.http, timeout=30)
        try:
            conn.request("POST", "/v2/repository/models/from_files/load", body=body.encode())
            resp = conn.getresponse()
            assert resp.status == 400 and b"holds an unpaired surrogate" in resp.read()
        finally:
            conn.close()
        # A name that is no directory's name is refused before anything is written (it used
        # to reach the temp folder's path: INTERNAL errors, and a way out of it).
        before = set(Path(tempfile.gettempdir()).glob("tritonpy-files-*/*"))
        for name in ("../escape", "a/b", "..", "."):
            with pytest.raises(InferenceServerException) as e:
                grpcc.load_model(name, config=lazy_config("grpc"),
                                 files={"file:1/model.py": code.encode()})
            assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert f"{name!r} is not a model name" in e.value.message()
        for escaped in ("..%2Fescape", "%2E%2E"):  # decoded after routing
            conn = http_client.HTTPConnection(served.http, timeout=30)
            try:
                conn.request("POST", f"/v2/repository/models/{escaped}/load", body=b"{}")
                resp = conn.getresponse()
                assert resp.status == 400 and b"is not a model name" in resp.read()
            finally:
                conn.close()
        assert set(Path(tempfile.gettempdir()).glob("tritonpy-files-*/*")) <= before
        grpcc.unload_model("from_files")
        assert not grpcc.is_model_ready("from_files")
    finally:
        http.unload_model("from_files")


def test_a_load_without_files_goes_back_to_the_repositorys_model(
        http: httpclient.InferenceServerClient) -> None:
    # As Triton: a files override lasts until a load without one (push a candidate, then roll
    # back to the repository). It used to reload the override's directory, without its config.
    code = textwrap.dedent(LAZY[1]).replace("self.who = ", "self.who = 'files:' + ")
    try:
        http.load_model("lazy", config=lazy_config("candidate"),
                        files={"file:1/model.py": code.encode()})
        assert who(http, httpclient) == "files:candidate"
        http.load_model("lazy")
        assert who(http, httpclient) == "disk"
        assert http.get_model_config("lazy")["parameters"]["WHO"]["string_value"] == "disk"
    finally:
        http.unload_model("lazy")


def test_repository_load_unload_over_grpc(served: Served, grpcc: grpcclient.InferenceServerClient) -> None:
    index = {m.name: m for m in grpcc.get_model_repository_index().models}
    assert index["bls_sync"].state == "READY" and "lazy" in index
    try:
        grpcc.load_model("lazy", config=lazy_config("grpc override"))
        assert grpcc.is_model_ready("lazy") and who(grpcc, grpcclient) == "grpc override"
        config = grpcc.get_model_config("lazy").config
        assert config.parameters["WHO"].string_value == "grpc override"
        grpcc.unload_model("lazy")
        assert not grpcc.is_model_ready("lazy")
        ready = {m.name for m in grpcc.get_model_repository_index().models if m.state == "READY"}
        assert "lazy" not in ready and "ident" in ready
        with pytest.raises(InferenceServerException) as e:
            who(grpcc, grpcclient)
        assert e.value.status() == "StatusCode.NOT_FOUND"
    finally:
        grpcc.unload_model("lazy")


def test_repository_load_errors(http: httpclient.InferenceServerClient,
                                grpcc: grpcclient.InferenceServerClient) -> None:
    # Triton: INTERNAL "failed to load '<name>', failed to poll from model repository".
    with pytest.raises(InferenceServerException,
                       match="failed to load 'no_such_model', failed to poll from model repository") as e:
        http.load_model("no_such_model")
    assert e.value.status() == "500"
    with pytest.raises(InferenceServerException,
                       match="failed to load 'no_such_model', failed to poll from model repository") as e:
        grpcc.load_model("no_such_model")
    assert e.value.status() == "StatusCode.INTERNAL"
    # An override that does not parse: Triton's words (tritonclient's model-control example
    # looks for "failed to load"), then why; 400, as the client's mistake.
    with pytest.raises(InferenceServerException,
                       match="failed to load 'lazy', failed to poll from model repository: .*"
                             "invalid JSON model configuration") as e:
        http.load_model("lazy", config="{not json")
    assert e.value.status() == "400"
    assert not http.is_model_ready("lazy")
    assert http.infer("ident", [fp32_input(httpclient, [1.0])]).as_numpy("OUTPUT0").tolist() == [1.0]


@pytest.mark.parametrize("override, why", [
    # Triton 2.51's words (measured: its log says them, its answer is a bare 500 "failed to
    # poll"); the reasons were Python's ("invalid literal for int() with base 10: 'abc'").
    ('{"max_batch_size": "abc"}', '(max_batch_size): invalid value "abc" for type TYPE_INT32'),
    ('{"max_batch_size": 1.5}', "(max_batch_size): invalid value 1.5 for type TYPE_INT32"),
    ('{"instance_group": 3}',
     "(instance_group): invalid value 3 for type type.googleapis.com/inference.ModelInstanceGroup"),
    ('{"input": [{"name": "X", "data_type": "TYPE_NOPE", "dims": [1]}]}',
     '(input[0].data_type): invalid value "TYPE_NOPE" for type type.googleapis.com/inference.DataType'),
    ("[1,2]", "the model configuration must be a JSON object, not an array"),
    ("not json", "invalid JSON model configuration: Expecting value: line 1 column 1 (char 0)"),
])
def test_a_config_override_of_the_wrong_type_names_the_field(
        http: httpclient.InferenceServerClient, grpcc: grpcclient.InferenceServerClient,
        override: str, why: str) -> None:
    message = f"failed to load 'lazy', failed to poll from model repository: Invalid config override: {why}"
    with pytest.raises(InferenceServerException) as e:
        http.load_model("lazy", config=override)
    assert (e.value.status(), e.value.message()) == ("400", message)
    with pytest.raises(InferenceServerException) as e:
        grpcc.load_model("lazy", config=override)
    assert (e.value.status(), e.value.message()) == ("StatusCode.INVALID_ARGUMENT", message)
    assert not http.is_model_ready("lazy")


def test_a_config_override_in_protobufs_looser_json_loads(
        http: httpclient.InferenceServerClient, grpcc: grpcclient.InferenceServerClient) -> None:
    # Triton parses an override with protobuf's JSON parser, which takes keys without
    # quotes, strings in single quotes and a trailing comma (Triton 2.51 loads all three,
    # measured; upstream's L0_iterative_sequence sends `direct: {...}`). A bare word as a
    # value is still refused, as on Triton.
    loose = ("{backend: 'python', input: [{name: 'INPUT0', data_type: 'TYPE_FP32', "
             "dims: [-1],},], 'output': [{'name': 'WHO', data_type: \"TYPE_STRING\", "
             "dims: [1]}], parameters: {WHO: {string_value: 'it\\'s \"loose\"'}},}")
    try:
        for client, mod in ((http, httpclient), (grpcc, grpcclient)):
            client.load_model("lazy", config=loose)
            assert who(client, mod) == 'it\'s "loose"'
        with pytest.raises(InferenceServerException, match="invalid JSON model configuration"):
            http.load_model("lazy", config="{backend: python}")
    finally:
        http.unload_model("lazy")


def test_an_invalid_config_override_is_named_as_the_override(
        http: httpclient.InferenceServerClient) -> None:
    # A value the override gives that the checks refuse: the error names the override, not
    # the model's config.pbtxt on disk (which says nothing of the kind).
    with pytest.raises(InferenceServerException) as e:
        http.load_model("lazy", config='{"backend": "python", "max_batch_size": -1}')
    assert e.value.status() == "400"
    assert ("load failed for model 'lazy': the config override of model 'lazy': "
            "'max_batch_size' must be non-negative value for lazy") in e.value.message()
    assert "config.pbtxt" not in e.value.message()
    assert not http.is_model_ready("lazy")


# == BLS over the wire ============================================================================

def test_bls_models_over_http_and_grpc(served: Served, http: httpclient.InferenceServerClient,
                                       grpcc: grpcclient.InferenceServerClient) -> None:
    x = [1.0, 2.0, 3.0]
    assert http.infer("bls_sync", [fp32_input(httpclient, x)]).as_numpy("OUTPUT0").tolist() == [2, 4, 6]
    assert grpcc.infer("bls_sync", [fp32_input(grpcclient, x)]).as_numpy("OUTPUT0").tolist() == [2, 4, 6]
    # async execute with two concurrent BLS calls, one of them itself a BLS model: x + 2x.
    assert http.infer("bls_async", [fp32_input(httpclient, x)]).as_numpy("OUTPUT0").tolist() == [3, 6, 9]

    async def many() -> list[list[float]]:
        client = grpcaio.InferenceServerClient(served.grpc)
        try:
            results = await asyncio.gather(*(client.infer("bls_async", [fp32_input(grpcaio, [float(i)])])
                                             for i in range(8)))
            return [r.as_numpy("OUTPUT0").tolist() for r in results]
        finally:
            await client.close()

    assert asyncio.run(many()) == [[3.0 * i] for i in range(8)]
    # A BLS call the model cannot make: the model's error reaches the client.
    with pytest.raises(InferenceServerException, match="BLS call failed.*no_such_model") as e:
        http.infer("bls_sync", [fp32_input(httpclient, x)], parameters={"target": "no_such_model"})
    assert e.value.status() == "500"
    with pytest.raises(InferenceServerException, match="BLS call failed.*lazy") as e:
        grpcc.infer("bls_sync", [fp32_input(grpcclient, x)], parameters={"target": "lazy"})
    assert e.value.status() == "StatusCode.INTERNAL"
    assert http.infer("bls_sync", [fp32_input(httpclient, x)]).as_numpy("OUTPUT0").tolist() == [2, 4, 6]


# == a client that goes away cancels its request ==================================================

def _marks(served: Served, rid: str) -> tuple[Path, Path]:
    return served.marks / f"started-{rid}", served.marks / f"cancelled-{rid}"


def test_http_disconnect_cancels_the_request(served: Served, http: httpclient.InferenceServerClient) -> None:
    rid = f"h{secrets.token_hex(3)}"
    started, cancelled = _marks(served, rid)
    body = json.dumps({"id": rid, "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1],
                                              "data": [1.0]}]}).encode()
    host, port = served.http.split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        sock.sendall(b"POST /v2/models/cancel_watch/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(started.exists, 10, "the model to start the request")
        assert not cancelled.exists()
    finally:
        sock.close()
    wait_until(cancelled.exists, 10, "the model to see the cancellation")
    assert http.infer("ident", [fp32_input(httpclient, [5.0])]).as_numpy("OUTPUT0").tolist() == [5.0]


def test_grpc_cancelled_future_and_stream_cancel_the_request(
        served: Served, grpcc: grpcclient.InferenceServerClient) -> None:
    rid = f"f{secrets.token_hex(3)}"
    started, cancelled = _marks(served, rid)
    results: queue.Queue[Any] = queue.Queue()
    ctx = grpcc.async_infer("cancel_watch", [fp32_input(grpcclient, [1.0])],
                            callback=lambda result, error: results.put((result, error)), request_id=rid)
    wait_until(started.exists, 10, "the model to start the request")
    assert not cancelled.exists()
    ctx.cancel()
    result, error = results.get(timeout=10)
    assert result is None and "CANCELLED" in str(error.status())
    wait_until(cancelled.exists, 10, "the model to see the cancelled future")

    rid = f"s{secrets.token_hex(3)}"
    started, cancelled = _marks(served, rid)
    grpcc.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        grpcc.async_stream_infer("cancel_watch", [fp32_input(grpcclient, [1.0])], request_id=rid)
        wait_until(started.exists, 10, "the model to start the streamed request")
        assert not cancelled.exists()
    finally:
        grpcc.stop_stream(cancel_requests=True)
    wait_until(cancelled.exists, 10, "the model to see the stream's cancellation")
    assert grpcc.infer("ident", [fp32_input(grpcclient, [6.0])]).as_numpy("OUTPUT0").tolist() == [6.0]


# == errors not covered by test_frontends_serving =================================================

def test_http_wrong_shapes_and_missing_inputs(http: httpclient.InferenceServerClient) -> None:
    a = httpclient.InferInput("A", [2], "FP32")
    a.set_data_from_numpy(np.zeros(2, np.float32))
    b = httpclient.InferInput("B", [4], "INT32")
    b.set_data_from_numpy(np.zeros(4, np.int32))
    with pytest.raises(InferenceServerException, match="unexpected shape for input 'A'") as e:
        http.infer("pair", [a, b])
    assert e.value.status() == "400"
    a4 = httpclient.InferInput("A", [4], "FP32")
    a4.set_data_from_numpy(np.zeros(4, np.float32))
    with pytest.raises(InferenceServerException, match="missing required input.*B") as e:
        http.infer("pair", [a4])
    assert e.value.status() == "400"
    b_fp = httpclient.InferInput("B", [4], "FP32")
    b_fp.set_data_from_numpy(np.zeros(4, np.float32))
    with pytest.raises(InferenceServerException, match="B") as e:
        http.infer("pair", [a4, b_fp])
    assert e.value.status() == "400"
    with pytest.raises(InferenceServerException) as e:
        http.infer("pair", [a4, b], model_version="7")
    assert e.value.status() == "404" and "pair" in e.value.message()
    assert http.infer("pair", [a4, b]).as_numpy("OUT").tolist() == [0, 0, 0, 0]


def test_grpc_wrong_names_shapes_and_framing(served: Served, grpcc: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="WRONG") as e:
        grpcc.infer("ident", [fp32_input(grpcclient, [1.0], name="WRONG")])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    a = grpcclient.InferInput("A", [4], "FP32")
    a.set_data_from_numpy(np.zeros(4, np.float32))
    with pytest.raises(InferenceServerException, match="missing required input.*B") as e:
        grpcc.infer("pair", [a])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as e:
        grpcc.infer("ident", [fp32_input(grpcclient, [1.0])], model_version="7")
    assert e.value.status() == "StatusCode.NOT_FOUND"
    with grpc.insecure_channel(served.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = service_pb2.ModelInferRequest(model_name="ident")
        req.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
        req.raw_input_contents.append(b"\0" * 12)  # 3 floats for a shape of 4
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == ("[request id: <id_unknown>] input byte size mismatch for "
                                       "input 'INPUT0' for model 'ident'. Expected 16, got 12")
        req.raw_input_contents.append(b"\0" * 16)  # more raw contents than inputs
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        req = service_pb2.ModelInferRequest(model_name="ident")
        req.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
        req.raw_input_contents.append(b"\0" * 4)
        assert np.frombuffer(stub.ModelInfer(req).raw_output_contents[0], np.float32).tolist() == [0.0]


# == metrics =====================================================================================

def _samples(served: Served) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = urllib.request.urlopen(served.metrics, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_metrics_values_and_custom_metrics(served: Served, http: httpclient.InferenceServerClient,
                                           grpcc: grpcclient.InferenceServerClient) -> None:
    http.infer("metric_model", [fp32_input(httpclient, [1.0, 2.0, 3.0])])
    grpcc.infer("metric_model", [fp32_input(grpcclient, [1.0] * 5)])
    with pytest.raises(InferenceServerException, match="negative input"):
        http.infer("metric_model", [fp32_input(httpclient, [-1.0])])
    samples = _samples(served)
    model = frozenset({("model", "metric_model"), ("version", "1")})

    def value(name: str) -> float:
        # prometheus_client's parser names a counter's samples with "_total".
        got = samples.get((name, model), samples.get((name + "_total", model)))
        assert got is not None, name
        return got

    assert value("nv_inference_request_success") == 2
    # Labelled by reason, as Triton 2.51's: every reason is there, the execute's is BACKEND.
    failures = {dict(labels).get("reason"): v for (name, labels), v in samples.items()
                if name.startswith("nv_inference_request_failure")
                and ("model", "metric_model") in labels}
    assert failures == {"BACKEND": 1, "REJECTED": 0, "CANCELED": 0, "OTHER": 0}
    # As Triton 2.51 counts them (measured): the failed execution is an execution, but its
    # request is no inference (Triton adds a request's rows when it reports a success).
    assert value("nv_inference_count") == 2
    assert value("nv_inference_exec_count") == 3
    assert value("nv_inference_request_duration_us") >= value("nv_inference_compute_infer_duration_us") > 0
    for name in ("nv_inference_queue_duration_us", "nv_inference_compute_input_duration_us",
                 "nv_inference_compute_output_duration_us"):
        assert value(name) >= 0
    # The model's own metrics, with its labels.
    items = frozenset({("model", "metric_model"), ("kind", "items")})
    assert samples.get(("tpy_test_items", items), samples.get(("tpy_test_items_total", items))) == 8
    assert samples[("tpy_test_last_size", frozenset({("model", "metric_model")}))] == 5
    # Shared-memory usage per pool: each stub instance's pool by its segments...
    stub_pools = {dict(labels)["pool"]: v for (name, labels), v in samples.items()
                  if name == "tritonpy_shm_pool_mapped_bytes" and ("pool", "host") not in labels}
    # (a stub maps segments only when it needs them: small tensors travel inline)...
    assert len([p for p in stub_pools if p.startswith("metric_model")]) == 1
    assert len([p for p in stub_pools if p.startswith("cancel_watch")]) == 3  # count: 3
    assert all(v >= 0 for v in stub_pools.values())
    # ... and the host pool, with what is in use.
    host = frozenset({("pool", "host")})
    assert samples[("tritonpy_shm_pool_mapped_bytes", host)] > 0
    assert samples[("tritonpy_shm_pool_segments", host)] >= 1
    assert 0 <= samples[("tritonpy_shm_pool_used_bytes", host)] <= samples[("tritonpy_shm_pool_mapped_bytes", host)]
