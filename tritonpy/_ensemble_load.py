"""Loading an ensemble (:func:`load_ensemble`): the step models are loaded first (explicit
mode loads them as dependencies, as Triton does), then the ensemble is checked against their
completed configurations (:func:`._ensemble_config.validate_ensemble`), and the ensemble is
decoupled when any of its steps is. Also which step models an unload with
``unload_dependents`` takes with the ensemble (:func:`step_models_to_unload`), and the order
in which a stop unloads ensembles (:func:`ensembles_outermost_first`).
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Sequence

from ._ensemble import EnsembleRuntime
from ._ensemble_config import validate_ensemble
from ._errors import InvalidArgumentError, TritonpyError

if TYPE_CHECKING:
    from ._repo_entry import ModelEntry
    from ._repo_manager import RepositoryManager

log = logging.getLogger("tritonpy.ensemble")

# Ensembles being loaded by this thread, outermost first (circular dependency detection).
_loading = threading.local()


# ---------------------------------------------------------------------------- dependencies


def ensure_step_loaded(repo: RepositoryManager, ensemble: str, name: str,
                       namespace: str = "") -> None:
    """Make sure step model ``name`` of ``ensemble`` is loaded, loading it if that is allowed.

    Explicit mode loads a missing step model as a dependency (as Triton does); in the other
    modes every model was already tried at start-up, so a step model without a loaded version
    fails the ensemble with that model's reason. An ensemble met again while it is itself being
    loaded is a circular dependency.
    """
    try:  # with namespacing: the one of the ensemble's repository, else the only one
        entry: ModelEntry | None = repo.find(name, namespace) if repo.namespacing \
            else repo.entries.get(name)
    except TritonpyError:
        entry = None
    stack: list[str] = getattr(_loading, "stack", [])  # the keys of the ensembles loading
    key = entry.key if entry is not None else name
    if key in stack:
        last_entry = repo.entries.get(stack[-1])
        last = last_entry.name if last_entry is not None else stack[-1]
        raise InvalidArgumentError(
            f"circular dependency between ensembles: {name} -> ... -> {last} -> {name}")
    if entry is None:
        raise InvalidArgumentError(
            f"ensemble {ensemble} contains models that are not available or ambiguous: {name}")
    with entry.lock:  # waits for a load of that model already under way
        if entry.runtimes:
            return
        never_tried = entry.reason == "unloaded"
        if repo.server.model_control_mode != "explicit" and not never_tried:
            raise InvalidArgumentError(
                f"ensemble '{ensemble}' depends on '{name}' which has no loaded version. "
                f"Model '{name}' loading failed with error: {entry.reason}")
        try:
            repo.without_files(entry)  # as a load of it without files would
            repo._load_entry(entry, None)
        except TritonpyError as exc:
            raise InvalidArgumentError(
                f"ensemble '{ensemble}' depends on '{name}' which has no loaded version. "
                f"Model '{name}' loading failed with error: {exc.message}") from None


class _LoadingGuard:
    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        stack = getattr(_loading, "stack", None)
        if stack is None:
            stack = _loading.stack = []
        stack.append(self.name)

    def __exit__(self, *exc: Any) -> None:
        _loading.stack.pop()


# ---------------------------------------------------------------------------- loading


def step_models_to_unload(repo: RepositoryManager, name: str) -> list[str]:
    """The models that unloading ensemble ``name`` with ``unload_dependents`` also unloads.

    Its step models (and theirs, for nested ensembles), except those that another loaded
    ensemble still runs and those a load asked for by name (Triton keeps both). Empty for a
    model that is not a loaded ensemble.
    """
    def steps_of(model: str) -> set[str]:  # by key
        entry = repo.entries.get(model)
        rts = list(entry.runtimes.values()) if entry is not None else []
        keys = {repo.step_key(st.model, rt.namespace) for rt in rts
                if isinstance(rt, EnsembleRuntime) for st in rt.steps}
        return {k for k in keys if k is not None}

    def requested(model: str) -> bool:
        entry = repo.entries.get(model)
        return entry is not None and entry.requested

    closure: set[str] = set()
    todo = list(steps_of(name))
    while todo:
        model = todo.pop()
        if model not in closure and model != name and not requested(model):
            closure.add(model)
            todo.extend(steps_of(model))
    kept: set[str] = set()  # everything the other ensembles run, directly or nested
    todo = [s for other in repo.entries if other != name and other not in closure
            for s in steps_of(other)]
    while todo:
        model = todo.pop()
        if model not in kept:
            kept.add(model)
            todo.extend(steps_of(model))
    return sorted(closure - kept)


def load_ensemble(repo: RepositoryManager, entry: ModelEntry, cfg: Any,
                  versions: Sequence[int]) -> dict[int, EnsembleRuntime]:
    """Runtimes for the ensemble's versions, after loading and checking its step models.

    Args:
        repo: The repository manager (to find and, in explicit mode, load step models).
        entry: The ensemble's repository entry (its lock is held by the caller).
        cfg: The ensemble's normalised configuration.
        versions: The versions selected by its version policy.
    """
    from .config import config_to_json

    name = entry.name
    with _LoadingGuard(entry.key):
        for step in cfg.ensemble_scheduling.step:
            ensure_step_loaded(repo, name, step.model_name, entry.namespace)
    configs = []
    for step in cfg.ensemble_scheduling.step:
        try:
            rt = repo.runtime(step.model_name, int(step.model_version), near=entry.namespace)
        except TritonpyError:
            raise InvalidArgumentError(
                f"ensemble '{name}' depends on '{step.model_name}' whose required version "
                f"{step.model_version} is not loaded.") from None
        configs.append(rt.config)
    # As Triton: an ensemble's config always has its transaction policy (decoupled when a
    # step is), where a plain model's has it only when set.
    decoupled = validate_ensemble(cfg, configs)
    if decoupled and cfg.response_cache.enable:  # as Triton 2.51 (it was loaded, never cached)
        raise InvalidArgumentError(
            f"Response Cache does not currently support model {name} with 'decoupled' "
            "transaction policy. Please disable the response cache.")
    cfg.model_transaction_policy.SetInParent()
    cfg.model_transaction_policy.decoupled = decoupled
    cfg_json = config_to_json(cfg)
    out: dict[int, EnsembleRuntime] = {}
    for v in versions:
        ens_rt = EnsembleRuntime(repo.server, name, v, cfg, cfg_json, entry.directory)
        ens_rt.namespace = ens_rt.stats.namespace = entry.namespace
        ens_rt.load()
        out[v] = ens_rt
    log.info("ensemble '%s': %d step(s) over %s%s", name, len(cfg.ensemble_scheduling.step),
             sorted({s.model_name for s in cfg.ensemble_scheduling.step}),
             " (decoupled)" if decoupled else "")
    return out


def ensembles_outermost_first(entries: list[ModelEntry]) -> list[list[ModelEntry]]:
    """The loaded ensembles among ``entries`` in layers: the first holds those that no other
    of them runs as a step, the next those that only the first run, and so on."""
    left = [e for e in entries
            if any(isinstance(rt, EnsembleRuntime) for rt in e.runtimes.values())]
    layers = []
    while left:
        used = {step.model for e in left for rt in e.runtimes.values()
                if isinstance(rt, EnsembleRuntime) for step in rt.steps}
        layer = [e for e in left if e.name not in used] or left  # (a cycle: all at once)
        layers.append(layer)
        left = [e for e in left if e not in layer]
    return layers
