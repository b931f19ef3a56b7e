"""The flags of ``tritonpy serve``: the argparse types that read their values (a usage error
names the flag) and the tables of Triton's flags that are taken with no effect, the gRPC
keepalive flags and the frontends not served, which both the parser (``cli.build_parser``)
and the translation of the flags into settings (``_cli_settings``) read.
"""
from __future__ import annotations

import argparse
from typing import Any

from ._errors import TritonpyError
from ._ratelimit import parse_resource


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
    :func:`._cli_settings.check_port`), as Triton takes any for a service turned off (QA
    L0_socket)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}") \
            from None


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
