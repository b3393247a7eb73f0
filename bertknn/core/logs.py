"""How every command logs: one line format (text, or one JSON object a line), which names the process where a
service runs several, for the project's loggers and uvicorn's alike."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["text", "json"]
LINE = "%(asctime)s %(levelname)s%(role)s %(name)s: %(message)s"
FORMAT_ENV = "BERTKNN_LOG_FORMAT"  # the service's ``log_format`` setting; every other command reads it as is
_QUOTED = re.compile('[ ="]')  # a text value with one of these is written quoted, as JSON
_role: str | None = None  # this process's role where a service runs several (``worker``, ``model``)


@dataclass(frozen=True)
class Event:
    """A log message made of named fields: ``name k=v k=v`` in text lines (or ``text``, a sentence written for
    the eye), the fields as keys of a JSON line. Log it as the message itself: ``logger.info(Event("request",
    {...}))``."""

    name: str
    fields: dict[str, Any] = field(default_factory=dict)
    text: str | None = None

    def __str__(self) -> str:
        if self.text is not None:
            return self.text
        return " ".join([self.name, *(f"{k}={_text_value(v)}" for k, v in self.fields.items() if v is not None)])


def summary(name: str, fields: dict[str, Any]) -> Event:
    """A command's closing figures: ``name: {JSON}`` in a text line, the figures as keys of a JSON line."""
    return Event(name, fields, text=f"{name}: {json.dumps(fields)}")


def _text_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}".rstrip("0").rstrip(".") if value == value else "nan"
    if isinstance(value, dict):
        return ",".join(f"{k}:{_text_value(v)}" for k, v in value.items())
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if not text or _QUOTED.search(text) else text


class LineFormatter(logging.Formatter):
    """`LINE`: time, level, ``[role pid]`` in a process of a service that runs several, logger, message."""

    def __init__(self) -> None:
        super().__init__(LINE)

    def format(self, record: logging.LogRecord) -> str:
        record.role = f" [{_role} {record.process}]" if _role else ""
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``pid``, ``role`` where there is
    one, ``message``; an `Event`'s fields as keys of their own; ``exception`` with the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        line: dict[str, Any] = {"time": when, "level": record.levelname, "logger": record.name, "pid": record.process}
        if _role:
            line["role"] = _role
        event = record.msg if isinstance(record.msg, Event) and not record.args else None
        line["message"] = event.name if event is not None else record.getMessage()
        if event is not None:
            line.update({k: v for k, v in event.fields.items() if k not in line and v is not None})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def formatter(fmt: LogFormat = "text") -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else LineFormatter()


def name_process(role: str | None) -> None:
    """From now on, each line of this process names it as ``role`` (``supervisor``, ``worker``, ``model``) with
    its pid; None: lines name no process (a service of one process, any other command)."""
    global _role
    _role = role


def configure(level: str | int = logging.INFO, role: str | None = None, fmt: LogFormat | None = None) -> None:
    """Log to stderr at ``level`` in ``fmt``'s lines (once per process, as `logging.basicConfig`); ``role`` as
    `name_process`'s. Without ``fmt`` (the commands that have no setting for it), ``BERTKNN_LOG_FORMAT``'s."""
    name_process(role)
    asked = os.environ.get(FORMAT_ENV, "text").strip().lower() if fmt is None else fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter("json" if asked == "json" else "text"))
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, handlers=[handler])
    if asked not in ("text", "json"):
        logging.getLogger(__name__).warning("%s=%s: neither text nor json; logging text", FORMAT_ENV, asked)


def uvicorn_config(fmt: LogFormat = "text") -> dict[str, Any]:
    """uvicorn's ``log_config``: its own loggers' lines in the same format as the project's (uvicorn applies it
    in every server process it starts)."""
    klass = f"{__name__}.{'JsonFormatter' if fmt == 'json' else 'LineFormatter'}"
    handler = {"class": "logging.StreamHandler", "formatter": "line", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"line": {"()": klass}},
        "handlers": {"line": handler},
        "loggers": {
            "uvicorn": {"handlers": ["line"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "INFO"},
            "uvicorn.access": {"handlers": ["line"], "level": "INFO", "propagate": False},
        },
    }
