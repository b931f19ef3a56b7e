"""Start and stop the servers that the benchmarks compare, on free ports.

Two kinds, one interface (a context manager):

* :class:`TritonServer` — the real ``tritonserver`` 2.51 with its Python backend, from the
  anchor venv that ``scripts/install_anchor.sh`` builds (see ``/work/shared/ANCHOR.md``);
* :class:`TritonpyServer` — ``python -m tritonpy serve`` with the same flags.

Each server gets its own process group and its own ``shm-region-prefix-name``, so that
``stop()`` can kill every process it started (server and stubs) and unlink every shm region
it left in ``/dev/shm`` — the real Triton leaves its regions behind when it is killed.

Example::

    with TritonServer(BENCH_MODELS) as server:
        client = tritonclient.http.InferenceServerClient(server.http_url)
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import glob
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TypeVar

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_MODELS = Path(__file__).resolve().parent / "bench_models"
DEFAULT_ANCHOR_DIR = Path(os.environ.get("TRITONPY_ANCHOR_DIR", REPO_ROOT / ".anchor"))
ANCHOR_MISSING = "anchor not installed: run scripts/install_anchor.sh"
BEST_SHM = {"shm-default-byte-size": "268435456", "shm-growth-byte-size": "67108864"}

_counter = itertools.count()
_live: set[_Server] = set()
S = TypeVar("S", bound="_Server")


class ServerStartError(RuntimeError):
    """The server exited or did not become ready in time; the message ends with its log."""


def free_ports(count: int) -> list[int]:
    """Ports the kernel reports free now (all bound at once so that they differ)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_SERVER_EXES = {"tritonserver", "triton_python_backend_stub"}


def _dead_owner(name: str) -> bool:
    """Whether the benchmark pid embedded in ``...tpbench_<pid>_...`` is gone."""
    pid_text = name.split("tpbench_", 1)[1].split("_", 1)[0]
    if not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def sweep_orphans() -> list[str]:
    """Kill the leftover processes and unlink the ``/dev/shm`` entries of dead benchmarks.

    Names carry the creating benchmark's pid (``tpbench_<pid>_...``: the shm prefix, which
    also appears on every stub's command line, and ``sem.tpbench_...`` for semaphores). When a
    benchmark is SIGKILLed its server dies with it (PR_SET_PDEATHSIG), but the real Triton's
    stubs can outlive their server and its regions stay in ``/dev/shm``.
    """
    removed = []
    for proc in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(proc, "rb") as f:
                cmdline = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        argv = cmdline.split("\0")
        # Only server-side processes: never a shell or tool that merely names our prefix.
        if os.path.basename(argv[0]) not in _SERVER_EXES and not any("tritonpy" in a for a in argv[1:3]):
            continue
        for arg in argv:
            if "tpbench_" in arg and _dead_owner(arg):
                pid = int(proc.split("/")[2])
                log.info("killing orphaned server process %d", pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                    removed.append(f"pid {pid}")
                except (ProcessLookupError, PermissionError):
                    pass
                break
    for path in glob.glob("/dev/shm/tpbench_*") + glob.glob("/dev/shm/sem.tpbench_*"):
        if not _dead_owner(os.path.basename(path)):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    if removed:
        log.info("removed orphans of dead benchmarks: %s", ", ".join(removed))
    return removed


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it if the benchmark process dies, so that a
    crashed benchmark does not leave a server holding ports and shm."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _Server:
    """Common lifecycle: spawn in a new session, poll readiness, stop, sweep shm."""

    kind = "server"

    def __init__(
        self,
        repo: str | os.PathLike[str],
        backend_config: dict[str, str] | None = None,
        args: Sequence[str] = (),
        ready_timeout: float = 120.0,
    ) -> None:
        """Describe a server; nothing starts before :meth:`start` (or ``with``).

        Args:
            repo: the model repository.
            backend_config: Python-backend options, passed as ``--backend-config=python,k=v``.
            args: extra command-line flags, e.g. ``["--model-control-mode=explicit"]``.
            ready_timeout: seconds to wait for ``/v2/health/ready``.
        """
        self.repo = Path(repo).resolve()
        self.backend_config = dict(backend_config or {})
        self.args = list(args)
        self.ready_timeout = ready_timeout
        # A per-server prefix keeps two servers' regions apart and lets stop() find ours.
        self.shm_prefix = f"tpbench_{os.getpid()}_{next(_counter)}_"
        self.backend_config.setdefault("shm-region-prefix-name", self.shm_prefix)
        self.shm_prefix = self.backend_config["shm-region-prefix-name"]
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.start_to_ready_seconds = float("nan")
        self.process: subprocess.Popen[bytes] | None = None
        self._log_path: str | None = None

    # -- addresses -------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """``host:port`` of the KServe v2 HTTP endpoint, as tritonclient wants it."""
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC endpoint."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """``host:port`` of the Prometheus metrics endpoint (path ``/metrics``)."""
        return f"127.0.0.1:{self.metrics_port}"

    # -- to be provided by each kind -------------------------------------------------------
    def command(self) -> list[str]:
        """The argv to run."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """The environment to run it in."""
        return dict(os.environ)

    def cwd(self) -> str | None:
        """The working directory to run it in."""
        return None

    def _common_flags(self) -> list[str]:
        flags = [
            f"--model-repository={self.repo}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
        ]
        flags += [f"--backend-config=python,{k}={v}" for k, v in self.backend_config.items()]
        return flags + self.args

    # -- lifecycle -------------------------------------------------------------------------
    def start(self: S) -> S:
        """Spawn the server and block until ``/v2/health/ready`` answers 200.

        Raises:
            ServerStartError: it exited, or was not ready within ``ready_timeout``; the
                server is stopped and cleaned up before this is raised.
        """
        sweep_orphans()
        fd, self._log_path = tempfile.mkstemp(prefix=f"tpbench-{self.kind}-", suffix=".log")
        cmd = self.command()
        log.info("starting %s: %s", self.kind, " ".join(cmd))
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as log_file:
            self.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,  # a file, not a pipe: a chatty server must never block
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=self.cwd(),
                start_new_session=True,  # its own process group: stop() kills stubs too
                preexec_fn=_die_with_parent,
            )
        _live.add(self)
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop(keep_log=True)
            raise
        self.start_to_ready_seconds = time.perf_counter() - t0
        log.info("%s ready in %.2f s (http %s)", self.kind, self.start_to_ready_seconds, self.http_url)
        return self

    def _wait_ready(self, t0: float) -> None:
        assert self.process is not None
        url = f"http://{self.http_url}/v2/health/ready"
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(f"exited with code {code}: {self._reason()}{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass  # not listening yet, or listening but not ready (HTTP 400)
            if time.perf_counter() - t0 > self.ready_timeout:
                raise ServerStartError(f"not ready after {self.ready_timeout:.0f} s: {self._reason()}{self.log_tail()}")
            time.sleep(0.02)  # fine-grained: start_to_ready_seconds is a benchmark figure

    def _log_lines(self) -> list[str]:
        if not self._log_path or not os.path.exists(self._log_path):
            return []
        with open(self._log_path, "rb") as f:
            text = f.read()[-16384:].decode("utf-8", "replace")
        # Triton's option tables (lines of | and +) say nothing about a failure.
        return [ln.rstrip() for ln in text.splitlines() if ln.strip() and ln.lstrip()[:1] not in "|+"]

    def log_tail(self, lines: int = 12) -> str:
        """The last lines of the server's output (tables dropped), for error messages."""
        tail = self._log_lines()[-lines:]
        return f"\n    log {self._log_path}:\n    " + "\n    ".join(tail) if tail else ""

    def _reason(self) -> str:
        """The last line of the log that looks like an error, else the last line."""
        lines = self._log_lines()
        harmless = ("NVML", "DCGM", "CudaDriverHelper")
        errors = [
            ln for ln in lines
            if any(w in ln.lower() for w in ("error", "exception", "failed", "no module"))
            and not any(h in ln for h in harmless)
        ]
        line = (errors or lines or ["no output"])[-1].strip()
        return line if len(line) <= 300 else line[:297] + "..."

    def stop(self, timeout: float = 15.0, keep_log: bool = False) -> None:
        """Stop the server, then kill anything left in its process group and unlink its
        shm regions. Safe to call twice."""
        proc, self.process = self.process, None
        _live.discard(self)
        if proc is not None:
            # SIGTERM to the server alone: it finalizes its own stubs; signalling the whole
            # group at once would kill the stubs under it and turn shutdown into errors.
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not exit within %.0f s: SIGKILL", self.kind, timeout)
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers: stubs, or a hung server
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            self._wait_group_gone(proc.pid)
        for path in glob.glob(f"/dev/shm/{glob.escape(self.shm_prefix)}*"):
            log.info("removing leftover shm region %s", path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if self._log_path and not keep_log:
            try:
                os.unlink(self._log_path)
            except FileNotFoundError:
                pass

    @staticmethod
    def _wait_group_gone(pgid: int, timeout: float = 5.0) -> None:
        # A stub may hold a region open until it dies; sweep shm only after the group is gone.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.02)

    def __enter__(self: S) -> S:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class TritonServer(_Server):
    """The real Triton 2.51 (``tritonserver`` from the nvidia-pytriton wheel)."""

    kind = "triton"

    def __init__(
        self,
        repo: str | os.PathLike[str],
        backend_config: dict[str, str] | None = None,
        anchor_dir: str | os.PathLike[str] = DEFAULT_ANCHOR_DIR,
        args: Sequence[str] = (),
        ready_timeout: float = 120.0,
    ) -> None:
        """See :class:`_Server`; ``anchor_dir`` is the venv built by install_anchor.sh."""
        super().__init__(repo, backend_config, args, ready_timeout)
        self.anchor_dir = Path(anchor_dir).resolve()

    @staticmethod
    def _site(anchor_dir: Path) -> Path | None:
        found = sorted(anchor_dir.glob("lib/python3*/site-packages/pytriton/tritonserver"))
        return found[-1].parent.parent if found else None

    @classmethod
    def available(cls, anchor_dir: str | os.PathLike[str] = DEFAULT_ANCHOR_DIR) -> bool:
        """Whether the anchor is installed: server binary and the stub beside the backend."""
        site = cls._site(Path(anchor_dir).resolve())
        if site is None:
            return False
        ts = site / "pytriton" / "tritonserver"
        return (ts / "bin" / "tritonserver").exists() and (
            ts / "backends" / "python" / "triton_python_backend_stub"
        ).exists()

    def command(self) -> list[str]:
        """``tritonserver`` with the backend directory and our flags."""
        site = self._site(self.anchor_dir)
        if site is None or not self.available(self.anchor_dir):
            raise ServerStartError(ANCHOR_MISSING)
        ts = site / "pytriton" / "tritonserver"
        # A short exit timeout: the benchmarks never stop a server with work in flight.
        return [str(ts / "bin" / "tritonserver"), f"--backend-directory={ts / 'backends'}",
                "--exit-timeout-secs=5", *self._common_flags()]

    def cwd(self) -> str:
        """The anchor venv: the stub puts its working directory on ``sys.path``, and the repo
        root holds tritonpy's own ``triton_python_backend_utils.py`` shim, which must not
        shadow Triton's."""
        return str(self.anchor_dir)

    def environment(self) -> dict[str, str]:
        """The anchor venv's ``bin/`` first on PATH (the stub's embedded Python finds its
        packages through the first ``python3`` on PATH, not PYTHONPATH) and the wheel's
        bundled libraries on LD_LIBRARY_PATH."""
        site = self._site(self.anchor_dir)
        assert site is not None
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONHOME", None)
        env.pop("VIRTUAL_ENV", None)
        env["PATH"] = f"{self.anchor_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        libs = str(site / "nvidia_pytriton.libs")
        env["LD_LIBRARY_PATH"] = f"{libs}{os.pathsep}{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else libs
        return env


class TritonpyServer(_Server):
    """``python -m tritonpy serve`` from this checkout, with Triton's flags."""

    kind = "tritonpy"

    @classmethod
    def available(cls) -> bool:
        """Whether the ``tritonpy`` package is importable here (``serve`` may still fail)."""
        import importlib.util

        return importlib.util.find_spec("tritonpy") is not None

    def command(self) -> list[str]:
        """The tritonpy CLI under the benchmark's own interpreter."""
        return [sys.executable, "-m", "tritonpy", "serve", *self._common_flags()]

    def cwd(self) -> str:
        """The repo root, so ``-m tritonpy`` runs this checkout even if not installed."""
        return str(REPO_ROOT)


@atexit.register
def _stop_all() -> None:
    """Last resort on an unexpected exit: no server outlives the benchmark."""
    for server in list(_live):
        server.stop()


# -- what the benchmarks iterate over ----------------------------------------------------------
@dataclass
class ServerSpec:
    """One column of a benchmark: a server kind and its Python-backend options."""

    label: str
    cls: type[TritonServer] | type[TritonpyServer]
    backend_config: dict[str, str] = field(default_factory=dict)

    def make(self, repo: str | os.PathLike[str], args: Sequence[str] = ()) -> _Server:
        """A server for this column (not started)."""
        return self.cls(repo, backend_config=dict(self.backend_config), args=args)


def bench_parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """The flags every side-by-side benchmark takes: ``--quick``, ``--only``, ``-v``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--only", choices=["triton", "tritonpy"], help="run one kind of server")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    return parser


def parse_bench_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the flags and set up logging (progress with ``-v``, warnings otherwise)."""
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args


def server_specs(only: str | None = None, triton_best: bool = True) -> list[ServerSpec]:
    """The columns to run: Triton at default shm settings, Triton at its best shm settings
    (if ``triton_best``), and tritonpy; ``only`` ("triton" or "tritonpy") keeps one kind.
    Prints the anchor-missing line when the real Triton cannot run."""
    specs: list[ServerSpec] = []
    if only in (None, "triton"):
        if TritonServer.available():
            specs.append(ServerSpec("Triton default", TritonServer))
            if triton_best:
                specs.append(ServerSpec("Triton best", TritonServer, dict(BEST_SHM)))
        else:
            print(ANCHOR_MISSING)
    if only in (None, "tritonpy"):
        specs.append(ServerSpec("tritonpy", TritonpyServer))
    return specs


R = TypeVar("R")


def run_on_each(
    specs: Sequence[ServerSpec],
    repo: str | os.PathLike[str],
    body: Callable[[_Server], R],
    args: Sequence[str] = (),
) -> dict[str, R]:
    """Start each server in turn (one at a time: two cores), run ``body`` on it, stop it.

    A server that does not become ready is skipped with one line
    ``<label>: not ready (<reason>)``, and one whose benchmark raises with
    ``<label>: failed (<error>)``; its column is then absent from the result.
    """
    results: dict[str, R] = {}
    for spec in specs:
        try:
            with spec.make(repo, args) as server:
                results[spec.label] = body(server)
        except ServerStartError as exc:
            reason = str(exc).split("\n", 1)
            print(f"{spec.label}: not ready ({reason[0]})")
            if len(reason) > 1:
                log.info("%s start failure:\n%s", spec.label, reason[1])
        except Exception as exc:  # one broken server must not cost the other columns
            log.debug("%s failed", spec.label, exc_info=True)
            print(f"{spec.label}: failed ({type(exc).__name__}: {str(exc)[:300]})")
    return results


if __name__ == "__main__":
    # `python benchmarks/_servers.py`: clean up after benchmarks that were SIGKILLed.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    sweep_orphans()
