"""What a stub writes to stdout and stderr reaches the server's log (real stubs), a line a
record, even a line that never ends; the stderr lines a death's reason quotes are cut short."""
from __future__ import annotations

import logging

import numpy as np
import pytest

import tritonpy
from _models import infer, io_config, serving, wait_for, write_model

pytestmark = pytest.mark.timeout(60)

MODEL_PY = '''
import json, os, sys
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        mode = json.loads(requests[0].parameters())["mode"]
        if mode == "progress":  # a progress bar redrawn 3,000 times, never ended with \\n
            for i in range(3000):
                sys.stderr.write("\\r%6d/3000 |%s| progress" % (i, "#" * 80))
            sys.stderr.flush()
        elif mode == "die":  # the progress line ended, one long line, then the end
            sys.stderr.write("\\n" + "Q" * 5000 + "\\n")
            sys.stderr.flush()
            os._exit(3)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
'''


def test_an_unended_line_is_logged_in_pieces_and_a_deaths_reason_is_short(
        tmp_path, shm_prefix, caplog) -> None:
    # (QA) The host held a line that never ended whole, however long (300 MiB of it: 736 MB
    # more RSS), and logged nothing of it until a newline; a death's reason quoted a 20 MiB
    # stderr line whole, to the client and to the log.
    write_model(tmp_path, "talky", MODEL_PY, io_config())
    caplog.set_level(logging.INFO, logger="tritonpy.model.talky")
    x = {"IN": np.array([1.0], np.float32)}
    with serving(tmp_path, shm_prefix, backend_config={"restart-backoff-seconds": "0.1"}) as srv:
        model = srv.model("talky")
        assert infer(model, x, parameters={"mode": "progress"}).error is None

        def pieces() -> list[str]:
            return [r.getMessage() for r in caplog.records if "progress" in r.getMessage()]

        # 3,000 redraws of 104 bytes: five pieces of 64 KiB come before any newline.
        assert wait_for(lambda: len(pieces()) >= 4, timeout=20), len(pieces())
        assert all(len(p) <= (1 << 16) + 20 for p in pieces())
        resp = infer(model, x, wait=30, parameters={"mode": "die"})
        assert isinstance(resp.error, tritonpy.UnavailableError), resp
        assert "exited with code 3" in resp.error.message
        assert "Q" * 1024 + "... (5000 characters)" in resp.error.message
        tail = resp.error.message.split("last stderr lines:\n", 1)[1].split("\n")
        assert tail and all(len(line) <= 1024 + 30 for line in tail), [len(t) for t in tail]
