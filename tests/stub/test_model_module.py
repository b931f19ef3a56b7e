"""model.py is imported as Triton imports it: the module ``<version>.model`` of a package that
is the version directory, so its relative imports work (Triton's QA model ``multi_file`` does
``from . import file2``), while plain imports of the version directory's files, and then of the
model directory's (beside config.pbtxt: Triton puts both on sys.path, after the standard library
and site-packages), still work.
Also the pb_utils names such a model reaches for: ``get_model_dir()`` and ``Logger.INFO``
and its siblings (Triton's logging QA models call ``logger.log(msg, logger.INFO)``).
Checked in a real stub and under ``tritonpy.testing.ModelRunner``."""
from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
import pytest

from _models import infer, new_prefix, serving, write_model
from tritonpy.testing import ModelRunner

pytestmark = pytest.mark.timeout(60)

MODEL_PY = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

from . import helper
from .helper import TWICE
import plain_helper
import shared_helper  # beside config.pbtxt, in the model directory


class TritonPythonModel:
    def initialize(self, args):
        self.dir_at_init = pb_utils.get_model_dir()

    def execute(self, requests):
        logger = pb_utils.Logger
        logger.log("logged at " + repr(logger.INFO), logger.INFO)
        report = {
            "name": __name__,
            "package": __package__,
            "helper": helper.NAME,
            "plain": plain_helper.NAME,
            "shared": shared_helper.NAME,
            "twice": TWICE(2),
            "model_dir": pb_utils.get_model_dir(),
            "dir_at_init": self.dir_at_init,
            "levels": [int(logger.INFO), int(logger.WARNING), int(logger.ERROR),
                       int(logger.VERBOSE)],
            "loglevel_is_pb": logger.LogLevel is pb_utils.LogLevel,
            # The version directory's csv.py does not shadow the standard library's for the
            # libraries the model uses (Triton 2.51 searches the model's folders last).
            "csv_is_stdlib": not hasattr(__import__("csv"), "SHADOW"),
        }
        out = np.array([json.dumps(report)], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]) for _ in requests]
'''

FILES = {
    "helper.py": '''
NAME = __name__


def TWICE(x):
    return 2 * x
''',
    "plain_helper.py": "NAME = __name__\n",
    "csv.py": "SHADOW = True\n",
}

CONFIG = '''
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] } ]
'''


def _write_multi_file(tmp_path, versions=(1,)):
    mdir = write_model(tmp_path, "multi_file", MODEL_PY, CONFIG, versions=versions, files=FILES)
    (mdir / "shared_helper.py").write_text("NAME = __name__\n")
    return mdir


def _report(resp) -> dict:
    assert resp.error is None, resp.error
    raw = resp.outputs["OUT"].to_numpy()[0]
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def _expected(version_dir: str, package: str) -> dict:
    return {
        "name": f"{package}.model", "package": package, "helper": f"{package}.helper",
        "plain": "plain_helper", "shared": "shared_helper", "twice": 4, "model_dir": version_dir,
        "dir_at_init": version_dir, "levels": [0, 1, 2, 3], "loglevel_is_pb": True,
        "csv_is_stdlib": True,
    }


def test_model_is_imported_as_version_dot_model_in_a_stub(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tritonpy.model.multi_file")
    mdir = _write_multi_file(tmp_path, versions=(3,))
    with serving(tmp_path, new_prefix()) as server:
        resp = infer(server.model("multi_file"), {"IN": np.zeros(1, np.float32)})
        assert _report(resp) == _expected(os.path.join(str(mdir), "3"), "3")
        deadline = time.monotonic() + 10  # the log line travels on its own frame
        while time.monotonic() < deadline and not _logged(caplog):
            time.sleep(0.02)
    assert _logged(caplog)


def _logged(caplog) -> bool:
    return any("logged at <LogLevel.INFO: 0>" in r.getMessage() for r in caplog.records)


def test_model_runner_imports_it_the_same_way(tmp_path):
    mdir = _write_multi_file(tmp_path)
    with ModelRunner(mdir) as runner:
        (resp,) = runner.execute([{"IN": np.zeros(1, np.float32)}])
        report = _report_of(resp)
        package = runner.module.__package__
    assert package.startswith("_tritonpy_testing_model_")  # its own: runners may coexist
    assert report == _expected(os.path.join(str(mdir), "1"), package)


def _report_of(resp) -> dict:
    return json.loads(resp.output_tensors()[0].as_numpy()[0])
