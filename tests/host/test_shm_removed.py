"""Segments removed from /dev/shm behind the server's back (``rm /dev/shm/*``, or systemd's
``RemoveIPC=yes`` at the logout of the server's user) are replaced within a second.

Processes open each other's segments by name. Before, a host segment removed before a stub had
opened it failed every request whose inputs were placed there (1-16 MiB ones, in the host's
first segment), until a restart, with a 400 and a traceback (found by QA; Triton 2.51 maps its
regions once and went on serving).
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

import tritonpy
from _models import io_config, serving, wait_until, write_model

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20

COPY_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().copy())])
            for r in requests]
"""


def test_the_server_replaces_its_removed_segments(tmp_path, shm_prefix: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tritonpy")
    write_model(tmp_path, "echo", COPY_PY, io_config(in_type="TYPE_UINT8",
                                                     out_type="TYPE_UINT8"))
    with serving(tmp_path, shm_prefix) as srv:
        model = srv.model("echo")

        def send(nbytes: int) -> tritonpy.InferenceResponse:
            return model.infer({"IN": np.full(nbytes, 7, np.uint8)}).get(timeout=30)

        big = send(20 * MiB)  # its own segment; the stub never opens the host's first one
        assert big.error is None and big.outputs["OUT"].to_numpy().sum() == 7 * 20 * MiB
        del big
        ours = [n for n in os.listdir("/dev/shm") if n.startswith(shm_prefix)
                and n in srv.pool.segment_names()]
        assert ours
        for name in ours:
            os.unlink(os.path.join("/dev/shm", name))
        errors = []
        t0 = time.monotonic()
        while True:
            resp = send(8 * MiB)
            if resp.error is None:
                break
            errors.append(resp.error)
            assert time.monotonic() - t0 < 5, errors[-1]
            time.sleep(0.1)
        assert resp.outputs["OUT"].to_numpy().sum() == 7 * 8 * MiB
        for err in errors:  # what came meanwhile: retryable, and saying why
            assert err.code.value == "UNAVAILABLE", err
            assert "was removed from its directory while in use" in err.message, err
        assert not set(ours) & set(srv.pool.segment_names())
        # Everything after works, and the log said what happened.
        for size in (1 * MiB, 8 * MiB, 15 * MiB):
            assert send(size).outputs["OUT"].to_numpy().sum() == 7 * size
        warned = " ".join(r.getMessage() for r in caplog.records
                          if "were removed from /dev/shm while in use" in r.getMessage())
        assert all(n in warned for n in ours), warned  # (in one warning, or over two ticks)


MAKER_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            n = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", np.full(n, 7, np.uint8))]))
        return out
"""


def test_a_stub_replaces_its_removed_segments(tmp_path, shm_prefix: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tritonpy")
    write_model(tmp_path, "maker", MAKER_PY, io_config(in_type="TYPE_INT64",
                                                       out_type="TYPE_UINT8"))
    with serving(tmp_path, shm_prefix) as srv:
        model = srv.model("maker")

        def make(nbytes: int) -> tritonpy.InferenceResponse:
            return model.infer({"IN": np.array([nbytes], np.int64)}).get(timeout=30)

        big = make(20 * MiB)  # the stub's own segment for it
        assert big.error is None and big.outputs["OUT"].to_numpy().sum() == 7 * 20 * MiB
        del big
        host = set(srv.pool.segment_names())
        theirs = [n for n in os.listdir("/dev/shm") if n.startswith(shm_prefix)
                  and n not in host]
        assert theirs
        for name in theirs:
            os.unlink(os.path.join("/dev/shm", name))
        t0 = time.monotonic()
        while True:
            resp = make(8 * MiB)
            if resp.error is None:
                break
            assert time.monotonic() - t0 < 5, resp.error
            time.sleep(0.1)
        assert resp.outputs["OUT"].to_numpy().sum() == 7 * 8 * MiB
        for size in (1 * MiB, 8 * MiB, 15 * MiB):
            assert make(size).outputs["OUT"].to_numpy().sum() == 7 * size
        # (its next maintenance, within a second, finds them: the host had mapped them before)
        def warned() -> str:
            return " ".join(r.getMessage() for r in caplog.records if
                            "of this stub's pool were removed from /dev/shm while in use"
                            in r.getMessage())

        assert wait_until(lambda: all(n in warned() for n in theirs), 5, "the stub's warning")
        assert not set(theirs) & {n for n in os.listdir("/dev/shm")}


# Calls ident with its input; OUT is the answer, or (an error response) empty, with its error
# passed on as this model's own.
BLS_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            resp = pb_utils.InferenceRequest(model_name="ident", inputs=[
                pb_utils.Tensor("IN", x.copy())], requested_output_names=["OUT"]).exec()
            if resp.has_error():
                out.append(pb_utils.InferenceResponse([], error=resp.error()))
                continue
            y = pb_utils.get_output_tensor_by_name(resp, "OUT").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", y.copy())]))
        return out
"""


def test_segments_removed_again_and_again_under_load(tmp_path, shm_prefix: str) -> None:
    # (QA) Removing every segment of the server every 0.3-2.5 s under load: a few requests
    # got 500s ("AssertionError", "bad response"), a BLS call raised into its caller's
    # execute, and a BLS request was called malformed (400). What may fail now is a request
    # that meets a removed segment before its owner noticed: UNAVAILABLE, saying so.
    import threading

    uint8 = io_config(in_type="TYPE_UINT8", out_type="TYPE_UINT8")
    write_model(tmp_path, "ident", COPY_PY, uint8)
    write_model(tmp_path, "bls", BLS_PY, uint8)
    with serving(tmp_path, shm_prefix) as srv:
        stop = threading.Event()
        answers: list = []

        def client(model: str, nbytes: int) -> None:
            data = np.full(nbytes, 5, np.uint8)
            while not stop.is_set():
                resp = srv.model(model).infer({"IN": data}).get(timeout=30)
                ok = resp.error is None and int(resp.outputs["OUT"].to_numpy().sum()) == 5 * nbytes
                answers.append((model, ok, resp.error))

        threads = [threading.Thread(target=client, args=a)
                   for a in (("ident", 4 * MiB), ("bls", 2 * MiB), ("ident", 12 * MiB))]
        for t in threads:
            t.start()
        try:
            for _ in range(8):
                time.sleep(0.4)
                for name in os.listdir("/dev/shm"):
                    if name.startswith(shm_prefix):
                        try:
                            os.unlink(os.path.join("/dev/shm", name))
                        except FileNotFoundError:
                            pass
            time.sleep(1.5)  # every owner notices: then nothing fails
            n = len(answers)
            time.sleep(1.0)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        errors = [e for _, ok, e in answers if e is not None]
        assert all(ok or e is not None for _, ok, e in answers), "a wrong answer"
        for err in errors:
            assert err.code.value == "UNAVAILABLE" and "removed" in err.message, err
        assert all(ok for _, ok, _ in answers[n:]), [e for _, _, e in answers[n:]]
        assert len(answers) > n and {m for m, _, _ in answers[n:]} == {"ident", "bls"}
