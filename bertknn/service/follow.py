"""Multi-hop relation following (DrKIT's ``X.follow(R1).follow(R2)``) with BERT-kNN's entity answers.

Hop 1 asks the first template with ``[X]`` = the subject's name, restricted to the subject's article (the
subject rule; BM25's articles when it has none), with ``answer: entity``: a weighted set of entities. Each next hop
asks the next template once for each of the ``beam`` most probable entities of the previous hop (all in one
batch: one forward pass), restricted to that entity's article; each result is weighted by its entity's
probability and the weighted results are summed:

    P_{h+1}(a) = sum over e in beam(P_h) of P_h(e) * p(a | e, R_{h+1})

where p(a | e, R) is the entity answer's p for the query "R with [X] = e". The beam keeps the probabilities as
they are (not renormalised), so an answer's probability is the mass of the paths that reach it. Each answer
keeps its best path: the entity of every hop that contributed most, with the sentences that support each step.

Names of several wordpieces get their p_MLM from a fill pass (`bertknn.service.entities`). A hop fills them once
for all its queries, in one forward pass, and only as many as the hop hands on (the beam; the last hop's top_k):
those whose P_h(e) * p(a | e, R), before the fill, ranks highest over the hop; the others keep p_MLM 0. So a
hop costs one fill pass whatever the beam, not one per parent with a margin of candidates each.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from bertknn.core.errors import InvalidRequest
from bertknn.service.assemble import subject_warnings
from bertknn.service.entities import FILL_CANDIDATES, MAX_NAME_PIECES, surface_form
from bertknn.service.results import Answer, Context, Query

if TYPE_CHECKING:
    from bertknn.service.pipeline import AnswerPipeline

_X, _Y = "[X]", "[Y]"
_MASK = re.compile(r"\[mask\]", re.IGNORECASE)


def check_template(template: str, i: int) -> None:
    """A relation template has exactly one [X] and one [Y], and no [MASK] of its own."""
    nx, ny = template.count(_X), template.count(_Y)
    if nx != 1 or ny != 1:
        raise InvalidRequest(
            f"relations.{i}: a template needs exactly one [X] (the entity) and one [Y] (the answer); "
            f"{template!r} has {nx} [X] and {ny} [Y]"
        )
    if _MASK.search(template):
        raise InvalidRequest(f"relations.{i}: write the answer's place as [Y], not [MASK]")


def fill(template: str, entity_title: str, lower: bool) -> str:
    """The cloze question of one hop: [X] = the entity's name, [Y] = [MASK]."""
    return template.replace(_X, surface_form(entity_title, lower)).replace(_Y, "[MASK]")


@dataclass(frozen=True)
class Step:
    """One hop of a path: the entity reached, its probability at that hop, the sentences that support it."""

    title: str
    prob: float
    contexts: list[Context] = field(default_factory=list)
    found_by: str | None = None  # how the articles this step was read from were found; None for the subject


@dataclass(frozen=True)
class HopEntity:
    title: str
    prob: float
    contexts: list[Context]
    via: str | None  # the previous hop's entity that contributed most (None at hop 1: the subject)
    found_by: str | None = None  # how that parent's query found its articles (subject, redirect, folded, bm25...)


@dataclass(frozen=True)
class Hop:
    relation: str
    entities: list[HopEntity]  # most probable first


@dataclass(frozen=True)
class FollowAnswer:
    title: str
    prob: float
    path: list[Step]  # one step per hop, the subject first


@dataclass(frozen=True)
class FollowResult:
    subject: str
    hops: list[Hop]
    answers: list[FollowAnswer]
    warnings: list[str] = field(default_factory=list)


def combine(
    parents: Sequence[tuple[str, float]],
    results: Sequence[Sequence[tuple[str, float, list[Context]]]],
    found_by: Sequence[str | None] | None = None,
) -> list[HopEntity]:
    """One hop's weighted set: ``results[i]`` is the entity answer (title, p, contexts) of parent ``parents[i]``
    (title, weight); P(a) = sum_i weight_i * p_i(a), each entity keeping the parent that gave it most.
    ``found_by[i]``: how parent i's query found its articles."""
    rules = list(found_by) if found_by is not None else [None] * len(parents)
    total: dict[str, float] = {}
    best: dict[str, tuple[float, str, list[Context], str | None]] = {}
    for (parent, weight), answers, rule in zip(parents, results, rules, strict=True):
        for title, p, contexts in answers:
            share = weight * p
            total[title] = total.get(title, 0.0) + share
            if title not in best or share > best[title][0]:
                best[title] = (share, parent, contexts, rule)
    ranked = sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))
    return [HopEntity(t, p, best[t][2], best[t][1], best[t][3]) for t, p in ranked]


def found_by(answer: Answer) -> str | None:
    """How a hop's query found its articles: the rule of its retrieved articles (subject, redirect, bm25...)."""
    if not answer.articles:
        return None
    rule = answer.articles[0].rule
    return answer.subject_status if rule == "subject" and answer.subject_status in ("redirect", "folded") else rule


def hop_warnings(
    h: int, titles: list[str], queries: list[Query], answers: list[Answer], rules: list[str | None]
) -> list[str]:
    """What hop ``h`` (from 0) must say of each entity it asked from: that it has no article (and which rule
    ranked its articles instead), and its answer's other warnings (no context voted...), each once."""
    out: list[str] = []
    for title, q, a, rule in zip(titles, queries, answers, rules, strict=True):
        if a.subject_status == "not_found":
            out.append(f"hop {h + 1}: {title!r} has no article in this datastore; its articles were ranked by {rule}")
        said = set(subject_warnings(q, a.subject_status))  # (just said in the hop's words)
        out += [f"hop {h + 1}: {title!r}: {w}" for w in a.warnings if w not in said]
    return list(dict.fromkeys(out))


class InProcess:
    """`follow`'s ``ask`` and ``fill_names`` answered synchronously by a pipeline (evaluation, CLI, benchmarks;
    the server routes them through its model thread instead)."""

    def __init__(self, pipeline: AnswerPipeline):
        self.pipeline = pipeline
        self.batches: list[int] = []  # the number of queries of each ``ask``

    async def ask(self, queries: list[Query]) -> list[Answer]:
        self.batches.append(len(queries))
        return self.pipeline.predict_batch(queries)

    async def fill_names(self, requests: list[tuple[str, list[str]]]) -> list[list[float]]:
        return self.pipeline.fill_names(requests)


def paths(subject: str, hops: Sequence[Hop], top_k: int) -> list[FollowAnswer]:
    """The last hop's entities with the path each came through (back along ``via``)."""
    index = [{e.title: e for e in hop.entities} for hop in hops]
    out = []
    for e in hops[-1].entities[:top_k]:
        chain: list[HopEntity] = [e]
        for h in range(len(hops) - 1, 0, -1):
            via = chain[-1].via
            if via is None or via not in index[h - 1]:
                break
            chain.append(index[h - 1][via])
        steps = [Step(subject, 1.0)] + [Step(x.title, x.prob, x.contexts, x.found_by) for x in reversed(chain)]
        out.append(FollowAnswer(e.title, e.prob, steps))
    return out


FillNames = Callable[[list[tuple[str, list[str]]]], Awaitable[list[list[float]]]]


def to_fill(parents: Sequence[tuple[str, float]], answers: Sequence[Answer], need: int) -> list[tuple[int, int]]:
    """The (answer, prediction) pairs whose names a hop fills: several-piece names (at most `MAX_NAME_PIECES`),
    the ``need`` with the highest parent weight x p before the fill (each answer lists its `FILL_CANDIDATES`
    best, as a single entity answer fills them)."""
    pairs = [
        (weight * p.prob, a, i)
        for a, ((_, weight), answer) in enumerate(zip(parents, answers, strict=True))
        for i, p in enumerate(answer.predictions)
        if 1 < p.pieces <= MAX_NAME_PIECES
    ]
    pairs.sort(key=lambda x: (-x[0], x[1], x[2]))
    return [(a, i) for _, a, i in pairs[:need]]


async def fill_hop(
    queries: Sequence[Query], answers: list[Answer], chosen: Sequence[tuple[int, int]], fill_names: FillNames
) -> list[Answer]:
    """``answers`` with the ``chosen`` names' p_MLM from one fill pass and p = lambda p_kNN + (1 - lambda)
    p_MLM recomputed for them, each answer's predictions ranked again."""
    by_answer: dict[int, list[int]] = {}
    for a, i in chosen:
        by_answer.setdefault(a, []).append(i)
    order = sorted(by_answer)
    probs = await fill_names(
        [(queries[a].text, [answers[a].predictions[i].token for i in by_answer[a]]) for a in order]
    )
    out = list(answers)
    for a, filled in zip(order, probs, strict=True):
        lam = answers[a].lambda_used
        preds = list(answers[a].predictions)
        for i, p_mlm in zip(by_answer[a], filled, strict=True):
            p = preds[i]
            preds[i] = replace(p, p_mlm=p_mlm, prob=lam * p.p_knn + (1.0 - lam) * p_mlm)
        preds.sort(key=lambda p: -p.prob)  # stable: ties keep the answer's order
        out[a] = replace(answers[a], predictions=preds)
    return out


async def follow(
    subject: str,
    relations: Sequence[str],
    *,
    top_k: int,
    beam: int,
    lower: bool,
    base: Query,
    ask: Callable[[list[Query]], Awaitable[list[Answer]]],
    fill_names: FillNames,
) -> FollowResult:
    """Follow ``relations`` from ``subject`` (a resolved title). ``ask`` answers a batch of entity queries (one
    forward pass) without filling their names; ``fill_names`` scores (question, names) pairs in one fill pass
    (`EntityAnswerer.fill_names`); ``base``: the query options of every hop (k, temperature, lambda, retriever...)."""
    parents: list[tuple[str, float]] = [(subject, 1.0)]
    hops: list[Hop] = []
    warnings: list[str] = []
    for h, relation in enumerate(relations):
        queries = [
            replace(
                base, text=fill(relation, title, lower), subject=title, answer="entity",
                top_k=max(top_k, beam, FILL_CANDIDATES), fill_names=False,
            )
            for title, _ in parents
        ]  # fmt: skip
        answers = await ask(queries)
        chosen = to_fill(parents, answers, beam if h < len(relations) - 1 else top_k)
        if chosen:
            answers = await fill_hop(queries, answers, chosen, fill_names)
        kept = max(top_k, beam)  # each parent's answers that its hop sums (the fill's candidates were more)
        results = [[(p.token, p.prob, p.contexts) for p in a.predictions[:kept]] for a in answers]
        rules = [found_by(a) for a in answers]
        warnings += hop_warnings(h, [t for t, _ in parents], queries, answers, rules)
        entities = combine(parents, results, rules)
        if h == 0:
            entities = [HopEntity(e.title, e.prob, e.contexts, None, e.found_by) for e in entities]
        hops.append(Hop(relation, entities))
        parents = [(e.title, e.prob) for e in entities[:beam]]
        if not parents:
            break
    return FollowResult(
        subject, [Hop(h.relation, h.entities[:top_k]) for h in hops], paths(subject, hops, top_k), warnings
    )
