"""Building at Wikipedia's scale: shards cut by contexts (the resume unit, bounded memory) and multistream dumps
whose slices decompress only their own streams.

The tiny BERT with the real bert-base-uncased vocabulary of ``test_builder`` builds from real Wikipedia lead
sections (``../shared/data/wiki``). A multistream dump and its index are written here the way Wikimedia writes
them: a header stream, groups of pages each compressed as a bz2 stream of its own, a footer stream, and one
``offset:page_id:title`` line per page.
"""

from __future__ import annotations

import bz2
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np
import pytest

import bertknn.builder.blocks as blocks_module
from bertknn.builder.blocks import plan_blocks
from bertknn.builder.build import build
from bertknn.builder.corpus import CorpusStats, read_stream_index, read_streams
from bertknn.builder.merge import merge_slices
from bertknn.core.errors import BuildError, CorpusError, MergeError
from bertknn.core.format import MANIFEST, REDIRECTS, SHARDS_DIR, Datastore, read_manifest, validate_datastore
from tests.integration.test_builder import (
    REPO,
    VITAL,
    as_wikitext,
    bert_vocab_model,  # noqa: F401  (fixture)
    settings,
    torch_threads,
    tree_bytes,
    vital_slice,
)


@pytest.fixture(scope="module")
def vital60(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vital_slice(tmp_path_factory.mktemp("corpus") / "vital60.jsonl", 0, 60)


def rows_by_article(root: Path) -> dict[str, tuple[list[str], np.ndarray, list[str]]]:
    """Per article: its sentences, its vectors and its words (word text per row), wherever its shard is."""
    store = Datastore(root)
    out = {}
    for title, e in store.articles.items():
        shard = store.shards[e.shard]
        words = (
            [shard.words[int(label)].text for label in shard.labels[e.row_start : e.row_end]]
            if store.whole_words
            else [str(int(label)) for label in shard.labels[e.row_start : e.row_end]]
        )
        out[title] = (
            [shard.sentence(i) for i in range(e.sent_start, e.sent_end)],
            np.asarray(shard.vectors[e.row_start : e.row_end]),
            words,
        )
    return out


# ---- shards cut by contexts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("targets", ["single-piece", "whole-word"])
def test_blocks_cut_by_contexts_hold_the_same_rows(
    tmp_path: Path, bert_vocab_model: Path, vital60: Path, targets: str  # noqa: F811
) -> None:
    with torch_threads(1):
        whole = build(settings([vital60], bert_vocab_model, tmp_path / "whole", articles_per_shard=20,
                               contexts_per_shard=0, targets=targets))  # fmt: skip
        cut = build(settings([vital60], bert_vocab_model, tmp_path / "cut", articles_per_shard=20,
                             contexts_per_shard=200, targets=targets))  # fmt: skip
    assert validate_datastore(tmp_path / "cut") == []
    assert [s.name for s in whole.shards] == ["shard-00000", "shard-00001", "shard-00002"]
    assert whole.contexts_per_shard is None and cut.contexts_per_shard == 200
    # Several parts per block, named block.part, the block's final part marked; no part starts past the limit.
    assert len(cut.shards) >= 4 * 3
    assert {s.index for s in cut.shards} == {0, 1, 2}
    for s in cut.shards:
        assert s.name == (f"shard-{s.index:05d}" if s.part == 0 else f"shard-{s.index:05d}.{s.part:03d}")
        nxt = [t for t in cut.shards if t.key == (s.index, s.part + 1)]
        assert s.last == (not nxt)
    store = Datastore(tmp_path / "cut")
    for shard in store.shards:
        arts = sorted(shard.articles(), key=lambda a: a["row_start"])
        assert arts, shard.info.name
        before_last = arts[-1]["row_start"]  # rows before the part's last article: under the limit
        assert before_last < 200, (shard.info.name, before_last)
    # Cutting changes where rows live, not what they are: same articles, sentences, words and vectors (up to the
    # float noise of other batch companions: a context is padded to its batch's longest).
    a, b = rows_by_article(tmp_path / "whole"), rows_by_article(tmp_path / "cut")
    assert sorted(a) == sorted(b)
    for title in a:
        assert a[title][0] == b[title][0]
        assert a[title][2] == b[title][2]
        np.testing.assert_allclose(a[title][1].astype(np.float32), b[title][1].astype(np.float32), atol=2e-3)
    assert whole.counts == cut.counts


def test_a_sigkill_mid_block_loses_at_most_one_part(
    tmp_path: Path, bert_vocab_model: Path, vital60: Path  # noqa: F811
) -> None:
    """One block of 60 articles in parts of ~250 contexts: killed after the first part, the resumed build keeps the
    finished parts (same inodes) and ends byte-identical to an uninterrupted build."""
    argv = [
        "build", "--corpus", str(vital60), "--model", str(bert_vocab_model), "--device", "cpu",
        "--articles-per-shard", "60", "--contexts-per-shard", "250", "--batch-size", "32", "--threads", "1",
        "--no-sparse-indexes", "--workers", "1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    reference = tmp_path / "reference"
    subprocess.run([sys.executable, "-m", "datastore_builder", *argv, "--out", str(reference)], cwd=REPO, env=env,
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    parts = read_manifest(reference).shards
    assert len(parts) >= 6 and {p.index for p in parts} == {0}

    out = tmp_path / "killed"
    command = [sys.executable, "-m", "datastore_builder", *argv, "--out", str(out)]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    second = out / SHARDS_DIR / "shard-00000.001"
    deadline = time.monotonic() + 300
    while proc.poll() is None and not second.exists() and time.monotonic() < deadline:
        time.sleep(0.002)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the build finished before it could be killed"
    kept = sorted(p.name for p in (out / SHARDS_DIR).glob("shard-*"))
    assert 2 <= len(kept) < len(parts), kept
    inode = (out / SHARDS_DIR / "shard-00000" / "vectors.npy").stat().st_ino

    resumed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "block 00000 resumed after its" in resumed.stderr
    assert (out / SHARDS_DIR / "shard-00000" / "vectors.npy").stat().st_ino == inode
    assert validate_datastore(out) == []
    assert tree_bytes(out / SHARDS_DIR) == tree_bytes(reference / SHARDS_DIR)
    assert (out / MANIFEST).read_bytes() == (reference / MANIFEST).read_bytes()


def test_validate_names_a_missing_part(tmp_path: Path, bert_vocab_model: Path, vital60: Path) -> None:  # noqa: F811
    with torch_threads(1):
        m = build(settings([vital60], bert_vocab_model, tmp_path / "ds", articles_per_shard=30, contexts_per_shard=400))
    manifest = json.loads((tmp_path / "ds" / MANIFEST).read_text())
    victim = next(s for s in m.shards if s.part == 1)
    manifest["shards"] = [s for s in manifest["shards"] if s["name"] != victim.name]
    (tmp_path / "ds" / MANIFEST).write_text(json.dumps(manifest))
    problems = validate_datastore(tmp_path / "ds")
    assert problems and f"part {victim.part + 1} without part {victim.part}" in problems[0]


# ---- multistream dumps ----------------------------------------------------------------------------------------


def page_xml(title: str, text: str, page_id: int, ns: int = 0, redirect: str | None = None) -> bytes:
    redirect_el = f'<redirect title="{escape(redirect)}" />' if redirect else ""
    return (
        f"  <page>\n    <title>{escape(title)}</title>\n    <ns>{ns}</ns>\n    <id>{page_id}</id>\n{redirect_el}"
        f'    <revision>\n      <id>{page_id}0</id>\n      <text bytes="{len(text)}" xml:space="preserve">'
        f"{escape(text)}</text>\n    </revision>\n  </page>\n"
    ).encode()


def write_multistream(directory: Path, pages: list[tuple[str, str, int, int, str | None]], per_stream: int) -> Path:
    """``enwiki-...-pages-articles-multistream.xml.bz2`` and its index, as Wikimedia lays them out."""
    dump = directory / "enwiki-20990101-pages-articles-multistream.xml.bz2"
    index_lines = []
    with open(dump, "wb") as f:
        f.write(bz2.compress(
            b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11" xml:lang="en">\n'
            b"  <siteinfo>\n    <sitename>Wikipedia</sitename>\n  </siteinfo>\n"
        ))  # fmt: skip
        for start in range(0, len(pages), per_stream):
            group = pages[start : start + per_stream]
            offset = f.tell()
            f.write(bz2.compress(b"".join(page_xml(*p) for p in group)))
            index_lines += [f"{offset}:{p[2]}:{p[0]}" for p in group]
        f.write(bz2.compress(b"</mediawiki>\n"))
    (directory / "enwiki-20990101-pages-articles-multistream-index.txt.bz2").write_bytes(
        bz2.compress(("\n".join(index_lines) + "\n").encode("utf-8"))
    )
    return dump


@pytest.fixture(scope="module")
def multistream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """45 real lead sections dressed as wikitext, with redirects, a talk page and a disambiguation page among
    them, in streams of 5 pages."""
    with open(VITAL, encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(45), f, strict=False)]
    pages: list[tuple[str, str, int, int, str | None]] = []
    for i, r in enumerate(rows):
        pages.append((r["title"], as_wikitext(r["title"], r["text"]), 1000 + i, 0, None))
        if i % 7 == 0:
            pages.append((f"{r['title']} (alias)", f"#REDIRECT [[{r['title']}]]", 5000 + i, 0, r["title"]))
        if i % 11 == 0:
            pages.append((f"Talk:{r['title']}", "Talk about it here.", 7000 + i, 1, None))
    pages.append(("Mercury", "'''Mercury''' may refer to:\n* [[Mercury (planet)]]\n{{Disambiguation}}", 9000, 0, None))
    return write_multistream(tmp_path_factory.mktemp("multistream"), pages, per_stream=5)


def test_the_index_beside_a_multistream_dump_is_found_and_read(multistream: Path) -> None:
    plan = plan_blocks([multistream], None, True)
    assert plan.unit == "streams"
    index = plan.indexes[0]
    assert index is not None and len(index.offsets) == 12  # 58 pages in streams of 5
    assert sum(index.pages) == 45 + 7 + 5 + 1
    assert all(n == 5 for n in index.pages[:-1])
    # blocks: whole streams, at most articles_per_shard pages each
    assert index.groups(12) == [(k, min(k + 2, len(index.pages))) for k in range(0, len(index.pages), 2)]
    assert plan_blocks([multistream], None, False).unit == "articles"


def test_multistream_slices_read_only_their_streams_and_merge_into_one_build(
    tmp_path: Path, bert_vocab_model: Path, multistream: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    read: list[tuple[int, int]] = []
    real = blocks_module.read_streams

    def counting(index, first, end, stats):  # type: ignore[no-untyped-def]
        read.append((first, end))
        return real(index, first, end, stats)

    monkeypatch.setattr(blocks_module, "read_streams", counting)
    with torch_threads(1):
        single = build(settings([multistream], bert_vocab_model, tmp_path / "single", articles_per_shard=10,
                                contexts_per_shard=200))  # fmt: skip
        all_groups = list(read)
        slices = []
        for i in range(3):
            read.clear()
            out = tmp_path / f"slice{i}"
            m = build(settings([multistream], bert_vocab_model, out, articles_per_shard=10, contexts_per_shard=200,
                               shard_index=i, num_shards=3))  # fmt: skip
            assert m.slice is not None and m.slice.unit == "streams"
            # this slice decompressed its own blocks' streams and nothing else
            assert read == [g for j, g in enumerate(all_groups) if j % 3 == i]
            assert {s.index % 3 for s in m.shards} == {i}
            slices.append(out)
    assert len(all_groups) >= 6
    store = Datastore(tmp_path / "single")
    assert len(store.articles) == 45 and "Mercury" not in store.articles
    assert single.counts.skipped_pages == 1
    assert len(json.loads((tmp_path / "single" / REDIRECTS).read_text())) == 7

    merged = merge_slices(slices, tmp_path / "merged", sparse_indexes=False)
    assert validate_datastore(tmp_path / "merged") == []
    assert merged.counts == single.counts
    assert tree_bytes(tmp_path / "merged" / SHARDS_DIR) == tree_bytes(tmp_path / "single" / SHARDS_DIR)
    assert (tmp_path / "merged" / MANIFEST).read_bytes() == (tmp_path / "single" / MANIFEST).read_bytes()
    assert (tmp_path / "merged" / REDIRECTS).read_bytes() == (tmp_path / "single" / REDIRECTS).read_bytes()

    # Without the index (today's path) the same articles are built, cut into blocks of articles instead.
    with torch_threads(1):
        plain = build(settings([multistream], bert_vocab_model, tmp_path / "plain", articles_per_shard=10,
                               contexts_per_shard=200, multistream=False))  # fmt: skip
    assert plain.counts.articles == 45 and plain.counts.contexts == single.counts.contexts


def test_multistream_mistakes_are_refused_before_the_model_loads(
    tmp_path: Path, bert_vocab_model: Path, multistream: Path, vital60: Path  # noqa: F811
) -> None:
    def attempt(corpus: list[Path], **kw: object) -> str:
        with pytest.raises((BuildError, CorpusError)) as err:
            build(settings(corpus, Path("/nonexistent/model"), tmp_path / "x", **kw))
        return str(err.value)

    index = multistream.with_name("enwiki-20990101-pages-articles-multistream-index.txt.bz2")
    assert "names the index of one dump" in attempt([multistream, vital60], index=index)
    assert "cannot be split across slices" in attempt([multistream], limit_articles=5, num_shards=2)
    bad = tmp_path / "other-index.txt"
    bad.write_text("999999999:1:Somewhere\n")
    assert "lies past the end" in attempt([multistream], index=bad)
    garbage = tmp_path / "garbage-index.txt"
    garbage.write_text("not an index\n")
    assert "not a multistream index line" in attempt([multistream], index=garbage)
    assert read_stream_index(multistream, index).pages


def test_a_damaged_multistream_dump_or_index_is_named_with_the_stream_it_fails_at(
    tmp_path: Path, multistream: Path
) -> None:
    """What a partial download, a wrong index or a damaged stream looks like, one line each: the file, the byte
    offset of the stream, and what to do."""
    index_path = multistream.with_name("enwiki-20990101-pages-articles-multistream-index.txt.bz2")
    index = read_stream_index(multistream, index_path)

    def read_all(dump: Path, idx_path: Path) -> str:
        idx = read_stream_index(dump, idx_path)
        with pytest.raises(CorpusError) as err:
            list(read_streams(idx, 0, len(idx.offsets), CorpusStats()))
        return str(err.value)

    empty = tmp_path / "empty-index.txt"
    empty.write_text("\n")
    with pytest.raises(CorpusError, match=f"^{empty}: an empty multistream index; give the index that belongs to "
                       f"{multistream.name}$"):  # fmt: skip
        read_stream_index(multistream, empty)

    # an index of another dump whose offsets fall inside this dump's streams
    shifted = tmp_path / "shifted-index.txt"
    shifted.write_text("".join(f"{o + 1}:1:X\n" for o in index.offsets))
    said = read_all(multistream, shifted)
    assert said.startswith(f"{multistream}: the bz2 stream at byte {index.offsets[0] + 1} cannot be read ("), said
    assert said.endswith(f"check that {shifted.name} is this dump's index, or download the dump again"), said

    # a download cut inside the last stream: the streams before it are read, the last one is named
    cut = tmp_path / multistream.name
    cut.write_bytes(multistream.read_bytes()[: index.offsets[-1] + 20])
    said = read_all(cut, index_path)
    assert said.startswith(f"{cut}: the bz2 stream at byte {index.offsets[-1]} cannot be read (the file ends inside a "
                           "bz2 stream)"), said  # fmt: skip

    # a stream whose XML is broken
    bad = tmp_path / "bad"
    bad.mkdir()
    pages = [("Alpha", "Alpha is a letter.", 1, 0, None), ("Beta", "Beta is a letter.", 2, 0, None)]
    dump = write_multistream(bad, pages, per_stream=1)
    data = dump.read_bytes()
    second = read_stream_index(dump, dump.with_name(index_path.name)).offsets[1]
    end = data.index(b"BZh", second + 1)  # the next stream (the footer)
    broken = bz2.compress(bz2.decompress(data[second:end]).replace(b"</title>", b"</titel>"))
    dump.write_bytes(data[:second] + broken + data[end:])
    said = read_all(dump, dump.with_name(index_path.name))
    assert said.startswith(f"{dump}: malformed XML in the stream at byte {second} (mismatched tag"), said


def test_slices_cut_by_articles_and_by_streams_do_not_merge(
    tmp_path: Path, bert_vocab_model: Path, multistream: Path  # noqa: F811
) -> None:
    with torch_threads(1):
        a = tmp_path / "a"
        b = tmp_path / "b"
        build(settings([multistream], bert_vocab_model, a, articles_per_shard=10, shard_index=0, num_shards=2))
        build(settings([multistream], bert_vocab_model, b, articles_per_shard=10, shard_index=1, num_shards=2,
                       multistream=False))  # fmt: skip
    with pytest.raises(MergeError, match="blocks cut by|differ"):
        merge_slices([a, b], tmp_path / "m", sparse_indexes=False)
