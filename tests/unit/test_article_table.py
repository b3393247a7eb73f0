"""The article table (``bertknn.core.format.table``): lookups, folded titles, redirects, superseding, the row ->
article map, read-only opening, and threads."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path

import pytest

from bertknn.core.errors import DatastoreError
from bertknn.core.format.table import ArticleTable, write_article_table
from bertknn.core.titles import fold_title


def art(title: str, rows: tuple[int, int], sents: tuple[int, int], id_: str = "1") -> dict:
    return {"title": title, "id": id_, "source": "c.jsonl", "row_start": rows[0], "row_end": rows[1],
            "sent_start": sents[0], "sent_end": sents[1]}  # fmt: skip


SHARDS = [
    (0, [art("Paris", (0, 5), (0, 2)), art("Paris (band)", (5, 7), (2, 3)), art("Émile Zola", (7, 9), (3, 4)),
         art("Empty", (9, 9), (4, 4))]),
    (1, [art("Emile Zola", (0, 30), (0, 6)), art("PARIS", (30, 31), (6, 7)), art("Berlin", (31, 40), (7, 9))]),
]  # fmt: skip
REDIRECTS = [("Lutetia", "Paris"), ("Zola", "Émile Zola"), ("Loop A", "Loop B"), ("Loop B", "Loop A"),
             ("Berlín", "Berlin"), ("Gone", "Nowhere")]  # fmt: skip


@pytest.fixture()
def table(tmp_path: Path) -> ArticleTable:
    path = tmp_path / "articles.sqlite"
    counts = write_article_table(path, SHARDS, REDIRECTS, content_id="abc")
    assert counts == {"articles": 7, "entries": 7, "redirects": 6}
    t = ArticleTable(path)
    yield t
    t.close()


def test_lookups_by_title(table: ArticleTable) -> None:
    assert len(table) == 7 and table.content_id == "abc"
    e = table["Emile Zola"]
    assert (e.shard, e.row_start, e.row_end, e.sent_start, e.sent_end, e.rows) == (1, 0, 30, 0, 6, 30)
    assert "Paris" in table and "paris" not in table and table.get("Nobody") is None
    with pytest.raises(KeyError):
        table["Nobody"]
    assert list(table) == ["Paris", "Paris (band)", "Émile Zola", "Empty", "Emile Zola", "PARIS", "Berlin"]
    assert [a.title for a in table.live()] == list(table)
    assert table["Empty"].rows == 0


def test_folded_titles_collide_on_case_and_accents(table: ArticleTable) -> None:
    assert [e.title for e in table.folded(fold_title("emile zola"))] == ["Émile Zola", "Emile Zola"]
    assert [e.title for e in table.folded(fold_title("paris"))] == ["Paris", "PARIS"]
    assert table.folded(fold_title("nobody")) == []


def test_redirects(table: ArticleTable) -> None:
    r = table.redirects
    assert len(r) == 6 and r["Lutetia"] == "Paris" and r.get("Paris") is None and "Zola" in r
    assert r.folded(fold_title("berlin")) == ["Berlín"]
    assert sorted(r) == sorted(s for s, _ in REDIRECTS)


def test_row_to_article_map(table: ArticleTable) -> None:
    assert table.title_at(0, 0) == "Paris" and table.title_at(0, 4) == "Paris"
    assert table.title_at(0, 5) == "Paris (band)" and table.title_at(0, 8) == "Émile Zola"
    assert table.title_at(1, 30) == "PARIS" and table.title_at(1, 39) == "Berlin"
    with pytest.raises(DatastoreError, match="no article holds row 40"):
        table.title_at(1, 40)

    # several rows at once: one query per shard, the same titles as row by row
    for shard, rows in ((0, [8, 0, 5, 4, 6, 0]), (1, [39, 30, 35])):
        assert table.titles_at(shard, rows) == [table.title_at(shard, r) for r in rows]
    assert table.titles_at(0, []) == []
    with pytest.raises(DatastoreError, match="no article holds row 40"):
        table.titles_at(1, [30, 40])


def test_superseding_by_a_later_version(tmp_path: Path, table: ArticleTable) -> None:
    """``add``: a later shard repeats titles; the base table's entries stay, the old ones become superseded."""
    path = tmp_path / "v2.sqlite"
    new = [(2, [art("Paris", (0, 8), (0, 3), "9"), art("Rome", (8, 12), (3, 4))])]
    counts = write_article_table(path, new, [("Roma", "Rome"), ("Lutetia", "Paris")], content_id="def",
                                 base=table.path)  # fmt: skip
    assert counts == {"articles": 8, "entries": 9, "redirects": 7}
    v2 = ArticleTable(path)
    try:
        assert v2["Paris"].shard == 2 and v2["Paris"].id == "9" and v2["Rome"].rows == 4
        assert [e.title for e in v2.superseded()] == ["Paris"] and v2.superseded()[0].shard == 0
        assert v2.totals(live=False) == (1, 2, 5)
        assert v2.totals(live=True) == (8, 4 + 9 - 2 + 4, 49 - 5 + 12)
        assert [e.title for e in v2.folded(fold_title("paris"))] == ["PARIS", "Paris"]
        assert v2.title_at(0, 2) == "Paris"  # superseded rows still map to their article
        assert v2.titles_at(0, [2, 0]) == ["Paris", "Paris"] and v2.titles_at(2, [8, 0]) == ["Rome", "Paris"]
        assert v2.redirects["Roma"] == "Rome"
    finally:
        v2.close()
    # the base is untouched: a running service keeps reading version 1
    assert table["Paris"].shard == 0 and table.superseded() == [] and "Rome" not in table


def test_a_title_twice_in_one_write_keeps_the_last_one_live(tmp_path: Path) -> None:
    # within one write, the last occurrence wins (superseding); the unique index guards what remains
    path = tmp_path / "t.sqlite"
    write_article_table(path, [(0, [art("A", (0, 1), (0, 1))]), (1, [art("A", (0, 2), (0, 1))])], [], content_id="x")
    t = ArticleTable(path)
    assert t["A"].shard == 1 and len(t.superseded()) == 1
    t.close()


def test_a_writer_replaces_a_dead_writers_temp_file_and_a_failed_write_leaves_the_table_as_it_was(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.sqlite"
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # a writer of this pid that died half way
    temp.write_bytes(b"half a table" * 1000)
    write_article_table(path, SHARDS, REDIRECTS, content_id="abc")
    assert not temp.exists()
    before = path.read_bytes()

    def full_disk(shard: int, ranges: list[tuple[int, int]]) -> tuple[dict[str, int], int]:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_article_table(path, SHARDS, REDIRECTS, content_id="def", mentions=full_disk)
    assert path.read_bytes() == before and not temp.exists()
    t = ArticleTable(path)
    assert t.content_id == "abc" and t["Paris"].shard == 0
    t.close()


def test_the_file_is_opened_read_only_and_foreign_files_are_refused(tmp_path: Path, table: ArticleTable) -> None:
    con = table._cons.get()
    with pytest.raises(sqlite3.OperationalError):
        con.execute("DELETE FROM entries")
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database at all" * 10)
    with pytest.raises(DatastoreError, match="not a readable article table"):
        ArticleTable(junk)
    other = tmp_path / "other.sqlite"
    c = sqlite3.connect(other)
    c.executescript("CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT); INSERT INTO meta VALUES ('format', 'x');")
    c.close()
    with pytest.raises(DatastoreError, match="upgrade"):
        ArticleTable(other)
    with pytest.raises(DatastoreError, match="missing"):
        ArticleTable(tmp_path / "absent.sqlite")


def test_threads_each_get_their_own_connection(table: ArticleTable) -> None:
    errors: list[BaseException] = []
    seen: list[int] = []

    def worker() -> None:
        try:
            for _ in range(200):
                assert table["Berlin"].rows == 9
                assert table.redirects["Zola"] == "Émile Zola"
            seen.append(id(table._cons.get()))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(seen)) == 4


def test_a_datastore_keeps_a_bounded_number_of_shards_mapped(tiny_datastore: Path) -> None:
    from bertknn.core.format import Datastore
    from bertknn.core.format.reader import OpenShards

    ds = Datastore(tiny_datastore)
    shards = OpenShards(list(ds.shards[:]), limit=2)
    assert len(shards) >= 3
    for pos in range(len(shards)):
        assert shards[pos].vectors.shape[0] == shards[pos].info.rows
    assert shards.mapped == 2
    assert "vectors" not in shards._shards[0].__dict__  # released: unmapped once nothing refers to it
    assert "vectors" in shards._shards[len(shards) - 1].__dict__
    assert shards[0].labels.shape[0] == shards._shards[0].info.rows  # mapped again on use
    # a negative position is the same shard, counted once: shards[-1] and shards[n - 1] take one slot, not two
    n = len(shards)
    shards[n - 2].labels, shards[-1].labels, shards[n - 1].labels
    assert shards.mapped == 2 and "labels" not in shards._shards[0].__dict__
    assert "labels" in shards._shards[n - 2].__dict__ and "labels" in shards._shards[n - 1].__dict__
