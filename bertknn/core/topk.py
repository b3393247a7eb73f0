"""The k largest entries of a row: the one top-k of the project, with one tie rule.

The rule: largest first; among equal values the smaller id first, and at the boundary the smaller ids are the
ones kept. `top_entries` ranks (answers, p_MLM heads), `top_set` keeps the same entries in id order (the cached
p_MLM head), `top_set_torch` does what `top_set` does where a forward ran (a GPU), so that only the kept entries
leave the device.
"""

from __future__ import annotations

import numpy as np
import torch

# Rows shorter than this are ranked by one stable sort of the whole row (the answer's few hundred candidates):
# there, finding candidates first costs more than the sort it saves.
SORT_WHOLE_BELOW = 512


def _candidates(row: np.ndarray, k: int) -> np.ndarray:
    """Ids (ascending) of at least the ``k`` largest entries of ``row`` (0 < k < len(row)), about 1.5 k of them:
    a threshold taken from every 8th entry, or the k-th largest value itself when that keeps too few."""
    n = len(row)
    sample = row[::8]
    m = min(len(sample), k // 8 + k // 16 + 1)  # about 1.5 k rows are expected at or above the threshold
    cand = np.flatnonzero(row >= np.partition(sample, len(sample) - m)[len(sample) - m])
    if len(cand) < k:
        cand = np.flatnonzero(row >= np.partition(row, n - k)[n - k])
    return cand


def top_entries(log_probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest entries of one row: (values, ids int64), largest first, ties by smaller id. The values keep
    the row's float dtype (float32 or float64), so that no two of them are made equal by a conversion.

    Exact, and faster than ``argpartition`` over the whole vocabulary: `_candidates` keeps about 1.5 ``k``
    candidates in id order, and a sort of those orders them. A row shorter than `SORT_WHOLE_BELOW` is sorted whole.
    """
    row = np.asarray(log_probs)
    if row.dtype.kind != "f":
        row = row.astype(np.float32)
    n = len(row)
    k = min(k, n)
    if k <= 0:
        return np.zeros(0, row.dtype), np.zeros(0, np.int64)
    if n < SORT_WHOLE_BELOW:  # the rule itself: a stable sort keeps equal values in id order
        whole = np.argsort(-row, kind="stable")[:k]
        return row[whole], whole.astype(np.int64)
    cand = _candidates(row, k) if k < n else np.arange(n)
    values = row[cand]
    # numpy's default sort is several times faster than its stable sort (SIMD), but it leaves equal values in
    # any order, and equal float32 log-probabilities are common among thousands. So: sort by value, then put
    # each run of equal values among the first k (the run at the boundary whole) in id order; candidates are
    # in id order, so an index order is an id order.
    order = np.argsort(-values)
    neg = -values[order]
    end = int(np.searchsorted(neg, neg[k - 1], side="right"))  # through the end of the k-th value's run
    head, neg = order[:end], neg[:end]
    if (neg[1:] == neg[:-1]).any():
        run = np.concatenate(([0], np.cumsum(neg[1:] != neg[:-1])))
        head = head[np.argsort(run * len(values) + head)]
    order = head[:k]
    return values[order], cand[order].astype(np.int64)


def top_set(log_probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The same ``k`` entries as `top_entries` (the k largest, ties at the boundary by smaller id), in id order.

    For callers that need the set and not its order (the service's cached p_MLM head): no sort of the
    candidates, which cost about as much as finding them.
    """
    row = np.asarray(log_probs, dtype=np.float32)
    n = len(row)
    k = min(k, n)
    if k <= 0:
        return np.zeros(0, np.float32), np.zeros(0, np.int64)
    if k == n:
        return row.copy(), np.arange(n, dtype=np.int64)
    cand = _candidates(row, k)
    values = row[cand]
    if len(cand) > k:
        kth = np.partition(values, len(values) - k)[len(values) - k]  # the k-th largest value
        keep = values > kth
        short = k - int(np.count_nonzero(keep))  # entries equal to it that still fit: the smallest ids
        if short:
            keep[np.flatnonzero(values == kth)[:short]] = True
        cand, values = cand[keep], values[keep]
    return values, cand.astype(np.int64)


def top_set_torch(log_probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_set` of each row of a 2-D tensor, on its device: (values [n, k], ids [n, k]), ids ascending per row.

    ``torch.topk`` finds the k-th largest value; every entry above it is kept, and of the entries equal to it, the
    smaller ids, as many as still fit (``torch.topk`` alone keeps ties at the boundary in an unspecified order).
    """
    n, vocab = log_probs.shape
    k = min(k, vocab)
    if k <= 0 or n == 0:
        return log_probs.new_zeros((n, 0)), torch.zeros((n, 0), dtype=torch.int64, device=log_probs.device)
    kth = torch.topk(log_probs, k, dim=-1).values[:, -1:]
    above = log_probs > kth
    tied = log_probs == kth
    room = k - above.sum(dim=-1, keepdim=True)
    keep = above | (tied & (torch.cumsum(tied, dim=-1) <= room))
    ids = keep.nonzero()[:, 1].view(n, k)  # row-major: each row's kept ids, ascending
    return log_probs.gather(1, ids), ids
