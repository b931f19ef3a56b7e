"""Shared helpers of the BLS, decoupled and soak tests: the model repositories they serve,
module-scoped shm prefixes, and bounded waits on response streams (a bug shows up as a failed
assertion, never as a hung test run).

The repositories are ``tests/models/bls`` (BLS callers and their targets) and
``tests/models/decoupled`` (decoupled, async-execute, cancellation and rescheduling models).
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import tritonpy

HERE = os.path.dirname(os.path.abspath(__file__))
BLS_REPO = os.path.join(HERE, "models", "bls")
DECOUPLED_REPO = os.path.join(HERE, "models", "decoupled")
SHM_DIR = "/dev/shm"
MiB = 1 << 20

#: A BLS caller taking a COUNT and answering a REPORT string (of what it read).
REPORT_CALLER_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "REPORT", data_type: TYPE_STRING, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""


def new_prefix() -> str:
    """A segment prefix like the ``shm_prefix`` fixture's, for servers that outlive one test.

    It is registered with the suite's leak guard (``conftest._ISSUED``) when that is loaded, so
    the session-end check counts leaks under it as ours.
    """
    prefix = f"tpyt{secrets.token_hex(4)}_"
    guard = sys.modules.get("conftest")
    issued = getattr(guard, "_ISSUED", None)
    if isinstance(issued, set):
        issued.add(prefix)
    return prefix


def segments(prefix: str) -> list[str]:
    """Names of the shm segments under ``prefix``."""
    try:
        return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(prefix))
    except OSError:
        return []


@contextlib.contextmanager
def serve(repos: str | list[str], prefix: str, **kwargs: Any) -> Iterator[tritonpy.Server]:
    """A started server over ``repos`` with segment prefix ``prefix``; stopped on exit, and
    then nothing of that prefix may remain in /dev/shm."""
    backend_config = dict(kwargs.pop("backend_config", {}) or {})
    backend_config["shm-region-prefix-name"] = prefix
    server = tritonpy.Server(repos, backend_config=backend_config, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        deadline = time.monotonic() + 2.0
        left = segments(prefix)
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = segments(prefix)
        for name in left:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))
        assert not left, f"server left shm segments behind: {left}"


def collect(stream: Any, timeout: float = 30.0) -> list:
    """Every response of a stream up to its final one; fails (never hangs) after ``timeout``."""
    out = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            resp = stream.get(timeout=max(left, 0.001))
        except queue.Empty:
            raise AssertionError(
                f"no final response within {timeout} s; got {len(out)}: {out}") from None
        out.append(resp)
        if resp.final:
            return out


def infer_one(server: tritonpy.Server, model: str, inputs: dict, timeout: float = 30.0,
              **kwargs: Any) -> Any:
    """The single response of a default-mode request."""
    responses = collect(server.model(model).infer(inputs, **kwargs), timeout)
    assert len(responses) == 1, responses
    return responses[0]


def text(resp: Any, name: str) -> Any:
    """A JSON string output (BYTES [1]) decoded."""
    assert resp.error is None, resp.error
    raw = resp.outputs[name].to_numpy()[0]
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def bytes_tensor(*values: str) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=np.object_)


def drive(server: tritonpy.Server, spec: dict, data: np.ndarray | None = None,
          timeout: float = 60.0) -> tuple[dict, Any]:
    """Run ``bls_driver`` with ``spec``; its REPORT and the whole response."""
    inputs: dict[str, Any] = {"SPEC": bytes_tensor(json.dumps(spec))}
    if data is not None:
        inputs["DATA"] = data
    resp = infer_one(server, "bls_driver", inputs, timeout=timeout)
    return text(resp, "REPORT"), resp


def fp32(*values: float) -> dict:
    """A driver SPEC input of FP32 values."""
    return {"data": list(values), "dtype": "float32"}


def rss(pid: int | None = None) -> int:
    import psutil

    return int(psutil.Process(pid or os.getpid()).memory_info().rss)
