"""What model code sees of its interpreter: the same as under Triton's embedded one."""
from __future__ import annotations

import pytest

from _models import fp32, infer, io_config, serving, write_model

pytestmark = pytest.mark.timeout(60)

# A model in the style of Triton's own QA models: it runs a unittest suite inside execute.
# unittest.main reads sys.argv, which must not hold the stub's socket and options.
UNITTEST_PY = '''
import sys
import unittest

import numpy as np
import triton_python_backend_utils as pb_utils


class Inner(unittest.TestCase):
    def test_argv(self):
        self.assertEqual(sys.argv, [""])


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            result = unittest.main("model", argv=None, exit=False, verbosity=0).result
            ok = result.wasSuccessful() and result.testsRun == 1
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([ok], dtype=bool))],
                parameters={"argv": repr(sys.argv)}))
        return out
'''


def test_model_sees_triton_argv_and_can_run_unittest_main(tmp_path, shm_prefix):
    repo = tmp_path / "repo"
    write_model(repo, "inner_tests", UNITTEST_PY, io_config(out_type="TYPE_BOOL"))
    with serving(repo, shm_prefix) as srv:
        r = infer(srv.model("inner_tests"), {"IN": fp32(1.0)})
        assert r.parameters["argv"] == "['']"
        assert r.outputs["OUT"].to_numpy().tolist() == [True]
