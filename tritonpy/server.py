"""The in-process API: ``tritonpy.Server`` and ``Model`` — what a host server embeds.

Shaped after Triton's own in-process Python API (the ``tritonserver`` package): a server over
one or more model repositories, model handles with ``infer``/``async_infer`` returning
iterables of responses, and the repository, statistics and metrics views the frontends serve.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import operator
import os
import threading
from typing import Any, Mapping, Sequence

import numpy as np
from prometheus_client import CollectorRegistry

from tritonpy.shm import Pool, TensorTransport
from tritonpy.shm.dtypes import triton_dtype_of
from tritonpy.shm.waiting import StallWatch

from . import _repo_manager
from ._bls import BlsRouter
from ._cache import ResponseCache
from ._custom_metrics import CustomMetrics
from . import _arguments as arg
from ._errors import InvalidArgumentError, TritonpyError, input_twice, public
from ._loop import FrameLoop
from ._model import ModelRuntime
from ._model_handle import Model
from ._options import BackendOptions
from ._ratelimit import RateLimiter, parse_resource
from ._request import HostRequest
from ._timers import Timers
from ._server_lifecycle import ServerLifecycle
from ._server_stats import ServerStats
from ._server_stubs import ServerStubs
from ._stats import CounterCarry, MetricsConfig
from ._stubproc import StubProcess
from ._trace import Tracing
from .repository import DEFAULT_BACKEND_DIRECTORY, repository_problem

log = logging.getLogger("tritonpy")
__version__ = "0.1.0"


def load_models_problem(model_control_mode: str, load_models: Sequence[str]) -> str:
    """What is wrong with models to load at start (empty: nothing), in Triton's words: it
    refuses to start then, rather than load every model or some of them."""
    if load_models and model_control_mode != "explicit":
        return ("Use of '--load-model' requires setting '--model-control-mode=explicit' as "
                "well.")
    if "*" in load_models and len(load_models) > 1:
        return "Wildcard model name '*' must be the ONLY startup model if specified at all."
    return ""


EXTENSIONS = ["classification", "sequence", "model_repository", "model_repository(unload_dependents)",
              "schedule_policy", "model_configuration", "system_shared_memory", "binary_tensor_data",
              "parameters", "statistics", "trace", "logging"]


# Its lifecycle (start, stop, abort), its talk with the stubs outside requests and its
# statistics views are parts of its own, each in a module (mixins: they share its state).
@public
class Server(ServerLifecycle, ServerStubs, ServerStats):
    """A tritonpy server: model repositories, stubs, scheduling, BLS routing.

    Args:
        model_repository: one or more repository directories (str, bytes or
            ``os.PathLike``).
        model_control_mode: ``"none"`` (load everything at start), ``"explicit"`` (load what
            ``load_models``/``load()`` ask for) or ``"poll"`` (rescan and reload on changes).
        load_models: models to load at start in explicit mode (``"*"`` for all; None: none).
        backend_config: Triton's python backend options, e.g.
            ``{"shm-default-byte-size": "16777216", "shm-region-prefix-name": "myapp_"}``.
        exit_timeout: seconds ``stop()`` waits for in-flight requests.
        poll_interval: seconds between repository scans in poll mode (0: the repository is
            read at start only, as Triton's ``--repository-poll-secs 0``).
        strict_readiness: not ready while a model failed to load or is loading (Triton's
            default).
        auto_complete: call a model's ``auto_complete_config`` (and allow a missing
            config.pbtxt); False is Triton's ``--disable-auto-complete-config``.
        tracing: the trace settings (Triton's ``--trace-config``); tracing is off without.
        model_config_name: Triton's ``--model-config-name``: a model whose directory has
            ``configs/<name>.pbtxt`` is configured by it instead of its ``config.pbtxt``.
        response_cache_size: bytes of Triton's local response cache (``--cache-config
            local,size=N``) for the models whose config enables ``response_cache``; 0: none
            (those models run every request, as in Triton).
        model_load_retry_count: how many times a model that fails to load is tried again
            (Triton's ``--model-load-retry-count``); an invalid configuration is not.
        metrics_config: Triton's ``--metrics-config`` (duration counters on or off, duration
            summaries and their quantiles); None: Triton's defaults (counters, no summaries).
        backend_directory: Triton's ``--backend-directory``, where a model whose config names
            another backend than ``python`` finds it as a Python-based backend
            (``<backend_directory>/<backend>/model.py``); None: Triton's default,
            ``/opt/tritonserver/backends``.
        rate_limit: Triton's ``--rate-limit``: ``"execution_count"`` turns the rate limiter
            on (an instance whose group lists ``rate_limiter`` resources runs an execute only
            while they are free, across models); ``"off"`` (the default) ignores them.
        rate_limit_resources: Triton's ``--rate-limit-resource``, each
            ``"<name>:<count>[:<device>]"``: the copies of a resource (on every device, and for
            a global one, without a device); others have as many as the largest count an
            instance lists.
        model_namespacing: Triton's ``--model-namespacing``: a model name that two
            repositories hold is two models, each ensemble running the steps of its own
            repository first; a request, a load or an unload naming it stands for both (a
            request is refused for its ambiguity), and the metrics carry a ``namespace`` label
            (the repository). False: such a name is served by neither (as Triton).
        loop: a running event loop on which to read the stubs' frames, typically the one the
            caller serves its clients on (``tritonpy serve`` passes the HTTP/gRPC loop): a
            response then reaches an ``async_infer`` caller there with no hand-off between
            threads. It must run until :meth:`stop` returns. None: a thread of the server's own.
    """

    def __init__(self, model_repository: arg.PathArg | Sequence[arg.PathArg] | None = None, *,
                 model_control_mode: str = "none", load_models: Sequence[str] | None = (),
                 backend_config: Mapping[str, str] | None = None, log_verbose: int = 0,
                 exit_timeout: float = 30.0, poll_interval: float = 1.0,
                 strict_readiness: bool = True, auto_complete: bool = True,
                 server_id: str = "triton", tracing: Tracing | None = None,
                 loop: asyncio.AbstractEventLoop | None = None,
                 model_config_name: str = "", response_cache_size: int = 0,
                 model_load_retry_count: int = 0,
                 metrics_config: MetricsConfig | None = None,
                 backend_directory: arg.PathArg | None = None,
                 rate_limit: str = "off",
                 rate_limit_resources: Sequence[str] = (),
                 model_namespacing: bool = False) -> None:
        repos = [] if model_repository is None else arg.paths(model_repository)
        if model_control_mode not in ("none", "explicit", "poll"):
            raise InvalidArgumentError(
                f"model_control_mode must be none, explicit or poll, not {model_control_mode!r}")
        load_models = arg.names("load_models", load_models)
        if backend_config is not None and not isinstance(backend_config, Mapping):
            raise InvalidArgumentError(f"backend_config must be a mapping of keys to values, "
                                       f"not {type(backend_config).__name__}")
        log_verbose = arg.count("log_verbose", log_verbose)
        exit_timeout = arg.seconds("exit_timeout", exit_timeout)
        poll_interval = arg.seconds("poll_interval", poll_interval)
        model_load_retry_count = arg.count("model_load_retry_count", model_load_retry_count)
        response_cache_size = arg.count("response_cache_size", response_cache_size)
        for what, text in (("server_id", server_id), ("model_config_name", model_config_name),
                           ("rate_limit", rate_limit)):
            if not isinstance(text, str):
                raise InvalidArgumentError(f"{what} must be a str, not {type(text).__name__}")
        rate_limit_resources = arg.names("rate_limit_resources", rate_limit_resources, "resources")
        strict_readiness = arg.flag("strict_readiness", strict_readiness)
        auto_complete = arg.flag("auto_complete", auto_complete)
        model_namespacing = arg.flag("model_namespacing", model_namespacing)
        arg.instance("tracing", tracing, Tracing, "a tritonpy.Tracing")
        arg.instance("loop", loop, asyncio.AbstractEventLoop, "an asyncio event loop")
        arg.instance("metrics_config", metrics_config, MetricsConfig, "a tritonpy.MetricsConfig")
        problem = load_models_problem(model_control_mode, load_models)
        if problem:
            raise InvalidArgumentError(problem)
        for r in repos:
            wrong = repository_problem(r)
            if wrong:
                raise InvalidArgumentError(wrong)
        self.repositories = [os.path.abspath(r) for r in repos]
        # Triton's --model-namespacing: see RepositoryManager.
        self.model_namespacing = model_namespacing
        self.model_control_mode = model_control_mode
        self.load_models = list(load_models)
        self.options = BackendOptions.from_mapping(backend_config)
        self.log_verbose = log_verbose
        self.exit_timeout = exit_timeout
        self.poll_interval = poll_interval
        self.strict_readiness = strict_readiness
        # False: a model's auto_complete_config is never called and config.pbtxt is required
        # (Triton's --disable-auto-complete-config).
        self.auto_complete = auto_complete
        self.model_config_name = model_config_name
        if rate_limit.lower() not in ("off", "execution_count"):
            raise InvalidArgumentError(
                f"rate_limit must be off or execution_count, not {rate_limit!r}")
        # Triton's rate limiter, with --rate-limit execution_count (see _ratelimit).
        self.limiter = (RateLimiter(parse_resource(r) for r in rate_limit_resources)
                        if rate_limit.lower() == "execution_count" else None)
        self.backend_directory = os.path.abspath(
            DEFAULT_BACKEND_DIRECTORY if backend_directory is None
            else arg.path("backend_directory", backend_directory))
        self.model_load_retry_count = model_load_retry_count
        # Triton's --metrics-config: duration counters and summaries on the metrics page.
        self.metrics_config = metrics_config if metrics_config is not None else MetricsConfig()
        # Triton's local response cache (--cache-config local,size=N); None: no cache.
        self.response_cache = ResponseCache(response_cache_size) if response_cache_size > 0 \
            else None
        # The name in the server metadata: Triton's default, which clients written for Triton
        # check (Triton's --id).
        self.server_id = server_id
        # Triton's trace extension: requests from the HTTP and gRPC frontends are traced
        # by these settings (off unless given a level and a file).
        self.tracing = tracing if tracing is not None else Tracing()
        self.metrics_registry = CollectorRegistry(auto_describe=True)
        # The per-model Prometheus counters across reloads and unloads (Triton's lifetimes).
        self.counter_carry = CounterCarry()
        # A dead stub's MetricFamily objects keep no series (its death is no deletion).
        self.custom_metrics = CustomMetrics(is_live=lambda stub: bool(stub.alive))
        self.metrics_registry.register(self.custom_metrics)
        self.timers = Timers()
        self._loop = loop
        self.frames: FrameLoop = None  # type: ignore[assignment]  # from start()
        self.bls = BlsRouter(self)
        self.transport: TensorTransport = None  # type: ignore[assignment]
        self.pool: Pool = None  # type: ignore[assignment]
        self.repo = _repo_manager.RepositoryManager(self)
        self._started = False
        self._stopping = False
        self._draining = False  # a stop is draining its requests (see stop())
        self._in_start = False  # start() runs (see abort())
        # Why start() failed, if it did: ``tritonpy serve --exit-on-error=false`` goes on serving
        # such a server, as Triton does, neither live nor ready and "Server not ready" to calls.
        self.start_error: str | None = None
        self.refusing = False  # see refuse_new_requests()
        self._maint: threading.Thread | None = None
        # The stubs of instances being started (spawned, initializing or warming up), which a
        # stop does not wait for: cancel_loads() kills them and refuses to start more.
        self._starting: set[StubProcess] = set()
        self._starting_lock = threading.Lock()
        self.loads_cancelled = False
        # Other event loops whose stalls the maintenance watches too (watch_loop).
        self._loop_watches: list[StallWatch] = []
        # After stop(): the model versions whose in-flight requests outlasted exit_timeout.
        self.cut_short: list[str] = []
        self.aborted = False  # abort() cut the stop short (its log says so, not a timeout)

    def tell_reserved(self, instances: Sequence[Any]) -> None:
        """The rate limiter reserved resources for ``instances``: their models dispatch
        (on the timer thread: the caller may hold a model's lock)."""
        for inst in instances:
            self.timers.at(0.0, functools.partial(inst.model.kick_reserved, inst))

    # -- health and metadata ---------------------------------------------------------------------
    def live(self) -> bool:
        return self._started and not self._stopping and not self.refusing

    def refuse_new_requests(self) -> None:
        """The start of ``tritonpy serve``'s stop, as Triton's: the server is neither live nor
        ready from now on, and its frontends refuse clients' new inference requests (Triton's
        UNAVAILABLE "Server is stopping, ..."), while the requests in flight finish and the
        BLS calls they make go on."""
        self.refusing = True

    def ready(self) -> bool:
        """Live, every loaded model ready and, with ``strict_readiness`` (Triton's default), no
        model that failed to load or is still loading; models unloaded on purpose do not
        count."""
        if not (self.live() and self.repo.all_ready()):
            return False
        return not (self.strict_readiness and self.repo.not_available())

    def metadata(self) -> dict:
        extensions = list(EXTENSIONS)
        if self.repo.gpu_count():  # as a Triton built with GPU support
            extensions.insert(extensions.index("system_shared_memory") + 1, "cuda_shared_memory")
        return {"name": self.server_id, "version": __version__, "extensions": extensions}

    def models(self) -> list[dict]:
        """Repository index: ``{"name", "version", "state", "reason"}`` for every model, as
        Triton's: a model never loaded has only its name (the rest ""), an unloaded one its
        last versions, each ``UNAVAILABLE`` with reason ``"unloaded"``."""
        self._require_started()
        return self.repo.index()

    def model(self, name: str, version: int = -1) -> Model:
        """A handle on a model; NotFoundError if the repository has no such model,
        UnavailableError before :meth:`start` or after :meth:`stop`. The version is looked
        up by each request (a version not loaded yet may be by then)."""
        if not self._started:  # (the check, before the call: every request comes here)
            self._require_started()
        if type(name) is not str:  # (a plain str goes the short way: every request comes here)
            name = arg.model_name(name)
        self.repo.require_known(name)
        if type(version) is not int:
            try:
                version = operator.index(version)
            except TypeError:
                raise InvalidArgumentError(f"model version must be an int (-1: the latest), "
                                           f"not {type(version).__name__}") from None
        if version < -1:
            raise InvalidArgumentError(f"model version must be -1 (the latest) or a version "
                                       f"number, not {version}")
        return Model(self, name, version)

    def load(self, name: str, config: str | bytes | Mapping[str, Any] | None = None,
             files: Mapping[str, bytes] | None = None) -> None:
        """Load or reload a model (explicit mode): raises with the reason on failure.
        ``config``: a config override, Triton's model configuration as JSON text (str or
        UTF-8 bytes), or as a dict, written as JSON (numpy numbers and arrays as the numbers
        and lists they hold); ``files``: ``{"file:1/model.py": b"..."}``, with a config."""
        self._not_on_frame_loop("load()")
        self._require_started()
        if type(name) is not str:
            name = arg.model_name(name)
        text = arg.config_text(config)
        if files is not None and not isinstance(files, Mapping):
            raise InvalidArgumentError(f"files must be a mapping of paths to bytes, not "
                                       f"{type(files).__name__}")
        try:
            self.repo.load(name, config=text, files=files, api=True)
        except TritonpyError as exc:  # as Triton's, the server's log says so too
            self.log_failed_load(name, exc.message)
            raise

    def log_failed_load(self, name: str, why: str) -> None:
        """Log a failed load: as an error, unless a stop cut it short (no fault of the
        model's: :meth:`cancel_loads`)."""
        log.log(logging.INFO if self.loads_cancelled else logging.ERROR,
                "failed to load '%s': %s", name, why)

    def unload(self, name: str, unload_dependents: bool = False, wait: bool = True) -> None:
        """Unload a model (explicit mode); with ``unload_dependents`` an ensemble's step
        models go too, unless another loaded ensemble still runs them. The model takes no new
        request at once; those in flight or queued finish first, however long they take (as
        in Triton), and ``wait`` says whether to return only then (False: at once, as Triton's
        HTTP, gRPC and ``pb_utils.unload_model`` do; the model shows UNLOADING meanwhile)."""
        from ._ensemble_load import step_models_to_unload

        self._not_on_frame_loop("unload()")
        self._require_started()
        if type(name) is not str:
            name = arg.model_name(name)
        for what, flag in (("unload_dependents", unload_dependents), ("wait", wait)):
            if not isinstance(flag, (bool, int, np.bool_)):
                raise InvalidArgumentError(f"{what} must be a bool, not {type(flag).__name__}")
        steps = [step for key in self.repo.keys_of(name)
                 for step in step_models_to_unload(self.repo, key)] if unload_dependents else []
        self.repo.unload(name, api=True, wait=wait)
        for step in steps:
            self.repo.unload(step, api=True, wait=wait)

    def runtime(self, name: str, version: int = -1) -> ModelRuntime:
        """The loaded runtime of a model version (-1: the newest loaded)."""
        return self.repo.runtime(name, version)

    def execution_env(self, rt: ModelRuntime) -> list[str] | None:
        return self.repo.execution_env(rt)

    # -- requests --------------------------------------------------------------------------------
    def validate(self, rt: ModelRuntime, req: HostRequest) -> None:
        self.check_signature(rt, req.inputs, req.requested, req.request_id)
        if rt.max_batch_size > 0 and req.inputs:
            req.batch_size = int(req.inputs[0][1].shape[0]) if req.inputs[0][1].ndim else 1

    @staticmethod
    def check_signature(rt: ModelRuntime, inputs: Sequence[tuple[str, Any]],
                        requested: Sequence[str], request_id: str) -> None:
        """Check each input's name, datatype and shape against the model (``inputs``: pairs of
        a name and anything with a numpy ``dtype`` and a ``shape``, data not needed)."""
        validator = rt.validator
        key = (tuple([(n, a.dtype, a.shape) for n, a in inputs]), tuple(requested))
        good = validator.known_good
        if key not in good:
            shapes = {}
            for n, a in inputs:
                if n in shapes:
                    raise input_twice(n)
                shapes[n] = (triton_dtype_of(a), tuple(a.shape))
            validator.validate(shapes, requested or None, request_id)
            if len(good) < 4096:
                good[key] = True
