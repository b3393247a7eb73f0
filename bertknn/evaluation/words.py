"""Whole-word answers in the evaluation (``--multi-piece``): T-REx facts whose object is one word of several
wordpieces, scored against a whole-word datastore.

A kept object is ONE word (the tokenizer's pre-tokenizer does not split it) of 2 to ``MAX_WORD_PIECES``
wordpieces, none unknown; its gold text is the word as the datastore spells words (``bertknn.core.words``).
Objects of several words and single wordpieces (those are the ordinary, single-piece section) are counted and
dropped. The query is LAMA's template with one [MASK], whatever the object's length.

Ranks (`word_result`): the gold word's 1-based rank among the pipeline's candidate words (the neighbours' words
and the MLM's top one-piece words, see ``bertknn.service.words``) plus the gold itself when it is not among them, under
p_MLM (one-piece words: the query's p_MLM; multi-piece: sequential fill), p_kNN and their interpolation. The
gold is always scored, so the MLM column is the MLM's own ranking of the gold against those candidates; a zero
probability is no rank. Ties go to the earlier candidate, the gold last.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from bertknn.core.text import MASK_RE
from bertknn.core.words import MAX_WORD_PIECES
from bertknn.evaluation.base import Runner, RunSettings, gold_rank
from bertknn.evaluation.lama import (
    TREX,
    Fact,
    LamaQuery,
    ObjectVocabulary,
    Relation,
    fill_template,
    read_facts,
)
from bertknn.evaluation.metrics import QueryResult, format_table, report_dict, summarize
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Answer
from bertknn.service.words import WordDistributions

logger = logging.getLogger(__name__)

METHOD_NOTE = (
    f"T-REx facts whose object is one word of 2-{MAX_WORD_PIECES} wordpieces; one [MASK] per query; gold ranked "
    "among the candidate words (neighbours' words + the MLM's top one-piece words) plus the gold; p_MLM of a "
    "multi-piece word by left-to-right sequential fill (product of the piece probabilities)"
)


@dataclass
class MultiPieceStats:
    """What happened to a relation's facts on the way to multi-piece queries."""

    read: int = 0
    no_subject: int = 0
    bad_mask: int = 0
    several_words: int = 0
    single_wordpiece: int = 0
    unknown_piece: int = 0
    too_many_pieces: int = 0
    duplicate: int = 0
    over_limit: int = 0
    kept: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def object_word(vocab: ObjectVocabulary, obj: str) -> tuple[str, tuple[int, ...]] | str:
    """The object as one multi-piece word ``(text, pieces)``, or the name of the filter that drops it."""
    words = vocab.words
    text = vocab.normalize(obj.strip())
    if not text:
        return "several_words"
    tok = words.tokenize([f" {text}"])[0]
    found = words.words(tok)
    if len(found) != 1 or (found[0].start, found[0].end) != (1, len(tok.text)):
        return "several_words"
    pieces = tuple(tok.ids[i] for i in words.content(tok, found[0]))
    if not set(pieces).isdisjoint(words.special_ids) or vocab.tokenizer.unk_token_id in pieces:
        return "unknown_piece"
    if len(pieces) == 1:
        return "single_wordpiece"
    if len(pieces) > MAX_WORD_PIECES:
        return "too_many_pieces"
    return words.decode_word(pieces), pieces


def build_multi_piece_queries(
    relation: Relation, facts: Iterable[Fact], vocab: ObjectVocabulary, *, limit: int | None = None
) -> tuple[list[LamaQuery], MultiPieceStats]:
    """Template queries for the facts of one T-REx relation whose object is a single multi-piece word.

    Filters, in order: subject present, object one word of several wordpieces, duplicate (subject, object) pair,
    ``limit`` (the first N kept, in file order).
    """
    stats = MultiPieceStats()
    out: list[LamaQuery] = []
    seen: set[tuple[str, str]] = set()
    assert relation.template is not None
    for fact in facts:
        stats.read += 1
        subject = (fact.subject or "").strip()
        if not subject:
            stats.no_subject += 1
            continue
        if MASK_RE.search(subject):
            stats.bad_mask += 1
            continue
        word = object_word(vocab, fact.obj)
        if isinstance(word, str):
            setattr(stats, word, getattr(stats, word) + 1)
            continue
        gold, pieces = word
        text = fill_template(relation.template, subject, lowercase=vocab.lowercase)
        if (text, gold) in seen:
            stats.duplicate += 1
            continue
        seen.add((text, gold))
        if limit is not None and len(seen) > limit:
            stats.over_limit += 1
            continue
        out.append(LamaQuery(relation.id, relation.dataset, fact.uid, text, subject, gold, -1, pieces))
    stats.kept = len(out)
    return out, stats


def load_multi_piece_probe(
    relations: Sequence[Relation], vocab: ObjectVocabulary, *, limit: int | None = None
) -> tuple[list[LamaQuery], dict[str, MultiPieceStats]]:
    """Multi-piece queries of the T-REx relations among ``relations`` (the others have no such section)."""
    queries: list[LamaQuery] = []
    stats: dict[str, MultiPieceStats] = {}
    for rel in relations:
        if rel.dataset != TREX:
            continue
        qs, st = build_multi_piece_queries(rel, read_facts(rel), vocab, limit=limit)
        queries.extend(qs)
        stats[rel.id] = st
        logger.info(
            "%s %s multi-piece: %d queries (%s)", rel.dataset, rel.id, len(qs), json.dumps(st.as_dict())
        )
    return queries, stats


def word_result(pipeline: AnswerPipeline, q: LamaQuery, answer: Answer) -> QueryResult:
    """The gold word's ranks under p_MLM, p_kNN and the interpolation of a whole-word answer."""
    d = answer.distributions
    if not isinstance(d, WordDistributions) or pipeline.words is None:
        raise TypeError("word_result needs the answer of a whole-word datastore, with distributions")
    p_mlm, p_knn, p = (np.asarray(a, dtype=np.float64) for a in (d.p_mlm, d.p_knn, d.p))
    gold = d.index(q.obj)
    if gold is None:  # not a candidate: score it, p_kNN = 0
        pieces = q.obj_pieces or (q.obj_id,)
        if len(pieces) > 1:
            g_mlm = float(pipeline.words.fill.fill_probs(q.text, [pieces])[0])
        else:
            assert d.token_p_mlm is not None
            g_mlm = float(d.token_p_mlm[pieces[0]])
        g_p = float(np.float32((1.0 - answer.lambda_used) * g_mlm))
        p_mlm, p_knn, p = np.append(p_mlm, g_mlm), np.append(p_knn, 0.0), np.append(p, g_p)
        gold = len(p) - 1

    def top(values: np.ndarray) -> str:
        i = int(np.argmax(values[: len(d.words)])) if len(d.words) else -1
        return d.words[i].text if i >= 0 and values[i] > 0 else ""

    return QueryResult(
        q.relation,
        q.dataset,
        q.uid,
        gold_rank(p_mlm, gold),
        gold_rank(p_knn, gold),
        gold_rank(p, gold),
        (top(p_mlm), top(p_knn), top(p)),
    )


@dataclass(frozen=True)
class MultiPieceSection:
    """The ``--multi-piece`` part of a run: its table and its ``report["multi_piece"]`` block."""

    queries: list[LamaQuery]
    results: list[QueryResult]
    report: dict
    table: str


def evaluate_multi_piece(
    runner: Runner,
    settings: RunSettings,
    relations: Sequence[Relation],
    vocab: ObjectVocabulary,
    *,
    limit: int | None = None,
) -> MultiPieceSection:
    """Build, run and summarise the multi-piece T-REx queries (macro over relations, as the main table)."""
    queries, stats = load_multi_piece_probe(relations, vocab, limit=limit)
    filters = {rel: st.as_dict() for rel, st in stats.items()}
    if not queries:
        note = "no T-REx fact with a one-word, multi-piece object survived the filters (see filters)"
        return MultiPieceSection(
            [], [], {"facts": 0, "note": note, "method": METHOD_NOTE, "filters": filters}, note
        )
    results = runner.run(queries, settings)
    summary = summarize(results)
    body = report_dict(summary, {})
    block = {
        **body["macro"],
        "facts": summary.facts,
        "micro": {c: {k: round(v, 2) for k, v in summary.micro[c].items()} for c in summary.micro},
        "relations": body["relations"],
        "method": METHOD_NOTE,
        "filters": filters,
    }
    table = format_table(
        summary, title="T-REx, objects of several wordpieces (whole words): P@1/P@5/P@10 in %"
    )
    return MultiPieceSection(queries, results, block, table)
