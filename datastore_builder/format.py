"""The on-disk datastore contract: file names, the manifest model, validation and the memory-mapped reader.

Layout of a datastore directory (all arrays are ``.npy``, opened with ``mmap_mode="r"``; no pickle anywhere)::

    manifest.json                 written last, atomically; its presence marks a finished datastore
    redirects.json                {normalised redirect title: normalised target title}
    shards/shard-00000/
        vectors.npy               float16 [rows, hidden]   [MASK] embedding at ``manifest.layer``
        labels.npy                int32   [rows]           token id of the masked word, row-aligned
                                                           (whole-word datastores: id into words.json)
        sentence_ids.npy          int32   [rows]           row -> sentence index within the shard
        spans.npy                 int32   [rows, 2]        character span of the word in its sentence
        sentences.txt             UTF-8 sentences, concatenated
        sentence_offsets.npy      int64   [sentences + 1]  byte offsets of each sentence in sentences.txt
        articles.json             [{"title", "id", "source", "row_start", "row_end", "sent_start", "sent_end"}]
        words.json                whole-word datastores only: [[word text, [piece ids]], ...], the shard's words
        SHARD.json                written last inside the shard: rows and sha256 of every file above
    index/bm25/                   Lucene index (pyserini), one document per article, docid = title
    index/tfidf/                  DrQA-style hashed TF-IDF (see ``datastore_builder.sparse_index``)
    index/ivfpq.faiss             optional whole-datastore IVF-PQ index (the no-retrieval ablation)
    index/v2/ ...                 the indexes of version 2, 3, ... (``add``); ``manifest.indexes`` names the current

Rows of one article are contiguous inside one shard, so a search restricted to a few articles reads only
their rows, whatever the datastore's size.

Versions: ``python -m datastore_builder add`` (``datastore_builder.update``) appends shards and writes manifest
version N+1 with an ``updates`` record naming them. An article of a later shard replaces the same title in
earlier shards: the old rows stay on disk (shards are immutable) but are no longer reachable, and the manifest
counts them as ``superseded_*``. Only shards an ``add`` made may repeat a title (``validate`` checks it).

``manifest.targets`` says which words are stored (absent in older manifests: ``single-piece``):

- ``single-piece`` (the paper's rule): whole words that are exactly one wordpiece; the word replaced by one
  [MASK]; ``labels.npy`` holds the token id.
- ``whole-word``: whole words of 1 to ``words.MAX_WORD_PIECES`` wordpieces; ALL the word's wordpieces are
  replaced by ONE [MASK] (a query has one [MASK] too, whatever the answer's length); ``spans.npy`` covers the
  whole word; ``labels.npy`` holds ids into the shard's own ``words.json`` (one-piece words included, so every
  label means a word). Per-shard tables keep shards self-contained (resume, merge by hard links); a word is
  identified by its text across shards. See ``datastore_builder.words``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import BinaryIO, Literal, cast

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from datastore_builder.words import WordEntry, WordTable, check_word_table, read_word_table

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REDIRECTS = "redirects.json"
SHARDS_DIR = "shards"
SHARD_MARKER = "SHARD.json"
VECTORS = "vectors.npy"
LABELS = "labels.npy"
SENTENCE_IDS = "sentence_ids.npy"
SPANS = "spans.npy"
SENTENCES = "sentences.txt"
SENTENCE_OFFSETS = "sentence_offsets.npy"
ARTICLES = "articles.json"
SHARD_FILES = (VECTORS, LABELS, SENTENCE_IDS, SPANS, SENTENCES, SENTENCE_OFFSETS, ARTICLES)
WORDS = "words.json"  # whole-word datastores only
OPTIONAL_SHARD_FILES = (WORDS,)
INDEX_DIR = "index"
BM25_DIR = "index/bm25"
TFIDF_DIR = "index/tfidf"
IVFPQ_FILE = "index/ivfpq.faiss"


class DatastoreError(Exception):
    """A datastore is missing, incomplete or inconsistent; the message names the file and what to do."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


class FileInfo(BaseModel):
    model_config = ConfigDict(frozen=True)
    bytes: int
    sha256: str


class ShardInfo(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str
    index: int
    rows: int
    articles: int
    sentences: int
    files: dict[str, FileInfo]


class ModelInfo(BaseModel):
    model_config = ConfigDict(frozen=True, protected_namespaces=())
    name: str
    weights_sha256: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int


class SourceInfo(BaseModel):
    model_config = ConfigDict(frozen=True)
    path: str
    format: Literal["jsonl", "mediawiki-xml"]
    sha256: str


class Counts(BaseModel):
    """``articles``/``sentences``/``contexts``: what readers can reach; ``superseded_*``: rows of articles that a
    later ``add`` replaced, still in their (immutable) shards but never read. The two sum to the shards' totals."""

    articles: int = 0
    sentences: int = 0
    contexts: int = 0
    skipped_duplicate_titles: int = 0
    skipped_pages: int = 0
    superseded_articles: int = 0
    superseded_sentences: int = 0
    superseded_contexts: int = 0


class UpdateInfo(BaseModel):
    """One ``python -m datastore_builder add``: the version it made and the shards it appended."""

    model_config = ConfigDict(frozen=True)
    version: int
    shards: list[str]
    added: int  # articles whose title was new
    replaced: int  # articles whose title existed with other text: their old rows are superseded
    unchanged: int  # articles given again with the same stored sentences: skipped
    sources: list[SourceInfo] = Field(default_factory=list)


class SliceInfo(BaseModel):
    model_config = ConfigDict(frozen=True)
    index: int
    count: int


class Manifest(BaseModel):
    """Everything a reader must know to trust and use a datastore."""

    model_config = ConfigDict(protected_namespaces=())
    format_version: int = FORMAT_VERSION
    datastore_id: str = ""
    version: int = 1
    model: ModelInfo
    layer: int
    dtype: Literal["float16"] = "float16"
    max_seq_len: int
    articles_per_shard: int
    stopwords_sha256: str
    counts: Counts = Field(default_factory=Counts)
    sources: list[SourceInfo] = Field(default_factory=list)
    shards: list[ShardInfo] = Field(default_factory=list)
    indexes: dict[str, str] = Field(default_factory=dict)
    slice: SliceInfo | None = None
    targets: Literal["single-piece", "whole-word"] = "single-piece"
    updates: list[UpdateInfo] = Field(default_factory=list)  # one per `add`, oldest first

    def compute_id(self) -> str:
        """Content id: the model, the layer and every shard checksum (stable across identical builds)."""
        h = hashlib.sha256()
        h.update(self.model.weights_sha256.encode())
        h.update(str(self.layer).encode())
        for s in self.shards:
            for name in sorted(s.files):
                h.update(f"{s.name}/{name}:{s.files[name].sha256}".encode())
        return h.hexdigest()[:16]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


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
        raise DatastoreError(
            f"{path}: no manifest. The build did not finish; re-run the same build command to resume it."
        )
    try:
        return Manifest.model_validate_json(path.read_bytes())
    except ValueError as exc:
        raise DatastoreError(f"{path}: not a valid manifest ({exc}). Rebuild the datastore.") from exc


def write_manifest(root: Path, manifest: Manifest) -> None:
    atomic_write_json(Path(root) / MANIFEST, manifest.model_dump(mode="json"))


def read_shard_info(shard_dir: Path) -> ShardInfo | None:
    marker = shard_dir / SHARD_MARKER
    if not marker.is_file():
        return None
    try:
        return ShardInfo.model_validate_json(marker.read_bytes())
    except ValueError:
        return None


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


def shard_file_names(info: ShardInfo) -> tuple[str, ...]:
    """The files a shard must have: the fixed ones, plus the optional ones its SHARD.json lists."""
    return (*SHARD_FILES, *(n for n in OPTIONAL_SHARD_FILES if n in info.files))


@dataclass(frozen=True)
class ArticleEntry:
    title: str
    id: str
    source: str
    shard: int
    row_start: int
    row_end: int
    sent_start: int
    sent_end: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class ContextRef:
    article: str
    sentence: str
    span: tuple[int, int]


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
    def words(self) -> WordTable:
        """The shard's word table (whole-word datastores)."""
        path = self.dir / WORDS
        try:
            return read_word_table(path)
        except (OSError, ValueError) as exc:
            raise DatastoreError(f"{path}: cannot be read ({exc}); run `validate` and rebuild this shard") from exc


class Datastore:
    """Read side of the contract, shared by the service, the evaluation and the builder's `validate`."""

    def __init__(self, root: Path | str, manifest: Manifest | None = None):
        self.root = Path(root)
        self.manifest = manifest or read_manifest(self.root)
        if self.manifest.format_version != FORMAT_VERSION:
            raise DatastoreError(
                f"{self.root / MANIFEST}: format version {self.manifest.format_version}, this code reads "
                f"{FORMAT_VERSION}; rebuild the datastore with this version of the builder"
            )
        self.shards = [Shard(self.root, s) for s in self.manifest.shards]
        offsets = np.zeros(len(self.shards) + 1, dtype=np.int64)
        np.cumsum([s.info.rows for s in self.shards], out=offsets[1:])
        self.shard_offsets = offsets  # global row id = shard_offsets[shard] + row
        self._offsets = offsets.tolist()  # the same as Python ints: `locate` bisects it (per neighbour, per query)
        # `add` appends shards; an article in a later shard replaces the same title in earlier ones. The old rows
        # stay in their immutable shard but become unreachable: not in `articles` (restricted kNN, subject
        # lookup), not in `iter_article_texts` (sparse indexes), and in `superseded_rows` (whole-datastore kNN).
        self.articles: dict[str, ArticleEntry] = {}
        self.superseded: list[ArticleEntry] = []
        for shard in self.shards:
            for a in shard.articles():
                entry = ArticleEntry(shard=shard.info.index, **a)
                previous = self.articles.get(entry.title)
                if previous is not None:
                    self.superseded.append(previous)
                self.articles[entry.title] = entry
        redirects_path = self.root / REDIRECTS
        self.redirects: dict[str, str] = (
            json.loads(redirects_path.read_text(encoding="utf-8")) if redirects_path.is_file() else {}
        )

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
        for e in self.superseded:
            base = self.shard_offsets[self.shard_position(e.shard)]
            parts.append(np.arange(base + e.row_start, base + e.row_end, dtype=np.int64))
        return np.sort(np.concatenate(parts))

    @property
    def total_rows(self) -> int:
        return int(self.shard_offsets[-1])

    def shard_position(self, shard: int) -> int:
        """Shard index (as in ShardInfo.index) -> position in ``self.shards``."""
        return self._shard_positions[shard]

    @cached_property
    def _shard_positions(self) -> dict[int, int]:
        return {s.info.index: i for i, s in enumerate(self.shards)}

    def article_rows(self, titles: Iterable[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Vectors (float16), labels and global row ids of the given articles, reading only their rows."""
        vecs, labels, ids = [], [], []
        for title in titles:
            entry = self.articles.get(title)
            if entry is None or entry.rows == 0:
                continue
            pos = self.shard_position(entry.shard)
            shard = self.shards[pos]
            vecs.append(shard.vectors[entry.row_start : entry.row_end])
            labels.append(shard.labels[entry.row_start : entry.row_end])
            base = self.shard_offsets[pos]
            ids.append(np.arange(base + entry.row_start, base + entry.row_end, dtype=np.int64))
        if not vecs:
            dim = self.manifest.model.hidden_size
            return np.zeros((0, dim), np.float16), np.zeros(0, np.int32), np.zeros(0, np.int64)
        return np.concatenate(vecs), np.concatenate(labels), np.concatenate(ids)

    def iter_article_texts(self) -> Iterator[tuple[str, str]]:
        """(title, text) per article, the text being its stored sentences: what the sparse indexes index."""
        for shard in self.shards:
            for a in shard.articles():
                if self.articles[a["title"]].shard != shard.info.index:
                    continue  # superseded by a later shard
                yield a["title"], self.article_text(a["title"])

    def article_sentences(self, title: str) -> list[str]:
        """The stored sentences of an article (its current version)."""
        entry = self.articles[title]
        shard = self.shards[self.shard_position(entry.shard)]
        return [shard.sentence(i) for i in range(entry.sent_start, entry.sent_end)]

    def article_text(self, title: str) -> str:
        return " ".join(self.article_sentences(title))

    def locate(self, global_row: int) -> tuple[int, int]:
        """(position in ``shards``, row in that shard) of a global row id."""
        global_row = int(global_row)
        pos = bisect.bisect_right(self._offsets, global_row) - 1
        return pos, global_row - self._offsets[pos]

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
        for i, g in enumerate(global_rows):
            pos, row = self.locate(int(g))
            out[i] = self.shards[pos].labels[row]
        return out

    @cached_property
    def _row_to_article(self) -> list[tuple[list[int], list[str]]]:
        table = []
        for shard in self.shards:
            arts = sorted(shard.articles(), key=lambda a: a["row_start"])
            table.append(([int(a["row_start"]) for a in arts], [a["title"] for a in arts]))
        return table

    def context(self, global_row: int) -> ContextRef:
        """The article, sentence and word span behind one stored row."""
        return self.contexts([global_row])[0]

    def contexts(self, global_rows: Sequence[int]) -> list[ContextRef]:
        """`context` of several rows, reading each shard's arrays once for all of them (one answer shows up
        to a few dozen: row by row, the small reads from the memory-mapped arrays cost most of the time)."""
        out: list[ContextRef | None] = [None] * len(global_rows)
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for i, g in enumerate(global_rows):
            pos, row = self.locate(g)
            by_shard.setdefault(pos, []).append((i, row))
        for pos, items in by_shard.items():
            shard = self.shards[pos]
            starts, titles = self._row_to_article[pos]
            rows = np.fromiter((r for _, r in items), dtype=np.int64, count=len(items))
            spans = shard.spans[rows].tolist()
            sids = shard.sentence_ids[rows].astype(np.int64)
            begin, end = shard.sentence_offsets[sids].tolist(), shard.sentence_offsets[sids + 1].tolist()
            text = shard._sentences
            for (i, row), (a, b), s0, s1 in zip(items, spans, begin, end, strict=True):
                sentence = text[s0:s1].tobytes().decode("utf-8")
                out[i] = ContextRef(titles[bisect.bisect_right(starts, row) - 1], sentence, (a, b))
        return cast(list[ContextRef], out)


def validate_datastore(root: Path | str, *, hashes: bool = True, manifest: Manifest | None = None) -> list[str]:
    """Check manifest, files, checksums, row counts and id-map lengths. Returns problems (first one first).

    ``manifest``: check this manifest (one about to be written, e.g. by ``add``) instead of the one on disk.
    """
    root = Path(root)
    if manifest is None:
        try:
            manifest = read_manifest(root)
        except DatastoreError as exc:
            return [str(exc)]
    problems: list[str] = []
    if manifest.format_version != FORMAT_VERSION:
        problems.append(f"{root / MANIFEST}: format version {manifest.format_version} != {FORMAT_VERSION}")
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
    if not problems:
        problems.extend(_check_updates(root, manifest))
    if not problems:
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
        if manifest.datastore_id != manifest.compute_id():
            problems.append(f"{root / MANIFEST}: datastore_id does not match the shard checksums")
    for name, rel in manifest.indexes.items():
        if not (root / rel).exists():
            problems.append(f"{root / rel}: {name} index listed in the manifest is missing")
    return problems


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


def _check_shard_arrays(shard: Shard, manifest: Manifest) -> list[str]:
    d = shard.dir
    rows = shard.info.rows
    try:
        vec, lab, sid, spans, offs = (
            shard.vectors,
            shard.labels,
            shard.sentence_ids,
            shard.spans,
            shard.sentence_offsets,
        )
    except DatastoreError as exc:
        return [str(exc)]
    expect = {
        VECTORS: (vec.shape, (rows, manifest.model.hidden_size), vec.dtype, np.float16),
        LABELS: (lab.shape, (rows,), lab.dtype, np.int32),
        SENTENCE_IDS: (sid.shape, (rows,), sid.dtype, np.int32),
        SPANS: (spans.shape, (rows, 2), spans.dtype, np.int32),
        SENTENCE_OFFSETS: (offs.shape, (shard.info.sentences + 1,), offs.dtype, np.int64),
    }
    for name, (shape, want_shape, dtype, want_dtype) in expect.items():
        if shape != want_shape or dtype != want_dtype:
            return [f"{d / name}: shape {shape} {dtype}, expected {want_shape} {np.dtype(want_dtype)}"]
    whole = manifest.targets == "whole-word"
    if whole != (WORDS in shard.info.files):
        what = "has no" if whole else "has a"
        return [f"{d}: {what} {WORDS} but the manifest says targets={manifest.targets}; rebuild the datastore"]
    if whole:
        try:
            words = shard.words
        except DatastoreError as exc:
            return [str(exc)]
        problem = check_word_table(words, manifest.model.vocab_size)
        if problem:
            return [f"{d / WORDS}: {problem}"]
        if rows and (lab.min() < 0 or lab.max() >= len(words)):
            return [f"{d / LABELS}: label outside the word table [0, {len(words)})"]
    elif rows and (lab.min() < 0 or lab.max() >= manifest.model.vocab_size):
        return [f"{d / LABELS}: label outside the vocabulary [0, {manifest.model.vocab_size})"]
    if rows and (sid.min() < 0 or sid.max() >= shard.info.sentences):
        return [f"{d / SENTENCE_IDS}: sentence id outside [0, {shard.info.sentences})"]
    if offs[-1] != (d / SENTENCES).stat().st_size:
        return [f"{d / SENTENCE_OFFSETS}: last offset {offs[-1]} != size of {SENTENCES}"]
    arts = sorted(shard.articles(), key=lambda a: a["row_start"])
    cursor = 0
    for a in arts:
        if a["row_start"] != cursor or a["row_end"] < a["row_start"]:
            return [f"{d / ARTICLES}: article {a['title']!r} rows [{a['row_start']}, {a['row_end']}) are not contiguous"]
        cursor = a["row_end"]
    if cursor != rows:
        return [f"{d / ARTICLES}: article rows cover {cursor} of {rows} rows"]
    if len(arts) != shard.info.articles:
        return [f"{d / ARTICLES}: {len(arts)} articles, {SHARD_MARKER} says {shard.info.articles}"]
    return []
