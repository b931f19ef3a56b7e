"""tritonpy.config: parsing, Triton's defaults and checks, and the JSON form a model sees."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tritonclient.grpc.model_config_pb2 import ModelConfig, ModelInstanceGroup

from tritonpy._errors import ConfigError, InvalidArgumentError, NotFoundError
from tritonpy.config import (
    config_from_dict,
    config_to_dict,
    config_to_json,
    load_model_config,
    normalize_config,
    parse_config_text,
)

PATH = "/repo/m/config.pbtxt"

REALISTIC = """
name: "m"
backend: "python"
max_batch_size: 8
input [
  { name: "IN" data_type: TYPE_FP32 dims: [ -1, 4 ] },
  { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } optional: true }
]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
instance_group [ { kind: KIND_CPU count: 2 } ]
parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "$$TRITON_MODEL_DIRECTORY/env" } }
model_transaction_policy { decoupled: true }
"""


def parse(text: str) -> ModelConfig:
    return parse_config_text(text, PATH)


def normalized(text: str, name: str = "m", gpus: int = 0) -> ModelConfig:
    return normalize_config(parse(text), name, PATH, gpu_count=gpus)


def config_error(text: str, name: str = "m", gpus: int = 0) -> str:
    with pytest.raises(ConfigError) as info:
        normalized(text, name, gpus)
    message = str(info.value)
    assert message.startswith(PATH + ": ")
    return message


IO = 'input [{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }]\n'


# --- parsing ---------------------------------------------------------------------------------


def test_parse_realistic_config() -> None:
    cfg = parse(REALISTIC)
    assert cfg.max_batch_size == 8
    assert list(cfg.input[0].dims) == [-1, 4]
    assert cfg.input[1].optional
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 100
    assert cfg.parameters["EXECUTION_ENV_PATH"].string_value.endswith("/env")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('name: "m"\n\n\n  max_batch_sizes: 4\n',
         f"{PATH}:4:3: invalid field 'max_batch_sizes' in ModelConfig"),
        ('input [\n  {\n    nam: "a"\n  }\n]\n', f"{PATH}:3:5: invalid field 'nam' in ModelInput"),
        ("instance_group [ { kind: KIND_TPU } ]",
         f"{PATH}:1:26: Enum type \"inference.ModelInstanceGroup.Kind\" has no value named "
         "KIND_TPU. (in 'instance_group [ { kind: KIND_TPU } ]')"),
    ],
)
def test_parse_error_names_file_line_column_and_field(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert str(info.value) == expected
    assert isinstance(info.value, InvalidArgumentError)


@pytest.mark.parametrize(
    ("text", "where", "fragments"),
    [
        ('max_batch_size: "x"', ":1:17:", ["Couldn't parse integer", "max_batch_size"]),
        ('name: "a"\nname: "b"', ":2:", ['multiple "name" fields']),
        ("dynamic_batching {}\nsequence_batching {}", ":2:", ["sequence_batching", "oneof"]),
        ("max_batch_size: 4 {", ":1:19:", ["Expected identifier or number", "got {"]),
        ('input [{ data_type: TYPE_FP33 }]', ":1:", ["TYPE_FP33"]),
    ],
)
def test_parse_errors_are_precise(text: str, where: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse(text)
    message = str(info.value)
    assert message.startswith(PATH + where)
    for fragment in fragments:
        assert fragment in message


def test_load_model_config_present_and_absent(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.pbtxt").write_text('name: "a"\nmax_batch_size: 2\n')
    cfg, provided = load_model_config(str(tmp_path / "a"))
    assert provided and cfg.name == "a" and cfg.max_batch_size == 2

    (tmp_path / "b").mkdir()
    cfg, provided = load_model_config(str(tmp_path / "b"))
    assert not provided and cfg == ModelConfig()


def test_load_model_config_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="does not exist"):
        load_model_config(str(tmp_path / "missing"))

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.pbtxt").write_text('name: "bad"\nbackend: "python"\ninputs []\n')
    with pytest.raises(ConfigError) as info:
        load_model_config(str(bad))
    assert str(info.value) == f"{bad}/config.pbtxt:3:1: invalid field 'inputs' in ModelConfig"

    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "config.pbtxt").write_bytes(b'name: "\xff"\n')
    with pytest.raises(ConfigError, match="config.pbtxt: not UTF-8"):
        load_model_config(str(binary))

    weird = tmp_path / "weird"
    (weird / "config.pbtxt").mkdir(parents=True)
    with pytest.raises(ConfigError, match="config.pbtxt: cannot read model configuration"):
        load_model_config(str(weird))


# --- normalisation: what Triton fills ----------------------------------------------------------


def test_defaults_for_an_empty_config_without_gpus() -> None:
    empty = ModelConfig()
    cfg = normalize_config(empty, "m", PATH)
    assert empty == ModelConfig(), "the input is not modified"
    assert cfg.name == "m"
    assert cfg.backend == "python"
    assert cfg.default_model_filename == "model.py"
    assert cfg.version_policy.latest.num_versions == 1
    assert cfg.optimization.input_pinned_memory.enable
    assert cfg.optimization.output_pinned_memory.enable
    assert len(cfg.instance_group) == 1
    group = cfg.instance_group[0]
    # Triton names the group it creates after the model itself.
    assert (group.name, group.kind, group.count, list(group.gpus)) == (
        "m", ModelInstanceGroup.KIND_CPU, 1, []
    )


def test_default_instance_group_uses_all_gpus() -> None:
    group = normalized(IO, gpus=2).instance_group[0]
    assert (group.name, group.kind, group.count, list(group.gpus)) == (
        "m", ModelInstanceGroup.KIND_GPU, 1, [0, 1]
    )


def test_explicit_groups_are_named_counted_and_resolved() -> None:
    text = IO + """instance_group [
        { kind: KIND_CPU count: 3 },
        { name: "mine" kind: KIND_AUTO },
        { kind: KIND_GPU count: 0 },
        { kind: KIND_AUTO gpus: [ 5 ] }
    ]"""
    with pytest.raises(ConfigError, match="has kind KIND_CPU but specifies one or more GPUs"):
        normalized(text, gpus=2)  # KIND_AUTO with a missing GPU becomes CPU, as in Triton
    cfg = normalized(text.replace("gpus: [ 5 ]", "gpus: [ 1 ]"), gpus=2)
    got = [(g.name, ModelInstanceGroup.Kind.Name(g.kind), g.count, list(g.gpus))
           for g in cfg.instance_group]
    assert got == [
        ("m_0", "KIND_CPU", 3, []),
        ("mine", "KIND_GPU", 1, [0, 1]),
        ("m_2", "KIND_GPU", 1, [0, 1]),
        ("m_3", "KIND_GPU", 1, [1]),
    ]
    cpu_only = normalized(IO + 'instance_group [{ kind: KIND_AUTO count: 2 }]')
    assert ModelInstanceGroup.Kind.Name(cpu_only.instance_group[0].kind) == "KIND_CPU"


def test_batching_defaults() -> None:
    cfg = normalized(IO + "max_batch_size: 16\ndynamic_batching { }")
    assert list(cfg.dynamic_batching.preferred_batch_size) == [16]
    cfg = normalized(IO + "dynamic_batching { }")
    assert list(cfg.dynamic_batching.preferred_batch_size) == []
    cfg = normalized(IO + "max_batch_size: 4\nsequence_batching { oldest { } }")
    assert cfg.sequence_batching.max_sequence_idle_microseconds == 1_000_000
    assert list(cfg.sequence_batching.oldest.preferred_batch_size) == [4]


def test_name_and_backend_rules() -> None:
    assert normalized('name: "m"\n' + IO).name == "m"
    message = config_error('name: "other"\n' + IO)
    assert "unexpected directory name 'm' for model 'other', directory name must equal model name" in message
    # Another backend is a Python-based backend (its model.py is looked for as a version
    # loads): filled as Triton 2.51 fills one (measured), a runtime given kept as given.
    other = normalized('backend: "mybe"\n' + IO)
    assert (other.backend, other.runtime, other.default_model_filename) == ("mybe", "model.py", "")
    assert normalized('backend: "mybe"\nruntime: "other.py"\n' + IO).runtime == "other.py"
    assert normalized(IO).runtime == ""
    assert "unexpected platform type 'tensorflow_savedmodel'" in config_error(
        'platform: "tensorflow_savedmodel"\n' + IO
    )
    assert "must have platform type 'ensemble' and empty backend type" in config_error(
        'platform: "ensemble"\nbackend: "python"\n' + IO
    )
    assert "ensemble scheduling must be set for ensemble m" in config_error('platform: "ensemble"\n' + IO)
    keep = normalized('default_model_filename: "entry.py"\n' + IO)
    assert keep.default_model_filename == "entry.py"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("max_batch_size: -1", "'max_batch_size' must be non-negative value for m"),
        ("max_batch_size: 4\ndynamic_batching { preferred_batch_size: [ 8 ] }",
         "dynamic batching preferred size must be <= max batch size for m ('preferred_batch_size' 8 > 'max_batch_size' 4)"),
        ("max_batch_size: 4\ndynamic_batching { preferred_batch_size: [ 0 ] }",
         "dynamic batching preferred size must be positive for m"),
        ("dynamic_batching { priority_levels: 2 default_priority_level: 3 }",
         "default priority level must be in range [1, 2] for m"),
        ("dynamic_batching { priority_levels: 2 default_priority_level: 1 "
         "priority_queue_policy { key: 5 value: { } } }",
         "priority queue policy must have priority level in range [1, 2] for m"),
        ("dynamic_batching { preserve_ordering: true priority_levels: 2 default_priority_level: 1 }",
         "Only one priority level is allowed when 'preserve_ordering' is true for m"),
        ("dynamic_batching { preserve_ordering: true default_queue_policy "
         "{ timeout_action: DELAY default_timeout_microseconds: 5 } }",
         "Queue policy can not have DELAY as timeout action"),
        ("model_transaction_policy { decoupled: true }\nresponse_cache { enable: true }",
         "with 'decoupled' transaction policy"),
        ("sequence_batching { }\nresponse_cache { enable: true }", "with sequence batching scheduler"),
        ("max_batch_size: 2\nsequence_batching { oldest { preferred_batch_size: [ 3 ] } }",
         "sequence batching preferred batch size must be <= max batch size for m"),
        ("sequence_batching { direct { minimum_slot_utilization: 1.5 } }",
         "minimum slot utilization must be in range (0.0, 1.0] for m"),
        ("model_metrics { metric_control { histogram_options { buckets: [ 1 ] } } }",
         "metric control must specify 'metric_identifier'"),
    ],
)
def test_model_level_checks(text: str, fragment: str) -> None:
    assert fragment in config_error(IO + text)


@pytest.mark.parametrize(
    ("control", "fragment"),
    [
        ('{ control [{ kind: CONTROL_SEQUENCE_START }] }',
         "sequence batching control tensor must have a name for m"),
        ('{ name: "S" control [{ kind: CONTROL_SEQUENCE_START }] }',
         "must specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' for CONTROL_SEQUENCE_START for m"),
        ('{ name: "S" control [{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0 ] }] }',
         "control 'int32_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_START for m"),
        ('{ name: "S" control [{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] fp32_false_true: [ 0, 1 ] }] }',
         "specifies more than one from"),
        ('{ name: "S" control [{ kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] }] },'
         '{ name: "S" control [{ kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] }] }',
         "control tensor 'S' is specified for multiple control kinds for m"),
        ('{ name: "A" control [{ kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] }] },'
         '{ name: "B" control [{ kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] }] }',
         "specifies multiple CONTROL_SEQUENCE_END tensors for m"),
        ('{ name: "C" control [{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 }] }',
         "unexpected data type for control CONTROL_SEQUENCE_CORRID for m"),
        ('{ name: "C" control [{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 int32_false_true: [ 0, 1 ] }] }',
         "must not specify either"),
    ],
)
def test_sequence_control_checks(control: str, fragment: str) -> None:
    assert fragment in config_error(IO + f"sequence_batching {{ control_input [ {control} ] }}")


def test_valid_sequence_controls_pass() -> None:
    text = IO + """sequence_batching { control_input [
        { name: "START" control [{ kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] }] },
        { name: "CORRID" control [{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING }] }
    ] }"""
    assert len(normalized(text).sequence_batching.control_input) == 2


@pytest.mark.parametrize(
    ("io", "fragment"),
    [
        ('input [{ data_type: TYPE_FP32 dims: [ 1 ] }]', "model input must specify 'name' for m"),
        ('input [{ name: "A" dims: [ 1 ] }]', "model input 'A' must specify 'data_type' for m"),
        ('input [{ name: "A" data_type: TYPE_FP32 }]', "model input 'A' must specify 'dims' for m"),
        ('output [{ name: "O" data_type: TYPE_FP32 }]', "model output 'O' must specify 'dims' for m"),
        ('input [{ name: "A" data_type: TYPE_FP32 dims: [ 0 ] }]',
         # Triton's sentence whole, then ours (QA L0_model_config greps for Triton's).
         "model input 'A' dimension must be integer >= 1, or -1 to indicate a variable-size dimension for m ('dims' has 0)"),
        ('input [{ name: "A" data_type: TYPE_FP32 dims: [ -2 ] }]', "('dims' has -2)"),
        ('input [{ name: "A" data_type: TYPE_FP32 dims: [ 1 ] reshape { shape: [ ] } }]',
         "cannot have empty reshape for non-batching model"),
        ('input [{ name: "A" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape { shape: [ 5 ] } }]',
         "model input 'A' has different size for dims and reshape for m"),
        ('input [{ name: "A" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape { shape: [ 0, 6 ] } }]',
         "reshape dimensions must be integer >= 1"),
        ('input [{ name: "A" data_type: TYPE_FP32 dims: [ 2, -1 ] reshape { shape: [ -1, 2, -1 ] } }]',
         "different number of variable-size dimensions for dims and reshape"),
        ('input [{ name: "A" data_type: TYPE_FP32 dims: [ 2, -1, 3 ] reshape { shape: [ 3, -1, 2 ] } }]',
         "has different size for dims and reshape"),
        ('input [{ name: "A" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "A" data_type: TYPE_FP32 dims: [ 1 ] }]',
         "model input 'A' is specified more than once for m"),
        ('input [{ name: "A" data_type: TYPE_FP32 dims: [ 1 ] is_shape_tensor: true }]',
         "shape tensors are only supported for TensorRT platform for m ('is_shape_tensor' on "
         "'A')"),
        ('input [{ name: "A" data_type: TYPE_FP32 dims: [ 1 ] format: FORMAT_NCHW }]',
         "model input 'A' NHWC/NCHW require 3 dims"),
        ('input [{ name: "A" data_type: TYPE_FP32 dims: [ 1 ] }]\n'
         'batch_input [{ kind: BATCH_ELEMENT_COUNT target_name: "B" data_type: TYPE_FP32 source_input: "X" }]',
         "unknown source input name 'X' for m"),
    ],
)
def test_io_checks(io: str, fragment: str) -> None:
    assert fragment in config_error(io)


def test_valid_io_shapes_pass() -> None:
    text = """max_batch_size: 4
    input [
      { name: "S" data_type: TYPE_STRING dims: [ 1 ] reshape { shape: [ ] } },
      { name: "W" data_type: TYPE_FP32 dims: [ 2, 4, -1, 6 ] reshape { shape: [ 8, -1, 1, 6 ] } },
      { name: "IO" data_type: TYPE_FP32 dims: [ -1 ] }
    ]
    output [ { name: "IO" data_type: TYPE_FP32 dims: [ -1 ] } ]"""
    assert len(normalized(text).input) == 3


@pytest.mark.parametrize(
    ("groups", "gpus", "fragment"),
    [
        ('[{ kind: KIND_GPU }]', 0, "instance group m_0 of model m has kind KIND_GPU but no GPUs are available"),
        ('[{ kind: KIND_GPU gpus: [ 3 ] }]', 2,
         "instance group m_0 of model m specifies invalid or unsupported gpu id 3 in 'gpus'. Available GPUs are: 0, 1"),
        ('[{ kind: KIND_CPU gpus: [ 0 ] }]', 1, "has kind KIND_CPU but specifies one or more GPUs"),
        ('[{ kind: KIND_MODEL gpus: [ 0 ] }]', 1, "has kind KIND_MODEL but specifies one or more GPUs"),
        ('[{ kind: KIND_CPU profile: [ "0" ] }]', 0, "specifies 'profile' field which is only supported for TensorRT"),
    ],
)
def test_instance_group_checks(groups: str, gpus: int, fragment: str) -> None:
    assert fragment in config_error(IO + f"instance_group {groups}", gpus=gpus)


# --- ensembles ---------------------------------------------------------------------------------

ENSEMBLE = """
name: "ens"
platform: "ensemble"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "pre" model_version: -1 input_map { key: "X" value: "IN" } output_map { key: "Y" value: "mid" } },
  { model_name: "post" model_version: 2 input_map { key: "X" value: "mid" } output_map { key: "Y" value: "OUT" } }
] }
"""


def test_valid_ensemble_normalizes_without_instances() -> None:
    cfg = normalized(ENSEMBLE, name="ens", gpus=1)
    assert cfg.backend == "" and cfg.platform == "ensemble"
    assert len(cfg.instance_group) == 0
    assert not cfg.HasField("optimization")
    assert cfg.version_policy.latest.num_versions == 1


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (("", 'instance_group [{ kind: KIND_CPU }]'), "instance group should not be specified for ensemble 'ens'"),
        (('key: "Y" value: "mid"', 'key: "Y" value: "other"'),
         "output 'OUT' for ensemble 'ens' is not written: at least one of its depending tensors, "
         "'mid', is not connected"),
        (('value: "IN"', 'value: "IN2"'), "ensemble input 'IN' for ensemble 'ens' is not used"),
        (('key: "Y" value: "OUT"', 'key: "Y" value: "OUT2"'), "ensemble output 'OUT' for ensemble 'ens' is not used"),
        (('key: "Y" value: "mid"', 'key: "Y" value: "OUT"'), "ensemble tensor 'OUT' can appear in an output map only once for ensemble 'ens' step 1"),
        (('model_name: "post"', 'model_name: ""'), "must specify 'model_name' in step 1 of ensemble 'ens'"),
        (('platform: "ensemble"', 'platform: "ensemble"\nbackend: "python"'), "must have platform type 'ensemble' and empty backend type"),
    ],
)
def test_ensemble_checks(change: tuple[str, str], fragment: str) -> None:
    old, new = change
    text = ENSEMBLE + new if old == "" else ENSEMBLE.replace(old, new, 1)
    assert fragment in config_error(text, name="ens")


def test_ensemble_unused_tensor() -> None:
    text = ENSEMBLE.replace(
        'output_map { key: "Y" value: "mid" }',
        'output_map { key: "Y" value: "mid" } output_map { key: "Z" value: "dangling" }',
    )
    assert "ensemble tensor 'dangling' is unused in ensemble 'ens'" in config_error(text, name="ens")


def test_scheduling_on_a_python_model_is_refused() -> None:
    text = IO + 'ensemble_scheduling { step [ { model_name: "x" } ] }'
    assert "ensemble scheduling cannot be set for model 'm' whose platform is not ensemble" in config_error(text)


# --- JSON ---------------------------------------------------------------------------------------


def test_json_is_exactly_what_a_python_model_sees_under_triton() -> None:
    cfg = normalized(REALISTIC)
    # The layout Triton's ModelConfigToJson produces: field declaration order, proto names,
    # defaults printed, unset sub-messages absent, int64 dims/delays as numbers, compact.
    expected = (
        '{"name":"m","platform":"","backend":"python","runtime":"",'
        '"version_policy":{"latest":{"num_versions":1}},"max_batch_size":8,'
        '"input":[{"name":"IN","data_type":"TYPE_FP32","format":"FORMAT_NONE","dims":[-1,4],'
        '"is_shape_tensor":false,"allow_ragged_batch":false,"optional":false,'
        '"is_non_linear_format_io":false},'
        '{"name":"TEXT","data_type":"TYPE_STRING","format":"FORMAT_NONE","dims":[1],'
        '"reshape":{"shape":[]},"is_shape_tensor":false,"allow_ragged_batch":false,'
        '"optional":true,"is_non_linear_format_io":false}],'
        '"output":[{"name":"OUT","data_type":"TYPE_FP32","dims":[-1,4],"label_filename":"",'
        '"is_shape_tensor":false,"is_non_linear_format_io":false}],'
        '"batch_input":[],"batch_output":[],'
        '"optimization":{"priority":"PRIORITY_DEFAULT","input_pinned_memory":{"enable":true},'
        '"output_pinned_memory":{"enable":true},"gather_kernel_buffer_threshold":0,'
        '"eager_batching":false},'
        '"dynamic_batching":{"preferred_batch_size":[8],"max_queue_delay_microseconds":100,'
        '"preserve_ordering":false,"priority_levels":0,"default_priority_level":0,'
        '"priority_queue_policy":{}},'
        '"instance_group":[{"name":"m_0","kind":"KIND_CPU","count":2,"gpus":[],'
        '"secondary_devices":[],"profile":[],"passive":false,"host_policy":""}],'
        '"default_model_filename":"model.py","cc_model_filenames":{},"metric_tags":{},'
        '"parameters":{"EXECUTION_ENV_PATH":{"string_value":"$$TRITON_MODEL_DIRECTORY/env"}},'
        '"model_warmup":[],"model_transaction_policy":{"decoupled":true}}'
    )
    assert config_to_json(cfg) == expected
    assert config_to_dict(cfg) == json.loads(expected)


def test_json_int64_rule_follows_triton_list() -> None:
    cfg = parse("""
    version_policy { specific { versions: [ 1, 3 ] } }
    dynamic_batching { priority_levels: 2 default_priority_level: 1
      default_queue_policy { default_timeout_microseconds: 7 }
      priority_queue_policy { key: 2 value: { default_timeout_microseconds: 9 } } }
    instance_group [{ secondary_devices [{ kind: KIND_NVDLA device_id: 3 }] }]
    optimization { cuda { graph_spec [{ input { key: "A" value: { dim: [ 2 ] } } }] } }
    model_warmup [{ name: "w" batch_size: 1 inputs { key: "A" value: { data_type: TYPE_FP32 dims: [ 5 ] zero_data: true } } }]
    """)
    d = config_to_dict(cfg)
    assert d["version_policy"] == {"specific": {"versions": [1, 3]}}
    db = d["dynamic_batching"]
    assert (db["priority_levels"], db["default_priority_level"]) == (2, 1)
    assert db["default_queue_policy"]["default_timeout_microseconds"] == 7
    assert db["priority_queue_policy"] == {"2": {
        "timeout_action": "REJECT", "default_timeout_microseconds": 9, "allow_timeout_override": False,
        "max_queue_size": 0}}
    assert d["model_warmup"][0]["inputs"]["A"]["dims"] == [5]
    # Not on Triton's list: these stay protobuf-JSON strings under Triton too.
    assert d["instance_group"][0]["secondary_devices"][0]["device_id"] == "3"
    assert d["optimization"]["cuda"]["graph_spec"][0]["input"]["A"]["dim"] == ["2"]
    assert config_from_dict(d) == cfg

    seq = config_to_dict(parse("""sequence_batching { max_sequence_idle_microseconds: 5
      oldest { max_queue_delay_microseconds: 6 }
      state [{ input_name: "I" output_name: "O" data_type: TYPE_FP32 dims: [ 3 ]
               initial_state [{ name: "s" data_type: TYPE_FP32 dims: [ 3 ] zero_data: true }] }] }"""))
    sb = seq["sequence_batching"]
    assert sb["max_sequence_idle_microseconds"] == 5
    assert sb["oldest"]["max_queue_delay_microseconds"] == 6
    assert sb["state"][0]["dims"] == [3]
    assert sb["state"][0]["initial_state"][0]["dims"] == ["3"]

    ens = config_to_dict(normalized(ENSEMBLE, name="ens"))
    assert [s["model_version"] for s in ens["ensemble_scheduling"]["step"]] == [-1, 2]


def test_json_round_trip() -> None:
    for cfg in (normalized(REALISTIC), normalized(ENSEMBLE, name="ens"), ModelConfig()):
        assert config_from_dict(config_to_dict(cfg)) == cfg
        assert config_from_dict(config_to_json(cfg)) == cfg


def test_from_dict_accepts_triton_and_user_spellings() -> None:
    cfg = config_from_dict({
        "name": "m", "max_batch_size": 4,
        "input": [{"name": "IN", "data_type": "type_fp32", "dims": [-1, "4"]}],
        "instance_group": [{"kind": "kind_gpu", "gpus": [0]}],
        "dynamicBatching": {"maxQueueDelayMicroseconds": "50"},
        "parameters": {"k": {"string_value": "v"}},
    })
    assert list(cfg.input[0].dims) == [-1, 4]
    assert cfg.input[0].data_type == 11
    assert cfg.instance_group[0].kind == ModelInstanceGroup.KIND_GPU
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 50
    assert cfg.parameters["k"].string_value == "v"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"nmae": "m"}, "auto.json: invalid field 'nmae' in ModelConfig"),
        ({"input": [{"name": "a", "dimz": [1]}]}, "auto.json: invalid field 'dimz' in ModelInput (at 'input[0]')"),
        ({"parameters": {"k": {"strval": "x"}}}, "auto.json: invalid field 'strval' in ModelParameter (at 'parameters[k]')"),
        ('{"name": ', "auto.json: invalid JSON model configuration"),
        ([1, 2], "auto.json: the model configuration must be a JSON object, not an array"),
        (None, "auto.json: the model configuration must be a JSON object, not null"),
        # Values of the wrong type, in Triton 2.51's words (measured with config overrides):
        # the field's path, the value as JSON and the type it is not.
        ({"input": {"name": "a"}},
         'auto.json: (input): invalid value {"name": "a"} for type type.googleapis.com/inference.ModelInput'),
        ({"max_batch_size": "many"},
         'auto.json: (max_batch_size): invalid value "many" for type TYPE_INT32'),
        ({"max_batch_size": 1.5}, "auto.json: (max_batch_size): invalid value 1.5 for type TYPE_INT32"),
        ({"max_batch_size": "1e3"}, 'auto.json: (max_batch_size): invalid value "1e3" for type TYPE_INT32'),
        ({"max_batch_size": 2**40},
         "auto.json: (max_batch_size): invalid value 1099511627776 for type TYPE_INT32"),
        ({"max_batch_size": True}, "auto.json: (max_batch_size): invalid value true for type TYPE_INT32"),
        ({"instance_group": 3},
         "auto.json: (instance_group): invalid value 3 for type type.googleapis.com/inference.ModelInstanceGroup"),
        ({"instance_group": [{"count": "x"}]},
         'auto.json: (instance_group[0].count): invalid value "x" for type TYPE_INT32'),
        ({"input": [{"data_type": "TYPE_NOPE"}]},
         'auto.json: (input[0].data_type): invalid value "TYPE_NOPE" for type '
         "type.googleapis.com/inference.DataType"),
        ({"input": [{"dims": [1.5]}]}, "auto.json: (input[0].dims[0]): invalid value 1.5 for type TYPE_INT64"),
        ({"dynamic_batching": {"max_queue_delay_microseconds": -1}},
         "auto.json: (dynamic_batching.max_queue_delay_microseconds): invalid value -1 for type TYPE_UINT64"),
        ({"dynamic_batching": {"preserve_ordering": 1}},
         "auto.json: (dynamic_batching.preserve_ordering): invalid value 1 for type TYPE_BOOL"),
        ({"dynamic_batching": [1]}, "auto.json: (dynamic_batching): invalid value [1] for type "
                                    "type.googleapis.com/inference.ModelDynamicBatching"),
        ({"backend": 5}, "auto.json: (backend): invalid value 5 for type TYPE_STRING"),
        ({"parameters": {"k": "v"}},
         'auto.json: (parameters[k]): invalid value "v" for type type.googleapis.com/inference.ModelParameter'),
    ],
)
def test_from_dict_errors(value: object, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(value, "auto.json")  # type: ignore[arg-type]
    assert str(info.value).startswith(expected)


def test_from_dict_takes_what_tritons_json_parser_takes() -> None:
    # Triton 2.51 (measured) loads these: integral numbers and strings of integers for
    # integers, "true" for a bool, enums by number or by name in any case.
    cfg = config_from_dict({
        "max_batch_size": 2.0, "input": [{"name": "a", "data_type": 9, "dims": ["-1", 4.0]}],
        "dynamic_batching": {"preserve_ordering": "true", "max_queue_delay_microseconds": "100"},
        "instance_group": [{"kind": "kind_cpu"}],
    })
    assert cfg.max_batch_size == 2 and list(cfg.input[0].dims) == [-1, 4]
    assert cfg.input[0].data_type == 9 and cfg.instance_group[0].kind == ModelInstanceGroup.KIND_CPU
    assert cfg.dynamic_batching.preserve_ordering
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 100


def test_float_fields_print_like_triton() -> None:
    cfg = parse("sequence_batching { direct { minimum_slot_utilization: 1.0 } }")
    assert '"minimum_slot_utilization":1}' in config_to_json(cfg)
    cfg = parse("sequence_batching { direct { minimum_slot_utilization: 0.5 } }")
    assert '"minimum_slot_utilization":0.5' in config_to_json(cfg)

