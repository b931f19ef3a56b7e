"""How the model code of a :class:`~tritonpy.testing.ModelRunner` reaches its runner: the
open runners, the runner running in a context, and the runtime that stands in for the stub's
in ``pb_utils`` while any runner is open (see :mod:`tritonpy.testing`).
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import sys
import threading
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

if TYPE_CHECKING:
    from tritonpy.testing import ModelRunner

_LOG_LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}
# The open runners, oldest first. While there is one, pb_utils._runtime is _RUNTIME, saved
# from and restored to what it was before the first opened.
_install_lock = threading.Lock()
_open_runners: list[ModelRunner] = []
_runtime_before: Any = None
# The runner whose model code runs in this context (its hooks and the tasks they start): the
# one pb_utils' calls (Logger, metrics, BLS, get_model_dir) reach.
_running: contextvars.ContextVar[ModelRunner | None] = contextvars.ContextVar(
    "tritonpy_testing_runner", default=None)


def _pb() -> Any:
    """The pb_utils module, also installed as ``triton_python_backend_utils``."""
    from tritonpy.stub import pb_utils

    sys.modules.setdefault("triton_python_backend_utils", pb_utils)
    return pb_utils


def _pberrors() -> Any:
    from tritonpy.stub import _pberrors

    return _pberrors


def _install(runner: ModelRunner) -> None:
    """``runner`` is open: the first one opened puts :data:`_RUNTIME` in pb_utils."""
    global _runtime_before
    pb = _pb()
    with _install_lock:
        if not _open_runners:
            _runtime_before = pb._runtime
            pb._runtime = _RUNTIME
        _open_runners.append(runner)


def _uninstall(runner: ModelRunner) -> None:
    """``runner`` is closed: the last one closed puts back pb_utils' runtime of before."""
    pb = _pb()
    with _install_lock:
        if runner in _open_runners:
            _open_runners.remove(runner)
            if not _open_runners and pb._runtime is _RUNTIME:
                pb._runtime = _runtime_before


@contextlib.contextmanager
def _others_hidden(runner: ModelRunner) -> Iterator[None]:
    """The other open runners' added folders off ``sys.path`` and their models' own modules
    out of ``sys.modules`` meanwhile; put back after, behind ``runner``'s (a module of the
    same name stays ``runner``'s: a later import of that name outside the import of a model
    finds the newest runner's)."""
    with _install_lock:
        others = [r for r in _open_runners if r is not runner]
    paths = [p for r in others for p in r._added_paths if p in sys.path]
    modules = {n: sys.modules.pop(n) for r in others for n in r._own_modules if n in sys.modules}
    for p in paths:
        sys.path.remove(p)
    try:
        yield
    finally:
        sys.path.extend(p for p in paths if p not in sys.path)
        for name, module in modules.items():
            sys.modules.setdefault(name, module)


class _RunnerRuntime:
    """What pb_utils calls when it needs a server, answered in-process by the runner whose
    model made the call."""

    @property
    def runner(self) -> ModelRunner:
        """The runner running this code, else (a thread the model started) the newest open."""
        running = _running.get()
        if running is not None:
            return running
        with _install_lock:
            if not _open_runners:  # a call that began as the last runner closed
                raise _pb().TritonModelException("the model's ModelRunner is closed")
            return _open_runners[-1]

    @property
    def version_dir(self) -> str:
        return self.runner.version_dir

    def _owner(self, req: Any) -> ModelRunner:
        return getattr(req, "_tritonpy_runner", None) or self.runner

    @staticmethod
    def _family_owner(family_id: int) -> ModelRunner | None:
        """The open runner whose model made that MetricFamily: its deletion may come from the
        garbage collector, in whatever code runs then."""
        with _install_lock:
            return next((r for r in _open_runners if family_id in r._metric_made), None)

    def send_response(self, req: Any, resp: Any, final: bool) -> None:
        r = self._owner(req)
        with r._sent_cv:
            if resp is not None:
                r._sent.setdefault(req._host_id, []).append(resp)
            if final:
                r._final.add(req._host_id)
                r._sent_cv.notify_all()

    def _bls(self, req: Any, decoupled: bool) -> Any:
        pb = _pb()
        r = self.runner
        if r.bls_handler is None:
            raise pb.TritonModelException(
                f"BLS request to model '{req.model_name()}' from '{r.name}': "
                "tritonpy.testing.ModelRunner runs one model without a server; pass "
                "bls_handler=... to answer BLS calls, or test with tritonpy.Server")
        if r._phase != "execute":
            raise pb.TritonModelException(
                "BLS is only supported during the 'execute' function. "
                f"(this call came from {r._phase}())")
        return r.bls_handler(req, decoupled)

    def bls_exec(self, req: Any, decoupled: bool) -> Any:
        out = self._bls(req, decoupled)
        return iter(out) if decoupled else out

    def bls_async_exec(self, req: Any, decoupled: bool) -> Any:
        """As a stub's: the handler is called now (needing a running event loop, as Triton's
        async_exec does), and the Task returned gives what it answers."""
        import asyncio

        loop = asyncio.get_running_loop()
        out = self._bls(req, decoupled)

        async def reply() -> Any:
            answer = await out if inspect.isawaitable(out) else out
            return iter(answer) if decoupled else answer
        return loop.create_task(reply())

    def model_call(self, what: str, name: str, **kw: Any) -> Any:
        raise _pb().TritonModelException(
            f"the model loading API ({what} '{name}') needs a tritonpy server in explicit "
            "model control mode; ModelRunner runs one model on its own")

    def log(self, level: int, message: str, where: tuple[str, int] | None = None) -> None:
        r = self.runner
        r.log.log(_LOG_LEVELS.get(level, logging.INFO), "[%s] %s", r.instance_name, message)

    def metric_family(self, name: str, description: str, kind: int, family_id: int) -> None:
        r = self.runner
        known = r.metric_kinds.setdefault(name, kind)
        if known != kind:  # as the server: one name, one kind
            raise _pb().TritonModelException(
                f"metric family '{name}' already exists with another kind ({known})")
        r._metric_made[family_id] = set()

    def metric_family_delete(self, name: str, family_id: int, collecting: bool = False) -> None:
        # As the server: the series made through that object go (unless another family object
        # made them too); not once the runner is closed (finalize returned). In process there
        # is no frame to interrupt: a deletion by the cyclic collector applies at once.
        r = self._family_owner(family_id)
        if r is None:
            return
        made = r._metric_made.pop(family_id)
        others = set().union(*r._metric_made.values())
        for key in made - others:
            r.metrics.pop(key, None)

    def metric_op(self, family: str, labels: dict, op: str, value: float,
                  buckets: list | None, family_id: int = 0) -> None:
        key = (family, tuple(sorted(labels.items())))
        if op == "create":  # from the family's own runner, wherever the Metric is made
            r = self._family_owner(family_id)
            if r is not None:
                r.metrics.setdefault(key, 0.0)
                r._metric_made[family_id].add(key)
            return
        m = self.runner.metrics
        if op == "set":
            m[key] = value
        else:  # increment, observe
            m[key] = m.get(key, 0.0) + value

    def metric_value(self, family: str, labels: dict) -> float:
        return self.runner.metrics.get((family, tuple(sorted(labels.items()))), 0.0)

    def new_shm_array(self, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        return np.empty(shape, dtype=dtype)


_RUNTIME = _RunnerRuntime()
