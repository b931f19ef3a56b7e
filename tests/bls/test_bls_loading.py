"""The model loading API from a model (``pb_utils.load_model / unload_model / is_model_ready``)
in real stubs: explicit model-control mode loads, reloads with a config override, loads a
model made only of the given files, unloads; initialize may use it (Triton's doc example);
other modes refuse load/unload with a clear error.

Each test works on a private copy of a few models of tests/models/bls, so loading and
unloading never disturbs another test.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import numpy as np
import pytest

import tritonpy
from _bls_models import BLS_REPO, infer_one, new_prefix, serve, text

COPY = ["loader", "lazy_target", "load_in_init", "add_sub"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("loading_repo")
    for name in COPY:
        shutil.copytree(os.path.join(BLS_REPO, name), root / name)
    return str(root)


@pytest.fixture
def explicit(repo) -> Iterator[tritonpy.Server]:
    with serve(repo, new_prefix(), model_control_mode="explicit",
               load_models=["loader"]) as srv:
        yield srv


def act(server, action: str, model: str = "lazy_target", data=(1.0, 2.0), **params) -> dict:
    resp = infer_one(server, "loader", {"INPUT0": np.array(data, np.float32)},
                     parameters={"action": action, "model": model, **params})
    return text(resp, "REPORT")


def test_load_infer_unload_in_explicit_mode(explicit) -> None:
    assert act(explicit, "ready") == {"action": "ready", "model": "lazy_target", "error": None,
                                      "error_type": None, "ready": False}
    before = act(explicit, "infer")
    assert before["infer_error"] is not None and "lazy_target" in before["infer_error"]

    loaded = act(explicit, "load")
    assert loaded["error"] is None and loaded["ready"] is True
    assert explicit.model("lazy_target").ready()
    assert act(explicit, "ready", version="1")["ready"] is True
    assert act(explicit, "ready", version="9")["ready"] is False
    served = act(explicit, "infer", data=(1.0, -2.0))
    assert served["infer_error"] is None and served["output"] == [3.0, -6.0]

    unloaded = act(explicit, "unload", unload_dependents=True)
    assert unloaded["error"] is None and unloaded["ready"] is False
    assert not explicit.model("lazy_target").ready()
    after = act(explicit, "infer")
    assert after["infer_error"] is not None


def fp32_config(name: str, **more) -> str:
    """A config override (JSON) of a Python model with INPUT0 and OUTPUT0, FP32 of any length."""
    return json.dumps({
        "name": name, "backend": "python", **more,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    })


def test_load_with_a_config_override(explicit) -> None:
    config = fp32_config("lazy_target", max_batch_size=0,
                         instance_group=[{"count": 2, "kind": "KIND_CPU"}])
    assert act(explicit, "load", config=config)["ready"] is True
    assert len(explicit.runtime("lazy_target").instances) == 2
    assert act(explicit, "infer", data=(2.0,))["output"] == [6.0]


# OUTPUT0 = INPUT0 + 100.
PLUS_100_PY = (
    "import triton_python_backend_utils as pb_utils\n"
    "class TritonPythonModel:\n"
    "    def execute(self, requests):\n"
    "        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor('OUTPUT0',\n"
    "            pb_utils.get_input_tensor_by_name(r, 'INPUT0').as_numpy() + 100)])\n"
    "            for r in requests]\n")


def test_load_a_model_made_of_files(explicit) -> None:
    config = fp32_config("from_files")
    report = act(explicit, "load", model="from_files", config=config,
                 files=json.dumps({"file:1/model.py": PLUS_100_PY}))
    assert report["error"] is None and report["ready"] is True
    assert act(explicit, "infer", model="from_files", data=(1.0,))["output"] == [101.0]


def test_file_paths_in_bytes_are_files(explicit) -> None:
    # As Triton 2.51's std::string keys (measured): they were dropped here, and the load then
    # looked for the model in the repository ("unknown model").
    config = fp32_config("from_bytes_paths")
    report = act(explicit, "load", model="from_bytes_paths", config=config,
                 files=json.dumps({"file:1/model.py": PLUS_100_PY}), bytes_paths=True)
    assert report["error"] is None and report["ready"] is True, report
    assert act(explicit, "infer", model="from_bytes_paths", data=(1.0,))["output"] == [101.0]


def test_a_file_key_without_its_prefix_is_no_file(explicit) -> None:
    # As Triton 2.51 (QA round 18, measured): pb_utils.load_model's files are the keys that
    # begin with "file:", as over HTTP and gRPC; "1/model.py" was written and served here,
    # where Triton loads the repository's model.py with the config override.
    config = fp32_config("lazy_target", max_batch_size=0)
    report = act(explicit, "load", config=config, files=json.dumps({"1/model.py": PLUS_100_PY}))
    assert report["error"] is None and report["ready"] is True, report
    assert act(explicit, "infer", data=(2.0,))["output"] == [6.0]  # the repository's


def test_load_failures_raise_with_the_reason(explicit) -> None:
    unknown = act(explicit, "load", model="no_such_model")
    assert unknown["error_type"] == "TritonModelException"
    assert "no_such_model" in unknown["error"]
    bad = act(explicit, "load", config='{"name": "lazy_target", "not_a_field": 1}')
    assert bad["error_type"] == "TritonModelException"
    assert "not_a_field" in bad["error"]
    files_without_config = act(explicit, "load", model="x",
                               files=json.dumps({"file:1/model.py": "pass"}))
    assert files_without_config["error_type"] == "TritonModelException"
    assert "config" in files_without_config["error"]
    # the loader keeps serving
    assert act(explicit, "ready")["error"] is None


def test_a_name_of_bytes_that_are_not_utf8_finds_no_model(explicit) -> None:
    # QA round 15: is_model_ready(b"\xff\xfe") is False on Triton 2.51; it was a
    # UnicodeDecodeError here. Such a name reaches the server as those bytes (the frames carry
    # no lone surrogate) and finds no model: a load fails as for any unknown name, an unload
    # does nothing, and its error comes back (escaped) rather than leave the model waiting.
    ready = act(explicit, "ready", model_hex="fffe")
    assert ready["error"] is None and ready["ready"] is False
    loaded = act(explicit, "load", model_hex="fffe")
    assert loaded["error_type"] == "TritonModelException", loaded
    assert loaded["error"] == "Request for unknown model: '\\udcff\\udcfe' is not found"
    unloaded = act(explicit, "unload", model_hex="fffe")
    assert unloaded["error"] is None and unloaded["ready"] is False
    # UTF-8 bytes are the model of that name.
    assert act(explicit, "load", model_hex=b"lazy_target".hex())["ready"] is True


def test_a_version_that_is_no_number_is_named(explicit) -> None:
    # It was an INTERNAL error from int(): "invalid literal for int() with base 10: 'abc'".
    report = act(explicit, "ready", version="abc")
    assert report["error_type"] == "TritonModelException", report
    assert report["error"] == \
        "is_model_ready: model_version must be a version number, got 'abc'", report
    assert act(explicit, "ready", version="1")["error"] is None


def test_load_model_in_initialize(explicit) -> None:
    assert act(explicit, "ready")["ready"] is False
    explicit.load("load_in_init")
    assert explicit.model("lazy_target").ready()
    resp = infer_one(explicit, "load_in_init", {"INPUT0": np.array([4.0], np.float32)})
    assert resp.error is None
    assert resp.outputs["OUTPUT0"].to_numpy().tolist() == [12.0]


@pytest.mark.parametrize("mode", ["none", "poll"])
def test_load_and_unload_need_explicit_mode(repo, mode: str) -> None:
    with serve(repo, new_prefix(), model_control_mode=mode) as srv:
        assert srv.model("add_sub").ready()
        for action, model in (("load", "lazy_target"), ("unload", "add_sub")):
            report = act(srv, action, model=model)
            assert report["error_type"] == "TritonModelException", report
            assert "explicit" in report["error"]
        # nothing changed, and is_model_ready works in any mode
        assert act(srv, "ready", model="add_sub")["ready"] is True
        assert srv.model("add_sub").ready()
