"""The substrate's exceptions; the host maps them onto Triton error codes in one place."""
from __future__ import annotations


class ShmError(Exception):
    """Base class of every error raised by :mod:`tritonpy.shm`."""


#: The reason of a ShmExhaustedError when the filesystem itself is full (not a pool's cap).
NO_SPACE = "no space left"


class ShmExhaustedError(ShmError, MemoryError):
    """Shared memory could not be reserved: /dev/shm is full or the pool's cap is reached."""

    def __init__(self, asked: int, free: int, where: str, reason: str = "") -> None:
        self.asked = asked
        self.free = free
        self.where = where
        self.reason = reason
        why = f" ({reason})" if reason else ""
        if reason == "pool cap":
            limit = "raise the pool cap (backend config shm-total-byte-cap)"
        elif "RLIMIT_FSIZE" in reason:  # (the reason names ulimit -f)
            limit = "raise that limit"
        elif where.rstrip("/") == "/dev/shm":
            limit = "raise the limit (e.g. docker --shm-size)"
        else:  # a fallback directory (shm-fallback-directory): its filesystem is full
            limit = f"free space on the filesystem of {where}"
        super().__init__(
            f"shared memory exhausted{why}: asked for {asked} bytes in {where}, "
            f"{free} bytes free; {limit} or send smaller tensors"
        )


class FdLimitError(ShmError, OSError):
    """A segment could not be opened or mapped: the process (or the system) has as many files
    open as it may. Each mapped segment, stub pipe and client connection holds one."""

    def __init__(self, what: str, system: bool = False) -> None:
        if system:
            why = "the system has as many files open as it allows (fs.file-max)"
        else:
            why = (f"this process has as many files open as RLIMIT_NOFILE allows "
                   f"({_nofile()})")
        super().__init__(
            f"{what}: {why}; raise the limit (ulimit -n, docker --ulimit nofile=...) or "
            "serve fewer connections or tensors at once")


def _nofile() -> str:
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return "its soft limit"
    return f"soft limit {soft}, hard limit {'unlimited' if hard < 0 else hard}"


class ChannelClosedError(ShmError, ConnectionError):
    """The peer process closed the channel or died."""


class ProtocolError(ShmError, ValueError):
    """A frame or a tensor handle from the peer is malformed or out of range."""


class SegmentGoneError(ProtocolError):
    """A peer's segment named in a handle is no longer in its directory: removed while in use
    (``rm /dev/shm/*``, or systemd's ``RemoveIPC=yes`` at the logout of the server's user).
    Its owner stops using it within a second (``Pool.drop_lost``)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"shared-memory segment {name} does not exist: it was removed from its directory "
            "while in use (rm, or systemd's RemoveIPC=yes at the logout of the server's user); "
            "its owner replaces it within a second")


class TruncatedElementError(ProtocolError):
    """A BYTES element whose length prefix says more than the buffer still holds."""

    def __init__(self, length: int, available: int) -> None:
        super().__init__(f"truncated BYTES tensor: element of {length} bytes runs past the end")
        self.length = length
        self.available = available
