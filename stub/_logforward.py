"""Python logging in a stub's model, forwarded to the host's log with its level and source line."""
from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._runtime import StubRuntime


class _LogForwarder(logging.Handler):
    """Sends Python logging records to the host as LOG frames (installed as lastResort, and
    used by the StreamHandlers on the stub's stdout and stderr)."""

    def __init__(self, rt: StubRuntime) -> None:
        super().__init__(logging.NOTSET)
        self.rt = rt

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            self.send(record, msg if record.name == "root" else f"{record.name}: {msg}")
        except Exception:
            self.handleError(record)

    def send(self, record: logging.LogRecord, message: str) -> None:
        """``message`` into the host log at the record's level, with its file and line."""
        # pb_utils.LogLevel: INFO 0, WARNING 1, ERROR 2, VERBOSE 3
        n = record.levelno
        level = (2 if n >= logging.ERROR else 1 if n >= logging.WARNING
                 else 0 if n >= logging.INFO else 3)
        self.rt.log(level, message, (record.filename, record.lineno))


def _forward_stdio_handlers(forwarder: _LogForwarder) -> None:
    """Make a ``logging.StreamHandler`` on the stub's stderr or stdout send its records to the
    host log as the forwarder does, instead of writing them as text.

    The stub's stderr and stdout reach the host log too, but as bare lines: at WARNING and
    INFO, from the host's reader, not the model's line. The handler a model gets from a
    ``logging.error(...)`` (which runs ``basicConfig()``) or from its own ``basicConfig()``
    is such a handler, and from then on lastResort is not used: without this the model's
    records lost their level and source line at its first ``logging.error``. The handler
    stays where it is and keeps its level and filters: ``basicConfig(level=DEBUG)`` still
    lets DEBUG records through, and nothing is logged twice. A format of the model's own
    (``basicConfig(format=...)``, ``setFormatter``) makes the message; the default ones
    (none, or basicConfig's ``LEVEL:name:message``) give the forwarder's ``name: message``,
    the line the record made before the handler existed. Installing the forwarder as a root
    handler instead would have made every later ``basicConfig(level=..., format=...)`` a
    silent no-op, and logged twice the records of a model that adds a StreamHandler itself.
    In a process the model forked, which cannot reach the host, the handler writes as usual.
    """
    stdio = (sys.stdout, sys.stderr)
    write = logging.StreamHandler.emit

    def emit(handler: logging.StreamHandler, record: logging.LogRecord) -> None:
        if handler.stream not in stdio or forwarder.rt._forked:
            write(handler, record)
            return
        fmt = handler.formatter
        if fmt is None or fmt._fmt == logging.BASIC_FORMAT:
            forwarder.emit(record)
            return
        try:
            forwarder.send(record, handler.format(record))
        except Exception:
            handler.handleError(record)

    logging.StreamHandler.emit = emit  # type: ignore[method-assign,assignment]
