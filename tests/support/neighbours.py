"""Comparing a search's neighbours with the host's FAISS search: the same distances, and the same neighbours in the
same order except among equal distances (a tiny random model's hidden states have some ties)."""

from __future__ import annotations

import numpy as np

from bertknn.service.retrieval.knn import Neighbours


def assert_same_neighbours(got: Neighbours, want: Neighbours) -> None:
    np.testing.assert_allclose(got.distances, want.distances, rtol=1e-4, atol=1e-6)
    tied = np.isclose(np.diff(want.distances), 0, rtol=0, atol=1e-7)
    untied = ~(np.r_[tied, False] | np.r_[False, tied])
    assert set(got.rows.tolist()) == set(want.rows.tolist())
    np.testing.assert_array_equal(got.rows[untied], want.rows[untied])
