"""What a request will cost before it runs, and admission by that cost (docs/limits.md).

The unit is the **row**: one sequence in one forward pass of the model, the model thread being what every request
shares. A word answer over a single-piece datastore is 1 row, plus its neighbour search beyond the default's
(k=128 over 3 articles), which runs on the CPU threads every request shares: ceil(k x N / 384) - 1 rows. A whole-word datastore's answer adds the sequential
fill of its multi-piece candidates: (k + the MLM's candidates) x the datastore's mean fill rows per word (from its
word table). An entity answer adds `ENTITY_FILL_ROWS`: its fill pass (a row per name length) and the CPU work of
its entity lookups, charged so that what the caps admit finishes within the deadline beside other clients. A batch
is the sum of its queries; a ``/follow`` is one entity answer at hop 1 and ``beam`` at each later hop.

`CostGate` admits a request when its cost is within ``max_request_cost`` (else `TooCostly`, a 422 that names the
cap), the client's requests in flight stay within ``max_client_cost`` (else `ClientOverloaded`, 429) and all
requests in flight within ``max_queued_cost`` (else `Overloaded`, 503); both with Retry-After. The estimate is what
admission uses; the deadline (`bertknn.core.errors.check_deadline`) bounds what a request really runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from bertknn.core.errors import ClientOverloaded, Overloaded, TooCostly
from bertknn.core.format import Datastore
from bertknn.service.results import Query
from bertknn.service.words import MLM_CANDIDATES

# What admission charges for an entity answer beyond its question's row. Its fill pass runs one short row per name
# length up to `MAX_NAME_PIECES`; the charge is higher so that the costliest requests the caps admit still finish within
# the deadline beside other clients (`python -m bench.load --abuse`, docs/limits.md). Charging the fill's rows alone
# admitted 4-hop follows at beam 20 and batches of 64 entity answers, and some of them ran past the deadline.
ENTITY_FILL_ROWS = 36
NEIGHBOUR_UNIT = 128 * 3  # k x articles of the default query: its neighbour search counts as part of its row


_ROWS_PER_WORD: WeakKeyDictionary[Datastore, float] = WeakKeyDictionary()  # (a reloaded version is let go)


def _fill_rows_per_word(datastore: Datastore, sample: int = 16) -> float:
    """Mean fill rows of a word of ``datastore``'s word tables (up to ``sample`` shards, spread over all): its
    pieces when several, else 0."""
    if datastore not in _ROWS_PER_WORD:
        rows, words = 0, 0
        n = len(datastore.shards) if datastore.whole_words else 0
        for pos in sorted({i * n // sample for i in range(sample)} if n else ()):
            entries = datastore.shards[pos].words.entries
            rows += sum(len(e.pieces) for e in entries if len(e.pieces) > 1)
            words += len(entries)
        _ROWS_PER_WORD[datastore] = rows / max(1, words)
    return _ROWS_PER_WORD[datastore]


def neighbour_cost(query: Query) -> int:
    """The neighbour search's work beyond the default's (k=128 over N=3 articles), counted in rows: it grows with
    the articles read and the neighbours kept, and runs on the CPU threads every request shares."""
    return math.ceil(query.k * query.num_articles / NEIGHBOUR_UNIT) - 1


def query_cost(query: Query, datastore: Datastore) -> int:
    """The rows one query is expected to run (the module docstring's rules)."""
    cost = 1 + neighbour_cost(query)
    if query.answer == "entity":
        return cost + (ENTITY_FILL_ROWS if query.fill_names else 0)
    if datastore.whole_words:
        candidates = query.k + max(query.top_k, MLM_CANDIDATES)
        return cost + math.ceil(candidates * _fill_rows_per_word(datastore))
    return cost


def batch_cost(queries: Sequence[Query], datastore: Datastore) -> int:
    return sum(query_cost(q, datastore) for q in queries)


def follow_cost(hop_query: Query, hops: int, beam: int, datastore: Datastore) -> int:
    """Hop 1 asks one query, each later hop ``beam`` queries, each counted as a whole entity answer. (A hop fills
    its names in one pass for all its queries, so the fill rows are fewer; the count stays an entity answer's,
    which also stands for the CPU work of each question's retrieval, kNN and entity lookups.)"""
    return (1 + beam * (hops - 1)) * query_cost(hop_query, datastore)


@dataclass(frozen=True)
class CostCaps:
    max_request_cost: int  # rows one request may be expected to run
    max_client_cost: int  # rows one client may have in flight
    max_queued_cost: int  # rows all requests may have in flight


class CostGate:
    """Rows in flight, in all and per client (event-loop side only: no lock)."""

    def __init__(self, caps: CostCaps):
        self.caps = caps
        self.in_flight = 0
        self._by_client: dict[str, int] = {}

    def check(self, cost: int, what: str) -> None:
        """`TooCostly` when one request is over ``max_request_cost``: it could never be admitted."""
        if cost > self.caps.max_request_cost:
            raise TooCostly(
                f"{what} is estimated at {cost} forward rows, over this server's limits.max_request_cost of "
                f"{self.caps.max_request_cost}; ask for less (smaller k, fewer queries, fewer hops or a smaller beam)"
            )

    def _client_cap(self, held: int, cost: int) -> None:
        """`ClientOverloaded` when ``cost`` more rows would take a client holding ``held`` over its cap."""
        if held + cost > self.caps.max_client_cost:
            raise ClientOverloaded(
                f"this client already has {held} forward rows in flight (limits.max_client_cost "
                f"{self.caps.max_client_cost}); wait for its answers, then retry after the Retry-After delay"
            )

    def _queue_cap(self, in_flight: int, cost: int) -> None:
        """`Overloaded` when ``cost`` more rows would take the server's ``in_flight`` over its cap."""
        if in_flight + cost > self.caps.max_queued_cost:
            raise Overloaded(
                f"server busy: {in_flight} forward rows are already in flight (limits.max_queued_cost "
                f"{self.caps.max_queued_cost}); retry after the Retry-After delay"
            )

    @contextmanager
    def admit(self, client: str, cost: int, what: str) -> Iterator[None]:
        """Hold ``cost`` rows for ``client`` for the length of one request, or refuse it at once (a request
        alone is admitted whatever its cost under ``max_request_cost``)."""
        self.check(cost, what)
        held = self._by_client.get(client, 0)
        if held:
            self._client_cap(held, cost)
        if self.in_flight:
            self._queue_cap(self.in_flight, cost)
        self.in_flight += cost
        self._by_client[client] = held + cost
        try:
            yield
        finally:
            self.in_flight -= cost
            left = self._by_client[client] - cost
            if left:
                self._by_client[client] = left
            else:
                del self._by_client[client]
