"""A BLS caller reading a decoupled stream whose producer is killed gets every response the
producer sent before it died, whole, then the error naming its death (QA round 10; Triton 2.51
gives all of them too).

Responses of 256 KiB travel by handle: a name of the producer's segment and an offset. The host
used to unlink a dead stub's segments at once, and tell the other stubs to unmap them: the
caller, reading what was sent before the kill, found the segment gone (``ProtocolError:
shared-memory segment ... does not exist``) and lost the rest. A dead stub's segment that the
host still views stays, named, until nothing reads it any more; then it goes.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from _bls_models import REPORT_CALLER_CONFIG
from _models import new_prefix, serving, stub_processes, wait_until, write_model

pytestmark = pytest.mark.timeout(90)

COUNT = 10

PRODUCER_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] } ]
"""
# COUNT responses of 256 KiB (every byte: the response's number), then it waits to be killed.
PRODUCER_PY = """
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            d = json.loads(request.parameters())["dir"]
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            for i in range(n):
                sender.send(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.full(256 << 10, i, np.uint8))]))
            open(os.path.join(d, "sent"), "w").close()
            time.sleep(60)
        return None
"""
# Reads two responses, says so, waits until the producer is killed, then reads the rest.
CALLER_PY = """
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            d = json.loads(request.parameters())["dir"]
            stream = pb_utils.InferenceRequest(
                model_name="producer", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "COUNT")],
                parameters={"dir": d}).exec(decoupled=True)
            whole, error = 0, None
            for i, response in enumerate(stream):
                if i == 2:
                    open(os.path.join(d, "read2"), "w").close()
                    deadline = time.monotonic() + 30
                    while not os.path.exists(os.path.join(d, "killed")):
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.01)
                if response.has_error():
                    error = response.error().message()
                    break
                t = pb_utils.get_output_tensor_by_name(response, "OUT")
                if t is not None:
                    a = t.as_numpy()
                    whole += int(a.size == 256 << 10 and (a == whole).all())
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("REPORT", np.array(
                [json.dumps({"whole": whole, "error": error})], dtype=object))]))
        return out
"""


def test_a_killed_producers_sent_responses_all_reach_the_caller(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "producer", PRODUCER_PY, PRODUCER_CONFIG)
    write_model(repo, "caller", CALLER_PY, REPORT_CALLER_CONFIG)
    prefix = new_prefix()
    with serving(repo, prefix) as srv:
        stream = srv.model("caller").infer({"COUNT": np.array([COUNT], np.int32)},
                                           parameters={"dir": str(tmp_path)})
        wait_until(lambda: (tmp_path / "sent").exists() and (tmp_path / "read2").exists(), 30,
                   "the producer to send all and the caller to read two")
        (producer,) = [p for p in stub_processes() if "producer" in " ".join(p.cmdline())]
        os.kill(producer.pid, signal.SIGKILL)  # (not waited for here: the server reaps it)
        (tmp_path / "killed").touch()
        response = stream.get(timeout=60)
        assert response.error is None, response.error
        report = json.loads(response.outputs["REPORT"].to_numpy()[0])
        assert report["whole"] == COUNT, report
        assert report["error"] and "killed by signal SIGKILL" in report["error"], report

        # Read and let go: the dead producer's segment goes, name and mapping.
        def left() -> list[str]:
            tag = f"{prefix}{producer.pid}x"
            with open("/proc/self/maps") as f:
                mapped = [line for line in f if tag in line]
            return mapped + [n for n in os.listdir("/dev/shm") if n.startswith(tag)]

        wait_until(lambda: not left(), 10, "the dead producer's segment to go")
