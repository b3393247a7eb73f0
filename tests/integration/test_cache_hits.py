"""A query whose encoding the in-process cache holds: where it is finished (the event loop's thread, or the
finisher's), where its articles are retrieved, and that its answer is the synchronous pipeline's either way."""

from __future__ import annotations

import pytest

from bertknn.service.results import Query
from tests.support.hits import answer_hits

TEXTS = ["zorblat was born in [MASK] .", "quimby is a small [MASK] near the sea ."]
LOOP, POOL, RETRIEVAL = "MainThread", "knn", "retrieval"
# case -> (the ranker, the finishing time and retrieval CPU measured per query, whether the hits come through
#          `answer_many`, the threads that finish the two hits, the threads that retrieve their articles)
CASES = {
    "cheap, in-process": ("tfidf", (0.001, 0.0001), False, [LOOP, LOOP], [LOOP, LOOP]),
    # the subject rule needs no ranker: Lucene's is not asked
    "the subject's own article": ("subject", (0.001, 0.0001), False, [LOOP, LOOP], [LOOP, LOOP]),
    "a subject without an article": ("no such subject", (0.001, 0.0001), False, [POOL, POOL], [RETRIEVAL, RETRIEVAL]),
    "a batch request": ("tfidf", (0.001, 0.0001), True, [POOL, POOL], [POOL, POOL]),
    "finishing dearer than the switch interval": ("tfidf", (1.0, 0.0001), False, [POOL, POOL], [POOL, POOL]),
    "retrieving dearer than the switch interval": ("tfidf", (0.001, 1.0), False, [POOL, POOL], [POOL, POOL]),
    # the first hit goes to the finisher, which measures it (after its answer is out: the second may find the
    # measure made or not yet, so either thread is right for it)
    "finishing not measured yet": ("tfidf", (None, 0.0001), False, [POOL, None], [POOL, None]),
    "a ranker outside the interpreter": ("bm25", (0.001, 0.0001), False, [POOL, POOL], [RETRIEVAL, RETRIEVAL]),
    "the whole-datastore search": ("none", (0.001, 0.0001), False, [POOL, POOL], [POOL, POOL]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_cache_hit_is_finished_on_the_event_loop_only_where_that_is_cheap(
    tiny_datastore, tiny_datastore_ivfpq, case: str
) -> None:
    """A hit whose articles are this interpreter's to find (TF-IDF, or the subject's own article whatever the
    ranker; the in-process cache), while this process retrieves and finishes a query in less than the
    interpreter's switch interval, is answered on the event loop's thread with no hand-off, its articles retrieved
    there too. A batch request's hits, a process whose queries retrieve or finish slower (or whose finishing is not
    measured yet), a ranker outside the GIL (Lucene, for a subject without an article too) and the whole-datastore
    search (IVF-PQ) go to the finisher, which also retrieves unless the ranker is outside the interpreter. The
    answers are the synchronous pipeline's."""
    ranker, (finish_s, retrieve_s), many, finisher, retriever = CASES[case]
    subjects = {"subject": [t.split()[0] for t in TEXTS], "no such subject": ["Nowhere Atall"] * 2}.get(ranker)
    if subjects is None:
        queries = [Query(t, retriever=ranker) for t in TEXTS]
    else:  # with Lucene's BM25 for the subject that has no article
        queries = [Query(t, retriever="bm25", subject=s) for t, s in zip(TEXTS, subjects, strict=True)]
    got = answer_hits(tiny_datastore_ivfpq if ranker == "none" else tiny_datastore, queries, finish_s=finish_s,
                      retrieve_s=retrieve_s, many=many)  # fmt: skip
    assert [h.cache["encoding"] for h in got.answers] == ["hit", "hit"]
    assert [None if t is None else f for f, t in zip(got.finished, finisher, strict=True)] == finisher
    assert [None if t is None else r for r, t in zip(got.retrieved, retriever, strict=True)] == retriever
    assert got.finish_s is not None and (finish_s is None or got.finish_s == finish_s)  # measured, or as set
    for hit, want in zip(got.answers, got.expected, strict=True):
        assert [(p.token, p.prob, p.p_mlm, p.p_knn, p.contexts) for p in hit.predictions] == [
            (p.token, p.prob, p.p_mlm, p.p_knn, p.contexts) for p in want.predictions]
        assert (hit.articles, hit.knn, hit.mlm) == (want.articles, want.knn, want.mlm)
    if subjects is not None:
        assert [h.articles[0].rule for h in got.answers] == ["subject" if ranker == "subject" else "bm25"] * 2
