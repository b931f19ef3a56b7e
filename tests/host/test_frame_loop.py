"""Where the host reads its stubs' frames: a loop the caller gives the server (``tritonpy serve``
gives its HTTP/gRPC loop), or a thread of the server's own. Real stubs throughout.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import tritonpy
from _models import fp32, infer, segments, serving, serving_frontends, wait_until, write_model
from tritonpy._loop import new_event_loop
from tritonpy.shm import Cmd

pytestmark = pytest.mark.timeout(90)

# OUT = IN * 2; a negative first value ends the stub process at once, as a crash would.
CRASHY_PY = """
import os
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if x.size and x[0] < 0:
                os._exit(3)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)]))
        return out
"""


@pytest.fixture
def running_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread, as an application serving its own clients has."""
    loop = new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="app-loop", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def frame_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "tritonpy-frames"]


def test_a_server_reads_its_stubs_on_the_loop_it_is_given(
        tmp_path: Path, shm_prefix: str, running_loop: asyncio.AbstractEventLoop) -> None:
    write_model(tmp_path, "crashy", CRASHY_PY)
    before = frame_threads()
    with serving(tmp_path, shm_prefix, loop=running_loop) as server:
        assert frame_threads() == before  # no thread of its own: the given loop reads
        model = server.model("crashy")

        async def concurrent(values: list[float]) -> list[Any]:
            async def one(v: float) -> Any:
                return [r async for r in model.async_infer({"IN": fp32(v, v + 1)})]
            return await asyncio.gather(*(one(v) for v in values))

        answers = asyncio.run_coroutine_threadsafe(
            concurrent([float(v) for v in range(8)]), running_loop).result(30)
        for v, responses in enumerate(answers):
            assert [r.error for r in responses] == [None]
            np.testing.assert_array_equal(responses[0].outputs["OUT"].to_numpy(),
                                          fp32(2 * v, 2 * v + 2))
        # Waiting there for an answer read there could only hang: refused at once.
        async def sync_infer_on_the_loop() -> Any:
            return model.infer({"IN": fp32(1)})
        with pytest.raises(RuntimeError, match="use async_infer|another thread"):
            asyncio.run_coroutine_threadsafe(sync_infer_on_the_loop(), running_loop).result(10)
        # A sync caller in another thread is answered through the same loop.
        answer = infer(model, {"IN": fp32(5)})
        np.testing.assert_array_equal(answer.outputs["OUT"].to_numpy(), fp32(10))

        # The stub dies: its death (read on the given loop) fails the request and the
        # instance is restarted.
        crashed = infer(model, {"IN": fp32(-1)})
        assert crashed.error is not None and "exited with code 3" in crashed.error.message

        def served() -> bool:
            r = infer(model, {"IN": fp32(3)})
            return r.error is None and r.outputs["OUT"].to_numpy().tolist() == [6.0]
        wait_until(served, 30, "the restarted stub to serve")
    # serving() checked that no stub process or segment is left.


def test_waiting_for_a_stub_on_the_loop_that_reads_it_fails_at_once(
        tmp_path: Path, shm_prefix: str) -> None:
    # The answer would be read on that very loop: waiting there could only hang.
    write_model(tmp_path, "crashy", CRASHY_PY)
    write_model(tmp_path, "gated", CRASHY_PY.replace(
        "    def execute", "    def is_ready(self):\n        return True\n\n    def execute"))
    with serving(tmp_path, shm_prefix) as server:
        stub = server.runtime("crashy", -1).instances[0].stub
        assert stub.call(Cmd.PING, None, 10)["ok"]  # from any other thread it works

        async def ping_on_the_frame_loop() -> Any:
            return stub.call(Cmd.PING, None, 30)

        t0 = time.monotonic()
        fut = asyncio.run_coroutine_threadsafe(ping_on_the_frame_loop(), server.frames.loop)
        with pytest.raises(RuntimeError, match="would wait for itself"):
            fut.result(10)
        assert time.monotonic() - t0 < 5
        # Nor does asking readiness there answer "not ready" as if the stub had said so.
        gated = server.runtime("gated", -1)

        async def ready_on_the_frame_loop() -> Any:
            return gated.ready()

        fut = asyncio.run_coroutine_threadsafe(ready_on_the_frame_loop(), server.frames.loop)
        with pytest.raises(RuntimeError, match="would wait for itself"):
            fut.result(10)
        assert server.model("gated").ready()  # from any other thread: asked of the stub
        answer = infer(server.model("crashy"), {"IN": fp32(1)})
        np.testing.assert_array_equal(answer.outputs["OUT"].to_numpy(), fp32(2))


def test_starting_a_server_on_the_loop_it_reads_on_is_refused(
        tmp_path: Path, shm_prefix: str, running_loop: asyncio.AbstractEventLoop) -> None:
    # start() waits for the stubs' first answers, which only that loop could read.
    write_model(tmp_path, "crashy", CRASHY_PY)
    server = tritonpy.Server(str(tmp_path), loop=running_loop,
                             backend_config={"shm-region-prefix-name": shm_prefix})

    async def start_on_the_loop() -> Any:
        return server.start()
    with pytest.raises(RuntimeError, match="start\\(\\) waits for the stubs"):
        asyncio.run_coroutine_threadsafe(start_on_the_loop(), running_loop).result(10)
    assert segments(shm_prefix) == []  # nothing was started

    async def start_beside_the_loop() -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, server.start)
    asyncio.run_coroutine_threadsafe(start_beside_the_loop(), running_loop).result(60)
    try:
        answer = infer(server.model("crashy"), {"IN": fp32(2)})
        np.testing.assert_array_equal(answer.outputs["OUT"].to_numpy(), fp32(4))
    finally:
        server.stop()
    assert segments(shm_prefix) == []


def test_a_frame_loop_that_runs_nothing_is_logged_with_where_it_is_stuck(
        tmp_path: Path, shm_prefix: str, running_loop: asyncio.AbstractEventLoop,
        caplog: pytest.LogCaptureFixture) -> None:
    # Every stub's answers (and, under tritonpy serve, every HTTP and gRPC request) wait while
    # that loop is stuck: the server says so, and where, rather than going silent.
    write_model(tmp_path, "crashy", CRASHY_PY)
    with serving(tmp_path, shm_prefix, loop=running_loop,
                 backend_config={"loop-stall-seconds": "1"}) as server:
        model = server.model("crashy")
        assert infer(model, {"IN": fp32(1)}).error is None
        caplog.set_level(logging.WARNING, logger="tritonpy._loop")
        release = threading.Event()

        def a_callback_that_blocks_the_loop() -> None:
            release.wait(20)

        running_loop.call_soon_threadsafe(a_callback_that_blocks_the_loop)
        try:
            wait_until(lambda: any("has run nothing for" in r.message for r in caplog.records),
                       10, "the stall to be logged")
        finally:
            release.set()
        stalled = [r for r in caplog.records if "has run nothing for" in r.message]
        assert len(stalled) == 1 and stalled[0].levelno == logging.ERROR
        assert "a_callback_that_blocks_the_loop" in stalled[0].message  # where it is stuck
        wait_until(lambda: any("runs again, after" in r.message for r in caplog.records),
                   10, "the recovery to be logged")
        answer = infer(model, {"IN": fp32(2)})
        assert answer.error is None and answer.outputs["OUT"].to_numpy().tolist() == [4.0]


@pytest.mark.parametrize("value, message", [
    ("-1", "loop-stall-seconds must be >= 0, got -1"),
    ("long", "backend option 'loop-stall-seconds' expects a number, got 'long'"),
])
def test_a_bad_loop_stall_option_is_refused(tmp_path: Path, value: str, message: str) -> None:
    with pytest.raises(tritonpy.InvalidArgumentError, match=message):
        tritonpy.Server(str(tmp_path), backend_config={"loop-stall-seconds": value})


def test_a_failing_maintenance_tick_is_logged_and_the_next_one_runs(
        tmp_path: Path, shm_prefix: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The thread that watches the loop and gives idle segments back must not end in silence
    # on one error (fault injected into the real pool's reap).
    with serving(tmp_path, shm_prefix) as server:
        calls: list[bool] = []
        real = server.pool.reap

        def reap(force: bool) -> Any:
            calls.append(force)
            if len(calls) == 1:
                raise OSError("injected: /dev/shm went away")
            return real(force)

        monkeypatch.setattr(server.pool, "reap", reap)
        wait_until(lambda: len(calls) >= 2, 10, "the tick after the failing one")
    failed = [r for r in caplog.records if r.getMessage() == "server maintenance failed"]
    assert len(failed) == 1 and "injected" in (failed[0].exc_text or "")


def test_the_frontends_own_loop_is_watched_too(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    # Frontends.start_in_thread (an embedder's HTTP/gRPC on a loop of their own): a stall there
    # stops every HTTP and gRPC request, and is reported as the frame loop's is.
    write_model(tmp_path, "crashy", CRASHY_PY)
    with serving_frontends(tmp_path, backend_config={"loop-stall-seconds": "1"}) as (server, fe):
        caplog.set_level(logging.WARNING, logger="tritonpy._loop")
        release = threading.Event()

        def a_handler_that_blocks_the_frontends() -> None:
            release.wait(20)

        fe._loop.call_soon_threadsafe(a_handler_that_blocks_the_frontends)
        try:
            wait_until(lambda: any("has run nothing" in r.getMessage() for r in caplog.records),
                       10, "the stall to be logged")
        finally:
            release.set()
        wait_until(lambda: any("runs again" in r.getMessage() for r in caplog.records), 10,
                   "its end to be logged")
        ready = urllib.request.urlopen(f"http://127.0.0.1:{fe.http_port}/v2/health/ready",
                                       timeout=10)
        assert ready.status == 200
    stalled = [r.getMessage() for r in caplog.records if "has run nothing" in r.getMessage()]
    assert len(stalled) == 1
    assert stalled[0].startswith("the event loop of the HTTP and gRPC frontends has run nothing")
    assert "a_handler_that_blocks_the_frontends" in stalled[0]
    assert server._loop_watches == []  # the frontends stopped: no longer watched


STREAM_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] } ]
"""
# COUNT responses of 1 MiB, until the request is cancelled, then the final flag.
STREAM_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(count):
                if request.is_cancelled():
                    break
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT", np.full(1 << 20, i % 256, np.uint8))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
STREAM_ENSEMBLE = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] } ]
ensemble_scheduling { step [ { model_name: "stream" model_version: -1
  input_map { key: "COUNT" value: "COUNT" } output_map { key: "OUT" value: "OUT" } } ] }
"""


def test_a_stream_cancelled_for_its_unread_responses_on_the_frame_loop(
        tmp_path: Path, shm_prefix: str, running_loop: asyncio.AbstractEventLoop,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``async_infer`` consumer on the loop that reads the stubs lets too much of a
    decoupled ensemble's stream wait (its pacing out of the way here): the request is
    cancelled, the consumer gets what waited and then the error, and the loop goes on. The
    cancel used to come from inside the ensemble's delivery, which holds the request's lock
    that the cancel takes: the loop waited on it for ever, and every stub's answers with it."""
    from tritonpy import _request

    monkeypatch.setattr(_request, "HOLD_BYTES", 1 << 40)  # no pacing
    monkeypatch.setattr(_request, "MAX_WAITING_BYTES", 4 << 20)
    monkeypatch.setattr(_request, "_HARD", 1)  # past 4 MiB waiting: cancelled at once
    write_model(tmp_path, "stream", STREAM_PY, STREAM_CONFIG)
    write_model(tmp_path, "stream_ensemble", "", STREAM_ENSEMBLE)
    server = tritonpy.Server(str(tmp_path), loop=running_loop,
                             backend_config={"shm-region-prefix-name": shm_prefix})
    server.start()
    try:
        async def read_late() -> tuple[int, str]:
            stream = server.model("stream_ensemble").async_infer(
                {"COUNT": np.array([200], np.int32)})
            await asyncio.sleep(1.0)  # reads nothing meanwhile
            taken, error = 0, ""
            async for resp in stream:
                if resp.error is not None:
                    error = resp.error.message
                    break
                taken += 1
            return taken, error

        taken, error = asyncio.run_coroutine_threadsafe(read_late(), running_loop).result(30)
        assert "the client did not read its responses" in error, error
        assert 1 <= taken < 200, taken
        answer = infer(server.model("stream_ensemble"), {"COUNT": np.array([2], np.int32)})
        assert answer.error is None  # (the first of its responses: the loop still reads)
    finally:
        server.stop()
    assert segments(shm_prefix) == []
