"""Triton's frontend options, with the real clients against real frontends: restricted APIs
(HTTP 403, gRPC UNAVAILABLE, in Triton 2.51's words, measured side by side), headers forwarded
to the model as request parameters, compressed gRPC responses, gRPC over TLS (mutual too) and
SO_REUSEPORT."""
from __future__ import annotations

import json
import secrets
import socket
import textwrap
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import tritonpy
from tritonpy.frontends import Frontends

TLS = Path(__file__).parent / "tls"

# Answers with its request's parameters, as JSON.
PARAMS_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", np.array([r.parameters().encode()], dtype=np.object_))]) for r in requests]
"""
PARAMS_CONFIG = """
name: "params"
backend: "python"
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] } ]
"""


@dataclass
class Running:
    server: tritonpy.Server
    frontends: Frontends
    http: str
    grpc: str


def _serve(repo: Path, prefix: str, **options: Any) -> Frontends:
    server = tritonpy.Server(str(repo), backend_config={"shm-region-prefix-name": prefix})
    server.start()
    fe = Frontends(server, http_port=0, grpc_port=0, allow_metrics=False,
                   http_address="127.0.0.1", grpc_address="127.0.0.1", exit_timeout=5.0,
                   **options)
    try:
        fe.start_in_thread()
    except BaseException:
        server.stop()
        raise
    return fe


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("repo")
    (path / "params" / "1").mkdir(parents=True)
    (path / "params" / "config.pbtxt").write_text(textwrap.dedent(PARAMS_CONFIG))
    (path / "params" / "1" / "model.py").write_text(textwrap.dedent(PARAMS_PY))
    return path


@pytest.fixture(scope="module")
def running(repo: Path) -> Iterator[Running]:
    fe = _serve(repo, f"tpyt{secrets.token_hex(4)}_",
                http_restricted={"model-repository": ("Admin-Key", "secret"),
                                 "statistics": ("admin-key", "secret")},
                grpc_restricted={"model-repository": ("admin-key", "secret"),
                                 "health": ("admin-key", "secret")},
                http_header_forward="MY_HEADER.*",  # case-insensitive, as Triton's
                grpc_header_forward="(?-i)header_1",  # case-sensitive, anywhere in the name
                grpc_compression="high")
    try:
        yield Running(fe.server, fe, f"127.0.0.1:{fe.http_port}", f"127.0.0.1:{fe.grpc_port}")
    finally:
        fe.stop_in_thread()
        fe.server.stop()


def _get(url: str, headers: dict[str, str] | None = None,
         data: bytes | None = None) -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as err:
        with err:  # closes its connection
            return err.code, err.headers.get("Content-Type", ""), err.read()


def _input(module: Any) -> Any:
    inp = module.InferInput("IN", [2], "FP32")
    inp.set_data_from_numpy(np.ones(2, np.float32))
    return inp


def _params(result: Any) -> dict[str, Any]:
    return json.loads(result.as_numpy("OUT")[0])


def test_a_restricted_http_api_needs_its_header(running: Running) -> None:
    base = f"http://{running.http}"
    refused = (403, "text/plain",  # Triton 2.51's bytes (measured: no space after ':')
               b'{"error":"This API is restricted, expecting header \'admin-key\'"}')
    assert _get(f"{base}/v2/repository/index", data=b"{}") == refused
    assert _get(f"{base}/v2/repository/index", {"admin-key": "wrong"}, b"{}") == refused
    status, _, body = _get(f"{base}/v2/repository/index", {"ADMIN-KEY": "secret"}, b"{}")
    assert status == 200 and json.loads(body)[0]["name"] == "params"
    assert _get(f"{base}/v2/models/params/stats")[0] == 403
    assert _get(f"{base}/v2/models/stats")[0] == 403
    assert _get(f"{base}/v2/models/stats", {"admin-key": "secret"})[0] == 200
    # What is not restricted answers as ever.
    assert _get(f"{base}/v2/models/params/config")[0] == 200
    assert _get(f"{base}/v2/health/ready")[0] == 200
    client = httpclient.InferenceServerClient(running.http)
    try:
        assert _params(client.infer("params", [_input(httpclient)])) == {}
        with pytest.raises(InferenceServerException, match="expecting header 'admin-key'"):
            client.get_model_repository_index()
        assert client.get_model_repository_index(headers={"admin-key": "secret"})
    finally:
        client.close()


def test_a_restricted_grpc_protocol_needs_its_metadata(running: Running) -> None:
    with grpc.insecure_channel(running.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for call, request in ((stub.ServerLive, service_pb2.ServerLiveRequest()),
                              (stub.RepositoryIndex, service_pb2.RepositoryIndexRequest())):
            for metadata in ((), (("triton-grpc-protocol-admin-key", "wrong"),),
                             (("admin-key", "secret"),)):
                with pytest.raises(grpc.RpcError) as err:
                    call(request, metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert err.value.details() == ("This protocol is restricted, expecting header "
                                               "'triton-grpc-protocol-admin-key'")
            call(request, metadata=(("triton-grpc-protocol-admin-key", "secret"),))
        assert stub.ServerMetadata(service_pb2.ServerMetadataRequest()).name == "triton"


def test_matching_headers_reach_the_model_as_parameters(running: Running) -> None:
    headers = {"my_header_1": "one", "My_Header_2": 'a "quoted" value\\', "other": "x"}
    http = httpclient.InferenceServerClient(running.http)
    try:
        got = _params(http.infer("params", [_input(httpclient)], headers=dict(headers),
                                 parameters={"my_header_1": "from the body"}))
    finally:
        http.close()
    # As in Triton 2.51 (measured; QA L0_http): HTTP header names arrive as the client sent
    # them (tritonpy made them lower-case), and a header wins over a parameter of the same
    # name that the request names itself (tritonpy kept the parameter).
    assert got == {"my_header_1": "one", "My_Header_2": 'a "quoted" value\\'}
    # The next request of that shape gets its own headers only, none of the last one's.
    http = httpclient.InferenceServerClient(running.http)
    try:
        for value in ("two", "three", "three"):  # the last head is one seen before
            got = _params(http.infer("params", [_input(httpclient)], headers={"My_header_3": value}))
            assert got == {"My_header_3": value}
        assert _params(http.infer("params", [_input(httpclient)])) == {}
    finally:
        http.close()

    client = grpcclient.InferenceServerClient(running.grpc)
    try:
        got = _params(client.infer("params", [_input(grpcclient)],
                                   headers={k.lower(): v for k, v in headers.items()},
                                   parameters={"my_header_1": "from the body", "k": 2}))
        assert got == {"my_header_1": "one", "k": 2}  # (?-i)header_1: not my_header_2
        assert _params(client.infer("params", [_input(grpcclient)])) == {}
        results: list[Any] = []
        client.start_stream(lambda result, error: results.append(error or result),
                            headers={"my_header_1": "streamed"})
        for _ in range(2):
            client.async_stream_infer("params", [_input(grpcclient)])
        client.stop_stream()
        assert [_params(r) for r in results] == [{"my_header_1": "streamed"}] * 2
    finally:
        client.close()


def test_compressed_grpc_responses_reach_the_client_whole(running: Running) -> None:
    # The server compresses every inference response here (level high: deflate, as gRPC's
    # core ranks them); the client decompresses what it gets. (The bytes on the wire are
    # checked frame by frame in test_http2.py.)
    client = grpcclient.InferenceServerClient(running.grpc)
    try:
        for _ in range(3):
            assert _params(client.infer("params", [_input(grpcclient)])) == {}
        assert client.is_server_ready(headers={"triton-grpc-protocol-admin-key": "secret"})
    finally:
        client.close()


def test_grpc_over_mutual_tls(repo: Path) -> None:
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(TLS / "server.pem", TLS / "server.key")
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(TLS / "ca.pem")
    fe = _serve(repo, f"tpyt{secrets.token_hex(4)}_", grpc_ssl=context)
    url = f"localhost:{fe.grpc_port}"
    try:
        client = grpcclient.InferenceServerClient(
            url, ssl=True, root_certificates=str(TLS / "ca.pem"),
            private_key=str(TLS / "client.key"), certificate_chain=str(TLS / "client.pem"))
        try:
            assert _params(client.infer("params", [_input(grpcclient)])) == {}
        finally:
            client.close()
        # No client certificate, or no TLS at all: no call gets through.
        for kwargs in ({"ssl": True, "root_certificates": str(TLS / "ca.pem")}, {}):
            client = grpcclient.InferenceServerClient(url, **kwargs)
            try:
                with pytest.raises(InferenceServerException):
                    client.is_server_live(client_timeout=5)
            finally:
                client.close()
        # HTTP is not affected.
        assert _get(f"http://127.0.0.1:{fe.http_port}/v2/health/live")[0] == 200
    finally:
        fe.stop_in_thread()
        fe.server.stop()


def test_reuse_port_lets_another_socket_bind_the_same_port(repo: Path) -> None:
    fe = _serve(repo, f"tpyt{secrets.token_hex(4)}_", reuse_http_port=True,
                reuse_grpc_port=True)
    try:
        for port in (fe.http_port, fe.grpc_port):
            other = socket.socket()
            try:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                other.bind(("127.0.0.1", port))  # refused (EADDRINUSE) without reuse-port
            finally:
                other.close()
        assert _get(f"http://127.0.0.1:{fe.http_port}/v2/health/live")[0] == 200
    finally:
        fe.stop_in_thread()
        fe.server.stop()


def _health_check(channel: grpc.Channel, metadata: Any = ()) -> bytes:
    """``grpc.health.v1.Health/Check`` with an empty request (any service), as Kubernetes'
    gRPC probe sends it; the raw HealthCheckResponse (no grpcio-health-checking here)."""
    check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    return check(b"", timeout=10, metadata=metadata)


SERVING, NOT_SERVING = b"\x08\x01", b"\x08\x02"  # HealthCheckResponse{status: 1 / 2}


def test_the_standard_grpc_health_check_is_served(running: Running) -> None:
    # As Triton 2.51 (measured): Check answers from the server's readiness, is restricted with
    # the health protocols, and Watch is not served.
    with grpc.insecure_channel(running.grpc) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _health_check(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "expecting header 'triton-grpc-protocol-admin-key'" in err.value.details()
        assert _health_check(channel, (("triton-grpc-protocol-admin-key", "secret"),)) == SERVING
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch",
                                     request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            list(watch(b"", timeout=10))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # A request that is not protobuf: INTERNAL, as Triton's "Unable to parse request".
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        with pytest.raises(grpc.RpcError) as err:
            check(b"\xff\xff", timeout=10,
                  metadata=(("triton-grpc-protocol-admin-key", "secret"),))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert check(b"\x0a\x03abc", timeout=10,  # service "abc": not looked at
                     metadata=(("triton-grpc-protocol-admin-key", "secret"),)) == SERVING


def test_the_grpc_health_check_says_not_serving_while_the_server_is_not_ready(
        repo: Path, tmp_path: Path) -> None:
    broken = tmp_path / "repo"
    (broken / "bad" / "1").mkdir(parents=True)
    (broken / "bad" / "config.pbtxt").write_text(
        PARAMS_CONFIG.replace('name: "params"', 'name: "bad"'))
    (broken / "bad" / "1" / "model.py").write_text("raise RuntimeError('no load')\n")
    fe = _serve(broken, f"tpyt{secrets.token_hex(4)}_")
    try:
        assert not fe.server.ready()  # a model failed to load (strict readiness)
        with grpc.insecure_channel(f"127.0.0.1:{fe.grpc_port}") as channel:
            # Any service name: Triton looks at none (measured).
            assert _health_check(channel) == NOT_SERVING
    finally:
        fe.stop_in_thread()
        fe.server.stop()


def test_the_grpc_response_delay_hook_delays_all_but_inference(
        repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Triton's test hook (read when the gRPC endpoint starts); upstream's
    # client_non_infer_timeout_test.py runs with 2 s and expects every non-inference call
    # with a 0.1 s deadline to fail "Deadline Exceeded", and with 5 s to succeed.
    monkeypatch.setenv("TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC", "1")
    fe = _serve(repo, f"tpyt{secrets.token_hex(4)}_")
    monkeypatch.delenv("TRITONSERVER_SERVER_DELAY_GRPC_RESPONSE_SEC")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{fe.grpc_port}")
    try:
        for call in (lambda t: client.is_server_live(client_timeout=t),
                     lambda t: client.get_model_config("params", client_timeout=t),
                     lambda t: client.get_model_repository_index(client_timeout=t)):
            with pytest.raises(InferenceServerException, match="Deadline Exceeded"):
                call(0.2)
            t0 = time.monotonic()
            assert call(10)
            assert time.monotonic() - t0 >= 0.9
        with grpc.insecure_channel(f"127.0.0.1:{fe.grpc_port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=0.2)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # Inference is not delayed.
        t0 = time.monotonic()
        assert _params(client.infer("params", [_input(grpcclient)], client_timeout=0.8)) == {}
        assert time.monotonic() - t0 < 0.8
        # Nor is HTTP.
        t0 = time.monotonic()
        assert _get(f"http://127.0.0.1:{fe.http_port}/v2/health/live")[0] == 200
        assert time.monotonic() - t0 < 0.8
    finally:
        client.close()
        fe.stop_in_thread()
        fe.server.stop()
