"""Request rescheduling: ``request.set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)``
puts the request back for another ``execute``, with ``sequence_batching { iterative_sequence:
true }`` as Triton's docs require.

* ``iterative`` (decoupled) sends COUNT = how many times this request has been executed, on
  every execute, and reschedules until COUNT reaches N; then closes the stream.
* ``iterative_default`` (default mode) appends ``None`` for a rescheduled request, as the docs
  say, and answers once, on the N-th execute, with COUNT = N.

As in Triton, an iterative-sequence request needs no correlation ID (each such request is a
sequence of its own); one with a correlation ID and START/END works too.
"""
from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tritonpy
from _bls_models import DECOUPLED_REPO, collect, new_prefix, serve

WAIT_S = 15.0
START = 1  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
START_END = 3  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START | _END


@pytest.fixture(scope="module")
def server() -> Iterator[tritonpy.Server]:
    with serve(DECOUPLED_REPO, new_prefix(), model_control_mode="explicit",
               load_models=["iterative", "iterative_default"]) as srv:
        yield srv


def counts(responses: list) -> list[int]:
    for r in responses:
        assert r.error is None, r.error
    return [int(r.outputs["COUNT"].to_numpy()[0]) for r in responses if r.outputs]


def infer(server, model: str, n: int, rid: str, **kwargs):
    return server.model(model).infer({"N": np.array([n], np.int32)}, request_id=rid, **kwargs)


@pytest.mark.parametrize("n", [1, 4])
def test_decoupled_request_is_executed_again_until_released(server, n):
    responses = collect(infer(server, "iterative", n, f"dec-{n}"), WAIT_S)
    assert counts(responses) == list(range(1, n + 1))
    assert [r.final for r in responses] == [False] * n + [True]


def test_decoupled_with_correlation_id_and_flags(server):
    responses = collect(infer(server, "iterative", 3, "dec-corr", correlation_id=77,
                              flags=START_END), WAIT_S)
    assert counts(responses) == [1, 2, 3]


def _seen(responses: list) -> list[tuple[str, int]]:
    return [(r.parameters["cid"], r.parameters["flags"]) for r in responses if r.outputs]


def test_a_request_without_correlation_id_gets_its_own_id_and_start(server):
    # As Triton's iterative sequencer: a new ID per request (1, 2, ... per model) and the START
    # flag; a rescheduled request comes back with neither START nor END.
    first = _seen(collect(infer(server, "iterative", 3, "ids-1"), WAIT_S))
    second = _seen(collect(infer(server, "iterative", 2, "ids-2"), WAIT_S))
    for seen in (first, second):
        cid = seen[0][0]
        assert int(cid) > 0
        assert seen == [(cid, START)] + [(cid, 0)] * (len(seen) - 1)
    assert first[0][0] != second[0][0]
    with_id = _seen(collect(infer(server, "iterative", 3, "ids-3", correlation_id=78,
                                  flags=START_END), WAIT_S))
    assert with_id == [("78", START_END), ("78", 0), ("78", 0)]


def test_an_iterative_sequence_ends_with_its_request(server):
    # START without END: released without RESCHEDULE, the sequence is over (Triton ends it),
    # so the ID needs a new START.
    assert counts(collect(infer(server, "iterative", 2, "end-1", correlation_id=79,
                                flags=START), WAIT_S)) == [1, 2]
    late = collect(infer(server, "iterative", 1, "end-2", correlation_id=79), WAIT_S)
    assert len(late) == 1 and late[0].error is not None  # never run
    # The final response may reach the client before its request is released (on Triton
    # too): a request sent in between is cancelled with the sequence, one sent after needs
    # START.
    assert late[0].error.message in (
        "inference request for sequence 79 to model 'iterative' must specify the START flag "
        "on the first request of the sequence",
        "iterative sequence 79 ended: its request was released without RESCHEDULE")
    assert counts(collect(infer(server, "iterative", 1, "end-3", correlation_id=79,
                                flags=START), WAIT_S)) == [1]


@pytest.mark.parametrize("n", [1, 3])
def test_default_mode_rescheduled_request_answers_once(server, n):
    responses = collect(infer(server, "iterative_default", n, f"def-{n}"), WAIT_S)
    assert len(responses) == 1 and responses[0].final
    assert counts(responses) == [n]  # executed n times, answered on the last


def test_response_returned_for_a_rescheduled_request_is_an_error_not_a_loop(server):
    # Triton fails such an execute; answering and running it again would loop for ever. Its
    # words, "reschduled" included (Triton's QA test_wrong_return_type looks for them).
    responses = collect(infer(server, "iterative_default", -1, "wrong-return"), WAIT_S)
    assert len(responses) == 1 and responses[0].final
    err = responses[0].error
    assert err is not None and "Expected a None object" in err.message
    assert err.message == (
        "Failed to process the request(s) for model 'iterative_default_0_0', message: Expected "
        "a None object in the execute function return list for reschduled request, found "
        "type '<class 'tritonpy.stub.pb_utils.InferenceResponse'>'.")
    again = collect(infer(server, "iterative_default", 2, "after-wrong"), WAIT_S)
    assert counts(again) == [2]


def test_concurrent_iterative_requests_each_complete(server):
    streams = {rid: infer(server, "iterative", n, rid) for rid, n in
               (("a", 3), ("b", 2), ("c", 4))}
    defaults = {rid: infer(server, "iterative_default", n, rid) for rid, n in
                (("x", 2), ("y", 5))}
    assert counts(collect(streams["a"], WAIT_S)) == [1, 2, 3]
    assert counts(collect(streams["b"], WAIT_S)) == [1, 2]
    assert counts(collect(streams["c"], WAIT_S)) == [1, 2, 3, 4]
    assert counts(collect(defaults["x"], WAIT_S)) == [2]
    assert counts(collect(defaults["y"], WAIT_S)) == [5]


def test_cancelled_between_executes_is_not_rescheduled_again(server):
    # A request that would reschedule itself a million times is cancelled after 3 executes.
    # It must leave the instance: the model has one sequence slot, so a request behind it
    # only completes if the cancelled one is not put back again.
    endless = infer(server, "iterative", 1_000_000, "endless")
    for i in range(1, 4):
        try:
            resp = endless.get(timeout=WAIT_S)
        except queue.Empty:
            raise AssertionError(f"response {i} did not come") from None
        assert counts([resp]) and not resp.final
    endless.cancel()
    last = None
    while last is None or not last.final:  # responses already on their way, then CANCELLED
        last = endless.get(timeout=WAIT_S)
    assert last.error is not None and last.error.code.value == "CANCELLED"
    assert counts(collect(infer(server, "iterative", 2, "after-endless"), WAIT_S)) == [1, 2]
    # And the host holds nothing for it any more (an unload would otherwise wait for it).
    (inst,) = server.runtime("iterative").instances
    deadline = time.monotonic() + WAIT_S
    while inst.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not inst.active, inst.active


@pytest.fixture(scope="module")
def threaded() -> Iterator[tritonpy.Server]:
    with serve(DECOUPLED_REPO, new_prefix(), model_control_mode="explicit",
               load_models=["iterative_thread"]) as srv:
        yield srv


def test_sender_of_a_run_before_a_reschedule_answers_from_a_thread(threaded):
    # As Triton's (its QA test_process_request_in_different_thread): the first execute hands
    # its sender to a thread and reschedules; the second lets go of the request. The request
    # stays open for the thread's responses, not ended as let go of.
    responses = collect(threaded.model("iterative_thread").infer(
        {"N": np.array([2], np.int32)}, request_id="thread-2"), WAIT_S)
    assert counts(responses) == [1, 2]
    assert [r.final for r in responses] == [False, False, True]
    # The next request is served the same way.
    assert counts(collect(threaded.model("iterative_thread").infer(
        {"N": np.array([1], np.int32)}, request_id="thread-1"), WAIT_S)) == [1]


def test_cancel_reaches_the_sender_of_a_run_before_a_reschedule(threaded):
    # The thread waits for is_cancelled() on the first run's sender, then sends its final
    # flag: the host holds the request until then.
    stream = threaded.model("iterative_thread").infer(
        {"N": np.array([0], np.int32)}, request_id="thread-cancel")
    (inst,) = threaded.runtime("iterative_thread").instances
    deadline = time.monotonic() + WAIT_S
    while not inst.active and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # the second execute is over and the thread waits for the cancel
    assert inst.active
    stream.cancel()
    last = collect(stream, WAIT_S)[-1]
    assert last.error is not None and last.error.code.value == "CANCELLED"
    deadline = time.monotonic() + 5.0
    while inst.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not inst.active, inst.active


REFUSED = ("Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE while the model "
           "is not configured to handle such a flag.")


@pytest.fixture(scope="module")
def not_iterative(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tritonpy.Server]:
    """The same models under schedulers that do not take a request back."""
    repo = tmp_path_factory.mktemp("not_iterative")
    schedulers = {"plain": "", "dynamic": "dynamic_batching { }",
                  "direct": "sequence_batching { direct { } iterative_sequence: false }",
                  "oldest": "sequence_batching { oldest { } }"}
    for source in ("iterative", "iterative_default"):
        cfg = Path(DECOUPLED_REPO, source, "config.pbtxt").read_text()
        code = Path(DECOUPLED_REPO, source, "1", "model.py").read_text()
        for kind, scheduler in schedulers.items():
            name = f"{source}_{kind}"
            (repo / name / "1").mkdir(parents=True)
            (repo / name / "1" / "model.py").write_text(code)
            (repo / name / "config.pbtxt").write_text(
                cfg.replace(f'name: "{source}"', f'name: "{name}"')
                .replace("sequence_batching { iterative_sequence: true }", scheduler))
    with serve(str(repo), new_prefix()) as srv:
        yield srv


@pytest.mark.parametrize("kind", ["plain", "dynamic", "direct", "oldest"])
def test_a_reschedule_the_scheduler_cannot_take_ends_the_request_in_tritons_words(
        not_iterative, kind):
    # Triton 2.51 logs this and leaves the client waiting for ever (measured; upstream's
    # test_unsupported_*_scheduler expect the error). The responses sent before it stay.
    flags = {"direct": START_END, "oldest": START_END}.get(kind, 0)
    cid = {"direct": 91, "oldest": 92}.get(kind, 0)
    responses = collect(not_iterative.model(f"iterative_{kind}").infer(
        {"N": np.array([3], np.int32)}, request_id=f"refused-{kind}", correlation_id=cid,
        flags=flags), WAIT_S)
    assert [int(r.outputs["COUNT"].to_numpy()[0]) for r in responses if r.outputs] == [1]
    last = responses[-1]
    assert last.final and last.error is not None
    assert last.error.code.value == "INVALID_ARG" and last.error.message == REFUSED
    # Default mode: the request that appended None for its reschedule gets the error.
    (answer,) = collect(not_iterative.model(f"iterative_default_{kind}").infer(
        {"N": np.array([3], np.int32)}, request_id=f"refused-default-{kind}",
        correlation_id=cid + 100 if cid else 0, flags=flags), WAIT_S)
    assert answer.final and answer.error is not None and answer.error.message == REFUSED
    # Nothing is left in flight; the model serves on.
    for model in (f"iterative_{kind}", f"iterative_default_{kind}"):
        (inst,) = not_iterative.runtime(model).instances
        assert not inst.active
    assert counts(collect(not_iterative.model(f"iterative_{kind}").infer(
        {"N": np.array([1], np.int32)}, request_id=f"after-{kind}", correlation_id=cid,
        flags=flags), WAIT_S)) == [1]
