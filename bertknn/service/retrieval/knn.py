"""kNN restricted to given articles: only their rows are read (memory-mapped), so cost is independent of size.

Rows are float16 vectors (searched exactly) or, in a datastore with a codec, codes (searched with FAISS's asymmetric
distance kernels over the codes: `bertknn.core.format.codec`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import faiss
import numpy as np

from bertknn.core.format import Datastore, RowSlice
from bertknn.core.format.codec import CodeSearcher, fp16_index, fp16_index_filled
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
    # float16 rows not read yet (`RestrictedKnn.prepare(read=False)`): read into ``index`` on a first host search
    unread: tuple[RowSlice, ...] = ()

    def __len__(self) -> int:
        return len(self.rows)

    def search(self, query: np.ndarray, k: int) -> Neighbours:
        n = len(self.rows)
        if n == 0:
            return EMPTY
        kk = min(k, n)
        # One query against a few thousand rows: a single thread is fastest, and FAISS's own OpenMP team would
        # otherwise spin next to torch's on the same cores and slow the forward pass.
        q = np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32)
        index = self._float16_index()
        with faiss_threads(1):
            if self.codes is not None:
                assert self.searcher is not None
                d2, i2 = self.searcher.search(self.codes, q, kk)
            elif index is not None:
                d2, i2 = index.search(q, kk)
            else:
                assert self.vectors is not None
                d2, i2 = faiss.knn(q, self.vectors, kk)
        return self.at(d2[0], i2[0])

    def at(self, dist: np.ndarray, idx: np.ndarray) -> Neighbours:
        """The neighbours at row indices ``idx`` (into these rows) with their distances, nearest first."""
        article = self.row_article[idx] if self.row_article is not None else None
        return Neighbours(dist.astype(np.float32), self.rows[idx], self.labels[idx].astype(np.int32), article)

    @property
    def float16(self) -> bool:
        """Whether the rows are float16 vectors (read or not): what a search on the model's device takes."""
        return self.index is not None or bool(self.unread)

    def float16_rows(self) -> np.ndarray | None:
        """The rows as float16 ``[n, hidden]``: a view of the index's codes (read now if they were not), valid
        while this search lives; None for rows under a codec or float32 rows."""
        index = self._float16_index()
        if index is None:
            return None
        n, dim = len(self.rows), index.d
        if n == 0:
            return np.zeros((0, dim), np.float16)
        codes = cast(faiss.IndexScalarQuantizer, index).codes  # (`fp16_index_filled` made it)
        return faiss.rev_swig_ptr(codes.data(), n * dim * 2).view(np.float16).reshape(n, dim)

    def read_float16_into(self, out: np.ndarray) -> None:
        """Copy the float16 rows into ``out`` (``[n, hidden]``): from the shards when they were not read yet (one
        copy, where `float16_rows` would make two), else from the index."""
        if self.unread and self.__dict__.get("_read") is None:
            _gather(list(self.unread), out)
            return
        rows = self.float16_rows()
        if rows is None:
            raise ValueError("these rows are not float16 vectors")
        out[...] = rows

    def _float16_index(self) -> faiss.Index | None:
        """``index``, or the index over the unread rows, read once (a frozen dataclass: kept in ``__dict__``)."""
        if self.index is not None or not self.unread:
            return self.index
        built = self.__dict__.get("_read")
        if built is None:
            slices = list(self.unread)
            built = fp16_index_filled(len(self.rows), slices[0].payload.shape[1], lambda out: _gather(slices, out))
            self.__dict__["_read"] = built
        return built


class RestrictedKnn:
    """Exact squared-L2 search over the rows of a few articles: `prepare` them, then `ArticleSearch.search`."""

    def __init__(self, datastore: Datastore):
        self.datastore = datastore

    def prepare(self, titles: list[str], answer: str = "word", *, read: bool = True) -> ArticleSearch:
        """The articles' rows, read and indexed for `ArticleSearch.search` (titles without rows are left out);
        ``answer``: ``entity`` takes the rows with an entity link only. Float16 rows are copied once, from the
        memory-mapped shards straight into the index (`fp16_index_filled`); with ``read`` False, not yet: a
        search on the model's device that keeps the rows there needs only their ids (`ArticleSearch.unread`)."""
        found = [(i, s) for i, s in enumerate(self.datastore.row_slices(titles, answer)) if s is not None]
        t = tuple(titles)
        if not found:
            return ArticleSearch(t, np.zeros(0, np.int32), np.zeros(0, np.int64), None, None, answer=answer)
        slices = [s for _, s in found]
        labels = np.concatenate([s.labels for s in slices])
        rows = np.concatenate([s.ids for s in slices])
        # each row's article, as an index into ``titles`` (None for a single article: there is nothing to weigh)
        arts = None if len(titles) < 2 else np.repeat(np.array([i for i, _ in found], np.int16), [len(s) for s in slices])
        if self.datastore.code_searcher is not None:
            codes = np.concatenate([s.taken() for s in slices])
            return ArticleSearch(t, labels, rows, None, None, codes, self.datastore.code_searcher, answer, arts)
        if slices[0].payload.dtype == np.float16 and not read:
            return ArticleSearch(t, labels, rows, None, None, answer=answer, row_article=arts, unread=tuple(slices))
        if slices[0].payload.dtype == np.float16:
            index = fp16_index_filled(len(rows), slices[0].payload.shape[1], lambda out: _gather(slices, out))
            return ArticleSearch(t, labels, rows, index, None, answer=answer, row_article=arts)
        vectors = np.concatenate([s.taken() for s in slices]).astype(np.float32)
        return ArticleSearch(t, labels, rows, None, vectors, answer=answer, row_article=arts)


def _gather(slices: list[RowSlice], out: np.ndarray) -> None:
    """The slices' rows, one after the other, into ``out``."""
    at = 0
    for s in slices:
        s.read_into(out[at : at + len(s)])
        at += len(s)
