"""The article table: one SQLite file per datastore version, opened read-only and memory-mapped, never loaded.

Tables (``SCHEMA``):

- ``entries``: one row per article occurrence in the shards, in shard order (``pos``): title, folded title,
  shard position, row and sentence ranges, id, source, and ``live`` (0 when a later shard, made by ``add``,
  replaced the title: superseded). Partial indexes serve the lookups: a live title (unique), a live folded title,
  and (shard, row_start) for the row -> article map.
- ``redirects``: normalised source title -> target title, with the source's folded form (indexed).
- ``meta``: the table format, the datastore content id it was made for (``Manifest.compute_id``), and counts.
- ``entities`` (datastores with links): link target title (after redirects) -> popularity, the number of rows of
  live articles that link to it (``Manifest.links``).

Start-up reads ``meta`` only; a lookup is one B-tree search (microseconds whatever the size). The file is written
once (to a temp name, then renamed) and never changed: readers open it ``immutable`` (no locks, no journal).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from bertknn.core.errors import DatastoreError
from bertknn.core.titles import fold_title

TABLE_FORMAT = "bertknn-articles"
TABLE_VERSION = 1
_IN_CHUNK = 500  # keys per IN (...) query: under SQLite's default limit on parameters
_MMAP_BYTES = 1 << 40  # map the whole file (address space only; pages come from the page cache on use)

SCHEMA = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE entries(
    pos INTEGER PRIMARY KEY, title TEXT NOT NULL, folded TEXT NOT NULL, shard INTEGER NOT NULL,
    row_start INTEGER NOT NULL, row_end INTEGER NOT NULL, sent_start INTEGER NOT NULL, sent_end INTEGER NOT NULL,
    id TEXT NOT NULL, source TEXT NOT NULL, live INTEGER NOT NULL DEFAULT 0);
CREATE TABLE redirects(source TEXT PRIMARY KEY, target TEXT NOT NULL, folded TEXT NOT NULL) WITHOUT ROWID;
"""
# datastores with links: every link target, resolved through the redirects, and its mentions in live articles
ENTITIES_SCHEMA = """
DROP TABLE IF EXISTS entities;
CREATE TABLE entities(title TEXT PRIMARY KEY, popularity INTEGER NOT NULL) WITHOUT ROWID;
"""
INDEXES = """
CREATE UNIQUE INDEX entries_live_title ON entries(title) WHERE live = 1;
CREATE INDEX entries_live_folded ON entries(folded) WHERE live = 1;
CREATE INDEX entries_rows ON entries(shard, row_start);
CREATE INDEX entries_superseded ON entries(pos) WHERE live = 0;
CREATE INDEX redirects_folded ON redirects(folded);
"""
_COLUMNS = "title, id, source, shard, row_start, row_end, sent_start, sent_end"


@dataclass(frozen=True)
class EntityRef:
    """A link target: its title after redirects and its popularity (mentions in the datastore's live articles)."""

    title: str
    popularity: int


@dataclass(frozen=True)
class ArticleEntry:
    title: str
    id: str
    source: str
    shard: int  # position in Datastore.shards
    row_start: int
    row_end: int
    sent_start: int
    sent_end: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


def _entry(row: tuple) -> ArticleEntry:
    return ArticleEntry(*row)


class _Connections:
    """One read-only connection per thread (sqlite3 objects are not shared across threads)."""

    def __init__(self, path: Path):
        self.path = path
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    def get(self) -> sqlite3.Connection:
        con: sqlite3.Connection | None = getattr(self._local, "con", None)
        if con is None:
            uri = f"{self.path.resolve().as_uri()}?mode=ro&immutable=1"
            try:
                con = sqlite3.connect(uri, uri=True, check_same_thread=False)
                con.execute(f"PRAGMA mmap_size={_MMAP_BYTES}")
            except sqlite3.Error as exc:
                raise DatastoreError(f"{self.path}: cannot be opened ({exc}); run `validate`") from exc
            self._local.con = con
            with self._lock:
                self._all.append(con)
        return con

    def close(self) -> None:
        with self._lock:
            for con in self._all:
                con.close()
            self._all.clear()
        self._local = threading.local()


class RedirectTable(Mapping[str, str]):
    """Redirect source title -> target title, read from the table."""

    def __init__(self, cons: _Connections, count: int):
        self._cons = cons
        self._count = count

    def __getitem__(self, key: str) -> str:  # Mapping derives get() and `in` from it
        row = self._cons.get().execute("SELECT target FROM redirects WHERE source = ?", (key,)).fetchone()
        if row is None:
            raise KeyError(key)
        return str(row[0])

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[str]:
        for (source,) in self._cons.get().execute("SELECT source FROM redirects ORDER BY source"):
            yield source

    def folded(self, key: str) -> list[str]:
        """Redirect titles whose folded form is ``key``."""
        rows = self._cons.get().execute("SELECT source FROM redirects WHERE folded = ? ORDER BY source", (key,))
        return [r[0] for r in rows]


K = TypeVar("K")
V = TypeVar("V")
_MISSING = object()


class Memo(Generic[K, V]):
    """A bounded memo of a batched look-up (``fetch``: keys -> values, in order), safe to share between threads.

    The article table is opened per datastore version and never changes under it, so what a query read stays
    true; the answers of a service read the same few hundred words and articles again and again. When full, it
    starts over (a bound on memory, not a cache policy)."""

    def __init__(self, fetch: Callable[[list[K]], Sequence[V]], max_items: int = 65536):
        self.fetch = fetch
        self.max_items = max_items
        self._data: dict[K, V] = {}

    def many(self, keys: Sequence[K]) -> list[V]:
        got = {k: self._data.get(k, _MISSING) for k in keys}
        missing = [k for k, v in got.items() if v is _MISSING]
        if missing:
            if len(self._data) + len(missing) > self.max_items:
                self._data = {}
            for k, v in zip(missing, self.fetch(missing), strict=True):
                got[k] = self._data[k] = v
        return [got[k] for k in keys]  # type: ignore[misc]


class ArticleTable(Mapping[str, ArticleEntry]):
    """Live articles by title (a ``Mapping``), plus folded-title lookups, superseded entries and row -> title."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise DatastoreError(f"{self.path}: the article table is missing; run `validate`, or rebuild the datastore")
        self._cons = _Connections(self.path)
        try:
            meta = dict(self._cons.get().execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.Error as exc:
            raise DatastoreError(f"{self.path}: not a readable article table ({exc}); run `validate`") from exc
        if meta.get("format") != TABLE_FORMAT or meta.get("version") != str(TABLE_VERSION):
            raise DatastoreError(
                f"{self.path}: article table {meta.get('format')!r} version {meta.get('version')!r}, this code reads "
                f"{TABLE_FORMAT!r} version {TABLE_VERSION}; run `bert-knn upgrade` on the datastore"
            )
        self.meta = meta
        self.content_id = meta.get("content_id", "")
        self._count = int(meta["articles"])
        self.redirects = RedirectTable(self._cons, int(meta["redirects"]))
        # what an answer looks up for its words and contexts, remembered (`Memo`)
        self._named: Memo[str, EntityRef | None] = Memo(self._entities_named)
        self._entities: Memo[str, EntityRef] = Memo(self._entities_of)
        self._first_folded: Memo[str, str | None] = Memo(self._first_folded_of)
        self._titles: Memo[tuple[int, int], str] = Memo(self._titles_of)
        self._entries: Memo[str, ArticleEntry | None] = Memo(self._entries_of)

    def _one(self, sql: str, args: tuple) -> tuple | None:
        return self._cons.get().execute(sql, args).fetchone()

    def __getitem__(self, key: str) -> ArticleEntry:  # Mapping derives get() and `in` from it
        entry = self._entries.many([key])[0]
        if entry is None:
            raise KeyError(key)
        return entry

    def _entries_of(self, keys: list[str]) -> list[ArticleEntry | None]:
        rows = {r[0]: _entry(r) for r in self._in(f"SELECT {_COLUMNS} FROM entries WHERE live = 1 AND title IN", keys)}
        return [rows.get(k) for k in keys]

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[str]:
        for (title,) in self._cons.get().execute("SELECT title FROM entries WHERE live = 1 ORDER BY pos"):
            yield title

    def live(self) -> Iterator[ArticleEntry]:
        """Every live article, in shard order (streamed)."""
        for row in self._cons.get().execute(f"SELECT {_COLUMNS} FROM entries WHERE live = 1 ORDER BY pos"):
            yield _entry(row)

    def superseded(self) -> list[ArticleEntry]:
        """Articles a later shard replaced (their rows stay on disk, unreachable)."""
        rows = self._cons.get().execute(f"SELECT {_COLUMNS} FROM entries WHERE live = 0 ORDER BY pos")
        return [_entry(r) for r in rows]

    def totals(self, *, live: bool) -> tuple[int, int, int]:
        """(articles, sentences, rows) of the live (or the superseded) entries."""
        row = self._one(
            "SELECT count(*), coalesce(sum(sent_end - sent_start), 0), coalesce(sum(row_end - row_start), 0) "
            "FROM entries WHERE live = ?",
            (1 if live else 0,),
        )
        assert row is not None
        return int(row[0]), int(row[1]), int(row[2])

    def recorded_totals(self, *, live: bool) -> tuple[int, int, int]:
        """``totals`` as the writer recorded them in ``meta`` (read at start-up: no scan)."""
        which = "live" if live else "superseded"
        try:
            return tuple(int(self.meta[f"{which}_{k}"]) for k in ("articles", "sentences", "rows"))  # type: ignore[return-value]
        except (KeyError, ValueError) as exc:
            raise DatastoreError(f"{self.path}: meta lacks the {which} totals ({exc}); run `upgrade`") from exc

    def folded(self, key: str) -> list[ArticleEntry]:
        """Live articles whose folded title is ``key``."""
        rows = self._cons.get().execute(f"SELECT {_COLUMNS} FROM entries WHERE folded = ? AND live = 1 ORDER BY pos", (key,))
        return [_entry(r) for r in rows]

    def title_at(self, shard: int, row: int) -> str:
        """The title of the article (live or superseded) whose rows hold ``row`` of shard position ``shard``."""
        found = self._one(
            "SELECT title FROM entries WHERE shard = ? AND row_start <= ? AND row_end > ? ORDER BY row_start DESC "
            "LIMIT 1",
            (shard, row, row),
        )
        if found is None:
            raise DatastoreError(f"{self.path}: no article holds row {row} of shard {shard}; run `validate`")
        return str(found[0])

    def titles_at(self, shard: int, rows: Sequence[int]) -> list[str]:
        """`title_at` of several rows of one shard, from one query for the articles that span them (an answer's
        contexts mostly share a few articles: row by row, the queries cost more than the rest of the reading)."""
        return self._titles.many([(shard, r) for r in rows])

    def _titles_of(self, where: list[tuple[int, int]]) -> list[str]:
        shard, rows = where[0][0], [r for _, r in where]  # (`titles_at`'s keys share their shard; never none)
        # from the entry that holds the first row (an index seek) to the last row: the scan spans the rows asked,
        # not the shard's entries before them
        spans = self._cons.get().execute(
            "SELECT row_start, row_end, title FROM entries WHERE shard = ?1 AND row_start <= ?2 AND row_start >= "
            "coalesce((SELECT max(row_start) FROM entries WHERE shard = ?1 AND row_start <= ?3), 0) "
            "AND row_end > row_start ORDER BY row_start",
            (shard, max(rows), min(rows)),
        ).fetchall()
        starts = [s[0] for s in spans]
        out = []
        for row in rows:
            i = bisect_right(starts, row) - 1
            # (entries of one shard do not overlap; if they ever did, the row's own query decides)
            out.append(str(spans[i][2]) if i >= 0 and spans[i][1] > row else self.title_at(shard, row))
        return out

    def shard_entries(self, shard: int) -> list[ArticleEntry]:
        """Every entry (live or not) of one shard position, by row (``validate`` compares them with the shard)."""
        rows = self._cons.get().execute(
            f"SELECT {_COLUMNS} FROM entries WHERE shard = ? ORDER BY row_start, pos", (shard,)
        )
        return [_entry(r) for r in rows]

    def entity(self, target: str) -> EntityRef | None:
        """The entity a link target names: the title through one redirect, with its popularity; None when the
        table has no such entity (or no entities table)."""
        if self.meta.get("entities") is None:
            return None
        title = self.redirects.get(target, target)
        row = self._one("SELECT title, popularity FROM entities WHERE title = ?", (title,))
        return None if row is None else EntityRef(str(row[0]), int(row[1]))

    def entities(self, targets: Sequence[str]) -> list[EntityRef]:
        """What several link targets name, in two queries for all of them: each target's title through one
        redirect, with its popularity (0 when the table has no such entity)."""
        return self._entities.many(targets)

    def _entities_of(self, targets: list[str]) -> list[EntityRef]:
        titles, popular = self._entity_rows(targets)
        return [EntityRef(t, int(popular.get(t, 0))) for t in titles]

    def entities_named(self, targets: Sequence[str]) -> list[EntityRef | None]:
        """`entity` of several targets in two queries for all of them: None where the table has no such entity
        (or no entities table)."""
        if self.meta.get("entities") is None:
            return [None] * len(targets)
        return self._named.many(targets)

    def _entities_named(self, targets: list[str]) -> list[EntityRef | None]:
        titles, popular = self._entity_rows(targets)
        return [EntityRef(t, int(popular[t])) if t in popular else None for t in titles]

    def _entity_rows(self, targets: Sequence[str]) -> tuple[list[str], dict[str, int]]:
        """Each target's title through one redirect, and the popularity of those of them that are entities."""
        wanted = sorted(set(targets))
        redirect = dict(self._in("SELECT source, target FROM redirects WHERE source IN", wanted))
        titles = [redirect.get(t, t) for t in targets]
        popular = (
            dict(self._in("SELECT title, popularity FROM entities WHERE title IN", sorted(set(titles))))
            if self.meta.get("entities") is not None else {}
        )  # fmt: skip
        return titles, popular

    def first_folded(self, keys: Sequence[str]) -> dict[str, str]:
        """For each folded title among ``keys`` that live articles have, the first such article's title (in the
        table's order, as `folded` lists them): one query for all of them."""
        return {k: t for k, t in zip(keys, self._first_folded.many(keys), strict=True) if t is not None}

    def _first_folded_of(self, keys: list[str]) -> list[str | None]:
        out: dict[str, str] = {}
        rows = self._in("SELECT folded, title, pos FROM entries WHERE live = 1 AND folded IN", sorted(set(keys)))
        for key, title, _ in sorted(rows, key=lambda r: r[2]):
            out.setdefault(key, title)
        return [out.get(k) for k in keys]

    def _in(self, sql: str, keys: Sequence[str]) -> list[tuple]:
        """``sql`` ending in ``IN`` run for ``keys`` in chunks (SQLite's limit on parameters)."""
        rows: list[tuple] = []
        con = self._cons.get()
        for lo in range(0, len(keys), _IN_CHUNK):
            chunk = keys[lo : lo + _IN_CHUNK]
            rows += con.execute(f"{sql} ({','.join('?' * len(chunk))})", chunk).fetchall()
        return rows

    def close(self) -> None:
        self._cons.close()


# ---- writing --------------------------------------------------------------------------------------------------


def write_article_table(
    path: Path,
    shards: Iterable[tuple[int, list[dict]]],
    redirects: Iterable[tuple[str, str]],
    *,
    content_id: str,
    base: Path | None = None,
    mentions: Callable[[int, list[tuple[int, int]]], tuple[dict[str, int], int]] | None = None,
) -> dict[str, int]:
    """Write the table for ``shards`` (position, the shard's ``articles.json`` entries) to ``path`` atomically.

    ``base``: an earlier version's table to extend (``add``): its entries are kept, titles that ``shards`` repeat
    become superseded, and ``redirects`` are merged over its own. ``mentions``: for a datastore with links,
    (shard position, row ranges of its live articles) -> (mentions per link target, anchor-only rows); the
    ``entities`` table is (re)made from it over every live article. Returns the counts written to ``meta``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        con = _open_for_writing(tmp, base)
        _insert_entries(con, shards, redirects)
        con.executescript(INDEXES if base is None else _LIVE_INDEXES)
        links = _write_entities(con, mentions) if mentions is not None else {}
        counts = _write_meta(con, content_id, links)
        con.execute("ANALYZE")
        con.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except sqlite3.IntegrityError as exc:
        tmp.unlink(missing_ok=True)
        raise DatastoreError(f"{path}: a title occurs twice among the live articles ({exc})") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return counts


_LIVE_INDEXES = (
    "CREATE UNIQUE INDEX entries_live_title ON entries(title) WHERE live = 1;"
    "CREATE INDEX entries_live_folded ON entries(folded) WHERE live = 1;"
)


def _open_for_writing(tmp: Path, base: Path | None) -> sqlite3.Connection:
    """A new table at ``tmp``, or a copy of ``base`` without its live-title indexes (remade after the insert)."""
    if base is not None:
        src = sqlite3.connect(f"{Path(base).resolve().as_uri()}?mode=ro", uri=True)
        con = sqlite3.connect(tmp)
        with con:
            src.backup(con)
        src.close()
        con.executescript("DROP INDEX entries_live_title; DROP INDEX entries_live_folded;")
    else:
        con = sqlite3.connect(tmp)
        con.executescript(SCHEMA)
    con.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF; PRAGMA cache_size=-262144;")
    return con


def _insert_entries(
    con: sqlite3.Connection, shards: Iterable[tuple[int, list[dict]]], redirects: Iterable[tuple[str, str]]
) -> None:
    """The shards' articles as entries after those already there; the last occurrence of a title is live, earlier
    ones (and an older version's live one) superseded; the redirects merged over the table's."""
    first = int(con.execute("SELECT coalesce(max(pos), -1) + 1 FROM entries").fetchone()[0])
    with con:
        for position, articles in shards:
            con.executemany(
                "INSERT INTO entries(title, folded, shard, row_start, row_end, sent_start, sent_end, id, source) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    (a["title"], fold_title(a["title"]), position, a["row_start"], a["row_end"], a["sent_start"],
                     a["sent_end"], str(a["id"]), a["source"])
                    for a in articles
                ),
            )  # fmt: skip
        if first == 0:
            con.execute("UPDATE entries SET live = 1 WHERE pos IN (SELECT max(pos) FROM entries GROUP BY title)")
        else:
            con.execute(
                "UPDATE entries SET live = (pos IN (SELECT max(pos) FROM entries WHERE title IN "
                "(SELECT title FROM entries WHERE pos >= ?) GROUP BY title)) WHERE title IN "
                "(SELECT title FROM entries WHERE pos >= ?)",
                (first, first),
            )
        con.executemany(
            "INSERT OR REPLACE INTO redirects(source, target, folded) VALUES (?, ?, ?)",
            ((s, t, fold_title(s)) for s, t in redirects),
        )


def _write_meta(con: sqlite3.Connection, content_id: str, links: dict[str, int]) -> dict[str, int]:
    """The table's counts (``links``' counts, live articles, entries, redirects; live and superseded articles,
    sentences and rows) into ``meta`` with its format and content id; the counts but the last six returned."""
    counts = {
        **links,
        "articles": int(con.execute("SELECT count(*) FROM entries WHERE live = 1").fetchone()[0]),
        "entries": int(con.execute("SELECT count(*) FROM entries").fetchone()[0]),
        "redirects": int(con.execute("SELECT count(*) FROM redirects").fetchone()[0]),
    }
    totals = {}
    for live, which in ((1, "live"), (0, "superseded")):
        a, sents, rows = con.execute(
            "SELECT count(*), coalesce(sum(sent_end - sent_start), 0), coalesce(sum(row_end - row_start), 0) "
            "FROM entries WHERE live = ?", (live,),
        ).fetchone()  # fmt: skip
        totals.update({f"{which}_articles": a, f"{which}_sentences": sents, f"{which}_rows": rows})
    meta = {"format": TABLE_FORMAT, "version": str(TABLE_VERSION), "content_id": content_id,
            **{k: str(v) for k, v in {**counts, **totals}.items()}}  # fmt: skip
    with con:
        con.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", meta.items())
    return counts


def _write_entities(
    con: sqlite3.Connection, mentions: Callable[[int, list[tuple[int, int]]], tuple[dict[str, int], int]]
) -> dict[str, int]:
    """The ``entities`` table from every live article's rows (targets resolved through one redirect)."""
    con.executescript(ENTITIES_SCHEMA + "DROP TABLE IF EXISTS temp.raw; CREATE TEMP TABLE raw(title TEXT, n INTEGER);")
    total = anchors = 0
    by_shard: dict[int, list[tuple[int, int]]] = {}
    for shard, a, b in con.execute("SELECT shard, row_start, row_end FROM entries WHERE live = 1 ORDER BY shard, row_start"):
        by_shard.setdefault(int(shard), []).append((int(a), int(b)))
    with con:
        for shard, ranges in by_shard.items():
            found, anchor_rows = mentions(shard, ranges)
            anchors += anchor_rows
            total += sum(found.values())
            con.executemany("INSERT INTO temp.raw(title, n) VALUES (?, ?)", found.items())
        con.execute(
            "INSERT INTO entities(title, popularity) SELECT coalesce(r.target, raw.title), sum(raw.n) FROM temp.raw "
            "LEFT JOIN redirects r ON r.source = raw.title GROUP BY 1"
        )
        con.execute("DROP TABLE temp.raw")
    entities = int(con.execute("SELECT count(*) FROM entities").fetchone()[0])
    return {"mentions": total, "anchor_rows": anchors, "entities": entities}
