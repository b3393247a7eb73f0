"""The vocabulary's word table kept on disk (`bertknn.core.vocab_cache`): read by the next process of the same
tokenizer and code instead of made again, never used for another tokenizer, made again when damaged."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from bertknn.core import vocab_cache as vc
from bertknn.core.vocab_cache import VocabCache, vocab_key
from bertknn.core.wordmodel import VocabWords, WordModel, read_vocab_words
from tests.conftest import TINY_ARTICLES, corpus_words
from tests.support.families import train_tokenizer

WORDS = corpus_words(TINY_ARTICLES)
TEXTS = [a["text"] for a in TINY_ARTICLES] + [" ".join(WORDS)]  # running text: words after spaces


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[WordModel]:
    """The word models whose table `read_vocab_words` made in this test (it still makes them)."""
    calls: list[WordModel] = []

    def counted(model: WordModel) -> VocabWords:
        calls.append(model)
        return read_vocab_words(model)

    monkeypatch.setattr(vc, "read_vocab_words", counted)
    return calls


def same(a: VocabWords, b: VocabWords) -> bool:
    return a.texts == b.texts and a.word_of.dtype == b.word_of.dtype and np.array_equal(a.word_of, b.word_of)


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta"])
def test_the_next_process_reads_the_kept_table_of_every_family(family: str, tmp_path: Path, made: list) -> None:
    tok = train_tokenizer(family, TEXTS)
    cache = VocabCache(tmp_path)
    first = cache.words(WordModel(tok))
    assert len(made) == 1 and len(list(tmp_path.glob("*.json"))) == 1
    second = WordModel(tok)  # as a process started again would: a new word model of the same tokenizer
    kept = cache.words(second)
    assert len(made) == 1, "the kept table was made again"
    assert same(kept, first) and same(kept, read_vocab_words(WordModel(tok)))
    second.vocab = kept
    assert same(second.vocab, first) and (first.word_of >= 0).sum() > len(WORDS) // 2  # a table with words in it
    assert all(np.array_equal(a, b) for a, b in zip(second.vocab.merges, first.merges, strict=True))


def test_another_tokenizer_or_vocabulary_size_never_reads_another_table(tmp_path: Path, made: list) -> None:
    bert, roberta = train_tokenizer("bert", TEXTS), train_tokenizer("roberta", TEXTS)
    smaller = train_tokenizer("bert", TEXTS[:2], vocab_size=400)
    keys = {vocab_key(WordModel(bert)), vocab_key(WordModel(roberta)), vocab_key(WordModel(smaller)),
            vocab_key(WordModel(bert, vocab_size=len(bert) + 8))}  # fmt: skip
    assert len(keys) == 4
    bert.save_pretrained(tmp_path / "tok")
    again = [AutoTokenizer.from_pretrained(tmp_path / "tok") for _ in range(2)]  # the same files, loaded again
    assert vocab_key(WordModel(again[0])) == vocab_key(WordModel(again[1])) == vocab_key(WordModel(bert))
    spec = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    word = next(w for w in vocab if w.isalpha() and len(w) > 3)
    vocab[word[:-1] + "Q"] = vocab.pop(word)  # one entry spelt differently: the same size, class and specials
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(spec))
    respelt = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert len(respelt) == len(bert) and vocab_key(WordModel(respelt)) != vocab_key(WordModel(bert))
    cache = VocabCache.from_setting(str(tmp_path / "kept"))
    assert cache is not None
    for tok in (bert, roberta, smaller):
        assert same(cache.words(WordModel(tok)), read_vocab_words(WordModel(tok)))
    assert len(made) == 3 and len(list((tmp_path / "kept").glob("*.json"))) == 3


@pytest.mark.parametrize(
    "damage",
    [
        lambda kept: kept[: len(kept) // 2],  # cut short
        lambda kept: json.dumps({**json.loads(kept), "format": vc.FORMAT + 1}),
        lambda kept: json.dumps({**json.loads(kept), "texts": json.loads(kept)["texts"][:-1]}),
        lambda kept: json.dumps({**json.loads(kept), "word_of": [10**6] * len(json.loads(kept)["word_of"])}),
        lambda kept: json.dumps({**json.loads(kept), "word_of": ["1"] * len(json.loads(kept)["word_of"])}),
        lambda kept: "[]",
    ],
    ids=["cut-short", "other-format", "other-size", "ids-outside", "ids-not-ints", "not-a-table"],
)
def test_a_damaged_table_is_made_again(damage, tmp_path: Path, made: list, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    tok = train_tokenizer("bert", TEXTS)
    cache = VocabCache(tmp_path)
    good = cache.words(WordModel(tok))
    (path,) = tmp_path.glob("*.json")
    path.write_text(damage(path.read_text()))
    caplog.set_level(logging.WARNING, logger="bertknn.core.vocab_cache")
    again = cache.words(WordModel(tok))
    assert len(made) == 2 and "made again" in caplog.text
    assert same(again, good) and same(cache.words(WordModel(tok)), good) and len(made) == 2  # rewritten whole


def test_processes_starting_together_make_it_once(tmp_path: Path, made: list) -> None:
    tok = train_tokenizer("bert", TEXTS)
    cache = VocabCache(tmp_path)
    got: list[VocabWords] = []
    threads = [threading.Thread(target=lambda: got.append(cache.words(WordModel(tok)))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len(got) == 3 and all(same(g, got[0]) for g in got)
    assert not list(tmp_path.glob("*.tmp"))


def test_the_least_recently_used_tables_beyond_the_limit_are_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vc, "KEEP", 2)
    cache = VocabCache(tmp_path)
    toks = [train_tokenizer("bert", TEXTS, vocab_size=n) for n in (300, 400, 500)]
    first = cache.path(vocab_key(WordModel(toks[0])))
    cache.words(WordModel(toks[0]))
    cache.words(WordModel(toks[1]))
    import os

    os.utime(first, (1, 1))
    os.utime(cache.path(vocab_key(WordModel(toks[1]))), (0, 0))
    cache.words(WordModel(toks[0]))  # read: now the most recently used
    cache.words(WordModel(toks[2]))
    assert first.is_file() and not cache.path(vocab_key(WordModel(toks[1]))).exists()
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_directory_deleted_after_start_up_makes_the_table_here(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(The setting's directory itself: tests/unit/test_disk_cache.py.)"""
    gone = VocabCache(tmp_path / "deleted-meanwhile")  # a directory removed after start-up checked it
    tok = train_tokenizer("bert", TEXTS)
    assert same(gone.words(WordModel(tok)), read_vocab_words(WordModel(tok)))
    assert "the table is made here" in caplog.text


def test_the_service_and_the_builder_keep_the_table_where_their_settings_say(
    tiny_datastore: Path, tiny_corpus: Path, tiny_model_dir: Path, tmp_path: Path, made: list,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from bertknn.service.main import open_pipeline
    from bertknn.service.results import Query
    from bertknn.service.settings import ServiceSettings
    from tests.conftest import build_tiny

    caplog.set_level(logging.INFO, logger="bertknn.core.vocab_cache")
    settings = ServiceSettings(datastore=tiny_datastore, model={"device": "cpu", "vocab_cache": str(tmp_path / "svc")})
    answers = []
    for _ in range(2):  # a start, and the next one (a restart, a replaced worker)
        pipe = open_pipeline(settings)
        try:
            answers.append(pipe.predict(Query("zorblat was born in [MASK] .", subject="zorblat")).predictions)
        finally:
            pipe.close()
    (kept,) = (tmp_path / "svc").glob("*.json")
    assert len(made) == 1 and answers[0] == answers[1]
    assert f"made and kept in {kept}" in caplog.text and f"loaded from {kept}" in caplog.text  # the operator's view

    build_tiny(tmp_path / "ds", [tiny_corpus], tiny_model_dir, vocab_cache=str(tmp_path / "builder"))
    assert len(list((tmp_path / "builder").glob("*.json"))) == 1, "the builder's preparer kept no table"
    made.clear()
    off = ServiceSettings(datastore=tiny_datastore, model={"device": "cpu", "vocab_cache": "off"})
    pipe = open_pipeline(off)
    pipe.close()
    assert len(made) == 0 and pipe.encoder.words.vocab is not None  # made where it is first read, as before
