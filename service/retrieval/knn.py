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


def fp16_search(xb16: np.ndarray, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact squared L2 of one float32 query against float16 rows, without converting the rows to float32.

    The rows' bytes become the codes of a FAISS ``QT_fp16`` scalar-quantizer index (a lossless float16 code),
    whose distance kernel reads float16 directly: ``python -m bench.knn_calls`` measured it 4-20x faster than
    converting to float32 for ``faiss.knn`` (the fastest of the other calls), with identical neighbours.
    """
    n, dim = xb16.shape
    index = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_L2)
    faiss.copy_array_to_vector(np.ascontiguousarray(xb16, dtype=np.float16).view(np.uint8).reshape(-1), index.codes)
    index.ntotal = n
    dist, idx = index.search(np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32), min(k, n))
    return dist[0], idx[0]


class RestrictedKnn:
    """Exact squared-L2 search over the rows of a few articles (`fp16_search` on their float16 vectors)."""

    def __init__(self, datastore: Datastore):
        self.datastore = datastore

    def search(self, query: np.ndarray, titles: list[str], k: int) -> Neighbours:
        vectors, labels, rows = self.datastore.article_rows(titles)
        if len(rows) == 0:
            return EMPTY
        kk = min(k, len(rows))
        # One query against a few thousand rows: a single thread is fastest, and FAISS's own OpenMP team would
        # otherwise spin next to torch's on the same cores (measured: the forward pass ran 2-3x slower).
        faiss.omp_set_num_threads(1)
        if vectors.dtype == np.float16:
            dist, idx = fp16_search(vectors, query, kk)
        else:
            xb = np.ascontiguousarray(vectors, dtype=np.float32)
            d2, i2 = faiss.knn(np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32), xb, kk)
            dist, idx = d2[0], i2[0]
        return Neighbours(dist.astype(np.float32), rows[idx], labels[idx].astype(np.int32))
