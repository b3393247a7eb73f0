"""The batch vote on the device (`DeviceVote`) gives the host's answers (`TokenAnswerer.answer`): the same
rankings, the same probabilities, for every setting that shapes them, question by question within one batch."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from bertknn.service.answer import ContextReader, TokenAnswerer, knn_offsets
from bertknn.service.codec import QueryEncoding
from bertknn.service.device_vote import DeviceVote, VoteInput
from bertknn.service.results import ArticleHit, Assembled, Query
from bertknn.service.retrieval.knn import EMPTY, Neighbours


def _encoding(rng: np.random.Generator, vocab: int, n_top: int, sharp: float) -> QueryEncoding:
    logits = rng.normal(size=vocab) * sharp
    logits[rng.integers(0, vocab, 5)] = logits.max()  # tied entries
    log_probs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    return QueryEncoding.from_log_probs(rng.normal(size=8).astype(np.float32), log_probs, n_top)


def _neighbours(rng: np.random.Generator, vocab: int, n: int, spread: float) -> Neighbours:
    distances = np.sort(rng.uniform(0, spread, n)).astype(np.float32)
    words = rng.integers(0, vocab, max(1, n // 6))  # repeated labels: a sum per word
    labels = rng.choice(words, n).astype(np.int32)
    article = rng.integers(0, 3, n).astype(np.int16)
    return Neighbours(distances, rng.integers(0, 10_000, n).astype(np.int64), labels, article)


def _host(answerer: TokenAnswerer, query: Query, enc: QueryEncoding, arts: list[ArticleHit], nbrs: Neighbours) -> Assembled:
    return answerer.answer(query, enc, arts, nbrs, with_distributions=False)


def _item(query: Query, enc: QueryEncoding, arts: list[ArticleHit], nbrs: Neighbours) -> VoteInput:
    return VoteInput.of(query, enc, nbrs, knn_offsets(query, nbrs.article, arts))


def _same(host: Assembled, dev: Assembled) -> None:
    assert [(p.token_id, p.token) for p in dev.predictions] == [(p.token_id, p.token) for p in host.predictions]
    for d, h in zip(dev.predictions, host.predictions, strict=True):
        assert d.prob == pytest.approx(h.prob, rel=1e-6, abs=1e-12)
        assert d.p_mlm == pytest.approx(h.p_mlm, rel=1e-6, abs=1e-12)
        assert d.p_knn == pytest.approx(h.p_knn, rel=1e-6, abs=1e-12)
    for side in ("mlm", "knn"):
        got, want = getattr(dev, side), getattr(host, side)
        assert [t.token for t in got] == [t.token for t in want], side
        assert [t.prob for t in got] == pytest.approx([t.prob for t in want], rel=1e-6, abs=1e-12), side
    assert dev.lambda_used == host.lambda_used
    assert dev.articles == host.articles


QUERIES = [
    Query("q [MASK] .", temperature=6.0),
    Query("q [MASK] .", temperature=0.5, mlm_prior=0.0, article_sharpness=0.0),
    Query("q [MASK] .", temperature=2.0, mlm_prior=1.0, lambda_=0.9, top_k=25),
    Query("q [MASK] .", temperature=3.0, any_token=True, top_k=1),
    Query("q [MASK] .", temperature=1e-3, mlm_prior=40.0, top_k=50),  # the weighted vote underflows: log space
    Query("q [MASK] .", temperature=4.0, lambda_=0.0, article_sharpness=2.5),
    Query("q [MASK] .", temperature=4.0, lambda_=1.0, any_token=True, top_k=100),
]


@pytest.mark.parametrize(("vocab", "n_top"), [(3000, 512), (700, 2048)])  # a shared remainder, and every id stored
def test_a_batch_voted_on_the_device_gives_each_question_the_hosts_answer(vocab: int, n_top: int) -> None:
    rng = np.random.default_rng(vocab)
    non_words = rng.random(vocab) < 0.2
    answerer = TokenAnswerer([f"w{i}" for i in range(vocab)], ContextReader(None), non_words=non_words)  # type: ignore[arg-type]
    arts = [ArticleHit("A", 12.0, "bm25"), ArticleHit("B", 9.0, "bm25"), ArticleHit("C", 3.0, "bm25")]
    cases = []
    for i, query in enumerate(QUERIES * 3):
        enc = _encoding(rng, vocab, n_top, sharp=[0.5, 3.0, 8.0][i % 3])
        nbrs = EMPTY if i == 4 else _neighbours(rng, vocab, int(rng.integers(1, 160)), spread=[5.0, 60.0][i % 2])
        cases.append((replace(query, return_contexts=False), enc, nbrs))
    vote = DeviceVote(torch.device("cpu"), non_words)
    voted = vote.vote([_item(q, e, arts, n) for q, e, n in cases])
    assert len(voted) == len(cases)
    for (query, enc, nbrs), got in zip(cases, voted, strict=True):
        _same(_host(answerer, query, enc, arts, nbrs), answerer.from_voted(query, got, nbrs, arts))


def test_ties_go_to_the_lower_id_as_on_the_host() -> None:
    vocab = 400
    probs = np.full(vocab, 1.0 / vocab)  # every word as likely: the top k is the k lowest ids
    enc = QueryEncoding.from_log_probs(np.zeros(4, np.float32), np.log(probs), 2048)
    nbrs = Neighbours(np.array([1.0, 1.0], np.float32), np.array([0, 1]), np.array([399, 398], np.int32))
    query = Query("q [MASK] .", temperature=1.0, lambda_=0.0, top_k=10, return_contexts=False)
    answerer = TokenAnswerer([f"w{i}" for i in range(vocab)], ContextReader(None), non_words=np.zeros(vocab, bool))  # type: ignore[arg-type]
    (got,) = DeviceVote(torch.device("cpu"), np.zeros(vocab, bool)).vote([_item(query, enc, [], nbrs)])
    assert [t for t, _ in got.best] == list(range(10))
    assert [t for t, _ in got.knn] == [398, 399]  # equal votes: the lower id first
    _same(_host(answerer, query, enc, [], nbrs), answerer.from_voted(query, got, nbrs, []))


def test_a_batch_of_two_vocabularies_is_refused() -> None:
    rng = np.random.default_rng(0)
    a, b = _encoding(rng, 300, 64, 1.0), _encoding(rng, 301, 64, 1.0)
    query = Query("q [MASK] .", temperature=1.0)
    vote = DeviceVote(torch.device("cpu"), np.zeros(300, bool))
    with pytest.raises(ValueError, match="one vocabulary"):
        vote.vote([_item(query, a, [], EMPTY), _item(query, b, [], EMPTY)])
