"""The exact public surface of ``triton_python_backend_utils`` (as trio's test_exports does).

A name added to or dropped from pb_utils must be a decision: update the list below with it.
"""
from __future__ import annotations

import __future__
import types
import typing

import triton_python_backend_utils
from tritonpy.stub import pb_utils

# Triton's names (SPEC §2), plus tritonpy's one extension, empty_shm_tensor.
EXPECTED = [
    "InferenceRequest",
    "InferenceResponse",
    "LogLevel",
    "Logger",
    "MemoryType",
    "Metric",
    "MetricFamily",
    "ModelConfig",
    "PreferredMemory",
    "ResponseSender",
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_CPU_PINNED",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITON_STRING_TO_NUMPY",
    "Tensor",
    "Trace",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "empty_shm_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_model_dir",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "is_model_ready",
    "load_model",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "unload_model",
    "using_decoupled_model_transaction_policy",
]


def _public(module: types.ModuleType) -> list[str]:
    """Public names, leaving out imported modules (np, json), ``from __future__`` features
    and typing constructs: what a model could take for pb_utils API."""
    out = []
    for name in dir(module):
        if name.startswith("_"):
            continue
        value = getattr(module, name)
        if isinstance(value, (types.ModuleType, __future__._Feature)):
            continue
        if getattr(value, "__module__", None) == "typing" or value is typing.Any:
            continue
        out.append(name)
    return sorted(out)


def test_public_names_of_the_module_a_stub_installs():
    # The stub installs this very module object as triton_python_backend_utils.
    assert _public(pb_utils) == EXPECTED


def test_all_lists_exactly_the_public_names():
    assert sorted(pb_utils.__all__) == EXPECTED


def test_plain_interpreter_alias_has_the_same_names_and_objects():
    assert _public(triton_python_backend_utils) == EXPECTED
    for name in EXPECTED:
        assert getattr(triton_python_backend_utils, name) is getattr(pb_utils, name), name


def test_error_codes_and_log_levels():
    codes = {n: getattr(pb_utils.TritonError, n) for n in (
        "UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
        "ALREADY_EXISTS", "CANCELLED")}
    assert sorted(codes.values()) == list(range(8))
    assert [m.name for m in pb_utils.LogLevel] == ["INFO", "WARNING", "ERROR", "VERBOSE"]
    assert (pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE,
            pb_utils.MetricFamily.HISTOGRAM) == (0, 1, 2)
