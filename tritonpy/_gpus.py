"""The GPUs this server may give to ``KIND_GPU`` instances.

Counted once per server: ``TRITONPY_GPU_COUNT`` when set (for hosts whose GPUs ``nvidia-smi``
cannot see, and for tests on machines without one), else the ``GPU n:`` lines of
``nvidia-smi -L`` (0 where it is missing), limited to the host's ``CUDA_VISIBLE_DEVICES``.
A GPU instance's stub sees only its own device: device ``i`` of the server is entry ``i`` of
the host's ``CUDA_VISIBLE_DEVICES`` list when there is one, else ``i``.
"""
from __future__ import annotations

import os
import subprocess


def _host_visible() -> list[str] | None:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip() and d.strip() != "-1"]


def visible_gpu_count() -> int:
    forced = os.environ.get("TRITONPY_GPU_COUNT")
    if forced is not None:
        try:
            return max(0, int(forced))
        except ValueError:
            raise ValueError(f"TRITONPY_GPU_COUNT must be an integer, got {forced!r}") from None
    host = _host_visible()
    if host is not None and not host:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    return min(count, len(host)) if host is not None else count


def device_for_stub(device_id: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that shows a stub exactly server device ``device_id``."""
    host = _host_visible()
    if host and 0 <= device_id < len(host):
        return host[device_id]
    return str(device_id)
