"""Writing and reading the datastore's files: checksums, atomic writes, ``.npy`` without pickle, the manifest."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import numpy as np
from pydantic import ValidationError

from bertknn.core.errors import DatastoreError
from bertknn.core.format.contract import BUILD_STATE, IVFPQ_FILE, MANIFEST, Manifest, ivfpq_meta_path


@contextmanager
def naming_write_errors(path: Path | str) -> Iterator[None]:
    """Give an OSError without a file name (a failed ``write``, ``flush`` or ``fsync``: ENOSPC, EFBIG, EIO) the
    name of the file or directory being written, so that the CLI's one-line error says where."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path)) from exc
        raise


class _PlainWrites:
    """A file numpy does not recognise as one: ``np.save`` on a real file calls ``ndarray.tofile``, whose failure on
    a full disk says only "N requested and M written" (no errno); through ``write`` it goes in 16 MiB chunks
    and ENOSPC / EFBIG arrive as the OSError they are. The bytes written are the same."""

    def __init__(self, f: BinaryIO):
        self.write = f.write


def save_npy(path: Path, array: np.ndarray, *, fsync: bool = False) -> None:
    """``np.save`` (never pickling) with a write error that names ``path`` and keeps its errno."""
    with naming_write_errors(path), open(path, "wb") as f:
        np.save(_PlainWrites(f), array, allow_pickle=False)  # type: ignore[arg-type]
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write then fsync then rename, so a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with naming_write_errors(tmp), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written temp file frees its space now, not on the next run
        raise


def atomic_write_json(path: Path, obj: object) -> None:
    atomic_write_bytes(path, (json.dumps(obj, ensure_ascii=False, indent=1, sort_keys=True) + "\n").encode())


def read_manifest(root: Path) -> Manifest:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise DatastoreError(_no_manifest(Path(root)))
    try:
        return Manifest.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise DatastoreError(f"{path}: not a valid manifest ({_first_problem(exc)}). Rebuild the datastore.") from exc
    except ValueError as exc:
        raise DatastoreError(f"{path}: not a valid manifest ({exc}). Rebuild the datastore.") from exc


def _no_manifest(root: Path) -> str:
    """Why ``root`` has no manifest, and what to do: a directory that is not there, one no build was started in,
    or a build that did not finish."""
    if not root.is_dir():
        return f"{root}: no such directory; pass a datastore's directory (what `bert-knn build --out DIR` wrote)"
    if not (root / BUILD_STATE).is_file():
        return (f"{root / MANIFEST}: no manifest, and no build was started in {root}: no datastore here; build one "
                "with `bert-knn build --corpus FILE --out DIR`")  # fmt: skip
    return f"{root / MANIFEST}: no manifest. The build did not finish; re-run the same build command to resume it."


def _first_problem(exc: ValidationError) -> str:
    """Pydantic's first error in one line and in plain words: where, and what (no URL, no input dump)."""
    errors = exc.errors(include_url=False, include_input=False)
    err = errors[0]
    where = ".".join(str(x) for x in err.get("loc", ())) or "the file"
    if err.get("type") == "json_invalid":
        return f"not JSON: {err.get('ctx', {}).get('error', 'cannot be parsed')}"
    more = f"; {len(errors) - 1} more" if len(errors) > 1 else ""
    return f"{where}: {err.get('msg', 'invalid')}{more}"


def write_manifest(root: Path, manifest: Manifest) -> None:
    atomic_write_json(Path(root) / MANIFEST, manifest.model_dump(mode="json"))


def read_ivfpq_meta(root: Path, index_rel: str = IVFPQ_FILE) -> dict:
    path = Path(root) / ivfpq_meta_path(index_rel)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
