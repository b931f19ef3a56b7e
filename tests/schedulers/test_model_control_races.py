"""Model control under races, through HTTP with tritonclient: loads of one model that wait for
each other each load what they were asked for, and load / unload from many threads while
requests stream leaves a served model, or none, and no stub process behind.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from _models import (SLEEPER_PY, io_config, serving_frontends, wait_for, wait_until,
                     write_model)
from tritonclient.utils import InferenceServerException

from tritonpy.shm import janitor

pytestmark = pytest.mark.timeout(60)

# OUT = IN + ADD; initialize logs where the model was loaded from, then takes SLOW seconds.
LOGGING_PY = """
import json, time
import triton_python_backend_utils as pb_utils

ADD = {add}

class TritonPythonModel:
    def initialize(self, args):
        with open({log!r}, "a") as fh:
            fh.write(json.dumps([ADD, args["model_repository"]]) + chr(10))
        time.sleep({slow})

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + ADD)])
            for r in requests]
"""

OVERRIDE = json.dumps({
    "backend": "python", "max_batch_size": 0,
    "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [-1]}],
    "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [-1]}]})


def _infer(client: httpclient.InferenceServerClient, model: str, value: float) -> np.ndarray:
    x = np.array([value], np.float32)
    inp = httpclient.InferInput("IN", [1], "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp]).as_numpy("OUT")


def test_plain_load_waiting_behind_a_files_load_loads_the_repository_model(
        tmp_path: Path) -> None:
    # A plain load sent while another load runs, then a load with files: when the plain one
    # gets its turn it loads the repository's model.py, not the files the later load wrote.
    log = tmp_path / "init.log"
    repo = tmp_path / "repo"
    write_model(repo, "m", LOGGING_PY.format(add=0, log=str(log), slow=1.2))
    files_py = LOGGING_PY.format(add=1000, log=str(log), slow=0)
    with serving_frontends(repo, model_control_mode="explicit") as (_, fe):
        url = f"127.0.0.1:{fe.http_port}"
        results: dict[str, object] = {}

        def load(key: str, **kwargs: object) -> None:
            c = httpclient.InferenceServerClient(url, network_timeout=60)
            try:
                c.load_model("m", **kwargs)
                results[key] = "OK"
            except InferenceServerException as exc:
                results[key] = exc.message()
            finally:
                c.close()

        # Its config differs from the repository's, and the repository's config file changes
        # while it loads (as Triton's, an override holds for later loads until then): the
        # plain load loads the model anew.
        changed = json.dumps({**json.loads(OVERRIDE), "parameters": {"p": {"string_value": "1"}}})
        first = threading.Thread(target=load, args=("first",), kwargs={"config": changed})
        first.start()
        wait_for(log.exists, timeout=20)  # the first load is initializing now
        (repo / "m" / "config.pbtxt").touch()
        plain = threading.Thread(target=load, args=("plain",))
        plain.start()
        time.sleep(0.2)
        files = threading.Thread(target=load, args=("files",), kwargs={
            "config": OVERRIDE, "files": {"file:1/model.py": files_py.encode()}})
        files.start()
        for t in (first, plain, files):
            t.join(60)
        assert results == {"first": "OK", "plain": "OK", "files": "OK"}
        loads = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(loads) == 3, loads
        from_repo = [add for add, where in loads if where == str(repo / "m")]
        from_files = [add for add, where in loads if where != str(repo / "m")]
        # Two loads from the repository (the first and the plain one), one from the files.
        assert from_repo == [0, 0] and from_files == [1000], loads
        # What serves is what the last load loaded.
        c = httpclient.InferenceServerClient(url)
        try:
            assert _infer(c, "m", 1.0)[0] == 1.0 + loads[-1][0]
        finally:
            c.close()


def test_load_and_unload_from_many_threads_while_requests_stream(tmp_path: Path) -> None:
    write_model(tmp_path, "s", SLEEPER_PY, io_config())
    with serving_frontends(tmp_path, model_control_mode="explicit",
                           load_models=["s"]) as (server, fe):
        url = f"127.0.0.1:{fe.http_port}"
        stop = threading.Event()
        control_errors: list[str] = []
        infer_errors: list[str] = []
        served = [0]

        def control(k: int) -> None:
            c = httpclient.InferenceServerClient(url, network_timeout=60)
            n = k
            try:
                while not stop.is_set():
                    try:
                        if n % 2:
                            c.load_model("s")
                        else:
                            c.unload_model("s")
                    except InferenceServerException as exc:
                        control_errors.append(exc.message())
                    n += 1
            finally:
                c.close()

        def requests() -> None:
            c = httpclient.InferenceServerClient(url, network_timeout=60)
            try:
                while not stop.is_set():
                    try:
                        assert _infer(c, "s", 2.0)[0] == 2.0
                        served[0] += 1
                    except InferenceServerException as exc:
                        # Between an unload and the next load: the model is not there.
                        if "has no available versions" not in exc.message():
                            infer_errors.append(exc.message())
            finally:
                c.close()

        threads = [threading.Thread(target=control, args=(k,)) for k in range(8)]
        threads += [threading.Thread(target=requests) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(4)
        stop.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert control_errors == [] and infer_errors == []
        assert served[0] > 0
        c = httpclient.InferenceServerClient(url)
        try:
            c.load_model("s")
            assert c.is_model_ready("s") and _infer(c, "s", 0.0)[0] == 0.0
            assert len(janitor.stubs_of(os.getpid())) >= 1
            c.unload_model("s")
            # Every version that the races loaded is gone, their stubs with them.
            wait_until(lambda: [m["state"] for m in c.get_model_repository_index()]
                       == ["UNAVAILABLE"], 15, "the unload to finish")
            assert not c.is_model_ready("s") and janitor.stubs_of(os.getpid()) == []
        finally:
            c.close()
        assert server.repo.entries["s"].runtimes == {}


def test_an_unloaded_models_watchdog_threads_end_at_once(tmp_path: Path) -> None:
    # Each stub's watchdog slept out its interval (up to 5 s) after the stub was gone, so the
    # host's thread count stayed up after every unload.
    from _models import new_prefix, serving

    write_model(tmp_path, "watched", config=io_config(
        extra="instance_group [ { count: 2, kind: KIND_CPU } ]\n"))
    with serving(tmp_path, new_prefix(), model_control_mode="explicit",
                 load_models=["watched"]) as server:
        def watchdogs() -> list[str]:
            return [t.name for t in threading.enumerate()
                    if t.name.startswith("watched_") and t.name.endswith("-watchdog")]

        assert len(watchdogs()) == 2
        t0 = time.monotonic()
        server.unload("watched")
        assert wait_for(lambda: not watchdogs(), timeout=4.0), watchdogs()
        assert time.monotonic() - t0 < 4.0
