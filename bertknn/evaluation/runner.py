"""Running LAMA queries: in process through `AnswerPipeline` (batched), or against a running service over HTTP."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from tqdm import tqdm

from bertknn.evaluation.base import RunSettings, gold_rank
from bertknn.evaluation.lama import LamaQuery
from bertknn.evaluation.metrics import QueryResult
from bertknn.evaluation.words import word_result
from bertknn.service.client import BertKnnClient
from bertknn.service.interpolate import AdaptiveRule, adaptive_lambda, interpolate, knn_skipped
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query

logger = logging.getLogger(__name__)


def found(q: LamaQuery, status: str | None) -> bool | None:
    """Whether the fact's subject had an article (its title, a redirect or a folded title: any status but
    ``not_found``); None when the fact names no subject."""
    return None if not q.subject else status != "not_found"


def _batches(items: Sequence[LamaQuery], size: int) -> list[Sequence[LamaQuery]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class PipelineRunner:
    """In process: one batched forward pass per batch; ranks from the full-vocabulary distributions.

    With an ``adaptive`` rule each query is also ranked under the rule's lambda, from the same two
    distributions (the `bert_knn_adaptive` column): exactly what the service answers in adaptive mode, where a
    skipped query's p is p_MLM alone.
    """

    def __init__(
        self,
        pipeline: AnswerPipeline,
        *,
        allowed_ids: np.ndarray | None = None,
        progress: bool = True,
        adaptive: AdaptiveRule | None = None,
    ):
        self.pipeline = pipeline
        self.allowed_ids = allowed_ids
        self.progress = progress
        self.adaptive = adaptive

    @staticmethod
    def to_query(q: LamaQuery, s: RunSettings) -> Query:
        return Query(
            text=q.text,
            subject=q.subject,
            top_k=1,
            retriever=s.retriever,
            num_articles=s.num_articles,
            k=s.k,
            temperature=s.temperature,
            lambda_=s.lambda_,
            mlm_prior=s.mlm_prior,
            article_sharpness=s.article_sharpness,
            return_contexts=False,
            any_token=True,  # LAMA's protocol: the whole vocabulary ranks (the service's default ranks words only)
        )

    def run(self, queries: Sequence[LamaQuery], settings: RunSettings) -> list[QueryResult]:
        out: list[QueryResult] = []
        bar = tqdm(
            total=len(queries), desc=f"lama ({settings.retriever})", unit="q", disable=not self.progress
        )
        try:
            for batch in _batches(queries, settings.batch_size):
                answers = self.pipeline.predict_batch(
                    [self.to_query(q, settings) for q in batch], with_distributions=True
                )
                for q, ans in zip(batch, answers, strict=True):
                    if self.pipeline.words is not None:  # whole-word datastore: ranks among candidate words
                        out.append(replace(word_result(self.pipeline, q, ans), subject_found=found(q, ans.subject_status)))
                        continue
                    d = ans.distributions
                    assert d is not None
                    top = (self._top1(d.p_mlm), self._top1(d.p_knn), self._top1(d.p))
                    adaptive: dict[str, object] = {}
                    if self.adaptive is not None:
                        pop = self.pipeline.assembler.subject_popularity(q.subject) if self.adaptive.popularity_weight else None
                        lam = adaptive_lambda(self.adaptive, d.p_mlm, d.p_knn, pop)
                        p_a = interpolate(d.p_knn, d.p_mlm, lam)
                        adaptive = {
                            "bert_knn_adaptive": gold_rank(p_a, q.obj_id, self.allowed_ids),
                            "knn_skipped": knn_skipped(self.adaptive, d.p_mlm),
                            "lambda_adaptive": lam,
                        }
                    out.append(
                        QueryResult(
                            q.relation,
                            q.dataset,
                            q.uid,
                            gold_rank(d.p_mlm, q.obj_id, self.allowed_ids),
                            gold_rank(d.p_knn, q.obj_id, self.allowed_ids),
                            gold_rank(d.p, q.obj_id, self.allowed_ids),
                            top,
                            **adaptive,  # type: ignore[arg-type]
                            subject_found=found(q, ans.subject_status),
                        )
                    )
                bar.update(len(batch))
        finally:
            bar.close()
        return out

    def _top1(self, p: np.ndarray) -> str:
        if self.allowed_ids is not None:
            sub = p[self.allowed_ids]
            i = int(self.allowed_ids[int(np.argmax(sub))])
            return self.pipeline.token(i) if sub.max() > 0 else ""
        i = int(np.argmax(p))
        return self.pipeline.token(i) if p[i] > 0 else ""


class HttpRunner:
    """Against a running service (`bertknn.service.client.BertKnnClient`): ranks from the returned top-k lists.

    The service returns the top ``top_k`` tokens of each distribution, not the distributions, so a rank is known
    only inside that list: P@1/5/10 are exact as long as ``top_k`` >= 10 tokens of the (restricted) vocabulary
    are returned, which is why a restricted run asks for the maximum (100).
    """

    MAX_BATCH = 64

    def __init__(
        self, client: BertKnnClient, *, allowed_tokens: frozenset[str] | None = None, progress: bool = True
    ):
        self.client = client
        self.allowed_tokens = allowed_tokens
        self.top_k = 100 if allowed_tokens is not None else 10
        self.progress = progress

    def payload(self, q: LamaQuery, s: RunSettings) -> dict:
        return {
            "text": q.text,
            "subject": q.subject,
            "top_k": self.top_k,
            "retriever": s.retriever,
            "num_articles": s.num_articles,
            "k": s.k,
            "temperature": s.temperature,
            "lambda": s.lambda_,
            "mlm_prior": s.mlm_prior,
            "article_sharpness": s.article_sharpness,
            "return_contexts": False,
            "any_token": True,  # LAMA's protocol: the whole vocabulary ranks
        }

    def _rank(self, tokens: list[str], gold: str) -> tuple[int | None, str]:
        if self.allowed_tokens is not None:
            tokens = [t for t in tokens if t in self.allowed_tokens]
        top = tokens[0] if tokens else ""
        try:
            return tokens.index(gold) + 1, top
        except ValueError:
            return None, top

    def run(self, queries: Sequence[LamaQuery], settings: RunSettings) -> list[QueryResult]:
        out: list[QueryResult] = []
        size = min(settings.batch_size, self.MAX_BATCH)
        bar = tqdm(
            total=len(queries), desc=f"lama http ({settings.retriever})", unit="q", disable=not self.progress
        )
        try:
            for batch in _batches(queries, size):
                resp = self.client.predict_batch([self.payload(q, settings) for q in batch])
                for q, r in zip(batch, resp.results, strict=True):
                    mlm, t_mlm = self._rank([t.token for t in r.mlm], q.obj)
                    knn, t_knn = self._rank([t.token for t in r.knn], q.obj)
                    both, t_both = self._rank([p.token for p in r.predictions], q.obj)
                    out.append(QueryResult(
                        q.relation, q.dataset, q.uid, mlm, knn, both, (t_mlm, t_knn, t_both),
                        subject_found=found(q, r.subject_status),
                    ))  # fmt: skip
                bar.update(len(batch))
        finally:
            bar.close()
        return out
