"""`RestrictedKnn` and `ArticleSearch` on each kind of row a datastore holds: float16 rows read at once or left
unread until a first search, float32 rows, and codes under a codec; every path gives the exact nearest rows of the
articles asked for, with their global ids, labels and articles."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from bertknn.core.format import RowSlice
from bertknn.core.format.codec import CodecSpec, CodeSearcher, decode, encode, train_codec
from bertknn.service.retrieval.knn import RestrictedKnn

DIM = 16


@dataclass
class Store:
    """A datastore stand-in: each title's rows as a `RowSlice` (a subset of its payload where ``keep`` says)."""

    payload: dict[str, np.ndarray]
    first_id: dict[str, int]
    keep: dict[str, np.ndarray] = field(default_factory=dict)
    code_searcher: CodeSearcher | None = None
    asked: list[tuple[tuple[str, ...], str]] = field(default_factory=list)

    def row_slices(self, titles: list[str], answer: str = "word") -> list[RowSlice | None]:
        self.asked.append((tuple(titles), answer))
        return [self._slice(t) for t in titles]

    def _slice(self, title: str) -> RowSlice | None:
        if title not in self.payload:
            return None
        p, keep = self.payload[title], self.keep.get(title)
        idx = np.arange(len(p)) if keep is None else keep
        ids = (self.first_id[title] + idx).astype(np.int64)
        return RowSlice(p, keep, (ids % 97 + 1000).astype(np.int32), ids)


def _store(dtype: type = np.float16, sizes: tuple[int, ...] = (40, 25, 60)) -> Store:
    rng = np.random.default_rng(1)
    titles = [f"A{i}" for i in range(len(sizes))]
    payload = {t: rng.normal(size=(n, DIM)).astype(dtype) for t, n in zip(titles, sizes, strict=True)}
    first = dict(zip(titles, np.cumsum((0, *sizes))[:-1].tolist(), strict=True))
    return Store(payload, {t: 10_000 * (i + 1) + f for i, (t, f) in enumerate(first.items())})


def _expected(store: Store, titles: list[str], vectors: dict[str, np.ndarray], query: np.ndarray, k: int):
    """Brute force: every asked title's rows taken (in title order), squared L2 in float64, nearest first."""
    rows, ids, labels, arts = [], [], [], []
    for a, t in enumerate(titles):
        s = store._slice(t)
        if s is None:
            continue
        rows.append(vectors[t] if s.keep is None else vectors[t][s.keep])
        ids.append(s.ids)
        labels.append(s.labels)
        arts.append(np.full(len(s), a))
    x = np.concatenate(rows).astype(np.float64)
    d = ((x - query.astype(np.float64)) ** 2).sum(1)
    order = np.argsort(d, kind="stable")[:k]
    article = None if len(titles) < 2 else np.concatenate(arts)[order]  # one article asked: nothing to weigh
    return d[order], np.concatenate(ids)[order], np.concatenate(labels)[order], article


def _check(got, want, rtol: float = 1e-4) -> None:
    d, ids, labels, arts = want
    np.testing.assert_array_equal(got.rows, ids)
    np.testing.assert_array_equal(got.labels, labels)
    np.testing.assert_allclose(got.distances, d, rtol=rtol, atol=1e-3)
    assert got.distances.dtype == np.float32 and got.labels.dtype == np.int32 and got.rows.dtype == np.int64
    if arts is None:
        assert got.article is None
    else:
        assert got.article is not None, "several articles asked: each neighbour's article is needed"
        np.testing.assert_array_equal(got.article, arts)


@pytest.mark.parametrize("read", [True, False])
def test_float16_rows_give_the_exact_nearest_rows_of_the_asked_articles(read: bool):
    store = _store()
    store.keep["A2"] = np.array([0, 3, 4, 10, 11, 59])  # an entity-style subset of one article's rows
    titles = ["A2", "missing", "A0"]
    search = RestrictedKnn(store).prepare(titles, read=read)
    assert store.asked == [(tuple(titles), "word")]
    assert len(search) == 6 + 40 and search.float16
    assert (search.index is None) == (not read) and bool(search.unread) == (not read)
    q = np.random.default_rng(2).normal(size=DIM).astype(np.float32)
    vectors = {t: v.astype(np.float32) for t, v in store.payload.items()}
    for k in (1, 7, 46, 500):  # k beyond the rows gives them all
        got = search.search(q, k)
        assert len(got) == min(k, 46)
        _check(got, _expected(store, titles, vectors, q, k))
    # the article of each neighbour indexes ``titles``: "missing" (1) holds none
    assert set(search.search(q, 46).article.tolist()) == {0, 2}


def test_unread_rows_are_read_once_and_equal_to_the_read_ones():
    store = _store()
    store.keep["A1"] = np.array([1, 2, 24])
    titles = ["A0", "A1"]
    unread = RestrictedKnn(store).prepare(titles, read=False)
    read = RestrictedKnn(store).prepare(titles)
    want = np.concatenate([store.payload["A0"], store.payload["A1"][[1, 2, 24]]])
    out = np.zeros_like(want)
    unread.read_float16_into(out)  # before any search: straight from the shards
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(unread.float16_rows(), want)
    np.testing.assert_array_equal(read.float16_rows(), want)
    index = unread._float16_index()
    assert index is unread._float16_index()  # built once, then kept
    out[...] = 0
    unread.read_float16_into(out)  # after: from the index built on the first read
    np.testing.assert_array_equal(out, want)
    q = np.ones(DIM, np.float32)
    a, b = unread.search(q, 9), read.search(q, 9)
    np.testing.assert_array_equal(a.rows, b.rows)
    np.testing.assert_array_equal(a.distances, b.distances)


def test_float32_rows_are_searched_exactly_and_are_not_float16():
    store = _store(np.float32)
    titles = ["A1", "A2"]
    search = RestrictedKnn(store).prepare(titles)
    assert search.index is None and search.vectors is not None and not search.float16
    assert search.float16_rows() is None
    with pytest.raises(ValueError, match="not float16"):
        search.read_float16_into(np.zeros((len(search), DIM), np.float16))
    q = np.random.default_rng(3).normal(size=DIM).astype(np.float32)
    _check(search.search(q, 20), _expected(store, titles, store.payload, q, 20))


def test_codes_are_searched_by_the_codec_as_their_decoded_vectors():
    store = _store(np.float32, sizes=(80, 50))
    codec = train_codec(CodecSpec("int8"), np.concatenate(list(store.payload.values())))
    store.payload = {t: encode(codec, v) for t, v in store.payload.items()}
    store.code_searcher = CodeSearcher(codec)
    titles = ["A0", "A1"]
    search = RestrictedKnn(store).prepare(titles, "entity")
    assert store.asked[-1] == (tuple(titles), "entity") and search.answer == "entity"
    assert search.codes is not None and search.codes.dtype == np.uint8 and not search.float16
    decoded = {t: decode(codec, c) for t, c in store.payload.items()}
    q = np.random.default_rng(4).normal(size=DIM).astype(np.float32)
    _check(search.search(q, 12), _expected(store, titles, decoded, q, 12), rtol=1e-3)


def test_articles_without_rows_give_an_empty_search_and_one_article_no_article_column():
    store = _store()
    empty = RestrictedKnn(store).prepare(["nowhere", "else"])
    assert len(empty) == 0 and len(empty.search(np.zeros(DIM, np.float32), 5)) == 0
    assert empty.labels.shape == empty.rows.shape == (0,)
    assert empty.titles == ("nowhere", "else")
    one = RestrictedKnn(store).prepare(["A1"])
    assert one.row_article is None and one.search(np.zeros(DIM, np.float32), 3).article is None
