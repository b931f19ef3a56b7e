"""Triton's ``--model-namespacing``: a model name two repositories hold is two models.

The scenarios are those of Triton's QA test ``L0_model_namespacing`` (rebuilt with models of
our own), in poll and explicit mode: each repository has an ensemble whose step is called
``composing_model`` in both; ``addsub`` answers (a + b, a - b) and ``subadd`` (a - b, a + b).
Each ensemble runs its own repository's step; a request naming a model that both hold is
refused for its ambiguity, in Triton 2.51's words (measured). Real servers, real stubs.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _models import (ADD, AMBIGUOUS, DATA, SUB, namespacing_repos, serving, wait_for,
                     write_model)

from tritonpy import InvalidArgumentError

# A BLS model that calls the model its request names and answers with that model's error.
CALLER_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            target = pb_utils.get_input_tensor_by_name(r, "TARGET").as_numpy()[0].decode()
            a = pb_utils.get_input_tensor_by_name(r, "INPUT0")
            b = pb_utils.get_input_tensor_by_name(r, "INPUT1")
            reply = pb_utils.InferenceRequest(
                model_name=target, inputs=[a, b], requested_output_names=["OUTPUT0"]).exec()
            if reply.has_error():
                out.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(reply.error().message())))
            else:
                out.append(pb_utils.InferenceResponse(
                    [pb_utils.get_output_tensor_by_name(reply, "OUTPUT0")]))
        return out
"""

def answer(server: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    resp = server.model(name).infer({"INPUT0": DATA, "INPUT1": DATA}).get(timeout=30)
    return resp.outputs["OUTPUT0"], resp.outputs["OUTPUT1"]


def check(server: Any, name: str, expected: tuple[np.ndarray, np.ndarray]) -> None:
    got = answer(server, name)
    np.testing.assert_array_equal(got[0], expected[0], err_msg=name)
    np.testing.assert_array_equal(got[1], expected[1], err_msg=name)


def ambiguous(server: Any, name: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        answer(server, name)
    assert caught.value.message == AMBIGUOUS.format(name)
    assert not server.repo.is_ready(name)


def serve(tmp_path: Path, shm_prefix: str, mode: str, scenario: str) -> Any:
    kwargs: dict[str, Any] = {"model_namespacing": True, "model_control_mode": mode}
    if mode == "poll":
        kwargs["poll_interval"] = 0.1
    return serving(list(namespacing_repos(tmp_path, scenario)), shm_prefix, **kwargs)


def load_in_explicit_mode(server: Any, mode: str, *names: str) -> None:
    """In explicit mode, load ``names`` (each, as Triton, with the steps it runs)."""
    if mode == "explicit":
        for name in names:
            server.load(name)


@pytest.mark.parametrize("mode", ["poll", "explicit"])
def test_names_held_once_are_served_as_without_namespacing(tmp_path: Path, shm_prefix: str,
                                                           mode: str) -> None:
    with serve(tmp_path, shm_prefix, mode, "no_duplication") as server:
        load_in_explicit_mode(server, mode, "simple_addsub", "simple_subadd")
        for name, expected in (("simple_addsub", ADD), ("composing_addsub", ADD),
                               ("simple_subadd", SUB), ("composing_subadd", SUB)):
            check(server, name, expected)


@pytest.mark.parametrize("mode", ["poll", "explicit"])
def test_each_ensemble_runs_the_step_of_its_own_repository(tmp_path: Path, shm_prefix: str,
                                                          mode: str) -> None:
    with serve(tmp_path, shm_prefix, mode, "duplication") as server:
        # As Triton: each load brings the step of the ensemble's own repository.
        load_in_explicit_mode(server, mode, "simple_addsub", "simple_subadd")
        check(server, "simple_addsub", ADD)
        check(server, "simple_subadd", SUB)
        ambiguous(server, "composing_model")
        assert server.ready()
        # The index lists both, by name; the statistics of all models hold both.
        index = [(m["name"], m["state"]) for m in server.models()]
        assert index.count(("composing_model", "READY")) == 2
        stats = [s["name"] for s in server.statistics()["model_stats"]]
        assert stats.count("composing_model") == 2
        with pytest.raises(InvalidArgumentError, match="resolve ambiguity"):
            server.statistics("composing_model")


@pytest.mark.parametrize("mode", ["poll", "explicit"])
def test_ensembles_of_one_name_load_and_unload_together(tmp_path: Path, shm_prefix: str,
                                                        mode: str) -> None:
    with serve(tmp_path, shm_prefix, mode, "ensemble_duplication") as server:
        load_in_explicit_mode(server, mode, "simple_ensemble")  # both, each with its step
        check(server, "composing_addsub", ADD)
        check(server, "composing_subadd", SUB)
        ambiguous(server, "simple_ensemble")
        states = [m["state"] for m in server.models() if m["name"] == "simple_ensemble"]
        assert states == ["READY", "READY"]
        if mode == "explicit":
            server.unload("simple_ensemble", unload_dependents=True)
            states = {m["name"]: m["state"] for m in server.models()}
            assert [m["state"] for m in server.models()] == ["UNAVAILABLE"] * 4, states


@pytest.mark.parametrize("mode", ["poll", "explicit"])
def test_a_step_resolves_again_when_a_repository_loses_or_regains_it(
        tmp_path: Path, shm_prefix: str, mode: str) -> None:
    with serve(tmp_path, shm_prefix, mode, "duplication") as server:
        own = tmp_path / "addsub_repo" / "composing_model"
        away = tmp_path / "composing_model"
        shutil.move(own, away)
        if mode == "explicit":
            load_in_explicit_mode(server, mode, "simple_addsub", "simple_subadd")
        else:
            # The poll unloads addsub_repo's step, and its ensemble with it, then loads the
            # ensemble again on the only composing_model left.
            wait_for(lambda: [m["name"] for m in server.models()].count("composing_model") == 1
                     and server.repo.is_ready("simple_addsub"), timeout=20)
        for name in ("simple_addsub", "simple_subadd", "composing_model"):
            check(server, name, SUB)
        shutil.move(away, own)
        if mode == "explicit":
            server.load("simple_addsub")  # loads its own repository's step again
        else:
            wait_for(lambda: [m["name"] for m in server.models()
                              if m["state"] == "READY"].count("composing_model") == 2,
                     timeout=20)
            time.sleep(0.2)
        check(server, "simple_addsub", ADD)
        check(server, "simple_subadd", SUB)
        ambiguous(server, "composing_model")


def test_a_bls_call_to_a_name_two_repositories_hold_gets_the_ambiguity(
        tmp_path: Path, shm_prefix: str) -> None:
    a, s = namespacing_repos(tmp_path, "duplication")
    write_model(a, "caller", CALLER_PY, 'backend: "python"\n' + """
input [ { name: "TARGET" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
""")
    with serving([a, s], shm_prefix, model_namespacing=True) as server:
        def call(target: str) -> Any:
            return server.model("caller").infer(
                {"TARGET": np.array([target.encode()], dtype=object), "INPUT0": DATA,
                 "INPUT1": DATA}).get(timeout=30)

        refused = call("composing_model")
        assert refused.error is not None
        assert AMBIGUOUS.format("composing_model") in refused.error.message
        # The caller's stub serves on; a name one repository holds is found.
        np.testing.assert_array_equal(call("simple_subadd").outputs["OUTPUT0"], SUB[0])


def test_without_namespacing_a_name_two_repositories_hold_is_served_by_neither(
        tmp_path: Path, shm_prefix: str) -> None:
    a, s = namespacing_repos(tmp_path, "duplication")
    with serving([a, s], shm_prefix) as server:
        rows = [m for m in server.models() if m["name"] == "composing_model"]
        assert len(rows) == 1 and rows[0]["state"] == "UNAVAILABLE"
        with pytest.raises(Exception):
            answer(server, "simple_addsub")
