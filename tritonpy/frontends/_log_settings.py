"""Triton's dynamic logging settings, as both frontends serve them (``/v2/logging``, gRPC
``LogSettings``)."""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Mapping, Sequence

from .._errors import InvalidArgumentError, UnavailableError

log = logging.getLogger(__name__)


class LogSettings:
    """Triton's dynamic logging settings (``/v2/logging``, gRPC ``LogSettings``), really applied.

    ``log_verbose_level`` sets the ``tritonpy`` loggers to DEBUG (>0) or INFO; ``log_info``,
    ``log_warning`` and ``log_error`` filter records of that level out of the handlers given
    (the CLI's stderr handler; the root logger's handlers when embedded); ``log_file`` adds a
    file handler; ``log_format`` is ``default`` or ``ISO8601``.
    """

    _FORMATS = {"default": None, "ISO8601": "%Y-%m-%dT%H:%M:%S"}
    _EXPECTED = {bool: "boolean", int: "unsigned integer", str: "string"}

    def __init__(self, handlers: Sequence[logging.Handler] | None = None, verbose: int = 0,
                 log_file: str = "") -> None:
        """``log_file``: where ``handlers`` write already (``--log-file``), as reported."""
        self._lock = threading.Lock()
        self._handlers = list(handlers) if handlers is not None else None
        self._file_handler: logging.FileHandler | None = None
        self.values: dict[str, Any] = {
            "log_file": log_file, "log_info": True, "log_warning": True, "log_error": True,
            "log_verbose_level": int(verbose), "log_format": "default",
        }
        self._filter = logging.Filter()
        self._filter.filter = self._keep  # type: ignore[method-assign]
        self._attached = False

    def _keep(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return bool(self.values["log_error"])
        if record.levelno >= logging.WARNING:
            return bool(self.values["log_warning"])
        if record.levelno >= logging.INFO:
            return bool(self.values["log_info"])
        return True

    def _targets(self) -> list[logging.Handler]:
        handlers = self._handlers if self._handlers is not None else logging.getLogger().handlers
        return list(handlers) + ([self._file_handler] if self._file_handler else [])

    def get(self) -> dict[str, Any]:
        """The current settings, as Triton reports them."""
        with self._lock:
            return dict(self.values)

    def update(self, new: Mapping[str, Any]) -> dict[str, Any]:
        """Validate and apply a settings update (null values are ignored, as in Triton)."""
        types = {"log_file": str, "log_info": bool, "log_warning": bool, "log_error": bool,
                 "log_verbose_level": int, "log_format": str}
        unknown = sorted(k for k in new if k not in types)
        if unknown:  # as Triton: ignored, and the known settings beside them apply
            log.warning("ignoring unknown logging setting(s): %s", ", ".join(unknown))
            new = {k: v for k, v in new.items() if k in types}
        for key, value in new.items():
            if value is None:
                continue
            want = types[key]
            if not isinstance(value, want) or (want is int and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 0)):
                raise InvalidArgumentError(f"Unable to parse '{key}': expect "
                                           f"{self._EXPECTED[want]}, got {json.dumps(value)}")
            if isinstance(value, int) and value > 0xFFFFFFFF:
                raise InvalidArgumentError(
                    f"Unable to parse '{key}': {value} is past the largest 32-bit unsigned "
                    f"integer, 4294967295")
            if key == "log_format" and value not in self._FORMATS:
                raise UnavailableError(f"invalid argument for --log_format, got: {value}")
        with self._lock:
            if new.get("log_file") is not None and new["log_file"] != self.values["log_file"]:
                self._set_file(new["log_file"])
            for key, value in new.items():
                if value is not None:
                    self.values[key] = value
            level = logging.DEBUG if self.values["log_verbose_level"] > 0 else logging.INFO
            logging.getLogger("tritonpy").setLevel(level)
            datefmt = self._FORMATS[self.values["log_format"]]
            for handler in self._targets():
                if not self._attached or handler is self._file_handler:
                    handler.addFilter(self._filter)
                if handler.formatter is not None:
                    handler.formatter.datefmt = datefmt
            self._attached = True
            return dict(self.values)

    def _set_file(self, path: str) -> None:
        old = self._file_handler
        self._file_handler = None
        if path:
            try:
                fh = logging.FileHandler(path)
            except OSError as exc:
                raise UnavailableError(f"failed to open log file '{path}': {exc}") from None
            targets = self._targets()
            if targets and targets[0].formatter is not None:
                fh.setFormatter(targets[0].formatter)
            logging.getLogger().addHandler(fh)
            self._file_handler = fh
        if old is not None:
            logging.getLogger().removeHandler(old)
            old.close()

    def close(self) -> None:
        """Detach the filter and close the log file, if any."""
        with self._lock:
            for handler in self._targets():
                handler.removeFilter(self._filter)
            if self._file_handler is not None:
                logging.getLogger().removeHandler(self._file_handler)
                self._file_handler.close()
                self._file_handler = None
