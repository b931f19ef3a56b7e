"""What a model.py sees when it calls pb_utils in odd ways, compared with Triton 2.51.

The probe model below ran unmodified on the real Triton 2.51 (its Python backend from the
nvidia-pytriton 0.7.0 wheel, numpy 1.26 in the stub's environment) and on tritonpy, side by
side, each call's outcome reported as a JSON string output: the value (typed), or the
exception's type and message. ``AS_TRITON`` holds what Triton answered where tritonpy answers
the same; a message ours extends is matched on Triton's words at its start (``Prefix``).
``BETTER_HERE`` holds where tritonpy answers differently on purpose, with what Triton did.

The client's view of what ``execute`` returns (outputs not in the config, not requested, of
another dtype, error codes) was compared the same way over HTTP and gRPC; ``RETURNS`` pins
the outcomes, which were the same on both servers.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import triton_python_backend_utils as pb_utils

import tritonpy
from _models import infer, new_prefix, serving, write_model

pytestmark = pytest.mark.timeout(60)

PROBE_CONFIG = """
backend: "python"
max_batch_size: 0
input [
  { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "TEXT", data_type: TYPE_STRING, dims: [ -1 ] }
]
output [
  { name: "REPORT", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] }
]
"""

PROBE_PY = r'''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def describe(v):
    """A value as both servers print it alike (numpy 1.x and 2.x)."""
    if isinstance(v, BaseException):
        return {"exc": type(v).__name__, "msg": str(v)}
    if isinstance(v, np.ndarray):
        return {"nd": str(v.dtype), "shape": list(v.shape), "v": describe(v.tolist()),
                "writeable": bool(v.flags.writeable), "c": bool(v.flags.c_contiguous)}
    if isinstance(v, type) and issubclass(v, np.generic):
        return "np:" + np.dtype(v).name
    if isinstance(v, (list, tuple)):
        return {type(v).__name__: [describe(x) for x in v]}
    if isinstance(v, (set, frozenset)):
        return {"set": sorted(describe(x) for x in v)}
    if isinstance(v, bytes):
        return "bytes:" + v.hex()
    if v is None or type(v) in (bool, int, float, str):
        return v
    return "%s:%s" % (type(v).__name__, v)


def call(fn, *args):
    try:
        return describe(fn(*args))
    except BaseException as exc:
        return describe(exc)


class TritonPythonModel:
    def execute(self, requests):
        reports = [json.dumps(self.probe(r)).encode() for r in requests]
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "REPORT", np.array([report], dtype=object))]) for report in reports]

    def probe(self, r):
        T, IR, TE = pb_utils.Tensor, pb_utils.InferenceResponse, pb_utils.TritonError
        out = T("OUT", np.zeros(1, np.float32))
        noncontig = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2]
        R = {}
        # -- the request as execute receives it
        R["get_unknown_input"] = call(pb_utils.get_input_tensor_by_name, r, "NOPE")
        R["input_as_numpy"] = call(lambda: pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())
        R["text_as_numpy"] = call(lambda: pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy())
        R["inputs_fresh_list"] = call(lambda: [r.inputs() is r.inputs(), len(r.inputs())])
        R["inputs_cleared"] = call(lambda: (r.inputs().clear(), len(r.inputs())))
        R["requested_output_names"] = call(r.requested_output_names)
        R["request_id"] = call(r.request_id)
        R["correlation_id"] = call(r.correlation_id)
        R["flags"] = call(r.flags)
        R["timeout"] = call(r.timeout)
        R["parameters"] = call(r.parameters)
        R["is_cancelled"] = call(r.is_cancelled)
        R["sender_is_cancelled"] = call(lambda: r.get_response_sender().is_cancelled())
        # -- Tensor
        R["noncontig"] = call(lambda: (lambda t: [t.shape(), t.as_numpy(),
                                                  np.shares_memory(t.as_numpy(), noncontig)])(
            T("A", noncontig)))
        R["zero_d"] = call(lambda: (lambda t: [t.shape(), t.as_numpy()])(
            T("A", np.array(3.0, np.float32))))
        R["contiguous_shared"] = call(lambda: (lambda a: np.shares_memory(
            T("A", a).as_numpy(), a))(np.zeros(3)))
        R["read_only_stays"] = call(lambda: T("A", np.frombuffer(b"\0" * 4, np.float32)).as_numpy())
        R["obj_str"] = call(lambda: T("A", np.array(["a", "bc"], dtype=object)).as_numpy())
        R["bytes_S"] = call(lambda: T("A", np.array([b"a", b"bc"])).as_numpy())
        R["f16_bool"] = call(lambda: [T("A", np.array([1.5], np.float16)).as_numpy(),
                                      T("B", np.array([True])).as_numpy()])
        R["list"] = call(T, "A", [1, 2])
        R["bytes"] = call(T, "A", b"abc")
        R["none"] = call(T, "A", None)
        R["np_scalar"] = call(T, "A", np.float32(2))
        R["int_name"] = call(T, 5, np.zeros(1))
        R["empty_name"] = call(T, "", np.zeros(1))
        R["str_array"] = call(T, "A", np.array(["a", "bc"]))
        R["big_endian"] = call(T, "A", np.array([1], ">i4"))
        R["complex"] = call(T, "A", np.array([1j], np.complex64))
        R["record"] = call(T, "A", np.zeros(2, dtype=[("a", "i4")]))
        R["bytes_to_dlpack"] = call(lambda: T("A", np.array([b"a"], dtype=object)).to_dlpack())
        R["dlpack_roundtrip"] = call(lambda: T.from_dlpack(
            "C", T("A", np.arange(3.0)).to_dlpack()).as_numpy())
        R["dlpack_device"] = call(lambda: T("A", np.arange(3.0)).__dlpack_device__())
        R["from_dlpack_list"] = call(T.from_dlpack, "A", [1])
        R["from_dlpack_empty_name"] = call(T.from_dlpack, "", np.arange(3.0))
        # -- InferenceResponse
        R["response_none_item"] = call(IR, [None])
        R["response_tuple"] = call(lambda: len(IR((out,)).output_tensors()))
        R["response_fresh_list"] = call(lambda: (lambda x: (x.output_tensors().append(out),
                                                            len(x.output_tensors())))(IR([out])))
        R["response_single_tensor"] = call(lambda: IR(out) and None)
        R["response_error_str"] = call(lambda: IR([], "boom") and None)
        R["response_error"] = call(lambda: (lambda x: [x.has_error(), x.error().message(),
                                                       int(x.error().code()),
                                                       len(x.output_tensors())])(
            IR(error=TE("bad", TE.NOT_FOUND))))
        R["response_ok"] = call(lambda: (lambda x: [x.has_error(), x.error()])(IR([out])))
        # -- TritonError and TritonModelException
        R["codes"] = call(lambda: [int(getattr(TE, n)) for n in (
            "UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
            "ALREADY_EXISTS", "CANCELLED")])
        R["code_text"] = call(lambda: [str(TE("m").code()), f"{TE.CANCELLED}", repr(TE.NOT_FOUND),
                                       TE.NOT_FOUND == 2, TE.NOT_FOUND.name, "%d" % TE.UNKNOWN])
        R["error_int_code"] = call(lambda: TE("m", 2) and None)
        R["error_none_message"] = call(lambda: TE(None) and None)
        R["error_is_exception"] = call(lambda: isinstance(TE("m"), BaseException))
        R["tme_no_args"] = call(lambda: str(pb_utils.TritonModelException()))
        R["tme_two_args"] = call(lambda: str(pb_utils.TritonModelException("a", "b")))
        R["tme_mro"] = call(lambda: [c.__name__ for c in pb_utils.TritonModelException.__mro__])
        # -- helpers
        R["numpy_to_triton"] = call(lambda: [pb_utils.numpy_to_triton_type(t) for t in (
            np.float32, np.dtype("float32"), np.bool_, np.object_, np.bytes_, np.float16,
            np.complex64, np.str_, None)])
        R["triton_to_numpy"] = call(lambda: [pb_utils.triton_to_numpy_type(c) for c in (
            0, 1, 11, 13, 15, 11.0, "TYPE_FP32")])
        R["string_to_numpy"] = call(lambda: [pb_utils.triton_string_to_numpy(s) for s in (
            "TYPE_FP32", "TYPE_BOOL", "TYPE_STRING")])
        R["string_to_numpy_unknown"] = call(pb_utils.triton_string_to_numpy, "FP32")
        ser = pb_utils.serialize_byte_tensor
        R["serialize"] = call(lambda: [
            ser(np.array([], dtype=object)), ser(np.array([], np.float32)),
            ser(np.array(["a", b"b", 1, 2.5, None], dtype=object)),
            ser(np.array([[b"a", b"bc"], [b"", b"d"]], dtype=object).T),
            ser(np.array([b"ab", b"c"])), ser(np.array(["ab"])), ser(np.array([1], np.int32))])
        R["serialize_list"] = call(ser, [b"a"])
        des = pb_utils.deserialize_bytes_tensor
        good = b"\x02\x00\x00\x00ab\x00\x00\x00\x00"
        R["deserialize"] = call(lambda: [des(b""), des(good), des(np.frombuffer(good, np.uint8)),
                                         des(memoryview(good))])
        R["deserialize_str"] = call(des, "abc")
        R["constants"] = call(lambda: [getattr(pb_utils, n) for n in (
            "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START", "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
            "TRITONSERVER_RESPONSE_COMPLETE_FINAL", "TRITONSERVER_REQUEST_RELEASE_ALL",
            "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE")])
        # -- where tritonpy answers differently on purpose
        R["from_dlpack_numpy"] = call(lambda: T.from_dlpack("A", np.arange(3.0)).as_numpy())
        R["from_dlpack_noncontig"] = call(lambda: T.from_dlpack("A", noncontig).as_numpy())
        text = pb_utils.get_input_tensor_by_name(r, "TEXT")
        R["triton_dtype"] = call(lambda: [T("A", np.zeros(1, np.float32)).triton_dtype(),
                                          text.triton_dtype()])
        R["bls_request_is_cancelled"] = call(lambda: pb_utils.InferenceRequest(
            model_name="m", inputs=[], requested_output_names=[]).is_cancelled())
        R["error_str"] = call(lambda: str(TE("m")))
        R["serialize_np_bytes_item"] = call(ser, np.array([np.bytes_(b"ab")], dtype=object))
        return R
'''


class Prefix(str):
    """An expected message that ours starts with and extends (a name, a hint)."""


def _exc(name: str, msg: str) -> dict:
    return {"exc": name, "msg": msg}


def _nd(dtype: str, shape: list, values: object, writeable: bool = True) -> dict:
    return {"nd": dtype, "shape": shape, "v": values, "writeable": writeable, "c": True}


def _list(*items: object) -> dict:
    return {"list": list(items)}


_CTOR = Prefix("")  # pybind11's "incompatible constructor arguments ..." there; ours names why

# What Triton 2.51 answered, measured; tritonpy answers the same.
AS_TRITON = {
    "get_unknown_input": None,
    "input_as_numpy": _nd("float32", [3], _list(1.0, 2.0, 3.0)),
    "text_as_numpy": _nd("object", [2], _list("bytes:61", "bytes:c3a9")),
    # inputs() and output_tensors() give a new list at each call: changing it changes nothing
    "inputs_fresh_list": _list(False, 2),
    "inputs_cleared": {"tuple": [None, 2]},
    "requested_output_names": {"set": ["REPORT"]},
    "request_id": "rid-1",
    "correlation_id": 42,
    "flags": 0,
    "timeout": 60_123_456,
    # as Triton's core writes it: compact, text other than ASCII as it is
    "parameters": '{"p":"v","n":3,"b":true,"u":"é"}',
    "is_cancelled": False,
    "sender_is_cancelled": False,
    "noncontig": _list(_list(2, 2), _nd("float32", [2, 2], _list(_list(0.0, 2.0), _list(3.0, 5.0))),
                       False),
    "zero_d": _list(_list(), _nd("float32", [], 3.0)),
    "contiguous_shared": True,
    "read_only_stays": _nd("float32", [1], _list(0.0), writeable=False),
    "obj_str": _nd("object", [2], _list("a", "bc")),
    "bytes_S": _nd("|S2", [2], _list("bytes:61", "bytes:6263")),
    "f16_bool": _list(_nd("float16", [1], _list(1.5)), _nd("bool", [1], _list(True))),
    "list": _exc("TypeError", _CTOR),
    "bytes": _exc("TypeError", _CTOR),
    "none": _exc("TypeError", _CTOR),
    "np_scalar": _exc("TypeError", _CTOR),
    "int_name": _exc("TypeError", _CTOR),
    "empty_name": _exc("TritonModelException", "Tensor name cannot be an empty string."),
    "str_array": _exc("TritonModelException", Prefix("NumPy dtype is not supported.")),
    "big_endian": _exc("TritonModelException", Prefix("NumPy dtype is not supported.")),
    "complex": _exc("TritonModelException", Prefix("NumPy dtype is not supported.")),
    "record": _exc("TritonModelException", Prefix("NumPy dtype is not supported.")),
    # Exactly (L0_backend_python's dlpack test compares the whole text; ours added a hint).
    "bytes_to_dlpack": _exc("TritonModelException",
                            "DLPack does not have support for string tensors."),
    "dlpack_roundtrip": _nd("float64", [3], _list(0.0, 1.0, 2.0)),
    "dlpack_device": {"tuple": [1, 0]},
    "from_dlpack_list": _exc("TritonModelException", Prefix("")),
    "from_dlpack_empty_name": _exc("TritonModelException",
                                   "Tensor name cannot be an empty string."),
    "response_none_item": _exc("TritonModelException",
                               "Output tensor for inference response should not be empty."),
    "response_tuple": 1,
    "response_fresh_list": {"tuple": [None, 1]},
    "response_single_tensor": _exc("TypeError", _CTOR),
    "response_error_str": _exc("TypeError", _CTOR),
    "response_error": _list(True, "bad", 2, 0),
    "response_ok": _list(False, None),
    "codes": _list(0, 1, 2, 3, 4, 5, 6, 7),
    "code_text": _list("__ErrorCode.INTERNAL", "__ErrorCode.CANCELLED",
                       "<__ErrorCode.NOT_FOUND: 2>", True, "NOT_FOUND", "0"),
    "error_int_code": _exc("TypeError", _CTOR),
    "error_none_message": _exc("TypeError", _CTOR),
    "error_is_exception": False,
    "tme_no_args": "",
    "tme_two_args": "('a', 'b')",
    "tme_mro": _list("TritonModelException", "Exception", "BaseException", "object"),
    "numpy_to_triton": _list(11, 11, 1, 13, 13, 10, None, None, None),
    "triton_to_numpy": _list(None, "np:bool", "np:float32", "np:object", None, "np:float32",
                             None),
    "string_to_numpy": _list("np:float32", "type:<class 'bool'>", "np:object"),
    "string_to_numpy_unknown": _exc("KeyError", "'FP32'"),
    "serialize": _list({"tuple": []}, {"tuple": []},
                       "bytes:" + b"".join(len(s).to_bytes(4, "little") + s for s in (
                           b"a", b"b", b"1", b"2.5", b"None")).hex(),
                       "bytes:" + b"".join(len(s).to_bytes(4, "little") + s for s in (
                           b"a", b"", b"bc", b"d")).hex(),
                       "bytes:0200000061620100000063", None, None),
    "serialize_list": _exc("AttributeError", "'list' object has no attribute 'size'"),
    "deserialize": _list(_nd("object", [0], _list()),
                         *[_nd("object", [2], _list("bytes:6162", "bytes:"))] * 3),
    "deserialize_str": _exc("TypeError", Prefix("")),
    "constants": _list(1, 2, 1, 1, 2),
}

# Where tritonpy answers differently on purpose; the comment says what Triton 2.51 did.
BETTER_HERE = {
    # Triton: the stub dies (numpy's DLPack, numpy 1.26), the request answers "Stub process
    # 'probe_0_0' is not healthy", and so does every later one: the stub is never restarted.
    "from_dlpack_numpy": _nd("float64", [3], _list(0.0, 1.0, 2.0)),
    # Triton: TritonModelException "DLPack tensor is not contiguous. Only contiguous DLPack
    # tensors that are stored in C-Order are supported."; here a C-contiguous copy.
    "from_dlpack_noncontig": _nd("float32", [2, 2], _list(_list(0.0, 2.0), _list(3.0, 5.0))),
    # Triton: TypeError "Unable to convert function return value to a Python type! The
    # signature was (self: c_python_backend_utils.Tensor) -> TRITONSERVER_datatype_enum".
    "triton_dtype": _list(11, 13),
    # Triton: the stub dies (a request built in the model has no server-side request).
    "bls_request_is_cancelled": False,
    # Triton: "<c_python_backend_utils.TritonError object at 0x...>".
    "error_str": "m",
    # Triton's serialize_byte_tensor writes str(np.bytes_(b"ab")), "b'ab'" (5 bytes).
    "serialize_np_bytes_item": "bytes:020000006162",
}


def _matches(got: object, want: object) -> bool:
    if isinstance(want, Prefix):
        return isinstance(got, str) and got.startswith(want)
    if isinstance(want, dict):
        return (isinstance(got, dict) and got.keys() == want.keys()
                and all(_matches(got[k], v) for k, v in want.items()))
    return bool(got == want) and type(got) is type(want)


RET_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [
  { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "OUT2", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "SOUT", data_type: TYPE_STRING, dims: [ -1 ] }
]
"""

RET_PY = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def error(code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(code, getattr(
        pb_utils.TritonError, code)))


class TritonPythonModel:
    def execute(self, requests):
        # Not at module level: Triton 2.51 loads model.py once before pb_utils has its classes
        # (for auto-complete), and "T = pb_utils.Tensor" there fails the load.
        T = pb_utils.Tensor
        r = requests[0]
        x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
        mode = json.loads(r.parameters())["mode"]
        outputs = {
            "not_in_config": [T("OUT", x), T("NOTCFG", np.array([1], np.int32))],
            "not_requested": [T("OUT", x), T("OUT2", np.array([1, 2], np.int32))],
            "requested_missing": [T("OUT2", np.array([1, 2], np.int32))],
            "other_dtype": [T("OUT", x.astype(np.float64))],
            "other_shape": [T("OUT", x.reshape(1, -1))],
            "noncontig": [T("OUT", np.arange(6, dtype=np.float32).reshape(2, 3)[:, 1])],
            "objects": [T("SOUT", np.array([1, 2.5, None, b"z", "\\u00e9"], dtype=object))],
            "bytes_as_fp32": [T("OUT", np.array([b"a"], dtype=object))],
        }.get(mode)
        if outputs is not None:
            return [pb_utils.InferenceResponse(outputs)]
        if mode == "error_and_outputs":
            return [pb_utils.InferenceResponse([T("OUT", x)], error=pb_utils.TritonError("both"))]
        if mode == "sender":
            r.get_response_sender().send(pb_utils.InferenceResponse([T("OUT", x)]),
                                         flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
        if mode == "raise_empty":
            raise pb_utils.TritonModelException()
        return [error(mode)]
'''

# (mode, requested outputs) -> what the client received from both servers: outputs as
# {name: (datatype, shape, values)}, or (error class, message).
RETURNS = {
    ("not_in_config", None): {"OUT": ("FP32", (3,), [1.0, -2.0, 3.0])},  # NOTCFG dropped
    ("not_requested", ("OUT",)): {"OUT": ("FP32", (3,), [1.0, -2.0, 3.0])},
    ("requested_missing", ("OUT",)): {},
    ("other_dtype", None): {"OUT": ("FP64", (3,), [1.0, -2.0, 3.0])},  # not checked
    ("other_shape", None): {"OUT": ("FP32", (1, 3), [1.0, -2.0, 3.0])},
    ("noncontig", None): {"OUT": ("FP32", (2,), [1.0, 4.0])},
    ("objects", None): {"SOUT": ("BYTES", (5,), [b"1", b"2.5", b"None", b"z", "é".encode()])},
    ("bytes_as_fp32", None): {"OUT": ("BYTES", (1,), [b"a"])},
    ("sender", None): {"OUT": ("FP32", (3,), [1.0, -2.0, 3.0])},
    ("error_and_outputs", None): (tritonpy.InternalError, "both"),
    ("NOT_FOUND", None): (tritonpy.NotFoundError, "NOT_FOUND"),
    ("INVALID_ARG", None): (tritonpy.InvalidArgumentError, "INVALID_ARG"),
    ("UNAVAILABLE", None): (tritonpy.UnavailableError, "UNAVAILABLE"),
    ("CANCELLED", None): (tritonpy.CancelledError, "CANCELLED"),
    ("raise_empty", None): (tritonpy.InternalError,
                            "Failed to process the request(s) for model 'ret_0', message: "
                            "TritonModelException: <EMPTY MESSAGE>"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "probe", PROBE_PY, PROBE_CONFIG)
    write_model(repo, "ret", RET_PY, RET_CONFIG)
    with serving(repo, new_prefix()) as srv:
        yield srv


@pytest.fixture(scope="module")
def report(server):
    resp = infer(server.model("probe"),
                 {"IN": np.array([1, 2, 3], np.float32),
                  "TEXT": np.array([b"a", "é".encode()], dtype=object)},
                 requested_output_names=["REPORT"], request_id="rid-1", correlation_id=42,
                 timeout=60_123_456, parameters={"p": "v", "n": 3, "b": True, "u": "é"})
    assert resp.error is None, resp.error
    return json.loads(resp.outputs["REPORT"].to_numpy()[0])


@pytest.mark.parametrize("key", sorted(AS_TRITON))
def test_a_model_sees_what_it_sees_in_triton(report, key):
    assert _matches(report[key], AS_TRITON[key]), (report[key], AS_TRITON[key])


@pytest.mark.parametrize("key", sorted(BETTER_HERE))
def test_where_tritonpy_answers_better(report, key):
    assert _matches(report[key], BETTER_HERE[key]), (report[key], BETTER_HERE[key])


def test_the_probe_reports_every_case(report):
    assert sorted(report) == sorted({**AS_TRITON, **BETTER_HERE})


@pytest.mark.parametrize("mode, requested", sorted(RETURNS, key=str))
def test_what_the_client_receives(server, mode, requested):
    resp = infer(server.model("ret"), {"IN": np.array([1.0, -2.0, 3.0], np.float32)},
                 requested_output_names=list(requested) if requested else None,
                 parameters={"mode": mode})
    want = RETURNS[(mode, requested)]
    if isinstance(want, tuple):
        cls, message = want
        assert isinstance(resp.error, cls) and str(resp.error).startswith(message), resp.error
        return
    assert resp.error is None, resp.error
    got = {name: (t.data_type, t.shape, t.to_numpy().ravel().tolist())
           for name, t in resp.outputs.items()}
    assert got == want


# -- the same, outside a server: a model's unit test sees what its execute sees -------------
def test_a_sender_takes_an_integer_flag_only():
    # Triton (pybind11): send(response, 0.0) is a TypeError; True is taken as 1.
    sender = pb_utils.ResponseSender(pb_utils.InferenceRequest(
        model_name="m", inputs=[], requested_output_names=[]))
    for flags in (0.0, "1", None):
        with pytest.raises(TypeError, match="flags must be an int"):
            sender.send(pb_utils.InferenceResponse(), flags)
    with pytest.raises(pb_utils.TritonModelException, match="Unsupported flag"):
        sender.send(pb_utils.InferenceResponse(), np.int64(5))


def test_error_codes_print_as_tritons():
    code = pb_utils.TritonError("x", pb_utils.TritonError.UNAVAILABLE).code()
    assert (str(code), f"{code}", f"{code:d}", int(code)) == (
        "__ErrorCode.UNAVAILABLE", "__ErrorCode.UNAVAILABLE", "4", 4)
    # The class's upper-case names are its codes alone, as Triton 2.51's (measured; a helper
    # table of ours was listed among them).
    assert [n for n in dir(pb_utils.TritonError) if n.isupper()] == [
        "ALREADY_EXISTS", "CANCELLED", "INTERNAL", "INVALID_ARG", "NOT_FOUND", "UNAVAILABLE",
        "UNKNOWN", "UNSUPPORTED"]


BASE_CONFIG = {"name": "m", "max_batch_size": 0,
               "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [-1]}],
               "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [-1]}],
               "model_transaction_policy": {"decoupled": False}}


@pytest.mark.parametrize("call, message", [
    (lambda mc: mc.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [1], "f": 1}),
     "input 'X' in auto-complete-config function for model 'm' contains property other than "
     "'name', 'data_type', 'dims' and 'optional'."),
    (lambda mc: mc.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [1],
                               "optional": True}),
     "output 'Y' in auto-complete-config function for model 'm' contains property other than "
     "'name', 'data_type' and 'dims'."),
    (lambda mc: mc.add_input({"data_type": "TYPE_FP32", "dims": [1]}),
     "input in auto-complete-config function for model 'm' is missing 'name' property."),
    (lambda mc: mc.add_output({"data_type": "TYPE_FP32", "dims": [1]}),
     "output in auto-complete-config function for model 'm' is missing 'name' property."),
    (lambda mc: mc.add_input({"name": "X", "dims": [1]}),
     "input 'X' in auto-complete-config function for model 'm' is missing 'data_type' "
     "property."),
    (lambda mc: mc.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [2]}),
     "model 'm', tensor 'IN': the model expects dims [2] but the model configuration "
     "specifies dims [-1]"),
    (lambda mc: mc.set_model_transaction_policy({"decoupled": True}),
     "trying to change decoupled property in auto-complete-config for model 'm', which is "
     "already set to 'False'."),
])
def test_model_config_errors_in_tritons_words(call, message):
    mc = pb_utils.ModelConfig(json.dumps(BASE_CONFIG))
    with pytest.raises(ValueError) as info:
        call(mc)
    assert str(info.value) == message


def test_model_config_refuses_what_is_no_dict_with_a_type_error():
    # Triton: a TypeError too (indexing a str or list by "name").
    mc = pb_utils.ModelConfig(json.dumps(BASE_CONFIG))
    for value in ("X", [("name", "X")]):
        with pytest.raises(TypeError, match="input must be a dict"):
            mc.add_input(value)
    assert mc.as_dict()["input"] == BASE_CONFIG["input"]


def test_parameters_are_taken_as_the_response_is_made():
    """As Triton's, which turns them into JSON there: a change the model makes to its dict
    afterwards changes nothing (and cannot get past the checks: a lone surrogate put in later
    used to make the response unsendable); a str subclass is checked as a str is."""
    params = {"note": "fine"}
    resp = pb_utils.InferenceResponse([], parameters=params)
    params["note"] = "\ud800"
    params["late"] = 1
    assert json.loads(resp.parameters()) == {"note": "fine"}

    class Text(str):
        pass

    with pytest.raises(pb_utils.TritonModelException, match="valid UTF-8.*key 'k'"):
        pb_utils.InferenceResponse([], parameters={"k": Text("\ud800")})


def test_logger_and_metric_kinds_as_tritons():
    """Measured on Triton 2.51: its enums print their names, its Logger takes a str and a
    LogLevel only and cannot be made, its MetricFamily takes a MetricKind only, and a
    label that is no string is refused (a model doing any of these fails there)."""
    assert (str(pb_utils.Logger.INFO), f"{pb_utils.LogLevel.ERROR}") == (
        "LogLevel.INFO", "LogLevel.ERROR")
    assert str(pb_utils.MetricFamily.COUNTER) == "MetricKind.COUNTER"
    assert int(pb_utils.MetricFamily.HISTOGRAM) == 2
    for call in (lambda: pb_utils.Logger.log("x", 0), lambda: pb_utils.Logger.log_info(None),
                 lambda: pb_utils.Logger.log_info(5), pb_utils.Logger,
                 lambda: pb_utils.MetricFamily("tpy_kind_probe", "d", 0)):
        with pytest.raises(TypeError):
            call()
    family = pb_utils.MetricFamily("tpy_label_probe", "d", pb_utils.MetricFamily.GAUGE)
    with pytest.raises(pb_utils.TritonModelException, match="non-string as string"):
        family.Metric(labels={"k": 1})
    family.Metric(labels={"k": "v"}).set(2)


def test_memory_types_are_tritons():
    """Triton 2.51's numbers and names (a model that passes 0 for the GPU, as Triton's enum
    has it, got the CPU here)."""
    assert (int(pb_utils.TRITONSERVER_MEMORY_GPU), int(pb_utils.TRITONSERVER_MEMORY_CPU)) == (0, 1)
    assert str(pb_utils.TRITONSERVER_MEMORY_GPU) == "MemoryType.TRITONSERVER_MEMORY_GPU"
    assert pb_utils.MemoryType.TRITONSERVER_MEMORY_CPU is pb_utils.TRITONSERVER_MEMORY_CPU
