"""``tritonpy serve``: a Triton-like server process over KServe v2 HTTP/REST and gRPC.

The flags are Triton's (``--model-repository``, ``--http-port``, ``--backend-config=python,k=v``
...). With no ``--model-repository`` it serves the bundled ``examples/`` repository. SIGINT or
SIGTERM stops accepting, drains in-flight requests (``--exit-timeout-secs``), stops the server
(no stub process or shared-memory segment left) and exits 0.

``tritonpy stress`` (see :mod:`tritonpy.stress`) pushes servers past their limits on purpose
and prints what a user sees.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import json
import logging
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from . import stress
from ._errors import TritonpyError
from ._otel import OtelSettings
from ._ratelimit import parse_resource
from ._trace import Tracing

if TYPE_CHECKING:
    from ._stats import MetricsConfig
    from .frontends._http2 import KeepAlive
    from .server import Server

log = logging.getLogger("tritonpy.cli")

_LOG_FORMAT = "%(levelname).1s%(asctime)s %(process)d %(filename)s:%(lineno)d] %(message)s"


class _TritonLogFormatter(logging.Formatter):
    """Triton's log lines: ``I1126 20:31:03.842345 <pid> <file>:<line>] <message>``, in UTC
    as Triton's, verbose lines with ``I`` as Triton's (Python's DEBUG); the file and line are
    those of the tritonpy code that logged (a model's lines are relayed: tritonpy's relay, the
    instance's name in the message). ``LogSettings`` switches the format (``--log-format``,
    ``/v2/logging``) through ``datefmt``: None is Triton's default; a strftime pattern is
    ISO8601, where Triton starts a line with the UTC time to the second and quotes its message
    (``2026-11-26T21:01:03Z I <pid> <file>:<line>] "msg"``), so that each line starts with a
    time that log tools read and holds one message, whatever it contains. As Triton's,
    ``TRITON_SERVER_ESCAPE_LOG_MESSAGES=0`` leaves that message bare.

    Triton 2.51 quotes the message in its default format too; tritonpy's default lines keep it
    bare (tools and tests read them as plain text)."""

    def __init__(self, fmt: str | None = None, datefmt: str | None = None) -> None:
        super().__init__(fmt, datefmt)
        self.escape = os.environ.get("TRITON_SERVER_ESCAPE_LOG_MESSAGES") != "0"

    def format(self, record: logging.LogRecord) -> str:
        letter = "I" if record.levelno <= logging.INFO else record.levelname[:1]
        if not self.datefmt:
            return f"{letter}{super().format(record)[1:]}"
        text = record.getMessage()
        if record.exc_info:
            text = f"{text}\n{self.formatException(record.exc_info)}"
        when = time.strftime(self.datefmt, time.gmtime(record.created))
        if self.escape:
            text = json.dumps(text, ensure_ascii=False)
        return f"{when}Z {letter} {record.process} {record.filename}:{record.lineno}] {text}"

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        when = time.gmtime(record.created)
        return f"{time.strftime('%m%d %H:%M:%S', when)}.{int(record.created * 1e6) % 1000000:06d}"


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _verbosity(text: str) -> int:
    """``--log-verbose``: a level, or a boolean word as Triton 2.51 takes one (``true``: 1)."""
    try:
        return int(text)
    except ValueError:
        try:
            return int(_bool(text))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected a level (a whole number) or a boolean, got {text!r}") from None


def _repository(text: str) -> str:
    """``--model-repository``: a local folder's path (see ``repository_problem``)."""
    from .repository import repository_problem

    problem = repository_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _config_name(text: str) -> str:
    """``--model-config-name``: a name, not an empty one (Triton 2.51's words, measured)."""
    if not text:
        raise argparse.ArgumentTypeError("empty argument for --model-config-name")
    return text


def _port(text: str) -> int:
    """A port number: an integer, checked (0-65535) only where its service is served (see
    :func:`check_port`), as Triton takes any for a service turned off (QA L0_socket)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}") \
            from None


def check_port(flag: str, port: int) -> None:
    """Stop the start, naming the flag, for a port out of range (Triton 2.51 takes -5 and
    reports "Started HTTPService at 0.0.0.0:-5")."""
    if not 0 <= port <= 65535:
        raise SystemExit(f"error: argument {flag}: expected a port number 0-65535, got "
                         f"'{port}'")


def _seconds(text: str) -> float:
    """A number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _backend_config(text: str) -> tuple[str, str, str]:
    """``python,key=value`` (or ``key=value``, a global setting) as (backend, key, value)."""
    backend, comma, setting = text.rpartition(",")
    if comma and not backend:  # Triton's words (QA L0_backend_config)
        raise argparse.ArgumentTypeError(
            "No backend specified. --backend-config option format is <backend name>,<setting>="
            f"<value> or <setting>=<value>. Got {text}")
    key, sep, value = setting.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(
            f"--backend-config expects <backend>,<key>=<value>, got {text!r}"
        )
    return backend, key, value


def _trace_config(text: str) -> tuple[str, str, str]:
    """``[mode,]setting=value`` as (mode, setting, value)."""
    mode, _, setting = text.rpartition(",")
    key, sep, value = setting.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(
            f"--trace-config expects [<mode>,]<setting>=<value>, got {text!r}")
    return mode, key.replace("_", "-"), value


_OTEL_NUMBERS = ("bsp-max-queue-size", "bsp-schedule-delay", "bsp-max-export-batch-size")


def _otel_setting(key: str, value: str, otel: dict[str, Any]) -> None:
    """One ``--trace-config opentelemetry,<key>=<value>`` into ``otel`` (OtelSettings' fields)."""
    if key == "url":
        otel["url"] = value
    elif key == "resource":
        name, sep, attr = value.partition("=")
        if not sep or not name:
            raise SystemExit(f"error: --trace-config opentelemetry,resource={value}: expected "
                             "resource=<key>=<value>")
        otel.setdefault("resource", {})[name] = attr
    elif key in _OTEL_NUMBERS:
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number <= 0:
            raise SystemExit(f"error: --trace-config opentelemetry,{key}={value}: expected a "
                             "positive integer")
        otel[key.replace("-", "_")] = number
    else:
        raise SystemExit(f"error: --trace-config opentelemetry: unknown setting '{key}' (url, "
                         f"resource, {', '.join(_OTEL_NUMBERS)})")


def _tracing(args: argparse.Namespace) -> Tracing:
    """The trace settings of Triton's --trace-config (and its older --trace-* flags)."""
    levels = list(args.trace_level)
    given: dict[str, str] = {}
    for name in ("rate", "count", "log_frequency", "file"):
        value = getattr(args, f"trace_{name}")
        if value is not None:
            given[name.replace("_", "-")] = value
    mode = "triton"
    otel: dict[str, Any] = {}
    for key in _OTEL_NUMBERS:  # OpenTelemetry's own variables, under the flags
        env = os.environ.get("OTEL_" + key.replace("-", "_").upper())
        if env:
            _otel_setting(key, env, otel)
    for scope, key, value in args.trace_config:
        if scope == "opentelemetry":
            _otel_setting(key, value, otel)
            continue
        if scope not in ("", "triton"):
            raise SystemExit(f"error: --trace-config {scope}: unknown trace mode (triton, "
                             "opentelemetry)")
        if key == "level":
            levels.append(value)
        elif key == "mode":
            if value not in ("triton", "opentelemetry"):
                raise SystemExit(f"error: --trace-config mode={value}: expected triton or "
                                 "opentelemetry")
            mode = value
        elif key in ("rate", "count", "log-frequency", "file"):
            given[key] = value
        else:
            raise SystemExit(f"error: --trace-config: unknown setting '{key}' (level, rate, "
                             "count, log-frequency, file, mode)")
    # Triton's older level names, which its command line still takes (QA L0_cmdline_trace).
    levels = ["TIMESTAMPS" if v.upper() in ("MIN", "MAX") else v for v in levels]
    try:
        return Tracing(level=levels or "OFF", rate=given.get("rate", 1000),
                       count=given.get("count", -1),
                       log_frequency=given.get("log-frequency", 0), file=given.get("file", ""),
                       mode=mode, otel=OtelSettings(**otel) if mode == "opentelemetry" else None)
    except TritonpyError as exc:
        raise SystemExit(f"error: trace settings: {exc.message}") from None


def _rate_resource(text: str) -> str:
    """``--rate-limit-resource``, checked here: a usage error (exit 1) names the form."""
    try:
        parse_resource(text)
    except TritonpyError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return text


#: Triton flags taken so that its command lines run, though they change nothing here: flag ->
#: (argparse type, repeatable, why). Each one given is named in a warning at start.
_NO_EFFECT: dict[str, tuple[Any, bool, str]] = {
    "--model-load-thread-count": (int, False, "models load in parallel, up to 8 at a time"),
    "--enable-peer-access": (_bool, False, "no GPU memory is used"),
    "--http-thread-count": (int, False, "HTTP is served on one event loop"),
    "--grpc-infer-allocation-pool-size": (int, False, "gRPC responses are not pooled"),
    "--repoagent-directory": (str, False, "the checksum agent is built in, and no other "
                                          "repository agent is loaded"),
    "--cache-directory": (str, False, "the local response cache is built in"),
    "--pinned-memory-pool-byte-size": (int, False, "no CUDA pinned memory is used"),
    "--cuda-memory-pool-byte-size": (str, True, "no CUDA memory pool is used"),
    "--cuda-virtual-address-size": (str, True, "no CUDA memory pool is used"),
    "--min-supported-compute-capability": (float, False, "GPUs are not checked"),
    "--buffer-manager-thread-count": (int, False, "there is no buffer manager"),
    "--host-policy": (str, True, "there are no host policies"),
    "--model-load-gpu-limit": (str, True, "no GPU memory is counted"),
}
#: Triton's gRPC keepalive flags: (flag, KeepAlive field, help).
_KEEPALIVE_FLAGS = (
    ("--grpc-keepalive-time", "time_ms",
     "ping a gRPC connection silent this many milliseconds"),
    ("--grpc-keepalive-timeout", "timeout_ms",
     "close a gRPC connection whose client does not answer a keepalive ping in this many ms"),
    ("--grpc-keepalive-permit-without-calls", "permit_without_calls",
     "keepalive pings both ways also while no call is open"),
    ("--grpc-http2-max-pings-without-data", "max_pings_without_data",
     "keepalive pings sent while the server sends no data (0: no limit)"),
    ("--grpc-http2-min-recv-ping-interval-without-data", "min_recv_ping_interval_without_data_ms",
     "a client ping sooner than this after the last, with no data between, is a strike"),
    ("--grpc-http2-max-ping-strikes", "max_ping_strikes",
     "strikes before GOAWAY too_many_pings (0: no limit)"),
    ("--grpc-max-connection-age", "max_connection_age_ms",
     "GOAWAY a gRPC connection this old, give or take 10%% (0: never)"),
    ("--grpc-max-connection-age-grace", "max_connection_age_grace_ms",
     "then close it this much later whatever calls are open (0: when they end)"),
)
#: Triton frontends and modes not served: taken when off, refused when turned on.
_NOT_SERVED = ("--allow-sagemaker", "--allow-vertex-ai")
_NOT_SERVED_SETTINGS = ("--sagemaker-port", "--sagemaker-safe-port-range",
                        "--sagemaker-thread-count", "--vertex-ai-port",
                        "--vertex-ai-thread-count", "--vertex-ai-default-model")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def no_effect_warnings(args: argparse.Namespace) -> list[str]:
    """One line for each flag of :data:`_NO_EFFECT`, and each setting of a frontend not
    served, given on the command line."""
    out = []
    for flag, (_, _, why) in _NO_EFFECT.items():
        value = getattr(args, _dest(flag))
        if value is not None:
            shown = ",".join(map(str, value)) if isinstance(value, list) else value
            out.append(f"{flag}={shown} is accepted for Triton's command lines and has no "
                       f"effect: {why}")
    for flag in _NOT_SERVED_SETTINGS:
        value = getattr(args, _dest(flag))
        if value is not None:
            frontend = "SageMaker" if flag.startswith("--sagemaker") else "Vertex AI"
            out.append(f"{flag}={value} is accepted for Triton's command lines and has no "
                       f"effect: tritonpy does not serve the {frontend} frontend")
    return out


def deprecation_warnings(args: argparse.Namespace) -> list[str]:
    """Triton 2.51's words for the deprecated ``--strict-model-config`` (measured; QA
    L0_model_config's cli_messages looks for them)."""
    if args.strict_model_config is None:
        return []
    out = ["Warning: '--strict-model-config' has been deprecated! Please use "
           "'--disable-auto-complete-config' instead."]
    if args.disable_auto_complete_config and not args.strict_model_config:
        out.append("Warning: Overriding deprecated '--strict-model-config' from False to True "
                   "in favor of '--disable-auto-complete-config'!")
    return out


def unbracketed(host: str | None) -> str | None:
    """An address as the frontends bind it: an IPv6 one may come bracketed, as gRPC writes it
    (``[::1]``, the form Triton's ``--grpc-address`` takes)."""
    if host and host.startswith("[") and host.endswith("]"):
        return host[1:-1]
    return host


def check_address(flag: str, host: str) -> None:
    """Stop the start, naming the flag, when ``host`` is no address of this machine (Triton
    2.51 starts anyway, without that endpoint: it logs "Started HTTPService" all the same)."""
    if not host:
        return
    try:
        found = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SystemExit(f"error: {flag} {host}: {exc.strerror}") from None
    problem = "no address"
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.bind(address)  # port 0: takes no port that a server could want
                return
            except OSError as exc:
                problem = exc.strerror or str(exc)
    raise SystemExit(f"error: {flag} {host}: not an address of this machine ({problem})")


def python_backend_config(args: argparse.Namespace) -> dict[str, str]:
    """The python backend's settings among the ``--backend-config`` flags.

    As in Triton, a global setting (``key=value``, no backend named) goes to every backend,
    and the python backend's own setting of the same key wins, whatever the order; a global
    setting the python backend does not take is left to the other backends, which are not
    served: each one left out is named in a warning, and so is each Triton setting that has no
    effect here. A ``python,key=value`` that tritonpy does not know stops the start (see
    :meth:`BackendOptions.from_mapping`).
    """
    from ._options import TRITON_NO_EFFECT, BackendOptions

    known = {f.name.replace("_", "-") for f in dataclasses.fields(BackendOptions)}
    known |= set(TRITON_NO_EFFECT) | {"shm-total-cap"}
    global_settings: dict[str, str] = {}
    own: dict[str, str] = {}
    for backend, key, value in args.backend_config:
        name = key.replace("_", "-")
        if backend == "python":
            own[name] = value
        elif backend == "" and name in known:
            global_settings[name] = value
        elif backend == "":
            log.warning("ignoring --backend-config=%s=%s: a global setting the python backend "
                        "does not take", key, value)
        else:
            log.warning("ignoring --backend-config for backend '%s' (%s): the python backend's "
                        "settings (--backend-config=python,...) apply to every model, those of "
                        "Python-based backends too", backend, key)
    merged = {**global_settings, **own}
    try:
        options = BackendOptions.from_mapping(merged)
    except TritonpyError as exc:
        raise SystemExit(f"error: {exc.message}") from None
    _log_backend_config(args, global_settings, merged, options)
    for name, value in merged.items():
        if name in TRITON_NO_EFFECT:
            log.warning("--backend-config=%s%s=%s is accepted for Triton's command lines "
                        "and has no effect: %s", "python," if name in own else "", name, value,
                        TRITON_NO_EFFECT[name][1])
    return merged


def _log_backend_config(args: argparse.Namespace, global_settings: Mapping[str, str],
                        merged: Mapping[str, str], options: Any) -> None:
    """Triton's verbose lines about the python backend's settings, which scripts grep for
    (QA L0_backend_config): the global default batch size, the backend's whole command-line
    configuration, and its shared memory settings (tritonpy's values)."""
    from .repository import DEFAULT_BACKEND_DIRECTORY

    if not log.isEnabledFor(logging.DEBUG):
        return
    batch = global_settings.get("default-max-batch-size")
    if batch is None:
        log.debug("Adding default backend config setting: default-max-batch-size,4")
    else:
        log.debug("Found overwritten default setting: default-max-batch-size,%s", batch)
    cmdline = {"auto-complete-config": "false" if (args.disable_auto_complete_config
                                                   or args.strict_model_config) else "true",
               "backend-directory": os.path.abspath(args.backend_directory
                                                    or DEFAULT_BACKEND_DIRECTORY),
               "default-max-batch-size": batch or "4",
               "min-compute-capability": "6.000000", **merged}
    log.debug("backend configuration:\n%s",
              json.dumps({"cmdline": dict(sorted(cmdline.items()))}, separators=(",", ":")))
    log.debug("Shared memory configuration is shm-default-byte-size=%d,shm-growth-byte-size=%d,"
              "stub-timeout-seconds=%g", options.shm_default_byte_size,
              options.shm_growth_byte_size, options.stub_timeout_seconds)


def keepalive_options(args: argparse.Namespace) -> KeepAlive:
    """The gRPC keepalive policy the ``--grpc-keepalive-*`` (and alike) flags ask for."""
    from .frontends._http2 import KeepAlive

    values = {field: getattr(args, _dest(flag)) for flag, field, _ in _KEEPALIVE_FLAGS}
    for flag, field, _ in _KEEPALIVE_FLAGS:
        if not isinstance(values[field], bool) and values[field] < 0:
            raise SystemExit(f"error: {flag} must be >= 0, got {values[field]}")
    if values["time_ms"] < 1 or values["timeout_ms"] < 1:
        raise SystemExit("error: --grpc-keepalive-time and --grpc-keepalive-timeout must be "
                         "at least 1 ms")
    return KeepAlive(**values)


def metrics_config(args: argparse.Namespace) -> MetricsConfig:
    """The ``--metrics-config`` settings; one without ``=`` stops the start, as Triton's."""
    from ._stats import MetricsConfig

    try:
        return MetricsConfig.parse(args.metrics_config)
    except ValueError as exc:
        raise SystemExit(f'error: Bad option: "--metrics-config". {exc}') from None


def cache_size(args: argparse.Namespace) -> int:
    """Bytes of the local response cache that ``--cache-config`` (or the older
    ``--response-cache-byte-size``) asks for; 0: none."""
    if args.response_cache_byte_size is not None and args.cache_config:
        raise SystemExit("error: Incompatible flags --response-cache-byte-size and "
                         "--cache-config both provided. Please provide one or the other.")
    size = args.response_cache_byte_size or 0
    for spec in args.cache_config:
        cache, _, setting = spec.partition(",")
        key, eq, value = setting.partition("=")
        if cache != "local":
            raise SystemExit(f"error: --cache-config {spec}: tritonpy has the local cache only")
        if "," in setting:
            raise SystemExit(f"error: --cache-config {spec}: one setting per --cache-config, "
                             "as in Triton (--cache-config local,size=BYTES)")
        if key != "size" or not eq:
            raise SystemExit(f"error: --cache-config {spec}: the local cache takes size=BYTES")
        try:
            size = int(value)
        except ValueError:
            raise SystemExit(f"error: --cache-config {spec}: size must be a number of bytes") \
                from None
        if size <= 0:
            # Triton 2.51 fails to start with size=0 too ("Failed to initialize LocalCache").
            raise SystemExit(f"error: --cache-config {spec}: the local cache needs a size of "
                             "1 byte or more")
    if size < 0:
        raise SystemExit("error: the response cache size must not be negative")
    return size


def grpc_ssl_context(args: argparse.Namespace) -> Any:
    """The server TLS context of ``--grpc-use-ssl`` / ``--grpc-use-ssl-mutual``, or None."""
    if not (args.grpc_use_ssl or args.grpc_use_ssl_mutual):
        return None
    import ssl

    if not args.grpc_server_cert or not args.grpc_server_key:
        raise SystemExit("error: --grpc-use-ssl needs --grpc-server-cert and --grpc-server-key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.grpc_server_cert, args.grpc_server_key)
        if args.grpc_use_ssl_mutual:
            if not args.grpc_root_cert:
                raise SystemExit("error: --grpc-use-ssl-mutual needs --grpc-root-cert (the "
                                 "certificate that signs the clients')")
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(args.grpc_root_cert)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(f"error: gRPC TLS certificates: {exc}") from None
    return context


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``tritonpy`` (subcommands ``serve`` and ``stress``)."""
    parser = argparse.ArgumentParser(prog="tritonpy", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve model repositories over HTTP/REST and gRPC",
                       description="Serve Triton Python-backend model repositories.")
    s.add_argument("--model-repository", "--model-store", action="append", default=[],
                   type=_repository, metavar="DIR",
                   help="model repository directory (repeatable); default: examples/")
    s.add_argument("--http-port", type=_port, default=8000)
    s.add_argument("--grpc-port", type=_port, default=8001)
    s.add_argument("--metrics-port", type=_port, default=8002)
    s.add_argument("--http-address", default="0.0.0.0")
    s.add_argument("--grpc-address", default="0.0.0.0")
    s.add_argument("--metrics-address", default=None, help="default: the HTTP address")
    s.add_argument("--allow-http", type=_bool, default=True, metavar="BOOL")
    s.add_argument("--allow-grpc", type=_bool, default=True, metavar="BOOL")
    s.add_argument("--allow-metrics", type=_bool, default=True, metavar="BOOL")
    s.add_argument("--allow-cpu-metrics", type=_bool, default=True, metavar="BOOL",
                   help="serve CPU utilization and memory metrics (as Triton)")
    s.add_argument("--allow-gpu-metrics", type=_bool, default=True, metavar="BOOL",
                   help="accepted for Triton's command lines; there are no GPU metrics")
    s.add_argument("--metrics-interval-ms", type=int, default=2000, metavar="MS",
                   help="CPU utilization is sampled every half of it (as Triton)")
    s.add_argument("--metrics-config", action="append", default=[], metavar="SETTING=VALUE",
                   help="counter_latencies=false drops the duration counters; "
                        "summary_latencies=true adds duration summaries, with "
                        "summary_quantiles=Q:ERROR,... (repeatable, as Triton)")
    s.add_argument("--model-control-mode", type=str.lower, choices=("none", "explicit", "poll"),
                   default="none", help="as Triton, in any case")
    s.add_argument("--load-model", action="append", default=[], metavar="NAME",
                   help="model to load at start in explicit mode (repeatable; '*' for all)")
    s.add_argument("--backend-config", action="append", default=[], type=_backend_config,
                   metavar="python,KEY=VALUE", help="python backend option (repeatable)")
    s.add_argument("--repository-poll-secs", type=_seconds, default=15.0, metavar="SECS",
                   help="seconds between scans in poll mode; 0: no scan after the start (as "
                        "Triton)")
    s.add_argument("--log-verbose", type=_verbosity, default=0, metavar="LEVEL")
    s.add_argument("--exit-timeout-secs", type=_seconds, default=30.0, metavar="SECS")
    s.add_argument("--id", default="triton", metavar="NAME",
                   help="the server's name in its metadata (Triton's default, which clients check)")
    s.add_argument("--strict-readiness", type=_bool, default=True, metavar="BOOL",
                   help="ready only while no model has failed to load (as Triton)")
    s.add_argument("--http-max-input-size", type=int, default=None, metavar="BYTES",
                   help="largest HTTP request body (default 64 MiB)")
    s.add_argument("--exit-on-error", type=_bool, default=True, metavar="BOOL",
                   help="exit (code 1) when a model fails to load at start, as Triton does")
    s.add_argument("--disable-auto-complete-config", action="store_true",
                   help="never call auto_complete_config; a model needs its config.pbtxt")
    s.add_argument("--strict-model-config", type=_bool, default=None, metavar="BOOL",
                   help="Triton's older spelling: true = --disable-auto-complete-config")
    s.add_argument("--log-file", default=None, metavar="PATH",
                   help="write the log to this file instead of stderr")
    s.add_argument("--backend-directory", default=None, metavar="DIR",
                   help="where a model of another backend than python finds it as a "
                        "Python-based backend (DIR/<backend>/model.py; default "
                        "/opt/tritonserver/backends, as Triton's); the python backend itself "
                        "is built in")
    s.add_argument("--trace-config", action="append", default=[], type=_trace_config,
                   metavar="[MODE,]SETTING=VALUE",
                   help="trace settings: level (OFF, TIMESTAMPS, TENSORS), rate, count, mode "
                        "(triton, opentelemetry); triton,log-frequency and triton,file; "
                        "opentelemetry,url, opentelemetry,resource=KEY=VALUE and "
                        "opentelemetry,bsp_max_queue_size / bsp_schedule_delay / "
                        "bsp_max_export_batch_size (repeatable)")
    s.add_argument("--trace-level", action="append", default=[], metavar="LEVEL",
                   help="Triton's older spelling of --trace-config level=")
    for old_flag in ("rate", "count", "log-frequency", "file"):
        s.add_argument(f"--trace-{old_flag}", default=None, metavar="VALUE",
                       help=f"Triton's older spelling of --trace-config {old_flag}=")
    s.add_argument("--rate-limit", default=None, type=str.lower, choices=("off", "execution_count"),
                   help="execution_count: an instance whose group lists rate_limiter resources "
                        "runs an execute only while they are free, across models (Triton's "
                        "rate limiter); off (the default): they are ignored")
    s.add_argument("--rate-limit-resource", action="append", default=[], type=_rate_resource,
                   metavar="NAME:COUNT[:DEVICE]",
                   help="the copies of a rate limiter resource, on DEVICE or on every device "
                        "(and for a global one); repeatable. Without it, a resource has as "
                        "many as the largest count an instance lists")
    s.add_argument("--reuse-http-port", type=_bool, default=False, metavar="BOOL",
                   help="bind the HTTP port with SO_REUSEPORT (several servers may share it)")
    s.add_argument("--reuse-grpc-port", type=_bool, default=False, metavar="BOOL",
                   help="bind the gRPC port with SO_REUSEPORT (several servers may share it)")
    s.add_argument("--http-header-forward-pattern", default=None, metavar="REGEX",
                   help="HTTP headers whose names match (case-insensitive unless it starts "
                        "with (?-i)) reach the model as request parameters")
    s.add_argument("--grpc-header-forward-pattern", default=None, metavar="REGEX",
                   help="gRPC metadata whose names match reach the model as request parameters")
    s.add_argument("--http-restricted-api", action="append", default=[],
                   metavar="API[,API...]:KEY=VALUE",
                   help="requests to these APIs must carry header KEY: VALUE, else 403 "
                        "(APIs: health, metadata, inference, shared-memory, model-config, "
                        "model-repository, statistics, trace, logging; repeatable)")
    s.add_argument("--grpc-restricted-protocol", action="append", default=[],
                   metavar="API[,API...]:KEY=VALUE",
                   help="calls to these APIs must carry metadata triton-grpc-protocol-KEY: "
                        "VALUE, else UNAVAILABLE (repeatable)")
    s.add_argument("--grpc-use-ssl", type=_bool, default=False, metavar="BOOL",
                   help="serve gRPC over TLS (needs --grpc-server-cert and --grpc-server-key)")
    s.add_argument("--grpc-use-ssl-mutual", type=_bool, default=False, metavar="BOOL",
                   help="serve gRPC over TLS and require client certificates signed by "
                        "--grpc-root-cert")
    s.add_argument("--grpc-server-cert", default=None, metavar="PEM")
    s.add_argument("--grpc-server-key", default=None, metavar="PEM")
    s.add_argument("--grpc-root-cert", default=None, metavar="PEM")
    s.add_argument("--grpc-infer-response-compression-level", default="none",
                   choices=("none", "low", "medium", "high"),
                   help="compress gRPC inference responses (gzip or deflate, as the client "
                        "accepts)")
    from .frontends._http2 import KeepAlive

    defaults = KeepAlive()
    for flag, field, help_ in _KEEPALIVE_FLAGS:
        default = getattr(defaults, field)
        s.add_argument(flag, type=_bool if isinstance(default, bool) else int, default=default,
                       metavar="BOOL" if isinstance(default, bool)
                       else "MS" if field.endswith("_ms") else "N",
                       help=f"{help_} (default {default})")
    s.add_argument("--cache-config", action="append", default=[], metavar="local,size=BYTES",
                   help="the response cache for models with response_cache enabled (the "
                        "local cache: its size in bytes)")
    s.add_argument("--response-cache-byte-size", type=int, default=None, metavar="BYTES",
                   help="Triton's older spelling of --cache-config local,size=BYTES")
    s.add_argument("--model-load-retry-count", type=int, default=0, metavar="N",
                   help="try a model that fails to load N more times (as Triton; an invalid "
                        "config is not retried)")
    s.add_argument("--model-namespacing", type=_bool, default=False, metavar="BOOL",
                   help="a model name that two repositories hold is two models: each "
                        "ensemble runs its own repository's steps first, a request naming "
                        "it is refused for its ambiguity, and metrics carry a namespace label "
                        "(as Triton)")
    s.add_argument("--model-config-name", type=_config_name, default=None, metavar="NAME",
                   help="configure each model by <model>/configs/NAME.pbtxt where it exists "
                        "(else its config.pbtxt)")
    for level in ("info", "warning", "error"):
        s.add_argument(f"--log-{level}", type=_bool, default=True, metavar="BOOL",
                       help=f"log messages of level {level} (as Triton)")
    s.add_argument("--log-format", default="default", choices=("default", "ISO8601"),
                   help="timestamps as Triton's default (MMDD hh:mm:ss) or ISO8601")
    for flag, (kind, repeat, why) in _NO_EFFECT.items():
        s.add_argument(flag, type=kind, default=None, action="append" if repeat else "store",
                       metavar="VALUE", help=f"accepted for Triton's command lines: {why}")
    for flag in _NOT_SERVED:
        s.add_argument(flag, type=_bool, default=False, metavar="BOOL",
                       help="accepted when false, as Triton's; not served")
    for flag in _NOT_SERVED_SETTINGS:
        s.add_argument(flag, default=None, metavar="VALUE", help=argparse.SUPPRESS)
    stress.add_parser(sub)
    return parser


def default_repository() -> Path:
    """The bundled ``examples/`` repository next to the package."""
    path = Path(__file__).resolve().parents[1] / "examples"
    if not path.is_dir():
        raise SystemExit(
            f"error: no --model-repository given and the bundled examples repository "
            f"({path}) does not exist"
        )
    return path


def _raise_fd_limit() -> None:
    """Raise the soft limit on open files to the hard one (stubs inherit it): each mapped
    shm segment, stub and client connection holds a descriptor, and the usual soft limit of
    1024 is reached long before the hard one. Nothing here uses select(), which breaks past
    1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard or soft == resource.RLIM_INFINITY:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError) as exc:
        log.warning("cannot raise the open files limit from %d to %d: %s", soft, hard, exc)
        return
    log.info("open files limit raised from %d to %s (RLIMIT_NOFILE's hard limit)", soft,
             "unlimited" if hard == resource.RLIM_INFINITY else hard)


#: A second SIGINT or SIGTERM stops the server at once (see _serve), unless it came within
#: this many seconds of the first: then it is taken for the same one, sent twice.
REPEAT_S = 0.25


async def _serve(args: argparse.Namespace, handler: logging.Handler) -> int:
    from . import Server
    from ._runtime_base import READY
    from .server import load_models_problem
    from .frontends import Frontends
    from .frontends.dataplane import (
        DEFAULT_MAX_INPUT_SIZE,
        LogSettings,
        header_pattern,
        parse_restrictions,
    )

    for flag in _NOT_SERVED:
        if getattr(args, _dest(flag)):
            raise SystemExit(f"error: {flag} true: tritonpy does not serve the "
                             f"{flag[len('--allow-'):]} frontend")
    try:
        http_restricted = parse_restrictions(args.http_restricted_api, "--http-restricted-api")
        grpc_restricted = parse_restrictions(args.grpc_restricted_protocol,
                                             "--grpc-restricted-protocol")
        header_pattern(args.http_header_forward_pattern)
        header_pattern(args.grpc_header_forward_pattern)
    except TritonpyError as exc:
        raise SystemExit(f"error: {exc.message}") from None
    for flag, port, served in (("--http-port", args.http_port, args.allow_http),
                               ("--grpc-port", args.grpc_port, args.allow_grpc),
                               ("--metrics-port", args.metrics_port, args.allow_metrics)):
        if served:  # as Triton, any port is taken for a service turned off (QA L0_socket)
            check_port(flag, port)
    for dest in ("http_address", "grpc_address", "metrics_address"):
        setattr(args, dest, unbracketed(getattr(args, dest)))
    metrics_address = args.metrics_address or args.http_address
    if args.allow_metrics and not args.metrics_address and not args.allow_http \
            and args.http_address:
        # Metrics take the HTTP address; with HTTP off, one that cannot serve (Triton's
        # L0_socket gives "-47") leaves them on every interface, as by default.
        try:
            check_address("--http-address", args.http_address)
        except SystemExit as exc:
            log.warning("%s (HTTP is off): metrics listen on 0.0.0.0",
                        str(exc).removeprefix("error: "))
            metrics_address = "0.0.0.0"
    for flag, host, served in (
            ("--http-address", args.http_address, args.allow_http),
            ("--grpc-address", args.grpc_address, args.allow_grpc),
            ("--metrics-address" if args.metrics_address else "--http-address",
             metrics_address, args.allow_metrics)):
        if served:
            check_address(flag, host)
    grpc_ssl = grpc_ssl_context(args)
    grpc_keepalive = keepalive_options(args)
    problem = load_models_problem(args.model_control_mode, args.load_model)
    if problem:
        raise SystemExit(f"error: {problem}")
    if args.model_load_retry_count < 0:
        raise SystemExit(f"error: --model-load-retry-count must be >= 0, got "
                         f"{args.model_load_retry_count}")
    if args.http_max_input_size is not None and args.http_max_input_size < 0:
        raise SystemExit(f"error: --http-max-input-size must be >= 0 bytes (0: the default), "
                         f"got {args.http_max_input_size}")
    if args.metrics_interval_ms < 0:
        raise SystemExit(f"error: --metrics-interval-ms must be >= 0, got "
                         f"{args.metrics_interval_ms}")
    log_settings = LogSettings([handler], verbose=args.log_verbose, log_file=args.log_file or "")
    log_settings.update({"log_info": args.log_info, "log_warning": args.log_warning,
                         "log_error": args.log_error, "log_format": args.log_format})
    for line in no_effect_warnings(args):
        log.warning("%s", line)
    for line in deprecation_warnings(args):  # Triton's, word for word, to stderr as its
        print(line, file=sys.stderr, flush=True)
    repos = args.model_repository or [str(default_repository())]
    backend_config = python_backend_config(args)
    if args.model_control_mode == "poll" and not args.repository_poll_secs:
        log.info("--repository-poll-secs 0: the repository is read at start only (as Triton)")
    auto_complete = not (args.disable_auto_complete_config or args.strict_model_config)
    _raise_fd_limit()
    loop = asyncio.get_running_loop()  # the stubs' frames are read on it too
    server = Server(repos, model_control_mode=args.model_control_mode,
                    load_models=args.load_model, backend_config=backend_config,
                    log_verbose=args.log_verbose, exit_timeout=args.exit_timeout_secs,
                    poll_interval=args.repository_poll_secs,
                    strict_readiness=args.strict_readiness, auto_complete=auto_complete,
                    server_id=args.id, tracing=_tracing(args), loop=loop,
                    model_config_name=args.model_config_name or "",
                    response_cache_size=cache_size(args),
                    model_load_retry_count=args.model_load_retry_count,
                    metrics_config=metrics_config(args),
                    backend_directory=args.backend_directory,
                    rate_limit=args.rate_limit or "off",
                    rate_limit_resources=args.rate_limit_resource,
                    model_namespacing=args.model_namespacing)
    stop = asyncio.Event()  # the first SIGINT or SIGTERM: drain, finalize, exit
    now = asyncio.Event()  # a second one: stop now (Triton ignores it, and drains on)

    serving: list[Frontends] = []  # once started: a second signal cuts their stop short
    first_at: list[float] = []  # when the first signal came

    def on_signal() -> None:
        if stop.is_set() and not now.is_set():
            if loop.time() - first_at[0] < REPEAT_S:
                # One signal sent twice: GNU timeout, for one, signals its child and then the
                # child's process group, the server in both.
                log.info("the signal came again within %g s: taken as the same one", REPEAT_S)
                return
            now.set()
            log.warning("second signal: stopping now; the requests in flight are cut off and "
                        "the models get no finalize")
            # The stubs killed and the queued requests failed first, then (a moment for those
            # answers to go out) the frontends' wait for the requests in flight ends.
            aborted = loop.run_in_executor(None, server.abort)
            aborted.add_done_callback(lambda _: loop.call_later(0.2, cut_short))
        if not first_at:
            first_at.append(loop.time())
        stop.set()

    def cut_short() -> None:
        for fronts in serving:
            fronts.cut_short()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    # Loading models can take a while (stub start-up); a signal meanwhile still stops cleanly.
    start = loop.run_in_executor(None, server.start)
    waiter = asyncio.ensure_future(stop.wait())
    started: set[asyncio.Future[Any]] = {start, waiter}
    await asyncio.wait(started, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set() and not start.done():
        # Not a wait for a model's initialize, however long it takes: its stub is stopped.
        log.info("signal received while models load: stopping")
        server.cancel_loads()
    try:
        await start
    except TritonpyError as exc:
        if args.exit_on_error or stop.is_set():
            waiter.cancel()
            await loop.run_in_executor(None, server.stop)
            raise
        # As Triton: --exit-on-error false serves on after a failed start (a model repository
        # that is not there, say), neither live nor ready, every model call "Server not ready".
        log.error("error: %s", exc.message)
        log.error("the server failed to start; serving on, not live (--exit-on-error false)")
    except BaseException:
        waiter.cancel()
        await loop.run_in_executor(None, server.stop)
        raise
    failed = set(server.repo.not_available())  # failed to load (not merely left unloaded)
    # As Triton, a folder whose configuration cannot be read and a model name that two
    # repositories hold fail the start too, though neither counts against readiness.
    failed |= {e.name for e in server.repo.entries.values()
               if e.unreadable and e.tried and e.state != READY}
    if args.model_control_mode != "explicit" or "*" in args.load_model:
        failed |= set(server.repo.scan_errors)
    else:  # the names --load-model asked for that two repositories hold
        failed |= set(server.repo.scan_errors) & set(args.load_model)
    if failed and args.exit_on_error and not stop.is_set():
        # As Triton: with --exit-on-error (its default) a model that failed to load at start
        # ends the server; --exit-on-error false serves the others (not ready while strict).
        for m in server.models():
            if m.get("name") in failed:
                log.error("model '%s' failed to load: %s", m.get("name"), m.get("reason") or "")
        log.error("failed to load all models; exiting (--exit-on-error false serves the rest)")
        waiter.cancel()
        await loop.run_in_executor(None, server.stop)
        return 1
    frontends = Frontends(
        server, http_port=args.http_port, grpc_port=args.grpc_port,
        metrics_port=args.metrics_port, allow_http=args.allow_http, allow_grpc=args.allow_grpc,
        allow_metrics=args.allow_metrics, http_address=args.http_address,
        grpc_address=args.grpc_address,
        metrics_address=metrics_address,
        max_input_size=args.http_max_input_size or DEFAULT_MAX_INPUT_SIZE,
        log_settings=log_settings,
        exit_timeout=args.exit_timeout_secs,
        cpu_metrics=args.allow_cpu_metrics, metrics_interval_ms=args.metrics_interval_ms,
        http_restricted=http_restricted, grpc_restricted=grpc_restricted,
        http_header_forward=args.http_header_forward_pattern,
        grpc_header_forward=args.grpc_header_forward_pattern,
        grpc_compression=args.grpc_infer_response_compression_level, grpc_ssl=grpc_ssl,
        reuse_http_port=args.reuse_http_port, reuse_grpc_port=args.reuse_grpc_port,
        grpc_keepalive=grpc_keepalive,
    )
    serving.append(frontends)
    began: float | None = None  # when the stop began
    try:
        if not stop.is_set():
            await frontends.start()
            for model in server.models() if server.start_error is None else ():
                if model.get("state"):  # not a model the repository holds but never loaded
                    log.info("model %s version %s: %s %s", model.get("name"),
                             model.get("version"), model.get("state"), model.get("reason") or "")
            for line in frontends.endpoints():
                log.info("listening: %s", line)
            await waiter
            log.info("signal received: stopping (draining for up to %g s)", args.exit_timeout_secs)
            log.info("Waiting for in-flight requests to complete.")  # Triton's words
            began = loop.time()
            await _drain(server, args.exit_timeout_secs, now)
    finally:
        waiter.cancel()
        if began is None:
            began = loop.time()
        # A load request in flight (model control API) is not drained: it fails at once.
        server.cancel_loads()
        # (A moment at least, for answers the drain saw done that are still being written;
        # requests still running when the timeout is spent are cut off, as Triton exits then.)
        left = 0.0 if now.is_set() else args.exit_timeout_secs - (loop.time() - began)
        frontends.exit_timeout = max(0.2, left)
        await frontends.stop()
        # --exit-timeout-secs bounds the whole drain, as in Triton: what the frontends spent
        # waiting for their in-flight requests is not granted a second time to the models.
        left = 0.0 if now.is_set() else args.exit_timeout_secs - (loop.time() - began)
        server.exit_timeout = max(0.0, left)
        await loop.run_in_executor(None, server.stop)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        _ignore_stop_signals()  # (before the loop's close could restore their defaults)
    if now.is_set():
        log.error("stopped at a second signal: requests in flight were cut off")
        return 1
    if server.cut_short:  # as Triton, which exits 1 after "Exit timeout expired"
        log.error("failed to stop server: Exit timeout expired. Exiting immediately.")
        return 1
    log.info("tritonpy stopped")
    return 0


async def _drain(server: Server, timeout: float, now: asyncio.Event) -> None:
    """The first part of a stop, as Triton's: the ports stay open, clients' new inference
    requests are refused and the server is neither live nor ready, until the requests in
    flight are answered (or ``timeout`` passes, or ``now`` is set). Each second the log says
    what is left, in Triton's words."""
    server.refuse_new_requests()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    told = -1.0
    while (busy := server.in_flight()) and loop.time() < deadline and not now.is_set():
        if loop.time() - told >= 1.0:
            told = loop.time()
            log.info("Timeout %d: Found %d model versions that have in-flight inferences",
                     max(0, round(deadline - told)), len(busy))
            for name, version, n in busy:
                log.info("Model '%s' (version %d) has %d in-flight inferences", name, version, n)
        await asyncio.sleep(0.02)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tritonpy`` console script and ``python -m tritonpy``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        # A usage error of serve exits 1, as tritonserver's does (argparse's code is 2), so
        # that scripts written for tritonserver see the same status.
        if exc.code == 2 and argv[:1] == ["serve"]:
            raise SystemExit(1) from None
        raise
    if args.command == "stress":
        logging.basicConfig(level=logging.WARNING, format=_LOG_FORMAT, datefmt="%m%d %H:%M:%S")
        return stress.main(args)
    handler: logging.Handler
    if args.log_file:
        try:
            handler = logging.FileHandler(args.log_file)
        except OSError as exc:
            print(f"error: --log-file {args.log_file}: {exc}", file=sys.stderr)
            return 1
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_TritonLogFormatter(_LOG_FORMAT))
    # Where the log goes, a crash of the server prints every thread's stack, and so does
    # SIGUSR1 at any time (``kill -USR1 <pid>``: where a server that seems stuck is; it goes on
    # serving).
    stream: Any = getattr(handler, "stream", sys.stderr)
    try:
        faulthandler.enable(file=stream, all_threads=True)
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
    except (AttributeError, OSError, ValueError):  # a stream without a file descriptor
        pass
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    # Verbose means tritonpy's own records (as Triton's --log-verbose), not the debug chatter
    # of every library underneath (grpc, asyncio).
    logging.getLogger("tritonpy").setLevel(logging.DEBUG if args.log_verbose > 0 else logging.INFO)
    try:
        from .frontends import run_loop

        return run_loop(_serve(args, handler))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:
        from ._errors import TritonpyError

        if isinstance(exc, TritonpyError):
            log.error("error: %s", exc)
            return 1
        log.exception("tritonpy serve failed")
        return 1
    finally:  # (a start that failed, too)
        _ignore_stop_signals()


def _ignore_stop_signals() -> None:
    """The server is stopped: a SIGINT or SIGTERM from now on would only change the exit code
    (to a death by that signal, or a KeyboardInterrupt), the clean-up done."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
