"""The model repository as the server sees it: which models exist, which are loaded, and the
load / reload / unload / poll life cycle of each.

A reload builds the new version's instances while the old ones keep serving, then swaps them
in; the old ones finish their in-flight requests and unload in the background. As in Triton,
a loaded version whose files are unchanged and whose config changed only in its instance groups
(or version policy) is not reloaded but updated in place: instances are added and removed, the
others kept. A model that fails to load is UNAVAILABLE with the reason; the others keep serving.

Here: the models' entries, names, start and stop, load / unload, ensembles' dependents, and the
poll. The loading of one model's versions is in ``_repo_loading``, the views (the version a
request reaches, readiness, the index) in ``_repo_views``, the folders of loads with files in
``_load_files``, EXECUTION_ENV_PATH in ``_execution_env``, a model's entry in ``_repo_entry``.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Mapping

from ._errors import (
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    TritonpyError,
    UnavailableError,
    load_cancelled,
)
from ._ensemble import EnsembleRuntime
from ._ensemble_config import is_ensemble_dir
from ._ensemble_load import ensembles_outermost_first
from ._execution_env import ExecutionEnvs
from ._load_files import FilesFolders, write_files
from ._model import ModelRuntime
from ._repo_entry import ModelEntry, _check_model_name
from ._repo_loading import VersionLoading
from ._repo_views import RepositoryViews
from ._runtime_base import UNAVAILABLE, UNLOADING
from .repository import namespaced_key

log = logging.getLogger("tritonpy.repository")


# Triton's words for a load or unload asked for outside explicit mode (any other mode; scripts
# and tools look for them).
NOT_EXPLICIT = "explicit model load / unload is not allowed if polling is enabled"


_DONE = object()  # (see _each_at_once)


def _each_at_once(fn: Callable[[Any], None], items: list[Any]) -> None:
    """``fn(item)`` for each item, 8 at a time in threads, until all have returned; the first
    exception one raised is raised here then. An interruption of the wait (Ctrl-C:
    KeyboardInterrupt) is raised at once, not once every call has ended (as a
    ThreadPoolExecutor's ``with`` would): the caller ends them (the server's stop kills the
    stubs they wait for). Threads of its own: a ThreadPoolExecutor takes no work once the
    interpreter is exiting, when a thread that outlives the main one may still stop a server."""
    todo = iter(items)
    lock = threading.Lock()
    failures: list[BaseException] = []

    def work() -> None:
        while True:
            with lock:
                item = next(todo, _DONE)
            if item is _DONE:
                return
            try:
                fn(item)
            except BaseException as exc:  # raised in the caller's thread, below
                failures.append(exc)

    threads = [threading.Thread(target=work, daemon=True, name="tritonpy-each")
               for _ in range(min(8, len(items)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


class RepositoryManager(VersionLoading, RepositoryViews):
    """Scans repositories and drives model loading for a :class:`~tritonpy.server.Server`."""

    def __init__(self, server: Any) -> None:
        self.server = server
        # Triton's --model-namespacing: models keyed <repository>::<name>; a name two
        # repositories hold is two models, and a request names one when the name is unique.
        self.namespacing = bool(getattr(server, "model_namespacing", False))
        self.entries: dict[str, ModelEntry] = {}  # by key (see ModelEntry)
        self.scan_errors: dict[str, str] = {}
        self._lock = threading.Lock()
        self._gpu_count: int | None = None
        self._poller: threading.Thread | None = None
        self._envs = ExecutionEnvs()
        # Threads that retire versions (a reload's old ones, an unload that does not wait).
        self._retiring: set[threading.Thread] = set()
        # Versions unloaded or replaced that still finish their requests (see _retire).
        self._retiring_runtimes: set[ModelRuntime] = set()
        # Ensembles unloaded because a model they run was: their step models, to load them
        # again once those are back.
        self._orphans: dict[str, set[str]] = {}
        self._scanned: dict[str, str] = {}  # the repositories' models, as last scanned
        # The folders of loads with files.
        self._files_folders = FilesFolders(server, self._files_in_use)

    # -- scanning ------------------------------------------------------------------------------
    def scan(self) -> None:
        from .repository import scan_repositories

        models, errors = scan_repositories(self.server.repositories, self.namespacing)
        with self._lock:
            self._scanned = models
            for key, directory in models.items():
                entry = self.entries.get(key)
                if entry is None:
                    name = os.path.basename(directory)
                    self.entries[key] = ModelEntry(
                        name, directory, key,
                        os.path.dirname(directory) if self.namespacing else "")
                elif entry.tmpdir is None:
                    entry.directory = directory
            # A model whose folder went, not loaded now: as Triton, no longer in the index,
            # nor (namespacing) one of the identifiers a name resolves among. (Poll mode
            # unloads a loaded one; explicit mode lists it until it is unloaded.)
            retiring = {rt.name for rt in self._retiring_runtimes}
            for key, entry in list(self.entries.items()):
                if key not in models and entry.tmpdir is None and not entry.runtimes \
                        and entry.state != UNLOADING and entry.name not in retiring \
                        and not entry.lock.locked():
                    del self.entries[key]
            self.scan_errors = errors

    def require_known(self, name: str, near: str | None = None) -> ModelEntry:
        """The model ``name`` (a key, or with namespacing a name, resolved as :meth:`find`
        does), else NotFoundError, or InvalidArgumentError for a name that cannot be served."""
        entry = self.entries.get(name)
        if entry is None:
            if self.namespacing:
                entry = self.find(name, near)
                if entry is not None:
                    return entry
            if name in self.scan_errors:
                raise InvalidArgumentError(self.scan_errors[name])
            raise NotFoundError(f"Request for unknown model: '{name}' is not found")
        return entry

    def find(self, name: str, near: str | None = None) -> ModelEntry | None:
        """With namespacing: the model called ``name`` in namespace ``near`` if there is one
        (an ensemble's step), else the only model of that name anywhere, else None; two or
        more are refused in Triton's words."""
        if near is not None:
            entry = self.entries.get(namespaced_key(near, name))
            if entry is not None:
                return entry
        found = self.named(name)
        if len(found) > 1:
            raise InvalidArgumentError(
                f"There are {len(found)} identifiers of model '{name}' in global map, model "
                "namespace must be provided to resolve ambiguity.")
        return found[0] if found else None

    def named(self, name: str) -> list[ModelEntry]:
        """The models called ``name``: one at most without namespacing."""
        if not self.namespacing:
            entry = self.entries.get(name)
            return [entry] if entry is not None else []
        return [e for e in list(self.entries.values()) if e.name == name]

    def keys_of(self, name: str) -> list[str]:
        """The keys of the models ``name`` stands for: itself where it is a key, else (with
        namespacing) every model of that name, else [name]."""
        if name in self.entries or not self.namespacing:
            return [name]
        return [e.key for e in self.named(name)] or [name]

    # -- start / stop --------------------------------------------------------------------------
    def start_up(self, wait: bool) -> None:
        self.scan()
        mode = self.server.model_control_mode
        if mode == "explicit":
            names = list(self.entries) if "*" in self.server.load_models else [
                key for n in self.server.load_models for key in self.keys_of(n)]
            # A name two repositories hold is not loaded (the index shows why); as Triton,
            # the start goes on with the others (tritonpy serve's --exit-on-error decides).
            names = [n for n in names if n not in self.scan_errors]
            for n in names:
                if n not in self.entries:
                    self.require_known(n)  # not found
        else:
            names = list(self.entries)
        for n in names:
            self.entries[n].requested = True
        work = lambda: self._load_many(names)  # noqa: E731
        if wait:
            work()
        else:
            threading.Thread(target=work, daemon=True, name="tritonpy-startup").start()
        if mode == "poll" and self.server.poll_interval > 0:  # 0: at start only, as Triton
            self._poller = threading.Thread(target=self._poll, daemon=True, name="tritonpy-poll")
            self._poller.start()

    def _load_many(self, names: list[str]) -> None:
        if not names:
            return
        # Ensembles after the models they run: they are checked against the loaded configs.
        ensembles = [n for n in names if is_ensemble_dir(self.entries[n].directory,
                                                          self.server.model_config_name)]
        plain = [n for n in names if n not in ensembles]
        if plain:
            _each_at_once(self._load_quietly, plain)
        for n in ensembles:  # one may already be loaded as a step of another
            if not self.entries[n].runtimes:
                self._load_quietly(n)

    def _load_quietly(self, name: str) -> None:
        try:
            self.load(name)
        except TritonpyError as exc:
            self.server.log_failed_load(name, exc.message)

    def shut_down(self, timeout: float) -> list[str]:
        """Unload everything, each drain bounded by ``timeout``; the model versions it cut
        off: with requests still in flight when it passed ("'name' version N (requests in
        flight)"), or a finalize still running then ("... (its finalize)")."""
        entries = list(self.entries.values())
        # The versions being unloaded or replaced count too: their drains are bounded by the
        # exit timeout as well, on their own threads, which run meanwhile (they were waited
        # for first, and a slow finalize among them made a stop take the timeout twice).
        live = [rt for e in entries for rt in e.runtimes.values()] + self.retiring()
        deadline = time.monotonic() + timeout
        # The ensembles first, each before the ensembles whose steps it runs, while their
        # steps still serve: a request under way goes on to its end rather than finding a step
        # unloaded (Triton's stop waits for every request in flight before it unloads any).
        layers = ensembles_outermost_first(entries)
        first = {id(e) for layer in layers for e in layer}
        for layer in [*layers, [e for e in entries if id(e) not in first]]:
            if layer:
                _each_at_once(
                    lambda e: self._unload_entry(e, max(0.0, deadline - time.monotonic())),
                    layer)
        for t in list(self._retiring):
            t.join(timeout + 15)
        self.remove_files_folders()
        return ([f"'{rt.name}' version {rt.version} (requests in flight)"
                 for rt in live if rt.cut_short]
                + [f"'{rt.name}' version {rt.version} (its finalize)"
                   for rt in live if rt.finalize_cut_off and not rt.cut_short])

    def _files_in_use(self) -> list[str]:
        """The folders of loads with files that a model still uses: its current files, or
        those of a version that still serves (or finishes its requests); see FilesFolders."""
        keep = [e.tmpdir for e in list(self.entries.values()) if e.tmpdir]
        keep.extend(os.path.dirname(rt.model_dir) for rt in self.runtimes() + self.retiring())
        return keep

    def remove_files_folders(self) -> None:
        """Remove the folders of the loads with files (the end of a stop, or an exit)."""
        self._files_folders.remove()

    # -- load / unload -------------------------------------------------------------------------
    def load(self, name: str, config: str | None = None,
             files: Mapping[str, bytes] | None = None, api: bool = False) -> None:
        """Load (or reload) ``name``; raises with the reason when it fails."""
        if api and self.server.model_control_mode != "explicit":
            raise UnavailableError(NOT_EXPLICIT)
        if api:
            _check_model_name(name)
            self.scan()
        keys = self.keys_of(name)
        if len(keys) > 1:  # namespacing: as Triton, a name two repositories hold loads both
            if config or files:
                raise InvalidArgumentError(
                    f"failed to load '{name}': {len(keys)} repositories hold a model of that "
                    "name, and a load with a config override or files is for one model")
            first: TritonpyError | None = None
            for key in keys:
                try:
                    self._load_key(key, name, None, None, api)
                except TritonpyError as exc:
                    first = first or exc
            if first is not None:
                raise first
            return
        try:
            self._load_key(keys[0], name, config, files, api)
        finally:
            if files or self._files_folders.root is not None:
                self._files_folders.sweep()

    def _load_key(self, name: str, shown: str, config: str | None,
                  files: Mapping[str, bytes] | None, api: bool) -> None:
        """:meth:`load` of one model: ``name`` is its key (its name, without namespacing),
        ``shown`` the name errors give."""
        refused = f"failed to load '{shown}', failed to poll from model repository"  # Triton's
        tmp = mdir = None
        if files:
            if not config:
                raise InvalidArgumentError(
                    f"{refused}: load with files needs a config override as well")
            tmp = self._files_folders.new(shown)
            mdir = os.path.join(tmp, shown)
            try:
                os.makedirs(mdir)
                write_files(mdir, files)
            except InvalidArgumentError as exc:  # Triton's sentence first (QA L0_lifecycle)
                self._files_folders.drop(tmp)
                if self.server._stopping:  # its folder was removed by the stop meanwhile
                    raise load_cancelled() from None
                raise InvalidArgumentError(f"{refused}: {exc.message}") from None
            except BaseException:  # a refused path: what was written so far goes too
                self._files_folders.drop(tmp)
                raise
        else:
            if name in self.scan_errors:  # in two repositories: what is loaded stays
                raise InvalidArgumentError(f"{refused}: {self.scan_errors[name]}")
            self.require_known(name)
        override = None
        if config:
            from .config import config_from_dict

            try:  # Triton's words for an override it cannot read (clients look for them)
                override = config_from_dict(config, "Invalid config override")
            except TritonpyError as exc:
                if tmp:
                    self._files_folders.drop(tmp)
                raise InvalidArgumentError(f"{refused}: {exc.message}") from exc
        if mdir:
            # Known from now on (a refused load of a new name leaves no entry in the index).
            with self._lock:
                entry = self.entries.setdefault(name, ModelEntry(shown, "", name))
        else:
            entry = self.require_known(name)
        # Which directory the model loads from is settled under the entry's lock, by the load
        # that holds it: a load waiting for another one must not change what that one reads.
        with entry.lock:
            # (A folder of files replaced goes once no version loaded from it serves: see
            # FilesFolders.sweep.)
            if mdir and tmp:  # (both or neither: a load with files)
                entry.tmpdir = tmp
                entry.directory = mdir
                self._files_folders.claim(tmp)
            else:
                self.without_files(entry)
            stamp = self._config_stamp(entry) if not mdir else None
            if override is None and not mdir and entry.override is not None:
                # As Triton 2.51 (measured, QA L0_lifecycle): the last override holds until
                # the config file changes.
                kept, when = entry.override
                if when == stamp:
                    override = kept
                else:
                    entry.override = None
            pristine = None  # the override as given, kept: a load completes the copy it reads
            if override is not None and not mdir:
                pristine, override = override, type(override)()
                override.CopyFrom(pristine)
            try:
                self._load_retrying(entry, override)
            except TritonpyError as exc:
                if not api:
                    raise
                # As Triton's model control API answers a failed load (HTTP 400).
                raise InvalidArgumentError(
                    f"load failed for model '{shown}': {exc.message}") from exc
            entry.requested = True
            entry.override = (pristine, stamp) if pristine is not None else None
        self._orphans.pop(name, None)
        self._revive_orphans()

    def without_files(self, entry: ModelEntry) -> None:
        """Before a load without files (its caller holds ``entry.lock``): as Triton, it undoes
        a files override and reads the repository's model again; a model known from files
        alone is no repository's, and Triton's poll of the repository refuses it."""
        if entry.key in self._scanned:
            if entry.tmpdir:
                entry.tmpdir = None
                entry.directory = self._scanned[entry.key]
        elif entry.tmpdir or not entry.directory:  # (INTERNAL, as Triton 2.51 answers it)
            raise InternalError(
                f"failed to load '{entry.name}', failed to poll from model repository")

    def _config_stamp(self, entry: ModelEntry) -> tuple[int, int] | None:
        """When and how big ``entry``'s config file is (None: there is none)."""
        from .config import config_path

        try:
            st = os.stat(config_path(entry.directory, self.server.model_config_name))
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _revive_orphans(self) -> None:
        """Load again the ensembles a step's unload took with it, once their steps are back."""
        progress = True
        while progress:
            progress = False
            for ens, steps in list(self._orphans.items()):
                ens_entry = self.entries.get(ens)
                ns = ens_entry.namespace if ens_entry is not None else ""
                if all((k := self.step_key(s, ns)) is not None
                       and (e := self.entries.get(k)) is not None and e.runtimes for s in steps):
                    if self._orphans.pop(ens, None) is not None:
                        self._load_quietly(ens)
                        progress = True

    def _retire(self, runtimes: list[ModelRuntime], timeout: float | None = None) -> None:
        """Unload versions taken out of service (None: every request finishes, as Triton's;
        see drain); meanwhile the stop's drain counts their requests in flight."""
        with self._lock:
            self._retiring_runtimes.update(runtimes)
        try:
            for rt in runtimes:
                rt.unload(timeout)
                self.server.counter_carry.finished(rt.stats)
        finally:
            with self._lock:
                self._retiring_runtimes.difference_update(runtimes)
            self._files_folders.sweep()

    def _in_background(self, fn: Any, *args: Any, name: str) -> None:
        """Run ``fn`` on a thread that ``shut_down`` waits for."""
        def run() -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("%s failed", name)
            finally:
                self._retiring.discard(threading.current_thread())

        t = threading.Thread(target=run, daemon=True, name=name)
        self._retiring.add(t)
        t.start()

    def unload(self, name: str, api: bool = False, wait: bool = True) -> None:
        """Unload ``name`` (and the ensembles that run it). Its in-flight and queued requests
        finish first, however long they take, as in Triton; with ``wait`` False (Triton's
        HTTP, gRPC and pb_utils unload) this returns at once and the model shows UNLOADING
        meanwhile."""
        if api and self.server.model_control_mode != "explicit":
            raise UnavailableError(NOT_EXPLICIT)
        keys = self.keys_of(name)
        if len(keys) > 1:  # namespacing: as Triton, a name two repositories hold unloads both
            for key in keys:
                self.unload(key, wait=wait)
            return
        name = keys[0]
        entry = self.entries.get(name)
        if entry is None and name not in self.scan_errors:
            # As Triton: unloading a model that is not loaded succeeds, a name the repository
            # does not have included (unload is idempotent for scripts that clean up).
            log.info("unload of '%s': the repository has no such model; nothing to unload", name)
            return
        entry = self.require_known(name)
        entry.requested = False
        self._orphans.pop(name, None)
        self._unload_with_dependents(entry, None, wait)

    def _unload_with_dependents(self, entry: ModelEntry, timeout: float | None,
                                wait: bool = True) -> None:
        """Unload ``entry`` and, first, as Triton does, the loaded ensembles that run it
        (directly or through other ensembles); they load again when it does."""
        for ens in reversed(self._dependents(entry.key)):  # the outermost first
            e = self.entries[ens]
            steps = {st.model for rt in e.runtimes.values() if isinstance(rt, EnsembleRuntime)
                     for st in rt.steps}
            self._unload_entry(e, timeout, wait)
            self._orphans[ens] = steps
            log.info("unloaded ensemble '%s', which runs '%s'", e.name, entry.name)
        self._unload_entry(entry, timeout, wait)

    def _dependents(self, key: str) -> list[str]:
        """The keys of the loaded ensembles that run model ``key``, directly or through other
        ensembles; an ensemble comes after those it runs."""
        found: list[str] = []
        todo = [key]
        while todo:
            model = todo.pop(0)
            for other, e in list(self.entries.items()):
                if other != key and other not in found and any(
                        isinstance(rt, EnsembleRuntime) and any(
                            self.step_key(st.model, rt.namespace) == model for st in rt.steps)
                        for rt in e.runtimes.values()):
                    found.append(other)
                    todo.append(other)
        return found

    def step_key(self, name: str, namespace: str) -> str | None:
        """The key of the model an ensemble of ``namespace`` runs as step ``name`` (None: none,
        or, with namespacing, two of that name elsewhere and none in its own namespace)."""
        if not self.namespacing:
            return name
        try:
            entry = self.find(name, namespace)
        except TritonpyError:
            return None
        return entry.key if entry is not None else None

    def _unload_entry(self, entry: ModelEntry, timeout: float | None, wait: bool = True) -> None:
        """Take ``entry``'s versions out of service now; they finish their requests (bounded by
        ``timeout``, None: see ``ModelRuntime.drain``) and are released before this returns,
        or on a thread of their own without ``wait`` (the model shows UNLOADING meanwhile)."""
        with entry.lock:
            entry.override = None  # as Triton 2.51 (measured): the next load reads the file
            if not entry.runtimes:
                if entry.state == UNAVAILABLE:  # e.g. failed to load: unloaded now, on purpose
                    entry.reason = "unloaded"
                return
            entry.state = UNLOADING
            rts = entry.runtimes
            with self._lock:  # retiring before they leave the entry: always one or the other
                self._retiring_runtimes.update(rts.values())
            entry.runtimes = {}
            entry.unloaded = sorted(rts)
            carry = self.server.counter_carry
            for v in rts:
                carry.unloaded(entry.namespace, entry.name, v)

        def finish() -> None:
            self._retire(list(rts.values()), timeout)
            with entry.lock:
                if not entry.runtimes and entry.state == UNLOADING:  # not loaded again since
                    entry.state = UNAVAILABLE
                    entry.reason = "unloaded"
                    if entry.tmpdir:
                        # As Triton: the files go with the model; a load without them reads
                        # the repository's model again (a model known from files alone is
                        # known no more).
                        entry.tmpdir = None
                        entry.directory = self._scanned.get(entry.key, "")
                        self._files_folders.sweep()

        if wait:
            finish()
        else:
            self._in_background(finish, name=f"{entry.name}-unload")

    # -- poll mode -----------------------------------------------------------------------------
    def _poll(self) -> None:
        from .repository import fingerprint

        while not self.server._stopping:
            time.sleep(self.server.poll_interval)
            if self.server._stopping:
                return
            before = set(self.entries)
            try:
                self.scan()
            except TritonpyError as exc:
                log.error("repository scan failed: %s", exc.message)
                continue
            for name, entry in list(self.entries.items()):
                # Gone, or now in a second repository too: as Triton, it is unloaded (the
                # index then shows the duplicate UNAVAILABLE, with Triton's reason).
                if not os.path.isdir(entry.directory) or (
                        name in self.scan_errors and entry.tmpdir is None):
                    self._unload_with_dependents(entry, None, wait=False)
                    self.entries.pop(name, None)
                    continue
                fp = fingerprint(entry.directory)
                if name not in before or (fp != entry.fingerprint):
                    entry.fingerprint = fp
                    self._load_quietly(name)
            # An ensemble that a step's removal took with it runs again once its steps are
            # there: with namespacing, a model of that name in another repository.
            self._revive_orphans()

    # -- execution environments ----------------------------------------------------------------
    def execution_env(self, rt: ModelRuntime) -> list[str] | None:
        """The command that starts the Python of the model's EXECUTION_ENV_PATH; see
        :meth:`ExecutionEnvs.command`."""
        return self._envs.command(rt)
