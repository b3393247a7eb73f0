"""Entity-level evaluation on a datastore with links (docs/entities.md, docs/evaluation.md "Entities").

- `entity_lama`: LAMA facts asked with ``answer: entity``; the gold entity is the object's article (its label as a
  title); a prediction is right when its title equals the gold title ignoring case and accents. Every fact counts,
  whatever its object's length in wordpieces (the word-level probe keeps one-wordpiece objects only). Rows:
  BERT-kNN and kNN (lambda 1) over entities, and the entity that the word answers of the MLM (lambda 0) and of
  BERT-kNN stand for (`entity_of_words`): what an application gets without entity answers.
- `two_hop`: questions composed from two facts, X r1 Y and Y r2 Z (for example citizenship, then membership),
  answered by relation following (`bertknn.service.follow`, the code `/follow` runs) and, as the baseline, in one
  shot with a single composed template; hop 1 is scored against Y, hop 2 and the one-shot answer against the Zs.
- `popularity_buckets`: word-level P@1 per quartile of the subjects' popularity (inbound links), Mallen et al.'s
  view of when retrieval helps.

All figures are macro averages over relations (LAMA's convention), with each relation's own figures beside them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from bertknn.core.titles import fold_title, normalize_title
from bertknn.evaluation.base import RunSettings
from bertknn.evaluation.lama import Relation, fill_template, read_facts
from bertknn.service.follow import InProcess, follow
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import DEFAULT_BEAM, Answer, Query

# Composed one-shot templates for the two-hop pairs this evaluation asks (r1, r2): [X] is the first fact's subject.
COMPOSED: dict[tuple[str, str], str] = {
    ("P27", "P463"): "[X] is a citizen of a country that is a member of [Y] .",
    ("P495", "P463"): "[X] comes from a country that is a member of [Y] .",
    ("P27", "P138"): "[X] is a citizen of a country named after [Y] .",
    ("P495", "P138"): "[X] comes from a country named after [Y] .",
    ("P19", "P138"): "[X] was born in a place named after [Y] .",
    ("P101", "P527"): "[X] works in a field that consists of [Y] .",
}
TOP = 10


def same_entity(a: str, b: str) -> bool:
    return fold_title(a) == fold_title(b)


def _rank(titles: Sequence[str | None], gold: set[str]) -> int | None:
    """1-based rank of the first title among ``gold`` (folded), or None."""
    for i, t in enumerate(titles):
        if t is not None and fold_title(t) in gold:
            return i + 1
    return None


@dataclass
class Tally:
    """P@1 and P@10 counts of one row over one relation."""

    n: int = 0
    at1: int = 0
    at10: int = 0

    def add(self, rank: int | None) -> None:
        self.n += 1
        self.at1 += rank == 1
        self.at10 += rank is not None and rank <= TOP

    def as_dict(self) -> dict[str, float | int]:
        return {"n": self.n, "p@1": 100.0 * self.at1 / max(1, self.n), "p@10": 100.0 * self.at10 / max(1, self.n)}


@dataclass
class Table:
    """Rows x relations of tallies, with macro averages."""

    rows: tuple[str, ...]
    by_relation: dict[str, dict[str, Tally]] = field(default_factory=dict)

    def tally(self, relation: str, row: str) -> Tally:
        return self.by_relation.setdefault(relation, {r: Tally() for r in self.rows})[row]

    def macro(self, row: str) -> dict[str, float]:
        rel = [t[row] for t in self.by_relation.values() if t[row].n]
        if not rel:
            return {"p@1": float("nan"), "p@10": float("nan"), "relations": 0}
        return {
            "p@1": float(np.mean([100.0 * t.at1 / t.n for t in rel])),
            "p@10": float(np.mean([100.0 * t.at10 / t.n for t in rel])),
            "relations": len(rel),
        }

    def report(self) -> dict[str, object]:
        return {
            "macro": {r: self.macro(r) for r in self.rows},
            "relations": {rel: {r: t.as_dict() for r, t in rows.items()} for rel, rows in self.by_relation.items()},
        }

    def format(self, title: str) -> str:
        lines = [title, f"{'':28s} {'P@1':>6s} {'P@10':>6s}  relations"]
        for r in self.rows:
            m = self.macro(r)
            lines.append(f"{r:28s} {m['p@1']:6.1f} {m['p@10']:6.1f}  {m['relations']}")
        return "\n".join(lines)


def _query(settings: RunSettings, text: str, subject: str | None, **kw: object) -> Query:
    return Query(
        text=text, subject=subject, top_k=TOP, retriever=settings.retriever, num_articles=settings.num_articles,
        k=settings.k, temperature=settings.temperature, lambda_=settings.lambda_, return_contexts=False, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _lowercase(pipeline: AnswerPipeline) -> bool:
    return pipeline.encoder.words.lowercase


def _facts(relation: Relation, limit: int | None) -> list[tuple[str, str]]:
    out = [(f.subject, f.obj) for f in read_facts(relation) if f.subject and f.obj and f.accepted]
    return out[:limit] if limit is not None else out


def entity_lama(
    pipeline: AnswerPipeline,
    relations: Sequence[Relation],
    settings: RunSettings,
    *,
    limit: int | None = None,
    batch_size: int = 32,
    progress: Callable[[int], None] | None = None,
) -> Table:
    """Entity-level P@1/P@10 of the rows in the module docstring."""
    rows = ("BERT-kNN (entity)", "kNN (entity)", "MLM word -> entity", "BERT-kNN word -> entity")
    table = Table(rows)
    lower = _lowercase(pipeline)
    for relation in relations:
        if relation.template is None:
            continue
        facts = _facts(relation, limit)
        for start in range(0, len(facts), batch_size):
            chunk = facts[start : start + batch_size]
            texts = [fill_template(relation.template, s, lowercase=lower) for s, _ in chunk]
            runs: list[list[Answer]] = [
                pipeline.predict_batch([_query(settings, t, s, answer="entity") for t, (s, _) in zip(texts, chunk, strict=True)]),
                pipeline.predict_batch([_query(replace(settings, lambda_=1.0), t, s, answer="entity") for t, (s, _) in zip(texts, chunk, strict=True)]),
                pipeline.predict_batch([_query(replace(settings, lambda_=0.0), t, s) for t, (s, _) in zip(texts, chunk, strict=True)]),
                pipeline.predict_batch([_query(settings, t, s) for t, (s, _) in zip(texts, chunk, strict=True)]),
            ]  # fmt: skip
            for i, (_, obj) in enumerate(chunk):
                gold = {fold_title(normalize_title(obj))}
                for row, answers in zip(rows, runs, strict=True):
                    preds = answers[i].predictions
                    titles = [p.token for p in preds] if "(entity)" in row else [p.entity.title if p.entity else None for p in preds]
                    table.tally(relation.id, row).add(_rank(titles, gold))
            if progress is not None:
                progress(len(chunk))
    return table


@dataclass(frozen=True)
class TwoHop:
    subject: str
    r1: str
    r2: str
    bridge: str  # the gold entity of hop 1
    answers: frozenset[str]  # gold entities of hop 2 (folded titles)


def two_hop_questions(relations: dict[str, Relation], pairs: Sequence[tuple[str, str]], limit: int | None) -> list[TwoHop]:
    """X r1 Y and Y r2 Z from the facts: one question per (X, r1, r2) whose Y is a subject of r2."""
    out: list[TwoHop] = []
    for r1, r2 in pairs:
        if r1 not in relations or r2 not in relations:
            continue
        second: dict[str, set[str]] = {}
        for s, o in _facts(relations[r2], None):
            second.setdefault(fold_title(normalize_title(s)), set()).add(fold_title(normalize_title(o)))
        taken = 0
        for s, o in _facts(relations[r1], None):
            zs = second.get(fold_title(normalize_title(o)))
            if not zs:
                continue
            out.append(TwoHop(s, r1, r2, normalize_title(o), frozenset(zs)))
            taken += 1
            if limit is not None and taken >= limit:
                break
    return out


def two_hop(
    pipeline: AnswerPipeline,
    relations: dict[str, Relation],
    questions: Sequence[TwoHop],
    settings: RunSettings,
    *,
    beam: int = DEFAULT_BEAM,
    progress: Callable[[int], None] | None = None,
) -> Table:
    """Hop-1, hop-2 (relation following) and one-shot (composed template) P@1/P@10, per pair of relations."""
    table = Table(("hop 1 (follow)", "hop 2 (follow)", "one shot (composed)"))
    lower = _lowercase(pipeline)
    base = _query(settings, "", None, answer="entity")

    here = InProcess(pipeline)

    for q in questions:
        t1, t2 = relations[q.r1].template, relations[q.r2].template
        assert t1 is not None and t2 is not None
        subject = pipeline.articles.subjects.resolve(q.subject) or normalize_title(q.subject)
        result = asyncio.run(follow(
            subject, [t1, t2], top_k=TOP, beam=beam, lower=lower, base=base, ask=here.ask, fill_names=here.fill_names
        ))
        pair = f"{q.r1}->{q.r2}"
        hop1 = [e.title for e in result.hops[0].entities]
        table.tally(pair, "hop 1 (follow)").add(_rank(hop1, {fold_title(q.bridge)}))
        hop2 = [a.title for a in result.answers] if len(result.hops) > 1 else []
        table.tally(pair, "hop 2 (follow)").add(_rank(hop2, set(q.answers)))
        composed = COMPOSED[(q.r1, q.r2)]
        (one,) = pipeline.predict_batch(
            [replace(base, text=fill_template(composed, q.subject, lowercase=lower), subject=q.subject)]
        )
        table.tally(pair, "one shot (composed)").add(_rank([p.token for p in one.predictions], set(q.answers)))
        if progress is not None:
            progress(1)
    return table


def popularity_of(pipeline: AnswerPipeline, subject: str) -> int:
    """Inbound links of the subject's entity (its article's title, through redirects); 0 when none link to it."""
    title = pipeline.articles.subjects.resolve(subject) or normalize_title(subject)
    ref = pipeline.datastore.links.entity(title)
    return ref.popularity if ref is not None else 0


def popularity_buckets(
    ranks: Mapping[str, Sequence[int | None]], popularity: Sequence[int], *, buckets: int = 4
) -> dict[str, object]:
    """P@1 per row and per popularity bucket: the subjects nothing links to (popularity 0, often most of them),
    then ``buckets`` quantile buckets of the others (ties kept together: a bucket's edges are values, so there may
    be fewer)."""
    pop = np.asarray(popularity, dtype=np.int64)
    positive = pop[pop > 0]
    edges = np.unique(np.quantile(positive, np.linspace(0, 1, buckets + 1))) if len(positive) else np.zeros(0)
    groups: list[tuple[tuple[float, float], np.ndarray]] = []
    if (pop == 0).any():
        groups.append(((0.0, 0.0), np.flatnonzero(pop == 0)))
    for b in range(max(0, len(edges) - 1)):
        lo, hi = edges[b], edges[b + 1]
        upper = pop <= hi if b == len(edges) - 2 else pop < hi
        groups.append(((float(lo), float(hi)), np.flatnonzero((pop >= lo) & upper & (pop > 0))))
    if len(edges) == 1:  # every linked subject has the same popularity
        groups.append(((float(edges[0]), float(edges[0])), np.flatnonzero(pop == edges[0])))
    out: dict[str, object] = {"zero": int((pop == 0).sum()), "edges": edges.tolist(), "buckets": []}
    for (lo, hi), members in groups:
        row: dict[str, object] = {"popularity": [lo, hi], "n": int(len(members))}
        for name, r in ranks.items():
            hits = [r[i] == 1 for i in members.tolist()]
            row[name] = 100.0 * sum(hits) / max(1, len(hits))
        out["buckets"].append(row)  # type: ignore[attr-defined]
    return out
