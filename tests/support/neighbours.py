"""Comparing a search's neighbours with the host's FAISS search: the same distances, and the same neighbours in the
same order except among distances equal within the comparison's tolerance. A tiny random model's hidden states are
close together, so float rounding can order near-ties either way, also at the k-th neighbour, where a row just
outside the list can take the last place."""

from __future__ import annotations

import numpy as np

from bertknn.service.retrieval.knn import Neighbours

RTOL, ATOL = 1e-4, 1e-6


def _tolerance(distances: np.ndarray) -> np.ndarray:
    return ATOL + RTOL * np.abs(distances)


def _clearly_inside(distances: np.ndarray) -> np.ndarray:
    """Where a neighbour is nearer than the k-th by more than the tolerance, so no row outside the list ties it."""
    return distances < distances[-1] - (ATOL + RTOL * abs(distances[-1]))


def assert_same_neighbours(got: Neighbours, want: Neighbours) -> None:
    np.testing.assert_allclose(got.distances, want.distances, rtol=RTOL, atol=ATOL)
    d, gd = (np.asarray(n.distances, dtype=np.float64) for n in (want, got))
    if not len(d):
        assert not len(got.rows)
        return
    tol = _tolerance(d)
    tied = np.abs(np.diff(d)) <= np.maximum(tol[:-1], tol[1:])
    inside = _clearly_inside(d)
    untied = ~(np.r_[tied, False] | np.r_[False, tied]) & inside
    np.testing.assert_array_equal(got.rows[untied], want.rows[untied])
    assert set(want.rows[inside].tolist()) <= set(got.rows.tolist())
    assert set(got.rows[_clearly_inside(gd)].tolist()) <= set(want.rows.tolist())
