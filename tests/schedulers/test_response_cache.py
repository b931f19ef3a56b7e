"""The response cache with real stubs: Triton's ``--cache-config local,size=N`` and a model's
``response_cache { enable: true }``. What is seen: whether the model ran (it answers how many
requests it has executed), the statistics and metrics Triton 2.51 gives for hits and misses
(measured side by side), eviction, and what is never cached."""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest
from _models import COUNTING_PY, infer, io_config, serving, wait_until, write_model

from tritonpy._cache import packed_size
from tritonpy.metrics import metrics_text

pytestmark = pytest.mark.timeout(60)

CONFIG = (io_config() + 'output [ { name: "N", data_type: TYPE_INT64, dims: [ 1 ] } ]\n'
          "instance_group [ { count: 1, kind: KIND_CPU } ]\n")


def _n(model, x, **kwargs) -> int:
    resp = infer(model, {"IN": np.asarray(x, np.float32)}, **kwargs)
    assert resp.error is None, resp.error
    np.testing.assert_array_equal(resp.outputs["OUT"].to_numpy(), np.asarray(x) * 2)
    return int(resp.outputs["N"].to_numpy()[0])


@pytest.fixture
def repo(tmp_path):
    write_model(tmp_path, "cached", COUNTING_PY, CONFIG + "response_cache { enable: true }\n")
    write_model(tmp_path, "plain", COUNTING_PY, CONFIG)
    return tmp_path


def test_a_repeated_request_is_answered_from_the_cache(repo, shm_prefix):
    with serving(repo, shm_prefix, response_cache_size=1 << 20) as server:
        model = server.model("cached")
        assert _n(model, [1, 2, 3]) == 1
        # The same inputs: the first answer, without running the model; ids and parameters
        # are not part of the key (as Triton).
        assert _n(model, [1, 2, 3]) == 1
        assert _n(model, [1, 2, 3], request_id="other", parameters={"p": 1}) == 1
        assert _n(model, [1, 2, 4]) == 2  # other inputs run the model
        assert _n(server.model("plain"), [1, 2, 3]) == 1
        assert _n(server.model("plain"), [1, 2, 3]) == 2  # its config does not ask for it

        st = server.statistics("cached")["model_stats"][0]
        inf = st["inference_stats"]
        assert (inf["success"]["count"], inf["cache_hit"]["count"],
                inf["cache_miss"]["count"]) == (4, 2, 2)
        assert inf["cache_hit"]["ns"] > 0 and inf["cache_miss"]["ns"] > 0
        assert inf["queue"]["count"] == 4 and inf["compute_infer"]["count"] == 2
        assert (st["execution_count"], st["inference_count"]) == (2, 2)
        text = metrics_text(server)
        for family in ("nv_cache_num_hits_per_model", "nv_cache_num_misses_per_model"):
            assert f'{family}{{model="cached",version="1"}} 2\n' in text, text


def test_what_a_hit_answers_and_what_is_not_kept(repo, shm_prefix):
    with serving(repo, shm_prefix, response_cache_size=1 << 20) as server:
        model = server.model("cached")
        # An entry made for OUT alone cannot answer a request for every output: a miss.
        only = infer(model, {"IN": np.float32([5, 6])}, requested_output_names=["OUT"])
        assert list(only.outputs) == ["OUT"]
        assert _n(model, [5, 6]) == 2
        hit = infer(model, {"IN": np.float32([5, 6])}, requested_output_names=["OUT"])
        assert list(hit.outputs) == ["OUT"]  # a hit answers what its request asks for
        # A caller that writes to an answer writes to its own copy.
        hit.outputs["OUT"].to_numpy()[:] = -1
        assert _n(model, [5, 6]) == 2
        # A failed execute is not kept: the same request runs again.
        for _ in range(2):
            failed = infer(model, {"IN": np.float32([-1])})
            assert failed.error is not None and "negative input" in failed.error.message
        assert server.statistics("cached")["model_stats"][0]["execution_count"] == 4


def test_the_least_recently_used_answers_go_first(repo, shm_prefix):
    # Each answer packs into 109 bytes as Triton's cache entry packs it (12 bytes of OUT and
    # 8 of N, and their names, types and shapes): a 330-byte cache keeps three.
    with serving(repo, shm_prefix, response_cache_size=330) as server:
        model = server.model("cached")
        rows = [[float(i)] * 3 for i in range(4)]
        assert [_n(model, r) for r in rows[:3]] == [1, 2, 3]
        assert _n(model, rows[0]) == 1  # a hit: rows[0] is now the most recently used
        assert _n(model, rows[3]) == 4  # evicts rows[1], the least recently used
        assert _n(model, rows[0]) == 1 and _n(model, rows[2]) == 3
        assert _n(model, rows[1]) == 5  # it was evicted: the model runs again


def test_without_a_server_cache_the_model_runs_every_request(repo, shm_prefix):
    with serving(repo, shm_prefix) as server:
        model = server.model("cached")
        assert [_n(model, [1.0]) for _ in range(3)] == [1, 2, 3]
        inf = server.statistics("cached")["model_stats"][0]["inference_stats"]
        assert inf["cache_hit"]["count"] == inf["cache_miss"]["count"] == 0


# COUNTING_PY whose execute of IN == [1000] says it started (file STARTED) and waits for the
# file GATE.
GATED_PY = COUNTING_PY.replace("""            self.n += 1
""", """            self.n += 1
            if pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().tolist() == [1000]:
                import os, time
                open("STARTED", "w").close()
                while not os.path.exists("GATE"):
                    time.sleep(0.005)
""")

QUEUE_POLICY = """dynamic_batching { default_queue_policy { max_queue_size: 1 timeout_action: REJECT
  default_timeout_microseconds: 200000 } }
"""


def test_a_miss_counts_once_its_request_has_run_and_its_answer_is_new(tmp_path, shm_prefix):
    # (QA) As Triton 2.51 counts them (measured): a request rejected or timed out in the queue
    # is no miss, nor is one whose answer an identical request kept first. tritonpy counted
    # every lookup that missed: 4 misses where Triton counts 2, in both cases below.
    gated = GATED_PY.replace('"STARTED"', repr(str(tmp_path / "started"))).replace(
        '"GATE"', repr(str(tmp_path / "gate")))
    assert gated != COUNTING_PY
    write_model(tmp_path, "queued", gated, CONFIG + "response_cache { enable: true }\n"
                + QUEUE_POLICY)
    write_model(tmp_path, "twins", gated, CONFIG + "response_cache { enable: true }\n")
    with serving(tmp_path, shm_prefix, response_cache_size=1 << 20) as server:
        model = server.model("queued")
        assert _n(model, [1]) == 1
        held = model.infer({"IN": np.float32([1000])})
        wait_until((tmp_path / "started").exists, 30, "the held execute")
        late = model.infer({"IN": np.float32([2])})  # queued, then times out
        full = infer(model, {"IN": np.float32([3])})  # the queue is full
        assert full.error is not None and "Exceeds maximum queue size" in full.error.message
        late_resp = late.get(timeout=30)
        assert late_resp.error is not None and "timeout" in late_resp.error.message.lower()
        (tmp_path / "gate").touch()
        assert held.get(timeout=30).error is None
        assert _n(model, [1]) == 1  # a hit
        inf = server.statistics("queued")["model_stats"][0]["inference_stats"]
        assert (inf["cache_hit"]["count"], inf["cache_miss"]["count"]) == (1, 2)

        (tmp_path / "gate").unlink()
        (tmp_path / "started").unlink()
        twins = server.model("twins")
        held = twins.infer({"IN": np.float32([1000])})
        wait_until((tmp_path / "started").exists, 30, "the held execute")
        # Both miss at their lookup and both run; the second one's answer is already kept.
        first, second = (twins.infer({"IN": np.float32([7])}) for _ in range(2))
        (tmp_path / "gate").touch()
        assert held.get(timeout=30).error is None
        assert {int(s.get(timeout=30).outputs["N"].to_numpy()[0]) for s in (first, second)} \
            == {2, 3}
        st = server.statistics("twins")["model_stats"][0]
        assert st["execution_count"] == 3
        assert st["inference_stats"]["cache_miss"]["count"] == 2
        text = metrics_text(server)
        assert 'nv_cache_num_misses_per_model{model="twins",version="1"} 2\n' in text


ENSEMBLE_CONFIG = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] },
         { name: "N", data_type: TYPE_INT64, dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "plain" model_version: -1
  input_map { key: "IN" value: "IN" }
  output_map [ { key: "OUT" value: "OUT" }, { key: "N" value: "N" } ] } ] }
response_cache { enable: true }
"""


def test_an_ensemble_that_enables_the_cache_is_cached_as_a_whole(repo, shm_prefix):
    # As Triton 2.51 (measured): a hit runs no step, and carries no sequence parameters.
    write_model(repo, "ens", "", ENSEMBLE_CONFIG)
    with serving(repo, shm_prefix, response_cache_size=1 << 20) as server:
        ens = server.model("ens")
        assert _n(ens, [1, 2]) == 1
        hit = infer(ens, {"IN": np.float32([1, 2])})
        assert int(hit.outputs["N"].to_numpy()[0]) == 1  # the step did not run again
        assert "sequence_id" not in hit.parameters
        assert _n(ens, [3]) == 2
        st = server.statistics("ens")["model_stats"][0]["inference_stats"]
        assert (st["cache_hit"]["count"], st["cache_miss"]["count"]) == (1, 2)
        assert server.statistics("plain")["model_stats"][0]["execution_count"] == 2


DECOUPLED_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_an_ensemble_over_a_decoupled_step_cannot_enable_the_cache(tmp_path, shm_prefix):
    # As Triton 2.51 (measured): its load fails. tritonpy used to load it and never cache it.
    write_model(tmp_path, "dec", DECOUPLED_PY,
                io_config(extra="model_transaction_policy { decoupled: true }\n"))
    write_model(tmp_path, "ensd", "", """
platform: "ensemble"
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
ensemble_scheduling { step [ { model_name: "dec" model_version: -1
  input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "OUT" } } ] }
response_cache { enable: true }
""")
    with serving(tmp_path, shm_prefix, response_cache_size=1 << 20) as server:
        state = {m["name"]: m for m in server.models()}
        assert state["dec"]["state"] == "READY"
        assert state["ensd"]["state"] == "UNAVAILABLE"
        assert ("Response Cache does not currently support model ensd with 'decoupled' "
                "transaction policy. Please disable the response cache.") in state["ensd"]["reason"]


def test_an_answer_larger_than_the_cache_is_not_kept_and_says_so(repo, shm_prefix, caplog):
    with serving(repo, shm_prefix, response_cache_size=64) as server:
        model = server.model("cached")
        with caplog.at_level(logging.ERROR, logger="tritonpy._cache"):
            assert _n(model, np.zeros(32)) == 1
            assert _n(model, np.zeros(32)) == 2  # not kept: run again
        # Triton's words (Triton 2.51 sized an answer of two 16-float outputs 242 bytes, as
        # packed_size does); our key is a number too, and the model is named.
        assert re.search(r"Failed to insert key \[\d+\] into response cache: Requested "
                         r"byte_size: 225 is greater than total cache size: 64 \(model "
                         r"'cached'\)", caplog.text), caplog.text
        # Triton's server-wide durations are whole microseconds.
        text = metrics_text(server)
        line = next(x for x in text.splitlines() if x.startswith("nv_cache_lookup_duration "))
        assert line.split(" ")[1].isdigit(), line


def test_an_entry_is_sized_as_triton_packs_a_response() -> None:
    # Triton 2.51 reported 242 bytes for an answer of two [1, 16] FP32 outputs, OUTPUT0 and
    # OUTPUT1 (measured: "Requested byte_size: 242"): 4 + 2 x (8 + 4+7 + 4+4 + 4+16 + 8+64).
    two = [(f"OUTPUT{i}", np.zeros((1, 16), np.float32)) for i in range(2)]
    assert packed_size(two) == 242
    # BYTES data as it travels: each element after a 4-byte length.
    assert packed_size([("T", np.array([b"ab", "é"], dtype=np.object_))]) == \
        4 + 8 + 4 + 1 + 4 + 5 + 4 + 8 + 8 + (4 + 2) + (4 + 2)
