"""What a request is estimated to cost (forward rows) and the gate that admits it by that cost: each rule of
`bertknn.service.cost`'s docstring, with its boundaries, against a datastore stand-in whose word tables are known."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from bertknn.core.errors import ClientOverloaded, Overloaded, TooCostly
from bertknn.service.cost import (
    ENTITY_FILL_ROWS,
    CostCaps,
    CostGate,
    batch_cost,
    follow_cost,
    neighbour_cost,
    query_cost,
)
from bertknn.service.results import Query
from bertknn.service.words import MLM_CANDIDATES


@dataclass(frozen=True)
class Entry:
    pieces: tuple[int, ...]


@dataclass
class Words:
    entries: list[Entry]


@dataclass(eq=False)
class Shard:
    entries: list[Entry]
    reads: int = 0

    @property
    def words(self) -> Words:
        self.reads += 1
        return Words(self.entries)


@dataclass(eq=False)
class Store:
    """The parts of a `Datastore` the estimate reads (hashable by identity and weakly referenced, as one is)."""

    shards: list[Shard] = field(default_factory=list)
    whole_words: bool = True


def entries(*lengths: int) -> list[Entry]:
    return [Entry(tuple(range(n))) for n in lengths]


@pytest.mark.parametrize(
    ("k", "articles", "rows"),
    [(128, 3, 0), (1, 1, 0), (384, 1, 0), (129, 3, 1), (385, 1, 1), (384, 3, 2), (2048, 50, 266)],
)
def test_a_neighbour_search_beyond_the_default_s_costs_rows(k: int, articles: int, rows: int) -> None:
    """ceil(k x N / 384) - 1: the default query (k 128 over 3 articles) and anything smaller cost nothing more."""
    assert neighbour_cost(Query("q", k=k, num_articles=articles)) == rows


def test_a_word_answer_over_single_pieces_is_its_row_and_its_search() -> None:
    store = Store([Shard(entries(1, 3))], whole_words=False)
    assert query_cost(Query("q"), store) == 1
    assert query_cost(Query("q", k=400, num_articles=3), store) == 1 + 3
    assert store.shards[0].reads == 0  # a single-piece datastore's word tables are never read


def test_an_entity_answer_adds_its_fill_unless_the_caller_names_its_candidates() -> None:
    store = Store(whole_words=False)
    assert query_cost(Query("q", answer="entity"), store) == 1 + ENTITY_FILL_ROWS
    assert query_cost(Query("q", answer="entity", fill_names=False), store) == 1
    # (a whole-word datastore's fill does not add to an entity answer's)
    whole = Store([Shard(entries(5, 5))])
    assert query_cost(Query("q", answer="entity", k=129), whole) == 2 + ENTITY_FILL_ROWS


def test_a_whole_word_answer_adds_its_candidates_fill_rows() -> None:
    """(k + the MLM's candidates, at least top_k) x the mean fill rows of a word: a multi-piece word's pieces,
    a single-piece word's none. Here 2 + 3 rows over 4 words: 1.25."""
    store = Store([Shard(entries(1, 2)), Shard(entries(3, 1))])
    q = Query("q", k=128, top_k=5)
    assert query_cost(q, store) == 1 + 173  # (128 + 10) x 1.25 = 172.5, rounded up
    assert query_cost(Query("q", k=128, top_k=20), store) == 1 + 185  # (128 + 20) x 1.25
    assert MLM_CANDIDATES == 10
    assert query_cost(Query("q", k=1, top_k=1), Store([Shard(entries(1, 1))])) == 1
    assert query_cost(Query("q", k=118, top_k=1), Store([Shard(entries(3))])) == 1 + 384
    assert query_cost(Query("q"), Store([Shard([])])) == 1  # no words: no fill


def test_the_fill_estimate_reads_sixteen_shards_spread_over_all_once_per_datastore() -> None:
    """32 shards: the even ones (a two-piece word beside a single piece: 1.0 row a word) are the 16 read; the odd
    ones (five-piece words) are not."""
    shards = [Shard(entries(2, 1) if i % 2 == 0 else entries(5, 5)) for i in range(32)]
    store = Store(shards)
    assert query_cost(Query("q", k=118, top_k=1), store) == 1 + 128  # (118 + 10) x 1.0
    assert [s.reads for s in shards] == [1, 0] * 16
    assert query_cost(Query("q", k=118, top_k=1), store) == 129
    assert sum(s.reads for s in shards) == 16  # the estimate is kept for the datastore
    few = [Shard(entries(5, 5)) for _ in range(3)]  # fewer shards than the sample: each read once
    assert query_cost(Query("q", k=118, top_k=1), Store(few)) == 1 + 128 * 5
    assert [s.reads for s in few] == [1, 1, 1]


def test_a_batch_sums_its_queries_and_a_follow_counts_its_hops_and_beam() -> None:
    store = Store(whole_words=False)
    one, wide = Query("q"), Query("q", k=400)
    assert batch_cost([one, wide, one], store) == 1 + 4 + 1
    assert batch_cost([], store) == 0
    entity = Query("q", answer="entity")
    assert follow_cost(entity, 1, 5, store) == 1 + ENTITY_FILL_ROWS
    assert follow_cost(entity, 3, 5, store) == 11 * (1 + ENTITY_FILL_ROWS)  # 1 + 5 + 5


def test_a_request_alone_is_admitted_up_to_the_request_cap() -> None:
    """Over the client's and the server's caps, but alone, it runs; over the request cap it never could."""
    gate = CostGate(CostCaps(max_request_cost=50, max_client_cost=10, max_queued_cost=20))
    with gate.admit("a", 50, "q"):
        assert gate.in_flight == 50
    too_costly = "this batch is estimated at 51 forward rows.*max_request_cost of 50"
    with pytest.raises(TooCostly, match=too_costly), gate.admit("a", 51, "this batch"):
        pass
    assert gate.in_flight == 0 and not gate._by_client


def test_the_client_and_server_caps_admit_up_to_their_values() -> None:
    gate = CostGate(CostCaps(max_request_cost=100, max_client_cost=10, max_queued_cost=20))
    with gate.admit("a", 4, "q"):
        with gate.admit("a", 6, "q"):  # 10: at the client's cap
            with pytest.raises(ClientOverloaded, match="already has 10 forward rows"), gate.admit("a", 1, "q"):
                pass
            with gate.admit("b", 10, "q"):  # 20: at the server's cap
                with pytest.raises(Overloaded, match="server busy: 20 forward rows"), gate.admit("c", 1, "q"):
                    pass
                assert gate.in_flight == 20 and gate._by_client == {"a": 10, "b": 10}
        assert gate._by_client == {"a": 4}
    assert gate.in_flight == 0 and gate._by_client == {}


def test_rows_are_given_back_when_the_request_fails() -> None:
    gate = CostGate(CostCaps(max_request_cost=100, max_client_cost=10, max_queued_cost=20))
    with pytest.raises(RuntimeError), gate.admit("a", 7, "q"):
        raise RuntimeError("the request failed")
    assert gate.in_flight == 0 and gate._by_client == {}
    with gate.admit("a", 10, "q"):  # the client's whole cap is free again
        pass
