"""Model control with real stubs: none loads everything, explicit loads what it is asked, poll
rescans and loads / reloads / unloads; a reload serves the old version until the new one is
ready and loses no request; an unload finishes in-flight requests first.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _models import fp32, infer, io_config, serving, wait_for, wait_until, write_model
from _sched_models import Gate, params

from tritonpy import NotFoundError, TritonpyError, UnavailableError
from tritonpy.config import config_to_dict, parse_config_text

pytestmark = pytest.mark.timeout(90)

# OUT = IN; the response names the model's TAG. initialize waits for GATE when one is set and
# touches STARTED first, so a test knows that a new version is initializing right now.
TAGGED_PY = """
import json, os, time
from pathlib import Path
import triton_python_backend_utils as pb_utils

TAG = {tag!r}
GATE = {gate!r}
STARTED = {started!r}

class TritonPythonModel:
    def initialize(self, args):
        if STARTED:
            Path(STARTED).touch()
        if GATE:
            deadline = time.monotonic() + 60
            while not os.path.exists(GATE) and time.monotonic() < deadline:
                time.sleep(0.005)

    def execute(self, requests):
        for r in requests:
            gate = json.loads(r.parameters()).get("gate")
            if gate:
                deadline = time.monotonic() + 60
                while not os.path.exists(gate) and time.monotonic() < deadline:
                    time.sleep(0.005)
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())],
            parameters={{"tag": TAG}}) for r in requests]
"""


def tagged(tag: str, gate: str = "", started: str = "") -> str:
    return TAGGED_PY.format(tag=tag, gate=gate, started=started)


def _tag(model) -> str:
    return params(infer(model, {"IN": fp32(1)}))["tag"]


def _states(server) -> dict[str, str]:
    return {m["name"]: m["state"] for m in server.models()}


def _rewrite(path: Path, text: str) -> None:
    """Replace a file so that poll mode sees a change even within one mtime tick."""
    old = path.stat()
    path.write_text(text)
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns + 1_000_000_000))



def test_none_mode_loads_every_model(tmp_path, shm_prefix):
    for name in ("a", "b"):
        write_model(tmp_path, name, tagged(name))
    with serving(tmp_path, shm_prefix) as server:
        assert _states(server) == {"a": "READY", "b": "READY"}
        assert (_tag(server.model("a")), _tag(server.model("b"))) == ("a", "b")
        with pytest.raises(UnavailableError):
            server.load("a")  # the API is explicit mode's


def test_explicit_mode_loads_only_what_is_asked(tmp_path, shm_prefix):
    for name in ("a", "b"):
        write_model(tmp_path, name, tagged(name))
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["a"]) as server:
        # As Triton 2.51 (checked against it): a model never loaded is listed by name alone.
        assert _states(server) == {"a": "READY", "b": ""}
        assert [m for m in server.models() if m["name"] == "b"] == [
            {"name": "b", "version": "", "state": "", "reason": ""}]
        with pytest.raises(NotFoundError):
            server.model("b").infer({"IN": fp32(1)})
        write_model(tmp_path, "c", tagged("c"))  # appears later: known once asked for
        server.load("b")
        server.load("c")
        assert _states(server) == {"a": "READY", "b": "READY", "c": "READY"}
        assert _tag(server.model("c")) == "c"
        server.unload("a")
        # ... and an unloaded one by the versions it had, each UNAVAILABLE ("unloaded").
        assert [m for m in server.models() if m["name"] == "a"] == [
            {"name": "a", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]
        with pytest.raises(NotFoundError):
            server.model("a").infer({"IN": fp32(1)})
        with pytest.raises(NotFoundError):
            server.load("nope")
        server.unload("nope")  # as Triton 2.51: unloading what is not loaded succeeds
        assert "nope" not in _states(server)


def test_the_index_reads_the_repository_as_triton_does(tmp_path, shm_prefix):
    # As Triton 2.51 (measured, QA round 14): a folder added since the last load is listed by
    # name, and one removed once unloaded is not listed. tritonpy showed the repository as
    # its last load or unload had found it.
    write_model(tmp_path, "a", tagged("a"))
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["a"]) as server:
        write_model(tmp_path, "late", tagged("late"))
        assert _states(server) == {"a": "READY", "late": ""}
        server.load("late")
        server.unload("late")
        assert _states(server) == {"a": "READY", "late": "UNAVAILABLE"}
        shutil.rmtree(tmp_path / "late")
        assert _states(server) == {"a": "READY"}
        with pytest.raises(NotFoundError):
            server.model("late")
        write_model(tmp_path, "b", tagged("b"))  # and what is loaded stays listed while its
        server.load("b")                         # folder is gone, until it is unloaded
        shutil.rmtree(tmp_path / "b")
        assert _states(server) == {"a": "READY", "b": "READY"}
        server.unload("b")
        assert _states(server) == {"a": "READY"}
        # One still unloading (its finalize runs) is listed UNLOADING until it is done.
        write_model(tmp_path, "slow_end", tagged("slow_end") + (
            "\n    def finalize(self):\n        time.sleep(1.5)\n"))
        server.load("slow_end")
        server.unload("slow_end", wait=False)
        shutil.rmtree(tmp_path / "slow_end")
        assert _states(server) == {"a": "READY", "slow_end": "UNLOADING"}
        with pytest.raises(TritonpyError):  # its folder is gone: and it was dropped at once
            server.load("slow_end")
        assert "slow_end" in _states(server)
        wait_until(lambda: _states(server) == {"a": "READY"}, 10, "slow_end to go")


def test_models_to_load_at_start_need_explicit_mode(tmp_path):
    # As Triton: refused at once, not every model loaded instead.
    import tritonpy

    for mode in ("none", "poll"):
        with pytest.raises(tritonpy.InvalidArgumentError, match="requires setting "
                           "'--model-control-mode=explicit'"):
            tritonpy.Server(str(tmp_path), model_control_mode=mode, load_models=["a"])
    with pytest.raises(tritonpy.InvalidArgumentError, match="must be the ONLY startup model"):
        tritonpy.Server(str(tmp_path), model_control_mode="explicit", load_models=["*", "a"])


def test_reload_serves_the_old_version_until_the_new_one_is_ready(tmp_path, shm_prefix):
    mdir = write_model(tmp_path, "m", tagged("old"), io_config(
        extra="instance_group [ { count: 2, kind: KIND_CPU } ]\n"))  # one held, one free
    gate, started = Gate(tmp_path, "init_gate"), tmp_path / "started"
    held_gate = Gate(tmp_path, "exec_gate")
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server, gate, held_gate:
        model = server.model("m")
        held = model.infer({"IN": fp32(7)}, parameters={"gate": held_gate.path})
        (mdir / "1" / "model.py").write_text(tagged("new", gate.path, str(started)))
        errors: list[BaseException] = []

        def reload() -> None:
            try:
                server.load("m")
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                errors.append(exc)

        loader = threading.Thread(target=reload)
        loader.start()
        try:
            assert wait_for(started.exists, timeout=30), "the new version never initialized"
            # The new version is initializing: the old one answers meanwhile.
            assert [_tag(model) for _ in range(3)] == ["old"] * 3
            assert _states(server) == {"m": "READY"}
        finally:
            gate.open()
        # The swap waits for nothing new, but the old version finishes its in-flight request.
        assert wait_for(lambda: _tag(model) == "new", timeout=30)
        held_gate.open()
        resp = held.get(timeout=30)
        assert params(resp)["tag"] == "old" and resp.outputs["OUT"].to_numpy()[0] == 7
        loader.join(30)
        assert not loader.is_alive() and not errors
        assert _tag(model) == "new"


def test_reload_hands_queued_requests_the_old_version_never_ran_to_the_new_one(
        tmp_path, shm_prefix):
    mdir = write_model(tmp_path, "m", tagged("old"))  # one instance
    with serving(tmp_path, shm_prefix, model_control_mode="explicit", load_models=["m"],
                 exit_timeout=0.5) as server, Gate(tmp_path) as gate:
        model = server.model("m")
        held = model.infer({"IN": fp32(1)}, parameters={"gate": gate.path})
        queued = model.infer({"IN": fp32(2)})  # behind the held one, on the old version
        (mdir / "1" / "model.py").write_text(tagged("new"))
        server.load("m")
        resp = queued.get(timeout=30)
        assert resp.error is None, resp.error
        assert params(resp)["tag"] == "new" and resp.outputs["OUT"].to_numpy()[0] == 2
        # As Triton: the old version finishes what it runs, however long (exit_timeout
        # bounds only the server's stop): held well past its 0.5 s, it still answers.
        time.sleep(1.0)
        gate.open()
        done = held.get(timeout=30)
        assert done.error is None, done.error
        assert params(done)["tag"] == "old" and done.outputs["OUT"].to_numpy()[0] == 1


def test_unload_finishes_in_flight_requests_first(tmp_path, shm_prefix):
    write_model(tmp_path, "m", tagged("m"))
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server, Gate(tmp_path) as gate:
        model = server.model("m")
        held = model.infer({"IN": fp32(5)}, parameters={"gate": gate.path})
        unloader = threading.Thread(target=server.unload, args=("m",))
        unloader.start()
        try:
            assert wait_for(lambda: _states(server)["m"] == "UNLOADING", timeout=10)
            with pytest.raises(NotFoundError):  # nothing new is taken meanwhile
                model.infer({"IN": fp32(1)})
            assert unloader.is_alive()  # still waiting for the in-flight request
        finally:
            gate.open()
        resp = held.get(timeout=30)
        assert resp.error is None and resp.outputs["OUT"].to_numpy()[0] == 5
        unloader.join(30)
        assert not unloader.is_alive()
        assert _states(server)["m"] == "UNAVAILABLE"


def test_unload_without_waiting_returns_at_once_and_its_requests_outlive_the_exit_timeout(
        tmp_path, shm_prefix):
    # Triton's HTTP, gRPC and pb_utils unload: the call returns at once, the model shows
    # UNLOADING, and its in-flight request finishes however long it takes (exit_timeout
    # bounds only the server's stop).
    write_model(tmp_path, "m", tagged("m"))
    with serving(tmp_path, shm_prefix, model_control_mode="explicit", load_models=["m"],
                 exit_timeout=0.5) as server, Gate(tmp_path) as gate:
        held = server.model("m").infer({"IN": fp32(5)}, parameters={"gate": gate.path})
        t0 = time.monotonic()
        server.unload("m", wait=False)
        assert time.monotonic() - t0 < 0.5
        assert _states(server)["m"] == "UNLOADING"
        # A stop's drain counts its request (tritonpy serve's countdown names it), loaded
        # again or not: it named only the versions loaded.
        assert server.in_flight() == [("m", 1, 1)]
        server.load("m")
        assert server.in_flight() == [("m", 1, 1)]
        time.sleep(1.0)  # twice the exit timeout
        gate.open()
        resp = held.get(timeout=30)
        assert resp.error is None and resp.outputs["OUT"].to_numpy()[0] == 5
        assert wait_for(lambda: server.in_flight() == [], timeout=30)


SELF_UNLOAD_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        pb_utils.unload_model("selfish")  # itself: returns at once, as in Triton
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests]
"""


def test_a_model_that_unloads_itself_answers_and_then_unloads(tmp_path, shm_prefix):
    write_model(tmp_path, "selfish", SELF_UNLOAD_PY)
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["selfish"]) as server:
        t0 = time.monotonic()
        resp = infer(server.model("selfish"), {"IN": fp32(3)})
        assert resp.error is None and resp.outputs["OUT"].to_numpy()[0] == 3
        assert time.monotonic() - t0 < 10  # it used to wait out the exit timeout, then fail
        assert wait_for(lambda: _states(server)["selfish"] == "UNAVAILABLE", timeout=30)


def test_stop_bounds_an_unload_whose_request_never_ends(tmp_path, shm_prefix):
    write_model(tmp_path, "stuck", STUCK_PY,
                io_config(extra="model_transaction_policy { decoupled: true }\n"))
    with serving(tmp_path, shm_prefix, exit_timeout=2, model_control_mode="explicit",
                 load_models=["stuck"]) as server:
        stream = server.model("stuck").infer({"IN": fp32(1)})
        server.unload("stuck", wait=False)  # waits for a request that never ends
        time.sleep(0.5)
        t0 = time.monotonic()
        server.stop()
        elapsed = time.monotonic() - t0
    assert elapsed < 10, elapsed  # the exit timeout bounds it, then the stub is given up on
    resp = stream.get(timeout=5)
    assert resp.error is not None and resp.error.code.name == "UNAVAILABLE"


def test_poll_mode_loads_reloads_and_unloads(tmp_path, shm_prefix):
    a = write_model(tmp_path, "a", tagged("a1"))
    with serving(tmp_path, shm_prefix, model_control_mode="poll",
                 poll_interval=0.1) as server:
        assert _states(server) == {"a": "READY"}
        write_model(tmp_path, "b", tagged("b1"))  # a new model directory
        assert wait_for(lambda: _states(server).get("b") == "READY", timeout=30)
        assert _tag(server.model("b")) == "b1"
        _rewrite(a / "1" / "model.py", tagged("a2"))  # a file change
        assert wait_for(lambda: _tag(server.model("a")) == "a2", timeout=30)
        _rewrite(a / "config.pbtxt", io_config(4, dims="[ 1 ]"))  # a config change
        assert wait_for(lambda: server.model("a").config()["max_batch_size"] == 4, timeout=30)
        resp = infer(server.model("a"), {"IN": np.ones((3, 1), np.float32)})
        assert params(resp)["tag"] == "a2" and resp.outputs["OUT"].to_numpy().shape == (3, 1)
        _rewrite(a / "1" / "model.py", "this is not python\n")  # a broken change
        time.sleep(1.0)  # several polls: the failed reload leaves the old version serving
        assert _states(server)["a"] == "READY"
        assert params(infer(server.model("a"), {"IN": np.ones((1, 1), np.float32)}))["tag"] == "a2"
        broken = tmp_path / "broken"  # a folder whose config cannot be read
        broken.mkdir()
        (broken / "config.pbtxt").write_text("this is { not a config")
        time.sleep(1.0)
        assert server.ready()  # as Triton: it is no model of the server, readiness stays
        shutil.rmtree(broken)
        shutil.rmtree(tmp_path / "b")  # a removed model directory
        assert wait_for(lambda: "b" not in _states(server), timeout=30)
        with pytest.raises(NotFoundError):
            server.model("b")


def test_a_version_the_poll_takes_out_is_not_ready_not_unknown(tmp_path, shm_prefix):
    # As Triton 2.51 (measured): once a version folder is removed and the poll has unloaded
    # it, the index lists it UNAVAILABLE "unloaded" and a request for it is UNAVAILABLE (503)
    # "version 2 is not at ready state". tritonpy said NOT_FOUND "is not found".
    mdir = write_model(tmp_path, "m", tagged("v"), io_config(extra="version_policy: { all: {} }\n"),
                       versions=(1, 2))
    with serving(tmp_path, shm_prefix, model_control_mode="poll", poll_interval=0.1) as server:
        shutil.rmtree(mdir / "2")
        wait_until(lambda: [(m["version"], m["state"], m["reason"]) for m in server.models()]
                   == [("1", "READY", ""), ("2", "UNAVAILABLE", "unloaded")], 30,
                   "the poll to unload version 2")
        with pytest.raises(UnavailableError, match="'m' version 2 is not at ready state"):
            infer(server.model("m", 2), {"IN": fp32(0)})
        assert _tag(server.model("m", 1)) == "v"


def test_poll_mode_unloads_a_model_that_appears_in_a_second_repository(tmp_path, shm_prefix):
    # As Triton 2.51 (measured, QA L0_lifecycle's test_multiple_model_repository_polling):
    # the model is unloaded and the index shows it UNAVAILABLE with Triton's reason; once the
    # copy goes, it loads again. tritonpy kept serving it.
    r1, r2 = tmp_path / "r1", tmp_path / "r2"
    write_model(r1, "saved", tagged("s1"))
    r2.mkdir()
    with serving([r1, r2], shm_prefix, model_control_mode="poll", poll_interval=0.1) as server:
        assert _states(server) == {"saved": "READY"}
        shutil.copytree(r1 / "saved", r2 / "saved")
        assert wait_for(lambda: _states(server)["saved"] == "UNAVAILABLE", timeout=30)
        (row,) = server.models()
        assert row["reason"] == "model appears in two or more repositories"
        with pytest.raises(TritonpyError, match="two or more repositories"):
            infer(server.model("saved"), {"IN": fp32(1)})
        shutil.rmtree(r2 / "saved")
        assert wait_for(lambda: _states(server).get("saved") == "READY", timeout=30)
        assert _tag(server.model("saved")) == "s1"


def test_explicit_load_of_a_model_now_in_two_repositories_fails(tmp_path, shm_prefix):
    # As Triton 2.51 (measured, QA L0_lifecycle's test_multiple_model_repository_control):
    # the load fails in Triton's words; tritonpy reported success and kept the old version.
    r1, r2 = tmp_path / "r1", tmp_path / "r2"
    write_model(r1, "saved", tagged("s1"))
    r2.mkdir()
    with serving([r1, r2], shm_prefix, model_control_mode="explicit") as server:
        server.load("saved")
        shutil.copytree(r1 / "saved", r2 / "saved")
        with pytest.raises(TritonpyError) as info:
            server.load("saved")
        assert info.value.message == ("failed to load 'saved', failed to poll from model "
                                      "repository: model appears in two or more repositories")
        assert _tag(server.model("saved")) == "s1"  # what was loaded serves on
        with pytest.raises(TritonpyError, match="load with files needs a config override"):
            server.load("other", files={"file:1/model.py": b""})


def test_poll_reload_while_requests_flow_loses_no_request(tmp_path, shm_prefix):
    mdir = write_model(tmp_path, "m", tagged("old"), io_config(
        extra="instance_group [ { count: 2, kind: KIND_CPU } ]\n"))
    stop = threading.Event()
    seen: list[list[str]] = [[] for _ in range(4)]
    failures: list[str] = []

    def client(k: int, model) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                resp = infer(model, {"IN": fp32(i)}, wait=30)
            except Exception as exc:  # noqa: BLE001 - every failure is reported below
                failures.append(f"client {k} request {i}: raised {exc!r}")
                continue
            if resp.error is not None:
                failures.append(f"client {k} request {i}: {resp.error!r}")
            elif resp.outputs["OUT"].to_numpy()[0] != i:
                failures.append(f"client {k} request {i}: wrong output")
            else:
                seen[k].append(resp.parameters["tag"])

    with serving(tmp_path, shm_prefix, model_control_mode="poll",
                 poll_interval=0.1) as server:
        model = server.model("m")
        threads = [threading.Thread(target=client, args=(k, model)) for k in range(4)]
        for t in threads:
            t.start()
        try:
            assert wait_for(lambda: all(len(s) >= 5 for s in seen), timeout=30)
            # The new version takes a while to initialize; requests keep flowing meanwhile.
            _rewrite(mdir / "1" / "model.py",
                     tagged("new").replace("    def initialize(self, args):\n",
                                           "    def initialize(self, args):\n"
                                           "        time.sleep(0.5)\n"))
            assert wait_for(lambda: all(s and s[-1] == "new" for s in seen), timeout=30)
            counts = [len(s) for s in seen]
            assert wait_for(lambda: all(len(s) >= c + 5 for s, c in zip(seen, counts)),
                            timeout=30)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
    assert not failures, failures[:5]
    for s in seen:
        first_new = s.index("new")
        assert "old" in s[:first_new] and set(s[first_new:]) == {"new"}


# Decoupled: execute returns without ever sending the final flag; finalize never returns.
STUCK_PY = """
import time

class TritonPythonModel:
    def execute(self, requests):
        self.kept = requests  # kept open, never answered (one let go of would end at once)
        return None

    def finalize(self):
        while True:
            time.sleep(1)
"""


def test_stop_is_bounded_by_the_exit_timeout_when_a_request_never_ends(tmp_path, shm_prefix):
    write_model(tmp_path, "stuck", STUCK_PY,
                io_config(extra="model_transaction_policy { decoupled: true }\n"))
    with serving(tmp_path, shm_prefix, exit_timeout=4) as server:
        stream = server.model("stuck").infer({"IN": fp32(1)})
        time.sleep(0.3)
        t0 = time.monotonic()
        server.stop()
        elapsed = time.monotonic() - t0
    # As Triton: the exit timeout bounds the wait, then the stuck model is given up on (its
    # finalize gets a moment only: 4 + 4 + 4 s before).
    assert 4 <= elapsed < 8, elapsed
    assert server.cut_short == ["'stuck' version 1 (requests in flight)"]
    resp = stream.get(timeout=5)  # answered, not left hanging
    assert resp.error is not None and resp.error.code.name == "UNAVAILABLE"


def test_the_index_lists_each_version_being_loaded(tmp_path, shm_prefix):
    # As Triton's index: {"name", "version", "state": "LOADING"} while initialize runs.
    gate, started = tmp_path / "gate", tmp_path / "started"
    write_model(tmp_path / "repo", "slow", tagged("slow", gate=str(gate), started=str(started)),
                versions=(1, 2))
    with serving(tmp_path / "repo", shm_prefix, model_control_mode="explicit") as server:
        loader = threading.Thread(target=server.load, args=("slow",))
        loader.start()
        try:
            assert wait_for(started.exists, timeout=30)
            rows = [m for m in server.models() if m["name"] == "slow"]
            assert rows == [{"name": "slow", "version": "2", "state": "LOADING", "reason": ""}]
        finally:
            gate.touch()
            loader.join(30)
        assert [(m["version"], m["state"]) for m in server.models()] == [("2", "READY")]


BROKEN_INIT_PY = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("v2 broken")
"""


def test_a_reload_whose_new_version_fails_keeps_the_others_and_says_so(tmp_path, shm_prefix):
    # As Triton (measured): version 1 serves on, the index lists version 2 UNAVAILABLE with
    # its reason, and the server is not ready until a load succeeds.
    mdir = write_model(tmp_path, "mixed", tagged("v1"),
                       io_config(extra="version_policy: { all: {} }\n"))
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["mixed"]) as server:
        assert server.ready()
        (mdir / "2").mkdir()
        (mdir / "2" / "model.py").write_text(BROKEN_INIT_PY)
        with pytest.raises(TritonpyError, match="version 2 is at UNAVAILABLE state"):
            server.load("mixed")
        rows = [(m["version"], m["state"]) for m in server.models()]
        assert rows == [("1", "READY"), ("2", "UNAVAILABLE")]
        assert "RuntimeError: v2 broken" in server.models()[1]["reason"]
        assert not server.ready()
        assert _tag(server.model("mixed", 1)) == "v1"
        shutil.rmtree(mdir / "2")
        server.load("mixed")
        assert [(m["version"], m["state"]) for m in server.models()] == [("1", "READY")]
        assert server.ready()


def test_every_version_that_fails_to_load_is_named(tmp_path, shm_prefix):
    # As Triton 2.51 (measured): the versions load side by side, so the load's error names
    # each one that failed (joined by ';'), the index lists each with its own reason and the
    # one that loaded as unloaded again. tritonpy stopped at the first failure: version 2
    # was neither named nor listed, and version 3 was never tried.
    mdir = write_model(tmp_path, "m", BROKEN_INIT_PY.replace("v2", "v1"),
                       io_config(extra="version_policy: { all: {} }\n"))
    (mdir / "2").mkdir()
    (mdir / "2" / "model.py").write_text(BROKEN_INIT_PY)
    (mdir / "3").mkdir()
    (mdir / "3" / "model.py").write_text(tagged("v3"))
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as server:
        with pytest.raises(TritonpyError) as err:
            server.load("m")
        assert err.value.message.startswith(
            "load failed for model 'm': version 1 is at UNAVAILABLE state: Internal: ")
        assert ";version 2 is at UNAVAILABLE state: Internal: " in err.value.message
        assert "RuntimeError: v1 broken" in err.value.message
        assert "RuntimeError: v2 broken" in err.value.message
        rows = server.models()
        assert [(m["version"], m["state"]) for m in rows] == \
            [("1", "UNAVAILABLE"), ("2", "UNAVAILABLE"), ("3", "UNAVAILABLE")]
        assert rows[0]["reason"].startswith("Internal: RuntimeError: v1 broken")
        assert rows[1]["reason"].startswith("Internal: RuntimeError: v2 broken")
        assert rows[2]["reason"] == "unloaded"
        assert not server.model("m").ready()


def test_the_index_goes_on_listing_the_versions_a_reload_took_out(tmp_path, shm_prefix):
    # As Triton 2.51 (measured): a version that a reload's version policy leaves out is
    # listed UNAVAILABLE "unloaded" (UNLOADING while it drains) beside those serving, until it
    # serves again; an unload then lists every version that served.
    mdir = write_model(tmp_path, "two", tagged("v"), io_config(extra="version_policy: { all: {} }\n"),
                       versions=(1, 2))
    only = lambda v: io_config(extra=f"version_policy: {{ specific: {{ versions: [{v}] }} }}\n")  # noqa: E731
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["two"]) as server:
        def rows() -> list[tuple[str, str, str]]:
            return [(m["version"], m["state"], m.get("reason", "")) for m in server.models()]

        assert rows() == [("1", "READY", ""), ("2", "READY", "")]
        server.load("two", config=json.dumps(config_to_dict(parse_config_text(only(2), "two"))))
        wait_until(lambda: rows()[0][1] == "UNAVAILABLE", 10, "version 1 to finish unloading")
        assert rows() == [("1", "UNAVAILABLE", "unloaded"), ("2", "READY", "")]
        server.load("two", config=json.dumps(config_to_dict(parse_config_text(only(1), "two"))))
        wait_until(lambda: rows()[1][1] == "UNAVAILABLE", 10, "version 2 to finish unloading")
        assert rows() == [("1", "READY", ""), ("2", "UNAVAILABLE", "unloaded")]
        assert server.ready()  # a version taken out on purpose is no failure
        server.unload("two")
        assert rows() == [("1", "UNAVAILABLE", "unloaded"), ("2", "UNAVAILABLE", "unloaded")]
    assert mdir.exists()


def test_a_version_still_unloading_is_unavailable_not_unknown(tmp_path, shm_prefix):
    # As Triton 2.51 (measured): while a version a reload took out still drains, and once it
    # is unloaded, a request for it is UNAVAILABLE (503, which clients retry), "not at ready
    # state". It was NOT_FOUND all along, then once it was unloaded.
    from _models import SLEEPER_PY

    write_model(tmp_path, "two", SLEEPER_PY, io_config(extra="version_policy: { all: {} }\n"),
                versions=(1, 2))
    only2 = io_config(extra="version_policy: { specific: { versions: [2] } }\n")
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["two"]) as server:
        slow = threading.Thread(target=infer, args=(server.model("two", 1), {"IN": fp32(1500)}))
        slow.start()
        time.sleep(0.3)
        server.load("two", config=json.dumps(config_to_dict(parse_config_text(only2, "two"))))
        with pytest.raises(UnavailableError, match="'two' version 1 is not at ready state"):
            infer(server.model("two", 1), {"IN": fp32(0)})
        slow.join(10)
        wait_until(lambda: [m["state"] for m in server.models()][0] == "UNAVAILABLE", 10,
                   "version 1 to finish unloading")
        with pytest.raises(UnavailableError, match="'two' version 1 is not at ready state"):
            infer(server.model("two", 1), {"IN": fp32(0)})
        assert infer(server.model("two", 2), {"IN": fp32(0)}).error is None
        with pytest.raises(NotFoundError, match="'two' version 3 is not found"):
            infer(server.model("two", 3), {"IN": fp32(0)})  # never there


def test_an_unloaded_models_series_leave_the_metrics_page(tmp_path, shm_prefix):
    # As Triton's metrics (measured): the series of an unloaded version go with it, all but
    # nv_inference_request_failure's (see test_counter_lifetimes).
    from tritonpy.metrics import metrics_text

    write_model(tmp_path, "m", tagged("m"))
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["m"]) as server:
        _tag(server.model("m"))
        assert 'nv_inference_count{model="m",version="1"} 1' in metrics_text(server).splitlines()
        server.unload("m")
        lines = [line for line in metrics_text(server).splitlines() if 'model="m"' in line]
        assert 'nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 0' in lines
        assert all(line.startswith("nv_inference_request_failure{") for line in lines)
        with pytest.raises(TritonpyError, match="requested model 'm' is not available"):
            server.statistics("m")  # as Triton's (measured): they go with the model


def test_a_load_that_fails_on_a_bug_of_ours_leaves_the_model_unavailable(
        tmp_path, shm_prefix, monkeypatch):
    # A model whose load raised something other than tritonpy's errors (QA L0_model_config
    # found one: a sequence state with no data_type) stayed LOADING for ever, the server not
    # ready, and at start it ended tritonpy serve. Here a bug is stood in for by a scheduler
    # that raises RuntimeError: the model ends UNAVAILABLE with the reason, and loads once
    # the cause is gone.
    import tritonpy._model as model_module

    write_model(tmp_path, "m", tagged("v1"))
    real = model_module.make_scheduler
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as server:
        def broken(rt):
            raise RuntimeError("a bug of ours")
        monkeypatch.setattr(model_module, "make_scheduler", broken)
        with pytest.raises(TritonpyError, match="RuntimeError: a bug of ours"):
            server.load("m")
        (row,) = server.models()
        assert (row["state"], row["version"]) == ("UNAVAILABLE", "1")
        assert "RuntimeError: a bug of ours" in row["reason"]
        monkeypatch.setattr(model_module, "make_scheduler", real)
        server.load("m")
        assert server.ready() and _tag(server.model("m")) == "v1"


def test_a_config_override_holds_for_later_loads_until_the_config_file_changes(
        tmp_path, shm_prefix):
    # As Triton 2.51 (measured, QA L0_lifecycle's test_model_config_overwite): a load without
    # an override keeps the last override; once the config file changes, the file is read
    # again. tritonpy went back to the file at the next load.
    mdir = write_model(tmp_path, "m", tagged("v"),
                       io_config(extra="version_policy: { all: {} }\n"), versions=(1, 2))
    only = lambda v: io_config(extra=f"version_policy: {{ specific: {{ versions: [{v}] }} }}\n")  # noqa: E731
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as server:
        def loaded() -> list[str]:
            return [m["version"] for m in server.models() if m["state"] == "READY"]

        server.load("m", config=json.dumps(config_to_dict(parse_config_text(only(2), "m"))))
        assert loaded() == ["2"]
        server.load("m")
        assert loaded() == ["2"]
        assert server.model("m").config()["version_policy"] == {"specific": {"versions": [2]}}
        (mdir / "config.pbtxt").write_text(only(1))  # the file changes: it is read again
        server.load("m")
        wait_until(lambda: loaded() == ["1"], 10, "version 2 to finish unloading")
        server.load("m")
        assert loaded() == ["1"]
        # An unload drops an override too (Triton 2.51, measured).
        server.load("m", config=json.dumps(config_to_dict(parse_config_text(only(2), "m"))))
        server.unload("m")
        server.load("m")
        assert loaded() == ["1"]
