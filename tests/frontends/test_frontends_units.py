"""Frontend pieces that need no running server: the shm registry, the wire codecs, the metrics
text, the logging settings, the CLI parser."""
from __future__ import annotations

import logging
import os
import secrets
import time
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from tritonclient.utils import shared_memory as shm_utils
from _models import truncate_shm

from tritonpy._errors import AlreadyExistsError, InternalError, InvalidArgumentError, NotFoundError
from tritonpy.cli import build_parser
from tritonpy.frontends._infer_types import InferRequest, OutputTensor
from tritonpy.frontends._log_settings import LogSettings
from tritonpy.frontends._request_parsing import apply_parameters, parse_version, shm_ref
from tritonpy.frontends._tensor_decode import array_from_json, array_from_raw
from tritonpy.frontends._tensor_encode import json_data, tensor_bytes
from tritonpy.frontends.dataplane import to_error
from tritonpy.frontends.sharedmem import SharedMemoryRegistry
from tritonpy.metrics import CpuMetrics, metrics_text, render
from tritonpy.shm.dtypes import serialize_bytes


@pytest.fixture
def client_region():
    """A client-side system shm object of 64 bytes (destroyed after)."""
    name = f"tpyc{secrets.token_hex(4)}"
    handle = shm_utils.create_shared_memory_region(name, "/" + name, 64)
    try:
        yield name, handle
    finally:
        shm_utils.destroy_shared_memory_region(handle)


# -- shared-memory registry ---------------------------------------------------------------------

def test_registry_register_read_write_status_unregister(client_region) -> None:
    name, handle = client_region
    reg = SharedMemoryRegistry(["tritonpy_"])
    reg.register("r", "/" + name, 16, 32)
    assert reg.status() == [{"name": "r", "key": "/" + name, "offset": 16, "byte_size": 32}]
    shm_utils.set_shared_memory_region(handle, [np.arange(16, dtype=np.float32)])
    got = reg.read("r", 0, 8)  # region offset 16 = element 4 of the client's array
    assert got.view(np.float32).tolist() == [4.0, 5.0]
    reg.write("r", 0, np.array([-1, -2], np.float32).tobytes())
    got = shm_utils.get_contents_as_numpy(handle, np.float32, [16])
    assert got[4:6].tolist() == [-1.0, -2.0]
    with pytest.raises(AlreadyExistsError, match="already in manager"):
        reg.register("r", "/" + name, 0, 8)
    with pytest.raises(InvalidArgumentError, match="Invalid offset"):
        reg.read("r", 32, 1)
    with pytest.raises(InvalidArgumentError, match="Invalid offset \\+ byte size"):
        reg.write("r", 8, b"\0" * 25)
    with pytest.raises(NotFoundError, match="Unable to find shared memory region: 'zz'"):
        reg.hold([("zz", 0, 1)])
    reg.unregister("r")
    reg.unregister("r")  # unknown names are not an error, as in Triton
    assert reg.status() == []
    with pytest.raises(NotFoundError):
        reg.status("r")


def test_registry_refuses_bad_windows_and_reserved_keys(client_region) -> None:
    name, _ = client_region
    reg = SharedMemoryRegistry(["tpyc"])
    with pytest.raises(InvalidArgumentError, match="reserved"):
        reg.register("a", "/" + name, 0, 8)
    reg = SharedMemoryRegistry([])
    with pytest.raises(InvalidArgumentError, match="invalid args"):
        reg.register("a", "/" + name, 60, 8)
    # Triton's status (500) and words for a key it cannot open (measured)
    with pytest.raises(InternalError, match=f"^Unable to open shared memory region: '/{name}nothere'$"):
        reg.register("a", f"/{name}nothere", 0, 8)
    with pytest.raises(InternalError, match="^Unable to open shared memory region: '/../etc/passwd'$"):
        reg.register("a", "/../etc/passwd", 0, 8)
    with pytest.raises(InternalError, match="^Unable to open shared memory region: ''$"):
        reg.register("a", "", 0, 8)
    # JSON's "\ud800" (no text): posix_ipc took the whole process down on it.
    with pytest.raises(InvalidArgumentError, match="unpaired surrogate"):
        reg.register("a", "/\ud800", 0, 16)
    with pytest.raises(InvalidArgumentError, match="non-negative"):
        reg.register("a", "/" + name, -1, 8)
    # a byte_size of 0: Triton's mmap's words (measured), where the window fits
    with pytest.raises(InvalidArgumentError, match="^failed to register shared memory region 'a': "
                       "unable to process address spaceInvalid argument$"):
        reg.register("a", "/" + name, 64, 0)
    assert reg.status() == []


def test_registry_refuses_a_key_another_region_has_registered(client_region) -> None:
    """As Triton 2.51 (measured): 500 "Invalid shared memory region: '<key>'", whatever the
    offset and size; the key is free again once that region is unregistered."""
    name, _ = client_region
    reg = SharedMemoryRegistry()
    reg.register("a", "/" + name, 0, 64)
    for offset, size in ((0, 64), (0, 16), (16, 16)):
        with pytest.raises(InternalError, match=f"^Invalid shared memory region: '/{name}'$"):
            reg.register("b", "/" + name, offset, size)
    reg.unregister("a")
    reg.register("b", "/" + name, 0, 16)
    reg.close()


def test_registry_a_truncated_object_is_an_error_not_a_sigbus(client_region) -> None:
    """A client that shrinks its shm object after registering it gets an error naming the
    region; nothing reads or writes past the object's new end through a mapping (a SIGBUS,
    which killed the server, and kills Triton 2.51: measured)."""
    name, _ = client_region
    reg = SharedMemoryRegistry()
    reg.register("r", "/" + name, 0, 64)
    truncate_shm(name, 0)
    with pytest.raises(InvalidArgumentError, match=f"^shared memory region 'r' cannot be read: "
                       f"its shm object '/{name}' no longer holds byte 8 "):
        reg.read("r", 8, 8)
    with pytest.raises(InvalidArgumentError, match="shared memory region 'r' cannot be written"):
        reg.write("r", 0, b"x" * 64)
    assert os.stat(f"/dev/shm/{name}").st_size == 0  # not grown back by the write
    fd = reg._regions["r"].fd
    reg.close()
    assert not _holds(fd, name)


def test_registry_unregister_during_a_copy_unmaps_after_it(client_region) -> None:
    name, _ = client_region
    reg = SharedMemoryRegistry()
    reg.register("r", "/" + name, 0, 64)
    fd = reg._regions["r"].fd
    seen = []

    def alloc(n: int) -> np.ndarray:  # runs while the region is held for the copy
        reg.unregister()
        seen.append(_holds(fd, name))
        return np.empty(n, np.uint8)

    assert len(reg.read("r", 0, 64, alloc)) == 64
    assert seen == [True] and reg.status() == []
    assert not _holds(fd, name)


def test_registry_large_copies_in_parts_whole_or_naming_the_first_missing_byte() -> None:
    # 20 MiB goes in parts copied together; every byte lands where it belongs, and when the
    # object is shrunk under a later part the error names the first byte that is gone.
    name = f"tpyc{secrets.token_hex(4)}"
    size = 20 << 20
    handle = shm_utils.create_shared_memory_region(name, "/" + name, size)
    try:
        reg = SharedMemoryRegistry()
        reg.register("big", "/" + name, 0, size)
        data = np.arange(size // 4, dtype=np.uint32)
        reg.write("big", 0, data)
        assert np.array_equal(reg.read("big", 0, size).view(np.uint32), data)
        truncate_shm(name, 9 << 20)
        with pytest.raises(InvalidArgumentError, match=f"no longer holds byte {9 << 20} "):
            reg.read("big", 0, size)
        with pytest.raises(InvalidArgumentError, match=f"no longer holds byte {9 << 20} "):
            reg.write("big", 0, data)
        assert np.array_equal(reg.read("big", 0, 9 << 20).view(np.uint32),
                              data[:(9 << 20) // 4])
        reg.close()
    finally:
        shm_utils.destroy_shared_memory_region(handle)


def _holds(fd: int, name: str) -> bool:
    """Whether descriptor ``fd`` of this process is (still) open on shm object ``name``."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == f"/dev/shm/{name}"
    except OSError:
        return False


# -- codecs -------------------------------------------------------------------------------------

def test_array_from_raw_checks_sizes() -> None:
    a = np.arange(6, dtype=np.int32)
    got = array_from_raw("x", "INT32", [2, 3], a.tobytes(), model="m")
    assert got.shape == (2, 3) and got.ravel().tolist() == list(range(6))
    with pytest.raises(InvalidArgumentError, match=r"^\[request id: r\] input byte size mismatch for input 'x' for model 'm'\. Expected 24, got 20$"):
        array_from_raw("x", "INT32", [2, 3], a.tobytes()[:20], model="m", request_id="r")
    words = np.array([b"a", b"", b"\xff\x00"], dtype=object)
    assert array_from_raw("s", "BYTES", [3], serialize_bytes(words), model="m").tolist() == words.tolist()
    with pytest.raises(InvalidArgumentError, match="input 's'"):
        array_from_raw("s", "BYTES", [4], serialize_bytes(words), model="m")
    with pytest.raises(InvalidArgumentError, match="invalid datatype 'FLOAT'"):
        array_from_raw("x", "FLOAT", [1], b"1234", model="m")
    bf16 = array_from_raw("x", "BF16", [2], b"\x80\x3f\x00\x40", model="m")  # 1.0, 2.0
    assert str(bf16.dtype) == "bfloat16" and bf16.astype(np.float32).tolist() == [1.0, 2.0]
    with pytest.raises(InvalidArgumentError, match="Expected 4, got 2"):
        array_from_raw("x", "BF16", [2], b"12", model="m")
    with pytest.raises(InvalidArgumentError, match="shape"):
        array_from_raw("x", "INT32", [-1], b"", model="m")


def test_array_from_json_types_and_shapes() -> None:
    assert array_from_json("x", "FP32", [2, 2], [[1, 2], [3, 4.5]]).tolist() == [[1, 2], [3, 4.5]]
    assert array_from_json("x", "FP32", [2, 2], [1, 2, 3, 4]).shape == (2, 2)
    assert array_from_json("b", "BOOL", [2], [True, False]).dtype == np.bool_
    assert array_from_json("s", "BYTES", [2], ["hé", ""]).tolist() == ["hé".encode(), b""]
    assert array_from_json("e", "INT64", [0], []).shape == (0,)
    # Ragged nesting is read in order, as Triton 2.51 reads it (QA round 14: it was a 400).
    assert array_from_json("r", "FP32", [3], [[1, 2], [3.5]]).tolist() == [1, 2, 3.5]
    assert array_from_json("r", "INT32", [1, 3], [[1, [2]], 3]).tolist() == [[1, 2, 3]]
    for datatype, data, msg in [
        ("FP32", [1, 2, 3], "Shape does not match"),
        ("INT32", [1.5], "expected INT32"),
        ("INT8", [300], "out of range"),
        ("BOOL", [1], "expected BOOL"),
        ("BYTES", [1], "must be strings"),
        ("BYTES", ["ok", "\udcff"], r"unpaired surrogate \(\\udcff\)"),  # JSON's "\udcff"
        ("FP32", [[1], [2, 3]], "Unable to parse 'data'"),
        ("FP32", "12", "expected a list"),
    ]:
        with pytest.raises(InvalidArgumentError, match=msg):
            array_from_json("x", datatype, [2], data)


def test_outputs_to_wire() -> None:
    out = OutputTensor("o", "FP32", (2,), np.array([1.5, 2], np.float32))
    assert json_data(out) == [1.5, 2.0]
    assert bytes(tensor_bytes(out.array, "FP32")) == np.array([1.5, 2], np.float32).tobytes()
    assert json_data(OutputTensor("o", "FP16", (1,), np.ones(1, np.float16))) is None
    nonfinite = json_data(OutputTensor("o", "FP32", (3,), np.array([np.nan, np.inf, -np.inf],
                                                                    np.float32)))
    assert nonfinite is not None and np.isnan(nonfinite[0]) and nonfinite[1:] == [np.inf, -np.inf]
    text = OutputTensor("o", "BYTES", (2,), np.array([b"ok", b"\xc3\xa9"], dtype=object))
    assert json_data(text) == ["ok", "é"]
    assert json_data(OutputTensor("o", "BYTES", (1,), np.array([b"\xff"], dtype=object))) is None


def test_request_parameters() -> None:
    req = InferRequest("m")
    apply_parameters(req, {"sequence_id": 7, "sequence_start": True, "sequence_end": False,
                           "priority": 2, "timeout": 100, "binary_data_output": True,
                           "mine": "x", "n": 3, "flag": False}, http=True)
    assert (req.correlation_id, req.flags, req.priority, req.timeout) == (7, 1, 2, 100)
    assert req.binary_output_default and req.parameters == {"mine": "x", "n": 3, "flag": False}
    with pytest.raises(InvalidArgumentError, match="reserved for Triton"):
        apply_parameters(InferRequest("m"), {"triton_enable_empty_final_response": True}, http=True)
    grpc_req = InferRequest("m")
    apply_parameters(grpc_req, {"triton_enable_empty_final_response": True, "sequence_id": "abc"},
                     http=False)
    assert grpc_req.enable_empty_final and grpc_req.correlation_id == "abc"
    with pytest.raises(InvalidArgumentError, match="Only the following keys"):
        apply_parameters(InferRequest("m"), {"triton_other": True}, http=False)
    for bad in ({"sequence_start": 1}, {"priority": -1}, {"x": [1]}, {"x": {"y": 1}}):
        with pytest.raises(InvalidArgumentError):
            apply_parameters(InferRequest("m"), bad, http=True)


def test_shm_ref_and_version_parsing() -> None:
    assert shm_ref("t", {}) is None
    ref = shm_ref("t", {"shared_memory_region": "r", "shared_memory_byte_size": 8})
    assert ref is not None and (ref.region, ref.offset, ref.byte_size) == ("r", 0, 8)
    for bad in ({"shared_memory_region": "r"}, {"shared_memory_byte_size": 8},
                {"shared_memory_region": "r", "shared_memory_byte_size": -1}):
        with pytest.raises(InvalidArgumentError):
            shm_ref("t", bad)
    assert parse_version("") == -1 and parse_version("3") == 3
    with pytest.raises(InvalidArgumentError, match="integral"):
        parse_version("x1")


def test_to_error_maps_everything() -> None:
    assert to_error(NotFoundError("n")).http_status == 404
    assert to_error(ValueError("v")).grpc_code == "INVALID_ARGUMENT"
    err = to_error(RuntimeError("r"))
    assert err.http_status == 500 and "RuntimeError: r" in err.message


# -- metrics --------------------------------------------------------------------------------------

def test_metrics_text_uses_triton_names() -> None:
    registry = CollectorRegistry()
    Counter("custom_requests", "custom counter", ["model"], registry=registry).labels("m").inc(2)
    Histogram("custom_latency", "custom histogram", registry=registry, buckets=(1.0,)).observe(0.5)
    stats = [{
        "name": "m", "version": "1", "inference_count": "5", "execution_count": 4,
        "inference_stats": {"success": {"count": 5, "ns": 5000}, "fail": {"count": 1, "ns": 10},
                            "queue": {"count": 5, "ns": 2000}, "compute_input": {"count": 5},
                            "compute_infer": {"count": 5, "ns": 3000}, "compute_output": {}},
    }]
    server = SimpleNamespace(counters=lambda: stats, metrics_registry=registry,
                             shm_usage=lambda: [{"pool": "host", "segments": 2,
                                                 "mapped_bytes": 1 << 20, "used_bytes": 512,
                                                 "peak_bytes": 3 << 20}],
                             pending_requests=lambda: [{"name": "m", "version": "1", "count": 3}],
                             failures=lambda: [{"name": "m", "version": "1", "reasons": {
                                 "REJECTED": 0, "CANCELED": 0, "BACKEND": 1, "OTHER": 0}}])
    text = metrics_text(server)  # type: ignore[arg-type]
    for line in [
        "# TYPE nv_inference_request_success counter",
        'nv_inference_request_success{model="m",version="1"} 5',
        'nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 1',
        'nv_inference_request_failure{model="m",reason="REJECTED",version="1"} 0',
        'nv_inference_count{model="m",version="1"} 5',
        'nv_inference_exec_count{model="m",version="1"} 4',
        'nv_inference_request_duration_us{model="m",version="1"} 5',
        'nv_inference_queue_duration_us{model="m",version="1"} 2',
        'nv_inference_compute_input_duration_us{model="m",version="1"} 0',
        'nv_inference_compute_infer_duration_us{model="m",version="1"} 3',
        'nv_inference_compute_output_duration_us{model="m",version="1"} 0',
        "# TYPE nv_inference_pending_request_count gauge",
        'nv_inference_pending_request_count{model="m",version="1"} 3',
        'tritonpy_shm_pool_mapped_bytes{pool="host"} 1048576',
        'tritonpy_shm_pool_used_bytes{pool="host"} 512',
        'tritonpy_shm_pool_segments{pool="host"} 2',
        'tritonpy_shm_pool_peak_bytes{pool="host"} 3145728',
        'custom_requests{model="m"} 2',
        'custom_latency_bucket{le="1.0"} 1',
        "custom_latency_count 1",
    ]:
        assert line in text.splitlines(), line
    assert "_created" not in text and "custom_requests_total" not in text


def test_metrics_keep_a_models_own_names_and_tritons_cache_families() -> None:
    # Measured against Triton 2.51: a model's counter registered as "x_total" keeps that name
    # (prometheus_client strips it), a gauge named "..._created" keeps its value, the per-model
    # cache families list only the models that enable the cache, and --cache-config adds the
    # server-wide nv_cache_* gauges.
    from tritonpy._cache import ResponseCache
    from tritonpy._custom_metrics import COUNTER, GAUGE, CustomMetrics

    custom = CustomMetrics()
    custom.family("audit_requests_total", "requests", COUNTER)
    custom.op("audit_requests_total", {"m": "a"}, "increment", 3, None)
    custom.family("audit_items_created", "items made", GAUGE)
    custom.op("audit_items_created", {}, "set", 7, None)
    registry = CollectorRegistry()
    registry.register(custom)
    cache = ResponseCache(1470)
    key = cache.key("c", 1, [("IN", np.ones(2, np.float32))])
    assert cache.lookup(key, ["OUT"]) is None
    cache.insert(key, [("OUT", np.ones(25, np.float32))], None)  # 100 bytes: 147 packed
    assert cache.lookup(key, ["OUT"]) is not None
    stats = [{"name": n, "version": "1"} for n in ("c", "plain")]

    def rt(name: str, enabled: bool) -> SimpleNamespace:
        return SimpleNamespace(name=name, namespace="", version=1, config=SimpleNamespace(
            response_cache=SimpleNamespace(enable=enabled)))

    server = SimpleNamespace(
        counters=lambda: stats, metrics_registry=registry, response_cache=cache,
        repo=SimpleNamespace(runtimes=lambda: [rt("c", True), rt("plain", False)]),
        shm_usage=lambda: [], pending_requests=lambda: [], failures=lambda: [])
    lines = metrics_text(server).splitlines()  # type: ignore[arg-type]
    for line in ["# TYPE audit_requests_total counter", 'audit_requests_total{m="a"} 3',
                 "# TYPE audit_items_created gauge", "audit_items_created 7",
                 'nv_cache_num_hits_per_model{model="c",version="1"} 0',
                 "# TYPE nv_cache_util gauge", "nv_cache_util 0.1", "nv_cache_num_entries 1",
                 "nv_cache_num_lookups 2", "nv_cache_num_hits 1", "nv_cache_num_misses 1",
                 "nv_cache_num_evictions 0"]:
        assert line in lines, line
    assert not any(line.startswith("nv_cache_num_hits_per_model{model=\"plain\"")
                   for line in lines)
    assert any(line.startswith("nv_cache_lookup_duration ") for line in lines)
    assert any(line.startswith("nv_cache_insertion_duration ") for line in lines)


def test_metrics_survive_a_failing_server() -> None:
    def boom() -> dict:
        raise RuntimeError("down")

    server = SimpleNamespace(counters=boom, shm_usage=boom, pending_requests=boom,
                             metrics_registry=None)
    # The page is still served: the CPU's families, and no model family (as Triton's
    # exporter, a family with no series is left out).
    text = metrics_text(server, CpuMetrics(interval_s=3600))  # type: ignore[arg-type]
    assert "# TYPE nv_cpu_utilization gauge" in text
    assert "nv_inference" not in text
    assert render([]) == ""


# -- logging settings, CLI ------------------------------------------------------------------------

def test_cpu_metrics_are_triton_families_read_from_the_machine() -> None:
    before = CpuMetrics(interval_s=3600)
    assert before.utilization() == 0.0  # no interval has passed yet: 0, as Triton's first value
    cpu = CpuMetrics(interval_s=0.02)
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline:  # this process keeps one CPU busy meanwhile
        pass
    families = {f.name: f.samples[0].value for f in cpu.collect()}
    assert set(families) == {"nv_cpu_utilization", "nv_cpu_memory_total_bytes",
                             "nv_cpu_memory_used_bytes"}
    assert 0.0 < families["nv_cpu_utilization"] <= 1.0
    total = psutil.virtual_memory().total
    assert families["nv_cpu_memory_total_bytes"] == total
    assert 0 < families["nv_cpu_memory_used_bytes"] < total
    server = SimpleNamespace(counters=list, shm_usage=list, pending_requests=list,
                             metrics_registry=None)
    text = metrics_text(server, cpu)  # type: ignore[arg-type]
    assert "# TYPE nv_cpu_utilization gauge" in text
    assert f"nv_cpu_memory_total_bytes {total}" in text.splitlines()
    assert "nv_cpu_" not in metrics_text(server)  # type: ignore[arg-type]


def test_log_settings_apply(tmp_path) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    settings = LogSettings([handler])
    try:
        assert settings.get()["log_info"] is True
        settings.update({"log_info": False, "log_verbose_level": 1, "log_format": "ISO8601",
                         "log_file": str(tmp_path / "t.log")})
        record = logging.LogRecord("tritonpy.x", logging.INFO, "", 0, "hi", None, None)
        assert not handler.filter(record)
        assert logging.getLogger("tritonpy").level == logging.DEBUG
        assert settings.get()["log_file"].endswith("t.log")
        for bad in ({"log_info": "yes"}, {"log_verbose_level": -1},
                    {"log_verbose_level": 2 ** 32}):
            with pytest.raises(InvalidArgumentError):
                settings.update(bad)
        # An unknown setting is ignored, as Triton ignores it; the known ones beside it apply.
        assert settings.update({"nope": 1, "log_verbose_level": 2})["log_verbose_level"] == 2
        assert "nope" not in settings.get()
        with pytest.raises(Exception, match="log_format"):
            settings.update({"log_format": "json"})
    finally:
        settings.update({"log_info": True, "log_verbose_level": 0, "log_file": "",
                         "log_format": "default"})
        settings.close()
        logging.getLogger("tritonpy").setLevel(logging.NOTSET)


def test_cli_parser_accepts_triton_flags() -> None:
    args = build_parser().parse_args([
        "serve", "--model-repository", "a", "--model-repository=b", "--http-port", "0",
        "--allow-grpc", "false", "--model-control-mode", "explicit", "--load-model", "m",
        "--backend-config=python,shm-region-prefix-name=x_", "--log-verbose", "1",
        "--exit-timeout-secs", "5",
    ])
    assert args.model_repository == ["a", "b"] and args.allow_grpc is False
    assert args.backend_config == [("python", "shm-region-prefix-name", "x_")]
    assert args.load_model == ["m"] and args.exit_timeout_secs == 5.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--backend-config", "python,novalue"])


@pytest.mark.parametrize("arr", [np.zeros((0, 3), np.float32), np.zeros((2, 0), np.int64),
                                 np.arange(6, dtype=np.float16).reshape(2, 3).T,
                                 np.array([True, False])])
def test_tensor_bytes_of_any_shape_is_the_flat_layout(arr: np.ndarray) -> None:
    # Empty multi-dimensional outputs (a zero in the shape) and non-contiguous ones too.
    data = tensor_bytes(arr, "FP32")
    assert len(data) == arr.nbytes
    assert bytes(data) == arr.tobytes()


def _random_infer_request(rng: np.random.Generator) -> bytes:
    """A ``ModelInferRequest`` with random fields, serialized; its raw contents sometimes
    between the other fields (protobuf accepts any field order)."""
    from tritonclient.grpc import service_pb2

    msg = service_pb2.ModelInferRequest(model_name=f"m{rng.integers(3)}",
                                        model_version=str(rng.integers(3)) if rng.random() < 0.5 else "",
                                        id="x" * int(rng.integers(0, 200)))
    for k in range(int(rng.integers(0, 3))):
        msg.parameters[f"p{k}"].int64_param = int(rng.integers(-5, 5))
    for k in range(int(rng.integers(0, 4))):
        msg.inputs.add(name=f"IN{k}", datatype="FP32", shape=[int(rng.integers(0, 40))])
        msg.raw_input_contents.append(rng.bytes(int(rng.integers(0, 300))))
    for k in range(int(rng.integers(0, 3))):
        msg.outputs.add(name=f"OUT{k}")
    data = msg.SerializeToString()
    if msg.raw_input_contents and rng.random() < 0.3:
        # One raw content first, the rest as serialized: a field order clients do not use.
        first = service_pb2.ModelInferRequest(raw_input_contents=[msg.raw_input_contents[0]])
        rest = service_pb2.ModelInferRequest()
        rest.CopyFrom(msg)
        del rest.raw_input_contents[0]
        data = first.SerializeToString() + rest.SerializeToString()
    return data


def test_grpc_infer_requests_split_on_the_wire_as_protobuf_reads_them() -> None:
    """``split_infer`` reads a ModelInfer request's wire bytes by hand (the key of a kept
    decode, and its raw contents): for any message, what it keeps apart from the raw contents
    parses to the message without them, and the raw contents are protobuf's, in order. Bytes
    that are not such a message give None or a split (never an exception)."""
    from google.protobuf.message import DecodeError
    from tritonclient.grpc import service_pb2

    from tritonpy.frontends._grpc_codec import split_infer

    rng = np.random.default_rng(7)
    for _ in range(300):
        data = _random_infer_request(rng)
        split = split_infer(data)
        assert split is not None
        head, spans = split
        msg = service_pb2.ModelInferRequest.FromString(data)
        assert [data[a:b] for a, b in spans] == list(msg.raw_input_contents)
        without = service_pb2.ModelInferRequest()
        without.CopyFrom(msg)
        del without.raw_input_contents[:]
        assert service_pb2.ModelInferRequest.FromString(head) == without
        assert split_infer(memoryview(data)) == split  # as the HTTP/2 server hands it over
        # Mangled: a byte changed, or the message cut short.
        bad = bytearray(data)
        if bad:
            bad[int(rng.integers(len(bad)))] = int(rng.integers(256))
        for mangled in (bytes(bad), data[:int(rng.integers(len(data) + 1))]):
            split = split_infer(mangled)
            if split is None:
                continue
            head, spans = split
            try:
                msg = service_pb2.ModelInferRequest.FromString(mangled)
            except DecodeError:
                continue  # the full parse refuses it: a kept decode is never reached
            assert [mangled[a:b] for a, b in spans] == list(msg.raw_input_contents)
            del msg.raw_input_contents[:]
            assert service_pb2.ModelInferRequest.FromString(head) == msg
