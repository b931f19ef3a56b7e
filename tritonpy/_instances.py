"""Model instances: the ones a config asks for (planned as Triton plans its instance groups
and compares them in an in-place instance update), and :class:`Instance`, one instance's stub
and the work it holds.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from tritonclient.grpc.model_config_pb2 import ModelInstanceGroup

if TYPE_CHECKING:
    from ._model import ModelRuntime
    from ._request import HostRequest
    from ._stubproc import StubProcess

_KINDS = {0: "AUTO", 1: "GPU", 2: "CPU", 3: "MODEL"}


def initialize_args(config_json: str, kind: str, instance_name: str, device_id: int,
                    model_dir: str, version: int, model_name: str) -> dict[str, str]:
    """The ``args`` of ``initialize(args)``: exactly Triton's keys, all strings."""
    return {
        "model_config": config_json,
        "model_instance_kind": kind,
        "model_instance_name": instance_name,
        "model_instance_device_id": str(device_id),
        "model_repository": model_dir,
        "model_version": str(version),
        "model_name": model_name,
    }


def instance_signature(group: Any) -> bytes:
    """What makes two instances alike, as Triton's instance update compares them: the group
    without its name and count."""
    g = type(group)()
    g.CopyFrom(group)
    g.ClearField("name")
    g.ClearField("count")
    return g.SerializeToString(deterministic=True)


def plan_instances(config: Any, model_name: str) -> list[tuple[str, str, int, bytes]]:
    """The instances ``config`` asks for: (name, kind, device id, signature) each."""
    out: list[tuple[str, str, int, bytes]] = []
    for group in config.instance_group:
        kind = _KINDS.get(int(group.kind), "CPU")
        sig = instance_signature(group)
        devices = list(group.gpus) if kind == "GPU" and group.gpus else [0]
        for dev in devices if kind == "GPU" else [0]:
            for _ in range(max(1, group.count)):
                idx = len([x for x in out if x[0].startswith(group.name + "_")])
                out.append((f"{group.name}_{idx}", kind, dev, sig))
    if not out:
        out.append((f"{model_name}_0_0", "CPU", 0, b""))
    return out


def config_needs_reload(old: Any, new: Any) -> bool:
    """Whether a loaded version with config ``old`` must be reloaded to serve ``new``: as
    Triton's check, whether they differ in more than instance groups and version policy."""
    a, b = type(old)(), type(new)()
    a.CopyFrom(old)
    b.CopyFrom(new)
    for c in (a, b):
        c.ClearField("instance_group")
        c.ClearField("version_policy")
    return bool(a != b)
class Instance:
    """One model instance: a stub process and what it is executing.

    Its ``state`` is STARTING, READY, RESTARTING, RETIRING (removed by an instance update: it
    takes no new work and stops once what it holds is done) or STOPPED.
    """

    def __init__(self, model: ModelRuntime, name: str, kind: str, device_id: int,
                 signature: bytes = b"") -> None:
        self.model = model
        self.name = name
        self.kind = kind
        self.device_id = device_id
        self.signature = signature
        self.state = "STARTING"
        self.stub: StubProcess | None = None
        self.capacity = 1
        self.running = 0
        # Prefetch (backend option execute-prefetch-microseconds): a sync default-mode instance
        # of a model without a batcher takes its next request while its execute still runs, as
        # long as its recent executes were short; the stub runs it right after, with no
        # round trip to the host in between. 0: off for this instance.
        self.prefetch_ns = 0
        self.exec_mean_ns = 0.0  # moving mean of its recent executes' durations
        self.last_done_ns = 0  # when its last execute was done (a prefetched one starts then)
        self.held_back = False  # its stub gave one back: no more until its execute is done
        self.inflight: dict[int, tuple[list[HostRequest], int, int]] = {}
        self.active: dict[int, HostRequest] = {}
        self.waiting_on: set[HostRequest] = set()  # sync BLS calls this instance blocks on
        self.bls_calls: dict[int, HostRequest] = {}  # call id -> request, for BLS_CANCEL
        self._exec_ids = 0
        self.restarts = 0
        self.started_at = time.monotonic()  # when its stub last started (see _model.CRASH_LOOP_S)
        self.crash_loop = 0  # its deaths in a row soon after a start, for the back-off
        self.attempt = 0  # restart attempts ever made: a stale attempt's bound does nothing
        self.restarter: threading.Thread | None = None  # the restart of its dead stub
        self.has_is_ready = False
        # The rate limiter (see _ratelimit): the resources it needs, ((name, device), count)
        # each (none: it is not limited), its priority and its executes so far (their product
        # orders the instances that wait); whether it holds them for its execute, or has them
        # reserved.
        self.limits: tuple = ()
        self.priority = 1
        self.executes = 0
        self.holding = False
        self.reserved = False
        # Of a ``passive: true`` group: initialized (and warmed up) but never given a request
        # by the server, as in Triton.
        self.passive = bool(signature) and ModelInstanceGroup.FromString(signature).passive

    def admitted(self) -> bool:
        """Whether the rate limiter lets it start an execute now (always, where it is not
        limited). A limited instance runs one execute at a time (no prefetch)."""
        return not self.limits or (not self.running and self.model.server.limiter.admits(self))

    def free(self) -> bool:
        if self.state != "READY" or self.passive:
            return False
        if self.limits:
            return self.admitted()
        if self.running < self.capacity:
            return True
        # One request more while a short execute runs, unless that execute waits on the
        # server (a BLS call, model loading): the request could be what it waits for.
        return (self.running == 1 and self.exec_mean_ns < self.prefetch_ns
                and not self.held_back and not self.waiting_on)

    def next_exec_id(self) -> int:
        self._exec_ids += 1
        return self._exec_ids


def take_back(active: dict[int, HostRequest], batch: list[HostRequest]) -> list[HostRequest]:
    """Requests an instance was sent but never ran: no longer its (``active``); returns
    those still waiting for their answer, to queue again."""
    for req in batch:
        active.pop(req.id, None)
        req.instance = None
    return [req for req in batch if not req.done]

