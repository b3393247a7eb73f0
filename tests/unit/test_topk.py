"""One top-k, one tie rule (largest first, equal values by smaller id, the smaller ids kept at the boundary), the same
from every caller: `bertknn.core.topk` on the host and on a tensor, the answer's `top_k` and `top_k_among`, a cached
encoding's ranked ids and the sparse retrievers' article ranking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bertknn.core.topk import top_entries, top_set, top_set_torch
from bertknn.service.interpolate import top_k, top_k_among


def _reference(row: np.ndarray, k: int) -> list[int]:
    """The rule written plainly: a stable sort by decreasing value keeps equal values in id order."""
    return np.argsort(-row, kind="stable")[:k].tolist()


def _rows() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    rows = []
    for vocab in (5, 64, 3000):
        for levels in (2, 7, 1000):  # few distinct values: ties everywhere, at the boundary too
            rows.append(rng.integers(0, levels, vocab).astype(np.float32) / levels)
        rows.append(rng.permutation(vocab).astype(np.float32) / vocab)  # no tie anywhere
    rows.append(np.zeros(50, np.float32))
    return rows


@pytest.mark.parametrize("k", [1, 3, 17, 200, 5000])
def test_every_top_k_keeps_the_same_entries_in_the_same_order(k: int) -> None:
    for row in _rows():
        want = _reference(row, k)
        values, ids = top_entries(row, k)
        assert ids.tolist() == want
        assert values.tolist() == row[want].tolist()
        assert [i for i, _ in top_k(row, k)] == want
        assert [i for i, _ in top_k_among(np.arange(len(row)), row, k, None) or []] == want
        set_values, set_ids = top_set(row, k)
        assert set_ids.tolist() == sorted(want) and set_values.tolist() == row[sorted(want)].tolist()


@pytest.mark.parametrize("k", [1, 3, 17, 200])
def test_the_tensor_top_set_keeps_the_host_s_entries(k: int) -> None:
    rows = [r for r in _rows() if len(r) == 64]
    batch = torch.from_numpy(np.stack(rows))
    values, ids = top_set_torch(batch, k)
    for row, v, i in zip(rows, values.numpy(), ids.numpy(), strict=True):
        host_values, host_ids = top_set(row, k)
        assert i.tolist() == host_ids.tolist()
        assert v.tolist() == host_values.tolist()


def test_top_k_among_ranks_ids_not_positions() -> None:
    ids = np.array([3, 10, 11, 40])
    values = np.array([0.2, 0.5, 0.2, 0.5], np.float32)
    assert top_k_among(ids, values, 3, None) == [(10, 0.5), (40, 0.5), (3, pytest.approx(0.2))]
    assert top_k_among(ids, values, 3, 0.3) is None  # the third listed value does not beat the rest


def test_float64_values_are_not_merged_by_a_conversion() -> None:
    row = np.array([1.0, 1.0 + 1e-12, 0.5])
    assert top_entries(row, 1)[1].tolist() == [1]
    counts = np.array([1, 3, 2])  # integers (counts, votes) are ranked as float32 values
    values, ids = top_entries(counts, 2)
    assert values.dtype == np.float32 and values.tolist() == [3.0, 2.0] and ids.tolist() == [1, 2]


def test_a_cached_encoding_ranks_its_ids_by_the_same_rule() -> None:
    from bertknn.service.codec import QueryEncoding

    ids = np.array([2, 5, 9, 12], np.int64)
    probs = np.array([0.25, 0.5, 0.25, 0.5], np.float16)
    enc = QueryEncoding(np.zeros(4, np.float32), ids, probs, 20)
    assert enc.ranked_ids().tolist() == [5, 12, 2, 9]


def test_k_zero_or_an_empty_batch_keeps_nothing_of_the_row_s_type() -> None:
    row = np.arange(600, dtype=np.float64)  # long enough for the candidates' path
    for k in (0, -3):
        values, ids = top_entries(row, k)
        assert values.shape == ids.shape == (0,) and values.dtype == np.float64 and ids.dtype == np.int64
        values, ids = top_set(row, k)
        assert values.shape == ids.shape == (0,) and ids.dtype == np.int64
        values, ids = top_set_torch(torch.from_numpy(np.stack([row, row])), k)
        assert tuple(values.shape) == tuple(ids.shape) == (2, 0) and ids.dtype == torch.int64
    values, ids = top_set_torch(torch.zeros((0, 600)), 5)
    assert tuple(values.shape) == tuple(ids.shape) == (0, 0)
