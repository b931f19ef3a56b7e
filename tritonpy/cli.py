"""``tritonpy serve``: a Triton-like server process over KServe v2 HTTP/REST and gRPC.

The flags are Triton's (``--model-repository``, ``--http-port``, ``--backend-config=python,k=v``
...). With no ``--model-repository`` it serves the bundled ``examples/`` repository. SIGINT or
SIGTERM stops accepting, drains in-flight requests (``--exit-timeout-secs``), stops the server
(no stub process or shared-memory segment left) and exits 0.

``tritonpy stress`` (see :mod:`tritonpy.stress`) pushes servers past their limits on purpose
and prints what a user sees.

Here: the parser, the log format and the entry point. The flags' types and tables are in
``_cli_flags``, their translation into the server's settings in ``_cli_settings``, and the
run of ``serve`` (signals, drain, exit status) in ``_serve_loop``.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from typing import Any, Sequence

from . import stress
from ._cli_flags import (
    _KEEPALIVE_FLAGS,
    _NO_EFFECT,
    _NOT_SERVED,
    _NOT_SERVED_SETTINGS,
    _backend_config,
    _bool,
    _config_name,
    _port,
    _rate_resource,
    _repository,
    _seconds,
    _trace_config,
    _verbosity,
)
from ._serve_loop import _ignore_stop_signals, _serve

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
    from .frontends._h2_keepalive import KeepAlive

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
        from .shm import ShmExhaustedError

        # (a full /dev/shm, or a pool cap too small for a first segment: the words say it all)
        if isinstance(exc, (TritonpyError, ShmExhaustedError)):
            log.error("error: %s", exc)
            return 1
        log.exception("tritonpy serve failed")
        return 1
    finally:  # (a start that failed, too)
        _ignore_stop_signals()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
