"""Python-based backends (Triton's ``backend: "<name>"`` served by
``<backend directory>/<name>/model.py``, as the vLLM backend is): the models of such a backend
run its one model.py, imported as Triton 2.51 imports it. Every expected value marked
"measured" is what Triton 2.51 (the anchor, ``--backend-directory`` with the same backend
folder beside its python backend) answered for the same files.
"""
from __future__ import annotations

import json
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import tritonclient.http as httpclient
from _models import serving, write_model
from _serve import Serve, serve_repo
from tritonclient.utils import InferenceServerException

from tritonpy import InvalidArgumentError
from tritonpy.testing import ModelRunner

# The backend's model.py: it reports where and how it was imported, and what it was given.
BACKEND_PY = """
import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

try:
    import helper  # beside this file in the backend's folder
    HELPER = helper.WHO
except ImportError as exc:
    HELPER = f"no helper: {exc}"
try:
    import vhelper  # in the model's version directory
    VHELPER = vhelper.WHO
except ImportError as exc:
    VHELPER = f"no vhelper: {exc}"


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(cfg):
        cfg.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [-1]})
        cfg.add_output({"name": "OUT", "data_type": "TYPE_STRING", "dims": [-1]})
        return cfg

    def initialize(self, args):
        config = json.loads(args.pop("model_config"))
        greeting = config["parameters"].get("GREETING", {}).get("string_value", "")
        self.info = {**args, "file": __file__, "module": __name__, "package": __package__,
                     "helper": HELPER, "vhelper": VHELPER,
                     "model_dir": pb_utils.get_model_dir(), "greeting": greeting,
                     "backend_on_path": os.path.dirname(__file__) in sys.path}

    def execute(self, requests):
        out = np.array([json.dumps(self.info).encode()], dtype=object)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]) for _ in requests]
"""

# A model.py in a version directory of a backend's model: never imported (as Triton).
IGNORED_PY = """
raise RuntimeError("the version directory's model.py must not be imported")
"""

# Triton 2.51's configuration of model 'm4' below (measured): auto-completed by the backend's
# model.py, its runtime kept as given and not used.
TRITON_M4_CONFIG = {
    "name": "m4", "platform": "", "backend": "mybe", "runtime": "other.py",
    "version_policy": {"latest": {"num_versions": 1}}, "max_batch_size": 0,
    "input": [{"name": "IN", "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [-1],
               "is_shape_tensor": False, "allow_ragged_batch": False, "optional": False,
               "is_non_linear_format_io": False}],
    "output": [{"name": "OUT", "data_type": "TYPE_STRING", "dims": [-1], "label_filename": "",
                "is_shape_tensor": False, "is_non_linear_format_io": False}],
    "batch_input": [], "batch_output": [],
    "optimization": {"priority": "PRIORITY_DEFAULT", "input_pinned_memory": {"enable": True},
                     "output_pinned_memory": {"enable": True},
                     "gather_kernel_buffer_threshold": 0, "eager_batching": False},
    "instance_group": [{"name": "m4", "kind": "KIND_CPU", "count": 1, "gpus": [],
                        "secondary_devices": [], "profile": [], "passive": False,
                        "host_policy": ""}],
    "default_model_filename": "", "cc_model_filenames": {}, "metric_tags": {},
    "parameters": {}, "model_warmup": [],
}

NO_BACKEND = ("Invalid argument: unable to find backend library for backend '{name}', try "
              "specifying runtime on the model configuration.")  # Triton 2.51's words


def _backends(root: Path) -> Path:
    """A backend directory holding the Python-based backend 'mybe' and a folder 'empty'."""
    backends = root / "backends"
    (backends / "mybe").mkdir(parents=True)
    (backends / "mybe" / "model.py").write_text(textwrap.dedent(BACKEND_PY))
    (backends / "mybe" / "helper.py").write_text('WHO = "backend helper"\n')
    (backends / "empty").mkdir()
    (backends / "empty" / "README").write_text("no model.py here\n")
    return backends


def _repo(root: Path) -> Path:
    repo = root / "repo"
    write_model(repo, "a", IGNORED_PY, 'backend: "mybe"\n'
                'parameters { key: "GREETING" value { string_value: "hello" } }\n',
                files={"vhelper.py": 'WHO = "version helper"\n'})
    write_model(repo, "b", IGNORED_PY, 'backend: "mybe"\n'
                'parameters { key: "GREETING" value { string_value: "salut" } }\n', versions=(3,))
    write_model(repo, "m4", IGNORED_PY, 'backend: "mybe"\nruntime: "other.py"\n')
    write_model(repo, "nope", IGNORED_PY, 'backend: "nope"\n')
    write_model(repo, "empty", IGNORED_PY, 'backend: "empty"\n')
    return repo


def _info(response: Any) -> dict:
    return json.loads(response.outputs["OUT"].to_numpy()[0])


def test_models_of_a_python_based_backend_run_its_model_py(tmp_path: Path, shm_prefix: str):
    backends, repo = _backends(tmp_path), _repo(tmp_path)
    with serving(repo, shm_prefix, model_control_mode="explicit", load_models=["a", "b"],
                 backend_directory=str(backends)) as srv:
        got = {m: _info(srv.model(m).infer({"IN": np.ones(1, np.float32)}).get(timeout=30))
               for m in ("a", "b")}
    for name, version, greeting in (("a", 1, "hello"), ("b", 3, "salut")):
        info = got[name]
        # As Triton 2.51 (measured): the backend's model.py as the top-level module "model",
        # its folder importable, the model's folders not; args and get_model_dir() are the
        # model's own.
        assert info["file"] == str(backends / "mybe" / "model.py")
        assert (info["module"], info["package"]) == ("model", "")
        assert info["helper"] == "backend helper"
        assert info["vhelper"].startswith("no vhelper: No module named 'vhelper'")
        assert info["backend_on_path"] is True
        assert info["model_dir"] == str(repo / name / str(version))
        assert (info["model_name"], info["model_version"], info["model_repository"]) == (
            name, str(version), str(repo / name))
        assert info["model_instance_name"] == f"{name}_0"
        # One model.py, each model with its own configuration.
        assert info["greeting"] == greeting


def test_a_missing_backend_fails_that_model_only(tmp_path: Path, shm_prefix: str):
    backends, repo = _backends(tmp_path), _repo(tmp_path)
    with serving(repo, shm_prefix, model_control_mode="explicit", load_models=["a"],
                 backend_directory=str(backends)) as srv:
        for name in ("nope", "empty"):
            with pytest.raises(InvalidArgumentError) as err:
                srv.load(name)
            # Triton's words (measured), then where tritonpy looked.
            assert (f"version 1 is at UNAVAILABLE state: {NO_BACKEND.format(name=name)} "
                    in err.value.message)
            assert str(backends / name / "model.py") in err.value.message
        assert srv.model("a").ready()
        assert _info(srv.model("a").infer({"IN": np.ones(1, np.float32)}).get(timeout=30))[
            "greeting"] == "hello"


def test_backend_directory_defaults_to_tritons(tmp_path: Path, shm_prefix: str):
    repo = _repo(tmp_path)
    with serving(repo, shm_prefix, model_control_mode="explicit") as srv:
        assert srv.backend_directory == "/opt/tritonserver/backends"
        with pytest.raises(InvalidArgumentError, match="found no /opt/tritonserver/backends/mybe/model.py"):
            srv.load("a")


def test_serve_with_backend_directory(serve: Callable[..., Serve], tmp_path: Path):
    backends, repo = _backends(tmp_path), _repo(tmp_path)
    server, http_port, _ = serve_repo(serve, repo, "--model-control-mode=explicit",
                                      "--load-model=a", "--load-model=m4",
                                      f"--backend-directory={backends}")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    try:
        assert client.get_model_config("m4") == TRITON_M4_CONFIG
        config = client.get_model_config("a")
        assert (config["backend"], config["runtime"], config["default_model_filename"]) == (
            "mybe", "model.py", "")  # as Triton 2.51 fills them (measured)
        assert client.get_model_metadata("a")["platform"] == "mybe"  # measured
        inp = httpclient.InferInput("IN", [1], "FP32")
        inp.set_data_from_numpy(np.ones(1, np.float32))
        out = client.infer("a", [inp]).as_numpy("OUT")
        assert json.loads(out[0])["greeting"] == "hello"
        with pytest.raises(InferenceServerException, match="unable to find backend library"):
            client.load_model("nope")
        rows = {r["name"]: r for r in client.get_model_repository_index()}
        assert rows["nope"]["state"] == "UNAVAILABLE"
        assert rows["nope"]["reason"].startswith(NO_BACKEND.format(name="nope"))
    finally:
        client.close()
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0


def test_model_runner_finds_the_backend(tmp_path: Path):
    backends, repo = _backends(tmp_path), _repo(tmp_path)
    with ModelRunner(repo / "a", backend_directory=backends) as runner:
        response = runner.execute([{"IN": np.ones(1, np.float32)}])[0]
        info = json.loads(response.output_tensors()[0].as_numpy()[0])
    assert info["file"] == str(backends / "mybe" / "model.py")
    assert (info["greeting"], info["helper"]) == ("hello", "backend helper")
    # Closed, it leaves no module of the backend's folder behind (another model's helper of
    # the same name imports afresh), nor the folder on the path.
    assert getattr(sys.modules.get("helper"), "__file__", None) != str(
        backends / "mybe" / "helper.py")
    assert str(backends / "mybe") not in sys.path
