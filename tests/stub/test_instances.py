"""Several instances of one model: one stub process each, named ``<model>_<group>_<index>``,
serving at the same time.

Concurrency is proven by a barrier, not by timing: each request registers its instance in a
directory and waits until as many requests as there are instances have registered. Had the
instances not run at the same time, the first request would never see the others and fail.
"""
from __future__ import annotations

import json
import logging

import pytest
from tritonclient.grpc import model_config_pb2

import tritonpy
from _models import fp32, io_config, serving, stub_processes, wait_for, write_model
from tritonpy._model import ModelRuntime
from tritonpy.config import config_from_dict, config_to_json, normalize_config

pytestmark = pytest.mark.timeout(60)

BARRIER_PY = '''
import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = {k: v for k, v in args.items() if k != "model_config"}

    def execute(self, requests):
        name = self.args["model_instance_name"]
        out = []
        for r in requests:
            p = json.loads(r.parameters())
            d, n = p["barrier"], int(p["n"])
            open(os.path.join(d, f"{name}.{os.getpid()}"), "w").close()
            print(f"serving a request in {name}")
            deadline = time.monotonic() + 15
            while len(os.listdir(d)) < n:
                if time.monotonic() > deadline:
                    raise pb_utils.TritonModelException(
                        f"{name}: barrier timed out with {sorted(os.listdir(d))}")
                time.sleep(0.005)
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", x * 2)],
                parameters={"pid": os.getpid(), "peers": json.dumps(sorted(os.listdir(d))),
                            "cvd": os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
                            **self.args}))
        return out
'''


def run_barrier(model: tritonpy.Model, n: int, barrier) -> list[dict]:
    """``n`` requests that can only finish together; their response parameters."""
    barrier.mkdir()
    streams = [model.infer({"IN": fp32(i)}, parameters={"barrier": str(barrier), "n": n})
               for i in range(n)]
    out = []
    for i, s in enumerate(streams):
        r = s.get(timeout=30)
        assert r.error is None, r.error
        assert r.outputs["OUT"].to_numpy().tolist() == [2 * i]
        out.append(r.parameters)
    return out


@pytest.mark.parametrize("count", [2, 4])
def test_instances_serve_concurrently(tmp_path, shm_prefix, caplog, count):
    caplog.set_level(logging.INFO, logger="tritonpy.model.multi")
    repo = tmp_path / "repo"
    write_model(repo, "multi", BARRIER_PY,
                io_config(extra=f"instance_group [ {{ count: {count}, kind: KIND_CPU }} ]\n"))
    with serving(repo, shm_prefix) as srv:
        stubs = {p.pid for p in stub_processes()}
        assert len(stubs) == count
        got = run_barrier(srv.model("multi"), count, tmp_path / "barrier")
        names = [f"multi_0_{i}" for i in range(count)]
        assert sorted(p["model_instance_name"] for p in got) == names
        assert {p["pid"] for p in got} == stubs  # one process per instance, all of them
        for p in got:  # every request saw all the others arrive while it waited
            assert len(json.loads(p["peers"])) == count
            assert p["model_instance_kind"] == "CPU"
            assert p["model_instance_device_id"] == "0"
        # print() in each instance reaches the host log tagged with model and instance
        for name in names:
            assert wait_for(lambda: any(
                r.name == "tritonpy.model.multi"
                and r.getMessage() == f"[{name}] serving a request in {name}"
                for r in caplog.records), timeout=5), name


def test_instance_names_and_kinds_across_groups(tmp_path, shm_prefix):
    repo = tmp_path / "repo"
    write_model(repo, "grouped", BARRIER_PY, io_config(extra=(
        'instance_group [ { count: 2, kind: KIND_CPU },'
        ' { name: "solo", count: 1, kind: KIND_MODEL } ]\n')))
    with serving(repo, shm_prefix) as srv:
        got = run_barrier(srv.model("grouped"), 3, tmp_path / "barrier")
        assert sorted((p["model_instance_name"], p["model_instance_kind"],
                       p["model_instance_device_id"]) for p in got) == [
            ("grouped_0_0", "CPU", "0"), ("grouped_0_1", "CPU", "0"), ("solo_0", "MODEL", "0")]
        assert len({p["pid"] for p in got}) == 3


def test_gpu_instances_are_refused_on_a_host_without_gpus(tmp_path, shm_prefix, monkeypatch):
    # A host with no GPU (forced, so that the test means the same on a GPU machine): a
    # KIND_GPU group fails that model's load, clearly; others load.
    monkeypatch.setenv("TRITONPY_GPU_COUNT", "0")
    repo = tmp_path / "repo"
    write_model(repo, "gpu", BARRIER_PY,
                io_config(extra="instance_group [ { count: 1, kind: KIND_GPU } ]\n"))
    write_model(repo, "cpu", BARRIER_PY)
    with serving(repo, shm_prefix) as srv:
        status = {m["name"]: m for m in srv.models()}
        assert status["cpu"]["state"] == "READY"
        assert status["gpu"]["state"] == "UNAVAILABLE"
        assert "instance group gpu_0 of model gpu has kind KIND_GPU but no GPUs are available" \
            in status["gpu"]["reason"]
        assert len(stub_processes()) == 1


def test_gpu_instances_each_see_only_their_own_device(tmp_path, shm_prefix, monkeypatch):
    # No GPU can exist on this machine: TRITONPY_GPU_COUNT stands in for the count nvidia-smi
    # would report (the one thing mocked). The rest is real: one stub per device, each started
    # with CUDA_VISIBLE_DEVICES naming only its own device, mapped through the host's list.
    monkeypatch.setenv("TRITONPY_GPU_COUNT", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    repo = tmp_path / "repo"
    write_model(repo, "g", BARRIER_PY, io_config(
        extra="instance_group [ { count: 1, kind: KIND_GPU, gpus: [ 0, 1 ] } ]\n"))
    with serving(repo, shm_prefix) as srv:
        got = run_barrier(srv.model("g"), 2, tmp_path / "barrier")
    assert sorted((p["model_instance_name"], p["model_instance_kind"],
                   p["model_instance_device_id"], p["cvd"]) for p in got) == [
        ("g_0_0", "GPU", "0", "5"), ("g_0_1", "GPU", "1", "7")]
    assert len({p["pid"] for p in got}) == 2


def _instances(groups: str, gpu_count: int) -> list[tuple[str, str, int, dict]]:
    """Instances (name, kind, device, initialize args) a config gives, without starting them."""
    text = io_config() + f"instance_group {groups}\n"
    cfg = normalize_config(config_from_dict(_parse(text)), "g", "config.pbtxt",
                           gpu_count=gpu_count)
    rt = ModelRuntime(None, "g", 1, cfg, config_to_json(cfg), "/repo/g",
                      {"model_file": "/repo/g/1/model.py", "version_dir": "/repo/g/1"})
    return [(i.name, i.kind, i.device_id, rt._initialize_args(i)) for i in rt.instances]


def _parse(text: str) -> dict:
    from google.protobuf import json_format, text_format

    msg = text_format.Parse(text, model_config_pb2.ModelConfig())
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def test_gpu_and_model_kind_instance_naming_from_config():
    # GPU kinds cannot run here (no GPU): this checks the configuration handling only.
    got = _instances("[ { count: 2, kind: KIND_GPU, gpus: [ 0, 1 ] },"
                     " { count: 1, kind: KIND_MODEL },"
                     " { name: \"c\", count: 2, kind: KIND_CPU } ]", 2)
    assert [(n, k, d) for n, k, d, _ in got] == [
        ("g_0_0", "GPU", 0), ("g_0_1", "GPU", 0), ("g_0_2", "GPU", 1), ("g_0_3", "GPU", 1),
        ("g_1_0", "MODEL", 0), ("c_0", "CPU", 0), ("c_1", "CPU", 0)]
    args = got[2][3]
    assert (args["model_instance_name"], args["model_instance_kind"],
            args["model_instance_device_id"]) == ("g_0_2", "GPU", "1")
    assert set(args) == {"model_config", "model_instance_kind", "model_instance_name",
                         "model_instance_device_id", "model_repository", "model_version",
                         "model_name"}
    # KIND_GPU without gpus takes every visible GPU; KIND_AUTO becomes GPU only where GPUs exist
    assert [(n, k, d) for n, k, d, _ in _instances("[ { kind: KIND_GPU } ]", 2)] == [
        ("g_0_0", "GPU", 0), ("g_0_1", "GPU", 1)]
    assert [(n, k) for n, k, _, _ in _instances("[ { count: 2 } ]", 0)] == [
        ("g_0_0", "CPU"), ("g_0_1", "CPU")]
    with pytest.raises(tritonpy.ConfigError, match="no GPUs are available"):
        _instances("[ { kind: KIND_GPU } ]", 0)
    assert [n for n, _, _, _ in _instances("[ { count: 3, kind: KIND_MODEL } ]", 0)] == [
        "g_0_0", "g_0_1", "g_0_2"]
