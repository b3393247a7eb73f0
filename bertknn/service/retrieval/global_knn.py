"""kNN over the whole datastore through its IVF-PQ index: the ``none`` retriever (the paper's ablation)."""

from __future__ import annotations

import logging
from typing import Any

import faiss
import numpy as np

from bertknn.core.errors import DatastoreError
from bertknn.core.format import IVFPQ_FILE, PAPER_NPROBE, Datastore, read_ivfpq_meta

logger = logging.getLogger(__name__)


def _read_index(path: str) -> faiss.Index:
    """Memory-map the index when this faiss can (codes stay in the page cache, shared between processes)."""
    flag = getattr(faiss, "IO_FLAG_MMAP_IFC", None) or faiss.IO_FLAG_MMAP
    try:
        return faiss.read_index(path, flag)
    except RuntimeError:
        return faiss.read_index(path)


class IvfPqKnn:
    """Approximate squared-L2 search over every row of the datastore.

    IVF-PQ distances are PQ estimates (exact for the flat index written for small datastores); the caller
    re-ranks the candidates with their stored vectors when it needs exact distances.
    """

    name = "none"

    def __init__(self, datastore: Datastore, nprobe: int = PAPER_NPROBE):
        root = datastore.root
        rel = datastore.manifest.indexes.get("ivfpq", IVFPQ_FILE)
        path = root / rel
        build_hint = f"build it with `bert-knn ivfpq {root}`"
        if not path.is_file():
            raise DatastoreError(
                f"{path}: no whole-datastore IVF-PQ index (needed by retriever 'none'); {build_hint}"
            )
        meta = read_ivfpq_meta(root, rel)
        if meta.get("content_id") != datastore.manifest.compute_id():
            raise DatastoreError(
                f"{path}: the index was built for other shards than this datastore's; re-{build_hint[1:]}"
            )
        try:
            self.index = _read_index(str(path))
        except RuntimeError as exc:
            raise DatastoreError(f"{path}: faiss cannot read it ({exc}); re-{build_hint[1:]}") from exc
        self.dim = datastore.manifest.model.hidden_size
        if self.index.d != self.dim or self.index.ntotal != datastore.total_rows:
            raise DatastoreError(
                f"{path}: {self.index.ntotal} vectors of dimension {self.index.d}, but the datastore has "
                f"{datastore.total_rows} of dimension {self.dim}; re-{build_hint[1:]}"
            )
        ivf = faiss.try_extract_index_ivf(self.index)
        self.nlist = int(ivf.nlist) if ivf is not None else 0
        self.nprobe = min(max(1, nprobe), self.nlist) if ivf is not None else 0
        if ivf is not None:
            ivf.nprobe = self.nprobe  # set once here: concurrent searches then only read the index
        # Rows of articles a later `add` replaced stay in the index; the search skips them.
        self.skipped = len(datastore.superseded_rows)
        self._params: faiss.SearchParameters | None = None
        if self.skipped:
            batch = faiss.IDSelectorBatch(datastore.superseded_rows)
            self._selectors = (batch, faiss.IDSelectorNot(batch))  # referenced here: faiss does not own them
            params: Any = faiss.SearchParametersIVF() if ivf is not None else faiss.SearchParameters()
            params.sel = self._selectors[1]
            if ivf is not None:
                params.nprobe = self.nprobe
            self._params = params
        logger.info(
            "ivfpq: %s opened (%s, %d rows, %d superseded skipped, nlist %d, nprobe %d)",
            path, type(self.index).__name__, self.index.ntotal, self.skipped, self.nlist, self.nprobe,
        )  # fmt: skip

    def search(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` nearest rows to one query vector.

        Args:
            query: float32 ``[d]`` (or ``[1, d]``), the [MASK] embedding.
            k: neighbours wanted; fewer come back when the datastore (or the probed lists) hold fewer.

        Returns:
            ``(distances, rows)``: float32 squared L2 distances, ascending, and int64 global row ids.
        """
        q = np.ascontiguousarray(query, dtype=np.float32).reshape(1, -1)
        if q.shape[1] != self.dim:
            raise ValueError(f"query has dimension {q.shape[1]}, the index {self.dim}")
        k = min(int(k), int(self.index.ntotal) - self.skipped)
        if k <= 0:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        dist, ids = self.index.search(q, k) if self._params is None else self.index.search(q, k, params=self._params)
        keep = ids[0] >= 0  # faiss pads with -1 when the probed lists hold fewer than k rows
        return dist[0][keep].astype(np.float32), ids[0][keep].astype(np.int64)
