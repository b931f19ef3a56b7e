"""The run of ``tritonpy serve``: the server started on the event loop that serves its
frontends, the signals (the first drains and stops, a second stops at once), the drain in
Triton's words, and the exit status.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import signal
import sys
from typing import TYPE_CHECKING, Any

from ._cli_flags import _NOT_SERVED, _dest
from ._cli_settings import (
    _tracing,
    cache_size,
    check_address,
    check_port,
    default_repository,
    deprecation_warnings,
    grpc_ssl_context,
    keepalive_options,
    metrics_config,
    no_effect_warnings,
    python_backend_config,
    unbracketed,
)
from ._errors import TritonpyError

if TYPE_CHECKING:
    from .server import Server

log = logging.getLogger("tritonpy.cli")


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
    from .frontends._log_settings import LogSettings
    from .frontends._request_parsing import header_pattern, parse_restrictions
    from .frontends.dataplane import DEFAULT_MAX_INPUT_SIZE

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
            left_in_flight = await _drain(server, args.exit_timeout_secs, now)
            if left_in_flight and not now.is_set():
                # Cut off by the exit timeout, whether or not they end before the models are
                # unloaded (the frontends cancel their calls first): the exit code says so
                # every time, not as that race goes.
                server.mark_cut_off(left_in_flight)
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


async def _drain(server: Server, timeout: float,
                 now: asyncio.Event) -> list[tuple[str, int, int]]:
    """The first part of a stop, as Triton's: the ports stay open, clients' new inference
    requests are refused and the server is neither live nor ready, until the requests in
    flight are answered (or ``timeout`` passes, or ``now`` is set). Each second the log says
    what is left, in Triton's words. Returns what is left then (``Server.in_flight()``)."""
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
    return busy


def _ignore_stop_signals() -> None:
    """The server is stopped: a SIGINT or SIGTERM from now on would only change the exit code
    (to a death by that signal, or a KeyboardInterrupt), the clean-up done."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
