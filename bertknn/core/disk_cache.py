"""What the caches kept on disk share (`bertknn.core.onnx_cache`, `bertknn.core.vocab_cache`): the directory a
setting names, made and checked; the bytes of the code a key reads; pruning the least recently used files."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


def default_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/bert-knn/<name>``, or ``~/.cache/bert-knn/<name>`` (where Hugging Face keeps its own)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bert-knn" / name


def usable_dir(setting: str, name: str, *, label: str, without: str) -> Path | None:
    """The directory a cache setting names: ``auto`` `default_dir`, ``off`` none, anything else that directory.
    None, logged as ``label``'s with ``without`` (what happens instead), where it cannot be made or written (a read-only
    container)."""
    if setting == "off":
        return None
    directory = default_dir(name) if setting == "auto" else Path(setting).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"{directory} is not writable")
    except OSError as exc:
        logger.warning("%s not used (%s): %s", label, exc, without)
        return None
    return directory


def module_bytes(name: str) -> bytes:
    """The file a loaded module came from (its source, or its bytecode where only that is installed)."""
    file = getattr(sys.modules[name], "__file__", None)
    try:
        return Path(file).read_bytes() if file else name.encode()
    except OSError:
        return name.encode()


def prune(directory: Path, suffix: str, keep: int) -> list[Path]:
    """Delete the files ending in ``suffix`` beyond the ``keep`` most recently modified; the deleted ones."""
    found = []
    for path in directory.glob(f"*{suffix}"):
        with contextlib.suppress(OSError):  # deleted meanwhile by another process
            found.append((path.stat().st_mtime, path))
    gone = [path for _, path in sorted(found, reverse=True)[keep:]]
    for path in gone:
        path.unlink(missing_ok=True)
    return gone


@contextlib.contextmanager
def locked(directory: Path, key: str) -> Iterator[None]:
    """Held by one process at a time per key (``.<key>.lock``, an empty file that stays: deleting it would
    break the locking); released when the file closes, also when the process dies."""
    with open(directory / f".{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
