"""Loading one model's versions: its configuration read (or overridden), completed by its
``auto_complete_config`` and checked, then each version's instances started side by side; a
reload builds the new versions while the old ones serve, keeps those that only changed their
instance groups (updated in place), and hands the rest to the manager to retire. A load that
fails leaves the model UNAVAILABLE, with the reason and the versions Triton's index lists.
"""
from __future__ import annotations

import logging
import re
import threading
from typing import TYPE_CHECKING, Any

from ._errors import (
    ConfigError,
    InternalError,
    TritonpyError,
    UnsupportedError,
    load_cancelled,
    version_failed,
)
from ._ensemble_config import is_ensemble
from ._ensemble_load import load_ensemble
from ._instances import config_needs_reload
from ._model import ModelRuntime
from ._runtime_base import LOADING, READY, UNAVAILABLE, side_by_side

if TYPE_CHECKING:
    from ._repo_entry import ModelEntry

log = logging.getLogger("tritonpy.repository")


# "version N is at UNAVAILABLE state: <why>" (errors.version_failed)
_VERSION_FAILED = re.compile(r"version (\d+) is at (?:UNAVAILABLE|READY) state: (.*)", re.DOTALL)


def _failed_versions(exc: TritonpyError) -> dict[int, str]:
    """Version → why, for each version a failed load names (none: the model failed)."""
    each = getattr(exc, "versions_failed", None) or [exc.message]
    found = [_VERSION_FAILED.match(message) for message in each]
    return {int(m.group(1)): m.group(2) for m in found if m}


def _load_versions(runtimes: list[ModelRuntime]) -> None:
    """Load the versions of one model in parallel, as Triton does. When any fails, the
    error names each one that failed, in order of version (Triton's words, joined by ';'),
    and those that loaded stay loaded: the caller unloads them again."""
    errors = {rt.version: exc for rt, exc in zip(runtimes, side_by_side(
        [(f"{rt.name}-{rt.version}-load", rt.load) for rt in runtimes])) if exc is not None}
    if not errors:
        return
    failures = [errors[v] for v in sorted(errors)]
    first = failures[0]
    if not isinstance(first, TritonpyError) or len(failures) == 1:
        raise first
    messages = [e.message if isinstance(e, TritonpyError) else str(e) for e in failures]
    err = type(first)(";".join(messages))
    err.versions_failed = messages  # type: ignore[attr-defined]
    raise err


class VersionLoading:
    """The loading of one model entry, a part of :class:`~tritonpy._repo_manager.RepositoryManager`.

    A mixin, not an object of its own: a load reads the server's options and the manager's
    GPU count, moves the versions a reload replaces into the manager's retiring set under its
    lock (so that a stop's drain and the files-folder sweep always see them), and retires them
    on the manager's background threads; an ensemble's load calls back into the manager
    (``load_ensemble(self, ...)``) to load its steps.
    """

    if TYPE_CHECKING:  # the manager's (see RepositoryManager.__init__)
        server: Any
        _lock: threading.Lock
        _gpu_count: int | None
        _retiring_runtimes: set[ModelRuntime]

        def _retire(self, runtimes: list[ModelRuntime], timeout: float | None = None) -> None:
            ...

        def _in_background(self, fn: Any, *args: Any, name: str) -> None:
            ...

    def gpu_count(self) -> int:
        """GPUs for KIND_GPU instances, counted once (see ``tritonpy._gpus``)."""
        if self._gpu_count is None:
            from ._gpus import visible_gpu_count

            self._gpu_count = visible_gpu_count()
        return self._gpu_count

    def _load_retrying(self, entry: ModelEntry, config_override: Any = None) -> None:
        """:meth:`_load_entry`, tried again up to the server's ``model_load_retry_count`` times
        when the model fails to load (Triton's ``--model-load-retry-count``); a configuration
        that is invalid is not retried (it fails the same way until it is edited)."""
        retries = self.server.model_load_retry_count
        for attempt in range(retries + 1):
            try:
                self._load_entry(entry, config_override)
                return
            except (ConfigError, UnsupportedError):
                raise
            except TritonpyError as exc:
                if attempt == retries or self.server.loads_cancelled:
                    raise
                log.warning("failed to load '%s' (attempt %d of %d), retrying: %s",
                            entry.name, attempt + 1, retries + 1, exc.message)

    def _load_entry(self, entry: ModelEntry, config_override: Any = None) -> None:
        """Load ``entry`` from its directory, or with ``config_override`` (a parsed ModelConfig)
        in place of its config.pbtxt."""
        from .config import (
            config_path,
            config_to_json,
            load_model_config,
            normalize_config,
            read_labels,
        )
        from .repository import (
            available_versions,
            fingerprint,
            model_file,
            model_source,
            run_repo_agents,
            select_versions,
            version_fingerprints,
        )

        srv = self.server
        old = dict(entry.runtimes)
        entry.tried = True
        if not old:
            entry.state = LOADING
            entry.reason = ""
        # What errors name as the configuration at fault: a load's override, not the file.
        cfg_path = (f"the config override of model '{entry.name}'" if config_override is not None
                    else config_path(entry.directory, srv.model_config_name))
        new: dict[int, ModelRuntime] = {}
        read: tuple[Any, bool] | None = None  # the configuration as read; whether a file held it
        try:
            if config_override is not None:
                cfg, exists = config_override, True
            else:
                cfg, exists = load_model_config(entry.directory, srv.model_config_name)
            read = cfg, exists
            if entry.directory and cfg.model_repository_agents.agents:
                run_repo_agents(cfg, entry.directory)
            ensemble = is_ensemble(cfg)
            files = version_fingerprints(entry.directory) if entry.directory else {}
            if not exists and not srv.auto_complete:
                # Triton 2.51's words (QA L0_model_config), then ours.
                raise ConfigError(f"failed to open text file for read {cfg_path}: No such file "
                                  "or directory (auto-complete is disabled: it would complete "
                                  "a missing configuration)")
            if not ensemble and srv.auto_complete:
                cfg = self._auto_complete(entry, cfg, cfg_path)
            cfg = normalize_config(cfg, entry.name, cfg_path, gpu_count=self.gpu_count())
            labels = read_labels(cfg, entry.directory, cfg_path) if entry.directory else {}
            versions = select_versions(cfg, available_versions(entry.directory))
            if not old:
                entry.loading, entry.failed, entry.rolled_back = list(versions), {}, []
            if ensemble:  # steps are loaded (explicit mode) and checked first
                new.update(load_ensemble(self, entry, cfg, versions))  # type: ignore[arg-type]
                versions = []
            cfg_json = config_to_json(cfg)
            # As Triton: a loaded version whose files are unchanged, and whose config changed
            # in its instance groups at most, is updated in place; the others load anew.
            kept = {v: rt for v, rt in old.items() if v in versions and not rt.is_ensemble
                    and files.get(v) == entry.version_files.get(v)
                    and not config_needs_reload(rt.config, cfg)}
            fresh = []
            for v in versions:
                if v not in kept:
                    path = model_file(cfg, entry.directory, v, srv.backend_directory)
                    rt = ModelRuntime(srv, entry.name, v, cfg, cfg_json, entry.directory,
                                      model_source(cfg, entry.directory, v, path,
                                                   srv.backend_directory))
                    rt.namespace = rt.stats.namespace = entry.namespace
                    new[v] = rt
                    fresh.append(rt)
            _load_versions(fresh)
            for rt in kept.values():
                rt.update_instances(cfg, cfg_json)
        except Exception as caught:
            # Anything else is a bug of ours, but the model must still end UNAVAILABLE with a
            # reason (it stayed LOADING for ever, and the server not ready).
            exc = caught if isinstance(caught, TritonpyError) else InternalError(
                f"{type(caught).__name__}: {caught}")
            if exc is not caught:
                log.exception("loading model '%s' failed", entry.name)
            rolled_back: list[int] = []
            for rt in new.values():
                if rt.state == READY:
                    rt.unload(timeout=5)
                    rolled_back.append(rt.version)
            failed = _failed_versions(exc)
            if not old:
                entry.state = UNAVAILABLE
                entry.reason = exc.message
                config_error = isinstance(exc, (ConfigError, UnsupportedError))
                entry.unreadable = config_error and read is None
                entry.failed = failed
                entry.unlisted = False
                if config_error and not failed and read is not None:
                    tried = self._failed_after_poll(entry, *read)
                    entry.unlisted = tried is None
                    entry.failed = dict.fromkeys(tried or (), exc.message)
                    # Only a configuration that Triton's poll refuses makes no model of the
                    # server; past the poll (no version to load, a missing model file, a
                    # version that fails) the model counts against readiness, as in Triton.
                    entry.unreadable = tried == []
                # As Triton: the versions that loaded beside the one that failed were unloaded
                # again, and its index lists each of them so ("unloaded").
                entry.rolled_back = rolled_back if failed else []
            else:
                for v, why in failed.items():
                    if v in old:  # an update of a version that serves on: READY, with a reason
                        old[v].failed_update = why
            if old and any(v not in old for v in failed):
                # A reload whose new versions failed beside the ones serving on: as Triton,
                # the index lists them and the server is not ready until a load succeeds.
                entry.failed = {v: why for v, why in failed.items() if v not in old}
            if exc is caught:
                raise
            raise exc from caught
        entry.fingerprint = fingerprint(entry.directory) if entry.directory else ""
        entry.version_files = files
        serving = {**kept, **new}
        for rt in serving.values():
            rt.output_labels = labels
            rt.failed_update = ""
        gone = [rt for v, rt in old.items() if v not in kept]
        for rt in gone:  # what still reaches an old version goes to its replacement
            rt.successor = serving.get(rt.version) or (
                serving[max(serving)] if serving else None)
        # The counters of a version whose runtime is replaced go on (kept ones keep theirs);
        # those of a version the reload leaves out go, as with an unload.
        replaced = {rt.version: rt for rt in gone}
        for rt in new.values():
            srv.counter_carry.serving(rt.stats)
            prev = replaced.get(rt.version)
            if prev is not None and prev.stats.summaries is not None \
                    and rt.stats.summaries is not None:
                rt.stats.summaries = prev.stats.summaries  # they go on too, as Triton's
        for rt in gone:
            if rt.version not in serving:
                srv.counter_carry.unloaded(entry.namespace, entry.name, rt.version)
                entry.dropped[rt.version] = rt
        for v in serving:
            entry.dropped.pop(v, None)
        if gone:
            with self._lock:  # retiring before they leave the entry: always one or the other
                self._retiring_runtimes.update(gone)
        entry.runtimes = serving
        entry.state = READY
        entry.reason = ""
        entry.unreadable = False
        entry.failed = {}
        entry.rolled_back = []
        entry.unlisted = False
        if gone:  # the new versions serve already; the old ones finish up meanwhile
            self._in_background(self._retire, gone, name=f"{entry.name}-retire")
        if new:
            log.info("loaded model '%s' version(s) %s", entry.name, sorted(new))
        if kept:
            log.info("updated model '%s' version(s) %s in place", entry.name, sorted(kept))

    def _failed_after_poll(self, entry: ModelEntry, cfg: Any,
                           exists: bool) -> list[int] | None:
        """The versions of ``entry`` that Triton would have tried to load, and failed, when its
        configuration ``cfg`` (as read) did not load: none where Triton's poll of the
        repository refuses the configuration already (a missing one without auto-complete, a
        wrong name, a model-level setting out of range), so that the model never reaches
        Triton's model lifecycle and its index lists it by name alone; None where no version
        is there to load (Triton's index leaves such a folder out); else those its version
        policy names (a backend not found, a tensor's settings, a label file, an
        ``auto_complete_config`` that fails: Triton lists each version UNAVAILABLE, with the
        reason)."""
        from .config import normalize_config
        from .repository import available_versions, select_versions

        srv = self.server
        if not entry.directory or (not exists and not srv.auto_complete):
            return []
        try:
            versions = select_versions(cfg, available_versions(entry.directory))
        except TritonpyError:
            return None
        try:
            # Triton checks the tensors and the instance groups (a KIND_GPU group where there
            # is no GPU, measured), and reads label files, as a version loads, past its poll:
            # the rest of the configuration is what the poll refuses.
            polled = type(cfg)()
            polled.CopyFrom(cfg)
            for field in ("input", "output", "batch_input", "batch_output", "instance_group"):
                polled.ClearField(field)
            normalize_config(polled, entry.name, "", gpu_count=self.gpu_count())
        except TritonpyError:
            return []
        return versions

    def _auto_complete(self, entry: ModelEntry, cfg: Any, cfg_path: str) -> Any:
        """Run the model's ``auto_complete_config`` in a short-lived stub, if it has one."""
        from tritonpy.shm import Cmd

        from ._stubproc import StubProcess
        from .config import auto_complete_input, auto_completed, config_from_dict
        from .repository import available_versions, model_file, model_source

        versions = available_versions(entry.directory)
        if not versions:
            return cfg
        srv = self.server
        try:
            path = model_file(cfg, entry.directory, versions[-1], srv.backend_directory)
        except ConfigError:
            return cfg  # the load reports the missing file later, with its path
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                if "auto_complete_config" not in fh.read():
                    return cfg
        except OSError:
            return cfg  # model_file() reports the missing file later with its path
        d = auto_complete_input(cfg, entry.name, self.gpu_count())
        if srv.loads_cancelled:  # no new stub once the server is stopping
            raise load_cancelled()
        stub = StubProcess(f"{entry.name}_autocomplete", entry.name, srv.transport,
                           srv.options, srv.frames, on_frame=lambda s, m: None,
                           on_death=lambda s, r: None)
        try:
            srv.track_start(stub)  # a stop does not wait for its model.py to import
            stub.wait_hello(60)
            reply = stub.call(Cmd.AUTO_COMPLETE, {
                "config": d, **model_source(cfg, entry.directory, versions[-1], path,
                                            srv.backend_directory),
            }, timeout=60)
        except TritonpyError as exc:
            if srv.loads_cancelled:
                raise load_cancelled() from None
            raise type(exc)(version_failed(versions[-1], exc)) from exc
        finally:
            srv.untrack_start(stub)
            stub.stop(finalize=False, timeout=2)
        # Its errors name auto_complete_config, not a config.pbtxt that may not exist.
        return config_from_dict(reply["config"], auto_completed(entry.name))
