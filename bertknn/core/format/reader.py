"""The datastore's read side: shards memory-mapped on first use, articles, contexts (opened, not loaded)."""

from __future__ import annotations

import bisect
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import cast, overload

import numpy as np

from bertknn.core.errors import DatastoreError
from bertknn.core.format.codec import READABLE_CODECS, CodeSearcher, read_codec
from bertknn.core.format.contract import (
    ARTICLES,
    CODES,
    ENTITIES,
    ENTITY_LABELS,
    ENTITY_OFFSETS,
    FORMAT_VERSION,
    LABELS,
    MANIFEST,
    SENTENCE_IDS,
    SENTENCE_OFFSETS,
    SENTENCES,
    SHARDS_DIR,
    SPANS,
    UPGRADABLE_FORMAT_VERSIONS,
    VECTORS,
    WORDS,
    Manifest,
    ShardInfo,
)
from bertknn.core.format.files import read_manifest
from bertknn.core.format.links import EntityLinks
from bertknn.core.format.table import ArticleTable, RedirectTable
from bertknn.core.words import WordEntry, WordTable, read_word_table


@dataclass(frozen=True)
class ContextRef:
    article: str
    sentence: str
    span: tuple[int, int]


@dataclass(frozen=True)
class RowSlice:
    """One article's rows as `Datastore.row_slices` finds them: its shard's payload rows (a view, not read yet),
    the ones taken (``keep``; None: all), and their labels and global row ids."""

    payload: np.ndarray  # [article rows, dim] float16 or [article rows, code bytes] uint8: a memory-mapped view
    keep: np.ndarray | None  # int64 indexes into ``payload``, ascending; None: every row
    labels: np.ndarray
    ids: np.ndarray  # int64 global row ids of the rows taken

    def __len__(self) -> int:
        return len(self.ids)

    def taken(self) -> np.ndarray:
        """The payload of the rows taken: the view itself when every row is, else a copy of those rows."""
        return self.payload if self.keep is None else self.payload[self.keep]

    def read_into(self, out: np.ndarray) -> None:
        """Copy the payload of the rows taken into ``out`` ([len(self), ...]): the shard's rows read once."""
        if self.keep is None:
            out[...] = self.payload
        else:
            np.take(self.payload, self.keep, axis=0, out=out)


class Shard:
    """One shard's arrays, memory-mapped on first use.

    They are handed out as plain ``ndarray`` views of the mapping: slicing an ``np.memmap`` runs Python code
    (``__getitem__``, ``__array_finalize__``) on every access, which showed up in the query path's profile.
    """

    def __init__(self, root: Path, info: ShardInfo):
        self.dir = Path(root) / SHARDS_DIR / info.name
        self.info = info

    def _load(self, name: str) -> np.ndarray:
        path = self.dir / name
        try:
            return np.asarray(np.load(path, mmap_mode="r", allow_pickle=False))
        except (OSError, ValueError) as exc:
            raise DatastoreError(f"{path}: cannot be read ({exc}); run `validate` and rebuild this shard") from exc

    @cached_property
    def vectors(self) -> np.ndarray:
        return self._load(VECTORS)

    @cached_property
    def codes(self) -> np.ndarray:
        """uint8 [rows, code bytes]: the rows' codes (datastores with a codec)."""
        return self._load(CODES)

    @property
    def payload(self) -> np.ndarray:
        """What the shard stores per row: its codes when it has them, else its float16 vectors."""
        return self.codes if CODES in self.info.files else self.vectors

    @cached_property
    def labels(self) -> np.ndarray:
        return self._load(LABELS)

    @cached_property
    def sentence_ids(self) -> np.ndarray:
        return self._load(SENTENCE_IDS)

    @cached_property
    def spans(self) -> np.ndarray:
        return self._load(SPANS)

    @cached_property
    def sentence_offsets(self) -> np.ndarray:
        return self._load(SENTENCE_OFFSETS)

    @cached_property
    def _sentences(self) -> np.ndarray:
        return np.asarray(np.memmap(self.dir / SENTENCES, dtype=np.uint8, mode="r"))

    def sentence(self, sentence_id: int) -> str:
        a, b = int(self.sentence_offsets[sentence_id]), int(self.sentence_offsets[sentence_id + 1])
        return bytes(self._sentences[a:b]).decode("utf-8")

    def articles(self) -> list[dict]:
        return json.loads((self.dir / ARTICLES).read_text(encoding="utf-8"))

    @cached_property
    def entity_labels(self) -> np.ndarray:
        """int32 [rows]: each row's link target (an index for `entity_title`), or -1 (datastores with links)."""
        return self._load(ENTITY_LABELS)

    @cached_property
    def _entity_offsets(self) -> np.ndarray:
        return self._load(ENTITY_OFFSETS)

    @cached_property
    def _entities(self) -> np.ndarray:
        return np.asarray(np.memmap(self.dir / ENTITIES, dtype=np.uint8, mode="r"))

    @property
    def entity_count(self) -> int:
        return len(self._entity_offsets) - 1

    def entity_title(self, index: int) -> str:
        """The normalised link target (before redirects) that ``entity_labels`` value ``index`` names."""
        a, b = int(self._entity_offsets[index]), int(self._entity_offsets[index + 1])
        return bytes(self._entities[a : b - 1]).decode("utf-8")  # (each title ends with a newline)

    def release(self) -> None:
        """Drop this shard's mappings (they are unmapped once no array still refers to them); the next use maps
        the files again."""
        for name in ("vectors", "codes", "labels", "sentence_ids", "spans", "sentence_offsets", "_sentences", "words",
                     "entity_labels", "_entity_offsets", "_entities"):  # fmt: skip
            self.__dict__.pop(name, None)

    @cached_property
    def words(self) -> WordTable:
        """The shard's word table (whole-word datastores)."""
        path = self.dir / WORDS
        try:
            return read_word_table(path)
        except (OSError, ValueError) as exc:
            raise DatastoreError(f"{path}: cannot be read ({exc}); run `validate` and rebuild this shard") from exc


class OpenShards(Sequence[Shard]):
    """The datastore's shards; at most ``limit`` of them keep their files mapped (least recently used released).

    A process may hold about 65,000 memory mappings (``vm.max_map_count``); a shard maps up to seven files, and all
    of Wikipedia makes thousands of shards: without a bound, a long-running service that touched every shard would
    run out of mappings."""

    def __init__(self, shards: list[Shard], limit: int = 1024):
        self._shards = shards
        self._limit = limit
        self._used: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._shards)

    @overload
    def __getitem__(self, pos: int) -> Shard: ...
    @overload
    def __getitem__(self, pos: slice) -> Sequence[Shard]: ...
    def __getitem__(self, pos: int | slice) -> Shard | Sequence[Shard]:
        if isinstance(pos, slice):
            return self._shards[pos]
        shard = self._shards[pos]
        pos = pos % len(self._shards)
        with self._lock:
            self._used[pos] = None
            self._used.move_to_end(pos)
            while len(self._used) > self._limit:
                old, _ = self._used.popitem(last=False)
                self._shards[old].release()
        return shard

    @property
    def mapped(self) -> int:
        return len(self._used)


class Datastore:
    """Read side of the contract, shared by the service, the evaluation and the builder's `validate`."""

    def __init__(self, root: Path | str, manifest: Manifest | None = None):
        """Open a datastore: the manifest, then the article table (read-only, memory-mapped; nothing per article is
        loaded). Shards map their arrays on first use."""
        self.root = Path(root)
        self.manifest = manifest or read_manifest(self.root)
        version = self.manifest.format_version
        if version != FORMAT_VERSION:
            fix = (
                f"convert it: bert-knn upgrade {self.root}"
                if version in UPGRADABLE_FORMAT_VERSIONS
                else "rebuild the datastore with this version of the builder"
            )
            raise DatastoreError(
                f"{self.root / MANIFEST}: format version {version}, this code reads {FORMAT_VERSION}; {fix}"
            )
        if self.manifest.article_table is None:
            raise DatastoreError(f"{self.root / MANIFEST}: names no article table; run `validate`")
        self.shards = OpenShards([Shard(self.root, s) for s in self.manifest.shards])
        offsets = np.zeros(len(self.shards) + 1, dtype=np.int64)
        np.cumsum([s.info.rows for s in self.shards], out=offsets[1:])
        self.shard_offsets = offsets  # global row id = shard_offsets[shard] + row
        self._offsets = offsets.tolist()  # the same as Python ints: `locate` bisects it (per neighbour, per query)
        # `add` appends shards; an article in a later shard replaces the same title in earlier ones. The old rows
        # stay in their immutable shard but become unreachable: not in `articles` (restricted kNN, subject
        # lookup), not in `iter_article_texts` (sparse indexes), and in `superseded_rows` (whole-datastore kNN).
        self.codec = None
        self.code_searcher: CodeSearcher | None = None
        if self.manifest.codec is not None:
            info = self.manifest.codec
            if info.name not in READABLE_CODECS:
                raise DatastoreError(
                    f"{self.root / MANIFEST}: codec {info.name!r}, this version reads {', '.join(READABLE_CODECS)} "
                    "(and fp16 vectors); upgrade bert-knn, or rebuild the datastore with this version"
                )
            self.codec = read_codec(self.root / info.file, info.code_bytes)
            self.code_searcher = CodeSearcher(self.codec)
        self.table = ArticleTable(self.root / self.manifest.article_table)
        self.articles: ArticleTable = self.table
        self.redirects: RedirectTable = self.table.redirects
        links = self.manifest.links
        self.links = EntityLinks(None if links is None else links.entities, self.shards, self.table, self._by_shard)

    def close(self) -> None:
        """Close the table's connections (a reload closes the version it replaced)."""
        self.table.close()

    @property
    def id(self) -> str:
        return self.manifest.datastore_id

    @property
    def version(self) -> int:
        return self.manifest.version

    @cached_property
    def superseded_rows(self) -> np.ndarray:
        """Sorted global row ids of the articles a later shard replaced: a whole-datastore search skips them."""
        parts = [np.zeros(0, np.int64)]
        for e in self.table.superseded():
            base = self.shard_offsets[e.shard]
            parts.append(np.arange(base + e.row_start, base + e.row_end, dtype=np.int64))
        return np.sort(np.concatenate(parts))

    @property
    def total_rows(self) -> int:
        return int(self.shard_offsets[-1])

    def float_rows(self, pos: int, rows: slice | np.ndarray) -> np.ndarray:
        """float32 vectors of some rows of shard ``pos``: the stored float16, or what their codes stand for."""
        shard = self.shards[pos]
        if self.codec is None:
            return np.asarray(shard.vectors[rows], dtype=np.float32)
        from bertknn.core.format.codec import decode

        return decode(self.codec, shard.codes[rows])

    @property
    def linked(self) -> bool:
        """Whether the rows carry entity links (``manifest.links``)."""
        return self.manifest.links is not None

    def article_rows(
        self, titles: Iterable[str], answer: str = "word"
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What is stored for the given articles' rows (float16 vectors, or uint8 codes with a codec), their labels
        and global row ids, reading only those rows. ``answer``: ``word`` leaves out the rows that are an entity
        link's anchor only (label -1); ``entity`` keeps only the rows with a link, their labels being the links'
        targets (shard-local: use `entity_at` on the row ids)."""
        found = [s for s in self.row_slices(titles, answer) if s is not None]
        if not found:
            if self.manifest.codec is not None:
                empty = np.zeros((0, self.manifest.codec.code_bytes), np.uint8)
            else:
                empty = np.zeros((0, self.manifest.model.hidden_size), np.float16)
            return empty, np.zeros(0, np.int32), np.zeros(0, np.int64)
        return (
            np.concatenate([s.taken() for s in found]),
            np.concatenate([s.labels for s in found]),
            np.concatenate([s.ids for s in found]),
        )

    def row_slices(self, titles: Iterable[str], answer: str = "word") -> list[RowSlice | None]:
        """`article_rows` per title (None: no such article, or no rows), with the stored rows not yet read: each
        a view of its shard's memory-mapped payload and the rows it takes, so that a caller copies them once, to
        where it needs them (the restricted kNN: into its index)."""
        out: list[RowSlice | None] = []
        for title in titles:
            entry = self.articles.get(title)
            if entry is None or entry.rows == 0:
                out.append(None)
                continue
            shard = self.shards[entry.shard]
            a, b = entry.row_start, entry.row_end
            base = self.shard_offsets[entry.shard]
            if not self.linked:
                out.append(None if answer == "entity" else RowSlice(
                    shard.payload[a:b], None, shard.labels[a:b], np.arange(base + a, base + b, dtype=np.int64)
                ))  # fmt: skip
                continue
            lab = (shard.entity_labels if answer == "entity" else shard.labels)[a:b]
            keep = np.flatnonzero(lab >= 0)
            if len(keep) == b - a:  # (no row left out: the plain slice, as without links)
                out.append(RowSlice(shard.payload[a:b], None, lab, np.arange(base + a, base + b, dtype=np.int64)))
            else:
                taken = RowSlice(shard.payload[a:b], keep, lab[keep], base + a + keep.astype(np.int64))
                out.append(taken if len(keep) else None)
        return out

    def iter_article_texts(self) -> Iterator[tuple[str, str]]:
        """(title, text) per live article, in shard order, the text being its stored sentences: what the sparse
        indexes index."""
        for entry in self.table.live():
            shard = self.shards[entry.shard]
            yield entry.title, " ".join(shard.sentence(i) for i in range(entry.sent_start, entry.sent_end))

    def article_sentences(self, title: str) -> list[str]:
        """The stored sentences of an article (its current version)."""
        entry = self.articles[title]
        shard = self.shards[entry.shard]
        return [shard.sentence(i) for i in range(entry.sent_start, entry.sent_end)]

    def locate(self, global_row: int) -> tuple[int, int]:
        """(position in ``shards``, row in that shard) of a global row id."""
        global_row = int(global_row)
        pos = bisect.bisect_right(self._offsets, global_row) - 1
        return pos, global_row - self._offsets[pos]

    def _by_shard(self, global_rows: Sequence[int] | np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """`locate` of many rows at once: for each shard position, (the indexes into ``global_rows``, the rows in
        that shard), in the order given."""
        rows = np.asarray(global_rows, dtype=np.int64)
        starts = np.asarray(self.shard_offsets, dtype=np.int64)
        pos = np.searchsorted(starts, rows, side="right") - 1
        out = {}
        for p in np.unique(pos).tolist():
            at = np.flatnonzero(pos == p)
            out[p] = (at, rows[at] - starts[p])
        return out

    @property
    def whole_words(self) -> bool:
        return self.manifest.targets == "whole-word"

    def word_at(self, global_row: int) -> WordEntry:
        """The word stored at one row of a whole-word datastore."""
        pos, row = self.locate(global_row)
        shard = self.shards[pos]
        return shard.words[int(shard.labels[row])]

    def labels_at(self, global_rows: np.ndarray) -> np.ndarray:
        out = np.empty(len(global_rows), dtype=np.int32)
        for pos, (at, rows) in self._by_shard(global_rows).items():
            out[at] = self.shards[pos].labels[rows]
        return out

    def context(self, global_row: int) -> ContextRef:
        """The article, sentence and word span behind one stored row."""
        return self.contexts([global_row])[0]

    def contexts(self, global_rows: Sequence[int]) -> list[ContextRef]:
        """`context` of several rows, reading each shard's arrays once for all of them (one answer shows up
        to a few dozen: row by row, the small reads from the memory-mapped arrays cost most of the time)."""
        out: list[ContextRef | None] = [None] * len(global_rows)
        if not len(global_rows):
            return []
        for pos, (at, rows) in self._by_shard(global_rows).items():
            shard = self.shards[pos]
            spans = shard.spans[rows].tolist()
            sids = shard.sentence_ids[rows].astype(np.int64)
            begin, end = shard.sentence_offsets[sids].tolist(), shard.sentence_offsets[sids + 1].tolist()
            text = shard._sentences.data  # a memoryview: its slices decode without a copy into numpy
            titles = self.table.titles_at(pos, rows.tolist())
            for i, (a, b), s0, s1, title in zip(at.tolist(), spans, begin, end, titles, strict=True):
                out[i] = ContextRef(title, str(text[s0:s1], "utf-8"), (a, b))
        return cast(list[ContextRef], out)
