"""Reloading a model whose files are unchanged and whose config differs only in its instance
groups updates it in place, as Triton's model update does: only the difference is initialized
or finalized, the other instances keep serving (and what they run), a removed instance
finishes its in-flight execute (or, under the sequence batcher, its sequences) first, and a
failed update leaves the model as it was. Any other change is a full reload, which returns
once the new version serves, while the old one finishes in the background.

Real stubs throughout; every initialize and finalize is logged to a file by the model itself.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from _models import fp32, infer, io_config, serving, wait_for, write_model
from _sched_models import Gate, params

from tritonpy import InvalidArgumentError

pytestmark = pytest.mark.timeout(120)

START, END = 1, 2

# Logs "init <version>:<instance>" / "fini <version>:<instance>" to LOG. initialize fails while the file FAIL
# exists; execute waits for the file named by the request's "gate" parameter, if any.
MODEL_PY = """
import json, os, time
import triton_python_backend_utils as pb_utils

LOG = {log!r}
FAIL = {fail!r}
TAG = {tag!r}

def note(what):
    with open(LOG, "a") as fh:
        fh.write(what + "\\n")

class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_version"] + ":" + args["model_instance_name"]
        if os.path.exists(FAIL):
            note("failed " + self.name)
            raise RuntimeError("told to fail")
        self.count = json.loads(args["model_config"])["instance_group"][0]["count"]
        note("init " + self.name)

    def execute(self, requests):
        out = []
        for r in requests:
            gate = json.loads(r.parameters()).get("gate")
            deadline = time.monotonic() + 60
            while gate and not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.005)
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)], parameters={{
                "instance": self.name, "count": self.count, "tag": TAG}}))
        return out

    def finalize(self):
        note("fini " + self.name)
"""


class Counts:
    """The model's own log of initialize / finalize calls."""

    def __init__(self, tmp_path: Path) -> None:
        self.log = tmp_path / "calls.log"
        self.log.touch()
        self.fail = tmp_path / "FAIL"

    def lines(self, kind: str) -> list[str]:
        return [ln.split(" ", 1)[1] for ln in self.log.read_text().splitlines()
                if ln.startswith(kind + " ")]

    def __call__(self) -> tuple[int, int]:
        return len(self.lines("init")), len(self.lines("fini"))


def _model_py(counts: Counts, tag: str = "v1") -> str:
    return MODEL_PY.format(log=str(counts.log), fail=str(counts.fail), tag=tag)


def _config(count: int, extra: str = "", group: str = "") -> str:
    return io_config(extra=f"instance_group [ {{ count: {count}, kind: KIND_CPU {group} }} ]\n"
                     + extra)


def _setup(tmp_path: Path, count: int, extra: str = "") -> tuple[Path, Counts]:
    counts = Counts(tmp_path)
    mdir = write_model(tmp_path / "repo", "m", _model_py(counts), _config(count, extra))
    return mdir, counts


def _instance(model, **kwargs) -> str:
    return params(infer(model, {"IN": fp32(1)}, **kwargs))["instance"]


def _answers(model, n: int = 40) -> list[dict]:
    """The response parameters of ``n`` requests sent at once."""
    streams = [model.infer({"IN": fp32(i)}) for i in range(n)]
    return [params(s.get(timeout=30)) for s in streams]


def _served_by(model, n: int = 40) -> set[str]:
    """The instances that answer ``n`` requests sent at once."""
    return {p["instance"] for p in _answers(model, n)}


def _pending(stream) -> bool:
    """Whether a request has no final response yet (the stream drops it once it has)."""
    return stream.request is not None and not stream.request.done


def test_count_changes_add_and_remove_only_the_difference(tmp_path, shm_prefix):
    mdir, counts = _setup(tmp_path, 3)
    with serving(tmp_path / "repo", shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server:
        model = server.model("m")
        assert counts() == (3, 0)
        first = set(counts.lines("init"))
        (mdir / "config.pbtxt").write_text(_config(4))
        server.load("m")
        assert counts() == (4, 0)  # one more, none re-created
        assert set(counts.lines("init")) > first
        assert model.config()["instance_group"][0]["count"] == 4
        assert wait_for(lambda: len(_served_by(model)) == 4, timeout=30)

        (mdir / "config.pbtxt").write_text(_config(2))
        server.load("m")
        assert counts() == (4, 2)  # the two removed are finalized before load returns
        live = set(counts.lines("init")) - set(counts.lines("fini"))
        assert _served_by(model) <= live and len(live) == 2

        server.load("m")  # nothing changed: nothing happens
        assert counts() == (4, 2)

        (mdir / "config.pbtxt").write_text(_config(0))  # count 0 means 1, as in Triton
        server.load("m")
        assert counts() == (4, 3)
        assert _instance(model) in live
        assert model.config()["instance_group"][0]["count"] == 1

        # Through the API's config override (as tritonclient's load_model(config=...)).
        cfg = model.config()
        cfg["instance_group"][0]["count"] = 2
        server.load("m", config=json.dumps(cfg))
        assert counts() == (5, 3)
        # A new instance is told the new config in initialize's args; the one kept since
        # the first load still has the config it was initialized with.
        assert wait_for(lambda: {p["count"] for p in _answers(model)} == {3, 2}, timeout=30)


def test_other_changes_reload_every_instance(tmp_path, shm_prefix):
    mdir, counts = _setup(tmp_path, 2)
    with serving(tmp_path / "repo", shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server:
        (mdir / "config.pbtxt").write_text(_config(3, extra='parameters { key: "k" value: { '
                                                          'string_value: "v" } }\n'))
        server.load("m")  # a config change beside the instance group: a full reload
        assert wait_for(lambda: counts() == (5, 2), timeout=30), counts()
        (mdir / "1" / "model.py").write_text(_model_py(counts, tag="v2"))
        server.load("m")  # a model file changed, the config did not: a full reload
        assert wait_for(lambda: counts() == (8, 5), timeout=30), counts()
        assert params(infer(server.model("m"), {"IN": fp32(1)}))["tag"] == "v2"


def test_adding_an_instance_waits_for_no_request_and_removing_one_waits_for_its_execute(
        tmp_path, shm_prefix):
    mdir, counts = _setup(tmp_path, 1)
    with serving(tmp_path / "repo", shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server, Gate(tmp_path, "g1") as g1, \
            Gate(tmp_path, "g2") as g2:
        model = server.model("m")
        (only,) = counts.lines("init")
        held = model.infer({"IN": fp32(7)}, parameters={"gate": g1.path})
        time.sleep(0.2)  # the held request is executing on the only instance
        (mdir / "config.pbtxt").write_text(_config(2))
        t0 = time.monotonic()
        server.load("m")  # returns once the new instance serves, not when the held one ends
        assert time.monotonic() - t0 < 20 and counts() == (2, 0)
        assert _instance(model) != only  # the new instance serves while the old one is busy
        assert _pending(held)

        # Both busy; then down to one: the idle-first choice has none, so the removed one
        # finishes its execute before it is finalized and the load returns.
        held2 = model.infer({"IN": fp32(8)}, parameters={"gate": g2.path})
        time.sleep(0.3)
        (mdir / "config.pbtxt").write_text(_config(1))
        loader = threading.Thread(target=server.load, args=("m",))
        loader.start()
        time.sleep(0.5)
        assert loader.is_alive() and counts()[1] == 0  # waiting for an in-flight execute
        g1.open()
        g2.open()
        loader.join(30)
        assert not loader.is_alive()
        assert counts() == (2, 1)
        for stream, value in ((held, 7), (held2, 8)):
            resp = stream.get(timeout=30)
            assert resp.error is None and resp.outputs["OUT"].to_numpy()[0] == value
        (left,) = set(counts.lines("init")) - set(counts.lines("fini"))
        assert _served_by(model) == {left}


def test_a_failed_update_leaves_the_model_as_it_was(tmp_path, shm_prefix):
    mdir, counts = _setup(tmp_path, 1)
    with serving(tmp_path / "repo", shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server:
        model = server.model("m")
        (only,) = counts.lines("init")
        counts.fail.touch()
        (mdir / "config.pbtxt").write_text(_config(3))
        with pytest.raises(InvalidArgumentError, match="told to fail") as err:
            server.load("m")
        # As Triton 2.51 words it (measured; QA L0_model_update): the version serves on, so
        # it "is at READY state", and the index keeps it READY with the failure as its reason
        # (tritonpy said UNAVAILABLE state, and gave no reason).
        assert err.value.message.startswith(
            "load failed for model 'm': version 1 is at READY state: ")
        assert counts() == (1, 0) and len(counts.lines("failed")) >= 1
        assert model.config()["instance_group"][0]["count"] == 1
        assert _served_by(model) == {only}
        (row,) = server.models()
        assert row["state"] == "READY" and "told to fail" in row["reason"]

        (mdir / "config.pbtxt").write_text("--- not a config ---")
        with pytest.raises(InvalidArgumentError):
            server.load("m")
        assert _instance(model) == only

        counts.fail.unlink()
        (mdir / "config.pbtxt").write_text(_config(3))
        server.load("m")
        assert counts() == (3, 0)
        assert server.models()[0]["reason"] == ""  # the update that succeeds clears it


def test_a_removed_instance_keeps_its_sequences_until_they_end(tmp_path, shm_prefix):
    seq = "sequence_batching { direct { }\nmax_sequence_idle_microseconds: 30000000 }\n"
    mdir, counts = _setup(tmp_path, 3, extra=seq)
    with serving(tmp_path / "repo", shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server:
        model = server.model("m")

        def send(cid: int, flags: int = 0) -> str:
            return _instance(model, correlation_id=cid, flags=flags)

        on = {1: send(1, START), 2: send(2, START)}
        assert on[1] != on[2]
        # One instance of another kind (its rate limiter differs) replaces all three: the one
        # without a sequence goes at once, the two with one live until their sequences end.
        other = "rate_limiter { priority: 2 }"
        (mdir / "config.pbtxt").write_text(_config(1, extra=seq, group=other))
        server.load("m")
        assert counts()[0] == 4
        assert wait_for(lambda: counts()[1] == 1, timeout=30), counts()
        (new,) = set(counts.lines("init")) - set(counts.lines("fini")) - set(on.values())
        assert send(1) == on[1] and send(2) == on[2]  # same instance, same state
        assert send(3, START) == new  # a new sequence goes to the new instance
        assert counts()[1] == 1
        assert send(1, END) == on[1]
        assert wait_for(lambda: counts()[1] == 2, timeout=30), counts()
        assert send(2, END) == on[2]
        assert wait_for(lambda: counts()[1] == 3, timeout=30), counts()
        assert set(counts.lines("fini")) == set(counts.lines("init")) - {new}
        assert send(3, END) == new
        assert server.models()[0]["state"] == "READY" and model.ready()


def test_a_full_reload_does_not_wait_for_the_old_versions_requests(tmp_path, shm_prefix):
    mdir, counts = _setup(tmp_path, 1)
    with serving(tmp_path / "repo", shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server, Gate(tmp_path) as gate:
        model = server.model("m")
        held = model.infer({"IN": fp32(5)}, parameters={"gate": gate.path})
        time.sleep(0.2)
        (mdir / "1" / "model.py").write_text(_model_py(counts, tag="v2"))
        server.load("m")
        assert _pending(held) and counts() == (2, 0)
        assert params(infer(model, {"IN": fp32(1)}))["tag"] == "v2"
        gate.open()
        resp = held.get(timeout=30)
        assert params(resp)["tag"] == "v1" and resp.outputs["OUT"].to_numpy()[0] == 5
        assert wait_for(lambda: counts() == (2, 1), timeout=30), counts()


def test_versions_whose_files_are_unchanged_are_not_reloaded(tmp_path, shm_prefix):
    counts = Counts(tmp_path)
    mdir = write_model(tmp_path / "repo", "m", _model_py(counts),
                       _config(1, extra="version_policy: { all { } }\n"), versions=(1, 2))
    with serving(tmp_path / "repo", shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server:
        assert sorted(counts.lines("init")) == ["1:m_0_0", "2:m_0_0"]
        write_model(tmp_path / "repo", "m", _model_py(counts, tag="v3"),
                    _config(1, extra="version_policy: { all { } }\n"), versions=(3,))
        server.load("m")  # a new version: only it loads
        assert sorted(counts.lines("init")) == ["1:m_0_0", "2:m_0_0", "3:m_0_0"]
        assert counts()[1] == 0
        (mdir / "1" / "model.py").write_text(_model_py(counts, tag="v1b"))
        server.load("m")  # one version's file changed: only it reloads
        assert wait_for(lambda: counts.lines("fini") == ["1:m_0_0"], timeout=30)
        assert len(counts.lines("init")) == 4
        assert params(infer(server.model("m", 1), {"IN": fp32(1)}))["tag"] == "v1b"
        assert params(infer(server.model("m", 2), {"IN": fp32(1)}))["tag"] == "v1"
        (mdir / "config.pbtxt").write_text(_config(1, extra="version_policy: { latest { "
                                                          "num_versions: 2 } }\n"))
        server.load("m")  # the policy drops version 1; 2 and 3 stay as they are
        assert wait_for(lambda: len(counts.lines("fini")) == 2, timeout=30)
        assert len(counts.lines("init")) == 4
        # As Triton's index: the version taken out is listed, unloaded.
        assert [(m["version"], m["state"]) for m in server.models()] == [
            ("1", "UNAVAILABLE"), ("2", "READY"), ("3", "READY")]


def test_poll_mode_updates_instances_in_place(tmp_path, shm_prefix):
    mdir, counts = _setup(tmp_path, 1)
    with serving(tmp_path / "repo", shm_prefix, model_control_mode="poll",
                 poll_interval=0.1) as server:
        cfg = mdir / "config.pbtxt"
        old = cfg.stat()
        cfg.write_text(_config(3))
        os.utime(cfg, ns=(old.st_atime_ns, old.st_mtime_ns + 1_000_000_000))  # a new mtime
        assert wait_for(lambda: counts() == (3, 0), timeout=30), counts()
        assert wait_for(lambda: len(_served_by(server.model("m"))) == 3, timeout=30)
        assert counts() == (3, 0)  # no further reload came of it
