"""Model repositories generated into tmp directories, and a server around them for tests.

``write_model(repo, name, model_py, config)`` writes ``<repo>/<name>/config.pbtxt`` and
``<repo>/<name>/<version>/model.py``; ``serving(repo, prefix)`` is a started
``tritonpy.Server`` that always uses the given shm prefix and, when it stops, is checked for
leftovers: no stub process and no segment of the prefix may survive it.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import psutil

import tritonpy
from tritonpy.shm import janitor

# One small model body used by many tests: OUT = IN * 2 for FP32 IN (any shape).
DOUBLE_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", x * 2)], parameters={"instance": self.instance}))
        return out
"""


# Ensemble steps: OUT = IN + 1, and OUT = IN * 2.
PLUS1 = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + 1)])
            for r in requests]
"""

SCALE2 = PLUS1.replace("as_numpy() + 1", "as_numpy() * 2")

# OUT = IN * 2 and N = how many requests this instance has executed; IN < 0 fails.
COUNTING_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.n = 0

    def execute(self, requests):
        out = []
        for r in requests:
            self.n += 1
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if (x < 0).any():
                raise pb_utils.TritonModelException("negative input")
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", x * 2), pb_utils.Tensor("N", np.array([self.n], np.int64))]))
        return out
"""


# OUT = IN after sleeping IN[0] ms: requests whose durations are known from below.
SLEEPER_PY = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            time.sleep(float(x[0]) / 1000)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return out
"""


def io_config(max_batch_size: int = 0, dims: str = "[ -1 ]", extra: str = "",
              in_type: str = "TYPE_FP32", out_type: str = "TYPE_FP32") -> str:
    """A config.pbtxt body with FP32 ``IN`` and ``OUT`` (no name: the directory names it)."""
    return (f'backend: "python"\nmax_batch_size: {max_batch_size}\n'
            f'input [ {{ name: "IN", data_type: {in_type}, dims: {dims} }} ]\n'
            f'output [ {{ name: "OUT", data_type: {out_type}, dims: {dims} }} ]\n{extra}')


def write_model(repo: str | os.PathLike[str], name: str, model_py: str = DOUBLE_PY,
                config: str | None = None, versions: tuple[int, ...] = (1,),
                files: Mapping[str, str] | None = None,
                filename: str = "model.py") -> Path:
    """Write one model; ``config=None`` writes :func:`io_config`, ``""`` writes none at all.

    ``files`` are extra files per version directory (relative name -> text).
    """
    mdir = Path(repo) / name
    mdir.mkdir(parents=True, exist_ok=True)
    if config is None:
        config = io_config()
    if config != "":
        (mdir / "config.pbtxt").write_text(textwrap.dedent(config))
    for v in versions:
        vdir = mdir / str(v)
        vdir.mkdir(exist_ok=True)
        (vdir / filename).write_text(textwrap.dedent(model_py))
        for rel, text in (files or {}).items():
            p = vdir / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(textwrap.dedent(text))
    return mdir


def new_prefix() -> str:
    """An shm prefix for a server shared by a module's tests (``tpytm<hex>_``)."""
    return f"tpytm{secrets.token_hex(4)}_"


def holds(pid: int, name: str) -> bool:
    """Whether process ``pid`` maps or holds open something named ``name`` (a shm object,
    unlinked or not)."""
    with open(f"/proc/{pid}/maps") as f:
        if name in f.read():
            return True
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if name in os.readlink(f"/proc/{pid}/fd/{fd}"):
                return True
        except OSError:  # closed meanwhile
            pass
    return False


def truncate_shm(name: str, size: int) -> None:
    """Shrink (or grow) the shm object ``name`` to ``size`` bytes, as a careless client may."""
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def segments(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except OSError:
        return []


def stub_processes() -> list[psutil.Process]:
    """Live (non-zombie) stub processes of this test process's servers."""
    return janitor.stubs_of(os.getpid())


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until truthy or ``timeout``; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """``wait_for`` that fails the test, naming ``what``, when ``timeout`` passes first."""
    value = wait_for(predicate, timeout)
    if not value:
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
    return value


def assert_clean(prefix: str, before: set[int] | None = None) -> None:
    """No stub process (other than the pids in ``before``) and no segment of ``prefix``."""
    left = wait_for(lambda: not [p for p in stub_processes() if p.pid not in (before or set())],
                    timeout=5.0)
    assert left, f"stub processes left: {[p.cmdline() for p in stub_processes()]}"
    assert wait_for(lambda: not segments(prefix), timeout=2.0), \
        f"segments left: {segments(prefix)}"


def communicate_in_session(proc: subprocess.Popen, timeout: float) -> tuple[Any, Any]:
    """``proc.communicate(timeout)`` of a child started in a session of its own; one that
    outlives ``timeout`` is killed, its process group and all, even when the test fails."""
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def run_driver(driver: str, *args: str, timeout: float = 50) -> tuple[str, str]:
    """Run ``python -c driver args`` (from tests/, in a session of its own: killed, group and
    all, if it outlives ``timeout``): the text after its last ``RESULT `` line, and its stderr.
    Fails, naming its exit and stderr, when it printed no result."""
    proc = subprocess.Popen([sys.executable, "-c", driver, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parent,
                            start_new_session=True)
    out, err = communicate_in_session(proc, timeout)
    lines = [ln for ln in out.decode().splitlines() if ln.startswith("RESULT ")]
    assert lines, f"the child printed no result (exit {proc.returncode}):\n{err.decode()[-3000:]}"
    return lines[-1][len("RESULT "):], err.decode()


@contextlib.contextmanager
def serving(repo: str | os.PathLike[str] | list[Any], prefix: str,
            **kwargs: Any) -> Iterator[tritonpy.Server]:
    """A started server on ``repo`` (or a list of repositories) with shm prefix ``prefix``;
    checked for leftovers after."""
    backend = dict(kwargs.pop("backend_config", None) or {})
    backend["shm-region-prefix-name"] = prefix
    before = {p.pid for p in stub_processes()}
    repos = [os.fspath(r) for r in repo] if isinstance(repo, list) else os.fspath(repo)
    server = tritonpy.Server(repos, backend_config=backend, **kwargs)
    try:
        server.start()
        yield server
    finally:
        server.stop()
    assert_clean(prefix, before)


@contextlib.contextmanager
def serving_models(repo: str | os.PathLike[str], models: Mapping[str, tuple[str, str]],
                   **kwargs: Any) -> Iterator[tritonpy.Server]:
    """Write ``models`` (name -> (model.py, config)) into ``repo`` and serve them, with a
    fresh shm prefix, as :func:`serving` does."""
    for name, (model_py, config) in models.items():
        write_model(repo, name, model_py, config)
    with serving(repo, new_prefix(), **kwargs) as server:
        yield server


@contextlib.contextmanager
def serving_frontends(repo: str | os.PathLike[str], **kwargs: Any) -> Iterator[tuple[Any, Any]]:
    """(server, frontends): :func:`serving` on ``repo`` (a fresh shm prefix) behind HTTP and
    gRPC frontends on loopback (free ports, no metrics); the frontends stop first, as
    ``tritonpy serve`` stops (a test may stop them itself before)."""
    from tritonpy.frontends import Frontends

    with serving(repo, new_prefix(), **kwargs) as server:
        fe = Frontends(server, http_port=0, grpc_port=0, allow_metrics=False,
                       http_address="127.0.0.1", grpc_address="127.0.0.1")
        fe.start_in_thread()
        try:
            yield server, fe
        finally:
            fe.stop_in_thread()


def infer(model: tritonpy.Model, inputs: Mapping[str, Any], wait: float = 30.0,
          **kwargs: Any) -> tritonpy.InferenceResponse:
    """The one response of a default-mode request (waits at most ``wait`` seconds)."""
    stream = model.infer(inputs, **kwargs)
    return stream.get(timeout=wait)


def fp32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


#: An ensemble of two ``double`` steps (write_model's default model): OUT = IN * 4.
QUADRUPLE_ENSEMBLE = """
name: "quadruple"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "double", model_version: -1,
    input_map { key: "IN", value: "IN" }, output_map { key: "OUT", value: "twice" } },
  { model_name: "double", model_version: -1,
    input_map { key: "IN", value: "twice" }, output_map { key: "OUT", value: "OUT" } }
] }
"""


def write_quadruple(repo: str | os.PathLike[str]) -> None:
    """``double`` and the ensemble ``quadruple`` of two of its steps."""
    write_model(repo, "double")
    mdir = Path(repo) / "quadruple"
    (mdir / "1").mkdir(parents=True, exist_ok=True)
    (mdir / "config.pbtxt").write_text(textwrap.dedent(QUADRUPLE_ENSEMBLE))


#: Calls ``double`` twice through BLS: once with ``trace=request.trace()``, once without.
BLS_TRACED_PY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN")
            traced = pb_utils.InferenceRequest(model_name="double", requested_output_names=["OUT"],
                                               inputs=[x], trace=r.trace()).exec()
            pb_utils.InferenceRequest(model_name="double", requested_output_names=["OUT"],
                                      inputs=[x]).exec()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.get_output_tensor_by_name(traced, "OUT")]))
        return out
"""


@contextlib.contextmanager
def pinned_beside_busy(pid: int, hogs: int, same_cpu: bool) -> Iterator[list[psutil.Process]]:
    """Every thread of process ``pid`` pinned to one CPU, and ``hogs`` busy processes pinned to
    that CPU (``same_cpu``) or to another (skipped on a single CPU); yields the busy processes.
    They are killed, and the threads unpinned, when the block ends."""
    everywhere = sorted(os.sched_getaffinity(0))
    if not same_cpu and len(everywhere) < 2:
        import pytest

        pytest.skip("needs two CPUs")
    own, theirs = everywhere[-1], everywhere[-1] if same_cpu else everywhere[0]
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    try:
        for proc in procs:
            os.sched_setaffinity(proc.pid, {theirs})
        for tid in tids:
            os.sched_setaffinity(tid, {own})
        yield [psutil.Process(proc.pid) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for tid in tids:
            try:
                os.sched_setaffinity(tid, set(everywhere))
            except OSError:  # a thread that has ended since
                pass


# -- Triton's L0_model_namespacing scenarios ---------------------------------------------
ADDSUB_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

SIGN = {sign}  # 1: (a + b, a - b); -1: the two swapped


class TritonPythonModel:
    def execute(self, requests):
        return [self._answer(r) for r in requests]

    def _answer(self, request):
        a, b = (pb_utils.get_input_tensor_by_name(request, n).as_numpy()
                for n in ("INPUT0", "INPUT1"))
        pair = (a + b, a - b)[::SIGN]
        return pb_utils.InferenceResponse(
            [pb_utils.Tensor(f"OUTPUT{i}", x.astype(np.int32)) for i, x in enumerate(pair)])
"""

NS_IO = """
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""

AMBIGUOUS = ("There are 2 identifiers of model '{}' in global map, model namespace must be "
             "provided to resolve ambiguity.")
DATA = np.arange(16, dtype=np.int32)
ADD, SUB = (DATA + DATA, DATA - DATA), (DATA - DATA, DATA + DATA)


def _addsub(repo: Path, name: str, sign: int) -> None:
    write_model(repo, name, ADDSUB_PY.replace("{sign}", str(sign)), 'backend: "python"\n' + NS_IO)


def write_step_ensemble(repo: Path, name: str, step: str) -> None:
    """The ensemble ``name`` of one step, model ``step``: FP32 ``IN`` to ``OUT``."""
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        'platform: "ensemble"\nmax_batch_size: 0\n'
        'input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
        'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
        f'ensemble_scheduling {{ step [ {{ model_name: "{step}" model_version: -1 '
        'input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "OUT" } } ] }\n')


def _one_step_ensemble(repo: Path, name: str, step: str) -> None:
    maps = "".join(f' input_map {{ key: "INPUT{i}" value: "INPUT{i}" }}' for i in (0, 1)) + \
        "".join(f' output_map {{ key: "OUTPUT{i}" value: "OUTPUT{i}" }}' for i in (0, 1))
    write_model(repo, name, "", f'platform: "ensemble"\n{NS_IO}ensemble_scheduling {{ step [ '
                f'{{ model_name: "{step}" model_version: -1{maps} }} ] }}\n')


def namespacing_repos(tmp_path: Path, scenario: str) -> tuple[Path, Path]:
    """The two repositories of one of upstream's scenarios."""
    a, s = tmp_path / "addsub_repo", tmp_path / "subadd_repo"
    if scenario == "no_duplication":
        _one_step_ensemble(a, "simple_addsub", "composing_addsub")
        _addsub(a, "composing_addsub", 1)
        _one_step_ensemble(s, "simple_subadd", "composing_subadd")
        _addsub(s, "composing_subadd", -1)
    elif scenario == "duplication":
        _one_step_ensemble(a, "simple_addsub", "composing_model")
        _addsub(a, "composing_model", 1)
        _one_step_ensemble(s, "simple_subadd", "composing_model")
        _addsub(s, "composing_model", -1)
    else:  # ensemble_duplication
        _one_step_ensemble(a, "simple_ensemble", "composing_addsub")
        _addsub(a, "composing_addsub", 1)
        _one_step_ensemble(s, "simple_ensemble", "composing_subadd")
        _addsub(s, "composing_subadd", -1)
    return a, s
