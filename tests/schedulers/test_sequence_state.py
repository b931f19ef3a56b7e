"""Implicit state (``sequence_batching.state``) as Triton documents it: the state output of a
sequence's request is the state input of its next one; at START the state input holds its
initial value (zeros, or ``<model dir>/initial_state/<data_file>``). Triton 2.51's Python
backend does not carry it (measured with the same model.py: the initial value at every step),
so a model written to Triton's documentation got a state that never moved there.
"""
from __future__ import annotations

import numpy as np
import pytest

import tritonpy
from _models import new_prefix, serving, write_model

pytestmark = pytest.mark.timeout(60)

START, END = 1, 2

# OUT = state + IN; the new state is OUT, unless IN is negative (then no state output at all).
# STATE_OUT_TYPE makes a model that returns its state in another type than the config's.
ACC_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

STATE_OUT_TYPE = np.float32

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            st = pb_utils.get_input_tensor_by_name(r, "INPUT_STATE").as_numpy()
            s = (st + x).astype(np.float32)
            tensors = [pb_utils.Tensor("OUT", s)]
            if "OUTPUT_STATE" in r.requested_output_names() and float(x.reshape(-1)[0]) >= 0:
                tensors.append(pb_utils.Tensor("OUTPUT_STATE", s.astype(STATE_OUT_TYPE)))
            out.append(pb_utils.InferenceResponse(tensors))
        return out
"""


def _config(initial: str = "", listed: bool = False) -> str:
    state_out = ', { name: "OUTPUT_STATE" data_type: TYPE_FP32 dims: [ 1 ] }' if listed else ""
    return f"""
backend: "python"
max_batch_size: 4
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }}{state_out} ]
sequence_batching {{
  state [ {{ input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_FP32
            dims: [ 1 ] {initial} }} ]
}}
"""


def _step(model, cid: int, x: float, flags: int = 0, outputs=None) -> dict[str, float]:
    resp = model.infer({"IN": np.array([[x]], np.float32)}, outputs, correlation_id=cid,
                       flags=flags).get(timeout=30)
    assert resp.error is None, resp.error
    return {k: float(v.to_numpy().reshape(-1)[0]) for k, v in resp.outputs.items()}


def _sums(model, cid: int, xs=(1, 2, 3)) -> list[float]:
    flags = [START] + [0] * (len(xs) - 2) + [END]
    got = []
    for x, f in zip(xs, flags):
        outs = _step(model, cid, x, f)
        assert list(outs) == ["OUT"]  # the state output is the server's: the config omits it
        got.append(outs["OUT"])
    return got


def test_the_state_output_is_the_next_steps_state_input(tmp_path):
    write_model(tmp_path, "zeros", ACC_PY, _config(
        'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "z" }'))
    write_model(tmp_path, "bare", ACC_PY, _config())
    mdir = write_model(tmp_path, "from_file", ACC_PY, _config(
        'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] data_file: "ten" name: "f" }'))
    (mdir / "initial_state").mkdir()
    (mdir / "initial_state" / "ten").write_bytes(np.array([10], np.float32).tobytes())
    with serving(tmp_path, new_prefix()) as server:
        assert _sums(server.model("zeros"), 7) == [1.0, 3.0, 6.0]
        assert _sums(server.model("bare"), 8) == [1.0, 3.0, 6.0]
        assert _sums(server.model("from_file"), 9) == [11.0, 13.0, 16.0]
        # The same ID again starts from the initial state, not from where it ended.
        assert _sums(server.model("from_file"), 9) == [11.0, 13.0, 16.0]
        # A state input is the server's to give: a client that sends one is refused.
        with pytest.raises(tritonpy.InvalidArgumentError, match="INPUT_STATE"):
            server.model("zeros").infer(
                {"IN": np.array([[1]], np.float32), "INPUT_STATE": np.array([[100]], np.float32)},
                correlation_id=10, flags=START | END)


def test_sequences_keep_their_own_state(tmp_path):
    write_model(tmp_path, "acc", ACC_PY, _config())
    with serving(tmp_path, new_prefix()) as server:
        m = server.model("acc")
        assert _step(m, 1, 1, START)["OUT"] == 1
        assert _step(m, 2, 100, START)["OUT"] == 100
        assert _step(m, 1, 1)["OUT"] == 2
        assert _step(m, 2, 100)["OUT"] == 200
        # A step that returns no state output leaves the state as it was.
        assert _step(m, 1, -5)["OUT"] == -3
        assert _step(m, 1, 1)["OUT"] == 3
        # START on an ID whose sequence is open ends it: the new one starts from zeros.
        assert _step(m, 2, 7, START)["OUT"] == 7
        assert _step(m, 2, 1, END)["OUT"] == 8
        assert _step(m, 1, 1, END)["OUT"] == 4


def test_a_client_gets_the_state_output_only_when_the_config_lists_it(tmp_path):
    write_model(tmp_path, "listed", ACC_PY, _config(listed=True))
    write_model(tmp_path, "unlisted", ACC_PY, _config())
    with serving(tmp_path, new_prefix()) as server:
        listed = server.model("listed")
        # Asking for every output gets it; asking for OUT alone still carries the state.
        assert _step(listed, 3, 2, START) == {"OUT": 2.0, "OUTPUT_STATE": 2.0}
        assert _step(listed, 3, 3, 0, ["OUT"]) == {"OUT": 5.0}
        assert _step(listed, 3, 4, END, ["OUTPUT_STATE"]) == {"OUTPUT_STATE": 9.0}
        with pytest.raises(tritonpy.InvalidArgumentError, match="OUTPUT_STATE"):
            server.model("unlisted").infer({"IN": np.array([[1]], np.float32)},
                                           ["OUTPUT_STATE"], correlation_id=4, flags=START)


def test_a_state_output_of_the_wrong_type_fails_that_request_and_keeps_the_state(tmp_path):
    write_model(tmp_path, "wrong", ACC_PY.replace("STATE_OUT_TYPE = np.float32",
                                                  "STATE_OUT_TYPE = np.float64"), _config())
    with serving(tmp_path, new_prefix()) as server:
        m = server.model("wrong")
        resp = m.infer({"IN": np.array([[1]], np.float32)}, correlation_id=5,
                       flags=START).get(timeout=30)
        assert isinstance(resp.error, tritonpy.InternalError)
        assert ("returned state output 'OUTPUT_STATE' as FP64, but its state 'INPUT_STATE' is "
                "TYPE_FP32") in resp.error.message
        # The sequence goes on, from the state it had (zeros), and the model still serves.
        assert _step(m, 5, -1, END)["OUT"] == -1
        assert _step(m, 6, -2, START | END)["OUT"] == -2


BIG_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            st = pb_utils.get_input_tensor_by_name(r, "INPUT_STATE").as_numpy()
            s = x.copy() if st.size == 0 else st + x
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", s[:1]),
                                                   pb_utils.Tensor("OUTPUT_STATE", s)]))
        return out
"""

BIG_CONFIG = """
backend: "python"
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching {
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_FP32
            dims: [ -1 ] } ]
}
"""


def test_a_large_state_goes_back_to_the_model_by_handle(tmp_path):
    write_model(tmp_path, "big", BIG_PY, BIG_CONFIG)
    ones = np.ones(1 << 18, np.float32)  # 1 MiB: by handle, not inline
    with serving(tmp_path, new_prefix()) as server:
        m, tx = server.model("big"), server.transport

        def step(flags: int) -> float:
            resp = m.infer({"IN": ones}, correlation_id=11, flags=flags).get(timeout=30)
            assert resp.error is None, resp.error
            return float(resp.outputs["OUT"].to_numpy()[0])

        assert step(START) == 1.0  # a state of shape [0] at START: dims [ -1 ]
        copies, forwards = tx.copies, tx.forwards
        assert step(0) == 2.0
        # The host copied the client's input into shared memory, and not the state: the
        # model's state output went back to it by handle.
        assert tx.copies - copies == ones.nbytes
        assert tx.forwards - forwards == 1
        assert step(END) == 3.0


def test_an_initial_state_file_that_cannot_be_read_fails_the_load(tmp_path):
    # In Triton 2.51's words (measured; QA L0_implicit_state), as a failure of the version;
    # a file longer than the state is taken, its first bytes (as in Triton).
    write_model(tmp_path, "missing", ACC_PY, _config(
        'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] data_file: "nope" name: "f" }'))
    mdir = write_model(tmp_path, "short", ACC_PY, _config(
        'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] data_file: "two" name: "f" }'))
    (mdir / "initial_state").mkdir()
    (mdir / "initial_state" / "two").write_bytes(b"\0\0")
    mdir = write_model(tmp_path, "long", ACC_PY, _config(
        'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] data_file: "eight" name: "f" }'))
    (mdir / "initial_state").mkdir()
    (mdir / "initial_state" / "eight").write_bytes(np.array([5, 9], np.float32).tobytes())
    with serving(tmp_path, new_prefix()) as server:
        state = {m["name"]: m for m in server.models()}
        assert state["missing"]["state"] == "UNAVAILABLE"
        assert state["missing"]["reason"] == (
            "Internal: failed to open text file for read "
            f"{tmp_path / 'missing' / 'initial_state' / 'nope'}: No such file or directory")
        assert state["short"]["state"] == "UNAVAILABLE"
        assert state["short"]["reason"] == (
            "Invalid argument: initial_state setting expects 4 bytes, but the data provided "
            "from twoonly has 2 bytes.")
        assert state["long"]["state"] == "READY"
        model = server.model("long")
        first = model.infer({"IN": np.ones((1, 1), np.float32)}, correlation_id=1, flags=1)
        assert first.get(timeout=30).error is None


@pytest.mark.parametrize("state, words", [
    ('input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_FP32 dims: [ 1 ] '
     'initial_state: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true name: "x" }',
     "'initial_state' dim for input name 'INPUT_STATE' doesn't match 'state' dim "
     "description. 2 != 1"),
    ('input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_FP32 dims: [ 1 ] '
     'initial_state: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "x" }',
     "The data type used for 'initial_state' field of state 'INPUT_STATE' does not match the "
     "state data type."),
    ('input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_FP32 dims: [ -1 ] '
     'initial_state: { data_type: TYPE_FP32 dims: [ -1 ] zero_data: true name: "x" }',
     "'initial_state' field for state input name 'INPUT_STATE' contains variable dimensions."),
    ('input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_FP32 dims: [ 1 ] '
     'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] name: "x" }',
     "initial_state setting expects state'INPUT_STATE' to have state_data set"),
    ('input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_FP32 dims: [ 1 ] '
     'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true }',
     "Field 'name' must be set when using initial_state for state input 'INPUT_STATE'."),
    ('input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_FP32 dims: [ 1, 1 ] '
     'initial_state: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "x" }',
     "Number of dimensions in 'initial_state' doesn't match the size of 'state' dimensions "
     "for state input 'INPUT_STATE'. 1 != 2"),
    # Triton 2.51 loads this one and aborts at its first request.
    ('output_name: "OUTPUT_STATE" data_type: TYPE_FP32 dims: [ 1 ]',
     "a 'state' of the sequence batching of model 'bad' has no 'input_name'"),
    # Triton 2.51 loads this one; tritonpy died at start with a ProtocolError, or in explicit
    # mode left the model LOADING for ever (QA L0_model_config, measured).
    ('input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" dims: [ 1 ]',
     "the 'state' 'INPUT_STATE' of the sequence batching of model 'bad' has no 'data_type'"),
])
def test_a_bad_initial_state_fails_the_load_as_in_triton(tmp_path, state: str,
                                                         words: str) -> None:
    # As Triton 2.51 refuses them at load (measured; QA L0_implicit_state). tritonpy loaded
    # them: a 2-element state for a 1-element one, a state of [0] elements, and so on.
    write_model(tmp_path, "bad", ACC_PY, _config().replace(
        'input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_FP32\n'
        '            dims: [ 1 ] ', state))
    with serving(tmp_path, new_prefix(), model_control_mode="explicit") as server:
        with pytest.raises(tritonpy.InvalidArgumentError) as err:
            server.load("bad")
        assert err.value.message == ("load failed for model 'bad': version 1 is at "
                                     f"UNAVAILABLE state: Invalid argument: {words}")


def test_a_bytes_initial_state_is_its_whole_file(tmp_path) -> None:
    # As Triton 2.51 reads a TYPE_STRING initial state: the file whole, as serialized elements
    # (tritonpy refused every BYTES data file: "need a fixed size").
    from tritonclient.grpc.model_config_pb2 import ModelSequenceBatching

    from tritonpy._sequence_controls import _initial_state
    from tritonpy.shm.dtypes import serialize_bytes

    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "words").write_bytes(
        serialize_bytes(np.array([b"ab", b""], dtype=object)))
    st = ModelSequenceBatching.State(input_name="S", output_name="S_OUT", data_type=13,
                                     dims=[2])  # TYPE_STRING
    st.initial_state.add(data_type=13, dims=[2], data_file="words", name="w")
    arr = _initial_state(st, True, str(tmp_path), set(), "m")
    assert arr.shape == (1, 2) and arr.tolist() == [[b"ab", b""]]
