"""Model warmup (``model_warmup``) with real stubs: what each instance's execute receives before
the model is ready, the statistics it leaves, and how a failing warmup fails the load. The
expected calls are what Triton 2.51 made on the same model (checked side by side)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

import tritonpy
from _models import new_prefix, serving, write_model
from tritonpy.shm.dtypes import serialize_bytes

# Logs every request it executes, one JSON line per request, to <log dir>/<instance>.jsonl.
LOGGING_PY = """
    import json, os
    import numpy as np
    import triton_python_backend_utils as pb_utils

    LOG_DIR = %(log_dir)r

    class TritonPythonModel:
        def initialize(self, args):
            self.inst = args["model_instance_name"]

        def execute(self, requests):
            out = []
            for r in requests:
                a = pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
                s = pb_utils.get_input_tensor_by_name(r, "S").as_numpy()
                with open(os.path.join(LOG_DIR, self.inst + ".jsonl"), "a") as f:
                    f.write(json.dumps({"batch": len(requests), "A": a.tolist(), "A_dtype": str(a.dtype),
                                        "S": [x.decode() for x in s.ravel()], "S_shape": list(s.shape)}) + "\\n")
                if os.path.exists(os.path.join(LOG_DIR, "fail")):
                    raise RuntimeError("warmup boom")
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", a)]))
            return out
    """

CONFIG = """
    backend: "python"
    max_batch_size: 4
    input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "S" data_type: TYPE_STRING dims: [ 1 ] } ]
    output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
    instance_group [ { count: 2 kind: KIND_CPU } ]
    model_warmup [
      { name: "zeros" batch_size: 2 count: 3
        inputs { key: "A" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }
        inputs { key: "S" value: { data_type: TYPE_STRING dims: [ 1 ] zero_data: true } } },
      { name: "files" batch_size: 1
        inputs { key: "A" value: { data_type: TYPE_FP32 dims: [ 4 ] input_data_file: "a.bin" } }
        inputs { key: "S" value: { data_type: TYPE_STRING dims: [ 1 ] input_data_file: "s.bin" } } },
      { name: "random" batch_size: 1
        inputs { key: "A" value: { data_type: TYPE_FP32 dims: [ 4 ] random_data: true } }
        inputs { key: "S" value: { data_type: TYPE_STRING dims: [ 1 ] random_data: true } } }
    ]
    """


def write_warmup_model(repo: Path, log_dir: Path, config: str = CONFIG) -> None:
    mdir = write_model(repo, "wm", LOGGING_PY % {"log_dir": str(log_dir)}, config)
    (mdir / "warmup").mkdir()
    np.arange(4, dtype=np.float32).tofile(mdir / "warmup" / "a.bin")
    (mdir / "warmup" / "s.bin").write_bytes(serialize_bytes(np.array([b"from file"], dtype=object)))


def calls(log_dir: Path, instance: str) -> list[dict]:
    path = log_dir / f"{instance}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_each_instance_runs_every_sample_before_the_model_is_ready(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    write_warmup_model(tmp_path / "repo", log_dir)
    caplog.set_level(logging.DEBUG, logger="tritonpy")
    with serving(tmp_path / "repo", new_prefix()) as server:
        # Triton's verbose line for each iteration of each sample on each instance, word for
        # word (QA L0_warmup looks for it; tritonpy logged nothing).
        said = [r.getMessage() for r in caplog.records if "warmup sample" in r.getMessage()]
        for instance in ("wm_0_0", "wm_0_1"):
            mine = [m for m in said if f" instance {instance} " in m]
            assert mine == [f"model 'wm' instance {instance} is running warmup sample '{name}' "
                            f"for iteration {i}"
                            for name, i in (("zeros", 1), ("zeros", 2), ("zeros", 3),
                                            ("files", 1), ("random", 1))]
        zeros = {"batch": 2, "A": [[0.0] * 4], "A_dtype": "float32", "S": [""], "S_shape": [1, 1]}
        from_file = {"batch": 1, "A": [[0.0, 1.0, 2.0, 3.0]], "A_dtype": "float32", "S": ["from file"],
                     "S_shape": [1, 1]}
        for instance in ("wm_0_0", "wm_0_1"):
            seen = calls(log_dir, instance)
            # 3 executes of 2 requests, then the file sample, then the random one.
            assert seen[:7] == [zeros] * 6 + [from_file]
            assert len(seen) == 8 and seen[7]["batch"] == 1 and seen[7]["S"] == [""]
            assert all(0.0 <= v < 1.0 for v in seen[7]["A"][0])
        stats = server.statistics("wm")["model_stats"][0]
        # Warmup counts in the statistics, as in Triton: 2 instances x (6 + 1 + 1) requests
        # in 2 x (3 + 1 + 1) executes.
        assert (stats["inference_count"], stats["execution_count"]) == (16, 10)
        out = server.model("wm").infer({"A": np.ones((1, 4), np.float32), "S": np.array([[b"x"]], dtype=object)})
        assert next(iter(out)).outputs["OUT"].to_numpy().tolist() == [[1.0] * 4]


@pytest.mark.parametrize("setup, message", [
    ("raise", "failed to run warmup sample 'zeros': Failed to process the request(s) for model "
              "'wm_0_0', message: RuntimeError: warmup boom"),
    ("short file", "failed to run warmup sample 'files': warmup setting 'files': input 'A' expects "
                   "16 bytes, but the data provided from 'a.bin' has 8 bytes"),
    ("missing file", "failed to run warmup sample 'files': warmup setting 'files': input 'A': "
                     "cannot read 'a.bin': No such file or directory"),
])
def test_a_failing_warmup_fails_the_load(tmp_path: Path, setup: str, message: str) -> None:
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    repo = tmp_path / "repo"
    config = CONFIG.replace("count: 2", "count: 1")  # one instance: one message to expect
    write_warmup_model(repo, log_dir, config)
    if setup == "raise":
        (log_dir / "fail").touch()
    elif setup == "short file":
        np.arange(2, dtype=np.float32).tofile(repo / "wm" / "warmup" / "a.bin")
    else:
        (repo / "wm" / "warmup" / "a.bin").unlink()
    with serving(repo, new_prefix(), model_control_mode="explicit") as server:
        with pytest.raises(tritonpy.TritonpyError) as info:
            server.load("wm")
        assert message in str(info.value)
        assert not server.model("wm").ready()


DECOUPLED_PY = """
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            for r in requests:
                n = int(pb_utils.get_input_tensor_by_name(r, "N").as_numpy()[0])
                s = r.get_response_sender()
                for i in range(n):
                    if n == 3 and i == 2:
                        s.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("third fails")))
                    else:
                        s.send(pb_utils.InferenceResponse([pb_utils.Tensor("I", np.array([i], np.int32))]))
                s.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
    """
DECOUPLED_CONFIG = """
    backend: "python"
    max_batch_size: 0
    model_transaction_policy { decoupled: true }
    input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
    output [ { name: "I" data_type: TYPE_INT32 dims: [ 1 ] } ]
    model_warmup [ { name: "stream" batch_size: 1
        inputs { key: "N" value: { data_type: TYPE_INT32 dims: [ 1 ] input_data_file: "n.bin" } } } ]
    """


@pytest.mark.parametrize("n, message", [(2, None), (3, "failed to run warmup sample 'stream': third fails")])
def test_decoupled_warmup_waits_for_the_stream_and_fails_on_an_error_response(
        tmp_path: Path, n: int, message: str | None) -> None:
    mdir = write_model(tmp_path / "repo", "dec", DECOUPLED_PY, DECOUPLED_CONFIG)
    (mdir / "warmup").mkdir()
    np.array([n], np.int32).tofile(mdir / "warmup" / "n.bin")
    with serving(tmp_path / "repo", new_prefix(), model_control_mode="explicit") as server:
        if message is None:
            server.load("dec")
            stats = server.statistics("dec")["model_stats"][0]
            assert (stats["inference_count"], stats["execution_count"]) == (1, 1)
        else:
            with pytest.raises(tritonpy.TritonpyError, match=message):
                server.load("dec")


# One input A of FP32[4]; logs the inputs each request brings (an extra warmup input too).
NAMES_PY = """
    import json, os
    import numpy as np
    import triton_python_backend_utils as pb_utils

    LOG_DIR = %(log_dir)r

    class TritonPythonModel:
        def execute(self, requests):
            with open(os.path.join(LOG_DIR, "calls.jsonl"), "a") as f:
                for r in requests:
                    f.write(json.dumps({t.name(): t.as_numpy().ravel().tolist()
                                        for t in r.inputs()}) + "\\n")
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", pb_utils.get_input_tensor_by_name(r, "A").as_numpy())]) for r in requests]
    """


def _sample_config(max_batch_size: int, batch_size: int, inputs: str) -> str:
    return (f'backend: "python"\nmax_batch_size: {max_batch_size}\n'
            'input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
            'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
            f'model_warmup [ {{ name: "s" batch_size: {batch_size} {inputs} }} ]\n')


ZEROS = 'inputs { key: "A" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }'


@pytest.mark.parametrize("max_batch_size, batch_size", [(2, 4), (0, 2)])
def test_a_warmup_batch_past_max_batch_size_fails_the_load(tmp_path: Path, max_batch_size: int,
                                                           batch_size: int,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    # Triton 2.51 (measured): each request of the sample fails with "batch size N for
    # '<instance>', max allowed is M" and the load fails with them; the model runs nothing.
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    write_model(tmp_path / "repo", "wb", NAMES_PY % {"log_dir": str(log_dir)},
                _sample_config(max_batch_size, batch_size, ZEROS))
    with serving(tmp_path / "repo", new_prefix(), model_control_mode="explicit") as server, \
            caplog.at_level(logging.ERROR, logger="tritonpy"):
        with pytest.raises(tritonpy.TritonpyError) as info:
            server.load("wb")
    # A load that fails through the API is in the server's log too, as Triton's.
    assert f"failed to load 'wb': {info.value.message}" in caplog.text
    one = f"batch size {batch_size} for 'wb_0', max allowed is {max_batch_size}; "
    assert f"failed to run warmup sample 's': {one}" in str(info.value), str(info.value)
    assert str(info.value).count(one) == batch_size, str(info.value)
    assert not (log_dir / "calls.jsonl").exists()


def test_a_sample_of_batch_size_0_runs_nothing(tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    write_model(tmp_path / "repo", "wb", NAMES_PY % {"log_dir": str(log_dir)},
                _sample_config(4, 0, ZEROS))
    with serving(tmp_path / "repo", new_prefix()) as server:
        assert server.model("wb").ready()
        assert server.statistics("wb")["model_stats"][0]["execution_count"] == 0
    assert not (log_dir / "calls.jsonl").exists()


def test_an_extra_input_and_a_longer_file_load_as_in_triton(tmp_path: Path) -> None:
    # Triton 2.51 (measured): a warmup input the config does not name reaches the model as it
    # is, and a data file longer than the input gives its first bytes.
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    inputs = ('inputs { key: "A" value: { data_type: TYPE_FP32 dims: [ 4 ] '
              'input_data_file: "a.bin" } } '
              'inputs { key: "X" value: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } }')
    mdir = write_model(tmp_path / "repo", "wb", NAMES_PY % {"log_dir": str(log_dir)},
                       _sample_config(4, 1, inputs))
    (mdir / "warmup").mkdir()
    np.arange(8, dtype=np.float32).tofile(mdir / "warmup" / "a.bin")  # 32 bytes for 16
    with serving(tmp_path / "repo", new_prefix()) as server:
        assert server.model("wb").ready()
    (call,) = [json.loads(line) for line in (log_dir / "calls.jsonl").read_text().splitlines()]
    assert call == {"A": [0.0, 1.0, 2.0, 3.0], "X": [0.0]}
