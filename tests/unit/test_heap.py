"""The frozen heap: settle freezes what start-up made and raises the young generation's threshold, thaw gives both
back (CPython's own threshold, however often it settled), and a process that ends freezes everything first."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from bertknn.service import heap

pytestmark = pytest.mark.usefixtures("collector_restored")  # (tests/conftest.py)


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_settle_freezes_the_heap_and_thaw_gives_it_back() -> None:
    gc.set_threshold(700, 11, 12)  # CPython's, whatever they are
    own = gc.get_threshold()
    kept = [[i] for i in range(1000)]  # objects start-up made
    frozen = heap.settle()
    assert frozen == gc.get_freeze_count() >= len(kept)
    assert gc.get_threshold() == (heap.YOUNG_THRESHOLD, *own[1:])
    heap.thaw()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == own


def test_settling_again_keeps_cpython_s_threshold_to_restore() -> None:
    own = gc.get_threshold()
    heap.settle()
    assert heap.resettle() > 0 and gc.get_threshold() == (heap.YOUNG_THRESHOLD, *own[1:])
    heap.settle()
    assert heap._thresholds == [own]  # one threshold to give back, CPython's
    heap.thaw()
    assert gc.get_threshold() == own
    heap.thaw()  # a second thaw changes nothing
    assert gc.get_threshold() == own and gc.get_freeze_count() == 0


def test_garbage_is_collected_before_the_freeze_and_a_retired_version_s_cycles_on_resettle() -> None:
    garbage, retired = Node(), Node()
    gone, old = weakref.ref(garbage), weakref.ref(retired)
    del garbage
    heap.settle()
    assert gone() is None and old() is not None  # collected, not frozen
    del retired  # the last reference to a retired version (frozen: no collection frees its cycles)
    gc.collect()
    assert old() is not None
    heap.resettle()
    assert old() is None


def test_a_process_that_ends_freezes_everything_first() -> None:
    """Importing the module registers the hook: a hook registered before it runs after it (atexit's order) and
    finds the heap frozen, though the process unfroze it."""
    probe = ("import atexit, gc; atexit.register(lambda: print('frozen', gc.get_freeze_count()));"
             "import bertknn.service.heap; gc.unfreeze()")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.startswith("frozen ") and int(out.stdout.split()[1]) > 0
    gc.unfreeze()
    heap.before_exit()
    assert gc.get_freeze_count() > 0
