"""The service with a probe at each step of a request: `bench.steps`'s server side, not a benchmark of its own.

``python -m bench.steps_probe SERVICE-ARGS...`` runs ``python -m service`` unchanged, after wrapping the
functions in `PROBES` so that each call records its start and end (``perf_counter``) in memory. When the process
exits, the records go to the JSON file named by ``$BENCH_STEPS_OUT``. Each record names the asyncio task it ran
in (each request's own, on the event loop; none on the model thread), so that `bench.steps` can tell one
request's records from the next one's. A probed function that is gone (renamed, moved) stops the run at once
with its name, so that the steps never silently lose one.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import importlib
import inspect
import itertools
import json
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

# (module, attribute path, the probe's name): each call records "NAME<" on entry and "NAME>" on exit
PROBES = (
    ("bertknn.service.api.middleware", "RequestContextMiddleware.__call__", "http"),
    ("bertknn.core.encoder", "MaskedLMEncoder.query_input", "tokenise"),
    ("bertknn.service.encoding", "QueryEncoder.forward", "forward"),
    ("bertknn.service.assemble", "AnswerAssembler.answer_from_encoding", "answer"),
    ("bertknn.service.serving", "AsyncAnswerer.answer", "answered"),
)

EVENTS: list[tuple[str, float, int | None]] = []  # (probe event, perf_counter, its asyncio task's number or None)

_TASKS: weakref.WeakKeyDictionary[asyncio.Task[Any], int] = weakref.WeakKeyDictionary()
_NUMBERS = itertools.count()


def _task() -> int | None:
    """The number of the asyncio task running this call (each request's own; numbered on first sight, since an
    id() is reused once a task is gone), None outside the event loop."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop in this thread (the model thread, the pools)
        return None
    if task is None:
        return None
    number = _TASKS.get(task)
    if number is None:
        number = _TASKS[task] = next(_NUMBERS)
    return number


def _probed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    clock, add = time.perf_counter, EVENTS.append
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            add((name + "<", clock(), _task()))
            try:
                return await fn(*args, **kwargs)
            finally:
                add((name + ">", clock(), _task()))

        return wrapped_async

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        add((name + "<", clock(), _task()))
        try:
            return fn(*args, **kwargs)
        finally:
            add((name + ">", clock(), _task()))

    return wrapped


def install() -> None:
    """Wrap every function of `PROBES` in place; RuntimeError naming the first one that is not there."""
    for module, path, name in PROBES:
        owner_path, _, attr = path.rpartition(".")
        try:
            owner: Any = importlib.import_module(module)
            for part in owner_path.split(".") if owner_path else ():  # (a module's own function: no owner path)
                owner = getattr(owner, part)
            fn = getattr(owner, attr)
        except (ImportError, AttributeError) as exc:
            raise RuntimeError(f"bench.steps_probe: {module}.{path} is gone ({exc}): update PROBES") from None
        setattr(owner, attr, _probed(fn, name))


def _write() -> None:
    out = os.environ.get("BENCH_STEPS_OUT")
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(EVENTS, f)


def main(argv: list[str]) -> int:
    install()
    atexit.register(_write)
    # uvicorn puts this handler back after its graceful shutdown and raises the signal again: exit through atexit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from bertknn.service.__main__ import main as serve

    return serve(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
