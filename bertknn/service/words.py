"""Whole-word answers over a whole-word datastore: p_kNN over words, p_MLM of multi-piece words by sequential fill.

Candidates: every word of the k neighbours (in order of its nearest neighbour) plus the MLM's most probable
one-piece words (the top ``max(top_k, MLM_CANDIDATES)`` tokens that are whole words), each word once (by text).

p_kNN(w) = the sum of softmax(-d/l) over the neighbours whose stored word is w, as for tokens.

p_MLM(w): a one-piece word takes the ordinary p_MLM at the query's single [MASK] (the forward pass every query
has); a word of m >= 2 wordpieces is scored by sequential fill (`bertknn.service.fill`).

Answers are ranked by p(w) = lambda * p_kNN(w) + (1 - lambda) * p_MLM(w) over the candidates (ties: candidate
order). Single-piece datastores never come here: their path is the one forward pass of `AnswerAssembler.answer`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bertknn.core.format import Datastore
from bertknn.core.query_model import QueryModel
from bertknn.core.words import WordEntry as Word
from bertknn.service.answer import ContextReader, knn_offsets, lambda_for
from bertknn.service.codec import QueryEncoding
from bertknn.service.encoding import QueryEncoder
from bertknn.service.fill import WordFill
from bertknn.service.interpolate import interpolate, knn_distribution, top_k, weigh_vote
from bertknn.service.results import (
    ArticleHit,
    Assembled,
    Distributions,
    Prediction,
    Query,
    TokenProb,
)
from bertknn.service.retrieval.knn import Neighbours

logger = logging.getLogger(__name__)

MLM_CANDIDATES = 10  # one-piece words the MLM contributes (at least top_k): exact ranks up to P@10


@dataclass(frozen=True)
class WordDistributions(Distributions):
    """`Distributions` over the candidate words (``p_mlm``, ``p_knn``, ``p`` indexed like ``words``)."""

    words: tuple[Word, ...] = ()
    token_p_mlm: np.ndarray | None = None  # the query's p_MLM over single tokens (scores a one-piece word)

    def index(self, text: str) -> int | None:
        for i, w in enumerate(self.words):
            if w.text == text:
                return i
        return None


class WordAnswerer:
    """The whole-word counterpart of `AnswerAssembler.answer` (see the module docstring for the method)."""

    def __init__(self, encoder: QueryModel, datastore: Datastore, queries: QueryEncoder, reader: ContextReader):
        self.encoder = encoder
        self.datastore = datastore
        self.reader = reader
        self.fill = WordFill(encoder, queries)  # p_MLM of multi-piece words (the query cache holds their scores too)
        # filled lazily: only the MLM's top tokens are ever asked
        self._token_words: dict[int, Word | None] = {}

    # ---- vocabulary --------------------------------------------------------------------------------------

    def token_word(self, token_id: int) -> Word | None:
        """The whole word a token spells on its own (`WordModel.token_word`), or None: inner pieces (``##s``),
        special tokens, punctuation."""
        if token_id not in self._token_words:
            words = self.encoder.words
            label = words.token_word(token_id)
            self._token_words[token_id] = Word(words.token_text(label), (label,)) if label >= 0 else None
        return self._token_words[token_id]

    # ---- p_MLM of words ----------------------------------------------------------------------------------

    def mlm_probs(self, query: Query, token_p: np.ndarray, words: Sequence[Word]) -> np.ndarray:
        """p_MLM of each word: one-piece words from ``token_p``, multi-piece words by sequential fill."""
        out = np.zeros(len(words), dtype=np.float64)
        multi = []
        for i, w in enumerate(words):
            if w.multi_piece:
                multi.append(i)
            else:
                out[i] = float(token_p[w.pieces[0]])
        if multi:
            out[multi] = self.fill.fill_probs(query.text, [words[i].pieces for i in multi], deadline=query.deadline)
        return out

    # ---- the answer --------------------------------------------------------------------------------------

    def candidates(self, query: Query, enc: QueryEncoding, nbrs: Neighbours) -> tuple[list[Word], np.ndarray]:
        """Candidate words (neighbours' words first, then the MLM's top one-piece words) and each neighbour's
        candidate index."""
        words: list[Word] = []
        index: dict[str, int] = {}
        labels = np.empty(len(nbrs), dtype=np.int64)
        for n, row in enumerate(nbrs.rows):
            entry = self.datastore.word_at(int(row))
            c = index.get(entry.text)
            if c is None:
                c = index[entry.text] = len(words)
                words.append(entry)  # the shard's word-table entry (frozen)
            labels[n] = c
        want, taken = max(query.top_k, MLM_CANDIDATES), 0
        for token_id in enc.ranked_ids():  # most probable first
            w = self.token_word(int(token_id))
            if w is None:  # not a word of its own (`token_word` has no punctuation either: a cloze answer is a word)
                continue
            if w.text not in index:
                index[w.text] = len(words)
                words.append(w)
            taken += 1
            if taken >= want:
                break
        return words, labels

    def answer(
        self, query: Query, enc: QueryEncoding, articles: list[ArticleHit], nbrs: Neighbours, *, with_distributions: bool
    ) -> Assembled:
        token_p = enc.p_mlm()
        words, labels = self.candidates(query, enc, nbrs)
        p_mlm = self.mlm_probs(query, token_p, words).astype(np.float32)
        assert query.temperature is not None, "the pipeline resolves temperature auto"
        offsets = knn_offsets(query, nbrs.article, articles)
        p_knn = knn_distribution(nbrs.distances, labels, len(words), query.temperature, offsets)
        p_knn = weigh_vote(p_knn, p_mlm, query.mlm_prior)
        lam = lambda_for(query, p_mlm, p_knn, nbrs)
        p = interpolate(p_knn, p_mlm, lam)
        preds = []
        best, shown = self.reader.top_with_support(p, query, nbrs, labels)
        for c, prob in best:
            w = words[c]
            token_id = w.pieces[0] if not w.multi_piece else -1
            preds.append(
                Prediction(w.text, token_id, prob, float(p_mlm[c]), float(p_knn[c]), shown[c], len(w.pieces))
            )
        mlm = [TokenProb(words[c].text, pr) for c, pr in top_k(p_mlm, query.top_k)]
        knn = [TokenProb(words[c].text, pr) for c, pr in top_k(p_knn, query.top_k, nonzero=True)]
        dists = WordDistributions(p_mlm, p_knn, p, tuple(words), token_p) if with_distributions else None
        return Assembled(preds, mlm, knn, lam, dists, self.reader.articles_seen(query, nbrs, articles))

