"""Passive instance groups (``passive: true``), as in Triton 2.51 (measured with the same
model.py): their instances are initialized but the server gives them no request. Where every
instance is passive, Triton crashes (SIGSEGV) on the first request; tritonpy answers it with
an error.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from _models import serving, write_model

# Answers with the name of the instance that ran it; notes each initialize in a file.
NAMED_PY = """
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_instance_name"]
        log = json.loads(args["model_config"])["parameters"]["LOG"]["string_value"]
        with open(log, "a") as f:
            f.write(self.name + "\\n")

    def execute(self, requests):
        out = np.array([self.name.encode()], dtype=object)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]) for _ in requests]
"""


def _config(groups: str, log: Path, extra: str = "") -> str:
    return ('backend: "python"\n'
            'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
            'output [ { name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] } ]\n'
            f"instance_group [ {groups} ]\n"
            f'parameters {{ key: "LOG" value {{ string_value: "{log}" }} }}\n' + extra)


def _who(srv, model: str, **kwargs) -> str:
    response = srv.model(model).infer({"IN": np.ones(1, np.float32)}, **kwargs).get(timeout=30)
    assert response.error is None, response.error
    return response.outputs["OUT"].to_numpy()[0].decode()


MIXED = ('{ name: "act", count: 1, kind: KIND_CPU }, '
         '{ name: "pas", count: 2, kind: KIND_CPU, passive: true }')


def test_passive_instances_start_but_take_no_request(tmp_path: Path, shm_prefix: str):
    log = tmp_path / "init.log"
    repo = tmp_path / "repo"
    write_model(repo, "p", NAMED_PY, _config(MIXED, log))
    seq = ("sequence_batching { max_sequence_idle_microseconds: 5000000 }\n")
    write_model(repo, "s", NAMED_PY, _config(MIXED, tmp_path / "s.log", seq))
    with serving(repo, shm_prefix) as srv:
        assert sorted(log.read_text().split()) == ["act_0", "pas_0", "pas_1"]
        streams = [srv.model("p").infer({"IN": np.ones(1, np.float32)}) for _ in range(6)]
        assert {s.get(timeout=30).outputs["OUT"].to_numpy()[0] for s in streams} == {b"act_0"}
        # Sequences take slots on active instances only.
        for cid in (1, 2, 3):
            assert _who(srv, "s", correlation_id=cid, flags=3) == "act_0"  # START | END


def test_a_model_with_only_passive_instances_answers_an_error(tmp_path: Path, shm_prefix: str):
    log = tmp_path / "init.log"
    repo = tmp_path / "repo"
    write_model(repo, "q", NAMED_PY, _config('{ count: 1, kind: KIND_CPU, passive: true }', log))
    with serving(repo, shm_prefix) as srv:
        assert srv.model("q").ready()  # as Triton's: loaded, and ready
        assert log.read_text().split() == ["q_0_0"]
        response = srv.model("q").infer({"IN": np.ones(1, np.float32)}).get(timeout=30)
        assert "model 'q' takes no requests: all its instance groups are passive" in str(
            response.error)
        # The server goes on serving (Triton's ends with SIGSEGV there).
        assert srv.model("q").ready()
