"""Ensembles of real Python models in real stubs: a linear chain, a diamond whose middle steps
must overlap, a failing step, a decoupled step streaming through, requested-output pruning,
statistics, zero-copy hand-over between steps, and the real ``tritonclient`` over HTTP.

One server serves the module (stub start-up is the expensive part); config errors and model
control get small servers of their own.
"""
from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import tritonpy
from tritonpy import NotFoundError, TritonpyError

from _models import PLUS1, SCALE2, infer, new_prefix, serving, wait_for, write_model


# Diamond middle steps: each announces itself with a file and waits (bounded) for the other's.
# If the ensemble ran them one after the other, the first would give up with an error.
BARRIER = """
import json, os, time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.me = args["model_name"]
        self.other = "right" if self.me == "left" else "left"
        self.add = 10 if self.me == "left" else 100

    def execute(self, requests):
        out = []
        for r in requests:
            d = json.loads(r.parameters())["barrier_dir"]
            open(os.path.join(d, self.me), "w").close()
            deadline = time.monotonic() + 20
            while not os.path.exists(os.path.join(d, self.other)):
                if time.monotonic() > deadline:
                    out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        f"{self.me} ran alone: {self.other} never started meanwhile")))
                    break
                time.sleep(0.005)
            else:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + self.add)]))
        return out
"""

JOIN = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT",
            pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
            + pb_utils.get_input_tensor_by_name(r, "B").as_numpy())]) for r in requests]
"""

FAIL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError(
            "step exploded on purpose")) for r in requests]
"""

# Decoupled: one response per element of IN. With an ``ack_dir`` parameter it sends element
# i+1 only once the client has created ack<i>, i.e. only once response i went all the way
# through the downstream step and out of the ensemble.
REPEAT = """
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            ack = json.loads(r.parameters()).get("ack_dir")
            for i, v in enumerate(x):
                sender.send(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.array([v], dtype=np.float32))]))
                if ack and i + 1 < len(x):
                    deadline = time.monotonic() + 20
                    while not os.path.exists(os.path.join(ack, f"ack{i}")):
                        if time.monotonic() > deadline:
                            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                                f"response {i} never reached the client")))
                            break
                        time.sleep(0.005)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# BLS along the ``route`` request parameter: calls the first model named there, passing the
# rest of the route on.
BLS_ROUTE = """
import json
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            params = json.loads(r.parameters())
            first, _, rest = params["route"].partition(",")
            params["route"] = rest
            resp = pb_utils.InferenceRequest(
                model_name=first, requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(r, "IN")],
                parameters=params).exec()
            if resp.has_error():
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "BLS call failed: " + resp.error().message())))
            else:
                out.append(pb_utils.InferenceResponse(
                    [pb_utils.get_output_tensor_by_name(resp, "OUT")]))
        return out
"""

# Announces itself with a file, then holds its instance until the test creates "release".
HOLD = """
import json, os, time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            d = json.loads(r.parameters())["hold_dir"]
            open(os.path.join(d, "holding"), "w").close()
            deadline = time.monotonic() + 20
            while not os.path.exists(os.path.join(d, "release")) and time.monotonic() < deadline:
                time.sleep(0.005)
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return out
"""

FP32_IO = """
backend: "python"
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""


def step(model: str, inputs: dict[str, str], outputs: dict[str, str], version: int = -1) -> str:
    ins = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    outs = " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: {version} {ins} {outs} }}'


def ensemble_config(steps: list[str], inputs: str = "IN", outputs: str = "OUT",
                    dtype: str = "TYPE_FP32") -> str:
    ins = ", ".join(f'{{ name: "{n}", data_type: {dtype}, dims: [ -1 ] }}'
                    for n in inputs.split())
    outs = ", ".join(f'{{ name: "{n}", data_type: {dtype}, dims: [ -1 ] }}'
                     for n in outputs.split())
    return (f'platform: "ensemble"\nmax_batch_size: 0\ninput [ {ins} ]\noutput [ {outs} ]\n'
            f'ensemble_scheduling {{ step [ {", ".join(steps)} ] }}\n')


def write_ensemble(repo: Path, name: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(textwrap.dedent(config))


CHAIN3 = ensemble_config([
    step("plus1", {"IN": "IN"}, {"OUT": "t1"}),
    step("scale2", {"IN": "t1"}, {"OUT": "t2"}),
    step("plus1", {"IN": "t2"}, {"OUT": "OUT"}),
])
DIAMOND = ensemble_config([
    step("left", {"IN": "IN"}, {"OUT": "L"}),
    step("right", {"IN": "IN"}, {"OUT": "R"}),
    step("join", {"A": "L", "B": "R"}, {"OUT": "SUM"}),
], outputs="SUM")
PAIR = ensemble_config([
    step("plus1", {"IN": "IN"}, {"OUT": "A"}),
    step("scale2", {"IN": "IN"}, {"OUT": "B"}),
], outputs="A B")
FAILING = ensemble_config([
    step("plus1", {"IN": "IN"}, {"OUT": "t1"}),
    step("fail", {"IN": "t1"}, {"OUT": "t2"}),
    step("scale2", {"IN": "t2"}, {"OUT": "OUT"}),
])
# One tensor as both inputs of a step, and again as one input of a later step together with
# that step's output (upstream's ensemble_add_sub_int32_int32_int32, L0_simple_ensemble).
TWICE = ensemble_config([
    step("join", {"A": "IN", "B": "IN"}, {"OUT": "double"}),
    step("join", {"A": "double", "B": "IN"}, {"OUT": "triple"}),
    step("join", {"A": "triple", "B": "triple"}, {"OUT": "OUT"}),
])
HALF = ensemble_config([step("only_out", {"IN": "IN"}, {"OUT": "A", "OUT2": "B"})],
                       outputs="A B")
SELF_LOOP = ensemble_config([step("bls_to_ensemble", {"IN": "IN"}, {"OUT": "OUT"})])
HELD = ensemble_config([step("hold", {"IN": "IN"}, {"OUT": "OUT"})])
STREAM = ensemble_config([
    step("repeat", {"IN": "IN"}, {"OUT": "t1"}),
    step("scale2", {"IN": "t1"}, {"OUT": "OUT"}),
])


def write_repo(repo: Path) -> Path:
    for name, body in (("plus1", PLUS1), ("scale2", SCALE2), ("left", BARRIER),
                       ("right", BARRIER), ("fail", FAIL),
                       ("bls_to_ensemble", BLS_ROUTE), ("bls_outer", BLS_ROUTE),
                       ("hold", HOLD)):
        write_model(repo, name, body, FP32_IO)
    write_model(repo, "join", JOIN, FP32_IO.replace(
        'input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]',
        'input [ { name: "A", data_type: TYPE_FP32, dims: [ -1 ] },'
        ' { name: "B", data_type: TYPE_FP32, dims: [ -1 ] } ]'))
    write_model(repo, "only_out", PLUS1, FP32_IO.replace(
        'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]',
        'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] },'
        ' { name: "OUT2", data_type: TYPE_FP32, dims: [ -1 ] } ]'))
    write_model(repo, "repeat", REPEAT,
                FP32_IO + "model_transaction_policy { decoupled: true }\n")
    for name, cfg in (("chain3", CHAIN3), ("diamond", DIAMOND), ("pair", PAIR),
                      ("failing", FAILING), ("stream", STREAM), ("self_loop", SELF_LOOP),
                      ("twice", TWICE), ("half", HALF),
                      ("held", HELD)):
        write_ensemble(repo, name, cfg)
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tritonpy.Server]:
    repo = write_repo(tmp_path_factory.mktemp("ens_repo"))
    with serving(repo, new_prefix()) as srv:
        yield srv


def stat(server: tritonpy.Server, model: str) -> dict[str, Any]:
    return server.statistics(model)["model_stats"][0]


def test_linear_chain_runs_every_step_in_order(server: tritonpy.Server) -> None:
    before = {m: stat(server, m)["inference_count"] for m in ("plus1", "scale2")}
    resp = infer(server.model("chain3"), {"IN": np.array([1, 2, 3], np.float32)})
    assert resp.error is None
    assert resp.final
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), [5, 7, 9])  # (x+1)*2+1
    assert resp.model == "chain3"
    # plus1 ran twice, scale2 once, and the ensemble's own statistics count the request.
    assert stat(server, "plus1")["inference_count"] == before["plus1"] + 2
    assert stat(server, "scale2")["inference_count"] == before["scale2"] + 1
    ens = stat(server, "chain3")
    assert ens["inference_stats"]["success"]["count"] >= 1
    assert ens["inference_stats"]["compute_infer"]["ns"] > 0


def test_one_tensor_may_feed_two_inputs_of_a_step(server: tritonpy.Server) -> None:
    # Each input a tensor feeds is one read of it: tritonpy counted one per step, so the
    # second input failed ("KeyError: 0") and the request stayed in flight until the stop.
    for _ in range(3):
        resp = infer(server.model("twice"), {"IN": np.array([1, 2], np.float32)})
        assert resp.error is None, resp.error
        np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), [6, 12])  # 3x, twice
    assert not server.runtime("twice")._busy()  # nothing left in flight


def test_ensemble_responses_carry_the_sequence_parameters_as_tritons(
        server: tritonpy.Server) -> None:
    # Triton 2.51 (measured) puts the request's sequence ID and flags in every ensemble
    # response, over HTTP and gRPC alike, sequence or not.
    x = np.array([1], np.float32)
    assert infer(server.model("chain3"), {"IN": x}).parameters == {
        "sequence_id": 0, "sequence_start": False, "sequence_end": False}
    assert infer(server.model("chain3"), {"IN": x}, correlation_id=42, flags=1).parameters == {
        "sequence_id": 42, "sequence_start": True, "sequence_end": False}


def test_diamond_runs_its_middle_steps_concurrently(server: tritonpy.Server,
                                                    tmp_path: Path) -> None:
    resp = infer(server.model("diamond"), {"IN": np.array([1, 2], np.float32)},
                 parameters={"barrier_dir": str(tmp_path)})
    assert resp.error is None, resp.error
    np.testing.assert_array_equal(resp.outputs["SUM"].to_numpy(), [112, 114])
    assert sorted(os.listdir(tmp_path)) == ["left", "right"]


def test_failing_step_fails_the_request_with_its_message(server: tritonpy.Server) -> None:
    after_before = stat(server, "scale2")["inference_count"]
    fails_before = stat(server, "failing")["inference_stats"]["fail"]["count"]
    resp = infer(server.model("failing"), {"IN": np.array([1], np.float32)})
    assert resp.final
    assert resp.error is not None
    assert "in ensemble 'failing'" in resp.error.message
    assert "step exploded on purpose" in resp.error.message
    assert not resp.outputs
    # The step after the failing one never ran; the failure is counted; others still serve.
    assert stat(server, "scale2")["inference_count"] == after_before
    assert stat(server, "failing")["inference_stats"]["fail"]["count"] == fails_before + 1
    ok = infer(server.model("chain3"), {"IN": np.array([0], np.float32)})
    np.testing.assert_array_equal(ok.outputs["OUT"].to_numpy(), [3])


def test_a_fault_moving_a_request_on_fails_that_request_alone(
        server: tritonpy.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # Fault injection (no input makes tritonpy's own code raise here any more): whatever
    # raises while the next steps are made, the request is answered with it, at once, and
    # nothing stays in flight (an unanswered request used to hold the stop for its timeout).
    from tritonpy import _ensemble

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(_ensemble, "fit_batch_dim", broken)
    resp = infer(server.model("chain3"), {"IN": np.array([1], np.float32)}, wait=10)
    assert resp.final and not resp.outputs
    assert resp.error is not None and resp.error.code == "INTERNAL"
    assert "in ensemble 'chain3'" in resp.error.message
    assert "RuntimeError: injected fault" in resp.error.message
    assert not server.runtime("chain3")._busy()
    monkeypatch.undo()
    ok = infer(server.model("chain3"), {"IN": np.array([0], np.float32)})
    np.testing.assert_array_equal(ok.outputs["OUT"].to_numpy(), [3])


def test_a_step_output_not_made_is_logged_in_tritons_words(
        server: tritonpy.Server, caplog: pytest.LogCaptureFixture) -> None:
    # As Triton 2.51 (measured; L0_simple_ensemble's test_ensemble_partial_add_sub greps the
    # line at --log-verbose 1): the response has the outputs made, the log names the other.
    with caplog.at_level("DEBUG", logger="tritonpy.ensemble"):
        resp = infer(server.model("half"), {"IN": np.array([1], np.float32)})
    assert resp.error is None, resp.error
    assert list(resp.outputs) == ["A"]
    assert "Composing models did not output tensor B" in caplog.text
    assert "did not output tensor A" not in caplog.text


def test_decoupled_step_streams_through_the_ensemble(server: tritonpy.Server,
                                                     tmp_path: Path) -> None:
    model = server.model("stream")
    assert model.decoupled()  # an ensemble with a decoupled step is decoupled
    assert model.config()["model_transaction_policy"]["decoupled"] is True
    stream = model.infer({"IN": np.array([1, 2, 3], np.float32)},
                         parameters={"ack_dir": str(tmp_path)})
    values = []
    while True:
        resp = stream.get(timeout=30)
        assert resp.error is None, resp.error
        if resp.outputs:
            values.append(float(resp.outputs["OUT"].to_numpy()[0]))
            # Only now may the decoupled step send its next response: each one must have
            # passed the downstream step and left the ensemble on its own.
            (tmp_path / f"ack{len(values) - 1}").touch()
        if resp.final:
            break
    assert values == [2.0, 4.0, 6.0]


def test_requested_outputs_prune_steps_they_do_not_need(server: tritonpy.Server) -> None:
    model = server.model("pair")
    both = infer(model, {"IN": np.array([3], np.float32)})
    assert sorted(both.outputs) == ["A", "B"]
    scale_before = stat(server, "scale2")["inference_count"]
    only_a = infer(model, {"IN": np.array([3], np.float32)}, requested_output_names=["A"])
    assert only_a.error is None
    assert list(only_a.outputs) == ["A"]
    np.testing.assert_array_equal(only_a.outputs["A"].to_numpy(), [4])
    assert stat(server, "scale2")["inference_count"] == scale_before  # B's step was pruned
    with pytest.raises(TritonpyError, match="unexpected inference output 'C'"):
        model.infer({"IN": np.array([3], np.float32)}, requested_output_names=["C"])


def test_large_tensors_pass_between_steps_by_handle(server: tritonpy.Server) -> None:
    x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: above the inline limit
    transport = server.transport
    copies, forwards = transport.copies, transport.forwards
    resp = infer(server.model("chain3"), {"IN": x})
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), (x + 1) * 2 + 1)
    # The host copied the client's input into shm once; each step's output went on to the
    # next step by handle.
    assert transport.copies - copies == x.nbytes
    assert transport.forwards - forwards >= 2


def test_ensemble_input_validation_and_metadata(server: tritonpy.Server) -> None:
    model = server.model("chain3")
    with pytest.raises(TritonpyError, match="data-type is 'INT32'"):
        model.infer({"IN": np.array([1], np.int32)})
    meta = model.metadata()
    assert meta["name"] == "chain3"
    assert meta["platform"] == "ensemble"
    assert [i["name"] for i in meta["inputs"]] == ["IN"]
    cfg = model.config()
    assert [s["model_name"] for s in cfg["ensemble_scheduling"]["step"]] == [
        "plus1", "scale2", "plus1"]
    # As Triton 2.51's config (measured): the transaction policy is always there, and no
    # field of a newer ModelConfig than 2.51's shows.
    assert cfg["model_transaction_policy"] == {"decoupled": False}
    assert "max_inflight_requests" not in cfg["ensemble_scheduling"]
    assert model.ready()
    assert not model.decoupled()


def test_ensemble_over_real_tritonclient_http(server: tritonpy.Server) -> None:
    import tritonclient.http as httpclient

    from tritonpy.frontends import Frontends

    fe = Frontends(server, http_port=0, grpc_port=0, metrics_port=0, allow_grpc=False,
                   allow_metrics=False, http_address="127.0.0.1", exit_timeout=5.0)
    fe.start_in_thread()
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{fe.http_port}")
        try:
            assert client.is_model_ready("chain3")
            assert client.get_model_metadata("chain3")["platform"] == "ensemble"
            assert client.get_model_config("chain3")["platform"] == "ensemble"
            inp = httpclient.InferInput("IN", [4], "FP32")
            inp.set_data_from_numpy(np.array([0, 1, 2, 3], np.float32), binary_data=True)
            result = client.infer("chain3", [inp], sequence_id=7, sequence_end=True)
            np.testing.assert_array_equal(result.as_numpy("OUT"), [3, 5, 7, 9])
            assert result.get_response()["parameters"] == {  # as Triton 2.51's (measured)
                "sequence_id": 7, "sequence_start": False, "sequence_end": True}
            stats = client.get_inference_statistics("chain3")["model_stats"][0]
            assert stats["name"] == "chain3"
            assert int(stats["inference_stats"]["success"]["count"]) >= 1
        finally:
            client.close()
    finally:
        fe.stop_in_thread()


def test_bls_calls_an_ensemble_and_a_circular_wait_through_one_is_an_error(
        server: tritonpy.Server) -> None:
    caller = server.model("bls_to_ensemble")
    ok = infer(caller, {"IN": np.array([1], np.float32)}, parameters={"route": "chain3"})
    assert ok.error is None, ok.error
    np.testing.assert_array_equal(ok.outputs["OUT"].to_numpy(), [5])
    # bls_to_ensemble (one instance) -> self_loop -> bls_to_ensemble: the step can never
    # run. The real Triton hangs here; tritonpy answers with the cycle.
    loop = infer(caller, {"IN": np.array([1], np.float32)}, parameters={"route": "self_loop,self_loop"})
    assert loop.error is not None
    assert "BLS call failed: in ensemble 'self_loop', BLS deadlock" in loop.error.message
    again = infer(caller, {"IN": np.array([2], np.float32)}, parameters={"route": "chain3"})
    np.testing.assert_array_equal(again.outputs["OUT"].to_numpy(), [7])


def test_a_bls_wait_on_a_slow_but_progressing_ensemble_is_not_a_deadlock(
        server: tritonpy.Server, tmp_path: Path) -> None:
    x = {"IN": np.array([4], np.float32)}
    # First bls_to_ensemble's only instance blocks on the ensemble "held", whose step holds
    # its instance until released; then bls_outer calls bls_to_ensemble, which must queue.
    first = server.model("bls_to_ensemble").infer(
        x, parameters={"route": "held", "hold_dir": str(tmp_path)})
    assert wait_for(lambda: (tmp_path / "holding").exists(), timeout=20)
    second = server.model("bls_outer").infer(
        x, parameters={"route": "bls_to_ensemble,held", "hold_dir": str(tmp_path)})
    # Give the deadlock detector its first check and a re-check while the step is held; the
    # wait it sees goes through the ensemble to a step that runs, so it is no cycle.
    time.sleep(0.6)
    (tmp_path / "release").touch()
    for stream in (first, second):
        resp = stream.get(timeout=30)
        assert resp.error is None, resp.error
        np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), [4])


# --------------------------------------------------------------------- configs and control


def test_bad_ensembles_are_rejected_clearly_and_the_rest_serves(tmp_path: Path,
                                                                shm_prefix: str) -> None:
    write_model(tmp_path, "plus1", PLUS1, FP32_IO)
    write_ensemble(tmp_path, "good", ensemble_config([step("plus1", {"IN": "IN"},
                                                           {"OUT": "OUT"})]))
    write_ensemble(tmp_path, "missing_step", ensemble_config([
        step("nosuch", {"IN": "IN"}, {"OUT": "OUT"})]))
    write_ensemble(tmp_path, "wrong_dtype", ensemble_config([
        step("plus1", {"IN": "IN"}, {"OUT": "OUT"})], dtype="TYPE_INT32"))
    write_ensemble(tmp_path, "bad_input", ensemble_config([
        step("plus1", {"NOPE": "IN"}, {"OUT": "OUT"})]))
    write_ensemble(tmp_path, "twice", ensemble_config([
        step("plus1", {"IN": "IN"}, {"OUT": "OUT"}),
        step("plus1", {"IN": "IN"}, {"OUT": "OUT"})]))
    write_ensemble(tmp_path, "loop_a", ensemble_config([step("loop_b", {"IN": "IN"},
                                                             {"OUT": "OUT"})]))
    write_ensemble(tmp_path, "loop_b", ensemble_config([step("loop_a", {"IN": "IN"},
                                                             {"OUT": "OUT"})]))
    with serving(tmp_path, shm_prefix) as srv:
        reasons = {m["name"]: m["reason"] for m in srv.models() if m["state"] != "READY"}
        assert "contains models that are not available or ambiguous: nosuch" in \
            reasons["missing_step"]
        assert "inconsistent data type: TYPE_INT32 is inferred from model wrong_dtype while " \
               "TYPE_FP32 is inferred from model plus1" in reasons["wrong_dtype"]
        assert "ensemble tensor IN is mapping to non-existing input NOPE in model plus1" in \
            reasons["bad_input"]
        assert "ensemble tensor 'OUT' can appear in an output map only once" in reasons["twice"]
        assert "circular dependency between ensembles" in reasons["loop_a"]
        assert set(reasons) == {"missing_step", "wrong_dtype", "bad_input", "twice", "loop_a",
                                "loop_b"}
        assert not srv.model("wrong_dtype").ready()
        with pytest.raises(TritonpyError, match="has no available versions"):
            srv.model("wrong_dtype").infer({"IN": np.array([1], np.int32)})
        resp = infer(srv.model("good"), {"IN": np.array([1], np.float32)})
        np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), [2])


def test_explicit_mode_loads_steps_and_an_unloaded_step_takes_the_ensemble_with_it(
        tmp_path: Path, shm_prefix: str) -> None:
    write_model(tmp_path, "plus1", PLUS1, FP32_IO)
    write_model(tmp_path, "scale2", SCALE2, FP32_IO)
    write_ensemble(tmp_path, "chain3", CHAIN3)
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as srv:
        assert all(m["state"] != "READY" for m in srv.models())
        srv.load("chain3")  # loads its steps as dependencies
        ready = {m["name"] for m in srv.models() if m["state"] == "READY"}
        assert ready == {"plus1", "scale2", "chain3"}
        model = srv.model("chain3")
        assert model.ready()
        np.testing.assert_array_equal(
            infer(model, {"IN": np.array([1], np.float32)}).outputs["OUT"].to_numpy(), [5])
        srv.unload("scale2")  # as Triton: the ensemble that runs it is unloaded too
        assert not model.ready()
        states = {m["name"]: (m["state"], m["reason"]) for m in srv.models()}
        assert states["chain3"] == states["scale2"] == ("UNAVAILABLE", "unloaded")
        assert srv.ready()  # unloaded on purpose, both
        with pytest.raises(NotFoundError, match="'chain3' has no available versions"):
            model.infer({"IN": np.array([1], np.float32)})
        srv.load("scale2")  # ... and comes back with it
        assert model.ready()
        np.testing.assert_array_equal(
            infer(model, {"IN": np.array([2], np.float32)}).outputs["OUT"].to_numpy(), [7])
        # Its steps go with it, but for one a load asked for by name (scale2, just above):
        # as Triton 2.51 (measured), which unloads only what the ensemble's load brought in.
        srv.unload("chain3", unload_dependents=True)
        assert {m["name"] for m in srv.models() if m["state"] == "READY"} == {"scale2"}
        np.testing.assert_array_equal(
            infer(srv.model("scale2"), {"IN": np.array([1], np.float32)}).outputs["OUT"]
            .to_numpy(), [2])
        srv.load("chain3")
        srv.unload("scale2")  # asked for by name no more: the ensemble goes with it
        srv.load("chain3")
        srv.unload("chain3", unload_dependents=True)
        assert all(m["state"] != "READY" for m in srv.models())


def test_cancelling_an_ensemble_request_answers_cancelled(server: tritonpy.Server,
                                                          tmp_path: Path) -> None:
    # The cancel races the diamond's few milliseconds of work: on a loaded machine the
    # ensemble may finish first (a full, correct answer), so it gets a few tries.
    for attempt in range(5):
        barrier = tmp_path / str(attempt)
        barrier.mkdir()
        stream = server.model("diamond").infer({"IN": np.array([1], np.float32)},
                                               parameters={"barrier_dir": str(barrier)})
        stream.cancel()
        resp = stream.get(timeout=30)
        assert resp.final
        if resp.error is None:
            np.testing.assert_array_equal(resp.outputs["SUM"].to_numpy(), [112])
            continue
        assert resp.error.code.value == "CANCELLED", resp.error
        break
    else:
        pytest.fail("five cancelled ensemble requests all completed")
    # The server still serves the ensemble afterwards.
    ok = infer(server.model("chain3"), {"IN": np.array([1], np.float32)})
    np.testing.assert_array_equal(ok.outputs["OUT"].to_numpy(), [5])


def test_ensemble_compute_times_are_the_sums_of_its_steps(tmp_path: Path) -> None:
    # As Triton's: an ensemble's compute_input/infer/output are its steps' summed, not the
    # request's wall time (which here includes 300 ms queued in a step's dynamic batcher),
    # and the ensemble itself queues nothing.
    batching = FP32_IO + "max_batch_size: 4\n"
    write_model(tmp_path, "a1", PLUS1, batching)
    write_model(tmp_path, "b2", SCALE2,
                batching + "dynamic_batching { max_queue_delay_microseconds: 300000 }\n")
    write_ensemble(tmp_path, "timed", ensemble_config([
        step("a1", {"IN": "IN"}, {"OUT": "t"}), step("b2", {"IN": "t"}, {"OUT": "OUT"})])
        .replace("max_batch_size: 0", "max_batch_size: 4"))
    with serving(tmp_path, new_prefix()) as server:
        resp = infer(server.model("timed"), {"IN": np.array([[1, 2]], np.float32)})
        assert resp.error is None, resp.error
        np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), [[4, 6]])
        ens = stat(server, "timed")["inference_stats"]
        steps = [stat(server, m)["inference_stats"] for m in ("a1", "b2")]
        for key in ("compute_input", "compute_infer", "compute_output"):
            assert ens[key]["count"] == 1
            assert ens[key]["ns"] == sum(s[key]["ns"] for s in steps) > 0
        assert ens["queue"]["ns"] == 0
        assert steps[1]["queue"]["ns"] >= 300_000_000  # waited in the step's batcher
        assert ens["success"]["ns"] >= 300_000_000  # the request's own time includes it
