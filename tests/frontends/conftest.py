"""Fixtures of the frontend tests."""
from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from tritonclient.utils import shared_memory as shm_utils

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


@pytest.fixture
def regions() -> Iterator[Callable[[int], tuple[str, Any]]]:
    """``make(size)``: a client's system shm region of ``size`` bytes, as ``(key, handle)``
    (tritonclient's shared_memory utilities); each is destroyed when the test ends."""
    made: list[Any] = []

    def make(size: int) -> tuple[str, Any]:
        key = f"tpyc{secrets.token_hex(4)}"
        made.append(shm_utils.create_shared_memory_region(key, "/" + key, size))
        return key, made[-1]

    try:
        yield make
    finally:
        for handle in made:
            shm_utils.destroy_shared_memory_region(handle)
