"""The model contract as a real server keeps it: initialize's args, auto_complete_config,
default_model_filename and version_policy. One server (model control mode none) serves all.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tritonpy
from _models import (
    DOUBLE_PY,
    fp32,
    infer,
    io_config,
    new_prefix,
    serving,
    wait_until,
    write_model,
)
from tritonpy.config import config_to_json, load_model_config, normalize_config

pytestmark = pytest.mark.timeout(60)

ARGS_PY = """
import json
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.args = args

    def execute(self, requests):
        return [pb_utils.InferenceResponse([], parameters={
            "args": json.dumps(self.args),
            "types": json.dumps(sorted({type(k).__name__ + ":" + type(v).__name__
                                        for k, v in self.args.items()}))})
            for r in requests]
"""

AUTO_PY = """
import json
import os
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        cfg = auto_complete_model_config
        with open(os.path.join(os.path.dirname(__file__), "seen.json"), "w") as f:
            json.dump(cfg.as_dict(), f)  # what the model was given
        cfg.set_max_batch_size(4)
        cfg.set_dynamic_batching()
        cfg.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [2]})
        cfg.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [2]})
        cfg.set_model_transaction_policy({"decoupled": DECOUPLED})
        return cfg

    def execute(self, requests):
        if DECOUPLED:
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                sender = r.get_response_sender()
                for k in (1, 2):
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * k)]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + 1)])
            for r in requests]
"""

VERSION_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.version = args["model_version"]

    def execute(self, requests):
        return [pb_utils.InferenceResponse([], parameters={"version": self.version})
                for r in requests]
"""

VERSION_CONFIG = """
backend: "python"
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ], optional: true } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "args_model", ARGS_PY,
                io_config(extra="instance_group [ { count: 1, kind: KIND_CPU } ]\n"))
    write_model(repo, "nogroup", ARGS_PY, io_config())
    write_model(repo, "auto", AUTO_PY.replace("DECOUPLED", "False"), config="")
    write_model(repo, "auto_dec", AUTO_PY.replace("DECOUPLED", "True"), config="")
    write_model(repo, "custom_file", DOUBLE_PY, io_config(
        extra='default_model_filename: "custom.py"\n'), filename="custom.py")
    write_model(repo, "vlatest", VERSION_PY, VERSION_CONFIG, versions=(1, 2, 3))
    write_model(repo, "vall", VERSION_PY, VERSION_CONFIG + "version_policy: { all { } }\n",
                versions=(1, 2, 3))
    write_model(repo, "vspecific", VERSION_PY,
                VERSION_CONFIG + "version_policy: { specific { versions: [ 1, 3 ] } }\n",
                versions=(1, 2, 3))
    return repo


@pytest.fixture(scope="module")
def server(repo):
    with serving(repo, new_prefix()) as srv:
        yield srv


def _ok(model, inputs=None, **kw):
    resp = infer(model, inputs or {}, **kw)
    assert resp.error is None, resp.error
    return resp


def test_all_models_loaded(server):
    index = {(m["name"], m["version"]): m["state"] for m in server.models()}
    assert index == {
        ("args_model", "1"): "READY", ("nogroup", "1"): "READY", ("auto", "1"): "READY",
        ("auto_dec", "1"): "READY", ("custom_file", "1"): "READY", ("vlatest", "3"): "READY",
        ("vall", "1"): "READY", ("vall", "2"): "READY", ("vall", "3"): "READY",
        ("vspecific", "1"): "READY", ("vspecific", "3"): "READY",
    }


def test_initialize_args_are_exactly_tritons(server, repo):
    resp = _ok(server.model("args_model"), {"IN": fp32(1)})
    args = json.loads(resp.parameters["args"])
    mdir = repo / "args_model"
    cfg, _ = load_model_config(str(mdir))
    expected_json = config_to_json(normalize_config(cfg, "args_model", str(mdir / "config.pbtxt")))
    assert args == {
        "model_config": expected_json,
        "model_instance_kind": "CPU",
        "model_instance_name": "args_model_0_0",
        "model_instance_device_id": "0",
        "model_repository": str(mdir),
        "model_version": "1",
        "model_name": "args_model",
    }
    assert json.loads(resp.parameters["types"]) == ["str:str"]
    # the same JSON the config endpoint serves
    assert json.loads(args["model_config"]) == server.model("args_model").config()


def test_instance_name_without_instance_group(server):
    # Triton names the default group after the model itself: one instance, '<model>_0'.
    args = json.loads(_ok(server.model("nogroup"), {"IN": fp32(1)}).parameters["args"])
    assert args["model_instance_name"] == "nogroup_0"
    assert json.loads(args["model_config"])["instance_group"][0]["name"] == "nogroup"


def test_auto_complete_fills_a_missing_config(server):
    model = server.model("auto")
    cfg = model.config()
    assert cfg["name"] == "auto"
    assert cfg["max_batch_size"] == 4
    assert "dynamic_batching" in cfg
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == [
        ("IN", "TYPE_FP32", [2])]
    assert [(o["name"], o["data_type"], o["dims"]) for o in cfg["output"]] == [
        ("OUT", "TYPE_FP32", [2])]
    assert cfg["model_transaction_policy"] == {"decoupled": False}
    assert not model.decoupled()
    resp = _ok(model, {"IN": np.zeros((3, 2), np.float32)})
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), np.ones((3, 2)))
    with pytest.raises(tritonpy.InvalidArgumentError, match="batch-size must be <= 4"):
        model.infer({"IN": np.zeros((5, 2), np.float32)})


def test_auto_complete_is_given_the_defaults_triton_fills_first(server, repo):
    # As Triton 2.51 (measured): auto_complete_config's config already has the backend, the
    # default model file, one CPU instance group named after the model, the version policy
    # and the pinned-memory flags, though the model has no config.pbtxt at all.
    assert server.model("auto").ready()
    seen = json.loads((repo / "auto" / "1" / "seen.json").read_text())
    assert (seen["name"], seen["backend"], seen["default_model_filename"]) == (
        "auto", "python", "model.py")
    assert [(g["name"], g["kind"], g["count"]) for g in seen["instance_group"]] == [
        ("auto", "KIND_CPU", 1)]
    assert seen["version_policy"] == {"latest": {"num_versions": 1}}
    assert seen["optimization"]["input_pinned_memory"] == {"enable": True}
    assert seen["max_batch_size"] == 0 and seen["input"] == [] and seen["output"] == []
    # What the model then set is what the server serves; the defaults are as before.
    cfg = server.model("auto").config()
    assert cfg["instance_group"] == seen["instance_group"]
    assert cfg["version_policy"] == seen["version_policy"]


def test_auto_complete_decoupled_policy(server):
    model = server.model("auto_dec")
    assert model.config()["model_transaction_policy"] == {"decoupled": True}
    assert model.decoupled()
    responses = list(model.infer({"IN": np.ones((1, 2), np.float32)}))
    data = [r.outputs["OUT"].to_numpy().tolist() for r in responses if r.outputs]
    assert data == [[[1, 1]], [[2, 2]]]
    assert responses[-1].final and all(r.error is None for r in responses)


def test_default_model_filename(server):
    model = server.model("custom_file")
    assert model.config()["default_model_filename"] == "custom.py"
    resp = _ok(model, {"IN": fp32(2)})
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), fp32(4))


def _version(server, name, version=-1):
    return _ok(server.model(name, version)).parameters["version"]


def test_version_policy_latest(server):
    assert _version(server, "vlatest") == "3"
    assert _version(server, "vlatest", 3) == "3"
    for v in (1, 2):
        with pytest.raises(tritonpy.NotFoundError, match=f"'vlatest' version {v} is not found"):
            server.model("vlatest", v).infer({})


def test_version_policy_all(server):
    assert [_version(server, "vall", v) for v in (1, 2, 3)] == ["1", "2", "3"]
    assert _version(server, "vall") == "3"  # no version: the newest
    assert server.model("vall", 2).ready()


def test_version_policy_specific(server):
    assert [_version(server, "vspecific", v) for v in (1, 3)] == ["1", "3"]
    with pytest.raises(tritonpy.NotFoundError, match="version 2 is not found"):
        server.model("vspecific", 2).infer({})
    assert not server.model("vspecific", 2).ready()
    assert server.model("vspecific", 1).ready()


FLAKY_INIT = """
import os
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        marks = os.path.join(args["model_repository"], "attempts")
        with open(marks, "a") as fh:
            fh.write("x")
        with open(marks) as fh:
            attempts = len(fh.read())
        if attempts <= int(open(os.path.join(args["model_repository"], "failures")).read()):
            raise RuntimeError(f"not yet ready (attempt {attempts})")

    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests]
"""


@pytest.mark.parametrize("retries, failures, loads", [(2, 2, True), (1, 2, False), (0, 1, False)])
def test_a_model_that_fails_to_load_is_tried_again_model_load_retry_count_times(
        tmp_path: Path, retries: int, failures: int, loads: bool) -> None:
    # Triton's --model-load-retry-count: a load that fails is tried again that many times.
    mdir = write_model(tmp_path, "flaky", FLAKY_INIT)
    (mdir / "failures").write_text(str(failures))
    with serving(tmp_path, new_prefix(), model_load_retry_count=retries) as server:
        state = {m["name"]: m for m in server.models()}["flaky"]
        attempts = len((mdir / "attempts").read_text())
        if loads:
            assert state["state"] == "READY" and attempts == failures + 1
            out = infer(server.model("flaky"), {"IN": np.array([1.5], np.float32)})
            assert out.outputs["OUT"].to_numpy().tolist() == [1.5]
        else:
            assert state["state"] == "UNAVAILABLE" and attempts == retries + 1
            assert f"not yet ready (attempt {retries + 1})" in state["reason"]


def test_an_invalid_config_is_not_tried_again(tmp_path: Path) -> None:
    write_model(tmp_path, "broken", FLAKY_INIT, config='backend: "python"\nmax_batch_size: -3\n')
    with serving(tmp_path, new_prefix(), model_load_retry_count=3) as server:
        state = {m["name"]: m for m in server.models()}["broken"]
        assert state["state"] == "UNAVAILABLE"
        assert not (tmp_path / "broken" / "attempts").exists()  # never got to initialize


def test_auto_complete_config_must_return_the_config(tmp_path: Path) -> None:
    # A forgotten ``return`` fails the load, in Triton's words, as it does on Triton; the
    # other models load.
    write_model(tmp_path, "no_return", AUTO_PY.replace("DECOUPLED", "False").replace(
        "        return cfg\n", "", 1), config="")
    write_model(tmp_path, "fine", AUTO_PY.replace("DECOUPLED", "False"), config="")
    # A value no config may hold is blamed on what auto_complete_config returned (it used to
    # name <model>/config.pbtxt, which does not exist).
    write_model(tmp_path, "bad_type", AUTO_PY.replace("DECOUPLED", "False").replace(
        '"data_type": "TYPE_FP32", "dims": [2]})\n        cfg.add_output',
        '"data_type": "FP32", "dims": [2]})\n        cfg.add_output', 1), config="")
    with serving(tmp_path, new_prefix()) as server:
        state = {m["name"]: m for m in server.models()}
        assert state["fine"]["state"] == "READY"
        assert state["no_return"]["state"] == "UNAVAILABLE"
        assert ("auto_complete_config function in model 'no_return' must return a valid "
                "pb.ModelConfig object.") in state["no_return"]["reason"]
        assert state["bad_type"]["state"] == "UNAVAILABLE"
        reason = state["bad_type"]["reason"]
        assert ("the configuration auto_complete_config of 'bad_type' returned: "
                "(input[0].data_type): invalid value \"FP32\"") in reason, reason
        assert "config.pbtxt" not in reason


# Writes "<phase>" in the model's directory as it gets there, then sleeps for ever.
STUCK_PY = """
import os, time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(cfg):
        if os.path.exists(os.path.join(HERE, "stuck_in_auto_complete")):
            open(os.path.join(HERE, "auto_complete"), "w").close()
            time.sleep(3600)
        return cfg

    def initialize(self, args):
        open(os.path.join(HERE, "initialize"), "w").close()
        time.sleep(3600)

    def execute(self, requests):
        return []
"""


@pytest.mark.parametrize("phase", ["initialize", "auto_complete"])
def test_stop_does_not_wait_for_a_model_still_loading(tmp_path: Path, phase: str) -> None:
    # A load through the API whose initialize (or auto_complete_config) never ends: stop()
    # stops that stub at once and the load fails saying why; nothing is left behind.
    mdir = write_model(tmp_path, "stuck", STUCK_PY)
    if phase == "auto_complete":
        (mdir / "stuck_in_auto_complete").touch()
    box: list[BaseException | None] = []

    def load() -> None:
        try:
            server.repo.load("stuck", api=True)
            box.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box.append(exc)

    with serving(tmp_path, new_prefix(), model_control_mode="explicit",
                 exit_timeout=30) as server:
        loader = threading.Thread(target=load)
        loader.start()
        wait_until(lambda: (mdir / phase).exists(), 30, f"the model to reach {phase}")
        t0 = time.monotonic()
        server.stop()
        elapsed = time.monotonic() - t0
        loader.join(10)
    assert elapsed < 5, f"stop() took {elapsed:.1f} s"
    assert len(box) == 1 and isinstance(box[0], tritonpy.TritonpyError), box
    assert "the server is stopping: the model's load was cancelled" in str(box[0])


STUCK_FINALIZE_PY = """
import time

class TritonPythonModel:
    def execute(self, requests):
        return []

    def finalize(self):
        time.sleep(3600)
"""


def test_instances_stuck_in_finalize_are_stopped_together(tmp_path: Path) -> None:
    # Each instance's finalize gets its grace (here the 2 s exit timeout) at the same time:
    # three stuck ones cost one grace, not three, and none is left running.
    write_model(tmp_path, "stuck", STUCK_FINALIZE_PY,
                config=io_config(extra="instance_group [ { kind: KIND_CPU, count: 3 } ]\n"))
    with serving(tmp_path, new_prefix(), exit_timeout=2) as server:
        assert len(server.repo.runtime("stuck", -1).instances) == 3
        t0 = time.monotonic()
        server.stop()
        elapsed = time.monotonic() - t0
    assert elapsed < 5.5, f"stop() took {elapsed:.1f} s"  # one by one: 3 graces, 6 s or more


@pytest.mark.parametrize("where, words", [
    ("", "the model repository path is empty"),
    ("gs://bucket/models", "gs:// locations are not supported"),
])
def test_a_repository_that_is_no_local_folder_is_refused_at_once(where, words):
    # An empty path served the current folder; a cloud address was read as a folder.
    with pytest.raises(tritonpy.InvalidArgumentError, match=words):
        tritonpy.Server(where)
