"""Dynamic batching with real stubs: batches actually formed (seen in execute and in the
statistics), max_batch_size, preferred_batch_size, max_queue_delay_microseconds, request
timeouts, priority levels and the queue policy (REJECT / DELAY, max_queue_size), and which
requests may share a batch (equal shapes unless ragged, the same optional inputs).

Batches are made deterministic with a gate: a first request holds the only instance in
execute while the test queues the others, then the gate opens and the batches that form are
read back from what the model saw (its execute count, batch length, rows, positions).
"""
from __future__ import annotations

import concurrent.futures
import queue
import time

import numpy as np
import pytest
from _models import infer, io_config, new_prefix, serving, write_model
from _sched_models import BATCH_PY, Gate, params

from tritonpy import InferenceResponse

pytestmark = pytest.mark.timeout(90)

ONE = 'instance_group [ { count: 1, kind: KIND_CPU } ]\n'


def _cfg(max_batch_size: int, dynamic: str) -> str:
    return io_config(max_batch_size, dims="[ 1 ]",
                     extra=f"dynamic_batching {{ {dynamic} }}\n{ONE}")


MODELS = {
    "db_basic": _cfg(8, ""),
    "db_cap": _cfg(4, ""),
    "db_rows": _cfg(8, ""),
    "db_pref": _cfg(8, "preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 300000"),
    "db_hold": _cfg(3, "max_queue_delay_microseconds: 30000000"),
    "db_delay": _cfg(8, "max_queue_delay_microseconds: 200000"),
    "db_nodelay": _cfg(8, ""),
    "db_prio": _cfg(8, "priority_levels: 2 default_priority_level: 2"),
    "db_reject": _cfg(8, "default_queue_policy { timeout_action: REJECT "
                         "default_timeout_microseconds: 100000 }"),
    "db_override": _cfg(8, "default_queue_policy { allow_timeout_override: true }"),
    "db_capped": _cfg(8, "default_queue_policy { timeout_action: REJECT allow_timeout_override: "
                         "true default_timeout_microseconds: 100000 }"),
    "db_delayed": _cfg(8, "default_queue_policy { timeout_action: DELAY "
                          "allow_timeout_override: true }"),
    "db_late": _cfg(8, "default_queue_policy { timeout_action: DELAY "
                       "allow_timeout_override: true }"),
    "db_delay_order": _cfg(8, "default_queue_policy { timeout_action: DELAY "
                              "allow_timeout_override: true }"),
    "db_reform": _cfg(8, "preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 30000000 "
                         "default_queue_policy { timeout_action: REJECT "
                         "allow_timeout_override: true }"),
    "db_reform_delay": _cfg(8, "preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: "
                               "30000000 default_queue_policy { timeout_action: DELAY "
                               "allow_timeout_override: true }"),
    "db_full": _cfg(8, "default_queue_policy { max_queue_size: 2 }"),
    # A model that does not batch: batches of one, but its queue policy applies (Triton 2.51).
    "db_full_nobatch": _cfg(0, "default_queue_policy { max_queue_size: 1 }"),
    "db_levelfull": _cfg(8, "priority_levels: 2 default_priority_level: 1 "
                            "priority_queue_policy { key: 2 value: { max_queue_size: 1 } }"),
    "db_cancel": _cfg(8, ""),
    # Upstream's L0_config_json max_priority_level: 2^64-1 levels, a policy past 2^32.
    "db_maxprio": _cfg(8, "priority_levels: 18446744073709551615 default_priority_level: "
                          "4294967295 priority_queue_policy { key: 4294967296 value: { "
                          "timeout_action: REJECT default_timeout_microseconds: "
                          "18446744073709551615 allow_timeout_override: true max_queue_size: "
                          "2 } }"),
    "db_ordered": io_config(8, dims="[ 1 ]", extra="dynamic_batching { preserve_ordering: true }\n"
                            "instance_group [ { count: 2, kind: KIND_CPU } ]\n"),
    "no_db": io_config(8, dims="[ 1 ]", extra=ONE),
    "db_shapes": io_config(8, dims="[ -1 ]", extra=f"dynamic_batching {{ }}\n{ONE}"),
    "db_ragged": io_config(8, dims="[ -1 ]", extra=f"dynamic_batching {{ }}\n{ONE}").replace(
        "dims: [ -1 ] }", "dims: [ -1 ], allow_ragged_batch: true }", 1),
    "db_optional": io_config(8, dims="[ 1 ]", extra=(
        'input [ { name: "OPT", data_type: TYPE_FP32, dims: [ 1 ], optional: true } ]\n'
        f"dynamic_batching {{ }}\n{ONE}")),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for name, cfg in MODELS.items():
        write_model(repo, name, BATCH_PY, cfg)
    with serving(repo, new_prefix()) as srv:
        yield srv


@pytest.fixture
def gate(tmp_path):
    with Gate(tmp_path) as g:
        yield g


def _row(v: float) -> np.ndarray:
    return np.array([[v]], dtype=np.float32)


def _hold(model, gate, rows: int = 1):
    """Send a request that keeps the model's only instance busy until the gate opens."""
    held = np.full((rows, 1), -1, dtype=np.float32)
    return model.infer({"IN": held}, parameters={"gate": gate.path})


def _all(streams, timeout=30.0) -> list[InferenceResponse]:
    return [s.get(timeout=timeout) for s in streams]


def _value(resp: InferenceResponse) -> float:
    assert resp.error is None, resp.error
    return float(resp.outputs["OUT"].to_numpy().reshape(-1)[0])


def test_queued_requests_reach_execute_as_one_batch(server, gate):
    model = server.model("db_basic")
    held = _hold(model, gate)
    streams = [model.infer({"IN": _row(i)}) for i in range(5)]
    gate.open()
    first = params(held.get(timeout=30))
    assert (first["exec"], first["batch"]) == (1, 1)
    resps = _all(streams)
    assert [_value(r) for r in resps] == [0, 1, 2, 3, 4]
    seen = [params(r) for r in resps]
    assert {(p["exec"], p["batch"], p["rows"]) for p in seen} == {(2, 5, 5)}
    assert [p["pos"] for p in seen] == [0, 1, 2, 3, 4]  # arrival order within the batch
    stats = server.statistics("db_basic")["model_stats"][0]
    assert stats["inference_count"] == 6
    assert stats["execution_count"] == 2
    assert [b["batch_size"] for b in stats["batch_stats"]] == [1, 5]
    assert [b["compute_infer"]["count"] for b in stats["batch_stats"]] == [1, 1]
    assert stats["inference_stats"]["success"]["count"] == 6


def test_batches_never_exceed_max_batch_size(server, gate):
    model = server.model("db_cap")
    held = _hold(model, gate)
    streams = [model.infer({"IN": _row(i)}) for i in range(11)]
    gate.open()
    held.get(timeout=30)
    seen = [params(r) for r in _all(streams)]
    # FIFO: the first four, the next four, the last three.
    assert [(p["exec"], p["batch"], p["pos"]) for p in seen] == (
        [(2, 4, i) for i in range(4)] + [(3, 4, i) for i in range(4)]
        + [(4, 3, i) for i in range(3)])
    sizes = {b["batch_size"]: b["compute_infer"]["count"]
             for b in server.statistics("db_cap")["model_stats"][0]["batch_stats"]}
    assert sizes == {1: 1, 4: 2, 3: 1}


def test_batch_size_counts_rows_of_batched_requests(server, gate):
    model = server.model("db_rows")
    held = _hold(model, gate)
    three = np.arange(3, dtype=np.float32).reshape(3, 1)
    streams = [model.infer({"IN": three}) for _ in range(3)]
    gate.open()
    held.get(timeout=30)
    resps = _all(streams)
    for r in resps:
        np.testing.assert_array_equal(r.outputs["OUT"].to_numpy(), three)
    seen = [params(r) for r in resps]
    # 3 + 3 rows fit in max_batch_size 8; a third request of 3 rows would make 9.
    assert [(p["exec"], p["batch"], p["rows"]) for p in seen] == [(2, 2, 6), (2, 2, 6), (3, 1, 3)]
    sizes = [b["batch_size"] for b in server.statistics("db_rows")["model_stats"][0]["batch_stats"]]
    assert sizes == [1, 3, 6]


def test_batches_behind_a_busy_instance_grow_past_the_preferred_size_as_in_triton(server, gate):
    model = server.model("db_pref")
    held = _hold(model, gate, rows=2)  # a preferred size by itself: sent at once, alone
    streams = [model.infer({"IN": _row(i)}) for i in range(7)]
    gate.open()
    first = params(held.get(timeout=30))
    assert (first["exec"], first["batch"], first["rows"]) == (1, 1, 2)
    seen = [params(r) for r in _all(streams)]
    # Seven queued one by one behind the busy instance, preferred [2, 4] and a queue delay: as
    # Triton 2.51 forms them (measured side by side; QA), the batch grows as they come, to 4
    # (a preferred size), takes one more (the one that passes it) and is closed; the next two
    # make a preferred size. tritonpy sent 4 + 2 + 1 (the last after its queue delay).
    assert [(p["exec"], p["batch"]) for p in seen] == [(2, 5)] * 5 + [(3, 2)] * 2
    stats = server.statistics("db_pref")["model_stats"][0]
    assert [b["batch_size"] for b in stats["batch_stats"]] == [2, 5]


def test_a_request_too_big_for_the_batch_formed_ahead_starts_the_next(server, gate):
    # As Triton's batcher: the 7-row request cannot join the 2 rows formed ahead (past
    # max_batch_size 8), which closes them; it makes a batch of its own (past the largest
    # preferred size), and the last request runs after it, alone.
    model = server.model("db_pref")
    held = _hold(model, gate, rows=2)
    small = [model.infer({"IN": _row(i)}) for i in range(2)]
    big = model.infer({"IN": np.full((7, 1), 9, dtype=np.float32)})
    last = model.infer({"IN": _row(5)})
    gate.open()
    n = params(held.get(timeout=30))["exec"]
    seen = [params(r) for r in _all(small + [big, last])]
    assert [(p["exec"] - n, p["rows"]) for p in seen] == [(1, 2), (1, 2), (2, 7), (3, 1)]


def test_queue_delay_holds_a_batch_open_until_it_is_full(server):
    # max_queue_delay 30 s, max_batch_size 3: the first request waits for company instead of
    # running alone, and the batch goes as soon as it is full (long before the delay ends).
    model = server.model("db_hold")
    streams = [model.infer({"IN": _row(i)}) for i in range(3)]
    seen = [params(r) for r in _all(streams, timeout=20)]
    assert [(p["exec"], p["batch"], p["pos"]) for p in seen] == [(1, 3, 0), (1, 3, 1), (1, 3, 2)]


def test_a_lone_request_waits_its_delay_and_no_longer_needs_company(server):
    model = server.model("db_delay")
    resp = infer(model, {"IN": _row(7)}, wait=20)
    assert _value(resp) == 7
    assert (params(resp)["exec"], params(resp)["batch"]) == (1, 1)
    queue = server.statistics("db_delay")["model_stats"][0]["inference_stats"]["queue"]
    assert queue["count"] == 1
    assert queue["ns"] >= 200_000_000  # it did wait for others, for its full delay


def test_without_delay_a_free_instance_takes_a_request_at_once(server):
    model = server.model("db_nodelay")
    streams = [model.infer({"IN": _row(i)}) for i in range(2)]
    first = params(streams[0].get(timeout=20))
    assert (first["exec"], first["batch"]) == (1, 1)  # dispatched on arrival, alone
    _all(streams[1:])


def test_without_dynamic_batching_each_request_runs_alone(server, gate):
    model = server.model("no_db")
    held = _hold(model, gate)
    streams = [model.infer({"IN": _row(i)}) for i in range(3)]
    gate.open()
    held.get(timeout=30)
    seen = [params(r) for r in _all(streams)]
    assert [(p["exec"], p["batch"]) for p in seen] == [(2, 1), (3, 1), (4, 1)]


def test_priority_levels_order_the_batch(server, gate):
    model = server.model("db_prio")
    held = _hold(model, gate)
    low = [model.infer({"IN": _row(i)}) for i in range(2)]  # default level 2
    explicit_low = model.infer({"IN": _row(2)}, priority=2)
    high = model.infer({"IN": _row(10)}, priority=1)
    gate.open()
    held.get(timeout=30)
    pos = {_value(r): params(r)["pos"] for r in _all(low + [explicit_low, high])}
    assert pos == {10: 0, 0: 1, 1: 2, 2: 3}


def test_a_huge_number_of_priority_levels_loads_and_orders_by_level(server, gate):
    # tritonpy made every declared level at load: 2^64-1 of them grew the host by ~200 MiB/s
    # and the load never ended (QA L0_config_json). Only levels in use exist now.
    model = server.model("db_maxprio")
    cfg = model.config()["dynamic_batching"]
    assert cfg["priority_levels"] == 18446744073709551615  # as Triton 2.51 answers it
    assert cfg["priority_queue_policy"]["4294967296"]["max_queue_size"] == 2
    held = _hold(model, gate)
    default = model.infer({"IN": _row(0)})  # level 4294967295
    top = model.infer({"IN": _row(1)}, priority=1)
    policed = [model.infer({"IN": _row(2 + i)}, priority=4294967296) for i in range(3)]
    beyond = model.infer({"IN": _row(9)}, priority=18446744073709551615)  # the last level
    # The policy's queue of 2 holds at its level: the third is refused at once.
    third = policed[2].get(timeout=30)
    assert third.error is not None and "Exceeds maximum queue size" in third.error.message
    gate.open()
    held.get(timeout=30)
    pos = {_value(r): params(r)["pos"] for r in _all([default, top, *policed[:2], beyond])}
    assert pos == {1: 0, 0: 1, 2: 2, 3: 3, 9: 4}
    # The levels used and emptied are forgotten; the batcher keeps one.
    batcher = server.runtime("db_maxprio").sched
    assert len(batcher.levels) == 1 and batcher.n == 0


def test_default_timeout_rejects_requests_still_queued(server, gate):
    model = server.model("db_reject")
    held = _hold(model, gate)
    streams = [model.infer({"IN": _row(i)}) for i in range(2)]
    try:
        rejected = _all(streams, timeout=20)  # 100 ms default timeout, instance held
    finally:
        gate.open()
    for r in rejected:
        assert r.error is not None and r.error.code.name == "UNAVAILABLE"
        assert r.error.message == "Request timeout expired"
    assert params(held.get(timeout=30))["batch"] == 1  # the executing request is not affected
    assert _value(infer(model, {"IN": _row(5)})) == 5  # and the model serves on
    stats = server.statistics("db_reject")["model_stats"][0]["inference_stats"]
    assert (stats["success"]["count"], stats["fail"]["count"]) == (2, 2)


def test_request_timeout_overrides_the_default_when_allowed(server, gate):
    model = server.model("db_override")
    held = _hold(model, gate)
    timed = model.infer({"IN": _row(1)}, timeout=50_000)
    patient = model.infer({"IN": _row(2)})
    try:
        r = timed.get(timeout=20)
    finally:
        gate.open()
    assert r.error is not None and r.error.message == "Request timeout expired"
    held.get(timeout=30)
    assert _value(patient.get(timeout=30)) == 2


def test_request_timeout_cannot_lengthen_the_default(server, gate):
    model = server.model("db_capped")
    held = _hold(model, gate)
    longer = model.infer({"IN": _row(1)}, timeout=60_000_000)  # 60 s asked, 100 ms allowed
    try:
        r = longer.get(timeout=20)
    finally:
        gate.open()
    assert r.error is not None and r.error.message == "Request timeout expired"
    held.get(timeout=30)


def test_a_timeout_that_passed_before_the_batch_formed_rejects_with_an_idle_instance(server):
    # As Triton: the queue policy applies when the batcher picks a request, not only when its
    # timer fires; 1 µs is over before the request reaches the scheduler.
    model = server.model("db_capped")
    before = server.statistics("db_capped")["model_stats"][0]["inference_stats"]["fail"]["count"]
    r = model.infer({"IN": _row(1)}, timeout=1).get(timeout=10)
    assert r.error is not None and r.error.code.name == "UNAVAILABLE"
    assert r.error.message == "Request timeout expired"
    stats = server.statistics("db_capped")["model_stats"][0]["inference_stats"]
    assert stats["fail"]["count"] == before + 1
    assert _value(infer(model, {"IN": _row(2)})) == 2


def test_a_timeout_that_passed_under_delay_still_runs(server):
    model = server.model("db_late")
    assert _value(model.infer({"IN": _row(7)}, timeout=1).get(timeout=10)) == 7


def test_delay_policy_moves_timed_out_requests_behind_the_others(server, gate):
    model = server.model("db_delayed")
    held = _hold(model, gate)
    late = model.infer({"IN": _row(1)}, timeout=1_000)  # 1 ms, then DELAY: not rejected
    time.sleep(0.5)  # its timeout passes while the instance is held
    others = [model.infer({"IN": _row(v)}) for v in (2, 3)]
    gate.open()
    held.get(timeout=30)
    resps = _all([late] + others)
    pos = {_value(r): params(r)["pos"] for r in resps}
    assert {params(r)["exec"] for r in resps} == {2}
    assert pos == {2: 0, 3: 1, 1: 2}


def test_delayed_requests_run_in_arrival_order_whichever_timed_out_first(server, gate):
    # As Triton 2.51 (measured): the request that timed out later but arrived first runs first
    # among the delayed ones, which all run after the request that did not time out.
    model = server.model("db_delay_order")
    held = _hold(model, gate)
    first = model.infer({"IN": _row(1)}, timeout=200_000)  # times out second
    second = model.infer({"IN": _row(2)}, timeout=1_000)  # times out first
    time.sleep(0.5)  # both time out while the instance is held
    fresh = model.infer({"IN": _row(3)})
    gate.open()
    held.get(timeout=30)
    resps = _all([first, second, fresh])
    assert {params(r)["exec"] for r in resps} == {2}
    assert {_value(r): params(r)["pos"] for r in resps} == {3: 0, 1: 1, 2: 2}


@pytest.mark.parametrize("name", ["db_reform", "db_reform_delay"])
def test_a_timeout_in_the_queue_lets_the_rest_form_a_batch_at_once(server, name):
    # As Triton 2.51 (measured, QA L0_model_queue's test_timeout_override): rows 1 + 2 + 2 make
    # no preferred batch (4 or 8), so they wait for the 30 s delay. When the first one times out
    # (200 ms) it is rejected, or moved behind the others, and the two that are left make 4
    # rows: they go at once. tritonpy did not look at the queue again until the delay ran out.
    model = server.model(name)
    t0 = time.monotonic()
    first = model.infer({"IN": _row(1)}, timeout=200_000)
    pair = [model.infer({"IN": np.full((2, 1), v, np.float32)}) for v in (2, 3)]
    resps = _all(pair, timeout=10)
    assert [_value(r) for r in resps] == [2, 3]
    assert time.monotonic() - t0 < 10
    assert {params(r)["exec"] for r in resps} == {params(resps[0])["exec"]}  # one batch
    if name == "db_reform":
        late = first.get(timeout=10)
        assert late.error is not None and late.error.message == "Request timeout expired"
    else:  # delayed: still queued (alone, it would wait out the 30 s delay)
        first.cancel()
        assert first.get(timeout=10).error.code.name == "CANCELLED"


def test_a_full_queue_rejects_cleanly_and_loses_nothing_queued(server, gate):
    model = server.model("db_full")
    held = _hold(model, gate)
    queued = [model.infer({"IN": _row(i)}) for i in range(2)]
    over = model.infer({"IN": _row(9)}).get(timeout=10)
    assert over.error is not None and over.error.code.name == "UNAVAILABLE"
    assert over.error.message == "[request id: <id_unknown>] Exceeds maximum queue size"
    gate.open()
    held.get(timeout=30)
    assert [_value(r) for r in _all(queued)] == [0, 1]
    assert _value(infer(model, {"IN": _row(3)})) == 3  # room again once the queue drained
    # A request refused as it is queued is no failure in Triton 2.51's statistics (measured).
    stats = server.statistics("db_full")["model_stats"][0]["inference_stats"]
    assert (stats["success"]["count"], stats["fail"]["count"]) == (4, 0)


def test_a_model_that_does_not_batch_keeps_its_queue_policy(server, gate):
    # As Triton 2.51 (measured): dynamic_batching with max_batch_size 0 still queues by its
    # policy. tritonpy used to ignore the policy there, and queued without limit.
    model = server.model("db_full_nobatch")
    held = model.infer({"IN": np.array([-1], np.float32)}, parameters={"gate": gate.path})
    queued = model.infer({"IN": np.array([1], np.float32)})
    over = model.infer({"IN": np.array([2], np.float32)}).get(timeout=10)
    assert over.error is not None and over.error.code.name == "UNAVAILABLE"
    assert over.error.message == "[request id: <id_unknown>] Exceeds maximum queue size"
    gate.open()
    assert params(held.get(timeout=30))["batch"] == 1
    resp = queued.get(timeout=30)
    assert _value(resp) == 1 and params(resp)["batch"] == 1


def test_queue_size_is_per_priority_level(server, gate):
    model = server.model("db_levelfull")
    held = _hold(model, gate)
    low = model.infer({"IN": _row(1)}, priority=2)
    over = model.infer({"IN": _row(2)}, priority=2).get(timeout=10)
    assert over.error is not None
    assert over.error.message == "[request id: <id_unknown>] Exceeds maximum queue size"
    high = [model.infer({"IN": _row(v)}, priority=1) for v in (3, 4)]  # level 1: no limit
    gate.open()
    held.get(timeout=30)
    assert [_value(r) for r in _all([low] + high)] == [1, 3, 4]


def test_requests_from_many_threads_are_all_answered_in_batches(server):
    model = server.model("db_basic")
    before = server.statistics("db_basic")["model_stats"][0]["inference_count"]

    def one(i: int) -> float:
        return _value(infer(model, {"IN": _row(i)}))

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        got = list(ex.map(one, range(200)))
    assert got == list(range(200))
    stats = server.statistics("db_basic")["model_stats"][0]
    assert stats["inference_count"] - before == 200
    assert all(b["batch_size"] <= 8 for b in stats["batch_stats"])


def test_a_cancelled_queued_request_leaves_the_batch(server, gate):
    model = server.model("db_cancel")
    held = _hold(model, gate)
    streams = [model.infer({"IN": _row(i)}) for i in range(3)]
    streams[1].cancel()
    cancelled = streams[1].get(timeout=10)
    assert cancelled.error is not None and cancelled.error.code.name == "CANCELLED"
    gate.open()
    held.get(timeout=30)
    seen = [params(streams[i].get(timeout=30)) for i in (0, 2)]
    assert [(p["exec"], p["batch"], p["pos"]) for p in seen] == [(2, 2, 0), (2, 2, 1)]


def test_preserve_ordering_holds_a_later_response_until_earlier_ones(server, gate):
    model = server.model("db_ordered")
    first = _hold(model, gate)  # on one instance, held
    second = model.infer({"IN": _row(2)})  # on the other instance, done at once
    try:
        with pytest.raises(queue.Empty):
            second.get(timeout=0.5)  # answered by the model, but held back
    finally:
        gate.open()
    a, b = first.get(timeout=30), second.get(timeout=30)
    assert params(a)["instance"] != params(b)["instance"]  # they really ran side by side
    assert _value(b) == 2


def _wide(v: float, width: int, rows: int = 1) -> np.ndarray:
    return np.full((rows, width), v, dtype=np.float32)


def test_requests_of_different_shapes_are_not_batched_together(server, gate):
    # IN has dims [ -1 ]: as Triton, a batch holds one shape (the batch dimension aside), so a
    # model may concatenate its requests' inputs; the first request that differs ends the batch,
    # which goes at once. Rows may differ: 1 and 2 rows of width 2 share a batch.
    model = server.model("db_shapes")
    held = _hold(model, gate)
    sent = [_wide(0, 2), _wide(1, 2, rows=2), _wide(2, 3), _wide(3, 3), _wide(4, 2)]
    streams = [model.infer({"IN": x}) for x in sent]
    gate.open()
    held.get(timeout=30)
    resps = _all(streams)
    for x, r in zip(sent, resps):
        np.testing.assert_array_equal(r.outputs["OUT"].to_numpy(), x)
    seen = [params(r) for r in resps]
    assert [(p["exec"], p["batch"], p["rows"], p["pos"]) for p in seen] == [
        (2, 2, 3, 0), (2, 2, 3, 1), (3, 2, 2, 0), (3, 2, 2, 1), (4, 1, 1, 0)]


def test_inputs_that_allow_a_ragged_batch_share_one(server, gate):
    model = server.model("db_ragged")
    held = _hold(model, gate)
    sent = [_wide(0, 2), _wide(1, 3), _wide(2, 1, rows=2), _wide(3, 2)]
    streams = [model.infer({"IN": x}) for x in sent]
    gate.open()
    held.get(timeout=30)
    resps = _all(streams)
    for x, r in zip(sent, resps):
        np.testing.assert_array_equal(r.outputs["OUT"].to_numpy(), x)
    assert [(params(r)["exec"], params(r)["batch"]) for r in resps] == [(2, 4)] * 4


def test_requests_with_different_optional_inputs_are_not_batched_together(server, gate):
    model = server.model("db_optional")
    held = _hold(model, gate)
    opt = {"OPT": _row(9)}
    sent = [{}, {}, opt, opt, {}]
    streams = [model.infer({"IN": _row(i), **extra}) for i, extra in enumerate(sent)]
    gate.open()
    held.get(timeout=30)
    resps = _all(streams)
    assert [_value(r) for r in resps] == [0, 1, 2, 3, 4]
    assert [(params(r)["exec"], params(r)["batch"]) for r in resps] == [
        (2, 2), (2, 2), (3, 2), (3, 2), (4, 1)]


def test_stop_does_not_wait_for_a_cancelled_request_still_in_the_queue(tmp_path):
    # A cancelled request is answered at once but stays in the batcher's queue until a batch
    # forms: here only when the 30 s delay has passed. Stopping the server waited for it.
    write_model(tmp_path, "db_slow", BATCH_PY,
                _cfg(8, "max_queue_delay_microseconds: 30000000"))
    with serving(tmp_path, new_prefix()) as srv:
        queued = srv.model("db_slow").infer({"IN": _row(1)})
        time.sleep(0.2)
        queued.cancel()
        assert queued.get(timeout=10).error.code.name == "CANCELLED"
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 10
