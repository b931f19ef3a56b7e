"""From the parsed flags of ``tritonpy serve`` to the settings of its server and frontends:
the trace settings, the python backend's configuration, the gRPC keepalive policy and TLS
context, the metrics and cache settings, the addresses and ports checked, and the warnings of
flags with no effect; a flag that cannot be served stops the start (``SystemExit``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ._cli_flags import _KEEPALIVE_FLAGS, _NO_EFFECT, _NOT_SERVED_SETTINGS, _dest
from ._errors import TritonpyError
from ._otel import OtelSettings
from ._trace import Tracing

if TYPE_CHECKING:
    from ._stats import MetricsConfig
    from .frontends._h2_keepalive import KeepAlive

log = logging.getLogger("tritonpy.cli")


def check_port(flag: str, port: int) -> None:
    """Stop the start, naming the flag, for a port out of range (Triton 2.51 takes -5 and
    reports "Started HTTPService at 0.0.0.0:-5")."""
    if not 0 <= port <= 65535:
        raise SystemExit(f"error: argument {flag}: expected a port number 0-65535, got "
                         f"'{port}'")


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
    :meth:`._options.BackendOptions.from_mapping`).
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
    from .frontends._h2_keepalive import KeepAlive

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


def default_repository() -> Path:
    """The bundled ``examples/`` repository next to the package."""
    path = Path(__file__).resolve().parents[1] / "examples"
    if not path.is_dir():
        raise SystemExit(
            f"error: no --model-repository given and the bundled examples repository "
            f"({path}) does not exist"
        )
    return path
