"""HTTP routes: thin (schema in -> pipeline -> schema out)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from bertknn.core.errors import InvalidRequest, QueryError
from bertknn.core.inputs import MaskedInput
from bertknn.service.api.admission import admitted, deadline_s, monotonic_deadline
from bertknn.service.api.deps import AnswererDep, ResourcesDep
from bertknn.service.api.middleware import note
from bertknn.service.api.schemas import (
    BatchRequest,
    BatchResponse,
    CacheHealth,
    ErrorBody,
    HealthResponse,
    PredictRequest,
    PredictResponse,
    ReadyResponse,
)
from bertknn.service.cost import batch_cost, query_cost
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.resources import Resources
from bertknn.service.results import Answer, Query
from bertknn.service.settings import ServiceSettings

router = APIRouter()
ERRORS: dict[int | str, dict[str, Any]] = {
    413: {"model": ErrorBody, "description": "body too large"},
    422: {"model": ErrorBody, "description": "invalid request or query (the message says what to fix)"},
    429: {"model": ErrorBody, "description": "this client has as much work in flight as it may (see Retry-After)"},
    503: {"model": ErrorBody, "description": "not ready, or overloaded (see Retry-After)"},
    504: {"model": ErrorBody, "description": "the request ran past its deadline (see Retry-After)"},
}


def temperature_value(value: float | str) -> float | None:
    """A number, or None for auto (the pipeline applies the datastore's own)."""
    return None if value == "auto" else float(value)


def to_query(req: PredictRequest, settings: ServiceSettings, *, deadline: float | None = None) -> Query:
    """The pipeline's query for a request: the server's defaults where it names none, its limits checked;
    ``deadline``: `monotonic_deadline`'s, or None."""
    d, lim = settings.defaults, settings.limits
    if req.interpolation == "adaptive" and req.lambda_ is not None:
        raise InvalidRequest("lambda: a fixed kNN weight does not apply to interpolation 'adaptive'; drop one of them")
    # a request that names its lambda wants it, whatever the server's default mode
    interpolation = req.interpolation or ("fixed" if req.lambda_ is not None else d.interpolation)
    q = Query(
        text=req.text,
        subject=req.subject,
        top_k=req.top_k or d.top_k,
        retriever=req.retriever or d.retriever,
        num_articles=req.num_articles or d.num_articles,
        k=req.k or d.k,
        temperature=temperature_value(req.temperature if req.temperature is not None else d.temperature),
        lambda_=req.lambda_ if req.lambda_ is not None else d.lambda_,
        mlm_prior=req.mlm_prior if req.mlm_prior is not None else d.mlm_prior,
        article_sharpness=req.article_sharpness if req.article_sharpness is not None else d.article_sharpness,
        return_contexts=req.return_contexts,
        contexts_per_answer=req.contexts_per_answer,
        any_token=req.any_token,
        interpolation=interpolation,
        rule=d.adaptive_rule,
        answer=req.answer,
        deadline=deadline,
    )
    checks = [
        ("text", len(q.text), lim.max_text_chars, "characters"),
        ("top_k", q.top_k, lim.max_top_k, ""),
        ("k", q.k, lim.max_k, ""),
        ("num_articles", q.num_articles, lim.max_num_articles, ""),
    ]
    for name, value, limit, unit in checks:
        if value > limit:
            raise InvalidRequest(f"{name}: {value} {unit} exceeds this server's limit of {limit}".replace("  ", " "))
    return q


def response_fields(answer: Answer, identity: dict) -> dict[str, Any]:
    """The fields of a `PredictResponse`, as plain values and the pipeline's own dataclasses (whose field names
    are the schema's: `Context`, `TokenProb`, `ArticleHit`)."""
    return {
        "predictions": [
            {
                "token": p.token,
                "prob": p.prob,
                "p_mlm": p.p_mlm,
                "p_knn": p.p_knn,
                "contexts": p.contexts,
                "multi_piece": p.pieces > 1,
                "pieces": p.pieces,
                "entity": p.entity,
            }
            for p in answer.predictions
        ],
        "mlm": answer.mlm,
        "knn": answer.knn,
        "articles": answer.articles,
        "lambda_used": answer.lambda_used,
        "temperature_used": answer.temperature_used,
        "interpolation": answer.interpolation,
        "knn_skipped": answer.knn_skipped,
        "subject_status": answer.subject_status,
        "warnings": answer.warnings,
        "timings_ms": answer.timings_ms,
        "cache": answer.cache,
        **identity,
    }


def to_response(answer: Answer, identity: dict) -> PredictResponse:
    """The response model of an answer."""
    return PredictResponse.model_validate(response_fields(answer, identity), from_attributes=True)


@router.post("/predict", response_model=PredictResponse, responses=ERRORS, summary="Answer one cloze question")
async def predict(
    body: PredictRequest, request: Request, answerer: AnswererDep, resources: ResourcesDep
) -> PredictResponse:
    seconds = deadline_s(resources, body.deadline_ms)
    query = to_query(body, resources.settings, deadline=monotonic_deadline(seconds))
    with answerer.lease() as pipe:  # one datastore version for the whole request, even across a live reload
        cost = query_cost(query, pipe.datastore)
        answer = await admitted(
            request, resources, cost=cost, what="this question", seconds=seconds,
            work=lambda: answerer.answer(query, pipeline=pipe),
        )  # fmt: skip
        note(request, cache=answer.cache, stages_ms=answer.timings_ms)
        return to_response(answer, pipe.identity())


def checked_batch(
    body: BatchRequest, resources: Resources, pipe: AnswerPipeline, deadline: float | None
) -> tuple[list[Query], list[MaskedInput]]:
    """Each query of a batch checked and tokenised; one error that names every bad query (``queries.I: why``),
    of the first one's kind, so that a caller fixes them all in one round."""
    queries, inputs, bad = [], [], []
    for i, req in enumerate(body.queries):
        try:
            q = to_query(req, resources.settings, deadline=deadline)
            inputs.append(pipe.check_query(q))
            queries.append(q)
        except (InvalidRequest, QueryError) as exc:
            bad.append((i, exc))
    if bad:
        raise type(bad[0][1])("; ".join(f"queries.{i}: {exc}" for i, exc in bad))
    return queries, inputs


def batch_log_fields(answers: list[Answer]) -> dict[str, Any]:
    """A batch's log fields: how many questions, how many hit each cache, the stage times summed."""
    hits: dict[str, int] = {}
    stages: dict[str, float] = {}
    for a in answers:
        for name, state in a.cache.items():
            hits[name] = hits.get(name, 0) + (state == "hit")
        for name, ms in a.timings_ms.items():
            stages[name] = stages.get(name, 0.0) + ms
    return {"queries": len(answers), "cache_hits": hits, "stages_ms": stages}


@router.post("/predict/batch", response_model=BatchResponse, responses=ERRORS, summary="Answer several questions")
async def predict_batch(
    body: BatchRequest, request: Request, answerer: AnswererDep, resources: ResourcesDep
) -> BatchResponse:
    limit = resources.settings.limits.max_batch_queries
    if len(body.queries) > limit:
        raise InvalidRequest(f"queries: {len(body.queries)} exceeds this server's limit of {limit} per batch")
    asked = [ms for ms in (body.deadline_ms, *(q.deadline_ms for q in body.queries)) if ms is not None]
    seconds = deadline_s(resources, min(asked, default=None))
    deadline = monotonic_deadline(seconds)
    with answerer.lease() as pipe:  # every query of the batch from the same datastore version
        queries, inputs = checked_batch(body, resources, pipe, deadline)
        cost = batch_cost(queries, pipe.datastore)
        answers = await admitted(
            request, resources, cost=cost, what=f"this batch of {len(queries)} questions", seconds=seconds,
            work=lambda: answerer.answer_many(queries, inputs, pipeline=pipe),
        )  # fmt: skip
        identity = pipe.identity()
        note(request, **batch_log_fields(answers))
        return BatchResponse(results=[to_response(a, identity) for a in answers])


@router.get("/healthz", response_model=HealthResponse, summary="Liveness: the process answers")
async def healthz() -> HealthResponse:
    return HealthResponse()


_CACHE_DETAIL = {"degraded": "the cache is unreachable; requests are answered without it (the server log has the error)"}


@router.get(
    "/readyz",
    response_model=ReadyResponse,
    responses={503: {"model": ReadyResponse, "description": "not ready"}},
    summary="Readiness: model, indexes and datastore loaded; cache state",
)
async def readyz(resources: ResourcesDep) -> JSONResponse:
    pipe = resources.pipeline
    if not resources.ready or pipe is None or resources.draining:
        detail = "draining" if resources.draining else (resources.error or "loading")
        body = ReadyResponse(status="not_ready", detail=detail)
        return JSONResponse(body.model_dump(), status_code=503)
    status = pipe.cache.status()
    body = ReadyResponse.model_validate(
        {
            "status": "ready",
            "retrievers": sorted([*pipe.retrievers, *(["none"] if "ivfpq" in pipe.datastore.manifest.indexes else [])]),
            # the state only: the error's text (hosts, addresses) stays in the server's log
            "cache": CacheHealth(backend=status.backend, state=status.state, detail=_CACHE_DETAIL.get(status.state, "")),
            **pipe.identity(),
        }
    )
    return JSONResponse(body.model_dump())


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(resources: ResourcesDep) -> Response:
    resources.metrics.ready.set(1.0 if resources.ready and not resources.draining else 0.0)
    return Response(resources.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
