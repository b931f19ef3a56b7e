"""``tritonpy serve`` takes a ``tritonserver`` command line as Triton 2.51 takes it.

Each case was run side by side with the real ``tritonserver`` 2.51 (same repository, same
flags). Where Triton's behaviour is what a user expects, tritonpy does the same: usage errors
exit 1, ``--model-control-mode`` and ``--rate-limit`` in any case, ``--repository-poll-secs 0``
reads the repository at start only, the python backend's own Triton settings
(``thread-pool-size``, the global ``default-max-batch-size``) run, and the log lines have
Triton's layout. Where Triton accepts nonsense (a port of -5, an address that is not the
machine's, a negative poll interval), the start stops here, naming the flag and the value.
"""
from __future__ import annotations

import json
import logging
import re
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import pytest

from _models import wait_for, write_model
from _serve import START_TIMEOUT, Serve, free_ports, serve_repo

from tritonpy import cli
from tritonpy._cli_settings import _tracing, python_backend_config, unbracketed


def _status(url: str, body: bytes | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _stop(server: Serve) -> int:
    server.proc.send_signal(signal.SIGTERM)
    return server.wait(30)


@pytest.mark.parametrize("flags, words", [
    # Triton logs "Started HTTPService at 0.0.0.0:-5" and serves nothing there; tritonpy used to
    # end in a traceback (OverflowError from bind()).
    (["--http-port=-5"], "argument --http-port: expected a port number 0-65535, got '-5'"),
    (["--grpc-port", "70000"], "argument --grpc-port: expected a port number 0-65535, got '70000'"),
    # Triton starts without the endpoint; tritonpy said "Socket ... already in use".
    (["--grpc-address", "192.0.2.1"],
     "--grpc-address 192.0.2.1: not an address of this machine"),
    # Triton takes them (a negative exit timeout exits 1 at once); tritonpy's poller died on it.
    (["--model-control-mode=poll", "--repository-poll-secs=-1"],
     "argument --repository-poll-secs: expected a number of seconds >= 0, got '-1'"),
    (["--exit-timeout-secs=-1"],
     "argument --exit-timeout-secs: expected a number of seconds >= 0, got '-1'"),
    # As Triton: a bad value stops the start with exit code 1 (argparse's own code is 2).
    (["--model-control-mode=sometimes"], "argument --model-control-mode: invalid choice"),
    (["--backend-config=python,thread-pool-size=0"],
     "backend option 'thread-pool-size' expects an integer >= 1, got '0'"),
    # Triton fails to start with size=0 ("Failed to initialize LocalCache"); tritonpy started
    # with no cache, without a word.
    (["--cache-config", "local,size=0"],
     "--cache-config local,size=0: the local cache needs a size of 1 byte or more"),
    (["--cache-config", "local,size=100000,foo=bar"],
     "one setting per --cache-config, as in Triton"),
    # Triton 2.51's words (QA L0_backend_config); tritonpy took it as a global setting.
    (["--backend-config=,default-max-batch-size=3"],
     "No backend specified. --backend-config option format is <backend name>,<setting>=<value>"
     " or <setting>=<value>. Got ,default-max-batch-size=3"),
    # Triton 2.51: "Error: empty argument for --model-config-name" (measured, QA
    # L0_custom_model_config); tritonpy started with the default config.
    (["--model-config-name="], "empty argument for --model-config-name"),
    # An unset variable in a launch line: Triton 2.51 stops ("failed to stat file"); tritonpy
    # served the current folder.
    (["--model-repository="], "argument --model-repository/--model-store: the model "
     "repository path is empty"),
    # Triton 2.51 hangs at start (s3, gs) or aborts (as); tritonpy said "model repository
    # '.../s3:/bucket/models' does not exist".
    (["--model-repository=s3://bucket/models"], "model repository 's3://bucket/models': "
     "s3:// locations are not supported; tritonpy serves model repositories in local folders"),
    # Triton 2.51's words (measured); tritonpy started, --cache-config winning.
    (["--response-cache-byte-size=12345", "--cache-config=local,size=67890"],
     "Incompatible flags --response-cache-byte-size and --cache-config both provided. "
     "Please provide one or the other."),
    # QA round 14: the server started, then refused every HTTP request, health probes too
    # ("exceeds the maximum allowed value of -1 bytes").
    (["--http-max-input-size=-1"],
     "--http-max-input-size must be >= 0 bytes (0: the default), got -1"),
    (["--metrics-interval-ms=-1"], "--metrics-interval-ms must be >= 0, got -1"),
])
def test_a_bad_value_stops_the_start_with_code_1_naming_it(
        serve: Callable[..., Serve], tmp_path: Path, flags: list[str], words: str) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "ident")
    server = serve("--model-repository", str(repo), *flags)
    assert server.wait(START_TIMEOUT) == 1, server.log()
    text = server.log()
    assert words in text, text
    assert "Traceback" not in text, text


def test_model_control_mode_and_rate_limit_in_any_case(serve: Callable[..., Serve],
                                                      tmp_path: Path) -> None:
    # Triton 2.51 takes EXPLICIT, Poll, OFF...; tritonpy refused them as invalid choices.
    repo = tmp_path / "repo"
    write_model(repo, "ident")
    write_model(repo, "other")
    server, http_port, _ = serve_repo(serve, repo, "--model-control-mode=EXPLICIT",
                                      "--load-model=ident", "--rate-limit=OFF")
    base = f"http://127.0.0.1:{http_port}/v2"
    assert _status(f"{base}/models/ident/ready") == 200
    assert _status(f"{base}/models/other/ready") == 400  # explicit: not loaded at start
    assert _status(f"{base}/repository/models/other/load", b"{}") == 200
    assert _status(f"{base}/models/other/ready") == 200
    assert _stop(server) == 0


def test_poll_secs_0_reads_the_repository_at_start_only(serve: Callable[..., Serve],
                                                        tmp_path: Path) -> None:
    # As Triton 2.51: 0 turns the polling off. tritonpy used to scan the repository without a
    # pause (half a CPU) and so loaded a model added later.
    repo = tmp_path / "repo"
    write_model(repo, "ident")
    server, http_port, _ = serve_repo(serve, repo, "--model-control-mode=poll",
                                      "--repository-poll-secs=0")
    base = f"http://127.0.0.1:{http_port}/v2"
    assert _status(f"{base}/models/ident/ready") == 200
    write_model(repo, "late")
    assert not wait_for(lambda: _status(f"{base}/models/late/ready") == 200, timeout=3.0)
    assert _stop(server) == 0
    assert "--repository-poll-secs 0: the repository is read at start only" in server.log()


def test_triton_backend_settings_run_and_are_named(serve: Callable[..., Serve],
                                                   tmp_path: Path) -> None:
    # Triton 2.51 runs these: thread-pool-size is its python backend's, default-max-batch-size
    # a global setting given to every backend, foo=1 a global one no backend takes. tritonpy
    # refused the first three as unknown python options.
    repo = tmp_path / "repo"
    write_model(repo, "ident")
    server, http_port, _ = serve_repo(
        serve, repo, "--backend-config=python,thread-pool-size=8",
        "--backend-config=default-max-batch-size=4", "--backend-config=foo=1",
        "--backend-config=onnxruntime,default-max-batch-size=2")
    assert _status(f"http://127.0.0.1:{http_port}/v2/models/ident/ready") == 200
    assert _stop(server) == 0
    text = server.log()
    for line in ("--backend-config=python,thread-pool-size=8 is accepted for Triton's command "
                 "lines and has no effect: ",
                 "--backend-config=default-max-batch-size=4 is accepted for Triton's command "
                 "lines and has no effect: ",
                 "ignoring --backend-config=foo=1: a global setting the python backend does "
                 "not take",
                 "ignoring --backend-config for backend 'onnxruntime'"):
        assert re.search(rf"^W.*{re.escape(line)}", text, re.M), (line, text)


def test_the_python_backends_own_setting_wins_over_a_global_one() -> None:
    # As in Triton, whatever the order on the command line; a python option tritonpy does not
    # know still stops the start (Triton's python backend ignores it: a typo goes unnoticed).
    parser = cli.build_parser()
    for order in ((0, 1), (1, 0)):
        flags = ["--backend-config=python,shm-default-byte-size=2097152",
                 "--backend-config=shm_default_byte_size=1048576"]
        args = parser.parse_args(["serve", *(flags[i] for i in order)])
        assert python_backend_config(args) == {"shm-default-byte-size": "2097152"}
    args = parser.parse_args(["serve", "--backend-config=python,shm-default-bytes=1"])
    with pytest.raises(SystemExit, match="unknown backend option 'shm-default-bytes'"):
        python_backend_config(args)


def test_verbose_log_tells_the_backend_settings_in_tritons_words(
        caplog: pytest.LogCaptureFixture) -> None:
    # QA L0_backend_config greps Triton 2.51's verbose lines (measured) for them; tritonpy
    # logged none. The shared memory line gives tritonpy's own values.
    parser = cli.build_parser()
    with caplog.at_level(logging.DEBUG, logger="tritonpy"):
        python_backend_config(parser.parse_args(["serve"]))
        python_backend_config(parser.parse_args([
            "serve", "--backend-config=default-max-batch-size=5",
            "--backend-config=python,shm-default-byte-size=8388608",
            "--backend-config=python,shm-region-prefix-name=p_"]))
    lines = [r.getMessage() for r in caplog.records]
    assert "Adding default backend config setting: default-max-batch-size,4" in lines
    assert "Found overwritten default setting: default-max-batch-size,5" in lines
    configs = [json.loads(line.split("\n", 1)[1]) for line in lines
               if line.startswith("backend configuration:\n")]
    assert configs[1]["cmdline"]["default-max-batch-size"] == "5"
    assert configs[1]["cmdline"]["shm-region-prefix-name"] == "p_"
    assert configs[1]["cmdline"]["auto-complete-config"] == "true"
    assert "Shared memory configuration is shm-default-byte-size=8388608,shm-growth-byte-size=" \
           "16777216,stub-timeout-seconds=30" in lines


def test_log_lines_have_tritons_default_layout(serve: Callable[..., Serve],
                                               tmp_path: Path) -> None:
    # Triton: "I1126 20:30:47.719771 10221 file.cc:273] ..." (UTC). tritonpy printed
    # "I2026-11-26 20:31:03,842 ...", against its own --log-format help, then the logger's
    # name where Triton has the file and line ("tritonpy.cli]").
    repo = tmp_path / "repo"
    write_model(repo, "ident")
    server, http_port, _ = serve_repo(serve, repo)
    settings = json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{http_port}/v2/logging", timeout=10).read())
    assert settings["log_format"] == "default"
    assert _stop(server) == 0
    lines = [ln for ln in server.log().splitlines() if re.match(r"^[IWE]\S", ln)]
    assert lines, server.log()
    for line in lines:
        assert re.match(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ \w+\.py:\d+\] ", line), line


VERBOSE_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        pb_utils.Logger.log_verbose('a "verbose" line')
        pb_utils.Logger.log_warn("a warning")
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests]
"""


@pytest.mark.parametrize("iso", [False, True])
def test_model_log_lines_as_triton_writes_them(serve: Callable[..., Serve], tmp_path: Path,
                                               iso: bool) -> None:
    # A verbose line starts with I, as Triton's (it was D); ISO8601 starts a line with the UTC
    # time, then the level, and quotes the message (it was "I2026-11-26T21:01:11 ..." with the
    # message bare).
    repo = tmp_path / "repo"
    write_model(repo, "ident", VERBOSE_PY)
    server, http_port, _ = serve_repo(serve, repo, "--log-verbose=1",
                                      *(["--log-format", "ISO8601"] if iso else []))
    body = json.dumps({"inputs": [{"name": "IN", "shape": [1], "datatype": "FP32",
                                   "data": [1.0]}]}).encode()
    assert _status(f"http://127.0.0.1:{http_port}/v2/models/ident/infer", body) == 200
    assert _stop(server) == 0
    text = server.log()
    if iso:
        head = r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (?P<level>[IWE]) \d+ \w+\.py:\d+\] '
        verbose, warning = r'"\[ident_0\] a \\"verbose\\" line"$', r'"\[ident_0\] a warning"$'
    else:
        head = r"^(?P<level>[IWE])\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ \w+\.py:\d+\] "
        verbose, warning = r'\[ident_0\] a "verbose" line$', r"\[ident_0\] a warning$"
    found = re.search(head + verbose, text, re.M)
    assert found and found["level"] == "I", text
    found = re.search(head + warning, text, re.M)
    assert found and found["level"] == "W", text
    # As Triton's: the model's own file and line (Logger.log_verbose is on line 7 of VERBOSE_PY).
    head = head.replace(r"\w+\.py:\d+\] ", r"model\.py:(?P<line>\d+)\] ")
    assert [m["line"] for m in re.finditer(head + f"(?:{verbose}|{warning})", text, re.M)] == [
        "7", "8"], text


# Triton 2.51's start-up lines, --log-verbose 1 --log-info true (measured):
#   I1126 22:47:40.197481 4379 http_server.cc:4713] "Started HTTPService at 0.0.0.0:38497"
#   2026-11-26T22:47:45Z I 4585 model_lifecycle.cc:472] "loading: ident:1"
# The same fields and separators here: level and time (UTC; microseconds, or whole seconds and
# a Z in ISO8601), pid, the file and line that logged, "] ", the message. ISO8601 quotes the
# message as a JSON string, as Triton; with TRITON_SERVER_ESCAPE_LOG_MESSAGES=0 it is bare,
# as Triton's. (Triton 2.51 quotes its default lines too; tritonpy's default lines stay bare:
# see README.)
ISO_HEAD = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ [IWE] \d+ \w+\.py:\d+\] "


@pytest.mark.parametrize("escape", [None, "0"])
def test_iso8601_start_up_lines_have_tritons_layout(
        serve: Callable[..., Serve], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        escape: str | None) -> None:
    if escape is not None:
        monkeypatch.setenv("TRITON_SERVER_ESCAPE_LOG_MESSAGES", escape)
    repo = tmp_path / "repo"
    write_model(repo, "ident")
    server, http_port, _ = serve_repo(serve, repo, "--log-verbose=1", "--log-info=true",
                                      "--log-format=ISO8601")
    assert _stop(server) == 0
    lines = [ln for ln in server.log().splitlines() if ln[:2].isdigit()]
    assert lines, server.log()
    for line in lines:
        if escape is None:
            assert re.match(ISO_HEAD + r'"([^"\\]|\\.)*"$', line), line
        else:
            assert re.match(ISO_HEAD + r'[^"]', line), line
    started = ISO_HEAD + (r'"Started HTTPService at [\d.]+:%d"$' if escape is None
                          else r"Started HTTPService at [\d.]+:%d$") % http_port
    assert re.search(started, server.log(), re.M), server.log()


@pytest.mark.parametrize("case", ["unreadable config", "name in two repositories"])
def test_a_folder_that_is_no_model_fails_the_start_as_triton(
        serve: Callable[..., Serve], tmp_path: Path, case: str) -> None:
    # Triton 2.51 (--exit-on-error true, its default): "failed to load all models", exit 1;
    # with --exit-on-error false it serves the rest and is ready (neither counts against
    # readiness). tritonpy used to start and serve with the default.
    repo = tmp_path / "repo"
    write_model(repo, "ident")
    repos = ["--model-repository", str(repo)]
    if case == "unreadable config":
        write_model(repo, "broken", config="this is { not pbtxt")
        name = "broken"
    else:
        write_model(tmp_path / "other", "ident")
        repos += ["--model-repository", str(tmp_path / "other")]
        name = "ident"
    server = serve(*repos)
    assert server.wait(START_TIMEOUT) == 1, server.log()
    assert re.search(rf"^E.*model '{name}' failed to load: ", server.log(), re.M), server.log()
    assert "failed to load all models" in server.log()

    server, http_port, _ = serve_repo(serve, repo, *repos[2:], "--exit-on-error=false")
    assert _status(f"http://127.0.0.1:{http_port}/v2/health/ready") == 200
    assert _stop(server) == 0


def test_a_missing_repository_with_exit_on_error_false_serves_on_not_live(
        serve: Callable[..., Serve], tmp_path: Path) -> None:
    # Triton 2.51 (measured): the start fails ("failed to stat file"), and with
    # --exit-on-error false its frontends serve on: neither live nor ready, every call about
    # models UNAVAILABLE "Server not ready" (HTTP 503), the rest answered. tritonpy exited 1.
    import grpc
    import tritonclient.grpc as grpcclient

    write_model(tmp_path / "repo", "ident")
    missing = tmp_path / "not-there"
    server = serve("--model-repository", str(missing), "--model-repository",
                   str(tmp_path / "repo"))
    assert server.wait(START_TIMEOUT) == 1, server.log()
    assert f"model repository '{missing}' does not exist" in server.log()

    server, http_port, grpc_port = serve_repo(serve, missing, "--model-repository",
                                              str(tmp_path / "repo"), "--exit-on-error=false")
    base = f"http://127.0.0.1:{http_port}/v2"
    assert _status(f"{base}/health/live") == 400
    assert _status(f"{base}/health/ready") == 400
    assert _status(base) == 200 and _status(f"{base}/logging") == 200
    for path, body in (("/models/ident", None), ("/models/ident/ready", None),
                       ("/models/stats", None), ("/repository/index", b"{}"),
                       ("/repository/models/ident/load", b"{}"),
                       ("/models/ident/infer", b'{"inputs": []}')):
        req = urllib.request.Request(base + path, data=body)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 503, path
        assert json.loads(err.value.read()) == {"error": "Server not ready"}, path
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        assert not client.is_server_live() and not client.is_server_ready()
        for call in (lambda: client.is_model_ready("ident"),
                     lambda: client.get_model_repository_index()):
            with pytest.raises(Exception) as gerr:
                call()
            assert gerr.value.status() == "StatusCode." + grpc.StatusCode.UNAVAILABLE.name
            assert gerr.value.message() == "Server not ready"
    finally:
        client.close()
    assert f"model repository '{missing}' does not exist" in server.log()
    assert _stop(server) == 0


def test_the_in_process_api_takes_a_poll_interval_of_0_as_the_command_line_does(
        tmp_path: Path) -> None:
    # Server(poll_interval=0) used to scan the repository without a pause, and a negative
    # interval killed the poll thread with a traceback while the server went on.
    import threading

    import tritonpy

    from _models import new_prefix, serving

    write_model(tmp_path, "ident")
    with serving(tmp_path, new_prefix(), model_control_mode="poll", poll_interval=0) as server:
        assert server.model("ident").ready()
        assert not [t for t in threading.enumerate() if t.name == "tritonpy-poll"]
        write_model(tmp_path, "late")
        assert not wait_for(lambda: "late" in {m["name"] for m in server.models()}, timeout=1.0)
    with pytest.raises(ValueError, match="poll_interval must be 0 or more seconds, got -1"):
        tritonpy.Server(str(tmp_path), model_control_mode="poll", poll_interval=-1)


def test_a_frontend_that_cannot_listen_says_why(tmp_path: Path) -> None:
    # Every bind error used to read "already in use"; that is kept for a port that is taken,
    # in Triton 2.51's words (measured: "failed to start GRPC service: Unavailable - Socket
    # '0.0.0.0:P' already in use"; tritonpy added Python's own errno text after them).
    import socket

    from _models import new_prefix, serving
    from tritonpy import UnavailableError
    from tritonpy.frontends import Frontends

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    write_model(tmp_path, "ident")
    try:
        with serving(tmp_path, new_prefix()) as server:
            for kwargs, words in (
                    ({"http_address": "127.0.0.1", "http_port": port},
                     f"failed to start HTTP service: Unavailable - Socket '127.0.0.1:{port}' "
                     "already in use"),
                    ({"allow_http": False, "allow_grpc": True, "grpc_address": "127.0.0.1",
                      "grpc_port": port},
                     f"failed to start GRPC service: Unavailable - Socket '127.0.0.1:{port}' "
                     "already in use"),
                    # Both taken: as Triton, gRPC starts first, so it is the one named.
                    ({"allow_grpc": True, "http_address": "127.0.0.1", "http_port": port,
                      "grpc_address": "127.0.0.1", "grpc_port": port},
                     f"failed to start GRPC service: Unavailable - Socket '127.0.0.1:{port}' "
                     "already in use"),
                    ({"allow_http": False, "allow_metrics": True, "metrics_address": "127.0.0.1",
                      "metrics_port": port},
                     f"failed to start Metrics service: Unavailable - Socket "
                     f"'127.0.0.1:{port}' already in use"),
                    ({"http_address": "192.0.2.1", "http_port": 0},
                     "failed to start HTTP service: cannot listen on '192.0.2.1:0': Cannot "
                     "assign requested address")):
                fe = Frontends(server, **{"allow_grpc": False, "allow_metrics": False, **kwargs})
                with pytest.raises(UnavailableError) as err:
                    fe.start_in_thread()
                assert err.value.message == words
    finally:
        taken.close()


def test_a_service_turned_off_takes_any_port_and_address(serve: Callable[..., Serve],
                                                        tmp_path: Path) -> None:
    # QA L0_socket: Triton 2.51 starts with a port or address of nonsense for a service that
    # is off; tritonpy refused the port (a usage error) and the address (metrics took it). The
    # metrics, which take the HTTP address, listen on every interface then, and say why.
    repo = tmp_path / "repo"
    write_model(repo, "ident")
    ports = free_ports(3)
    server = serve("--model-repository", str(repo), "--allow-http=0", "--http-port=-47",
                   "--http-address=-47", "--grpc-port", str(ports[1]),
                   "--metrics-port", str(ports[2]))
    assert wait_for(lambda: "listening: metrics" in server.log() or server.proc.poll() is not None,
                    timeout=START_TIMEOUT)
    text = server.log()
    assert f"listening: gRPC 127.0.0.1:{ports[1]}" in text, text
    assert f"listening: metrics 0.0.0.0:{ports[2]}" in text, text
    assert "--http-address -47: Name or service not known (HTTP is off): metrics listen on " \
           "0.0.0.0" in text, text
    assert _status(f"http://127.0.0.1:{ports[2]}/metrics") == 200
    assert _stop(server) == 0


def test_triton_older_trace_levels_min_and_max_are_timestamps(tmp_path: Path) -> None:
    # QA L0_cmdline_trace: Triton 2.51 takes --trace-config level=MIN (and MAX) as TIMESTAMPS;
    # tritonpy stopped the start.
    args = cli.build_parser().parse_args([
        "serve", "--trace-config", "level=MIN", "--trace-config", "level=max",
        "--trace-config", f"triton,file={tmp_path / 'trace.json'}"])
    assert _tracing(args).settings()["trace_level"] == ["TIMESTAMPS"]


def test_a_bracketed_ipv6_address_is_taken_as_grpc_writes_it() -> None:
    # QA L0_socket: Triton's --grpc-address takes "[::1]"; tritonpy stopped the start ("Name or
    # service not known"). The frontends bind the address inside the brackets.
    assert unbracketed("[::1]") == "::1"
    assert unbracketed("::1") == "::1"
    assert unbracketed("127.0.0.1") == "127.0.0.1"
    assert unbracketed(None) is None

