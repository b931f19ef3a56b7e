"""Every pb_utils call a model can make, made by a model in a real stub behind a real Server.

One ``probe`` model serves the whole module: each request names an operation in its
parameters (``{"op": "tensor"}``); the model runs it with pb_utils and reports what it saw in
the response's parameters (bool/int/str values, JSON where structured) and outputs.
"""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import tritonpy
from _models import fp32, infer, io_config, new_prefix, serving, serving_models, wait_for
from _models import write_model

pytestmark = pytest.mark.timeout(60)

PROBE_CONFIG = """
backend: "python"
max_batch_size: 0
input [
  { name: "IN", data_type: TYPE_FP32, dims: [ -1 ], optional: true },
  { name: "TEXT", data_type: TYPE_STRING, dims: [ -1 ], optional: true }
]
output [
  { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "TEXT_OUT", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "AUX", data_type: TYPE_INT64, dims: [ -1 ] }
]
parameters { key: "greeting", value: { string_value: "hello" } }
instance_group [ { count: 1, kind: KIND_CPU } ]
"""

PROBE_PY = '''
import json
import logging
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

import probe_helper  # a file next to model.py


class TritonPythonModel:
    def initialize(self, args):
        self.args = dict(args)
        self.config = json.loads(args["model_config"])
        self.ready = True
        # The families are kept: as in Triton, a metric whose family is gone cannot be used.
        self.families = [
            pb_utils.MetricFamily("probe_requests", "requests seen by the probe",
                                  pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily("probe_level", "a level", pb_utils.MetricFamily.GAUGE),
            pb_utils.MetricFamily("probe_latency", "a latency", pb_utils.MetricFamily.HISTOGRAM)]
        counter, gauge, hist = self.families
        self.counter = counter.Metric(labels={"model": "probe", "kind": "test"})
        self.gauge = gauge.Metric(labels={"model": "probe"})
        self.hist = hist.Metric(labels={"model": "probe"}, buckets=[1.0, 10.0])

    def is_ready(self):
        return self.ready

    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            responses.append(getattr(self, "op_" + params["op"])(request, params))
        return responses

    # -- tensors -------------------------------------------------------------------------
    def op_tensor(self, request, params):
        t = pb_utils.get_input_tensor_by_name(request, "IN")
        x = t.as_numpy()
        out = pb_utils.Tensor("OUT", x * 2)
        typed = pb_utils.Tensor("typed", np.zeros(2, np.float32).view(np.int32),
                                pb_utils.numpy_to_triton_type(np.float32))
        info = {
            "name": t.name(), "shape": json.dumps(t.shape()), "dtype": t.triton_dtype(),
            "is_cpu": t.is_cpu(), "numpy_dtype": str(x.dtype),
            "missing_is_none": pb_utils.get_input_tensor_by_name(request, "NOPE") is None,
            "out_name": out.name(), "out_dtype": out.triton_dtype(),
            "typed_dtype": str(typed.as_numpy().dtype),
        }
        try:
            pb_utils.Tensor("bad", np.array(["a", "b"]))
            info["unicode_refused"] = False
        except pb_utils.TritonModelException as exc:
            info["unicode_refused"] = "np.object_" in str(exc)
        return pb_utils.InferenceResponse([out], parameters=info)

    def op_bytes(self, request, params):
        t = pb_utils.get_input_tensor_by_name(request, "TEXT")
        arr = t.as_numpy()
        encoded = pb_utils.serialize_byte_tensor(arr)
        decoded = pb_utils.deserialize_bytes_tensor(encoded)
        info = {
            "dtype": t.triton_dtype(), "kind": arr.dtype.kind, "shape": json.dumps(t.shape()),
            "all_bytes": all(isinstance(v, bytes) for v in arr.ravel()),
            "encoded_type": type(encoded).__name__,
            "encoded_len": len(encoded),
            "roundtrip": decoded.tolist() == arr.ravel().tolist(),
            "empty": repr(pb_utils.serialize_byte_tensor(np.array([], dtype=np.object_))),
        }
        upper = np.array([v.upper() for v in arr.ravel()], dtype=np.object_).reshape(arr.shape)
        # str elements are allowed in a BYTES output: they travel as UTF-8.
        mixed = np.array(["é", b"\\x00\\xff"], dtype=np.object_)
        return pb_utils.InferenceResponse(
            [pb_utils.Tensor("TEXT_OUT", np.concatenate([upper.ravel(), mixed])),
             pb_utils.Tensor("AUX", np.array([len(v) for v in arr.ravel()], np.int64))],
            parameters=info)

    def op_dlpack(self, request, params):
        x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        src = pb_utils.Tensor("src", x)
        from_capsule = pb_utils.Tensor.from_dlpack("OUT", src.to_dlpack())
        via_protocol = np.from_dlpack(src)                   # Tensor.__dlpack__
        from_numpy = pb_utils.Tensor.from_dlpack("n", x)     # an object with __dlpack__
        info = {
            "device": json.dumps(list(src.__dlpack_device__())),
            "capsule_shares": bool(np.shares_memory(from_capsule.as_numpy(), x)),
            "protocol_shares": bool(np.shares_memory(via_protocol, x)),
            "numpy_shares": bool(np.shares_memory(from_numpy.as_numpy(), x)),
            "dtype": from_capsule.triton_dtype(),
        }
        try:
            pb_utils.Tensor("s", np.array([b"a"], dtype=np.object_)).to_dlpack()
            info["bytes_refused"] = ""
        except pb_utils.TritonModelException as exc:
            info["bytes_refused"] = str(exc)
        return pb_utils.InferenceResponse([from_capsule], parameters=info)

    def op_dtypes(self, request, params):
        checks = {
            "string_fp32": pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32,
            "string_bool": pb_utils.triton_string_to_numpy("TYPE_BOOL") is bool,
            "string_str": pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_,
            "np_fp16": pb_utils.numpy_to_triton_type(np.float16),
            "np_int64": pb_utils.numpy_to_triton_type(np.int64),
            "np_object": pb_utils.numpy_to_triton_type(np.object_),
            "np_bytes": pb_utils.numpy_to_triton_type(np.bytes_),
            "np_bool": pb_utils.numpy_to_triton_type(np.bool_),
            "code_8": pb_utils.triton_to_numpy_type(8).__name__,
            "code_13": pb_utils.triton_to_numpy_type(13).__name__,
            "code_1": pb_utils.triton_to_numpy_type(1).__name__,
        }
        return pb_utils.InferenceResponse([], parameters={"checks": json.dumps(checks)})

    # -- requests ------------------------------------------------------------------------
    def op_request(self, request, params):
        info = {
            "request_id": request.request_id(),
            "correlation_id": request.correlation_id(),
            "correlation_type": type(request.correlation_id()).__name__,
            "flags": request.flags(),
            "requested": json.dumps(sorted(request.requested_output_names())),
            "requested_type": type(request.requested_output_names()).__name__,
            "parameters": request.parameters(),
            "parameters_type": type(request.parameters()).__name__,
            "model_name": request.model_name(),
            "timeout": request.timeout(),
            "cancelled": request.is_cancelled(),
            "inputs": json.dumps(sorted(t.name() for t in request.inputs())),
        }
        return pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", np.zeros(1, np.float32)),
             pb_utils.Tensor("AUX", np.array([1], np.int64)),
             pb_utils.Tensor("TEXT_OUT", np.array([b"x"], dtype=np.object_))],
            parameters=info)

    def op_config(self, request, params):
        info = {
            "input": json.dumps(pb_utils.get_input_config_by_name(self.config, "IN")),
            "output": json.dumps(pb_utils.get_output_config_by_name(self.config, "AUX")),
            "no_input": pb_utils.get_input_config_by_name(self.config, "NOPE") is None,
            "no_output": pb_utils.get_output_config_by_name(self.config, "NOPE") is None,
            "decoupled": pb_utils.using_decoupled_model_transaction_policy(self.config),
            "decoupled_true": pb_utils.using_decoupled_model_transaction_policy(
                {"model_transaction_policy": {"decoupled": True}}),
            "greeting": self.config["parameters"]["greeting"]["string_value"],
        }
        return pb_utils.InferenceResponse([], parameters=info)

    def op_args(self, request, params):
        return pb_utils.InferenceResponse([], parameters={"args": json.dumps(self.args)})

    def op_module(self, request, params):
        import tritonpy.stub.pb_utils as real
        import c_python_backend_utils as c_utils  # Triton's C++ module, which models import
        first = pb_utils.empty_shm_tensor("X", [1 << 18], np.float32)  # a segment mapped
        free = c_utils.shared_memory.free_memory()
        second = pb_utils.empty_shm_tensor("Y", [1 << 18], np.float32)  # 1 MiB more taken
        free_holding = c_utils.shared_memory.free_memory()
        del first, second
        return pb_utils.InferenceResponse([], parameters={
            "same": sys.modules["triton_python_backend_utils"] is real and pb_utils is real,
            "all": json.dumps(sorted(pb_utils.__all__)),
            "c_tensor": c_utils.Tensor is pb_utils.Tensor,
            "c_error": c_utils.TritonError is pb_utils.TritonError,
            "c_free": free, "c_free_holding": free_holding})

    def op_helper(self, request, params):
        return pb_utils.InferenceResponse([], parameters={"helper": probe_helper.value()})

    def op_sender(self, request, params):
        # Default mode through the response sender instead of the return value.
        sender = request.get_response_sender()
        sender.send(pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", np.array([7.0], np.float32))]),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        try:
            sender.send(pb_utils.InferenceResponse([]))
            again = ""
        except pb_utils.TritonModelException as exc:
            again = str(exc)
        self.sent_again = again
        return None

    def op_sender_report(self, request, params):
        return pb_utils.InferenceResponse([], parameters={"again": self.sent_again})

    # -- errors --------------------------------------------------------------------------
    def op_error(self, request, params):
        code = getattr(pb_utils.TritonError, params["code"])
        err = pb_utils.TritonError("probe says " + params["code"], code)
        return pb_utils.InferenceResponse(error=err)

    def op_error_default(self, request, params):
        err = pb_utils.TritonError("no code given")
        return pb_utils.InferenceResponse(error=err, parameters={"code": err.code(),
                                                                 "message": err.message()})

    def op_model_exception(self, request, params):
        raise pb_utils.TritonModelException("the probe refuses")

    # -- telemetry -----------------------------------------------------------------------
    def op_log(self, request, params):
        tok = params["token"]
        pb_utils.Logger.log_info(tok + " info")
        pb_utils.Logger.log_warn(tok + " warn")
        pb_utils.Logger.log_error(tok + " error")
        pb_utils.Logger.log_verbose(tok + " verbose")
        pb_utils.Logger.log(tok + " explicit", pb_utils.LogLevel.ERROR)
        pb_utils.Logger.log(tok + " default")
        pb_utils.Logger.log_info(tok + " lone \\ud800")  # goes escaped
        try:
            pb_utils.Logger.log(tok + " bad level", "INFO")
            refused = ""
        except TypeError as exc:
            refused = str(exc)
        return pb_utils.InferenceResponse([], parameters={"refused": refused})

    def op_print(self, request, params):
        tok = params["token"]
        print(tok + " stdout")
        print(tok + " stderr", file=sys.stderr)
        logging.getLogger("probe.user").warning(tok + " logging-warning")
        log = logging.getLogger("probe.info")
        log.setLevel(logging.INFO)
        log.info(tok + " logging-info")
        return pb_utils.InferenceResponse([])

    def op_metrics(self, request, params):
        self.counter.increment(params["n"])
        self.gauge.set(params["n"] * 10)
        self.gauge.increment(1)
        self.hist.observe(0.5)
        self.hist.observe(5)
        info = {"counter": str(self.counter.value()), "gauge": str(self.gauge.value())}
        try:
            self.hist.value()
            info["hist_value_refused"] = False
        except pb_utils.TritonModelException:  # as Triton: a histogram has no single value
            info["hist_value_refused"] = True
        dropped = pb_utils.MetricFamily("probe_dropped", "a family nobody keeps",
                                        pb_utils.MetricFamily.COUNTER).Metric(labels={"a": "b"})
        try:
            dropped.increment(1)
            info["dropped_family"] = ""
        except pb_utils.TritonModelException as exc:
            info["dropped_family"] = str(exc)
        try:
            self.counter.increment(-1)
            info["negative_refused"] = False
        except pb_utils.TritonModelException:
            info["negative_refused"] = True
        return pb_utils.InferenceResponse([], parameters=info)

    def op_metric_rules(self, request, params):
        # Triton's rules for families and histogram buckets; each refusal is recorded.
        def refused(make):
            try:
                make()
                return False
            except pb_utils.TritonModelException:
                return True

        self.again = again = pb_utils.MetricFamily("probe_requests", "another description",
                                                   pb_utils.MetricFamily.COUNTER)
        again.Metric(labels={"model": "probe", "kind": "again"}).increment(1)
        # Kept: deleting a family drops its series (see tests/stub/test_custom_metrics.py).
        self.rules = hist = pb_utils.MetricFamily("probe_rules", "rules",
                                                  pb_utils.MetricFamily.HISTOGRAM)
        hist.Metric(labels={"b": "none"}, buckets=[]).observe(3)  # only the +Inf bucket
        info = {
            "other_kind": refused(lambda: pb_utils.MetricFamily(
                "probe_requests", "same name, other kind", pb_utils.MetricFamily.GAUGE)),
            "no_buckets": refused(lambda: hist.Metric(labels={"b": "x"})),
            "unsorted": refused(lambda: hist.Metric(labels={"b": "y"}, buckets=[2.5, 0.1])),
            "duplicate": refused(lambda: hist.Metric(labels={"b": "z"}, buckets=[1, 1, 2])),
        }
        return pb_utils.InferenceResponse([], parameters=info)

    # -- readiness -----------------------------------------------------------------------
    def op_ready(self, request, params):
        self.ready = params["value"]
        return pb_utils.InferenceResponse([])
'''

HELPER_PY = """
def value():
    return "from probe_helper"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "probe", PROBE_PY, PROBE_CONFIG, files={"probe_helper.py": HELPER_PY})
    prefix = new_prefix()
    with serving(repo, prefix) as srv:
        yield srv


@pytest.fixture
def probe(server):
    return server.model("probe")


def call(model, op, inputs=None, **params):
    """One request naming ``op``; the response, checked for no error."""
    kwargs = {k: params.pop(k) for k in ("requested_output_names", "request_id",
                                        "correlation_id", "flags", "timeout") if k in params}
    resp = infer(model, inputs or {}, parameters={"op": op, **params}, **kwargs)
    assert resp.error is None, resp.error
    return resp


# -- tensors ------------------------------------------------------------------------------------
def test_tensor_accessors_and_output(probe):
    x = fp32(1, 2, 3)
    resp = call(probe, "tensor", {"IN": x})
    p = resp.parameters
    assert p["name"] == "IN"
    assert json.loads(p["shape"]) == [3]
    assert p["dtype"] == 11 and p["out_dtype"] == 11  # TYPE_FP32
    assert p["is_cpu"] is True
    assert p["numpy_dtype"] == "float32"
    assert p["missing_is_none"] is True
    assert p["out_name"] == "OUT"
    assert p["typed_dtype"] == "float32"  # Tensor(name, arr, triton_dtype) reinterprets
    assert p["unicode_refused"] is True
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), x * 2)
    assert resp.outputs["OUT"].data_type == "FP32"


def test_bytes_tensor_and_serialization(probe):
    text = np.array([b"abc", "héllo".encode(), b""], dtype=np.object_)
    resp = call(probe, "bytes", {"TEXT": text})
    p = resp.parameters
    assert p["dtype"] == 13 and p["kind"] == "O" and p["all_bytes"] is True
    assert json.loads(p["shape"]) == [3]
    assert p["encoded_type"] == "bytes"  # what Triton's serialize_byte_tensor returns
    assert p["encoded_len"] == 4 * 3 + 3 + len("héllo".encode())
    assert p["roundtrip"] is True
    assert p["empty"] == "()"
    out = resp.outputs["TEXT_OUT"].to_numpy()
    assert out.tolist() == [b"ABC", "HéLLO".encode(), b"", "é".encode(), b"\x00\xff"]
    assert resp.outputs["TEXT_OUT"].data_type == "BYTES"
    assert resp.outputs["AUX"].to_numpy().tolist() == [3, 6, 0]


def test_bytes_input_given_as_str(probe):
    resp = call(probe, "bytes", {"TEXT": np.array(["ab", "c"])})
    assert resp.parameters["all_bytes"] is True
    assert resp.outputs["TEXT_OUT"].to_numpy().tolist()[:2] == [b"AB", b"C"]


def test_dlpack_cpu_round_trips_without_copies(probe):
    x = fp32(4, 5, 6, 7)
    resp = call(probe, "dlpack", {"IN": x})
    p = resp.parameters
    assert json.loads(p["device"]) == [1, 0]  # kDLCPU, device 0
    assert p["capsule_shares"] and p["protocol_shares"] and p["numpy_shares"]
    assert p["dtype"] == 11
    assert p["bytes_refused"] == "DLPack does not have support for string tensors."  # Triton's
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), x)


def test_dtype_helpers(probe):
    checks = json.loads(call(probe, "dtypes").parameters["checks"])
    assert checks == {
        "string_fp32": True, "string_bool": True, "string_str": True,
        "np_fp16": 10, "np_int64": 9, "np_object": 13, "np_bytes": 13, "np_bool": 1,
        "code_8": "int32", "code_13": "object_", "code_1": "bool",
    }


# -- requests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("corr", [12345678901234, "session-7"])
def test_request_accessors(probe, corr):
    resp = call(probe, "request", {"IN": fp32(1)}, request_id="rid-1", correlation_id=corr,
                flags=3, timeout=10_000_000, extra=5, flag=True, text="t")
    p = resp.parameters
    assert p["request_id"] == "rid-1"
    assert p["correlation_id"] == corr
    assert p["correlation_type"] == type(corr).__name__
    assert p["flags"] == 3
    # None asked for: every output of the config, as Triton 2.51 (checked against it).
    assert json.loads(p["requested"]) == ["AUX", "OUT", "TEXT_OUT"]
    assert p["requested_type"] == "set"  # as Triton's (a std::set on its C++ side)
    assert p["parameters_type"] == "str"
    assert json.loads(p["parameters"]) == {"op": "request", "extra": 5, "flag": True,
                                           "text": "t"}
    assert p["model_name"] == "probe"
    assert p["timeout"] == 10_000_000
    assert p["cancelled"] is False
    assert json.loads(p["inputs"]) == ["IN"]
    assert sorted(resp.outputs) == ["AUX", "OUT", "TEXT_OUT"]


def test_requested_output_names_reach_model_and_filter_outputs(probe):
    resp = call(probe, "request", requested_output_names=["AUX", "OUT"])
    assert json.loads(resp.parameters["requested"]) == ["AUX", "OUT"]
    assert sorted(resp.outputs) == ["AUX", "OUT"]  # TEXT_OUT was not asked for


def test_config_helpers(probe):
    p = call(probe, "config").parameters
    assert json.loads(p["input"]) == {
        "name": "IN", "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [-1],
        "is_shape_tensor": False, "allow_ragged_batch": False, "optional": True,
        "is_non_linear_format_io": False}
    assert json.loads(p["output"])["data_type"] == "TYPE_INT64"
    assert p["no_input"] is True and p["no_output"] is True
    assert p["decoupled"] is False and p["decoupled_true"] is True
    assert p["greeting"] == "hello"


def test_stub_installs_pb_utils_under_triton_name(probe):
    from test_pb_utils_exports import EXPECTED

    p = call(probe, "module").parameters
    assert p["same"] is True
    assert json.loads(p["all"]) == EXPECTED
    # Triton's C++ module too (Triton's QA restart model reads its shared_memory.free_memory()).
    assert p["c_tensor"] is True and p["c_error"] is True
    assert p["c_free"] - p["c_free_holding"] >= 1 << 20, p


def test_other_files_in_version_dir_are_importable(probe):
    assert call(probe, "helper").parameters["helper"] == "from probe_helper"


def test_default_mode_response_sender(probe):
    resp = call(probe, "sender")
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), fp32(7))
    again = call(probe, "sender_report").parameters["again"]
    # Triton names the default-mode limit before the closed sender.
    assert again == ("Unable to send response. Non-decoupled model cannot send more than one "
                     "response.")


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("code", ["UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG",
                                  "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS", "CANCELLED"])
def test_triton_error_code_reaches_caller(probe, code):
    resp = infer(probe, {}, parameters={"op": "error", "code": code})
    assert isinstance(resp.error, tritonpy.TritonpyError)
    assert resp.error.code == tritonpy.ErrorCode(code)
    assert resp.error.message == f"probe says {code}"
    assert resp.outputs == {}
    assert resp.final


def test_triton_error_default_code_is_internal(probe):
    resp = infer(probe, {}, parameters={"op": "error_default"})
    assert resp.error.code == tritonpy.ErrorCode.INTERNAL
    assert resp.error.message == "no code given"
    assert isinstance(resp.error, tritonpy.InternalError)


def test_triton_model_exception_reaches_caller(probe):
    resp = infer(probe, {}, parameters={"op": "model_exception"})
    assert resp.error.code == tritonpy.ErrorCode.INTERNAL
    assert "TritonModelException" in resp.error.message
    assert "the probe refuses" in resp.error.message
    # the model keeps serving
    call(probe, "helper")


# -- logging -------------------------------------------------------------------------------------
def _records(caplog, token):
    return [r for r in caplog.records
            if r.name == "tritonpy.model.probe" and token in r.getMessage()]


def test_logger_messages_reach_host_log(probe, caplog):
    caplog.set_level(logging.DEBUG, logger="tritonpy.model.probe")
    tok = "tok-logger-1"
    refused = call(probe, "log", token=tok).parameters["refused"]
    got = wait_for(lambda: len(_records(caplog, tok)) >= 7 and _records(caplog, tok))
    by_text = {r.getMessage(): r.levelno for r in got}
    assert by_text == {
        f"[probe_0_0] {tok} info": logging.INFO,
        f"[probe_0_0] {tok} warn": logging.WARNING,
        f"[probe_0_0] {tok} error": logging.ERROR,
        f"[probe_0_0] {tok} verbose": logging.DEBUG,
        f"[probe_0_0] {tok} explicit": logging.ERROR,
        f"[probe_0_0] {tok} default": logging.INFO,
        f"[probe_0_0] {tok} lone \\ud800": logging.INFO,
    }
    # As Triton's: a level that is not one of Logger's is a TypeError, naming the levels.
    assert refused == ("Logger.log: level must be one of Logger.INFO, WARNING, ERROR or "
                       "VERBOSE, got 'INFO'")


def test_print_and_logging_reach_host_log(probe, caplog):
    caplog.set_level(logging.DEBUG, logger="tritonpy.model.probe")
    tok = "tok-print-1"
    call(probe, "print", token=tok)
    wanted = ["stdout", "stderr", "logging-warning", "logging-info"]

    def seen():
        texts = [r.getMessage() for r in _records(caplog, tok)]
        return all(any(w in t for t in texts) for w in wanted)

    wait_for(seen, timeout=5)
    recs = {w: [r for r in _records(caplog, tok) if w in r.getMessage()] for w in wanted}
    assert recs["stdout"] and recs["stdout"][0].getMessage() == f"[probe_0_0] {tok} stdout"
    assert recs["stdout"][0].levelno == logging.INFO
    assert recs["stderr"] and recs["stderr"][0].getMessage() == f"[probe_0_0] {tok} stderr"
    assert recs["stderr"][0].levelno == logging.WARNING
    assert recs["logging-warning"], "logging.warning() in model.py did not reach the host log"
    rec = recs["logging-warning"][0]
    assert rec.getMessage() == f"[probe_0_0] probe.user: {tok} logging-warning"
    assert rec.levelno == logging.WARNING
    assert recs["logging-info"], \
        "logging.info() (logger level INFO) in model.py did not reach the host log"
    rec = recs["logging-info"][0]
    assert rec.getMessage() == f"[probe_0_0] probe.info: {tok} logging-info"
    assert rec.levelno == logging.INFO


LOGGING_CONFIG_PY = """
import json
import logging
import sys

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        params = json.loads(requests[0].parameters())
        tok = params["token"]
        if params.get("configure"):
            logging.basicConfig(level=logging.DEBUG, format="%(levelname)s|%(name)s|%(message)s",
                                force=True)
        logging.getLogger("mymodel").warning(tok + " A")
        logging.error(tok + " B")  # the first one runs basicConfig(): a handler on stderr
        logging.getLogger("mymodel").debug(tok + " C")
        print(tok + " end", file=sys.stderr, flush=True)
        return [pb_utils.InferenceResponse([]) for _ in requests]
"""


def test_logging_after_basic_config_still_reaches_host_log(tmp_path, caplog):
    # A model's logging.error() (or its own basicConfig()) puts a StreamHandler on stderr on
    # the root logger. Its records, and the other loggers' records, still reach the host log
    # at their level from model.py's line, once each (not as raw stderr lines); a format and a
    # level the model configures on purpose apply.
    caplog.set_level(logging.DEBUG, logger="tritonpy.model.logm")
    lines = LOGGING_CONFIG_PY.splitlines()
    line_of = {x: 1 + next(i for i, t in enumerate(lines) if f'(tok + " {x}")' in t)
               for x in "ABC"}
    write_model(tmp_path, "logm", LOGGING_CONFIG_PY)

    def logged(tok, **params):
        infer(server.model("logm"), {"IN": fp32(1)}, parameters={"token": tok, **params})
        got = wait_for(lambda: [r for r in caplog.records if tok in r.getMessage()]
                       if any(f"{tok} end" in r.getMessage() for r in caplog.records) else [])
        return [(r.levelno, r.filename, r.lineno, r.getMessage()) for r in got
                if f"{tok} end" not in r.getMessage()]

    with serving(tmp_path, new_prefix()) as server:
        for tok in ("tok-basic-1", "tok-basic-2"):
            assert logged(tok) == [
                (logging.WARNING, "model.py", line_of["A"], f"[logm_0] mymodel: {tok} A"),
                (logging.ERROR, "model.py", line_of["B"], f"[logm_0] {tok} B")]
        tok = "tok-basic-3"
        assert logged(tok, configure=True) == [
            (logging.WARNING, "model.py", line_of["A"], f"[logm_0] WARNING|mymodel|{tok} A"),
            (logging.ERROR, "model.py", line_of["B"], f"[logm_0] ERROR|root|{tok} B"),
            (logging.DEBUG, "model.py", line_of["C"], f"[logm_0] DEBUG|mymodel|{tok} C")]


# -- metrics -------------------------------------------------------------------------------------
def _samples(server):
    text = generate_latest(server.metrics_registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_custom_metrics_round_trip_and_export(server, probe):
    before = _samples(server).get(
        ("probe_requests_total", (("kind", "test"), ("model", "probe"))), 0.0)
    p = call(probe, "metrics", n=3).parameters
    assert float(p["counter"]) == before + 3
    assert float(p["gauge"]) == 31.0
    assert p["negative_refused"] is True
    assert p["hist_value_refused"] is True
    # Triton's QA (test_metric_lifetime_error): the family of MetricFamily(...).Metric(...) is
    # gone at once, and so is its metric (with the prefix of Triton's stub for increment).
    assert p["dropped_family"] == (
        "Failed to increment metric value: "
        "Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The "
        "'MetricFamily' object should be deleted AFTER its corresponding 'Metric' objects have "
        "been deleted.")
    s = _samples(server)
    assert s[("probe_requests_total", (("kind", "test"), ("model", "probe")))] == before + 3
    assert s[("probe_level", (("model", "probe"),))] == 31.0
    hist_sum = s[("probe_latency_sum", (("model", "probe"),))]
    assert hist_sum >= 5.5
    n = s[("probe_latency_count", (("model", "probe"),))]
    # Bounds written as Triton writes them (le="1", not "1.0").
    assert s[("probe_latency_bucket", (("le", "1"), ("model", "probe")))] == n / 2
    assert s[("probe_latency_bucket", (("le", "10"), ("model", "probe")))] == n
    assert s[("probe_latency_bucket", (("le", "+Inf"), ("model", "probe")))] == n
    text = generate_latest(server.metrics_registry).decode()
    assert "# HELP probe_requests_total requests seen by the probe" in text
    assert "# TYPE probe_latency histogram" in text
    assert 'probe_latency_bucket{le="1",model="probe"}' in text


def test_custom_metric_family_and_bucket_rules(server, probe):
    p = call(probe, "metric_rules").parameters
    assert p == {"other_kind": True, "no_buckets": True, "unsorted": True, "duplicate": True}
    s = _samples(server)
    # The same name and kind is the same family, with its first description.
    assert s[("probe_requests_total", (("kind", "again"), ("model", "probe")))] >= 1
    text = generate_latest(server.metrics_registry).decode()
    assert "# HELP probe_requests_total requests seen by the probe" in text
    assert "another description" not in text
    assert s[("probe_rules_bucket", (("b", "none"), ("le", "+Inf")))] >= 1


# -- readiness -----------------------------------------------------------------------------------
def test_is_ready_is_honoured(server, probe):
    assert probe.ready()
    call(probe, "ready", value=False)
    try:
        assert not probe.ready()
        assert not server.ready()
    finally:
        call(probe, "ready", value=True)
    assert probe.ready()


EXTRA_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", x * 2), pb_utils.Tensor("EXTRA", x)],
                parameters={"requested": ",".join(sorted(r.requested_output_names()))}))
        return out
'''


def test_an_output_the_config_does_not_declare_is_dropped(tmp_path):
    # As Triton 2.51 (checked against it): a request that names no output asks for the
    # config's outputs, so an undeclared one the model makes never reaches the client.
    with serving_models(tmp_path, {"extra": (EXTRA_PY, io_config())}) as srv:
        resp = infer(srv.model("extra"), {"IN": fp32(1, 2)})
        assert resp.error is None, resp.error
        assert sorted(resp.outputs) == ["OUT"]
        assert resp.parameters["requested"] == "OUT"
        np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), fp32(2, 4))
