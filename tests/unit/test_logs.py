"""The log line: the same for every command, naming the process where a service runs several."""

from __future__ import annotations

import logging
import os

from bertknn.core.logs import line_format


def _line(fmt: str) -> str:
    record = logging.LogRecord("service", logging.INFO, __file__, 1, "ready", None, None)
    return logging.Formatter(fmt).format(record)


def test_a_single_process_line_names_the_logger_alone():
    line = _line(line_format())
    assert line.endswith(" INFO service: ready") and "[" not in line


def test_a_worker_or_the_model_process_is_named_with_its_pid():
    assert _line(line_format("worker")).endswith(f" INFO [worker {os.getpid()}] service: ready")
    assert _line(line_format("model")).endswith(f" INFO [model {os.getpid()}] service: ready")
