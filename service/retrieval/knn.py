"""kNN restricted to given articles: only their rows are read (memory-mapped), so cost is independent of size."""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from datastore_builder.format import Datastore


@dataclass(frozen=True)
class Neighbours:
    distances: np.ndarray  # float32 [n], squared L2, ascending
    rows: np.ndarray  # int64 [n], global row ids
    labels: np.ndarray  # int32 [n], token id of each neighbour's word

    def __len__(self) -> int:
        return len(self.rows)


EMPTY = Neighbours(np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(0, np.int32))


class RestrictedKnn:
    """Exact squared-L2 search over the rows of a few articles (``faiss.knn`` on their vectors)."""

    def __init__(self, datastore: Datastore):
        self.datastore = datastore

    def search(self, query: np.ndarray, titles: list[str], k: int) -> Neighbours:
        vectors, labels, rows = self.datastore.article_rows(titles)
        if len(rows) == 0:
            return EMPTY
        kk = min(k, len(rows))
        xb = np.ascontiguousarray(vectors, dtype=np.float32)
        xq = np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32)
        # One query against a few thousand rows: a single thread is fastest, and FAISS's own OpenMP team would
        # otherwise spin next to torch's on the same cores (measured: the forward pass ran 2-3x slower).
        faiss.omp_set_num_threads(1)
        dist, idx = faiss.knn(xq, xb, kk)
        idx = idx[0]
        return Neighbours(dist[0].astype(np.float32), rows[idx], labels[idx].astype(np.int32))
