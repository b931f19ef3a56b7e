"""Per-pool shared-memory usage (SPEC §8): each stub reports its own pool, including what is in
use, so a model holding shared memory shows up in ``shm_usage()`` and on the metrics page."""
from __future__ import annotations

import time

import numpy as np
import pytest
from _models import fp32, infer, io_config, serving, wait_until, write_model

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
            return {p["pool"]: p for p in srv.shm_usage()}["sized_0"]

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
