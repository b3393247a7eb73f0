"""Whole-word targets and the word table, with the real bert-base-uncased tokenizer (realistic wordpieces)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerBase

from bertknn.builder.targets import TargetSelector, load_stopwords, masked_ids
from bertknn.core.wordmodel import WordModel
from bertknn.core.words import (
    MAX_WORD_PIECES,
    WordEntry,
    WordTable,
    WordTableBuilder,
    check_word_table,
)


@pytest.fixture(scope="module")
def whole(bert_tokenizer: PreTrainedTokenizerBase) -> TargetSelector:
    return TargetSelector(bert_tokenizer, load_stopwords(), "whole-word")


def test_multi_piece_words_become_targets_with_all_their_pieces(
    whole: TargetSelector, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    (s,) = whole.select(["Kierkegaard wrote philosophy in Copenhagen."])
    assert [s.text[t.char_start : t.char_end] for t in s.targets] == [
        "Kierkegaard",
        "wrote",
        "philosophy",
        "Copenhagen",
    ]
    kierkegaard = s.targets[0]
    assert bert_tokenizer.convert_ids_to_tokens(list(kierkegaard.pieces)) == ["ki", "##er", "##ke", "##gaard"]
    assert kierkegaard.num_pieces == 4 and kierkegaard.token_id == kierkegaard.pieces[0]
    assert all(t.num_pieces == 1 and t.pieces == (t.token_id,) for t in s.targets[1:])


def test_a_word_of_several_pieces_is_replaced_by_one_mask(
    whole: TargetSelector, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    (s,) = whole.select(["Kierkegaard wrote philosophy in Copenhagen."])
    mask = bert_tokenizer.mask_token_id
    ids, pos = masked_ids(s, s.targets[0], mask)
    assert pos == 0 and ids.count(mask) == 1 and len(ids) == len(s.ids) - 3
    assert bert_tokenizer.decode(ids) == "[MASK] wrote philosophy in copenhagen."
    # a one-piece word after the multi-piece one: positions are the sentence's own, one mask, nothing removed
    ids, pos = masked_ids(s, s.targets[3], mask)
    assert ids[pos] == mask and ids.count(mask) == 1 and len(ids) == len(s.ids)
    assert bert_tokenizer.convert_ids_to_tokens(ids[:4]) == ["ki", "##er", "##ke", "##gaard"]


def test_single_piece_mode_is_unchanged(bert_tokenizer: PreTrainedTokenizerBase) -> None:
    (s,) = TargetSelector(bert_tokenizer, load_stopwords()).select(["Kierkegaard wrote philosophy in Copenhagen."])
    assert [s.text[t.char_start : t.char_end] for t in s.targets] == ["wrote", "philosophy", "Copenhagen"]
    assert all(t.pieces == () and t.num_pieces == 1 for t in s.targets)


def test_stopwords_punctuation_and_overlong_words_are_not_targets(
    whole: TargetSelector, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    long_word = "Pneumonoultramicroscopicsilicovolcanoconiosis"
    assert len(bert_tokenizer.tokenize(long_word)) > MAX_WORD_PIECES
    (s,) = whole.select([f"The {long_word} of Zyxwvbq -- was (rare)."])
    got = [s.text[t.char_start : t.char_end] for t in s.targets]
    assert got == ["Zyxwvbq", "rare"]
    assert len(s.targets[0].pieces) > 1


def test_a_word_of_exactly_the_most_pieces_is_a_target_and_one_more_is_not(
    whole: TargetSelector, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    longest, too_long = "Qwxzvbnmlk", "Zyxwvbqrstuvw"
    assert (len(bert_tokenizer.tokenize(longest)), len(bert_tokenizer.tokenize(too_long))) == (
        MAX_WORD_PIECES, MAX_WORD_PIECES + 1)  # fmt: skip
    (s,) = whole.select([f"{longest} met {too_long} here."])
    assert [(s.text[t.char_start : t.char_end], t.num_pieces) for t in s.targets] == [
        (longest, MAX_WORD_PIECES), ("met", 1)]  # fmt: skip
    assert s.words == 3 and s.word_targets == 2  # ("here" a stopword) the overlong word is a word the corpus had, not a target


def test_unknown_type_is_rejected(bert_tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="whole-word"):
        TargetSelector(bert_tokenizer, load_stopwords(), "first-piece")  # type: ignore[arg-type]


def test_word_table_labels_are_first_occurrence_ids_keyed_by_text(
    whole: TargetSelector, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    sentences = whole.select(
        ["Kierkegaard wrote in Copenhagen.", "KIERKEGAARD lived in Copenhagen and wrote."]
    )
    builder = WordTableBuilder(WordModel(bert_tokenizer))
    labels = [builder.add(t.pieces) for s in sentences for t in s.targets]
    table = builder.table()
    assert [e.text for e in table.entries] == ["kierkegaard", "wrote", "copenhagen", "lived"]
    assert labels == [0, 1, 2, 0, 3, 2, 1]
    assert table[0].multi_piece and not table[1].multi_piece
    assert WordModel(bert_tokenizer).decode_word(table[0].pieces) == "kierkegaard"
    assert check_word_table(table, bert_tokenizer.vocab_size) is None
    again = WordTable.from_json(table.to_json())
    assert again.entries == table.entries


def test_word_table_checks_name_the_problem() -> None:
    assert "outside the vocabulary" in (check_word_table(WordTable([WordEntry("x", (5, 99))]), 50) or "")
    dup = WordTable([WordEntry("paris", (1,)), WordEntry("paris", (2, 3))])
    assert "listed twice" in (check_word_table(dup, 50) or "")
    for bad in (b"{}", b'[["x", []]]', b'[["", [1]]]', b'[["x", [1.5]]]', b'[["x", [1], 2]]', b"not json"):
        with pytest.raises(ValueError):
            WordTable.from_json(bad)
