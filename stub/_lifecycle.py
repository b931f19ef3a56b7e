"""The lifecycle calls of a stub's model: its import, ``initialize``, ``auto_complete_config``,
``is_ready`` and ``finalize`` (run on the stub's main thread, as Triton's stub runs them).
"""
from __future__ import annotations

import inspect
import os
import sys
import traceback
import types
from typing import Any

from tritonpy.shm import Pool

from . import pb_utils
from ._pberrors import _error_body, exception_text
from ._loader import import_model, model_search_path
from ._execute import _Executor


class _SharedMemory:
    """``c_python_backend_utils.shared_memory``: this stub's shared memory."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def free_memory(self) -> int:
        """Bytes free in the segments this stub has mapped (as Triton's, in its region)."""
        usage = self._pool.usage()
        return usage["mapped_bytes"] - usage["used_bytes"]


def _c_utils(pool: Pool) -> types.ModuleType:
    """Triton's C++ module ``c_python_backend_utils``, which some models import beside
    pb_utils (Triton's QA restart model: ``c_utils.shared_memory.free_memory()``): pb_utils'
    names, and ``shared_memory``."""
    module = types.ModuleType("c_python_backend_utils")
    for name in pb_utils.__all__:
        setattr(module, name, getattr(pb_utils, name))
    module.shared_memory = _SharedMemory(pool)  # type: ignore[attr-defined]
    return module


async def _awaited(awaitable: Any) -> Any:
    """A coroutine of any awaitable (asyncio.run takes coroutines only)."""
    return await awaitable


class _Lifecycle(_Executor):
    """The lifecycle calls of :class:`._runtime.StubRuntime` (a mixin: see ``_stubstate``)."""

    def _load_module(self, body: dict) -> Any:
        """Import the model of an INITIALIZE or AUTO_COMPLETE frame (see
        ``tritonpy.repository.model_source``)."""
        sys.modules["triton_python_backend_utils"] = pb_utils
        sys.modules.setdefault("c_python_backend_utils", _c_utils(self.pool))
        model_file, version_dir = body["model_file"], body["version_dir"]
        self.version_dir = version_dir
        backend = body.get("backend_dir")
        if backend is not None:
            # A Python-based backend, as Triton 2.51 imports it (measured): its folder is
            # searched last, the model's folders not at all, and its model.py is the
            # top-level module "model".
            if backend not in sys.path:
                sys.path.append(backend)
            return import_model(model_file, None)
        # As Triton: the version directory's files and then the model directory's (beside
        # config.pbtxt, shared by the versions) import as plain modules, searched after the
        # standard library and site-packages (as Triton 2.51 appends them, measured: a csv.py
        # of the model's does not shadow the csv a library of it imports), and model.py is
        # the module "<version>.model" (its relative imports work).
        for folder in model_search_path(version_dir):
            if folder not in sys.path:
                sys.path.append(folder)
        module = import_model(model_file, os.path.basename(os.path.normpath(version_dir)))
        # ``import model`` (e.g. Triton's QA models' unittest.main("model")) finds this one.
        sys.modules.setdefault(module.__name__.rpartition(".")[2], module)
        return module

    def _initialize(self, body: dict) -> dict:
        self.phase = "initialize"
        try:
            import json

            module = self._load_module(body)
            self.model = module.TritonPythonModel()
            args = body["args"]
            self.model_config = json.loads(args["model_config"])
            self.decoupled = bool(body.get("decoupled"))
            # Only an iterative sequence batcher takes a request back for another execute.
            self.reschedulable = bool((self.model_config.get("sequence_batching") or {})
                                      .get("iterative_sequence"))
            force = ((self.model_config.get("parameters") or {})
                     .get("FORCE_CPU_ONLY_INPUT_TENSORS") or {}).get("string_value", "yes")
            self.cpu_inputs = str(force).strip().lower() not in ("no", "false", "off", "0")
            self.max_async = max(1, int(body.get("max_async", 1)))
            if hasattr(self.model, "initialize"):
                result = self.model.initialize(args)
                if inspect.isawaitable(result):
                    import asyncio

                    asyncio.run(_awaited(result))  # an async initialize is allowed by Triton
            is_async = inspect.iscoroutinefunction(getattr(self.model, "execute", None))
            if not hasattr(self.model, "execute"):
                raise AttributeError("TritonPythonModel has no execute() method")
            if is_async:
                self._start_async_loop()
        # As Triton writes it: "Type: message", then the model's frames; sys.exit() too.
        except BaseException as exc:  # noqa: B036
            return {"ok": False, "error": _error_body("INTERNAL", exception_text(exc))}
        finally:
            self.phase = "ready"
        return {"ok": True, "async": is_async, "has_is_ready": hasattr(self.model, "is_ready")}

    def _auto_complete(self, body: dict) -> dict:
        self.phase = "initialize"
        try:
            module = self._load_module(body)
            cls = module.TritonPythonModel
            cfg = pb_utils.ModelConfig(body["config"])
            fn = getattr(cls, "auto_complete_config", None)
            if fn is not None:
                cfg = fn(cfg)
            if not isinstance(cfg, pb_utils.ModelConfig):  # a forgotten ``return``: Triton's words
                return {"ok": False, "error": _error_body("INTERNAL", (
                    f"auto_complete_config function in model '{body['config'].get('name', '')}' "
                    "must return a valid pb.ModelConfig object."))}
            return {"ok": True, "config": cfg.as_dict()}
        except BaseException as exc:  # noqa: B036 (sys.exit() too, as in initialize)
            return {"ok": False, "error": _error_body("INTERNAL", exception_text(exc))}

    def _is_ready(self) -> dict:
        fn = getattr(self.model, "is_ready", None)
        if fn is None:
            return {"ok": True, "ready": True}
        try:
            return {"ok": True, "ready": bool(fn())}
        except Exception:
            return {"ok": True, "ready": False, "reason": traceback.format_exc(limit=3)}

    def _finalize(self) -> dict:
        self.phase = "finalize"
        try:
            fn = getattr(self.model, "finalize", None)
            if fn is not None:
                result = fn()
                if inspect.isawaitable(result):
                    import asyncio

                    asyncio.run(_awaited(result))
        except BaseException:  # noqa: B036 (sys.exit() too: the stub must still end at once)
            return {"ok": False, "error": _error_body("INTERNAL", traceback.format_exc())}
        finally:
            self.flush_metric_deletes()
            self._finalized = True
            if self._async_loop is not None:
                self._async_loop.call_soon_threadsafe(self._async_loop.stop)
        return {"ok": True}
