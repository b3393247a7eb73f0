"""Hyper-parameter search over the paper's grid (N articles, lambda, k, temperature l), cheaply.

Each query costs one forward pass and one retrieval (with the largest N), and one restricted kNN search per N
(with the largest k); every other grid point is recomputed from those neighbours with the pure functions of
`bertknn.service.interpolate`, exactly as the pipeline computes an answer: the k nearest are a prefix of the 512 nearest,
and the first n articles of the N=5 retrieval are the articles an N=n query searches (the ranker's order; a query
whose subject has its own article searches that article alone, whatever N).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from bertknn.evaluation.base import RunSettings, gold_rank
from bertknn.evaluation.lama import LamaQuery
from bertknn.evaluation.metrics import KS, Precisions
from bertknn.service.answer import knn_offsets
from bertknn.service.codec import QueryEncoding
from bertknn.service.interpolate import (
    DEFAULT_ARTICLE_SHARPNESS,
    DEFAULT_MLM_PRIOR,
    interpolate,
    knn_sparse,
    weigh_vote,
)
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import ArticleHit, Query, RetrieverName
from bertknn.service.retrieval.knn import Neighbours

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GridSpace:
    """The paper's grid: N 1-5, lambda 0.2-0.8 (step 0.1), k 64/128/512, l 5-12."""

    num_articles: tuple[int, ...] = (1, 2, 3, 4, 5)
    lambdas: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
    ks: tuple[int, ...] = (64, 128, 512)
    temperatures: tuple[float, ...] = (5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0)

    def __post_init__(self) -> None:
        if not (self.num_articles and self.lambdas and self.ks and self.temperatures):
            raise ValueError("every grid axis needs at least one value")
        if min(self.num_articles) < 1 or min(self.ks) < 1 or min(self.temperatures) <= 0:
            raise ValueError("N and k must be >= 1 and l > 0")
        if not all(0.0 <= lam <= 1.0 for lam in self.lambdas):
            raise ValueError("lambda values must lie in [0, 1]")


@dataclass(frozen=True)
class GridPoint:
    num_articles: int | None  # None when there is no retrieval (kNN over the whole datastore)
    lambda_: float
    k: int
    temperature: float

    def apply(self, settings: RunSettings) -> RunSettings:
        changes: dict[str, object] = {"lambda_": self.lambda_, "k": self.k, "temperature": self.temperature}
        if self.num_articles is not None:
            changes["num_articles"] = self.num_articles
        return settings.with_(**changes)

    def as_dict(self) -> dict[str, object]:
        return {
            "num_articles": self.num_articles,
            "lambda": self.lambda_,
            "k": self.k,
            "temperature": self.temperature,
        }


@dataclass(frozen=True)
class GridResult:
    best: GridPoint
    ranking: list[tuple[GridPoint, Precisions]]  # every point with its macro P@k (bert_knn), best first
    queries: int
    relations: int
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def format(self, top: int = 10) -> str:
        lines = [
            f"grid search on the dev split: {self.queries} queries, {self.relations} relations, "
            f"{len(self.ranking)} settings, {self.seconds:.1f} s; macro P@k of bert_knn",
            f"{'rank':>4} {'N':>4} {'lambda':>7} {'k':>5} {'l':>5} | {'P@1':>6} {'P@5':>6} {'P@10':>6}",
        ]
        for i, (pt, p) in enumerate(self.ranking[:top], 1):
            n = "-" if pt.num_articles is None else str(pt.num_articles)
            lines.append(
                f"{i:>4} {n:>4} {pt.lambda_:>7.2f} {pt.k:>5} {pt.temperature:>5.1f} | "
                f"{p['p@1']:6.1f} {p['p@5']:6.1f} {p['p@10']:6.1f}"
            )
        b = self.best
        lines.append(
            f"best: N={b.num_articles if b.num_articles is not None else '-'} lambda={b.lambda_} k={b.k} "
            f"l={b.temperature}"
        )
        return "\n".join(lines)


def grid_search(
    pipeline: AnswerPipeline,
    queries: Sequence[LamaQuery],
    *,
    retriever: RetrieverName = "bm25",
    space: GridSpace | None = None,
    allowed_ids: np.ndarray | None = None,
    batch_size: int = 32,
    progress: bool = True,
    mlm_prior: float = DEFAULT_MLM_PRIOR,
    article_sharpness: float = DEFAULT_ARTICLE_SHARPNESS,
) -> GridResult:
    """Macro P@1/5/10 of the interpolation for every grid point; the best is the highest macro P@1.

    Ties are broken by P@10, then P@5, then grid order (smaller N, lambda, k, l first).
    """
    if not queries:
        raise ValueError("the dev split has no queries; raise --limit or choose more relations")
    t0 = time.perf_counter()
    grid = _Grid(pipeline, space or GridSpace(), retriever, sorted({q.relation for q in queries}), allowed_ids,
                 mlm_prior)  # fmt: skip
    bar = tqdm(total=len(queries), desc="grid", unit="q", disable=not progress)
    try:
        for start in range(0, len(queries), batch_size):
            batch = queries[start : start + batch_size]
            base = [
                Query(text=q.text, subject=q.subject, retriever=retriever, num_articles=grid.max_n, k=max(grid.ks),
                      return_contexts=False, any_token=True, mlm_prior=mlm_prior, article_sharpness=article_sharpness)
                for q in batch
            ]  # fmt: skip
            encs, _ = pipeline.queries.encode([pipeline.check_query(b) for b in base])
            for q, query, enc in zip(batch, base, encs, strict=True):
                grid.score(q, query, enc)
            bar.update(len(batch))
    finally:
        bar.close()
    result = grid.result(len(queries), round(time.perf_counter() - t0, 2))
    ranking = result.ranking
    logger.info("grid: best %s (macro P@1 %.2f)", result.best.as_dict(), ranking[0][1]["p@1"])
    return result


class _Grid:
    """The grid's points and, per point, relation and k of P@k, the queries whose gold ranks within k."""

    def __init__(
        self, pipeline: AnswerPipeline, space: GridSpace, retriever: RetrieverName, relations: list[str],
        allowed_ids: np.ndarray | None, mlm_prior: float,
    ):  # fmt: skip
        self.pipeline, self.retriever, self.allowed_ids, self.mlm_prior = pipeline, retriever, allowed_ids, mlm_prior
        self.ns: tuple[int | None, ...] = tuple(sorted(space.num_articles)) if retriever != "none" else (None,)
        self.ks, self.temps, self.lams = tuple(sorted(space.ks)), tuple(space.temperatures), tuple(space.lambdas)
        self.points = [GridPoint(n, lam, k, t) for n in self.ns for lam in self.lams for k in self.ks for t in self.temps]
        self.index = {(p.num_articles, p.lambda_, p.k, p.temperature): i for i, p in enumerate(self.points)}
        self.rel_index = {r: i for i, r in enumerate(relations)}
        self.hits = np.zeros((len(self.points), len(relations), len(KS)), dtype=np.int64)
        self.counts = np.zeros(len(relations), dtype=np.int64)
        self.max_n = max(n for n in self.ns if n is not None) if retriever != "none" else 1

    def neighbours(self, query: Query, enc: QueryEncoding) -> tuple[dict[int | None, Neighbours], list[ArticleHit]]:
        """The neighbours at each N (the first N of the retrieved articles; one search without retrieval)."""
        if self.retriever == "none":
            return {None: self.pipeline.neighbours_of.neighbours(query, enc, [])}, []
        articles, _ = self.pipeline.articles.retrieve(query)
        by_n: dict[int | None, Neighbours] = {}
        for n in self.ns:
            assert n is not None
            by_n[n] = self.pipeline.neighbours_of.neighbours(query, enc, articles[:n])
        return by_n, articles

    def score(self, q: LamaQuery, query: Query, enc: QueryEncoding) -> None:
        """One query at every point: p_kNN recomputed from its neighbours (the k nearest are a prefix)."""
        r = self.rel_index[q.relation]
        self.counts[r] += 1
        p_mlm = full_mlm = enc.p_mlm()
        gold = q.obj_id
        if self.allowed_ids is not None:
            p_mlm = p_mlm[self.allowed_ids]
            gold = int(np.searchsorted(self.allowed_ids, q.obj_id))
        by_n, articles = self.neighbours(query, enc)
        kvals = np.asarray(KS)
        for n, nbrs in by_n.items():
            for k in self.ks:
                dist, labels = nbrs.distances[:k], nbrs.labels[:k]
                near = None if nbrs.article is None else nbrs.article[:k]
                offsets = knn_offsets(query, near, articles[:n] if n is not None else [])
                for t in self.temps:
                    ids, probs = knn_sparse(dist, labels, t, offsets)  # weighed at the voted ids only
                    p_knn = np.zeros(self.pipeline.encoder.vocab_size, dtype=np.float32)
                    p_knn[ids] = weigh_vote(probs, full_mlm[ids], self.mlm_prior)
                    if self.allowed_ids is not None:
                        p_knn = p_knn[self.allowed_ids]
                    for lam in self.lams:
                        rank = gold_rank(interpolate(p_knn, p_mlm, lam if len(dist) else 0.0), gold)
                        if rank is not None:
                            self.hits[self.index[(n, lam, k, t)], r] += rank <= kvals

    def result(self, queries: int, seconds: float) -> GridResult:
        """Macro P@k per point, best first: the highest macro P@1, ties broken by P@10, P@5, then grid order."""
        present = self.counts > 0
        per_rel = 100.0 * self.hits[:, present, :] / self.counts[present][None, :, None]
        macro = per_rel.mean(axis=1)  # [points, len(KS)]
        p1, p5, p10 = (KS.index(1), KS.index(5), KS.index(10))
        order = sorted(range(len(self.points)), key=lambda i: (-macro[i, p1], -macro[i, p10], -macro[i, p5], i))
        ranking = [(self.points[i], {f"p@{k}": float(macro[i, j]) for j, k in enumerate(KS)}) for i in order]
        return GridResult(ranking[0][0], ranking, queries, int(present.sum()), seconds)
