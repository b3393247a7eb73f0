"""`bench.languages`' share of a text's words that a tokenizer keeps as targets: the same count as the build's."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.languages import word_share

BERT = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "tokenizer" / "bert-base-uncased"
ENGLISH = [
    "Paris is the capital and largest city of France, on the river Seine.",
    "The bridge of the old town was built of red stone in the twelfth century.",
]
UKRAINIAN = [
    "Київ є столицею та найбільшим містом України, розташованим на річці Дніпро.",
    "Міст старого міста був збудований з червоного каменю у дванадцятому столітті.",
]


def test_bert_s_tokenizer_keeps_most_english_words_and_few_ukrainian_ones() -> None:
    english, ukrainian = word_share(ENGLISH, BERT, "en"), word_share(UKRAINIAN, BERT, "uk")
    assert english is not None and ukrainian is not None
    assert english >= 0.8 and ukrainian <= 0.2, (english, ukrainian)


def test_a_text_of_stopwords_and_punctuation_alone_has_no_share() -> None:
    assert word_share(["It is of the, and it was."], BERT, "en") is None
    assert word_share([], BERT, "en") is None


@pytest.mark.parametrize("language", ["en", "uk"])
def test_the_share_counts_words_as_the_build_does(language: str) -> None:
    """Each sentence's words (the build's `TokenizedSentence.words`), not its tokens: 'Seine.' is one word."""
    share = word_share(["Seine Seine Seine Seine."], BERT, language)
    assert share == 1.0
