"""What every LAMA run shares: its settings, the runner contract and the gold's rank under a distribution."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from bertknn.evaluation.lama import LamaQuery
from bertknn.evaluation.metrics import QueryResult
from bertknn.service.interpolate import DEFAULT_ARTICLE_SHARPNESS, DEFAULT_MLM_PRIOR, rank_of
from bertknn.service.results import RetrieverName


@dataclass(frozen=True)
class RunSettings:
    """The pipeline knobs of one evaluation run (defaults: the service's)."""

    retriever: RetrieverName = "bm25"
    num_articles: int = 3
    k: int = 128
    temperature: float | None = None  # None: auto, the datastore's own (the service's default)
    lambda_: float = 0.3
    mlm_prior: float = DEFAULT_MLM_PRIOR  # 0: the paper's plain vote
    article_sharpness: float = DEFAULT_ARTICLE_SHARPNESS  # 0: every retrieved article counts the same
    batch_size: int = 32

    def with_(self, **changes: object) -> RunSettings:
        return replace(self, **changes)  # type: ignore[arg-type]


def gold_rank(p: np.ndarray, gold_id: int, allowed: np.ndarray | None = None) -> int | None:
    """1-based rank of the gold id under ``p`` (ties: lower id first, as `top_k`); None when p(gold) is 0.

    ``allowed`` (sorted ids) restricts the ranking to a sub-vocabulary, as LAMA's common vocabulary does. A
    zero probability is no rank at all: an empty p_kNN must not "rank" low ids by tie-breaking.
    """
    if p[gold_id] <= 0:
        return None
    if allowed is None:
        return rank_of(p, gold_id)
    pos = int(np.searchsorted(allowed, gold_id))
    if pos >= len(allowed) or allowed[pos] != gold_id:
        raise ValueError(f"gold id {gold_id} is outside the restricted vocabulary")
    return rank_of(p[allowed], pos)


class Runner(Protocol):
    def run(self, queries: Sequence[LamaQuery], settings: RunSettings) -> list[QueryResult]: ...
