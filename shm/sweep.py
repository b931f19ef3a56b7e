"""Removal of orphaned segments: those of a prefix whose creating process is gone."""
from __future__ import annotations

import os
import re
from typing import Collection

import psutil

from .segment import SHM_DIR, _unlink


def owner_pid(entry: str, prefix: str) -> int | None:
    """The creating pid encoded in a segment name ``<prefix><pid>x<rand>_<n>``."""
    m = re.match(re.escape(prefix) + r"(\d+)x[0-9a-f]+_", entry)
    return int(m.group(1)) if m else None


def process_ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie has); False when that cannot be known (no
    descriptor left to read /proc)."""
    if not psutil.pid_exists(pid):
        return True
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True
    except OSError:
        return False


def list_segments(prefix: str, directory: str | None = None) -> list[str]:
    """Names of existing segments that carry ``prefix``."""
    try:
        entries = os.listdir(directory or SHM_DIR)
    except OSError:
        return []
    return sorted(e for e in entries if e.startswith(prefix) and owner_pid(e, prefix) is not None)


def sweep_orphans(prefix: str, directory: str | None = None,
                  dead_pids: set[int] | None = None, keep: Collection[str] = ()) -> list[str]:
    """Unlink the segments of ``prefix`` whose creator no longer runs (or is in ``dead_pids``),
    but those named in ``keep``.

    Returns the names removed.
    """
    removed = []
    for entry in list_segments(prefix, directory):
        if entry in keep:
            continue
        pid = owner_pid(entry, prefix)
        assert pid is not None
        if (dead_pids is not None and pid in dead_pids) or process_ended(pid):
            _unlink(entry, directory)
            removed.append(entry)
    return removed
