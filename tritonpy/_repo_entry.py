"""A model's entry in the repository (:class:`ModelEntry`: its directory, its loaded versions
and what its last load and unload left), and the check of a model's name."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ._errors import InvalidArgumentError
from ._runtime_base import UNAVAILABLE

if TYPE_CHECKING:
    from ._model import ModelRuntime

def _check_model_name(name: str) -> None:
    """Refuses a name no model directory can have: a load must not reach outside the
    repository (or the temp folder, with files), whatever its name holds."""
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise InvalidArgumentError(
            f"{name!r} is not a model name: a model name is the name of one directory (not "
            "empty, '.' or '..', and without '/' or NUL)")


class ModelEntry:
    """One model: its directory and its loaded versions. Its ``key`` in the manager's entries
    is its name, or with ``--model-namespacing`` ``<repository>::<name>``, its ``namespace``
    being that repository ("" without)."""

    def __init__(self, name: str, directory: str, key: str = "", namespace: str = "") -> None:
        self.name = name
        self.key = key or name
        self.namespace = namespace
        self.directory = directory
        self.state = UNAVAILABLE
        self.reason = "unloaded"
        self.runtimes: dict[int, ModelRuntime] = {}
        self.tried = False  # a load was attempted (the index lists a never-loaded model bare)
        # Loaded because a load asked for it by name (not only as an ensemble's step): an
        # ensemble's unload with unload_dependents keeps it, as Triton's does.
        self.requested = False
        self.unloaded: list[int] = []  # the versions its last unload took down
        # The versions a reload took out of service (its version policy or files no longer
        # name them), which Triton's index goes on listing: UNLOADING, then "unloaded".
        self.dropped: dict[int, ModelRuntime] = {}
        self.fingerprint = ""
        self.version_files: dict[int, str] = {}  # see repository.version_fingerprints
        self.lock = threading.Lock()
        self.tmpdir: str | None = None
        # The versions its first load is loading, then those that failed and why (Triton's
        # index lists each, with the reason the version gave).
        self.loading: list[int] = []
        self.failed: dict[int, str] = {}
        # Its last load failed on its configuration (unreadable, invalid, another backend):
        # as in Triton, where such a directory fails the poll, it is no model of the server
        # and does not count against readiness.
        self.unreadable = False
        # The versions its last failed first load had loaded and took down again.
        self.rolled_back: list[int] = []
        # The config override its last load with one gave, and the stamp of its config file
        # then: as Triton's, a later load without an override keeps it until the file changes
        # or the model is unloaded.
        self.override: tuple[Any, tuple[int, int] | None] | None = None
        # Its last failed first load found no version to load: Triton's index leaves it out.
        self.unlisted = False
