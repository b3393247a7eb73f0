"""``POST /follow``: multi-hop relation following (`bertknn.service.follow`), thin as the other routes."""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from typing import Any

from fastapi import APIRouter, Request

from bertknn.core.errors import InvalidRequest, QueryError, UnknownSubject
from bertknn.service.api.admission import admitted, deadline_s, monotonic_deadline
from bertknn.service.api.deps import AnswererDep, ResourcesDep
from bertknn.service.api.middleware import note
from bertknn.service.api.routes import ERRORS, temperature_value
from bertknn.service.api.schemas import FollowRequest, FollowResponse
from bertknn.service.cost import follow_cost
from bertknn.service.follow import FollowResult, check_template, follow
from bertknn.service.pipeline import NO_LINKS, AnswerPipeline
from bertknn.service.results import Answer, Query
from bertknn.service.retrieval.subject import SubjectResolver
from bertknn.service.settings import ServiceSettings

router = APIRouter()


def base_query(req: FollowRequest, settings: ServiceSettings) -> Query:
    """The options every hop's queries share (text and subject are set per hop)."""
    d, lim = settings.defaults, settings.limits
    checks = [
        ("relations", len(req.relations), lim.max_follow_hops, "hops"),
        ("top_k", req.top_k, lim.max_top_k, ""),
        ("beam", req.beam, lim.max_beam, ""),
        ("k", req.k or d.k, lim.max_k, ""),
        ("num_articles", req.num_articles or d.num_articles, lim.max_num_articles, ""),
    ]
    for name, value, limit, unit in checks:
        if value > limit:
            raise InvalidRequest(f"{name}: {value} {unit} exceeds this server's limit of {limit}".replace("  ", " "))
    for i, template in enumerate(req.relations):
        check_template(template, i)
    return Query(
        text="",
        retriever=req.retriever or d.retriever,
        num_articles=req.num_articles or d.num_articles,
        k=req.k or d.k,
        temperature=temperature_value(req.temperature if req.temperature is not None else d.temperature),
        lambda_=req.lambda_ if req.lambda_ is not None else d.lambda_,
        article_sharpness=d.article_sharpness,
        contexts_per_answer=req.contexts_per_answer,
        return_contexts=req.contexts_per_answer > 0,
        answer="entity",
    )


def resolve_subject(pipe: AnswerPipeline, subject: str) -> str:
    """The subject's article title (exact, redirect, folded), else a linked entity's title; UnknownSubject if none."""
    resolver = SubjectResolver(pipe.datastore)
    title = resolver.resolve(subject)
    if title is not None:
        return title
    ref = pipe.datastore.links.entity(resolver.normalize(subject))
    if ref is not None:
        return ref.title
    raise UnknownSubject(
        f"subject: {subject!r} is neither an article nor a linked entity of this datastore; give a Wikipedia title"
    )


def to_response(result: FollowResult, seconds: float, identity: dict) -> FollowResponse:
    body: dict[str, Any] = {
        "subject": result.subject,
        "hops": [asdict(h) for h in result.hops],
        "answers": [asdict(a) for a in result.answers],
        "warnings": result.warnings,
        "timings_ms": {"total": round(seconds * 1000, 3)},
        **identity,
    }
    return FollowResponse.model_validate(body)


@router.post("/follow", response_model=FollowResponse, responses=ERRORS, summary="Follow relations from an entity")
async def follow_route(
    body: FollowRequest, request: Request, answerer: AnswererDep, resources: ResourcesDep
) -> FollowResponse:
    seconds = deadline_s(resources, body.deadline_ms)
    base = replace(base_query(body, resources.settings), deadline=monotonic_deadline(seconds))
    t0 = time.perf_counter()
    with answerer.lease() as pipe:  # one datastore version for every hop
        if not pipe.datastore.links.has_entities:
            raise QueryError(f"/follow follows entity links, and {NO_LINKS}")
        subject = resolve_subject(pipe, body.subject)

        asked = 0

        async def ask(queries: list[Query]) -> list[Answer]:
            nonlocal asked
            asked += len(queries)
            inputs = [pipe.check_query(q) for q in queries]
            return await answerer.answer_many(queries, inputs, pipeline=pipe)

        async def fill_names(requests: list[tuple[str, list[str]]]) -> list[list[float]]:
            return await answerer.fill_names(pipe, requests, base.deadline)

        lower = pipe.entity_answerer is not None and pipe.entity_answerer.lower
        cost = follow_cost(base, len(body.relations), body.beam, pipe.datastore)
        what = f"this follow of {len(body.relations)} hops with beam {body.beam}"
        result = await admitted(
            request, resources, cost=cost, what=what, seconds=seconds,
            work=lambda: follow(
                subject, body.relations, top_k=body.top_k, beam=body.beam, lower=lower, base=base, ask=ask,
                fill_names=fill_names,
            ),
        )  # fmt: skip
        note(request, hops=len(body.relations), questions=asked)
        return to_response(result, time.perf_counter() - t0, pipe.identity())
