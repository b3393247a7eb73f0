"""A word answer's rankings from the stored head of p_MLM and the neighbours' words alone (`interpolated_top_k`,
the service's path) are the rankings of the whole vocabulary's distributions (the path that returns them)."""

from __future__ import annotations

import numpy as np
import pytest

from bertknn.service import answer
from bertknn.service.answer import ContextReader, TokenAnswerer
from bertknn.service.codec import QueryEncoding
from bertknn.service.interpolate import interpolated_top_k
from bertknn.service.results import Assembled, Query
from bertknn.service.retrieval.knn import Neighbours


def _encoding(rng: np.random.Generator, vocab: int, n_top: int, sharp: float) -> QueryEncoding:
    logits = rng.normal(size=vocab) * sharp
    log_probs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    return QueryEncoding.from_log_probs(rng.normal(size=8).astype(np.float32), log_probs, n_top)


def _neighbours(rng: np.random.Generator, enc: QueryEncoding, n: int) -> Neighbours:
    # words from the head of p_MLM and beyond it, repeated: a vote that reorders the head
    words = np.concatenate((enc.ranked_ids()[: n // 3], rng.integers(0, enc.vocab_size, n // 3 + 1)))
    labels = rng.choice(words, n).astype(np.int32)
    distances = np.sort(rng.uniform(0, 30, n)).astype(np.float32)
    return Neighbours(distances, np.arange(n, dtype=np.int64), labels)


def _ranked(got: Assembled) -> tuple[list, list, list]:
    return ([(p.token_id, p.prob, p.p_mlm, p.p_knn) for p in got.predictions],
            [(t.token, t.prob) for t in got.mlm], [(t.token, t.prob) for t in got.knn])  # fmt: skip


@pytest.mark.parametrize("sharp", [0.5, 3.0, 8.0])
def test_the_head_s_rankings_are_the_whole_vocabulary_s(sharp: float, monkeypatch: pytest.MonkeyPatch) -> None:
    ranked_from_head: list[bool] = []

    def counted(*args: object, **kwargs: object) -> object:
        got = interpolated_top_k(*args, **kwargs)  # type: ignore[arg-type]
        ranked_from_head.append(got is not None)
        return got

    monkeypatch.setattr(answer, "interpolated_top_k", counted)
    rng = np.random.default_rng(int(sharp * 10))
    vocab = 5000
    non_words = rng.random(vocab) < 0.3  # pieces, punctuation, special tokens: never an answer
    answerer = TokenAnswerer([f"w{i}" for i in range(vocab)], ContextReader(None), non_words=non_words)  # type: ignore[arg-type]
    for i in range(40):
        enc = _encoding(rng, vocab, 1024, sharp)
        nbrs = _neighbours(rng, enc, int(rng.integers(8, 128)))
        query = Query("q [MASK] .", temperature=float(rng.choice([1.0, 6.0])), lambda_=float(rng.choice([0.1, 0.3, 0.8])),
                      top_k=int(rng.choice([1, 10, 40])), return_contexts=False)  # fmt: skip
        fast = answerer.answer(query, enc, [], nbrs, with_distributions=False)
        dense = answerer.answer(query, enc, [], nbrs, with_distributions=True)
        assert dense.distributions is not None and fast.distributions is None
        assert _ranked(fast) == _ranked(dense), i
    assert sum(ranked_from_head) >= 30  # most questions ranked from the head (the rest fell back to the dense path)
