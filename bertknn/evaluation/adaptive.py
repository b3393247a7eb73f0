"""Fitting the adaptive interpolation rule (`bertknn.service.interpolate.AdaptiveRule`) on the dev split, cheaply.

One in-process run at the evaluation's setting (N, k, l) gives each dev query's p_MLM and p_kNN (the runner's
``with_distributions``); every candidate rule is then scored from those two distributions without running the
model again. A query keeps only what the score needs: the confidences of both distributions under every
measure, and both distributions on a few candidate words (the MLM's top 64, every word a neighbour carries, and
the gold). The gold's rank among them is its rank in the whole vocabulary whenever that rank is <= 10 (a word
outside them has p_kNN 0 and p_MLM below 64 candidates, so it cannot beat the gold unless 64 others do too),
so P@1/5/10 are exact, barring exact float ties.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from tqdm import tqdm

from bertknn.core.topk import top_entries
from bertknn.evaluation.base import RunSettings, gold_rank
from bertknn.evaluation.lama import LamaQuery
from bertknn.evaluation.metrics import KS, Precisions
from bertknn.evaluation.runner import PipelineRunner
from bertknn.service.interpolate import AdaptiveRule, ConfidenceMeasure, confidence, rule_lambda
from bertknn.service.pipeline import AnswerPipeline

logger = logging.getLogger(__name__)

CANDIDATES_FROM_MLM = 64  # >= 10: see the module docstring


@dataclass(frozen=True)
class AdaptiveSpace:
    """The rules searched: every measure x base lambda x kNN weight x MLM weight x skip threshold.

    ``base_lambdas`` are the lambda when both confidences are 0 (bias = its logit); with both weights 0 a rule
    is a fixed lambda, so the search also contains the fixed interpolation (the run's lambda is added).
    """

    measures: tuple[ConfidenceMeasure, ...] = ("top1", "margin", "entropy")
    base_lambdas: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
    knn_weights: tuple[float, ...] = (0.0, 1.0, 2.0, 4.0, 8.0)
    mlm_weights: tuple[float, ...] = (0.0, 1.0, 2.0, 4.0, 8.0)
    skip_thresholds: tuple[float | None, ...] = (None, 0.99, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
    # the weight of the subject's log popularity (inbound links): (0,) leaves popularity out of the rule
    popularity_weights: tuple[float, ...] = (0.0,)

    def __post_init__(self) -> None:
        axes = (self.measures, self.base_lambdas, self.knn_weights, self.mlm_weights, self.skip_thresholds)
        if not all(axes):
            raise ValueError("every axis of the adaptive search needs at least one value")
        if not all(0.0 < lam < 1.0 for lam in self.base_lambdas):
            raise ValueError("base lambdas must lie strictly between 0 and 1 (their logit is the bias)")
        if min(self.knn_weights) < 0 or min(self.mlm_weights) < 0 or min(self.popularity_weights or (0,)) < 0:
            raise ValueError("confidence and popularity weights must be >= 0")
        if not self.popularity_weights:
            raise ValueError("popularity_weights needs at least one value ((0.0,): no popularity)")
        if not all(t is None or 0.0 < t <= 1.0 for t in self.skip_thresholds):
            raise ValueError("skip thresholds must lie in (0, 1], or be None (never skip)")

    def with_base_lambda(self, lam: float) -> AdaptiveSpace:
        if 0.0 < lam < 1.0 and lam not in self.base_lambdas:
            return replace(self, base_lambdas=tuple(sorted((*self.base_lambdas, lam))))
        return self


@dataclass(frozen=True)
class ScoredQuery:
    """What the fit needs of one dev query (see the module docstring)."""

    relation: str
    conf_mlm: np.ndarray  # [measures] confidence of p_MLM under each measure of the space
    conf_knn: np.ndarray  # [measures] confidence of p_kNN (0 when it is empty)
    has_knn: bool  # p_kNN is not empty (else lambda is 0 whatever the rule)
    mlm: np.ndarray  # float32 p_MLM on the candidates
    knn: np.ndarray  # float32 p_kNN on the candidates
    ids: np.ndarray  # the candidates' ids (in the ranking's vocabulary), ascending
    gold: int  # position of the gold among the candidates
    mlm_hits: np.ndarray  # bool [len(KS)]: rank under p_MLM alone <= k (what a skipped query scores)
    log_pop: float = 0.0  # log(1 + the subject's inbound links); 0 without links


def score_query(
    relation: str,
    p_mlm: np.ndarray,
    p_knn: np.ndarray,
    gold_id: int,
    measures: Sequence[ConfidenceMeasure],
    allowed_ids: np.ndarray | None = None,
    popularity: int = 0,
) -> ScoredQuery:
    """Compact one query. Confidences come from the full distributions (as the service sees them); ranks
    from the ``allowed_ids`` sub-vocabulary when one is given (as the evaluation ranks)."""
    conf_mlm = np.array([confidence(p_mlm, m) for m in measures])
    conf_knn = np.array([confidence(p_knn, m) for m in measures])
    has_knn = bool(np.any(p_knn))
    if allowed_ids is not None:
        p_mlm, p_knn = p_mlm[allowed_ids], p_knn[allowed_ids]
        gold_id = int(np.searchsorted(allowed_ids, gold_id))
    top = min(CANDIDATES_FROM_MLM, len(p_mlm))
    cands = np.union1d(
        np.union1d(top_entries(p_mlm, top)[1], np.flatnonzero(p_knn)), [gold_id]
    ).astype(np.int64)
    rank = gold_rank(p_mlm, gold_id)
    mlm_hits = np.array([rank is not None and rank <= k for k in KS])
    return ScoredQuery(
        relation, conf_mlm, conf_knn, has_knn, p_mlm[cands].astype(np.float32), p_knn[cands].astype(np.float32),
        cands, int(np.searchsorted(cands, gold_id)), mlm_hits, math.log1p(popularity),
    )  # fmt: skip


def hits_for_lambdas(q: ScoredQuery, lambdas: np.ndarray) -> np.ndarray:
    """bool [len(lambdas), len(KS)]: the gold's rank <= k under lam * p_kNN + (1 - lam) * p_MLM.

    The same arithmetic as `bertknn.service.interpolate.interpolate` (float64, then float32) and the same tie rule
    as `rank_of` (lower id first), so the fit scores exactly what the pipeline answers.
    """
    lam = np.asarray(lambdas, dtype=np.float64)[:, None]
    p = (lam * q.knn.astype(np.float64)[None, :] + (1.0 - lam) * q.mlm.astype(np.float64)[None, :]).astype(
        np.float32
    )
    g = p[:, q.gold][:, None]
    lower = (q.ids < q.ids[q.gold])[None, :]
    rank = (p > g).sum(axis=1) + ((p == g) & lower).sum(axis=1) + 1
    return (g[:, 0] > 0)[:, None] & (rank[:, None] <= np.asarray(KS)[None, :])


def collect(
    pipeline: AnswerPipeline,
    queries: Sequence[LamaQuery],
    settings: RunSettings,
    *,
    measures: Sequence[ConfidenceMeasure],
    allowed_ids: np.ndarray | None = None,
    progress: bool = True,
    popularity: bool = False,
) -> list[ScoredQuery]:
    """One batched run at ``settings`` (the runner's queries and distributions), compacted for the fit;
    ``popularity``: with each query's subject popularity (a datastore with links)."""
    out: list[ScoredQuery] = []
    bar = tqdm(total=len(queries), desc="adaptive (dev)", unit="q", disable=not progress)
    try:
        for start in range(0, len(queries), settings.batch_size):
            batch = queries[start : start + settings.batch_size]
            answers = pipeline.predict_batch(
                [PipelineRunner.to_query(q, settings) for q in batch], with_distributions=True
            )
            for q, ans in zip(batch, answers, strict=True):
                d = ans.distributions
                assert d is not None
                pop = pipeline.assembler.subject_popularity(q.subject) if popularity else 0
                out.append(score_query(q.relation, d.p_mlm, d.p_knn, q.obj_id, measures, allowed_ids, pop))
            bar.update(len(batch))
    finally:
        bar.close()
    return out


@dataclass(frozen=True)
class RuleScore:
    rule: AdaptiveRule
    macro: Precisions  # macro P@k of the interpolation under the rule, on dev
    skipped: float  # share of dev queries that skip the kNN search


@dataclass(frozen=True)
class AdaptiveFit:
    best: RuleScore
    fixed: Precisions  # macro P@k of the fixed lambda on the same dev queries
    fixed_lambda: float
    ranking: list[RuleScore]  # the best few, best first
    rules: int
    queries: int
    relations: int
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def format(self, top: int = 5) -> str:
        lines = [
            f"adaptive rule fit on the dev split: {self.queries} queries, {self.relations} relations, "
            f"{self.rules} rules, {self.seconds:.1f} s; macro P@k of the interpolation",
            f"{'rank':>4} {'measure':>8} {'bias':>7} {'w_knn':>6} {'w_mlm':>6} {'w_pop':>6} {'skip>=':>6} | "
            f"{'P@1':>6} {'P@5':>6} {'P@10':>6} | skipped",
        ]
        for i, s in enumerate(self.ranking[:top], 1):
            r, tau = s.rule, "-" if s.rule.skip_threshold is None else f"{s.rule.skip_threshold:.2f}"
            lines.append(
                f"{i:>4} {r.measure:>8} {r.bias:>7.3f} {r.knn_weight:>6.1f} {r.mlm_weight:>6.1f} "
                f"{r.popularity_weight:>6.2f} {tau:>6} | "
                f"{s.macro['p@1']:6.1f} {s.macro['p@5']:6.1f} {s.macro['p@10']:6.1f} | {100 * s.skipped:5.1f} %"
            )
        f = self.fixed
        lines.append(
            f"dev: fixed lambda={self.fixed_lambda} P@1 {f['p@1']:.1f} P@10 {f['p@10']:.1f}; adaptive P@1 "
            f"{self.best.macro['p@1']:.1f} P@10 {self.best.macro['p@10']:.1f}, kNN skipped for "
            f"{100 * self.best.skipped:.1f} % of the queries"
        )
        return "\n".join(lines)


def _bias(lam: float) -> float:
    return round(math.log(lam / (1.0 - lam)), 4)


def fit_rule(
    queries: Sequence[ScoredQuery], space: AdaptiveSpace, *, fixed_lambda: float
) -> AdaptiveFit:
    """Score every rule of ``space`` on the compacted dev queries; the best has the highest macro P@1.

    Ties are broken by P@10, then P@5, then by the larger share of skipped queries (the same answers for
    less work), then towards the fixed interpolation (smaller weights, base lambda nearer ``fixed_lambda``:
    no change that dev does not pay for), then by the order of the space. ``queries`` must be compacted with
    ``space.measures``.
    """
    if not queries:
        raise ValueError("the dev split has no queries; raise --limit or choose more relations")
    if any(len(q.conf_mlm) != len(space.measures) for q in queries):
        raise ValueError("queries were compacted with other measures than the space's; pass space.measures")
    t0 = time.perf_counter()
    rules = _RuleGrid(space, sorted({q.relation for q in queries}), fixed_lambda)
    for q in queries:
        rules.add(q)
    ranking, fixed = rules.ranking(len(queries))
    result = AdaptiveFit(
        ranking[0], fixed, fixed_lambda, ranking, len(rules.grid) * len(rules.taus), len(queries),
        int((rules.counts > 0).sum()), round(time.perf_counter() - t0, 2),
    )  # fmt: skip
    logger.info("adaptive: best %s (dev macro P@1 %.2f, fixed %.2f)", ranking[0].rule.model_dump(exclude={"fitted"}),
                ranking[0].macro["p@1"], result.fixed["p@1"])  # fmt: skip
    return result


class _RuleGrid:
    """Every rule of a space (measure, base lambda, weights, skip threshold) and, per rule, relation and k of P@k,
    the dev queries whose gold ranks within k under it; with the fixed interpolation's beside them."""

    def __init__(self, space: AdaptiveSpace, relations: list[str], fixed_lambda: float):
        self.space, self.fixed_lambda = space, fixed_lambda
        self.grid = [
            (mi, base, kw, mw, pw)
            for mi in range(len(space.measures))
            for base in space.base_lambdas
            for kw in space.knn_weights
            for mw in space.mlm_weights
            for pw in space.popularity_weights
        ]
        self.m_idx = np.array([g[0] for g in self.grid])
        self.bias = np.array([_bias(g[1]) for g in self.grid])
        self.kw = np.array([g[2] for g in self.grid], dtype=np.float64)
        self.mw = np.array([g[3] for g in self.grid], dtype=np.float64)
        self.pw = np.array([g[4] for g in self.grid], dtype=np.float64)
        self.taus = np.array([np.inf if t is None else t for t in space.skip_thresholds])
        self.rel = {r: i for i, r in enumerate(relations)}
        nk = len(KS)
        self.hits = np.zeros((len(self.grid), len(self.taus), len(relations), nk), dtype=np.int64)
        self.fixed_hits = np.zeros((len(relations), nk), dtype=np.int64)
        self.skips = np.zeros((len(space.measures), len(self.taus)), dtype=np.int64)
        self.counts = np.zeros(len(relations), dtype=np.int64)

    def add(self, q: ScoredQuery) -> None:
        """One dev query under every rule (each distinct lambda scored once) and under the fixed lambda."""
        r = self.rel[q.relation]
        self.counts[r] += 1
        skip_m = q.conf_mlm[:, None] >= self.taus[None, :]  # [measures, taus]
        self.skips += skip_m
        if q.has_knn:
            m = self.m_idx
            lam = rule_lambda(self.bias, self.kw, self.mw, q.conf_mlm[m], q.conf_knn[m],
                              popularity_weight=self.pw, log_popularity=q.log_pop)  # fmt: skip
            uniq, inverse = np.unique(lam, return_inverse=True)
            h = hits_for_lambdas(q, uniq)[inverse]  # [grid, KS]
            self.fixed_hits[r] += hits_for_lambdas(q, np.array([self.fixed_lambda]))[0]
        else:
            h = np.broadcast_to(q.mlm_hits, (len(self.grid), len(KS)))
            self.fixed_hits[r] += q.mlm_hits
        final = np.where(skip_m[self.m_idx][:, :, None], q.mlm_hits[None, None, :], h[:, None, :])
        self.hits[:, :, r, :] += final

    def ranking(self, queries: int) -> tuple[list[RuleScore], dict[str, float]]:
        """The ten best rules (see `fit_rule` for the order) and the fixed interpolation's macro P@k."""
        present = self.counts > 0
        counts = self.counts[present]
        macro = (100.0 * self.hits[:, :, present, :] / counts[None, None, :, None]).mean(axis=2)  # [grid, taus, KS]
        fixed = (100.0 * self.fixed_hits[present] / counts[:, None]).mean(axis=0)
        skipped = self.skips / queries  # [measures, taus]
        p1, p5, p10 = KS.index(1), KS.index(5), KS.index(10)
        n_taus = len(self.taus)
        order = np.lexsort((
            np.arange(macro.shape[0] * macro.shape[1]),
            np.repeat(np.abs(np.array([g[1] for g in self.grid]) - self.fixed_lambda), n_taus),  # nearest the fixed
            np.repeat(self.kw + self.mw + self.pw, n_taus),  # weaker dependence on the features (0: a fixed lambda)
            -skipped[self.m_idx].reshape(-1),
            -macro[:, :, p5].reshape(-1),
            -macro[:, :, p10].reshape(-1),
            -macro[:, :, p1].reshape(-1),
        ))  # fmt: skip

        def score(flat: int) -> RuleScore:
            gi, ti = divmod(int(flat), n_taus)
            mi, _, w_knn, w_mlm, w_pop = self.grid[gi]
            rule = AdaptiveRule(
                measure=self.space.measures[mi], bias=float(self.bias[gi]), knn_weight=w_knn, mlm_weight=w_mlm,
                skip_threshold=self.space.skip_thresholds[ti], popularity_weight=w_pop,
            )  # fmt: skip
            return RuleScore(rule, {f"p@{k}": float(macro[gi, ti, j]) for j, k in enumerate(KS)},
                             float(skipped[mi, ti]))  # fmt: skip

        return [score(i) for i in order[:10]], {f"p@{k}": float(fixed[j]) for j, k in enumerate(KS)}
