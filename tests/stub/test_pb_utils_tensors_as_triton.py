"""pb_utils tensors and responses behave as Triton 2.51's where model code can tell (each case
measured against the real Triton, running the same model.py on both servers):

* a tensor name given as bytes is taken as UTF-8 text;
* a tensor over a strided view (a slice, a transpose) holds a copy, made at ``Tensor(...)``,
  so writes into the viewed array afterwards do not reach it;
* ``to_dlpack()`` of a read-only array (``np.frombuffer`` of bytes) works (numpy refuses to
  export one in an unversioned capsule: it gives a copy then);
* a tensor imported from a bare DLPack capsule (``torch.utils.dlpack.to_dlpack`` gives those;
  numpy makes the same kind) is writable and shares the producer's memory, so it can be exported
  again: numpy alone imports such a capsule read-only;
* two outputs of one name in a response are refused at once, naming the name (Triton sends both,
  which gRPC's tritonclient cannot decode and HTTP's reads the first of): our own rule.

The last one is also checked through a real stub and server: the client gets the message.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest
import triton_python_backend_utils as pb_utils

from _models import infer, io_config, new_prefix, serving, write_model

pytestmark = pytest.mark.timeout(60)


def test_a_bytes_name_is_utf8_text():
    assert pb_utils.Tensor(b"x", np.zeros(1)).name() == "x"
    assert pb_utils.Tensor("é".encode(), np.zeros(1)).name() == "é"
    assert pb_utils.Tensor.from_dlpack(b"d", np.zeros(2)).name() == "d"
    with pytest.raises(pb_utils.TritonModelException, match="not UTF-8"):
        pb_utils.Tensor(b"\xff", np.zeros(1))
    with pytest.raises(pb_utils.TritonModelException, match="empty string"):
        pb_utils.Tensor(b"", np.zeros(1))


@pytest.mark.parametrize("view", [
    lambda a: a[:, 1], lambda a: a.T, lambda a: a[::-1], lambda a: np.asfortranarray(a),
], ids=["column", "transpose", "reversed", "fortran"])
def test_a_strided_view_is_copied_when_the_tensor_is_made(view):
    base = np.arange(6, dtype=np.int64).reshape(3, 2)
    src = view(base)
    want = src.copy()
    t = pb_utils.Tensor("OUT", src)
    base[:] = 42
    src[...] = 42
    assert t.as_numpy().tolist() == want.tolist()
    assert t.as_numpy().flags.c_contiguous


def test_a_contiguous_array_is_shared_as_before():
    base = np.arange(4, dtype=np.float32)
    t = pb_utils.Tensor("OUT", base)
    base[0] = 9
    assert t.as_numpy()[0] == 9  # no copy: the same memory (as Triton's)
    # A strided view given with a Triton dtype is copied first, then viewed.
    pairs = np.arange(8, dtype=np.int32).reshape(4, 2)[:, :1]
    viewed = pb_utils.Tensor("u", pairs, 4).as_numpy()  # 4: TYPE_UINT32
    assert viewed.dtype == np.uint32 and viewed.tolist() == [[0], [2], [4], [6]]


def test_a_read_only_array_exports_to_dlpack():
    raw = np.frombuffer(np.arange(3, dtype=np.float32).tobytes(), dtype=np.float32)
    assert not raw.flags.writeable
    t = pb_utils.Tensor("r", raw)
    again = pb_utils.Tensor.from_dlpack("again", t.to_dlpack())
    assert again.as_numpy().tolist() == [0.0, 1.0, 2.0]
    assert np.from_dlpack(t).tolist() == [0.0, 1.0, 2.0]  # a versioned consumer: no copy needed
    broadcast = pb_utils.Tensor("b", np.broadcast_to(np.float32(5), (2,)).copy())
    assert pb_utils.Tensor.from_dlpack("b2", broadcast.to_dlpack()).as_numpy().tolist() == [5, 5]


def test_a_tensor_from_a_bare_capsule_is_writable_and_shares_memory():
    producer = np.arange(6, dtype=np.float64).reshape(2, 3)
    t = pb_utils.Tensor.from_dlpack("x", producer.__dlpack__())  # a bare capsule
    arr = t.as_numpy()
    assert arr.flags.writeable
    arr[0, 0] = 7
    assert producer[0, 0] == 7  # zero copy: the producer's memory
    # Exported and imported again: still the same memory, still writable.
    twice = pb_utils.Tensor.from_dlpack("y", t.to_dlpack()).as_numpy()
    twice[1, 2] = -1
    assert producer[1, 2] == -1 and twice.flags.writeable
    # The import keeps the producer alive on its own.
    del producer, t
    gc.collect()
    assert arr.tolist() == [[7.0, 1.0, 2.0], [3.0, 4.0, -1.0]]
    assert twice.sum() == arr.sum()


def test_an_empty_tensor_from_a_bare_capsule():
    t = pb_utils.Tensor.from_dlpack("e", np.zeros((0, 3), np.float32).__dlpack__())
    assert t.shape() == [0, 3]


def test_two_outputs_of_one_name_are_refused():
    a, b = pb_utils.Tensor("OUT", np.zeros(1)), pb_utils.Tensor("OUT", np.ones(1))
    with pytest.raises(pb_utils.TritonModelException, match="'OUT' is given twice"):
        pb_utils.InferenceResponse([a, b])
    ok = pb_utils.InferenceResponse([a, pb_utils.Tensor("OUT2", np.ones(1))])
    assert [t.name() for t in ok.output_tensors()] == ["OUT", "OUT2"]


TWICE_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()
        outs = [pb_utils.Tensor("OUT", x)]
        if x[0] == 1:
            outs.append(pb_utils.Tensor("OUT", x + 1))
        return [pb_utils.InferenceResponse(outs)]
"""


def test_a_client_is_told_of_an_output_given_twice(tmp_path):
    write_model(tmp_path, "twice", TWICE_PY, io_config())
    with serving(tmp_path, new_prefix()) as server:
        resp = infer(server.model("twice"), {"IN": np.ones(2, np.float32)})
        assert resp.error is not None
        assert "output tensor 'OUT' is given twice" in str(resp.error)
        # The stub goes on serving.
        again = infer(server.model("twice"), {"IN": np.full(2, 3, np.float32)})
        assert again.error is None and again.outputs["OUT"].to_numpy().tolist() == [3.0, 3.0]
