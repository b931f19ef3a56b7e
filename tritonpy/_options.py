"""Backend options, named as Triton's Python backend names them (``--backend-config=python,k=v``)."""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from .shm import waiting
from .shm.segment import PAGE, SHM_DIR, total_bytes
from ._errors import InvalidArgumentError
from ._loop import STALL_S

MiB = 1 << 20
#: ``bls-spin-microseconds`` where "auto" polls (see :meth:`BackendOptions.bls_spin_us`).
BLS_SPIN_US = 200.0

#: Settings Triton 2.51's python backend takes that mean nothing here: key -> (least value,
#: why). A command line that gives one runs (its value checked as Triton checks it); it
#: changes nothing, and ``tritonpy serve`` says so in a warning.
TRITON_NO_EFFECT: dict[str, tuple[int, str]] = {
    "thread-pool-size": (1, "tritonpy's python backend has no such thread pool"),
    "default-max-batch-size": (0, "a python model's max_batch_size is its config's or its "
                                  "auto_complete_config's"),
}


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """The host's knobs for stubs and shared memory."""

    shm_default_byte_size: int = 16 * MiB
    shm_growth_byte_size: int = 16 * MiB
    shm_region_prefix_name: str = "tritonpy_"
    stub_timeout_seconds: float = 30.0
    shm_message_queue_size: int = 1000
    shm_total_byte_cap: int = 0  # 0: no cap beyond /dev/shm itself
    shm_fallback_directory: str = ""  # file-backed mmap here instead of /dev/shm
    stub_stderr_lines: int = 20
    restart_backoff_seconds: float = 0.2
    execution_env_path: str = ""
    # How long a model thread waiting in a sync BLS call (exec() of a default-mode request)
    # polls for the reply before it sleeps; 0 turns polling off; None ("auto"): see
    # bls_spin_us().
    bls_spin_microseconds: float | None = None
    # How long a stub with nothing to run polls for its next request before it sleeps, while
    # its recent requests came within that time; 0 turns polling off.
    idle_spin_microseconds: float = 1000.0
    # An instance of a sync default-mode model without a batcher whose recent executes took
    # less than this on average gets its next request while its execute runs; 0 turns it off.
    execute_prefetch_microseconds: float = 1000.0
    # An event loop of the host, or of a stub's async def execute, that runs nothing for this
    # long is logged with where its thread is; 0 turns the watch off.
    loop_stall_seconds: float = STALL_S

    def bls_spin_us(self) -> float:
        """The ``bls-spin-microseconds`` in effect. Given, it is taken as it is; "auto" (the
        default) is :data:`BLS_SPIN_US` where the caller's polling pays, else 0.

        A sync BLS call has three processes on its path: the caller's stub, the host and the
        target's stub, and the last two poll while idle (``idle-spin-microseconds``). A caller
        that polls too pays only where each of the three can have a CPU of its own: with two
        CPUs, its polls took CPU from the host and the target (a 16 B call took 99-108 µs
        polling, 71-84 µs sleeping). Where the host and the stubs do not poll (idle-spin 0),
        the caller's polls spare it the CPU wake-up of each reply, and pay on two CPUs too."""
        if self.bls_spin_microseconds is not None:
            return self.bls_spin_microseconds
        if waiting._CPUS >= 3 or self.idle_spin_microseconds == 0:
            return BLS_SPIN_US
        return 0.0

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, str] | None) -> BackendOptions:
        """Options from ``{"shm-default-byte-size": "1048576", ...}`` (dashes or underscores)."""
        kw: dict[str, object] = {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, raw in (cfg or {}).items():
            ignored = TRITON_NO_EFFECT.get(key.replace("_", "-"))
            if ignored is not None:
                try:
                    valid = int(raw) >= ignored[0]
                except ValueError:
                    valid = False
                if not valid:
                    raise InvalidArgumentError(
                        f"backend option '{key}' expects an integer >= {ignored[0]}, got {raw!r}")
                continue
            name = key.replace("-", "_")
            if name == "shm_total_cap":
                name = "shm_total_byte_cap"
            f = fields.get(name)
            if f is None:
                raise InvalidArgumentError(
                    f"unknown backend option '{key}'; known: "
                    + ", ".join(sorted(n.replace("_", "-") for n in fields))
                )
            if name == "bls_spin_microseconds" and str(raw).strip().lower() == "auto":
                kw[name] = None
                continue
            try:
                if f.type in ("int", int):
                    kw[name] = int(raw)
                elif f.type in ("float", float, "float | None"):
                    kw[name] = float(raw)
                else:
                    kw[name] = str(raw)
            except ValueError:
                raise InvalidArgumentError(
                    f"backend option '{key}' expects a number, got {raw!r}"
                ) from None
        opts = cls(**kw)  # type: ignore[arg-type]
        if opts.shm_default_byte_size <= 0 or opts.shm_growth_byte_size <= 0:
            raise InvalidArgumentError("shm-default-byte-size and shm-growth-byte-size must be > 0")
        spin = opts.bls_spin_microseconds
        if spin is not None and not 0 <= spin <= 1e6:
            raise InvalidArgumentError("bls-spin-microseconds must be between 0 and 1000000, "
                                       f"got {opts.bls_spin_microseconds:g}")
        if not 0 <= opts.idle_spin_microseconds <= 1e6:
            raise InvalidArgumentError("idle-spin-microseconds must be between 0 and 1000000, "
                                       f"got {opts.idle_spin_microseconds:g}")
        if not 0 <= opts.execute_prefetch_microseconds <= 1e9:
            raise InvalidArgumentError("execute-prefetch-microseconds must be between 0 and "
                                       f"1000000000, got {opts.execute_prefetch_microseconds:g}")
        if opts.loop_stall_seconds < 0:
            raise InvalidArgumentError(
                f"loop-stall-seconds must be >= 0, got {opts.loop_stall_seconds:g}")
        if not opts.shm_region_prefix_name.replace("_", "a").replace("-", "a").isalnum():
            raise InvalidArgumentError(
                f"shm-region-prefix-name must be letters, digits, '-' or '_': "
                f"{opts.shm_region_prefix_name!r}"
            )
        if opts.shm_total_byte_cap < 0 or 0 < opts.shm_total_byte_cap < PAGE:
            raise InvalidArgumentError(f"shm-total-byte-cap must be 0 (no cap) or at least "
                                       f"{PAGE} bytes (a page), got {opts.shm_total_byte_cap}")
        return opts

    def check_shm(self) -> None:
        """What a start checks of the shared memory it is about to use: the fallback directory
        exists, and a segment of the default or growth size can exist there at all (else the
        first one would be halved until it fits, taking most of it, and slowly)."""
        directory = self.shm_fallback_directory or None
        if directory is not None and not os.path.isdir(directory):
            raise InvalidArgumentError(f"shm-fallback-directory {directory!r} is not a "
                                       "directory")
        where = directory or SHM_DIR
        total = total_bytes(directory)
        for key, size in (("shm-default-byte-size", self.shm_default_byte_size),
                          ("shm-growth-byte-size", self.shm_growth_byte_size)):
            if size > total:
                raise InvalidArgumentError(
                    f"{key} ({size} bytes) is larger than all of {where} ({total} bytes): no "
                    f"segment that size can exist there; give a smaller size"
                    + (" or a larger /dev/shm (e.g. docker --shm-size)" if directory is None
                       else ""))
