"""Answer assembly: p_kNN from the neighbours, mixed with p_MLM, the top answers and their supporting contexts."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from bertknn.core.format import Datastore
from bertknn.service.codec import PMlmAt, QueryEncoding
from bertknn.service.device_vote import Voted
from bertknn.service.interpolate import (
    AdaptiveRule,
    adaptive_lambda,
    article_offsets,
    interpolate,
    interpolated_top_k,
    knn_sparse,
    top_k,
    top_k_among,
    weigh_vote,
)
from bertknn.service.results import (
    ArticleHit,
    Assembled,
    Context,
    Distributions,
    Prediction,
    Query,
    TokenProb,
)
from bertknn.service.retrieval.knn import Neighbours

DEFAULT_RULE = AdaptiveRule()


class Answerer(Protocol):
    """Turns a query's encoding and neighbours into its answers (tokens, or whole words)."""

    def answer(
        self, query: Query, enc: QueryEncoding, articles: list[ArticleHit], nbrs: Neighbours, *, with_distributions: bool
    ) -> Assembled: ...


class ContextReader:
    """The stored sentences of neighbours, the word in ``**bold**``; and the articles the neighbours came from."""

    def __init__(self, datastore: Datastore):
        self.datastore = datastore

    def contexts(self, nbrs: Neighbours, ranks: list[int]) -> list[Context]:
        """The stored sentences of the neighbours at these ranks (0-based), the word in ``**bold**``."""
        out = []
        refs = self.datastore.contexts(nbrs.rows[ranks].tolist())
        for rank, ref, distance in zip(ranks, refs, nbrs.distances[ranks].tolist(), strict=True):
            a, b = ref.span
            marked = f"{ref.sentence[:a]}**{ref.sentence[a:b]}**{ref.sentence[b:]}"
            out.append(Context(ref.article, marked, distance, int(rank) + 1))
        return out

    def by_label(self, nbrs: Neighbours, labels: np.ndarray, wanted: list[int], limit: int) -> dict[int, list[Context]]:
        """The first ``limit`` contexts (nearest first) of the neighbours of each wanted label (``labels``: one per
        neighbour), all read at once."""
        if limit <= 0:  # contexts not asked for: no pass over the neighbours
            return {c: [] for c in wanted}
        ranks = _ranks_by_label(labels, set(wanted), limit)
        shown = iter(self.contexts(nbrs, [r for c in wanted for r in ranks.get(c, [])]))
        return {c: [next(shown) for _ in ranks.get(c, [])] for c in wanted}

    def top_with_support(
        self, p: np.ndarray, query: Query, nbrs: Neighbours, labels: np.ndarray
    ) -> tuple[list[tuple[int, float]], dict[int, list[Context]]]:
        """The ``query.top_k`` most probable candidates under ``p`` (id, probability) and, when the query asks for
        contexts, the stored sentences that support each (`by_label`)."""
        best = top_k(p, query.top_k)
        return best, self.supporting(query, nbrs, labels, [c for c, _ in best])

    def supporting(self, query: Query, nbrs: Neighbours, labels: np.ndarray, wanted: list[int]) -> dict[int, list[Context]]:
        """The stored sentences behind each wanted answer, as many as the query asks for (none unless it asks
        for contexts)."""
        return self.by_label(nbrs, labels, wanted, query.contexts_per_answer if query.return_contexts else 0)

    def articles_seen(self, query: Query, nbrs: Neighbours, articles: list[ArticleHit]) -> list[ArticleHit]:
        """Without retrieval, the articles the neighbours came from (by count); else the retrieved ones."""
        if query.retriever != "none" or not len(nbrs):
            return articles
        counts: dict[str, int] = {}
        for ref in self.datastore.contexts(nbrs.rows[: query.k].tolist()):
            counts[ref.article] = counts.get(ref.article, 0) + 1
        return [ArticleHit(t, float(c), "none") for t, c in sorted(counts.items(), key=lambda x: -x[1])]


def lambda_for(query: Query, p_mlm: np.ndarray | None, p_knn: np.ndarray | None, nbrs: Neighbours) -> float:
    """The kNN weight of this query: fixed, or the adaptive rule's; 0 when no neighbour was found.

    ``p_mlm``, ``p_knn``: the dense distributions, which only the adaptive rule reads (None is fine in fixed mode).
    """
    if not len(nbrs):
        return 0.0
    if query.interpolation == "adaptive":
        if p_mlm is None or p_knn is None:
            raise ValueError("the adaptive rule needs the dense p_MLM and p_kNN")
        return adaptive_lambda(query.rule or DEFAULT_RULE, p_mlm, p_knn, query.popularity)
    return query.lambda_


def knn_offsets(query: Query, nbrs_article: np.ndarray | None, articles: list[ArticleHit]) -> np.ndarray | None:
    """The query's article weighting for its neighbours (`article_offsets`; None for the subject's own article,
    which has no score, and for the whole-datastore search, whose neighbours carry no article)."""
    return article_offsets(nbrs_article, [a.score for a in articles], query.article_sharpness)


class TokenAnswerer:
    """Answers over the vocabulary's tokens (single-piece datastores): the paper's interpolation.

    The rankings (predictions, mlm, knn) leave out the non-word tokens unless a query asks for ``any_token``; the
    distributions themselves (evaluation) are never changed."""

    def __init__(self, vocab: list[str], contexts: ContextReader, *, non_words: np.ndarray):
        """``non_words``: the ids that are never a cloze answer by default (`VocabWords.non_words`: special
        tokens, inner pieces, punctuation, bare forms whose mass went to their word)."""
        self.vocab = vocab
        self.vocab_size = len(vocab)
        self.reader = contexts
        self.non_words = non_words

    def answer(
        self, query: Query, enc: QueryEncoding, articles: list[ArticleHit], nbrs: Neighbours, *, with_distributions: bool
    ) -> Assembled:
        assert query.temperature is not None, "the pipeline resolves temperature auto"
        # The dense p_MLM and p_kNN (vocabulary-sized arrays) only where a whole distribution is read: the
        # adaptive rule, the returned distributions, the dense ranking below. Otherwise both are read at a few ids.
        dense = enc.p_mlm() if with_distributions or query.interpolation == "adaptive" else None
        p_mlm: np.ndarray | PMlmAt = dense if dense is not None else enc.p_mlm_at()
        offsets = knn_offsets(query, nbrs.article, articles)
        knn_ids, knn_probs = knn_sparse(nbrs.distances, nbrs.labels, query.temperature, offsets)
        knn_probs = weigh_vote(knn_probs, p_mlm[knn_ids], query.mlm_prior)

        def dense_knn() -> np.ndarray:
            p = np.zeros(self.vocab_size, dtype=np.float32)
            p[knn_ids] = knn_probs
            return p

        p_knn = dense_knn() if dense is not None else None
        lam = lambda_for(query, dense, p_knn, nbrs)
        # The ids that may be answers: all, or the words (no special token, piece or punctuation)
        skip = None if query.any_token else self.non_words
        # (p_MLM at every stored id, read in one piece: `PMlmAt` returns its stored values for ``top_ids``)
        mlm_ids, mlm_p, rank_ids, rank_probs = enc.top_ids, p_mlm[enc.top_ids], knn_ids, knn_probs
        if skip is not None:
            words = ~skip[mlm_ids]
            mlm_ids, mlm_p = mlm_ids[words], mlm_p[words]
            keep = ~skip[knn_ids]
            rank_ids, rank_probs = knn_ids[keep], knn_probs[keep]
        # Rank the stored p_MLM entries and the neighbours' words only: every other id shares one p_MLM value
        # and has no kNN mass. The dense path runs when that value could reach the top k, or for evaluation.
        fast = None
        if not with_distributions:
            fast = interpolated_top_k(
                p_mlm, mlm_ids, rank_ids, rank_probs, lam, query.top_k, mlm_rest=enc.rest_p_mlm(), mlm_p=mlm_p
            )
        if fast is None:
            p_mlm = enc.p_mlm()
            p_knn = dense_knn() if p_knn is None else p_knn
            p = interpolate(p_knn, p_mlm, lam)
            ranked_p, ranked_mlm = (p, p_mlm) if skip is None else (np.where(skip, 0, p), np.where(skip, 0, p_mlm))
            nz = skip is not None
            best, mlm_top = top_k(ranked_p, query.top_k, nonzero=nz), top_k(ranked_mlm, query.top_k, nonzero=nz)
        else:
            (best, mlm_top), p = fast, None
        knn_at = dict(zip(knn_ids.tolist(), knn_probs.tolist(), strict=True))  # float32 values, as in p_kNN
        preds = self._predictions(query, best, p_mlm, nbrs, knn_at)
        mlm = [TokenProb(self.vocab[i], pr) for i, pr in mlm_top]
        knn = [TokenProb(self.vocab[i], pr) for i, pr in top_k_among(rank_ids, rank_probs, query.top_k, None) or []]
        dists = Distributions(enc.p_mlm(), p_knn, p) if with_distributions and p is not None and p_knn is not None else None
        return Assembled(preds, mlm, knn, lam, dists, self.reader.articles_seen(query, nbrs, articles))

    def from_voted(self, query: Query, voted: Voted, nbrs: Neighbours, articles: list[ArticleHit]) -> Assembled:
        """`answer`'s result from the batch vote on the device (`DeviceVote`): the rankings made there, the
        supporting contexts read here."""
        preds = self._supported(query, voted.best, voted.best_p_mlm, voted.best_p_knn, nbrs)
        mlm = [TokenProb(self.vocab[i], pr) for i, pr in voted.mlm]
        knn = [TokenProb(self.vocab[i], pr) for i, pr in voted.knn]
        return Assembled(preds, mlm, knn, voted.lam, None, self.reader.articles_seen(query, nbrs, articles))

    def _predictions(
        self, query: Query, best: list[tuple[int, float]], p_mlm: np.ndarray | PMlmAt, nbrs: Neighbours,
        knn_at: dict[int, float],
    ) -> list[Prediction]:
        """`_supported` for the answers ``best`` (token id, p), their p_MLM read from ``p_mlm`` and their p_kNN
        from ``knn_at`` (float32 values, as in p_kNN)."""
        best_p_mlm = p_mlm[np.array([t for t, _ in best], dtype=np.int64)].tolist()
        return self._supported(query, best, best_p_mlm, [knn_at.get(t, 0.0) for t, _ in best], nbrs)

    def _supported(
        self, query: Query, best: list[tuple[int, float]], p_mlm: list[float], p_knn: list[float], nbrs: Neighbours
    ) -> list[Prediction]:
        """The answers ``best`` (token id, p) with their p_MLM and p_kNN and, when the query asks for them, their
        nearest contexts, read in one read for all."""
        shown = self.reader.supporting(query, nbrs, nbrs.labels, [t for t, _ in best])
        return [
            Prediction(self.vocab[t], t, prob, pm, pk, shown[t])
            for (t, prob), pm, pk in zip(best, p_mlm, p_knn, strict=True)
        ]


def _ranks_by_label(labels: np.ndarray, wanted: set[int], limit: int) -> dict[int, list[int]]:
    """For each wanted label, the ranks (0-based, nearest first) of its first ``limit`` neighbours: one pass over
    the neighbours for all answers (instead of one comparison of every neighbour per answer)."""
    out: dict[int, list[int]] = {}
    for rank, label in enumerate(labels.tolist()):
        if label in wanted:
            ranks = out.setdefault(label, [])
            if len(ranks) < limit:
                ranks.append(rank)
    return out
