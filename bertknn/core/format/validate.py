"""``validate``: manifest, files, checksums, row counts and id maps; the first problem named first."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bertknn.core.errors import DatastoreError
from bertknn.core.format.contract import (
    ARTICLES,
    CODES,
    ENTITIES,
    ENTITY_LABELS,
    ENTITY_OFFSETS,
    FORMAT_VERSION,
    LABELS,
    LINK_FILES,
    MANIFEST,
    REDIRECTS,
    SENTENCE_IDS,
    SENTENCE_OFFSETS,
    SENTENCES,
    SHARD_MARKER,
    SHARDS_DIR,
    SPANS,
    UPGRADABLE_FORMAT_VERSIONS,
    VECTORS,
    WORDS,
    Counts,
    Manifest,
    ShardInfo,
    read_shard_info,
    shard_file_names,
    shard_name,
)
from bertknn.core.format.files import read_manifest
from bertknn.core.format.reader import Shard
from bertknn.core.format.table import ArticleTable
from bertknn.core.hashing import sha256_file
from bertknn.core.words import check_word_table


def check_shard_files(shard_dir: Path, info: ShardInfo, *, hashes: bool) -> str | None:
    """Return the first problem with a shard's files, or None. ``hashes=False`` checks sizes only."""
    for name in shard_file_names(info):
        path = shard_dir / name
        expected = info.files.get(name)
        if expected is None:
            return f"{path}: not listed in {SHARD_MARKER}"
        if not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != expected.bytes:
            return f"{path}: {size} bytes, expected {expected.bytes} (truncated or rewritten)"
        if hashes and sha256_file(path) != expected.sha256:
            return f"{path}: sha256 mismatch (corrupted)"
    return None


def validate_datastore(
    root: Path | str, *, hashes: bool = True, manifest: Manifest | None = None, deep: bool = True
) -> list[str]:
    """Check manifest, files, checksums, row counts and id-map lengths. Returns problems (first one first).

    ``manifest``: check this manifest (one about to be written, e.g. by ``add``) instead of the one on disk.
    ``deep=False`` (the service's start-up and reload): the manifest, the shards' parts and ``SHARD.json`` markers,
    every listed file present with its size, and the article table's identity and counts; O(shards) small reads,
    nothing per article or per row (``validate`` runs the deep checks).
    """
    root = Path(root)
    if manifest is None:
        try:
            manifest = read_manifest(root)
        except DatastoreError as exc:
            return [str(exc)]
    problems: list[str] = []
    if manifest.format_version != FORMAT_VERSION:
        fix = (
            f"convert it: bert-knn upgrade {root}"
            if manifest.format_version in UPGRADABLE_FORMAT_VERSIONS
            else "rebuild it with this version of the builder"
        )
        return [f"{root / MANIFEST}: format version {manifest.format_version}, this code reads {FORMAT_VERSION}; {fix}"]
    problems.extend(validate_parts(root / MANIFEST, manifest.shards))
    problems.extend(_check_codec(root, manifest, hashes=hashes and deep))
    if not deep:
        return problems or _check_files_and_table(root, manifest)
    totals = _check_shards(root, manifest, problems, hashes=hashes)
    if not problems:
        problems.extend(_check_updates(root, manifest))
    if not problems:
        _check_counts(root, manifest, totals, problems)
        if manifest.datastore_id != manifest.compute_id():
            problems.append(f"{root / MANIFEST}: datastore_id does not match the shard checksums")
        if not problems:
            problems.extend(_check_table(root, manifest))
    for name, rel in manifest.indexes.items():
        if not (root / rel).exists():
            problems.append(f"{root / rel}: {name} index listed in the manifest is missing")
    return problems


def _check_shards(root: Path, manifest: Manifest, problems: list[str], *, hashes: bool) -> Counts:
    """Every shard: its marker as the manifest lists it, its files (sizes, checksums with ``hashes``) and arrays;
    the problems found appended; the articles, sentences and rows of the shards that passed."""
    totals = Counts()
    for info in manifest.shards:
        shard_dir = root / SHARDS_DIR / info.name
        on_disk = read_shard_info(shard_dir)
        if on_disk is None:
            problems.append(f"{shard_dir / SHARD_MARKER}: missing or unreadable")
            continue
        if on_disk != info:
            problems.append(f"{shard_dir / SHARD_MARKER}: differs from the manifest's entry for {info.name}")
        problem = check_shard_files(shard_dir, info, hashes=hashes)
        if problem:
            problems.append(problem)
            continue
        problems.extend(_check_shard_arrays(Shard(root, info), manifest))
        totals.articles += info.articles
        totals.sentences += info.sentences
        totals.contexts += info.rows
    return totals


def _check_counts(root: Path, manifest: Manifest, totals: Counts, problems: list[str]) -> None:
    """The manifest's live and superseded counts against the shards' (less the superseded articles')."""
    superseded = _superseded_totals(root, manifest, problems)
    live = (
        totals.articles - superseded.articles,
        totals.sentences - superseded.sentences,
        totals.contexts - superseded.contexts,
    )
    c = manifest.counts
    if not problems and (c.articles, c.sentences, c.contexts) != live:
        problems.append(
            f"{root / MANIFEST}: counts {c.articles}/{c.sentences}/{c.contexts} (articles/sentences/contexts) "
            f"do not match the shards' {live[0]}/{live[1]}/{live[2]}"
        )
    got = (c.superseded_articles, c.superseded_sentences, c.superseded_contexts)
    if not problems and got != (superseded.articles, superseded.sentences, superseded.contexts):
        problems.append(
            f"{root / MANIFEST}: superseded counts {got[0]}/{got[1]}/{got[2]} do not match the shards' "
            f"{superseded.articles}/{superseded.sentences}/{superseded.contexts}"
        )


def _check_codec(root: Path, manifest: Manifest, *, hashes: bool) -> list[str]:
    """The codec file is there, intact (``hashes``), readable and makes the manifest's code size; and every shard
    stores what the manifest says (codes with a codec, vectors without)."""
    info = manifest.codec
    for shard in manifest.shards:
        if (CODES in shard.files) != (info is not None):
            what = f"codes of codec {info.name}" if info is not None else "float16 vectors (no codec)"
            return [f"{root / SHARDS_DIR / shard.name}: does not hold {what} as the manifest says; rebuild it"]
    if info is None:
        return []
    from bertknn.core.format.codec import READABLE_CODECS, read_codec

    path = root / info.file
    if info.name not in READABLE_CODECS:
        return [f"{root / MANIFEST}: codec {info.name!r}, this version reads {', '.join(READABLE_CODECS)}; upgrade bert-knn"]
    if not path.is_file():
        return [f"{path}: missing (the codec the manifest names)"]
    if hashes and sha256_file(path) != info.sha256:
        return [f"{path}: sha256 mismatch (corrupted or replaced)"]
    try:
        codec = read_codec(path, info.code_bytes)
    except DatastoreError as exc:
        return [str(exc)]
    if codec.d != manifest.model.hidden_size:
        return [f"{path}: codes vectors of {codec.d} dimensions, the model has {manifest.model.hidden_size}"]
    return []


def _check_files_and_table(root: Path, manifest: Manifest) -> list[str]:
    for info in manifest.shards:
        shard_dir = root / SHARDS_DIR / info.name
        on_disk = read_shard_info(shard_dir)  # one small file per shard: a manifest of another build shows here
        if on_disk is None:
            return [f"{shard_dir / SHARD_MARKER}: missing or unreadable"]
        if on_disk != info:
            return [f"{shard_dir / SHARD_MARKER}: differs from the manifest's entry for {info.name}"]
        for name in shard_file_names(info):
            path = shard_dir / name
            try:
                size = path.stat().st_size
            except OSError:
                return [f"{path}: missing; run `validate`, then rebuild (the same build command resumes)"]
            if size != info.files[name].bytes:
                return [f"{path}: {size} bytes, expected {info.files[name].bytes} (truncated or rewritten)"]
    if manifest.datastore_id != manifest.compute_id():
        return [f"{root / MANIFEST}: datastore_id does not match the shard checksums"]
    for name, rel in manifest.indexes.items():
        if not (root / rel).exists():
            return [f"{root / rel}: {name} index listed in the manifest is missing"]
    return _check_table(root, manifest, entries=False)


def _check_table(root: Path, manifest: Manifest, *, entries: bool = True) -> list[str]:
    """The article table exists, belongs to these shards, and holds exactly the shards' articles, the live ones
    live (the last occurrence of each title), the counts of the manifest and the redirects of redirects.json."""
    if manifest.article_table is None:
        return [f"{root / MANIFEST}: names no article table (article_table); rebuild or upgrade the datastore"]
    path = root / manifest.article_table
    try:
        table = ArticleTable(path)
    except DatastoreError as exc:
        return [str(exc)]
    try:
        return _check_table_content(root, manifest, table, entries=entries)
    except DatastoreError as exc:  # a table that opens but cannot be read through (its meta, its rows)
        return [str(exc)]
    finally:
        table.close()


def _check_table_content(root: Path, manifest: Manifest, table: ArticleTable, *, entries: bool) -> list[str]:
    """The table's content id and totals (as recorded, or with ``entries`` counted, and then every entry)."""
    path = table.path
    if table.content_id != manifest.articles_id():
        return [f"{path}: made for other shards (content id {table.content_id}); rebuild it with `upgrade`"]
    c = manifest.counts
    for live, want in ((True, (c.articles, c.sentences, c.contexts)),
                       (False, (c.superseded_articles, c.superseded_sentences, c.superseded_contexts))):  # fmt: skip
        got = table.totals(live=live) if entries else table.recorded_totals(live=live)
        if got != want:
            what = "live" if live else "superseded"
            return [f"{path}: {what} articles/sentences/rows {got[0]}/{got[1]}/{got[2]}, the manifest says "
                    f"{want[0]}/{want[1]}/{want[2]}"]  # fmt: skip
    return _check_table_entries(root, manifest, table) if entries else []


def _check_table_entries(root: Path, manifest: Manifest, table: ArticleTable) -> list[str]:
    """Each shard's articles as its articles.json has them, the last copy of each title live, the redirects."""
    path = table.path
    last_seen: dict[str, int] = {}
    for pos, info in enumerate(manifest.shards):
        arts = sorted(Shard(root, info).articles(), key=lambda a: (a["row_start"], a["row_end"]))
        stored = table.shard_entries(pos)
        if len(stored) != len(arts):
            return [f"{path}: {len(stored)} articles of {info.name}, its {ARTICLES} has {len(arts)}"]
        for a, e in zip(arts, stored, strict=True):
            if (a["title"], a["row_start"], a["row_end"], a["sent_start"], a["sent_end"]) != (
                e.title, e.row_start, e.row_end, e.sent_start, e.sent_end
            ):
                return [f"{path}: the entry of {a['title']!r} in {info.name} differs from {ARTICLES}"]
            last_seen[a["title"]] = pos
    for title, pos in last_seen.items():
        entry = table.get(title)
        if entry is None or entry.shard != pos:
            return [f"{path}: {title!r} should be live in {manifest.shards[pos].name}"]
    redirects_path = root / REDIRECTS
    if redirects_path.is_file():
        want_redirects = json.loads(redirects_path.read_text(encoding="utf-8"))
        if len(table.redirects) != len(want_redirects) or any(
            table.redirects.get(k) != v for k, v in want_redirects.items()
        ):
            return [f"{path}: the redirects differ from {REDIRECTS}"]
    return []


def _check_updates(root: Path, manifest: Manifest) -> list[str]:
    """The update records name shards of this manifest and count up to its version."""
    names = {s.name for s in manifest.shards}
    last = 1
    for u in manifest.updates:
        if u.version <= last:
            return [f"{root / MANIFEST}: update versions must increase from 2 (found {u.version} after {last})"]
        missing = [n for n in u.shards if n not in names]
        if missing:
            return [f"{root / MANIFEST}: update {u.version} names shards that are not in the manifest: {missing[:3]}"]
        last = u.version
    if manifest.updates and manifest.version != last:
        return [f"{root / MANIFEST}: version {manifest.version}, but the last update made version {last}"]
    return []


def _superseded_totals(root: Path, manifest: Manifest, problems: list[str]) -> Counts:
    """Articles, sentences and rows that a later shard replaced (by title). Only shards an ``add`` appended may
    repeat a title; a title twice in one shard, or in two built shards, is a problem."""
    added = {name for u in manifest.updates for name in u.shards}
    latest: dict[str, tuple[str, dict]] = {}
    out = Counts()
    for info in manifest.shards:
        path = root / SHARDS_DIR / info.name / ARTICLES
        here: set[str] = set()
        for a in Shard(root, info).articles():
            title = a["title"]
            if title in here:
                problems.append(f"{path}: title {title!r} occurs twice")
                return out
            here.add(title)
            previous = latest.get(title)
            if previous is not None:
                if info.name not in added:
                    problems.append(
                        f"{path}: title {title!r} is also in {previous[0]}, and no `add` made {info.name}; rebuild"
                    )
                    return out
                old = previous[1]
                out.articles += 1
                out.sentences += old["sent_end"] - old["sent_start"]
                out.contexts += old["row_end"] - old["row_start"]
            latest[title] = (info.name, a)
    return out


def validate_parts(where_from: Path, shards: list[ShardInfo]) -> list[str]:
    """Names match (block, part); each block's parts are 0..k in order, and part k is its last."""
    previous: ShardInfo | None = None
    for info in shards:
        where = f"{where_from}: {info.name}"
        if info.name != shard_name(info.index, info.part):
            return [f"{where}: the name does not match block {info.index} part {info.part}"]
        if previous is not None and info.key <= previous.key:
            return [f"{where}: out of order after {previous.name}"]
        if info.part > 0 and (previous is None or previous.index != info.index or previous.part != info.part - 1):
            return [f"{where}: part {info.part} without part {info.part - 1} of its block before it"]
        if previous is not None and previous.index != info.index and not previous.last:
            return [f"{where_from}: {previous.name} is not the last part of its block, but the next is missing"]
        previous = info
    if previous is not None and not previous.last:
        return [f"{where_from}: {previous.name} is not the last part of its block, but the next is missing"]
    return []


def _check_links(shard: Shard, manifest: Manifest) -> str | None:
    """A datastore with links: every shard has the link files, row-aligned and in range; a row without a word
    label (-1) is an anchor, so it has a link. Without links: no link files."""
    d = shard.dir
    present = [n for n in LINK_FILES if n in shard.info.files]
    if manifest.links is None:
        return f"{d}: has {present[0]} but the manifest records no links; rebuild the datastore" if present else None
    if len(present) != len(LINK_FILES):
        missing = next(n for n in LINK_FILES if n not in shard.info.files)
        return f"{d}: lacks {missing}, and the manifest records links; rebuild this shard"
    try:
        ent, offs, lab = shard.entity_labels, shard._entity_offsets, shard.labels
    except DatastoreError as exc:
        return str(exc)
    if ent.shape != (shard.info.rows,) or ent.dtype != np.int32:
        return f"{d / ENTITY_LABELS}: shape {ent.shape} {ent.dtype}, expected ({shard.info.rows},) int32"
    if offs.ndim != 1 or offs.dtype != np.int64 or len(offs) < 1 or offs[0] != 0:
        return f"{d / ENTITY_OFFSETS}: expected int64 offsets starting at 0"
    if int(offs[-1]) != (d / ENTITIES).stat().st_size:
        return f"{d / ENTITY_OFFSETS}: last offset {int(offs[-1])} != size of {ENTITIES}"
    if len(ent) and (ent.min() < -1 or ent.max() >= len(offs) - 1):
        return f"{d / ENTITY_LABELS}: entity index outside [-1, {len(offs) - 1})"
    if len(ent) and bool(((lab < 0) & (ent < 0)).any()):
        return f"{d / LABELS}: a row has neither a word label nor a link; rebuild this shard"
    return None


def _check_shard_arrays(shard: Shard, manifest: Manifest) -> list[str]:
    """The first problem of a shard's arrays, in the order each check relies on the ones before it."""
    for check in (_check_shapes, _check_links, _check_labels, _check_references):
        try:
            problem = check(shard, manifest)
        except DatastoreError as exc:  # an array that cannot be read
            return [str(exc)]
        if problem:
            return [problem]
    return []


def _check_shapes(shard: Shard, manifest: Manifest) -> str | None:
    d, rows, codec = shard.dir, shard.info.rows, manifest.codec
    vec, lab, sid, spans, offs = shard.payload, shard.labels, shard.sentence_ids, shard.spans, shard.sentence_offsets
    expect = {
        (CODES if codec else VECTORS): (
            vec.shape, (rows, codec.code_bytes if codec else manifest.model.hidden_size), vec.dtype,
            np.uint8 if codec else np.float16,
        ),
        LABELS: (lab.shape, (rows,), lab.dtype, np.int32),
        SENTENCE_IDS: (sid.shape, (rows,), sid.dtype, np.int32),
        SPANS: (spans.shape, (rows, 2), spans.dtype, np.int32),
        SENTENCE_OFFSETS: (offs.shape, (shard.info.sentences + 1,), offs.dtype, np.int64),
    }  # fmt: skip
    for name, (shape, want_shape, dtype, want_dtype) in expect.items():
        if shape != want_shape or dtype != want_dtype:
            return f"{d / name}: shape {shape} {dtype}, expected {want_shape} {np.dtype(want_dtype)}"
    return None


def _check_labels(shard: Shard, manifest: Manifest) -> str | None:
    """Word labels inside the vocabulary, or inside the shard's word table for whole-word datastores."""
    d, lab = shard.dir, shard.labels
    word_rows = lab
    if manifest.links is not None and shard.info.rows:
        word_rows = lab[lab >= 0]  # (-1: an entity link's anchor only, checked by _check_links)
    whole = manifest.targets == "whole-word"
    if whole != (WORDS in shard.info.files):
        what = "has no" if whole else "has a"
        return f"{d}: {what} {WORDS} but the manifest says targets={manifest.targets}; rebuild the datastore"
    if whole:
        words = shard.words
        problem = check_word_table(words, manifest.model.vocab_size)
        if problem:
            return f"{d / WORDS}: {problem}"
        if len(word_rows) and (word_rows.min() < 0 or word_rows.max() >= len(words)):
            return f"{d / LABELS}: label outside the word table [0, {len(words)})"
    elif len(word_rows) and (word_rows.min() < 0 or word_rows.max() >= manifest.model.vocab_size):
        return f"{d / LABELS}: label outside the vocabulary [0, {manifest.model.vocab_size})"
    return None


def _check_references(shard: Shard, manifest: Manifest) -> str | None:
    """Sentence ids, the sentences' offsets and the articles' row ranges agree with the shard."""
    d, rows, sid, offs = shard.dir, shard.info.rows, shard.sentence_ids, shard.sentence_offsets
    if rows and (sid.min() < 0 or sid.max() >= shard.info.sentences):
        return f"{d / SENTENCE_IDS}: sentence id outside [0, {shard.info.sentences})"
    if offs[-1] != (d / SENTENCES).stat().st_size:
        return f"{d / SENTENCE_OFFSETS}: last offset {offs[-1]} != size of {SENTENCES}"
    arts = sorted(shard.articles(), key=lambda a: a["row_start"])
    cursor = 0
    for a in arts:
        if a["row_start"] != cursor or a["row_end"] < a["row_start"]:
            return f"{d / ARTICLES}: article {a['title']!r} rows [{a['row_start']}, {a['row_end']}) are not contiguous"
        cursor = a["row_end"]
    if cursor != rows:
        return f"{d / ARTICLES}: article rows cover {cursor} of {rows} rows"
    if len(arts) != shard.info.articles:
        return f"{d / ARTICLES}: {len(arts)} articles, {SHARD_MARKER} says {shard.info.articles}"
    return None
