"""One stub process: spawn, channel, frame reading, calls, death and hang detection.

The host side of a model instance. Its frames are read on the server's :class:`FrameLoop` and
handled as they arrive (responses are delivered, BLS requests routed), so there is no hand-off
on the hot path; ``on_frame`` is the owner's dispatcher. The process's stdout and stderr are
read line by line into the host log, and the last lines of stderr are kept for the error a
crash produces.
"""
from __future__ import annotations

import collections
import concurrent.futures
import errno
import itertools
import json
import logging
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from tritonpy.shm import Channel, ChannelClosedError, Cmd, TensorTransport, socket_pair
from tritonpy.shm import janitor, sweep_orphans
from tritonpy.shm._errors import FdLimitError
from tritonpy.shm.channel import EMPTY
from tritonpy.shm.messages import PROTOCOL_VERSION

from ._errors import InternalError, TritonpyError, UnavailableError, error_from_wire
from ._loop import THREAD_LIMIT_HINT, FrameLoop
from ._options import BackendOptions

log = logging.getLogger("tritonpy.stub")

#: Frames one turn of the frame loop takes from one stub; then the others, and the frontends'
#: clients on the same loop, have theirs. Taking one a turn left each further frame behind a
#: whole loop iteration: HTTP at 16 clients lost a third of its throughput.
_FRAMES_PER_TURN = 64
#: The commands this module handles itself, as plain ints: a frame's command is an int, and
#: comparing one with an IntEnum member costs several times an int comparison (every frame).
_REPLY, _HELLO = int(Cmd.REPLY), int(Cmd.HELLO)

# One long-lived thread spawns every stub: PR_SET_PDEATHSIG fires when the *thread* that forked
# the child exits, so stubs must not be forked from short-lived loader threads. A daemon thread
# of our own, not a ThreadPoolExecutor's: the interpreter ends those as soon as the main thread
# returns (before other non-daemon threads of the program, still serving, and before atexit's
# clean-up), which would kill every stub under them.
_spawn_lock = threading.Lock()
_spawn_queue: queue.SimpleQueue | None = None


def _spawner(jobs: queue.SimpleQueue) -> None:
    while True:
        fut, args, kwargs = jobs.get()
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(subprocess.Popen(*args, **kwargs))
            except BaseException as exc:
                fut.set_exception(exc)


def _spawn(cmd: list[str], fd: int, env: dict[str, str]) -> subprocess.Popen:
    global _spawn_queue
    with _spawn_lock:
        if _spawn_queue is None:
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            # Set once started: a start that failed (no thread to be had) is tried again by
            # the next spawn, instead of queueing it for a spawner that never ran.
            threading.Thread(target=_spawner, args=(jobs,), name="tritonpy-spawn",
                             daemon=True).start()
            _spawn_queue = jobs
    fut: concurrent.futures.Future = concurrent.futures.Future()
    # Its own process group (pgid = its pid): what the model starts (a subprocess, a shell
    # pipeline, a multiprocessing pool) stays in it, and ends with the stub (_end_group). In
    # the server's session, as Triton's stubs are: where the kernel groups CPU time by
    # session (autogroup, on by default in most distributions), a stub in a session of its
    # own competed with its host as an equal, and 4 HTTP clients at a time got 3,378 infer/s
    # against 3,977 (alternating runs, medians of 4, on 2 vCPUs). Python 3.10 has no
    # process_group: there a session of its own gives the group.
    group: dict[str, Any] = (
        {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True})
    _spawn_queue.put((fut, (cmd,), dict(
        pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=env, close_fds=True, **group)))
    proc = fut.result()
    janitor.watch_group(proc.pid)
    return proc


def _spawn_failed(name: str, exc: OSError, python: str = "") -> str:
    """Why stub ``name`` could not be started, in words that say which limit to raise."""
    what = f"cannot start stub process '{name}'"
    code = exc.errno
    if code == errno.EMFILE:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return (f"{what}: this process has as many files open as RLIMIT_NOFILE allows (soft "
                f"limit {soft}; each stub holds 3: its channel, stdout and stderr); raise it "
                "(ulimit -n, docker --ulimit nofile=...)")
    if code == errno.ENFILE:
        return f"{what}: the system has as many files open as it allows (fs.file-max)"
    if code == errno.EAGAIN:
        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        return (f"{what}: fork failed, too many processes or threads (RLIMIT_NPROC soft limit "
                f"{'unlimited' if soft < 0 else soft} for this user, or the cgroup's pids.max); "
                f"raise it (ulimit -u, docker --pids-limit) ({exc.strerror})")
    if code == errno.ENOMEM:
        return f"{what}: not enough memory to fork ({exc.strerror})"
    if python and code in (errno.ENOENT, errno.EACCES, errno.ENOEXEC):
        return f"{what}: cannot run its interpreter {python} ({exc.strerror})"
    return f"{what}: {exc}"


def _raise_if_no_thread(name: str, exc: BaseException, what: str) -> None:
    """UnavailableError naming the limit to raise, if ``exc`` is a thread that could not start
    (``RuntimeError: can't start new thread``)."""
    if isinstance(exc, RuntimeError) and "thread" in str(exc):
        raise UnavailableError(f"cannot start stub process '{name}': {what} can be started "
                               f"({exc}): {THREAD_LIMIT_HINT}") from None


def _proc_state(pid: int) -> tuple[bool, float] | None:
    """Whether process ``pid`` is stopped by a signal (state T), and the CPU time it has used
    (user and system, in seconds), from /proc; None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ')',
    # and utime, stime are the 12th and 13th fields from it.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return fields[0] == b"T", (int(fields[11]) + int(fields[12])) / _TICKS
    except (IndexError, ValueError):
        return None


_TICKS = os.sysconf("SC_CLK_TCK")

#: A stub's output line longer than this many bytes is logged in pieces of this size.
LINE_MAX = 1 << 16
#: A stderr line kept for a stub's death reason is cut at this many characters.
TAIL_LINE_MAX = 1024

#: A stub that does not answer the watchdog but used at least this share of a CPU meanwhile is
#: busy (C code holding the GIL: a long regex, json.loads of a huge document...), not stuck.
BUSY_CPU_SHARE = 0.1


#: Runs a stub in an environment as Triton's launcher does: its ``bin/activate`` sourced (a
#: conda-pack environment's activation scripts set its variables), its ``lib`` first on
#: LD_LIBRARY_PATH. Arguments: the activate script, the lib directory, the command.
_ACTIVATE = ('source "$1" && LD_LIBRARY_PATH="$2${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" '
             '&& export LD_LIBRARY_PATH && shift 2 && exec "$@"')


def env_launcher(env_dir: str) -> list[str] | None:
    """The command that starts a Python in environment ``env_dir``, or None when it has
    neither ``bin/activate`` nor a Python. With ``bin/activate`` (what Triton needs) it is
    sourced first; the Python is the environment's own, else this server's."""
    python = next((p for p in (os.path.join(env_dir, "bin", name) for name in ("python3", "python"))
                   if os.path.exists(p)), None)
    activate = os.path.join(env_dir, "bin", "activate")
    if os.path.isfile(activate):
        return ["/bin/bash", "-c", _ACTIVATE, "bash", activate, os.path.join(env_dir, "lib"),
                python or sys.executable]
    return [python] if python else None


#: How a stub starts on a Python of a model's own environment (``EXECUTION_ENV_PATH``), which
#: need not have tritonpy installed (Triton's needs only numpy there): the packages the
#: environment lacks (tritonpy, msgpack, posix_ipc, psutil) come from this server's
#: site-packages, added after the environment's own, so that its numpy and the rest stay its
#: own. A Python of another version cannot use them: it says so, naming both versions.
_FOREIGN_STUB = """\
import site, sys
for d in {dirs!r}:
    site.addsitedir(d)
try:
    import tritonpy.stub._runtime, tritonpy.stub.pb_utils
except ImportError as exc:
    last = ([line for line in str(exc).splitlines() if line.strip()] or [repr(exc)])[-1]
    sys.exit("the Python of EXECUTION_ENV_PATH (%s, %d.%d) cannot import what the stub needs "
             "from this server's packages (Python {version}): %s. Install tritonpy into that "
             "environment." % (sys.executable, *sys.version_info[:2], last))
import runpy
runpy.run_module("tritonpy.stub", run_name="__main__", alter_sys=True)
"""


def _server_site_dirs() -> list[str]:
    """This server's site-packages folders (its own first), whose .pth files are read too."""
    import site

    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def stub_command(launcher: list[str]) -> list[str]:
    """The command that starts a stub on ``launcher`` (its arguments follow): ``-m
    tritonpy.stub`` on this server's Python, the bootstrap of :data:`_FOREIGN_STUB` on any
    other."""
    if launcher[-1] == sys.executable:
        return [*launcher, "-m", "tritonpy.stub"]
    version = "%d.%d" % sys.version_info[:2]
    return [*launcher, "-c", _FOREIGN_STUB.format(dirs=_server_site_dirs(), version=version)]


def stub_python(options: BackendOptions) -> list[str]:
    """The command of the Python that runs stubs (``execution-env-path``'s, or this one)."""
    env_path = options.execution_env_path
    launcher = env_launcher(env_path) if env_path else None
    return launcher or [sys.executable]


class StubProcess:
    """A running stub; ``on_frame(stub, msg)`` receives every frame except replies to calls."""

    def __init__(self, name: str, model: str, transport: TensorTransport,
                 options: BackendOptions, frames: FrameLoop,
                 on_frame: Callable[[StubProcess, list], None],
                 on_death: Callable[[StubProcess, str], None], extra_env: dict[str, str] | None = None,
                 python: list[str] | None = None, instance: Any = None) -> None:
        self.name = name
        # Whose stub this is (the host's Instance), set before it is spawned: a stub that dies
        # at once may reach on_death before this constructor returns.
        self.instance = instance
        self.model = model
        self.options = options
        self.transport = transport
        self._on_frame = on_frame
        self._on_death = on_death
        self._frames = frames
        self._ended = threading.Event()  # the death path has run
        self._calls: dict[int, list] = {}
        self._call_ids = itertools.count(1)
        self._calls_lock = threading.Lock()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=options.stub_stderr_lines)
        self.alive = False
        self.dead_reason = ""
        self.segments_gone: list[str] = []  # once it ended: its segments, unlinked
        self._closing = False
        self._abandoned_why = ""  # see abandon()
        self.abandoned = False  # killed on purpose (abandon())
        self.finalize_cut_off = False  # stop() gave up on a finalize still running
        self._last_seen = time.monotonic()
        self.hello_info: dict | None = None  # the stub's HELLO, once it came
        try:
            host_sock, child_sock = socket_pair()
        except OSError as exc:
            raise UnavailableError(_spawn_failed(name, exc)) from None
        stub_opts = {
            "instance_name": name,
            "prefix": options.shm_region_prefix_name,
            "shm_default_byte_size": min(options.shm_default_byte_size, 16 << 20),
            "shm_growth_byte_size": options.shm_growth_byte_size,
            "shm_cap": options.shm_total_byte_cap,
            "bls_spin_us": options.bls_spin_us(),
            "idle_spin_us": options.idle_spin_microseconds,
            "loop_stall_s": options.loop_stall_seconds,
            "shm_directory": options.shm_fallback_directory,
            "host_pid": os.getpid(),
        }
        env = dict(os.environ)
        env.update(extra_env or {})
        env["PYTHONUNBUFFERED"] = "1"
        launcher = python or stub_python(options)
        cmd = [*stub_command(launcher), str(child_sock.fileno()), json.dumps(stub_opts)]
        self.python = launcher[-1]
        try:
            self.proc = _spawn(cmd, child_sock.fileno(), env)
        except OSError as exc:  # out of descriptors or processes, or no such interpreter
            host_sock.close()
            raise UnavailableError(_spawn_failed(name, exc, cmd[0])) from None
        except BaseException as exc:  # (RuntimeError: the spawning thread could not start)
            host_sock.close()
            _raise_if_no_thread(name, exc, "no thread to spawn it")
            raise
        finally:
            child_sock.close()
        self.pid = self.proc.pid
        try:
            self.channel = Channel(host_sock, transport, f"host:{name}")
            # Non-blocking: the frame loop never waits for a stub that does not read (it may be
            # sending to us meanwhile, and only the loop reads what it sends).
            fd = host_sock.fileno()
            self.channel.use_backlog(
                lambda: frames.writable(fd, self.channel.flush_backlog),
                lambda: not frames.on_loop())
            self.alive = True
            self._pipes = [
                threading.Thread(target=self._pump, args=(self.proc.stdout, False), daemon=True,
                                 name=f"{name}-stdout"),
                threading.Thread(target=self._pump, args=(self.proc.stderr, True), daemon=True,
                                 name=f"{name}-stderr"),
            ]
            self._hello = threading.Event()
            for t in self._pipes:
                t.start()
            # Started before the stub is watched: a start that fails must leave no stub
            # running with nobody to watch it.
            threading.Thread(target=self._watchdog, daemon=True, name=f"{name}-watchdog").start()
            frames.watch(self.channel.sock.fileno(), self._readable)
        except BaseException as exc:  # e.g. the frame loop is closed (the server stopped)
            self.alive = False
            self._closing = True  # a watchdog already started ends at once
            self.proc.kill()
            self.proc.wait()
            self._end_group()
            host_sock.close()
            _raise_if_no_thread(name, exc, "no thread to read it")
            raise

    # -- output -----------------------------------------------------------------------------
    def _pump(self, pipe: Any, is_err: bool) -> None:
        """Log what the stub writes to ``pipe``, a line a record. A line longer than
        ``LINE_MAX`` bytes (a progress bar redrawn with ``\r`` and never ended, say) is logged
        in pieces of that size as they come, so that it is neither held in memory whole nor
        kept from the log; the stderr lines kept for a death's reason are cut at
        ``TAIL_LINE_MAX`` characters."""
        logger = logging.getLogger(f"tritonpy.model.{self.model}")
        for raw in iter(lambda: pipe.readline(LINE_MAX), b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if is_err:
                self.stderr_tail.append(line if len(line) <= TAIL_LINE_MAX else
                                        f"{line[:TAIL_LINE_MAX]}... ({len(line)} characters)")
            logger.log(logging.WARNING if is_err else logging.INFO, "[%s] %s", self.name, line)
        pipe.close()

    # -- frames -----------------------------------------------------------------------------
    def _readable(self) -> None:
        """On the frame loop, when the channel is readable: handle the frames that are there."""
        ch = self.channel
        # Seen now (for the watchdog): once a turn, not once a frame.
        self._last_seen = time.monotonic()
        for _ in range(_FRAMES_PER_TURN):
            try:
                msg = ch.recv(wait=False)
            except FdLimitError as exc:
                # A frame spilled into a segment this process had no descriptor left to map:
                # it is lost, and whatever request it answered would wait for ever. Ending the
                # stub fails them all with the reason (and gives descriptors back).
                why = f"a frame from it could not be read: {exc}"
                log.error("[%s] %s; killing it", self.name, why)
                self.stderr_tail.append(f"(killed by tritonpy: {why})")
                self.kill()
                continue
            except Exception as exc:
                log.error("[%s] bad frame from stub: %s", self.name, exc)
                continue
            if msg is EMPTY:
                return
            if msg is None:
                # The stub is gone. Its death path waits for the process: not on this loop.
                self._frames.unwatch(ch.sock.fileno())
                # Not lost when no thread can be had now: its requests would wait for ever.
                self._frames.start_thread(
                    lambda: threading.Thread(target=self._died, daemon=True,
                                             name=f"{self.name}-died"),
                    f"the end of stub '{self.name}'")
                return
            cmd = msg[0]
            if cmd == _REPLY or cmd == _HELLO:
                self._control(msg)
                continue
            try:
                self._on_frame(self, msg)  # (here, not in a method of its own: once a frame)
            except Exception:
                log.exception("[%s] error handling frame %s", self.name, Cmd(cmd).name)

    def _control(self, msg: list) -> None:
        """A frame for this object itself: the reply to a call, or the stub's HELLO."""
        if msg[0] == _REPLY:
            with self._calls_lock:
                slot = self._calls.pop(msg[1], None)
            if slot is not None:
                slot[1] = msg[2]
                slot[0].set()
        else:
            self.hello_info = msg[2] if isinstance(msg[2], dict) else {}
            self._hello.set()

    def _died(self) -> None:
        try:
            self._death_path()
        finally:
            self._ended.set()

    def _death_path(self) -> None:
        was_alive = self.alive
        self.alive = False
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._end_group()  # before the pipes: a process left behind may hold them open
        for t in self._pipes:
            t.join(timeout=1)
        if code < 0:
            try:
                what = f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                what = f"killed by signal {-code}"
        else:
            what = f"exited with code {code}"
        tail = "\n".join(self.stderr_tail)
        # Triton's sentence first (scripts grep its log for it), then how the process ended.
        if self._abandoned_why:
            what += f" ({self._abandoned_why})"
        self.dead_reason = f"Stub process '{self.name}' is not healthy: pid {self.pid} {what}" + (
            f"; last stderr lines:\n{tail}" if tail else "")
        self.channel.close()
        # The stub's own segments die with it: nobody else will unlink them. (Where /dev/shm
        # cannot be listed now, e.g. no descriptor left, a later sweep removes them: the
        # next death's, or the server's at stop.)
        # The host's mappings of them go too, and the other stubs are told (see
        # ModelRuntime._on_death), but for those the host still views: a response the stub
        # sent may be on its way to a BLS caller by a handle that names its segment. Those
        # stay, named, until the server's maintenance finds them viewed no more.
        prefix = self.options.shm_region_prefix_name
        segments = self.transport.segments
        gone = segments.forget_created_by(prefix, self.pid)
        try:
            gone += sweep_orphans(prefix, self.options.shm_fallback_directory or None,
                                  dead_pids={self.pid}, keep=segments.kept)
        except Exception:  # its requests must be failed and it restarted all the same
            log.exception("[%s] could not remove the dead stub's segments", self.name)
        self.segments_gone = sorted(set(gone))
        err = UnavailableError(self.dead_reason)
        with self._calls_lock:
            calls, self._calls = self._calls, {}
        for ev, slot in ((s[0], s) for s in calls.values()):
            slot[1] = {"ok": False, "error": err.to_wire()}
            ev.set()
        self._hello.set()  # a start still waiting for HELLO fails now, not at its timeout
        if was_alive and not self._closing:
            log.error("%s", self.dead_reason)
        self._on_death(self, self.dead_reason)

    def _end_group(self) -> None:
        """SIGKILL what the model left running in the stub's process group. Its pid is not
        reused while a process of the group lives, so the group is still the stub's own.
        Processes that left the group (``setsid``, a daemon's double fork) are not reached."""
        janitor.forget_group(self.pid)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return  # nothing was left (the usual case)
        log.warning("[%s] killed the processes its model left running (process group %d)",
                    self.name, self.pid)

    # -- calls --------------------------------------------------------------------------------
    def call(self, cmd: Cmd, body: Any = None, timeout: float | None = None) -> dict:
        """Send a frame and wait for the stub's REPLY; raises the error the stub reports.

        Not on the frame loop, where the reply would be read: that raises RuntimeError (a
        programming error, which no handler of Triton errors takes for the stub's answer).
        """
        if self._frames.on_loop():
            raise RuntimeError(f"{Cmd(cmd).name} to stub '{self.name}' was called on the loop "
                                "that reads its answers: it would wait for itself")
        ev = threading.Event()
        slot: list = [ev, None]
        call_id = next(self._call_ids)
        with self._calls_lock:
            self._calls[call_id] = slot
        try:
            self.channel.send(cmd, call_id, body)
        except ChannelClosedError:
            with self._calls_lock:
                self._calls.pop(call_id, None)
            raise UnavailableError(self.dead_reason or f"stub '{self.name}' is gone") from None
        if not ev.wait(timeout):
            with self._calls_lock:
                self._calls.pop(call_id, None)
            raise NoAnswerError(
                f"stub '{self.name}' did not answer {Cmd(cmd).name} within {timeout} s")
        reply = slot[1]
        if not isinstance(reply, dict) or not reply.get("ok", False):
            raise error_from_wire((reply or {}).get("error") if isinstance(reply, dict) else reply)
        return reply

    def wait_hello(self, timeout: float) -> None:
        """Wait for the stub's HELLO; raises at once if it dies first (_died sets the event)."""
        if not self._hello.wait(timeout) or self.hello_info is None:
            if not self.alive:
                raise UnavailableError(self.dead_reason or f"stub '{self.name}' died at start")
            raise UnavailableError(f"stub '{self.name}' did not start within {timeout} s")
        version = self.hello_info.get("version")
        if version != PROTOCOL_VERSION:
            # Another tritonpy (e.g. in a model's EXECUTION_ENV_PATH) would misread frames.
            self.kill()
            raise UnavailableError(
                f"stub '{self.name}' speaks channel protocol {version!r} and this host "
                f"{PROTOCOL_VERSION}: the interpreter that runs it ({self.python}) has "
                "another version of tritonpy; install this server's version there")

    def send(self, cmd: Cmd, call_id: int = 0, body: Any = None) -> None:
        self.channel.send(cmd, call_id, body)

    def ping(self, timeout: float) -> bool:
        try:
            self.call(Cmd.PING, None, timeout)
            return True
        except TritonpyError:
            return False

    def _watchdog(self) -> None:
        """Kill a stub that stops answering for ``stub-timeout-seconds`` and is stuck (stopped,
        or blocked in C code holding the GIL: no CPU used meanwhile); its death path then fails
        its requests and restarts it. A stub that is merely busy answers (any thread of it may
        take the read role); one busy on a CPU in C code that holds the GIL cannot, and is let
        be, as Triton lets it be (a WARNING says so, once while it lasts)."""
        timeout = self.options.stub_timeout_seconds
        if timeout <= 0:
            return
        interval = min(max(timeout / 3, 0.05), 5.0)
        warned = False  # of the silence going on, spent on a CPU
        while self.alive and not self._closing:
            # Waits on the death path rather than sleeping: once the stub has ended, the
            # thread ends at once (a sleep kept up to 5 s of threads after unloads).
            if self._ended.wait(interval):
                return
            if not self.alive or self._closing:
                return
            if time.monotonic() - self._last_seen < interval or not self._hello.is_set():
                warned = False
                continue
            before, t0 = _proc_state(self.pid), time.monotonic()
            if self.ping(timeout):
                warned = False
            elif self.alive and not self._closing:
                if self.proc.poll() is not None:
                    return  # it died meanwhile (its death path, maybe late, says how)
                # A stopped stub (SIGSTOP, a debugger, Ctrl-Z) is silent for another reason.
                now = _proc_state(self.pid)
                stopped = now is not None and now[0]
                if (not stopped and before is not None and now is not None
                        and now[1] - before[1] >= BUSY_CPU_SHARE * (time.monotonic() - t0)):
                    if not warned:
                        warned = True
                        log.warning("[%s] stub has not answered for %.1f s, busy on a CPU "
                                    "(C code that holds the GIL?): not killed "
                                    "(stub-timeout-seconds is for a stub that is stuck)",
                                    self.name, time.monotonic() - t0)
                    continue
                how = "; it was stopped (SIGSTOP or SIGTSTP)" if stopped else ""
                log.error("[%s] stub did not answer for %.1f s (stub-timeout-seconds)%s; "
                          "killing it", self.name, timeout, how)
                self.stderr_tail.append(
                    f"(killed by tritonpy: no answer for {timeout:g} s, stub-timeout-seconds{how})")
                self.kill()
                return

    # -- ending -----------------------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL the stub; the end of its channel then starts the death path."""
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass

    def abandon(self, why: str = "") -> None:
        """SIGKILL the stub on purpose: its death is not logged as an error; ``why`` is added
        to what its requests in flight fail with."""
        self._closing = True
        self.abandoned = True
        self._abandoned_why = why
        self.kill()

    def stop(self, finalize: bool = True, timeout: float = 10.0) -> None:
        """Finalize (optionally) and end the process; leaves no process or segment behind."""
        self._closing = True
        grace = timeout if finalize else 0.1
        if finalize and self.alive:
            try:
                self.call(Cmd.FINALIZE, None, timeout)
            except TritonpyError as exc:
                if not self.abandoned:  # (killed on purpose meanwhile: abort() says so)
                    log.warning("[%s] finalize failed: %s", self.name, exc.message)
                if isinstance(exc, NoAnswerError):
                    grace = 0.5  # stuck in finalize: no second full wait
                    # Still running it when the time was up: cut off (a stop then exits 1).
                    # A finalize that raised was answered: the stub ends on its own now.
                    self.finalize_cut_off = self.alive
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if not self._ended.wait(timeout):  # the socket never closed: force the death path
            self.proc.kill()
            self._ended.wait(5)


class NoAnswerError(UnavailableError):
    """A call the stub did not answer in its time (not an error it answered with)."""


def internal(msg: str) -> InternalError:
    return InternalError(msg)
