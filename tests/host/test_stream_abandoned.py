"""A decoupled model's in-process response stream dropped before its end cancels its request.

The caller of ``Model.infer`` / ``Model.async_infer`` holds the only reference to the stream;
once it lets go (``del``, a function that returns, an ``async for`` broken out of), nobody can
read what the model sends. The request is cancelled then, at once: the model sees
``is_cancelled()``, the request ends, its instance serves the next one, and what was waiting
in the stream (the responses' shared memory blocks, the request itself) is freed. Before, the
model went on sending until back-pressure held it, and only HELD_STALLED_S (60 s) later was the
request cancelled.
"""
from __future__ import annotations

import asyncio
import gc
import json
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
from _models import serving, wait_for, write_model

from tritonpy import _request

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] } ]
"""
# Streams 64 KiB responses, a little apart, until the request is cancelled (IN of them at
# most, then the final flag); then writes what it saw to the request's "marker" file.
STREAM_PY = """
import json
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            marker = json.loads(request.parameters())["marker"]
            sender = request.get_response_sender()
            sent = 0
            while sent < count and not request.is_cancelled():
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT", np.full(64 << 10, sent % 256, np.uint8))]))
                sent += 1
                time.sleep(0.002)
            with open(marker, "w") as f:
                json.dump({"cancelled": request.is_cancelled(), "sent": sent}, f)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
# Well under HELD_STALLED_S (60 s), which ended such a request before.
SEEN_S = 10.0


def outcome(marker: Path) -> dict:
    """What the model saw, once its request ended (fails when it did not end soon)."""
    assert wait_for(marker.exists, SEEN_S), "the model was still streaming"
    return json.loads(marker.read_text())


def stub_used(srv) -> int:
    return {p["pool"]: p for p in srv.shm_usage()}["stream_0"]["used_bytes"]


@pytest.fixture
def server(tmp_path, shm_prefix):
    write_model(tmp_path / "repo", "stream", STREAM_PY, CONFIG)
    write_model(tmp_path / "repo", "stream_ensemble", "", ENSEMBLE_CONFIG)
    with serving(tmp_path / "repo", shm_prefix) as srv:
        yield srv


# STREAM_PY's model as the one step of a decoupled ensemble.
ENSEMBLE_CONFIG = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] } ]
ensemble_scheduling { step [ { model_name: "stream" model_version: -1
  input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "OUT" } } ] }
"""


def start(srv, marker: Path, count: int = 100_000, loop=None, name: str = "stream"):
    model = srv.model(name)
    inputs = {"IN": np.array([count], np.int32)}
    params = {"marker": str(marker)}
    if loop is not None:
        return model.async_infer(inputs, parameters=params, loop=loop)
    return model.infer(inputs, parameters=params)


def next_ok(stream) -> None:
    resp = stream.get(timeout=30)
    assert resp.error is None and not resp.final, resp


@pytest.mark.parametrize("read,name", [(0, "stream"), (3, "stream"), (3, "stream_ensemble")])
def test_a_dropped_sync_stream_cancels_its_request(server, tmp_path, read: int,
                                                   name: str) -> None:
    """``del stream`` after reading a few responses, or none: the model sees is_cancelled()
    at once, having sent far fewer than it would have, and the request and the blocks of the
    responses that waited are freed, by reference counting alone (no reference cycle keeps
    them for the cyclic GC: it is off meanwhile). The same through a decoupled ensemble."""
    marker = tmp_path / "seen.json"
    stream = start(server, marker, name=name)
    for _ in range(read):
        next_ok(stream)
    request = weakref.ref(stream.request)
    time.sleep(0.2)  # some responses wait in the stream
    gc.collect()
    gc.disable()
    try:
        dropped_at = time.monotonic()
        del stream
        seen = outcome(marker)
        assert seen["cancelled"], seen
        assert time.monotonic() - dropped_at < SEEN_S
        assert wait_for(lambda: request() is None, 5.0), "the cancelled request is still held"
        assert wait_for(lambda: stub_used(server) == 0, 5.0), \
            f"{stub_used(server)} bytes of responses still held"
    finally:
        gc.enable()
    # The instance is free again: the next request runs to its end.
    marker2 = tmp_path / "next.json"
    responses = list(start(server, marker2, count=3))
    assert [r.final for r in responses] == [False, False, False, True]
    assert outcome(marker2) == {"cancelled": False, "sent": 3}


def test_a_stream_left_behind_by_a_function_that_returned_is_cancelled(
        server, tmp_path) -> None:
    """The caller reads the first response inside a function and returns it, leaving the
    stream behind: the request is cancelled; the response it kept stays whole."""
    marker = tmp_path / "seen.json"

    def first():
        for resp in start(server, marker):
            return resp

    resp = first()
    seen = outcome(marker)
    assert seen["cancelled"], seen
    assert (resp.outputs["OUT"].to_numpy() == 0).all()


def test_breaking_out_of_an_async_for_and_dropping_the_stream_cancels(
        server, tmp_path) -> None:
    """``async for`` broken out of after two responses, the stream then dropped (the coroutine
    ends): the request is cancelled."""
    marker = tmp_path / "seen.json"

    async def two() -> int:
        taken = 0
        async for resp in start(server, marker, loop=asyncio.get_running_loop()):
            assert resp.error is None
            taken += 1
            if taken == 2:
                break
        return taken

    async def main() -> dict:
        assert await two() == 2
        # The loop goes on (the frontends' case: a served client went away).
        deadline = time.monotonic() + SEEN_S
        while not marker.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return outcome(marker)

    seen = asyncio.run(main())
    assert seen["cancelled"], seen


def test_a_stream_in_a_reference_cycle_is_cancelled_when_collected(server, tmp_path) -> None:
    """A stream kept only by a reference cycle is cancelled when the cyclic GC frees it (from
    whatever thread runs the collection)."""
    marker = tmp_path / "seen.json"
    holder: dict = {"stream": start(server, marker)}
    holder["self"] = holder
    next_ok(holder["stream"])
    del holder
    gc.collect()
    seen = outcome(marker)
    assert seen["cancelled"], seen



@pytest.mark.parametrize("name", ["stream", "stream_ensemble"])
def test_a_stream_held_unread_at_stop_does_not_hold_the_stop(
        tmp_path, shm_prefix, monkeypatch, name: str) -> None:
    """The caller still holds a stream that it does not read when the server stops: its model,
    waiting for that reader (back-pressure), is let go and finishes, and stop() returns then,
    not at the exit timeout with the model cut off; every response waits in the stream,
    whole. The same through a decoupled ensemble, whose reader paces its step."""
    monkeypatch.setattr(_request, "HOLD_BYTES", 1 * MiB)  # 16 responses
    write_model(tmp_path / "repo", "stream", STREAM_PY, CONFIG)
    write_model(tmp_path / "repo", "stream_ensemble", "", ENSEMBLE_CONFIG)
    marker = tmp_path / "seen.json"
    with serving(tmp_path / "repo", shm_prefix, exit_timeout=20) as srv:
        stream = start(srv, marker, count=200, name=name)
        next_ok(stream)
        time.sleep(0.3)  # the model waits for the reader by now
        began = time.monotonic()
        srv.stop()
        took = time.monotonic() - began
    assert took < 10, f"stop() took {took:.0f} s"
    assert json.loads(marker.read_text()) == {"cancelled": False, "sent": 200}
    rest = list(stream)
    assert [r.error for r in rest] == [None] * 200 and rest[-1].final
    assert [int(r.outputs["OUT"].to_numpy()[-1]) for r in rest[:-1]] == \
        [i % 256 for i in range(1, 200)]
