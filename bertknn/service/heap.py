"""The heap that start-up loads, kept out of the cyclic garbage collector's full passes (`gc.freeze`).

The model, the tokenizer, the vocabulary's words and the indexes are hundreds of thousands of Python objects that
live as long as the version of the datastore they serve. Every full collection walks all of them: a pause for
every request in flight while it runs; and interpreter exit runs several in a row, which is what a container's
PID 1 pays after SIGTERM (uvicorn re-raises the signal, the kernel ignores it for PID 1, and the interpreter
finalizes). Frozen, they are skipped by every collection; reference counting still frees them. Only the cycles
among frozen objects wait for `thaw`: a reload thaws before it lets the old version go
(docs/decisions/frozen-heap.md).

While settled, the young generation is collected after `YOUNG_THRESHOLD` net allocations, not CPython's default:
a request's objects die by reference counting, and the collections that the default runs every few requests walk
the requests in flight for nothing.
"""

from __future__ import annotations

import atexit
import gc

YOUNG_THRESHOLD = 10_000
_thresholds: list[tuple[int, int, int]] = []  # CPython's before the first settle, restored by `thaw`


def settle() -> int:
    """One full collection, then freeze what survived; the number of objects now frozen."""
    gc.collect()
    gc.freeze()
    if not _thresholds:
        _thresholds.append(gc.get_threshold())
        gc.set_threshold(YOUNG_THRESHOLD, *_thresholds[0][1:])
    return gc.get_freeze_count()


def thaw() -> None:
    """Give every frozen object back to the collector (an app that stops, a version that is retired), and the
    young generation its threshold."""
    gc.unfreeze()
    if _thresholds:
        gc.set_threshold(*_thresholds.pop())


def resettle() -> int:
    """After a retired version's last reference is gone: thaw, so its cycles are collected, and settle again."""
    thaw()
    return settle()


def before_exit() -> None:
    """The process is ending (an ``atexit`` hook, run before the interpreter finalizes its modules): freeze
    everything, so that finalization's collections skip it. As a container's PID 1 the signal uvicorn re-raises
    after SIGTERM is ignored, and every server process, `--workers`' too, exits this way."""
    gc.freeze()


atexit.register(before_exit)  # any process that serves: `python -m service`, each `--workers` process
