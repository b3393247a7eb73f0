"""What the answering pipeline takes and gives: the query, its answer and their parts (frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from bertknn.core.format.table import EntityRef
from bertknn.service.interpolate import (
    DEFAULT_ARTICLE_SHARPNESS,
    DEFAULT_MLM_PRIOR,
    AdaptiveRule,
    Interpolation,
)

RetrieverName = Literal["bm25", "tfidf", "none"]
AnswerKind = Literal["word", "entity"]
SubjectStatus = Literal["found", "redirect", "folded", "not_found"]
# why no stored context voted in an answer whose kNN search ran: no article matched, or those searched hold none
Unvoted = Literal["no_article", "no_context"]

# a /follow hop's entities that the next hop starts from, unless the request asks for another beam
# (docs/decisions/entity-fill.md, "The default beam")
DEFAULT_BEAM = 3


@dataclass(frozen=True)
class Query:
    text: str
    subject: str | None = None
    top_k: int = 10
    retriever: RetrieverName = "bm25"
    num_articles: int = 3
    k: int = 128
    temperature: float | None = None  # l in softmax(-d/l); None: auto, the datastore's own (core.calibration)
    lambda_: float = 0.3
    mlm_prior: float = DEFAULT_MLM_PRIOR  # the vote weighted by p_MLM ** mlm_prior (0: the paper's plain vote)
    article_sharpness: float = DEFAULT_ARTICLE_SHARPNESS  # lower-ranked articles' neighbours count less (0: the same)
    return_contexts: bool = True
    contexts_per_answer: int = 3
    interpolation: Interpolation = "fixed"  # adaptive: lambda from `rule`, kNN skipped when the MLM is confident
    rule: AdaptiveRule | None = None  # the adaptive rule; None = AdaptiveRule() defaults
    any_token: bool = False  # rank every vocabulary entry (LAMA's protocol), not only words
    answer: AnswerKind = "word"  # entity: p_kNN over the linked entities (datastores with links)
    fill_names: bool = True  # entity answers: names of several pieces scored by a fill pass (False: the caller's)
    popularity: int | None = None  # the subject's inbound links, for an adaptive rule that weighs them (pipeline)
    deadline: float | None = None  # time.monotonic() past which no further forward pass starts (None: none)


@dataclass(frozen=True)
class TokenProb:
    token: str
    prob: float


@dataclass(frozen=True)
class Context:
    article: str
    sentence: str  # the word is marked as **word**
    distance: float
    rank: int  # 1-based rank of this neighbour among the k


@dataclass(frozen=True)
class Prediction:
    token: str  # whole-word datastores: the word
    token_id: int  # -1 for a word of several wordpieces
    prob: float
    p_mlm: float
    p_knn: float
    contexts: list[Context]
    pieces: int = 1  # wordpieces of the answer (> 1 only from a whole-word datastore, or an entity's name)
    entity: EntityRef | None = None  # the entity the answer stands for (datastores with links)

    def with_entity(self, entity: EntityRef | None) -> Prediction:
        """This prediction standing for ``entity`` (``dataclasses.replace`` costs twice as much, per answer)."""
        return Prediction(self.token, self.token_id, self.prob, self.p_mlm, self.p_knn, self.contexts, self.pieces, entity)


@dataclass(frozen=True)
class ArticleHit:
    title: str
    score: float | None
    rule: Literal["subject", "bm25", "tfidf", "none"]


@dataclass(frozen=True)
class Distributions:
    p_mlm: np.ndarray
    p_knn: np.ndarray
    p: np.ndarray


@dataclass(frozen=True)
class Assembled:
    """The answer's own parts, as an answerer (tokens or words) assembles them after the kNN search."""

    predictions: list[Prediction]
    mlm: list[TokenProb]
    knn: list[TokenProb]
    lambda_used: float
    distributions: Distributions | None
    articles: list[ArticleHit]


@dataclass(frozen=True)
class Answer:
    predictions: list[Prediction]
    mlm: list[TokenProb]
    knn: list[TokenProb]
    articles: list[ArticleHit]
    lambda_used: float
    timings_ms: dict[str, float]
    cache: dict[str, str]
    distributions: Distributions | None = None
    interpolation: Interpolation = "fixed"
    knn_skipped: bool = False  # adaptive: answered by the MLM alone, no retrieval and no kNN search ran
    subject_status: SubjectStatus | None = None  # how the query's subject found its article; None: no subject
    temperature_used: float = 6.0  # l applied: the query's, or for auto the one derived from its neighbours' distances
    warnings: list[str] = field(default_factory=list)  # a fallback the caller should know of (an unknown subject)
    unvoted: Unvoted | None = None  # the answer is the model's alone, though its kNN search ran: why (a metric's)


@dataclass
class Stage:
    """Wall time of the pipeline's stages, in milliseconds."""

    times: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds * 1000.0
