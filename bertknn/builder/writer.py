"""Shard writer: arrays into a temporary directory, checksums, then one atomic rename."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bertknn.core.format import (
    ARTICLE_TABLE,
    ARTICLES,
    CODES,
    ENTITIES,
    ENTITY_LABELS,
    ENTITY_OFFSETS,
    INDEX_DIR,
    LABELS,
    SENTENCE_IDS,
    SENTENCE_OFFSETS,
    SENTENCES,
    SHARD_FILES,
    SHARD_MARKER,
    SHARDS_DIR,
    SPANS,
    VECTORS,
    WORDS,
    FileInfo,
    LinkInfo,
    Manifest,
    Shard,
    ShardInfo,
    check_shard_files,
    naming_write_errors,
    read_shard_info,
    save_npy,
    sha256_file,
    shard_name,
)
from bertknn.core.format.health import summed
from bertknn.core.format.table import write_article_table
from bertknn.core.words import WordTable

DROPPED = "dropped"  # an article's sentences left out, by reason: counted into its part's ShardInfo, not stored


@dataclass
class ShardData:
    vectors: np.ndarray  # float16 [rows, hidden], or uint8 [rows, code bytes]: codes of the datastore's codec
    labels: np.ndarray  # int32 [rows]
    sentence_ids: np.ndarray  # int32 [rows]
    spans: np.ndarray  # int32 [rows, 2]
    sentences: list[str]
    articles: list[dict]  # title, id, source, row_start, row_end, sent_start, sent_end
    words: WordTable | None = None  # whole-word datastores: what the labels index
    entity_labels: np.ndarray | None = None  # datastores with links: int32 [rows], index into entities, or -1
    entities: list[str] | None = None


def _fsync_save(path: Path, array: np.ndarray) -> None:
    save_npy(path, np.ascontiguousarray(array), fsync=True)


def _fsync_write(path: Path, data: bytes) -> None:
    with naming_write_errors(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def finished_shard(root: Path, index: int, part: int = 0) -> ShardInfo | None:
    """The shard's info when a complete, intact copy is on disk (resume skips it), else None."""
    shard_dir = Path(root) / SHARDS_DIR / shard_name(index, part)
    info = read_shard_info(shard_dir)
    if info is None or info.key != (index, part) or check_shard_files(shard_dir, info, hashes=True) is not None:
        return None
    return info


def finished_parts(root: Path, index: int) -> list[ShardInfo]:
    """The intact parts 0, 1, ... of block ``index`` on disk, up to the first missing one (resume keeps them;
    the block is complete when the last of them is its ``last`` part)."""
    parts: list[ShardInfo] = []
    while (info := finished_shard(root, index, len(parts))) is not None:
        parts.append(info)
        if info.last:
            break
    return parts


def write_shard(root: Path, index: int, data: ShardData, *, part: int = 0, last: bool = True) -> ShardInfo:
    """Write every file of part ``part`` of block ``index`` to a temp dir, then rename it into place (all or
    nothing)."""
    shards = Path(root) / SHARDS_DIR
    shards.mkdir(parents=True, exist_ok=True)
    name = shard_name(index, part)
    final = shards / name
    tmp = shards / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        return _write_shard_files(tmp, final, index, part, last, data)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never trusted anyway; a full disk gets its space back now
        raise


def _write_shard_files(tmp: Path, final: Path, index: int, part: int, last: bool, data: ShardData) -> ShardInfo:
    encoded = [s.encode("utf-8") for s in data.sentences]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    coded = data.vectors.dtype == np.uint8
    if coded:
        _fsync_save(tmp / CODES, data.vectors)
    else:
        _fsync_save(tmp / VECTORS, data.vectors.astype(np.float16, copy=False))
    _fsync_save(tmp / LABELS, data.labels.astype(np.int32, copy=False))
    _fsync_save(tmp / SENTENCE_IDS, data.sentence_ids.astype(np.int32, copy=False))
    _fsync_save(tmp / SPANS, data.spans.astype(np.int32, copy=False).reshape(-1, 2))
    _fsync_save(tmp / SENTENCE_OFFSETS, offsets)
    _fsync_write(tmp / SENTENCES, b"".join(encoded))
    articles = [{k: v for k, v in a.items() if k != DROPPED} for a in data.articles]
    _fsync_write(tmp / ARTICLES, json.dumps(articles, ensure_ascii=False, sort_keys=True).encode("utf-8"))
    names = tuple(CODES if coded and n == VECTORS else n for n in SHARD_FILES)
    if data.words is not None:
        _fsync_write(tmp / WORDS, data.words.to_json())
        names = (*names, WORDS)
    if data.entity_labels is not None:
        titles = [t.encode("utf-8") for t in data.entities or []]
        title_offsets = np.zeros(len(titles) + 1, dtype=np.int64)
        np.cumsum([len(t) + 1 for t in titles], out=title_offsets[1:])
        _fsync_save(tmp / ENTITY_LABELS, data.entity_labels.astype(np.int32, copy=False))
        _fsync_write(tmp / ENTITIES, b"".join(t + b"\n" for t in titles))
        _fsync_save(tmp / ENTITY_OFFSETS, title_offsets)
        names = (*names, ENTITY_LABELS, ENTITIES, ENTITY_OFFSETS)
    info = ShardInfo(
        name=shard_name(index, part),
        index=index,
        part=part,
        last=last,
        rows=int(len(data.labels)),
        articles=len(data.articles),
        sentences=len(data.sentences),
        dropped=summed(a.get(DROPPED, {}) for a in data.articles),
        files={
            name: FileInfo(bytes=(tmp / name).stat().st_size, sha256=sha256_file(tmp / name)) for name in names
        },
    )
    _fsync_write(tmp / SHARD_MARKER, info.model_dump_json(indent=1).encode())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return info


_NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES)


def link_or_copy(src: Path, dst: Path) -> bool:
    """``dst`` as a hard link to ``src`` (True), or a synced copy where the file system cannot link (False).

    Datastore files are never modified in place (a rebuild writes new files and renames them), so a hard link is as
    safe as a copy and costs no space. Other errors (a full disk, a missing file) are raised."""
    try:
        os.link(src, dst)
        return True
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())
    return False


def write_shard_files(final: Path, src: Path, info: ShardInfo, codes: np.ndarray) -> ShardInfo:
    """A copy of the shard in ``src`` at ``final`` with its vectors replaced by ``codes`` (``recode``): the other
    files hard-linked (copied across file systems), a new SHARD.json, one atomic rename."""
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _fsync_save(tmp / CODES, np.ascontiguousarray(codes, dtype=np.uint8))
        files = {CODES: FileInfo(bytes=(tmp / CODES).stat().st_size, sha256=sha256_file(tmp / CODES))}
        for name, entry in info.files.items():
            if name == VECTORS:
                continue
            link_or_copy(src / name, tmp / name)
            files[name] = entry
        new = info.model_copy(update={"files": dict(sorted(files.items()))})
        _fsync_write(tmp / SHARD_MARKER, new.model_dump_json(indent=1).encode())
        os.replace(tmp, final)
        return new
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_temp(root: Path) -> None:
    """Temp dirs left by a killed build are never trusted: delete them before resuming."""
    shards = Path(root) / SHARDS_DIR
    if shards.is_dir():
        for p in shards.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)
    for p in Path(root).glob(".*.tmp-*"):
        p.unlink(missing_ok=True)
    # A build killed while writing an index leaves `.ivfpq.faiss.tmp-PID` (possibly gigabytes), `.ivfpq.json.tmp-PID`,
    # or a directory a sparse-index swap renamed away; nothing else ever deletes them.
    index_dir = Path(root) / INDEX_DIR
    if index_dir.is_dir():
        for p in index_dir.iterdir():
            if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)


def write_table(
    root: Path,
    manifest: Manifest,
    redirects: Iterable[tuple[str, str]],
    rel_path: str = ARTICLE_TABLE,
    *,
    base: str | None = None,
    first_shard: int = 0,
) -> None:
    """Write the article table of ``manifest``'s shards from ``first_shard`` on (``base``: the table of the
    version those shards extend) to ``root/rel_path``, and name it in the manifest."""
    shards = ((pos, Shard(root, info).articles()) for pos, info in enumerate(manifest.shards) if pos >= first_shard)
    counts = write_article_table(
        Path(root) / rel_path, shards, redirects, content_id=manifest.articles_id(),
        base=None if base is None else Path(root) / base,
        mentions=None if manifest.links is None else lambda pos, ranges: _mentions(root, manifest, pos, ranges),
    )  # fmt: skip
    manifest.article_table = rel_path
    if manifest.links is not None:
        manifest.links = LinkInfo(
            mentions=counts["mentions"], anchor_rows=counts["anchor_rows"], entities=counts["entities"]
        )


def _mentions(root: Path, manifest: Manifest, pos: int, ranges: list[tuple[int, int]]) -> tuple[dict[str, int], int]:
    """The link targets named by the rows ``ranges`` of shard ``pos`` (mentions per normalised title), and how
    many of those rows are anchors of their own (label -1)."""
    shard = Shard(root, manifest.shards[pos])
    entity_labels, labels = shard.entity_labels, shard.labels
    counts = np.zeros(shard.entity_count, dtype=np.int64)
    anchors = 0
    for a, b in ranges:
        ent = np.asarray(entity_labels[a:b])
        linked = ent >= 0
        counts += np.bincount(ent[linked], minlength=len(counts))
        anchors += int((np.asarray(labels[a:b])[linked] < 0).sum())
    return {shard.entity_title(int(i)): int(counts[i]) for i in np.flatnonzero(counts)}, anchors
