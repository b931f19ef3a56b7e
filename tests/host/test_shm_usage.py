"""Per-pool shared-memory usage (SPEC §8): each stub reports its own pool, including what is in
use, so a model holding shared memory shows up in ``shm_usage()`` and on the metrics page."""
from __future__ import annotations

import gc
import os
import signal
import time

import numpy as np
import pytest
from _models import (fp32, infer, io_config, segments, serving, stub_processes, wait_until,
                     write_model)

from tritonpy.metrics import metrics_text

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20

# Keeps 3 MiB of its own pool alive (an output buffer it reuses), and echoes IN as OUT.
HOLDER_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.kept = pb_utils.empty_shm_tensor("KEPT", [3 << 20], np.uint8)
        self.kept.as_numpy()[:] = 1

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""


def test_a_stub_reports_what_its_pool_has_in_use(tmp_path, shm_prefix: str) -> None:
    write_model(tmp_path, "holder", HOLDER_PY, io_config())
    write_model(tmp_path, "plain")
    with serving(tmp_path, shm_prefix) as srv:
        assert infer(srv.model("holder"), {"IN": fp32(1, 2)}).outputs["OUT"].to_numpy().tolist() \
            == [1, 2]
        pools = {p["pool"]: p for p in srv.shm_usage()}
        holder = pools["holder_0"]
        assert holder["used_bytes"] >= 3 * MiB and holder["peak_bytes"] >= holder["used_bytes"]
        assert holder["mapped_bytes"] >= holder["used_bytes"] and holder["segments"] >= 1
        assert pools["plain_0"]["used_bytes"] == 0  # small tensors travel inline
        assert "host" in pools and pools["host"]["used_bytes"] >= 0
        page = metrics_text(srv)
        used = [line for line in page.splitlines()
                if line.startswith('tritonpy_shm_pool_used_bytes{pool="holder_0"}')]
        assert len(used) == 1 and float(used[0].split()[-1]) >= 3 * MiB


# Answers IN's first element in MiB of ones (a new array in its own pool), or 16 bytes for 0.
SIZED_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            mib = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", np.ones(mib << 20 or 16, np.uint8))]))
        return out
"""


def test_a_busy_stub_still_gives_its_idle_segments_back(tmp_path, shm_prefix: str) -> None:
    """A stub that gets requests all the time still unlinks a segment it no longer uses once
    its idle time (5 s) has passed. Each request's 64 KiB input reaches it by handle, so the
    stub owes the host a release every few milliseconds: its maintenance used to run only after
    a whole second with nothing owed, which steady traffic never left it."""
    write_model(tmp_path, "sized", SIZED_PY,
                io_config(in_type="TYPE_UINT8", out_type="TYPE_UINT8"))
    small_pool = {"shm-default-byte-size": str(MiB), "shm-growth-byte-size": str(MiB)}
    with serving(tmp_path, shm_prefix, backend_config=small_pool) as srv:
        model = srv.model("sized")

        def stub_pool() -> dict:
            # The stub's own report (a stub that takes over 0.5 s to answer, on a loaded
            # machine, is described without used_bytes: asked again).
            return wait_until(lambda: next((p for p in srv.shm_usage() if p["pool"] == "sized_0"
                                            and "used_bytes" in p), None), 10, "a report")

        # A 4 MiB output gets a segment of its own (bigger than the growth size).
        big = infer(model, {"IN": np.array([4], np.uint8)}).outputs["OUT"].to_numpy()
        assert big.nbytes == 4 * MiB
        del big
        assert wait_until(lambda: stub_pool()["used_bytes"] == 0, 10, "the 4 MiB output back")
        assert stub_pool()["mapped_bytes"] >= 4 * MiB
        steady = np.zeros(64 << 10, np.uint8)  # over the inline limit: sent by handle
        deadline = time.monotonic() + 15
        calls = 0
        while stub_pool()["mapped_bytes"] >= 4 * MiB and time.monotonic() < deadline:
            for _ in range(50):
                assert infer(model, {"IN": steady}).outputs["OUT"].to_numpy().nbytes == 16
                calls += 1
        assert stub_pool()["mapped_bytes"] < 4 * MiB, f"still {stub_pool()} after {calls} calls"


def _mapped_from(pid: int, prefix: str) -> list[str]:
    """What this process maps, or holds open, of the segments stub ``pid`` made."""
    tag = f"{prefix}{pid}x"
    with open("/proc/self/maps") as f:
        lines = [line.strip() for line in f if tag in line]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if tag in target:
            lines.append(target)
    return lines


def test_a_stub_that_ends_leaves_no_mapping_in_the_host(tmp_path, shm_prefix: str) -> None:
    """The host maps a stub's segments to read its outputs. Once the stub ends (killed,
    unloaded) they are unlinked, and the host lets go of them too: it used to keep each one
    mapped, and its memory used, until the server stopped (4 MiB here; 256 MiB for a stub that
    had sent a 256 MiB output). One the host still views stays, named (a handle may name it),
    until the view goes."""
    write_model(tmp_path, "sized", SIZED_PY,
                io_config(in_type="TYPE_UINT8", out_type="TYPE_UINT8"))
    with serving(tmp_path, shm_prefix, model_control_mode="explicit") as srv:
        srv.load("sized")
        model = srv.model("sized")

        def four_mib() -> np.ndarray:
            out = infer(model, {"IN": np.array([4], np.uint8)}).outputs["OUT"].to_numpy()
            assert out.nbytes == 4 * MiB and out[-1] == 1
            return out

        # Killed, while the host still holds a view of its output (a client not done with it):
        # the view stays readable, and the mapping goes when the view does.
        out = four_mib()
        (stub,) = stub_processes()
        assert _mapped_from(stub.pid, shm_prefix)  # (what the checks below look for)
        os.kill(stub.pid, signal.SIGKILL)
        wait_until(lambda: stub.pid not in {p.pid for p in stub_processes()}
                   and len(stub_processes()) == 1, 30, "the stub restarted")
        four_mib()  # served by the new stub
        assert out.sum() == 4 * MiB
        assert [n for n in segments(shm_prefix) if n.startswith(f"{shm_prefix}{stub.pid}x")]
        del out
        gc.collect()
        wait_until(lambda: _mapped_from(stub.pid, shm_prefix) == []
                   and not [n for n in segments(shm_prefix)
                            if n.startswith(f"{shm_prefix}{stub.pid}x")],
                   10, "the segment to go once not viewed")

        # Unloaded.
        four_mib()
        (stub,) = stub_processes()
        assert _mapped_from(stub.pid, shm_prefix)
        srv.unload("sized")
        assert _mapped_from(stub.pid, shm_prefix) == []


ECHO_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""

SIZED_THEN_ECHO = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_UINT8, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_UINT8, dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "sized" model_version: -1
    input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "big" } },
  { model_name: "echo" model_version: -1
    input_map { key: "IN" value: "big" } output_map { key: "OUT" value: "OUT" } } ] }
"""


def test_other_stubs_let_go_of_an_ended_stubs_segments(tmp_path, shm_prefix: str) -> None:
    """A step's output reaches the next step's stub by handle: that stub maps the first one's
    segment. When the first stub ends, the others are told (DROPPED) and unmap it too."""
    uint8 = io_config(in_type="TYPE_UINT8", out_type="TYPE_UINT8")
    write_model(tmp_path, "sized", SIZED_PY, uint8)
    write_model(tmp_path, "echo", ECHO_PY, uint8)
    write_model(tmp_path, "pipe", "", SIZED_THEN_ECHO)
    (tmp_path / "pipe" / "1" / "model.py").unlink()
    with serving(tmp_path, shm_prefix) as srv:
        out = infer(srv.model("pipe"), {"IN": np.array([4], np.uint8)}).outputs["OUT"]
        assert out.to_numpy().nbytes == 4 * MiB
        del out
        stubs = {p.pid: p for p in stub_processes()}
        by_model = {m: [pid for pid, p in stubs.items() if f"{m}_0" in " ".join(p.cmdline())]
                    for m in ("sized", "echo")}
        (sized,), (echo,) = by_model["sized"], by_model["echo"]

        def echo_maps_sized() -> bool:
            with open(f"/proc/{echo}/maps") as f:
                return f"{shm_prefix}{sized}x" in f.read()

        assert echo_maps_sized()
        os.kill(sized, signal.SIGKILL)
        wait_until(lambda: not echo_maps_sized(), 20, "the echo stub unmapped its segment")
        assert infer(srv.model("pipe"), {"IN": np.array([1], np.uint8)}).outputs[
            "OUT"].to_numpy().nbytes == MiB
