"""SPEC §1's import rules, read off the source: ``shm/`` imports nothing from ``tritonpy`` or
``stub``, and ``stub/`` imports only ``shm/`` (and itself) of ours. A stub that imported the
host side loaded its modules (and what they import) into every stub process; ``stub/`` did
import ``tritonpy._loop`` for its polling policy and stall watch, which now live in
``shm/waiting.py``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
