"""The statistics and usage views of a :class:`~tritonpy.Server` that the frontends serve:
Triton's model statistics, the per-model Prometheus counters, failures and pending requests,
and the shared-memory usage of the host and of each stub.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tritonpy.shm import Cmd, Pool

from ._errors import InvalidArgumentError, TritonpyError

if TYPE_CHECKING:
    from ._options import BackendOptions
    from ._repo_manager import RepositoryManager
    from ._stats import CounterCarry

_USAGE_TIMEOUT_S = 0.5  # a stub's answer to USAGE (a metrics scrape waits for it)


class ServerStats:
    """Server's statistics views, as a mixin of :class:`~tritonpy.Server`'s: each reads the
    server's repository, counters and pool (its public methods are Server's API)."""

    # Server's state, set up in Server.__init__ (the pool: in start()).
    repo: RepositoryManager
    counter_carry: CounterCarry
    model_namespacing: bool
    options: BackendOptions
    pool: Pool

    if TYPE_CHECKING:  # ServerLifecycle's (_server_lifecycle.py)
        def _require_started(self) -> None: ...

    def statistics(self, name: str = "", version: str = "") -> dict:
        """Triton's ModelStatisticsResponse as JSON, for the versions loaded now: as in
        Triton, an unloaded version's statistics go with it (its next load starts at 0)."""
        self._require_started()
        runtimes = [rt for rt in self.repo.runtimes() if not name or rt.name == name]
        if name and self.model_namespacing:
            self.repo.find(name)  # two or more of that name: refused, in Triton's words
        # Triton's words and code (INVALID_ARG: HTTP 400), for the model, then the version.
        if name and not runtimes:
            raise InvalidArgumentError(f"requested model '{name}' is not available")
        if version:
            runtimes = [rt for rt in runtimes if str(rt.version) == str(version)]
            if name and not runtimes:
                raise InvalidArgumentError(
                    f"requested model version is not available for model '{name}'")
        return {"model_stats": [rt.stats.as_dict() for rt in runtimes]}

    def counters(self) -> list[dict]:
        """Per loaded model version, its Prometheus counters: the cumulative fields of its
        statistics (``inference_count``, ``execution_count``, ``inference_stats``) summed over
        the runtimes that served it since it was loaded. As in Triton, a reload that replaces
        the runtime restarts :meth:`statistics`, not these (see ``CounterCarry``)."""
        out = []
        for rt in self.repo.runtimes():
            counters = self.counter_carry.counters(rt.namespace, rt.name, rt.version)
            if counters is not None:  # None: unloaded since runtimes() was read
                out.append({"name": rt.name, "version": str(rt.version), **counters,
                            **self._namespace_of(rt.namespace)})
        return out

    def _namespace_of(self, namespace: str) -> dict[str, str]:
        """A model's namespace, with --model-namespacing (Triton's metrics then carry one)."""
        return {"namespace": namespace} if self.model_namespacing else {}

    def failures(self) -> list[dict]:
        """Per model version that was ever loaded, its failed requests by Triton's reason
        (``REJECTED``, ``CANCELED``, ``BACKEND``, ``OTHER``), summed over all its runtimes: as
        Triton's ``nv_inference_request_failure``, they outlive an unload and go on from their
        values at the next load."""
        return [{"name": name, "version": str(version), "reasons": reasons,
                 **self._namespace_of(namespace)}
                for namespace, name, version, reasons in self.counter_carry.failures()]

    def pending_requests(self) -> list[dict]:
        """Per loaded model version, the requests awaiting execution (Triton's
        ``nv_inference_pending_request_count``): queued, or sent behind a running execute."""
        out = []
        for rt in self.repo.runtimes():
            out.append({"name": rt.name, "version": str(rt.version), "count": rt.pending(),
                        **self._namespace_of(rt.namespace)})
        return out

    def shm_usage(self) -> list[dict]:
        """Usage of the host pool and of each stub's pool (named after its instance).

        Each stub reports its own (segments, mapped, used and peak bytes); one that does not
        answer within a moment (busy in C code holding its GIL, or dying) is described by its
        segments' sizes in the shm directory, with no ``used_bytes``.
        """
        out = [{"pool": "host", **self.pool.usage()}] if self.pool is not None else []
        if self.pool is None:
            return out
        reported: dict[str, dict] = {}
        for rt in self.repo.runtimes():
            for inst in rt.instances:
                stub = inst.stub
                if stub is None or not stub.alive:
                    continue
                try:
                    reply = stub.call(Cmd.USAGE, None, _USAGE_TIMEOUT_S)
                except TritonpyError:
                    continue
                reported[inst.name] = {k: int(reply[k]) for k in (
                    "segments", "mapped_bytes", "used_bytes", "peak_bytes") if k in reply}
        # Stub segments are named "<prefix><stub pid>x<token>_<n>" (shm.process_token).
        owners: dict[str, str] = {}
        for rt in self.repo.runtimes():
            for inst in rt.instances:
                stub = getattr(inst, "stub", None)
                if stub is not None:
                    owners[f"{self.options.shm_region_prefix_name}{stub.pid}x"] = inst.name
        directory = self.options.shm_fallback_directory or "/dev/shm"
        try:
            names = os.listdir(directory)
        except OSError:
            names = []
        pools = {inst: {"segments": 0, "mapped_bytes": 0} for inst in owners.values()}
        for name in names:
            owner = next((inst for start, inst in owners.items() if name.startswith(start)), None)
            if owner is None:
                continue
            try:
                size = os.stat(os.path.join(directory, name)).st_size
            except OSError:  # unlinked meanwhile
                continue
            pool = pools[owner]
            pool["segments"] += 1
            pool["mapped_bytes"] += size
        pools.update(reported)
        out.extend({"pool": inst, **usage} for inst, usage in sorted(pools.items()))
        return out
