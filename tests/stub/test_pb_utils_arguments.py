"""pb_utils refuses arguments of the wrong type as Triton's (pybind11) API does: a TypeError
naming the argument, at construction, instead of an object that fails later or never. The
parameter errors carry Triton's own wording, which users and Triton's tests match on.

Runs in a plain interpreter: ``triton_python_backend_utils`` imports outside a server.
"""
from __future__ import annotations

import numpy as np
import pytest
import triton_python_backend_utils as pb_utils

from tritonpy.stub import pb_utils as stub_pb_utils

T = pb_utils.Tensor("IN", np.zeros(2, np.float32))


@pytest.mark.parametrize("kwargs, what", [
    ({"model_name": None}, "model_name"),
    ({"model_name": 3}, "model_name"),
    ({"inputs": None}, "inputs"),
    ({"inputs": [np.zeros(2)]}, "inputs"),
    ({"requested_output_names": None}, "requested_output_names"),
    ({"requested_output_names": [None]}, "requested_output_names"),
    ({"request_id": None}, "request_id"),
    ({"model_version": None}, "model_version"),
    ({"model_version": 1.5}, "model_version"),
    ({"flags": None}, "flags"),
    ({"timeout": "10"}, "timeout"),
    # Unsigned in Triton, whose API refuses a negative one (they used to be accepted here).
    ({"timeout": -1}, "timeout"),
    ({"flags": -1}, "flags"),
    ({"correlation_id": -1}, "correlation_id"),
    # (QA) Past Triton's widths: flags of 32 bits (2**32 was delivered as it was), the others
    # of 64.
    ({"flags": 2**32}, "flags must be below 2\\*\\*32"),
    ({"timeout": 2**64}, "timeout must be below 2\\*\\*64"),
    ({"correlation_id": 2**64}, "correlation_id must be below 2\\*\\*64"),
])
def test_inference_request_wrong_argument_types(kwargs, what):
    args = {"model_name": "m", "inputs": [T], "requested_output_names": ["OUT"], **kwargs}
    with pytest.raises(TypeError, match=what):
        pb_utils.InferenceRequest(**args)


@pytest.mark.parametrize("left_out", ["model_name", "inputs", "requested_output_names"])
def test_inference_request_required_arguments(left_out):
    args = {"model_name": "m", "inputs": [T], "requested_output_names": ["OUT"]}
    del args[left_out]
    with pytest.raises(TypeError, match=left_out):
        pb_utils.InferenceRequest(**args)


def test_inference_request_positional_order_and_bytes_names_as_triton():
    # Triton's order: request_id, correlation_id, inputs, requested_output_names, model_name.
    req = pb_utils.InferenceRequest("rid", 7, [T], [b"OUT"], b"target")
    assert (req.request_id(), req.correlation_id(), req.model_name()) == ("rid", 7, "target")
    assert req.requested_output_names() == {"OUT"} and req.inputs() == [T]


def test_inference_request_accepts_numpy_integers_and_defaults():
    req = pb_utils.InferenceRequest(model_name="m", inputs=[T], requested_output_names=["OUT"],
                                    model_version=np.int64(2), timeout=np.int32(5))
    assert req.model_version() == 2 and type(req.model_version()) is int
    assert req.timeout() == 5
    bare = pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[])
    assert bare.inputs() == [] and bare.requested_output_names() == set()


def test_a_missing_tensor_in_a_list_is_tritons_model_exception():
    # Triton 2.51's words (its argument_validation QA model catches TritonModelException).
    with pytest.raises(pb_utils.TritonModelException) as e:
        pb_utils.InferenceRequest(request_id="r1", model_name="m", inputs=[T, None],
                                  requested_output_names=["OUT"])
    assert str(e.value) == ("Input tensor for request with id 'r1' and model name 'm' should "
                            "not be empty.")
    with pytest.raises(pb_utils.TritonModelException) as e:
        pb_utils.InferenceResponse(output_tensors=[None])
    assert str(e.value) == "Output tensor for inference response should not be empty."
    with pytest.raises(pb_utils.TritonModelException) as e:  # refused as it is built
        pb_utils.InferenceRequest(request_id="r2", model_name="m", inputs=[T],
                                  requested_output_names=["OUT", ""])
    assert str(e.value) == ("Requested output name for request with id 'r2' and model name "
                            "'m' should not be empty.")


def test_inference_response_and_tensor_wrong_argument_types():
    with pytest.raises(TypeError, match="output_tensors"):
        pb_utils.InferenceResponse(output_tensors=None)
    with pytest.raises(TypeError, match="output_tensors"):
        pb_utils.InferenceResponse(output_tensors=[np.zeros(2)])
    assert pb_utils.InferenceResponse().output_tensors() == []
    assert pb_utils.InferenceResponse((T,)).output_tensors() == [T]
    with pytest.raises(TypeError, match="numpy_array"):
        pb_utils.Tensor("OUT", None)
    with pytest.raises(TypeError, match="name"):
        pb_utils.Tensor(None, np.zeros(2))
    # As Triton's (measured): a numpy array only, so a model that runs here runs there too.
    for data, kind in (([1.0, 2.0], "list"), (5, "int"), (np.float32(3), "float32"),
                       ({"a": 1}, "dict")):
        with pytest.raises(TypeError, match=f"must be a numpy.ndarray, got {kind} "):
            pb_utils.Tensor("OUT", data)
    with pytest.raises(TypeError, match="masked array"):
        pb_utils.Tensor("OUT", np.ma.masked_array([1.0, 2.0], mask=[False, True]))
    # An ndarray subclass is an ndarray (a memmap, say), and a 0-d array is one too.
    assert pb_utils.Tensor("OUT", np.arange(2).view(np.recarray)).shape() == [2]
    assert pb_utils.Tensor("OUT", np.array(3.0, np.float32)).shape() == []
    # As Triton: a TritonModelException (the model may catch it), naming what was given.
    with pytest.raises(pb_utils.TritonModelException, match="given a NoneType.*DLPack capsule"):
        pb_utils.Tensor.from_dlpack("OUT", None)
    with pytest.raises(pb_utils.TritonModelException, match="__dlpack_device__"):
        pb_utils.Tensor.from_dlpack("OUT", type("OnlyDlpack", (), {"__dlpack__": None})())
    with pytest.raises(pb_utils.TritonModelException, match="name cannot be an empty string"):
        pb_utils.Tensor.from_dlpack("", np.arange(3))
    assert pb_utils.Tensor.from_dlpack("OUT", np.arange(3)).as_numpy().tolist() == [0, 1, 2]


@pytest.mark.parametrize("params, message", [
    ([], "Expect parameters to be a dict or a JSON object string, got <class 'list'>"),
    ({1: "int key"}, "Expect parameters keys to have type str, found type <class 'int'>"),
    ({"int": 2, "float": 0.5},
     "Expect parameters values to have type bool/int/str, found type <class 'float'>"),
    ({"null": None},
     "Expect parameters values to have type bool/int/str, found type <class 'NoneType'>"),
    # Past 64 bits: Triton answers "Unsupported value type on parameters"; it used to be an
    # OverflowError out of exec().
    ({"big": 2 ** 70}, "Unsupported value type on parameters: 1180591620717411303424 is not "
                       "a 64-bit signed integer (key 'big')"),
    # (QA) Triton's parameters are int64: 2**63 was passed on.
    ({"big": 2 ** 63}, "Unsupported value type on parameters: 9223372036854775808 is not a "
                       "64-bit signed integer (key 'big')"),
])
def test_parameter_errors_use_tritons_wording(params, message):
    for build in (lambda: pb_utils.InferenceResponse([T], parameters=params),
                  lambda: pb_utils.InferenceRequest(model_name="m", inputs=[T],
                                                    requested_output_names=[], parameters=params)):
        with pytest.raises(pb_utils.TritonModelException) as info:
            build()
        assert message in info.value.message()


def test_parameters_read_as_triton_writes_them():
    # Built in the model: Triton's stub writes them with json.dumps; a request that came
    # through the server reads as its core writes them, compact (tests/bls check that side).
    req = pb_utils.InferenceRequest(model_name="m", inputs=[T], requested_output_names=[],
                                    parameters={"b": True, "i": 5, "s": "x"})
    assert req.parameters() == '{"b": true, "i": 5, "s": "x"}'


def test_triton_error_takes_what_tritons_takes():
    # As Triton's (measured): a str or bytes message and one of its codes; anything else is
    # a TypeError when it is built (it was a ValueError, or taken and sent as it was).
    assert pb_utils.TritonError(b"bytes msg").message() == "bytes msg"
    with pytest.raises(TypeError, match="error must be a pb_utils.TritonError, got str"):
        pb_utils.InferenceResponse([], error="x")
    err = pb_utils.TritonError("x", pb_utils.TritonError.NOT_FOUND)
    assert (err.message(), err.code()) == ("x", pb_utils.TritonError.NOT_FOUND)
    for message in (5, None, ["x"]):
        with pytest.raises(TypeError, match="message must be a str"):
            pb_utils.TritonError(message)
    # Its codes are an enum of their own, as Triton's (a plain number is refused there too);
    # they still compare equal to their numbers.
    assert repr(err.code()) == "<__ErrorCode.NOT_FOUND: 2>" and err.code() == 2
    for code in (2, 99, -1, "INTERNAL", 1.0, True, 2 ** 70):
        with pytest.raises(TypeError, match="invalid TritonError code"):
            pb_utils.TritonError("x", code)


def test_a_sender_refuses_what_is_no_response_with_a_type_error():
    # As Triton's (pybind11, measured): TypeError for an argument of the wrong type, while a
    # bad flag is a TritonModelException on both.
    request = pb_utils.InferenceRequest(model_name="m", inputs=[T], requested_output_names=[])
    sender = pb_utils.ResponseSender(request)
    with pytest.raises(TypeError, match="takes a pb_utils.InferenceResponse or None, got str"):
        sender.send("not a response")
    with pytest.raises(pb_utils.TritonModelException, match="Unsupported flag provided"):
        sender.send(pb_utils.InferenceResponse(), flags=12345)


def test_preferred_memory_takes_a_memory_type_and_an_integer_device():
    # As Triton 2.51's (pybind11): a MemoryType, required, and an int device id; "x", a plain
    # number (0 for the GPU) or a str device id were taken here and fail there.
    for memory_type in ("x", 0, 1, None, 1.0):
        with pytest.raises(TypeError) as err:
            pb_utils.PreferredMemory(memory_type)
        assert str(err.value) == (
            "PreferredMemory: preferred_memory_type must be pb_utils.TRITONSERVER_MEMORY_GPU or "
            f"TRITONSERVER_MEMORY_CPU (a MemoryType, not a number), got {memory_type!r}")
    for device in ("0", None, 0.0):
        with pytest.raises(TypeError) as err:
            pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, device)
        assert str(err.value) == (f"PreferredMemory: preferred_device_id must be int, "
                                  f"got {type(device).__name__}")
    with pytest.raises(TypeError, match="preferred_memory_type"):
        pb_utils.PreferredMemory()
    gpu = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, np.int64(1))
    assert (gpu.preferred_memory_type, gpu.preferred_device_id) == (
        pb_utils.TRITONSERVER_MEMORY_GPU, 1)
    assert type(gpu.preferred_device_id) is int
    cpu = pb_utils.PreferredMemory(
        preferred_memory_type=pb_utils.MemoryType.TRITONSERVER_MEMORY_CPU)
    assert (cpu.preferred_memory_type, cpu.preferred_device_id) == (
        pb_utils.TRITONSERVER_MEMORY_CPU, 0)
    # A bool is an int to Triton's (pybind11, measured in QA round 15): True is device 1.
    cpu = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, True)
    assert cpu.preferred_device_id == 1 and type(cpu.preferred_device_id) is int


def test_a_preferred_device_id_as_triton_takes_it():
    # QA round 16: numpy's True was refused (Triton 2.51 takes it), 2**64 taken (refused).
    cpu = pb_utils.TRITONSERVER_MEMORY_CPU
    assert pb_utils.PreferredMemory(cpu, np.True_).preferred_device_id == 1
    with pytest.raises(TypeError, match="must be an int64, got 18446744073709551616"):
        pb_utils.PreferredMemory(cpu, 2**64)


def test_a_preferred_memory_that_is_not_one_is_refused():
    # As Triton 2.51's binding (a TypeError); any object was taken here.
    with pytest.raises(TypeError, match="preferred_memory must be PreferredMemory, got str"):
        pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[],
                                  preferred_memory="GPU")
    request = pb_utils.InferenceRequest(
        model_name="m", inputs=[], requested_output_names=[],
        preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU))
    assert request.model_name() == "m"


class _Server:
    """Stands in for a stub's runtime (as in a server): records the model loading calls."""

    def __init__(self):
        self.calls = []

    def model_call(self, what, name, **kw):
        self.calls.append((what, name, kw))
        return True


@pytest.fixture
def server(monkeypatch):
    rt = _Server()
    monkeypatch.setattr(stub_pb_utils, "_runtime", rt)
    return rt


@pytest.mark.parametrize("call, message", [
    (lambda: pb_utils.load_model(model_name=123), "load_model: model_name must be str, got int"),
    (lambda: pb_utils.load_model(None), "load_model: model_name must be str, got NoneType"),
    (lambda: pb_utils.load_model("m", config={"backend": "python"}),
     "load_model: config must be str, got dict"),
    (lambda: pb_utils.unload_model(7), "unload_model: model_name must be str, got int"),
    (lambda: pb_utils.is_model_ready(model_name="ident", model_version=1),
     "is_model_ready: model_version must be str, got int"),
    (lambda: pb_utils.is_model_ready(3), "is_model_ready: model_name must be str, got int"),
    (lambda: pb_utils.unload_model("m", unload_dependents="yes"),
     "unload_model: unload_dependents must be bool, got str"),
    (lambda: pb_utils.unload_model("m", None),
     "unload_model: unload_dependents must be bool, got NoneType"),
    (lambda: pb_utils.unload_model("m", []),
     "unload_model: unload_dependents must be bool, got list"),
])
def test_the_model_loading_api_takes_strings(server, call, message):
    # As Triton 2.51's bindings (std::string model_name, config and model_version): these
    # reached the server here (model_version=1 read as "1") and are a TypeError there.
    with pytest.raises(TypeError) as err:
        call()
    assert str(err.value) == message
    assert server.calls == []


def test_the_model_loading_api_with_strings_reaches_the_server(server):
    pb_utils.load_model("m", config='{"backend": "python"}', files={"file:1/model.py": b""})
    pb_utils.load_model(b"m")  # bytes, as Triton's std::string takes them
    pb_utils.unload_model("m", unload_dependents=True)
    assert pb_utils.is_model_ready("m", "1") is True
    assert server.calls == [
        ("load", "m", {"config": '{"backend": "python"}', "files": {"file:1/model.py": b""}}),
        ("load", "m", {"config": "", "files": None}),
        ("unload", "m", {"unload_dependents": True}),
        ("ready", "m", {"version": "1"})]


def test_unload_dependents_takes_ints_as_tritons_bool_does(server):
    # Triton 2.51 (pybind11's bool, converting) takes 0/1 and numpy's bools, as measured in
    # QA round 15, and floats by their truth (measured since); they were a TypeError here.
    for given, flag in ((0, False), (1, True), (np.int64(1), True), (np.True_, True),
                        (2, True), (1.0, True), (0.0, False), (np.float32(1), True)):
        pb_utils.unload_model("m", given)
        assert server.calls[-1] == ("unload", "m", {"unload_dependents": flag})
        assert type(server.calls[-1][2]["unload_dependents"]) is bool


def test_names_as_bytes_that_are_not_utf8_go_on(server):
    # Triton 2.51 takes any bytes as a std::string: is_model_ready(b"\xff\xfe") is False
    # there (QA round 15); it was a UnicodeDecodeError here. Such bytes are kept apart from
    # every text name (surrogateescape, as os.fsdecode reads a folder's name): no name they
    # hold is taken for another model's.
    assert pb_utils.is_model_ready(b"\xff\xfe") is True  # (the stand-in says True)
    pb_utils.load_model(b"\xff\xfe")
    pb_utils.unload_model(b"\xfe")
    assert server.calls == [("ready", "\udcff\udcfe", {"version": ""}),
                            ("load", "\udcff\udcfe", {"config": "", "files": None}),
                            ("unload", "\udcfe", {"unload_dependents": False})]
    request = pb_utils.InferenceRequest(request_id=b"\xff", model_name=b"m\xff",
                                        inputs=[], requested_output_names=[b"OUT\xff"])
    assert (request.request_id(), request.model_name(), request.requested_output_names()) == (
        "\udcff", "m\udcff", {"OUT\udcff"})


@pytest.mark.parametrize("files", [[1], "file:1/model.py", ({"file:1/model.py": b""},)])
def test_load_model_files_that_are_no_dict_are_refused_in_tritons_words(server, files):
    # Was "'list' object has no attribute 'items'" from the server (QA round 15).
    with pytest.raises(pb_utils.TritonModelException) as err:
        pb_utils.load_model("zz", '{"backend": "python"}', files=files)
    assert str(err.value) == ("failed to load model 'zz', files should be a dictionary of "
                              "file paths and file contents")
    assert server.calls == []


@pytest.mark.parametrize("files, error, message", [
    ({"file:1/model.py": "text"}, TypeError,
     "load_model: the content of files['file:1/model.py'] must be bytes, got str"),
    ({"file:1/model.py": None}, TypeError,
     "load_model: the content of files['file:1/model.py'] must be bytes, got NoneType"),
    ({1: b""}, TypeError, "load_model: the paths in files must be str or bytes, got int (1)"),
    ({b"file:1/\xff.py": b""}, pb_utils.TritonModelException,
     "load_model: the file path b'file:1/\\xff.py' is not UTF-8 text"),
])
def test_load_model_files_are_checked_at_the_call(server, files, error, message):
    # Triton 2.51 (measured): a str or None content is a TypeError at the call, a path that
    # is neither str nor bytes "Unable to cast". Here a str content reached the server (its
    # refusal came back as a TritonModelException) and an int path was dropped.
    with pytest.raises(error) as err:
        pb_utils.load_model("m", '{"backend": "python"}', files=files)
    assert str(err.value) == message
    assert server.calls == []


def test_load_model_takes_file_paths_in_bytes(server):
    # As Triton's std::string keys: a path given in bytes is a file (it was dropped here).
    pb_utils.load_model("m", "{}", files={b"file:1/model.py": b"code", "file:x": b""})
    assert server.calls == [("load", "m", {"config": "{}", "files": {
        "file:1/model.py": b"code", "file:x": b""}})]
