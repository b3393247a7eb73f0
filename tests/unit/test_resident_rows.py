"""Rows kept on the model's device (`ResidentRows`, ``model.knn_device_rows: resident``), here the CPU's torch: what
they hold is the datastore's rows at their global ids, a batch searched over them finds what the copied rows and
the host's FAISS search find, and they load in steps, follow a live update's new shards, and stay on the host over
their budget."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from bertknn.core.format import Datastore
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query
from bertknn.service.retrieval.device_knn import DeviceKnn, batch_knn, resident_knn
from bertknn.service.retrieval.resident_rows import ResidentRows, RowsKey, rows_key

QUESTIONS = [
    Query("zorblat was born in [MASK] .", retriever="bm25", num_articles=3, k=8),
    Query("the bridge of plonk is [MASK] .", retriever="tfidf", num_articles=2, k=8),
    Query("quimby is a small [MASK] near the sea .", subject="quimby", k=128),
]


@pytest.fixture(scope="module")
def pipe(tiny_datastore: Path) -> AnswerPipeline:
    p = AnswerPipeline.open(tiny_datastore, device="cpu")
    yield p
    p.close()


def _kept(datastore: Datastore, **kw) -> ResidentRows:
    rows = ResidentRows("cpu", lambda nbytes: True, **kw)
    assert rows.advance(datastore) == datastore.total_rows
    return rows


def _prepared(pipe: AnswerPipeline, read: bool = True):
    """Each question's embedding (as the encoding keeps it) and its rows, prepared as the service does."""
    encs, _ = pipe.queries.encode([pipe.check_query(q) for q in QUESTIONS])
    out = []
    for q, enc in zip(QUESTIONS, encs, strict=True):
        hits, _ = pipe.articles.retrieve(q)
        search = pipe.neighbours_of.prepare_search(q, hits, read=read)
        assert search is not None and len(search)
        out.append((np.asarray(enc.embedding), search, q.k))
    return out


def test_the_kept_rows_are_the_datastores_rows_at_their_global_ids(pipe: AnswerPipeline):
    ds = pipe.datastore
    rows = _kept(ds)
    ids = [np.array([0, ds.total_rows - 1, 3]), np.arange(ds.total_rows)]
    got = rows.gather(ids, width=ds.total_rows)
    assert got.dtype == torch.float32 and got.shape == (2, ds.total_rows, ds.manifest.model.hidden_size)
    for i, want in enumerate(ids):
        stored = np.concatenate([ds.float_rows(*ds.locate(int(r))[:1], np.array([ds.locate(int(r))[1]])) for r in want])
        np.testing.assert_array_equal(got[i, : len(want)].numpy(), stored)
    assert rows.covers(ds, np.array([ds.total_rows - 1])) and not rows.covers(ds, np.array([ds.total_rows]))
    assert not rows.covers(ds, np.zeros(0, np.int64))


def test_a_batch_over_kept_rows_finds_the_copied_rows_and_the_hosts_neighbours(pipe: AnswerPipeline):
    items = _prepared(pipe)
    queries = torch.from_numpy(np.stack([e.astype(np.float32) for e, _, _ in items]))
    kept = resident_knn(queries, [s.rows for _, s, _ in items], 128, _kept(pipe.datastore))
    copied = batch_knn(queries, [s for _, s, _ in items], 128)
    for (e, s, _), (kd, ki), (cd, ci) in zip(items, kept, copied, strict=True):
        np.testing.assert_array_equal(ki, ci)
        np.testing.assert_array_equal(kd, cd)  # the same rows, the same arithmetic
        host = s.search(e.astype(np.float32), 128)
        np.testing.assert_array_equal(s.rows[ki], host.rows)
        np.testing.assert_allclose(kd, host.distances, rtol=1e-4, atol=1e-3)


def test_device_knn_searches_kept_rows_without_reading_them_on_the_host(pipe: AnswerPipeline, monkeypatch):
    from bertknn.service.retrieval import knn as knn_module

    reads: list[int] = []
    gather = knn_module._gather
    monkeypatch.setattr(knn_module, "_gather", lambda slices, out: (reads.append(len(out)), gather(slices, out))[1])
    unread = _prepared(pipe, read=False)
    searched = DeviceKnn("cpu", resident=_kept(pipe.datastore)).search(unread, [pipe.datastore] * len(unread))
    assert reads == []  # only the rows' ids were used
    # without kept rows, the unread rows are read once, straight into the batch
    copied = DeviceKnn("cpu").search(unread, [pipe.datastore] * len(unread))
    assert reads == [len(s) for _, s, _ in unread]
    for (e, s, k), a, b in zip(_prepared(pipe), searched, copied, strict=True):
        host = s.search(e.astype(np.float32), k)
        for got in (a, b):
            np.testing.assert_array_equal(got.rows, host.rows)
            np.testing.assert_array_equal(got.labels, host.labels)


def test_rows_load_in_steps_and_a_batch_splits_between_kept_and_copied(pipe: AnswerPipeline):
    ds = pipe.datastore
    row_bytes = ds.manifest.model.hidden_size * 2
    rows = ResidentRows("cpu", lambda nbytes: True)
    items = _prepared(pipe)
    want = [s.search(e.astype(np.float32), k) for e, s, k in items]
    knn = DeviceKnn("cpu", resident=rows)
    steps = 0
    while rows.loaded < ds.total_rows:
        before = rows.loaded
        assert rows.advance(ds, max_bytes=10 * row_bytes) == min(10, ds.total_rows - before)
        steps += 1
        held = [rows.covers(ds, s.rows) for _, s, _ in items]
        assert held == [int(s.rows.max()) < rows.loaded for _, s, _ in items]
        for got, host in zip(knn.search(items, [ds] * len(items)), want, strict=True):
            np.testing.assert_array_equal(got.rows, host.rows)
    assert steps == -(-ds.total_rows // 10) and rows.advance(ds) == 0


def test_a_live_updates_new_shards_are_added_and_other_rows_replace_the_kept_ones():
    a, b, c = ("s0", 10, "x"), ("s1", 5, "y"), ("t0", 10, "z")
    assert RowsKey((a,)).agrees(RowsKey((a, b))) and RowsKey((a, b)).agrees(RowsKey((a,)))
    assert not RowsKey((a,)).agrees(RowsKey((c,))) and not RowsKey((a, b)).agrees(RowsKey((a, ("s1", 5, "w"))))


def test_rows_over_their_budget_or_under_a_codec_stay_on_the_host(pipe: AnswerPipeline, caplog, monkeypatch):
    ds = pipe.datastore
    asked: list[int] = []
    rows = ResidentRows("cpu", lambda nbytes: asked.append(nbytes) is not None)
    with caplog.at_level(logging.WARNING, "bertknn.service.retrieval.resident_rows"):
        assert rows.advance(ds) == 0 and rows.advance(ds) == 0
    assert len(asked) == 1 and asked[0] >= ds.total_rows * ds.manifest.model.hidden_size * 2  # not asked again
    assert "stay on the host" in caplog.text and not rows.covers(ds, np.array([0]))
    coded = ResidentRows("cpu", lambda nbytes: True)
    monkeypatch.setattr(ds, "codec", object())
    assert coded.advance(ds) == 0 and coded.key is None and rows_key(ds).shards


def test_a_datastore_of_other_rows_replaces_the_kept_ones(pipe: AnswerPipeline, monkeypatch):
    ds = pipe.datastore
    rows = _kept(ds)
    other = rows_key(ds)
    other = RowsKey(tuple((f"other-{n}", r, h) for n, r, h in other.shards))
    monkeypatch.setitem(rows._keys, ds, other)  # the same object, now standing for another datastore's rows
    assert not rows.covers(ds, np.array([0]))
    assert rows.advance(ds, max_bytes=1) == 1 and rows.loaded == 1 and rows.key == other


def test_an_earlier_version_leaves_the_kept_rows_to_the_later_one(pipe: AnswerPipeline, monkeypatch):
    """Rows kept for a version stay that version's when a batch of the version before it (one shard fewer, still
    draining) comes; a version whose last shard is another one replaces them."""
    ds = pipe.datastore
    full, n = rows_key(ds), ds.total_rows
    assert len(full.shards) >= 2
    rows = _kept(ds)
    earlier, diverging = RowsKey(full.shards[:-1]), RowsKey((*full.shards[:-1], ("other", 1, "b")))
    monkeypatch.setitem(rows._keys, ds, earlier)
    assert rows.advance(ds) == 0 and rows.key == full and rows.covers(ds, np.array([n - 1]))
    monkeypatch.setitem(rows._keys, ds, diverging)
    assert not rows.covers(ds, np.array([0]))
    assert rows.advance(ds) == n and rows.key == diverging  # loaded again from its first row
