"""SPEC §1's import rules, read off the source: ``shm/`` imports nothing from ``tritonpy`` or
``stub``, and ``stub/`` imports only ``shm/`` (and itself) of ours. A stub that imported the
host side loaded its modules (and what they import) into every stub process; ``stub/`` did
import ``tritonpy._loop`` for its polling policy and stall watch, which now live in
``shm/waiting.py``. And a running stub holds none of the host side: ``tritonpy/__init__.py``
imported the whole server, which every stub ran as it imported ``tritonpy.stub`` (a stub took
about 245 ms from spawn to its first frame and 61 MiB; now about 125 ms and 40 MiB)."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from _models import infer, new_prefix, serving, write_model

ROOT = Path(__file__).resolve().parents[2]


def _ours(path: Path, package: str) -> list[str]:
    """The modules of ours (``tritonpy...``, absolute) that ``path`` in ``package`` imports,
    anywhere in the file (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "tritonpy"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the installed package's name
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "tritonpy":
                found.append(module)
    return found


@pytest.mark.parametrize("folder, allowed", [
    ("shm", ("tritonpy.shm",)),
    ("stub", ("tritonpy.shm", "tritonpy.stub")),
])
def test_shm_and_stub_import_only_what_spec_1_allows(folder: str, allowed: tuple[str, ...]) -> None:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    wrong = {}
    for path in files:
        bad = [m for m in _ours(path, f"tritonpy.{folder}")
               if not any(m == a or m.startswith(a + ".") for a in allowed)]
        if bad:
            wrong[str(path.relative_to(ROOT))] = bad
    assert wrong == {}


LOADED_PY = """
import sys
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        names = sorted(m for m in sys.modules if m.split(".")[0] in
                       ("tritonpy", "grpc", "tritonclient", "google", "httptools", "uvloop",
                        "prometheus_client"))
        out = pb_utils.Tensor("OUT", np.array(names, dtype=object))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
"""


def test_a_running_stub_holds_none_of_the_host_side(tmp_path: Path) -> None:
    write_model(tmp_path, "loaded", LOADED_PY,
                'backend: "python"\nmax_batch_size: 0\n'
                'input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
                'output [ { name: "OUT", data_type: TYPE_STRING, dims: [ -1 ] } ]\n')
    with serving(tmp_path, new_prefix()) as server:
        resp = infer(server.model("loaded"), {"IN": np.zeros(1, np.float32)})
        assert resp.error is None, resp.error
        names = [n.decode() for n in resp.outputs["OUT"].to_numpy()]
    assert "tritonpy.stub._runtime" in names and "tritonpy.shm.channel" in names
    host = [n for n in names if not n.startswith(("tritonpy.shm", "tritonpy.stub"))
            and n not in ("tritonpy", "tritonpy._errors")]
    assert host == []
