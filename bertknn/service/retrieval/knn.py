"""kNN restricted to given articles: only their rows are read (memory-mapped), so cost is independent of size.

Rows are float16 vectors (searched exactly) or, in a datastore with a codec, codes (searched with FAISS's asymmetric
distance kernels over the codes: `bertknn.core.format.codec`)."""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from bertknn.core.format import Datastore
from bertknn.core.format.codec import CodeSearcher, fp16_index
from bertknn.core.runtime import faiss_threads


@dataclass(frozen=True)
class Neighbours:
    distances: np.ndarray  # float32 [n], squared L2, ascending
    rows: np.ndarray  # int64 [n], global row ids
    labels: np.ndarray  # int32 [n], token id of each neighbour's word
    article: np.ndarray | None = None  # int16 [n]: each neighbour's article, as an index into the articles searched

    def __len__(self) -> int:
        return len(self.rows)


EMPTY = Neighbours(np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(0, np.int32))


def fp16_search(xb16: np.ndarray, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact squared L2 of one float32 query against float16 rows, without converting the rows to float32.

    The rows' bytes become the codes of a FAISS ``QT_fp16`` scalar-quantizer index (a lossless float16 code),
    whose distance kernel reads float16 directly, with neighbours identical to an exact float32 search
    (docs/decisions/fp16-scalar-quantizer-search.md).
    """
    n = len(xb16)
    dist, idx = fp16_index(xb16).search(np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32), min(k, n))
    return dist[0], idx[0]


@dataclass(frozen=True)
class ArticleSearch:
    """The rows of a few articles, ready to be searched: read and indexed before the query's embedding exists
    (the service does it next to the retrieval, while the forward pass runs)."""

    titles: tuple[str, ...]
    labels: np.ndarray  # int32 [n]
    rows: np.ndarray  # int64 [n], global row ids
    index: faiss.Index | None  # float16 rows: a QT_fp16 scalar-quantizer index over them (see `fp16_search`)
    vectors: np.ndarray | None  # other rows: float32, searched with faiss.knn
    codes: np.ndarray | None = None  # a datastore with a codec: the rows' codes, searched by `searcher`
    searcher: CodeSearcher | None = None
    answer: str = "word"  # which rows: words, or entity links (`Datastore.article_rows`)
    row_article: np.ndarray | None = None  # int16 [n]: each row's article, as an index into ``titles``

    def search(self, query: np.ndarray, k: int) -> Neighbours:
        n = len(self.rows)
        if n == 0:
            return EMPTY
        kk = min(k, n)
        # One query against a few thousand rows: a single thread is fastest, and FAISS's own OpenMP team would
        # otherwise spin next to torch's on the same cores and slow the forward pass.
        q = np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32)
        with faiss_threads(1):
            if self.codes is not None:
                assert self.searcher is not None
                d2, i2 = self.searcher.search(self.codes, q, kk)
            elif self.index is not None:
                d2, i2 = self.index.search(q, kk)
            else:
                assert self.vectors is not None
                d2, i2 = faiss.knn(q, self.vectors, kk)
        dist, idx = d2[0], i2[0]
        article = self.row_article[idx] if self.row_article is not None else None
        return Neighbours(dist.astype(np.float32), self.rows[idx], self.labels[idx].astype(np.int32), article)


class RestrictedKnn:
    """Exact squared-L2 search over the rows of a few articles: `prepare` them, then `ArticleSearch.search`."""

    def __init__(self, datastore: Datastore):
        self.datastore = datastore

    def prepare(self, titles: list[str], answer: str = "word") -> ArticleSearch:
        """The articles' rows, read and indexed for `ArticleSearch.search` (titles without rows are left out);
        ``answer``: ``entity`` takes the rows with an entity link only."""
        vectors, labels, rows, arts = self._rows(titles, answer)
        t = tuple(titles)
        if len(rows) == 0:
            return ArticleSearch(t, labels, rows, None, None, answer=answer)
        if self.datastore.code_searcher is not None:
            return ArticleSearch(t, labels, rows, None, None, vectors, self.datastore.code_searcher, answer, arts)
        if vectors.dtype == np.float16:
            return ArticleSearch(t, labels, rows, fp16_index(vectors), None, answer=answer, row_article=arts)
        return ArticleSearch(
            t, labels, rows, None, np.ascontiguousarray(vectors, dtype=np.float32), answer=answer, row_article=arts
        )

    def _rows(
        self, titles: list[str], answer: str
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """`Datastore.article_rows` of the titles, and each row's article as an index into ``titles`` (None for a
        single article: there is nothing to weigh)."""
        if len(titles) < 2:
            return (*self.datastore.article_rows(titles, answer), None)
        per = [self.datastore.article_rows([title], answer) for title in titles]
        arts = np.repeat(np.arange(len(titles), dtype=np.int16), [len(p[2]) for p in per])
        vectors, labels, rows = (np.concatenate([p[i] for p in per]) for i in range(3))
        return vectors, labels, rows, arts
