"""The package's exported classes name the package as their home, not the private modules
that define them: a traceback reads ``tritonpy.NotFoundError: ...``, a ``repr`` of a model
handle ``<tritonpy.Model ...>``, and a pickle refers to ``tritonpy.<name>``."""
from __future__ import annotations

import pickle
import traceback
from pathlib import Path

import pytest

import tritonpy
from _models import fp32, new_prefix, serving, write_model

pytestmark = pytest.mark.timeout(60)

EXPORTED_CLASSES = [n for n in tritonpy.__all__ if isinstance(getattr(tritonpy, n), type)]


def test_every_exported_class_names_the_package() -> None:
    assert len(EXPORTED_CLASSES) == 20
    wrong = {n: getattr(tritonpy, n).__module__ for n in EXPORTED_CLASSES
             if getattr(tritonpy, n).__module__ != "tritonpy"}
    assert wrong == {}


def test_what_a_user_sees_of_them(tmp_path: Path) -> None:
    write_model(tmp_path, "double")
    with serving(tmp_path, new_prefix()) as server:
        with pytest.raises(tritonpy.NotFoundError) as info:
            server.model("no_such_model")
        assert traceback.format_exception_only(info.value)[-1].startswith(
            "tritonpy.NotFoundError: ")
        model = server.model("double")
        assert repr(model).startswith("<tritonpy.Model object")
        stream = model.infer({"IN": fp32(1, 2)})
        assert repr(stream).startswith("<tritonpy.ResponseStream object")
        resp = next(iter(stream))
        assert type(resp.outputs["OUT"]).__module__ == "tritonpy"
        assert resp.outputs["OUT"].to_numpy().tolist() == [2.0, 4.0]


@pytest.mark.parametrize("error", [tritonpy.NotFoundError("gone"),
                                   tritonpy.InvalidArgumentError("bad"),
                                   tritonpy.ConfigError("broken")])
def test_errors_pickle_by_their_public_name(error: tritonpy.TritonpyError) -> None:
    data = pickle.dumps(error)
    assert b"tritonpy" in data and b"_errors" not in data  # the package, not its module
    back = pickle.loads(data)
    assert type(back) is type(error) and str(back) == str(error)
    assert tritonpy.ErrorCode(pickle.loads(pickle.dumps(error.code))) is error.code

