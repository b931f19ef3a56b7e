"""tritonpy.testing.ModelRunner: a model's initialize/execute/finalize in this interpreter."""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import triton_python_backend_utils as pb_utils

from _models import write_model
from tritonpy import ConfigError, InternalError, InvalidArgumentError
from tritonpy.config import config_to_json, load_model_config, normalize_config
from tritonpy.stub import pb_utils as stub_pb_utils
from tritonpy.testing import ModelRunner

pytestmark = pytest.mark.timeout(30)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

RECORDER_PY = """
import json
import triton_python_backend_utils as pb_utils
import helper

SEEN = {}

class TritonPythonModel:
    def initialize(self, args):
        SEEN["args"] = dict(args)
        self.cfg = json.loads(args["model_config"])

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", x * helper.FACTOR)],
                parameters={"rid": r.request_id(), "params": r.parameters(),
                            "requested": json.dumps(sorted(r.requested_output_names()))}))
        return out

    def finalize(self):
        SEEN["finalized"] = True
"""


def _recorder(tmp_path: Path, factor: int = 3, name: str = "rec") -> Path:
    return write_model(tmp_path, name, RECORDER_PY,
                       files={"helper.py": f"FACTOR = {factor}\n"})


def test_add_sub_example():
    a = np.arange(4, dtype=np.float32)
    b = np.ones(4, dtype=np.float32)
    with ModelRunner(EXAMPLES / "add_sub") as runner:
        responses = runner.execute([{"INPUT0": a, "INPUT1": b}, {"INPUT0": b, "INPUT1": a}])
    assert len(responses) == 2
    assert all(isinstance(r, pb_utils.InferenceResponse) for r in responses)
    out0 = pb_utils.get_output_tensor_by_name(responses[0], "OUTPUT0").as_numpy()
    out1 = pb_utils.get_output_tensor_by_name(responses[1], "OUTPUT1").as_numpy()
    np.testing.assert_array_equal(out0, a + b)
    np.testing.assert_array_equal(out1, b - a)


def test_initialize_args_are_tritons(tmp_path):
    mdir = _recorder(tmp_path)
    with ModelRunner(mdir) as runner:
        args = runner.module.SEEN["args"]
    cfg, _ = load_model_config(str(mdir))
    expected_json = config_to_json(normalize_config(cfg, "rec", str(mdir / "config.pbtxt")))
    assert args == {
        "model_config": expected_json,
        "model_instance_kind": "CPU",
        "model_instance_name": "rec_0_0",
        "model_instance_device_id": "0",
        "model_repository": str(mdir),
        "model_version": "1",
        "model_name": "rec",
    }
    assert runner.config == json.loads(expected_json)
    assert runner.module.SEEN["finalized"] is True


def test_model_file_path_version_and_instance_name(tmp_path):
    mdir = write_model(tmp_path, "rec", RECORDER_PY, versions=(1, 4),
                       files={"helper.py": "FACTOR = 2\n"})
    with ModelRunner(mdir / "4" / "model.py", instance_name="rec_1_3") as runner:
        assert runner.args["model_version"] == "4"
        assert runner.args["model_instance_name"] == "rec_1_3"
        assert runner.args["model_repository"] == str(mdir)
    with ModelRunner(mdir, version=4) as runner:
        assert runner.model_file == str(mdir / "4" / "model.py")


def test_request_fields_and_requested_outputs(tmp_path):
    with ModelRunner(_recorder(tmp_path)) as runner:
        req = runner.request({"IN": np.ones(2, np.float32)}, ["OUT"], request_id="r1",
                             correlation_id="seq", flags=1, parameters={"k": 1})
        assert isinstance(req, pb_utils.InferenceRequest)
        assert (req.request_id(), req.correlation_id(), req.flags()) == ("r1", "seq", 1)
        assert req.model_name() == "rec"
        [resp] = runner.execute([req])
    assert resp.parameters() == json.dumps(
        {"rid": "r1", "params": '{"k":1}', "requested": json.dumps(["OUT"])})  # compact, as Triton
    np.testing.assert_array_equal(
        pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy(), [3, 3])


def test_config_given_as_dict_or_pbtxt(tmp_path):
    mdir = write_model(tmp_path, "rec", RECORDER_PY, config="",
                       files={"helper.py": "FACTOR = 1\n"})
    pbtxt = ('backend: "python"\ninput [{name: "IN", data_type: TYPE_FP32, dims: [2]}]\n'
             'output [{name: "OUT", data_type: TYPE_FP32, dims: [2]}]\n')
    with ModelRunner(mdir, config=pbtxt) as runner:
        assert runner.config["input"][0]["dims"] == [2]
        with pytest.raises(InvalidArgumentError, match="unexpected shape for input 'IN'"):
            runner.execute([{"IN": np.ones(3, np.float32)}])
    as_dict = {"backend": "python", "max_batch_size": 4,
               "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [-1]}],
               "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [-1]}]}
    with ModelRunner(mdir, config=as_dict) as runner:
        assert runner.config["max_batch_size"] == 4
        [resp] = runner.execute([{"IN": np.ones((2, 5), np.float32)}])
        assert pb_utils.get_output_tensor_by_name(resp, "OUT").shape() == [2, 5]



@pytest.mark.parametrize("config, message", [
    ("{bad", "ModelRunner(config=...): invalid JSON model configuration: "),
    ('backend: "python"\nbogus: 1', "ModelRunner(config=...):2:1: invalid field 'bogus'"),
    ({"bogus": 1}, "ModelRunner(config=...): invalid field 'bogus'"),
    ({"max_batch_size": -3}, "ModelRunner(config=...): 'max_batch_size' must be non-negative"),
])
def test_errors_in_a_config_given_name_the_argument_not_the_file(tmp_path, config, message):
    # They named <model>/config.pbtxt, which was not read (and here does not exist).
    mdir = write_model(tmp_path, "rec", RECORDER_PY, config="",
                       files={"helper.py": "FACTOR = 1\n"})
    with pytest.raises(ConfigError) as err:
        ModelRunner(mdir, config=config)
    assert str(err.value).startswith(message), str(err.value)
    assert "config.pbtxt" not in str(err.value)
    (mdir / "config.pbtxt").write_text("bogus: 1\n")  # one read still names its file
    with pytest.raises(ConfigError) as err:
        ModelRunner(mdir)
    assert str(err.value).startswith(f"{mdir / 'config.pbtxt'}:1:1: invalid field 'bogus'")

def test_auto_complete_config_runs(tmp_path):
    src = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.set_max_batch_size(8)
        config.add_input({"name": "X", "data_type": "TYPE_INT32", "dims": [1]})
        config.add_output({"name": "Y", "data_type": "TYPE_INT32", "dims": [1]})
        config.set_model_transaction_policy({"decoupled": False})
        return config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() + 1)]) for r in requests]
"""
    mdir = write_model(tmp_path, "auto", src, config="")
    with ModelRunner(mdir) as runner:
        assert runner.config["max_batch_size"] == 8
        assert [i["name"] for i in runner.config["input"]] == ["X"]
        assert runner.config["model_transaction_policy"] == {"decoupled": False}
        [resp] = runner.execute([{"X": np.array([[1], [2]], np.int32)}])
        assert pb_utils.get_output_tensor_by_name(resp, "Y").as_numpy().tolist() == [[2], [3]]


def test_bytes_inputs_arrive_as_bytes():
    with ModelRunner(EXAMPLES / "string_upper") as runner:
        [resp] = runner.execute([{"TEXT": np.array(["abc", "héllo"])}])
    assert pb_utils.get_output_tensor_by_name(resp, "UPPER").as_numpy().tolist() == [
        b"ABC", "HÉLLO".encode()]
    assert pb_utils.get_output_tensor_by_name(resp, "LENGTH").as_numpy().tolist() == [3, 6]


def test_validation_errors_and_opt_out(tmp_path):
    mdir = _recorder(tmp_path)
    with ModelRunner(mdir) as runner:
        with pytest.raises(InvalidArgumentError, match="unexpected inference input 'NOPE'"):
            runner.execute([{"NOPE": np.ones(1, np.float32)}])
        with pytest.raises(InvalidArgumentError, match="expected 1 inputs but got 2 inputs"):
            runner.execute([{"IN": np.ones(1, np.float32), "NOPE": np.ones(1, np.float32)}])
        with pytest.raises(InvalidArgumentError, match="data-type is 'INT32'"):
            runner.execute([{"IN": np.ones(1, np.int32)}])
        with pytest.raises(InvalidArgumentError, match="unexpected inference output 'X'"):
            runner.execute([{"IN": np.ones(1, np.float32)}], requested_outputs=["X"])
        with pytest.raises(TypeError, match="list of requests"):
            runner.execute({"IN": np.ones(1, np.float32)})
    with ModelRunner(mdir, validate=False) as runner:
        [resp] = runner.execute([{"IN": np.ones(1, np.int32)}])
        assert pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy().dtype == np.int32



def test_arguments_of_the_wrong_type_are_named_at_the_call(tmp_path):
    # They were Python's own errors from deep inside ('int' object has no attribute 'items',
    # 'NoneType' object is not iterable), or (bls_handler) accepted, failing every BLS call.
    mdir = _recorder(tmp_path)
    with ModelRunner(mdir) as runner:
        with pytest.raises(InvalidArgumentError, match="^request 1 must be a dict of input "
                           "arrays or a pb_utils.InferenceRequest, not int$"):
            runner.execute([{"IN": np.ones(1, np.float32)}, 1])
        for requests in (None, 5):
            with pytest.raises(TypeError, match="^requests must be a list of requests "
                               f"\\(dicts of input arrays or pb_utils.InferenceRequest\\), not "
                               f"{type(requests).__name__}$"):
                runner.execute(requests)
        with pytest.raises(InvalidArgumentError, match="^inputs must be a mapping of input "
                           "names to arrays, not list$"):
            runner.request([np.ones(1, np.float32)])
        with pytest.raises(InvalidArgumentError, match="^requested_outputs must be a list of "
                           "output names, not int$"):
            runner.execute([{"IN": np.ones(1, np.float32)}], requested_outputs=3)
        [resp] = runner.execute(({"IN": np.ones(1, np.float32)} for _ in range(1)), ("OUT",))
        assert not resp.has_error()  # any iterable of requests and of names, as before
    with pytest.raises(TypeError, match="^bls_handler must be a callable, "
                       "handler\\(request, decoupled\\), or None, not int$"):
        ModelRunner(mdir, bls_handler=1)
    with pytest.raises(TypeError, match="^config must be None, a dict in Triton's JSON form or "
                       "config.pbtxt text \\(a str\\), not int$"):
        ModelRunner(mdir, config=123)

BAD_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        mode = pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()[0]
        if mode == 0:
            raise ValueError("model is unhappy")
        if mode == 1:
            return "not a list"
        if mode == 2:
            return []
        if mode == 3:
            return None
        return [object() for _ in requests]
"""


def test_execute_errors_are_reported_like_a_server(tmp_path):
    with ModelRunner(write_model(tmp_path, "bad", BAD_PY)) as runner:
        def run(mode):
            return runner.execute([{"IN": np.array([mode], np.float32)}])

        with pytest.raises(ValueError, match="model is unhappy"):
            run(0)
        with pytest.raises(InternalError, match="^Failed to process the request\\(s\\) for model "
                           "'bad_0_0', message: Expected a list in the execute return, "
                           "found type '<class 'str'>'.$"):
            run(1)
        with pytest.raises(InternalError, match="InferenceResponse\\(s\\) size is:0"):
            run(2)
        with pytest.raises(InternalError, match="returned None, but no response was sent"):
            run(3)
        with pytest.raises(InternalError, match="found type '<class 'object'>'"):
            run(4)


SENDER_PY = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(
            __import__("json").loads(args["model_config"]))

    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])
            if not self.decoupled:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUT", np.array([n], np.float32))]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue

            def stream(sender=sender, n=n):
                for i in range(n):
                    sender.send(pb_utils.InferenceResponse(
                        [pb_utils.Tensor("OUT", np.array([i], np.float32))]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            threading.Thread(target=stream).start()
        return None
"""


def test_response_sender_default_and_decoupled(tmp_path):
    default = write_model(tmp_path, "snd", SENDER_PY)
    with ModelRunner(default) as runner:
        [r1, r2] = runner.execute([{"IN": np.array([5], np.float32)},
                                   {"IN": np.array([6], np.float32)}])
        assert pb_utils.get_output_tensor_by_name(r2, "OUT").as_numpy().tolist() == [6]
    decoupled = write_model(tmp_path, "dec", SENDER_PY, config=(
        'backend: "python"\nmodel_transaction_policy { decoupled: true }\n'
        'input [{name: "IN", data_type: TYPE_FP32, dims: [1]}]\n'
        'output [{name: "OUT", data_type: TYPE_FP32, dims: [1]}]\n'))
    with ModelRunner(decoupled) as runner:
        streams = runner.execute_decoupled([{"IN": np.array([3], np.float32)},
                                            {"IN": np.array([0], np.float32)}])
        assert [[pb_utils.get_output_tensor_by_name(r, "OUT").as_numpy()[0] for r in s]
                for s in streams] == [[0, 1, 2], []]
        with pytest.raises(InternalError, match="decoupled"):
            runner.execute([{"IN": np.array([1], np.float32)}])


def test_execute_decoupled_on_a_default_model_says_which_method_to_use(tmp_path):
    # It said "Python model 'rec_0_0' is using the decoupled mode and the execute function
    # must return None", of a model that is not decoupled.
    with ModelRunner(_recorder(tmp_path)) as runner:
        with pytest.raises(InternalError) as err:
            runner.execute_decoupled([{"IN": np.ones(1, np.float32)}])
        assert str(err.value) == "model 'rec' is not decoupled: use ModelRunner.execute()"
        [resp] = runner.execute([{"IN": np.ones(1, np.float32)}])
        assert not resp.has_error()


LATE_SENDER_PY = """
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            n = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])
            if n < 0:  # answered the usual way
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUT", np.array([n], np.float32))]))
                continue
            sender = r.get_response_sender()

            def later(sender=sender, n=n):
                time.sleep(0.1)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUT", np.array([n], np.float32))]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            threading.Thread(target=later).start()
            out.append(None)
        return out
"""


def test_default_model_sender_answering_after_execute_returned(tmp_path):
    # As with Triton: None in execute's list for a request whose sender answers later.
    with ModelRunner(write_model(tmp_path, "late", LATE_SENDER_PY)) as runner:
        got = runner.execute([{"IN": np.array([n], np.float32)} for n in (3, -1, 4)])
        assert [pb_utils.get_output_tensor_by_name(r, "OUT").as_numpy().tolist()
                for r in got] == [[3], [-1], [4]]


BLS_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            bls = pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", np.ones(4, np.float32)),
                        pb_utils.Tensor("INPUT1", np.ones(4, np.float32))])
            resp = bls.exec()
            if resp.has_error():
                raise pb_utils.TritonModelException(resp.error().message())
            t = pb_utils.get_output_tensor_by_name(resp, "OUTPUT0")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", t.as_numpy())]))
        return out

    def finalize(self):
        pb_utils.load_model("other")
"""


def test_bls_raises_a_clear_error_or_uses_the_handler(tmp_path):
    mdir = write_model(tmp_path, "bls", BLS_PY, config=(
        'backend: "python"\ninput [{name: "IN", data_type: TYPE_FP32, dims: [1]}]\n'
        'output [{name: "OUT", data_type: TYPE_FP32, dims: [4]}]\n'))
    runner = ModelRunner(mdir)
    with pytest.raises(pb_utils.TritonModelException, match="bls_handler"):
        runner.execute([{"IN": np.ones(1, np.float32)}])
    with pytest.raises(pb_utils.TritonModelException, match="model loading API"):
        runner.close()  # finalize() calls load_model, which needs a server

    seen = []

    def handler(request, decoupled):
        seen.append((request.model_name(), request.requested_output_names(), decoupled))
        a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
        return pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a * 10)])

    runner = ModelRunner(mdir, bls_handler=handler)
    runner.model.finalize = lambda: None
    with runner:
        [resp] = runner.execute([{"IN": np.ones(1, np.float32)}])
    assert seen == [("add_sub", {"OUTPUT0"}, False)]
    assert pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy().tolist() == [10] * 4


TELEMETRY_PY = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def initialize(self, args):
        self.fam = pb_utils.MetricFamily("runner_count", "calls", pb_utils.MetricFamily.COUNTER)
        self.count = self.fam.Metric({"m": "t"})
        try:  # one name, one kind: refused as by the server
            pb_utils.MetricFamily("runner_count", "calls", pb_utils.MetricFamily.GAUGE)
            raise AssertionError("a second kind for one family name was accepted")
        except pb_utils.TritonModelException:
            pass
        self.ready = True

    def is_ready(self):
        return self.ready

    async def execute(self, requests):
        await asyncio.sleep(0)
        self.count.increment(len(requests))
        pb_utils.Logger.log_warn(f"executing {len(requests)}")
        out = pb_utils.empty_shm_tensor("OUT", [1], np.float32)
        out.as_numpy()[:] = self.count.value()
        return [pb_utils.InferenceResponse([out]) for _ in requests]
"""


def test_async_hooks_logger_metrics_and_readiness(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="tritonpy.model.tel")
    mdir = write_model(tmp_path, "tel", TELEMETRY_PY)
    with ModelRunner(mdir) as runner:
        runner.execute([{"IN": np.ones(1, np.float32)}] * 2)
        [resp] = runner.execute([{"IN": np.ones(1, np.float32)}])
        assert pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy().tolist() == [3.0]
        assert runner.metrics == {("runner_count", (("m", "t"),)): 3.0}
        assert runner.is_ready()
        runner.model.ready = False
        assert not runner.is_ready()
    msgs = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "tritonpy.model.tel"]
    assert msgs == [(logging.WARNING, "[tel_0_0] executing 2"),
                    (logging.WARNING, "[tel_0_0] executing 1")]
    # closed: pb_utils is back to having no runtime
    assert stub_pb_utils._runtime is None


def test_helper_modules_do_not_leak_between_runners(tmp_path):
    first = _recorder(tmp_path / "a", factor=3)
    second = _recorder(tmp_path / "b", factor=5)
    path_before = list(sys.path)
    for mdir, factor in ((first, 3), (second, 5)):
        with ModelRunner(mdir) as runner:
            [resp] = runner.execute([{"IN": np.ones(1, np.float32)}])
            assert pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy()[0] == factor
    assert sys.path == path_before
    assert "helper" not in sys.modules


def test_runners_open_at_once_each_import_their_own_helper(tmp_path):
    # The second model imported the first one's helper.py (its folder came first on sys.path,
    # and its module was in sys.modules): many models ship a helper or utils module.
    path_before = list(sys.path)
    with ModelRunner(_recorder(tmp_path / "a", factor=3)) as first, \
            ModelRunner(_recorder(tmp_path / "b", factor=5)) as second:
        for runner, factor in ((first, 3), (second, 5), (first, 3)):
            [resp] = runner.execute([{"IN": np.ones(1, np.float32)}])
            assert pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy()[0] == factor
    assert sys.path == path_before
    assert "helper" not in sys.modules


def test_failures_while_loading_leave_nothing_behind(tmp_path):
    path_before = list(sys.path)
    raising = write_model(tmp_path, "boom", """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("initialize failed on purpose")
    def execute(self, requests):
        return []
    def finalize(self):
        raise AssertionError("finalize must not run after a failed initialize")
""")
    with pytest.raises(RuntimeError, match="initialize failed on purpose"):
        ModelRunner(raising)
    broken = write_model(tmp_path, "broken", "import not_a_module_anywhere\n")
    with pytest.raises(ModuleNotFoundError, match="not_a_module_anywhere"):
        ModelRunner(broken)
    with pytest.raises(FileNotFoundError, match="model file does not exist"):
        ModelRunner(broken, version=7)
    assert sys.path == path_before
    assert stub_pb_utils._runtime is None


def test_plain_interpreter_still_refuses_bls_without_a_runner():
    req = pb_utils.InferenceRequest(model_name="x", inputs=[], requested_output_names=[])
    with pytest.raises(pb_utils.TritonModelException, match="ModelRunner"):
        req.exec()


def test_runner_used_from_threads_and_twice(tmp_path):
    with ModelRunner(_recorder(tmp_path)) as runner:
        results = []

        def worker(i):
            [resp] = runner.execute([{"IN": np.array([i], np.float32)}])
            results.append(pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy()[0])

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(results) == [0, 3, 6, 9]
    runner.close()  # a second close is a no-op
    with pytest.raises(InternalError, match="closed"):
        runner.execute([{"IN": np.ones(1, np.float32)}])
    assert os.path.isdir(runner.version_dir)


# Counts its requests in a custom metric, logs, calls BLS and answers with its model directory.
OWN_RUNTIME_PY = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.fam = pb_utils.MetricFamily("qa_requests", "requests",
                                         pb_utils.MetricFamily.COUNTER)
        self.count = self.fam.Metric({"model": args["model_name"]})

    def execute(self, requests):
        return self.answer(requests, self.bls().exec().parameters(), [pb_utils.get_model_dir()])

    def bls(self):
        self.count.increment(1)
        pb_utils.Logger.log_info("executing")
        return pb_utils.InferenceRequest(model_name="step", requested_output_names=["OUT"],
                                         inputs=[])

    def answer(self, requests, via, dirs):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", np.ones(1, np.float32))],
            parameters={"dirs": "|".join(dirs), "bls": via}) for _ in requests]
"""

# The same with async hooks, and a model directory read by a task initialize started.
ASYNC_OWN_RUNTIME_PY = OWN_RUNTIME_PY + """
class TritonPythonModel(TritonPythonModel):
    async def initialize(self, args):
        super().initialize(args)
        self.task_dir = asyncio.create_task(self.model_dir_later())

    async def model_dir_later(self):
        await asyncio.sleep(0.2)  # once the runners opened after this one are open
        return pb_utils.get_model_dir()

    async def execute(self, requests):
        via = (await self.bls().async_exec()).parameters()
        return self.answer(requests, via, [pb_utils.get_model_dir(), await self.task_dir])
"""


def test_runners_open_at_once_each_use_their_own(tmp_path, caplog):
    # Each model's logs, metrics, BLS handler and model directory are its own runner's, not
    # the newest runner's, both in execute and in an asyncio task started in initialize.
    caplog.set_level(logging.INFO, logger="tritonpy.model")

    def handler(tag):
        return lambda request, decoupled: pb_utils.InferenceResponse(parameters={"by": tag})

    runners = {}
    for name, source in (("one", OWN_RUNTIME_PY), ("two", ASYNC_OWN_RUNTIME_PY),
                         ("three", OWN_RUNTIME_PY)):
        mdir = write_model(tmp_path, name, source)
        runners[name] = ModelRunner(mdir, bls_handler=handler(f"h_{name}"))
    try:
        for name in ("one", "two"):
            [resp] = runners[name].execute([{"IN": np.ones(1, np.float32)}])
            params = json.loads(resp.parameters())
            version_dir = str(tmp_path / name / "1")
            assert params["dirs"].split("|") == [version_dir] * (2 if name == "two" else 1)
            assert json.loads(params["bls"]) == {"by": f"h_{name}"}
        assert {n: r.metrics for n, r in runners.items()} == {
            "one": {("qa_requests", (("model", "one"),)): 1.0},
            "two": {("qa_requests", (("model", "two"),)): 1.0},
            "three": {("qa_requests", (("model", "three"),)): 0.0}}
        logged = [(r.name, r.getMessage()) for r in caplog.records
                  if r.name.startswith("tritonpy.model.")]
        assert logged == [("tritonpy.model.one", "[one_0_0] executing"),
                          ("tritonpy.model.two", "[two_0_0] executing")]
    finally:
        for r in runners.values():
            r.close()
    assert stub_pb_utils._runtime is None
