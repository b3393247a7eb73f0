"""The log line: the same for every command and for uvicorn's own loggers, naming the process where a service
runs several; text, or one JSON object a line with a request's fields as keys."""

from __future__ import annotations

import io
import json
import logging
import logging.config
import os
import subprocess
import sys

import pytest

from bertknn.core import logs
from bertknn.core.logs import Event, JsonFormatter, LineFormatter


@pytest.fixture(autouse=True)
def _no_role():
    yield
    logs.name_process(None)


def _record(msg: object, args: tuple | None = None, name: str = "service") -> logging.LogRecord:
    return logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)


def test_a_single_process_line_names_the_logger_alone():
    line = LineFormatter().format(_record("ready"))
    assert line.endswith(" INFO service: ready") and "[" not in line
    assert line[:4].isdigit()  # it starts with the time


def test_a_worker_or_the_model_process_is_named_with_its_pid():
    for role in ("worker", "model", "supervisor"):
        logs.name_process(role)
        assert LineFormatter().format(_record("ready")).endswith(f" INFO [{role} {os.getpid()}] service: ready")


def test_an_event_is_one_text_line_of_named_fields():
    event = Event("request", {
        "id": "ab12", "path": "/predict", "status": 200, "latency_ms": 21.63, "skipped": None,
        "cache": {"encoding": "miss", "retrieval": "hit"}, "stages_ms": {"embedding": 11.126, "total": 13.0},
        "note": "two words", "empty": "",
    })  # fmt: skip
    assert str(event) == (
        'request id=ab12 path=/predict status=200 latency_ms=21.63 cache=encoding:miss,retrieval:hit '
        'stages_ms=embedding:11.13,total:13 note="two words" empty=""'
    )
    assert LineFormatter().format(_record(event)).endswith(f" INFO service: {event}")


def test_a_json_line_has_the_events_fields_as_keys():
    logs.name_process("worker")
    event = Event("request", {"id": "ab12", "status": 503, "cache": {"encoding": "miss"}, "level": "spoofed",
                              "gone": None})  # fmt: skip
    line = json.loads(JsonFormatter().format(_record(event)))
    assert line["message"] == "request" and line["id"] == "ab12" and line["status"] == 503
    assert line["cache"] == {"encoding": "miss"} and "gone" not in line
    assert line["level"] == "INFO" and line["logger"] == "service"  # a field never replaces the line's own keys
    assert line["role"] == "worker" and line["pid"] == os.getpid() and line["time"].endswith("Z")


def test_an_event_with_its_own_text_and_a_commands_summary():
    event = Event("progress", {"contexts": 1200, "eta_s": None}, text="progress: 1,200 contexts embedded")
    assert LineFormatter().format(_record(event)).endswith(" INFO service: progress: 1,200 contexts embedded")
    line = json.loads(JsonFormatter().format(_record(event)))
    assert line["message"] == "progress" and line["contexts"] == 1200 and "eta_s" not in line
    done = logs.summary("build finished", {"contexts": 3, "stages": {"forward": {"seconds": 0.5}}})
    assert str(done) == 'build finished: {"contexts": 3, "stages": {"forward": {"seconds": 0.5}}}'
    assert json.loads(JsonFormatter().format(_record(done)))["stages"] == {"forward": {"seconds": 0.5}}


def test_a_json_line_of_a_plain_message_and_of_an_exception():
    line = json.loads(JsonFormatter().format(_record("%d articles, %s", (3, "ok"))))
    assert line["message"] == "3 articles, ok" and "role" not in line and "exception" not in line
    try:
        raise ValueError("broken")
    except ValueError:
        record = logging.LogRecord("service", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    line = json.loads(JsonFormatter().format(record))
    assert line["level"] == "ERROR" and "ValueError: broken" in line["exception"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_uvicorns_loggers_write_the_same_lines(fmt, monkeypatch):
    """uvicorn's log_config: its lines in the project's format, and the loggers that exist stay enabled."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    ours = logging.getLogger("bertknn.test_logs")
    saved = {name: logging.getLogger(name).__dict__.copy() for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}
    try:
        logging.config.dictConfig(logs.uvicorn_config(fmt))
        logs.name_process("worker")
        logging.getLogger("uvicorn.error").info("Started server process [%d]", 42)
        assert not ours.disabled
    finally:
        for name, state in saved.items():
            logging.getLogger(name).__dict__.update(state)
    line = stream.getvalue().strip()
    if fmt == "json":
        parsed = json.loads(line)
        assert parsed["logger"] == "uvicorn.error" and parsed["message"] == "Started server process [42]"
        assert parsed["role"] == "worker"
    else:
        assert line.endswith(f" INFO [worker {os.getpid()}] uvicorn.error: Started server process [42]"), line


@pytest.mark.parametrize(("asked", "json_lines"), [("json", True), (" JSON ", True), ("text", False), ("xml", False)])
def test_a_command_without_the_setting_reads_the_format_from_the_environment(asked, json_lines):
    """`bert-knn build` and `eval` have no log setting of their own: ``BERTKNN_LOG_FORMAT`` is the service's name."""
    code = "from bertknn.core import logs; import logging; logs.configure(); logging.getLogger('x').info('hi')"
    env = {**os.environ, logs.FORMAT_ENV: asked}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 0 and "hi" in lines[-1], run.stderr
    if json_lines:
        assert json.loads(lines[-1])["message"] == "hi" and len(lines) == 1
    else:
        assert " INFO x: hi" in lines[-1]
        assert (asked == "xml") == any("BERTKNN_LOG_FORMAT=xml: neither text nor json" in line for line in lines)
