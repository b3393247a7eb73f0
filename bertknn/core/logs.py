"""How every command logs: one line format, which names the process where a service runs several."""

from __future__ import annotations

import logging

LINE = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def line_format(role: str | None = None) -> str:
    """The log line's format; with ``role`` (``worker``, ``model``), the role and the process id after the level,
    so that the lines of a service's processes, which share one stream, can be told apart."""
    return LINE if role is None else LINE.replace(" %(name)s", f" [{role} %(process)d] %(name)s", 1)


def configure(level: str | int = logging.INFO, role: str | None = None) -> None:
    """Log to stderr at ``level`` in `line_format`'s lines (once per process, as `logging.basicConfig`)."""
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, format=line_format(role))
