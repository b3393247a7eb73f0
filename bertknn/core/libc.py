"""What the project asks of the C library itself (glibc on Linux; nothing elsewhere): the operating system's name of
a thread, and the heap's free pages given back (`bertknn.core.runtime.return_free_memory`)."""

from __future__ import annotations

import ctypes
import sys
import threading
from functools import cache

_PR_SET_NAME = 15  # prctl(2)


@cache
def glibc() -> ctypes.CDLL | None:
    """The C library, when it is glibc (it has ``malloc_trim``); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread its Python name (or ``name``) in the operating system too, so that ``top -H``,
    ``ps -L``, ``py-spy`` and ``/proc/PID/task/*/comm`` tell the service's threads apart (its event loop is the
    process's main thread). Linux keeps the first 15 bytes; elsewhere nothing happens. Called on a process's main
    thread, it names the process (``ps``, ``top``)."""
    libc = glibc()
    if libc is not None:
        text = (name or threading.current_thread().name).encode("utf-8", "replace")[:15]
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(text), 0, 0, 0)
