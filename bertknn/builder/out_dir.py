"""An output directory checked before any work: new, empty, or this tool's own files, never someone else's."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from bertknn.core.errors import BuildError

# what may be in any output directory: a mounted volume's own (hidden files are never counted)
VOLUME_ENTRIES = frozenset({"lost+found"})


def foreign_entries(out: Path, own: Collection[str] = ()) -> list[str]:
    """The names in ``out`` that neither this tool writes (``own``) nor a volume holds, sorted; [] for a new or
    empty directory. BuildError when ``out`` is a file."""
    if out.exists() and not out.is_dir():
        raise BuildError(f"--out {out}: a file, not a directory; pass a new or empty directory")
    if not out.is_dir():
        return []
    allowed = VOLUME_ENTRIES | frozenset(own)
    return sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and p.name not in allowed)


def shown(names: list[str]) -> str:
    """The first three names, and how many more."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3:,} more" if len(names) > 3 else "")
