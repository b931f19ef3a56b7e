"""The janitor: a small process each started :class:`~tritonpy.Server` leaves behind it, to
remove the shared-memory segments of its prefix should it die without removing them itself
(SIGKILL, the OOM killer). Its stubs die with it (PR_SET_PDEATHSIG), but neither they nor it can
unlink their segments then: without the janitor, 16 MiB or more per process stayed in
/dev/shm until the next start with the same prefix swept them.

It reads a pipe whose writing end only the server holds, so the pipe's end comes when the
server is gone, however it went. A server that stops cleanly writes ``bye`` first, after its own
sweep: the janitor sweeps once more and exits. Otherwise it waits (``_PATIENCE_S`` at most) for
the server's stubs to die (they carry its pid on their command line), then unlinks every
segment of the prefix whose creating process is dead: a live server of the same prefix keeps
its own.

Each stub runs in a process group of its own, where what its model starts stays; the server
tells its janitors of each one (``+PGID``, then ``-PGID`` once it has ended it), so that a
server's death ends those processes too, not only the stubs. Likewise the folders on disk
the server makes for itself (``dHEXPATH``, then ``uHEXPATH`` once it removed it: the models a
client loaded from files) are removed at its death.

Run as ``python -I .../janitor.py PREFIX SERVER_PID [DIRECTORY]`` with the pipe as stdin: by
its path, so that it imports only this package's sweep (0.05 s to start, not the server's
0.45 s).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psutil

_PATIENCE_S = 10.0
_EVERY_S = 0.05


#: This process's running janitors (one per started server), told of every stub's group.
_live: list[subprocess.Popen[bytes]] = []
_live_lock = threading.Lock()


def start(prefix: str, directory: str | None) -> subprocess.Popen[bytes]:
    """Start a janitor for this process's segments of ``prefix`` (see :func:`stop`). Its own
    session: a terminal's Ctrl-C goes to the server, not to it."""
    args = [sys.executable, "-I", os.path.abspath(__file__), prefix, str(os.getpid())]
    if directory:
        args.append(directory)
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            start_new_session=True)
    assert proc.stdin is not None
    # Never wait on a janitor that does not read: a line it cannot take now is dropped.
    os.set_blocking(proc.stdin.fileno(), False)
    with _live_lock:
        _live.append(proc)
    return proc


def _tell(line: bytes) -> None:
    with _live_lock:
        for proc in _live:
            try:  # a line under PIPE_BUF is written whole or not at all
                os.write(proc.stdin.fileno(), line)  # type: ignore[union-attr]
            except OSError:  # full (it does not read) or gone
                pass


def watch_group(pgid: int) -> None:
    """A stub's process group: the janitors end it should this process die."""
    _tell(b"+%d\n" % pgid)


def forget_group(pgid: int) -> None:
    """The stub's group was ended: its number may now be another process's."""
    _tell(b"-%d\n" % pgid)


def watch_folder(path: str) -> None:
    """A folder of the server's own: the janitors remove it should this process die."""
    _tell(b"d%s\n" % os.fsencode(path).hex().encode())


def forget_folder(path: str) -> None:
    """The folder was removed by the server itself."""
    _tell(b"u%s\n" % os.fsencode(path).hex().encode())


def stop(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """Tell the janitor the server cleaned up (it sweeps once more, and exits)."""
    with _live_lock:
        if proc in _live:
            _live.remove(proc)
    if proc.returncode is not None:  # stopped already (a stop finished by a second call)
        return
    try:
        # One stopped (SIGSTOP, a debugger, Ctrl-Z on its own) would keep the server's stop
        # waiting its whole timeout, then be killed before its last sweep: let it go on.
        os.kill(proc.pid, signal.SIGCONT)
    except OSError:
        pass
    try:
        if proc.stdin is not None and not proc.stdin.closed:
            os.set_blocking(proc.stdin.fileno(), True)
            proc.stdin.write(b"bye")
            proc.stdin.close()
        proc.wait(timeout)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


def stubs_of(host_pid: int) -> list[psutil.Process]:
    """The live stub processes of the server ``host_pid`` (each is told its host's pid on its
    command line), whether that server runs or is gone (they are reparented then)."""
    return [proc for proc in psutil.process_iter(["cmdline", "status"])
            if proc.info["status"] != psutil.STATUS_ZOMBIE
            and _host_of(proc.info["cmdline"] or []) == host_pid]


def _host_of(cmd: list[str]) -> int | None:
    """The host pid in a stub's command line (``... -m tritonpy.stub FD OPTIONS_JSON``)."""
    if "tritonpy.stub" not in cmd:
        return None
    try:
        host = json.loads(cmd[cmd.index("tritonpy.stub") + 2]).get("host_pid")
    except (ValueError, IndexError, AttributeError):
        return None
    return host if isinstance(host, int) else None


def main(argv: list[str]) -> int:
    prefix, server_pid = argv[1], int(argv[2])
    directory = argv[3] if len(argv) > 3 else None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    groups: set[int] = set()
    folders: set[bytes] = set()
    said = b""  # what follows the last whole line
    while chunk := os.read(0, 65536):
        *lines, said = (said + chunk).split(b"\n")
        for line in lines:
            if line[:1] in b"du":
                _note_folder(folders, line)
            else:
                _note_group(groups, line)
    sweep = _sweep()  # (imported once needed: the janitor starts with each server)
    if said != b"bye":  # the server died: its stubs are being killed (PR_SET_PDEATHSIG)
        for pgid in groups:  # and what their models left running with them
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        # The pipe can also end while the server's interpreter is still exiting (its Popen of
        # this janitor collected): its segments are kept while it runs, so wait for it too.
        deadline = time.monotonic() + _PATIENCE_S
        while ((stubs_of(server_pid) or not sweep.process_ended(server_pid))
               and time.monotonic() < deadline):
            time.sleep(_EVERY_S)
        import shutil

        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    sweep.sweep_orphans(prefix, directory)
    return 0


def _note_folder(folders: set[bytes], line: bytes) -> None:
    """``dHEXPATH``: a folder to remove should the server die; ``uHEXPATH``: removed."""
    try:
        path = bytes.fromhex(line[1:].decode("ascii"))
    except ValueError:
        return
    if not os.path.isabs(path):  # nothing but the absolute paths the server sends
        return
    if line[:1] == b"d":
        folders.add(path)
    else:
        folders.discard(path)


def _note_group(groups: set[int], line: bytes) -> None:
    """``+PGID``: a stub's group to end should the server die; ``-PGID``: ended already."""
    try:
        pgid = int(line[1:])
    except ValueError:
        return
    if pgid <= 1:
        return
    if line[:1] == b"+":
        groups.add(pgid)
    elif line[:1] == b"-":
        groups.discard(pgid)


def _sweep() -> Any:
    """The ``sweep`` module, imported without the package around it when run as a script."""
    if __package__:
        from . import sweep
        return sweep
    import importlib
    import types

    pkg = types.ModuleType("_tritonpy_shm")
    pkg.__path__ = [os.path.dirname(os.path.abspath(__file__))]
    sys.modules["_tritonpy_shm"] = pkg
    return importlib.import_module("_tritonpy_shm.sweep")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
