"""Run directories of several server processes: a killed server's is removed by the next, a live one's never."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bertknn.service.processes import (
    MAX_SLOTS,
    OWNER_LOCK,
    RUN_DIR_PREFIX,
    STALE_AFTER_S,
    WorkerSlot,
    live_slots,
    make_run_dir,
    remove_stale_run_dirs,
)


def _killed(parent: Path) -> Path:
    """What a server killed with SIGKILL leaves: its run directory, no lock held."""
    run = make_run_dir(parent)
    run._lock.close()  # the kernel lets go of a dead process's locks
    return run.root


def test_a_killed_servers_run_directory_is_removed_and_live_ones_are_kept(tmp_path: Path):
    dead = _killed(tmp_path)
    (dead / "gate.bin").write_bytes(b"\0" * 64)
    running = make_run_dir(tmp_path)  # its parent is alive: owner lock held
    orphaned = _killed(tmp_path)  # the parent died, a worker lives on
    slot = WorkerSlot.claim(orphaned)
    unrelated = tmp_path / "something-else"
    unrelated.mkdir()
    assert remove_stale_run_dirs(tmp_path) == [dead]
    assert not dead.exists() and running.root.is_dir() and orphaned.is_dir() and unrelated.is_dir()
    slot.release()
    assert remove_stale_run_dirs(tmp_path) == [orphaned]
    running.remove()
    assert not running.root.exists()


def test_a_run_directory_without_an_owner_lock_is_removed_only_once_old(tmp_path: Path):
    """An older server's layout, or one being made this instant (made, its lock not yet taken)."""
    young = tmp_path / f"{RUN_DIR_PREFIX}young"
    old = tmp_path / f"{RUN_DIR_PREFIX}old"
    for d in (young, old):
        (d / "metrics").mkdir(parents=True)
    past = time.time() - STALE_AFTER_S - 5
    os.utime(old, (past, past))
    assert remove_stale_run_dirs(tmp_path) == [old]
    assert young.is_dir() and not (young / OWNER_LOCK).exists()


def test_a_link_named_like_a_run_directory_is_never_followed(tmp_path: Path):
    target = tmp_path / "elsewhere"
    (target / "data").mkdir(parents=True)
    past = time.time() - STALE_AFTER_S - 5
    os.utime(target, (past, past))
    link = tmp_path / f"{RUN_DIR_PREFIX}link"
    link.symlink_to(target)
    os.utime(link, (past, past), follow_symlinks=False)
    assert remove_stale_run_dirs(tmp_path) == []
    assert sorted(p.name for p in target.iterdir()) == ["data"]  # nothing made or removed through the link


def test_slots_are_claimed_in_order_a_released_one_is_taken_again_and_too_many_are_refused(tmp_path: Path):
    slots = [WorkerSlot.claim(tmp_path) for _ in range(MAX_SLOTS)]
    assert [s.index for s in slots] == list(range(MAX_SLOTS))
    assert live_slots(tmp_path) == list(range(MAX_SLOTS))
    with pytest.raises(RuntimeError, match=f"more than {MAX_SLOTS} server processes"):
        WorkerSlot.claim(tmp_path)
    slots[5].release()  # a worker that died: its replacement takes its slot
    assert 5 not in live_slots(tmp_path)
    again = WorkerSlot.claim(tmp_path)
    assert again.index == 5 and 5 in live_slots(tmp_path)
    for s in (*slots, again):
        s.release()
    assert live_slots(tmp_path) == []
