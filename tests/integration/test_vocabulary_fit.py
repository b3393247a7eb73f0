"""A model whose tokenizer barely knows the corpus's language: the build says so as soon as its first block is
tokenised (before the forward of a whole corpus), and the manifest keeps it; a fitting corpus builds silently.

The model's tokenizer is trained on the bundled English sample (with the Ukrainian alphabet, so that Cyrillic
letters are tokens, as in bert-base-uncased's vocabulary), and built over the real Ukrainian dump."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from bertknn.builder.build import build
from bertknn.builder.settings import BuildSettings
from bertknn.builder.targets import TargetSelector, load_stopwords
from bertknn.core.format.reader import Datastore
from tests.support.families import make_family_model, train_tokenizer

REPO = Path(__file__).resolve().parents[2]
UK_DUMP = REPO / ".." / "shared" / "data" / "wiki-i18n" / "ukwiki-truncated-100k.xml.xz"
SAMPLE = REPO / "data" / "sample_wiki.jsonl"
SAID = "of the corpus's words (stopwords and punctuation aside) are"


@pytest.fixture(scope="module")
def english_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = [json.loads(line)["text"] for line in SAMPLE.read_text(encoding="utf-8").splitlines()[:200]]
    texts.append("абвгґдеєжзиіїйклмнопрстуфхцчшщьюя АБВГҐДЕЄЖЗИІЇЙКЛМНОПРСТУФХЦЧШЩЬЮЯ")
    tokenizer = train_tokenizer("bert", texts, vocab_size=3000)
    return make_family_model(tmp_path_factory.mktemp("en-model"), "bert", texts, tokenizer=tokenizer)


def _build(corpus: Path, model: Path, out: Path, **settings: object) -> list[str]:
    build(BuildSettings(corpus=[corpus], model=str(model), out=out, limit_articles=12, sparse_indexes=False,
                        **settings))  # fmt: skip
    return Datastore(out).manifest.warnings


def test_an_english_tokenizer_over_ukrainian_text_is_said_once_and_kept(
    english_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.INFO, logger="bertknn"):
        warnings = _build(UK_DUMP, english_model, tmp_path / "uk")
    said = [r for r in caplog.records if SAID in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    line = said[0].getMessage()
    assert "one token of this model's tokenizer" in line and "('uk')" in line and "--targets whole-word" in line
    share = float(line.removeprefix("only ").split("%")[0])
    assert share < 20, line
    finished = next(i for i, r in enumerate(caplog.records) if r.getMessage().startswith("build finished"))
    assert caplog.records.index(said[0]) < finished  # said when met, not only in the summary
    assert [w for w in warnings if SAID in w] == [line]  # the manifest keeps it (the share over the whole build)


def test_the_same_model_over_english_text_builds_silently(english_model: Path, tmp_path: Path):
    assert not [w for w in _build(SAMPLE, english_model, tmp_path / "en") if SAID in w]


def test_whole_word_targets_keep_enough_of_the_same_ukrainian_text(english_model: Path, tmp_path: Path):
    """What the warning offers instead holds: words of several tokens are kept, and nothing is said."""
    assert not [w for w in _build(UK_DUMP, english_model, tmp_path / "uk-whole", targets="whole-word") if SAID in w]


def test_words_the_tokenizer_cannot_spell_count_as_words_it_does_not_keep():
    """An XLM-R-style Unigram tokenizer trained on English spells a Cyrillic word as its unknown token: no word
    span holds it, yet it is a word of the corpus, so it counts among those seen (and the share falls)."""
    texts = [json.loads(line)["text"] for line in SAMPLE.read_text(encoding="utf-8").splitlines()[:200]]
    tokenizer = train_tokenizer("xlm-roberta", texts, vocab_size=3000)
    selector = TargetSelector(tokenizer, load_stopwords(None, "uk"))
    [sentence] = selector.select(["Київ є столицею та найбільшим містом України, розташованим на річці Дніпро."])
    assert tokenizer.unk_token_id in sentence.ids
    assert sentence.word_targets == 0 and sentence.words >= 6, sentence.words  # Київ, столицею, найбільшим...
