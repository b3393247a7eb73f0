"""The stored sentences shown behind an answer and the articles a whole-datastore kNN drew from
(`bertknn.service.answer.ContextReader`), over a datastore stand-in whose rows are known."""

from __future__ import annotations

import numpy as np

from bertknn.core.format.reader import ContextRef
from bertknn.service.answer import ContextReader
from bertknn.service.results import ArticleHit, Query
from bertknn.service.retrieval.knn import Neighbours

# global row -> (article, sentence, the word's span)
ROWS = {
    10: ContextRef("Paris", "Paris is in France.", (12, 18)),
    11: ContextRef("Lyon", "Lyon is in France too.", (11, 17)),
    12: ContextRef("Paris", "The Seine flows through Paris.", (24, 29)),
    13: ContextRef("Nice", "Nice is in France.", (11, 17)),
    14: ContextRef("Lyon", "Lyon lies on the Rhone.", (17, 22)),
}


class Store:
    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def contexts(self, rows: list[int]) -> list[ContextRef]:
        self.asked.append(rows)
        return [ROWS[r] for r in rows]


def _neighbours(rows: list[int], labels: list[int]) -> Neighbours:
    distances = np.arange(1, len(rows) + 1, dtype=np.float32) * 2.5
    return Neighbours(distances, np.array(rows, np.int64), np.array(labels, np.int32))


def test_contexts_are_ranked_from_one_with_the_word_in_bold_and_their_distance() -> None:
    reader = ContextReader(Store())  # type: ignore[arg-type]
    nbrs = _neighbours([10, 11, 12], [7, 7, 9])
    got = reader.contexts(nbrs, [2, 0])
    assert [(c.article, c.sentence, c.distance, c.rank) for c in got] == [
        ("Paris", "The Seine flows through **Paris**.", 7.5, 3),
        ("Paris", "Paris is in **France**.", 2.5, 1),
    ]


def test_each_answer_gets_its_nearest_contexts_up_to_the_limit_and_none_when_not_asked() -> None:
    store = Store()
    reader = ContextReader(store)  # type: ignore[arg-type]
    nbrs = _neighbours([10, 11, 12, 13, 14], [7, 9, 7, 7, 4])
    got = reader.by_label(nbrs, nbrs.labels, [7, 4, 5], 2)
    assert [c.rank for c in got[7]] == [1, 3] and [c.rank for c in got[4]] == [5] and got[5] == []
    assert store.asked == [[10, 12, 14]]  # one read for every answer's contexts
    assert [c.rank for c in reader.by_label(nbrs, nbrs.labels, [7], 1)[7]] == [1]  # the nearest alone
    assert reader.by_label(nbrs, nbrs.labels, [7, 4], 0) == {7: [], 4: []} and len(store.asked) == 2


def test_without_retrieval_the_articles_are_those_of_the_first_k_neighbours_by_count() -> None:
    reader = ContextReader(Store())  # type: ignore[arg-type]
    nbrs = _neighbours([11, 10, 14, 12, 13], [1, 2, 3, 4, 5])
    retrieved = [ArticleHit("Paris", 3.2, "bm25")]
    assert reader.articles_seen(Query("x [MASK]", retriever="bm25"), nbrs, retrieved) == retrieved
    seen = reader.articles_seen(Query("x [MASK]", retriever="none", k=4), nbrs, [])
    # among the first 4 neighbours: Lyon twice, Paris twice (Lyon met first), Nice (the 5th) not at all
    assert seen == [ArticleHit("Lyon", 2.0, "none"), ArticleHit("Paris", 2.0, "none")]
    three = reader.articles_seen(Query("x [MASK]", retriever="none", k=3), nbrs, [])
    assert three == [ArticleHit("Lyon", 2.0, "none"), ArticleHit("Paris", 1.0, "none")]
    assert reader.articles_seen(Query("x [MASK]", retriever="none"), _neighbours([], []), []) == []
