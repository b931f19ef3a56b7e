"""Triton's scheduler test hooks, environment variables of the server read when a model loads:
``TRITONSERVER_DELAY_SCHEDULER=N`` holds a batcher's first batch until N requests are queued,
and, for the direct sequence batcher, ``TRITONSERVER_BACKLOG_DELAY_SCHEDULER=M`` until M more
wait in the backlog. Upstream's L0_batcher, L0_sequence_batcher and L0_dyna_sequence_batcher
queue requests one by one under them and expect them batched together.

Triton 2.51 honours ``TRITONSERVER_DELAY_SCHEDULER`` (measured: three requests 0.3 s apart
under ``=3`` ran as one batch of 3, the next one alone).
"""
from __future__ import annotations

import queue

import numpy as np
import pytest
from _models import io_config, new_prefix, serving, write_model
from _sched_models import BATCH_PY, SEQ_PY, Gate, params, seq_config

pytestmark = pytest.mark.timeout(90)

START, END = 1, 2
HELD = 0.4  # seconds a held request is watched not to answer

ONE = 'instance_group [ { count: 1, kind: KIND_CPU } ]\n'


def _serve(tmp_path, monkeypatch, models, delay, backlog=None):
    repo = tmp_path / "repo"
    for name, (model_py, cfg) in models.items():
        write_model(repo, name, model_py, cfg)
    monkeypatch.setenv("TRITONSERVER_DELAY_SCHEDULER", delay)
    if backlog is not None:
        monkeypatch.setenv("TRITONSERVER_BACKLOG_DELAY_SCHEDULER", backlog)
    return serving(repo, new_prefix())


def _held(stream) -> bool:
    try:
        resp = stream.get(timeout=HELD)
    except queue.Empty:
        return True
    raise AssertionError(f"answered while it should be held: {params(resp)}")


def _row(v: float) -> dict:
    return {"IN": np.array([[v]], dtype=np.float32)}


def test_the_dynamic_batcher_waits_for_the_count_once(tmp_path, monkeypatch):
    models = {"db": (BATCH_PY, io_config(8, dims="[ 1 ]", extra=f"dynamic_batching {{ }}\n{ONE}")),
              "plain": (BATCH_PY, io_config(8, dims="[ 1 ]", extra=ONE))}
    with _serve(tmp_path, monkeypatch, models, " 3 ") as server:  # read as C's atoi reads it
        model = server.model("db")
        streams = [model.infer(_row(0))]
        assert _held(streams[0])  # without the hook it would run alone at once
        streams.append(model.infer(_row(1)))
        assert _held(streams[0])
        streams.append(model.infer(_row(2)))
        got = [params(s.get(timeout=30)) for s in streams]
        assert [(p["exec"], p["batch"], p["pos"]) for p in got] == [(1, 3, 0), (1, 3, 1),
                                                                     (1, 3, 2)]
        # Open for good: the next request runs at once, alone.
        p = params(model.infer(_row(3)).get(timeout=30))
        assert (p["exec"], p["batch"]) == (2, 1)
        # A model without a batcher is not held.
        assert params(server.model("plain").infer(_row(0)).get(timeout=30))["batch"] == 1


def _seq(server, model, v, cid, flags=0, **params):
    return server.model(model).infer(_row(v), correlation_id=cid, flags=flags,
                                     parameters=params or None)


def _out(stream) -> float:
    return float(stream.get(timeout=30).outputs["OUT"].to_numpy().reshape(-1)[0])


def test_the_direct_sequence_batcher_waits_for_the_count_over_all_sequences(
        tmp_path, monkeypatch):
    models = {"direct": (SEQ_PY, seq_config(max_batch_size=4))}
    with _serve(tmp_path, monkeypatch, models, "4") as server:
        a1 = _seq(server, "direct", 1, 11, START)
        b1 = _seq(server, "direct", 10, 12, START)
        a2 = _seq(server, "direct", 2, 11, END)
        assert _held(a1)
        b2 = _seq(server, "direct", 20, 12, END)
        got = [s.get(timeout=30) for s in (a1, b1, a2, b2)]
        assert [(params(r)["exec"], params(r)["batch"], params(r)["pos"]) for r in got] == [
            (1, 2, 0), (1, 2, 1), (2, 2, 0), (2, 2, 1)]
        assert [float(r.outputs["OUT"].to_numpy().reshape(-1)[0]) for r in got] == [1, 10, 3, 30]


def test_the_oldest_batcher_counts_sequences_per_instance(tmp_path, monkeypatch):
    # As Triton 2.51 (measured): each instance counts its own queue (Triton's per-instance
    # dynamic batcher), where a sequence has one request at a time; so many requests of one
    # sequence do not open a count of 2, and a second sequence on that instance does.
    models = {"one": (SEQ_PY, seq_config("oldest { max_candidate_sequences: 4 }",
                                         max_batch_size=4, instances=1)),
              "two": (SEQ_PY, seq_config("oldest { max_candidate_sequences: 4 }",
                                         max_batch_size=4, instances=2))}
    with _serve(tmp_path, monkeypatch, models, "2") as server:
        a = [_seq(server, "one", 1, 41, START), _seq(server, "one", 1, 41),
             _seq(server, "one", 1, 41)]
        assert _held(a[0])
        b = _seq(server, "one", 10, 42, START | END)
        a.append(_seq(server, "one", 1, 41, END))
        assert [_out(s) for s in a] == [1, 2, 3, 4]
        assert _out(b) == 10

        # Sequences take the instances in turn: 51 and 53 on one, 52 and 54 on the other.
        gate = Gate(tmp_path)  # 51's requests hold their instance, and their slot, until open
        c = [_seq(server, "two", 1, 51, START, gate=gate.path),
             _seq(server, "two", 1, 51, END, gate=gate.path)]
        d1 = _seq(server, "two", 1, 52, START)
        assert _held(c[0]) and _held(d1)
        e1 = _seq(server, "two", 5, 53, START | END)  # the first instance opens
        assert _held(d1)
        f1 = _seq(server, "two", 7, 54, START | END)  # and the second
        assert (_out(d1), _out(f1)) == (1, 7)
        gate.open()
        assert [_out(s) for s in c] + [_out(e1)] == [1, 2, 5]
        assert _out(_seq(server, "two", 1, 52, END)) == 2


def test_the_backlog_count_holds_the_direct_batcher_too(tmp_path, monkeypatch):
    models = {"one_slot": (SEQ_PY, seq_config(max_batch_size=1))}
    with _serve(tmp_path, monkeypatch, models, "2", backlog="1") as server:
        a1 = _seq(server, "one_slot", 1, 31, START)
        a2 = _seq(server, "one_slot", 2, 31, END)
        assert _held(a1)  # 2 queued in the slot, but none in the backlog yet
        b1 = _seq(server, "one_slot", 5, 32, START | END)  # no free slot: the backlog
        got = [s.get(timeout=30) for s in (a1, a2, b1)]
        assert [float(r.outputs["OUT"].to_numpy().reshape(-1)[0]) for r in got] == [1, 3, 5]
        assert [params(r)["exec"] for r in got] == [1, 2, 3]


def test_a_count_that_is_not_a_positive_number_is_no_hook(tmp_path, monkeypatch):
    # Triton reads "-1" as a count it never reaches (a batcher that never runs); tritonpy
    # takes it, like a word, as no hook at all.
    models = {"db": (BATCH_PY, io_config(8, dims="[ 1 ]", extra=f"dynamic_batching {{ }}\n{ONE}"))}
    for value in ("-1", "many"):
        with _serve(tmp_path / value, monkeypatch, models, value) as server:
            p = params(server.model("db").infer(_row(0)).get(timeout=30))
            assert (p["exec"], p["batch"]) == (1, 1)
