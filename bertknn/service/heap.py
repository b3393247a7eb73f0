"""The heap that start-up loads, kept out of the cyclic garbage collector's full passes (`gc.freeze`).

The model, the tokenizer, the vocabulary's words and the indexes are hundreds of thousands of Python objects that
live as long as the version of the datastore they serve. Every full collection walks all of them: a pause for
every request in flight while it runs; and interpreter exit runs several in a row, which is what a container's
PID 1 pays after SIGTERM (uvicorn re-raises the signal, the kernel ignores it for PID 1, and the interpreter
finalizes). Frozen, they are skipped by every collection; reference counting still frees them. Only the cycles
among frozen objects wait for `thaw`: a reload thaws before it lets the old version go
(docs/decisions/frozen-heap.md).
"""

from __future__ import annotations

import gc


def settle() -> int:
    """One full collection, then freeze what survived; the number of objects now frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Give every frozen object back to the collector (an app that stops, a version that is retired)."""
    gc.unfreeze()


def resettle() -> int:
    """After a retired version's last reference is gone: thaw, so its cycles are collected, and settle again."""
    thaw()
    return settle()


def before_exit() -> None:
    """The process is ending: freeze everything, so that finalization's collections skip it."""
    gc.freeze()
