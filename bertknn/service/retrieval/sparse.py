"""Article rankers for the service: BM25 over the Lucene index (pyserini) and DrQA-style TF-IDF.

Both read the indexes that ``bertknn.builder.sparse_index`` writes (its docstring documents the formats).
Construct each once at start-up and share it: the constructors pay the loading cost (for BM25, pyserini's
import and the JVM, seconds and hundreds of MB, once per process); ``top_articles`` is then cheap and may be
called from worker threads.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from bertknn.core.errors import RetrieverUnavailable, SparseIndexError
from bertknn.core.format.sparse import (
    BM25_META,
    PRETOKENIZED,
    SPARSE_FORMAT_VERSION,
    TFIDF_BUCKETS,
    TFIDF_DATA,
    TFIDF_IDF,
    TFIDF_INDICES,
    TFIDF_INDPTR,
    TFIDF_PARAMS,
    TFIDF_TITLE_OFFSETS,
    TFIDF_TITLES,
    NgramHasher,
)
from bertknn.core.lucene import ready_pyserini_env
from bertknn.core.text import is_punctuation, retrieval_text
from bertknn.core.topk import top_entries

logger = logging.getLogger(__name__)

_WORD = re.compile(r"\w")


@runtime_checkable
class Retriever(Protocol):
    """Ranks the datastore's articles for a cloze question."""

    name: str
    # True: its search is this interpreter's work, holding the GIL; False: it runs outside it (the JVM), so a
    # thread of its own overlaps it with the model thread's Python
    in_process: bool

    def top_articles(self, query: str, n: int) -> list[tuple[str, float]]:
        """Up to ``n`` ``(normalised title, score)`` pairs, best first; ``[MASK]`` in ``query`` is ignored."""
        ...


PYSERINI_MISSING = (
    "the bm25 retriever needs pyserini 0.25 and a JDK 17, which are not installed: "
    "pip install --no-deps pyserini==0.25.0 pyjnius (scripts/bootstrap.sh does it), or ask for retriever 'tfidf'"
)


class UnavailableRetriever:
    """Stands in for a retriever whose index exists but whose software is missing: every request for it gets
    a `RetrieverUnavailable` that says what to install; the other retrievers keep working."""

    in_process = True  # (it only raises)

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason

    def top_articles(self, query: str, n: int) -> list[tuple[str, float]]:
        raise RetrieverUnavailable(self.reason)


def pyserini_installed() -> bool:
    return importlib.util.find_spec("pyserini") is not None


_PYSERINI_LOCK = threading.Lock()
_LUCENE_SEARCHER_CLASS: Any = None


def _lucene_searcher_class() -> Any:
    """pyserini's ``LuceneSearcher``, imported once per process (this import starts the JVM)."""
    global _LUCENE_SEARCHER_CLASS
    with _PYSERINI_LOCK:
        if _LUCENE_SEARCHER_CLASS is None:
            ready_pyserini_env()
            try:
                from pyserini.search.lucene import LuceneSearcher
            except ImportError as exc:
                raise SparseIndexError(
                    f"the bm25 retriever needs pyserini 0.25 ({exc}); install it (see pyproject.toml), or serve "
                    "with another retriever"
                ) from exc
            except Exception as exc:  # JVM start failures surface from pyjnius as various exception types
                raise SparseIndexError(
                    f"pyserini could not start the Java VM ({exc}); pyserini 0.25 needs JDK 17 "
                    "(apt-get install openjdk-17-jdk-headless, or set JAVA_HOME)"
                ) from exc
            _LUCENE_SEARCHER_CLASS = LuceneSearcher
        return _LUCENE_SEARCHER_CLASS


class Bm25Retriever:
    """BM25 (Anserini's defaults, k1 = 0.9, b = 0.4) over ``index/bm25``; Lucene docids are the titles.

    Searches are serialised by a lock. Java code runs without the GIL, so unlocked searches could overlap,
    but one takes about a millisecond against tens for the model's forward pass, so serialising them costs
    nothing measurable, and correctness then does not rest on the undocumented thread-safety of Anserini's
    ``SimpleSearcher``. Any thread may call ``top_articles`` (pyjnius attaches it to the JVM).
    """

    name = "bm25"
    in_process = False

    def __init__(self, index_dir: Path):
        self.index_dir = Path(index_dir)
        if not (self.index_dir / BM25_META).is_file():
            raise SparseIndexError(
                f"{self.index_dir}: no BM25 index (missing {BM25_META}); rebuild the datastore with sparse indexes"
            )
        meta = json.loads((self.index_dir / BM25_META).read_text(encoding="utf-8"))
        searcher_class = _lucene_searcher_class()
        try:
            self._searcher: Any = searcher_class(str(self.index_dir))
        except Exception as exc:  # a Java exception (corrupt or foreign index) arrives as JavaException
            raise SparseIndexError(
                f"{self.index_dir}: Lucene cannot open the index ({exc}); rebuild it"
            ) from exc
        self.num_docs = int(self._searcher.num_docs)
        if self.num_docs != meta.get("documents"):
            raise SparseIndexError(
                f"{self.index_dir}: Lucene holds {self.num_docs} documents, {BM25_META} says "
                f"{meta.get('documents')}; rebuild the sparse indexes"
            )
        self._lock = threading.Lock()
        self._terms = self._set_analyzer(meta)
        self._searcher.search("warm up", k=1)  # the first search loads Lucene's classes: not on a request
        logger.info("bm25: %s opened, %d articles", self.index_dir, self.num_docs)

    def _set_analyzer(self, meta: dict) -> NgramHasher | None:
        """Query analysis as the index was built: Anserini's analyzer for its language (``analyzer``: ``ja``),
        or whitespace over the TF-IDF terms (`PRETOKENIZED`, whose hasher is returned); English by default."""
        analyzer = meta.get("analyzer")
        if analyzer is None:
            return None
        if analyzer != PRETOKENIZED:
            self._searcher.set_language(str(analyzer))
            return None
        from jnius import autoclass

        self._searcher.set_analyzer(autoclass("org.apache.lucene.analysis.core.WhitespaceAnalyzer")())
        return NgramHasher.from_params(meta, self.index_dir / BM25_META)

    def top_articles(self, query: str, n: int) -> list[tuple[str, float]]:
        text = retrieval_text(query)
        if n <= 0 or not _WORD.search(text):
            return []
        if self._terms is not None:
            text = " ".join(t for t in self._terms.terms(text) if not is_punctuation(t))
            if not text:
                return []
        with self._lock:
            if self._searcher is None:
                raise SparseIndexError(f"{self.index_dir}: this BM25 retriever was closed")
            hits = self._searcher.search(text, k=n)
            return [(str(h.docid), float(h.score)) for h in hits]

    def close(self) -> None:
        with self._lock:
            if self._searcher is not None:
                self._searcher.close()
                self._searcher = None


class TfidfRetriever:
    """DrQA's TF-IDF ranking over ``index/tfidf``: hashed unigrams + bigrams, ``log(1 + tf) * idf`` dot product."""

    name = "tfidf"
    in_process = True

    def __init__(self, index_dir: Path):
        self.index_dir = Path(index_dir)
        params_path = self.index_dir / TFIDF_PARAMS
        if not params_path.is_file():
            raise SparseIndexError(
                f"{self.index_dir}: no TF-IDF index (missing {TFIDF_PARAMS}); rebuild the datastore with sparse indexes"
            )
        try:
            params = json.loads(params_path.read_text(encoding="utf-8"))
            if params.get("format") != "bertknn-tfidf":
                raise ValueError(f"format {params.get('format')!r}")
            if params.get("version") != SPARSE_FORMAT_VERSION:
                raise SparseIndexError(
                    f"{self.index_dir}: TF-IDF index version {params.get('version')}, this code reads "
                    f"{SPARSE_FORMAT_VERSION}; convert the datastore: bert-knn upgrade DATASTORE"
                )
            self.hasher = NgramHasher.from_params(params, params_path)

            def mapped(name: str) -> np.ndarray:
                return np.asarray(np.load(self.index_dir / name, mmap_mode="r", allow_pickle=False))

            # every array memory-mapped: start-up reads their headers, a query pages in its own buckets' postings
            self._title_bytes = np.asarray(np.memmap(self.index_dir / TFIDF_TITLES, dtype=np.uint8, mode="r")) if (
                self.index_dir / TFIDF_TITLES).stat().st_size else np.zeros(0, np.uint8)  # fmt: skip
            self._title_offsets = mapped(TFIDF_TITLE_OFFSETS)
            self.buckets = mapped(TFIDF_BUCKETS)
            self.idf = mapped(TFIDF_IDF)
            self.indptr = mapped(TFIDF_INDPTR)
            self.indices = mapped(TFIDF_INDICES)
            self.data = mapped(TFIDF_DATA)
        except (OSError, ValueError, KeyError) as exc:
            raise SparseIndexError(
                f"{self.index_dir}: unreadable TF-IDF index ({exc}); rebuild the sparse indexes"
            ) from exc
        n_docs = len(self._title_offsets) - 1
        n_buckets = len(self.buckets)
        if not (
            n_docs == params.get("n_docs")
            and len(self.idf) == n_buckets == len(self.indptr) - 1
            and len(self.indices) == len(self.data) == (int(self.indptr[-1]) if n_buckets else 0)
        ):
            raise SparseIndexError(
                f"{self.index_dir}: sizes disagree (titles {n_docs}, buckets {n_buckets}, idf {len(self.idf)}, "
                f"indptr {len(self.indptr)}, postings {len(self.indices)}/{len(self.data)}); rebuild the sparse indexes"
            )
        self.n_docs = n_docs
        logger.info("tfidf: %s opened, %d articles, %d buckets", self.index_dir, n_docs, n_buckets)

    def titles(self) -> list[str]:
        """Every indexed title, in column order (reads them all: for checks and tools, not for queries)."""
        return [self.title(j) for j in range(self.n_docs)]

    def title(self, doc: int) -> str:
        a, b = int(self._title_offsets[doc]), int(self._title_offsets[doc + 1])
        return self._title_bytes[a:b].tobytes().decode("utf-8")

    def query_vector(self, query: str) -> tuple[np.ndarray, np.ndarray]:
        """Rows of the postings matrix the query touches and their weights ``log(1 + tf) * idf``."""
        buckets, counts = self.hasher.query_counts(retrieval_text(query))
        if len(buckets) == 0 or len(self.buckets) == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        rows = np.minimum(np.searchsorted(self.buckets, buckets), len(self.buckets) - 1)
        known = self.buckets[rows] == buckets  # buckets no document has score nothing
        rows = rows[known]
        weights = np.log1p(counts[known]).astype(np.float32) * self.idf[rows]
        nonzero = weights > 0
        return rows[nonzero], weights[nonzero]

    def top_articles(self, query: str, n: int) -> list[tuple[str, float]]:
        rows, weights = self.query_vector(query)
        if n <= 0 or len(rows) == 0:
            return []
        # the dot product over the query's buckets only: their postings lists, read from the mapped arrays
        starts, ends = self.indptr[rows], self.indptr[rows + 1]
        docs_parts = [self.indices[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        if not any(len(d) for d in docs_parts):
            return []
        docs_all = np.concatenate(docs_parts)
        vals_all = np.concatenate([
            self.data[a:b] * w for a, b, w in zip(starts.tolist(), ends.tolist(), weights.tolist(), strict=True)
        ])  # fmt: skip
        docs, inverse = np.unique(docs_all, return_inverse=True)
        values = np.bincount(inverse, weights=vals_all, minlength=len(docs)).astype(np.float32)
        top, order = top_entries(values, n)  # best first; ties by document order (docs ascending): stable results
        return [(self.title(int(d)), float(v)) for d, v in zip(docs[order].tolist(), top.tolist(), strict=True)]
