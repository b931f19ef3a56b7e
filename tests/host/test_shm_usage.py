"""Per-pool shared-memory usage (SPEC §8): each stub reports its own pool, including what is in
use, so a model holding shared memory shows up in ``shm_usage()`` and on the metrics page."""
from __future__ import annotations

import pytest
from _models import fp32, infer, io_config, serving, write_model

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
