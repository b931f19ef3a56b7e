"""Sequence batching with real stubs: correlation IDs (int and string), START/END flags, the
control inputs a model receives, the direct and oldest strategies, idle sequences ended, Triton's
errors for requests outside a sequence, and stateful models driven from BLS.
"""
from __future__ import annotations

import json
import queue
import time

import numpy as np
import pytest
from _models import io_config, new_prefix, serving, write_model
from _sched_models import ALL_CONTROLS, SEQ_BLS_PY, SEQ_PY, Gate, controls, params, seq_config

pytestmark = pytest.mark.timeout(90)

START, END = 1, 2

MODELS = {
    "seq_int": seq_config(controls=ALL_CONTROLS.replace("CORRID_TYPE", "TYPE_UINT64")),
    "seq_str": seq_config(controls=ALL_CONTROLS.replace("CORRID_TYPE", "TYPE_STRING"),
                          max_batch_size=2),
    "seq_any": seq_config(),
    "seq_two": seq_config(instances=2),
    "seq_direct": seq_config(max_batch_size=2),
    "seq_direct_slots": seq_config(controls=ALL_CONTROLS.replace("CORRID_TYPE", "TYPE_UINT64"),
                                   max_batch_size=4),
    "seq_oldest": seq_config("oldest { max_candidate_sequences: 4 }", max_batch_size=4),
    "seq_oldest_pref": seq_config("oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2 ] "
                                  "max_queue_delay_microseconds: 30000000 }", max_batch_size=4),
    "seq_idle": seq_config(idle_us=300_000),
    "seq_oldest_ready": seq_config("oldest { max_candidate_sequences: 2 preferred_batch_size: "
                                   "[ 2 ] max_queue_delay_microseconds: 1000000 }",
                                   max_batch_size=2),
    "seq_oldest_backlog": seq_config("oldest { max_candidate_sequences: 3 }", max_batch_size=4),
    "seq_cancel": seq_config(),
    "seq_cancel_backlog": seq_config(),
    "seq_timeout": seq_config(),
    **{f"seq_{t.lower()}": seq_config(controls=ALL_CONTROLS.replace("CORRID_TYPE", f"TYPE_{t}"))
       for t in ("INT32", "UINT32", "INT64")},
    "seq_direct_shapes": seq_config(max_batch_size=2, dims="[ -1 ]"),
    "seq_direct_ragged": seq_config(max_batch_size=4, dims="[ -1 ]"),
    "seq_direct_reuse": seq_config(max_batch_size=4),
    "seq_oldest_shapes": seq_config("oldest { max_candidate_sequences: 4 }", max_batch_size=4,
                                    dims="[ -1 ]"),
    "seq_bls": io_config(),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for name, cfg in MODELS.items():
        write_model(repo, name, SEQ_BLS_PY if name == "seq_bls" else SEQ_PY, cfg)
    with serving(repo, new_prefix()) as srv:
        yield srv


@pytest.fixture
def gate(tmp_path):
    with Gate(tmp_path) as g:
        yield g


def _x(v: float, batched: bool = False) -> np.ndarray:
    return np.array([[v]] if batched else [v], dtype=np.float32)


def _send(server, model, v, cid, flags=0, batched=False, **kw):
    return server.model(model).infer({"IN": _x(v, batched)}, correlation_id=cid, flags=flags,
                                     **kw)


def _run(server, model, v, cid, flags=0, batched=False, **kw):
    return _send(server, model, v, cid, flags, batched, **kw).get(timeout=30)


def _sum(resp) -> float:
    assert resp.error is None, resp.error
    return float(resp.outputs["OUT"].to_numpy().reshape(-1)[0])


def test_int_sequence_runs_in_order_with_its_controls(server):
    first = _run(server, "seq_int", 1, 42, START)
    mid = _run(server, "seq_int", 2, 42)
    last = _run(server, "seq_int", 3, 42, END)
    assert [_sum(r) for r in (first, mid, last)] == [1, 3, 6]
    assert [params(r)["flags"] for r in (first, mid, last)] == [START, 0, END]
    assert json.loads(params(first)["cid"]) == 42
    assert controls(first) == {"START": [1, "int32", [1]], "END": [0.0, "float32", [1]],
                               "READY": [True, "bool", [1]], "CORRID": [42, "uint64", [1]]}
    assert controls(mid)["START"][0] == 0 and controls(mid)["END"][0] == 0.0
    assert controls(last)["START"][0] == 0 and controls(last)["END"][0] == 1.0
    both = _run(server, "seq_int", 5, 43, START | END)  # a sequence of one request
    assert _sum(both) == 5
    assert (controls(both)["START"][0], controls(both)["END"][0]) == (1, 1.0)


@pytest.mark.parametrize("model, cid, value, dtype", [
    ("seq_int32", 5, 5, "int32"),
    ("seq_int32", 2**32 + 5, 5, "int32"),  # the ID's low bytes, as Triton copies them
    ("seq_int32", 2**32 - 1, -1, "int32"),
    ("seq_uint32", 2**32 + 5, 5, "uint32"),
    ("seq_int64", 2**63 + 1, -(2**63) + 1, "int64"),
    ("seq_int64", 77, 77, "int64"),
])
def test_corrid_control_has_its_configured_type(server, model, cid, value, dtype):
    resp = _run(server, model, 1, cid, START | END)
    assert _sum(resp) == 1
    assert controls(resp)["CORRID"] == [value, dtype, [1]]


def test_string_correlation_ids_keep_sequences_apart(server):
    a1 = _run(server, "seq_str", 1, "alpha", START, batched=True)
    b1 = _run(server, "seq_str", 10, "beta", START, batched=True)
    a2 = _run(server, "seq_str", 2, "alpha", batched=True)
    b2 = _run(server, "seq_str", 20, "beta", END, batched=True)
    a3 = _run(server, "seq_str", 3, "alpha", END, batched=True)
    assert [_sum(r) for r in (a1, a2, a3)] == [1, 3, 6]
    assert [_sum(r) for r in (b1, b2)] == [10, 30]
    assert json.loads(params(a2)["cid"]) == "alpha"
    # A string CORRID control and, with max_batch_size > 0, controls of shape [1, 1].
    assert controls(b1)["CORRID"] == ["beta", "object", [1, 1]]
    assert controls(b1)["START"] == [1, "int32", [1, 1]]


def test_request_without_correlation_id_gets_tritons_error(server):
    resp = server.model("seq_int").infer({"IN": _x(1)}, flags=START).get(timeout=10)
    assert resp.error is not None and resp.error.code.name == "INVALID_ARG"
    assert resp.error.message == ("inference request to model 'seq_int' must specify a non-zero "
                                  "or non-empty correlation ID")
    resp = _run(server, "seq_str", 1, "", START, batched=True)
    assert resp.error is not None and "non-empty correlation ID" in resp.error.message


def test_request_for_unknown_or_ended_sequence_gets_tritons_error(server):
    resp = _run(server, "seq_int", 1, 77)
    assert resp.error is not None and resp.error.code.name == "INVALID_ARG"
    assert resp.error.message == ("inference request for sequence 77 to model 'seq_int' must "
                                  "specify the START flag on the first request of the sequence")
    assert _sum(_run(server, "seq_int", 1, 78, START | END)) == 1
    ended = _run(server, "seq_int", 1, 78)  # its sequence has ended
    assert ended.error is not None and "sequence 78 to model 'seq_int'" in ended.error.message
    resp = _run(server, "seq_str", 1, "ghost", batched=True)
    assert resp.error is not None and resp.error.message == (
        "inference request for sequence ghost to model 'seq_str' must specify the START flag "
        "on the first request of the sequence")


@pytest.mark.parametrize("cid", ["x", 0])  # the batch size is checked first, as in Triton
def test_batched_request_is_refused_by_the_sequence_batcher(server, cid):
    resp = server.model("seq_str").infer({"IN": np.ones((2, 1), np.float32)},
                                         correlation_id=cid, flags=START).get(timeout=10)
    assert resp.error is not None and resp.error.message == (
        "inference request to model 'seq_str' must specify batch-size 1 due to requirements of "
        "sequence batcher")


def test_direct_sequences_stay_on_one_instance_and_wait_for_a_free_slot(server):
    a = [_run(server, "seq_two", 1, 1, START)]
    b = [_run(server, "seq_two", 10, 2, START)]
    for i in range(3):
        a.append(_run(server, "seq_two", 1, 1))
        b.append(_run(server, "seq_two", 10, 2))
    inst_a = {params(r)["instance"] for r in a}
    inst_b = {params(r)["instance"] for r in b}
    assert len(inst_a) == 1 and len(inst_b) == 1 and inst_a != inst_b
    assert [_sum(r) for r in a] == [1, 2, 3, 4]
    # Both instances hold a sequence (one slot each): a third one waits for a slot.
    c = _send(server, "seq_two", 100, 3, START)
    with pytest.raises(queue.Empty):
        c.get(timeout=0.3)
    assert _sum(_run(server, "seq_two", 1, 1, END)) == 5
    c_first = c.get(timeout=30)
    assert _sum(c_first) == 100
    assert {params(c_first)["instance"]} == inst_a  # it took the slot sequence 1 freed
    assert _sum(_run(server, "seq_two", 1, 3, END)) == 101
    assert _sum(_run(server, "seq_two", 10, 2, END)) == 50


def test_direct_batches_one_request_per_slot_in_slot_order(server, gate):
    held = _send(server, "seq_direct", 1, 11, START, batched=True,
                 parameters={"gate": gate.path})
    other = _send(server, "seq_direct", 5, 12, START, batched=True)  # slot 1
    again = _send(server, "seq_direct", 2, 11, batched=True)  # slot 0, queued after
    more = _send(server, "seq_direct", 3, 11, END, batched=True)
    gate.open()
    assert (params(held.get(timeout=30))["batch"]) == 1
    r_other, r_again, r_more = (s.get(timeout=30) for s in (other, again, more))
    assert [_sum(r) for r in (r_again, r_more, r_other)] == [3, 6, 5]
    # One request of each sequence per execute, placed by slot (sequence 11 has slot 0).
    assert (params(r_again)["exec"], params(r_again)["pos"]) == (2, 0)
    assert (params(r_other)["exec"], params(r_other)["pos"]) == (2, 1)
    assert (params(r_more)["exec"], params(r_more)["batch"]) == (3, 1)
    assert _sum(_run(server, "seq_direct", 5, 12, END, batched=True)) == 10


def test_direct_puts_each_request_at_its_slots_place_behind_null_requests(server):
    # QA L0_sequence_batcher: as Triton, a sequence's request sits at its slot's index in the
    # batch, so that a model may keep its state by batch index; the slots below with nothing
    # to send hold null requests (READY false, correlation ID 0). tritonpy used to send the
    # request alone, at index 0, where a model keeping state per index mixed sequences up.
    for cid, flags in ((71, START), (72, START), (73, START)):  # slots 0, 1, 2
        _run(server, "seq_direct_slots", 1, cid, flags, batched=True)
    before = server.statistics("seq_direct_slots")["model_stats"][0]
    got = _run(server, "seq_direct_slots", 5, 73, batched=True)
    assert _sum(got) == 6
    p = params(got)
    assert (p["batch"], p["pos"]) == (3, 2)
    assert json.loads(p["readies"]) == [False, False, True]
    assert json.loads(p["controls"])["READY"][0] is True
    got = _run(server, "seq_direct_slots", 2, 72, END, batched=True)
    assert (params(got)["batch"], params(got)["pos"], _sum(got)) == (2, 1, 3)
    # The nulls count in the executes' batch sizes, not as inferences.
    after = server.statistics("seq_direct_slots")["model_stats"][0]
    assert int(after["inference_count"]) - int(before["inference_count"]) == 2
    assert int(after["execution_count"]) - int(before["execution_count"]) == 2

    def sizes(stats):
        return {b["batch_size"]: int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}

    grown = {k: n - sizes(before).get(k, 0) for k, n in sizes(after).items()}
    assert {k: n for k, n in grown.items() if n} == {3: 1, 2: 1}
    for cid in (71, 73):
        _run(server, "seq_direct_slots", 0, cid, END, batched=True)


def test_oldest_batches_the_ready_sequences_together(server, gate):
    held = _send(server, "seq_oldest", 1, 21, START, batched=True,
                 parameters={"gate": gate.path})
    streams = [_send(server, "seq_oldest", 10 * k, 21 + k, START, batched=True)
               for k in (1, 2, 3)]
    tail = _send(server, "seq_oldest", 2, 21, END, batched=True)
    gate.open()
    assert params(held.get(timeout=30))["batch"] == 1
    resps = [s.get(timeout=30) for s in streams + [tail]]
    assert [_sum(r) for r in resps] == [10, 20, 30, 3]
    # The four sequences share one execute, oldest request first.
    assert [(params(r)["exec"], params(r)["batch"], params(r)["pos"]) for r in resps] == [
        (2, 4, 0), (2, 4, 1), (2, 4, 2), (2, 4, 3)]
    for k in (1, 2, 3):
        assert _sum(_run(server, "seq_oldest", 1, 21 + k, END, batched=True)) == 10 * k + 1


def _wide(server, model, width, cid, flags=0, **kw):
    x = np.full((1, width), float(width), dtype=np.float32)
    return server.model(model).infer({"IN": x}, correlation_id=cid, flags=flags, **kw)


def test_direct_leaves_a_slot_of_another_shape_out_of_the_batch(server, gate):
    # IN has dims [ -1 ]: a batch holds one shape, as Triton's. Sequence 52 (slot 1) is ready
    # beside 51's next request but its width differs, so it waits for the next execute; a
    # null holds its slot in this one (the batch spans the slots with a request ready, as
    # Triton's: measured, QA L0_sequence_batcher's test_ragged_batch).
    held = _wide(server, "seq_direct_shapes", 1, 51, START, parameters={"gate": gate.path})
    other = _wide(server, "seq_direct_shapes", 2, 52, START | END)
    again = _wide(server, "seq_direct_shapes", 1, 51, END)
    gate.open()
    assert params(held.get(timeout=30))["batch"] == 1
    r_again, r_other = again.get(timeout=30), other.get(timeout=30)
    assert (_sum(r_again), _sum(r_other)) == (2, 2)
    assert r_other.outputs["OUT"].to_numpy().shape == (1, 2)
    # Sequence 52 runs next at its slot's place, behind a null request in slot 0 (as Triton).
    assert [(params(r)["exec"], params(r)["batch"], params(r)["pos"])
            for r in (r_again, r_other)] == [(2, 2, 0), (3, 2, 1)]


def test_direct_fills_a_slot_of_another_shape_between_two_that_run(server, gate):
    # QA L0_sequence_batcher's test_ragged_batch: slot 0 sends its last request, slot 1's
    # width differs, slot 2's matches. The null for slot 1 was made from slot 0's request
    # after it had left its queue: IndexError, and the model's requests stopped running.
    held = _wide(server, "seq_direct_ragged", 2, 71, START, parameters={"gate": gate.path})
    last = _wide(server, "seq_direct_ragged", 2, 71, END)
    other = _wide(server, "seq_direct_ragged", 1, 72, START | END)
    third = _wide(server, "seq_direct_ragged", 2, 73, START | END)
    gate.open()
    assert params(held.get(timeout=30))["exec"] == 1
    got = {cid: s.get(timeout=30) for cid, s in ((71, last), (72, other), (73, third))}
    assert {cid: _sum(r) for cid, r in got.items()} == {71: 4, 72: 1, 73: 2}
    # As Triton: [71, null, 73], then 72 at its slot behind a null (71's slot freed with its
    # END batched).
    assert {cid: (params(r)["exec"], params(r)["batch"], params(r)["pos"])
            for cid, r in got.items()} == {71: (2, 3, 0), 73: (2, 3, 2), 72: (3, 2, 1)}


def test_direct_frees_a_slot_once_its_end_is_batched(server, gate):
    # As Triton 2.51 (measured: batch sizes 1 then 3): the sequences that arrive while the
    # END of the one in slot 0 runs take slots 0, 1 and 2, and run together with no null.
    held = _wide(server, "seq_direct_reuse", 1, 2001, START | END,
                 parameters={"gate": gate.path})
    wait_for_execute = time.monotonic() + 10
    while not server.runtime("seq_direct_reuse").instances[0].active:
        assert time.monotonic() < wait_for_execute
        time.sleep(0.01)
    streams = [_wide(server, "seq_direct_reuse", 1, cid, START | END) for cid in (2002, 2003, 2004)]
    gate.open()
    assert params(held.get(timeout=30))["batch"] == 1
    got = [params(s.get(timeout=30)) for s in streams]
    assert [(p["exec"], p["batch"], p["pos"]) for p in got] == [(2, 3, 0), (2, 3, 1), (2, 3, 2)]
    stats = server.statistics("seq_direct_reuse")["model_stats"][0]
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [
        (1, 1), (3, 1)]


def test_oldest_ends_the_batch_at_a_sequence_of_another_shape(server, gate):
    held = _wide(server, "seq_oldest_shapes", 1, 61, START | END, parameters={"gate": gate.path})
    streams = [_wide(server, "seq_oldest_shapes", w, cid, START | END)
               for w, cid in ((1, 62), (1, 63), (2, 64), (1, 65))]
    gate.open()
    assert params(held.get(timeout=30))["batch"] == 1
    resps = [s.get(timeout=30) for s in streams]
    assert [_sum(r) for r in resps] == [1, 1, 2, 1]
    assert [(params(r)["exec"], params(r)["batch"]) for r in resps] == [
        (2, 2), (2, 2), (3, 1), (4, 1)]


def test_oldest_counts_the_delay_from_when_a_request_became_its_sequences_next(server, gate):
    # As Triton's: A2 waits behind A1 (its own sequence) for 1.3 s, longer than the 1 s delay,
    # yet once A1 is done it still waits its delay for a partner (B1) instead of going alone.
    first = _send(server, "seq_oldest_ready", 1, 51, START, batched=True,
                  parameters={"gate": gate.path})
    partner = _send(server, "seq_oldest_ready", 7, 52, START | END, batched=True)
    second = _send(server, "seq_oldest_ready", 2, 51, END, batched=True)  # queued behind A1
    time.sleep(1.3)
    gate.open()
    assert [params(r.get(timeout=30))["batch"] for r in (first, partner)] == [2, 2]
    time.sleep(0.3)
    late = _send(server, "seq_oldest_ready", 5, 53, START | END, batched=True)
    r_second, r_late = second.get(timeout=30), late.get(timeout=30)
    assert (_sum(r_second), _sum(r_late)) == (3, 5)
    assert [(params(r)["exec"], params(r)["batch"]) for r in (r_second, r_late)] == [
        (2, 2), (2, 2)]


def test_oldest_queues_a_backlogged_sequence_from_when_it_gets_a_slot(server, gate):
    # As Triton 2.51 (measured): D waits for a slot (3 candidates: A, B, C); it gets A's
    # when A ends, so D1 joins the batcher after B2 and C2, which became ready as their
    # sequences' previous requests finished, though D1 arrived before them.
    m = "seq_oldest_backlog"
    held = _send(server, m, 1, 81, START, batched=True, parameters={"gate": gate.path})
    firsts = [_send(server, m, 10, cid, START, batched=True) for cid in (82, 83, 84)]
    ends = [_send(server, m, 1, cid, END, batched=True) for cid in (81, 82, 83, 84)]
    gate.open()
    assert params(held.get(timeout=30))["batch"] == 1
    seen = {}
    for cid, stream in zip((82, 83, 84, 81, 82, 83, 84), firsts + ends):
        p = params(stream.get(timeout=30))
        seen.setdefault(p["exec"], []).append((p["pos"], cid))
    assert [[cid for _, cid in sorted(seen[e])] for e in sorted(seen)] == [
        [82, 83, 81], [82, 83, 84], [84]]


def test_oldest_waits_its_queue_delay_for_a_preferred_batch(server):
    # A lone sequence request waits (30 s delay, preferred size 2) for a second sequence, and
    # the pair goes at once when it arrives.
    a = _send(server, "seq_oldest_pref", 1, 41, START, batched=True)
    b = _send(server, "seq_oldest_pref", 2, 42, START, batched=True)
    ra, rb = a.get(timeout=20), b.get(timeout=20)
    assert (_sum(ra), _sum(rb)) == (1, 2)
    assert [(params(r)["exec"], params(r)["batch"]) for r in (ra, rb)] == [(1, 2), (1, 2)]
    ends = [_send(server, "seq_oldest_pref", 1, cid, END, batched=True) for cid in (41, 42)]
    assert [_sum(e.get(timeout=20)) for e in ends] == [2, 3]


def test_idle_sequence_is_ended_and_its_slot_reused(server):
    assert _sum(_run(server, "seq_idle", 1, 31, START)) == 1
    # The only slot is taken: sequence 32 waits until 31 has been idle for 300 ms.
    waiting = _send(server, "seq_idle", 7, 32, START)
    assert _sum(waiting.get(timeout=30)) == 7
    late = _run(server, "seq_idle", 1, 31)
    assert late.error is not None and late.error.message == (
        "inference request for sequence 31 to model 'seq_idle' must specify the START flag on "
        "the first request of the sequence")
    assert _sum(_run(server, "seq_idle", 1, 32, END)) == 8


def _needs_start(resp, cid, model):
    assert resp.error is not None and resp.error.code.name == "INVALID_ARG"
    assert resp.error.message == (
        f"inference request for sequence {cid} to model '{model}' must specify the START flag "
        "on the first request of the sequence")


def test_a_cancelled_queued_request_ends_its_sequence(server, gate):
    # As Triton: the model never sees the sequence go on without the cancelled step; what was
    # queued behind it is cancelled too, and the ID needs a new START.
    held = _send(server, "seq_cancel", 1, 71, START, parameters={"gate": gate.path})
    cancelled = _send(server, "seq_cancel", 10, 71)
    behind = _send(server, "seq_cancel", 100, 71)
    cancelled.cancel()
    gate.open()
    assert _sum(held.get(timeout=30)) == 1
    assert cancelled.get(timeout=30).error.code.name == "CANCELLED"
    resp = behind.get(timeout=30)
    assert resp.error is not None and resp.error.code.name == "CANCELLED"
    assert resp.error.message == (
        "sequence 71 was cancelled: a request of it was cancelled before it ran")
    _needs_start(_run(server, "seq_cancel", 1000, 71, END), 71, "seq_cancel")
    assert _sum(_run(server, "seq_cancel", 5, 71, START | END)) == 5
    stats = server.statistics("seq_cancel")["model_stats"][0]["inference_stats"]
    assert stats["fail"]["count"] == 2


def test_a_backlogged_sequence_whose_start_is_cancelled_never_runs(server, gate):
    held = _send(server, "seq_cancel_backlog", 1, 81, START | END,
                 parameters={"gate": gate.path})  # holds the only slot
    start = _send(server, "seq_cancel_backlog", 10, 82, START)  # backlogged
    second = _send(server, "seq_cancel_backlog", 20, 82)
    start.cancel()
    # Ended at once, while the slot is still held: no slot would come to end it.
    assert start.get(timeout=30).error.code.name == "CANCELLED"
    assert second.get(timeout=10).error.code.name == "CANCELLED"
    _needs_start(_run(server, "seq_cancel_backlog", 30, 82, END), 82, "seq_cancel_backlog")
    gate.open()
    assert _sum(held.get(timeout=30)) == 1


def test_a_backlogged_sequence_whose_start_times_out_ends_at_once(server, gate):
    # As Triton 2.51 (measured): the START that timed out waiting for a slot is answered in
    # Triton's words, and the sequence is over at once: what is queued behind it too, and its
    # next request is refused for want of START. Those waited for the slot, then failed.
    held = _send(server, "seq_cancel_backlog", 1, 83, START,
                 parameters={"gate": gate.path})  # holds the only slot (no END yet)
    start = _send(server, "seq_cancel_backlog", 10, 84, START, timeout=200_000)
    behind = _send(server, "seq_cancel_backlog", 20, 84)
    for resp in (start.get(timeout=30), behind.get(timeout=10)):  # the slot is still held
        assert resp.error is not None and (resp.error.code.name, resp.error.message) == (
            "UNAVAILABLE", "timeout of the corresponding sequence has been expired")
    _needs_start(_run(server, "seq_cancel_backlog", 30, 84), 84, "seq_cancel_backlog")
    gate.open()
    assert _sum(held.get(timeout=30)) == 1
    assert _sum(_run(server, "seq_cancel_backlog", 2, 83, END)) == 3
    assert _sum(_run(server, "seq_cancel_backlog", 5, 84, START | END)) == 5


def test_a_queued_request_that_times_out_ends_its_sequence(server, gate):
    held = _send(server, "seq_timeout", 1, 91, START, parameters={"gate": gate.path})
    late = _send(server, "seq_timeout", 10, 91, timeout=200_000)
    behind = _send(server, "seq_timeout", 100, 91)
    resp = late.get(timeout=30)  # while the gate is still closed
    assert (resp.error.code.name, resp.error.message) == ("UNAVAILABLE", "Request timeout expired")
    gate.open()
    assert _sum(held.get(timeout=30)) == 1
    resp = behind.get(timeout=30)
    assert resp.error is not None and (resp.error.code.name, resp.error.message) == (
        "UNAVAILABLE", "timeout of the corresponding sequence has been expired")
    _needs_start(_run(server, "seq_timeout", 1000, 91, END), 91, "seq_timeout")


@pytest.mark.parametrize("cid,target", [(55, "seq_int"), ("bls-seq", "seq_any")])
def test_bls_drives_a_stateful_model(server, cid, target):
    resp = server.model("seq_bls").infer(
        {"IN": np.array([1, 2, 3, 4], np.float32)},
        parameters={"cid": cid, "target": target}).get(timeout=30)
    assert resp.error is None, resp.error
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), [1, 3, 6, 10])
    # The BLS sequence ended with its last request: the ID is free again.
    late = _run(server, target, 1, cid)
    assert late.error is not None and "must specify the START flag" in late.error.message


def test_a_bls_request_the_sequence_batcher_refuses_is_answered_in_tritons_words(server):
    # No correlation ID: the scheduler refuses it before it is queued, and Triton's Python
    # backend prefixes such a refusal (the caller's error says so).
    resp = server.model("seq_bls").infer(
        {"IN": np.array([1], np.float32)}, parameters={"cid": 0, "target": "seq_int"}
    ).get(timeout=30)
    assert resp.error is not None
    assert ("Model seq_int - Error when running inference: inference request to model "
            "'seq_int' must specify a non-zero or non-empty correlation ID") in resp.error.message


def test_a_huge_number_of_sequence_slots_loads_and_serves(tmp_path):
    # 2^31-1 candidate sequences per instance (the field's largest): tritonpy made every slot
    # at load and would never have finished; now a slot exists once a sequence takes it.
    cfg = seq_config("oldest { max_candidate_sequences: 2147483647 }", max_batch_size=4,
                     instances=2)
    write_model(tmp_path, "huge", SEQ_PY, cfg)
    with serving(tmp_path, new_prefix()) as srv:
        firsts = [srv.model("huge").infer({"IN": _x(cid, True)}, correlation_id=cid,
                                          flags=START) for cid in (1, 2, 3)]
        got = [r.get(timeout=30) for r in firsts]
        # Slot 0 of each instance fills before any slot 1, as with a handful of slots.
        assert [params(r)["instance"] for r in got] == ["huge_0_0", "huge_0_1", "huge_0_0"]
        ends = [srv.model("huge").infer({"IN": _x(1, True)}, correlation_id=cid, flags=END)
                for cid in (1, 2, 3)]
        assert [_sum(r.get(timeout=30)) for r in ends] == [2, 3, 4]
