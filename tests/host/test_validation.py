"""tritonpy.validation: Triton's request checks, model metadata and datatype names."""
from __future__ import annotations

from typing import Any

import pytest
from tritonclient.grpc.model_config_pb2 import DataType, ModelConfig

from tritonpy import validation
from tritonpy._errors import ErrorCode, InvalidArgumentError
from tritonpy.config import normalize_config, parse_config_text
from tritonpy.validation import (
    RequestValidator,
    model_metadata,
    triton_type_name,
    validate_request,
)

BATCHING = """
max_batch_size: 8
input [
  { name: "IN" data_type: TYPE_FP32 dims: [ -1, 4 ] },
  { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] reshape { shape: [ ] } },
  { name: "OPT" data_type: TYPE_INT32 dims: [ 2 ] optional: true }
]
output [
  { name: "OUT" data_type: TYPE_FP32 dims: [ -1, 4 ] },
  { name: "LEN" data_type: TYPE_INT64 dims: [ 1 ] }
]
"""

PLAIN = """
input [
  { name: "A" data_type: TYPE_FP32 dims: [ 2, -1 ] },
  { name: "B" data_type: TYPE_BOOL dims: [ 3 ] }
]
output [ { name: "C" data_type: TYPE_FP32 dims: [ 2, -1 ] } ]
"""

NOTE = (
    " NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension "
    "to be prepended to each input shape."
)


def config(text: str, name: str = "m") -> ModelConfig:
    return normalize_config(parse_config_text(text, "config.pbtxt"), name, "config.pbtxt")


@pytest.fixture(scope="module")
def batching() -> RequestValidator:
    return RequestValidator(config(BATCHING), "m")


@pytest.fixture(scope="module")
def plain() -> RequestValidator:
    return RequestValidator(config(PLAIN), "m")


# What Triton's core puts before a request error when the request has no id.
UNKNOWN = "[request id: <id_unknown>] "


def rejected(validator: RequestValidator, inputs: dict[str, Any],
             outputs: list[str] | None = None, request_id: str = "") -> str:
    with pytest.raises(InvalidArgumentError) as info:
        validator.validate(inputs, outputs, request_id)
    assert info.value.code is ErrorCode.INVALID_ARG
    return str(info.value)


# --- accepted ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inputs", "outputs"),
    [
        ({"IN": ("FP32", (1, 5, 4)), "TEXT": ("BYTES", (1, 1))}, None),
        ({"IN": ("FP32", (8, 1, 4)), "TEXT": ("BYTES", (8, 1))}, []),
        ({"IN": ("FP32", [3, 0, 4]), "TEXT": ("BYTES", [3, 1]), "OPT": ("INT32", [3, 2])}, ["LEN"]),
        ({"TEXT": ("BYTES", (2, 1)), "IN": ("FP32", (2, 7, 4))}, ["OUT", "LEN"]),
    ],
)
def test_batching_model_accepts(batching: RequestValidator, inputs: dict[str, Any],
                                outputs: list[str] | None) -> None:
    batching.validate(inputs, outputs)


@pytest.mark.parametrize(
    "inputs",
    [
        {"A": ("FP32", (2, 1)), "B": ("BOOL", (3,))},
        {"A": ("FP32", (2, 100)), "B": ("BOOL", (3,))},
    ],
)
def test_non_batching_model_accepts(plain: RequestValidator, inputs: dict[str, Any]) -> None:
    plain.validate(inputs, ["C"])


# --- rejected: names and counts -------------------------------------------------------------------


def test_unknown_requested_output(batching: RequestValidator) -> None:
    message = rejected(batching, {"IN": ("FP32", (1, 1, 4)), "TEXT": ("BYTES", (1, 1))},
                       ["OUT", "NOPE"], request_id="r7")
    # Triton finds an unknown name while looking it up in the model: no request prefix.
    assert message == "unexpected inference output 'NOPE' for model 'm'"


def test_unknown_input(plain: RequestValidator) -> None:
    message = rejected(plain, {"A": ("FP32", (2, 1)), "Z": ("BOOL", (3,))})
    assert message == "unexpected inference input 'Z' for model 'm'"
    message = rejected(plain, {"A": ("FP32", (2, 1)), "Z": ("BOOL", (3,))}, request_id="r8")
    assert message == "unexpected inference input 'Z' for model 'm'"


def test_missing_input_without_optional_inputs(plain: RequestValidator) -> None:
    message = rejected(plain, {"A": ("FP32", (2, 1))}, request_id="abc")
    assert message == (
        "[request id: abc] expected 2 inputs but got 1 inputs for model 'm'. Got input(s) ['A'], "
        "but missing required input(s) ['B']. Please provide all required input(s)."
    )
    assert rejected(plain, {}).startswith(UNKNOWN + "expected 2 inputs but got 0 inputs for model 'm'. "
                                          "Got input(s) [], but missing required input(s) ['A','B']")


def test_too_many_inputs(plain: RequestValidator) -> None:
    message = rejected(plain, {"A": ("FP32", (2, 1)), "B": ("BOOL", (3,)), "X": ("FP32", (1,))})
    assert message.startswith(UNKNOWN + "expected 2 inputs but got 3 inputs for model 'm'. "
                              "Got input(s) ['A','B','X'], but missing required input(s) []")


def test_missing_input_with_optional_inputs(batching: RequestValidator) -> None:
    message = rejected(batching, {"IN": ("FP32", (1, 1, 4))})
    assert message == UNKNOWN + (
        "expected number of inputs between 2 and 3 but got 1 inputs for model 'm'. Got input(s) "
        "['IN'], but missing required input(s) ['TEXT']. Please provide all required input(s)."
    )
    # An optional input standing in for a required one: Triton lets it through, we do not,
    # and say which one is missing (not the count, which is within range).
    message = rejected(batching, {"IN": ("FP32", (1, 1, 4)), "OPT": ("INT32", (1, 2))})
    assert message == UNKNOWN + (
        "missing required input(s) ['TEXT'] for model 'm': got input(s) ['IN','OPT'], and an "
        "optional input does not stand in for a required one. Please provide all required "
        "input(s).")


# --- rejected: datatypes and shapes -----------------------------------------------------------------


def test_datatype_mismatch(batching: RequestValidator) -> None:
    message = rejected(batching, {"IN": ("FP64", (1, 1, 4)), "TEXT": ("BYTES", (1, 1))},
                       request_id="x")
    assert message == "[request id: x] inference input 'IN' data-type is 'FP64', but model 'm' expects 'FP32'"
    message = rejected(batching, {"IN": ("FP32", (1, 1, 4)), "TEXT": ("STRING", (1, 1))})
    assert message == UNKNOWN + "inference input 'TEXT' data-type is 'STRING', but model 'm' expects 'BYTES'"


def test_shape_mismatch_batching(batching: RequestValidator) -> None:
    message = rejected(batching, {"IN": ("FP32", (2, 5, 3)), "TEXT": ("BYTES", (2, 1))})
    assert message.startswith(
        UNKNOWN + "unexpected shape for input 'IN' for model 'm'. Expected [-1,-1,4], got [2,5,3]." + NOTE
    )
    # A forgotten batch dimension is the common case the note is for.
    message = rejected(batching, {"IN": ("FP32", (5, 4)), "TEXT": ("BYTES", (5, 1))})
    assert message.startswith(UNKNOWN + "unexpected shape for input 'IN' for model 'm'. Expected "
                              "[-1,-1,4], got [5,4].")


def test_shape_mismatch_non_batching(plain: RequestValidator) -> None:
    message = rejected(plain, {"A": ("FP32", (3, 1)), "B": ("BOOL", (3,))})
    assert message == UNKNOWN + "unexpected shape for input 'A' for model 'm'. Expected [2,-1], got [3,1]. "
    message = rejected(plain, {"A": ("FP32", (2, 1)), "B": ("BOOL", (1, 3))})
    assert message == UNKNOWN + "unexpected shape for input 'B' for model 'm'. Expected [3], got [1,3]. "


def test_unspecified_dimensions(plain: RequestValidator, batching: RequestValidator) -> None:
    message = rejected(plain, {"A": ("FP32", (2, -1)), "B": ("BOOL", (3,))})
    assert message == (UNKNOWN + "All input dimensions should be specified for input 'A' for "
                       "model 'm', got [2,-1]")
    message = rejected(batching, {"IN": ("FP32", (-1, 1, 4)), "TEXT": ("BYTES", (-1, 1))})
    assert message.startswith(UNKNOWN + "All input dimensions should be specified for input 'IN'")


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        ({"IN": ("FP32", (9, 1, 4)), "TEXT": ("BYTES", (9, 1))},
         "inference request batch-size must be <= 8 for 'm'"),
        ({"IN": ("FP32", (0, 1, 4)), "TEXT": ("BYTES", (0, 1))},
         "inference request batch-size must be >= 1 for 'm'"),
        ({"IN": ("FP32", (2, 1, 4)), "TEXT": ("BYTES", (3, 1))},
         "input 'TEXT' batch size does not match other inputs for 'm'"),
        ({"IN": ("FP32", ()), "TEXT": ("BYTES", (1, 1))},
         "input 'IN' has no shape but model requires batch dimension for 'm'"),
    ],
)
def test_batch_dimension(batching: RequestValidator, inputs: dict[str, Any], expected: str) -> None:
    assert rejected(batching, inputs) == UNKNOWN + expected
    assert rejected(batching, inputs, request_id="b1") == "[request id: b1] " + expected


def test_check_order_follows_triton(batching: RequestValidator) -> None:
    # Outputs first, then the input count, then names, then batch, then datatype and shape.
    bad = {"IN": ("FP64", (9, 1, 3)), "TEXT": ("BYTES", (9, 1))}
    assert "unexpected inference output" in rejected(batching, bad, ["X"])
    assert "batch-size must be <= 8" in rejected(batching, bad)
    bad["IN"] = ("FP64", (1, 1, 3))
    bad["TEXT"] = ("BYTES", (1, 1))
    assert "data-type is 'FP64'" in rejected(batching, bad)


# --- the cached function form ------------------------------------------------------------------------


def test_validate_request_caches_per_config_object() -> None:
    cfg = config(PLAIN)
    good = {"A": ("FP32", (2, 1)), "B": ("BOOL", (3,))}
    validate_request(cfg, "m", good, None)
    first = validation._CACHE[id(cfg)][2]
    validate_request(cfg, "m", good, ["C"], request_id="again")
    assert validation._CACHE[id(cfg)][2] is first
    with pytest.raises(InvalidArgumentError, match=r"^unexpected inference "
                                                   r"input 'Q' for model 'other'$"):
        validate_request(cfg, "other", {"A": ("FP32", (2, 1)), "Q": ("BOOL", (3,))}, None, "q")
    assert validation._CACHE[id(cfg)][2] is not first


# --- metadata and type names ----------------------------------------------------------------------


def test_model_metadata_batching() -> None:
    assert model_metadata(config(BATCHING), "m", [1, 3]) == {
        "name": "m",
        "versions": ["1", "3"],
        "platform": "python",
        "inputs": [
            {"name": "IN", "datatype": "FP32", "shape": [-1, -1, 4]},
            {"name": "TEXT", "datatype": "BYTES", "shape": [-1, 1]},
            {"name": "OPT", "datatype": "INT32", "shape": [-1, 2]},
        ],
        "outputs": [
            {"name": "OUT", "datatype": "FP32", "shape": [-1, -1, 4]},
            {"name": "LEN", "datatype": "INT64", "shape": [-1, 1]},
        ],
    }


def test_model_metadata_plain_and_ensemble() -> None:
    meta = model_metadata(config(PLAIN), "m", [2])
    assert meta["platform"] == "python" and meta["versions"] == ["2"]
    assert meta["inputs"][0] == {"name": "A", "datatype": "FP32", "shape": [2, -1]}
    ensemble = parse_config_text('platform: "ensemble"', "config.pbtxt")
    assert model_metadata(ensemble, "e", [])["platform"] == "ensemble"


def test_triton_type_names() -> None:
    names = {name: triton_type_name(value) for name, value in DataType.items()}
    assert names == {
        "TYPE_INVALID": "INVALID", "TYPE_BOOL": "BOOL", "TYPE_UINT8": "UINT8",
        "TYPE_UINT16": "UINT16", "TYPE_UINT32": "UINT32", "TYPE_UINT64": "UINT64",
        "TYPE_INT8": "INT8", "TYPE_INT16": "INT16", "TYPE_INT32": "INT32", "TYPE_INT64": "INT64",
        "TYPE_FP16": "FP16", "TYPE_FP32": "FP32", "TYPE_FP64": "FP64", "TYPE_STRING": "BYTES",
        "TYPE_BF16": "BF16",
    }
    assert triton_type_name(999) == "INVALID"
