"""`bert-knn validate` names each kind of damage a datastore can have, in its first line: the file, and what is
wrong with it. Each case damages a copy of a real small build (entity links and an int8 codec; or whole-word
targets and float16 vectors) the way a broken tool or a buggy builder would. Where the damage is to a shard's
content, its SHARD.json, the manifest's entry and the datastore id are made to say what is now on disk (`reseal`):
a builder with that bug would have written them so, and the checksums would pass it; the check after them must not.
The service's start-up check (``deep=False``) is tested on what it reads: markers, sizes, ids, the table's record.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from bertknn.builder.__main__ import main
from bertknn.core.format import read_manifest, validate_datastore
from bertknn.core.format.contract import (
    ARTICLES,
    CODES,
    ENTITIES,
    ENTITY_LABELS,
    ENTITY_OFFSETS,
    LABELS,
    MANIFEST,
    REDIRECTS,
    SENTENCE_IDS,
    SENTENCE_OFFSETS,
    SENTENCES,
    SHARD_MARKER,
    SHARDS_DIR,
    WORDS,
    FileInfo,
    Manifest,
    ShardInfo,
    UpdateInfo,
    read_shard_info,
)
from bertknn.core.format.files import write_manifest
from bertknn.core.format.validate import validate_parts
from bertknn.core.hashing import sha256_file
from tests.conftest import build_tiny, corpus_words, make_tiny_bert, write_jsonl
from tests.integration.test_entities import ARTICLES as LINKED_ARTICLES

FIRST = "shard-00000"
SECOND = "shard-00001"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("validate-bert"), corpus_words(LINKED_ARTICLES))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("validate-corpus") / "linked.jsonl", LINKED_ARTICLES)


@pytest.fixture(scope="module")
def linked(tmp_path_factory: pytest.TempPathFactory, model: Path, corpus: Path) -> Path:
    """Entity links and an int8 codec, single-piece targets; three shards of two articles."""
    out = build_tiny(tmp_path_factory.mktemp("validate-linked") / "ds", [corpus], model, codec="int8")
    assert validate_datastore(out) == [] and len(read_manifest(out).shards) == 3
    return out


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory, model: Path, corpus: Path) -> Path:
    """Whole-word targets and float16 vectors, no links."""
    out = build_tiny(tmp_path_factory.mktemp("validate-whole") / "ds", [corpus], model, targets="whole-word",
                     links=False)  # fmt: skip
    assert validate_datastore(out) == []
    return out


@pytest.fixture(scope="module")
def updated(tmp_path_factory: pytest.TempPathFactory, linked: Path) -> Path:
    """``linked`` after an `add` that replaced Orvin Tasker with a text of the same shape (the same words in another
    order: as many sentences and contexts), so that his old rows are superseded and his new ones live."""
    from bertknn.builder.settings import AddSettings
    from bertknn.builder.update import add_articles

    out = Path(shutil.copytree(linked, tmp_path_factory.mktemp("validate-updated") / "ds"))
    changed = {**LINKED_ARTICLES[0], "text": LINKED_ARTICLES[0]["text"].replace("tall ships and harbours",
                                                                                "tall harbours and ships")}  # fmt: skip
    corpus = write_jsonl(out.parent / "changed.jsonl", [changed])
    add_articles(AddSettings(datastore=out, corpus=[corpus], device="cpu", batch_size=16))  # type: ignore[arg-type]
    man = read_manifest(out)
    assert man.version == 2 and man.counts.superseded_articles == 1 and validate_datastore(out) == []
    return out


# ---- how a copy is damaged ------------------------------------------------------------------------------------


def shard_dir(ds: Path, name: str = FIRST) -> Path:
    return ds / SHARDS_DIR / name


def edit_manifest(ds: Path, **changes: object) -> Manifest:
    """The manifest with these fields replaced, written back as it is (its id not recomputed)."""
    man = read_manifest(ds).model_copy(update=changes)
    write_manifest(ds, man)
    return man


def reseal(ds: Path, name: str = FIRST, *, unlist: tuple[str, ...] = (), **changes: object) -> None:
    """Make the shard's SHARD.json, the manifest's entry for it and the datastore id say what its files are now
    (sizes and checksums of the files it lists, less ``unlist``, plus any listed-to-be file now on disk), with
    ``changes`` to its other fields."""
    d = shard_dir(ds, name)
    info = read_shard_info(d)
    assert info is not None
    names = [n for n in {*info.files, *([WORDS] if (d / WORDS).is_file() else [])} if n not in unlist]
    files = {n: FileInfo(bytes=(d / n).stat().st_size, sha256=sha256_file(d / n)) for n in sorted(names)}
    new = info.model_copy(update={"files": files, **changes})
    (d / SHARD_MARKER).write_text(new.model_dump_json(indent=1))
    man = read_manifest(ds)
    man.shards = [new if s.name == name else s for s in man.shards]
    man.datastore_id = man.compute_id()
    write_manifest(ds, man)


def rewrite_array(ds: Path, name: str, change: Callable[[np.ndarray], np.ndarray]) -> None:
    """One array of the first shard changed, and the shard resealed."""
    path = shard_dir(ds) / name
    np.save(path, change(np.load(path).copy()))
    reseal(ds)


def set_at(index: int, value: int, *more: tuple[int, int]) -> Callable[[np.ndarray], np.ndarray]:
    """A change that sets ``a[index] = value`` (and each further (index, value) pair)."""

    def change(a: np.ndarray) -> np.ndarray:
        for i, v in ((index, value), *more):
            a[i] = v
        return a

    return change


def rewrite_articles(ds: Path, name: str, change: Callable[[list[dict]], None]) -> None:
    path = shard_dir(ds, name) / ARTICLES
    arts = json.loads(path.read_text(encoding="utf-8"))
    change(arts)
    path.write_text(json.dumps(arts, ensure_ascii=False), encoding="utf-8")
    reseal(ds, name)


def table_path(ds: Path) -> Path:
    man = read_manifest(ds)
    assert man.article_table is not None
    return ds / man.article_table


def table_sql(ds: Path, *statements: str) -> Path:
    path = table_path(ds)
    con = sqlite3.connect(path)
    try:
        for sql in statements:
            con.execute(sql)
        con.commit()
    finally:
        con.close()
    return path


# ---- the cases: (which build, damage) -> (the file the first line names, what it says) ------------------------


def old_format(ds: Path) -> tuple[Path, str]:
    edit_manifest(ds, format_version=3)
    return ds / MANIFEST, f"format version 3, this code reads 4; convert it: bert-knn upgrade {ds}"


def unknown_format(ds: Path) -> tuple[Path, str]:
    edit_manifest(ds, format_version=9)
    return ds / MANIFEST, "format version 9, this code reads 4; rebuild it with this version of the builder"


def foreign_id(ds: Path) -> tuple[Path, str]:
    edit_manifest(ds, datastore_id="0" * 16)
    return ds / MANIFEST, "datastore_id does not match the shard checksums"


def missing_index(ds: Path) -> tuple[Path, str]:
    rel = read_manifest(ds).indexes["tfidf"]
    shutil.rmtree(ds / rel) if (ds / rel).is_dir() else (ds / rel).unlink()
    return ds / rel, "tfidf index listed in the manifest is missing"


def live_counts(ds: Path) -> tuple[Path, str]:
    c = read_manifest(ds).counts
    edit_manifest(ds, counts=c.model_copy(update={"contexts": c.contexts + 1}))
    return ds / MANIFEST, f"/{c.contexts + 1} (articles/sentences/contexts) do not match the shards' "


def superseded_counts(ds: Path) -> tuple[Path, str]:
    c = read_manifest(ds).counts
    edit_manifest(ds, counts=c.model_copy(update={"superseded_contexts": 5}))
    return ds / MANIFEST, "superseded counts 0/0/5 do not match the shards' 0/0/0"


def update_from_1(ds: Path) -> tuple[Path, str]:
    edit_manifest(ds, updates=[UpdateInfo(version=1, shards=[FIRST], added=1, replaced=0, unchanged=0)])
    return ds / MANIFEST, "update versions must increase from 2 (found 1 after 1)"


def update_of_no_shard(ds: Path) -> tuple[Path, str]:
    edit_manifest(ds, version=2, updates=[UpdateInfo(version=2, shards=["shard-00099"], added=1, replaced=0,
                                                     unchanged=0)])  # fmt: skip
    return ds / MANIFEST, "update 2 names shards that are not in the manifest: ['shard-00099']"


def shards_out_of_order(ds: Path) -> tuple[Path, str]:
    shards = read_manifest(ds).shards
    edit_manifest(ds, shards=[shards[1], shards[0], *shards[2:]])
    return ds / MANIFEST, f"{FIRST}: out of order after {SECOND}"


def unknown_codec(ds: Path) -> tuple[Path, str]:
    codec = read_manifest(ds).codec
    assert codec is not None
    edit_manifest(ds, codec=codec.model_copy(update={"name": "zstd9"}))
    return ds / MANIFEST, "codec 'zstd9', this version reads "


def missing_codec(ds: Path) -> tuple[Path, str]:
    codec = read_manifest(ds).codec
    assert codec is not None
    (ds / codec.file).unlink()
    return ds / codec.file, "missing (the codec the manifest names)"


def replaced_codec(ds: Path) -> tuple[Path, str]:
    codec = read_manifest(ds).codec
    assert codec is not None
    data = bytearray((ds / codec.file).read_bytes())
    data[-1] ^= 0x01
    (ds / codec.file).write_bytes(bytes(data))
    return ds / codec.file, "sha256 mismatch (corrupted or replaced)"


def codec_not_faiss(ds: Path) -> tuple[Path, str]:
    """A file that is not a FAISS index, with its checksum in the manifest (written by a broken tool)."""
    codec = read_manifest(ds).codec
    assert codec is not None
    (ds / codec.file).write_bytes(b"not a faiss index\n" * 16)
    edit_manifest(ds, codec=codec.model_copy(update={"sha256": sha256_file(ds / codec.file)}))
    return ds / codec.file, "the codec cannot be read ("


def codec_of_other_code_size(ds: Path) -> tuple[Path, str]:
    codec = read_manifest(ds).codec
    assert codec is not None
    edit_manifest(ds, codec=codec.model_copy(update={"code_bytes": codec.code_bytes + 1}))
    return ds / codec.file, f"the codec makes {codec.code_bytes}-byte codes, the manifest says {codec.code_bytes + 1}"


def codec_of_other_width(ds: Path) -> tuple[Path, str]:
    man = read_manifest(ds)
    assert man.codec is not None
    edit_manifest(ds, model=man.model.model_copy(update={"hidden_size": 48}))
    return ds / man.codec.file, "codes vectors of 32 dimensions, the model has 48"


def codes_without_codec(ds: Path) -> tuple[Path, str]:
    edit_manifest(ds, codec=None)
    return shard_dir(ds), "does not hold float16 vectors (no codec) as the manifest says; rebuild it"


def no_article_table(ds: Path) -> tuple[Path, str]:
    edit_manifest(ds, article_table=None)
    return ds / MANIFEST, "names no article table (article_table)"


def table_of_other_shards(ds: Path) -> tuple[Path, str]:
    path = table_sql(ds, "UPDATE meta SET value = 'feedfacefeedface' WHERE key = 'content_id'")
    return path, "made for other shards (content id feedfacefeedface)"


def table_rows_off(ds: Path) -> tuple[Path, str]:
    path = table_sql(ds, "UPDATE entries SET row_end = row_end + 1 WHERE pos = (SELECT min(pos) FROM entries)")
    c = read_manifest(ds).counts
    return path, (f"live articles/sentences/rows {c.articles}/{c.sentences}/{c.contexts + 1}, the manifest says "
                  f"{c.articles}/{c.sentences}/{c.contexts}")  # fmt: skip


def table_entry_in_another_shard(ds: Path) -> tuple[Path, str]:
    path = table_sql(ds, "UPDATE entries SET shard = 1 WHERE pos = (SELECT min(pos) FROM entries)")
    return path, f"1 articles of {FIRST}, its {ARTICLES} has 2"


def table_old_copy_live(ds: Path) -> tuple[Path, str]:
    """After an `add` replaced a title: its superseded copy marked live and its new copy superseded."""
    title = LINKED_ARTICLES[0]["title"]
    path = table_sql(
        ds,
        f"UPDATE entries SET live = 2 WHERE title = '{title}' AND live = 1",
        f"UPDATE entries SET live = 1 WHERE title = '{title}' AND live = 0",
        f"UPDATE entries SET live = 0 WHERE title = '{title}' AND live = 2",
    )
    return path, f"{title!r} should be live in {read_manifest(ds).shards[-1].name}"


def table_titles_swapped(ds: Path) -> tuple[Path, str]:
    arts = sorted(json.loads((shard_dir(ds) / ARTICLES).read_text(encoding="utf-8")), key=lambda a: a["row_start"])
    first, second = arts[0]["title"], arts[1]["title"]
    path = table_sql(
        ds,
        f"UPDATE entries SET title = '~' WHERE title = '{first}'",
        f"UPDATE entries SET title = '{first}' WHERE title = '{second}'",
        f"UPDATE entries SET title = '{second}' WHERE title = '~'",
    )
    return path, f"the entry of {first!r} in {FIRST} differs from {ARTICLES}"


def redirects_not_in_table(ds: Path) -> tuple[Path, str]:
    (ds / REDIRECTS).write_text(json.dumps({"Quellport": "New Quellport"}), encoding="utf-8")
    return table_path(ds), f"the redirects differ from {REDIRECTS}"


def table_not_sqlite(ds: Path) -> tuple[Path, str]:
    table_path(ds).write_bytes(b"not an article table\n" * 64)
    return table_path(ds), "not a readable article table (file is not a database); run `validate`"


def table_missing(ds: Path) -> tuple[Path, str]:
    table_path(ds).unlink()
    return table_path(ds), "the article table is missing; run `validate`, or rebuild the datastore"


def table_of_another_version(ds: Path) -> tuple[Path, str]:
    path = table_sql(ds, "UPDATE meta SET value = '0' WHERE key = 'version'")
    return path, "article table 'bertknn-articles' version '0', this code reads 'bertknn-articles' version 1"


def table_without_totals(ds: Path) -> tuple[Path, str]:
    path = table_sql(ds, "DELETE FROM meta WHERE key = 'live_rows'")
    return path, "meta lacks the live totals ('live_rows'); run `upgrade`"


def labels_not_npy(ds: Path) -> tuple[Path, str]:
    (shard_dir(ds) / LABELS).write_bytes(b"not an array\n" * 8)
    reseal(ds)
    return shard_dir(ds) / LABELS, "); run `validate` and rebuild this shard"


def words_not_json(ds: Path) -> tuple[Path, str]:
    (shard_dir(ds) / WORDS).write_text("[[", encoding="utf-8")
    reseal(ds)
    return shard_dir(ds) / WORDS, "); run `validate` and rebuild this shard"


def unlisted_file(ds: Path) -> tuple[Path, str]:
    reseal(ds, unlist=(LABELS,))
    return shard_dir(ds) / LABELS, f"not listed in {SHARD_MARKER}"


def labels_int64(ds: Path) -> tuple[Path, str]:
    rewrite_array(ds, LABELS, lambda a: a.astype(np.int64))
    rows = read_shard_info(shard_dir(ds)).rows  # type: ignore[union-attr]
    return shard_dir(ds) / LABELS, f"shape ({rows},) int64, expected ({rows},) int32"


def label_outside_vocabulary(ds: Path) -> tuple[Path, str]:
    vocab = read_manifest(ds).model.vocab_size
    labels = np.load(shard_dir(ds) / LABELS)
    rewrite_array(ds, LABELS, set_at(int(np.flatnonzero(labels >= 0)[0]), vocab))
    return shard_dir(ds) / LABELS, f"label outside the vocabulary [0, {vocab})"


def sentence_id_outside(ds: Path) -> tuple[Path, str]:
    sentences = read_shard_info(shard_dir(ds)).sentences  # type: ignore[union-attr]
    rewrite_array(ds, SENTENCE_IDS, set_at(-1, sentences))
    return shard_dir(ds) / SENTENCE_IDS, f"sentence id outside [0, {sentences})"


def sentence_offsets_short(ds: Path) -> tuple[Path, str]:
    size = (shard_dir(ds) / SENTENCES).stat().st_size
    rewrite_array(ds, SENTENCE_OFFSETS, set_at(-1, size - 1))
    return shard_dir(ds) / SENTENCE_OFFSETS, f"last offset {size - 1} != size of {SENTENCES}"


def article_rows_gap(ds: Path) -> tuple[Path, str]:
    def change(arts: list[dict]) -> None:
        arts.sort(key=lambda a: a["row_start"])
        arts[0]["row_start"] = 1

    rewrite_articles(ds, FIRST, change)
    return shard_dir(ds) / ARTICLES, "rows [1, "


def article_rows_short(ds: Path) -> tuple[Path, str]:
    rows = read_shard_info(shard_dir(ds)).rows  # type: ignore[union-attr]
    rewrite_articles(ds, FIRST, lambda arts: max(arts, key=lambda a: a["row_end"]).update(row_end=rows - 1))
    return shard_dir(ds) / ARTICLES, f"article rows cover {rows - 1} of {rows} rows"


def marker_counts_articles(ds: Path) -> tuple[Path, str]:
    info = read_shard_info(shard_dir(ds))
    assert info is not None
    reseal(ds, articles=info.articles + 1)
    return shard_dir(ds) / ARTICLES, f"{info.articles} articles, {SHARD_MARKER} says {info.articles + 1}"


def title_twice_in_a_shard(ds: Path) -> tuple[Path, str]:
    first = json.loads((shard_dir(ds) / ARTICLES).read_text(encoding="utf-8"))[0]["title"]
    rewrite_articles(ds, FIRST, lambda arts: arts[1].update(title=first))
    return shard_dir(ds) / ARTICLES, f"title {first!r} occurs twice"


def title_in_two_built_shards(ds: Path) -> tuple[Path, str]:
    first = json.loads((shard_dir(ds) / ARTICLES).read_text(encoding="utf-8"))[0]["title"]
    rewrite_articles(ds, SECOND, lambda arts: arts[0].update(title=first))
    return shard_dir(ds, SECOND) / ARTICLES, f"title {first!r} is also in {FIRST}, and no `add` made {SECOND}"


def links_not_in_manifest(ds: Path) -> tuple[Path, str]:
    edit_manifest(ds, links=None)
    return shard_dir(ds), f"has {ENTITY_LABELS} but the manifest records no links"


def link_file_unlisted(ds: Path) -> tuple[Path, str]:
    (shard_dir(ds) / ENTITIES).unlink()
    reseal(ds, unlist=(ENTITIES,))
    return shard_dir(ds), f"lacks {ENTITIES}, and the manifest records links; rebuild this shard"


def entity_labels_int64(ds: Path) -> tuple[Path, str]:
    rewrite_array(ds, ENTITY_LABELS, lambda a: a.astype(np.int64))
    return shard_dir(ds) / ENTITY_LABELS, " int64, expected ("


def entity_offsets_not_at_0(ds: Path) -> tuple[Path, str]:
    rewrite_array(ds, ENTITY_OFFSETS, set_at(0, 1))
    return shard_dir(ds) / ENTITY_OFFSETS, "expected int64 offsets starting at 0"


def entity_offsets_short(ds: Path) -> tuple[Path, str]:
    size = (shard_dir(ds) / ENTITIES).stat().st_size
    rewrite_array(ds, ENTITY_OFFSETS, set_at(-1, size - 1))
    return shard_dir(ds) / ENTITY_OFFSETS, f"last offset {size - 1} != size of {ENTITIES}"


def entity_index_outside(ds: Path) -> tuple[Path, str]:
    entities = len(np.load(shard_dir(ds) / ENTITY_OFFSETS)) - 1
    rewrite_array(ds, ENTITY_LABELS, set_at(0, entities))
    return shard_dir(ds) / ENTITY_LABELS, f"entity index outside [-1, {entities})"


def row_with_no_label_nor_link(ds: Path) -> tuple[Path, str]:
    ent = np.load(shard_dir(ds) / ENTITY_LABELS)
    rewrite_array(ds, LABELS, set_at(int(np.flatnonzero(ent < 0)[0]), -1))
    return shard_dir(ds) / LABELS, "a row has neither a word label nor a link; rebuild this shard"


def words_on_single_piece(ds: Path) -> tuple[Path, str]:
    (shard_dir(ds) / WORDS).write_text('[["zembla",[5]]]', encoding="utf-8")
    reseal(ds)
    return shard_dir(ds), f"has a {WORDS} but the manifest says targets=single-piece"


def no_words_on_whole_word(ds: Path) -> tuple[Path, str]:
    (shard_dir(ds) / WORDS).unlink()
    reseal(ds, unlist=(WORDS,))
    return shard_dir(ds), f"has no {WORDS} but the manifest says targets=whole-word"


def rewrite_words(ds: Path, change: Callable[[list], None]) -> tuple[Path, list]:
    """The first shard's word table ([text, [piece ids]] entries) changed and resealed: its path and entries."""
    path = shard_dir(ds) / WORDS
    words = json.loads(path.read_text(encoding="utf-8"))
    change(words)
    path.write_text(json.dumps(words), encoding="utf-8")
    reseal(ds)
    return path, words


def word_piece_outside(ds: Path) -> tuple[Path, str]:
    vocab = read_manifest(ds).model.vocab_size
    path, words = rewrite_words(ds, lambda words: words[0].__setitem__(1, [vocab]))
    return path, f"entry 0 ({words[0][0]!r}) has a piece id outside the vocabulary [0, {vocab})"


def word_twice(ds: Path) -> tuple[Path, str]:
    path, words = rewrite_words(ds, lambda words: words[1].__setitem__(0, words[0][0]))
    return path, f"entry 1: the word {words[0][0]!r} is listed twice"


def label_outside_word_table(ds: Path) -> tuple[Path, str]:
    n = len(json.loads((shard_dir(ds) / WORDS).read_text(encoding="utf-8")))
    rewrite_array(ds, LABELS, set_at(0, n))
    return shard_dir(ds) / LABELS, f"label outside the word table [0, {n})"


def vectors_under_a_codec(ds: Path, linked: Path) -> tuple[Path, str]:
    edit_manifest(ds, codec=read_manifest(linked).codec)
    return shard_dir(ds), "does not hold codes of codec int8 as the manifest says; rebuild it"


LINKED = [old_format, unknown_format, foreign_id, missing_index, live_counts, superseded_counts, update_from_1,
          update_of_no_shard, shards_out_of_order, unknown_codec, missing_codec, replaced_codec, codec_not_faiss,
          codec_of_other_code_size, codec_of_other_width,
          codes_without_codec, no_article_table, table_of_other_shards, table_rows_off, table_entry_in_another_shard, table_titles_swapped,
          redirects_not_in_table, table_not_sqlite, table_missing, table_of_another_version, unlisted_file,
          labels_not_npy, labels_int64, label_outside_vocabulary, sentence_id_outside,
          sentence_offsets_short, article_rows_gap, article_rows_short, marker_counts_articles,
          title_twice_in_a_shard, title_in_two_built_shards, links_not_in_manifest, link_file_unlisted,
          entity_labels_int64, entity_offsets_not_at_0, entity_offsets_short, entity_index_outside,
          row_with_no_label_nor_link, words_on_single_piece]  # fmt: skip
WHOLE = [no_words_on_whole_word, words_not_json, word_piece_outside, word_twice, label_outside_word_table]


def check_first_line(ds: Path, path: Path, what: str, capsys: pytest.CaptureFixture[str]) -> None:
    """validate_datastore's first problem and `bert-knn validate`'s first line name ``path`` and say ``what``."""
    problems = validate_datastore(ds)
    assert problems and problems[0].startswith(f"{path}: ") and what in problems[0], problems
    capsys.readouterr()
    assert main(["validate", str(ds)]) == 1
    assert capsys.readouterr().err.splitlines()[0] == f"INVALID: {problems[0]}"


@pytest.mark.parametrize(
    ("build", "damage"),
    [*(("linked", d) for d in LINKED), *(("whole", d) for d in WHOLE), ("updated", table_old_copy_live)],
    ids=lambda x: x if isinstance(x, str) else x.__name__,
)  # fmt: skip
def test_validate_names_the_damage(
    tmp_path: Path, request: pytest.FixtureRequest, build: str, damage: Callable[[Path], tuple[Path, str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    ds = Path(shutil.copytree(request.getfixturevalue(build), tmp_path / "ds"))
    path, what = damage(ds)
    check_first_line(ds, path, what, capsys)


def test_validate_names_vectors_where_the_manifest_names_a_codec(
    tmp_path: Path, whole: Path, linked: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = Path(shutil.copytree(whole, tmp_path / "ds"))
    assert CODES not in read_shard_info(shard_dir(ds)).files  # type: ignore[union-attr]
    path, what = vectors_under_a_codec(ds, linked)
    check_first_line(ds, path, what, capsys)


# ---- the service's start-up check (deep=False): what it reads, and what it leaves to `validate` ----------------


def missing_labels(ds: Path) -> tuple[Path, str]:
    (shard_dir(ds) / LABELS).unlink()
    return shard_dir(ds) / LABELS, "missing; run `validate`, then rebuild (the same build command resumes)"


def truncated_labels(ds: Path) -> tuple[Path, str]:
    path = shard_dir(ds) / LABELS
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-4])
    return path, f"{size - 4} bytes, expected {size} (truncated or rewritten)"


def marker_of_another_build(ds: Path) -> tuple[Path, str]:
    info = read_shard_info(shard_dir(ds))
    assert info is not None
    (shard_dir(ds) / SHARD_MARKER).write_text(info.model_copy(update={"rows": info.rows + 1}).model_dump_json())
    return shard_dir(ds) / SHARD_MARKER, f"differs from the manifest's entry for {FIRST}"


def recorded_totals_off(ds: Path) -> tuple[Path, str]:
    path = table_sql(ds, "UPDATE meta SET value = value + 1 WHERE key = 'live_rows'")
    return path, "live articles/sentences/rows "


STARTUP = [missing_labels, truncated_labels, marker_of_another_build, foreign_id, missing_index, recorded_totals_off,
           table_of_other_shards, no_article_table, shards_out_of_order, table_not_sqlite, table_missing,
           table_of_another_version, table_without_totals]  # fmt: skip


@pytest.mark.parametrize("damage", STARTUP, ids=lambda f: f.__name__)
def test_the_start_up_check_names_what_it_reads(tmp_path: Path, linked: Path, damage: Callable) -> None:
    ds = Path(shutil.copytree(linked, tmp_path / "ds"))
    path, what = damage(ds)
    problems = validate_datastore(ds, hashes=False, deep=False)
    assert problems and problems[0].startswith(f"{path}: ") and what in problems[0], problems


def test_the_start_up_check_leaves_content_to_validate(tmp_path: Path, linked: Path) -> None:
    """A label outside the vocabulary, with checksums that match: only the deep check reads the rows."""
    ds = Path(shutil.copytree(linked, tmp_path / "ds"))
    path, what = label_outside_vocabulary(ds)
    assert validate_datastore(ds, hashes=False, deep=False) == []
    assert what in validate_datastore(ds)[0]


# ---- the order of a build's shard parts (block, part) ----------------------------------------------------------


def part(index: int, part: int = 0, *, last: bool = True, name: str | None = None) -> ShardInfo:
    label = name or (f"shard-{index:05d}" if part == 0 else f"shard-{index:05d}.{part:03d}")
    return ShardInfo(name=label, index=index, part=part, last=last, rows=1, articles=1, sentences=1, files={})


@pytest.mark.parametrize(
    ("shards", "what"),
    [
        ([part(0), part(1, 0, last=False), part(1, 1), part(2)], None),
        ([part(0, name="shard-00007")], "shard-00007: the name does not match block 0 part 0"),
        ([part(1), part(0)], "shard-00000: out of order after shard-00001"),
        ([part(0), part(0)], "shard-00000: out of order after shard-00000"),
        ([part(0), part(1, 1)], "shard-00001.001: part 1 without part 0 of its block before it"),
        ([part(1, 0, last=False), part(1, 2)], "shard-00001.002: part 2 without part 1 of its block before it"),
        ([part(0, 0, last=False), part(1)], "shard-00000 is not the last part of its block, but the next is missing"),
        ([part(0), part(1, 0, last=False)],
         "shard-00001 is not the last part of its block, but the next is missing"),
    ],
)  # fmt: skip
def test_shard_parts_come_in_block_and_part_order(shards: list[ShardInfo], what: str | None) -> None:
    problems = validate_parts(Path("m.json"), shards)
    assert problems == ([] if what is None else [f"m.json: {what}"])


# ---- the reader refuses the same without `validate` having run (a caller that opens a datastore directly) ------


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (old_format, "format version 3, this code reads 4; convert it: bert-knn upgrade "),
        (unknown_format, "format version 9, this code reads 4; rebuild the datastore with this version of the builder"),
        (no_article_table, "names no article table; run `validate`"),
        (unknown_codec, "codec 'zstd9', this version reads int8, pq (and fp16 vectors); upgrade bert-knn, or rebuild"),
        (codec_not_faiss, "the codec cannot be read ("),
        (table_not_sqlite, "not a readable article table (file is not a database); run `validate`"),
    ],
    ids=lambda x: x.__name__ if callable(x) else "",
)  # fmt: skip
def test_the_reader_refuses_in_one_line(tmp_path: Path, linked: Path, damage: Callable, says: str) -> None:
    from bertknn.core.errors import DatastoreError
    from bertknn.core.format import Datastore

    ds = Path(shutil.copytree(linked, tmp_path / "ds"))
    path, _ = damage(ds)
    with pytest.raises(DatastoreError) as err:
        Datastore(ds)
    assert str(err.value).startswith(f"{path}: ") and says in str(err.value), err.value


def test_the_edges_of_each_range_are_valid(tmp_path: Path, linked: Path) -> None:
    """What the checks allow at their bounds: word labels 0 and vocab_size - 1, entity index -1 on a row with a
    word label, and the last entity of the shard's table."""
    ds = Path(shutil.copytree(linked, tmp_path / "ds"))
    vocab = read_manifest(ds).model.vocab_size
    first, second = (int(i) for i in np.flatnonzero(np.load(shard_dir(ds) / LABELS) >= 0)[:2])
    rewrite_array(ds, LABELS, set_at(first, 0, (second, vocab - 1)))
    last = len(np.load(shard_dir(ds) / ENTITY_OFFSETS)) - 2
    rewrite_array(ds, ENTITY_LABELS, set_at(first, -1, (second, last)))
    assert validate_datastore(ds) == []
