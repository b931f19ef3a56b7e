"""Triton's rate limiter (``--rate-limit execution_count``): instances whose groups list
``rate_limiter`` resources run an execute only while those are free, across models. Expected
behaviour marked "measured" is what Triton 2.51 did with the same models and flags (models
that sleep 0.3 s in execute, two or three at once).
"""
from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _models import run_driver, serving, write_model

from tritonpy import InvalidArgumentError

# Records when its execute ran (CLOCK_MONOTONIC, the same in every process).
SLEEPY_PY = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import json
        params = json.loads(args["model_config"])["parameters"]
        self.sleep = float(params.get("SLEEP", {}).get("string_value", "0.3"))

    def execute(self, requests):
        t0 = time.monotonic()
        time.sleep(self.sleep)
        out = np.array([t0, time.monotonic()], np.float64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]) for _ in requests]
"""


def _config(resources: str, priority: int = 1, sleep: float = 0.3, count: int = 1) -> str:
    return (
        'backend: "python"\n'
        'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "OUT", data_type: TYPE_FP64, dims: [ 2 ] } ]\n'
        f"instance_group [ {{ count: {count}, kind: KIND_CPU, rate_limiter {{ "
        f"resources [ {resources} ] priority: {priority} }} }} ]\n"
        f'parameters {{ key: "SLEEP" value {{ string_value: "{sleep}" }} }}\n')


def _repo(root: Path, models: dict[str, str]) -> Path:
    repo = root / "repo"
    for name, config in models.items():
        write_model(repo, name, SLEEPY_PY, config)
    return repo


def _run_together(srv: Any, calls: list[str]) -> list[tuple[str, float, float]]:
    """Send one request per name in ``calls`` at once; (model, start, end) of each execute,
    in the order they started."""
    streams = [(m, srv.model(m).infer({"IN": np.ones(1, np.float32)})) for m in calls]
    out = []
    for m, stream in streams:
        response = stream.get(timeout=60)
        assert response.error is None, response.error
        t0, t1 = response.outputs["OUT"].to_numpy()
        out.append((m, float(t0), float(t1)))
    return sorted(out, key=lambda r: r[1])


def _overlaps(runs: list[tuple[str, float, float]]) -> int:
    """How many executes started before the one before them ended."""
    return sum(1 for a, b in zip(runs, runs[1:]) if b[1] < a[2] - 0.01)


R1 = '{ name: "R" count: 1 }'
R2 = '{ name: "R" count: 2 }'


def test_instances_needing_a_resource_take_turns(tmp_path: Path, shm_prefix: str):
    repo = _repo(tmp_path, {"a": _config(R1), "b": _config(R1, priority=2)})
    with serving(repo, shm_prefix, rate_limit="execution_count") as srv:
        runs = _run_together(srv, ["a", "b", "a", "b"])
    assert _overlaps(runs) == 0, runs  # measured: one at a time, 0.3 s each
    assert sorted(m for m, _, _ in runs) == ["a", "a", "b", "b"]


def test_without_rate_limit_the_resources_are_ignored(tmp_path: Path, shm_prefix: str):
    repo = _repo(tmp_path, {"a": _config(R1), "b": _config(R1)})
    with serving(repo, shm_prefix) as srv:
        runs = _run_together(srv, ["a", "b"])
    assert _overlaps(runs) == 1, runs


def test_default_copies_are_the_largest_need(tmp_path: Path, shm_prefix: str):
    # a needs 1, c needs 2: R has 2 copies, too few for both (measured: one after the other);
    # given 3 with --rate-limit-resource (on device 0, a CPU instance's), both run at once.
    repo = _repo(tmp_path, {"a": _config(R1), "c": _config(R2)})
    with serving(repo, shm_prefix, rate_limit="execution_count") as srv:
        assert _overlaps(_run_together(srv, ["a", "c"])) == 0
    with serving(repo, shm_prefix, rate_limit="execution_count",
                 rate_limit_resources=["R:3:0"]) as srv:
        assert _overlaps(_run_together(srv, ["a", "c"])) == 1


def test_an_instance_needing_more_than_given_fails_to_load(tmp_path: Path, shm_prefix: str):
    repo = _repo(tmp_path, {"a": _config(R1), "c": _config(R2)})
    with serving(repo, shm_prefix, model_control_mode="explicit", load_models=["a"],
                 rate_limit="execution_count", rate_limit_resources=["R:1"]) as srv:
        with pytest.raises(InvalidArgumentError) as err:
            srv.load("c")
        # Triton 2.51's words (measured).
        assert err.value.message == (
            "load failed for model 'c': version 1 is at UNAVAILABLE state: Invalid argument: "
            'Resource count for "R" is limited to 1 which will prevent scheduling of one or '
            "more model instances, the minimum required count is 2")
        assert _overlaps(_run_together(srv, ["a", "a"])) == 0
    # Copies given for device 1 only: device 0 has none (measured: "limited to 0").
    with serving(repo, shm_prefix, model_control_mode="explicit",
                 rate_limit="execution_count", rate_limit_resources=["R:3:1"]) as srv:
        with pytest.raises(InvalidArgumentError, match='"R" is limited to 0 '):
            srv.load("a")


def test_a_resource_listed_twice_needs_the_last_count(tmp_path: Path, shm_prefix: str):
    # As Triton 2.51 (measured): the entry listed last counts (tritonpy added them up, and
    # refused both models below, "minimum required count is 2" and "3").
    twice = '{ name: "R" count: 2 }, { name: "R" count: 1 }'
    repo = _repo(tmp_path, {"last_1": _config(twice), "last_2": _config(
        '{ name: "R" count: 1 }, { name: "R" count: 2 }')})
    with serving(repo, shm_prefix, model_control_mode="explicit",
                 rate_limit="execution_count", rate_limit_resources=["R:1"]) as srv:
        srv.load("last_1")
        _ran(_one(srv, "last_1"))
        with pytest.raises(InvalidArgumentError, match="the minimum required count is 2$"):
            srv.load("last_2")


def test_global_resources_are_one_pool(tmp_path: Path, shm_prefix: str):
    # Two models marking R global, count 1: one pool, so they take turns. A device number
    # given for a global resource is ignored, as Triton's --help says (measured: tritonpy gave
    # the pool none, "limited to 0"); here it gives 2 copies, so they run side by side.
    glob = '{ name: "R" global: true count: 1 }'
    repo = _repo(tmp_path, {"g": _config(glob), "h": _config(glob)})
    with serving(repo, shm_prefix, rate_limit="execution_count") as srv:
        assert _overlaps(_run_together(srv, ["g", "h"])) == 0
    with serving(repo, shm_prefix, rate_limit="execution_count",
                 rate_limit_resources=["R:2:5"]) as srv:
        assert _overlaps(_run_together(srv, ["g", "h"])) == 1


def test_a_resource_may_not_be_global_in_one_model_and_per_device_in_another(
        tmp_path: Path, shm_prefix: str):
    # As Triton 2.51 (measured, QA L0_rate_limiter): the model that would make it both fails
    # to load, in Triton's words; the others serve.
    glob = '{ name: "R" global: true count: 1 }'
    repo = _repo(tmp_path, {"a": _config(R1), "g": _config(glob)})
    with serving(repo, shm_prefix, model_control_mode="explicit", load_models=["a"],
                 rate_limit="execution_count") as srv:
        with pytest.raises(InvalidArgumentError) as err:
            srv.load("g")
        assert err.value.message.endswith(
            'Resource "R" is present as both global and device-specific resource in the model '
            "configuration.")
        assert _overlaps(_run_together(srv, ["a", "a"])) == 0


def test_a_resource_the_command_line_does_not_name_has_no_copies(tmp_path: Path,
                                                                  shm_prefix: str):
    # As Triton 2.51 (measured, QA L0_rate_limiter): once any --rate-limit-resource is given,
    # one not named has none (names are case-sensitive); without any, the largest need.
    repo = _repo(tmp_path, {"a": _config(R1), "s": _config('{ name: "S" count: 2 }')})
    with serving(repo, shm_prefix, model_control_mode="explicit", load_models=["a"],
                 rate_limit="execution_count", rate_limit_resources=["R:4", "s:2"]) as srv:
        with pytest.raises(InvalidArgumentError) as err:
            srv.load("s")
        assert err.value.message.endswith(
            'Resource count for "S" is limited to 0 which will prevent scheduling of one or '
            "more model instances, the minimum required count is 2")


def test_priority_gives_more_turns(tmp_path: Path, shm_prefix: str):
    # 'hold' keeps R while eight requests of 'x' (priority 1) and of 'y' (priority 4) queue;
    # then they take turns by weight: x runs four times as often as y.
    repo = _repo(tmp_path, {"hold": _config(R1, sleep=0.5), "x": _config(R1, sleep=0.02),
                            "y": _config(R1, priority=4, sleep=0.02)})
    with serving(repo, shm_prefix, rate_limit="execution_count") as srv:
        held = srv.model("hold").infer({"IN": np.ones(1, np.float32)})
        time.sleep(0.2)
        runs = _run_together(srv, ["x", "y"] * 8)
        assert held.get(timeout=30).error is None
    first = [m for m, _, _ in runs[:10]]
    assert _overlaps(runs) == 0, runs
    assert first.count("x") >= 7 and first.count("y") >= 1, first


def test_waiting_instances_go_in_tritons_order(tmp_path: Path, shm_prefix: str):
    # Triton orders them by executes since load times priority, its count starting at 2 (each
    # instance's initialize and warm-up pass through its rate limiter): x (priority 1) starts
    # at 2, y (priority 2) at 4, so x runs twice first, then they take turns 2:1 (a tie to the
    # one waiting longer). After six each, x is at 8 and y at 16: x runs its six first. As
    # Triton 2.51, measured with these models; tritonpy's stride passes ran xyxyxxyxxyyy and
    # then xxyxxyxxyyyy, and gave upstream's L0_rate_limiter priority case 80:45 where Triton
    # 2.51 gives 80:44 (1.82, it wants above 1.8), as tritonpy now does.
    repo = _repo(tmp_path, {"hold": _config(R1, sleep=0.5), "x": _config(R1, sleep=0.02),
                            "y": _config(R1, priority=2, sleep=0.02)})
    orders = []
    with serving(repo, shm_prefix, rate_limit="execution_count") as srv:
        for calls in (["x", "y"] * 6, ["y", "x"] * 6):
            held = srv.model("hold").infer({"IN": np.ones(1, np.float32)})  # takes R at once
            runs = _run_together(srv, calls)
            assert held.get(timeout=30).error is None
            assert _overlaps(runs) == 0, runs
            orders.append("".join(m for m, _, _ in runs))
    assert orders == ["xxyxxyxxyyyy", "xxxxxxyyyyyy"]


def test_an_instance_needing_more_copies_is_not_starved(tmp_path: Path, shm_prefix: str):
    # big needs both copies of R, small's two instances one each, and small always has more
    # queued. Nobody jumps the queue (as in Triton): once big waits, a copy that comes back
    # waits for the other; tritonpy gave it to small again, and big ran only once small's
    # queue was empty.
    repo = _repo(tmp_path, {"big": _config(R2, sleep=0.05),
                            "small": _config(R1, sleep=0.05, count=2)})
    with serving(repo, shm_prefix, rate_limit="execution_count") as srv:
        smalls = [srv.model("small").infer({"IN": np.ones(1, np.float32)}) for _ in range(30)]
        time.sleep(0.15)
        big = srv.model("big").infer({"IN": np.ones(1, np.float32)}).get(timeout=60)
        assert big.error is None, big.error
        big_start, big_end = big.outputs["OUT"].to_numpy()
        runs = []
        for stream in smalls:
            response = stream.get(timeout=60)
            assert response.error is None, response.error
            runs.append(response.outputs["OUT"].to_numpy())
    assert not any(t0 < big_end - 0.01 and t1 > big_start + 0.01 for t0, t1 in runs)
    after = sum(1 for t0, _ in runs if t0 >= big_end - 0.01)
    assert after >= 10, (after, sorted(t0 for t0, _ in runs), big_start)


RS = '{ name: "R" count: 1 }, { name: "S" count: 1 }'
S1 = '{ name: "S" count: 1 }'


def _one(srv: Any, model: str, **kwargs: Any) -> Any:
    return srv.model(model).infer({"IN": np.ones(1, np.float32)}, **kwargs)


def _ran(stream: Any) -> tuple[float, float]:
    response = stream.get(timeout=60)
    assert response.error is None, response.error
    t0, t1 = response.outputs["OUT"].to_numpy()
    return float(t0), float(t1)


def test_a_request_that_ended_while_waiting_holds_nobody_back(tmp_path: Path, shm_prefix: str):
    # w (R and S) waits for S, which hold has; its request is cancelled, or times out, while it
    # waits: w waits no more, and x (R) runs at once instead of after hold (the claim w had on
    # R was kept while nothing was left for w to run).
    repo = _repo(tmp_path, {"hold": _config(S1, sleep=1.5), "w": _config(RS, sleep=0.02),
                            "x": _config(R1, sleep=0.02)})
    with serving(repo, shm_prefix, rate_limit="execution_count") as srv:
        for end in ("cancel", "timeout"):
            held = _one(srv, "hold")
            time.sleep(0.2)
            if end == "cancel":
                _one(srv, "w").cancel()
            else:
                assert _one(srv, "w", timeout=200_000).get(timeout=30).error is not None
            time.sleep(0.1)
            x_start, _ = _ran(_one(srv, "x"))
            _, hold_end = _ran(held)
            assert x_start < hold_end - 0.5, (end, x_start, hold_end)


def test_another_instance_of_the_model_serves_what_one_waits_for(tmp_path: Path,
                                                                  shm_prefix: str):
    # m's first instance needs R and S, its second R only. While hold has S, m's request runs
    # on the second at once (tritonpy kept R claimed for the first, and both waited for hold).
    sibling = _config(RS, sleep=0.02).replace(
        "] priority: 1 } } ]", "] priority: 1 } }, { count: 1, kind: KIND_CPU, rate_limiter { "
        f"resources [ {R1} ] priority: 1 }} }} ]")
    assert sibling.count("rate_limiter") == 2
    repo = _repo(tmp_path, {"hold": _config(S1, sleep=1.5), "m": sibling,
                            "x": _config(R1, sleep=0.02)})
    with serving(repo, shm_prefix, rate_limit="execution_count") as srv:
        held = _one(srv, "hold")
        time.sleep(0.2)
        m_start, _ = _ran(_one(srv, "m"))
        x_start, _ = _ran(_one(srv, "x"))  # and nothing is claimed for m's first instance
        _, hold_end = _ran(held)
        assert m_start < hold_end - 0.5 and x_start < hold_end - 0.5, (m_start, x_start,
                                                                        hold_end)


def test_copies_beyond_what_a_waiting_instance_claims_are_used(tmp_path: Path,
                                                               shm_prefix: str):
    # R has 2 copies. w (R and S) waits for S and claims one R; x takes the other at once (it
    # waited behind w), and w still runs once S is back.
    repo = _repo(tmp_path, {"hold": _config(S1, sleep=1.5), "w": _config(RS, sleep=0.02),
                            "x": _config(R1, sleep=0.02)})
    with serving(repo, shm_prefix, rate_limit="execution_count",
                 rate_limit_resources=["R:2", "S:1"]) as srv:
        held = _one(srv, "hold")
        time.sleep(0.2)
        waiting = _one(srv, "w")
        time.sleep(0.2)
        x_start, _ = _ran(_one(srv, "x"))
        _, hold_end = _ran(held)
        w_start, _ = _ran(waiting)
        assert x_start < hold_end - 0.5 <= w_start, (x_start, hold_end, w_start)


def test_equal_priorities_alternate(tmp_path: Path, shm_prefix: str):
    repo = _repo(tmp_path, {"hold": _config(R1, sleep=0.5), "x": _config(R1, sleep=0.02),
                            "y": _config(R1, sleep=0.02)})
    with serving(repo, shm_prefix, rate_limit="execution_count") as srv:
        held = srv.model("hold").infer({"IN": np.ones(1, np.float32)})
        time.sleep(0.2)
        runs = _run_together(srv, ["x", "y"] * 5)
        assert held.get(timeout=30).error is None
    order = [m for m, _, _ in runs]
    assert order.count("x") == 5 and all(a != b for a, b in zip(order, order[1:])), order


# A model holding R that calls, by BLS, a model that needs R too: Triton waits for ever.
CALLER_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            inner = pb_utils.InferenceRequest(
                model_name="a", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "IN")]).exec()
            if inner.has_error():
                out.append(pb_utils.InferenceResponse(error=inner.error()))
            else:
                out.append(pb_utils.InferenceResponse(
                    [pb_utils.get_output_tensor_by_name(inner, "OUT")]))
        return out
"""


def test_bls_call_waiting_for_the_callers_resource_is_a_deadlock_error(
        tmp_path: Path, shm_prefix: str):
    repo = _repo(tmp_path, {"a": _config(R1)})
    write_model(repo, "caller", CALLER_PY, _config(R1))
    with serving(repo, shm_prefix, rate_limit="execution_count") as srv:
        response = srv.model("caller").infer({"IN": np.ones(1, np.float32)}).get(timeout=30)
        assert response.error is not None
        assert "BLS deadlock: request to model 'a' can never run" in str(response.error)
        assert "(a -> a_0_0 (waiting for rate limiter resources) -> caller_0_0)" in str(
            response.error)
        # Nothing is left holding R: 'a' runs, and so does 'caller' again (failing the same).
        assert _overlaps(_run_together(srv, ["a", "a"])) == 0


def test_a_dead_holder_gives_its_resources_back(tmp_path: Path, shm_prefix: str):
    killer = SLEEPY_PY.replace("time.sleep(self.sleep)", "import os; os._exit(3)")
    repo = _repo(tmp_path, {"a": _config(R1)})
    write_model(repo, "dies", killer, _config(R1))
    with serving(repo, shm_prefix, rate_limit="execution_count") as srv:
        dying = srv.model("dies").infer({"IN": np.ones(1, np.float32)})
        waiting = srv.model("a").infer({"IN": np.ones(1, np.float32)})
        assert dying.get(timeout=30).error is not None
        assert waiting.get(timeout=30).error is None


def test_many_models_at_once_never_exceed_and_always_finish(tmp_path: Path, shm_prefix: str):
    # 600 requests to four models with two or three instances each, sharing per-device and
    # global resources, a third of them with timeouts that pass while they queue: every one
    # is answered, and no resource is ever used beyond its copies. (Timed-out requests left
    # in a queue once made an admitted instance find nothing and keep the others out, and
    # the model's queue stalled with both instances idle.)
    models = {
        "m1": (_config(R1, sleep=0.005, count=2), {"R": 1}),
        "m2": (_config('{ name: "R" count: 2 }, { name: "G" global: true count: 1 }',
                       priority=3, sleep=0.003, count=2), {"R": 2, "G": 1}),
        "m3": (_config('{ name: "G" global: true count: 1 }', priority=2, sleep=0.004,
                       count=2), {"G": 1}),
        "m4": (_config('{ name: "Q" count: 1 }', sleep=0.002, count=3), {"Q": 1}),
    }
    repo = _repo(tmp_path, {m: cfg for m, (cfg, _) in models.items()})
    rng = random.Random(1)
    with serving(repo, shm_prefix, rate_limit="execution_count") as srv:
        names = [rng.choice(sorted(models)) for _ in range(600)]
        calls = [(m, srv.model(m).infer({"IN": np.ones(1, np.float32)},
                                        timeout=rng.choice([0, 0, 20_000, 100_000])))
                 for m in names]
        ran = []
        for m, stream in calls:
            response = stream.get(timeout=30)
            if response.error is None:
                t0, t1 = response.outputs["OUT"].to_numpy()
                ran.append((m, float(t0), float(t1)))
            else:
                assert "timeout" in str(response.error).lower(), response.error
    assert len(ran) > 100
    use = {"R": 0, "G": 0, "Q": 0}
    for _, delta, m in sorted([(t0, 1, m) for m, t0, _ in ran] + [(t1, -1, m) for m, _, t1 in ran],
                              key=lambda e: (e[0], e[1])):
        for k, n in models[m][1].items():
            use[k] += delta * n
            assert use[k] <= {"R": 2, "G": 1, "Q": 1}[k], (k, use)


def test_serve_takes_the_rate_limit_flags(tmp_path: Path, shm_prefix: str):
    # The flags reach the server: R given 1 copy, a model needing 2 fails to load, and so the
    # start (Triton's --exit-on-error), in Triton's words.
    repo = _repo(tmp_path, {"c": _config(R2)})
    out, err = run_driver(
        "import subprocess, sys\n"
        "p = subprocess.run([sys.executable, '-m', 'tritonpy', 'serve', '--model-repository', "
        f"{str(repo)!r}, '--http-port=0', '--grpc-port=0', '--metrics-port=0', "
        f"'--backend-config=python,shm-region-prefix-name={shm_prefix}', "
        "'--rate-limit=execution_count', '--rate-limit-resource=R:1'], capture_output=True, "
        "text=True, timeout=60)\n"
        "print('RESULT', p.returncode, repr(p.stderr))\n", timeout=90)
    assert out.startswith("1 "), (out, err)
    assert ('Resource count for "R" is limited to 1 which will prevent scheduling of one or '
            "more model instances, the minimum required count is 2") in out, out
    assert "failed to load all models" in out


def test_rate_limit_resource_flag_is_checked(tmp_path: Path):
    out, err = run_driver(
        "import subprocess, sys\n"
        "p = subprocess.run([sys.executable, '-m', 'tritonpy', 'serve', '--model-repository', "
        f"{str(tmp_path)!r}, '--rate-limit-resource=R'], capture_output=True, text=True)\n"
        "print('RESULT', p.returncode, p.stderr.strip().splitlines()[-1])\n")
    assert out.startswith("1 "), (out, err)  # a usage error, as Triton's
    assert "--rate-limit-resource 'R': expected <name>:<count> or <name>:<count>:<device>" in out


def test_the_resource_map_is_logged_as_tritons(tmp_path: Path, shm_prefix: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    # Triton 2.51's verbose words for the most of each resource the instances may take, as
    # instances come and go (QA L0_model_update's test_instance_resource_decrease looks for
    # "Resource: R1\t Count: 3" after a decrease); tritonpy logged nothing of the kind.
    import logging

    repo = _repo(tmp_path, {"m": _config('{ name: "R1" count: 5 }')})
    caplog.set_level(logging.DEBUG, logger="tritonpy")
    with serving(repo, shm_prefix, model_control_mode="explicit", load_models=["m"],
                 rate_limit="execution_count") as srv:
        (repo / "m" / "config.pbtxt").write_text(_config('{ name: "R1" count: 3 }'))
        srv.load("m")
    maps = [r.getMessage() for r in caplog.records if "Max Resource Map" in r.getMessage()]
    assert maps[0] == "\nMax Resource Map===>\n\tDevice: 0\n\t\tResource: R1\t Count: 5\n"
    assert maps[-1] == "\nMax Resource Map===>\n\tDevice: 0\n\t\tResource: R1\t Count: 3\n"
