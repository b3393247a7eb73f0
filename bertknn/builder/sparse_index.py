"""Sparse article indexes over a datastore's articles: Lucene BM25 (pyserini) and DrQA-style hashed TF-IDF.

Both index the same documents: one per article, the normalised title (``titles.normalize_title``) followed by
the article's stored sentences (``Datastore.iter_article_texts``). Both are written into temporary
directories and renamed into place, and both carry the fingerprint of what they index, so a resumed build
that finds matching indexes keeps them instead of rebuilding.

``index/bm25/`` -- a Lucene index written by Anserini's ``IndexCollection`` (pyserini 0.25, Lucene 9):
    one document per article, ``docid`` = the normalised title itself (Lucene stores it as an exact string;
    spaces, accents, NFC and astral characters round-trip unchanged), ``contents`` = title + newline + text,
    analysed by Anserini's default English analyzer (Porter stemming, stopwords removed). The sidecar
    ``bertknn-bm25.json`` records ``{"format", "version", "fingerprint", "documents", "pyserini"}``; Lucene
    ignores files that are not its own.

``index/tfidf/`` -- DrQA's TF-IDF (Chen et al. 2017, ``drqa/retriever``), stored without pickle:
    ``params.json``  ``{"format": "bertknn-tfidf", "version", "fingerprint", "n_docs", "n_buckets",
                      "n_features": 2**24, "ngram": 2, "stopwords": [...], "token_pattern", "fold", "tf", "idf"}``
    ``titles.txt`` + ``title_offsets.npy``  UTF-8 titles concatenated, int64 byte offsets [n_docs + 1];
                     column ``j`` of the postings is title ``j``
    ``buckets.npy``  int64 [n_buckets], sorted: the hash buckets that occur in at least one document
    ``idf.npy``      float32 [n_buckets], the idf of each bucket (row-aligned with ``buckets.npy``)
    ``postings_indptr.npy`` (int64 [n_buckets + 1]), ``postings_indices.npy`` (int32), ``postings_data.npy``
                     (float32): the CSR matrix [n_buckets, n_docs] whose row ``i`` holds ``log(1 + tf) * idf`` of
                     bucket ``buckets[i]`` in every document that contains it -- an inverted index. The reader
                     memory-maps every file, so a query reads only its own buckets' postings and start-up reads
                     nothing per document (format version 2; version 1's ``postings.npz`` and ``titles.json``
                     were loaded whole, and ``bert-knn upgrade`` converts them).
    Text -> features (:class:`NgramHasher`, shared with the service): Unicode NFKD with combining marks dropped,
    ``casefold`` (so "Émile" and "emile" match), tokens ``\\w+`` or single non-space symbols, unigrams and
    bigrams joined by a space; an n-gram is dropped when *all* its tokens are stopwords (the bundled English
    list, stored in ``params.json``) or punctuation. Each n-gram is hashed by scikit-learn's
    ``HashingVectorizer`` (signed 32-bit MurmurHash3, seed 0, ``abs(h) % 2**24``, no alternating sign).
    ``tf`` is the n-gram's count in the document, ``df`` the number of documents holding the bucket,
    ``idf = max(0, log((N - df + 0.5) / (df + 0.5)))`` (DrQA's formula). A query is hashed the same way and
    weighted ``log(1 + tf_query) * idf``; a document's score is the dot product (DrQA does not normalise).

Lucene indexing runs in a child process (``python -m pyserini.index.lucene``): the JVM and pyserini's imports
(seconds, ~750 MB) then never enter the builder process, whose memory goes to the model and the shards; a JVM
cannot be unloaded once started, and a JVM crash or out-of-memory stays in the child and is reported with
its log.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import IO

import numpy as np
import scipy.sparse as sp

from bertknn.builder.targets import load_stopwords
from bertknn.core import logs
from bertknn.core.errors import SparseIndexError
from bertknn.core.format import (
    INDEX_DIR,
    Datastore,
    Manifest,
    atomic_write_json,
    naming_write_errors,
    save_npy,
)
from bertknn.core.format.sparse import (
    ANSERINI_LANGUAGES,
    BM25_META,
    PRETOKENIZED,
    SPARSE_FORMAT_VERSION,
    TFIDF_BUCKETS,
    TFIDF_FILES,
    TFIDF_IDF,
    TFIDF_PARAMS,
    NgramHasher,
    write_tfidf_arrays,
)
from bertknn.core.languages import rules_for
from bertknn.core.lucene import ready_pyserini_env

logger = logging.getLogger(__name__)

_CHUNK = 2048  # articles hashed per HashingVectorizer call
_DOCS_PER_FILE = 50_000  # JSONL files given to Lucene; one file is read by one indexing thread


def default_hasher() -> NgramHasher:
    return NgramHasher(load_stopwords(None))


def drqa_idf(df: np.ndarray, n_docs: int) -> np.ndarray:
    """``max(0, log((N - df + 0.5) / (df + 0.5)))`` per bucket, float32."""
    df = df.astype(np.float64)
    return np.maximum(np.log((n_docs - df + 0.5) / (df + 0.5)), 0.0).astype(np.float32)


@dataclass(frozen=True)
class TfidfTables:
    """What ``index/tfidf/`` holds, in memory."""

    buckets: np.ndarray  # int64 [B], sorted
    idf: np.ndarray  # float32 [B]
    postings: sp.csr_array  # float32 [B, n_docs]


def tfidf_tables(counts: sp.csr_array) -> TfidfTables:
    """Counts (documents x 2**24) -> the inverted, compacted ``log(1 + tf) * idf`` tables.

    Only buckets that occur are kept (``np.unique``), so the stored matrix has ``n_used`` rows instead of
    2**24 and no 128 MB row-pointer array.
    """
    n_docs = counts.shape[0]
    buckets, inverse = np.unique(counts.indices, return_inverse=True)
    df = np.bincount(inverse, minlength=len(buckets))  # indices are unique within a row after sum_duplicates
    idf = drqa_idf(df, n_docs)
    weights = np.log1p(counts.data).astype(np.float32) * idf[inverse]
    by_doc = sp.csr_array((weights, inverse, counts.indptr), shape=(n_docs, len(buckets)))
    postings = sp.csr_array(by_doc.T.tocsr())
    postings.eliminate_zeros()  # buckets with idf 0 (in half the documents or more) score nothing
    postings.sort_indices()
    return TfidfTables(buckets.astype(np.int64), idf, postings)


# ---- building --------------------------------------------------------------------------------------------


@dataclass
class _Collected:
    titles: list[str] = field(default_factory=list)
    count_chunks: list[sp.csr_array] = field(default_factory=list)
    content: hashlib._Hash = field(default_factory=hashlib.sha256)


def _batched(items: Iterable[tuple[str, str]], size: int) -> Iterator[list[tuple[str, str]]]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def _fingerprint(content_id: str, hasher: NgramHasher) -> str:
    spec = json.dumps(
        {"content": content_id, "version": SPARSE_FORMAT_VERSION, **hasher.to_params()}, sort_keys=True
    )
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def sparse_indexes_current(root: Path, fingerprint: str, index_dir: str = INDEX_DIR, *, bm25: bool = True) -> bool:
    """True when the indexes (TF-IDF, and BM25 unless ``bm25`` is off) exist and were built from exactly this
    content with these parameters."""
    folder = Path(root) / index_dir
    tfidf = _read_json(folder / "tfidf" / TFIDF_PARAMS)
    return (
        (not bm25 or _read_json(folder / "bm25" / BM25_META).get("fingerprint") == fingerprint)
        and tfidf.get("fingerprint") == fingerprint
        and all((folder / "tfidf" / name).is_file() for name in TFIDF_FILES)
    )


def language_hasher(language: str, stopwords: frozenset[str] | None = None) -> NgramHasher:
    """The TF-IDF features of a datastore's language: its stopwords (default: the language's list) and terms."""
    words = load_stopwords(None, language) if stopwords is None else stopwords
    rules = rules_for(language)
    return NgramHasher.for_language(language, words, rules.fold_accents, rules.dotted_i)


def build_sparse_indexes(
    out: Path, manifest: Manifest, *, bm25: bool = True, stopwords: frozenset[str] | None = None
) -> dict[str, str]:
    """Build ``index/bm25`` (unless ``bm25`` is off) and ``index/tfidf`` over a datastore's finished shards.

    Called by the build (and merge) after the shards are written and before the manifest; safe to re-run.

    Returns:
        ``{"bm25": "index/bm25", "tfidf": "index/tfidf"}``, paths relative to ``out``, for ``Manifest.indexes``.
    """
    datastore = Datastore(out, manifest)
    # The shard checksums identify the articles and their sentences; the model in compute_id is harmless extra.
    return write_sparse_indexes(
        out, datastore.iter_article_texts(), content_id=manifest.compute_id(), bm25=bm25,
        hasher=language_hasher(manifest.language, stopwords),
    )  # fmt: skip


def write_sparse_indexes(
    root: Path,
    articles: Iterable[tuple[str, str]],
    *,
    content_id: str | None = None,
    hasher: NgramHasher | None = None,
    threads: int | None = None,
    index_dir: str = INDEX_DIR,
    bm25: bool = True,
) -> dict[str, str]:
    """Index ``(title, text)`` pairs into ``root/index/bm25`` and ``root/index/tfidf``.

    Args:
        root: the datastore (or any) directory; the indexes go to its ``index/`` folder.
        articles: normalised, unique titles and their text.
        content_id: identifies ``articles``; when given and the indexes on disk were built from the same id with
            the same parameters, they are kept and ``articles`` is not read. Without it the indexes are rebuilt
            and fingerprinted with a hash of the text.
        hasher: the TF-IDF features (default: the bundled stopwords, unigrams + bigrams, 2**24 buckets).
        threads: Lucene indexing threads (default: up to 4, within the CPU quota).
        index_dir: the folder under ``root`` that receives ``bm25/`` and ``tfidf/`` (``add`` writes each datastore
            version's indexes to their own ``index/vN``, so the previous version's stay intact).
        bm25: off: TF-IDF alone (no Lucene, so no Java needed); a ``bm25/`` left by an earlier build is removed.

    Returns:
        ``{"bm25": "index/bm25", "tfidf": "index/tfidf"}`` (with ``index_dir`` in place of ``index``; without
        ``bm25`` when it is off).
    """
    root = Path(root)
    hasher = hasher or default_hasher()
    result = {"bm25": f"{index_dir}/bm25", "tfidf": f"{index_dir}/tfidf"} if bm25 else {"tfidf": f"{index_dir}/tfidf"}
    folder = root / index_dir
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale(folder)
    if not bm25:
        shutil.rmtree(folder / "bm25", ignore_errors=True)  # never served beside a TF-IDF index of other content
    if content_id is not None:
        fingerprint = _fingerprint(content_id, hasher)
        if sparse_indexes_current(root, fingerprint, index_dir, bm25=bm25):
            logger.info("sparse indexes in %s are current (fingerprint %s), kept", folder, fingerprint)
            return result
    timings = _write_indexes(folder, articles, hasher, content_id, threads, bm25=bm25)
    logger.info(logs.summary("sparse indexes", timings))
    return result


def _write_indexes(
    folder: Path, articles: Iterable[tuple[str, str]], hasher: NgramHasher, content_id: str | None,
    threads: int | None, *, bm25: bool,
) -> dict[str, object]:  # fmt: skip
    """Write the indexes into temporary folders beside their places, then move them in: the counts and timings."""
    t0 = time.perf_counter()
    pid = os.getpid()
    docs_dir = folder / f".docs.tmp-{pid}"
    bm25_tmp = folder / f".bm25.tmp-{pid}"
    tfidf_tmp = folder / f".tfidf.tmp-{pid}"
    try:
        with naming_write_errors(folder):
            docs_dir.mkdir()
            tfidf_tmp.mkdir()
            collected = _collect(articles, hasher, docs_dir, pretokenized=_analyzer(hasher.language) == PRETOKENIZED)
            fingerprint = _fingerprint(content_id or collected.content.hexdigest(), hasher)
            n_docs = len(collected.titles)
            t1 = time.perf_counter()
            if bm25:
                analyzer = _analyzer(hasher.language)
                _run_lucene_indexer(docs_dir, bm25_tmp, n_docs, threads or _indexing_threads(), analyzer)
                atomic_write_json(
                    bm25_tmp / BM25_META,
                    {"format": "bertknn-bm25", "version": SPARSE_FORMAT_VERSION, "fingerprint": fingerprint,
                     "documents": n_docs, "pyserini": _pyserini_version(),
                     **({} if analyzer is None else {"analyzer": analyzer, **hasher.to_params()})},
                )  # fmt: skip
            t2 = time.perf_counter()
            _write_tfidf(tfidf_tmp, collected, hasher, fingerprint)
            t3 = time.perf_counter()
            if bm25:
                _install(bm25_tmp, folder / "bm25")
            _install(tfidf_tmp, folder / "tfidf")
    finally:
        for tmp in (docs_dir, bm25_tmp, tfidf_tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return {"articles": n_docs, "read_and_hash_s": round(t1 - t0, 2), "lucene_s": round(t2 - t1, 2) if bm25 else None,
            "tfidf_s": round(t3 - t2, 2), "fingerprint": fingerprint}  # fmt: skip


class _RollingJsonl:
    """JSON lines split over files of ``per_file`` lines (Lucene gives each input file to one thread)."""

    def __init__(self, directory: Path, per_file: int):
        self.directory = directory
        self.per_file = per_file
        self.lines = 0
        self._file: IO[str] | None = None

    def write(self, line: str) -> None:
        if self.lines % self.per_file == 0:
            self.close()
            self._file = open(self.directory / f"docs-{self.lines:09d}.jsonl", "w", encoding="utf-8")  # noqa: SIM115
        assert self._file is not None
        self._file.write(line)
        self.lines += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> _RollingJsonl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _analyzer(language: str) -> str | None:
    """Lucene's analysis of a language: None (Anserini's English default), Anserini's analyzer for it
    (``-language ja``), or `PRETOKENIZED`: the TF-IDF terms, whitespace-separated, for a language it has none for."""
    if language == "en":
        return None
    code = rules_for(language).bm25
    return code if code in ANSERINI_LANGUAGES else PRETOKENIZED


def _collect(
    articles: Iterable[tuple[str, str]], hasher: NgramHasher, docs_dir: Path, *, pretokenized: bool = False
) -> _Collected:
    """One pass over the articles: Lucene's JSONL input files, the TF-IDF counts, the titles, a content hash."""
    out = _Collected()
    seen: set[str] = set()
    with _RollingJsonl(docs_dir, _DOCS_PER_FILE) as docs:
        for chunk in _batched(articles, _CHUNK):
            texts = []
            for title, text in chunk:
                if title in seen:
                    raise SparseIndexError(
                        f"article title {title!r} occurs twice; titles must be unique document ids"
                    )
                seen.add(title)
                contents = f"{title}\n{text}"
                texts.append(contents)
                indexed = " ".join(hasher.terms(contents)) if pretokenized else contents
                line = json.dumps({"id": title, "contents": indexed}, ensure_ascii=False) + "\n"
                docs.write(line)
                out.content.update(line.encode("utf-8"))
                out.titles.append(title)
            out.count_chunks.append(hasher.counts(texts))
    return out


def _write_tfidf(directory: Path, collected: _Collected, hasher: NgramHasher, fingerprint: str) -> None:
    n_docs = len(collected.titles)
    counts = (
        sp.csr_array(sp.vstack(collected.count_chunks, format="csr"))
        if collected.count_chunks
        else sp.csr_array((0, hasher.n_features), dtype=np.float32)
    )
    tables = tfidf_tables(counts)
    write_tfidf_arrays(directory, collected.titles, tables.postings)
    save_npy(directory / TFIDF_BUCKETS, tables.buckets)
    save_npy(directory / TFIDF_IDF, tables.idf)
    atomic_write_json(
        directory / TFIDF_PARAMS,
        {
            "format": "bertknn-tfidf",
            "version": SPARSE_FORMAT_VERSION,
            "fingerprint": fingerprint,
            "n_docs": n_docs,
            "n_buckets": int(len(tables.buckets)),
            "tf": "log1p(count)",
            "idf": "max(0, log((N - df + 0.5) / (df + 0.5)))",
            "hash": "sklearn HashingVectorizer: murmurhash3_32(ngram, seed=0), abs() % n_features, no alternate sign",
            **hasher.to_params(),
        },
    )


def _run_lucene_indexer(docs_dir: Path, index_dir: Path, n_docs: int, threads: int, analyzer: str | None = None) -> None:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise SparseIndexError(
            "Lucene indexing needs a Java 17 runtime for pyserini 0.25 (Debian/Ubuntu: apt-get install "
            "openjdk-17-jdk-headless, or set JAVA_HOME); or build TF-IDF alone (--no-bm25), or no sparse indexes "
            "(--no-sparse-indexes)"
        )
    cmd = [
        sys.executable, "-m", "pyserini.index.lucene",
        "-collection", "JsonCollection",
        "-generator", "DefaultLuceneDocumentGenerator",
        "-input", str(docs_dir),
        "-index", str(index_dir),
        "-threads", str(threads),
        "-memoryBuffer", "512",
        "-optimize",
        *([] if analyzer is None else ["-pretokenized"] if analyzer == PRETOKENIZED else ["-language", analyzer]),
    ]  # fmt: skip
    env = dict(ready_pyserini_env(dict(os.environ)))
    logger.info("Lucene: indexing %d articles with %d threads", n_docs, threads)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace", check=False)
    log = (proc.stdout + proc.stderr).strip()
    # Anserini logs an IOException while writing the index (a full disk) as an ERROR line and still exits 0
    # with "Total N documents indexed", leaving a directory without a segments file: look at the log too.
    errors = [line for line in log.splitlines() if " ERROR " in line]
    if proc.returncode != 0 or errors:
        if "No space left on device" in log or "Disk quota exceeded" in log or "File too large" in log:
            # The JVM's IOException names the errno only in text; report it as the disk-full OSError it is.
            code = errno.EDQUOT if "Disk quota" in log else errno.EFBIG if "File too large" in log else errno.ENOSPC
            raise OSError(code, os.strerror(code), str(index_dir))
        if proc.returncode == 0:
            raise SparseIndexError(f"Lucene indexing into {index_dir} reported an error: {errors[0]}")
        tail = "\n".join(log.splitlines()[-15:])
        hint = ""
        if "UnsupportedClassVersionError" in log or "jdk.incubator.vector" in log:
            hint = " (this pyserini needs a newer Java: pyserini 0.25 runs on JDK 17, 0.35+ needs JDK 21)"
        elif "No module named" in log:
            hint = " (install pyserini==0.25.0 and its Lucene path dependencies: see pyproject.toml)"
        raise SparseIndexError(f"Lucene indexing failed with exit code {proc.returncode}{hint}:\n{tail}")
    logger.debug("Lucene indexer output:\n%s", log)
    if not any(index_dir.glob("segments_*")):
        raise SparseIndexError(f"Lucene indexing left no segments file in {index_dir}; see its log:\n{log[-2000:]}")
    m = re.search(r"Total ([\d,]+) documents? indexed", log)
    if m is not None and int(m.group(1).replace(",", "")) != n_docs:
        raise SparseIndexError(
            f"Lucene indexed {m.group(1)} documents of {n_docs}; see its log:\n"
            + "\n".join(log.splitlines()[-15:])
        )


def _indexing_threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def _pyserini_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pyserini")
    except PackageNotFoundError:
        return None


def _install(tmp: Path, final: Path) -> None:
    """Swap a finished directory into place: the old one is renamed away first, then deleted."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(old, ignore_errors=True)


def _remove_stale(index_dir: Path) -> None:
    """Temporary directories left by an interrupted build (any process id)."""
    for p in index_dir.iterdir():
        if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
