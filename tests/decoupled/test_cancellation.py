"""Cancellation at each stage, in real stubs: a request cancelled while queued never reaches
execute; one cancelled while its execute runs, or after execute returned and a thread still
streams, sees ``request.is_cancelled()`` and ``response_sender.is_cancelled()`` turn True; the
in-process API (sync stream ``cancel()``, or an asyncio consumer being cancelled) cancels; a
BLS caller's ``cancel()`` on its decoupled iterator (exec and async_exec) cancels the target's
request. The caller always gets a final CANCELLED response at once.

``cancel_poll`` records what each request saw (by request id) and every request id it
executed; its 'report' mode returns that record.
"""
from __future__ import annotations

import asyncio
import pathlib
import queue
from collections.abc import Iterator

import numpy as np
import pytest

import tritonpy
from _bls_models import DECOUPLED_REPO, collect, new_prefix, serve, text

MODELS = ["cancel_poll", "bls_cancel", "bls_cancel_async"]
WAIT_S = 15.0


@pytest.fixture(scope="module")
def server() -> Iterator[tritonpy.Server]:
    with serve(DECOUPLED_REPO, new_prefix(), model_control_mode="explicit",
               load_models=MODELS) as srv:
        yield srv


def start(server, mode: str, rid: str, **params):
    return server.model("cancel_poll").infer({"IN": np.array([0], np.int32)}, request_id=rid,
                                             parameters={"mode": mode, **params})


def report(server) -> dict:
    (resp,) = collect(start(server, "report", "report"), WAIT_S)
    return text(resp, "REPORT")


def next_response(stream, timeout: float = WAIT_S):
    try:
        return stream.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"no response within {timeout} s") from None


def assert_cancelled(resp) -> None:
    assert resp.final, resp
    assert resp.error is not None and resp.error.code.value == "CANCELLED", resp.error


@pytest.mark.parametrize("mode", ["poll", "poll_thread"])
def test_in_process_cancel_reaches_the_model(server, mode):
    # poll: the model polls inside execute; poll_thread: execute has returned and a thread of
    # the model polls (the request must stay cancellable until its stream ends).
    rid = f"api-{mode}"
    stream = start(server, mode, rid)
    first = next_response(stream)
    assert first.error is None and not first.final
    stream.cancel()
    assert_cancelled(next_response(stream))  # at once, whatever the model does next
    seen = report(server)["seen"][rid]
    assert seen["cancelled"] is True
    assert seen["sender_cancelled"] is True


def test_a_request_that_is_not_cancelled_reads_false(server):
    # The flag is not simply always True.
    (resp,) = collect(start(server, "check", "not-cancelled"), WAIT_S)
    assert resp.error is None and int(resp.outputs["OUT"].to_numpy()[0]) == 2
    seen = report(server)["seen"]["not-cancelled"]
    assert seen == {"cancelled": False, "sender_cancelled": False}


def test_asyncio_consumer_cancelled_cancels_the_request(server):
    rid = "asyncio"

    async def run() -> None:
        stream = server.model("cancel_poll").async_infer(
            {"IN": np.array([0], np.int32)}, request_id=rid, parameters={"mode": "poll"})

        async def consume() -> None:
            async for _ in stream:
                got_first.set()

        got_first = asyncio.Event()
        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(got_first.wait(), WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    seen = report(server)["seen"][rid]
    assert seen["cancelled"] is True and seen["sender_cancelled"] is True


def test_request_cancelled_while_queued_never_reaches_execute(server, tmp_path: pathlib.Path):
    gate = tmp_path / "gate"
    try:
        # 'gate' holds the only instance until the gate file exists; 'queued' waits behind it.
        blocker = start(server, "gate", "blocker", path=str(gate))
        queued = start(server, "poll", "queued")
        queued.cancel()
        # Answered at once, while the instance is still busy with the blocker.
        assert_cancelled(next_response(queued))
        with pytest.raises(queue.Empty):
            blocker.get(timeout=0.05)
    finally:
        gate.touch()
    (resp,) = collect(blocker, WAIT_S)
    assert resp.error is None and int(resp.outputs["OUT"].to_numpy()[0]) == 1
    executed = report(server)["executed"]
    assert "blocker" in executed
    assert "queued" not in executed


@pytest.mark.parametrize("caller", ["bls_cancel", "bls_cancel_async"])
def test_bls_iterator_cancel_cancels_the_target_request(server, caller):
    rid = f"from-{caller}"
    (resp,) = collect(server.model(caller).infer({"AFTER": np.array([3], np.int32)},
                                                 parameters={"rid": rid}), WAIT_S)
    got = text(resp, "REPORT")
    # The caller's iterator ends with a CANCELLED response after the cancel() ...
    assert got["ended"] is True
    assert got["received"] >= 3
    assert got["error"] is not None and got["error"]["cancelled"] is True, got
    # ... and the target's request saw is_cancelled() turn True and stopped streaming.
    seen = report(server)["seen"][rid]
    assert seen["cancelled"] is True
    assert seen["sent"] >= 3
