"""The on-disk datastore contract: file names and the manifest model (the reader and `validate` are beside it).

Layout of a datastore directory (all arrays are ``.npy``, opened with ``mmap_mode="r"``; no pickle anywhere)::

    manifest.json                 written last, atomically; its presence marks a finished datastore
    articles.sqlite               the article table (``bertknn.core.format.table``): titles -> shard rows, folded
                                  titles, redirects, superseded entries; ``manifest.article_table`` names it
    redirects.json                {normalised redirect title: normalised target title} (the builder's record)
    codec.faiss                   the trained codec of a compact datastore (``manifest.codec``; absent for fp16)
    shards/shard-00000/           block 0 (``shard-00000.001``, ... : its further parts, when it was cut by contexts)
        vectors.npy               float16 [rows, hidden]   [MASK] embedding at ``manifest.layer`` (fp16), or
        codes.npy                 uint8   [rows, bytes]    its code (int8, pq: see ``bertknn.core.format.codec``)
        labels.npy                int32   [rows]           token id of the masked word, row-aligned
                                                           (whole-word datastores: id into words.json)
        sentence_ids.npy          int32   [rows]           row -> sentence index within the shard
        spans.npy                 int32   [rows, 2]        character span of the word in its sentence
        sentences.txt             UTF-8 sentences, concatenated
        sentence_offsets.npy      int64   [sentences + 1]  byte offsets of each sentence in sentences.txt
        articles.json             [{"title", "id", "source", "row_start", "row_end", "sent_start", "sent_end"}]
        words.json                whole-word datastores only: [[word text, [piece ids]], ...], the shard's words
        entity_labels.npy         int32   [rows]           datastores with links: the row's link target, an index
                                                           into entities.txt, or -1 (no link)
        entities.txt              UTF-8 link target titles (normalised, before redirects), one per line
        entity_offsets.npy        int64   [entities + 1]   byte offsets of each title in entities.txt
        SHARD.json                written last inside the shard: rows and sha256 of every file above
    index/bm25/                   Lucene index (pyserini), one document per article, docid = title
    index/tfidf/                  DrQA-style hashed TF-IDF (see ``bertknn.builder.sparse_index``)
    index/ivfpq.faiss             optional whole-datastore IVF-PQ index (the no-retrieval ablation)
    index/v2/ ...                 the indexes of version 2, 3, ... (``add``); ``manifest.indexes`` names the current

Rows of one article are contiguous inside one shard, so a search restricted to a few articles reads only
their rows, whatever the datastore's size.

Versions: ``bert-knn add`` (``bertknn.builder.update``) appends shards and writes manifest
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
  identified by its text across shards. See ``bertknn.core.words``.

``manifest.links`` (format version 4; absent: no links) says the rows carry entity links (docs/entities.md):
a word target that is a link's whole anchor has the link's target in ``entity_labels.npy``; an anchor that is
not one word target (several words, a word of many wordpieces) is a row of its own, its whole span replaced by
one [MASK], with ``labels.npy`` -1 (no word: word answers never see it). The article table then holds an
``entities`` table: each target resolved through the redirects, with its popularity (mentions kept as rows in
live articles).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from bertknn.core.errors import DatastoreError

__all__ = [
    "IVFPQ_META",
    "PAPER_NLIST",
    "PAPER_CODE_BYTES",
    "PAPER_NPROBE",
    "ivfpq_meta_path",
    "DatastoreError",
    "FORMAT_VERSION",
    "MANIFEST",
    "BUILD_STATE",
    "REDIRECTS",
    "SHARDS_DIR",
    "SHARD_MARKER",
    "VECTORS",
    "CODES",
    "CODEC_FILE",
    "CodecInfo",
    "LABELS",
    "SENTENCE_IDS",
    "SPANS",
    "SENTENCES",
    "SENTENCE_OFFSETS",
    "ARTICLES",
    "SHARD_FILES",
    "WORDS",
    "ENTITY_LABELS",
    "ENTITIES",
    "ENTITY_OFFSETS",
    "LINK_FILES",
    "LinkInfo",
    "OPTIONAL_SHARD_FILES",
    "INDEX_DIR",
    "BM25_DIR",
    "TFIDF_DIR",
    "IVFPQ_FILE",
    "shard_name",
    "parse_shard_name",
    "UPGRADABLE_FORMAT_VERSIONS",
    "ARTICLE_TABLE",
    "FileInfo",
    "ShardInfo",
    "ModelInfo",
    "SourceInfo",
    "Counts",
    "UpdateInfo",
    "SliceInfo",
    "DistanceScale",
    "Manifest",
    "read_shard_info",
    "shard_file_names",
]

# 2: a block of articles may be written as several shards (parts), see ShardInfo.part
# 3: the article table (titles, folded titles, redirects, superseding) is an SQLite file, opened not loaded
# 4: entity links (``Manifest.links``): rows whose label is -1 (an anchor only), entity files, the entities table
FORMAT_VERSION = 4
UPGRADABLE_FORMAT_VERSIONS = (1, 2, 3)  # `bert-knn upgrade` converts them
MANIFEST = "manifest.json"
BUILD_STATE = "build.json"  # a build's settings, written when it starts: what a resumed build must match
REDIRECTS = "redirects.json"
SHARDS_DIR = "shards"
SHARD_MARKER = "SHARD.json"
VECTORS = "vectors.npy"
CODES = "codes.npy"  # instead of vectors.npy in a datastore with a codec
CODEC_FILE = "codec.faiss"
LABELS = "labels.npy"
SENTENCE_IDS = "sentence_ids.npy"
SPANS = "spans.npy"
SENTENCES = "sentences.txt"
SENTENCE_OFFSETS = "sentence_offsets.npy"
ARTICLES = "articles.json"
SHARD_FILES = (VECTORS, LABELS, SENTENCE_IDS, SPANS, SENTENCES, SENTENCE_OFFSETS, ARTICLES)
WORDS = "words.json"  # whole-word datastores only
ENTITY_LABELS = "entity_labels.npy"  # datastores with links only
ENTITIES = "entities.txt"
ENTITY_OFFSETS = "entity_offsets.npy"
LINK_FILES = (ENTITY_LABELS, ENTITIES, ENTITY_OFFSETS)
OPTIONAL_SHARD_FILES = (WORDS, *LINK_FILES)
INDEX_DIR = "index"
ARTICLE_TABLE = "articles.sqlite"  # the first version's; `add` writes index/vN/articles.sqlite
BM25_DIR = "index/bm25"
TFIDF_DIR = "index/tfidf"
IVFPQ_FILE = "index/ivfpq.faiss"
IVFPQ_META = "index/ivfpq.json"
# the paper's IVF-PQ (Kassner & Schütze 2020, via Johnson et al.): lists, bytes per code, lists probed
PAPER_NLIST = 40960
PAPER_CODE_BYTES = 64
PAPER_NPROBE = 64


def shard_name(index: int, part: int = 0) -> str:
    """``shard-00012`` for the first (often only) part of block 12, ``shard-00012.003`` for its fourth."""
    return f"shard-{index:05d}" if part == 0 else f"shard-{index:05d}.{part:03d}"


def parse_shard_name(name: str) -> tuple[int, int] | None:
    """(block index, part) of a shard directory name, or None when it is not one."""
    if not name.startswith("shard-"):
        return None
    block, _, part = name[6:].partition(".")
    if not block.isdigit() or (part and not part.isdigit()):
        return None
    return int(block), int(part or 0)


class FileInfo(BaseModel):
    model_config = ConfigDict(frozen=True)
    bytes: int
    sha256: str


class ShardInfo(BaseModel):
    """One shard directory. The corpus is cut into blocks of at most ``articles_per_shard`` articles (or, from a
    multistream dump with its index, of whole bz2 streams): the unit of slicing (block j belongs to slice j % n).
    A block is written as one or more parts of at most ``contexts_per_shard`` contexts each, cut between articles:
    the unit of resume. ``last`` marks a block's final part (a block whose final part is on disk is complete)."""

    model_config = ConfigDict(frozen=True)
    name: str
    index: int  # the block
    rows: int
    articles: int
    sentences: int
    files: dict[str, FileInfo]
    part: int = 0
    last: bool = True
    dropped: dict[str, int] = Field(default_factory=dict)  # its articles' sentences left out, by reason

    @property
    def key(self) -> tuple[int, int]:
        """Sort key and identity: (block, part)."""
        return self.index, self.part


class ModelInfo(BaseModel):
    model_config = ConfigDict(frozen=True, protected_namespaces=())
    name: str  # as the build was given it (a hub name, or a directory)
    path: str | None = None  # a local directory's absolute path, so that the service finds it from anywhere
    weights_sha256: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    # the forward's dtype and backend when the vectors were embedded ("float32/onnx"); None: built before it was kept
    numerics: str | None = None


class CodecInfo(BaseModel):
    """The trained codec of a compact datastore (``bertknn.core.format.codec``): its rows are codes, not vectors."""

    model_config = ConfigDict(frozen=True)
    name: str  # int8 | pq (a string, so that a newer codec's name reaches a one-line error, not a schema error)
    file: str = CODEC_FILE
    sha256: str
    code_bytes: int  # bytes per row in codes.npy
    factory: str  # FAISS index_factory string (e.g. "OPQ64,PQ64x8")
    rotation: Literal["opq", "pca", "none"] = "none"
    coded_dim: int  # dimensions the codes quantize (the model's, or a PCA's output)
    trained_on: int  # vectors in the training sample
    seed: int


class DistanceScale(BaseModel):
    """The datastore's own distance scale, from which the service derives ``temperature: auto``
    (``bertknn.core.calibration``): over a seeded sample of contexts, the squared L2 distances to their nearest
    neighbours in their own article, as the restricted kNN computes them (through the codec, when there is one)."""

    model_config = ConfigDict(frozen=True)
    statistic: str  # the statistic's name and version (calibration.STATISTIC)
    value: float  # v2: the factor a of l = a * (median distance of the query's neighbours); v1: l (squared-L2 units)
    typical: float | None = None  # v2: the l at the sample's median neighbour distance (squared-L2 units)
    sample: int  # contexts the statistic was taken over
    seed: int


class LinkInfo(BaseModel):
    """The rows carry entity links (Wikipedia's own): see the module docstring and docs/entities.md."""

    model_config = ConfigDict(frozen=True)
    mentions: int = 0  # live rows with a link
    anchor_rows: int = 0  # of which rows of their own (the anchor is no word target: label -1)
    entities: int = 0  # distinct link targets after redirects (rows of the entities table)


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
    dropped_sentences: dict[str, int] = Field(default_factory=dict)  # by reason (fragment, markup, short, hatnote)


class UpdateInfo(BaseModel):
    """One ``bert-knn add``: the version it made and the shards it appended."""

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
    # "articles": every slice read the whole corpus and kept its blocks (corpus-wide counts are the same in each);
    # "streams": each slice read only its blocks' bz2 streams (a multistream index), so its counts are its own
    unit: Literal["articles", "streams"] = "articles"


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
    articles_per_shard: int  # articles per block (see ShardInfo)
    contexts_per_shard: int | None = None  # contexts per part of a block; None: one part per block (version 1)
    stopwords_sha256: str
    counts: Counts = Field(default_factory=Counts)
    sources: list[SourceInfo] = Field(default_factory=list)
    shards: list[ShardInfo] = Field(default_factory=list)
    indexes: dict[str, str] = Field(default_factory=dict)
    slice: SliceInfo | None = None
    targets: Literal["single-piece", "whole-word"] = "single-piece"
    updates: list[UpdateInfo] = Field(default_factory=list)  # one per `add`, oldest first
    article_table: str | None = None  # relative path of this version's article table (format version 3)
    codec: CodecInfo | None = None  # None: fp16 vectors
    distance_scale: DistanceScale | None = None  # None: not measured (temperature auto falls back to the paper's 6)
    links: LinkInfo | None = None  # None: no entity links (format version 3 and builds without links)
    language: str = "en"  # the corpus's (a dump's xml:lang, or --language): its text, retrieval and warnings rules
    warnings: list[str] = Field(default_factory=list)  # what the build saw go wrong (a truncated dump, few targets)

    def compute_id(self) -> str:
        """Content id: the model, the layer and every shard checksum (stable across identical builds)."""
        h = hashlib.sha256()
        h.update(self.model.weights_sha256.encode())
        h.update(str(self.layer).encode())
        if self.codec is not None:
            h.update(f"codec:{self.codec.sha256}".encode())
        for s in self.shards:
            for name in sorted(s.files):
                h.update(f"{s.name}/{name}:{s.files[name].sha256}".encode())
        return h.hexdigest()[:16]

    def articles_id(self) -> str:
        """What the article table is made from: every shard's name and the checksum of its ``articles.json``."""
        h = hashlib.sha256()
        for s in self.shards:
            info = s.files.get(ARTICLES)
            h.update(f"{s.name}:{info.sha256 if info else ''}".encode())
        return h.hexdigest()[:16]


def read_shard_info(shard_dir: Path) -> ShardInfo | None:
    marker = shard_dir / SHARD_MARKER
    if not marker.is_file():
        return None
    try:
        return ShardInfo.model_validate_json(marker.read_bytes())
    except ValueError:
        return None


def shard_file_names(info: ShardInfo) -> tuple[str, ...]:
    """The files a shard must have: the fixed ones (codes.npy instead of vectors.npy when its SHARD.json lists
    codes), plus the optional ones its SHARD.json lists."""
    fixed = tuple(CODES if n == VECTORS and CODES in info.files else n for n in SHARD_FILES)
    return (*fixed, *(n for n in OPTIONAL_SHARD_FILES if n in info.files))


def ivfpq_meta_path(index_rel: str) -> str:
    """The sidecar of an index file: ``index/ivfpq.faiss`` -> ``index/ivfpq.json`` (also under ``index/vN/``)."""
    return str(Path(index_rel).with_suffix(".json"))
