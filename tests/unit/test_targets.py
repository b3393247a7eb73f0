"""Target selection and masking, with the real bert-base-uncased tokenizer so that tokenisation is realistic."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from bertknn.builder.targets import (
    TargetSelector,
    TokenizedSentence,
    load_stopwords,
    masked_ids,
    stopwords_sha256,
)
from bertknn.core.context_tokenizer import ContextTokenizer
from bertknn.core.text import is_punctuation


@pytest.fixture(scope="module")
def selector(bert_tokenizer: PreTrainedTokenizerBase) -> TargetSelector:
    return TargetSelector(bert_tokenizer, load_stopwords())


def words(sentence: TokenizedSentence) -> list[str]:
    return [sentence.text[t.char_start : t.char_end] for t in sentence.targets]


def test_single_wordpiece_words_are_targets_stopwords_and_punctuation_are_not(selector: TargetSelector) -> None:
    (s,) = selector.select(["Dante was born in Florence."])
    # "was"/"in" are stopwords, "." punctuation; every other word is one wordpiece.
    assert words(s) == ["Dante", "born", "Florence"]


def test_words_of_several_wordpieces_are_skipped(selector: TargetSelector, bert_tokenizer: PreTrainedTokenizerBase) -> None:
    text = "Kierkegaard wrote philosophy in Copenhagen."
    assert len(bert_tokenizer.tokenize("Kierkegaard")) > 1  # ki ##er ##ke ##gaard
    (s,) = selector.select([text])
    assert words(s) == ["wrote", "philosophy", "Copenhagen"]
    for t in s.targets:
        assert not str(bert_tokenizer.convert_ids_to_tokens(t.token_id)).startswith("##")


def test_a_sentence_counts_the_words_that_could_be_targets_and_those_the_tokenizer_cannot_spell(
    selector: TargetSelector, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    """What the build's vocabulary warning divides (`TokenizedSentence.words`, `word_targets`): words that are
    neither stopwords nor punctuation, kept or not; a word spelled only by the unknown token counts as one."""
    (s,) = selector.select(["Kierkegaard wrote philosophy in Copenhagen."])
    assert (s.words, s.word_targets) == (4, 3)  # "in" a stopword, "." punctuation; Kierkegaard of 4 pieces
    text = "Dante saw ሀገር and Ꮳ, ⁂ in Florence."
    assert bert_tokenizer.tokenize("ሀገር") == bert_tokenizer.tokenize("Ꮳ") == bert_tokenizer.tokenize("⁂") == ["[UNK]"]
    (u,) = selector.select([text])
    assert words(u) == ["Dante", "saw", "Florence"]
    assert (u.words, u.word_targets) == (5, 3)  # the two unknown letters' words count; the unknown symbol does not


def test_a_word_whose_token_carries_punctuation_at_either_edge_is_no_answer() -> None:
    """SentencePiece keeps punctuation inside a token (``(до``, ``また、``), which BERT's pre-tokenizer splits off."""
    from bertknn.builder.targets import _cut_punctuation

    assert _cut_punctuation("(до") and _cut_punctuation("また、") and _cut_punctuation("«oui»")
    assert not any(_cut_punctuation(w) for w in ("Paris", "a", "1990", "l'eau", "co-op", "1°c"))


def test_punctuation_and_symbols_are_skipped(selector: TargetSelector) -> None:
    (s,) = selector.select(["Paris — about 45% of it (roughly)... is old; «yes»!"])
    assert words(s) == ["Paris", "45", "roughly", "old", "yes"]
    assert all(is_punctuation(w) for w in [".", "--", "%", "—", "«", "...", "()"])
    assert not any(is_punctuation(w) for w in ["a1", "1990", "é", "x"])


def test_stopword_list_is_configurable(bert_tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    path = tmp_path / "stop.txt"
    path.write_text("# my list\nBorn\nin\n\n", encoding="utf-8")
    stop = load_stopwords(path)
    assert stop == frozenset({"born", "in"})
    (s,) = TargetSelector(bert_tokenizer, stop).select(["Dante was born in Florence."])
    assert words(s) == ["Dante", "was", "Florence"]
    assert stopwords_sha256(stop) == stopwords_sha256(frozenset({"in", "born"}))
    assert stopwords_sha256(stop) != stopwords_sha256(load_stopwords())


def test_spans_point_at_the_word_in_the_original_accented_uppercase_sentence(
    selector: TargetSelector, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    text = "Émile ZOLA visited Zürich in 1890 with a café owner."
    (s,) = selector.select([text])
    assert words(s) == ["Émile", "visited", "Zürich", "1890", "café", "owner"]
    for t in s.targets:
        word = text[t.char_start : t.char_end]
        # The label is the id the bert_tokenizer gives that word (lower-cased, accents stripped), at token_index.
        assert bert_tokenizer(word, add_special_tokens=False)["input_ids"] == [t.token_id]
        assert s.ids[t.token_index] == t.token_id
    assert bert_tokenizer.convert_ids_to_tokens(s.targets[2].token_id) == "zurich"


def test_masking_replaces_exactly_one_id_without_retokenising(
    selector: TargetSelector, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    text = "Émile Zola visited Zürich's old café in 1890."
    (s,) = selector.select([text])
    assert s.ids == tuple(bert_tokenizer(text, add_special_tokens=False)["input_ids"])
    mask = int(bert_tokenizer.mask_token_id)
    inputs = ContextTokenizer(bert_tokenizer, max_seq_len=128)
    assert len(s.targets) >= 4
    for t in s.targets:
        ids, pos = masked_ids(s, t, mask)
        assert pos == t.token_index
        assert len(ids) == len(s.ids)
        assert [i for i, (a, b) in enumerate(zip(ids, s.ids, strict=True)) if a != b] == [pos]
        assert ids[pos] == mask
        model_input = inputs.masked_input(ids, pos)
        assert model_input.input_ids == (bert_tokenizer.cls_token_id, *ids, bert_tokenizer.sep_token_id)
        assert model_input.input_ids[model_input.mask_pos] == mask


def test_literal_special_tokens_in_text_are_text_not_a_second_mask(
    selector: TargetSelector, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    (s,) = selector.select(["The [MASK] token and [CLS] appear in Paris."])
    assert bert_tokenizer.mask_token_id not in s.ids
    assert bert_tokenizer.cls_token_id not in s.ids
    for t in s.targets:
        ids, _ = masked_ids(s, t, bert_tokenizer.mask_token_id)
        assert ids.count(bert_tokenizer.mask_token_id) == 1


def test_batch_selection_equals_one_by_one(selector: TargetSelector) -> None:
    texts = ["Dante was born in Florence.", "Kierkegaard wrote philosophy.", "", "Émile Zola visited Zürich."]
    assert selector.select(texts) == [selector.select([t])[0] for t in texts]
    assert selector.select([]) == []
