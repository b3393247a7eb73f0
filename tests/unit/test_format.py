"""`validate` names the file behind each kind of damage; the article table is contiguous; the reader reads rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from bertknn.builder.__main__ import main
from bertknn.core.format import (
    ARTICLES,
    LABELS,
    MANIFEST,
    SHARD_MARKER,
    SHARDS_DIR,
    SPANS,
    VECTORS,
    Datastore,
    FileInfo,
    read_manifest,
    sha256_file,
    validate_datastore,
    write_manifest,
)
from tests.conftest import build_tiny


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("format") / "ds"
    return build_tiny(out, [tiny_corpus], tiny_model_dir, batch_size=8, sparse_indexes=False)


@pytest.fixture
def ds(built: Path, tmp_path: Path) -> Path:
    """A private copy to damage."""
    return Path(shutil.copytree(built, tmp_path / "ds"))


def shard_dir(root: Path, n: int = 1) -> Path:
    return root / SHARDS_DIR / f"shard-{n:05d}"


def test_a_fresh_build_validates(ds: Path) -> None:
    m = read_manifest(ds)
    assert validate_datastore(ds) == []
    assert len(m.shards) == 3 and m.counts.articles == 6
    assert m.counts.contexts > 20  # the tiny tokenizer knows the corpus words: real targets were found


def test_truncated_vectors_are_named(ds: Path) -> None:
    path = shard_dir(ds) / VECTORS
    path.write_bytes(path.read_bytes()[:-10])
    problems = validate_datastore(ds)
    assert problems[0].startswith(f"{path}: ")
    assert "truncated" in problems[0]
    assert validate_datastore(ds, hashes=False)[0].startswith(f"{path}: ")


def test_a_corrupted_byte_is_named(ds: Path) -> None:
    path = shard_dir(ds) / LABELS
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # same size, one bit flipped in the data
    path.write_bytes(bytes(data))
    problems = validate_datastore(ds)
    assert problems[0] == f"{path}: sha256 mismatch (corrupted)"


def test_a_missing_file_is_named(ds: Path) -> None:
    path = shard_dir(ds, 2) / SPANS
    path.unlink()
    assert validate_datastore(ds)[0] == f"{path}: missing"


def test_a_missing_shard_marker_is_named(ds: Path) -> None:
    path = shard_dir(ds, 0) / SHARD_MARKER
    path.unlink()
    assert validate_datastore(ds)[0].startswith(f"{path}: missing")


def test_wrong_manifest_counts_are_named(ds: Path) -> None:
    m = read_manifest(ds)
    m.counts.contexts += 1
    write_manifest(ds, m)
    problems = validate_datastore(ds)
    assert problems[0].startswith(f"{ds / MANIFEST}: counts ")
    assert "do not match" in problems[0]


def test_a_directory_without_a_build_is_not_called_an_unfinished_one(tmp_path: Path) -> None:
    """Only a directory a build was started in (its build.json) is told to resume; an empty or missing one is told
    that no datastore is there, and how to make one."""
    (empty,) = validate_datastore(tmp_path)
    assert empty.startswith(f"{tmp_path / MANIFEST}: no manifest, and no build was started in {tmp_path}")
    assert "bert-knn build --corpus FILE --out DIR" in empty and "resume" not in empty
    (missing,) = validate_datastore(tmp_path / "nowhere")
    assert missing.startswith(f"{tmp_path / 'nowhere'}: no such directory") and "resume" not in missing


def test_a_missing_manifest_says_the_build_did_not_finish(ds: Path) -> None:
    (ds / MANIFEST).unlink()
    (problem,) = validate_datastore(ds)
    assert problem.startswith(f"{ds / MANIFEST}: no manifest")
    assert "re-run the same build command" in problem


def test_article_rows_are_contiguous_and_cover_each_shard(built: Path) -> None:
    store = Datastore(built)
    for shard in store.shards:
        arts = sorted(shard.articles(), key=lambda a: a["row_start"])
        assert arts[0]["row_start"] == 0 and arts[-1]["row_end"] == shard.info.rows
        for a, b in zip(arts, arts[1:], strict=False):
            assert a["row_end"] == b["row_start"]
        for a in arts:
            # Every row of the article points into the article's own sentences.
            sids = shard.sentence_ids[a["row_start"] : a["row_end"]]
            assert np.all((sids >= a["sent_start"]) & (sids < a["sent_end"]))


def test_non_contiguous_article_rows_are_named(ds: Path) -> None:
    """Damage the article table consistently (checksums re-sealed) so only the contiguity check can catch it."""
    sd = shard_dir(ds)
    arts = json.loads((sd / ARTICLES).read_text(encoding="utf-8"))
    arts[1]["row_start"] += 1  # a gap of one row between the two articles
    (sd / ARTICLES).write_text(json.dumps(arts, ensure_ascii=False, sort_keys=True), encoding="utf-8")
    m = read_manifest(ds)
    entry = m.shards[1]
    files = {**entry.files, ARTICLES: FileInfo(bytes=(sd / ARTICLES).stat().st_size, sha256=sha256_file(sd / ARTICLES))}
    m.shards[1] = entry.model_copy(update={"files": files})
    (sd / SHARD_MARKER).write_text(m.shards[1].model_dump_json(indent=1))
    m.datastore_id = m.compute_id()
    write_manifest(ds, m)
    problems = validate_datastore(ds)
    assert problems[0].startswith(f"{sd / ARTICLES}: article ")
    assert "not contiguous" in problems[0]


def test_cli_validate_reports_the_first_problem(ds: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(ds)]) == 0
    assert f"OK: {ds}" in capsys.readouterr().out
    path = shard_dir(ds) / VECTORS
    path.write_bytes(path.read_bytes()[:-2])
    assert main(["validate", str(ds)]) == 1
    assert f"INVALID: {path}: " in capsys.readouterr().err


def test_reader_returns_the_rows_of_the_given_articles(built: Path, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    store = Datastore(built)
    vecs, labels, ids = store.article_rows(["Plonk", "No such article", "Zorblat"])
    plonk, zorblat = store.articles["Plonk"], store.articles["Zorblat"]
    assert len(ids) == plonk.rows + zorblat.rows
    pos = plonk.shard
    np.testing.assert_array_equal(vecs[: plonk.rows], store.shards[pos].vectors[plonk.row_start : plonk.row_end])
    np.testing.assert_array_equal(labels, store.labels_at(ids))
    for g, label in zip(ids[: plonk.rows], labels[: plonk.rows], strict=True):
        ref = store.context(int(g))
        assert ref.article == "Plonk"
        word = ref.sentence[ref.span[0] : ref.span[1]]
        assert tokenizer(word, add_special_tokens=False)["input_ids"] == [int(label)]


def test_contexts_of_rows_from_several_articles_in_any_order(built: Path, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    store = Datastore(built)
    titles = sorted(store.articles)
    _, labels, ids = store.article_rows(titles)
    owner = {}
    for title in titles:  # the article of each global row, from the article table
        entry = store.articles[title]
        base = int(store.shard_offsets[entry.shard])
        owner.update({base + r: title for r in range(entry.row_start, entry.row_end)})
    label_of = dict(zip(ids.tolist(), labels.tolist(), strict=True))
    rng = np.random.default_rng(0)
    rows = [int(r) for r in rng.permutation(ids)] + [int(ids[0]), int(ids[-1]), int(ids[0])]  # shuffled, repeated
    refs = store.contexts(rows)
    assert len(refs) == len(rows) and len({owner[r] for r in rows}) > 1
    for row, ref in zip(rows, refs, strict=True):
        assert ref.article == owner[row]
        word = ref.sentence[ref.span[0] : ref.span[1]]
        assert tokenizer(word, add_special_tokens=False)["input_ids"] == [label_of[row]]
    assert store.contexts([]) == []
    np.testing.assert_array_equal(store.labels_at(np.asarray(rows)), [label_of[r] for r in rows])
    assert [store.locate(r) for r in rows] == [
        (pos, int(local)) for r in rows for pos, (at, locals_) in store._by_shard([r]).items() for local in locals_
    ]
