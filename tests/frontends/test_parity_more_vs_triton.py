"""Where ``tritonpy serve`` differed from Triton 2.51, checked side by side with the real
``tritonserver`` (same repository, same requests; the values Triton gave are written here).

* A request with a method the HTTP parser does not know (``FOO``, ``PATCHX``) is routed as
  Triton routes it: 405 "Not Allowed" on a path that exists, 404 on one that does not, and the
  connection stays open (tritonpy answered 400 and closed). The 404 and 405 bodies go as
  Triton's content types (text/plain for a missing path and for the health, model ready and
  infer paths). A lowercase method, which Triton drops without a word, is answered 400 and
  the connection closed, as any request the parser refuses.
* ``POST /v2/logging`` with no JSON document (an empty body, or whitespace) changes nothing
  and is refused in Triton's words (tritonpy answered 200 as if it were ``{}``); Triton's
  status is 500, tritonpy's 400, as for any malformed body.
* The repository index lists each version of a model whose configuration Triton's load (past
  its repository poll) refuses UNAVAILABLE with the reason (a tensor's settings, another
  backend, a KIND_GPU instance group without GPUs): tritonpy gave no version; a folder with no
  version to load is not listed; and the versions that loaded beside one that failed, then
  were unloaded again for it, are listed UNAVAILABLE "unloaded" (tritonpy left them out). A
  configuration that Triton's poll refuses already (it cannot be parsed) is listed without a
  version, as by Triton, but UNAVAILABLE with its reason, on purpose (Triton: the name alone).
"""
from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc

from _models import io_config, write_model
from _serve import Serve, serve_repo

READY = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
NOT_ALLOWED = b'{"error":"Method Not Allowed"}'
NOT_FOUND = b'{"error":"Not Found"}'


class Reply:
    def __init__(self, status_line: str, headers: dict[str, str], body: bytes) -> None:
        self.status_line, self.headers, self.body = status_line, headers, body

    def __repr__(self) -> str:
        return f"Reply({self.status_line!r}, {self.headers!r}, {self.body!r})"


def _read_reply(sock: socket.socket, buf: bytearray) -> Reply | None:
    """One response from ``sock`` (``buf`` holds what was read before); None at EOF."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            assert not buf, f"a cut response: {bytes(buf)!r}"
            return None
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    size = int(headers.get("content-length", "0"))
    while len(rest) < size:
        chunk = sock.recv(65536)
        assert chunk, f"a cut body: {rest!r}"
        rest += chunk
    buf[:] = rest[size:]
    return Reply(lines[0], headers, rest[:size])


def converse(port: int, *writes: bytes, expect: int = 0) -> tuple[list[Reply], bool]:
    """Send each of ``writes`` (a short pause between them); the replies (``expect`` of them,
    one per write by default), then whether the server closed the connection. An open one is
    told by a liveness request that it answers."""
    replies: list[Reply] = []
    buf = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for i, data in enumerate(writes):
            if i:
                time.sleep(0.1)
            sock.sendall(data)
        while True:
            try:
                reply = _read_reply(sock, buf)
            except (ConnectionResetError, BrokenPipeError):
                return replies, True
            if reply is None:
                return replies, True
            replies.append(reply)
            if reply.headers.get("connection", "").lower() == "close":
                assert _read_reply(sock, buf) is None
                return replies, True
            if len(replies) == (expect or len(writes)):
                try:
                    sock.sendall(LIVE)
                except (ConnectionResetError, BrokenPipeError):
                    return replies, True
                probe = _read_reply(sock, buf)
                if probe is None:
                    return replies, True
                assert probe.status_line == "HTTP/1.1 200 OK", probe
                return replies, False


def _stop(server: Serve) -> None:
    """Stop as an operator does (SIGTERM): the server removes its segments on the way out."""
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0, server.log()


@pytest.fixture
def empty_server(serve: Callable[..., Serve], tmp_path: Path) -> Iterator[int]:
    """A tritonpy server of an empty repository; its HTTP port."""
    (tmp_path / "repo").mkdir()
    server, http_port, _ = serve_repo(serve, tmp_path / "repo", "--model-control-mode=explicit")
    yield http_port
    _stop(server)


# request, then as Triton 2.51 answers it: status line, content type, body (measured).
UNKNOWN_METHODS = [
    (b"FOO /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n",
     "HTTP/1.1 405 Not Allowed", "text/plain", NOT_ALLOWED),
    (b"PATCH /v2/models/ident/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
     "HTTP/1.1 405 Not Allowed", "text/plain", NOT_ALLOWED),
    (b"FOO /v2/models/ident/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nabcde",
     "HTTP/1.1 405 Not Allowed", "text/plain", NOT_ALLOWED),
    (b"PATCHX /v2/models/ident/ready HTTP/1.1\r\nHost: x\r\n\r\n",
     "HTTP/1.1 405 Not Allowed", "text/plain", NOT_ALLOWED),
    (b"FOO_BAR /v2/repository/index HTTP/1.1\r\nHost: x\r\n\r\n",
     "HTTP/1.1 405 Not Allowed", "application/json", NOT_ALLOWED),
    (b"FOO /v2/logging HTTP/1.1\r\nHost: x\r\n\r\n",
     "HTTP/1.1 405 Not Allowed", "application/json", NOT_ALLOWED),
    (b"TRACE / HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 404 Not Found", "text/plain", NOT_FOUND),
    (b"FOO /nope HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 404 Not Found", "text/plain", NOT_FOUND),
    (b"DELETE /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n",
     "HTTP/1.1 405 Not Allowed", "text/plain", NOT_ALLOWED),
    (b"PUT /v2/models/stats HTTP/1.1\r\nHost: x\r\n\r\n",
     "HTTP/1.1 405 Not Allowed", "application/json", NOT_ALLOWED),
]


def test_a_method_the_parser_does_not_know_is_routed_as_triton_routes_it(
        empty_server: int) -> None:
    # tritonpy answered FOO, PATCHX and FOO_BAR with 400 "Invalid method encountered" and
    # closed the connection; Triton routes them like any other method.
    for request, status, content_type, body in UNKNOWN_METHODS:
        replies, closed = converse(empty_server, request)
        assert [(r.status_line, r.headers.get("content-type"), r.body) for r in replies] == \
            [(status, content_type, body)], request
        assert not closed, request


def test_an_unknown_method_among_other_requests_is_answered_in_turn(empty_server: int) -> None:
    foo = b"FOO /v2/health/ready HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
    # In two writes, as Triton 2.51 answers them: 405, then the next request on the same
    # connection.
    replies, closed = converse(empty_server, foo, READY)
    assert [r.status_line for r in replies] == ["HTTP/1.1 405 Not Allowed", "HTTP/1.1 200 OK"]
    assert not closed
    # In one write, after another request and before one (Triton 2.51 answers the first of
    # them only: see README).
    replies, closed = converse(empty_server, READY + foo + READY, expect=3)
    assert [r.status_line for r in replies] == [
        "HTTP/1.1 200 OK", "HTTP/1.1 405 Not Allowed", "HTTP/1.1 200 OK"]
    assert [r.body for r in replies] == [b"", NOT_ALLOWED, b""]
    replies, closed = converse(empty_server, foo + foo + READY + foo, expect=4)
    assert [r.status_line for r in replies] == ["HTTP/1.1 405 Not Allowed"] * 2 + [
        "HTTP/1.1 200 OK", "HTTP/1.1 405 Not Allowed"]
    assert not closed


_HEALTH = b" /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
# A request cut inside its method by the end of a read (a slow client's): each part is a write
# of its own. Known methods went through before; unknown ones were refused with 400 and a close.
SPLIT_METHODS = [
    ((b"FO", b"O" + _HEALTH), ["HTTP/1.1 405 Not Allowed"]),
    ((b"F", b"O", b"O" + _HEALTH), ["HTTP/1.1 405 Not Allowed"]),
    ((b"PATCH", b"X" + _HEALTH), ["HTTP/1.1 405 Not Allowed"]),
    ((b"FOO", _HEALTH), ["HTTP/1.1 405 Not Allowed"]),
    ((b"GE", b"T" + _HEALTH), ["HTTP/1.1 200 OK"]),
    ((b"GET" + _HEALTH + b"FO", b"O" + _HEALTH), ["HTTP/1.1 200 OK", "HTTP/1.1 405 Not Allowed"]),
    ((b"\r\nFO", b"O" + _HEALTH + b"GE", b"T" + _HEALTH),
     ["HTTP/1.1 405 Not Allowed", "HTTP/1.1 200 OK"]),
    ((b"FOO /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
      b"Upgrade: h2c\r\n\r\n",), ["HTTP/1.1 405 Not Allowed"]),
]


@pytest.mark.parametrize("writes,statuses", SPLIT_METHODS)
def test_a_method_cut_by_a_read_is_read_whole(empty_server: int, writes: tuple[bytes, ...],
                                              statuses: list[str]) -> None:
    replies, closed = converse(empty_server, *writes, expect=len(statuses))
    assert [r.status_line for r in replies] == statuses, writes
    assert not closed, writes


@pytest.mark.parametrize("method", [b"get", b"Get", b"FOO1", b"FOO-BAR"])
def test_a_method_that_is_no_method_token_is_refused_and_the_connection_closed(
        empty_server: int, method: bytes) -> None:
    # Triton 2.51 closes the connection without an answer; tritonpy says why first.
    replies, closed = converse(empty_server, method + b" /v2/health/ready HTTP/1.1\r\n\r\n")
    assert [(r.status_line, json.loads(r.body)) for r in replies] == [(
        "HTTP/1.1 400 Bad Request",
        {"error": "malformed HTTP request: Invalid method encountered"})]
    assert closed


def _logging(port: int, body: bytes | None = None, *headers: bytes) -> Reply:
    if body is None:
        data = b"GET /v2/logging HTTP/1.1\r\nHost: x\r\n\r\n"
    else:
        data = b"\r\n".join([b"POST /v2/logging HTTP/1.1", b"Host: x", *headers]) + \
            b"\r\n\r\n" + body
    replies, _ = converse(port, data)
    assert len(replies) == 1, replies
    return replies[0]


def test_a_logging_update_without_a_json_document_is_refused_and_changes_nothing(
        empty_server: int) -> None:
    port = empty_server
    changed = _logging(port, b'{"log_verbose_level":1}', b"Content-Length: 23")
    assert changed.status_line == "HTTP/1.1 200 OK", changed
    settings = json.loads(_logging(port).body)
    assert settings["log_verbose_level"] == 1
    # Triton 2.51: 500 and these words; tritonpy answered 200 with the settings unchanged.
    for body, headers, offset in [
            (b"", [b"Content-Length: 0"], 0),
            (b"", [], 0),  # no body at all
            (b"0\r\n\r\n", [b"Transfer-Encoding: chunked"], 0),
            (b" \n\t", [b"Content-Length: 3"], 3),
            (b"\r\n", [b"Content-Length: 2"], 2)]:
        reply = _logging(port, body, *headers)
        assert reply.status_line == "HTTP/1.1 400 Bad Request", (body, reply)
        assert json.loads(reply.body) == {"error": "failed to parse the request JSON buffer: "
                                                   f"The document is empty. at {offset}"}
        assert json.loads(_logging(port).body) == settings
    # As in Triton, {} is an update that changes nothing.
    same = _logging(port, b"{}", b"Content-Length: 2")
    assert same.status_line == "HTTP/1.1 200 OK" and json.loads(same.body) == settings


INIT_FAILS = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("boom in init")

    def execute(self, requests):
        return []
"""
CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
"""


def _index_repo(repo: Path) -> None:
    for name in ("ident", "unloaded", "never"):
        write_model(repo, name)
    write_model(repo, "badcfg", config='name: "badcfg"\nbackend: "python"\nthis is not pbtxt {{{\n')
    write_model(repo, "initfail", INIT_FAILS, config=CONFIG.format(name="initfail"))
    # Version 1 loads, version 2 raises in initialize.
    write_model(repo, "twover",
                config=CONFIG.format(name="twover") + "version_policy: { all { } }\n")
    (repo / "twover" / "2").mkdir()
    (repo / "twover" / "2" / "model.py").write_text(INIT_FAILS)
    # Configurations that Triton's repository poll takes and its model load refuses.
    write_model(repo, "badio", config=io_config(dims="[ 0 ]"))
    write_model(repo, "onnx", config='name: "onnx"\nbackend: "onnxruntime"\n')
    # A folder with a config and no version: Triton's index leaves it out.
    write_model(repo, "noversion", config=CONFIG.format(name="noversion"), versions=())


def _reason(path: Path) -> str:
    # The line of the raise in INIT_FAILS (its first line is empty).
    return f"Internal: RuntimeError: boom in init\n\nAt:\n  {path}(6): initialize\n"


def test_index_rows_as_tritons(serve: Callable[..., Serve], tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _index_repo(repo)
    server, http_port, grpc_port = serve_repo(serve, repo, "--model-control-mode=explicit",
                                              "--load-model=ident")

    def post(path: str, body: bytes = b"{}") -> tuple[str, Any]:
        req = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
        replies, _ = converse(http_port, req)
        return replies[0].status_line, json.loads(replies[0].body or b"null")

    for name in ("badcfg", "initfail", "twover", "badio", "onnx", "noversion"):
        assert post(f"/v2/repository/models/{name}/load")[0] == "HTTP/1.1 400 Bad Request"
    assert post("/v2/repository/models/unloaded/load")[0] == "HTTP/1.1 200 OK"
    assert post("/v2/repository/models/unloaded/unload")[0] == "HTTP/1.1 200 OK"
    unloaded = {"name": "unloaded", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    deadline = time.monotonic() + 10  # the unload finishes in the background
    while post("/v2/repository/index")[1][-1] != unloaded and time.monotonic() < deadline:
        time.sleep(0.05)
    # Triton 2.51's rows for this repository, field for field (measured), but badcfg's: Triton
    # lists it by name alone; tritonpy says why, on purpose. tritonpy used to give badio and
    # onnx no version, and to leave out twover's version 1.
    # badio's reason is tritonpy's own words (Triton's: "Invalid argument: model input 'IN'
    # dimension must be integer >= 1, or -1 to indicate a variable-size dimension for
    # badio"); onnx's is Triton's, then where tritonpy looked for a Python-based backend.
    badcfg = {"name": "badcfg", "state": "UNAVAILABLE",
              "reason": f"{repo / 'badcfg' / 'config.pbtxt'}:3:1: invalid field 'this' in "
                        "ModelConfig"}
    expected = [
        badcfg,
        {"name": "badio", "version": "1", "state": "UNAVAILABLE",
         "reason": f"{repo / 'badio' / 'config.pbtxt'}: model input 'IN' dimension must be "
                   "integer >= 1, or -1 to indicate a variable-size dimension for badio "
                   "('dims' has 0)"},
        {"name": "ident", "version": "1", "state": "READY"},
        {"name": "initfail", "version": "1", "state": "UNAVAILABLE",
         "reason": _reason(repo / "initfail" / "1" / "model.py")},
        {"name": "never"},
        {"name": "onnx", "version": "1", "state": "UNAVAILABLE",
         "reason": "Invalid argument: unable to find backend library for backend "
                   "'onnxruntime', try specifying runtime on the model configuration. (tritonpy "
                   "runs the python backend and Python-based backends, and found no "
                   "/opt/tritonserver/backends/onnxruntime/model.py; the backend directory is "
                   "Triton's --backend-directory)"},
        {"name": "twover", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"},
        {"name": "twover", "version": "2", "state": "UNAVAILABLE",
         "reason": _reason(repo / "twover" / "2" / "model.py")},
        unloaded,
    ]
    ready = [{"name": "ident", "version": "1", "state": "READY"}]
    assert post("/v2/repository/index") == ("HTTP/1.1 200 OK", expected)
    assert post("/v2/repository/index", b'{"ready": true}') == ("HTTP/1.1 200 OK", ready)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for only_ready, rows in ((False, expected), (True, ready)):
            got = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=only_ready),
                                       timeout=10)
            assert json_format.MessageToDict(got) == {"models": rows}
    _stop(server)
