"""Fixtures of the frontend tests."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest
from _serve import Serve


@pytest.fixture
def serve(tmp_path: Path, shm_prefix: str) -> Iterator[Callable[..., Serve]]:
    started: list[Serve] = []

    def start(*args: str) -> Serve:
        s = Serve(list(args), shm_prefix, tmp_path)
        started.append(s)
        return s

    try:
        yield start
    finally:
        for s in started:
            s.close()
