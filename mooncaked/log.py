"""Structured logging: one line per event, JSON (default) or plain text.

Use `get_logger(__name__).info("event_name", key=value, ...)`: the event name is
a short snake_case word and the fields are its facts (units in the key names,
e.g. `ttft_s`, `bytes`).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        event = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                 "logger": record.name, "event": record.getMessage()}
        event.update(getattr(record, "fields", {}))
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(event, default=str).decode()


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{ts} {record.levelname[0]} {record.name}: {record.getMessage()} {fields}".rstrip()
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class EventLogger:
    """A logger whose calls take an event name and keyword fields."""

    def __init__(self, name: str):
        self._log = logging.getLogger(name)

    def _emit(self, level: int, event: str, exc_info: bool, fields: dict[str, Any]) -> None:
        if self._log.isEnabledFor(level):
            self._log.log(level, event, extra={"fields": fields}, exc_info=exc_info)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, False, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, False, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, False, fields)

    def error(self, event: str, exc_info: bool = False, **fields: Any) -> None:
        self._emit(logging.ERROR, event, exc_info, fields)


def get_logger(name: str) -> EventLogger:
    """An EventLogger under the `mooncaked` hierarchy."""
    return EventLogger(name)


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    """Routes all logging to stderr, one line per event. Raises KeyError for an unknown level."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS[level])
    for noisy in ("aiohttp.access",):
        logging.getLogger(noisy).setLevel(logging.WARNING)
