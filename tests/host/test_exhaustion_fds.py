"""A host out of file descriptors (``RLIMIT_NOFILE`` reached: each mapped segment, stub pipe
and client connection holds one) answers the requests that need a new one with an error that
names the limit, leaves no request in flight and no instance busy, and serves again once
descriptors are back.

The server runs in a child process whose limit is lowered (never this one's); the child fills
its descriptor table with ``/dev/null`` and reports what each request got, as JSON.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from _models import assert_clean, io_config, run_driver, write_model

pytestmark = pytest.mark.timeout(60)


# Run as ``python -c DRIVER REPO PREFIX SCENARIO``: prints one JSON object, then stops the server.
DRIVER = textwrap.dedent("""
    import json, os, resource, signal, sys, time
    import numpy as np
    import tritonpy
    from tritonpy.shm import janitor

    repo, prefix, scenario = sys.argv[1:4]
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
    server = tritonpy.Server(repo, exit_timeout=20.0, backend_config={
        "shm-region-prefix-name": prefix, "restart-backoff-seconds": "0.05"})
    server.start()
    out = {}
    fill = []

    def exhaust():
        try:
            while True:
                fill.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass

    def give_back():
        while fill:
            os.close(fill.pop())

    def ask(model, n, wait=8.0):
        try:
            r = server.model(model).infer({"IN": np.ones(n, np.float32)}).get(timeout=wait)
        except Exception as exc:
            return f"raised {type(exc).__name__}: {exc}"
        return f"error: {r.error}" if r.error else "ok"

    try:
        ask("m", 4)
        if scenario == "tensors":
            exhaust()
            out["small"] = ask("m", 4)          # in segments it has: still fine
            out["new_input"] = ask("m", 8 << 20)   # the host needs a new segment
            give_back()
            out["after"] = [ask("m", 4), ask("m", 8 << 20)]
        elif scenario == "restart":
            stub = janitor.stubs_of(os.getpid())[0]
            exhaust()
            os.kill(stub.pid, signal.SIGKILL)
            deadline = time.monotonic() + 8  # past the answer of the death itself
            while "killed by signal" in (got := ask("m", 4)) and time.monotonic() < deadline:
                time.sleep(0.05)
            out["during"] = got
            give_back()
            deadline = time.monotonic() + 10
            while (got := ask("m", 4)) != "ok" and time.monotonic() < deadline:
                time.sleep(0.1)
            out["after"] = got
        elif scenario == "spill":
            exhaust()
            out["big_frame"] = ask("spill", 4)
            give_back()
            deadline = time.monotonic() + 10
            while (got := ask("spill", 4)) != "ok" and time.monotonic() < deadline:
                time.sleep(0.1)
            out["after"] = got
    finally:
        give_back()
        t0 = time.monotonic()
        server.stop()
        out["stop_s"] = time.monotonic() - t0
        out["cut_short"] = bool(server.cut_short)
    print("RESULT " + json.dumps(out))
""")

# A response frame of two 40 KiB inline outputs (80 KiB): above the channel's frame limit, so
# it is spilled into the stub's pool, whose first segment the host maps for it.
SPILL_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([
            pb_utils.Tensor("OUT", np.ones(10 << 10, np.float32)),
            pb_utils.Tensor("OUT2", np.full(10 << 10, 2, np.float32))]) for r in requests]
"""


def _run(tmp_path: Path, prefix: str, scenario: str) -> dict:
    result, _ = run_driver(DRIVER, str(tmp_path), prefix, scenario)
    assert_clean(prefix)
    return json.loads(result)


def test_a_new_segment_without_a_descriptor_fails_that_request_naming_the_limit(
        tmp_path: Path, shm_prefix: str) -> None:
    write_model(tmp_path, "m")
    got = _run(tmp_path, shm_prefix, "tensors")
    assert got["small"] == "ok"
    # An error response (it used to raise OSError out of infer() with no word of which limit,
    # and leave the request in flight: stop() then waited its whole exit timeout).
    assert got["new_input"].startswith("error: "), got
    assert "RLIMIT_NOFILE" in got["new_input"] and "soft limit 128" in got["new_input"], got
    assert got["after"] == ["ok", "ok"]
    assert not got["cut_short"] and got["stop_s"] < 10, got


def test_a_stub_that_cannot_be_restarted_for_want_of_descriptors_says_so_and_comes_back(
        tmp_path: Path, shm_prefix: str) -> None:
    write_model(tmp_path, "m")
    got = _run(tmp_path, shm_prefix, "restart")
    assert "cannot start stub process 'm_0'" in got["during"], got
    assert "RLIMIT_NOFILE" in got["during"], got
    assert got["after"] == "ok"
    assert not got["cut_short"], got


def test_a_spilled_frame_the_host_cannot_map_fails_its_request_instead_of_losing_it(
        tmp_path: Path, shm_prefix: str) -> None:
    write_model(tmp_path, "spill", SPILL_PY, io_config(extra=(
        'output [ { name: "OUT2", data_type: TYPE_FP32, dims: [ -1 ] } ]\n')))
    got = _run(tmp_path, shm_prefix, "spill")
    # It used to be logged as a bad frame and dropped: the request waited for ever.
    assert got["big_frame"].startswith("error: "), got
    assert "could not be read" in got["big_frame"] and "RLIMIT_NOFILE" in got["big_frame"], got
    assert got["after"] == "ok"
    assert not got["cut_short"], got
