"""Pure functions: neighbour distances -> p_kNN, mixing with p_MLM, top-k."""

from __future__ import annotations

import numpy as np


def knn_distribution(distances: np.ndarray, labels: np.ndarray, vocab_size: int, temperature: float) -> np.ndarray:
    """p_kNN(w) = sum over neighbours labelled w of softmax(-d / l), computed stably.

    The softmax is taken in log space (log-sum-exp over all neighbours), so every weight is exp of a number
    <= 0: huge distances underflow to 0 instead of overflowing. Every neighbour counts (a sum per word,
    not the nearest one per word). Returns zeros when there are no neighbours.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    p = np.zeros(vocab_size, dtype=np.float64)
    if len(distances) == 0:
        return p.astype(np.float32)
    logits = -np.asarray(distances, dtype=np.float64) / temperature
    top = logits.max()
    log_z = top + np.log(np.exp(logits - top).sum())
    np.add.at(p, np.asarray(labels, dtype=np.int64), np.exp(logits - log_z))
    return p.astype(np.float32)


def interpolate(p_knn: np.ndarray, p_mlm: np.ndarray, lam: float) -> np.ndarray:
    """p = lam * p_kNN + (1 - lam) * p_MLM over the whole vocabulary."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError("lambda must be in [0, 1]")
    return (lam * p_knn.astype(np.float64) + (1.0 - lam) * p_mlm.astype(np.float64)).astype(np.float32)


def top_k(p: np.ndarray, k: int, *, nonzero: bool = False) -> list[tuple[int, float]]:
    """The k most probable ids, most probable first (ties by lower id); ``nonzero`` drops zero entries."""
    k = min(k, len(p))
    if k <= 0:
        return []
    idx = np.argpartition(-p, k - 1)[:k]
    idx = idx[np.lexsort((idx, -p[idx]))]
    return [(int(i), float(p[i])) for i in idx if not nonzero or p[i] > 0]


def rank_of(p: np.ndarray, token_id: int) -> int:
    """1-based rank of ``token_id`` under ``p`` (ties broken by lower id, as in `top_k`)."""
    v = p[token_id]
    return int(np.count_nonzero(p > v) + np.count_nonzero(p[:token_id] == v) + 1)
