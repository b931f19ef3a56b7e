"""Model configuration and metadata as a client reads them, compared with Triton 2.51 case by
case: each expected body here is what Triton 2.51 answered on ``GET /v2/models/<m>/config`` for
the same ``config.pbtxt`` (or ``auto_complete_config``), key order included, since clients and
models (``args["model_config"]``) see the JSON as Triton prints it.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from _models import serving_frontends, write_model

IO4 = ('input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
       'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]\n')

CONFIGS = {
    "seq_oldest": 'backend: "python"\nmax_batch_size: 4\n' + IO4 + """sequence_batching {
  oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2 ]
           max_queue_delay_microseconds: 100 }
  control_input [ { name: "START"
                    control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ]
            initial_state: { name: "init" data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } ]
}
""",
    "seq_direct": 'backend: "python"\nmax_batch_size: 4\n' + IO4 + """sequence_batching {
  direct { max_queue_delay_microseconds: 10 minimum_slot_utilization: 0.5 }
  max_sequence_idle_microseconds: 5000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
""",
    "db_full": 'backend: "python"\nmax_batch_size: 8\n' + IO4 + """dynamic_batching {
  preferred_batch_size: [ 2, 4 ]
  max_queue_delay_microseconds: 100
  preserve_ordering: true
  default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 5000
                         allow_timeout_override: true max_queue_size: 16 }
}
""",
    "auto": "",
}

SIMPLE_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""

# auto_complete_config fills inputs, outputs, max_batch_size and dynamic batching.
AUTO_PY = SIMPLE_PY.replace("class TritonPythonModel:\n", """class TritonPythonModel:
    @staticmethod
    def auto_complete_config(c):
        c.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4]})
        c.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]})
        c.set_max_batch_size(8)
        c.set_dynamic_batching()
        return c

""")

# What Triton 2.51 answered, byte for byte.
TRITON = {
    "seq_oldest": (
        '{"name":"seq_oldest","platform":"","backend":"python","runtime":"","version_policy":{"'
        'latest":{"num_versions":1}},"max_batch_size":4,"input":[{"name":"IN","data_type":"TYPE'
        '_FP32","format":"FORMAT_NONE","dims":[4],"is_shape_tensor":false,"allow_ragged_batch":'
        'false,"optional":false,"is_non_linear_format_io":false}],"output":[{"name":"OUT","data'
        '_type":"TYPE_FP32","dims":[4],"label_filename":"","is_shape_tensor":false,"is_non_line'
        'ar_format_io":false}],"batch_input":[],"batch_output":[],"optimization":{"priority":"P'
        'RIORITY_DEFAULT","input_pinned_memory":{"enable":true},"output_pinned_memory":{"enable'
        '":true},"gather_kernel_buffer_threshold":0,"eager_batching":false},"sequence_batching"'
        ':{"oldest":{"max_candidate_sequences":4,"preferred_batch_size":[2],"max_queue_delay_mi'
        'croseconds":100,"preserve_ordering":false},"max_sequence_idle_microseconds":1000000,"c'
        'ontrol_input":[{"name":"START","control":[{"kind":"CONTROL_SEQUENCE_START","int32_fals'
        'e_true":[0,1],"fp32_false_true":[],"bool_false_true":[],"data_type":"TYPE_INVALID"}]}]'
        ',"state":[{"input_name":"INPUT_STATE","output_name":"OUTPUT_STATE","data_type":"TYPE_I'
        'NT32","dims":[1],"initial_state":[{"data_type":"TYPE_INT32","dims":["1"],"name":"init"'
        ',"zero_data":true}],"use_same_buffer_for_input_output":false,"use_growable_memory":fal'
        'se}],"iterative_sequence":false},"instance_group":[{"name":"seq_oldest","kind":"KIND_C'
        'PU","count":1,"gpus":[],"secondary_devices":[],"profile":[],"passive":false,"host_poli'
        'cy":""}],"default_model_filename":"model.py","cc_model_filenames":{},"metric_tags":{},'
        '"parameters":{},"model_warmup":[]}'
    ),
    "seq_direct": (
        '{"name":"seq_direct","platform":"","backend":"python","runtime":"","version_policy":{"'
        'latest":{"num_versions":1}},"max_batch_size":4,"input":[{"name":"IN","data_type":"TYPE'
        '_FP32","format":"FORMAT_NONE","dims":[4],"is_shape_tensor":false,"allow_ragged_batch":'
        'false,"optional":false,"is_non_linear_format_io":false}],"output":[{"name":"OUT","data'
        '_type":"TYPE_FP32","dims":[4],"label_filename":"","is_shape_tensor":false,"is_non_line'
        'ar_format_io":false}],"batch_input":[],"batch_output":[],"optimization":{"priority":"P'
        'RIORITY_DEFAULT","input_pinned_memory":{"enable":true},"output_pinned_memory":{"enable'
        '":true},"gather_kernel_buffer_threshold":0,"eager_batching":false},"sequence_batching"'
        ':{"direct":{"max_queue_delay_microseconds":10,"minimum_slot_utilization":0.5},"max_seq'
        'uence_idle_microseconds":5000000,"control_input":[{"name":"START","control":[{"kind":"'
        'CONTROL_SEQUENCE_START","int32_false_true":[],"fp32_false_true":[0,1],"bool_false_true'
        '":[],"data_type":"TYPE_INVALID"}]},{"name":"READY","control":[{"kind":"CONTROL_SEQUENC'
        'E_READY","int32_false_true":[0,1],"fp32_false_true":[],"bool_false_true":[],"data_type'
        '":"TYPE_INVALID"}]},{"name":"END","control":[{"kind":"CONTROL_SEQUENCE_END","int32_fal'
        'se_true":[],"fp32_false_true":[],"bool_false_true":[false,true],"data_type":"TYPE_INVA'
        'LID"}]},{"name":"CORRID","control":[{"kind":"CONTROL_SEQUENCE_CORRID","int32_false_tru'
        'e":[],"fp32_false_true":[],"bool_false_true":[],"data_type":"TYPE_UINT64"}]}],"state":'
        '[],"iterative_sequence":false},"instance_group":[{"name":"seq_direct","kind":"KIND_CPU'
        '","count":1,"gpus":[],"secondary_devices":[],"profile":[],"passive":false,"host_policy'
        '":""}],"default_model_filename":"model.py","cc_model_filenames":{},"metric_tags":{},"p'
        'arameters":{},"model_warmup":[]}'
    ),
    "db_full": (
        '{"name":"db_full","platform":"","backend":"python","runtime":"","version_policy":{"lat'
        'est":{"num_versions":1}},"max_batch_size":8,"input":[{"name":"IN","data_type":"TYPE_FP'
        '32","format":"FORMAT_NONE","dims":[4],"is_shape_tensor":false,"allow_ragged_batch":fal'
        'se,"optional":false,"is_non_linear_format_io":false}],"output":[{"name":"OUT","data_ty'
        'pe":"TYPE_FP32","dims":[4],"label_filename":"","is_shape_tensor":false,"is_non_linear_'
        'format_io":false}],"batch_input":[],"batch_output":[],"optimization":{"priority":"PRIO'
        'RITY_DEFAULT","input_pinned_memory":{"enable":true},"output_pinned_memory":{"enable":t'
        'rue},"gather_kernel_buffer_threshold":0,"eager_batching":false},"dynamic_batching":{"p'
        'referred_batch_size":[2,4],"max_queue_delay_microseconds":100,"preserve_ordering":true'
        ',"priority_levels":0,"default_priority_level":0,"default_queue_policy":{"timeout_actio'
        'n":"REJECT","default_timeout_microseconds":5000,"allow_timeout_override":true,"max_que'
        'ue_size":16},"priority_queue_policy":{}},"instance_group":[{"name":"db_full","kind":"K'
        'IND_CPU","count":1,"gpus":[],"secondary_devices":[],"profile":[],"passive":false,"host'
        '_policy":""}],"default_model_filename":"model.py","cc_model_filenames":{},"metric_tags'
        '":{},"parameters":{},"model_warmup":[]}'
    ),
    "auto": (
        '{"name":"auto","platform":"","backend":"python","runtime":"","version_policy":{"latest'
        '":{"num_versions":1}},"max_batch_size":8,"input":[{"name":"IN","data_type":"TYPE_FP32"'
        ',"format":"FORMAT_NONE","dims":[4],"is_shape_tensor":false,"allow_ragged_batch":false,'
        '"optional":false,"is_non_linear_format_io":false}],"output":[{"name":"OUT","data_type"'
        ':"TYPE_FP32","dims":[4],"label_filename":"","is_shape_tensor":false,"is_non_linear_for'
        'mat_io":false}],"batch_input":[],"batch_output":[],"optimization":{"priority":"PRIORIT'
        'Y_DEFAULT","input_pinned_memory":{"enable":true},"output_pinned_memory":{"enable":true'
        '},"gather_kernel_buffer_threshold":0,"eager_batching":false},"dynamic_batching":{"pref'
        'erred_batch_size":[8],"max_queue_delay_microseconds":0,"preserve_ordering":false,"prio'
        'rity_levels":0,"default_priority_level":0,"priority_queue_policy":{}},"instance_group"'
        ':[{"name":"auto","kind":"KIND_CPU","count":1,"gpus":[],"secondary_devices":[],"profile'
        '":[],"passive":false,"host_policy":""}],"default_model_filename":"model.py","cc_model_'
        'filenames":{},"metric_tags":{},"parameters":{},"model_warmup":[]}'
    ),
}


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    repo = tmp_path_factory.mktemp("config_vs_triton")
    for name, config in CONFIGS.items():
        write_model(repo, name, AUTO_PY if name == "auto" else SIMPLE_PY, config)
    write_model(repo, "three", SIMPLE_PY, 'backend: "python"\n' + IO4 +
                "version_policy: { all { } }\n", versions=(1, 2, 3))
    with serving_frontends(repo) as (_, fe):
        yield f"127.0.0.1:{fe.http_port}", f"127.0.0.1:{fe.grpc_port}"


def pairs(text: str) -> Any:
    """The JSON with every object as a list of (key, value): key order counts."""
    return json.loads(text, object_pairs_hook=list)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_config_endpoint_prints_what_triton_prints_in_its_order(
        urls: tuple[str, str], name: str) -> None:
    with urllib.request.urlopen(f"http://{urls[0]}/v2/models/{name}/config", timeout=30) as r:
        body = r.read().decode()
    assert pairs(body) == pairs(TRITON[name])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_clients_read_the_same_config_as_from_triton(urls: tuple[str, str], name: str) -> None:
    http = httpclient.InferenceServerClient(urls[0])
    grpc = grpcclient.InferenceServerClient(urls[1])
    try:
        assert http.get_model_config(name) == json.loads(TRITON[name])
        expected = json_format.Parse(TRITON[name], model_config_pb2.ModelConfig())
        assert grpc.get_model_config(name).config == expected
    finally:
        http.close()
        grpc.close()


def test_an_initial_state_prints_its_name_before_its_data_as_triton(
        urls: tuple[str, str]) -> None:
    # Triton's printer puts a set scalar oneof member ('zero_data', 'data_file') after the
    # other fields, though 'name' is declared after it.
    with urllib.request.urlopen(f"http://{urls[0]}/v2/models/seq_oldest/config", timeout=30) as r:
        config = json.loads(r.read())
    initial = config["sequence_batching"]["state"][0]["initial_state"][0]
    assert list(initial) == ["data_type", "dims", "name", "zero_data"]
    assert initial["dims"] == ["1"]  # a string, as Triton leaves it


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_unknown_model_or_version_is_not_found_as_in_triton(
        urls: tuple[str, str], protocol: str) -> None:
    module: Any = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(urls[0] if protocol == "http" else urls[1])
    try:
        for call in (client.get_model_config, client.get_model_metadata):
            with pytest.raises(InferenceServerException) as e:
                call("nosuch")
            assert e.value.message() == "Request for unknown model: 'nosuch' is not found"
            with pytest.raises(InferenceServerException) as e:
                call("db_full", "9")
            assert e.value.message() == ("Request for unknown model: 'db_full' version 9 is "
                                         "not found")
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_metadata_of_a_version_names_that_version_as_in_triton(
        urls: tuple[str, str], protocol: str) -> None:
    module: Any = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(urls[0] if protocol == "http" else urls[1])
    try:
        def versions(*version: str) -> list[str]:
            meta = client.get_model_metadata("three", *version)
            return list(meta["versions"] if protocol == "http" else meta.versions)

        assert versions() == ["1", "2", "3"]
        assert versions("2") == ["2"]  # tritonpy used to list every loaded version here
    finally:
        client.close()


def test_an_empty_model_name_is_an_unknown_model_as_in_triton(urls: tuple[str, str]) -> None:
    # Over gRPC; over HTTP the path has no model name (/v2/models//config): 404 "Not Found" on
    # both servers.
    client = grpcclient.InferenceServerClient(urls[1])
    try:
        for call in (client.get_model_config, client.get_model_metadata):
            with pytest.raises(InferenceServerException) as e:
                call("")
            # It used to be INVALID_ARGUMENT "Missing model name in request".
            assert e.value.status() == "StatusCode.NOT_FOUND"
            assert e.value.message() == "Request for unknown model: '' is not found"
    finally:
        client.close()
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(f"http://{urls[0]}/v2/models//config", timeout=30)
    assert h.value.code == 404 and json.loads(h.value.read()) == {"error": "Not Found"}
