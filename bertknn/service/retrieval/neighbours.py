"""The k nearest stored contexts of a query: among its articles' rows, or over the whole datastore (IVF-PQ)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from bertknn.core.errors import RetrieverUnavailable
from bertknn.core.format import Datastore
from bertknn.service.codec import QueryEncoding
from bertknn.service.results import ArticleHit, Query
from bertknn.service.retrieval.knn import EMPTY, ArticleSearch, Neighbours, RestrictedKnn


class GlobalKnn(Protocol):
    """A whole-datastore index: approximate distances and global row ids (-1 pads)."""

    def search(self, vec: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]: ...


class NeighbourFinder:
    """Restricted kNN over the retrieved articles' rows; whole-datastore search for retriever ``none``."""

    def __init__(self, datastore: Datastore, *, global_knn_factory: Callable[[], GlobalKnn] | None = None):
        self.datastore = datastore
        self.knn = RestrictedKnn(datastore)
        self._global_knn_factory = global_knn_factory or (lambda: _open_global_knn(datastore))
        self._global_knn: GlobalKnn | None = None

    def prepare_search(self, query: Query, articles: list[ArticleHit], *, read: bool = True) -> ArticleSearch | None:
        """The retrieved articles' rows, read and indexed for `neighbours` before the embedding exists (the
        service runs this next to the retrieval, during the forward pass); None when there is nothing to prepare.
        ``read`` False: float16 rows are found but not read (`RestrictedKnn.prepare`)."""
        if query.retriever == "none" or not articles:
            return None
        return self.knn.prepare([a.title for a in articles], query.answer, read=read)

    def neighbours(
        self, query: Query, enc: QueryEncoding, articles: list[ArticleHit], search: ArticleSearch | None = None
    ) -> Neighbours:
        """The k nearest stored contexts among ``articles`` (``search``: their rows from `prepare_search`)."""
        vec = enc.embedding.astype(np.float32)
        if query.retriever == "none":
            return self._global_search(vec, query.k)
        found = self.search_for(query, articles, search)
        return EMPTY if found is None else found.search(vec, query.k)

    def search_for(
        self, query: Query, articles: list[ArticleHit], prepared: ArticleSearch | None = None, *, read: bool = True
    ) -> ArticleSearch | None:
        """The rows the query searches: ``prepared`` when it was made for these articles and answer, else found
        (and with ``read``, read) now (`prepare_search`); None where there is nothing to search."""
        titles = tuple(a.title for a in articles)
        if prepared is not None and prepared.titles == titles and prepared.answer == query.answer:
            return prepared
        return self.prepare_search(query, articles, read=read)

    def _global_search(self, vec: np.ndarray, k: int) -> Neighbours:
        if self._global_knn is None:
            self._global_knn = self._global_knn_factory()
        dist, rows = self._global_knn.search(vec, k)
        keep = rows >= 0
        rows = rows[keep]
        if len(rows) == 0:
            return EMPTY
        # Re-rank the candidates with their stored vectors: p_kNN sees the distances the restricted kNN would
        # compute (exact for fp16; through the datastore's codec otherwise), not IVF-PQ estimates.
        vectors = np.stack([self._row_vector(int(r)) for r in rows]).astype(np.float32)
        exact = ((vectors - vec[None, :]) ** 2).sum(axis=1)
        order = np.argsort(exact, kind="stable")
        rows = rows[order]
        labels = self.datastore.labels_at(rows)
        word = labels >= 0  # (an entity link's anchor-only row is no word)
        return Neighbours(exact[order][word].astype(np.float32), rows[word], labels[word])

    def _row_vector(self, global_row: int) -> np.ndarray:
        pos, row = self.datastore.locate(global_row)
        return self.datastore.float_rows(pos, np.array([row]))[0]

def _open_global_knn(datastore: Datastore) -> GlobalKnn:
    if "ivfpq" not in datastore.manifest.indexes:
        raise RetrieverUnavailable(
            "retriever 'none' needs the whole-datastore IVF-PQ index; build it with "
            "`bert-knn ivfpq DATASTORE` (the datastore this service serves)"
        )
    from bertknn.service.retrieval.global_knn import IvfPqKnn

    return IvfPqKnn(datastore)
