"""The entity links of a datastore's rows: which entity a row's word names, and entities by title."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from bertknn.core.format.table import ArticleTable, EntityRef


class EntityLinks:
    """A datastore's links (`Datastore.links`): every look-up answers None, or nothing, where it has none.

    ``shards``: the datastore's open shards (each with ``entity_labels`` and ``entity_title``); ``by_shard``: its
    rows grouped by shard (`Datastore._by_shard`); ``entities``: the manifest's count of linked entities, None
    for a datastore built without links."""

    def __init__(
        self,
        entities: int | None,
        shards: Sequence,
        table: ArticleTable,
        by_shard: Callable[[Sequence[int]], dict[int, tuple[np.ndarray, np.ndarray]]],
    ):
        self.linked = entities is not None
        # whether any row is linked (a build that kept links over a corpus without any has none)
        self.has_entities = bool(entities)
        self._shards = shards
        self._table = table
        self._by_shard = by_shard

    def entity_at(self, global_row: int) -> EntityRef | None:
        """The entity a row links to (its title after redirects, its popularity), or None (no link)."""
        (found,) = self.entity_indexes([global_row])
        return None if found is None else self.entities_of([found])[0]

    def entity_indexes(self, global_rows: Sequence[int]) -> list[tuple[int, int] | None]:
        """For each row, (shard position, its link's index in that shard's entities), or None (no link): one
        read of each shard's ``entity_labels`` for all of them."""
        out: list[tuple[int, int] | None] = [None] * len(global_rows)
        if not self.linked or not len(global_rows):
            return out
        for pos, (at, rows) in self._by_shard(global_rows).items():
            for i, local in zip(at.tolist(), self._shards[pos].entity_labels[rows].tolist(), strict=True):
                if local >= 0:
                    out[i] = (pos, local)
        return out

    def entities_of(self, where: Sequence[tuple[int, int]]) -> list[EntityRef]:
        """The entity of each (shard position, link index) that `entity_indexes` gave (two table queries in all)."""
        shards = {pos: self._shards[pos] for pos in dict.fromkeys(pos for pos, _ in where)}  # each looked up once
        return self._table.entities([shards[pos].entity_title(local) for pos, local in where])

    def entity(self, title: str) -> EntityRef | None:
        """An entity by (normalised) title, through a redirect: its popularity; None when nothing links to it."""
        return self._table.entity(title) if self.linked else None

    def entities_named(self, titles: Sequence[str]) -> list[EntityRef | None]:
        """`entity` of several titles at once (two table queries in all)."""
        return self._table.entities_named(titles) if self.linked else [None] * len(titles)
