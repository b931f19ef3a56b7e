"""``tritonpy serve`` as a subprocess, for the tests that run the command itself.

The ``serve`` fixture (``conftest.py``) starts them; each is killed with its process group when
its test ends, whatever happened.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

import psutil
from _models import wait_until

from tritonpy.shm import janitor

START_TIMEOUT = 60.0

#: ``python -m tritonpy`` that dies with the test process (PR_SET_PDEATHSIG), even when that is
#: killed and no fixture's clean-up runs: its janitor then removes its segments, its stubs die
#: with it. A server started by a test run killed from outside used to serve on for ever.
_DIE_WITH_TEST = (
    "import ctypes, os, runpy, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    f"if os.getppid() != {os.getpid()}: sys.exit('the test process is gone')\n"
    "runpy.run_module('tritonpy', run_name='__main__', alter_sys=True)\n")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports the OS just handed out (held together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()



class Serve:
    """A ``tritonpy serve`` subprocess; its output goes to a log file the test can read."""

    def __init__(self, args: list[str], prefix: str, workdir: Path) -> None:
        self.prefix = prefix
        self.log_path = workdir / f"serve-{prefix}.log"
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-c", _DIE_WITH_TEST, "serve", "--http-address", "127.0.0.1",
               "--grpc-address", "127.0.0.1",
               f"--backend-config=python,shm-region-prefix-name={prefix}", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=workdir,
                                     start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def endpoints(self) -> dict[str, str]:
        """The ``listening:`` lines the server logs, once all three are there."""
        def found() -> dict[str, str] | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"tritonpy serve exited with {self.proc.returncode}:\n{self.log()}")
            got = dict(re.findall(r"listening: (HTTP|gRPC|metrics) (\S+)", self.log()))
            return got if len(got) == 3 else None
        return wait_until(found, START_TIMEOUT, "tritonpy serve to listen")

    def stubs(self) -> list[psutil.Process]:
        """Its live stub processes (not its janitor)."""
        return janitor.stubs_of(self.proc.pid)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        else:
            # The server is gone; reap anything of its group still around (a leaked stub).
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()


def serve_repo(serve: Callable[..., Serve], repo: Path, *flags: str) -> tuple[Serve, int, int]:
    """``tritonpy serve`` of ``repo`` on free ports, listening: (server, HTTP port, gRPC port)."""
    http_port, grpc_port, metrics_port = free_ports(3)
    server = serve("--model-repository", str(repo), "--http-port", str(http_port),
                   "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), *flags)
    server.endpoints()
    return server, http_port, grpc_port
