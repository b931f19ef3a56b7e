"""The keepalive and ping policy of :mod:`._http2`'s server (gRPC core's, with Triton's flags):
:class:`KeepAlive`, the policy, and :class:`ConnectionKeepAlive`, its timers and counts on a
connection.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable

from ._h2_frames import _ENHANCE_YOUR_CALM, _PING, _ConnectionError, _frame

if TYPE_CHECKING:
    from ._h2_call import _Call
    from ._http2 import Http2GrpcServer

# The server's one logger, named as before the split (log settings and tests name it).
log = logging.getLogger("tritonpy.frontends._http2")

#: The payload of our keepalive pings (a client's own pings carry theirs).
_KEEPALIVE_PING = b"tpy-keep"
#: A ping received while no call is open, without ``permit_without_calls``, is a strike unless
#: the last came this long before (gRPC core's rule).
_IDLE_PING_INTERVAL = 7200.0


@dataclass(frozen=True)
class KeepAlive:
    """The keepalive and ping policy of gRPC core's servers, in the terms (milliseconds) and
    with the defaults of Triton's ``--grpc-keepalive-*``, ``--grpc-http2-*`` and
    ``--grpc-max-connection-age*`` flags.

    - Once a connection has been silent for ``time_ms``, the server pings it, if a call is open
      (or ``permit_without_calls``) and fewer than ``max_pings_without_data`` pings (0: no
      limit) went since it last sent headers or data; a ping not answered within
      ``timeout_ms`` closes the connection (a client gone without a word).
    - A client ping that comes sooner than ``min_recv_ping_interval_without_data_ms`` after the
      last one (two hours while no call is open, unless ``permit_without_calls``), with no
      headers or data sent by the server between, is a strike; past ``max_ping_strikes``
      strikes (0: no limit) the connection ends with GOAWAY ENHANCE_YOUR_CALM
      ``too_many_pings``.
    - ``max_connection_age_ms`` (0: none), give or take 10%, after a connection opened, it gets
      GOAWAY: its open calls go on, new ones are refused (REFUSED_STREAM, which clients retry
      on a new connection), and it closes when the last call ends or
      ``max_connection_age_grace_ms`` (0: no limit) later.
    """

    time_ms: int = 7_200_000
    timeout_ms: int = 20_000
    permit_without_calls: bool = False
    max_pings_without_data: int = 2
    min_recv_ping_interval_without_data_ms: int = 300_000
    max_ping_strikes: int = 2
    max_connection_age_ms: int = 0
    max_connection_age_grace_ms: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type != "bool" and (not isinstance(value, int) or value < 0):
                raise ValueError(f"keepalive {f.name} must be a whole number >= 0, "
                                 f"not {value!r}")
        if self.time_ms < 1 or self.timeout_ms < 1:
            raise ValueError("keepalive time_ms and timeout_ms must be at least 1")


class ConnectionKeepAlive:
    """The keepalive pings, ping strikes and maximum age of a connection, as a mixin of
    :class:`~tritonpy.frontends._h2_connection._Connection`'s: its timers and counts are the
    connection's state (set up in its ``__init__``; ``sends`` moves on with every call's
    headers and data, on the hot path), and it reads and writes the connection's transport,
    calls and output: an object of its own would reach back into all of that."""

    # _Connection's state, set up in _Connection.__init__.
    server: Http2GrpcServer
    transport: Any
    calls: dict[int, _Call]
    out: list[Any]
    clock: Callable[[], float]
    sends: int
    last_read: float
    keepalive_timer: asyncio.TimerHandle | None
    watchdog: asyncio.TimerHandle | None
    pings_without_data: int
    ping_mark: int
    ping_recv_at: float | None
    ping_strikes: int
    strike_mark: int
    going_away: bool
    age_timer: asyncio.TimerHandle | None

    if TYPE_CHECKING:  # _Connection's (_h2_connection.py)
        def flush(self) -> None: ...

        def goaway(self, code: int = ..., debug: bytes = ...) -> None: ...

        def close_soon(self) -> None: ...

        def _close_drained(self) -> None: ...

    def _keepalive(self) -> None:
        """The keepalive period is up: ping a silent client (KeepAlive says when)."""
        self.keepalive_timer = None
        if self.transport is None:
            return
        keepalive = self.server.keepalive
        period = keepalive.time_ms / 1000
        loop = asyncio.get_running_loop()
        silent = self.clock() - self.last_read
        if silent < period:  # heard from meanwhile: count the period from then
            self.keepalive_timer = loop.call_later(period - silent, self._keepalive)
            return
        if self.sends != self.ping_mark:
            self.ping_mark = self.sends
            self.pings_without_data = 0
        limit = keepalive.max_pings_without_data
        if (self.calls or keepalive.permit_without_calls) and (
                not limit or self.pings_without_data < limit):
            self.pings_without_data += 1
            self.out.append(_frame(_PING, 0, 0, _KEEPALIVE_PING))
            self.flush()
            # The next period starts with the answer.
            self.watchdog = loop.call_later(keepalive.timeout_ms / 1000, self._no_ping_answer)
            return
        self.keepalive_timer = loop.call_later(period, self._keepalive)

    def _ping_answered(self) -> None:
        if self.watchdog is None:
            return  # a late answer, or one to a ping we did not send
        self.watchdog.cancel()
        self.watchdog = None
        self.keepalive_timer = asyncio.get_running_loop().call_later(
            self.server.keepalive.time_ms / 1000, self._keepalive)

    def _no_ping_answer(self) -> None:
        self.watchdog = None
        if self.transport is not None:
            log.debug("gRPC connection closed: no answer to a keepalive ping within %g s",
                      self.server.keepalive.timeout_ms / 1000)
            self.transport.abort()

    def _ping_received(self) -> None:
        """Count a strike for a ping that comes too soon (KeepAlive's policy)."""
        keepalive = self.server.keepalive
        if self.sends != self.strike_mark:  # we sent headers or data since: start over
            self.strike_mark = self.sends
            self.ping_recv_at = None
            self.ping_strikes = 0
        now = self.clock()
        last, self.ping_recv_at = self.ping_recv_at, now
        if last is None:
            return
        interval = (keepalive.min_recv_ping_interval_without_data_ms / 1000
                    if self.calls or keepalive.permit_without_calls else _IDLE_PING_INTERVAL)
        if now - last < interval:
            self.ping_strikes += 1
            if keepalive.max_ping_strikes and self.ping_strikes > keepalive.max_ping_strikes:
                raise _ConnectionError(_ENHANCE_YOUR_CALM,
                                       f"{self.ping_strikes} pings too close together",
                                       b"too_many_pings")

    def _too_old(self) -> None:
        """Past the maximum age: GOAWAY; the open calls go on for the grace period."""
        self.age_timer = None
        if self.transport is None or self.going_away:
            return
        self.going_away = True
        self.goaway()
        if not self.calls:
            self.close_soon()
            return
        grace = self.server.keepalive.max_connection_age_grace_ms
        if grace:
            self.age_timer = asyncio.get_running_loop().call_later(grace / 1000,
                                                                   self._grace_over)

    def _grace_over(self) -> None:
        self.age_timer = None
        if self.transport is not None:
            log.debug("gRPC connection closed: %d calls still open past its age's grace period",
                      len(self.calls))
            self._close_drained()
