"""Request and response models: the public contract of the HTTP API (field names are stable)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bertknn.service.results import DEFAULT_BEAM, RetrieverName

_EXAMPLE: Any = {"text": "albert einstein was born in [MASK] .", "subject": "Albert Einstein", "top_k": 5}


class PredictRequest(BaseModel):
    """One cloze question with exactly one [MASK] (any case: `[mask]` and `<mask>` are accepted)."""

    # strict: `top_k: true` or `top_k: "5"` is an error, not 1 or 5
    model_config = ConfigDict(
        extra="forbid", strict=True, populate_by_name=True, json_schema_extra={"examples": [_EXAMPLE]}
    )

    text: str = Field(..., min_length=1, description="cloze question with exactly one [MASK] (length limit: the server's limits.max_text_chars)")
    subject: str | None = Field(
        None, min_length=1, max_length=300, description="the entity asked about; its own article is searched (alone) when it has one"
    )
    top_k: int | None = Field(None, ge=1, description="answers returned (default: the server's, 10; at most limits.max_top_k)")
    retriever: RetrieverName | None = Field(None, description="article ranker (default bm25); none = whole datastore")
    num_articles: int | None = Field(None, ge=1, description="N articles searched (default 3; at most limits.max_num_articles)")
    k: int | None = Field(None, ge=1, description="neighbours (default 128; at most limits.max_k)")
    temperature: Annotated[float, Field(gt=0, le=1000)] | Literal["auto"] | None = Field(
        None,
        description="l in softmax(-d/l); auto: the datastore's own factor, measured when it was built, times the "
        "median distance of this query's neighbours (default: the server's, auto)",
    )
    lambda_: float | None = Field(None, ge=0, le=1, alias="lambda", description="kNN weight (default 0.3)")
    mlm_prior: float | None = Field(
        None, ge=0, le=4, description="the neighbours' vote for a word weighted by p_MLM(word) to this power, so that "
        "words that fit the question win the article's votes; 0: the paper's plain vote (default: the server's, "
        "0.15; word answers, not entity answers)",
    )
    article_sharpness: float | None = Field(
        None, ge=0, le=100, description="neighbours from articles the ranker scored lower count less: each one's "
        "weight times exp(-article_sharpness * (1 - its article's score / the top score)); 0: every retrieved "
        "article counts the same, as in the paper (default: the server's, 10)",
    )
    interpolation: Literal["fixed", "adaptive"] | None = Field(
        None,
        description="fixed: p = lambda p_kNN + (1 - lambda) p_MLM; adaptive: lambda per query from the confidence of "
        "both distributions, and no retrieval or kNN at all when p_MLM is confident (default: the server's, fixed; "
        "a request that sets lambda alone is fixed)",
    )
    return_contexts: bool = Field(True, description="include supporting contexts for each answer")
    any_token: bool = Field(
        False, description="rank every vocabulary entry: special tokens, punctuation and word pieces (##s) too, as "
        "the LAMA probe does; by default answers are words"
    )
    contexts_per_answer: int = Field(3, ge=0, le=20)
    answer: Literal["word", "entity"] = Field(
        "word",
        description="word: answers are words (the paper's); entity: answers are Wikipedia entities, voted for by the "
        "neighbours linked to them whatever their surface form (datastores with links; docs/entities.md)",
    )
    deadline_ms: int | None = Field(
        None, ge=1, description="how long this request may run, if shorter than the server's limits.deadline_ms "
        "(default 5000); past it the answer is a 504 with Retry-After"
    )


_FOLLOW_EXAMPLE: Any = {
    "subject": "Galileo Galilei",
    "relations": ["[X] was born in [Y] .", "[X] is located in [Y] ."],
    "top_k": 5,
    "beam": DEFAULT_BEAM,
}


class FollowRequest(BaseModel):
    """Multi-hop relation following from one entity (docs/entities.md): each hop's template is asked of the
    previous hop's most probable entities, restricted to their own articles."""

    model_config = ConfigDict(
        extra="forbid", strict=True, populate_by_name=True, json_schema_extra={"examples": [_FOLLOW_EXAMPLE]}
    )

    subject: str = Field(..., min_length=1, max_length=300, description="the entity to start from: a title")
    relations: list[Annotated[str, Field(min_length=1, max_length=500)]] = Field(
        ..., min_length=1, description="one template per hop, each with one [X] (the entity) and one [Y] (the answer); "
        "at most limits.max_follow_hops"
    )
    top_k: int = Field(10, ge=1, description="entities returned per hop and answers (at most limits.max_top_k)")
    beam: int = Field(
        DEFAULT_BEAM, ge=1, description="entities of a hop that the next hop starts from (at most limits.max_beam)"
    )
    retriever: RetrieverName | None = Field(None, description="ranker for an entity without an article (default bm25)")
    num_articles: int | None = Field(None, ge=1, description="N articles for an entity without an article (default 3)")
    k: int | None = Field(None, ge=1, description="neighbours per hop query (default 128)")
    temperature: Annotated[float, Field(gt=0, le=1000)] | Literal["auto"] | None = None
    lambda_: float | None = Field(None, ge=0, le=1, alias="lambda", description="kNN weight (default 0.3)")
    contexts_per_answer: int = Field(2, ge=0, le=20, description="supporting sentences per entity and step")
    deadline_ms: int | None = Field(
        None, ge=1, description="how long this request may run, if shorter than the server's limits.deadline_ms "
        "(default 5000); past it the answer is a 504 with Retry-After"
    )


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [{"queries": [_EXAMPLE]}]})
    queries: list[PredictRequest] = Field(
        ..., min_length=1, description="at most the server's limits.max_batch_queries (default 64)"
    )
    deadline_ms: int | None = Field(
        None, ge=1, description="how long the whole batch may run, if shorter than the server's limits.deadline_ms "
        "(default 5000); past it the answer is a 504 with Retry-After"
    )


class ContextOut(BaseModel):
    article: str
    sentence: str = Field(..., description="the stored sentence, the word marked as **word**")
    distance: float
    rank: int


class EntityOut(BaseModel):
    title: str = Field(..., description="the entity's Wikipedia title (after redirects)")
    popularity: int = Field(..., description="links to it kept in the datastore's live articles")


class PredictionOut(BaseModel):
    token: str = Field(..., description="the answer: a word, or an entity's title (answer: entity)")
    prob: float
    p_mlm: float
    p_knn: float
    contexts: list[ContextOut]
    multi_piece: bool = Field(False, description="the answer is a word of several wordpieces (whole-word datastores)")
    pieces: int = Field(1, ge=1, description="wordpieces of the answer")
    entity: EntityOut | None = Field(
        None, description="the entity the answer stands for (datastores with links; null when none is known)"
    )


class TokenProbOut(BaseModel):
    token: str
    prob: float


class ArticleOut(BaseModel):
    title: str
    score: float | None = Field(..., description="ranker score; null when the subject rule picked the article")
    rule: Literal["subject", "bm25", "tfidf", "none"]


class ModelIdentity(BaseModel):
    model_config = ConfigDict(protected_namespaces=())
    name: str
    weights_sha256: str
    layer: int
    num_layers: int


class DatastoreIdentity(BaseModel):
    model_config = ConfigDict(protected_namespaces=())
    id: str
    version: int
    articles: int
    contexts: int
    model_name: str


class PredictResponse(BaseModel):
    predictions: list[PredictionOut]
    mlm: list[TokenProbOut]
    knn: list[TokenProbOut]
    articles: list[ArticleOut]
    lambda_used: float = Field(..., description="the kNN weight applied (0 when no neighbour was found)")
    interpolation: Literal["fixed", "adaptive"] = Field("fixed", description="how lambda_used was chosen")
    knn_skipped: bool = Field(
        False, description="adaptive: p_MLM was confident, so no retrieval and no kNN search ran (lambda_used 0)"
    )
    temperature_used: float = Field(..., description="l applied in softmax(-d/l): the request's, or for auto the one derived from this query's neighbours")
    subject_status: Literal["found", "redirect", "folded", "not_found"] | None = Field(
        None, description="how the request's subject was matched to an article (found: its exact title; redirect: "
        "through a redirect; folded: ignoring case and accents); not_found: no article, so the retriever ranked "
        "the articles instead; null when the request named no subject"
    )
    warnings: list[str] = Field(
        default_factory=list, description="fallbacks the caller should know of: a subject that has no article, no "
        "context to vote (no article matched the question, or none of those searched holds a context), a question "
        "in another script than the datastore's, a question longer than the window the model reads"
    )
    timings_ms: dict[str, float]
    cache: dict[str, Literal["hit", "miss", "none"]]
    model: ModelIdentity
    datastore: DatastoreIdentity


class BatchResponse(BaseModel):
    results: list[PredictResponse]


class ErrorDetail(BaseModel):
    code: str
    message: str
    request_id: str


class ErrorBody(BaseModel):
    error: ErrorDetail


class CacheHealth(BaseModel):
    backend: Literal["redis", "memory", "none"]
    state: Literal["ok", "degraded", "disabled"]
    detail: str = ""


class ReadyResponse(BaseModel):
    status: Literal["ready", "not_ready"]
    model: ModelIdentity | None = None
    datastore: DatastoreIdentity | None = None
    retrievers: list[str] = Field(default_factory=list)
    cache: CacheHealth | None = None
    detail: str = ""


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReloadResponse(BaseModel):
    status: Literal["reloaded", "unchanged"] = Field(
        ..., description="reloaded: new requests use the new version; unchanged: the manifest on disk is the one served"
    )
    previous: DatastoreIdentity
    datastore: DatastoreIdentity = Field(..., description="the version now serving")
    seconds: float = Field(..., description="time to open the new version (validation, indexes)")
    draining: int = Field(0, description="requests still finishing on the previous version")
    processes: int = Field(1, description="server processes serving the new version when this answered (all of them "
                           "unless one was still opening it after reload_wait_s)")


class FollowEntityOut(BaseModel):
    title: str
    prob: float
    contexts: list[ContextOut]
    found_by: str | None = Field(
        None, description="how the articles this step was read from were found: subject (the entity's own article), "
        "redirect, folded, or the retriever that ranked them when the entity has no article; null for the subject"
    )


class FollowHopOut(BaseModel):
    relation: str
    entities: list[FollowEntityOut] = Field(..., description="the hop's weighted set of entities, most probable first")


class FollowAnswerOut(BaseModel):
    title: str
    prob: float = Field(..., description="the mass of the paths that reach this entity")
    path: list[FollowEntityOut] = Field(
        ..., description="the subject, then the entity each hop went through (its probability at that hop and the "
        "sentences that support the step)"
    )


class FollowResponse(BaseModel):
    subject: str = Field(..., description="the subject's title, as resolved")
    hops: list[FollowHopOut]
    answers: list[FollowAnswerOut]
    warnings: list[str] = Field(
        default_factory=list, description="fallbacks taken: a hop whose entity has no article of its own, and each "
        "hop's answers' own warnings (an entity whose article holds no context that links an entity...)"
    )
    timings_ms: dict[str, float]
    model: ModelIdentity
    datastore: DatastoreIdentity
