"""What the repository shows: the version a request reaches (or why none does), readiness,
and Triton's repository index, read off the manager's entries.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ._errors import NotFoundError, TritonpyError, UnavailableError
from ._model import ModelRuntime
from ._runtime_base import LOADING, READY, UNAVAILABLE, UNLOADING

if TYPE_CHECKING:
    from ._repo_entry import ModelEntry


class RepositoryViews:
    """The read side of :class:`~tritonpy._repo_manager.RepositoryManager`.

    A mixin, not an object of its own: every view reads the manager's entries, its scan
    (what the repositories hold, and the names they refuse), and its retiring set under its
    lock, and resolves names as the manager does; :meth:`runtime` is on every request's path,
    where a mixin costs no extra call.
    """

    if TYPE_CHECKING:  # the manager's (see RepositoryManager.__init__)
        server: Any
        entries: dict[str, ModelEntry]
        scan_errors: dict[str, str]
        _lock: threading.Lock
        _retiring_runtimes: set[ModelRuntime]
        _scanned: dict[str, str]

        def scan(self) -> None:
            ...

        def require_known(self, name: str, near: str | None = None) -> ModelEntry:
            ...

    def runtime(self, name: str, version: int = -1, near: str | None = None) -> ModelRuntime:
        entry = self.require_known(name, near)
        rts = entry.runtimes
        if not rts:
            # As Triton: a known model with no loaded version is NOT_FOUND (HTTP 404). One
            # never loaded is not in Triton's model lifecycle at all, so it is "not found";
            # "no available versions" is for one whose load failed or that was unloaded.
            if not entry.tried:
                raise NotFoundError(f"Request for unknown model: '{name}' is not found")
            if version is not None and version >= 0:
                # As Triton 2.51 (measured): a version asked for by number is looked up
                # first; one the model had (unloaded, or failed to load) is not ready.
                if any(version in known for known in (entry.unloaded, entry.dropped,
                                                      entry.failed, entry.rolled_back)):
                    raise UnavailableError(f"Request for unknown model: '{name}' version "
                                           f"{version} is not at ready state")
                raise NotFoundError(
                    f"Request for unknown model: '{name}' version {version} is not found")
            raise NotFoundError(
                f"Request for unknown model: '{name}' has no available versions"
                + (f" ({entry.reason})" if entry.reason and entry.reason != "unloaded" else ""))
        if version is None or version == -1:
            return rts[max(rts)]
        rt = rts.get(version)
        if rt is None:
            if version in entry.dropped:
                # As Triton 2.51 (measured): a version a reload or the poll took out, still
                # unloading or unloaded, is there, just not ready (503, which a client may
                # retry), not unknown (404).
                raise UnavailableError(
                    f"Request for unknown model: '{name}' version {version} is not at ready "
                    "state")
            raise NotFoundError(
                f"Request for unknown model: '{name}' version {version} is not found")
        return rt

    def runtimes(self) -> list[ModelRuntime]:
        out: list[ModelRuntime] = []
        for e in list(self.entries.values()):
            out.extend(e.runtimes.values())
        return out

    def retiring(self) -> list[ModelRuntime]:
        """The versions unloaded or replaced that still finish their requests."""
        with self._lock:
            return list(self._retiring_runtimes)

    def loaded_versions(self, name: str) -> list[int]:
        return sorted(self.require_known(name).runtimes)

    def is_ready(self, name: str, version: int = -1) -> bool:
        try:
            return self.runtime(name, version).ready()
        except TritonpyError:
            return False

    def all_ready(self) -> bool:
        return all(rt.ready() for rt in self.runtimes())

    def not_available(self) -> list[str]:
        """Models neither ready nor unloaded on purpose: failed, loading or unloading. As in
        Triton, a directory whose configuration cannot even be read is not a model of the
        server and does not count (a broken folder dropped into a polled repository does not
        take the server out of service)."""
        return [e.name for e in list(self.entries.values())
                if (e.state != READY and e.reason != "unloaded" and not e.unreadable)
                or (e.state == READY and any(v not in e.runtimes for v in e.failed))]

    def index(self) -> list[dict]:
        """Triton's repository index. As Triton's, it reads the repository first: a folder
        added since is listed (by name), one removed and not loaded is not. (In poll mode
        the poller reads it.)"""
        if self.server.model_control_mode != "poll":
            self.scan()
        out = []
        for key in sorted(set(self.entries) | set(self.scan_errors)):  # Triton's order
            e = self.entries.get(key)
            name = e.name if e is not None else key
            if e is not None and e.unlisted and not e.runtimes:
                continue  # as Triton: a folder with no version to load is not listed
            if e is not None and e.tmpdir and key not in self._scanned:
                continue  # as Triton: loaded from files, and no repository's model
            if e is None:
                out.append({"name": name, "version": "", "state": UNAVAILABLE,
                            "reason": self.scan_errors[name]})
            elif e.runtimes:
                # (a version whose every instance died and cannot restart now says why, as
                # its ready endpoint and its requests do)
                rows = {v: (rt.state, rt.failed_update or getattr(rt, "unserviceable", ""))
                        for v, rt in e.runtimes.items()}
                for v, why in e.failed.items():  # a new version a reload could not load
                    rows.setdefault(v, (UNAVAILABLE, why))
                self._dropped_rows(e, rows)
                for v, (state, why) in sorted(rows.items()):
                    out.append({"name": name, "version": str(v), "state": state,
                                "reason": why})
            elif not e.tried:  # as Triton: a model never loaded is listed by name alone
                out.append({"name": name, "version": "", "state": "", "reason": ""})
            elif e.state == LOADING and e.loading:
                for v in e.loading:  # as Triton: each version being loaded
                    out.append({"name": name, "version": str(v), "state": LOADING, "reason": ""})
            elif e.state == UNAVAILABLE and e.failed and e.reason != "unloaded":
                # As Triton: the version that failed, with the reason it gave, and those that
                # loaded beside it and were unloaded again for it.
                rows = {v: (UNAVAILABLE, "unloaded") for v in e.rolled_back}
                rows.update({v: (UNAVAILABLE, why) for v, why in e.failed.items()})
                for v, (state, why) in sorted(rows.items()):
                    out.append({"name": name, "version": str(v), "state": state,
                                "reason": why})
            elif e.unloaded and (e.state == UNLOADING or e.reason == "unloaded"):
                # As Triton: the versions the unload took down, each UNAVAILABLE ("unloaded"),
                # and those an earlier reload did.
                rows = {v: (e.state, e.reason) for v in e.unloaded}
                self._dropped_rows(e, rows)
                for v, (state, why) in sorted(rows.items()):
                    out.append({"name": name, "version": str(v), "state": state,
                                "reason": why})
            else:
                out.append({"name": name, "version": "", "state": e.state, "reason": e.reason})
        return out

    @staticmethod
    def _dropped_rows(e: ModelEntry, rows: dict[int, tuple[str, str]]) -> None:
        """Add the versions a reload took out of ``e``'s service to its index ``rows``."""
        for v, rt in e.dropped.items():
            rows.setdefault(v, (UNAVAILABLE, "unloaded") if rt.state == UNAVAILABLE
                            else (UNLOADING, ""))
