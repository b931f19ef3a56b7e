"""Entry point of a stub process: ``python -m tritonpy.stub <socket-fd> <options-json>``."""
from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import signal
import socket
import sys


def _die_with_parent(parent: int) -> None:
    # PR_SET_PDEATHSIG: the kernel kills us when the host dies, even by SIGKILL.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the host died before prctl took effect
        os._exit(0)


def _dropped_signal(signum: int, frame: object) -> None:
    """A SIGINT or SIGTERM to the stub: for the host (see main)."""


def main() -> int:
    fd = int(sys.argv[1])
    options = json.loads(sys.argv[2])
    # Model code sees the argv of Triton's embedded interpreter, not our socket and options:
    # ``unittest.main(...)`` inside execute, or argparse at import, would read them.
    sys.argv = [""]
    _die_with_parent(int(options.get("host_pid", os.getppid())))
    # As Triton's stub: a Ctrl-C (SIGINT to the whole process group) or a group SIGTERM is for
    # the host, which drains in-flight requests and then finalizes and stops every stub; a stub
    # that died of it would fail the very requests the host is draining. Caught and dropped,
    # not ignored: a program the model runs gets them back at its exec (an ignored one keeps
    # them ignored, and the model's Popen.terminate() would not end it), and a process the
    # model forks gets SIGTERM back (see StubRuntime._after_fork_in_child).
    signal.signal(signal.SIGINT, _dropped_signal)
    signal.signal(signal.SIGTERM, _dropped_signal)
    # A crash in native code (a segfault in a library the model calls) prints the Python stack
    # of the thread that crashed to stderr, whose last lines the host puts in the error of
    # every request the stub had: it says which line of model.py it was. (Triton's stub dies
    # without a word.) That thread only: the tail keeps a few lines.
    faulthandler.enable(all_threads=False)
    # ``kill -USR1 <stub pid>``: where every thread of the model is (into the host's log,
    # tagged with the model and instance), and the stub goes on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    sock = socket.socket(fileno=fd)
    from ._runtime import StubRuntime

    return StubRuntime(sock, options).run()


if __name__ == "__main__":
    sys.exit(main())
