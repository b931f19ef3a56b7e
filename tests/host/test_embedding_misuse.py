"""The in-process API misused as a Python user will: a server used before start() or after
stop(), a start that fails inside ``with``, request settings of the wrong type or range, an
event loop that does not run, and a program that exits without stop(). Each is refused at the
call with an error that names what was wrong, and leaves no stub or segment behind."""
from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import tritonpy
from _models import (SLEEPER_PY, fp32, infer, io_config, new_prefix, segments, serving,
                     wait_until, write_model, write_step_ensemble)
from tritonpy import InvalidArgumentError, NotFoundError, UnavailableError

pytestmark = pytest.mark.timeout(60)

# Reports what the model sees of the request's settings.
SEES_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([], parameters={
            "correlation_id": repr(r.correlation_id()), "flags": r.flags()}) for r in requests]
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("misuse")
    write_model(path, "double")
    write_model(path, "sees", SEES_PY, io_config())
    write_model(path, "sleeper", SLEEPER_PY)
    return path


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[tritonpy.Server]:
    with serving(repo, new_prefix()) as srv:
        yield srv


def _backend(prefix: str) -> dict[str, str]:
    return {"shm-region-prefix-name": prefix}


def test_a_server_not_started_or_stopped_says_so(repo: Path, shm_prefix: str) -> None:
    srv = tritonpy.Server(str(repo), backend_config=_backend(shm_prefix))
    srv.stop()  # before start: nothing to do
    with pytest.raises(UnavailableError, match="not started: call start"):
        srv.model("double")  # was NotFoundError "unknown model"
    srv.start()
    srv.start()  # a second start does nothing
    model = srv.model("double")
    assert infer(model, {"IN": fp32(1)}).error is None
    srv.stop()
    srv.stop()
    for call in (lambda: model.infer({"IN": fp32(1)}), lambda: srv.model("double")):
        with pytest.raises(UnavailableError, match="server was stopped"):
            call()
    # Was: it "started" with every model's load cancelled, and a later stop() did nothing,
    # leaving its new host segment behind.
    with pytest.raises(UnavailableError, match="cannot be started again"):
        srv.start()
    assert segments(shm_prefix) == []


def test_a_start_that_fails_in_with_leaves_nothing_behind(repo: Path, shm_prefix: str) -> None:
    srv = tritonpy.Server(str(repo), model_control_mode="explicit", load_models=["nosuch"],
                          backend_config=_backend(shm_prefix))
    with pytest.raises(NotFoundError, match="nosuch"):
        with srv:  # __exit__ is not called when __enter__ raises
            pass
    # Was: live, with its segment, janitor and threads, until the interpreter exited.
    assert not srv.live()
    assert segments(shm_prefix) == []


@pytest.mark.parametrize("kwargs, words", [
    ({"correlation_id": -1}, "correlation_id .* got -1"),
    ({"correlation_id": 2**64}, "correlation_id .* uint64"),
    ({"correlation_id": 1.5}, "correlation_id .* not float"),
    ({"correlation_id": True}, "correlation_id .* not bool"),
    ({"request_id": 7}, "request_id must be a str"),
    ({"timeout": -5}, "timeout .* got -5"),
    ({"priority": -1}, "priority .* got -1"),
    ({"flags": 4}, "flags must combine SEQUENCE_START"),
    ({"parameters": {1: "x"}}, "parameter name 1 is not a str"),
    ({"parameters": {"big": 2**70}}, "parameter 'big': .* int64"),
    ({"parameters": [("x", 1)]}, "parameters must be a mapping of names to values, not list"),
])
def test_request_settings_of_a_wrong_type_or_range_are_refused(
        server: tritonpy.Server, kwargs: dict[str, Any], words: str) -> None:
    # Were passed on as they were (the model saw correlation_id -1, flags 4, timeout -5, a
    # request_id 7), or failed later as a response "a value of it cannot be encoded".
    model = server.model("sees")
    with pytest.raises(InvalidArgumentError, match=words):
        model.infer({"IN": fp32(1)}, **kwargs)


def test_request_settings_in_range_reach_the_model(server: tritonpy.Server) -> None:
    model = server.model("sees")
    for corr in ("session-1", 2**64 - 1, np.uint64(5)):
        resp = infer(model, {"IN": fp32(1)}, correlation_id=corr, flags=3, timeout=0,
                     priority=2**64 - 1)
        assert resp.error is None, resp.error
        assert resp.parameters["correlation_id"] == repr(corr if isinstance(corr, str)
                                                         else int(corr))
        assert resp.parameters["flags"] == 3


def test_a_stream_read_with_get_then_iterated_ends_after_its_final_response(
        server: tritonpy.Server) -> None:
    """``get()`` takes the final response: a ``for`` over the stream then ends at once (it
    waited for ever for a response that would never come), and another ``get()`` raises
    queue.Empty at once, whatever its timeout."""
    import queue

    stream = server.model("double").infer({"IN": fp32(1, 2)})
    resp = stream.get(timeout=30)
    assert resp.final and resp.error is None
    assert list(stream) == []
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        stream.get()
    assert time.monotonic() - t0 < 1


def test_inputs_that_are_not_a_mapping_are_refused(server: tritonpy.Server) -> None:
    with pytest.raises(InvalidArgumentError, match="mapping of input names"):
        server.model("double").infer([("IN", fp32(1))])  # type: ignore[arg-type]


def test_a_model_version_that_is_not_an_int_is_refused(server: tritonpy.Server) -> None:
    # Was a bare ValueError from int("x").
    with pytest.raises(InvalidArgumentError, match="model version must be an int .*not str"):
        server.model("double", "x")  # type: ignore[arg-type]
    assert infer(server.model("double", np.int64(1)), {"IN": fp32(2)}).outputs[
        "OUT"].to_numpy().tolist() == [4.0]


def test_a_negative_model_version_other_than_minus_one_is_refused(
        server: tritonpy.Server) -> None:
    # Was served as the latest version.
    with pytest.raises(InvalidArgumentError,
                       match=r"model version must be -1 \(the latest\) or a version number, "
                             r"not -5"):
        server.model("double", -5)
    assert infer(server.model("double", -1), {"IN": fp32(2)}).outputs[
        "OUT"].to_numpy().tolist() == [4.0]


@pytest.mark.parametrize("kwargs, words", [
    # QA round 14. Was: stop() failed with "TypeError: unsupported operand type(s) for +",
    # without finalize; "'int' object is not iterable" at start(); AttributeError.
    ({"exit_timeout": "x"}, "exit_timeout must be a number of seconds, not str"),
    ({"exit_timeout": -1}, "exit_timeout must be 0 or more seconds, got -1"),
    ({"poll_interval": float("nan")}, "poll_interval must be 0 or more seconds, got nan"),
    ({"log_verbose": "x"}, "log_verbose must be an int, not str"),
    ({"model_load_retry_count": -2}, "model_load_retry_count must be >= 0, not -2"),
    ({"response_cache_size": 1.5}, "response_cache_size must be an int, not float"),
    ({"model_repository": 123}, "model_repository must be a path or a list of paths, not int"),
    ({"backend_config": ["x"]}, "backend_config must be a mapping of keys to values, not list"),
    ({"load_models": [1]}, r"load_models must be model names \(str\), not int"),
    ({"server_id": 5}, "server_id must be a str, not int"),
    ({"model_repository": [1]}, "model_repository must be a path or a list of paths, not a "
                                "list holding int"),
    ({"backend_directory": 5}, r"backend_directory must be a path \(or None\), not int"),
    # QA round 15. Were taken as true ("false" turned namespacing on), or failed later:
    # tracing=5 at stop() and loop=5 at start() with an AttributeError.
    ({"strict_readiness": "no"}, "strict_readiness must be a bool, not str"),
    ({"model_namespacing": "false"}, "model_namespacing must be a bool, not str"),
    ({"auto_complete": 1.0}, "auto_complete must be a bool, not float"),
    ({"tracing": 5}, r"tracing must be a tritonpy.Tracing \(or None\), not int"),
    ({"loop": 5}, r"loop must be an asyncio event loop \(or None\), not int"),
    ({"metrics_config": 5}, r"metrics_config must be a tritonpy.MetricsConfig \(or None\), "
                            "not int"),
    ({"rate_limit_resources": [5]}, r"rate_limit_resources must be resources \(str\), not int"),
])
def test_server_settings_of_a_wrong_type_are_refused_at_construction(
        repo: Path, kwargs: dict[str, Any], words: str) -> None:
    settings = {"model_repository": str(repo), **kwargs}
    with pytest.raises(InvalidArgumentError, match=words):
        tritonpy.Server(**settings)


def test_bytes_are_one_path_but_no_model_name(repo: Path) -> None:
    # QA round 16: load_models=b"double" was taken byte by byte ("not int"), and so was a
    # bytearray repository.
    assert tritonpy.Server(bytearray(os.fsencode(repo))).repositories == [str(repo)]
    with pytest.raises(InvalidArgumentError, match=r"load_models must be model names \(str\), "
                                                   "not bytes"):
        tritonpy.Server(str(repo), model_control_mode="explicit", load_models=b"double")
    # An int is a bool setting as it is an unload's wait (strict_readiness=1 was refused).
    assert tritonpy.Server(str(repo), strict_readiness=1).strict_readiness is True


def test_numpy_numbers_are_server_settings_too(repo: Path) -> None:
    srv = tritonpy.Server(str(repo), exit_timeout=np.float32(2.5), poll_interval=np.int64(3),
                          log_verbose=np.int32(1), strict_readiness=np.False_,
                          model_namespacing=np.True_, auto_complete=np.bool_(False))
    assert (srv.exit_timeout, srv.poll_interval, srv.log_verbose) == (2.5, 3.0, 1)
    flags = (srv.strict_readiness, srv.model_namespacing, srv.auto_complete)
    assert flags == (False, True, False) and all(type(flag) is bool for flag in flags)


def test_bytes_paths_and_no_models_to_load_are_server_settings_too(repo: Path) -> None:
    # QA round 15: a bytes path was refused ("not bytes"), a list of them raised a bare
    # TypeError, and load_models=None was "not NoneType".
    class BytesPath:
        def __fspath__(self) -> bytes:
            return os.fsencode(repo)

    for given in (os.fsencode(repo), [os.fsencode(repo)], BytesPath(), [BytesPath()]):
        srv = tritonpy.Server(given, backend_directory=BytesPath(),  # type: ignore[arg-type]
                              load_models=None)  # type: ignore[arg-type]
        assert srv.repositories == [str(repo)] and srv.backend_directory == str(repo)
        assert srv.load_models == []


def test_one_model_name_to_load_may_be_a_str(repo: Path, shm_prefix: str) -> None:
    # It was taken letter by letter: "Request for unknown model: 'd' is not found".
    with serving(repo, shm_prefix, model_control_mode="explicit",
                 load_models="double") as srv:
        assert [m["name"] for m in srv.models() if m["state"] == "READY"] == ["double"]


def test_model_api_arguments_of_a_wrong_type_are_refused(tmp_path: Path,
                                                         shm_prefix: str) -> None:
    # QA round 14. Were: TypeError "argument of type 'int' is not iterable" (load(123)),
    # AttributeError (files=[1], loop=123), NotFoundError "unknown model: '123'", and unload()
    # returning silently, its wait="x" taken as true.
    write_model(tmp_path, "double")
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as srv:
        for call, words in (
                (lambda: srv.load(123), "model name must be a str, not int"),
                (lambda: srv.load("double", config=7), "config must be JSON text or a dict"),
                (lambda: srv.load("double", config="{}", files=[1]),
                 "files must be a mapping of paths to bytes, not list"),
                (lambda: srv.model(123), "model name must be a str, not int"),
                (lambda: srv.unload(123), "model name must be a str, not int"),
                (lambda: srv.unload("double", wait="x"), "wait must be a bool, not str"),
                (lambda: srv.unload("double", unload_dependents=None),
                 "unload_dependents must be a bool, not NoneType")):
            with pytest.raises(InvalidArgumentError, match=words):
                call()
        # A config override may be given as a dict.
        srv.load("double", config=_CONFIG)
        model = srv.model("double")
        assert infer(model, {"IN": fp32(3)}).outputs["OUT"].to_numpy().tolist() == [6.0]
        with pytest.raises(InvalidArgumentError, match="loop must be an asyncio event loop"):
            model.async_infer({"IN": fp32(1)}, loop=123)  # type: ignore[arg-type]


class _Names(str, enum.Enum):
    DOUBLE = "double"


def test_model_names_may_be_str_subclasses(tmp_path: Path, shm_prefix: str) -> None:
    # QA round 15: np.str_ (a name read from a numpy array) and a str Enum were refused as
    # "not str_" / "not _Names"; they go on as the plain str they hold.
    write_model(tmp_path, "double")
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as srv:
        srv.load(_Names.DOUBLE)
        for name in (np.str_("double"), _Names.DOUBLE):
            model = srv.model(name)
            assert type(model.name) is str and model.name == "double"
            assert infer(model, {"IN": fp32(3)}).outputs["OUT"].to_numpy().tolist() == [6.0]
        srv.unload(np.str_("double"))
        assert not srv.model("double").ready()


_CONFIG = {"max_batch_size": 0, "backend": "python",
           "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [-1]}],
           "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [-1]}]}


def test_a_config_override_may_hold_numpy_numbers_or_be_bytes(tmp_path: Path,
                                                              shm_prefix: str) -> None:
    # QA round 15: numpy numbers in a dict were a bare TypeError from json.dumps ("Object of
    # type int64 is not JSON serializable"); they are written as the numbers they hold. JSON
    # text given as bytes was refused ("not bytes"); it is read as UTF-8.
    write_model(tmp_path, "double")
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as srv:
        config = {**_CONFIG, "max_batch_size": np.int64(0),
                  "input": [{**_CONFIG["input"][0], "dims": np.array([-1])}]}  # type: ignore
        srv.load("double", config=config)
        assert srv.model("double").config()["input"][0]["dims"] == [-1]
        srv.load("double", config=json.dumps(_CONFIG).encode())  # type: ignore[arg-type]
        assert infer(srv.model("double"), {"IN": fp32(3)}).outputs[
            "OUT"].to_numpy().tolist() == [6.0]
        for config, words in (
                ({**_CONFIG, "parameters": {"x": {"string_value": object()}}},
                 "config cannot be written as JSON: Object of type object is not JSON "
                 "serializable"),
                ({**_CONFIG, (1, 2): 3}, "config cannot be written as JSON: keys must be"),
                (b'{"backend": "\xff"}', "config must be UTF-8 JSON text: 'utf-8' codec can't "
                                          "decode byte 0xff")):
            with pytest.raises(InvalidArgumentError, match=words):
                srv.load("double", config=config)  # type: ignore[arg-type]


def test_a_load_file_given_as_text_is_named(tmp_path: Path, shm_prefix: str) -> None:
    # Was "TypeError: a bytes-like object is required", naming no file.
    write_model(tmp_path, "double")
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as srv:
        with pytest.raises(InvalidArgumentError,
                           match="the content of file '1/model.py' must be bytes, not str"):
            srv.load("double", config='{"backend": "python"}',
                     files={"file:1/model.py": "text"})  # type: ignore[dict-item]


def test_the_model_loading_api_outside_a_server_does_not_point_at_model_runner() -> None:
    import triton_python_backend_utils as pb_utils
    with pytest.raises(pb_utils.TritonModelException,
                       match=r"load_model\(\) needs a running tritonpy server .*ModelRunner "
                             "does not serve the model loading API"):
        pb_utils.load_model("double")


def test_async_infer_off_a_loop_says_which_loop(server: tritonpy.Server) -> None:
    with pytest.raises(RuntimeError, match="pass loop="):
        server.model("double").async_infer({"IN": fp32(1)})


def test_a_loop_that_does_not_run_is_refused(repo: Path, shm_prefix: str) -> None:
    loop = asyncio.new_event_loop()
    try:
        srv = tritonpy.Server(str(repo), loop=loop, backend_config=_backend(shm_prefix))
        # Was: start() waited 60 s per model for stubs whose answers nobody read.
        with pytest.raises(RuntimeError, match="not running"):
            srv.start()
        assert segments(shm_prefix) == []
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        srv.start()
        try:
            model = srv.model("double")
            assert infer(model, {"IN": fp32(2)}).error is None
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
            # Was: a request that waited for ever.
            with pytest.raises(UnavailableError, match="is not running"):
                model.infer({"IN": fp32(2)})
        finally:
            thread = threading.Thread(target=loop.run_forever, daemon=True)
            thread.start()
            srv.stop()
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
    finally:
        loop.close()


def test_exit_without_stop_is_quiet_and_clean(repo: Path, shm_prefix: str) -> None:
    script = textwrap.dedent(f"""
        import numpy as np, tritonpy
        srv = tritonpy.Server({str(repo)!r},
                              backend_config={{"shm-region-prefix-name": {shm_prefix!r}}})
        srv.start()
        out = srv.model("double").infer({{"IN": np.ones(4, np.float32)}}).get(timeout=30)
        assert out.error is None, out.error
        print("served", flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=40, env=env)
    assert done.returncode == 0 and "served" in done.stdout, done.stderr
    # Was: "stub process ... killed by signal SIGKILL" and "instance ... died; restarting".
    assert "died" not in done.stderr and "killed" not in done.stderr, done.stderr
    assert segments(shm_prefix) == []


FILES_MODEL_PY = (b"import triton_python_backend_utils as pb_utils\n"
                  b"class TritonPythonModel:\n"
                  b"    def execute(self, requests):\n"
                  b"        return [pb_utils.InferenceResponse([pb_utils.Tensor('OUT', "
                  b"pb_utils.get_input_tensor_by_name(r, 'IN').as_numpy() * %d)]) "
                  b"for r in requests]\n")
FILES_CONFIG = _CONFIG


def test_the_folders_of_loads_with_files_do_not_pile_up(tmp_path: Path,
                                                         shm_prefix: str) -> None:
    # QA round 15: each load with files left a folder until the stop (15 after a 9-minute
    # soak of load/unload cycles); Triton 2.51 keeps none. Now only what serves is kept.
    write_model(tmp_path, "double")
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as srv:
        def folders() -> list[Path]:
            roots = {Path(srv.runtime("f").model_dir).parent.parent} if srv.repo.runtimes() \
                else set()
            return sorted(p for root in roots for p in root.iterdir())
        for factor in range(2, 7):
            srv.load("f", config=FILES_CONFIG, files={"file:1/model.py": FILES_MODEL_PY % factor})
            out = infer(srv.model("f"), {"IN": fp32(1)}).outputs["OUT"].to_numpy().tolist()
            assert out == [float(factor)]
            # (The version it replaced is unloaded in the background, its folder then.)
            wait_until(lambda: len(folders()) == 1, 10, "one folder of files")
            if factor % 2:
                srv.unload("f")
        root = Path(srv.runtime("f").model_dir).parent.parent
        srv.load("double")  # a load without files sweeps too
        assert [p.name[:2] for p in root.iterdir()] == ["f-"]  # f's current files only
        srv.unload("f")
        srv.load("f", config=FILES_CONFIG, files={"file:1/model.py": FILES_MODEL_PY % 9})
        assert len(list(root.iterdir())) == 1
        assert infer(srv.model("f"), {"IN": fp32(1)}).outputs["OUT"].to_numpy().tolist() == [9.0]
    assert not root.exists()


READS_ITS_FILE_PY = (b"import os, time\n"
                     b"import numpy as np\n"
                     b"import triton_python_backend_utils as pb_utils\n"
                     b"class TritonPythonModel:\n"
                     b"    def initialize(self, args):\n"
                     b"        self.dir = os.path.dirname(__file__)\n"
                     b"    def execute(self, requests):\n"
                     b"        time.sleep(1.0)\n"
                     b"        with open(os.path.join(self.dir, 'data.txt')) as f:\n"
                     b"            text = f.read()\n"
                     b"        return [pb_utils.InferenceResponse([pb_utils.Tensor('OUT', "
                     b"np.array([float(text)], np.float32))]) for r in requests]\n")


def test_a_version_keeps_its_files_while_it_serves(tmp_path: Path, shm_prefix: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # QA round 16: a version replaced (or unloaded without waiting) was for a moment neither
    # the model's nor among those finishing, and a sweep then removed the files it was still
    # reading: FileNotFoundError in 4 of 498 requests of a stress run. The moment is widened
    # here (its unload starts 0.5 s late) so that the sweep of another load falls in it.
    from tritonpy._repo_manager import RepositoryManager

    retire = RepositoryManager._retire

    def late_retire(self: Any, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.5)
        retire(self, *args, **kwargs)

    monkeypatch.setattr(RepositoryManager, "_retire", late_retire)
    write_model(tmp_path, "double")
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as srv:
        for how in ("reload", "unload"):
            srv.load("rd", config=FILES_CONFIG, files={"file:1/model.py": READS_ITS_FILE_PY,
                                                       "file:1/data.txt": b"1"})
            pending = srv.model("rd").infer({"IN": fp32(0)})
            time.sleep(0.2)  # it runs
            if how == "reload":
                srv.load("rd", config=FILES_CONFIG, files={
                    "file:1/model.py": READS_ITS_FILE_PY, "file:1/data.txt": b"2"})
            else:
                srv.unload("rd", wait=False)
            srv.load("double")  # a load sweeps the folders of loads with files
            response = pending.get(timeout=20)
            assert response.error is None, (how, response.error)
            assert response.outputs["OUT"].to_numpy().tolist() == [1.0]
            srv.unload("rd")


def test_a_model_known_from_files_alone_goes_with_its_unload(tmp_path: Path,
                                                             shm_prefix: str) -> None:
    # QA round 16: its folder stayed until the stop, and a load without files then served
    # it again from there, with no inputs or outputs (Triton 2.51: "failed to load 'rz',
    # failed to poll from model repository").
    write_model(tmp_path, "double")
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as srv:
        srv.load("rz", config=FILES_CONFIG, files={"file:1/model.py": FILES_MODEL_PY % 3})
        root = Path(srv.runtime("rz").model_dir).parent.parent
        srv.unload("rz")
        assert list(root.iterdir()) == []
        with pytest.raises(NotFoundError):
            srv.load("rz")
        assert "rz" not in [m["name"] for m in srv.models()]
        # A repository model overridden with files is the repository's again.
        srv.load("double", config=FILES_CONFIG, files={"file:1/model.py": FILES_MODEL_PY % 5})
        assert infer(srv.model("double"), {"IN": fp32(1)}).outputs["OUT"].to_numpy().tolist() \
            == [5.0]
        srv.unload("double")
        assert list(root.iterdir()) == []
        srv.load("double")
        assert infer(srv.model("double"), {"IN": fp32(1)}).outputs["OUT"].to_numpy().tolist() \
            == [2.0]


SLOW_FINALIZE_DOUBLE_PY = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)])
            for r in requests]

    def finalize(self):
        time.sleep(1.5)
"""


def test_a_load_without_files_never_reads_a_models_files(tmp_path: Path,
                                                         shm_prefix: str) -> None:
    # QA round 17: a load without files of a model known from files alone (loaded, or being
    # unloaded) reloaded it from its files with no configuration: READY with no inputs and no
    # outputs (Triton 2.51 refuses: "failed to poll from model repository", and serves on);
    # and an ensemble loaded while its step overridden with files was being unloaded loaded
    # that step from the files, with no configuration, and failed (Triton: the repository's).
    write_model(tmp_path, "double", SLOW_FINALIZE_DOUBLE_PY)
    write_step_ensemble(tmp_path, "ens", "double")
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as srv:
        srv.load("fonly", config=FILES_CONFIG, files={"file:1/model.py": FILES_MODEL_PY % 3})
        for then in ("loaded", "unloading"):
            if then == "unloading":
                srv.unload("fonly", wait=False)
            with pytest.raises(tritonpy.InternalError,  # (Triton's: HTTP 500, QA round 18)
                               match="failed to load 'fonly', failed to poll from model "
                                     "repository"):
                srv.load("fonly")
            if then == "loaded":  # it serves on, as it was
                assert infer(srv.model("fonly"), {"IN": fp32(1)}).outputs["OUT"] \
                    .to_numpy().tolist() == [3.0]
        srv.load("double", config=FILES_CONFIG, files={"file:1/model.py": FILES_MODEL_PY % 7})
        srv.unload("double", wait=False)  # its finalize takes 1.5 s
        srv.load("ens")
        assert infer(srv.model("ens"), {"IN": fp32(1)}).outputs["OUT"].to_numpy().tolist() \
            == [2.0]


def test_loads_with_files_during_a_stop_leave_no_folder(tmp_path: Path, shm_prefix: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # QA round 16: a load that had begun before the stop made a new tritonpy-files-* folder
    # after the stop had removed the server's, and it outlived the process.
    # The window is widened: a load reads the repository (1 s here) before it makes its
    # folder, and the stop comes meanwhile.
    import tempfile

    from tritonpy._repo_manager import RepositoryManager

    scan = RepositoryManager.scan

    def slow_scan(self: Any) -> None:
        if threading.current_thread().name.startswith("loader"):
            time.sleep(1.0)
        scan(self)

    monkeypatch.setattr(RepositoryManager, "scan", slow_scan)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    write_model(tmp_path / "repo", "double")
    for _ in range(3):
        srv = tritonpy.Server(str(tmp_path / "repo"), model_control_mode="explicit",
                              backend_config=_backend(shm_prefix))
        srv.start()
        errors: list[str] = []

        def keep_loading(k: int, srv: tritonpy.Server = srv) -> None:
            for i in range(200):
                try:
                    srv.load(f"m{k}", config=FILES_CONFIG,
                             files={"file:1/model.py": FILES_MODEL_PY % i,
                                    "file:1/pad.bin": bytes(1 << 20)})
                except tritonpy.TritonpyError as exc:
                    errors.append(exc.message)
                    return

        loaders = [threading.Thread(target=keep_loading, args=(k,), name=f"loader{k}")
                   for k in range(3)]
        for t in loaders:
            t.start()
        time.sleep(0.3)  # (each is reading the repository)
        srv.stop()
        for t in loaders:
            t.join(30)
        assert list(temp.iterdir()) == []
        assert errors and all("stopp" in e or "not started" in e or "was stopped" in e
                              for e in errors), errors
    assert segments(shm_prefix) == []


@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_the_folder_of_a_load_with_files_goes_when_the_program_ends(
        repo: Path, shm_prefix: str, end: str) -> None:
    # QA round 14: a model a client loaded from files stayed in the temp folder
    # (tritonpy-<name>-*) after a program that exited without stop(), or a server SIGKILLed.
    model_py = (b"import triton_python_backend_utils as pb_utils\n"
                b"class TritonPythonModel:\n"
                b"    def execute(self, requests):\n"
                b"        return [pb_utils.InferenceResponse([pb_utils.Tensor('OUT', "
                b"pb_utils.get_input_tensor_by_name(r, 'IN').as_numpy())]) for r in requests]\n")
    script = textwrap.dedent(f"""
        import glob, os, signal, tempfile
        import tritonpy
        srv = tritonpy.Server({str(repo)!r}, model_control_mode="explicit",
                              backend_config={{"shm-region-prefix-name": {shm_prefix!r}}})
        srv.start()
        srv.load("from_files", config={_CONFIG!r},
                 files={{"file:1/model.py": {model_py!r}}})
        print(os.path.dirname(srv.runtime("from_files").model_dir), flush=True)
        if {end!r} == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=40, env=env)
    assert done.stdout, done.stderr
    folder = Path(done.stdout.splitlines()[0])
    assert folder.name.startswith("from_files-") and folder.parent.name.startswith(
        "tritonpy-files-"), (done.stdout, done.stderr)
    wait_until(lambda: not folder.parent.exists(), 20, f"{folder.parent} to be removed")
    wait_until(lambda: segments(shm_prefix) == [], 20, "the segments to be removed")


def test_ctrl_c_during_stop_ends_it_at_once_and_leaves_nothing(repo: Path,
                                                               shm_prefix: str) -> None:
    # A Ctrl-C while stop() drained a 20 s request left the stop half done: a second stop()
    # did nothing, the exit's clean-up neither, and the host's segment stayed in /dev/shm
    # after the process ended (the janitor swept while the exiting server still ran).
    script = textwrap.dedent(f"""
        import os, signal, threading, time
        import numpy as np, tritonpy
        srv = tritonpy.Server({str(repo)!r}, model_control_mode="explicit",
                              load_models=["sleeper", "double"],
                              backend_config={{"shm-region-prefix-name": {shm_prefix!r}}})
        srv.start()
        stub = srv.runtime("sleeper").instances[0].stub.proc
        threading.Thread(target=lambda: srv.model("sleeper").infer(
            {{"IN": np.array([20000], np.float32)}}).get(timeout=60), daemon=True).start()
        time.sleep(0.5)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            srv.stop()
        except KeyboardInterrupt:
            print("interrupted after %.1f s" % (time.monotonic() - t0), flush=True)
        print("stub ended", stub.poll() is not None, flush=True)
        srv.stop()  # a no-op now
        try:
            srv.model("double")
        except tritonpy.UnavailableError as exc:
            print("refused:", exc, flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=40, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("interrupted after ") and float(lines[0].split()[2]) < 5, lines
    assert lines[1:] == ["stub ended True",
                         "refused: the server was stopped: create a new Server"], lines
    assert "stop interrupted: the instances left are killed, without finalize" in done.stderr
    assert segments(shm_prefix) == []


def test_abort_from_another_thread_ends_a_draining_stop_at_once(repo: Path,
                                                                shm_prefix: str) -> None:
    with _sleeper_server(repo, shm_prefix) as srv:
        stub = srv.runtime("sleeper").instances[0].stub.proc
        pending = srv.model("sleeper").infer({"IN": np.array([20000], np.float32)})
        time.sleep(0.3)
        threading.Timer(0.5, srv.abort).start()
        t0 = time.monotonic()
        srv.stop()  # would drain the 20 s request (exit timeout 30 s)
        assert time.monotonic() - t0 < 5
        assert stub.poll() is not None
        response = pending.get(timeout=5)
        assert "the server stopped it at once, without finalize" in str(response.error)
        srv.abort()  # a no-op now
        srv.stop()
        with pytest.raises(UnavailableError, match="the server was stopped"):
            srv.model("sleeper")


def test_abort_during_a_stop_fails_the_queued_requests_in_its_words(
        repo: Path, shm_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    # QA round 16: with a stop draining, abort() killed the stubs first, and the drain failed
    # the queued requests as "model 'sleeper' was unloaded"; and the stop's cut_short stayed
    # empty, as after a clean stop. (Later QA: the log said "exit timeout expired", which the
    # abort had cut short.)
    caplog.set_level(logging.ERROR, logger="tritonpy")
    with _sleeper_server(repo, shm_prefix) as srv:
        model = srv.model("sleeper")
        running = model.infer({"IN": np.array([5000], np.float32)})
        time.sleep(0.3)
        queued = [model.infer({"IN": np.array([10], np.float32)}) for _ in range(3)]
        threading.Timer(0.5, srv.abort).start()
        srv.stop()
        assert "the server stopped it at once" in str(running.get(timeout=10).error)
        for pending in queued:
            assert "the server stopped at once (abort() or a second signal): the request " \
                "was not run" in str(pending.get(timeout=10).error)
        assert srv.cut_short == ["'sleeper' version 1 (requests in flight)"]
    said = [r.getMessage() for r in caplog.records]
    assert "stopped at once (abort() or a second signal): cut off in 'sleeper' version 1 " \
        "(requests in flight)" in said, said
    assert not any("exit timeout expired" in m for m in said), said


@contextlib.contextmanager
def _sleeper_server(repo: Path, shm_prefix: str) -> Iterator[tritonpy.Server]:
    """A started server of ``sleeper`` alone; stopped after, its segments checked gone."""
    srv = tritonpy.Server(str(repo), model_control_mode="explicit", load_models=["sleeper"],
                          backend_config=_backend(shm_prefix))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
    assert segments(shm_prefix) == []


SLOW_INIT_PY = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        time.sleep(20)

    def execute(self, requests):
        return []
"""


SLOW_FINALIZE_PY = SLOW_INIT_PY.replace("def initialize(self, args):", "def finalize(self):")


def test_abort_during_a_stops_finalize_says_no_finalize_failed(
        tmp_path: Path, shm_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    # (QA) abort() from another thread while stop() waited for a model's finalize logged
    # "finalize failed: Stub process ... is not healthy ... (the server stopped it at once,
    # without finalize)": a failure of the finalize that abort() had meant to skip.
    write_model(tmp_path, "slow_finalize", SLOW_FINALIZE_PY, io_config())
    caplog.set_level(logging.WARNING, logger="tritonpy")
    srv = tritonpy.Server(str(tmp_path), backend_config=_backend(shm_prefix))
    srv.start()
    stub = srv.runtime("slow_finalize").instances[0].stub.proc
    threading.Timer(1.0, srv.abort).start()
    t0 = time.monotonic()
    srv.stop()  # in the model's 20 s finalize when the abort comes
    assert time.monotonic() - t0 < 10
    assert stub.poll() is not None
    said = [r.getMessage() for r in caplog.records]
    assert not any("finalize failed" in m for m in said), said
    assert segments(shm_prefix) == []


def test_abort_during_start_stops_it(tmp_path: Path, shm_prefix: str) -> None:
    # QA round 15: abort() before the start had set itself started was lost: start() went on
    # for the whole 20 s initialize.
    write_model(tmp_path, "slow_init", SLOW_INIT_PY, io_config())
    for delay in (0.0, 0.005, 0.5):
        srv = tritonpy.Server(str(tmp_path), model_control_mode="explicit",
                              load_models=["slow_init"], backend_config=_backend(shm_prefix))
        failure: list[BaseException] = []

        def start(srv: tritonpy.Server = srv) -> None:
            try:
                srv.start()
            except BaseException as exc:
                failure.append(exc)

        starter = threading.Thread(target=start)
        t0 = time.monotonic()
        starter.start()
        while not srv._in_start and starter.is_alive():  # (start() has begun)
            time.sleep(0.0005)
        time.sleep(delay)
        srv.abort()
        starter.join(15)
        assert time.monotonic() - t0 < 5
        assert failure and isinstance(failure[0], tritonpy.TritonpyError), failure
        srv.stop()
        assert segments(shm_prefix) == []


def test_ctrl_c_during_start_is_raised_at_once_and_leaves_nothing(tmp_path: Path,
                                                                  shm_prefix: str) -> None:
    # The KeyboardInterrupt waited for the slowest initialize (20 s here) before it was raised,
    # then for the finalize of the models already loaded (10 s more here).
    write_model(tmp_path, "slow_init", SLOW_INIT_PY)
    write_model(tmp_path, "slow_finalize", SLOW_FINALIZE_PY)
    write_model(tmp_path, "double")
    script = textwrap.dedent(f"""
        import os, signal, threading, time
        import tritonpy
        srv = tritonpy.Server({str(tmp_path)!r},
                              backend_config={{"shm-region-prefix-name": {shm_prefix!r}}})
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            srv.start()
        except KeyboardInterrupt:
            print("interrupted after %.1f s" % (time.monotonic() - t0), flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=40, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines and lines[0].startswith("interrupted after "), done.stdout + done.stderr
    assert float(lines[0].split()[2]) < 6, lines
    assert segments(shm_prefix) == []


def test_a_thread_may_serve_on_after_the_main_thread_returns(repo: Path, shm_prefix: str) -> None:
    # The stubs were spawned from a ThreadPoolExecutor's thread, which the interpreter ends
    # when the main thread returns: PR_SET_PDEATHSIG then killed every stub under a program
    # whose other (non-daemon) thread was still serving.
    script = textwrap.dedent(f"""
        import threading, time
        import numpy as np, tritonpy
        srv = tritonpy.Server({str(repo)!r},
                              backend_config={{"shm-region-prefix-name": {shm_prefix!r}}})
        srv.start()

        def serve_on():
            time.sleep(1.0)  # the main thread has returned by now
            out = srv.model("double").infer({{"IN": np.ones(4, np.float32)}}).get(timeout=30)
            print("late", out.error, out.outputs["OUT"].to_numpy().tolist(), flush=True)
            srv.stop()

        threading.Thread(target=serve_on).start()
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=40, env=env)
    assert done.returncode == 0, done.stderr
    assert "late None [2.0, 2.0, 2.0, 2.0]" in done.stdout, done.stdout + done.stderr
    assert "died" not in done.stderr and "killed" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # the stop from that thread works
    assert segments(shm_prefix) == []


@pytest.mark.parametrize("timeout, words", [
    (-1, "timeout must be 0 or more seconds, not -1"),
    (float("nan"), "timeout must be 0 or more seconds, not nan"),
    ("x", "timeout must be a number of seconds or None, not str"),
    # (get(True) reads as queue.Queue's get(block=True): it was a 1 s timeout)
    (True, "timeout must be a number of seconds or None, not bool"),
])
def test_a_bad_get_timeout_is_refused_before_and_after_the_end(
        server: tritonpy.Server, timeout: Any, words: str) -> None:
    # (QA) Was queue's ValueError, or "'str' object cannot be interpreted as an integer",
    # before the end, and queue.Empty after it.
    stream = server.model("double").infer({"IN": fp32(1)})
    with pytest.raises(InvalidArgumentError, match=re.escape(words)):
        stream.get(timeout)
    assert stream.get(timeout=float("inf")).final  # (inf waits for ever: was OverflowError)
    with pytest.raises(InvalidArgumentError, match=re.escape(words)):
        stream.get(timeout)
