"""Unit-test a Triton Python model in the current interpreter, without a server.

:class:`ModelRunner` loads ``model.py`` the way a stub does (``triton_python_backend_utils``
importable, the version directory on ``sys.path``), builds ``initialize``'s ``args`` the way
Triton does (the configuration read, auto-completed and normalised, then serialised to
Triton's JSON), and runs ``execute`` on requests you give as dicts of numpy arrays::

    import numpy as np
    import triton_python_backend_utils as pb_utils
    from tritonpy.testing import ModelRunner

    def test_add_sub():
        with ModelRunner("examples/add_sub") as runner:
            a = np.arange(4, dtype=np.float32)
            [response] = runner.execute([{"INPUT0": a, "INPUT1": a}])
            assert not response.has_error()
            out = pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy()
            np.testing.assert_array_equal(out, a + a)

What a server would do around ``execute`` is done here too: inputs are checked against the
configuration (as the host does before a stub sees a request; ``validate=False`` turns that
off), BYTES inputs reach the model as object arrays of ``bytes``, and a wrong return value
(type or count) raises the error a server would report. An exception raised by ``execute``
propagates unchanged, with its traceback. Responses are returned as the model built them: a
server would also drop the outputs a request did not ask for.

While a runner is open it stands in for the stub's runtime, so ``pb_utils.Logger`` writes to
the ``tritonpy.model.<name>`` logger, custom metrics keep their values (:attr:`metrics`), and
the response sender works (default mode, and decoupled models through
:meth:`ModelRunner.execute_decoupled`). Several runners may be open at once: the code a runner
runs (``initialize``, ``execute``, ``finalize``, ``is_ready``, and the asyncio tasks they
start) logs, counts, calls BLS and reads ``get_model_dir()`` through its own runner. A thread
the model starts does not carry that (Python threads do not inherit context): its calls go to
the newest open runner (a response sender's still reach its request's runner). BLS
(``InferenceRequest.exec``/``async_exec``) raises a clear
:class:`~triton_python_backend_utils.TritonModelException` unless you pass ``bls_handler``, a
function that answers BLS requests in the test's place. The model loading API
(``pb_utils.load_model`` …) always raises: it needs a server.
"""
from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import logging
import os
import sys
import threading
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from tritonpy._errors import InternalError, InvalidArgumentError
from tritonpy._instances import initialize_args
from tritonpy._testing_runtime import (
    _install,
    _others_hidden,
    _pb,
    _pberrors,
    _running,
    _uninstall,
)

__all__ = ["ModelRunner"]

_module_ids = itertools.count(1)
_request_ids = itertools.count(1)


class ModelRunner:
    """One model instance running in this interpreter: ``initialize`` now, ``finalize`` on close.

    Args:
        model: A model directory (``<model>/config.pbtxt`` and ``<model>/<version>/model.py``),
            a version directory, or the model file itself.
        config: The configuration: ``None`` reads ``config.pbtxt`` next to the version
            directories (a missing file is an empty configuration, as in Triton), a dict in
            Triton's JSON form, or ``config.pbtxt`` text. The model's
            ``auto_complete_config`` then runs on it, as the server runs it.
        version: The version directory to load when ``model`` is a model directory (and the
            version ``args`` reports).
        instance_name: ``args["model_instance_name"]``; ``<model>_0_0`` by default.
        model_name: The model's name; the configuration's ``name`` or the directory name by
            default.
        validate: Check requests against the configuration as the server does.
        bls_handler: Answers BLS calls: ``handler(request, decoupled)`` returns an
            ``InferenceResponse`` (or, when ``decoupled`` is True, an iterable of them).
            Without it BLS raises ``TritonModelException``.
        backend_directory: Where a model whose configuration names a Python-based backend
            finds its ``model.py`` (``<backend_directory>/<backend>/model.py``), as with
            ``Server(backend_directory=...)``; Triton's default,
            ``/opt/tritonserver/backends``, when None.

    Raises:
        ConfigError: The configuration is invalid; the message names its file, or
            ``ModelRunner(config=...)`` for one given.
        TypeError: ``config`` or ``bls_handler`` is of the wrong type.
        FileNotFoundError: There is no model file where one is expected.
        Exception: Whatever importing ``model.py`` or its ``initialize`` raises, unchanged.
    """

    def __init__(self, model: str | os.PathLike[str], config: Mapping[str, Any] | str | None = None,
                 version: int = 1, instance_name: str | None = None, *,
                 model_name: str | None = None, validate: bool = True,
                 bls_handler: Callable[[Any, bool], Any] | None = None,
                 backend_directory: str | os.PathLike[str] | None = None) -> None:
        from tritonpy.config import (
            auto_complete_input,
            auto_completed,
            config_from_dict,
            config_to_json,
            load_model_config,
            normalize_config,
            parse_config_text,
        )
        from tritonpy.repository import DEFAULT_BACKEND_DIRECTORY, backend_dir
        from tritonpy.validation import RequestValidator, Reshapes

        if config is not None and not isinstance(config, (str, Mapping)):
            raise TypeError("config must be None, a dict in Triton's JSON form or config.pbtxt "
                            f"text (a str), not {type(config).__name__}")
        if bls_handler is not None and not callable(bls_handler):
            raise TypeError("bls_handler must be a callable, handler(request, decoupled), or "
                            f"None, not {type(bls_handler).__name__}")
        pb = _pb()
        self._closed = True  # until initialize succeeds: close() has nothing to undo
        model_dir, version_dir, model_file, version = _locate(os.fspath(model), version)
        # What the configuration's errors name as its source: the file, or the argument.
        cfg_path = (os.path.join(model_dir, "config.pbtxt") if config is None
                    else "ModelRunner(config=...)")
        if config is None:
            cfg, _ = load_model_config(model_dir)
        elif isinstance(config, str) and not config.lstrip().startswith("{"):
            cfg = parse_config_text(config, cfg_path)
        else:
            cfg = config_from_dict(config if isinstance(config, str) else dict(config), cfg_path)
        name = model_name or cfg.name or os.path.basename(model_dir)
        backend = backend_dir(cfg, DEFAULT_BACKEND_DIRECTORY if backend_directory is None
                              else os.path.abspath(backend_directory))
        if model_file is None and backend:
            model_file = os.path.join(backend, "model.py")
        elif model_file is None:
            model_file = os.path.join(version_dir, cfg.default_model_filename or "model.py")
        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"{model_file}: model file does not exist")

        self.name = name
        self.version = version
        self.model_file = model_file
        self.version_dir = version_dir
        self.instance_name = instance_name or f"{name}_0_0"
        self.bls_handler = bls_handler
        self.metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.metric_kinds: dict[str, int] = {}  # family name -> kind
        # MetricFamily object id -> the series its metrics made (deleting it drops them)
        self._metric_made: dict[int, set[tuple[str, tuple[tuple[str, str], ...]]]] = {}
        self.log = logging.getLogger(f"tritonpy.model.{name}")
        self._sent: dict[int, list[Any]] = {}
        self._final: set[int] = set()
        self._sent_cv = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._phase = "initialize"

        from tritonpy.stub._loader import import_model, model_search_path

        # Searched after the standard library and site-packages, as a stub searches them: a
        # Python-based backend's folder (its models' folders not at all), or the model's.
        searched = [backend] if backend else model_search_path(version_dir)
        self._added_paths = [p for p in searched if p not in sys.path]
        sys.path.extend(self._added_paths)
        # Where the model's own modules come from (see _owns).
        self._own_folders = tuple(os.path.join(p, "") for p in (
            os.path.dirname(os.path.normpath(version_dir)), *self._added_paths))
        self._modules_before = set(sys.modules)  # (again below, once the others' are hidden)
        # Its own package name: several runners may hold models of the same version.
        self._package = f"_tritonpy_testing_model_{next(_module_ids)}"
        self._own_modules: set[str] = set()
        try:
            # The other open runners' folders and modules are out of sight while the model is
            # imported: its `import helper` is its own helper.py, not another model's (in a
            # server each stub is a process of its own).
            with _others_hidden(self):
                self._modules_before = set(sys.modules)
                self.module = import_model(model_file, self._package)
                self._own_modules = {n for n in set(sys.modules) - self._modules_before
                                     if self._owns(n)}
            cls = self.module.TritonPythonModel
            complete = getattr(cls, "auto_complete_config", None)
            if complete is not None:
                d = auto_complete_input(cfg, name)
                out = complete(pb.ModelConfig(d))
                if not isinstance(out, pb.ModelConfig):  # as a server (and Triton) refuses it
                    raise InternalError(f"auto_complete_config function in model '{d['name']}' "
                                        "must return a valid pb.ModelConfig object.")
                cfg = config_from_dict(out.as_dict(), auto_completed(name))
            self.model_config_proto = normalize_config(cfg, name, cfg_path, gpu_count=0)
            self.config_json = config_to_json(self.model_config_proto)
            #: The normalised configuration as the model sees it (Triton's JSON form).
            self.config: dict[str, Any] = json.loads(self.config_json)
            self.decoupled = bool(self.model_config_proto.model_transaction_policy.decoupled)
            self._validator = RequestValidator(self.model_config_proto, name) if validate else None
            self._reshapes = Reshapes.of(self.model_config_proto)
            #: ``initialize``'s argument, exactly as a server builds it.
            self.args: dict[str, str] = initialize_args(
                self.config_json, "CPU", self.instance_name, 0, model_dir, version, name)
            self.model = cls()
            if not hasattr(self.model, "execute"):
                raise AttributeError(f"{model_file}: TritonPythonModel has no execute() method")
            _install(self)
            self._closed = False
            if hasattr(self.model, "initialize"):
                self._call(self.model.initialize, self.args)
        except BaseException:
            self.close(finalize=False)
            raise
        self._phase = "execute"

    # -- requests -----------------------------------------------------------------------------
    def request(self, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None = None,
                *, request_id: str = "", correlation_id: int | str = 0, flags: int = 0,
                timeout: int = 0, parameters: Mapping[str, Any] | str | None = None) -> Any:
        """A ``pb_utils.InferenceRequest`` as ``execute`` would receive it.

        Args:
            inputs: Input name to array (or anything ``np.asarray`` takes; ``str`` elements
                arrive as UTF-8 ``bytes``, as they do through a server).
            requested_outputs: Output names asked for (``None``: all).
            request_id, correlation_id, flags, timeout, parameters: as a client sends them.

        Raises:
            InvalidArgumentError: ``inputs`` is not a mapping or ``requested_outputs`` no list
                of names; with ``validate``, the request does not fit the model.
        """
        from tritonpy.shm.dtypes import deserialize_bytes, serialize_bytes, triton_dtype_of

        # Named here, as the server names them, not as Python's errors from further in.
        if not isinstance(inputs, Mapping):
            raise InvalidArgumentError(
                f"inputs must be a mapping of input names to arrays, not {type(inputs).__name__}")
        if isinstance(requested_outputs, str):
            requested_outputs = [requested_outputs]
        elif requested_outputs is not None and not isinstance(requested_outputs, Iterable):
            raise InvalidArgumentError("requested_outputs must be a list of output names, not "
                                       f"{type(requested_outputs).__name__}")
        pb = _pb()
        arrays: dict[str, np.ndarray] = {}
        for n, value in inputs.items():
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
            if arr.dtype.kind in ("O", "S", "U"):
                # What the model sees through a server: a fresh object array of bytes.
                arr = deserialize_bytes(serialize_bytes(arr)).reshape(arr.shape)
            try:
                triton_dtype_of(arr)
            except TypeError:
                raise InvalidArgumentError(
                    f"input '{n}' has numpy dtype {arr.dtype}, which has no Triton data type"
                ) from None
            arrays[n] = arr
        if self._validator is not None:
            self._validator.validate(
                {n: (triton_dtype_of(a), tuple(a.shape)) for n, a in arrays.items()},
                list(requested_outputs or ()) or None, request_id)
        if self._reshapes is not None:
            # The model sees an input in its config's reshape form, as through a server.
            for n, a in arrays.items():
                shape = self._reshapes.input_shape(n, a.shape)
                if shape is not None:
                    arrays[n] = a.reshape(shape)
        req = pb.InferenceRequest(
            model_name=self.name, requested_output_names=list(requested_outputs or ()),
            inputs=[pb.Tensor(n, a) for n, a in arrays.items()], request_id=request_id,
            correlation_id=correlation_id, model_version=self.version, flags=flags,
            timeout=timeout, parameters=dict(parameters) if isinstance(parameters, Mapping)
            else parameters)
        self._adopt(req)
        return req

    def cancel(self, request: Any) -> None:
        """Mark a request cancelled: its ``is_cancelled()`` (and its sender's) turns True."""
        request._cancelled = True

    def execute(self, requests: Iterable[Mapping[str, Any] | Any],
                requested_outputs: Sequence[str] | None = None,
                timeout: float = 10.0) -> list[Any]:
        """Run ``execute`` on a batch and return one ``pb_utils.InferenceResponse`` per request.

        Args:
            requests: Each a dict of input arrays (see :meth:`request`) or a
                ``pb_utils.InferenceRequest`` (from :meth:`request`, or built by hand).
            requested_outputs: Applied to the requests given as dicts.
            timeout: Seconds to wait for responses a request's sender sends after ``execute``
                returned (``None`` for that request, or ``None`` in all).

        Returns:
            Per request, the response ``execute`` returned for it or, where it returned
            ``None``, the response its response sender sent (as with Triton, either before
            or after ``execute`` returned).

        Raises:
            TypeError: ``requests`` is not a list (or other iterable) of requests.
            InvalidArgumentError: A request is neither a dict nor an ``InferenceRequest``, or
                does not fit the model (see :meth:`request`).
            InternalError: ``execute`` returned something a server would refuse (the message
                is the one a client would get).
            TimeoutError: A sender did not send its final flag within ``timeout``.
            Exception: Whatever ``execute`` raises, unchanged.
        """
        if self.decoupled:
            raise InternalError(
                f"model '{self.name}' is decoupled: use ModelRunner.execute_decoupled()")
        reqs = self._requests(requests, requested_outputs)
        result = self._execute(reqs)
        if result is None:
            result = [None] * len(reqs)
        elif not isinstance(result, (list, tuple)):
            raise InternalError(self._failed(_pberrors().not_a_list(result)))
        if len(result) != len(reqs):
            raise InternalError(self._failed(_pberrors().count_mismatch(len(reqs), len(result))))
        missing = sum(resp is None and not r._taken for r, resp in zip(reqs, result))
        if missing:
            raise InternalError(
                f"execute() returned None, but no response was sent for {missing} of "
                f"{len(reqs)} request(s) of model '{self.name}'; return a list of "
                "InferenceResponse or use the response sender")
        for resp in result:
            if resp is not None and not isinstance(resp, _pb().InferenceResponse):
                raise InternalError(self._failed(_pberrors().not_a_response(resp)))
        self._wait_final([r for r, resp in zip(reqs, result) if resp is None], timeout)
        out = []
        for r, resp in zip(reqs, result):
            if resp is None:
                sent = self._take(r)
                resp = sent[0] if sent else _pb().InferenceResponse()
            out.append(resp)
        return out

    def execute_decoupled(self, requests: Iterable[Mapping[str, Any] | Any],
                          requested_outputs: Sequence[str] | None = None,
                          timeout: float = 10.0) -> list[list[Any]]:
        """Run a decoupled model's ``execute`` and collect every request's responses.

        Waits (up to ``timeout`` seconds) until each request's sender was given
        ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``: responses may come from threads the model
        started.

        Returns:
            Per request, the responses sent, in order (a final flag sent without a response
            adds nothing).

        Raises:
            InternalError: The model is not decoupled, or ``execute`` did not return ``None``.
            TimeoutError: A request was not finished within ``timeout``.
        """
        if not self.decoupled:
            raise InternalError(f"model '{self.name}' is not decoupled: use ModelRunner.execute()")
        reqs = self._requests(requests, requested_outputs)
        result = self._execute(reqs)
        if result is not None:
            raise InternalError(self._failed(_pberrors().decoupled_returned(self.instance_name)))
        self._wait_final(reqs, timeout)
        return [self._take(r) for r in reqs]

    def _failed(self, message: str) -> str:
        """What a client would be told (the failed execute's text, with the instance name)."""
        return str(_pberrors().execute_failed(self.instance_name, message))

    def _wait_final(self, reqs: list[Any], timeout: float) -> None:
        """Until every request's sender sent its final flag; TimeoutError after ``timeout``."""
        with self._sent_cv:
            done = self._sent_cv.wait_for(
                lambda: all(r._host_id in self._final for r in reqs), timeout)
        if not done:
            open_ = sum(r._host_id not in self._final for r in reqs)
            raise TimeoutError(f"{open_} request(s) got no TRITONSERVER_RESPONSE_COMPLETE_FINAL "
                               f"within {timeout} s")

    def is_ready(self) -> bool:
        """The model's ``is_ready()`` (True when it has none, False when it raises)."""
        fn = getattr(self.model, "is_ready", None)
        if fn is None:
            return True
        try:
            return bool(self._call(fn))
        except Exception:
            return False

    def close(self, finalize: bool = True) -> None:
        """Call ``finalize`` (once) and undo what loading the model changed in this process."""
        if not self._closed and finalize:
            self._phase = "finalize"
            fn = getattr(self.model, "finalize", None)
            try:
                if fn is not None:
                    self._call(fn)
            finally:
                self._teardown()
        else:
            self._teardown()

    def __enter__(self) -> ModelRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------
    def _teardown(self) -> None:
        if getattr(self, "_torn_down", False):
            return
        self._torn_down = True
        self._closed = True
        _uninstall(self)
        if self._loop is not None:
            loop, self._loop = self._loop, None
            loop.call_soon_threadsafe(loop.stop)
            self._loop_thread.join(timeout=5)
            if not self._loop_thread.is_alive():
                loop.close()
        # Modules loaded from the version and model directories (or the backend's) go, so
        # that another model's helper of the same name is imported afresh.
        for mod_name in (set(sys.modules) - self._modules_before) | self._own_modules:
            if self._owns(mod_name):
                sys.modules.pop(mod_name, None)
        for folder in self._added_paths:
            if folder in sys.path:
                sys.path.remove(folder)

    def _owns(self, mod_name: str) -> bool:
        """Whether module ``mod_name`` was loaded from this model's folders (or the backend's)
        or is its package."""
        f = getattr(sys.modules.get(mod_name), "__file__", None) or ""
        return f.startswith(self._own_folders) or mod_name.partition(".")[0] == self._package

    def _adopt(self, req: Any) -> None:
        req._host_id = next(_request_ids)
        req._decoupled_model = self.decoupled
        req._tritonpy_runner = self

    def _requests(self, requests: Iterable[Any], requested_outputs: Sequence[str] | None) -> list:
        if self._closed:
            raise InternalError(f"ModelRunner for '{self.name}' is closed")
        if isinstance(requests, Mapping):
            raise TypeError("execute() takes a list of requests: wrap the dict in a list")
        if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
            raise TypeError("requests must be a list of requests (dicts of input arrays or "
                            f"pb_utils.InferenceRequest), not {type(requests).__name__}")
        pb = _pb()
        out = []
        for i, r in enumerate(requests):
            if isinstance(r, pb.InferenceRequest):
                if getattr(r, "_tritonpy_runner", None) is not self:
                    self._adopt(r)
                out.append(r)
            elif isinstance(r, Mapping):
                out.append(self.request(r, requested_outputs))
            else:
                raise InvalidArgumentError(f"request {i} must be a dict of input arrays or a "
                                           f"pb_utils.InferenceRequest, not {type(r).__name__}")
        return out

    def _execute(self, reqs: list) -> Any:
        with self._sent_cv:
            for r in reqs:
                self._sent.pop(r._host_id, None)
                self._final.discard(r._host_id)
        return self._call(self.model.execute, reqs)

    def _call(self, hook: Callable[..., Any], *args: Any) -> Any:
        """``hook(*args)`` run as this runner's model code, awaited when it is awaitable
        (async def hooks)."""
        token = _running.set(self)
        try:
            return self._resolve(hook(*args))
        finally:
            _running.reset(token)

    def _resolve(self, result: Any) -> Any:
        """``result``, or what it resolves to when it is awaitable."""
        if not inspect.isawaitable(result):
            return result
        if self._loop is None:
            # One loop in a thread for the runner's life: async state made in initialize stays
            # usable in execute, and a caller inside its own event loop is not disturbed.
            loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=loop.run_forever, daemon=True,
                                                 name=f"{self.name}-runner-loop")
            self._loop_thread.start()
            self._loop = loop

        async def wait() -> Any:
            return await result

        # The task runs in a copy of this thread's context: the runner stays _running there,
        # and in the tasks it starts.
        return asyncio.run_coroutine_threadsafe(wait(), self._loop).result()

    def _take(self, req: Any) -> list:
        with self._sent_cv:
            self._final.discard(req._host_id)
            return self._sent.pop(req._host_id, [])


def _locate(path: str, version: int) -> tuple[str, str, str | None, int]:
    """``(model_dir, version_dir, model_file or None, version)`` for what the user named."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        vdir = os.path.dirname(path)
        base = os.path.basename(vdir)
        if base.isdigit():
            return os.path.dirname(vdir), vdir, path, int(base)
        return vdir, vdir, path, version
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such model directory or file")
    base = os.path.basename(path)
    if base.isdigit() and not os.path.isdir(os.path.join(path, str(version))):
        return os.path.dirname(path), path, None, int(base)
    return path, os.path.join(path, str(version)), None, version
