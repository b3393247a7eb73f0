"""bench.calibration's likelihoods, against the service's own p_kNN and closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.calibration import knn_gold, mixture_ll
from bertknn.service.interpolate import knn_sparse


def test_knn_gold_is_the_services_p_knn_of_the_contexts_word() -> None:
    rng = np.random.default_rng(11)
    distances, matches, golds, labels_all = [], [], [], []
    for _ in range(30):
        n = int(rng.integers(1, 20))
        d = np.sort(rng.uniform(40, 160, n)).astype(np.float32)
        labels = rng.integers(0, 5, n)
        gold = int(rng.integers(0, 6))  # 5: a word no neighbour carries
        distances.append(d)
        matches.append(labels == gold)
        golds.append(gold)
        labels_all.append(labels)
    scales = np.array([float(np.median(d)) for d in distances])
    got = knn_gold(distances, matches, scales, 0.15)
    for i, (d, labels, gold) in enumerate(zip(distances, labels_all, golds, strict=True)):
        ids, probs = knn_sparse(d, labels, 0.15 * scales[i])
        want = float(probs[ids == gold][0]) if gold in ids else 0.0
        assert got[i] == pytest.approx(want, rel=1e-5, abs=1e-12)


def test_mixture_ll_is_the_mean_log_probability_of_the_mixture() -> None:
    pk = np.array([0.5, 0.0, 1.0])
    pm = np.array([0.1, 0.2, 0.0])
    want = (math.log(0.3 * 0.5 + 0.7 * 0.1) + math.log(0.7 * 0.2) + math.log(0.3)) / 3
    assert mixture_ll(pk, pm, 0.3) == pytest.approx(want)
    assert mixture_ll(pk, pm, 1.0) == -math.inf  # the second word gets no kNN mass
    assert mixture_ll(pk, pm, 0.0) == -math.inf  # the third gets no MLM mass
